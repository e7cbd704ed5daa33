"""bench_serving's configuration names: a stack shape and `+` modifiers, as `pdserve up` flags."""

from __future__ import annotations

import pytest

from benchmarks.bench_serving import config_args


def test_configurations_become_pdserve_up_flags() -> None:
    assert config_args("unified") == ("unified", ["--gateways", "1"])
    assert config_args("unified+2gw") == ("unified", ["--gateways", "2"])
    assert config_args("disaggregated+graphs") == (
        "disaggregated",
        ["--gateways", "1", "--worker-arg=--cuda-graphs"],
    )
    assert config_args("disaggregated+graphs+3gw") == (
        "disaggregated",
        ["--gateways", "3", "--worker-arg=--cuda-graphs"],
    )
    assert config_args("disaggregated+eager") == (
        "disaggregated",
        ["--gateways", "1", "--worker-arg=--no-cuda-graphs"],
    )


@pytest.mark.parametrize("bad", ["unifed", "unified+0gw", "unified+gw", "disaggregated+fast", "+2gw"])
def test_unknown_configurations_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown"):
        config_args(bad)


def test_a_phases_ttft_split_sums_the_gateways_and_takes_the_phases_requests() -> None:
    """ttft_phases_ms: the mean ms per phase of the requests whose first token came between two
    snapshots, every gateway's histogram summed (a burst spreads over --gateways N)."""
    import http.server
    import threading

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from benchmarks.bench_serving import gateway_ttft_phases, ttft_phases_ms

    registries = [CollectorRegistry(), CollectorRegistry()]
    hists = [
        Histogram("pdserve_time_to_first_token_phase_seconds", "", ["phase"], registry=r) for r in registries
    ]

    def serve(registry: CollectorRegistry) -> http.server.HTTPServer:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = generate_latest(registry)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    servers = [serve(r) for r in registries]
    urls = [f"http://127.0.0.1:{s.server_port}/metrics" for s in servers] + ["http://127.0.0.1:1/metrics"]
    try:
        hists[0].labels(phase="schedule").observe(1.0)  # before the phase: not counted
        before = gateway_ttft_phases(urls)
        hists[0].labels(phase="schedule").observe(0.002)
        hists[1].labels(phase="schedule").observe(0.004)
        hists[1].labels(phase="prefill").observe(0.1)
        split = ttft_phases_ms(before, gateway_ttft_phases(urls))
    finally:
        for s in servers:
            s.shutdown()
    assert split == pytest.approx({"schedule": 3.0, "prefill": 100.0})
