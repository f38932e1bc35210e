"""Which decoder a rollout samples with: the batched one (``harts.rollout.fast``) on CUDA, the
reference (``harts.rollout.decode``) elsewhere, behind one small interface of path handles, so
``collect`` reads the same either way and produces the same trees (``tests/rollout/test_fast.py``
holds the two to the same tokens and log-probs in float64).

A handle is one path's decoding state: a ``Branch`` for the reference, a sequence id of a
``FastDecoder`` for the batched decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from harts.models.hybrid_lm import HybridLM
from harts.rollout.decode import extend, new_branch
from harts.rollout.fast import DecodeBatch, FastDecoder, FastDecoding, fast_decoding_applies
from harts.rollout.sampler import SamplingConfig, Turn, generate

__all__ = ["FastPaths", "ReferencePaths", "rollout_paths"]


class ReferencePaths:
    """Paths on the reference decoder: handles are immutable ``Branch``es."""

    def __init__(self, model: HybridLM) -> None:
        self.model = model

    def prompts(self, prompts: Sequence[Sequence[int]]) -> list[Any]:
        return extend(self.model, [new_branch(self.model)] * len(prompts), prompts)

    def turn(self, handles: Sequence[Any], cfg: SamplingConfig, generator: torch.Generator) -> tuple[list, list[Turn]]:
        return generate(self.model, handles, cfg, generator)

    def extend(self, handles: Sequence[Any], tokens: Sequence[Sequence[int]]) -> list[Any]:
        return extend(self.model, handles, tokens)

    def fork(self, handle: Any, count: int) -> list[Any]:
        return handle.fork(count)

    def close(self, handles: Sequence[Any]) -> None:
        """Nothing to free: a branch's caches go with its last reference."""


class FastPaths:
    """Paths on one ``FastDecoder``: handles are its sequence ids, each turn one ``DecodeBatch``
    of every path; sampling draws from a generator on the model's device, seeded from the
    caller's host generator (the same host generator, the same samples)."""

    def __init__(self, model: HybridLM) -> None:
        self.decoder = FastDecoder(model)

    def prompts(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        ids = self.decoder.open(len(prompts))
        self.decoder.extend(ids, prompts)
        return ids

    def turn(self, handles: Sequence[int], cfg: SamplingConfig, generator: torch.Generator) -> tuple[list, list[Turn]]:
        device = self.decoder.device
        if device.type != "cpu":
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            generator = torch.Generator(device).manual_seed(seed)
        decoding = FastDecoding(self.decoder, handles, cfg)
        batch = DecodeBatch(self.decoder)
        batch.add(decoding, generator)
        while batch.jobs:
            batch.step()
        return list(handles), decoding.turns

    def extend(self, handles: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[int]:
        self.decoder.extend(handles, tokens)
        return list(handles)

    def fork(self, handle: int, count: int) -> list[int]:
        return [handle, *self.decoder.fork(handle, count - 1)]

    def close(self, handles: Sequence[int]) -> None:
        self.decoder.close(handles)


def rollout_paths(model: HybridLM, fast: bool | None = None) -> ReferencePaths | FastPaths:
    """The batched decoder's paths where it applies (``fast`` None: ``fast_decoding_applies``),
    else the reference's; ``fast`` forces either (the tests run the batched one on the CPU)."""
    if fast is None:
        fast = fast_decoding_applies(model)
    return FastPaths(model) if fast else ReferencePaths(model)
