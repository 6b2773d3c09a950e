"""HTTP routes of the kv-streams server, added to SGLang's FastAPI ``app``.

``POST /kvstreams/open {"shared_prefix_len": int | null, "extra_key": str | null}`` opens a KV
stream (a streaming session) and answers ``{"session_id", "shared_prefix_len", "extra_key"}``.
``shared_prefix_len``: how many of its first tokens other streams may share through the radix tree
(the episode's first message, the same for the GRPO siblings of a task; null = the whole first turn;
0 = nothing shared); spans inside it cannot be evicted. ``extra_key``: the radix namespace of that
prefix (the policy version at open, so that prompts computed under other weights are not shared).
Its turns are ``POST /generate {"input_ids": [new tokens], "session_params": {"id": session_id}, ...}``
as for any streaming session; ``POST /close_session {"session_id"}`` closes it (its private KV is freed).

A turn of a stream whose KV the cache evicted under memory pressure answers 200 with
``meta_info.finish_reason = {"type": "abort", "message": "kvstreams: stream evicted: ...",
"status_code": 409}``: nothing ran; restore the stream (a fresh stream replaying the ledger, see
``client``) and send the turn again. A turn the server cannot run answers 400 with the reason and
leaves the stream as it was: token ids outside the vocabulary, or a turn whose KV or positions would
not fit.

A turn may carry an eviction: ``"sampling_params": {..., "custom_params": {"kvstreams_evict": [start, end,
start, end, ...]}}`` (flat: SGLang's custom parameters hold flat lists). The scheduler evicts those spans
in place just before it admits the turn, in the same step; a refused eviction answers 400 with the reason
and the turn does not run. This is the fast path: ``/kvstreams/evict`` below waits for a scheduler step
of its own, and the RPC channel serves one call per step.

``POST /kvstreams/evict {"session_id": str, "spans": [[start, end], ...]}`` evicts a stream's spans
(stream positions) in place, between turns, and answers the stream's state after (``live_tokens``,
``evicted_tokens``, ``stream_length``, ``slots``, ``positions``, ``shared_prefix_len``, ``lost``,
``evicted``). ``POST /kvstreams/session_info {"session_id"}`` and ``POST /kvstreams/pool_info {}``
read (pool: ``available_tokens``, ``evictable_tokens``, ``protected_tokens``, ``total_tokens``,
``stream_tokens`` held by open streams' private branches, ``open_streams``, ``prefix_hit_tokens``,
``branches_evicted``, ``turns_aborted_evicted``, ...). ``POST /kvstreams/host_clock {}``: the scheduler's host
time so far per hook (``sglang_ext.host_clock``; a bench differences two reads). A refused call answers 400 with
the reason; nothing was changed.

The calls reach the scheduler over SGLang's RPC channel (the socket ``Engine.collective_rpc``
uses), one at a time, between two scheduler steps.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sglang.srt.managers.io_struct import (
    CloseSessionReqInput,
    OpenSessionReqInput,
    async_sock_recv,
    async_sock_send,
)
from sglang.srt.utils.network import get_zmq_socket

from .engine import SESSION_CAPACITY, KVStreamsRPCError, rpc_request, rpc_result


class OpenRequest(BaseModel):
    shared_prefix_len: int | None = Field(default=None, ge=0)
    extra_key: str | None = None


class EvictRequest(BaseModel):
    session_id: str
    # taken as sent: the one eviction rule (trainer_masks.check_spans, in the scheduler) refuses what is not a list of
    # [start, end) integer pairs with a 400 and its reason (pydantic's lax ints would turn 2.0, "3" or true into ints)
    spans: list[Any] = Field(min_length=1)


class SessionRequest(BaseModel):
    session_id: str


class _RPC:
    def __init__(self, rpc_ipc_name: str):
        self.socket = get_zmq_socket(zmq.asyncio.Context(1), zmq.DEALER, rpc_ipc_name, True)
        self.lock = asyncio.Lock()

    async def call(self, method: str, **parameters) -> dict:
        async with self.lock:  # replies come back in order on one DEALER socket
            await async_sock_send(self.socket, rpc_request(method, **parameters))
            output = await async_sock_recv(self.socket)
        return rpc_result(output)

    async def respond(self, method: str, **parameters) -> JSONResponse:
        try:
            return JSONResponse(await self.call(method, **parameters))
        except KVStreamsRPCError as e:
            return JSONResponse({"error": str(e)}, status_code=400)


def add_routes(app: FastAPI, rpc_ipc_name: str) -> None:
    rpc = _RPC(rpc_ipc_name)

    @app.post("/kvstreams/open")
    async def open_stream(req: OpenRequest):
        from sglang.srt.entrypoints.http_server import get_global_state

        tokenizer_manager = get_global_state().tokenizer_manager
        session_id = await tokenizer_manager.open_session(
            OpenSessionReqInput(capacity_of_str_len=SESSION_CAPACITY, streaming=True), None)
        if session_id is None:
            return JSONResponse({"error": "SGLang refused to open a streaming session"}, status_code=400)
        try:
            return JSONResponse(await rpc.call("kvstreams_open", session_id=session_id,
                                               shared_prefix_len=req.shared_prefix_len, extra_key=req.extra_key))
        except KVStreamsRPCError as e:
            await tokenizer_manager.close_session(CloseSessionReqInput(session_id=session_id), None)
            return JSONResponse({"error": str(e)}, status_code=400)

    @app.post("/kvstreams/evict")
    async def evict(req: EvictRequest):
        return await rpc.respond("kvstreams_evict", session_id=req.session_id, spans=req.spans)

    @app.post("/kvstreams/session_info")
    async def session_info(req: SessionRequest):
        return await rpc.respond("kvstreams_session_info", session_id=req.session_id)

    @app.post("/kvstreams/pool_info")
    async def pool_info():
        return await rpc.respond("kvstreams_pool_info")

    @app.post("/kvstreams/host_clock")
    async def host_clock():
        return await rpc.respond("kvstreams_host_clock")
