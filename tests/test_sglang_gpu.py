"""SGLang 0.5.17 with ``--kv4rl`` on a GPU: CUDA graphs on (decode captured whole, prefill "breakable").

Skipped without CUDA or SGLang; ``pytest -k sglang_gpu`` selects these. ``bench/device/sglang_gpu_check.sh`` runs
them on the H200 (the model comes from ``KVSTREAMS_GPU_MODEL`` when set: the script builds it once).

- ``test_sglang_gpu_graph_steps_match_eager``: the backend alone (``tests/sglang_graph_step.py``), its decode steps
  captured in CUDA graphs as SGLang's runner captures them and replayed with padded batches, against the eager path;
  ``..._prefill_graph_steps_...`` the same for extend steps under "full" prefill graphs.
- ``test_sglang_gpu_server_...``: a ``launch_server --kv4rl --enable-kv-streams`` server on a small random Qwen3
  (GQA group 4, head_dim 128: the CUDA decode kernel's shapes), three concurrent multi-turn streams with evictions
  between turns and a weight update from disk (flush_cache=False) between two rounds; its log must show every decode
  step on a CUDA graph, and its logprobs must match the built-in engine's kv4rl logprobs on the same streams.
- ``test_sglang_gpu_graph_steps_ran_the_cuda_kernel`` (last, so a missing NVRTC does not hide the rest): the graph
  path ran the shipped CUDA decode kernel, not the Triton fallback.

Each test prints what it measured before asserting (the device run keeps the output).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
                                reason="needs a CUDA GPU and sglang")

TESTS = Path(__file__).parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))
import sglang_graph_step as graph_steps  # noqa: E402

# the streams, the built-in engine's replay of them and the comparison: bench.sglang_parity (its CLI tells a gap's
# sources on any device); MAX_DIFF / MEAN_DIFF: SGLang (CUDA graphs) vs the built-in engine, both kv4rl in bf16
from bench.sglang_parity import (  # noqa: E402
    MAX_DIFF,
    MEAN_DIFF,
    MODEL_FLAGS,
    PROMPTS,
    ROUNDS,
    SHARED_PREFIX,
    UPDATE_BEFORE_ROUND,
    Turn,
    builtin_rounds,
    gap,
)
from bench.sglang_servers import answers, wait_serving  # noqa: E402
from harness.trainer import free_port  # noqa: E402


def env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def graph_steps_result(tmp_path_factory) -> dict:
    res = graph_steps.run(tmp_path_factory.mktemp("graph_steps") / "steps.json", "cuda", env())
    for s in res["steps"]:
        print({k: s[k] for k in ("rows", "bs", "max_diff", "mean_diff", "ref_abs_mean", "kernels")})
    return res


def test_sglang_gpu_graph_steps_match_eager(graph_steps_result):
    """Each decode step replayed from a captured CUDA graph (padded to a captured batch size) equals the same hooks
    launched eagerly bit for bit, writes the same KV bytes as the eager path wherever a real request can read, never
    touches row 0's INT8 entries, and matches the eager path's outputs up to the split layout (a graph plan sizes
    each request's splits from its own length; the eager plan from the step's longest: fp32 sums in another order)."""
    steps = graph_steps_result["steps"]
    for s in steps:
        assert s["replay_equals_hooks"], s
        assert s["caches_equal"] and s["row0_side_untouched"] and s["padding_lists_empty"], s
        assert s["max_diff"] <= 3e-2 and s["mean_diff"] <= 1e-3, s
    assert {s["bs"] > len(s["rows"]) for s in steps} == {True, False}
    # each batch size's planning captured in a graph of its own (DecodePlanGraph), replayed before the step's
    assert graph_steps_result["plan_graphs_captured"] == sorted(graph_steps.CAPTURE_BS), graph_steps_result


def test_sglang_gpu_prefill_graph_steps_match_eager(tmp_path):
    """``--cuda-graph-backend-prefill full``: each extend step replayed from a graph captured per token bucket over
    fixed request slots equals the same hooks launched eagerly bit for bit, writes the same KV bytes as the eager path
    wherever a real request can read, never touches row 0's INT8 entries, and matches the eager outputs up to the
    launch layout (the graph's grid covers a request holding the whole bucket, unsplit; the eager one is sized from
    the step: fp32 sums in another order)."""
    res = graph_steps.run(tmp_path / "prefill.json", "cuda", env(), prefill=True)
    for s in res["steps"]:
        print({k: s[k] for k in ("reqs", "bucket", "tokens", "max_diff", "bitwise")})
        assert s["replay_equals_hooks"], s
        assert s["caches_equal"] and s["row0_side_untouched"], s
        assert s["max_diff"] <= 3e-2, s


# ---- the server ----

@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    if os.environ.get("KVSTREAMS_GPU_MODEL"):
        return Path(os.environ["KVSTREAMS_GPU_MODEL"])
    path = tmp_path_factory.mktemp("qwen3_small")
    subprocess.run([sys.executable, "-m", "kvstreams_sglang.checkpoints", str(path), *MODEL_FLAGS, "--device", "cuda"],
                   env=env(), check=True, timeout=300)
    return path


@contextlib.contextmanager
def kv4rl_server(model_path: Path, log: Path, *extra: str):
    """(URL, log path) of a kv4rl + kv-streams server with SGLang's default CUDA graphs, at small capture sizes."""
    port = free_port()
    flags = ["--model-path", str(model_path), "--kv4rl", "--enable-kv-streams", "--grammar-backend", "none",
             "--skip-tokenizer-init", "--mem-fraction-static", "0.5", "--port", str(port), "--skip-server-warmup",
             "--max-running-requests", "8", "--cuda-graph-bs-decode", "1", "2", "4", "8",
             "--cuda-graph-bs-prefill", "16", "32", "64", "128", "256", "512", "1024",  # few buckets: a quick capture
             "--context-length", "4096", "--decode-log-interval", "1",
             # logprobs from an fp32 LM head, as the built-in engine and the trainer compute them (SGLang's default
             # bf16 head alone puts ~1e-2 on every logprob: H200, 2026-12-02, max 4.3e-2 / mean 9.5e-3)
             "--enable-fp32-lm-head",
             # norms, RoPE, activation and projections rounded as HF rounds them (the built-in engine runs HF's model):
             # without it, on the CPU in bf16, max 2.0e-2 / mean 6.6e-3 on this model's shape (bit-equal with it)
             "--hf-numerics", *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvstreams_sglang.launch_server", *flags], env=env(), stdout=f,
                                stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, log, lambda: answers(url + "/get_model_info"), timeout_s=420)
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        out = os.environ.get("OUT")
        if out:  # the device script keeps the server log
            (Path(out) / f"sglang_gpu_{log.stem}.log").write_text(log.read_text()[-2_000_000:])


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    with kv4rl_server(model_path, tmp_path_factory.mktemp("sglang_gpu") / "server.log") as s:
        yield s


