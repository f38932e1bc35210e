#!/usr/bin/env bash
# The issue-10 GPU figures on one H200 without registry access, one device call per part, each
# inside one call's 10 minutes. Wheels travel as docs/gpu.md says (a GPU machine without registry access):
#
#   here, once:  scripts/fa4_wheels.sh pack            # .whl (fla-core, FA4), .fa4a, .fa4b
#   call 1:      carry [".whl", ".fa4a"]   bash scripts/gpu_bench_runs.sh tests     # keeps FA4 part A
#   call 2..:    carry [".whl", ".fa4b"]   bash scripts/gpu_bench_runs.sh PART       # same machine, within its idle window
#
# A call that finds a fresh machine (the last one went back) has no part A: carry [".whl",
# ".fa4a"] and run `bash scripts/fa4_wheels.sh keep` first, or its parts run on Triton attention.
#
# PART (figures land in $OUT/PART.log and $OUT/PART*.json; the last lines of each go to stdout):
#   tests     pytest -m gpu -n 8, then `harts compare --device cuda --dtype float32` (as is, and with
#             the MoE block kept); keeps FA4's part A in /tmp for the next call
#   flash_tests  the FlexAttention GPU tests with FLASH's runtime there (call 1's suite runs before
#             it arrives, so FLASH's own tests skip there)
#   moe       one MoE layer: plain / recompute / kept, reference and fast paths, by kernel family
#   medium    `medium` step 0, ling3_tiny pattern KKKM, with and without the MoE block kept
#   swe5      `swe` step 5, replica 0 of 8, the full model, the MoE block kept
#   swe0      `swe` step 0, replica 0 of 8, the full model, the MoE block kept
#   profile   `medium` step 0 as `medium` with --profile: one microbatch per side, device busy and time by region
#   plan      `harts plan --workload swe --dp 8` on this host's CPU: every step planned with 4 worker
#             processes and alone, side by side (the step planner's share of Core)
#   profile_swe  `swe` step 5, replica 0 of 8, the full model, the MoE block kept: --profile-only (the
#             first microbatch of each side, after one untimed run of it; the step is not timed)
#   medium_layers N  `medium` step 0 as `medium`, the MoE block kept, only the first N layers checkpointed
#   layers N  `swe` step 5, replica 0 of 8, the MoE block kept and only the first N layers checkpointed
#   moe_keep N [S]  `swe` step S (default 5), replica 0 of 8, the MoE block kept, its first N MoE layers
#             keeping their gate/up output (--moe-keep-gate-up N: about 1.07 GB more per layer)
#   medium_keep N  `medium` step 0 as `medium` with the MoE block kept and --moe-keep-gate-up N
#   medium_full N  `medium` step 0 on the full ling3_tiny (24 layers, no --pattern), the MoE block kept
#             and its first N MoE layers keeping their gate/up output
#   qwen NAME [L]  `medium` step 3 (2.05 M raw tokens, 5.55x over the whole trie) on preset NAME's first L
#             layers (default 8; qwen3_next_80b_a3b, qwen3_5_35b_a3b, qwen3_5_9b, kimi_linear_48b_a3b),
#             --attention auto (FlashAttention-2 varlen views for the GQA models), everything recomputed;
#             TIMEOUT=S stops it after S seconds (default 560), so that several fit one call;
#             QWEN_FLAGS="..." adds bench flags (e.g. "--recompute-skip attention,linear_attention --force"),
#             TAG=NAME names that run's files; PROFILE=1 also profiles one microbatch per side of the
#             timed step (--profile: device time by region and kernel, printed)
#   gdn_ab NAME [L]  `qwen NAME L` twice in one call: HARTS_GDN_NATIVE=0 (GDN on the KDA kernels with the
#             decay broadcast, the default), then =1 (fla-core's own GDN kernels), both --no-core-run;
#             TIMEOUT=S per run (default 320 for the first, 250 for the second); files tagged gdn0 / gdn1
#   qwen_profile NAME [L]  `qwen NAME L` with --profile-only: the first microbatch of each side, after
#             one untimed run of it (the step is not timed): device busy time by region and by kernel
#   silu_ab N  `medium_full N` twice in one call: HARTS_KDA_SILU_IN_SPLIT=0 (the short conv's SiLU in
#             fla-core's conv, the older arrangement), then =1 (in the split kernel, the default)
#   env_ab NAME N  `medium_full N` twice in one call, with the environment switch NAME=0, then =1
#             (HARTS_KDA_FLA_GATE: KDA's log-decay by the compiled glue, then by fla-core's fused gate)
#   gpu_tests ARGS...  `pytest -m gpu ARGS` (test files, -k EXPR, ...) with part A of FA4 kept, as `tests`
#   qkv_norm  the split-l2norm kernel's GPU test, then one KDA layer's split + l2 norms at 65,536 rows,
#             kernel against the torch reference, forward and backward (benchmarks.ops.qkv_norm),
#             and fla-core's short conv + the split with the SiLU in the conv against in the split
#   profile_la  `profile_swe` without the MoE block's gate/up kept, twice: --la-backend tree (one call per
#             round) and tree_linked (the rounds linked into one op per layer): one microbatch per side each
#   sweep     launch configurations of the state scans and fla-core's short conv on the first `swe` step-5
#             microbatch of each side (benchmarks.ops.kernel_sweep): ms per configuration, harts beside baseline
#   tune      autotune fla-core's KDA and short-conv kernels at 65,536 rows (`benchmarks.ops.tune_fla
#             --rows 65536`) into /tmp/harts_fla_tuned (kept on this machine) and $OUT/fla_configs,
#             list what differs from the shipped configs, then `medium` step 0 (as `medium`, MoE
#             recomputed) with the tuned configs
#
# COLD=1 first deletes this machine's Triton, Inductor and fla-core caches (~/.triton,
# /tmp/torchinductor_*, ~/.cache/torch/inductor, ~/.cache/fla*), so that the part's cold start is a
# fresh machine's (FA4's cute-DSL compilation keeps no cache there that we know of).
# LA_BACKEND=NAME runs the bench parts with --la-backend NAME (default auto, on CUDA
# tree_linked: a microbatch's rounds linked into one op per layer); LA_BACKEND=tree runs the tree
# kernel one call per round.
# HARTS_KDA_SILU_IN_SPLIT=0 runs any part with the short conv's SiLU back in fla-core's conv (the
# older arrangement), for A/B timing against the default.
# REPEATS=N times each side's step (and harts' Core run) N times in the bench parts and reports the
# median run with every run's seconds (`medium`'s 4-second harts step varies by a few percent).
# USE_TUNED_FLA=1 runs any part with the configs a `tune` call left on this machine (it stops if
# there are none); the part's log says so.
set -uo pipefail
part=${1:?usage: scripts/gpu_bench_runs.sh tests|flash_tests|moe|medium|swe5|swe0|plan|profile|profile_swe|profile_la|tune|qkv_norm|sweep|layers N|medium_layers N|moe_keep N [S]|medium_keep N|medium_full N|silu_ab N|env_ab NAME N|qwen NAME [L]|qwen_profile NAME [L]|gdn_ab NAME [L]|gpu_tests PATH...}
case "$part" in
tests | flash_tests | moe | medium | swe5 | swe0 | plan | profile | profile_swe | profile_la | tune | qkv_norm | sweep) ;;
layers | medium_layers | moe_keep | medium_keep | medium_full | silu_ab) [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "$part needs a layer count N" >&2; exit 2; } ;;
qwen | qwen_profile | gdn_ab) [[ "${2:-}" =~ ^[a-z0-9_]+$ ]] || { echo "$part needs a preset name" >&2; exit 2; } ;;
env_ab)
    [[ "${2:-}" =~ ^HARTS_[A-Z0-9_]+$ ]] || { echo "env_ab needs a HARTS_* switch name, e.g. HARTS_KDA_FLA_GATE" >&2; exit 2; }
    [[ "${3:-}" =~ ^[0-9]+$ ]] || { echo "env_ab needs a layer count N after the name" >&2; exit 2; } ;;
