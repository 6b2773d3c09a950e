"""HTTP routes of the kv-streams server, added to SGLang's FastAPI ``app``.

``POST /kvstreams/evict {"session_id": str, "spans": [[start, end], ...]}`` evicts a
streaming session's spans (stream positions) in place and answers the session's state
after (``live_tokens``, ``evicted_tokens``, ``evicted``, ``slots``, ``positions``).
``POST /kvstreams/session_info {"session_id"}`` and ``POST /kvstreams/pool_info {}`` read.
A refused call answers 400 with the reason; nothing was changed.

The calls reach the scheduler over SGLang's RPC channel (the socket ``Engine.collective_rpc``
uses), one at a time, between two scheduler steps.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sglang.srt.managers.io_struct import async_sock_recv, async_sock_send
from sglang.srt.utils.network import get_zmq_socket

from .engine import KVStreamsRPCError, rpc_request, rpc_result


class EvictRequest(BaseModel):
    session_id: str
    spans: list[tuple[int, int]] = Field(min_length=1)


class SessionRequest(BaseModel):
    session_id: str


class _RPC:
    def __init__(self, rpc_ipc_name: str):
        self.socket = get_zmq_socket(zmq.asyncio.Context(1), zmq.DEALER, rpc_ipc_name, True)
        self.lock = asyncio.Lock()

    async def call(self, method: str, **parameters) -> JSONResponse:
        async with self.lock:  # replies come back in order on one DEALER socket
            await async_sock_send(self.socket, rpc_request(method, **parameters))
            output = await async_sock_recv(self.socket)
        try:
            return JSONResponse(rpc_result(output))
        except KVStreamsRPCError as e:
            return JSONResponse({"error": str(e)}, status_code=400)


def add_routes(app: FastAPI, rpc_ipc_name: str) -> None:
    rpc = _RPC(rpc_ipc_name)

    @app.post("/kvstreams/evict")
    async def evict(req: EvictRequest):
        return await rpc.call("kvstreams_evict", session_id=req.session_id, spans=[list(s) for s in req.spans])

    @app.post("/kvstreams/session_info")
    async def session_info(req: SessionRequest):
        return await rpc.call("kvstreams_session_info", session_id=req.session_id)

    @app.post("/kvstreams/pool_info")
    async def pool_info():
        return await rpc.call("kvstreams_pool_info")
