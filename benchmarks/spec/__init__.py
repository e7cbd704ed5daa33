"""The speculative decoding benchmark (`python -m benchmarks.bench_spec`, `make bench-spec`).

Modules: `config` (the workloads' texts, the targets, the flags), `run` (one case on an engine,
repetitions combined, every case of a run), `report` (the results document, its file, the plot
and the target lines).
"""
