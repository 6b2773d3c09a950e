"""Run the real ``sglang.Engine`` (kv-streams, optionally kv4rl) on CPU and dump what the tests check.

    python tests/sglang_session.py MODEL_DIR OUT.json [--kv4rl [--kv4rl-sink N --kv4rl-recent N]]
        [--disable-overlap-schedule]

Run as a subprocess (SGLang spawns its scheduler; a scheduler crash SIGQUITs its parent), with
``tests/sglang_cpu_shims`` on PYTHONPATH and ``SGLANG_USE_CPU_ENGINE=1``. One engine, a KV pool of
``POOL_TOKENS``, three scenarios in order:

1. ``main``: one stream whose prompt is private (``shared_prefix_len=0``, so spans may cover it):
   turn 1 (prompt), turn 2 (appended observation), eviction, invalid evictions, turn 3, a weight
   update from tensors without flushing, turn 4, close.
2. ``siblings``: four GRPO siblings of one prompt submitted together (their first turns), the
   shared prefix refused for eviction.
3. ``pressure``: a stream (turn, observation, prefill, eviction, turn) left idle while nine more
   streams fill the pool (eight idle ones, then a long turn: issue 25's S2); its next turn finds its
   KV evicted, is restored and answered; the same stream run alone first gives the reference.
   Then every stream takes one more turn and all close; the cache is flushed and the pool read.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

PROMPT = [(7 * i + 3) % 250 for i in range(40)]
OBS = [[(5 * i + 11) % 250 for i in range(12)], [(3 * i + 1) % 250 for i in range(9)],
       [(11 * i + 2) % 250 for i in range(6)], [(13 * i + 5) % 250 for i in range(5)]]
EVICT = [(4, 20), (41, 47)]  # part of the prompt and part of turn 1's answer
INVALID = {"already_evicted": [(10, 12)], "pending": [(60, 64)], "outside": [(70, 200)], "reversed": [(30, 25)],
           "overlapping": [(22, 30), (28, 32)], "not_pairs": "oops"}

SIBLING_PROMPT = [(17 * i + 9) % 250 for i in range(48)]
SIBLINGS = 4

PRESSURE_PROMPT = [(19 * i + 4) % 250 for i in range(90)]
PRESSURE_OBS = [[(23 * i + 7) % 250 for i in range(14)], [(29 * i + 1) % 250 for i in range(10)],
                [(31 * i + 3) % 250 for i in range(8)]]
PRESSURE_EVICT = [(91, 94), (98, 102)]  # in turn 1's answer and the first observation
POOL_TOKENS = 1024
FILLERS = 8  # idle streams of FILLER_LEN tokens, then one turn of LONG_TURN tokens: more than the pool holds
FILLER_LEN = 100
LONG_TURN = 300


def wait_for_pool(eng, want: int) -> dict:
    """The RPC socket is not ordered with the request queue that carries a close: give the scheduler a
    bounded moment to free the sessions' KV before reading the pool (a leak still shows after it)."""
    deadline = time.monotonic() + 10
    while (info := eng.pool_info())["stream_tokens"] != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return info


def main_scenario(eng, streams, params, res: dict) -> None:
    from kvstreams_sglang.sglang_ext.engine import KVStreamsRPCError

    sid = streams.open_stream(PROMPT, shared_prefix_len=0)
    turns = []

    def turn(obs):
        if obs is not None:
            streams.append(sid, obs)
        gen, meta = streams.generate(sid, params)
        turns.append(dict(tokens=gen.token_ids, logprobs=gen.logprobs, cached_tokens=meta["cached_tokens"],
                          prompt_tokens=meta["prompt_tokens"]))

    turn(None)
    turn(OBS[0])
    session = streams.session_id(sid)
    before = eng.session_info(session)
    res["pool_before_evict"] = eng.pool_info()
    res["evict"] = eng.evict(session, EVICT)
    streams.ledger(sid).evict(EVICT)  # the client's mirror (EngineStreams.evict does both; split to time it)
    res["before_evict"] = before
    res["pool_after_evict"] = eng.pool_info()
    res["invalid"] = {}
    for name, spans in INVALID.items():
        try:
            eng.evict(session, spans)
            res["invalid"][name] = "accepted"
        except KVStreamsRPCError as e:
            res["invalid"][name] = str(e)
    res["after_invalid"] = eng.session_info(session)
    res["pool_after_invalid"] = eng.pool_info()
    turn(OBS[1])
    # a weight update from tensors that keeps the cache: same values, so logprobs stay comparable
    import glob

    from safetensors.torch import load_file

    weights = {}
    for f in sorted(glob.glob(f"{eng.server_args.model_path}/*.safetensors")):
        weights.update(load_file(f))
    eng.update_weights_from_tensor(list(weights.items()), flush_cache=False)
    res["after_update"] = eng.session_info(session)
    turn(OBS[2])
    res["turns"] = turns
    res["record"] = streams.stream_record(sid).model_dump(mode="json")
    res["main_stats"] = dict(streams.stats)
    streams.close(sid)


