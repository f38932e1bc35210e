"""A sample run in slices samples what it samples in one go, whatever runs between the slices."""

from __future__ import annotations

import torch
from tinker.proto import tinker_public_pb2 as pb

from harts.rollout.sampler import SamplingConfig
from harts.serve.futures import Done
from harts.serve.sampling import SampleJob, SampleRun, take_snapshot
from harts.serve.worker import Later
from harts.trainer.engine import Engine
from harts.trainer.lora import LoraConfig

JOB = SampleJob(prompt=[1, 2, 3, 4], num_samples=3, config=SamplingConfig(max_tokens=12), seed=5, prompt_logprobs=True)


def finish(run: SampleRun, between: object = None) -> tuple[pb.SampleResponse, int]:
    """Run every slice of ``run`` (calling ``between()`` between two); (its response, its slices)."""
    step, slices = run.step(), 1
    while isinstance(step, Later):
        if callable(between):
            between()
        step, slices = step.run(), slices + 1
    assert isinstance(step, Done)
    out = pb.SampleResponse()
    out.ParseFromString(step.body)
    return out, slices


def test_slices_sample_the_same_tokens_as_one_go_while_the_run_trains_in_between():
    engine = Engine.from_spec("tiny", lora=LoraConfig(rank=2, seed=1), seed=0, capacity=128)
    with torch.no_grad():
        for p in engine.model.parameters():
            if p.requires_grad:
                p.add_(0.05)  # adapters that change the samples
    snap = take_snapshot("m", 0, engine.model)
    whole, slices = finish(SampleRun(JOB, lambda: (engine, snap.tensors), slice_seconds=1e9))
    assert slices == 1

    def train() -> None:  # another lane's optim_step between two slices moves the run's weights
        with torch.no_grad():
            for p in engine.model.parameters():
                if p.requires_grad:
                    p.add_(0.01)

    sliced, slices = finish(SampleRun(JOB, lambda: (engine, snap.tensors), slice_seconds=0.0), train)
    assert slices > 1  # a few decoding steps a slice at most (ten times the adapters' swap)
    assert sliced == whole  # the snapshot's weights at every step: the same tokens and log-probs
