"""LoRA adapters in the engine (engine/lora.py): greedy output through an adapter equals PEFT's
(the reference implementation of the format) on the lean forward and on transformers' own
forward (another architecture too), requests of different adapters and of the base model share
steps without changing each other's output, the disaggregated path equals the unified one, an
adapter's prompt is never served from the base model's prefix cache (nor the reverse), and
malformed adapters are refused at start with the reason."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.engine.api import SamplingConfig
from services.worker.engine.lora import load_adapter, parse_lora_modules
from shared.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from tests.support.tiny_models import build_tiny_lora
from tests.unit.engine.conftest import EngineFactory, collect, greedy, handoff_run, request, tokens_of

PROMPT = tuple(random.Random(5).randrange(3, 400) for _ in range(37))
OTHER = tuple(random.Random(6).randrange(3, 400) for _ in range(21))
NEW_TOKENS = 8


def with_adapter(name: str, max_tokens: int = NEW_TOKENS) -> SamplingConfig:
    return dataclasses.replace(greedy(max_tokens, ignore_eos=True), lora_adapter=name)


@pytest.fixture(scope="module")
def adapters(tiny_bpe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "sql": build_tiny_lora(tiny_bpe, root / "sql", seed=1),
        # another rank, rsLoRA scaling, attention projections only
        "chat": build_tiny_lora(
            tiny_bpe, root / "chat", seed=2, rank=4, alpha=8, targets=("q_proj", "v_proj"), use_rslora=True
        ),
    }


def specs(adapters: dict[str, Path]) -> tuple[str, ...]:
    return tuple(f"{name}={path}" for name, path in adapters.items())


def peft_greedy(base: Path, adapter: Path | None, prompt: tuple[int, ...], n: int) -> list[int]:
    """n greedy tokens of transformers' model with PEFT's adapter (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def reference(tiny_bpe: Path, adapters: dict[str, Path]) -> dict[str, list[int]]:
    """PEFT's greedy tokens of PROMPT per adapter ("" = the base model)."""
    out = {name: peft_greedy(tiny_bpe, path, PROMPT, NEW_TOKENS) for name, path in adapters.items()}
    out[""] = peft_greedy(tiny_bpe, None, PROMPT, NEW_TOKENS)
    assert len({tuple(t) for t in out.values()}) == 3  # each adapter changes the output
    return out


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "transformers-forward"])
async def test_adapters_give_pefts_tokens(
    make_engine: EngineFactory, adapters: dict[str, Path], reference: dict[str, list[int]], lean: bool
) -> None:
    engine = make_engine(lora_modules=specs(adapters), lean_forward=lean)
    assert engine.lora_adapters == ("sql", "chat")
    for name in ("sql", "chat", ""):
        out = await collect(engine.add_request(request(f"r-{name}", PROMPT, with_adapter(name))))
        assert tokens_of(out) == reference[name], name


