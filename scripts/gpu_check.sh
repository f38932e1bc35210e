#!/usr/bin/env bash
# harts on one CUDA GPU: the GPU tests, model agreement on device, and a training-step speed figure.
#
#   scripts/gpu_check.sh [OUT_DIR]          # from the repo root; fla-core must import
#
# 1. tests   pytest -m gpu: the one-pass tree kernel (KDA and GDN, float32 and bf16, injected state
#            gradients alone, replay bit-identity) and its state scans; the grouped-GEMM MoE
#            without host syncs; fla-core KDA (float32, bfloat16) and GDN against the reference op
#            with exported boundary states and their consumers' gradients, split exactness,
#            the GDN backward guard, FlexAttention tree mask against the dense mask, the short
#            conv on fla-core's kernel (runs with initial states) against the gather conv, and
#            the compiled glue against float64.
# 2. compare harts compare --device cuda, float32: trajectory-wise vs compact, one forward +
#            backward, for la-backend {tree, fla, reference} x attention {mask, gather}. Model:
#            ling3_tiny's dimensions (chunk 64, 16 heads of 128: what fla's kernels take) with
#            pattern KGMA, so KDA, GDN (fla forward, reference backward on Hopper, fla #640),
#            MLA and GQA all run; workload tiny.
# 3. bench   harts bench --device cuda --la-backend auto --dtype bfloat16 --recompute: the
#            small workload's 3 steps at capacity 65,536 (BENCH_WORK for others),
#            ling3_tiny's dimensions with pattern KKKM (one period of the paper model's
#            6 x (3 KDA + 1 MLA); 128 experts; 0.99 B parameters at the small workload's 512-token
#            vocabulary, 1.47 B at 157k), baseline and harts side by
#            side; JSON per run.
# 4. fidelity harts fidelity --device cuda --dtype bfloat16 --la-backend auto --attention mask: the
#            paper's replay ablation (§5.4, Table 5 and Figure 4): Baseline A, Baseline B (rerun
#            noise), harts Replay and No-replay, without and with recomputation, errors by
#            state-handoff depth; FIDELITY_MODEL (default ling3_tiny's dimensions, pattern KKKM,
#            the paper's 157,184-entry vocabulary for the full-vocabulary KL) on FIDELITY_WORK
#            (default: the small workload's step 0 at capacity 8,192, both microbatches, depths
#            0..6+); every path also against Baseline A on a float32 copy of the weights (the
#            noise floor if a rerun on one GPU is bit-identical); OUT_DIR/fidelity.json and .png.
#
# Every step writes OUT_DIR/<name>.log (and .json); OUT_DIR/summary.txt has one line per run
# with its exit status and wall time. The exit status is the number of failed runs.
#
# Environment:
#   PYTHON        interpreter (default python3)
#   PARALLEL=1    run steps 1-2 as concurrent processes, together with an untimed bench on the
#                 small workload that autotunes the bf16 kernels: cold Triton autotuning is
#                 CPU-bound compilation, so this cuts a cold run's wall time several-fold.
#                 The timed benches (step 3) always run alone.
#   STEPS         which of "tests compare la bench fidelity" to run (default "tests compare bench
#                 fidelity"; "la" runs
#                 python -m benchmarks.ops.la on LA_WORK's rounds, default medium)
#   BENCH_MODEL   bench model flags (default "--model ling3_tiny --pattern KKKM")
#   BENCH_WORK    bench workload flags (default "--workload small": 3 steps of ~38k raw tokens;
#                 "--workload medium --steps 1" is 3.6 M raw tokens, which did not finish in
#                 340 s on an H200 with this model)
#   BENCH_ATTN    attention implementations to bench (default "gather mask")
#   BENCH_LA      linear-attention backend of the bench (default auto: the tree kernel, rounds linked, on CUDA; "fla" for the split path)
#   TEST_FILES    GPU test files (default: the fla, tree-kernel, MoE, attention, conv, glue, no-sync and LM-head tests)
#   PYTEST_XDIST  extra pytest flags, e.g. "-n 4" (tests autotune different shapes: parallel helps)
#   COMPARE_LA, COMPARE_ATTN   compare grid (default "fla reference" x "mask gather")
#   FIDELITY_MODEL, FIDELITY_WORK   fidelity model and workload flags (defaults in step 4)
set -uo pipefail
# the benchmarks are modules of this repository (python -m benchmarks...), not of the harts package:
# its root on the path, wherever the script is started from
REPO_ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"

OUT=${1:-gpu_check_out}
PY=${PYTHON:-python3}
STEPS=${STEPS:-tests compare bench fidelity}
BENCH_MODEL=${BENCH_MODEL:---model ling3_tiny --pattern KKKM}
BENCH_WORK=${BENCH_WORK:---workload small}
BENCH_ATTN=${BENCH_ATTN:-gather mask}
TEST_FILES=${TEST_FILES:-tests/ops/test_linear_attn_fla.py tests/ops/test_tree_kernel.py tests/ops/test_tree_scan.py tests/models/test_moe.py tests/ops/test_attention.py tests/ops/test_conv_runs.py tests/ops/test_compiled.py tests/models/test_no_host_sync.py tests/ops/test_logprob.py tests/ops/test_row_gather.py}
COMPARE_LA=${COMPARE_LA:-tree fla reference}
COMPARE_ATTN=${COMPARE_ATTN:-mask gather}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1

