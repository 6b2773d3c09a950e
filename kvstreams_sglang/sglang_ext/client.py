"""Engine clients over SGLang streaming sessions: one KV stream = one session.

The client keeps each stream's ``StreamLedger`` (every token with its source, sampler logprob
and policy version, the computed count, the evictions: what the trainer needs) and sends the
server only what it does not have yet: each turn's request carries the tokens appended since
the last one; the server keeps the session's KV, so nothing is re-prefilled. Spans are
validated by the ledger before they travel (the server checks its own state again).

- ``SGLangClient``: the harness's async ``EngineClient`` over the HTTP server
  (``python -m kvstreams_sglang.launch_server ... --enable-kv-streams``).
- ``EngineStreams``: the same verbs, synchronous, over an in-process ``KVStreamsEngine``.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from trainer_masks import StreamLedger

from ..engine.engine import Generation
from ..engine.sampling import SamplingParams

SESSION_CAPACITY = 1 << 30  # SGLang's per-session string capacity; streams are bounded by the KV pool instead


def sglang_sampling_params(params: SamplingParams) -> dict:
    """Our sampling parameters in SGLang's request format (EOS stops only when listed, as in the built-in engine)."""
    out = dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
               top_k=params.top_k if params.top_k else -1, ignore_eos=True)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


@dataclass
class _Session:
    """A stream on the server: its ledger, the session id, and how many of its tokens the server
    holds (sent, or sampled there)."""

    session_id: str
    ledger: StreamLedger
    opened_version: int = 0
    sent: int = 0

    def request_ids(self) -> list[int]:
        ids = self.ledger.token_ids[self.sent:]
        if not ids:
            raise ValueError(f"{self.ledger.name}: nothing to send (generate needs a pending token)")
        return ids

    def record_prefill(self) -> None:
        """Book a prefill-only turn (``max_new_tokens=0``): the server computed everything it holds."""
        self.sent = self.ledger.end
        self.ledger.commit(self.ledger.num_pending)

    def record(self, output: dict, params: SamplingParams, version: int) -> Generation:
        """Book one turn's server response; returns it as a ``Generation``."""
        ids = list(output["output_ids"])
        lps = [float(lp) for lp, *_ in output["meta_info"]["output_token_logprobs"]]
        if len(lps) != len(ids):
            raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(lps)} logprobs")
        ledger = self.ledger
        for tok, lp in zip(ids, lps, strict=True):
            ledger.add_sampled(tok, lp, version)
        ledger.commit(ledger.num_pending - 1)  # the server computed everything it holds but the last sampled token
        self.sent = ledger.end
        stop = set(params.stop_token_ids)
        reason = "stop" if ids and ids[-1] in stop else "length"
        return Generation(ids, lps, reason)


class _Streams:
    """Bookkeeping shared by both clients: stream ids -> sessions, and what the server reused.

    ``stats``: ``turns``; ``turns_across_updates`` (turns of streams opened under an older
    policy); ``cached_tokens_lost``: kept tokens the server did not find cached when a turn
    arrived (it would have re-prefilled them; 0 when sessions survive evictions and updates)."""

    def __init__(self):
        self._sessions: dict[int, _Session] = {}
        self._sids = itertools.count()
        self.policy_version = 0
        self.stats = dict(turns=0, turns_across_updates=0, cached_tokens_lost=0)

    def _count_turn(self, s: _Session, meta: dict) -> None:
        self.stats["turns"] += 1
        self.stats["turns_across_updates"] += s.opened_version < self.policy_version
        self.stats["cached_tokens_lost"] += max(0, s.ledger.num_live - int(meta.get("cached_tokens", 0)))

    def _new(self, session_id: str, stream: list[int] | StreamLedger) -> int:
        ledger = stream if isinstance(stream, StreamLedger) else StreamLedger(stream)
        if not ledger.token_ids or ledger.num_computed:
            raise ValueError("open needs at least one token, none computed")
        sid = next(self._sids)
        ledger.name = f"stream {sid}"
        self._sessions[sid] = _Session(session_id, ledger, opened_version=self.policy_version)
        return sid

    def _get(self, sid: int) -> _Session:
        try:
            return self._sessions[sid]
        except KeyError:
            raise KeyError(f"no open stream {sid}") from None

    def ledger(self, sid: int) -> StreamLedger:
        return self._get(sid).ledger

    def _record(self, sid: int, kv_dtype: str, **meta):
        return self._get(sid).ledger.to_record(kv_dtype=kv_dtype, engine="sglang", **meta)


