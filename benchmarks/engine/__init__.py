"""The engine benchmark (`python -m benchmarks.bench_engine`, `make bench-engine`).

Modules: `config` (flags, derived defaults, the contenders, the results file), `workload` (prompts
and the figures of one run), `hf` (the transformers contenders), `pdserve` (the engine contenders,
the prefix-cache run and the floor probe), `report` (the table, ratios and the results file).
Each contender runs in its own subprocess (`bench_engine --contender NAME`).
"""
