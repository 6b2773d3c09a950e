"""Engine clients over SGLang KV streams (``--enable-kv-streams``): one KV stream = one streaming session.

The client keeps each stream's ``StreamLedger`` (every token with its source, sampler logprob
and policy version, the computed count, the evictions: what the trainer needs) and sends the
server only what it does not have yet: each turn's request carries the tokens appended since
the last one; the server keeps the stream's KV in its radix tree, so nothing is re-prefilled.
Spans are validated by the ledger before they travel (the server checks its own state again).

An eviction rides with the stream's next turn (``sampling_params.custom_params.kvstreams_evict``):
the scheduler applies it just before it admits the turn, in the same step. A separate call would
wait for a scheduler step of its own, and SGLang's RPC channel carries one call per step: with
dozens of streams compacting every turn, evictions would be served one per step and set the
pace of the whole rollout. ``sync`` sends a stream's pending eviction at once, when its server
state must be read before the next turn.

A stream is opened with its shared prefix: the tokens it has at ``open`` (the episode's first
message), which its GRPO siblings share through the tree, namespaced by the policy version
(``extra_key``). Under memory pressure the server may evict an idle stream's KV; its next turn is
then answered with ``STREAM_EVICTED`` and the client restores the stream exactly, from its ledger
(``restore_plan``): on a fresh stream it prefills the computed tokens segment by segment and evicts
each eviction event's spans at its ``at_index`` boundary, so every kept token's KV is recomputed
under the mask it was computed under (``k <= q < death[k]``), by the current weights; then it sends
the turn again.

- ``SGLangClient``: the harness's async ``EngineClient`` over the HTTP server
  (``python -m kvstreams_sglang.launch_server ... --enable-kv-streams``).
- ``EngineStreams``: the same verbs, synchronous, over an in-process ``KVStreamsEngine``.

Both run the same protocol (``_Streams``): its steps are generators that yield ``Call``s, which
each client carries out with its transport.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass, field

from trainer_masks import EvictionError, StreamLedger

from ..engine.engine import Generation
from ..engine.sampling import SamplingParams
from . import STREAM_EVICTED
from .http_client import JsonPoster
from .sessions import EVICT_PARAM

MAX_RESTORES = 8  # restores of one turn before giving up (each one evicted again before it finished)


def sglang_sampling_params(params: SamplingParams) -> dict:
    """Our sampling parameters in SGLang's request format. Without stop tokens nothing stops a turn before
    ``max_new_tokens`` (``ignore_eos``), as in the built-in engine. With them, ``ignore_eos`` must be off: SGLang
    checks ``stop_token_ids`` only when it looks for EOS at all (``Req._check_token_based_finish``), so the model's
    own EOS ids (its config's) stop a turn too; chat renderers list them anyway (``ChatRenderer.eos_ids``)."""
    out = dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
               top_k=params.top_k if params.top_k else -1, ignore_eos=not params.stop_token_ids)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def prefill_sampling(turn: dict) -> dict:
    """A prefill-only request (``max_new_tokens=0``) with the temperature, top-p and top-k of its stream's turns
    (``turn``: the last one's SGLang sampling, ``{}`` before any). SGLang samples a token for every row of a batch
    that generates at all, a prefill-only row's too (then drops it), and a batch whose rows disagree takes its
    top-k path: a bare prefill (SGLang's default T = 1, every token) beside greedy turns (top_k = 1) did, on a fresh
    H100 (2026-12-06), where that path is FlashInfer's JIT-compiled kernel: the held-out games' server stalled
    compiling it. Where rows agree, a batch is argmax (greedy) or one multinomial draw (T = 1), as the turns' own
    batches are."""
    return dict({k: turn[k] for k in ("temperature", "top_p", "top_k") if k in turn}, max_new_tokens=0)


def policy_namespace(version: int) -> str:
    """The radix namespace (``extra_key``) of prompts computed under policy ``version``."""
    return f"policy-{version}"


@dataclass(frozen=True)
class Prefill:
    """Restore step: compute ledger tokens ``[start, end)`` (a prefill-only request)."""

    start: int
    end: int


@dataclass(frozen=True)
class Evict:
    """Restore step: evict ``spans``."""

    spans: tuple[tuple[int, int], ...]