class EngineStreams(_Streams):
    """Streams over an in-process ``KVStreamsEngine`` (synchronous)."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.kv_dtype = "kv4rl" if engine.server_args.kv4rl else "bf16"

    def open_stream(self, stream: list[int] | StreamLedger) -> int:
        session_id = self.engine.open_session(capacity_of_str_len=SESSION_CAPACITY, streaming=True)
        return self._new(session_id, stream)

    def append(self, sid: int, token_ids: list[int], *, source: str = "env") -> None:
        self._get(sid).ledger.append(token_ids, source)

    def generate(self, sid: int, params: SamplingParams) -> tuple[Generation, dict]:
        """One turn; also returns SGLang's ``meta_info`` (``cached_tokens``, ``prompt_tokens``)."""
        s = self._get(sid)
        out = self.engine.generate(input_ids=s.request_ids(), sampling_params=sglang_sampling_params(params),
                                   return_logprob=True, session_params={"id": s.session_id})
        self._count_turn(s, out["meta_info"])
        return s.record(out, params, self.policy_version), out["meta_info"]

    def evict(self, sid: int, spans) -> int:
        s = self._get(sid)
        eviction = s.ledger.check_evict(spans)
        self.engine.evict(s.session_id, eviction.spans)
        s.ledger.apply(eviction)
        return len(eviction.dropped)

    def stream_record(self, sid: int, **meta):
        return self._record(sid, self.kv_dtype, **meta)

    def close(self, sid: int) -> None:
        self.engine.close_session(self._sessions.pop(sid).session_id)


class SGLangClient(_Streams):
    """``envs.rollout.client.EngineClient`` over an SGLang HTTP server launched with ``--enable-kv-streams``."""

    def __init__(self, base_url: str, *, kv_dtype: str = "bf16", timeout_s: float = 600.0):
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.kv_dtype = kv_dtype
        self.timeout_s = timeout_s
        self._http = None

    async def _post(self, route: str, payload: dict):
        import aiohttp

        if self._http is None:
            # a connection per request: a pooled one goes stale while the trainer holds the event loop
            # longer than the server's keep-alive, and a request sent on it is lost
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                               connector=aiohttp.TCPConnector(force_close=True, limit=0))
        async with self._http.post(self.base_url + route, json=payload) as resp:
            text = await resp.text()
            body = json.loads(text) if text else None
            if resp.status != 200:
                raise RuntimeError(f"SGLang {route} failed ({resp.status}): {body}")
            return body

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def open(self, stream):
        session_id = await self._post("/open_session", dict(capacity_of_str_len=SESSION_CAPACITY, streaming=True))
        if not session_id:
            raise RuntimeError("SGLang refused to open a session (is --enable-kv-streams on?)")
        return self._new(session_id, stream)

    async def append(self, sid, token_ids, source="env"):
        self._get(sid).ledger.append(token_ids, source)

    async def generate(self, sid, params):
        s = self._get(sid)
        out = await self._post("/generate", dict(input_ids=s.request_ids(),
                                                 sampling_params=sglang_sampling_params(params),
                                                 return_logprob=True, session_params={"id": s.session_id}))
        if out["meta_info"]["finish_reason"] and out["meta_info"]["finish_reason"].get("type") == "abort":
            raise RuntimeError(f"SGLang aborted the turn: {out['meta_info']['finish_reason']}")
        self._count_turn(s, out["meta_info"])
        return s.record(out, params, self.policy_version)

    async def evict(self, sid, spans):
        s = self._get(sid)
        eviction = s.ledger.check_evict(spans)
        await self._post("/kvstreams/evict", dict(session_id=s.session_id, spans=[list(x) for x in eviction.spans]))
        s.ledger.apply(eviction)
        return len(eviction.dropped)

    async def prefill(self, sid):
        s = self._get(sid)
        if not s.ledger.num_pending:
            return
        await self._post("/generate", dict(input_ids=s.request_ids(), sampling_params=dict(max_new_tokens=0),
                                           session_params={"id": s.session_id}))
        s.record_prefill()

    async def reprefill_streams(self, sids=None):
        raise NotImplementedError("reprefill_on_update needs the built-in engine; SGLang keeps the sessions' KV")

    async def close(self, sid, **meta):
        record = self._record(sid, self.kv_dtype, **meta)
        await self._post("/close_session", dict(session_id=self._sessions.pop(sid).session_id))
        return record

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Load new weights without flushing: every session keeps its KV."""
        out = await self._post("/update_weights_from_disk", dict(model_path=model_path, flush_cache=False,
                                                                  weight_version=str(version)))
        if not out.get("success", False):
            raise RuntimeError(f"SGLang weight update failed: {out}")
        self.policy_version = version

    async def pool_info(self) -> dict:
        return await self._post("/kvstreams/pool_info", {})