async def sglang_rounds(url: str, model_path: Path) -> dict:
    from kvstreams_sglang.engine import SamplingParams
    from kvstreams_sglang.sglang_ext.client import SGLangClient

    client = SGLangClient(url, kv_dtype="kv4rl")
    sids = [await client.open(list(p), shared_prefix_len=SHARED_PREFIX) for p in PROMPTS]
    out = {"turns": [], "pools": []}

    async def turn(t: Turn):
        sid = sids[t.stream]
        if t.spans:
            await client.evict(sid, t.spans)
        if t.obs:
            await client.append(sid, list(t.obs))
        return await client.generate(sid, SamplingParams(max_new_tokens=t.new, temperature=0.0))

    for i, round_ in enumerate(ROUNDS):
        if i == UPDATE_BEFORE_ROUND:
            before = await client.pool_info()
            await client.update_weights_from_disk(str(model_path), version=1)  # same weights, flush_cache=False
            out["pools"] = [before, await client.pool_info()]
        gens = await asyncio.gather(*(turn(t) for t in round_))
        out["turns"].append([(g.token_ids, g.logprobs) for g in gens])
    out["stats"] = dict(client.stats)
    for s in sids:
        await client.close(s)
    await client.aclose()
    return out


def noise_floor(sglang_turns: list, reference: list, model_path: Path) -> dict:
    """Where the SGLang-vs-built-in gap comes from (printed, not asserted): SGLang against the built-in engine
    running each turn alone, the built-in engine against itself batched and alone (bf16 GEMMs round by batch shape),
    its bf16-KV run against its kv4rl run, and SGLang against built-in bf16 KV."""
    def pair(a: list, b: list) -> tuple[float, float]:
        g = gap(a, b)
        return round(g["max"], 5), round(g["mean"], 6)

    one_by_one = builtin_rounds(model_path, sglang_turns)
    bf16 = builtin_rounds(model_path, sglang_turns, kv_dtype="bf16", batched=True)
    return {"sglang_kv4rl_vs_builtin_one_by_one": pair(sglang_turns, one_by_one),
            "builtin_kv4rl_batched_vs_one_by_one": pair(reference, one_by_one),
            "builtin_kv4rl_vs_builtin_bf16": pair(reference, bf16),
            "sglang_kv4rl_vs_builtin_bf16": pair(sglang_turns, bf16)}


