#!/usr/bin/env bash
# harts on N GPUs of one host (torchrun, NCCL): correctness against one GPU, and a scaling run.
#
#   scripts/multi_gpu.sh [OUT_DIR]          # from the repo root
#
# correctness  one step's gradients (no update), float32, model ling3_tiny's dimensions with
#              pattern KGMA (CORR_MODEL), workload tiny (CORR_WORK), the step plan's replicas
#              fixed to N so 1 GPU and N GPUs run the same microbatches:
#                1 GPU twice (corr_one.json, corr_rerun.json), N GPUs (corr_many.json, --ep CORR_EP),
#                then compare: loss, MoE objective, expert counts, per-parameter-group gradient
#                norms; tolerance per quantity max(4 |one - rerun|, 1e-5 |one|) -> correctness.json
#                (exit status 1 if a quantity is outside its tolerance)
# scaling      full ling3_tiny, swe workload (SCALE_WORK), T = 65,536, bf16, recompute, harts
#              (compact) and the trajectory baseline (raw tokens packed at T), D in SCALE_DS (<= N):
#                scaling_D<d>.json per D: step time, tokens/s/GPU, MFU and effective MFU, measured vs
#                predicted per-replica time
#
# context     Ulysses context parallelism (--cp C): one CP group of C GPUs against 1 GPU, model
#              qwen3_next_80b_a3b --layers 8 (CP_MODEL), bf16, T compact rows per microbatch for
#              each T in CP_TS (131,072 and 262,144), each C in CP_CS (2 and 4, those <= N):
#                correctness: 1 GPU twice and C GPUs, one step's gradients (--replicas 1: the same
#                  microbatches), compared as above (cp_corr_T<T>_cp<c>.json; within rerun noise);
#                scaling: one step of CP_WORK on 1 GPU (cp_scale_T<T>_C1.json) and on C GPUs
#                  (cp_scale_T<T>_cp<c>.json: step time, per-rank peak memory), efficiency t_1 / (C t_C) and peak memory ratio
#                  (cp_eff_T<T>_cp<c>.json; expected: the ratio near 1/C for the activations, the
#                  efficiency below 1 by the all-to-alls' share). Where 1 GPU does not fit T
#                  (out of memory: the reason for CP), its runs fail and only the C-GPU figures stand.
#              The C-GPU runs always start through torchrun, so CP_CS="1" on one GPU runs every
#              command of this part as written, torchrun included (the check a one-GPU machine
#              can make; one rank joins no process group, so NCCL's all-to-alls wait for C >= 2).
#
# tensor      tensor parallelism with sequence parallelism (--tp P): the context part's runs with
#              --tp for --cp (TP_* settings, files tp_*), P in TP_PS, T in TP_TS; the same
#              correctness tolerance, per-rank peak memory and efficiency t_1 / (P t_P).
#
# In device calls of at most 10 minutes (the lent H200 machines) run the parts one at a time. One
# H200 runs a whole `swe` step of the full model in about 225 s with harts and about 1,200 s
# trajectory-wise (8 x the replica-0 times of
# benchmarks/results/ling3-tiny_h200_2026-12-02_fla-gate-moe-swiglu.md), so:
#   PARTS=correctness                                                       (minutes)
#   PARTS=scaling SCALE_MODES=compact SCALE_DS=1 SCALE_WORK="--workload swe --steps 1"
#   PARTS=scaling SCALE_MODES=compact SCALE_DS="2 4" SCALE_WORK="--workload swe --steps 1"
#   PARTS=scaling SCALE_MODES=trajectory SCALE_DS=4 SCALE_WORK="--workload swe --steps 1"
#   PARTS=scaling SCALE_WORK="--workload medium --steps 1" SCALE_DS="1 2 4"  (both modes: the
#             baseline at D = 1 and 2 on a step that fits; `medium` is about 92 s / 14 s on one GPU)
# each with TIMEOUT below the call's limit.
#
# Every run writes OUT_DIR/<name>.log; OUT_DIR/summary.txt has one line per run with its exit
# status and wall time. The exit status is the number of failed runs.
#
# Environment:
#   PYTHON       interpreter (default python3)
#   PARTS        which parts to run (default "correctness scaling"; also "context", "tensor")
#   NGPUS        GPUs to use (default: all visible, from nvidia-smi)
#   DEVICE       cuda (default) or cpu (gloo processes: how the tests run this script)
#   CORR_MODEL   correctness model flags (default "--model ling3_tiny --pattern KGMA")
#   CORR_WORK    correctness workload flags (default "--workload tiny --capacity 4096")
#   CORR_EP      expert-parallel degree of the N-GPU correctness run (default 1; N must divide by it)
#   CORR_DTYPE   default float32
#   SCALE_DS     data-parallel sizes (default "1 2 4 8", those <= NGPUS)
#   SCALE_MODEL  default "--model ling3_tiny"
#   SCALE_WORK   default "--workload swe --steps 2"
#   SCALE_FLAGS  default "--dtype bfloat16 --recompute --capacity 65536 --la-backend auto --attention mask"
#   SCALE_MODES  default "compact trajectory"
#   CP_MODEL     default "--model qwen3_next_80b_a3b --layers 8"
#   CP_TS        compact rows per microbatch (default "131072 262144")
#   CP_CS        context-parallel degrees (default "2 4", those <= NGPUS)
#   CP_WORK      default "--workload medium --steps 1"
#   CP_FLAGS     default "--dtype bfloat16 --recompute --la-backend auto --attention auto"
#   TP_MODEL, TP_WORK, TP_FLAGS  the tensor part's (defaults: the CP_ ones)
#   TP_TS        compact rows per microbatch of the tensor part (default "65536 131072")
#   TP_PS        tensor-parallel degrees (default "2 4", those <= NGPUS)
#   TIMEOUT      seconds per run (default 1800)
set -uo pipefail
# the benchmarks are modules of this repository (python -m benchmarks...), not of the harts package:
# its root on the path, wherever the script is started from
REPO_ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"

