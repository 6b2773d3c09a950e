#!/bin/bash
# Here, once: the diagnostic tools the device image lacks, as wheels to carry (~3 MB): py-spy (bench.pyspy samples the
# SGLang schedulers' Python stacks in the rollout bench, PYSPY=1 bash bench/device/rollout_check.sh ...).
#   bash bench/device/tools_bundle.sh .devtools      # then carry .devtools beside .device_sgl
# bench/device/bundle.sh installs every wheel in .devtools into /tmp/site (its scripts into /tmp/site/bin).
set -euo pipefail
OUT=${1:-.devtools}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.12 \
  -d "$OUT" py-spy
ls -la "$OUT"