def graph_lines(log: str, kind: str) -> list[tuple[int, bool]]:
    """(running requests, ran on a CUDA graph) of every '<kind> batch' log line."""
    pat = re.compile(rf"{kind} batch.*?#running-req: (\d+).*?cuda graph: (True|False)")
    return [(int(m.group(1)), m.group(2) == "True") for m in pat.finditer(log)]


def test_sglang_gpu_server_kv4rl_graphs_match_builtin_engine(server, model_path):
    url, log_path = server
    res = asyncio.run(sglang_rounds(url, model_path))
    log = log_path.read_text()
    decode, prefill = graph_lines(log, "Decode"), graph_lines(log, "Prefill")
    # the reference batches each round's turns as the server ran them (the streams concurrently)
    builtin = builtin_rounds(model_path, res["turns"], batched=True)
    g = gap(res["turns"], builtin)
    total = sum(len(t) for r in res["turns"] for t, _ in r)
    before, after = res["pools"]
    print(f"decode steps logged: {len(decode)}, on a CUDA graph: {sum(g for _, g in decode)} (running requests: "
          f"{sorted({r for r, _ in decode})}); prefill batches on a graph: {sum(g for _, g in prefill)}/{len(prefill)}")
    print(f"client stats {res['stats']}; pool before/after the weight update {before} / {after}")
    print(f"compared {g['compared']}/{total} logprobs (per stream {g['per_stream']}); |diff| max {g['max']:.2e} mean "
          f"{g['mean']:.2e}")
    print("gap sources (max, mean):", noise_floor(res["turns"], builtin, model_path))

    assert decode and all(g for _, g in decode), "a decode step ran without a CUDA graph"
    assert max(r for r, _ in decode) == 3  # a batch padded to a captured size (4)
    assert any(g for _, g in prefill), "no prefill ran on the breakable prefill graph"
    # the streams kept every computed token's KV through evictions and the weight update: nothing re-prefilled
    assert res["stats"]["cached_tokens_lost"] == 0 and res["stats"]["turns_across_updates"] == len(PROMPTS)
    assert before["available_tokens"] == after["available_tokens"] and before["kv_bytes"] == after["kv_bytes"]
    assert all(c > 0 for c in g["per_stream"])
    assert g["max"] <= MAX_DIFF and g["mean"] <= MEAN_DIFF


