"""A training microbatch on CUDA never waits for the device: forward, GRPO loss and backward, in
both modes, under ``torch.cuda.set_sync_debug_mode("warn")`` (issue 10: no ``.item()``,
``.tolist()``, ``unique`` or synchronous upload inside a microbatch, so the host can prepare the
next kernels while the device runs). Every synchronizing call is collected with the Python stack
that made it, so one failing run names all of them, not only the first. GPU only; the CPU suite
checks the same code's numerics."""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

pytestmark = pytest.mark.gpu


@contextmanager
def record_device_syncs() -> Iterator[Counter[str]]:
    """Count each synchronizing CUDA call by the innermost harts (else outermost non-test) frames
    of the Python stack that made it. Calls made by the autograd engine's device threads are
    reported at the ``backward()`` that ran them."""
    found: Counter[str] = Counter()

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # type: ignore[no-untyped-def]
        if "called a synchronizing" not in str(message):  # not the "prototype feature" notice
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        ours = [f for f in frames if "/harts/" in f.filename and "/tests/" not in f.filename]
        where = (ours or frames)[-3:]
        found[" <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in reversed(where))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")


def assert_never_synchronizes(forward: Callable[[], torch.Tensor]) -> None:
    """Run ``forward()`` and the backward of the loss it returns without a synchronizing call.

    The backward's device-thread syncs carry no stack of their own: when there are any, the
    backward is rerun under ``set_sync_debug_mode("error")`` and the traceback of the first is
    added to the report (it names the Python backward that made it, if one did).
    """
    with record_device_syncs() as in_forward:
        loss = forward()
    with record_device_syncs() as in_backward:
        loss.backward()
    torch.cuda.synchronize()
    report = [f"  forward: {n} x {where}" for where, n in in_forward.most_common()]
    report += [f"  backward: {n} x {where}" for where, n in in_backward.most_common()]
    if in_backward:
        loss = forward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        except RuntimeError:
            report.append("  first in the backward:\n" + traceback.format_exc(limit=-6))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not report, "synchronizing CUDA calls in a microbatch:\n" + "\n".join(report)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["trajectory", "compact"])
@pytest.mark.parametrize("logprobs", ["all", "actions"])
def test_microbatch_never_synchronizes(mode: str, logprobs: str) -> None:
    pytest.importorskip("fla")
    from harts.models.config import HybridConfig
    from harts.models.execution.config import ExecutionConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.rl.grpo import grpo_loss, grpo_normalizer
    from harts.tree.workloads import generate

    torch.manual_seed(0)
    # ling3_tiny's layer shapes (fla's chunk 64, MLA 192 / 128) on a small vocabulary and few experts
    cfg = HybridConfig.ling3_tiny(
        layer_pattern="KM", vocab_size=512, num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1
    )
    model = HybridLM(cfg).to("cuda", torch.bfloat16)
    batch = generate("tiny", step=0)
    execution = ExecutionConfig(
        mode=mode, attention="mask", recompute=True, linear_attention_backend="auto", logprob_positions=logprobs
    )
    inputs = model.prepare_compact(batch, execution) if mode == "compact" else batch
    normalizer = grpo_normalizer(batch)

    def forward() -> torch.Tensor:
        out = model(inputs, execution)
        loss = grpo_loss(out.logprobs, batch, normalizer=normalizer).loss
        assert out.moe_losses is not None
        return loss + out.moe_objective(1e-3, 1e-3)

    forward().backward()  # compiles, autotunes, allocates: may synchronize
    torch.cuda.synchronize()
    assert_never_synchronizes(forward)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_recorder_sees_a_synchronizing_call() -> None:
    """The recorder is not blind: ``.item()`` on a device tensor is found, and named."""
    x = torch.ones(4, device="cuda", requires_grad=True)

    def forward() -> torch.Tensor:
        torch.nonzero(x)
        return x.sum()

    with pytest.raises(AssertionError, match=r"forward: 1 x test_no_host_sync.py:\d+ forward"):
        assert_never_synchronizes(forward)
