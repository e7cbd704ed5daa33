"""Model runner: the backend flags choose one forward path; the zero-copy path (consecutive
blocks) and the gather path (scattered blocks) give the same tokens, for a fresh prefill, a later
prefill chunk and decode steps; KV bytes round-trip through the wire layout."""

from __future__ import annotations

from pathlib import Path

import torch

from services.worker.engine.api import SamplingConfig
from services.worker.engine.backend import CpuOptions, CudaOptions, ForwardPath, ModelBackend
from services.worker.engine.model_loading import kv_layout_of, load_model
from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
from services.worker.engine.options import BackendOptions

GREEDY = SamplingConfig(max_tokens=1, temperature=0.0)


def test_the_backend_flags_choose_one_forward_path() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # no GPU needed to choose
    assert ModelBackend.choose(BackendOptions(), cpu) == ModelBackend(
        ForwardPath.LEAN_CPU, cpu=CpuOptions(prepack=True, row_copy=True, attention_kernel=True)
    )
    plain = ModelBackend.choose(BackendOptions(lean_forward=False, cpu_attention_kernel=False), cpu)
    assert plain.path is ForwardPath.TRANSFORMERS and not plain.cpu.attention_kernel
    assert plain.cuda == CudaOptions()  # CUDA options never apply on a CPU
    gpu = ModelBackend.choose(BackendOptions(cpu_prepack=True), cuda)
    assert gpu.path is ForwardPath.LEAN_CUDA and gpu.cuda.graphs and gpu.cpu == CpuOptions()
    assert not gpu.without_graphs().cuda.graphs and gpu.without_graphs().path is gpu.path
    assert not ModelBackend.choose(BackendOptions(cuda_graphs=False), cuda).cuda.graphs
    eager = ModelBackend.choose(BackendOptions(lean_forward=False), cuda)
    assert eager == ModelBackend(ForwardPath.TRANSFORMERS)


def _runner(path: Path) -> ModelRunner:
    model = load_model(str(path), torch.device("cpu"), torch.float32)
    layout = kv_layout_of(model.config, 4, torch.float32)
    return ModelRunner(model, layout, 16, torch.device("cpu"), torch.float32)


def _generate(runner: ModelRunner, blocks: list[int], prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    # prompt in two chunks (the second attends to the first through the pool), then decode
    runner.execute([ScheduledSeq(tokens[:6], 0, blocks, False, GREEDY, None)])
    out = runner.execute([ScheduledSeq(tokens[6:], 6, blocks, True, GREEDY, None)])
    tokens.append(out[0][0])
    for _ in range(steps - 1):
        pos = len(tokens) - 1
        out = runner.execute([ScheduledSeq([tokens[-1]], pos, blocks, True, GREEDY, None)])
        tokens.append(out[0][0])
    return tokens[len(prompt) :]


def test_consecutive_and_scattered_blocks_agree(tiny_bpe: Path) -> None:
    runner = _runner(tiny_bpe)
    prompt = [5, 17, 99, 23, 41, 7, 8, 120, 33, 64]
    # 10 prompt + 5 generated tokens -> 4 blocks of 4 tokens
    a = _generate(runner, [0, 1, 2, 3], prompt, 6)
    b = _generate(runner, [11, 4, 9, 6], prompt, 6)
    assert a == b


def test_kv_wire_round_trip(tiny_bpe: Path) -> None:
    runner = _runner(tiny_bpe)
    runner.execute([ScheduledSeq(list(range(10, 18)), 0, [3, 8], True, GREEDY, None)])
    data = runner.read_blocks([3, 8])
    assert len(data) == 2 * runner.bytes_per_block
    runner.write_blocks([1, 2], data)
    assert runner.read_blocks([1, 2]) == data
    lay = runner.layout
    # wire layout: block, layer, K/V, head, row, dim
    wire = torch.frombuffer(bytearray(data), dtype=torch.float32).view(
        2, lay.num_layers, 2, lay.num_kv_heads, lay.block_size, lay.head_dim
    )
    pool = runner.kv_cache  # [L, 2, H, slots, D]
    assert torch.equal(wire[1, 0, 1, :, 2], pool[0, 1, :, 8 * lay.block_size + 2])
