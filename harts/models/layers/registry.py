"""The mixer registry: layer letter -> ``MixerSpec`` (``harts.models.layers.spec``).

    K  Kimi Delta Attention (KDA, per-channel decay; Kimi Linear / Ling 3.0)      layers/kda.py
    G  Gated DeltaNet (GDN, scalar decay; Qwen3-Next, Qwen3.5)                   layers/gdn.py
    S  Mamba-2 SSD (scalar decay, plain rule; Nemotron-H, Granite 4.0-H)         layers/mamba2.py
    M  Multi-head Latent Attention (DeepSeek-V3 / Ling 3.0 MLA)                   layers/mla.py
    A  grouped-query attention, optionally gated, q/k-normed, partially rotated   layers/gqa.py
    -  no mixer: the decoder layer is its FFN block only (Nemotron-H's MLP / MoE layers)

Adding a mixer: one module under ``harts/models/layers/`` ending with its ``SPEC``, one line in
``MIXERS`` below, and its tests (``tests/models/test_mixer_registry.py`` checks the spec is
complete; the compact-vs-trajectory and transformers equality tests check the layer).
"""

from __future__ import annotations

from harts.models.layers import gdn, gqa, kda, mamba2, mla
from harts.models.layers.spec import MixerSpec

__all__ = ["MIXERS", "NO_MIXER", "mixer_spec", "mixer_specs"]

#: the letter of a decoder layer without a mixer (its FFN block only)
NO_MIXER = "-"

#: every mixer kind by its layer letter, in the order error messages list them
MIXERS: dict[str, MixerSpec] = {s.letter: s for s in (kda.SPEC, gdn.SPEC, mla.SPEC, gqa.SPEC, mamba2.SPEC)}


def mixer_spec(letter: str) -> MixerSpec | None:
    """The spec of layer letter ``letter``; None for ``NO_MIXER``. KeyError for an unknown
    letter (``HybridConfig.validate`` rejects those first)."""
    return None if letter == NO_MIXER else MIXERS[letter]


def mixer_specs(layer_pattern: str) -> list[MixerSpec]:
    """The specs of the mixer kinds in ``layer_pattern``, each once: full attention first, then
    linear, each in registry order (the order the divisor checks report them in)."""
    present = [s for letter, s in MIXERS.items() if letter in set(layer_pattern)]
    return sorted(present, key=lambda s: s.family != "full")
