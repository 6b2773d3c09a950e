"""Data-parallel KV streams: one ``EngineClient`` over several SGLang servers.

A stream's KV lives on one server, so a stream is routed once, at ``open``, and stays there for its
life. The GRPO siblings of a task go where their shared prompt already is (an open stream with the
same shared prefix and policy namespace), so its KV is computed once and hit from the tree; any other
stream goes to the server holding the fewest open streams. Weight updates reach every server
(``update_weights_from_disk`` concurrently; a broadcast group spans all their ranks,
``harness.weight_broadcast``), so every stream keeps its KV and all servers serve one policy version.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections import Counter

from trainer_masks import StreamLedger

from .client import SGLangClient, policy_namespace


def prompt_key(stream: list[int] | StreamLedger, shared_prefix_len: int | None, version: int) -> str | None:
    """What GRPO siblings share: their shared prefix (the whole first message by default) in one policy
    namespace; None when the stream shares nothing."""
    tokens = stream.token_ids if isinstance(stream, StreamLedger) else list(stream)
    shared = tokens if shared_prefix_len is None else tokens[:shared_prefix_len]
    if not shared:
        return None
    digest = hashlib.blake2b(repr(shared).encode(), digest_size=12).hexdigest()
    return f"{policy_namespace(version)}/{len(shared)}/{digest}"


class StreamRouter:
    """``SGLangClient`` verbs over ``urls`` (one client each); stream ids are the router's own."""

    def __init__(self, urls: list[str], *, kv_dtype: str = "bf16", timeout_s: float = 600.0):
        if len(urls) < 1 or len(set(urls)) != len(urls):
            raise ValueError(f"StreamRouter needs distinct server URLs, got {urls}")
        self.clients = [SGLangClient(u, kv_dtype=kv_dtype, timeout_s=timeout_s) for u in urls]
        self.urls = [c.base_url for c in self.clients]
        self._route: dict[int, tuple[int, int, str | None]] = {}  # sid -> (server, the server client's sid, prompt key)
        self._prompts = [Counter() for _ in urls]  # open streams per prompt key, per server
        self.opened = [0] * len(urls)  # streams opened on each server so far
        self._sids = itertools.count()

    # ---- routing ----
    def _entry(self, sid: int) -> tuple[int, int, str | None]:
        try:
            return self._route[sid]
        except KeyError:
            raise KeyError(f"stream {sid} is not open") from None

    def server_of(self, sid: int) -> int:
        return self._entry(sid)[0]

    def open_streams(self) -> list[int]:
        """Open streams per server."""
        return [sum(c.values()) for c in self._prompts]

    def _pick(self, key: str | None) -> int:
        holding = [i for i, c in enumerate(self._prompts) if key is not None and c[key]]
        candidates = holding or range(len(self.clients))
        load = self.open_streams()
        return min(candidates, key=lambda i: (load[i], i))

    def _at(self, sid: int) -> tuple[SGLangClient, int]:
        i, inner, _ = self._entry(sid)
        return self.clients[i], inner

    # ---- EngineClient ----
    @property
    def policy_version(self) -> int:
        return self.clients[0].policy_version

    @property
    def stats(self) -> dict:
        """The servers' client counters, summed."""
        total = Counter()
        for c in self.clients:
            total.update(c.stats)
        return dict(total)

    @property
    def tokens_reprefilled(self) -> int:
        return self.stats.get("tokens_reprefilled", 0)

    async def open(self, stream, *, shared_prefix_len: int | None = None) -> int:
        key = prompt_key(stream, shared_prefix_len, self.policy_version)
        i = self._pick(key)
        inner = await self.clients[i].open(stream, shared_prefix_len=shared_prefix_len)
        sid = next(self._sids)
        self._route[sid] = (i, inner, key)
        self._prompts[i][key] += 1
        self.opened[i] += 1
        return sid

    def ledger(self, sid: int) -> StreamLedger:
        c, inner = self._at(sid)
        return c.ledger(inner)

    async def append(self, sid, token_ids, source="env"):
        c, inner = self._at(sid)
        await c.append(inner, token_ids, source)

    async def generate(self, sid, params):
        c, inner = self._at(sid)
        return await c.generate(inner, params)

    async def evict(self, sid, spans):
        c, inner = self._at(sid)
        return await c.evict(inner, spans)

    async def sync(self, sid):
        c, inner = self._at(sid)
        await c.sync(inner)

    async def prefill(self, sid):
        c, inner = self._at(sid)
        await c.prefill(inner)

    async def reprefill_streams(self, sids=None):
        raise NotImplementedError("reprefill_on_update needs the built-in engine; SGLang keeps the streams' KV")

    async def close(self, sid, **meta):
        c, inner = self._at(sid)
        record = await c.close(inner, **meta)
        i, _, key = self._route.pop(sid)
        self._prompts[i][key] -= 1
        if not self._prompts[i][key]:
            del self._prompts[i][key]
        return record

    # ---- every server ----
    async def pool_info(self) -> list[dict]:
        return list(await asyncio.gather(*(c.pool_info() for c in self.clients)))

    async def server_info(self) -> list[dict]:
        return list(await asyncio.gather(*(c.server_info() for c in self.clients)))

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        await asyncio.gather(*(c.update_weights_from_disk(model_path, version) for c in self.clients))

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))
