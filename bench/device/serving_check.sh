#!/bin/bash
# Issue 21 on the H200, one command (under 10 minutes), most decisive first:
# 1. tests/test_sglang_gpu.py's server tests (bench/device/sglang_gpu_check.sh): a kv4rl server under CUDA graphs
#    against the built-in engine (logprob parity), and the harness training 3 steps against it;
# 2. bench/sglang_parity.py's table: where a parity gap comes from (in-process engines, with and without
#    --hf-numerics; PARITY=0 skips, PARITY_CONFIGS picks);
# 3. the serving table (bench/sglang_serving.py: ours --kv4rl --enable-kv-streams against stock SGLang with bf16 KV,
#    and fp8 with CONFIGS=..., the same requests and memory fraction; SERVE=0 skips).
# The JIT caches come back in $OUT for the next run (carry as .devcache/jit_cache.tar.xz).
#   bash bench/device/serving_check.sh      (carry .device_sgl, and .devcache if an earlier run made one)
source bench/device/bundle.sh || exit 1
OUT=${OUT:-bench/results/check}
export OUT
KVS_TESTS="tests/test_sglang_gpu.py::test_sglang_gpu_server_kv4rl_graphs_match_builtin_engine tests/test_sglang_gpu.py::test_sglang_gpu_harness_trains_three_steps_against_the_server" PYTEST_X= PYTEST_TIMEOUT=${SGL_TIMEOUT:-170} bash bench/device/sglang_gpu_check.sh
[ "${PARITY:-1}" = 1 ] && timeout ${PARITY_TIMEOUT:-200} python3 -m bench.sglang_parity --device cuda \
  --configs ${PARITY_CONFIGS:-kv4rl,kv4rl_hf} --out "$OUT/sglang_parity_${DEVICE_CARD}.json" 2>&1 | grep -v "^\[20" | tail -12
if [ "${SERVE:-1}" = 1 ]; then
  python3 -m kvstreams_sglang.checkpoints /tmp/qwen3-4b --shape qwen3-4b --dtype bfloat16 --device cuda > /dev/null 2>&1
  timeout ${SERVE_TIMEOUT:-370} python3 -m bench.sglang_serving --model /tmp/qwen3-4b --out "$OUT/sglang_serving_${DEVICE_CARD}.json" \
    --configs ${CONFIGS:-kv4rl,stock_bf16} --shapes ${SHAPES:-64x4096,64x8192,128x8192} \
    --decode-tokens ${DECODE_TOKENS:-64} 2>&1 | grep -v "^\[20" | tail -30
fi
ls -la "$OUT"
