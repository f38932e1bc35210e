"""Shared test settings: a hypothesis profile that keeps the default suite fast on 2 cores."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "harts", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("harts")
