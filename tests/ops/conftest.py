"""Fixtures shared by the operator tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """These tests run many tiny kernels, where OpenMP hand-offs cost more than they save (and
    spin badly when the suite's workers share 2 cores); restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
