#!/bin/bash
# The first device run of a session, one command (under 10 minutes on a cold H200, the riskiest part first):
# kv4rl under CUDA graphs in a real SGLang server (sglang_gpu_check.sh: issue 21), then the KV4 decode kernels and
# their timing (decode_check.sh: issue 23's re-run, graph plans), the JIT caches tarred into $OUT on the way for
# later runs to carry (.devcache/jit_cache.tar.xz).
#   bash bench/device/check_all.sh      (carry .device_sgl, and .devcache if an earlier run made one)
source bench/device/bundle.sh || exit 1
OUT=${OUT:-bench/results/check}
export OUT
KVS_TESTS=tests/test_sglang_gpu.py PYTEST_TIMEOUT=${SGL_TIMEOUT:-240} bash bench/device/sglang_gpu_check.sh
rc=$?
PYTEST_TIMEOUT=${KERNEL_TIMEOUT:-150} BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} bash bench/device/decode_check.sh
exit $rc
