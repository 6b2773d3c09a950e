#!/bin/bash
# SWE end to end on the H200 (issue 24), from the repository root; carry .devenv and .devswe (built here by
# bench/device/env_bundle.sh and bench/device/swe_bundle.sh):
#   OUT=$OUT bash bench/device/swe_check.sh
# First the sandbox: bubblewrap, patch (from .devswe/debs where the image lacks them) and git must run, and bwrap
# must be able to create its namespaces in the device's container; if not, one line says which and the script exits 3.
# Then `python -m bench.swe_e2e` with configs/swe/gpu_small.toml (3 GRPO steps, Sliding Window + KV-streams + kv4rl,
# a random ~20M Qwen3 on the built-in engine) on the carried task set. Results: $OUT/swe_e2e_CARD.json (rewards and
# the time split per step), the log, metrics.jsonl.
set -o pipefail
OUT=${OUT:-bench/results/check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source bench/device/envsite.sh || exit 1
[ -f .devswe/data/instances.jsonl ] || { echo "SWE task set missing: bash bench/device/swe_bundle.sh, carry .devswe"; exit 1; }
for tool in bwrap:bubblewrap patch:patch; do  # unpack a carried package where the command is missing
  command -v "${tool%%:*}" >/dev/null && continue
  for deb in .devswe/debs/${tool#*:}_*.deb; do dpkg -x "$deb" / && echo "unpacked $deb"; done
done
for lib in libcap2 libselinux1 libpcre2-8-0; do
  ldconfig -p | grep -q "${lib%%[0-9-]*}" || { dpkg -x .devswe/debs/${lib}_*.deb / && echo "unpacked $lib"; }
done
ldconfig 2>/dev/null
missing=$(for t in bwrap git patch setpriv unshare; do command -v $t >/dev/null || echo -n "$t "; done)
[ -z "$missing" ] || { echo "SWE on this device: blocked: missing $missing(not in the image, not carried)"; exit 3; }
# the jail exactly as the environment builds it (as root: setpriv drops to nobody, which needs the capability
# bounding set to be writable; 2026-12-03's device container refused it: "setpriv: apply bounding set")
probe=$(${PYTHON:-python3} -c "from envs.swe.sandbox import require_bwrap; require_bwrap()" 2>&1) || {
  echo "SWE on this device: blocked: $(echo "$probe" | tail -1)"; exit 3; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 540 ${PYTHON:-python3} -m bench.swe_e2e --config configs/swe/gpu_small.toml --data .devswe/data \
  --out-dir /tmp/swe_e2e --json "$OUT/swe_e2e_${DEVICE_CARD}.json" $SWE_ARGS 2>&1 | tee "$OUT/swe_e2e.log"
rc=$?
cp /tmp/swe_e2e/metrics.jsonl /tmp/swe_e2e/metrics.png "$OUT/" 2>/dev/null
exit $rc
