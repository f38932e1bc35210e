"""Region timers: the model's numbers are untouched, every region is timed in each phase."""

from __future__ import annotations

import time

import pytest
import torch

import harts
from harts.models import regions
from harts.tree.workloads import generate


def _run(model: harts.HybridLM, batch, recompute: bool) -> list[torch.Tensor]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    out = model(batch, mode="compact", recompute=recompute)
    (out.logprobs.sum() + out.moe_objective(0.01, 0.01)).backward()
    return [out.logprobs.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


@pytest.mark.parametrize("recompute", [False, True])
def test_timer_changes_nothing_and_times_every_region(recompute: bool) -> None:
    torch.manual_seed(0)
    batch = generate("tiny", step=0)
    model = harts.HybridLM(harts.HybridConfig.tiny(dtype="float64", vocab_size=int(batch.tokens.max()) + 1))
    ref = _run(model, batch, recompute)
    with regions.RegionTimer("cpu") as timer:
        t0 = time.perf_counter()
        got = _run(model, batch, recompute)
        elapsed = time.perf_counter() - t0
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    totals = timer.totals()
    # a recomputed layer's work outside its core regions is timed as the layer region's own
    layer = totals.pop(regions.LAYER, None)
    assert (layer is not None) == recompute
    if layer is not None:
        assert layer["recompute"] > 0 and layer["forward"] == layer["backward"] == 0
    assert set(totals) == {"linear_attention", "attention", "moe", "lm_head"}
    for name, phases in totals.items():
        assert phases["forward"] > 0 and phases["backward"] > 0, name
    # recomputed layers: the mixers re-run inside backward (MoE may be cut short by checkpoint)
    assert (totals["linear_attention"]["recompute"] > 0) == recompute
    assert (totals["attention"]["recompute"] > 0) == recompute
    # exclusive times never add up to more than the wall time
    assert sum(sum(p.values()) for p in [*totals.values(), layer or {}]) <= elapsed
    # inactive again: regions are pass-through
    x = torch.ones(2, requires_grad=True)
    assert regions.enter("attention", x)[0] is x


def test_layer_recompute_is_its_own_and_an_early_stop_keeps_inner_regions(monkeypatch) -> None:  # noqa: ANN001
    """On a clock that ticks once per mark: a layer recomputation inside the MoE's backward is
    the MoE backward's child (subtracted from it), and when checkpoint stops it early (its
    exception passing through ``recompute_span``) the core region it had open is recorded up to
    that point, not dropped into the layer's time."""
    ticks = iter(range(100))
    monkeypatch.setattr(regions.RegionTimer, "_mark", lambda self: float(next(ticks)))
    monkeypatch.setattr(regions, "recomputing", lambda: True)

    class Stop(Exception):
        pass

    with regions.RegionTimer("cpu") as timer:
        timer.start("moe", "backward")  # 0
        with pytest.raises(Stop):
            with regions.recompute_span():  # 1
                timer.start("attention", "recompute")  # 2
                timer.stop("attention", "recompute")  # 3
                timer.start("moe", "recompute")  # 4
                raise Stop  # checkpoint's early stop; the layer closes at 5
        timer.stop("moe", "backward")  # 6
    totals = timer.totals()
    assert totals["attention"]["recompute"] == 1.0
    assert totals["moe"]["recompute"] == 1.0  # 4 -> 5, kept
    assert totals[regions.LAYER]["recompute"] == 4.0 - 1.0 - 1.0  # 1 -> 5 less its two children
    assert totals["moe"]["backward"] == 6.0 - 4.0  # 0 -> 6 less the layer (1 -> 5)


def test_only_one_timer_at_a_time() -> None:
    with regions.RegionTimer("cpu"):
        with pytest.raises(RuntimeError, match="already active"):
            with regions.RegionTimer("cpu"):
                pass


def test_annotating_timer_leaves_a_profiler_range_per_region_and_phase(tmp_path) -> None:  # noqa: ANN001
    """Under the profiler, an annotating timer opens ``harts/<region>/<phase>`` ranges (what
    ``device_time_by_region`` attributes kernels to) around the same work it times, without
    changing a number."""
    import json

    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    batch = generate("tiny", step=0)
    model = harts.HybridLM(harts.HybridConfig.tiny(dtype="float64", vocab_size=int(batch.tokens.max()) + 1))
    ref = _run(model, batch, True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with regions.RegionTimer("cpu", annotate=True) as timer:
            got = _run(model, batch, True)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    timed = {f"{regions.ANNOTATION_PREFIX}{r}/{p}" for r, ph in timer.totals().items() for p, s in ph.items() if s > 0}
    assert timed and timed <= names
    assert f"{regions.ANNOTATION_PREFIX}attention/recompute" in names
    # an annotating timer without a profiler changes nothing either
    with regions.RegionTimer("cpu", annotate=True):
        assert torch.equal(_run(model, batch, True)[0], ref[0])