# run NAME CMD...: CMD's output to OUT/NAME.log; one summary line
run() {
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    echo "[gpu_check] start $name: $*"
    "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    printf '%-28s rc=%-3s %5ss  %s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$*" | tee -a "$SUMMARY"
    return $rc
}

HARTS=("$PY" -m harts.cli)
COMPARE=(compare --overwrite --device cuda --dtype float32 --model ling3_tiny --pattern KGMA --workload tiny)
BENCH=(bench --overwrite --device cuda --la-backend ${BENCH_LA:-auto} --dtype bfloat16 --recompute --capacity 65536)

phase_a=()
want() { [[ " $STEPS " == *" $1 "* ]]; }
if want tests; then
    for f in $TEST_FILES; do
        name=$(basename "$f" .py)
        phase_a+=("run ${name} $PY -m pytest -m gpu $f -v -p no:cacheprovider ${PYTEST_XDIST:-}")
    done
fi
if want compare; then
    for la in $COMPARE_LA; do
        for attn in $COMPARE_ATTN; do
            phase_a+=("run compare_${la}_${attn} ${HARTS[*]} ${COMPARE[*]} --la-backend $la --attention $attn --json $OUT/compare_${la}_${attn}.json")
        done
    done
fi
if want bench && [[ ${PARALLEL:-0} == 1 ]]; then
    for attn in $BENCH_ATTN; do
        phase_a+=("run bench_warm_${attn} ${HARTS[*]} ${BENCH[*]} $BENCH_MODEL --workload small --steps 1 --attention $attn --json $OUT/bench_warm_${attn}.json")
    done
fi

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    "$PY" -c "import fla; print('fla-core', fla.__version__)"
} 2>&1 | tee "$OUT/env.txt"

if [[ ${PARALLEL:-0} == 1 ]]; then
    pids=()
    for cmd in "${phase_a[@]}"; do
        eval "$cmd" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
else
    for cmd in "${phase_a[@]}"; do eval "$cmd"; done
fi

if want compare; then
    # same weights, same batch: the fla and reference cores must give the same losses too
    "$PY" - "$OUT" <<'PYEOF' 2>&1 | tee "$OUT/compare_backends.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for attn in ("mask", "gather"):
    runs = {la: out / f"compare_{la}_{attn}.json" for la in ("fla", "reference")}
    if not all(p.exists() for p in runs.values()):
        print(f"attention {attn}: a compare run is missing")
        continue
    r = {la: json.loads(p.read_text()) for la, p in runs.items()}
    for mode in ("trajectory", "compact"):
        a, b = r["fla"]["modes"][mode]["loss"], r["reference"]["modes"][mode]["loss"]
        print(f"attention {attn}, {mode}: loss fla {a:.8g} vs reference {b:.8g}, rel diff {abs(a - b) / max(abs(b), 1e-300):.2e}")
PYEOF
fi

if want la; then
    # the linear-attention core alone on real rounds: tree kernel vs fla split path vs plain fla
    run la_bench "$PY" -m benchmarks.ops.la --workload "${LA_WORK:-medium}" --device cuda \
        --json "$OUT/la_bench.json"
fi

if want bench; then
    for attn in $BENCH_ATTN; do
        # shellcheck disable=SC2086
        run "bench_${attn}" "${HARTS[@]}" "${BENCH[@]}" $BENCH_MODEL $BENCH_WORK --attention "$attn" \
            --json "$OUT/bench_${attn}.json"
    done
fi

if want fidelity; then
    FIDELITY_MODEL=${FIDELITY_MODEL:---model ling3_tiny --pattern KKKM --vocab-size 157184}
    FIDELITY_WORK=${FIDELITY_WORK:---workload small --step 0 --capacity 8192}
    # shellcheck disable=SC2086
    run fidelity "${HARTS[@]}" fidelity --overwrite --device cuda --dtype bfloat16 --la-backend auto \
        --attention mask --reference-dtype float32 $FIDELITY_MODEL $FIDELITY_WORK --json "$OUT/fidelity.json" --plot "$OUT/fidelity.png"
fi

for f in "$OUT"/compare_*.log "$OUT"/la_bench.log "$OUT"/bench_*.log "$OUT"/fidelity.log; do
    [[ -e $f ]] || continue
    echo "=== $f"
    grep -v "^\s*$" "$f" | tail -n 25
done
for f in "$OUT"/test_*.log; do
    [[ -e $f ]] || continue
    echo "=== $f"
    grep -E "PASSED|FAILED|ERROR|passed|failed|skipped" "$f" | tail -n 15
done
echo "=== summary"
cat "$SUMMARY"
exit "$(grep -vc 'rc=0 ' "$SUMMARY")"
