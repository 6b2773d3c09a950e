source bench/device/bundle.sh || exit 1
# One-command H200 check of SGLang 0.5.17 with --kv4rl under CUDA graphs (issue 21), from the repository root:
#   bash bench/device/sglang_gpu_check.sh        (carry .device_sgl: ../shared/device/sglang_bundle.sh builds it;
#                                                 optionally .devcache/jit_cache.tar.xz from an earlier run)
# 1. builds the small random Qwen3 the GPU tests serve (4 layers, hidden 1024, 16 query / 4 KV heads of 128: the
#    CUDA decode kernel's GQA group and head size; bf16);
# 2. pytest tests/test_sglang_gpu.py tests/test_kernels_decode.py -x:
#    - the kv4rl backend's decode steps captured in CUDA graphs as SGLang's runner captures them, replayed with
#      padded batches: bit-identical to the same hooks launched eagerly, the same KV bytes as the eager path, row 0's
#      INT8 entries untouched, outputs within the split layout's rounding of the eager path, the CUDA kernel ran;
#    - a launch_server --kv4rl --enable-kv-streams server: every decode step on a CUDA graph (its log), prefill on
#      the breakable graph, three concurrent streams (a batch padded 3 -> 4), evictions between turns, a weight
#      update from disk without flush (pool untouched, nothing re-prefilled), logprobs against the built-in engine;
#    - the decode kernel tests (CUDA kernel variants, graph plans, captured store + decode replays);
# 3. tars the JIT caches (bench/device/jit_cache.sh) into $OUT/jit_cache.tar.xz (split into < 15 MiB parts if larger:
#    `cat jit_cache.tar.xz.part* > jit_cache.tar.xz`) for later runs to carry as .devcache/jit_cache.tar.xz.
# Results in $OUT (or bench/results/sglang_gpu_check): pytest.log, sglang_gpu_server.log, env.txt, the JIT cache.
set -o pipefail
OUT=${OUT:-bench/results/sglang_gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OUT
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers, sglang; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'sglang', sglang.__version__)"
} 2>&1 | tee "$OUT/env.txt"

MODEL=/tmp/kvstreams_qwen3_small
python3 -m kvstreams_sglang.checkpoints "$MODEL" --num-layers 4 --hidden-size 1024 --num-heads 16 --num-kv-heads 4 \
  --head-dim 128 --dtype bfloat16 --device cuda 2>&1 | tee -a "$OUT/env.txt"
export KVSTREAMS_GPU_MODEL=$MODEL

timeout ${PYTEST_TIMEOUT:-510} python3 -m pytest -q -p no:cacheprovider -rA -s --durations=10 \
  ${KVS_TESTS:-tests/test_sglang_gpu.py tests/test_kernels_decode.py} ${PYTEST_X--x} 2>&1 | tee "$OUT/pytest.log" | tail -60
rc=$?

jit_cache_save "$OUT" && ls -la "$OUT" | tee -a "$OUT/env.txt"
exit $rc
