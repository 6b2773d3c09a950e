"""Host cost of a KV stream's in-place eviction in SGLang's scheduler (``KVStreamRadixCache.evict_spans``).

Why: the scheduler runs a turn's eviction in the step that admits the turn, on the CPU, while the GPU runs
the previous batch; past a step's length its cost idles the GPU. A py-spy profile of the long-games rollout
on an H100 put ``evict_spans`` at ~9% of the scheduler's time (~1 ms a call). This times it on the real
SGLang classes (``RadixCache``, ``TokenToKVPoolAllocator``, ``ReqToTokenPool`` on the CPU) for a stream
shaped like the long games under Sliding Window: a shared prompt, then ``--live`` private tokens, each turn
evicting the oldest ``--turn`` tokens after the prompt and appending a computed turn of that length.

    python -m bench.stream_cache_cost --out bench/results/stream_cache_cost_cpu.json
    python -m bench.stream_cache_cost --growth 20,80 --out bench/results/stream_cache_growth_cpu.json

``--growth``: the tree work per turn of a stream that never evicts, with and without merging its private branch
into one node after each turn (``KVStreamRadixCache._merge_branch``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
import types
from array import array
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _cache(size: int):
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from kvstreams_sglang.sglang_ext.stream_cache import KVStreamRadixCache

    class _Pool:  # what the allocator asks of its KV pool
        device = "cpu"

    alloc = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", _Pool(), need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(8, 65536, "cpu", False),
                             token_to_kv_pool_allocator=alloc, page_size=1)
    return KVStreamRadixCache(params), alloc


def _session(tokens: list[int]):
    """A streaming session as ``sessions`` reads it: one finished request holding the stream's tokens."""
    req = types.SimpleNamespace(output_ids=array("q"), sampling_params=types.SimpleNamespace(max_new_tokens=0))
    session = types.SimpleNamespace(session_id="s", _inflight=False, streaming=True,
                                    req_nodes={0: types.SimpleNamespace(req=req)})
    _set_tokens(session, tokens)
    return session


def _set_tokens(session, tokens) -> None:
    req = session.req_nodes[0].req
    req.origin_input_ids = req.origin_input_ids_unpadded = req.full_untruncated_fill_ids = array("q", tokens)
    session.committed_origin_len = len(tokens)


def evict_cost(live: int, prompt: int = 76, turn: int = 200, turns: int = 60) -> dict:
    """Median and p90 ms of ``evict_spans`` over ``turns`` turns of a stream holding ``live`` tokens."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    size = 2 * live + turn * turns
    cache, alloc = _cache(size)
    state = cache.open_stream("s", prompt, None)
    state.prompt = array("q", range(1000, 1000 + prompt))
    tokens = list(range(1000, 1000 + live))
    cache.insert(InsertParams(key=state.key(tokens), value=alloc.alloc(live)))
    cache._split_at_prefix(state, state.key(tokens))
    state.live = list(range(live))
    session = _session(tokens)
    times = []
    for t in range(turns):
        start = state.live[prompt]
        t0 = time.perf_counter()
        cache.evict_spans(session, [[start, start + turn]])
        times.append(time.perf_counter() - t0)
        cur = list(session.req_nodes[0].req.origin_input_ids)
        toks = cur + list(range(50_000 + t * turn, 50_000 + (t + 1) * turn))  # the next turn, computed
        slots = torch.cat([cache._slots(state, cur), alloc.alloc(turn)])
        cache.insert(InsertParams(key=state.key(toks), value=slots))
        state.live.extend(range(state.computed + state.offset, len(toks) + state.offset))
        _set_tokens(session, toks)
    # the stream is whole, and each eviction freed exactly its tokens' slots
    assert state.computed == live and len(cache._slots(state, toks)) == live
    assert cache.evictable_size() == live and alloc.available_size() == size - live, (
        cache.evictable_size(), alloc.available_size(), size, live)
    times.sort()
    return dict(live_tokens=live, evicted_per_call=turn, calls=turns, median_ms=statistics.median(times) * 1e3,
                p90_ms=times[int(0.9 * (len(times) - 1))] * 1e3)


def growth_cost(turns: int = 80, turn: int = 154, prompt: int = 76, merge: bool = True, last: int = 10) -> dict:
    """A stream that never evicts (full context, or the turns before a window fills): per turn, the tree work of
    SGLang's hooks -- the turn's ``match_prefix``, the insert and re-match of ``cache_unfinished_req`` -- then, with
    ``merge``, ``_merge_branch`` as ``cache_finished_req`` ends (without it, each turn leaves one more node on the
    branch, as before the merge). Median ms of the last ``last`` turns, and the branch's nodes at the end."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    size = prompt + turn * turns + 16
    cache, alloc = _cache(size)
    state = cache.open_stream("s", prompt, None)
    tokens = list(range(1000, 1000 + prompt))
    state.prompt = array("q", tokens)
    slots, times = torch.empty(0, dtype=torch.int64), []
    for t in range(turns):
        toks = tokens + list(range(50_000 + t * turn, 50_000 + (t + 1) * turn))
        key = state.key(toks)
        t0 = time.perf_counter()
        hit = RadixCache.match_prefix(cache, MatchPrefixParams(key=key)).device_indices
        new = alloc.alloc(len(toks) - len(hit))
        cache.insert(InsertParams(key=key, value=torch.cat([hit, new])))
        cache._split_at_prefix(state, key)
        again = RadixCache.match_prefix(cache, MatchPrefixParams(key=key)).device_indices
        state.live.extend(range(state.computed, len(toks)))
        if merge:
            cache._merge_branch(state, array("q", toks))
        times.append(time.perf_counter() - t0)
        slots = torch.cat([slots, new])
        assert torch.equal(again, slots)
        tokens = toks
    # the stream's slots are those it was given, in order, and all of its KV is evictable cache
    assert torch.equal(cache._slots(state, tokens), slots) and cache.evictable_size() == len(tokens)
    nodes, node = 0, cache._find_branch(state)
    while node is not None:
        nodes += 1
        node = next(iter(node.children.values()), None)
    tail = sorted(times[-last:])
    return dict(turns=turns, tokens_per_turn=turn, stream_tokens=len(tokens), merge=merge, branch_nodes=nodes,
                last_turns_median_ms=statistics.median(tail) * 1e3)


