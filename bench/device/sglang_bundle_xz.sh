#!/usr/bin/env bash
# Shrink the carried SGLang bundle (../shared/device/sglang_bundle.sh's OUT_DIR, default .device_sgl) from ~55 MB
# to ~46 MB: its transformers and tokenizers wheels (tf/*.whl, 14.4 MB of zip) unpacked and packed again as one
# xz tar (tf_site.tar.xz, 5.4 MB), which bench/device/bundle.sh unpacks into /tmp/site as it unpacks site.tar.xz.
# Why: a learning call on TextWorld carries the bundle, TextWorld's wheels (.devenv_tw), the SFT inputs (.devlearn)
# and the tree: 66.1 MB of the 67.1 MB a call may carry, so the JIT cache (.devcache, 4.75 MB; ~3 min of first
# compiles on a fresh machine) did not fit beside them; with this it does (61.8 MB).
# Usage (in the project root, after the shared script):  bash bench/device/sglang_bundle_xz.sh [OUT_DIR=.device_sgl]
set -euo pipefail
out="${1:-.device_sgl}"
py="${PYTHON:-python3}"
compgen -G "$out/tf/*.whl" > /dev/null || { echo "no $out/tf/*.whl: build the bundle first" \
  "(bash ../shared/device/sglang_bundle.sh $out), or it is packed already"; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# a wheel's files are its install (both are pure or abi3, no .data, no scripts needed): pip --target does the same
for f in "$out"/tf/*.whl; do "$py" -m zipfile -e "$f" "$tmp/site"; done
tar -cf - -C "$tmp/site" . | xz -9 -T0 > "$out/tf_site.tar.xz.tmp"
mv "$out/tf_site.tar.xz.tmp" "$out/tf_site.tar.xz" && rm -r "$out/tf"
du -sh "$out"/*.tar.xz
