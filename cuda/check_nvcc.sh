#!/usr/bin/env bash
# check_nvcc.sh — compile every CUDA kernel for the H100/H200 (sm_90) with nvcc and
# report what ptxas says about each kernel: registers, static shared memory, stack and
# spills. Fails (exit 1) on a compile error, on any register spill, or when an attention
# kernel is missing at one of the head dims of SUPPORTED_HEAD_DIMS in
# refengine/kernels/plans.py (32, 64, 96, 128, 256), or a quantized-weight product
# (quant_matmul.cu) at one of the activation dtypes.
#
# Usage: bash cuda/check_nvcc.sh [ARCH]      (ARCH defaults to sm_90)
# Outputs: cuda/build/<kernel file>.cubin and cuda/build/<kernel file>.ptxas.log, plus
#          cuda/build/all_kernels.ptx (every .cu in one translation unit: the production
#          module CudaAttention compiles is this minus the mma_check.cu self-tests).
#
# Dynamic shared memory (all our tiles) is chosen at launch, so ptxas reports 0 smem for
# it; the sizes are documented in each kernel's header comment.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
arch="${1:-sm_90}"
build="$here/build"
mkdir -p "$build"

if ! command -v nvcc >/dev/null 2>&1; then
    echo "check_nvcc.sh: nvcc not found on PATH" >&2
    exit 1
fi

sources=("$here"/*.cu)
pids=()
for src in "${sources[@]}"; do
    name="$(basename "$src" .cu)"
    # One nvcc per file, all in parallel: the machine's cores do the waiting.
    nvcc -arch="$arch" -cubin -std=c++17 -O3 -Xptxas -v -I"$here" \
        -o "$build/$name.cubin" "$src" >"$build/$name.ptxas.log" 2>&1 &
    pids+=($!)
done

# CudaAttention hands NVRTC its kernel files as one translation unit: check that the
# concatenation (here with the self-tests too) compiles (front end + PTX only; the cubins
# above cover ptxas).
cat "${sources[@]}" >"$build/all_kernels.cu"
nvcc -arch="$arch" -ptx -std=c++17 -I"$here" -o "$build/all_kernels.ptx" "$build/all_kernels.cu" \
    >"$build/all_kernels.log" 2>&1 &
concat_pid=$!

status=0
if ! wait "$concat_pid"; then
    echo "COMPILE ERROR in the concatenation of all kernels (what CudaAttention compiles):" >&2
    cat "$build/all_kernels.log" >&2
    status=1
fi
for i in "${!sources[@]}"; do
    name="$(basename "${sources[$i]}" .cu)"
    if ! wait "${pids[$i]}"; then
        echo "COMPILE ERROR in $name.cu:" >&2
        cat "$build/$name.ptxas.log" >&2
        status=1
    fi
done
[ "$status" -eq 0 ] || exit "$status"

# Every attention kernel at every supported head dim must be among the compiled entries.
head_dims="$(sed -n 's/^SUPPORTED_HEAD_DIMS = (\(.*\))$/\1/p' "$here/../refengine/kernels/plans.py" | tr -d ' ' | tr ',' ' ')"
if [ -z "$head_dims" ]; then
    echo "check_nvcc.sh: cannot read SUPPORTED_HEAD_DIMS from refengine/kernels/plans.py" >&2
    exit 1
fi
entries="$(for src in "${sources[@]}"; do cat "$build/$(basename "$src" .cu).ptxas.log"; done |
    sed -n "s/.*Compiling entry function '\([^']*\)'.*/\1/p")"
missing=""
for d in $head_dims; do
    for kernel in flash_prefill_{f32,f16,bf16} flash_prefill_mma_{f16,bf16} paged_decode_{f32,f16,bf16} \
                  paged_decode_reduce_{f32,f16,bf16} \
                  {flash_prefill,paged_decode}_{f32,f16,bf16}_{int8,fp8e4m3,fp8e5m2}; do
        grep -qx "${kernel}_hd$d" <<<"$entries" || missing="$missing ${kernel}_hd$d"
    done
done
# the quantized-weight products (quant_matmul.cu), one per format, path and activation dtype
for kernel in {int8,int4}_{gemv,gemm}_{f32,f16,bf16}; do
    grep -qx "$kernel" <<<"$entries" || missing="$missing $kernel"
done
if [ -n "$missing" ]; then
    echo "MISSING KERNELS:$missing" >&2
    exit 1
fi
echo "check_nvcc.sh: every attention kernel present at head dims $head_dims"

# ptxas -v prints, per entry function:
#   ptxas info    : Compiling entry function 'NAME' for 'sm_90'
#   ptxas info    : Function properties for NAME
#       N bytes stack frame, N bytes spill stores, N bytes spill loads
#   ptxas info    : Used N registers, used N barriers, N bytes smem, N bytes cmem[0]
printf '%-34s %5s %6s %6s %7s %7s\n' kernel regs smem stack spill_st spill_ld
for src in "${sources[@]}"; do cat "$build/$(basename "$src" .cu).ptxas.log"; done | awk '
    /Compiling entry function/ { match($0, /'\''[^'\'']+'\''/); name = substr($0, RSTART + 1, RLENGTH - 2) }
    /bytes stack frame/ { stack = $1; sst = $5; sld = $9 }
    /Used [0-9]+ registers/ {
        regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
        smem = 0
        if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ bytes smem/, "", smem) }
        printf "%-34s %5s %6s %6s %7s %7s\n", name, regs, smem, stack, sst, sld
        if (sst + 0 > 0 || sld + 0 > 0) spilled = spilled " " name
    }
    END {
        if (spilled != "") { print "REGISTER SPILLS in:" spilled > "/dev/stderr"; exit 1 }
    }
'
echo "check_nvcc.sh: all kernels compiled for $arch without spills"
