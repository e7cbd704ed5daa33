"""The goodput benchmark (`python -m benchmarks.bench_goodput`, `make bench-goodput`): open-loop
load over the OpenAI-compatible HTTP API, SLO attainment and goodput per serving configuration.

Modules: `stats` (pure: percentiles, per-rate metrics, SLOs, the goodput search), `workloads`
(seeded prompts from the bundled corpus), `loadgen` (the async HTTP streaming client and the
Poisson open-loop driver), `configs` (the `pdserve up` command per configuration, starting and
stopping it), `plots` (matplotlib figures), `cli` (the flags), `harness` (one run: quiet requests,
SLOs, the rate search per configuration and workload), `report` (the table, target checks and
`--merge`), `merge` (merging result documents).
"""