async def test_another_architecture_through_transformers_forward(
    make_engine: EngineFactory, tiny_family: Callable[[str], Path], tmp_path: Path
) -> None:
    base = tiny_family("qwen2")  # projection biases: transformers' own forward, the modules' hooks
    adapter = build_tiny_lora(base, tmp_path / "qwen-lora", seed=3)
    engine = make_engine(base, lora_modules=(f"q={adapter}",))
    out = await collect(engine.add_request(request("q", PROMPT, with_adapter("q"))))
    assert tokens_of(out) == peft_greedy(base, adapter, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize(
    ("speculative", "names"),
    [
        ("off", ["sql", "", "chat", "sql", "", "chat"]),  # several adapters in a step
        ("off", ["sql", "", "sql", ""]),  # one adapter beside base rows
        ("ngram", ["sql", "", "chat", "sql", "", "chat"]),
    ],
)
async def test_mixed_steps_leave_each_request_its_own_output(
    make_engine: EngineFactory,
    adapters: dict[str, Path],
    reference: dict[str, list[int]],
    speculative: str,
    names: list[str],
) -> None:
    """Base and adapter requests decoded (and prefilled) in the same steps, on the CPU decode
    kernel's path and with a prompt chunk beside decode rows (and with speculation's verify
    rows): each equals its reference."""
    engine = make_engine(
        lora_modules=specs(adapters), max_batch_tokens=48, speculative=speculative, spec_step_cost=False
    )
    outs = await asyncio.gather(
        *(collect(engine.add_request(request(f"m{i}", PROMPT, with_adapter(n)))) for i, n in enumerate(names))
    )
    for name, out in zip(names, outs, strict=True):
        assert tokens_of(out) == reference[name], name
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


async def test_the_disaggregated_path_equals_the_unified_one(
    make_engine: EngineFactory, adapters: dict[str, Path], reference: dict[str, list[int]]
) -> None:
    prefill = make_engine(lora_modules=specs(adapters))
    decode = make_engine(lora_modules=specs(adapters))
    for name in ("sql", "chat"):
        first, rest = await handoff_run(prefill, decode, f"d-{name}", PROMPT, with_adapter(name))
        assert list(first.new_token_ids) + tokens_of(rest) == reference[name], name
    assert decode.num_free_blocks(0) == decode.num_total_blocks(0)
    assert prefill.num_free_blocks(0) == prefill.num_total_blocks(0)


async def test_an_adapters_prompt_never_hits_another_models_cache(
    make_engine: EngineFactory, adapters: dict[str, Path]
) -> None:
    engine = make_engine(lora_modules=specs(adapters), block_size=4)
    cached = {}
    for rid, name in (("b1", ""), ("s1", "sql"), ("c1", "chat"), ("s2", "sql"), ("b2", "")):
        out = await collect(engine.add_request(request(rid, OTHER, with_adapter(name, 2))))
        cached[rid] = out[-1].num_local_cached_tokens
    assert cached == {"b1": 0, "s1": 0, "c1": 0, "s2": 20, "b2": 20}


async def test_an_adapter_not_loaded_is_not_found(
    make_engine: EngineFactory, adapters: dict[str, Path]
) -> None:
    engine = make_engine(lora_modules=specs(adapters))
    with pytest.raises(NotFound, match=r"'nope' is not loaded.*'sql', 'chat'"):
        engine.add_request(request("x", PROMPT, with_adapter("nope")))
    plain = make_engine()
    with pytest.raises(NotFound, match="its adapters: none"):
        plain.add_request(request("y", PROMPT, with_adapter("sql")))
    assert plain.num_free_blocks(0) == plain.num_total_blocks(0)


def test_lora_module_specs() -> None:
    assert parse_lora_modules(["a=/x", " b.v2 = /y/z "]) == {"a": "/x", "b.v2": "/y/z"}
    for bad, why in (
        ("a", "NAME=PATH"),
        ("=/x", "NAME=PATH"),
        ("a=", "NAME=PATH"),
        ("a b=/x", "must be 1-128"),
        ("-a=/x", "must be 1-128"),
    ):
        with pytest.raises(InvalidArgument, match=why):
            parse_lora_modules([bad])
    with pytest.raises(InvalidArgument, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])


