#!/usr/bin/env bash
# Build what the SWE end-to-end run (issue 24, bench/device/swe_check.sh) needs on the GPU device, which has no
# registry: a small offline task set (2 libraries x 8 instances, ~2.5 MB, ~2 min here) and the sandbox's system
# tools as Debian packages (bubblewrap and its libraries, patch; ~0.3 MB), unpacked there only where missing.
# Usage (project root, on your machine):  bash bench/device/swe_bundle.sh [OUT_DIR=.devswe]; then carry OUT_DIR with
# .devenv (together ~26 MB). Needs `make setup` here (the project venv) and apt-get.
set -euo pipefail
out="${1:-.devswe}"
py="${PYTHON:-.venv/bin/python}"
mkdir -p "$out/debs"
[ -f "$out/data/instances.jsonl" ] || "$py" -m envs.swe.build --libs toolz,cachetools --per-lib 8 \
  --max-per-function 2 --out "$out/data"
# git is not carried (its dependencies are most of perl and curl): swe_check.sh says so if the device lacks it
(cd "$out/debs" && apt-get download -q bubblewrap libcap2 libselinux1 libpcre2-8-0 patch)
du -sh "$out"
