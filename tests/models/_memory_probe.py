"""Run one config's training steps in this process and print its peak resident memory (VmHWM)
beside ``estimate_memory``'s total, as JSON (``test_memory_estimate`` runs it in a subprocess:
torch's own counters miss what the C allocator keeps).

    python _memory_probe.py '{"rows": 8192, "config": {...}, "mode": "trajectory", ...}'

Keys: rows (tokens of the batch), trajectories, mode (trajectory: ``trajectories`` sequences of
rows / trajectories tokens; compact: a shared trunk of rows / 2 and the rest split among them),
config (``HybridConfig.tiny`` overrides), fused (the chunked head), recompute, optimizer (two
steps of two microbatches each and an AdamW step after each: the optimizer state then lives
through a whole step, as in training).
"""

from __future__ import annotations

import json
import sys


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(spec: dict) -> dict:
    import numpy as np
    import torch

    from harts.models import HybridConfig, HybridLM
    from harts.models.execution.config import ExecutionConfig
    from harts.models.memory import estimate_memory, gathered_view_rows
    from harts.tree.batch import RolloutBatch
    from harts.tree.compact import compact

    torch.set_num_threads(1)
    cfg = HybridConfig.tiny(**spec.get("config", {}))
    rows, n, mode = spec["rows"], spec.get("trajectories", 4), spec.get("mode", "trajectory")
    rng = np.random.default_rng(0)
    if mode == "compact":
        trunk = list(rng.integers(0, cfg.vocab_size, rows // 2))
        trajs = [trunk + list(rng.integers(0, cfg.vocab_size, (rows - len(trunk)) // n)) for _ in range(n)]
    else:
        trajs = [list(rng.integers(0, cfg.vocab_size, rows // n)) for _ in range(n)]
    batch = RolloutBatch.from_trajectories(trajs, advantages=rng.normal(size=n))
    torch.manual_seed(0)
    model = HybridLM(cfg, seed=0)
    execution = ExecutionConfig(
        mode=mode, fused_logprobs=spec.get("fused", True), recompute=spec.get("recompute", False)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) if spec.get("optimizer") else None
    for _ in range(2 if optimizer else 1):
        for _ in range(2 if optimizer else 1):
            out = model(batch, execution)
            (out.logprobs.sum() + out.moe_objective(1e-3, 1e-3)).backward()
            del out
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    capacity = compact(batch).num_compact_tokens if mode == "compact" else batch.num_tokens
    logit_rows = capacity if mode == "compact" else batch.num_tokens - n
    # the views as the commands size them: from the step's compression (semantic / compact)
    views = gathered_view_rows(capacity, batch.num_tokens / capacity) if mode == "compact" else None
    est = estimate_memory(
        cfg, execution, capacity=capacity, optimizer=optimizer is not None, logit_rows=logit_rows, view_rows=views
    )
    return {"measured": _vm_hwm(), "estimate": est.total, "terms": est.terms}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
