#!/usr/bin/env bash
# Issue 12: FSDP2 trainer on GPUs 0-1 (torchrun, 2 ranks, bf16 compute, sharded params + AdamW
# state), the built-in engine with kv4rl KV on GPU 1 (colocated with trainer rank 1, owned by
# rank 0's process), TextWorld Sliding Window in kv-streams execution, a Qwen3-1.7B-shaped model
# (random weights, byte tokenizer), weights pushed to the engine after every step without
# flushing KV. Usage: bench/multi_gpu_run.sh OUT_DIR [STEPS]
set -euo pipefail
out=${1:?output dir}; steps=${2:-20}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
run=${RUN_DIR:-/tmp/multi_gpu_run}
rm -rf "$run"
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader -l 5 > "$out/nvidia_smi.csv" &
smi=$!
set +e
timeout "${TIMEOUT:-540}" python3 -m torch.distributed.run --nproc-per-node 2 -m harness.run \
  configs/textworld/sliding_window.toml \
  --model.tiny.num_layers 28 --model.tiny.hidden_size 2048 --model.tiny.num_heads 16 \
  --model.tiny.num_kv_heads 8 --model.tiny.head_dim 128 --model.tiny.intermediate_size 6144 \
  --inference.kv_dtype kv4rl --inference.device cuda:1 --inference.kv_slots 262144 --inference.max_streams 128 \
  --environment.options '{presets = ["short"], n_train = 32, n_eval = 0, max_steps = 100}' \
  --compaction.window_turns 4 --compaction.budget 8192 \
  --orchestrator.group_size 8 --orchestrator.groups_per_step 2 --orchestrator.episode.max_turns 10 \
  --orchestrator.episode.max_new_tokens 16 --trainer.micro_batch_records 4 \
  --run.steps "$steps" --run.checkpoint_every "$steps" --run.output_dir "$run" 2>&1 | grep -v "Loading weights\|Writing model" | tee "$out/log.txt"
rc=${PIPESTATUS[0]}
kill $smi
cp "$run/metrics.jsonl" "$run/metrics.png" "$out/" 2>/dev/null
exit "$rc"
