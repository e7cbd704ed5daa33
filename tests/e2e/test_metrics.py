"""Prometheus endpoints of the real processes after traffic: the numbers add up across services."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.proto import gateway_pb2, gateway_pb2_grpc
from tests.support.stack import running_stack

pytestmark = pytest.mark.e2e

GATEWAY, SCHEDULER, LOAD_MONITOR, PREFILL, DECODE = 0, 1, 2, 10, 20


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


async def test_metrics_add_up_after_traffic(tiny_bpe_model: Path, tmp_path: Path) -> None:
    with running_stack(str(tiny_bpe_model), tmp_path / "logs", metrics=True) as stack:
        usages = []
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            for i in range(6):
                req = gateway_pb2.GenerateRequest(
                    prompt=f"metrics check number {i} " * (i + 1), max_tokens=3 + i, temperature=0
                )
                if i % 2:
                    frames = [f async for f in stub.Generate(req, timeout=60)]
                    usages.append(frames[-1].usage)
                else:
                    usages.append((await stub.Complete(req, timeout=60)).usage)
        gw = scrape(stack.metrics_url(GATEWAY))
        assert total(gw, "pdserve_generation_tokens_total") == sum(u.completion_tokens for u in usages)
        assert total(gw, "pdserve_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
        assert total(gw, "pdserve_requests_total") == len(usages)
        assert total(gw, "pdserve_time_to_first_token_seconds_count") == len(usages)
        # where each TTFT went: the three phases of a disaggregated request, adding up to it
        for phase in ("schedule", "admit", "prefill"):
            assert total(gw, "pdserve_time_to_first_token_phase_seconds_count", phase=phase) == len(usages)
        phases = total(gw, "pdserve_time_to_first_token_phase_seconds_sum")
        assert phases == pytest.approx(total(gw, "pdserve_time_to_first_token_seconds_sum"), abs=1e-6)
        assert total(gw, "pdserve_e2e_request_latency_seconds_count") == len(usages)
        assert total(gw, "pdserve_errors_total") == 0

        prefill, decode = scrape(stack.metrics_url(PREFILL)), scrape(stack.metrics_url(DECODE))
        sent = total(prefill, "pdserve_kv_transfer_bytes_total", direction="sent")
        assert sent > 0
        assert sent == total(decode, "pdserve_kv_transfer_bytes_total", direction="received")
        assert total(prefill, "pdserve_kv_transfer_seconds_count") == len(usages)
        # each worker's engine steps: the prefill worker ran every prompt, the decode worker
        # decoded (its counters refresh every --load-refresh-s)
        time.sleep(1.5)
        prefill, decode = scrape(stack.metrics_url(PREFILL)), scrape(stack.metrics_url(DECODE))
        prompt_steps = total(prefill, "pdserve_engine_steps_total", kind="prefill")
        assert prompt_steps >= 1 and total(prefill, "pdserve_engine_steps_total", kind="decode") == 0
        # it computed every prompt token its prefix cache did not hold
        computed = sum(u.prompt_tokens - u.cached_tokens for u in usages)
        assert total(prefill, "pdserve_engine_step_tokens_total") == computed
        assert total(decode, "pdserve_engine_steps_total", kind="decode") >= 1
        assert (
            total(prefill, "pdserve_prefix_cache_queries_tokens_total")
            >= sum(u.prompt_tokens for u in usages) - 1
        )
        for worker in (prefill, decode):
            assert ("pdserve_kv_cache_usage_ratio", (("dp_rank", "0"),)) in worker
            assert all(v >= 0 for v in worker.values())
            # CPU workers compile nothing (on CUDA: at start only), and hold no GPU figures
            assert worker[("pdserve_torch_compiles_total", ())] == 0
            assert total(worker, "pdserve_gpu_memory_allocated_bytes") == 0

        sched = scrape(stack.metrics_url(SCHEDULER))
        assert total(sched, "pdserve_schedule_decisions_total") >= len(usages)
        assert total(sched, "pdserve_prefill_mode_total", mode="disaggregated") == len(usages)
        lm = scrape(stack.metrics_url(LOAD_MONITOR))
        assert total(lm, "pdserve_registered_workers") == 2
