"""Where a training step's GPU memory goes: the scaling harness under a CUDA memory history.

    OUT=DIR PYTHONPATH=. python scripts/diagnostics/memory_by_site.py scaling --device cuda [harness flags]

Takes ``python -m benchmarks.step.multi_gpu``'s arguments (one process). Writes DIR/mem.txt: after
every microbatch's forward, the memory allocated and the peak since the previous one; at the
end, or when the step runs out of memory, the live memory grouped by its innermost harts frame
and the largest live blocks with their frames. It found the D = 1 out-of-memory run of
2026-11-30: the trajectory baseline executing harts' compact-token microbatches.
"""

import collections
import os
import sys
import traceback

import torch

import harts.trainer.step as T

OUT = os.environ.get("OUT", ".")
log = open(os.path.join(OUT, "mem.txt"), "w")


def say(*a):
    print(*a, flush=True)
    print(*a, file=log, flush=True)


_orig = T.grpo_loss
n = [0]


def wrapped(*a, **k):
    n[0] += 1
    say(
        f"mb {n[0]}: after forward allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, "
        f"peak since last {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    )
    torch.cuda.reset_peak_memory_stats()
    return _orig(*a, **k)


T.grpo_loss = wrapped


def report():
    snap = torch.cuda.memory._snapshot()
    by_site = collections.Counter()
    blocks = []
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = b.get("frames", [])
            site = next(
                (
                    f"{f['filename'].split('/harts/')[-1]}:{f['line']} {f['name']}"
                    for f in frames
                    if "/harts/" in f["filename"]
                ),
                "?",
            )
            by_site[site] += b["size"]
            blocks.append((b["size"], frames))
    say("== live bytes by innermost harts frame ==")
    for site, s in by_site.most_common(30):
        say(f"{s / 2**30:8.2f} GiB  {site}")
    blocks.sort(key=lambda x: -x[0])
    say("== largest live blocks ==")
    for size, frames in blocks[:12]:
        say(f"-- {size / 2**30:.2f} GiB")
        for f in [f for f in frames if "/harts/" in f["filename"] or "torch/utils/checkpoint" in f["filename"]][:10]:
            say(f"     {f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}")


torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
from benchmarks.step import multi_gpu  # noqa: E402

try:
    multi_gpu.main(sys.argv[1:])
except torch.OutOfMemoryError:
    say(traceback.format_exc()[-3000:])
    report()
    sys.exit(1)
say("finished without OOM")
report()