def restore_plan(ledger: StreamLedger) -> list[Prefill | Evict]:
    """How a fresh stream gets exactly the KV of ``ledger``'s computed tokens: each eviction event is applied
    when the tokens before its ``at_index`` are computed and none after, as it happened."""
    steps: list[Prefill | Evict] = []
    start = 0
    for event in ledger.evictions:
        if event.at_index > start:
            steps.append(Prefill(start, event.at_index))
            start = event.at_index
        steps.append(Evict(tuple(event.spans)))
    if ledger.num_computed > start:
        steps.append(Prefill(start, ledger.num_computed))
    return steps


@dataclass(frozen=True)
class Call:
    """One request to the server: ``open`` (``shared_prefix_len``, ``extra_key``) -> session id,
    ``generate`` (``payload``) -> SGLang's response, ``evict`` (``session_id``, ``spans``), ``close``
    (``session_id``)."""

    verb: str
    args: dict


def _evicted(out: dict) -> bool:
    reason = out["meta_info"].get("finish_reason") or {}
    return reason.get("type") == "abort" and str(reason.get("message", "")).startswith(STREAM_EVICTED)


def book_generation(ledger: StreamLedger, output: dict, params: SamplingParams, version: int) -> Generation:
    """An SGLang ``/generate`` answer into ``ledger``: the sampled tokens with their logprobs and ``version``; the
    server computed everything the stream holds but the last sampled token (its KV comes with the next turn)."""
    ids = list(output["output_ids"])
    lps = [float(lp) for lp, *_ in output["meta_info"]["output_token_logprobs"]]
    if len(lps) != len(ids):
        raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(lps)} logprobs")
    for tok, lp in zip(ids, lps, strict=True):
        ledger.add_sampled(tok, lp, version)
    ledger.commit(ledger.num_pending - 1)
    stop = set(params.stop_token_ids)
    return Generation(ids, lps, "stop" if ids and ids[-1] in stop else "length")


def _check(out: dict) -> dict:
    reason = out["meta_info"].get("finish_reason") or {}
    if reason.get("type") == "abort":
        raise RuntimeError(f"SGLang aborted the turn: {reason}")
    return out


@dataclass
class _Session:
    """A stream on the server: its ledger, the session id, its shared prefix, and how many of its tokens
    the server holds (sent, or sampled there)."""

    session_id: str
    ledger: StreamLedger
    shared_prefix_len: int
    opened_version: int = 0
    sent: int = 0
    turns: int = 0
    pending_evict: list[tuple[int, int]] = field(default_factory=list)  # in the ledger, not yet on the server
    sampling: dict = field(default_factory=dict)  # its last turn's SGLang sampling (prefill_sampling)

    def pending_spans(self) -> list[list[int]]:
        """The pending eviction's spans, sorted, adjacent ones merged."""
        merged: list[list[int]] = []
        for start, stop in sorted(self.pending_evict):
            if merged and merged[-1][1] == start:
                merged[-1][1] = stop
            else:
                merged.append([start, stop])
        return merged

    def sampling_with_evictions(self, sampling: dict) -> dict:
        """``sampling`` plus the pending eviction (flat ``[start, end, start, end, ...]``: SGLang's custom
        parameters hold flat lists)."""
        if not self.pending_evict:
            return sampling
        flat = [p for span in self.pending_spans() for p in span]
        return dict(sampling, custom_params=dict(sampling.get("custom_params") or {}, **{EVICT_PARAM: flat}))

    def request_ids(self, upto: int | None = None) -> list[int]:
        ids = self.ledger.token_ids[self.sent:upto]
        if not ids:
            raise ValueError(f"{self.ledger.name}: nothing to send (generate needs a pending token)")
        return ids

    def record_prefill(self) -> None:
        """Book a prefill-only turn (``max_new_tokens=0``): the server computed everything it holds."""
        self.sent = self.ledger.end
        self.ledger.commit(self.ledger.num_pending)

    def record(self, output: dict, params: SamplingParams, version: int) -> Generation:
        """Book one turn's server response; returns it as a ``Generation``."""
        gen = book_generation(self.ledger, output, params, version)
        self.sent = self.ledger.end
        return gen


