# Source from the repository root on the GPU device: installs the carried environment wheels (.devenv, built here
# by bench/device/env_bundle.sh: pydantic, transformers 5.12.1, TextWorld, ALFWorld, ...) into /tmp/envsite once
# per machine (ENV_BUNDLE: another bundle folder, e.g. env_bundle.sh's TextWorld-only one), restores the carried JIT
# caches (bench/device/jit_cache.sh), and exports the paths.
if [ ! -f /tmp/envsite/.installed ]; then
  [ -d "${ENV_BUNDLE:-.devenv}/whl" ] || { echo "environments missing: bash bench/device/env_bundle.sh, then carry ${ENV_BUNDLE:-.devenv}"; return 1; }
  ${PYTHON:-python3} -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/envsite "${ENV_BUNDLE:-.devenv}"/whl/*.whl \
    && touch /tmp/envsite/.installed || return 1
fi
source bench/device/jit_cache.sh && jit_cache_restore
source bench/device/card.sh
export PYTHONPATH=/tmp/envsite:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
