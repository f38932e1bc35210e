"""One microbatch of one side of ``harts bench --workload medium --dp 8 --replica 3 --model tiny
--capacity C``: the first microbatch of replica 3 (the one ``--profile`` picks), its forward, GRPO
loss and backward once, without the profiler; prints rows, wall and CPU seconds and the process's
peak resident memory (VmHWM, bytes; ``hwm_before``: before the microbatch) as JSON.

    python one_microbatch.py baseline|harts CAPACITY
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def main(side: str, capacity: int) -> dict:
    import torch

    from harts.integrations.loading import load_model
    from harts.models.execution.config import ExecutionConfig
    from harts.plan.baselines.trajectory_plan import plan_trajectory_step
    from harts.plan.step import plan_step
    from harts.tree.workloads import load_workload

    try:
        from harts.trainer.step_bench import _microbatch_runner
    except ImportError:  # before the bench moved
        from harts.bench.step_bench import _microbatch_runner

    torch.set_num_threads(1)  # harts bench's --threads default
    batch = replace(load_workload("medium", step=0, seed=0), old_logprobs=None, ref_logprobs=None)
    vocab = max(int(batch.tokens.max()) + 1, batch.vocab_size or 0)
    model = load_model("tiny", vocab_size=vocab, dtype="float32", seed=0)
    execution = ExecutionConfig(fused_logprobs=True, mode="trajectory" if side == "baseline" else "compact")
    if side == "baseline":
        raw = plan_trajectory_step(batch.lengths, dp=8, capacity=capacity)
        sub = batch.select(raw.microbatches[raw.for_replica(3)[0]])
        item, rows = (sub, model.prepare_trajectory(sub, execution)), sub.num_tokens
    else:
        plan = plan_step(batch, dp=8, capacity=capacity)
        cb, call_plan = plan.prepare_microbatch(plan.for_replica(3)[0], model.config.chunk_size)
        inputs = model.prepare_compact(cb, execution, plan=call_plan)
        item, rows = (cb.batch, inputs), inputs.layout.num_rows
    before = vm_hwm()
    one = _microbatch_runner(model, batch, execution)
    wall, cpu = time.perf_counter(), time.process_time()
    one(*item)
    return dict(
        side=side,
        capacity=capacity,
        rows=rows,
        trajectories=item[0].num_trajectories,
        seconds=round(time.perf_counter() - wall, 1),
        cpu_seconds=round(time.process_time() - cpu, 1),
        hwm_before=before,
        hwm=vm_hwm(),
    )


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
