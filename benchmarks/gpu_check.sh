#!/usr/bin/env bash
# GPU check: device, (pre)compilation, the whole test suite on the GPU, then the forward benchmark.
#
# Usage (from anywhere; runs in the repository root):
#   bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --precompile-only DIR   # no GPU needed; then CUFLASH_CACHE_DIR=DIR
# Environment:
#   OUT=DIR               where logs, CSV, table and plot go (default ./bench_out)
#   CUFLASH_CACHE_DIR=DIR use these precompiled cubins and skip the precompile step
#   CUFLASH_ARCH=sm_90a   arch for the precompile step (default: from nvidia-smi's compute capability)
#   PYTEST_ARGS="..."     extra pytest arguments (e.g. "-k forward")
#   BENCH_ARGS="..."      extra benchmark arguments (e.g. "--quick")
#   SKIP_TESTS=1 / SKIP_BENCH=1
# The benchmark runs even when tests fail; the exit status is nonzero if any step failed.

set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
# The checkout's cuflash, whether or not it is pip-installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-./bench_out}
status=0

# Every variant the tests can reach (cuflash.kernels.catalogue.reachable_variants: each family x dtype x
# compiled head dim x score-modifier set (none, each alone, all) x dropout on/off, both backward
# passes, decode contiguous/paged, merges), compiled in parallel: `python -m cuflash precompile`
# alone covers the common ones, and compiling the rest one by one inside pytest would cost minutes
# of GPU time. Works without a GPU, so it can also run ahead of time (see --precompile-only).
precompile_test_variants() {  # $1 = arch, $2 = cache dir ("" = the user cache)
    python - "$1" "$2" <<'PY'
import sys, time
from cuflash import kernels
from cuflash._build import compile as _compile
arch, cache_dir = sys.argv[1], sys.argv[2] or None
variants = kernels.catalogue.reachable_variants(arch)
start = time.time()
done = _compile.precompile(variants=variants, arch=arch, cache_dir=cache_dir, quiet=True)
slowest = max(done, key=lambda r: r.seconds, default=None)
print(f"{len(variants)} test variants for {arch}: {len(done)} compiled now, the rest cached "
      f"({time.time() - start:.0f} s" + (f"; slowest {slowest.variant.family} {slowest.seconds:.1f} s)"
                                         if slowest else ")"))
PY
}

detect_arch() {
    local arch=${CUFLASH_ARCH:-}
    if [ -z "$arch" ]; then
        local cc
        cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')
        case "$cc" in
            90|"") arch=sm_90a ;;
            *) arch=sm_$cc ;;
        esac
    fi
    echo "$arch"
}

if [ "${1:-}" = "--precompile-only" ]; then
    # Ahead of time, no GPU needed: bash benchmarks/gpu_check.sh --precompile-only DIR
    # then run on the GPU machine with CUFLASH_CACHE_DIR=DIR.
    dir=${2:?usage: gpu_check.sh --precompile-only DIR}
    arch=$(detect_arch)
    rc=0
    python -m cuflash precompile --arch "$arch" --cache-dir "$dir" || rc=1
    precompile_test_variants "$arch" "$dir" || rc=1
    exit $rc
fi

mkdir -p "$OUT"
echo "== device"
nvidia-smi -L || { echo "nvidia-smi failed"; status=1; }
python -c "import cupy; print('cupy', cupy.__version__, 'devices:', cupy.cuda.runtime.getDeviceCount())" \
    || status=1

if [ -z "${CUFLASH_CACHE_DIR:-}" ]; then
    arch=$(detect_arch)
    echo "== precompile ($arch)"
    start=$(date +%s)
    # Both steps run even if the first reports a failure (e.g. a variant that spills).
    rc=0
    python -m cuflash precompile --arch "$arch" > "$OUT/precompile.log" 2>&1 || rc=1
    precompile_test_variants "$arch" "" >> "$OUT/precompile.log" 2>&1 || rc=1
    tail -n 40 "$OUT/precompile.log"
    if [ "$rc" -ne 0 ]; then
        echo "precompile FAILED (full log: $OUT/precompile.log)"
        status=1
    fi
    echo "precompile took $(( $(date +%s) - start )) s"
else
    echo "== precompile skipped: CUFLASH_CACHE_DIR=$CUFLASH_CACHE_DIR"
fi

test_summary="tests skipped"
if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== tests"
    start=$(date +%s)
    # shellcheck disable=SC2086
    HYPOTHESIS_PROFILE=gpu python -m pytest -q tests benchmarks/tests -x -p no:cacheprovider ${PYTEST_ARGS:-} \
        2>&1 | tee "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
    test_summary=$(grep -E '[0-9]+ (passed|failed|error|errors|skipped)|no tests ran' "$OUT/pytest.log" | tail -n1)
    test_summary="pytest rc=$rc: ${test_summary:-no summary line} ($(( $(date +%s) - start )) s)"
    echo "$test_summary"
    [ "$rc" -eq 0 ] || status=1
fi

if [ -z "${SKIP_BENCH:-}" ]; then
    echo "== benchmark"
    rm -f "$OUT/bench_forward.md"  # never show a stale table from an earlier run
    png_arg=""
    if python -c "import matplotlib" 2>/dev/null; then png_arg="--png $OUT/bench_forward.png"; fi
    # shellcheck disable=SC2086
    python benchmarks/bench_forward.py --csv "$OUT/bench_forward.csv" --md "$OUT/bench_forward.md" \
        $png_arg ${BENCH_ARGS:-} > "$OUT/bench_forward.log" 2>&1
    rc=$?
    # Progress lines only; the table comes last, below.
    grep -v '^|' "$OUT/bench_forward.log" | tail -n 60
    [ "$rc" -eq 0 ] || { echo "benchmark FAILED (rc=$rc, log: $OUT/bench_forward.log)"; status=1; }
fi

echo
echo "== summary"
echo "$test_summary"
if [ -f "$OUT/bench_forward.md" ]; then
    cat "$OUT/bench_forward.md"
fi
echo "gpu_check status: $status (outputs in $OUT)"
exit "$status"