def siblings_scenario(eng, params, res: dict) -> None:
    """G siblings' first turns submitted together, as an orchestrator does for one task's group."""
    from kvstreams_sglang.sglang_ext.client import policy_namespace, sglang_sampling_params
    from kvstreams_sglang.sglang_ext.engine import KVStreamsRPCError

    sessions = [eng.open_stream(shared_prefix_len=len(SIBLING_PROMPT), extra_key=policy_namespace(0))
                for _ in range(SIBLINGS)]
    first = SIBLING_PROMPT + [1, 2, 3]  # the first message, then an assistant header

    async def turns():
        return await asyncio.gather(*[
            eng.async_generate(input_ids=first, sampling_params=sglang_sampling_params(params), return_logprob=True,
                               session_params={"id": s}) for s in sessions])

    outs = eng.loop.run_until_complete(turns())
    res["siblings"] = dict(
        cached_tokens=[o["meta_info"]["cached_tokens"] for o in outs], tokens=[o["output_ids"] for o in outs],
        logprobs=[[lp for lp, *_ in o["meta_info"]["output_token_logprobs"]] for o in outs],
        infos=[eng.session_info(s) for s in sessions], pool=eng.pool_info())
    try:
        eng.evict(sessions[0], [(10, 20)])
        res["siblings"]["evict_shared"] = "accepted"
    except KVStreamsRPCError as e:
        res["siblings"]["evict_shared"] = str(e)
    for s in sessions:
        eng.close_session(s)


def pressure_stream(streams, params, sid, between=None) -> list[dict]:
    """The pressure scenario's stream: turn, observation, prefill, eviction, observation, turn, [between],
    observation, turn."""
    out = []

    def turn():
        gen, meta = streams.generate(sid, params)
        out.append(dict(tokens=gen.token_ids, logprobs=gen.logprobs, cached_tokens=meta["cached_tokens"]))

    turn()
    streams.append(sid, PRESSURE_OBS[0])
    streams.prefill(sid)
    streams.evict(sid, PRESSURE_EVICT)
    streams.append(sid, PRESSURE_OBS[1])
    turn()
    if between is not None:
        between()
    streams.append(sid, PRESSURE_OBS[2])
    turn()
    return out


def pressure_scenario(eng, params, res: dict) -> None:
    from kvstreams_sglang.engine import SamplingParams
    from kvstreams_sglang.sglang_ext.client import EngineStreams

    reference = EngineStreams(eng)
    sid = reference.open_stream(PRESSURE_PROMPT)
    res["pressure_reference"] = pressure_stream(reference, params, sid)
    reference.close(sid)

    streams = EngineStreams(eng)
    fillers = []
    short = SamplingParams(max_new_tokens=2, temperature=0.0)  # the fillers only need to hold KV

    def fill_the_pool():
        for i in range(FILLERS + 1):
            n = LONG_TURN if i == FILLERS else FILLER_LEN
            f = streams.open_stream([(37 * j + 11 * i + 5) % 250 for j in range(n)])
            streams.generate(f, short)
            fillers.append(f)
        res["pressure_pool_full"] = eng.pool_info()

    sid = streams.open_stream(PRESSURE_PROMPT)
    res["pressure_turns"] = pressure_stream(streams, params, sid, between=fill_the_pool)
    res["pressure_after_restore"] = dict(streams.stats)
    res["pressure_record"] = streams.stream_record(sid).model_dump(mode="json")
    for f in fillers:  # every idle stream still gets its next turn
        streams.append(f, [7, 8, 9])
        streams.generate(f, short)
    res["pressure_stats"] = dict(streams.stats)
    for f in [sid, *fillers]:
        streams.close(f)


def main(model: str, out: str, kv4rl: bool, overlap: bool, **kv4: int) -> None:
    from kvstreams_sglang.engine import SamplingParams
    from kvstreams_sglang.sglang_ext.client import EngineStreams
    from kvstreams_sglang.sglang_ext.engine import KVStreamsEngine

    eng = KVStreamsEngine(model_path=model, device="cpu", dtype="float32", kv4rl=kv4rl, enable_kv_streams=True,
                          attention_backend=None if kv4rl else "torch_native", sampling_backend="pytorch",
                          grammar_backend="none", max_total_tokens=POOL_TOKENS, skip_server_warmup=True,
                          disable_overlap_schedule=not overlap, log_level="error", **kv4)
    # seconds: per scenario, for the suite's budget
    res: dict = {"pool_start": eng.pool_info(), "seconds": {},
                 "overlap_schedule": not eng.server_args.disable_overlap_schedule}
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    t = time.monotonic()
    main_scenario(eng, EngineStreams(eng), params, res)
    res["pool_after_main"] = wait_for_pool(eng, 0)
    res["seconds"]["main"] = time.monotonic() - t
    for name, scenario in [("siblings", siblings_scenario), ("pressure", pressure_scenario)]:
        t = time.monotonic()
        scenario(eng, params, res)
        res["seconds"][name] = time.monotonic() - t
    res["pool_closed"] = wait_for_pool(eng, 0)
    eng.flush_cache()
    res["pool_end"] = eng.pool_info()
    eng.shutdown()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    flags = sys.argv[3:]
    kv4 = {f.removeprefix("--").replace("-", "_"): int(flags[i + 1]) for i, f in enumerate(flags)
           if f in ("--kv4rl-sink", "--kv4rl-recent")}
    main(sys.argv[1], sys.argv[2], "--kv4rl" in flags, "--disable-overlap-schedule" not in flags, **kv4)
