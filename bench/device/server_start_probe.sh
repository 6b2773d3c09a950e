#!/bin/bash
# Where a learning server's start goes (bench/NOTES.md, tenth session: 153 s, 90.8 s of it capturing the breakable
# prefill graphs of an 8-layer 74M model). Starts our kv4rl server on a random model of the learning bench's shape
# once per flag set in turn and keeps each log: SGLang's "Engine startup timings" line splits the start.
#   bash bench/device/server_start_probe.sh   (carry .device_sgl; results: $OUT/server_start_*.log)
# PROBE_SETS: flag sets separated by ';', `none` for no extra flag (default: the learning server with
# --max-total-tokens 524288, then without, i.e. a pool of mem fraction 0.3).
source bench/device/bundle.sh || exit 1
OUT=${OUT:-bench/results/check}
mkdir -p "$OUT"
MODEL=/tmp/learning_shape
[ -f $MODEL/config.json ] || python3 -m kvstreams_sglang.checkpoints $MODEL --num-layers 8 --hidden-size 768 \
  --num-heads 8 --num-kv-heads 2 --head-dim 128 --intermediate-size 3072 --dtype bfloat16 > /dev/null || exit 1
IFS=';' read -ra SETS <<< "${PROBE_SETS:---max-total-tokens 524288;none}"
i=0
for extra in "${SETS[@]}"; do
  i=$((i + 1)); log="$OUT/server_start_$i.log"; port=$((31000 + i))
  echo "== $extra" | tee "$log"
  [ "$extra" = none ] && extra=""
  t0=$(date +%s)
  setsid python3 -m kvstreams_sglang.launch_server --model-path $MODEL --port $port --kv4rl --kv4rl-sink 16 \
    --kv4rl-recent 128 --enable-kv-streams --enable-fp32-lm-head --max-running-requests 128 --context-length 8268 \
    --mem-fraction-static 0.3 --skip-tokenizer-init --grammar-backend none $extra >> "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 ${PROBE_WAIT:-200}); do
    grep -q "Uvicorn running\|Traceback" "$log" && break
    sleep 1
  done
  echo "up after $(( $(date +%s) - t0 )) s" | tee -a "$log"
  grep -h "KV Cache is allocated\|startup timings\|CUDA graph end" "$log" | cut -c1-300
  kill -- -$pid; wait $pid 2>/dev/null; sleep 3  # the server's process group: its scheduler too
done