gpu_tests)
    [ $# -ge 2 ] || { echo "gpu_tests needs test paths" >&2; exit 2; }
    for f in "${@:2}"; do  # the arguments that name test files (others, such as -k EXPR, go to pytest as they are)
        case "$f" in -*) continue ;; esac
        [[ "$f" == */* || "$f" == *.py* ]] || continue
        [ -e "${f%%::*}" ] || { echo "gpu_tests: no test file '${f%%::*}'" >&2; exit 2; }
    done ;;
*) echo "unknown part '$part' (tests, flash_tests, moe, medium, swe5, swe0, plan, profile, profile_swe, profile_la, tune, qkv_norm, sweep, layers N, medium_layers N, moe_keep N [S], medium_keep N, medium_full N, silu_ab N, env_ab NAME N, qwen NAME [L], qwen_profile NAME [L], gdn_ab NAME [L], gpu_tests PATH...)" >&2; exit 2 ;;
esac
OUT=${OUT:-gpu_bench_out}
mkdir -p "$OUT"
if [ "${COLD:-0}" = 1 ]; then
    rm -rf ~/.triton /tmp/torchinductor_* ~/.cache/torch/inductor ~/.cache/fla* 2>/dev/null
    echo "COLD=1: Triton, Inductor and fla-core caches deleted at $(date +%T)"
fi
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
if { [ "$part" = tests ] || [ "$part" = gpu_tests ]; } && [ -f .fa4a/part-a ]; then
    bash scripts/fa4_wheels.sh keep >/dev/null || exit 9
elif [ -f .fa4b/part-b ]; then
    if ! why=$(bash scripts/fa4_wheels.sh unpack /tmp/site 2>&1); then
        echo "FA4 runtime not unpacked, attention runs on Triton: ${why##*$'\n'}"
        echo "(a fresh machine: first a call that carries [\".whl\", \".fa4a\"] and runs scripts/fa4_wheels.sh keep)"
    fi
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
TUNED=/tmp/harts_fla_tuned
if [ "${USE_TUNED_FLA:-0}" = 1 ]; then
    tuned_dir=$(ls -d "$TUNED"/*/ 2>/dev/null | head -1)
    [ -n "$tuned_dir" ] || { echo "USE_TUNED_FLA=1 but no tune call left configs in $TUNED on this machine" >&2; exit 2; }
    export FLA_CONFIG_DIR=${tuned_dir%/} FLA_CACHE_MODE=full
    echo "fla configs: tuned on this machine ($FLA_CONFIG_DIR), not the shipped ones"
fi

B=(python3 -m harts.cli bench --device cuda --la-backend "${LA_BACKEND:-auto}" --dtype bfloat16 --recompute --capacity 65536
    --attention mask --model ling3_tiny --repeats "${REPEATS:-1}")
KEEP=(--recompute-skip attention,linear_attention)
KEEP_MOE=(--recompute-skip attention,linear_attention,moe)
show() { grep -E "^step|^ +[0-9]+ |cold start|FlexAttention backend|passed|failed|^(plain|recompute|kept) " "$1" | grep -v "microbatches:"; }

case "$part" in
tests)
    # SIGINT at the limit: pytest still reports what finished and the slowest tests (-v, --durations)
    timeout -s INT -k 20 330 python3 -m pytest -m gpu -n 8 -v --durations=15 -p no:cacheprovider >"$OUT/tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  " "$OUT/tests.log" | head -30
    grep -A16 "slowest .*durations" "$OUT/tests.log"
    tail -3 "$OUT/tests.log"
    # compact against trajectory-wise on the GPU, float32: as the results' figures, and with the
    # MoE block kept (no recomputation of it)
    for mode in default moe_kept; do
        extra=(); [ "$mode" = moe_kept ] && extra=(--recompute "${KEEP_MOE[@]}")
        timeout 150 python3 -m harts.cli compare --device cuda --dtype float32 "${extra[@]}" \
            --json "$OUT/compare_$mode.json" >"$OUT/compare_$mode.log" 2>&1
        echo "== compare $mode"; grep -vE "^compare:" "$OUT/compare_$mode.log" | tail -14
    done
    ;;
