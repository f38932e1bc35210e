"""Row contexts for the two execution modes of ``HybridLM`` (trajectory-wise and compact)."""

from harts.models.execution.base import RowContext

__all__ = ["RowContext"]
