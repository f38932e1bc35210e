"""Compilation in a training step: ``harts bench`` with Dynamo's compile statistics.

    OUT=DIR TAG=name TORCH_LOGS=recompiles python scripts/diagnostics/compile_profile.py \
        bench --device cuda ... --profile DIR/prof

Takes ``harts bench``'s arguments. The ``--profile`` tables of one microbatch per side are sorted
by device time, host self time and host total time, then by device time per operator and input
shapes; DIR/dynamo_<TAG>.txt gets
``torch._dynamo.utils.compile_times()`` and Dynamo's counters. With ``TORCH_LOGS=recompiles`` it
showed the compiled glue recompiling inside harts' timed step
(``benchmarks/results/ling3-tiny-kkkm_h200_2026-12-01_compiled-glue.md``).
"""

import os
import sys

import torch

import harts.experiments.probes as probes
from harts.cli import main

OUT = os.environ.get("OUT", ".")
tag = os.environ.get("TAG", "run")


def _profile(run, device, path):
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        run()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    with open(os.path.splitext(path)[0] + ".txt", "w") as f:
        f.write(ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60) + "\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60) + "\n")
        f.write(ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60) + "\n")
        # operators by input shapes: which aten::mul / index / copy is which
        by_shape = prof.key_averages(group_by_input_shape=True)
        f.write(
            by_shape.table(
                sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=40, max_shapes_column_width=90
            )
            + "\n"
        )


probes.profile_microbatch = _profile
rc = main(sys.argv[1:])
from torch._dynamo.utils import compile_times, counters  # noqa: E402

with open(os.path.join(OUT, f"dynamo_{tag}.txt"), "w") as f:
    f.write(str(compile_times(repr="str")) + "\n")
    for k, v in counters.items():
        f.write(f"{k}: {dict(v)}\n")
sys.exit(rc)