def test_sglang_gpu_batch_invariant_server_matches_builtin_engine(model_path, tmp_path):
    """``--kv4rl-batch-invariant``: the server's GEMMs, norm means and attention plans are the invariant engine's, so a
    stream's logprobs no longer depend on what the scheduler batched it with or on the graph's padding rows: the
    reference is the built-in engine with ``batch_invariant``, one turn at a time and batched alike. Same thresholds
    as the default server's test."""
    with kv4rl_server(model_path, tmp_path / "invariant_server.log", "--kv4rl-batch-invariant") as (url, log_path):
        res = asyncio.run(sglang_rounds(url, model_path))
        log = log_path.read_text()
    decode = graph_lines(log, "Decode")
    batched = builtin_rounds(model_path, res["turns"], batched=True, invariant=True)
    alone = builtin_rounds(model_path, res["turns"], invariant=True)
    g, g_alone, g_self = gap(res["turns"], batched), gap(res["turns"], alone), gap(batched, alone)
    print(f"batch-invariant server: |diff| max {g['max']:.2e} mean {g['mean']:.2e} ({g['compared']} logprobs); vs "
          f"the invariant engine one turn at a time {g_alone['max']:.2e} / {g_alone['mean']:.2e}; that engine batched "
          f"vs alone {g_self['max']:.2e} / {g_self['mean']:.2e}; decode steps on a graph "
          f"{sum(x for _, x in decode)}/{len(decode)}")
    assert decode and all(x for _, x in decode), "a decode step ran without a CUDA graph"
    assert "--kv4rl-batch-invariant: batch-invariant matmuls" in log
    # the reference itself, batched or alone: only the fp32 LM head's cuBLAS order is left (~1e-6)
    assert g_self["max"] <= 1e-5
    assert all(c > 0 for c in g["per_stream"])
    assert g["max"] <= MAX_DIFF and g["mean"] <= MEAN_DIFF


def test_sglang_gpu_graph_steps_ran_the_cuda_kernel(graph_steps_result):
    """Last: the captured decode was the shipped CUDA kernel (where it is unavailable the Triton kernel runs, and the
    tests above still hold)."""
    assert all(set(s["kernels"]) == {"cuda"} for s in graph_steps_result["steps"])


def test_sglang_gpu_harness_trains_three_steps_against_the_server(server, model_path, tmp_path):
    """The harness (configs/demo.toml: the toy corridor, Sliding Window KV-streams) trains 3 steps on the GPU against
    the kv4rl server: weights go over from disk with flush_cache=False after every step, compaction evicts in place,
    nothing is re-prefilled and no cached token is lost."""
    import json

    from harness.config import load_config
    from harness.run import run

    url, _ = server
    cfg = load_config(str(ROOT / "configs/demo.toml"), [
        "--run.output_dir", str(tmp_path / "run"), "--run.steps", "3", "--model.path", str(model_path),
        "--inference.engine", "sglang", "--inference.url", url, "--inference.kv_dtype", "kv4rl",
        "--inference.device", "cuda", "--orchestrator.group_size", "2", "--orchestrator.groups_per_step", "2",
        "--orchestrator.oversubscription", "2", "--orchestrator.episode.max_turns", "6",
        "--orchestrator.episode.max_new_tokens", "4", "--trainer.micro_batch_records", "4"])
    rows = asyncio.run(run(cfg))
    out = os.environ.get("OUT")
    if out:  # the device script keeps the metrics
        (Path(out) / "harness_sglang_gpu.metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    last = rows[-1]
    print("harness on the GPU server:", {k: v for k, v in last.items() if k.startswith("sglang_")}, "re-prefilled",
          sum(r["tokens_reprefilled"] for r in rows), "compactions", sum(r["compactions"] for r in rows))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert sum(r["compactions"] for r in rows) > 0 and sum(r["tokens_reprefilled"] for r in rows) == 0
    assert last["sglang_turns"] > 0 and last["sglang_cached_tokens_lost"] == 0