class _Streams:
    """The protocol both clients run: stream ids -> sessions, turns with restore, and what the server reused.

    ``stats``: ``turns``; ``turns_across_updates`` (turns of streams opened under an older policy);
    ``cached_tokens_lost``: kept tokens the server did not have when a turn arrived (0 when memory
    suffices); ``prefix_hit_tokens``: tokens of streams' first turns served from the tree (a sibling's
    prompt); ``restores``: streams restored after the server evicted them; ``tokens_reprefilled``:
    tokens the restores computed again (0 when memory suffices)."""

    def __init__(self):
        self._sessions: dict[int, _Session] = {}
        self._sids = itertools.count()
        self.policy_version = 0
        self.stats = dict(turns=0, turns_across_updates=0, cached_tokens_lost=0, prefix_hit_tokens=0, restores=0,
                          tokens_reprefilled=0)

    @property
    def tokens_reprefilled(self) -> int:
        """``EngineClient.tokens_reprefilled``: the restores' tokens."""
        return self.stats["tokens_reprefilled"]

    # ---- protocol steps (generators of Calls) ----
    def _open(self, stream: list[int] | StreamLedger, shared_prefix_len: int | None) -> Generator[Call, object, int]:
        ledger = stream if isinstance(stream, StreamLedger) else StreamLedger(stream)
        if not ledger.token_ids or ledger.num_computed:
            raise ValueError("open needs at least one token, none computed")
        shared = ledger.end if shared_prefix_len is None else shared_prefix_len
        if not 0 <= shared <= ledger.end:
            raise ValueError(f"shared_prefix_len {shared} is outside the stream's {ledger.end} tokens")
        session_id = yield Call("open", dict(shared_prefix_len=shared, extra_key=policy_namespace(self.policy_version)))
        sid = next(self._sids)
        ledger.name = f"stream {sid}"
        self._sessions[sid] = _Session(session_id, ledger, shared, opened_version=self.policy_version)
        return sid

    def _turn(self, s: _Session, sampling: dict, *, logprobs: bool, upto: int | None = None
              ) -> Generator[Call, object, dict]:
        """Send the pending tokens (up to ``upto``) and the pending eviction; on ``STREAM_EVICTED`` restore the
        stream (the restore replays every eviction of the ledger) and send them again."""
        for _ in range(MAX_RESTORES + 1):
            out = yield Call("generate", dict(input_ids=s.request_ids(upto), sampling_params=s.sampling_with_evictions(
                sampling), return_logprob=logprobs, session_params={"id": s.session_id}))
            if not _evicted(out):
                out = _check(out)
                s.pending_evict.clear()
                return out
            s.pending_evict.clear()
            yield from self._restore(s)
        raise RuntimeError(f"{s.ledger.name}: evicted {MAX_RESTORES} times in a row; the KV pool is too small for "
                           "one stream at a time")

    def _restore(self, s: _Session) -> Generator[Call, object, None]:
        """Rebuild ``s`` on a fresh stream from its ledger (``restore_plan``): afterwards the server holds
        exactly the ledger's computed tokens, under the positions and masks they were computed with."""
        ledger = s.ledger
        self.stats["restores"] += 1
        for attempt in range(MAX_RESTORES):
            yield Call("close", dict(session_id=s.session_id))
            s.session_id = yield Call("open", dict(shared_prefix_len=s.shared_prefix_len,
                                                   extra_key=policy_namespace(self.policy_version)))
            s.sent = 0
            for step in restore_plan(ledger):
                if isinstance(step, Evict):
                    yield Call("evict", dict(session_id=s.session_id, spans=[list(x) for x in step.spans]))
                    continue
                out = yield Call("generate", dict(input_ids=ledger.token_ids[step.start: step.end],
                                                  sampling_params=prefill_sampling(s.sampling),
                                                  session_params={"id": s.session_id}))
                if _evicted(out):
                    break
                meta = _check(out)["meta_info"]
                if step.start == 0 and attempt == 0:  # the live tokens the server did not have
                    self.stats["cached_tokens_lost"] += max(0, ledger.num_live - int(meta.get("cached_tokens", 0)))
                self.stats["tokens_reprefilled"] += int(meta["prompt_tokens"]) - int(meta.get("cached_tokens", 0))
                s.sent = step.end
            else:
                return
        raise RuntimeError(f"{ledger.name}: evicted {MAX_RESTORES} times during its restore")

    def _share_prompt(self, s: _Session) -> Generator[Call, object, None]:
        """kv4rl: a first turn that runs past the shared prefix (the agent loop's: first message, then an assistant
        header) sends the prefix on its own first, prefill only. The server keeps the INT8 side row of a first turn
        that is exactly its shared prefix for the GRPO siblings (``stream_cache``), who then compute only what
        follows; one longer extend would leave no row holding the prompt's INT8 copies as of its end."""
        p = s.shared_prefix_len
        if self.kv_dtype != "kv4rl" or s.turns or s.sent or not 0 < p < s.ledger.end:
            return
        out = yield from self._turn(s, prefill_sampling(s.sampling), logprobs=False, upto=p)
        self.stats["prefix_hit_tokens"] += int(out["meta_info"].get("cached_tokens", 0))
        s.turns += 1
        s.sent = p
        s.ledger.commit(p - s.ledger.num_computed)

    def _generate(self, sid: int, params: SamplingParams) -> Generator[Call, object, tuple[Generation, dict]]:
        s = self._get(sid)
        s.sampling = sglang_sampling_params(params)
        yield from self._share_prompt(s)
        out = yield from self._turn(s, s.sampling, logprobs=True)
        meta = out["meta_info"]
        cached = int(meta.get("cached_tokens", 0))
        self.stats["turns"] += 1
        self.stats["turns_across_updates"] += s.opened_version < self.policy_version
        self.stats["cached_tokens_lost"] += max(0, s.ledger.num_live - cached)
        if s.turns == 0:
            self.stats["prefix_hit_tokens"] += cached
        s.turns += 1
        return s.record(out, params, self.policy_version), meta

    def _prefill(self, sid: int) -> Generator[Call, object, None]:
        s = self._get(sid)
        if not s.ledger.num_pending:
            return
        yield from self._share_prompt(s)
        out = yield from self._turn(s, prefill_sampling(s.sampling), logprobs=False)
        if s.turns == 0:
            self.stats["prefix_hit_tokens"] += int(out["meta_info"].get("cached_tokens", 0))
        s.turns += 1
        s.record_prefill()

    def _evict(self, sid: int, spans) -> int:
        """Evict in the ledger now, on the server with the stream's next turn (or ``sync``)."""
        s = self._get(sid)
        eviction = s.ledger.check_evict(spans)
        for start, stop in eviction.spans:  # the server's rule too: checked here, as the ledger changes now
            if start < s.shared_prefix_len:
                raise EvictionError(f"{s.ledger.name}: span [{start}, {stop}) reaches into the shared prefix "
                                    f"[0, {s.shared_prefix_len}), whose KV other streams share (open the stream "
                                    "with a smaller shared_prefix_len to evict it)")
        s.ledger.apply(eviction)
        s.pending_evict.extend(eviction.spans)
        return len(eviction.dropped)

    def _sync(self, sid: int) -> Generator[Call, object, None]:
        s = self._get(sid)
        if s.pending_evict:
            yield Call("evict", dict(session_id=s.session_id, spans=s.pending_spans()))
            s.pending_evict.clear()

    def _close(self, sid: int) -> Generator[Call, object, None]:
        yield Call("close", dict(session_id=self._sessions.pop(sid).session_id))

    # ---- reading ----
    def _get(self, sid: int) -> _Session:
        try:
            return self._sessions[sid]
        except KeyError:
            raise KeyError(f"no open stream {sid}") from None

    def ledger(self, sid: int) -> StreamLedger:
        return self._get(sid).ledger

    def session_id(self, sid: int) -> str:
        """The stream's current SGLang session (a restore opens a new one)."""
        return self._get(sid).session_id

    def _record(self, sid: int, kv_dtype: str, **meta):
        return self._get(sid).ledger.to_record(kv_dtype=kv_dtype, engine="sglang", **meta)


