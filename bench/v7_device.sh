#!/bin/bash
# v7 device run: wheels, the CUDA kernel's GPU tests, then one bench invocation per "SHAPES|ALTS|NAME" group in RUNS
# (newline separated), and with FULL=1 the full table (ALTS) into $OUT/decode_attention_h200.json.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl_fi/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
[ -n "$PYTEST_K" ] && timeout ${PYTEST_TIMEOUT:-180} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py -k "${PYTEST_K}" 2>&1 | tee $OUT/pytest.log | tail -25
i=0
while IFS='|' read -r shapes alts name; do
  [ -z "$shapes" ] && continue
  i=$((i+1))
  timeout ${BENCH_TIMEOUT:-300} python3 -m bench.decode_attention --shapes "$shapes" --alts "$alts" --out $OUT/${name:-v7_$i}.json 2>&1 | tee $OUT/bench_${name:-v7_$i}.log
done <<< "$RUNS"
[ -n "$FULL" ] && timeout ${FULL_TIMEOUT:-420} python3 -m bench.decode_attention --alts "${ALTS}" --out $OUT/decode_attention_h200.json 2>&1 | tee $OUT/full.log
true
