#!/bin/bash
# H200 runs of the SGLang rollout bench (issue 22), from the repository root; one device call each (< 10 min):
#   bash bench/device/rollout_check.sh stock   # configs 1-2 (stock bf16, stock fp8; re-prefill), SW + Markovian
#   bash bench/device/rollout_check.sh ours    # configs 3-5 (ours bf16 / kv4rl KV-streams, kv4rl full context)
#   bash bench/device/rollout_check.sh quick   # stock bf16 and ours kv4rl, Sliding Window only
#   bash bench/device/rollout_check.sh concentration  # waves vs refill, long-tailed episodes, one server
#     (CONC_ARGS="--conc-episodes 64 --conc-timeout 100": bench.rollout_sglang's --conc-* options, for a short call)
# CONFIGS=a,b and STRATEGIES=x,y override a mode's lists; PREFILL_GRAPH=disabled runs every server's prefill eagerly;
# TURN_BATCHING=0.25 (TURN_BATCH_MS=30) holds prefills back on every server (bench.rollout_sglang --turn-batching:
# SGLang's prefill delayer, stock and ours alike since 2026-12-05; ours ran its own copy of the rule before).
# GAMES=long (LONG_TURNS=30,60): longer games than the recorded ones; KVSTREAMS_SYNC_REPORT=1: our servers log every
# call stack that makes the scheduler wait for the GPU (kvstreams_sglang/sglang_ext/sync_report.py; in server_logs).
# CHECK_GRAPHS=1: the decode graph-step test first, falling back to op-by-op planning if it fails (below; ~1 min:
# give the rollouts ROLLOUT_TIMEOUT=420 to stay within one call).
# then, here: python -m bench.rollout_sglang merge stock.json ours.json --out bench/results/rollout_sglang_CARD.json
# (the same episode list and seed in both calls; the merge refuses parts run with other settings).
# What the first run taught (2026-12-02, bench/results/rollout_sglang_h200.json):
# - a fresh machine spends ~150 s of stock's start-up in FlashInfer's JIT (fp8 KV has its own kernels), and every
#   server start pays ~26 s of imports and ~20-60 s of CUDA-graph capture: budget ~300 s for the first stock server,
#   ~90 s for the others; the JIT cache comes back as $OUT/jit_cache.tar.xz (carry it as .devcache/jit_cache.tar.xz:
#   bench/device/bundle.sh restores it);
# - the first ~10 s of a server's traffic still compiles kernels: --warmup 15;
# - (2026-12-03) turn batching decides ours vs stock on these episodes: TURN_BATCHING=0.25 TURN_BATCH_MS=40 gave ours
#   kv4rl 1.22x stock (rollout_sglang_h200.json), 0.5/60 1.46x, none 0.85x; with the JIT cache carried a server
#   starts in 60-110 s;
# - OURS_PREFILL_GRAPH=full captures our servers' whole prefill steps (attention included); stock keeps its default.
#   2026-12-04: 2.12x stock bf16 on long games; 37 of 407 prefill steps ran eagerly (over SGLang's 16 request slots):
#   OURS_PREFILL_SLOTS=64 captures 64 slots per graph (--cuda-graph-config ...full_prefill_max_req; not yet measured).
# - OURS_ROWS=128 gives the kv4rl servers 128 request rows (each holds an INT8 side row, 10.8 MB at the 4B shape, out
#   of the KV memory: 257 rows took 2.6 of the 9 GiB in the long-games runs, whose ours admitted 58 episodes).
# - (2026-12-05, an H100) a fixed --mem-fraction 0.12 left 13k-token pools beside the 8 GiB of weights on an 80 GB
#   card: the bench now sizes every server's static memory in GiB (--static-gib 16.8, 0.12 of an H200; STATIC_GIB=,
#   or MEM_FRACTION= for a fixed fraction). OURS_ROWS=128, long games: ours kv4rl 2.14x stock bf16 in episodes/s and
#   2.13x in output tokens/s, 1.46x / 1.80x stock fp8 (bench/results/rollout_sglang_long_games_h100.json). A 15 s window
#   completes only 15-40 long episodes (the ratio's 95% interval was 0.93-5.83x), so DURATION is now 45 s by default;
#   the output-token ratio (same episode list everywhere) is the steadier measure and is printed beside.
# - PROFILE=40 records 40 steps of each server with SGLang's torch profiler, summarised into the JSON (bench.trace_summary).
# - PYSPY=1 samples each PROFILE_CONFIGS server's scheduler and the bench's client with py-spy over the window (the
#   Python between steps: bench.pyspy); carry .devtools (bash bench/device/tools_bundle.sh .devtools, ~3 MB).
# - (2026-12-06, an H100) the strategies now compact as configs/textworld/STRATEGY.toml (Sliding Window: 10 live
#   turns, the paper's; 4 before): GAMES=long OURS_ROWS=128 OURS_PREFILL_GRAPH=full TURN_BATCHING=0.25 TURN_BATCH_MS=40
#   gave ours kv4rl 4.08x stock bf16 (3.92x in output tokens), ours bf16 2.84x (rollout_sglang_paper_window_h100.json);
#   a fresh machine's stock server took 280 s to come up (FlashInfer's JIT): budget ROLLOUT_TIMEOUT=540 for two configs.
# Needs the SGLang bundle at .device_sgl (bash ../shared/device/sglang_bundle.sh .device_sgl; carry .device_sgl).
set -o pipefail
OUT=${OUT:-bench/results/check}
MODE=${1:-quick}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source bench/device/bundle.sh || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
# CHECK_GRAPHS=1: first the decode graph-step test (~1 min: each batch size's captured planning and step replayed
# against the eager hooks, bit for bit); if it fails, our servers plan every step op by op (KVSTREAMS_PLAN_GRAPH=0,
# recorded per server in the JSON's servers.*.kvstreams_env) and the rollouts still run. Its log: $OUT/graph_check.log.
if [ "${CHECK_GRAPHS:-0}" = 1 ]; then
  if timeout 170 python3 -m pytest -q -p no:cacheprovider -s \
      tests/test_sglang_gpu.py::test_sglang_gpu_graph_steps_match_eager > "$OUT/graph_check.log" 2>&1 \
      && grep -q "1 passed" "$OUT/graph_check.log"; then  # (a skip is no check)
    echo "graph check passed (KVSTREAMS_PLAN_GRAPH=${KVSTREAMS_PLAN_GRAPH:-1})"
  else
    tail -20 "$OUT/graph_check.log"
    echo "graph check failed: the rollouts run with KVSTREAMS_PLAN_GRAPH=0"
    export KVSTREAMS_PLAN_GRAPH=0
  fi
