# Source from the repository root on the GPU device: unpacks the carried SGLang 0.5.17 bundle (.device_sgl, built by
# ../shared/device/sglang_bundle.sh) into /tmp/site once, and puts it and the repository on PYTHONPATH. A JIT cache
# from an earlier run (.devcache/jit_cache.tar.xz: FlashInfer's and Triton's) is restored into $HOME if carried.
if [ ! -d /tmp/site/sglang ]; then
  [ -f .device_sgl/site.tar.xz ] || { echo "sglang bundle missing: carry .device_sgl (../shared/device/sglang_bundle.sh)"; return 1; }
  mkdir -p /tmp/site && tar -xJf .device_sgl/site.tar.xz -C /tmp/site || return 1
  if [ -f .device_sgl/tf_site.tar.xz ]; then  # its transformers/tokenizers repacked (bench/device/sglang_bundle_xz.sh)
    tar -xJf .device_sgl/tf_site.tar.xz -C /tmp/site || return 1
  else
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .device_sgl/tf/*.whl || return 1
  fi
fi
# diagnostic tools carried as wheels (.devtools, bench/device/tools_bundle.sh: py-spy), once per machine
if compgen -G ".devtools/*.whl" > /dev/null && [ ! -f /tmp/site/.devtools_installed ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .devtools/*.whl && \
    touch /tmp/site/.devtools_installed
fi
source bench/device/jit_cache.sh && jit_cache_restore
source bench/device/card.sh
# stand-ins for what the bundle leaves out and SGLang imports at start-up (bench/device/stubs/*: why, in each)
export PYTHONPATH=/tmp/site:$PWD/bench/device/stubs:$PWD PYTHONUNBUFFERED=1
