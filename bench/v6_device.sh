#!/bin/bash
# v6 device run: wheels, the CUDA INT4 kernel's GPU tests, host overhead, then the bench (SHAPES, ALTS).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl_fi/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
[ -n "$DEBUG" ] && timeout 120 python3 -m bench.decode_lse_check 2>&1 | tee $OUT/lse_check.log
timeout ${PYTEST_TIMEOUT:-180} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py -k "${PYTEST_K:-cuda}" 2>&1 | tee $OUT/pytest.log | tail -25
[ -n "$OVERHEAD" ] && python3 -m bench.decode_attention --overhead 2>&1 | tee $OUT/overhead.log
[ -n "$SHAPES" ] && timeout ${BENCH_TIMEOUT:-330} python3 -m bench.decode_attention --shapes "${SHAPES}" --alts "${ALTS}" --out $OUT/${NAME:-v6}.json 2>&1 | tee $OUT/bench.log
[ -n "$FULL" ] && timeout ${FULL_TIMEOUT:-400} python3 -m bench.decode_attention --alts "${ALTS}" --out $OUT/decode_attention_h200.json 2>&1 | tee $OUT/full.log
true