OUT=${1:-multi_gpu_out}
PY=${PYTHON:-python3}
PARTS=${PARTS:-correctness scaling}
DEVICE=${DEVICE:-cuda}
if [[ -z ${NGPUS:-} ]]; then
    NGPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
fi
CORR_MODEL=${CORR_MODEL:---model ling3_tiny --pattern KGMA}
CORR_WORK=${CORR_WORK:---workload tiny --capacity 4096}
CORR_EP=${CORR_EP:-1}
CORR_DTYPE=${CORR_DTYPE:-float32}
SCALE_DS=${SCALE_DS:-1 2 4 8}
SCALE_MODEL=${SCALE_MODEL:---model ling3_tiny}
SCALE_WORK=${SCALE_WORK:---workload swe --steps 2}
SCALE_FLAGS=${SCALE_FLAGS:---dtype bfloat16 --recompute --capacity 65536 --la-backend auto --attention mask}
SCALE_MODES=${SCALE_MODES:-compact trajectory}
CP_MODEL=${CP_MODEL:---model qwen3_next_80b_a3b --layers 8}
CP_TS=${CP_TS:-131072 262144}
CP_CS=${CP_CS:-2 4}
CP_WORK=${CP_WORK:---workload medium --steps 1}
CP_FLAGS=${CP_FLAGS:---dtype bfloat16 --recompute --la-backend auto --attention auto}
TP_MODEL=${TP_MODEL:-$CP_MODEL}
TP_TS=${TP_TS:-65536 131072}
TP_PS=${TP_PS:-2 4}
TP_WORK=${TP_WORK:-$CP_WORK}
TP_FLAGS=${TP_FLAGS:-$CP_FLAGS}
TIMEOUT=${TIMEOUT:-1800}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1
FAILED=0

# run NAME CMD...: CMD's output to OUT/NAME.log; one summary line
run() {
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    echo "[multi_gpu] start $name: $*"
    timeout "$TIMEOUT" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    printf '%-24s rc=%-3s %5ss  %s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$*" | tee -a "$SUMMARY"
    [[ $rc == 0 ]] || FAILED=$((FAILED + 1))
    return $rc
}

# run_launch NAME N ARGS...: benchmarks.step.multi_gpu ARGS as N ranks (torchrun for N > 1, plain
# python for 1: the one-process path has no process group), through run; the interpreter and the
# output paths stay single words, spaces in them included
run_launch() {
    local name=$1 n=$2
    shift 2
    if [[ $n == 1 ]]; then
        run "$name" "$PY" -m benchmarks.step.multi_gpu "$@"
    else
        run "$name" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" -m benchmarks.step.multi_gpu "$@"
    fi
}

# run_torchrun NAME N ARGS...: as run_launch, always through torchrun (N = 1 included: the
# launch as written for C ranks, checked on a one-GPU machine)
run_torchrun() {
    local name=$1 n=$2
    shift 2
    run "$name" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" -m benchmarks.step.multi_gpu "$@"
}

want() { [[ " $PARTS " == *" $1 "* ]]; }
if ((NGPUS < 1)); then
    echo "no GPU found (set NGPUS, or DEVICE=cpu NGPUS=2 for gloo processes)" >&2
    exit 1
fi

if want correctness; then
    # shellcheck disable=SC2086
    common="correctness --device $DEVICE --dtype $CORR_DTYPE --replicas $NGPUS $CORR_MODEL $CORR_WORK"
    # shellcheck disable=SC2086
    run_launch corr_one 1 $common --out "$OUT/corr_one.json"
    # shellcheck disable=SC2086
    run_launch corr_rerun 1 $common --out "$OUT/corr_rerun.json"
    # shellcheck disable=SC2086
    run_launch corr_many "$NGPUS" $common --ep "$CORR_EP" --out "$OUT/corr_many.json"
    run corr_compare "$PY" -m benchmarks.step.multi_gpu compare "$OUT/corr_one.json" "$OUT/corr_rerun.json" \
        "$OUT/corr_many.json" --out "$OUT/correctness.json"
