"""``sglang.Engine`` with the kv-streams flags, KV streams (open, evict, inspect) and cache-keeping weight updates.

Offline (in-process tokenizer manager, spawned scheduler): the same process layout as the
HTTP server, for tests and for harnesses that embed the engine. Create it under
``if __name__ == "__main__":`` (SGLang spawns its subprocesses).
"""

from __future__ import annotations

import json

import zmq
from sglang.srt.entrypoints.engine import Engine
from sglang.srt.managers.io_struct import RpcReqInput, UpdateWeightFromDiskReqInput, sock_recv, sock_send

from .patches import RPC_ARGS
from .scheduler import run_scheduler_process
from .server_args import KVStreamsServerArgs

SESSION_CAPACITY = 1 << 30  # SGLang's per-session string capacity; streams are bounded by the KV pool instead


class KVStreamsRPCError(RuntimeError):
    """The scheduler refused a kvstreams call (the message says why); nothing was changed."""


def rpc_request(method: str, **parameters) -> RpcReqInput:
    """A kvstreams call for the scheduler. SGLang's IPC is typed msgpack and an RPC parameter a flat scalar, so
    the arguments (spans are lists) travel as one JSON string, as the result comes back."""
    return RpcReqInput(method=method, parameters={RPC_ARGS: json.dumps(parameters)})


def rpc_result(output) -> dict:
    if not output.success:
        raise KVStreamsRPCError(output.message)
    return json.loads(output.message) if output.message else {}


class KVStreamsEngine(Engine):
    server_args_class = KVStreamsServerArgs
    run_scheduler_process_func = staticmethod(run_scheduler_process)

    def _rpc(self, method: str, **parameters) -> dict:
        sock_send(self.send_to_rpc, rpc_request(method, **parameters))
        return rpc_result(sock_recv(self.send_to_rpc, flags=zmq.BLOCKY))

    def open_stream(self, shared_prefix_len: int | None = None, extra_key: str | None = None) -> str:
        """A new KV stream (a streaming session); returns its session id. ``shared_prefix_len``: its first
        tokens that other streams may share (the episode's first message; None = its whole first turn);
        ``extra_key``: the radix namespace of that prefix (the policy version: prompts computed under other
        weights are not shared)."""
        session_id = self.open_session(capacity_of_str_len=SESSION_CAPACITY, streaming=True)
        try:
            self._rpc("kvstreams_open", session_id=session_id, shared_prefix_len=shared_prefix_len,
                      extra_key=extra_key)
        except KVStreamsRPCError:
            self.close_session(session_id)
            raise
        return session_id

    def evict(self, session_id: str, spans) -> dict:
        """Evict ``spans`` (``[start, end)`` stream positions) of a stream in place.
        Returns the stream's state after (``stream_cache.KVStreamRadixCache.info`` + ``evicted``)."""
        return self._rpc("kvstreams_evict", session_id=session_id, spans=[list(s) for s in spans])

    def session_info(self, session_id: str) -> dict:
        return self._rpc("kvstreams_session_info", session_id=session_id)

    def pool_info(self) -> dict:
        """Free and total token slots of the KV pool, the radix tree's evictable and locked tokens, what open
        streams hold, the stream counters, the pool class (``kvstreams_pool_info`` in ``patches``)."""
        return self._rpc("kvstreams_pool_info")

    def host_clock(self) -> dict:
        """The scheduler's host time so far per hook (``kvstreams_host_clock`` in ``patches``)."""
        return self._rpc("kvstreams_host_clock")

    def update_weights_keep_cache(self, model_path: str, *, weight_version: str | None = None) -> dict:
        """Load weights from disk without flushing the cache: sessions keep their KV."""
        obj = UpdateWeightFromDiskReqInput(model_path=model_path, flush_cache=False, weight_version=weight_version)
        success, message, *_ = self.loop.run_until_complete(
            self.tokenizer_manager.update_weights_from_disk(obj, None))
        if not success:
            raise KVStreamsRPCError(message)
        return dict(success=success, message=message)