flash_tests)
    [ -f .fa4b/part-b ] || { echo "flash_tests needs FA4's part B carried (.fa4b)" >&2; exit 2; }
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_attention.py >"$OUT/flash_tests.log" 2>&1
    tail -5 "$OUT/flash_tests.log"
    ;;
moe)
    timeout 500 python3 -m benchmarks.modules.moe --device cuda --profile --json "$OUT/moe.json" >"$OUT/moe.log" 2>&1
    show "$OUT/moe.log"
    ;;
medium)
    for keep in KEEP KEEP_MOE; do
        declare -n flags=$keep
        timeout 280 "${B[@]}" "${flags[@]}" --pattern KKKM --workload medium --steps 1 \
            --json "$OUT/medium_$keep.json" >"$OUT/medium_$keep.log" 2>&1
        echo "== medium $keep"; show "$OUT/medium_$keep.log"
    done
    ;;
swe5 | swe0)
    step=${part#swe}
    timeout 580 "${B[@]}" "${KEEP_MOE[@]}" --workload swe --first-step "$step" --steps 1 --dp 8 --replica 0 \
        --json "$OUT/$part.json" >"$OUT/$part.log" 2>&1
    show "$OUT/$part.log"
    ;;
plan)
    timeout 300 python3 -m harts.cli plan --workload swe --dp 8 --planner-workers 4 --json "$OUT/plan_swe.json" \
        >"$OUT/plan_swe.log" 2>&1
    grep -vE "^plan|checking" "$OUT/plan_swe.log" | tail -20
    ;;
