"""The GPU runs behind the results files as one table, and a runner for rows of it.

    python -m benchmarks.step.gpu_runs NAME [NAME ...] [--out DIR] [--cold] [--dry-run] [--bench-flags "..."]
    python -m benchmarks.step.gpu_runs --list

A row is one command (``harts ...``, ``pytest ...`` or a benchmark script) with its purpose, time
limit, environment and the card it needs ("h200": its estimated peak exceeds an H100's 80 GB).
Named rows run in order, each a subprocess under its limit (the rest run on after one fails or
times out), its output in DIR/NAME.log, its ``--json`` in DIR/NAME.json, a profile's text in
DIR/NAME.profile/ (its Chrome traces deleted: too large to bring back); each prints its summary
lines, and one status line per row ends the run (exit status 1 if any failed). ``--cold``
deletes the Triton, Inductor and fla-core caches before each row: a fresh machine's cold start.
``bash scripts/gpu_bench_runs.sh NAME ...`` installs carried wheels first (docs/gpu.md).

The ``scripts/gpu_bench_runs.sh PART`` commands the results files name, and their rows:

    tests: gpu_suite compare compare_moe_kept      medium: medium medium_moe_kept
    swe5, swe0, profile, profile_swe, sweep: rows of those names   plan: plan_swe
    layers 20: swe5_layers20                       moe_keep 20 / moe_keep 20 0: swe5_keep20 / swe0_keep20
    medium_layers 0 / 2: medium_layers0 / medium_layers2   medium_keep 3: medium_keep3
    medium_full 20: medium_full_keep20             silu_ab 20: silu_conv_keep20 silu_split_keep20
    env_ab HARTS_KDA_FLA_GATE 20: fla_gate0_keep20 fla_gate1_keep20
    profile_la: profile_la_tree profile_la_linked  qkv_norm: qkv_norm_test qkv_norm
    tune: tune medium_tuned (one call: medium_tuned reads the configs tune wrote into DIR)
    gpu_tests FILES...: kernel_tests (every test file the results name with it)
    qwen qwen3_5_35b_a3b 8: q35_L8 (PROFILE=1: q35_L8_profile)   qwen qwen3_5_9b 8: q9_L8
    qwen qwen3_next_80b_a3b 8: qnext_L8 (on an H200, without the H100 attempt's --force)
    gdn_ab qwen3_5_35b_a3b 8: q35_L8_gdn_kda q35_L8_gdn_native

COLD=1 is ``--cold``; LA_BACKEND=tree_linked is the default (``auto`` on CUDA); REPEATS=N,
QWEN_FLAGS, LA_BACKEND=NAME are ``--bench-flags``; TIMEOUT is each row's limit; switches such as
TORCHDYNAMO_DISABLE=1 pass through. No result cites flash_tests (``pytest -m gpu
tests/ops/test_attention.py``), moe (``python -m benchmarks.modules.moe --device cuda
--profile``), qwen_profile or USE_TUNED_FLA: they have no rows.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks._runner import parser


@dataclass(frozen=True, slots=True)
class Run:
    """One named run. ``argv`` and ``env`` may hold ``{out}`` (the --out directory), ``{name}``
    (the row's) and ``{gpu}`` (the GPU's name as fla-core's config folders spell it)."""

    name: str
    #: one line: what the run measures or checks, and why it is set up so
    purpose: str
    #: what follows ``python3 -m``: ``harts.cli ...``, ``pytest ...`` or a benchmark script
    argv: tuple[str, ...]
    timeout_s: int = 560
    env: Mapping[str, str] = field(default_factory=dict)
    #: the card it needs where any card will not do ("h200": an H100's 80 GB are too few)
    card: str | None = None
    #: run first, into the same log (the long-context rows write their batch files)
    setup: tuple[str, ...] = ()


JSON = ("--json", "{out}/{name}.json")
PROFILE = ("--profile", "{out}/{name}.profile")
KEEP = ("--recompute-skip", "attention,linear_attention")
MOE = ("--recompute-skip", "attention,linear_attention,moe")
MEDIUM = ("--pattern", "KKKM", "--workload", "medium", "--steps", "1")
# the full 24-layer ling3_tiny on `medium` step 0, 20 of its MoE layers keeping their gate/up output
FULL20 = (*MOE, "--moe-keep-gate-up", "20", "--workload", "medium", "--steps", "1")
EIGHTH = ("--dp", "8", "--replica", "0")  # one replica's share of the step: about 1/8 of it
SWE5, SWE0 = (("--workload", "swe", "--first-step", s, "--steps", "1", *EIGHTH) for s in ("5", "0"))
STEP3 = ("--workload", "medium", "--first-step", "3", "--steps", "1")  # 2.05 M raw tokens, 5.55x
TESTS, LONG = ("pytest", "-m", "gpu", "-p", "no:cacheprovider"), "/tmp/harts_batches"


def ling(*flags: str, la: str = "auto", json: bool = True) -> tuple[str, ...]:
    """``harts bench`` of ``ling3_tiny`` as its results ran it (every layer recomputed, the tree mask)."""
    return ("harts.cli", "bench", "--device", "cuda", "--la-backend", la, "--dtype", "bfloat16", "--recompute",
            "--capacity", "65536", "--attention", "mask", "--model", "ling3_tiny", *flags,
            *(JSON if json else ()))  # fmt: skip


def qwen(model: str, *flags: str, capacity: int = 65536) -> tuple[str, ...]:
    """``harts bench`` of a real model's preset (Qwen's, Nemotron's; its own vocabulary), every layer
    recomputed, ``--attention auto``."""
    return ("harts.cli", "bench", "--device", "cuda", "--la-backend", "auto", "--dtype", "bfloat16", "--recompute",
            "--capacity", str(capacity), "--attention", "auto", "--model", model, *flags, *JSON)  # fmt: skip


Q35, Q9, L8 = "qwen3_5_35b_a3b", "qwen3_5_9b", ("--layers", "8")
NEMOTRON = "nemotron_3_nano_30b_a3b"
# fmt: off
RUNS = (
    Run("cpu_smoke", "the tiny model on the CPU: the runner end to end", ("harts.cli", "bench", "--model", "tiny",
        "--workload", "tiny", "--steps", "1", *JSON), 120),
    Run("gpu_suite", "every GPU test, 8 workers", (*TESTS, "-n", "8", "-v", "--durations=15"), 330),
    Run("gpu_tests", "the LM head's, a training microbatch's (no host sync, recompute) and the varlen views' GPU tests",
        (*TESTS, "-x", "-q", "tests/ops/test_logprob.py", "tests/models/test_no_host_sync.py",
         "tests/models/test_recompute.py",
         "tests/ops/test_attention.py::test_flash_varlen_ancestor_views_and_packed_causal_on_cuda"), 330),
    Run("kernel_tests", "tree kernel, linked rounds, qkv norm, compiled glue, stacked qkv", (*TESTS, "-v",
        "--durations=15", "tests/ops/test_tree_kernel.py", "tests/models/test_linked_rounds.py",
        "tests/ops/test_qkv_norm.py", "tests/ops/test_compiled.py", "tests/models/test_kda_stacked_qkv.py"), 330),
    Run("qkv_norm_test", "the split-l2norm kernel's GPU test", (*TESTS, "-q", "tests/ops/test_qkv_norm.py"), 200),
    Run("compare", "compact against trajectory-wise on the GPU, float32",
        ("harts.cli", "compare", "--device", "cuda", "--dtype", "float32", *JSON), 150),
    Run("compare_moe_kept", "the same with the MoE block kept through recomputation",
        ("harts.cli", "compare", "--device", "cuda", "--dtype", "float32", "--recompute", *MOE, *JSON), 150),
    Run("medium", "`medium` step 0, ling3_tiny pattern KKKM", ling(*KEEP, *MEDIUM), 280),
    Run("medium_moe_kept", "the same, the MoE block kept", ling(*MOE, *MEDIUM), 280),
    Run("medium_layers0", "the same, no layer checkpointed", ling(*MOE, "--recompute-layers", "0", *MEDIUM), 280),
    Run("medium_layers2", "the same, the first 2 layers checkpointed", ling(*MOE, "--recompute-layers", "2", *MEDIUM),
        280),
    Run("medium_keep3", "the same, its 3 MoE layers keeping gate/up", ling(*MOE, "--moe-keep-gate-up", "3", *MEDIUM),
        280),
    Run("medium_full_keep20", "`medium` step 0, the full ling3_tiny, 20 MoE layers keeping gate/up", ling(*FULL20)),
    Run("silu_conv_keep20", "medium_full_keep20, the short conv's SiLU in fla-core's conv", ling(*FULL20), 290,
        {"HARTS_KDA_SILU_IN_SPLIT": "0"}),
    Run("silu_split_keep20", "the same, the SiLU in the split kernel (the default)", ling(*FULL20), 290,
        {"HARTS_KDA_SILU_IN_SPLIT": "1"}),
    Run("fla_gate0_keep20", "medium_full_keep20, KDA's log-decay by the compiled glue", ling(*FULL20), 290,
        {"HARTS_KDA_FLA_GATE": "0"}),
    Run("fla_gate1_keep20", "the same, by fla-core's fused gate", ling(*FULL20), 290, {"HARTS_KDA_FLA_GATE": "1"}),
    Run("swe5", "`swe` step 5, replica 0 of 8, the full model, the MoE block kept", ling(*MOE, *SWE5), 580),
    Run("swe0", "`swe` step 0, as swe5", ling(*MOE, *SWE0), 580),
    Run("swe5_layers20", "swe5, only the first 20 layers checkpointed",
        ling(*MOE, "--recompute-layers", "20", *SWE5), 580),
    Run("swe5_keep20", "swe5, 20 MoE layers keeping gate/up", ling(*MOE, "--moe-keep-gate-up", "20", *SWE5), 580),
    Run("swe0_keep20", "swe0, 20 MoE layers keeping gate/up", ling(*MOE, "--moe-keep-gate-up", "20", *SWE0), 580),
    Run("profile", "medium, one microbatch per side profiled: device time by region",
        ling(*KEEP, *MEDIUM, *PROFILE), 400),
    Run("profile_swe", "the first swe5 microbatch of each side profiled; the step is not timed",
        ling(*MOE, *SWE5, *PROFILE, "--profile-only", json=False), 400),
    Run("profile_la_tree", "profile_swe, one linear-attention call per round",
        ling(*MOE, *SWE5, *PROFILE, "--profile-only", la="tree", json=False), 280),
    Run("profile_la_linked", "profile_swe, a microbatch's rounds linked into one op per layer",
        ling(*MOE, *SWE5, *PROFILE, "--profile-only", la="tree_linked", json=False), 280),
    Run("plan_swe", "every `swe` step planned at dp 8 on the host's CPU, 4 worker processes and alone",
        ("harts.cli", "plan", "--workload", "swe", "--dp", "8", "--planner-workers", "4", *JSON), 300),
    Run("qkv_norm", "KDA's split + q / k l2 norms at 65,536 rows, kernel against torch",
        ("benchmarks.ops.qkv_norm", "--device", "cuda", *JSON), 200),
    Run("sweep", "state-scan and short-conv launch configurations on a swe5 microbatch",
        ("benchmarks.ops.kernel_sweep", *JSON), 540),
    Run("tune", "fla-core's KDA and conv kernels autotuned at 65,536 rows into DIR/fla_configs/GPU (then "
        "`python -m harts.ops.linear_attn.fla_configs diff` against the shipped ones)",
        ("benchmarks.ops.tune_fla", "--out", "{out}/fla_configs", "--rows", "65536", "--kernels", "kda,conv"), 400),
    Run("medium_tuned", "medium on the configs `tune` wrote into the same DIR", ling(*KEEP, *MEDIUM), 280,
        {"FLA_CONFIG_DIR": "{out}/fla_configs/{gpu}", "FLA_CACHE_MODE": "full"}),
    Run("q35_L8", "`medium` step 3 on qwen3_5_35b_a3b's first 8 layers", qwen(Q35, *L8, *STEP3)),
    Run("q35_L8_profile", "q35_L8, a microbatch per side profiled", qwen(Q35, *L8, *STEP3, *PROFILE)),
    Run("q9_L8", "`medium` step 3 on qwen3_5_9b's first 8 layers", qwen(Q9, *L8, *STEP3)),
    Run("q35_L8_gdn_kda", "q35_L8 without the Core run, GDN on the KDA kernels (the default)",
        qwen(Q35, *L8, *STEP3, "--no-core-run"), 320, {"HARTS_GDN_NATIVE": "0"}),
    Run("q35_L8_gdn_native", "the same, GDN on fla-core's own GDN kernels",
        qwen(Q35, *L8, *STEP3, "--no-core-run"), 250, {"HARTS_GDN_NATIVE": "1"}),
    Run("layer_memory_q9", "saved bytes per row of each qwen3_5_9b layer kind at 16,384 rows, full training and "
        "rank-32 LoRA, against harts.models.memory's count", ("benchmarks.modules.layer_memory", "--model", Q9,
        "--device", "cuda", "--rows", "16384", *JSON), 200, setup=("benchmarks.modules.layer_memory", "--model", Q9,
        "--device", "cuda", "--rows", "16384", "--lora", "32")),
    Run("layer_memory_q35", "the same for qwen3_5_35b_a3b's layer kinds, rank-32 LoRA", ("benchmarks.modules"
        ".layer_memory", "--model", Q35, "--device", "cuda", "--rows", "16384", "--lora", "32", *JSON), 200),
    Run("mamba2_la", "Mamba-2's SSD on `medium` step 3's rounds at nemotron_3_nano_30b_a3b's shapes (64 heads, "
        "state 128, head dim 64): the tree kernel against fla's chunk_simple_gla (target: within 1.15x)",
        ("benchmarks.ops.la", "--device", "cuda", "--rule", "plain", "--model", NEMOTRON, "--workload", "medium",
         "--step", "3", "--backends", "tree,plain", "--dtype", "bfloat16", *JSON), 300),
    Run("nemotron_L8", "`medium` step 3 on nemotron_3_nano_30b_a3b's first 8 layers: 4 Mamba-2, 1 attention, 3 MoE "
        "(estimated 48.5 GiB)", qwen(NEMOTRON, *L8, *STEP3)),
    Run("qnext_L8", "`medium` step 3 on qwen3_next_80b_a3b's first 8 layers (estimated 94.8 GiB)",
        qwen("qwen3_next_80b_a3b", *L8, *STEP3), card="h200"),
    Run("q35_lora_full", "all 40 layers of qwen3_5_35b_a3b, rank-32 LoRA, 1/8 of `medium` step 3 (estimated 113 GiB)",
        qwen(Q35, "--lora", "32", *STEP3, *EIGHTH), card="h200"),
    Run("q9_lora_full", "all 32 layers of qwen3_5_9b, rank-32 LoRA, 1/8 of `medium` step 3 (estimated 78.3 GiB: an "
        "H100, narrowly)",
        qwen(Q9, "--lora", "32", *STEP3, *EIGHTH)),
    Run("q9_full_ft", "all of qwen3_5_9b trained, its AdamW step timed, 1/8 of `medium` step 3; estimated 130 GiB "
        "(AdamW's moments bf16 like the weights; bench has no CPU offload)", qwen(Q9, "--optimizer", *STEP3,
        *EIGHTH), card="h200"),
    Run("q9_long_131k", "qwen3_5_9b on one 131,072-token trajectory, rank-32 LoRA (training every weight: "
        "estimated 152 GiB)", qwen(Q9, "--lora", "32", "--workload", f"{LONG}/trajectory_131072.jsonl", "--steps", "1",
        capacity=131072), card="h200", setup=("benchmarks.step.long_batches", "--out", LONG)),
    Run("q9_long_131k_tree", "the same on a tree whose longest path is 131,072 tokens (1.75x)", qwen(Q9, "--lora",
        "32", "--workload", f"{LONG}/tree_131072.jsonl", "--steps", "1", capacity=131072), card="h200",
        setup=("benchmarks.step.long_batches", "--out", LONG)),
)
# fmt: on
BY_NAME = {r.name: r for r in RUNS}
CACHES = ("~/.triton", "/tmp/torchinductor_*", "~/.cache/torch/inductor", "~/.cache/fla*")
BENCH_LINES = re.compile(r"^step|^ +[0-9]+ |^cold start|peak|^model |^kernels")
ERROR_LINES = re.compile(r"error|Traceback|^(FAILED|ERROR) |^E  |interrupted|Killed")


class _Fill(dict):
    """``str.format_map``'s values; ``{gpu}`` asks nvidia-smi only when a row uses it."""

    def __missing__(self, key: str) -> str:
        if key != "gpu":
            raise KeyError(key)
        smi = [shutil.which("nvidia-smi") or "true", "--query-gpu=name", "--format=csv,noheader"]
        got = subprocess.run(smi, capture_output=True, text=True)
        name = (got.stdout.splitlines() or [""])[0] if got.returncode == 0 else ""
        self[key] = re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"  # as fla_configs.gpu_dir_name
        return self[key]


def commands(run: Run, out: str, bench_flags: tuple[str, ...] = ()) -> tuple[list[list[str]], dict[str, str]]:
    """The row's module argvs (its setup's first; ``bench_flags`` after a ``harts bench``'s) and its
    environment, filled in."""
    fill = _Fill(out=out, name=run.name)
    argv = [w.format_map(fill) for w in run.argv] + list(bench_flags if run.argv[:2] == ("harts.cli", "bench") else ())
    setup = [[w.format_map(fill) for w in run.setup]] if run.setup else []
    return [*setup, argv], {k: v.format_map(fill) for k, v in run.env.items()}


def shown(run: Run, out: str, bench_flags: tuple[str, ...] = ()) -> str:
    """The row's commands as one shell line."""
    argvs, env = commands(run, out, bench_flags)
    lines = [shlex.join(["python3", "-m", *a]) for a in argvs]
    lines[-1] = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), lines[-1]])
    return " && ".join(lines)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _call(cmd: list[str], env: dict[str, str], log: Path, limit: float) -> int | None:
    """Run ``cmd``, its output appended to ``log``; its exit status, or None at ``limit`` seconds:
    SIGINT then (pytest still reports what finished), and 20 s later SIGKILL to its process group."""
    with log.open("a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=max(1.0, limit))
    except subprocess.TimeoutExpired:
        _kill(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        return None
    finally:
        _kill(proc.pid, signal.SIGKILL)  # whatever of its group still runs (planner workers, pytest workers)
        proc.wait()


def summary(run: Run, text: str) -> list[str]:
    """The lines of a row's log worth printing: a bench's tables, cold start and peaks, else the
    last 15 lines; errors for every row."""
    lines = text.splitlines()
    if run.argv[:2] == ("harts.cli", "bench"):
        return [s for s in lines if (BENCH_LINES.search(s) or ERROR_LINES.search(s)) and "microbatches, sec" not in s]
    return [s for s in lines[:-15] if ERROR_LINES.search(s)][:30] + lines[-15:]


def run_row(run: Run, out: Path, bench_flags: tuple[str, ...], cold: bool) -> str:
    """Run one row (its setup first, both within its limit) and print its summary; its status line."""
    if cold:
        for path in (p for pattern in CACHES for p in glob.glob(os.path.expanduser(pattern))):
            shutil.rmtree(path, ignore_errors=True)
        print(f"caches deleted: {' '.join(CACHES)}", flush=True)
    log, started = out / f"{run.name}.log", time.monotonic()
    log.write_text("")
    (out / f"{run.name}.json").unlink(missing_ok=True)  # harts refuses to overwrite its --json
    shutil.rmtree(out / f"{run.name}.profile", ignore_errors=True)
    argvs, env = commands(run, str(out), bench_flags)
    rc: int | None = 0
    for argv in argvs:
        left = run.timeout_s - (time.monotonic() - started)
        rc = _call([sys.executable, "-m", *argv], {**os.environ, "PYTHONUNBUFFERED": "1", **env}, log, left)
        if rc != 0:
            break
    for trace in (out / f"{run.name}.profile").rglob("*.json"):
        trace.unlink()  # Chrome traces: hundreds of MB; the .txt summaries beside them stay
    for line in summary(run, log.read_text(errors="replace")):
        print(f"  {line}")
    took = f"{time.monotonic() - started:.0f} s"
    if rc is None:
        return f"{run.name}: timed out after {run.timeout_s} s"
    return f"{run.name}: ok ({took})" if rc == 0 else f"{run.name}: failed rc {rc} ({took})"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("names", nargs="*", metavar="NAME", help="rows to run, in this order (--list shows them)")
    p.add_argument("--out", default="gpu_bench_out", help="where each row's NAME.log and NAME.json go")
    p.add_argument("--cold", action="store_true", help="delete Triton, Inductor and fla-core caches before each row")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--list", action="store_true", help="print the table")
    p.add_argument("--bench-flags", default="", help="appended to every harts bench row, e.g. '--repeats 3'")
    argv = list(sys.argv[1:] if argv is None else argv)
    # its value starts with "--", which argparse would take for an option: glue it on
    for i, a in enumerate(argv[:-1]):
        if a == "--bench-flags":
            argv[i : i + 2] = [f"--bench-flags={argv[i + 1]}"]
            break
    args = p.parse_args(argv)
    if args.list:
        for r in RUNS:
            print(f"{r.name:<18} {r.card or '':<4} {r.timeout_s:>3} s  {r.purpose}")
        return 0
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown or not args.names:
        said = f"unknown run(s) {', '.join(unknown)}" if unknown else "name at least one run"
        print(f"gpu_runs: {said}; runs: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    extra, out, statuses = tuple(shlex.split(args.bench_flags)), Path(args.out), []
    for name in args.names:
        run = BY_NAME[name]
        card = f", needs an {run.card}" if run.card else ""
        print(f"== {name} (limit {run.timeout_s} s{card}): {shown(run, str(out), extra)}", flush=True)
        if not args.dry_run:
            out.mkdir(parents=True, exist_ok=True)
            statuses.append(run_row(run, out, extra, args.cold))
    if statuses:
        print("\n".join(statuses))
    return 0 if all(": ok (" in s for s in statuses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