fi

if want scaling; then
    for d in $SCALE_DS; do
        ((d <= NGPUS)) || continue
        # shellcheck disable=SC2086
        run_launch "scaling_D$d" "$d" scaling --device $DEVICE $SCALE_MODEL $SCALE_WORK $SCALE_FLAGS \
            --modes $SCALE_MODES --out "$OUT/scaling_D$d.json"
    done
    "$PY" - "$OUT" <<'PYEOF' 2>&1 | tee "$OUT/scaling.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'D':>2} {'mode':>10} {'step':>4} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6} {'eff. MFU':>8}  replica s measured / predicted")
for f in sorted(out.glob("scaling_D*.json"), key=lambda p: int(p.stem[9:])):
    r = json.loads(f.read_text())
    for mode, steps in r["modes"].items():
        for s in steps:
            mfu = f"{s['mfu']:.3f}" if s["mfu"] is not None else "-"
            eff = f"{s['effective_mfu']:.3f}" if s.get("effective_mfu") is not None else "-"
            pairs = " ".join(f"{m:.2f}/{p:.2f}" for m, p in zip(s["replica_seconds_measured"], s["replica_seconds_predicted"]))
            print(f"{r['world_size']:>2} {mode:>10} {s['step']:>4} {s['step_seconds']:>8.3f} {s['tokens_per_second_per_gpu']:>10.0f} {mfu:>6} {eff:>8}  {pairs}")
PYEOF
fi
# rows_part PREFIX FLAG DEGREES TS MODEL WORK FLAGS: one row group of C ranks (--cp C or --tp C)
# against one GPU, for each T in TS and C in DEGREES (those <= N): correctness and scaling, files
# OUT/PREFIX_{corr,scale,correctness,eff}_T<T>_<PREFIX><C>.json beside the one-GPU runs
rows_part() {
    local p=$1 flag=$2 degrees=$3 ts=$4 model=$5 work=$6 flags=$7 t c corr scale
    for t in $ts; do
        corr="correctness --device $DEVICE --replicas 1 --capacity $t $model $work $flags"
        scale="scaling --device $DEVICE --modes compact --warmup 1 --capacity $t $model $work $flags"
        # shellcheck disable=SC2086
        run_launch "${p}_corr_T${t}_one" 1 $corr --out "$OUT/${p}_corr_T${t}_one.json"
        # shellcheck disable=SC2086
        run_launch "${p}_corr_T${t}_rerun" 1 $corr --out "$OUT/${p}_corr_T${t}_rerun.json"
        # shellcheck disable=SC2086
        run_launch "${p}_scale_T${t}_C1" 1 $scale --out "$OUT/${p}_scale_T${t}_C1.json"
        for c in $degrees; do
            ((c <= NGPUS)) || continue
            # shellcheck disable=SC2086
            run_torchrun "${p}_corr_T${t}_$p$c" "$c" $corr "$flag" "$c" --out "$OUT/${p}_corr_T${t}_$p$c.json"
            run "${p}_compare_T${t}_$p$c" "$PY" -m benchmarks.step.multi_gpu compare "$OUT/${p}_corr_T${t}_one.json" \
                "$OUT/${p}_corr_T${t}_rerun.json" "$OUT/${p}_corr_T${t}_$p$c.json" \
                --out "$OUT/${p}_correctness_T${t}_$p$c.json"
            # shellcheck disable=SC2086
            run_torchrun "${p}_scale_T${t}_$p$c" "$c" $scale "$flag" "$c" --out "$OUT/${p}_scale_T${t}_$p$c.json"
            run "${p}_eff_T${t}_$p$c" "$PY" -m benchmarks.step.multi_gpu efficiency "$OUT/${p}_scale_T${t}_C1.json" \
                "$OUT/${p}_scale_T${t}_$p$c.json" --out "$OUT/${p}_eff_T${t}_$p$c.json"
        done
    done
}

if want context; then
    rows_part cp --cp "$CP_CS" "$CP_TS" "$CP_MODEL" "$CP_WORK" "$CP_FLAGS"
    cat "$OUT"/cp_eff_T*_cp*.log 2>/dev/null | tee "$OUT/context.txt"
fi
if want tensor; then
    rows_part tp --tp "$TP_PS" "$TP_TS" "$TP_MODEL" "$TP_WORK" "$TP_FLAGS"
    cat "$OUT"/tp_eff_T*_tp*.log 2>/dev/null | tee "$OUT/tensor.txt"
fi
exit "$FAILED"
