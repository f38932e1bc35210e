"""Shared test settings.

* a hypothesis profile that keeps the default suite fast on 2 cores;
* one torch intra-op thread per test process: the suite runs as ``pytest -n 2`` on 2 cores and
  works on tiny tensors, where two OpenMP threads per worker oversubscribe the machine (a tiny
  linear layer then takes up to 100x longer).
"""

from hypothesis import HealthCheck, settings

settings.register_profile("harts", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("harts")

try:
    import torch
except ImportError:  # the tree/plan tests need no torch
    pass
else:
    torch.set_num_threads(1)


def _inductor_cpu_unavailable() -> str | None:
    """Why Inductor cannot build CPU kernels here, or None. Inductor passes torch's include and
    library directories to g++ unquoted, so a torch installed under a path with whitespace (a
    clone in "my projects/harts" with its venv inside) fails every CPU compile; harts then falls
    back to eager code, but a test of the compiled path itself cannot run."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    import os

    where = os.path.dirname(torch.__file__)
    if any(c.isspace() for c in where):
        return f"Inductor's CPU compiler cannot build under a path with whitespace ({where!r})"
    return None


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    import pytest

    reason = None
    for item in items:
        if item.get_closest_marker("inductor_cpu") is None:
            continue
        if reason is None:
            reason = _inductor_cpu_unavailable() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
