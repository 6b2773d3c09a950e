# Source from the repository root on the GPU device. The JIT compilers' caches, carried between machines:
#   jit_cache_restore      unpacks a carried .devcache/jit_cache.tar.xz into $HOME, once per machine
#   jit_cache_save DIR     tars this machine's caches into DIR/jit_cache.tar.xz (parts of < 15 MiB if larger:
#                          `cat jit_cache.tar.xz.part* > jit_cache.tar.xz`), to carry as .devcache/jit_cache.tar.xz
# What is cached: Triton's kernels (ours, SGLang's), FlashInfer's, and sgl-kernel's JIT kernels built by nvcc through
# tvm-ffi (~/.cache/tvm-ffi: norms, RoPE, activation per shape). On a fresh H200 these made a learning server's
# first start take 123 s (78 s "capturing" the prefill graphs) against 42 s (3 s) for the next one (2026-12-05).
jit_cache_restore() {  # JIT_RESTORED: the machine's mark that it was done
  local mark=${JIT_RESTORED:-/tmp/.jit_restored}
  if [ -f .devcache/jit_cache.tar.xz ] && [ ! -f "$mark" ]; then
    tar -xJf .devcache/jit_cache.tar.xz -C "$HOME" && touch "$mark" && echo "JIT cache restored"
  fi
}

jit_cache_save() {
  local out=$1 d dirs=()
  for d in "$HOME/.cache/tvm-ffi" "$HOME/.cache/flashinfer" "${TRITON_CACHE_DIR:-$HOME/.triton/cache}"; do
    [ -d "$d" ] && dirs+=("${d#"$HOME"/}")
  done
  [ ${#dirs[@]} -gt 0 ] || return 0
  # xz -9: the cache travels back beside the 46 MB SGLang bundle (64 MiB a call); -1 made it 2.7x larger
  tar -cf - -C "$HOME" "${dirs[@]}" | xz -9 -T0 > "$out/jit_cache.tar.xz"
  if [ "$(stat -c %s "$out/jit_cache.tar.xz")" -gt $((15 * 1024 * 1024)) ]; then
    split -b 15M -d "$out/jit_cache.tar.xz" "$out/jit_cache.tar.xz.part" && rm "$out/jit_cache.tar.xz"
  fi
}
