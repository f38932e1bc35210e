#!/usr/bin/env bash
# flash-attn-4 (torch FlexAttention's BACKEND="FLASH") onto a GPU machine without a registry.
#
# Its CuTe-DSL runtime for CUDA 13 (nvidia-cutlass-dsl-libs-cu13, 92 MB as a wheel, 61 MiB as
# tar.xz) is larger than what one device call carries beside the repo (64 MiB), so it travels in
# two parts over two calls to the same warm machine:
#
#   here:    scripts/fa4_wheels.sh pack          # .whl/ gets the small wheels (beside fla-core),
#                                                # .fa4a/part-a and .fa4b/part-b the runtime
#   call 1:  carry [".whl", ".fa4a"]; the command runs  scripts/fa4_wheels.sh keep
#            (part A moves to $FA4_KEEP, default /tmp/fa4keep: outside the repo, whose copy
#            a later call replaces, ignored folders too), then anything else
#   call 2:  on the same machine, within its idle window: carry [".whl", ".fa4b"]; after the
#            usual install of .whl/*.whl into /tmp/site, run  scripts/fa4_wheels.sh unpack /tmp/site
#            then e.g. python -m benchmarks.ops.attention ... --variant flash+kv=96
#
# The runtime is unpacked over the installed wheels (pip --target --upgrade would replace the
# shared nvidia_cutlass_dsl/ folder). Versions: flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1,
# quack-kernels 0.6.5, apache-tvm-ffi 0.1.15.post2, torch-c-dlpack-ext 0.1.5 (cp312, manylinux).
set -euo pipefail

PLATFORM=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64)
SMALL=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
    nvidia-cutlass-dsl-libs-core==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2
    torch-c-dlpack-ext==0.1.5)
PART_A_BYTES=${PART_A_BYTES:-50000000}
KEEP=${FA4_KEEP:-/tmp/fa4keep}

case "${1:-}" in
pack)
    for d in .whl .fa4a .fa4b; do
        grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
    done
    mkdir -p .whl .fa4a .fa4b
    python3 -m pip download -q "${PLATFORM[@]}" -d .whl "${SMALL[@]}"
    tmp=$(mktemp -d)
    python3 -m pip download -q "${PLATFORM[@]}" -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
    mkdir "$tmp/x"
    (cd "$tmp/x" && python3 -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl .)
    tar -C "$tmp/x" -cf - . | xz -T0 -9e > "$tmp/cu13.tar.xz"
    head -c "$PART_A_BYTES" "$tmp/cu13.tar.xz" > .fa4a/part-a
    tail -c +"$((PART_A_BYTES + 1))" "$tmp/cu13.tar.xz" > .fa4b/part-b
    (cd "$tmp" && sha256sum cu13.tar.xz | cut -d' ' -f1) > .fa4b/sha256
    rm -rf "$tmp"
    du -sh .whl .fa4a .fa4b
    ;;
keep)
    mkdir -p "$KEEP"
    mv .fa4a/part-a "$KEEP/part-a"
    ls -l "$KEEP"
    ;;
unpack)
    site=${2:?usage: scripts/fa4_wheels.sh unpack SITE_DIR}
    [ -f "$KEEP/part-a" ] || { echo "fa4_wheels: no $KEEP/part-a here (call 1 ran on another machine)"; exit 3; }
    got=$(cat "$KEEP/part-a" .fa4b/part-b | sha256sum | cut -d' ' -f1)
    [ "$got" = "$(cat .fa4b/sha256)" ] || { echo "fa4_wheels: parts do not match (sha256 $got)"; exit 4; }
    cat "$KEEP/part-a" .fa4b/part-b | xz -d | tar -C "$site" -xf -
    echo "fa4_wheels: CuTe-DSL cu13 runtime unpacked into $site"
    ;;
*)
    echo "usage: scripts/fa4_wheels.sh pack | keep | unpack SITE_DIR" >&2
    exit 2
    ;;
esac
