#!/bin/bash
# Run the GPU correctness workloads (tests/test_workloads.py) and benchmark on a CUDA host with
# runtime-only TVM.
#
# From the repository root, after `python benchmarks/gpu_prepare.py --bundle` built .gpu/ here:
#   bash benchmarks/gpu_host.sh [gpu_bench.py options, e.g. --quick]
# Environment: LIBS (prepared folder, default .gpu), BUNDLE (default $LIBS/bundle),
# CHECK=0 / BENCH=0 skip that part, CHECK_ARGS (extra pytest options, e.g. -k d128),
# OUT (folder for the logs; default $LIBS/logs).
# Exit status: 0 when the check passed and the benchmark ran without a flagged difference.
set -u
libs=${LIBS:-.gpu}
bundle=${BUNDLE:-$libs/bundle}
logs=${OUT:-$libs/logs}
mkdir -p "$logs"
. "$bundle/setup_gpu_host.sh" || { echo "gpu_host.sh: cannot set up the TVM bundle in $bundle" >&2; exit 2; }
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
# fatbins gpu_prepare.py compiled (relax_kvcache.deploy finds them there and skips nvcc)
export RELAX_KVCACHE_CACHE_DIR=${RELAX_KVCACHE_CACHE_DIR:-$(cd "$libs" && pwd)/cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$logs/device.txt"
rc=0
if [ "${CHECK:-1}" != 0 ]; then
    RELAX_KVCACHE_TEST_DEVICE=cuda RELAX_KVCACHE_WORKLOAD_LIBS="$libs" python3 -m pytest -s -q -p no:cacheprovider \
        tests/test_workloads.py ${CHECK_ARGS:-} 2>&1 | tee "$logs/workloads.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "${BENCH:-1}" != 0 ]; then
    python3 benchmarks/gpu_bench.py --libs "$libs" "$@" 2>&1 | tee "$logs/gpu_bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit $rc