class EngineStreams(_Streams):
    """Streams over an in-process ``KVStreamsEngine`` (synchronous)."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.kv_dtype = "kv4rl" if engine.server_args.kv4rl else "bf16"

    def _run(self, steps: Generator):
        try:
            call = next(steps)
            while True:
                call = steps.send(self._call(call))
        except StopIteration as done:
            return done.value

    def _call(self, call: Call):
        a = call.args
        if call.verb == "open":
            return self.engine.open_stream(**a)
        if call.verb == "generate":
            return self.engine.generate(**a)
        if call.verb == "evict":
            return self.engine.evict(**a)
        return self.engine.close_session(**a)

    def open_stream(self, stream: list[int] | StreamLedger, *, shared_prefix_len: int | None = None) -> int:
        """A new stream on ``stream``'s tokens; its first ``shared_prefix_len`` (default: all of them) are shared
        with other streams through the radix tree and cannot be evicted."""
        return self._run(self._open(stream, shared_prefix_len))

    def append(self, sid: int, token_ids: list[int], *, source: str = "env") -> None:
        self._get(sid).ledger.append(token_ids, source)

    def generate(self, sid: int, params: SamplingParams) -> tuple[Generation, dict]:
        """One turn; also returns SGLang's ``meta_info`` (``cached_tokens``, ``prompt_tokens``)."""
        return self._run(self._generate(sid, params))

    def prefill(self, sid: int) -> None:
        self._run(self._prefill(sid))

    def evict(self, sid: int, spans) -> int:
        """Drop ``spans`` from the stream (the ledger now, the server with the next turn); returns the count."""
        return self._evict(sid, spans)

    def sync(self, sid: int) -> None:
        """Send the stream's pending eviction now."""
        self._run(self._sync(sid))

    def stream_record(self, sid: int, **meta):
        return self._record(sid, self.kv_dtype, **meta)

    def close(self, sid: int) -> None:
        self._run(self._close(sid))