profile)
    timeout 400 "${B[@]}" "${KEEP[@]}" --pattern KKKM --workload medium --steps 1 --profile "$OUT/profile" \
        --json "$OUT/profile.json" >"$OUT/profile.log" 2>&1
    show "$OUT/profile.log"
    for side in baseline harts; do echo "== $side"; head -28 "$OUT/profile/step0/$side.txt"; done
    rm -f "$OUT"/profile/step0/*.json  # the traces: too large to come back
    ;;
profile_swe)
    timeout 400 "${B[@]}" "${KEEP_MOE[@]}" --workload swe --first-step 5 --steps 1 --dp 8 --replica 0 \
        --profile "$OUT/profile_swe" --profile-only >"$OUT/profile_swe.log" 2>&1
    grep -vE "^ +[0-9.]+ +[0-9]+  " "$OUT/profile_swe.log" | tail -40
    rm -f "$OUT"/profile_swe/step5/*.json  # the traces: too large to come back
    ;;
profile_la)
    for be in tree tree_linked; do
        BE=("${B[@]}"); BE[7]=$be  # --la-backend's value
        timeout 280 "${BE[@]}" "${KEEP_MOE[@]}" --workload swe --first-step 5 --steps 1 --dp 8 --replica 0 \
            --profile "$OUT/profile_la_$be" --profile-only >"$OUT/profile_la_$be.log" 2>&1
        echo "== --la-backend $be"
        grep -E "microbatch wall|^  [a-z_/]+ +[0-9.]+ ms" "$OUT/profile_la_$be.log" | head -24
        rm -f "$OUT"/profile_la_"$be"/step5/*.json
    done
    ;;
tune)
    rm -rf "$TUNED"
    timeout 400 python3 -m benchmarks.ops.tune_fla --out "$TUNED" --rows 65536 --kernels kda,conv >"$OUT/tune.log" 2>&1
    tail -4 "$OUT/tune.log"
    tuned_dir=$(ls -d "$TUNED"/*/ 2>/dev/null | head -1)
    [ -n "$tuned_dir" ] || { echo "tune_fla wrote no configs"; exit 1; }
    cp -r "$tuned_dir" "$OUT/fla_configs"
    python3 -m harts.ops.linear_attn.fla_configs diff "harts/ops/linear_attn/fla_configs/$(basename "$tuned_dir")" "$tuned_dir"
    FLA_CONFIG_DIR=${tuned_dir%/} FLA_CACHE_MODE=full timeout 170 "${B[@]}" "${KEEP[@]}" --pattern KKKM --workload medium \
        --steps 1 --json "$OUT/medium_tuned.json" >"$OUT/medium_tuned.log" 2>&1
    echo "== medium, tuned fla configs"; show "$OUT/medium_tuned.log"
    ;;
medium_layers)
    n=$2
    timeout 280 "${B[@]}" "${KEEP_MOE[@]}" --recompute-layers "$n" --pattern KKKM --workload medium --steps 1 \
        --json "$OUT/medium_layers$n.json" >"$OUT/medium_layers$n.log" 2>&1
    show "$OUT/medium_layers$n.log"
    ;;
gpu_tests)
    timeout -s INT -k 20 330 python3 -m pytest -m gpu -v --durations=15 -p no:cacheprovider "${@:2}" >"$OUT/gpu_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|^E  " "$OUT/gpu_tests.log" | head -30
    grep -A16 "slowest .*durations" "$OUT/gpu_tests.log"
    tail -3 "$OUT/gpu_tests.log"
    ;;
