"""Reading this process's Prometheus registry in tests: a metric summed over its series."""

from __future__ import annotations

from prometheus_client import REGISTRY


def sample_total(name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there are none)."""
    total = 0.0
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
