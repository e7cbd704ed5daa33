"""The scheduling benchmark (`python -m benchmarks.bench_sched`, `make bench-sched`).

Modules: `config` (the simulated cluster, its trace, the end-to-end run's shape), `sim` (the
simulated disaggregated cluster per policy, with the seed and load sweeps), `decisions` (the real
Router.schedule and Schedule RPC latency), `e2e` (the rank policies on real CPU workers),
`report` (targets, the results document and its file).
"""