class SGLangClient(_Streams):
    """``envs.rollout.client.EngineClient`` over an SGLang HTTP server launched with ``--enable-kv-streams``."""

    def __init__(self, base_url: str, *, kv_dtype: str = "bf16", timeout_s: float = 600.0):
        super().__init__()
        self.http = JsonPoster(base_url, timeout_s=timeout_s)
        self.base_url = self.http.base_url
        self.kv_dtype = kv_dtype

    async def _post(self, route: str, payload: dict):
        return await self.http.post(route, payload)

    async def _run(self, steps: Generator):
        try:
            call = next(steps)
            while True:
                call = steps.send(await self._call(call))
        except StopIteration as done:
            return done.value

    async def _call(self, call: Call):
        a = call.args
        if call.verb == "open":
            return (await self._post("/kvstreams/open", a))["session_id"]
        if call.verb == "generate":
            return await self._post("/generate", a)
        if call.verb == "evict":
            return await self._post("/kvstreams/evict", a)
        return await self._post("/close_session", a)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def open(self, stream, *, shared_prefix_len: int | None = None):
        """A new stream on ``stream``'s tokens; its first ``shared_prefix_len`` (default: all of them, the
        episode's first message) are shared with other streams and cannot be evicted."""
        return await self._run(self._open(stream, shared_prefix_len))

    async def append(self, sid, token_ids, source="env"):
        self._get(sid).ledger.append(token_ids, source)

    async def generate(self, sid, params):
        gen, _meta = await self._run(self._generate(sid, params))
        return gen

    async def evict(self, sid, spans):
        """Drop ``spans`` from the stream (the ledger now, the server with the next turn); returns the count."""
        return self._evict(sid, spans)

    async def sync(self, sid):
        """Send the stream's pending eviction now (``/kvstreams/evict``)."""
        await self._run(self._sync(sid))

    async def prefill(self, sid):
        await self._run(self._prefill(sid))

    async def reprefill_streams(self, sids=None):
        raise NotImplementedError("reprefill_on_update needs the built-in engine; SGLang keeps the streams' KV")

    async def close(self, sid, **meta):
        record = self._record(sid, self.kv_dtype, **meta)
        await self._run(self._close(sid))
        return record

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Load new weights without flushing: every stream keeps its KV."""
        out = await self._post("/update_weights_from_disk", dict(model_path=model_path, flush_cache=False,
                                                                  weight_version=str(version)))
        if not out.get("success", False):
            raise RuntimeError(f"SGLang weight update failed: {out}")
        self.policy_version = version

    async def init_weights_update_group(self, master_address: str, master_port: int, world_size: int, *,
                                        group_name: str, backend: str, rank_offset: int = 1) -> None:
        """The server's ranks join a process group (ranks ``rank_offset..``) whose rank 0 is the caller, who must
        join it concurrently (``harness.weight_broadcast``)."""
        out = await self._post("/init_weights_update_group", dict(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
            group_name=group_name, backend=backend))
        if not out.get("success", False):
            raise RuntimeError(f"SGLang init_weights_update_group failed: {out}")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        out = await self._post("/destroy_weights_update_group", dict(group_name=group_name))
        if not out.get("success", False):
            raise RuntimeError(f"SGLang destroy_weights_update_group failed: {out}")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: int, *, group_name: str) -> None:
        """Receive new weights by broadcast from rank 0 of ``group_name`` (the caller broadcasts them, in this
        order, concurrently), without flushing: every stream keeps its KV."""
        out = await self._post("/update_weights_from_distributed", dict(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=False,
            weight_version=str(version)))
        if not out.get("success", False):
            raise RuntimeError(f"SGLang weight update failed: {out}")
        self.policy_version = version

    async def server_info(self) -> dict:
        """SGLang's ``/server_info`` (its server arguments and state)."""
        return await self.http.get("/server_info")

    async def pool_info(self) -> dict:
        return await self._post("/kvstreams/pool_info", {})

    async def host_clock(self) -> dict:
        """The scheduler's host time so far per hook (``host_clock``; difference two reads)."""
        return await self._post("/kvstreams/host_clock", {})
