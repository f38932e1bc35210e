"""One module per layer type; each mixer takes ``(x_TD, ctx: RowContext)`` and declares its
``MixerSpec`` (``spec.py``), registered by layer letter in ``registry.py``."""

from harts.models.layers.gdn import GatedDeltaNet
from harts.models.layers.gqa import GatedAttention
from harts.models.layers.kda import KimiDeltaAttention
from harts.models.layers.mamba2 import Mamba2Mixer
from harts.models.layers.mla import MultiheadLatentAttention
from harts.models.layers.mlp import MLP
from harts.models.layers.moe import MoE

__all__ = [
    "GatedAttention",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "MLP",
    "Mamba2Mixer",
    "MoE",
    "MultiheadLatentAttention",
]
