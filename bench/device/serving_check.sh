#!/bin/bash
# Issue 21 on the H200, one command (under 10 minutes): the kv4rl server under CUDA graphs against the built-in
# engine (tests/test_sglang_gpu.py), then the serving table (bench/sglang_serving.py: ours --kv4rl, stock bf16 and
# stock fp8 KV, the same requests and memory fraction; kv4rl first, it needs no FlashInfer JIT), then the JIT caches
# tarred into $OUT for the next run (.devcache/jit_cache.tar.xz).
#   bash bench/device/serving_check.sh      (carry .device_sgl, and .devcache if an earlier run made one)
source bench/device/bundle.sh || exit 1
OUT=${OUT:-bench/results/check}
export OUT
KVS_TESTS=tests/test_sglang_gpu.py PYTEST_TIMEOUT=${SGL_TIMEOUT:-200} bash bench/device/sglang_gpu_check.sh
python3 -m kvstreams_sglang.checkpoints /tmp/qwen3-4b --shape qwen3-4b --dtype bfloat16 --device cuda > /dev/null 2>&1
timeout ${SERVE_TIMEOUT:-330} python3 -m bench.sglang_serving --model /tmp/qwen3-4b --out "$OUT/sglang_serving_h200.json" \
  --configs ${CONFIGS:-kv4rl,stock_bf16,stock_fp8} --shapes ${SHAPES:-64x4096,64x8192,128x8192} \
  --decode-tokens ${DECODE_TOKENS:-128} 2>&1 | grep -v "^\[20" | tail -40
dirs=()
for d in .cache/flashinfer .triton/cache; do [ -d "$HOME/$d" ] && dirs+=("$d"); done
[ ${#dirs[@]} -gt 0 ] && tar -cf - -C "$HOME" "${dirs[@]}" | xz -6 -T0 > "$OUT/jit_cache.tar.xz"
ls -la "$OUT"
