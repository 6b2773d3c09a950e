#!/bin/bash
# Issue 21 on the H200, one command (under 10 minutes): the serving table first (bench/sglang_serving.py: ours
# --kv4rl --enable-kv-streams against stock SGLang with bf16 KV (and fp8 with CONFIGS=...), the same requests and
# memory fraction; kv4rl first, it needs no FlashInfer JIT), then tests/test_sglang_gpu.py (the kv4rl server under CUDA
# graphs against the built-in engine, and the harness training 3 steps against it), then the JIT caches tarred into
# $OUT for the next run (.devcache/jit_cache.tar.xz).
#   bash bench/device/serving_check.sh      (carry .device_sgl, and .devcache if an earlier run made one)
source bench/device/bundle.sh || exit 1
OUT=${OUT:-bench/results/check}
export OUT
python3 -m kvstreams_sglang.checkpoints /tmp/qwen3-4b --shape qwen3-4b --dtype bfloat16 --device cuda > /dev/null 2>&1
timeout ${SERVE_TIMEOUT:-370} python3 -m bench.sglang_serving --model /tmp/qwen3-4b --out "$OUT/sglang_serving_h200.json" \
  --configs ${CONFIGS:-kv4rl,stock_bf16} --shapes ${SHAPES:-64x4096,64x8192,128x8192} \
  --decode-tokens ${DECODE_TOKENS:-64} 2>&1 | grep -v "^\[20" | tail -30
KVS_TESTS="tests/test_sglang_gpu.py::test_sglang_gpu_server_kv4rl_graphs_match_builtin_engine tests/test_sglang_gpu.py::test_sglang_gpu_harness_trains_three_steps_against_the_server" PYTEST_X= PYTEST_TIMEOUT=${SGL_TIMEOUT:-170} bash bench/device/sglang_gpu_check.sh
ls -la "$OUT"
