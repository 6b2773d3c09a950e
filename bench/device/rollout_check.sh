#!/bin/bash
# One-command H200 run of the SGLang rollout bench (issue 22), from the repository root:
#   bash bench/device/rollout_check.sh quick          # ~3 min warm (+2-4 min of JIT on a fresh machine): configs 1, 4
#   bash bench/device/rollout_check.sh full           # < 9.5 min: 5 servers x (Sliding Window, Markovian Thinker, Summary)
#   bash bench/device/rollout_check.sh concentration  # ~3.5 min: waves vs refill, long-tailed episodes, one server
# Needs the SGLang bundle at .device_sgl (bash ../shared/device/sglang_bundle.sh .device_sgl; carry .device_sgl).
# A fresh machine compiles FlashInfer's kernels on first use (2-4 min; fp8 KV has its own) and our Triton kernels:
# both caches come back as $OUT/jit_cache.tar.xz; carry it as .devcache/jit_cache.tar.xz (bench/device/bundle.sh
# unpacks it before the servers start; on a fresh machine run `quick` first, then `full` with the cache carried).
# Results in $OUT (or bench/results/check): the JSON, its PNG and the servers' logs (server_logs.tar.xz).
set -o pipefail
OUT=${OUT:-bench/results/check}
MODE=${1:-full}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source bench/device/bundle.sh || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
MODEL=/tmp/qwen3-4b
[ -f $MODEL/config.json ] || python3 -m kvstreams_sglang.checkpoints $MODEL --shape qwen3-4b --dtype bfloat16 \
  --device cuda > /dev/null || exit 1
case $MODE in
  quick) timeout ${ROLLOUT_TIMEOUT:-420} python3 -m bench.rollout_sglang --model $MODEL --quick --out "$OUT/rollout_sglang_quick_h200.json" ;;
  full) timeout ${ROLLOUT_TIMEOUT:-530} python3 -m bench.rollout_sglang --model $MODEL --out "$OUT/rollout_sglang_h200.json" ;;
  concentration) timeout 400 python3 -m bench.rollout_sglang --model $MODEL --study concentration \
    --out "$OUT/kv_concentration_sglang_h200.json" ;;
  *) echo "usage: bash bench/device/rollout_check.sh [quick|full|concentration]"; exit 2 ;;
esac
rc=$?
[ -d "$OUT/logs" ] && tar -cJf "$OUT/server_logs.tar.xz" -C "$OUT/logs" . && rm -rf "$OUT/logs"
(cd ~ && ls -d .cache/flashinfer .triton/cache 2>/dev/null | xargs -r tar -cJf "$OUT/jit_cache.tar.xz")
exit $rc