SERVER_HOOKS = ("match_prefix", "cache_unfinished_req", "cache_finished_req")


def server_turns(turns: int = 80, turn: int = 150, kv4rl: bool = True, work: Path | None = None) -> list[dict]:
    """The same growth through a real server: our SGLang server on the CPU (a tiny model), one stream of ``turns``
    turns of ``turn`` new tokens and 4 sampled ones, nothing evicted; per turn, the scheduler's host time in the
    stream cache's hooks (``/kvstreams/host_clock`` differenced around the turn)."""
    import asyncio
    import tempfile

    from harness.trainer import free_port
    from kvstreams_sglang.checkpoints.tiny_model import build_tiny_model
    from kvstreams_sglang.engine import SamplingParams
    from kvstreams_sglang.sglang_ext.client import SGLangClient
    from kvstreams_sglang.sglang_ext.host_clock import clock_difference

    from .sglang_servers import OURS, Server, ServerConfig, cpu_flags_env

    work = Path(work or tempfile.mkdtemp(prefix="stream_host_"))
    model = build_tiny_model(work / "model")
    flags, env = cpu_flags_env(turns * (turn + 8) + 4096)
    flags += ["--enable-kv-streams", *(["--kv4rl"] if kv4rl else [])]
    rows = []
    with Server(ServerConfig("ours", OURS), str(model), free_port(), work / "server.log", flags=flags, env=env) as srv:
        async def run():
            client = SGLangClient(srv.url, kv_dtype="kv4rl" if kv4rl else "bf16")
            params = SamplingParams(max_new_tokens=4, temperature=0.0)
            try:
                sid = await client.open([1 + i % 200 for i in range(turn)], shared_prefix_len=0)
                for t in range(turns):
                    if t:
                        await client.append(sid, [1 + (t * 7 + i) % 200 for i in range(turn)])
                    before = await client.host_clock()
                    await client.generate(sid, params)
                    after = await client.host_clock()
                    spent = clock_difference(before, after)
                    rows.append(dict(turn=t, stream_tokens=client.ledger(sid).end,
                                     **{h: round(spent.get(h, {}).get("ms", 0.0), 3) for h in SERVER_HOOKS}))
            finally:
                await client.aclose()

        asyncio.run(run())
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", default="1000,3500,10000", help="live private tokens per stream, comma-separated")
    ap.add_argument("--turn", type=int, default=200, help="tokens evicted (and appended) per turn")
    ap.add_argument("--growth", default="", help="instead: streams of this many turns without eviction, comma-"
                    "separated, each with and without merging the branch after a turn (``growth_cost``)")
    ap.add_argument("--server-turns", type=int, default=0, help="instead: one stream of this many turns through our "
                    "SGLang server on the CPU, the scheduler's host time per hook and turn (``server_turns``)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.server_turns:
        from .sglang_servers import unwind_on_sigterm

        unwind_on_sigterm()  # a SIGTERM stops the server too (its own process group), as in every serving bench
        turns = server_turns(args.server_turns)
        rows = [dict(stream_tokens_from=part[0]["stream_tokens"], stream_tokens_to=part[-1]["stream_tokens"],
                     **{f"{h}_median_ms": statistics.median(r[h] for r in part) for h in SERVER_HOOKS},
                     **{f"{h}_max_ms": max(r[h] for r in part) for h in SERVER_HOOKS})
                for part in (turns[i: i + 20] for i in range(0, len(turns), 20))]
        for r in rows:
            print(r)
        rows = dict(per_20_turns=rows, turns=turns)
    elif args.growth:
        rows = [growth_cost(int(n), merge=merge) for n in args.growth.split(",") for merge in (False, True)]
        for r in rows:
            print(f"{r['turns']:>4} turns ({r['stream_tokens']} tokens), merge {r['merge']!s:>5}: "
                  f"{r['branch_nodes']:>3} branch nodes, last turns' tree work {r['last_turns_median_ms']:.3f} ms")
    else:
        rows = [evict_cost(int(n), turn=args.turn) for n in args.live.split(",")]
        for r in rows:
            print(f"live {r['live_tokens']:>6}: evict_spans median {r['median_ms']:.3f} ms, p90 {r['p90_ms']:.3f} ms")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = dict(command="python -m bench.stream_cache_cost " + " ".join(argv or os.sys.argv[1:]),
                  commit=commit.strip(), machine=f"{platform.processor() or platform.machine()}, "
                  f"{os.cpu_count()} cores", torch=torch.__version__, rows=rows)
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
