"""benchmarks/soak.py's verdict: RSS growth is a rise of the series' tail, not one high sample."""

from __future__ import annotations

from benchmarks.soak import rss_growth


def test_a_swinging_but_flat_series_did_not_grow() -> None:
    # a prefill worker's RSS: +-35 MiB with the chunks in flight, no trend
    swinging = [2098, 2147, 2134, 2133, 2116, 2138, 2106, 2151, 2139, 2168, 2138, 2155, 2128, 2150, 2103]
    assert abs(rss_growth(swinging)) < 10


def test_a_leak_shows_as_growth() -> None:
    leaking = [2000 + 5 * i for i in range(30)]  # +5 MiB per sample
    assert rss_growth(leaking) == 100.0  # medians of the thirds: 2000+5*4.5.. vs 2000+5*24.5..
    assert rss_growth([55, 55, 55, 56, 55, 55]) == 0