qwen)
    name=$2
    layers=${3:-8}
    tag="qwen_${name}_L$layers${TAG:+_$TAG}"
    prof=(); [ "${PROFILE:-0}" = 1 ] && prof=(--profile "$OUT/$tag.profile")
    # shellcheck disable=SC2086  # QWEN_FLAGS: extra bench flags, word-split on purpose
    timeout "${TIMEOUT:-560}" "${B[@]}" --attention auto --model "$name" --layers "$layers" --workload medium --first-step 3 \
        --steps 1 ${QWEN_FLAGS:-} "${prof[@]}" --json "$OUT/$tag.json" >"$OUT/$tag.log" 2>&1
    show "$OUT/$tag.log"
    if [ "${PROFILE:-0}" = 1 ]; then
        cat "$OUT/$tag.profile"/step3/*.txt 2>/dev/null | grep -vE "^ +[0-9.]+ +[0-9]+  " | head -120
        rm -f "$OUT/$tag.profile"/step3/*.json  # the traces: too large to come back
    fi
    ;;
gdn_ab)
    # the first run pays a fresh machine's compilation (about 200 s for qwen3_5_35b_a3b on an H100),
    # the second only the GDN kernels' first autotune; no Core run (the A/B needs F/B/Grad only)
    for v in 0 1; do
        echo "== HARTS_GDN_NATIVE=$v"
        limit=${TIMEOUT:-$([ "$v" = 0 ] && echo 320 || echo 250)}
        HARTS_GDN_NATIVE=$v TAG=gdn$v TIMEOUT=$limit QWEN_FLAGS="${QWEN_FLAGS:-} --no-core-run" \
            bash "$0" qwen "$2" "${3:-8}"
    done
    ;;
qwen_profile)
    name=$2
    layers=${3:-8}
    dir="$OUT/qwen_profile_${name}_L$layers"
    timeout "${TIMEOUT:-560}" "${B[@]}" --attention auto --model "$name" --layers "$layers" --workload medium \
        --first-step 3 --steps 1 --profile "$dir" --profile-only >"$dir.log" 2>&1
    grep -vE "^ +[0-9.]+ +[0-9]+  " "$dir.log" | tail -40
    rm -f "$dir"/step3/*.json  # the traces: too large to come back
    ;;
medium_full)
    n=$2
    timeout 560 "${B[@]}" "${KEEP_MOE[@]}" --moe-keep-gate-up "$n" --workload medium --steps 1 \
        --json "$OUT/medium_full_keep$n.json" >"$OUT/medium_full_keep$n.log" 2>&1
    show "$OUT/medium_full_keep$n.log"
    ;;
silu_ab)
    n=$2
    for v in 0 1; do
        HARTS_KDA_SILU_IN_SPLIT=$v timeout 290 "${B[@]}" "${KEEP_MOE[@]}" --moe-keep-gate-up "$n" --workload medium \
            --steps 1 --json "$OUT/silu_ab${v}_keep$n.json" >"$OUT/silu_ab${v}_keep$n.log" 2>&1
        echo "HARTS_KDA_SILU_IN_SPLIT=$v:"
        show "$OUT/silu_ab${v}_keep$n.log"
    done
    ;;
env_ab)
    name=$2 n=$3
    for v in 0 1; do
        env "$name=$v" timeout 290 "${B[@]}" "${KEEP_MOE[@]}" --moe-keep-gate-up "$n" --workload medium \
            --steps 1 --json "$OUT/${name}_${v}_keep$n.json" >"$OUT/${name}_${v}_keep$n.log" 2>&1
        echo "$name=$v:"
        show "$OUT/${name}_${v}_keep$n.log"
    done
    ;;
moe_keep)
    n=$2 step=${3:-5}
    timeout 580 "${B[@]}" "${KEEP_MOE[@]}" --moe-keep-gate-up "$n" --workload swe --first-step "$step" --steps 1 --dp 8 \
        --replica 0 --json "$OUT/moe_keep${n}_swe$step.json" >"$OUT/moe_keep${n}_swe$step.log" 2>&1
    show "$OUT/moe_keep${n}_swe$step.log"
    ;;
medium_keep)
    n=$2
    timeout 280 "${B[@]}" "${KEEP_MOE[@]}" --moe-keep-gate-up "$n" --pattern KKKM --workload medium --steps 1 \
        --json "$OUT/medium_keep$n.json" >"$OUT/medium_keep$n.log" 2>&1
    show "$OUT/medium_keep$n.log"
    ;;
qkv_norm)
    timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_qkv_norm.py >"$OUT/qkv_norm_test.log" 2>&1
    tail -2 "$OUT/qkv_norm_test.log"
    timeout 200 python3 -m benchmarks.ops.qkv_norm --device cuda --json "$OUT/qkv_norm.json" 2>&1 | tee "$OUT/qkv_norm.log"
    ;;
sweep)
    timeout 540 python3 -m benchmarks.ops.kernel_sweep --json "$OUT/kernel_sweep.json" 2>&1 | tee "$OUT/kernel_sweep.log"
    ;;
layers)
    n=$2
    timeout 580 "${B[@]}" "${KEEP_MOE[@]}" --recompute-layers "$n" --workload swe --first-step 5 --steps 1 --dp 8 \
        --replica 0 --json "$OUT/layers$n.json" >"$OUT/layers$n.log" 2>&1
    show "$OUT/layers$n.log"
    ;;
esac
