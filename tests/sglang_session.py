"""Run the real ``sglang.Engine`` (kv-streams, optionally kv4rl) on CPU and dump what the tests check.

    python tests/sglang_session.py MODEL_DIR OUT.json [--kv4rl]

Run as a subprocess (SGLang spawns its scheduler; a scheduler crash SIGQUITs its parent), with
``tests/sglang_cpu_shims`` on PYTHONPATH and ``SGLANG_USE_CPU_ENGINE=1``. One streaming session:
turn 1 (prompt), turn 2 (appended observation), eviction, invalid evictions, turn 3, a
prefill-only turn, a weight update from tensors without flushing, turn 4, close.
"""

from __future__ import annotations

import json
import sys
import time

PROMPT = [(7 * i + 3) % 250 for i in range(40)]
OBS = [[(5 * i + 11) % 250 for i in range(12)], [(3 * i + 1) % 250 for i in range(9)],
       [(11 * i + 2) % 250 for i in range(6)], [(13 * i + 5) % 250 for i in range(5)]]
EVICT = [(4, 20), (41, 47)]  # part of the prompt and part of turn 1's answer
INVALID = {"already_evicted": [(10, 12)], "pending": [(60, 64)], "outside": [(70, 200)], "reversed": [(30, 25)],
           "overlapping": [(22, 30), (28, 32)], "not_pairs": "oops"}


def main(model: str, out: str, kv4rl: bool) -> None:
    import glob

    from safetensors.torch import load_file

    from kvstreams_sglang.engine import SamplingParams
    from kvstreams_sglang.sglang_ext.client import EngineStreams
    from kvstreams_sglang.sglang_ext.engine import KVStreamsEngine, KVStreamsRPCError

    eng = KVStreamsEngine(model_path=model, device="cpu", dtype="float32", kv4rl=kv4rl, enable_kv_streams=True,
                          attention_backend=None if kv4rl else "torch_native", sampling_backend="pytorch",
                          grammar_backend="none", max_total_tokens=2048, skip_server_warmup=True, log_level="error")
    res: dict = {"pool_start": eng.pool_info()}
    streams = EngineStreams(eng)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    sid = streams.open_stream(PROMPT)
    turns = []

    def turn(obs):
        if obs is not None:
            streams.append(sid, obs)
        gen, meta = streams.generate(sid, params)
        turns.append(dict(tokens=gen.token_ids, logprobs=gen.logprobs, cached_tokens=meta["cached_tokens"],
                          prompt_tokens=meta["prompt_tokens"]))

    turn(None)
    turn(OBS[0])
    session = streams._get(sid).session_id
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
    weights = {}
    for f in sorted(glob.glob(f"{model}/*.safetensors")):
        weights.update(load_file(f))
    eng.update_weights_from_tensor(list(weights.items()), flush_cache=False)
    res["after_update"] = eng.session_info(session)
    turn(OBS[2])
    res["turns"] = turns
    res["record"] = streams.stream_record(sid).model_dump(mode="json")
    streams.close(sid)
    # The RPC socket is not ordered with the request queue that carries the close: give the scheduler a
    # bounded moment to free the session's slots before reading the pool (a leak still shows after it).
    deadline = time.monotonic() + 10
    while (info := eng.pool_info())["available_tokens"] != res["pool_start"]["available_tokens"] \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    res["pool_end"] = info
    eng.shutdown()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--kv4rl" in sys.argv[3:])
