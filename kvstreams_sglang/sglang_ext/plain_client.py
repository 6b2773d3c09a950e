"""An engine client for a stock SGLang server: every turn sends the stream's whole current context.

A stock server (``python -m sglang.launch_server``) keeps no stream between requests and cannot evict in
place. ``PlainClient`` keeps each stream's ``StreamLedger`` as the session client does, but every
``generate`` sends all of the ledger's tokens as ``input_ids`` with no session: the radix cache reuses the
longest prefix it still holds (SGLang answers it as ``meta_info.cached_tokens``) and prefills the rest. It
is the ``EngineClient`` of the harness against stock SGLang with ``execution = "reprefill"`` (what prime-rl /
verifiers do): a compaction closes the stream and opens the kept tokens as a new one (``StreamLedger.reopen``),
whose first request re-prefills every kept token after the first evicted one (the cache shares only the
prefix before it). ``evict`` is refused.

``stats``, server facts summed over requests: ``turns``; ``prompt_tokens``; ``cached_tokens``;
``computed_tokens`` (prompt - cached: what the server prefilled); ``cached_tokens_lost`` (tokens this stream
had computed in earlier requests that the server no longer had cached: radix evictions under memory
pressure); ``reopened`` and ``reopen_cached_tokens`` (streams opened on an adopted ledger, a re-prefill
window, and the prefix the cache still shared on their first request). A stream's own facts go into its
record's ``meta["server"]``.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

from trainer_masks import StreamLedger

from ..engine.engine import Generation
from ..engine.sampling import SamplingParams
from .client import book_generation, prefill_sampling, sglang_sampling_params
from .http_client import JsonPoster

STAT_KEYS = ("turns", "prompt_tokens", "cached_tokens", "computed_tokens", "cached_tokens_lost")


@dataclass
class StreamStats:
    """What the server did for one stream (a context window in re-prefill execution)."""

    reopened: bool  # opened on an adopted ledger (a re-prefill window)
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    cached_tokens_lost: int = 0
    first_cached_tokens: int = 0  # cached_tokens of the stream's first request


@dataclass
class _Stream:
    ledger: StreamLedger
    stats: StreamStats
    sampling: dict = field(default_factory=dict)  # its last turn's SGLang sampling (client.prefill_sampling)


class PlainClient:
    """``envs.rollout.client.EngineClient`` over a stock SGLang HTTP server (no sessions, radix cache on)."""

    def __init__(self, base_url: str, *, kv_dtype: str = "bf16", timeout_s: float = 600.0):
        self.http = JsonPoster(base_url, timeout_s=timeout_s)
        self.base_url = self.http.base_url
        self.kv_dtype = kv_dtype
        self.policy_version = 0
        self.stats = dict.fromkeys((*STAT_KEYS, "reopened", "reopen_cached_tokens"), 0)
        self._streams: dict[int, _Stream] = {}
        self._sids = itertools.count()

    async def _post(self, route: str, payload: dict):
        return await self.http.post(route, payload)

    async def aclose(self) -> None:
        await self.http.aclose()

    def _get(self, sid: int) -> _Stream:
        try:
            return self._streams[sid]
        except KeyError:
            raise KeyError(f"no open stream {sid}") from None

    async def open(self, stream):
        adopted = isinstance(stream, StreamLedger)
        ledger = stream if adopted else StreamLedger(stream)
        if not ledger.token_ids or ledger.num_computed:
            raise ValueError("open needs at least one token, none computed")
        sid = next(self._sids)
        ledger.name = f"stream {sid}"
        self._streams[sid] = _Stream(ledger, StreamStats(reopened=adopted))
        self.stats["reopened"] += adopted
        return sid

    def ledger(self, sid):
        return self._get(sid).ledger

    async def append(self, sid, token_ids, source="env"):
        self._get(sid).ledger.append(token_ids, source)

    async def _request(self, s: _Stream, sampling: dict, *, logprobs: bool) -> dict:
        """Send the whole context; book what the server reused and computed."""
        ledger, st = s.ledger, s.stats
        if not ledger.num_pending:
            raise ValueError(f"{ledger.name}: nothing to send (generate needs a pending token)")
        computed_before = ledger.num_computed
        out = await self._post("/generate", dict(input_ids=list(ledger.token_ids), sampling_params=sampling,
                                                 return_logprob=logprobs))
        meta = out["meta_info"]
        if meta.get("finish_reason") and meta["finish_reason"].get("type") == "abort":
            raise RuntimeError(f"SGLang aborted the request: {meta['finish_reason']}")
        prompt, cached = int(meta.get("prompt_tokens", ledger.end)), int(meta.get("cached_tokens", 0))
        step = dict(turns=1, prompt_tokens=prompt, cached_tokens=cached, computed_tokens=prompt - cached,
                    cached_tokens_lost=max(0, computed_before - cached))
        if st.turns == 0:
            st.first_cached_tokens = cached
            if st.reopened:
                self.stats["reopen_cached_tokens"] += cached
        for key, n in step.items():
            setattr(st, key, getattr(st, key) + n)
            self.stats[key] += n
        return out

    async def generate(self, sid, params: SamplingParams) -> Generation:
        s = self._get(sid)
        s.sampling = sglang_sampling_params(params)
        out = await self._request(s, s.sampling, logprobs=True)
        return book_generation(s.ledger, out, params, self.policy_version)

    async def prefill(self, sid):
        s = self._get(sid)
        if s.ledger.num_pending:
            await self._request(s, prefill_sampling(s.sampling), logprobs=False)
            s.ledger.commit(s.ledger.num_pending)

    async def evict(self, sid, spans):
        raise NotImplementedError("a stock SGLang server cannot evict in place: run with execution = 'reprefill' "
                                  "(the compacted context is sent as a new request)")

    async def reprefill_streams(self, sids=None):
        raise NotImplementedError("reprefill_on_update: a stock server recomputes nothing it still caches")

    async def close(self, sid, **meta):
        s = self._streams.pop(sid)
        return s.ledger.to_record(kv_dtype=self.kv_dtype, engine="sglang-stock", server=asdict(s.stats), **meta)