def _edited(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_malformed_adapters_are_refused_with_the_reason(
    tiny_bpe: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_bpe), dtype=torch.float32)
    cpu = torch.device("cpu")
    loaded = load_adapter("sql", str(adapters["sql"]), model, cpu, torch.float32)
    assert loaded.rank == 8 and len(loaded.weights) == 2 * 7  # 2 layers x 7 projections
    cases = {
        "no adapter_config.json": tmp_path,
        "DoRA is not served": _edited(adapters["sql"], tmp_path / "dora", use_dora=True),
        "modules_to_save": _edited(adapters["sql"], tmp_path / "mts", modules_to_save=["lm_head"]),
        "LoRA biases": _edited(adapters["sql"], tmp_path / "bias", bias="all"),
    }
    for why, path in cases.items():
        with pytest.raises(FailedPrecondition, match=why):
            load_adapter("x", str(path), model, cpu, torch.float32)
    # matrices of a model of other shapes (a wider MLP), or a module this model lacks
    from safetensors.torch import load_file, save_file

    for why, edit in (
        (
            "do not fit the model's",
            lambda k, t: torch.zeros(t.shape[0], 2 * t.shape[1]) if "down_proj.lora_A" in k else t,
        ),
        ("not a projection of this model", None),
    ):
        dst = _edited(adapters["sql"], tmp_path / f"shapes-{edit is None}")
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        if edit is None:
            tensors["base_model.model.model.layers.7.mlp.up_proj.lora_A.weight"] = torch.zeros(8, 64)
            tensors["base_model.model.model.layers.7.mlp.up_proj.lora_B.weight"] = torch.zeros(128, 8)
        else:
            tensors = {k: edit(k, t) for k, t in tensors.items()}
        save_file(tensors, str(dst / "adapter_model.safetensors"))
        with pytest.raises(FailedPrecondition, match=why):
            load_adapter("g", str(dst), model, cpu, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_on_cuda_adapter_rows_leave_graphs_and_fused_kernels_to_the_base_model(
    make_engine: EngineFactory, adapters: dict[str, Path], reference: dict[str, list[int]]
) -> None:
    """On CUDA (fp32, graphs and fused kernels on) a step with adapter rows runs the unfused
    layers eagerly, the base model's steps keep their graphs: mixed requests, PEFT's tokens."""
    engine = make_engine(lora_modules=specs(adapters), device="cuda", dtype="float32", cuda_graphs=True)
    names = ["sql", "", "chat", ""]
    outs = await asyncio.gather(
        *(collect(engine.add_request(request(f"g{i}", PROMPT, with_adapter(n)))) for i, n in enumerate(names))
    )
    for name, out in zip(names, outs, strict=True):
        assert tokens_of(out) == reference[name], name


async def test_adapters_load_and_unload_at_run_time(
    make_engine: EngineFactory, adapters: dict[str, Path], reference: dict[str, list[int]]
) -> None:
    """--enable-lora with no adapters at start: one loaded while a base request decodes (which
    goes on unchanged) serves PEFT's tokens on every rank; unloaded, it is NOT_FOUND; loaded
    again under the same name with other weights, it never finds its predecessor's cached KV."""
    engine = make_engine(enable_lora=True, dp_size=2, block_size=4)
    assert engine.lora_adapters == ()
    base = asyncio.ensure_future(
        collect(engine.add_request(request("base", PROMPT, with_adapter("", NEW_TOKENS))))
    )
    await asyncio.to_thread(engine.load_lora_adapter, "x", str(adapters["sql"]))
    assert engine.lora_adapters == ("x",)
    for rank in (0, 1):
        out = await collect(engine.add_request(request(f"x{rank}", PROMPT, with_adapter("x"), dp_rank=rank)))
        assert tokens_of(out) == reference["sql"]
    assert tokens_of(await base) == reference[""]
    engine.unload_lora_adapter("x")
    assert engine.lora_adapters == ()
    with pytest.raises(NotFound, match="'x' is not loaded"):
        engine.add_request(request("gone", PROMPT, with_adapter("x")))
    await asyncio.to_thread(engine.load_lora_adapter, "x", str(adapters["chat"]))
    again = await collect(engine.add_request(request("again", PROMPT, with_adapter("x"))))
    assert again[-1].num_local_cached_tokens == 0  # the old x's blocks of PROMPT are not its
    assert tokens_of(again) == reference["chat"]
    for rank in (0, 1):
        assert engine.num_free_blocks(rank) == engine.num_total_blocks(rank)


async def test_run_time_changes_refuse_what_would_break_requests(
    make_engine: EngineFactory, adapters: dict[str, Path], tmp_path: Path
) -> None:
    plain = make_engine()
    with pytest.raises(FailedPrecondition, match="--enable-lora"):
        plain.load_lora_adapter("x", str(adapters["sql"]))
    engine = make_engine(lora_modules=(f"sql={adapters['sql']}",))
    with pytest.raises(AlreadyExists, match="loaded already"):
        engine.load_lora_adapter("sql", str(adapters["chat"]))
    with pytest.raises(AlreadyExists, match="base model's id"):
        engine.load_lora_adapter(engine.model_id, str(adapters["chat"]))
    with pytest.raises(InvalidArgument, match="lora_name"):
        engine.load_lora_adapter("a b", str(adapters["chat"]))
    with pytest.raises(FailedPrecondition, match=r"no adapter_config\.json"):
        engine.load_lora_adapter("broken", str(tmp_path))
    assert engine.lora_adapters == ("sql",)  # nothing changed
    with pytest.raises(NotFound, match="'broken' is not loaded"):
        engine.add_request(request("b", PROMPT, with_adapter("broken")))
    with pytest.raises(NotFound, match="'nope' is not loaded"):
        engine.unload_lora_adapter("nope")
    # a request of it queued or running: refused until it ends
    running = asyncio.ensure_future(
        collect(engine.add_request(request("r", PROMPT, with_adapter("sql", 64))))
    )
    await asyncio.sleep(0)
    with pytest.raises(FailedPrecondition, match="1 request"):
        engine.unload_lora_adapter("sql")
    await running
    engine.unload_lora_adapter("sql")
    assert engine.lora_adapters == ()


async def test_loads_and_unloads_under_load_leave_every_request_its_output(
    make_engine: EngineFactory, adapters: dict[str, Path], reference: dict[str, list[int]]
) -> None:
    """Churn: one adapter loaded and unloaded over and over while requests of the base model and
    of a static adapter decode, and requests of the churned one come and go. Every request that
    was admitted gives its reference tokens (a step running during a load or unload reads
    consistent matrices), every refused one is NOT_FOUND, nothing leaks."""
    engine = make_engine(lora_modules=(f"sql={adapters['sql']}",), max_batch_tokens=64)
    stop = False
    churned = 0

    admitted = threading.Event()  # a request of the churned adapter got in since its load

    def churn() -> None:
        nonlocal churned
        while not stop:
            admitted.clear()
            engine.load_lora_adapter("chat", str(adapters["chat"]))
            admitted.wait(0.5)  # let a request of it in, then unload it as soon as none runs
            for _ in range(400):
                try:
                    engine.unload_lora_adapter("chat")
                    break
                except FailedPrecondition:
                    time.sleep(0.005)
            else:
                return
            churned += 1
            time.sleep(0.02)

    churner = asyncio.create_task(asyncio.to_thread(churn))
    outcomes: dict[str, list[int] | None] = {}

    async def one(rid: str, name: str) -> None:
        try:
            handle = engine.add_request(request(rid, PROMPT, with_adapter(name)))
        except NotFound:
            outcomes[rid] = None
            return
        if name == "chat":
            admitted.set()
        outcomes[rid] = tokens_of(await collect(handle))

    names = ["", "sql", "chat"]
    for wave in range(6):
        await asyncio.gather(*(one(f"w{wave}-{i}", names[i % 3]) for i in range(6)))
        await asyncio.sleep(0.01)
    stop = True
    await churner
    assert churned >= 1
    for rid, got in outcomes.items():
        name = names[int(rid.split("-")[1]) % 3]
        if got is None:
            assert name == "chat", rid  # only the churned adapter may be away
        else:
            assert got == reference[name], rid
    assert any(got is not None for rid, got in outcomes.items() if rid.endswith(("-2", "-5")))
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


async def test_workers_publish_their_adapters_and_each_ones_requests(
    make_engine: EngineFactory, adapters: dict[str, Path]
) -> None:
    """pdserve_lora_adapters (how many a worker serves) and pdserve_lora_requests{dp_rank,
    adapter} (unfinished requests of each); an adapter's series goes with its last request."""
    from prometheus_client import REGISTRY

    from services.worker.rank_metrics import RankMetrics

    def sample(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    engine = make_engine(lora_modules=specs(adapters))
    exported = RankMetrics(engine)
    running = [
        engine.add_request(request(f"q{i}", PROMPT, with_adapter(name, 64)))
        for i, name in enumerate(("sql", "sql", "chat", ""))
    ]
    assert engine.lora_requests(0) == {"sql": 2, "chat": 1}
    exported.refresh()
    assert sample("pdserve_lora_adapters") == 2
    assert sample("pdserve_lora_requests", dp_rank="0", adapter="sql") == 2
    assert sample("pdserve_lora_requests", dp_rank="0", adapter="chat") == 1
    for handle in running:
        await collect(handle)
    assert engine.lora_requests(0) == {}
    exported.refresh()
    assert sample("pdserve_lora_requests", dp_rank="0", adapter="sql") is None


def test_the_cuda_layout_runs_adapter_steps_unfused_and_base_steps_static(
    tiny_bpe: Path, adapters: dict[str, Path]
) -> None:
    """The CUDA layout (fused layers, static decode steps, FlexAttention in place), run eagerly on
    a CPU: a step with adapter rows goes through the unfused layers (graphs hold the base model's
    projections only), a base-only step through the static steps; the greedy tokens equal the
    plain runner's, adapter and base rows mixed in the same steps, and the static steps were used."""
    from services.worker.engine.api import KvLayout
    from services.worker.engine.lora import LoraSet
    from services.worker.engine.model_loading import kv_layout_of, load_model
    from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
    from tests.unit.engine.test_decode_graphs import _backend

    cpu = torch.device("cpu")

    def runner(static: bool) -> ModelRunner:
        model = load_model(str(tiny_bpe), cpu, torch.float32, prepack=not static)
        lora = LoraSet.load({n: str(p) for n, p in adapters.items()}, model, cpu, torch.float32)
        layout: KvLayout = kv_layout_of(model.config, 4, torch.float32)
        return ModelRunner(
            model,
            layout,
            96,
            cpu,
            torch.float32,
            backend=_backend(cpu, static, static),
            lora=lora,
            max_model_len=64,
        )

    def run(r: ModelRunner, names: list[str], steps: int) -> list[list[int]]:
        prompts = [list(PROMPT[: 9 + 5 * i]) for i in range(len(names))]
        tables = [list(range(12 * i, 12 * i + 12)) for i in range(len(names))]

        def seq(i: int, tokens: list[int], start: int) -> ScheduledSeq:
            sampling = with_adapter(names[i], 1)
            return ScheduledSeq(tokens, start, tables[i], True, sampling, None)

        outs = [list(t) for t in r.execute([seq(i, p, 0) for i, p in enumerate(prompts)])]
        for step in range(steps):
            live = range(len(names)) if step < steps // 2 else [i for i, n in enumerate(names) if not n]
            new = r.execute([seq(i, [outs[i][-1]], len(prompts[i]) + len(outs[i]) - 1) for i in live])
            for i, t in zip(live, new, strict=True):
                outs[i].extend(t)
        return outs

    names = ["sql", "", "chat", ""]  # the adapters' rows leave halfway: base-only steps follow
    plain, static = runner(False), runner(True)
    assert static.fused and static.graphs is not None and plain.graphs is None
    assert run(static, names, 8) == run(plain, names, 8)
    assert any(e.replays for e in static.graphs.buckets.values())  # the base-only steps'


async def test_adapters_on_fp8_weights_agree_between_forwards_and_change_the_output(
    make_engine: EngineFactory, adapters: dict[str, Path]
) -> None:
    """--quantization fp8 with LoRA adapters: the adapters' deltas ride on the FP8 products (no
    PEFT reference exists for FP8 base layers), the same on the lean forward and on transformers'
    forward (module hooks), and each adapter changes the FP8 model's output."""
    got: dict[bool, dict[str, list[int]]] = {}
    for lean in (True, False):
        engine = make_engine(lora_modules=specs(adapters), lean_forward=lean, quantization="fp8")
        got[lean] = {}
        for name in ("sql", "chat", ""):
            out = await collect(engine.add_request(request(f"f-{lean}-{name}", PROMPT, with_adapter(name))))
            got[lean][name] = tokens_of(out)
    assert got[True] == got[False]
    assert len({tuple(t) for t in got[True].values()}) == 3
