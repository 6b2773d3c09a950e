#!/usr/bin/env bash
# Build the carry-able environments for the learning bench on the GPU device (Python 3.12, torch 2.11, no registry
# there): TextWorld, ALFWorld and what the harness needs beyond the device image, plus the ALFWorld game archive.
# Usage (in the project root, on your machine):  bash bench/device/env_bundle.sh [OUT_DIR=.devenv] [all|textworld|alfworld]
# `textworld`: TextWorld's wheels alone (~5 MB; no ALFWorld, no transformers/tokenizers/pydantic, which the SGLang
# bundle carries), to carry beside .device_sgl (46 MB, bench/device/sglang_bundle_xz.sh) in one call: ENV_BUNDLE=OUT_DIR
# LEARNING_ENGINE=sglang bash bench/device/learning_check.sh textworld does SFT and the runs on one carry.
# `alfworld`: the same for ALFWorld (its wheels and games, ~10 MB): ENV_BUNDLE=OUT_DIR LEARNING_ENGINE=sglang
# bash bench/device/learning_check.sh alfworld, carrying .device_sgl, OUT_DIR and .devlearn.
# Produces OUT_DIR/whl/*.whl and OUT_DIR/alfworld-json_2.1.1-solvable.tar.xz (~28 MB together; the device's carry
# limit is 64 MiB a call). OUT_DIR is ignored by git (.gitignore); carry it: bench/device/learning_check.sh installs
# the wheels into /tmp/envsite once per machine. ALFWORLD_ARCHIVE: the archive, if not at ../shared/data/alfworld.
# Why these are enough: textworld's wheel is py3-none-manylinux (Inform 7 and Glulx binaries, no CPython
# extension); jericho and fast-downward-textworld are sdists on PyPI whose builds are pure Python around a ctypes
# library (libfrotz.so, libdownward.so: no CPython ABI), so a wheel built here runs under the device's 3.12;
# alfworld, tatsu, hashids, mementos, more-itertools, termcolor, prompt-toolkit, wcwidth are pure Python; spacy
# (jericho's declared need) is imported only by jericho helpers the games never call. pydantic (+ core, cp312) is
# not on the image (typing-extensions >= 4.14 comes along: pydantic-core imports its Sentinel); transformers 5.12.1 / tokenizers 0.22.2 are the versions the project is tested with (the
# image has 5.17 / 0.23). numpy, networkx, tqdm, rich, matplotlib, torch come from the image.
set -euo pipefail
out="${1:-.devenv}"
what="${2:-all}"
py="${PYTHON:-python3}"
mkdir -p "$out/whl"
download=("$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d "$out/whl")
if [ "$what" = textworld ]; then  # TextWorld's own needs (fast-downward is ALFWorld's PDDL planner: left out)
  "${download[@]}" typing-extensions==4.16.0 textworld==1.7.0 tatsu==5.8.3 hashids==1.3.1 mementos==1.3.1 \
    more-itertools==11.2.1 termcolor==3.3.0
  "$py" -m pip wheel -q --no-deps -w "$out/whl" jericho==3.3.1
  du -sh "$out"/whl
  exit 0
fi
# sdists: built here (pip's wheel cache answers when `make setup` built them already). fast-downward-textworld's
# build calls a bare `python`: the interpreter's own folder goes first on PATH. Its library loses its debug info
# (bench/device/strip_wheel.py: 12 MB of wheel -> ~0.5 MB).
build_sdists() {
  PATH="$(dirname "$(command -v "$py")"):$PATH" "$py" -m pip wheel -q --no-deps -w "$out/whl" "$@"
  for w in "$out"/whl/fast_downward_textworld-*.whl; do [ -f "$w" ] && "$py" "$(dirname "$0")/strip_wheel.py" "$w"; done
  return 0
}
archive="${ALFWORLD_ARCHIVE:-$(cd "$(dirname "$0")/../.." && pwd)/../shared/data/alfworld/alfworld-json_2.1.1-solvable.tar.xz}"
if [ "$what" = alfworld ]; then  # ALFWorld's own needs and its games (pydantic, transformers, tokenizers,
  # prompt-toolkit and wcwidth come with the SGLang bundle): ~10 MB, to carry beside .device_sgl in one call
  "${download[@]}" typing-extensions==4.16.0 textworld==1.7.0 alfworld==0.4.2 tatsu==5.8.3 hashids==1.3.1 \
    mementos==1.3.1 more-itertools==11.2.1 termcolor==3.3.0
  build_sdists jericho==3.3.1 fast-downward-textworld==20.6.4
  cp "$archive" "$out/"
  du -sh "$out"/whl "$out"/*.tar.xz
  exit 0
fi
[ "$what" = all ] || { echo "usage: bash bench/device/env_bundle.sh [OUT_DIR] [all|textworld|alfworld]"; exit 2; }
"${download[@]}" pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
  transformers==5.12.1 tokenizers==0.22.2 \
  textworld==1.7.0 alfworld==0.4.2 tatsu==5.8.3 hashids==1.3.1 mementos==1.3.1 more-itertools==11.2.1 \
  termcolor==3.3.0 prompt-toolkit==3.0.53 wcwidth==0.9.4
build_sdists jericho==3.3.1 fast-downward-textworld==20.6.4
cp "$archive" "$out/"
du -sh "$out"/whl "$out"/*.tar.xz
