"""The engine client the agent loop talks to: one async interface for the built-in
engine and for an SGLang server (same verbs: open, append, generate, evict, close).

A client keeps one ``StreamLedger`` per stream (``ledger(sid)``): the stream's tokens,
sources, sampler logprobs, computed count and evictions. The agent loop reads the stream
from it rather than asking the engine, and ``close`` turns it into the ``StreamRecord``
the trainer replays."""

from __future__ import annotations

from typing import Protocol

from kvstreams_sglang.engine import Engine, Generation, SamplingParams
from trainer_masks import StreamLedger, StreamRecord


class EngineClient(Protocol):
    async def open(self, stream: list[int] | StreamLedger) -> int:
        """A new stream on these tokens (a ledger is adopted: e.g. ``StreamLedger.reopen``)."""
        ...

    def ledger(self, sid: int) -> StreamLedger: ...

    async def append(self, sid: int, token_ids: list[int], source: str = "env") -> None: ...

    async def generate(self, sid: int, params: SamplingParams) -> Generation: ...

    async def evict(self, sid: int, spans: list[tuple[int, int]]) -> int: ...

    async def prefill(self, sid: int) -> None: ...

    async def reprefill_streams(self, sids: list[int] | None = None) -> int:
        """Recompute the kept KV of ``sids`` (default: every open stream) under the current
        weights, in place; returns the number of tokens run (see ``Engine.reprefill``)."""
        ...

    async def close(self, sid: int, **meta) -> StreamRecord: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def tokens_reprefilled(self) -> int:
        """Tokens the engine computed again on its own so far (streams restored after it evicted them under memory
        pressure): not the episodes' re-prefill compaction, which the agent loop counts."""
        ...


class BuiltinClient:
    """``EngineClient`` over the in-process engine (all episodes share its batches)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def open(self, stream):
        return self.engine.open_stream(stream)

    def ledger(self, sid):
        return self.engine.ledger(sid)

    async def append(self, sid, token_ids, source="env"):
        self.engine.append(sid, token_ids, source=source)

    async def generate(self, sid, params):
        return await self.engine.agenerate(sid, params)

    async def evict(self, sid, spans):
        return self.engine.evict(sid, spans)

    async def prefill(self, sid):
        await self.engine.aprefill(sid)

    async def reprefill_streams(self, sids=None):
        # Synchronous on purpose: it runs between two scheduler steps of the engine's loop, so
        # streams with a generation in flight are recomputed too (their pending token stays pending).
        return self.engine.reprefill(sids)

    @property
    def tokens_reprefilled(self) -> int:
        return self.engine.stats.tokens_reprefilled

    async def close(self, sid, **meta):
        record = self.engine.stream_record(sid, **meta)
        self.engine.close(sid)
        return record
