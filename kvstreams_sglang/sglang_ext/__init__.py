"""KV-streams and KV4-RL inside SGLang (``sglang==0.5.17``), by subclassing and patching.

Nothing of SGLang is vendored. The pieces:

- ``server_args.KVStreamsServerArgs``: ``--kv4rl [--kv4rl-sink --kv4rl-recent]`` and
  ``--enable-kv-streams`` on top of SGLang's ``ServerArgs``, with their validation.
- ``pool.KV4TokenToKVPool``: SGLang's MHA token pool holding KV4-RL bytes (INT4 + INT8 side).
- ``backend.KV4RLAttnBackend``: the ``kv4rl`` attention backend (our kernels / their references).
- ``sessions``: in-place eviction of a streaming session's spans, and its position offset.
- ``patches.install``: the hooks SGLang has no extension point for, installed inside the
  scheduler process by ``scheduler.run_scheduler_process``.
- ``engine.KVStreamsEngine`` (offline) and ``kvstreams_sglang.launch_server`` (HTTP).
- ``client.SGLangClient`` (sessions, in place) and ``plain_client.PlainClient`` (a stock server: the whole context
  every turn, ``execution = "reprefill"``): the agent loop's ``EngineClient`` over HTTP.

Importing this package does not import SGLang; the modules above do.
"""
