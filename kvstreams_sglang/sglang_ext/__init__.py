"""KV-streams and KV4-RL inside SGLang (``sglang==0.5.17``), by subclassing and patching.

Nothing of SGLang is vendored. The pieces:

- ``server_args.KVStreamsServerArgs``: ``--kv4rl [--kv4rl-sink --kv4rl-recent]`` and
  ``--enable-kv-streams`` on top of SGLang's ``ServerArgs``, with their validation.
- ``stream_cache.KVStreamRadixCache``: the ``kvstreams`` radix cache backend. A KV stream is a
  streaming session whose tokens live in the radix tree: its shared prefix (the episode's first
  message) is shared with its GRPO siblings, the rest is a private tagged branch, evicted in place
  by span and by the cache's policy only whole.
- ``sessions``: a stream's SGLang session (its token arrays) and the checks a turn passes.
- ``side_rows.SideRows``: kv4rl's INT8 side row of a stream between turns.
- ``pool.KV4TokenToKVPool``: SGLang's MHA token pool holding KV4-RL bytes (INT4 + INT8 side).
- ``backend.KV4RLAttnBackend``: the ``kv4rl`` attention backend (our kernels / their references).
- ``hf_numerics``: ``--hf-numerics``, the model's norms, RoPE, activation and merged projections
  rounded as Hugging Face transformers rounds them (the built-in engine's and the trainer's numerics).
- ``patches.install``: the hooks SGLang has no extension point for, installed inside the
  scheduler process by ``scheduler.run_scheduler_process``.
- ``engine.KVStreamsEngine`` (offline) and ``kvstreams_sglang.launch_server`` (HTTP).
- ``client.SGLangClient`` (sessions, in place) and ``plain_client.PlainClient`` (a stock server: the whole context
  every turn, ``execution = "reprefill"``): the agent loop's ``EngineClient`` over HTTP.

Importing this package does not import SGLang; the modules above do.
"""

# The abort message of a turn whose stream the cache evicted (its ``meta_info.finish_reason`` is
# ``{"type": "abort", "message": STREAM_EVICTED + ..., "status_code": 409}``): the client restores the
# stream from its ledger and sends the turn again.
STREAM_EVICTED = "kvstreams: stream evicted"
