#!/usr/bin/env bash
# Issue 26: disaggregated RL on one host. SGLang servers (--kv4rl --enable-kv-streams, each on its own GPU) serve the
# rollouts, data parallel (the harness's StreamRouter keeps each stream on one server, GRPO siblings together); an
# FSDP2 trainer runs under torchrun on the other GPUs; weights go trainer rank 0 -> every server over NCCL in one
# group (SGLang's init_weights_update_group / update_weights_from_distributed, flush_cache=False: streams keep their
# KV). From the repository root, with SGLang installed (.[sglang]; on the device: source bench/device/bundle.sh):
#   bash bench/disagg_run.sh 2gpu OUT_DIR [STEPS]   # GPU 0: trainer (1 rank)   GPU 1: one server
#   bash bench/disagg_run.sh 4gpu OUT_DIR [STEPS]   # GPUs 0-1: trainer (2 ranks)   GPUs 2, 3: two servers
# Writes OUT_DIR/metrics.jsonl (per step: rollout_s = generation wait, sync_s = weight broadcast, train_s, tokens,
# sglang_cached_tokens_lost, sglang_streams_opened_server<i>), metrics.png, the server logs and the command lines.
# MODEL=/path serves and trains that checkpoint; else a random Qwen3-4B-shaped one is built. The servers batch turns
# into prefill steps (TURN_BATCH_RATIO, default 0.25: SGLang's --enable-prefill-delayer
# --prefill-delayer-queue-min-ratio; 0 turns it off).
set -euo pipefail
layout=${1:?2gpu or 4gpu}; out=${2:?output dir}; steps=${3:-10}
case $layout in
  2gpu) trainer_gpus=0; server_gpus=(1) ;;
  4gpu) trainer_gpus=0,1; server_gpus=(2 3) ;;
  *) echo "usage: bash bench/disagg_run.sh 2gpu|4gpu OUT_DIR [STEPS]" >&2; exit 2 ;;
esac
mkdir -p "$out"; out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
model=${MODEL:-/tmp/kvstreams_disagg_model}
[ -f "$model/config.json" ] || python3 -m kvstreams_sglang.checkpoints "$model" --shape qwen3-4b \
  --dtype bfloat16 --device cuda > /dev/null

pids=(); urls=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
port=${PORT:-31200}
for g in "${server_gpus[@]}"; do
  cmd=(python3 -m kvstreams_sglang.launch_server --model-path "$model" --kv4rl --enable-kv-streams --port "$port"
       --mem-fraction-static "${MEM_FRACTION:-0.80}" --max-running-requests "${MAX_RUNNING:-128}"
       --grammar-backend none --skip-tokenizer-init --enable-metrics)
  [ "${TURN_BATCH_RATIO:-0.25}" = 0 ] || cmd+=(--enable-prefill-delayer --prefill-delayer-queue-min-ratio
       "${TURN_BATCH_RATIO:-0.25}" --prefill-delayer-max-delay-ms 40)
  echo "CUDA_VISIBLE_DEVICES=$g ${cmd[*]}" >> "$out/commands.txt"
  CUDA_VISIBLE_DEVICES=$g "${cmd[@]}" > "$out/server_gpu$g.log" 2>&1 &
  pids+=($!); urls+=("http://127.0.0.1:$port"); port=$((port + 1))
done
for u in "${urls[@]}"; do  # SGLang's /health answers once the server has captured its graphs and warmed up
  for _ in $(seq 600); do curl -sf "$u/health" > /dev/null && break; sleep 1; done
  curl -sf "$u/health" > /dev/null || { echo "server $u did not come up; see $out/server_gpu*.log" >&2; exit 1; }
done

nproc=$(echo "$trainer_gpus" | tr ',' '\n' | wc -l)
url_list=$(IFS=,; echo "${urls[*]}")
run=${RUN_DIR:-/tmp/kvstreams_disagg_run}
rm -rf "$run"
trainer=(python3 -m torch.distributed.run --nproc-per-node "$nproc" -m harness.run configs/textworld/sliding_window.toml
  --model.path "$model" --inference.engine sglang --inference.url "$url_list" --inference.kv_dtype kv4rl
  --inference.weight_sync distributed --inference.device cuda:0
  --environment.options '{presets = ["short"], n_train = 64, n_eval = 0, max_steps = 100}'
  --compaction.window_turns 4 --compaction.budget 8192 --orchestrator.group_size 8
  --orchestrator.groups_per_step "${GROUPS_PER_STEP:-4}" --orchestrator.episode.max_turns 12
  --orchestrator.episode.max_new_tokens 24 --trainer.micro_batch_records 4
  --run.steps "$steps" --run.checkpoint_every "$steps" --run.output_dir "$run")
echo "CUDA_VISIBLE_DEVICES=$trainer_gpus ${trainer[*]}" >> "$out/commands.txt"
set +e
CUDA_VISIBLE_DEVICES=$trainer_gpus timeout "${TIMEOUT:-1800}" "${trainer[@]}" 2>&1 \
  | grep -v "Loading weights\|Writing model" | tee "$out/trainer.log"
rc=${PIPESTATUS[0]}
set -e
cp "$run/metrics.jsonl" "$run/metrics.png" "$out/" 2>/dev/null || true
exit "$rc"
