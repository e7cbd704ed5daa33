"""Settings every test shares: hypothesis runs without its per-example deadline (200 ms by default),
because CI and developer machines are shared and a slow example is not a failure; examples stay
bounded by each test's max_examples."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("pdserve", deadline=None)
settings.load_profile("pdserve")