fi
MODEL=/tmp/qwen3-4b
[ -f $MODEL/config.json ] || python3 -m kvstreams_sglang.checkpoints $MODEL --shape qwen3-4b --dtype bfloat16 \
  --device cuda > /dev/null || exit 1
COMMON="--model $MODEL --warmup ${WARMUP:-15} --duration ${DURATION:-45} --min-duration ${DURATION:-45} --budget-s 5000
  --games ${GAMES:-recorded} --long-turns ${LONG_TURNS:-30,60} --prefill-graph ${PREFILL_GRAPH:-default} ${OURS_PREFILL_GRAPH:+--ours-prefill-graph $OURS_PREFILL_GRAPH} ${OURS_PREFILL_SLOTS:+--ours-prefill-graph-slots $OURS_PREFILL_SLOTS} ${OURS_ROWS:+--ours-max-running-requests $OURS_ROWS} ${MEM_FRACTION:+--mem-fraction $MEM_FRACTION} ${STATIC_GIB:+--static-gib $STATIC_GIB} --turn-batching ${TURN_BATCHING:-0} --turn-batch-max-delay-ms ${TURN_BATCH_MS:-30}
  --profile-steps ${PROFILE:-0} --profile-configs ${PROFILE_CONFIGS:-stock_bf16,streams_kv4rl} ${PYSPY:+--pyspy}"
LIMIT=${ROLLOUT_TIMEOUT:-540}
case $MODE in
  quick) timeout $LIMIT python3 -m bench.rollout_sglang $COMMON --configs ${CONFIGS:-stock_bf16,streams_kv4rl} \
    --strategies ${STRATEGIES:-sliding_window} --out "$OUT/rollout_sglang_quick_${DEVICE_CARD}.json" ;;
  stock) timeout $LIMIT python3 -m bench.rollout_sglang $COMMON --configs ${CONFIGS:-stock_bf16,stock_fp8} \
    --strategies ${STRATEGIES:-sliding_window,markovian_thinker} --out "$OUT/rollout_sglang_stock_${DEVICE_CARD}.json" ;;
  ours) timeout $LIMIT python3 -m bench.rollout_sglang $COMMON --configs ${CONFIGS:-streams_bf16,streams_kv4rl,kv4rl_full} \
    --strategies ${STRATEGIES:-sliding_window,markovian_thinker} --out "$OUT/rollout_sglang_ours_${DEVICE_CARD}.json" ;;
  concentration) timeout $LIMIT python3 -m bench.rollout_sglang --model $MODEL --study concentration ${CONC_ARGS:-} \
    --out "$OUT/kv_concentration_sglang_${DEVICE_CARD}.json" ;;
  *) echo "usage: bash bench/device/rollout_check.sh [quick|stock|ours|concentration]"; exit 2 ;;
esac
rc=$?
[ -d "$OUT/logs" ] && tar -cJf "$OUT/server_logs.tar.xz" -C "$OUT/logs" . && rm -rf "$OUT/logs"
rm -rf "$OUT/profiles"  # summarised into the JSON; the traces are too large to bring back
jit_cache_save "$OUT"
exit $rc
