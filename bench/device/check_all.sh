#!/bin/bash
# The first device run of a session, one command (~8 minutes on a cold H200): the KV4 decode kernels and their timing
# (decode_check.sh: issue 23's re-run, graph plans), then kv4rl under CUDA graphs in a real SGLang server
# (sglang_gpu_check.sh), then the JIT caches tarred into $OUT for later runs to carry (.devcache/jit_cache.tar.xz).
#   bash bench/device/check_all.sh      (carry .device_sgl, and .devcache if an earlier run made one)
source bench/device/bundle.sh || exit 1
OUT=${OUT:-bench/results/check}
export OUT
PYTEST_TIMEOUT=${KERNEL_TIMEOUT:-200} bash bench/device/decode_check.sh
SGL_TESTS=tests/test_sglang_gpu.py bash bench/device/sglang_gpu_check.sh
