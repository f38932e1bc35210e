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
