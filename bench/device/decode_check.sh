#!/bin/bash
# One-command H200 check of the KV4 decode (issues 21 + 23), under 5 minutes with the machine warm:
#   1. the GPU kernel tests: all of tests/test_kernels_decode.py on the GPU (the CUDA kernel's launch variants,
#      per-request split sizes (graph plans) against the float64 reference, the workspace over several layers,
#      CUDA-graph capture + 3 replays of store + decode with the CUDA and the Triton kernel, fused CUDA vs Triton
#      under graphs; the Triton kernel compiled), the BF16 decode, the NVRTC compile checks, the CUDA store kernel
#      (`pytest ... -k cuda` alone selects the CUDA-kernel and CUDA-graph tests);
#   2. timing, in one process: the shipped kernel with an eager plan vs a graph plan (launched eagerly and replayed
#      from a captured CUDA graph) vs FlashInfer BF16 (when installed) at 128x8k, 64x2k and 64x4k, with the v7
#      table's rows (bench/results/decode_attention_h200.json: 128x8k 0.328 ms = 3.00x, 64x2k 0.0657 ms = 2.17x,
#      64x4k 0.111 ms = 2.36x) recorded beside them.
# Run from the repository root: `bash bench/device/decode_check.sh` (results in $OUT, or bench/results/check).
# FlashInfer is optional: carry its wheels in .whl_fi (bench/NOTES.md v3) for the BF16 column; .whl likewise.
set -o pipefail
OUT=${OUT:-bench/results/check}
mkdir -p "$OUT"
wheels=$(ls .whl/*.whl .whl_fi/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null || echo "flashinfer: not installed (ratios against the v7 table's FlashInfer times instead)"
timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --durations=5 \
  tests/test_kernels_decode.py tests/test_kernels_bf16_decode.py 2>&1 | tee -a "$OUT/decode.log" | tail -25
timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --durations=5 \
  tests/test_kernels_store.py -k cuda 2>&1 | tee -a "$OUT/decode.log" | tail -15
timeout ${BENCH_TIMEOUT:-150} python3 -m bench.decode_attention --shapes '128,8192;64,2048;64,4096' --graph \
  --max-context ${MAX_CONTEXT:-32768} --out "$OUT/decode_check_${DEVICE_CARD}.json" 2>&1 | tee -a "$OUT/decode.log"
true
