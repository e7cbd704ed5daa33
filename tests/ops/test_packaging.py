"""Dependencies: pyproject.toml states compatible ranges (lower bound = the version CI tests,
upper bound = the next major), requirements/dev.txt pins exactly what `make install` put in this
environment, and the lock stays installable for every torch build (no local version label)."""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.ops.dockerfile import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def lock(name: str) -> dict[str, Version]:
    out: dict[str, Version] = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        req = line.split("#")[0].strip()
        if req:
            pkg, sep, version = req.partition("==")
            assert sep, f"requirements/{name}: {req!r} is not pinned with =="
            out[canonicalize_name(pkg)] = Version(version)
    return out


def declared() -> list[tuple[str, Requirement]]:
    """(group, requirement) for the main dependencies and every extra."""
    out = [("dependencies", Requirement(r)) for r in PROJECT["dependencies"]]
    for extra, reqs in PROJECT["optional-dependencies"].items():
        out += [(extra, Requirement(r)) for r in reqs]
    return out


def no_deps_pins() -> dict[str, Version]:
    """Packages scripts/install.sh installs with --no-deps, outside the lock (NAME=pkg==version)."""
    out: dict[str, Version] = {}
    for line in (ROOT / "scripts" / "install.sh").read_text().splitlines():
        name, eq, pin = line.partition("=")
        if eq and name.isupper() and "==" in pin:
            pkg, _, version = pin.partition("==")
            out[canonicalize_name(pkg)] = Version(version)
    return out


def next_major(v: Version) -> Version:
    return Version("1") if v.major == 0 else Version(f"{v.major + 1}")


@pytest.mark.parametrize(("group", "req"), declared(), ids=lambda x: str(x))
def test_each_dependency_is_a_range_from_the_tested_version_to_the_next_major(
    group: str, req: Requirement
) -> None:
    specs = {s.operator: Version(s.version) for s in req.specifier}
    assert set(specs) == {">=", "<"}, f"{group}: {req} must read 'name>=TESTED,<NEXT_MAJOR'"
    # An extra installed --no-deps (nixl-cu13) is pinned in scripts/install.sh instead of the lock.
    locked = lock("dev.txt").get(canonicalize_name(req.name)) or no_deps_pins().get(
        canonicalize_name(req.name)
    )
    assert locked is not None, f"{req.name} is not in requirements/dev.txt: run make lock"
    # The lower bound is what CI tests (torch's lock entry carries no +cpu label).
    assert specs[">="] == locked, f"{req.name}: lower bound {specs['>=']} != locked {locked}"
    upper = next_major(specs[">="])
    assert specs["<"] == upper, f"{req.name}: the upper bound should be the next major, {upper}"


def test_runtime_lock_holds_every_main_dependency() -> None:
    runtime = lock("runtime.txt")
    for r in PROJECT["dependencies"]:
        req = Requirement(r)
        assert canonicalize_name(req.name) in runtime, f"{req.name} missing from requirements/runtime.txt"
        assert req.specifier.contains(runtime[canonicalize_name(req.name)], prereleases=True)


def test_torch_lock_entry_fits_cpu_and_cuda_builds() -> None:
    # `torch==2.13.0` takes the CPU wheel here and in the CPU image, the CUDA build in the CUDA image.
    for name in ("dev.txt", "runtime.txt"):
        torch = lock(name)["torch"]
        assert torch.local is None, f"requirements/{name}: torch=={torch} must not carry a local label"
    constraints = (ROOT / "requirements" / "constraints.txt").read_text()
    assert f"torch=={lock('dev.txt')['torch']}" in constraints


def test_this_environment_has_exactly_the_locked_versions() -> None:
    """`make install` installed the lock: every pinned package at its pinned version."""
    wrong: dict[str, tuple[Version, object]] = {}
    for name, version in lock("dev.txt").items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            wrong[name] = (version, None)
            continue
        # A local build label (torch 2.13.0+cpu) is the same release.
        if installed.public != str(version):
            wrong[name] = (version, installed)
    assert not wrong, f"installed versions differ from requirements/dev.txt (make install): {wrong}"


def test_requires_python_admits_this_python_and_has_no_upper_cap() -> None:
    spec = SpecifierSet(PROJECT["requires-python"])
    assert spec.contains(f"{sys.version_info.major}.{sys.version_info.minor}")
    # The dependency set supports newer Pythons than the one CI tests; a cap would only break
    # resolvers. 3.11 is the floor: the code uses asyncio.timeout.
    assert all(s.operator == ">=" for s in spec), PROJECT["requires-python"]
    assert Version("3.11") in spec and Version("3.10") not in spec
