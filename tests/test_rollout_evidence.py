"""The GPU evidence benchmarks of issue 11 (``bench.rollout_evidence``) in ``--quick`` mode on the
CPU: the JSON they write and the invariants their numbers must satisfy, plus the pieces they
are built from (byte accounting, episode peaks, the fake-quant attention's region rule)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.replay import EpisodeSpec, Template, episode_peaks, load_episode_pool, sample_episodes
from bench.rollout_common import kv_bytes, size_pool
from bench.sampler_fidelity import FakeQuant, SampledStream, regions

ROOT = Path(__file__).resolve().parent.parent
ROW_KEYS = {"config", "kv_dtype", "execution", "tokens_per_s", "gpu_s_per_100_episodes", "tokens_reprefilled",
            "engine_tokens_reprefilled", "peak_kv_tokens", "peak_kv_bytes", "pool_bytes", "pool_tokens",
            "budget_bytes", "mean_concurrency", "steps", "decode_calls", "generated_tokens", "episodes",
            "max_episode_peak_tokens_measured", "episodes_within_reservation"}


@pytest.fixture(scope="module")
def evidence(tmp_path_factory):
    out = tmp_path_factory.mktemp("evidence") / "evidence.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.rollout_evidence", "--quick", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), out, proc.stdout


def test_quick_run_writes_json_plots_and_table(evidence):
    result, out, stdout = evidence
    assert {"throughput", "concentration", "fidelity", "command", "device", "timings_s"} <= set(result)
    for item in ("throughput", "concentration", "fidelity"):
        assert out.with_name(f"{out.stem}_{item}.png").stat().st_size > 1000
    assert "1. Rollout throughput" in stdout and "2. KV concentration" in stdout and "3. Sampler fidelity" in stdout
    assert result["timings_s"]["total"] < 120


def test_throughput_rows_and_invariants(evidence):
    t = evidence[0]["throughput"]
    rows = {(r["execution"], r["kv_dtype"]): r for r in t["rows"]}
    assert set(rows) == {(e, k) for e in ("kv_streams", "reprefill", "full_context") for k in ("bf16", "kv4rl")}
    for (execution, _kv), r in rows.items():
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["episodes"] == t["episodes"] and r["generated_tokens"] > 0 and r["tokens_per_s"] > 0
        assert r["pool_bytes"] <= r["budget_bytes"]  # every engine's pool fits the same budget
        assert 0 < r["peak_kv_tokens"] <= r["pool_tokens"]
        assert r["episodes_within_reservation"] == r["episodes"]  # admission reserved enough for every stream
        assert r["engine_tokens_reprefilled"] == 0  # the engine computes each stream token once
        if execution == "reprefill":
            assert r["tokens_reprefilled"] > 0
        else:
            assert r["tokens_reprefilled"] == 0
    for kv in ("bf16", "kv4rl"):
        ks, rp, fc = rows[("kv_streams", kv)], rows[("reprefill", kv)], rows[("full_context", kv)]
        # same episodes, same tokens generated; re-prefill recomputes what KV-streams keeps in place
        assert ks["generated_tokens"] == rp["generated_tokens"] == fc["generated_tokens"]
        assert rp["tokens_prefilled"] == ks["tokens_prefilled"] + rp["tokens_reprefilled"]
        # a full-context episode holds more KV than the same episode under the sliding window
        assert fc["max_episode_peak_tokens_measured"] > ks["max_episode_peak_tokens_measured"]
        assert fc["mean_episode_peak_tokens"] > ks["mean_episode_peak_tokens"]
    # the same bytes buy kv4rl more token slots than bf16
    assert rows[("kv_streams", "kv4rl")]["pool_tokens"] > rows[("kv_streams", "bf16")]["pool_tokens"]


def test_concentration_waves_vs_refill(evidence):
    c = evidence[0]["concentration"]
    r, w = c["refill"], c["waves"]
    assert w["decode_calls"] > r["decode_calls"]
    assert w["mean_decode_batch"] < r["mean_decode_batch"]
    assert c["c_kv_measured"] > 1
    assert c["theory"]["e_max_over_e_l_generated"] > 1
    assert set(c["ratios"]) == {"mean_decode_batch", "decode_calls", "mean_resident_kv_tokens", "mean_decode_step_ms"}


def test_fidelity_kl_and_engine_check(evidence):
    f = evidence[0]["fidelity"]
    cfg = f["configs"]
    assert set(cfg) == {"kv8", "kv4_unprotected", "kv4_sink16_recent128", "kv4_sink144", "kv4_recent144"}
    assert all(v["mean_kl"] >= 0 and v["prefixes"] > 20 for v in cfg.values())
    assert cfg["kv8"]["mean_kl"] < cfg["kv4_sink16_recent128"]["mean_kl"] <= cfg["kv4_unprotected"]["mean_kl"]
    assert f["ratio_unprotected_over_protected"] >= 1
    # the fake-quant teacher forcing reproduces the engine's own logprobs at the same tokens
    # (INT4 codes can flip on float noise: a rare max of ~1e-4; an off-by-one region rule gives means ~1e-4)
    ec = f["engine_check"]
    assert ec["bf16"]["max_abs_diff"] < 1e-4
    assert ec["kv4rl"]["max_abs_diff"] < 1e-3 and ec["kv4rl"]["mean_abs_diff"] < 3e-5
    assert ec["kv4rl"]["mean_abs_diff_vs_other_storage"] > 30 * ec["kv4rl"]["mean_abs_diff"]
    assert ec["kv4rl"]["tokens"] > 5
    assert max(ec["kv4rl"]["turns"]) >= 3  # observations appended: several extend steps
    assert max(ec["kv4rl"]["stream_tokens"]) > 16 + 128 + 64  # the INT4 region is exercised


def test_kv_bytes_are_the_pools_bytes():
    from kvstreams_sglang.streams import FullPrecisionPool, KV4Pool

    b = kv_bytes("kv4rl", 36, 8, 128, sink=16, recent=128)
    assert b["per_token"] == KV4Pool.bytes_per_token(36, 8, 128)
    # INT8 codes + fp16 scale, K and V, per side slot: 16 sinks + a ring of 128 + 1 (kv4.cache's spare slot)
    assert b["per_stream"] == 145 * 2 * 36 * 8 * (128 + 2)
    assert kv_bytes("bf16", 36, 8, 128)["per_token"] == FullPrecisionPool.bytes_per_token(36, 8, 128, torch.bfloat16)
    tokens, streams = size_pool(2**30, kv_bytes("bf16", 36, 8, 128), 64, 2000)
    assert streams == 64 and tokens == 2**30 // (2 * 36 * 8 * 128 * 2)
    tokens, streams = size_pool(2**30, b, 64, 2000)
    assert tokens * b["per_token"] + streams * b["per_stream"] <= 2**30 and streams < 64


def test_episode_peaks_and_sampling(tiny_model_path):
    from transformers import AutoTokenizer

    from bench.replay import SYSTEM_PROMPT
    from envs.rollout.chat import ChatRenderer
    from envs.rollout.compaction import CompactionConfig

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_path), SYSTEM_PROMPT)
    ep = EpisodeSpec(100, ((10, 50), (10, 60), (10, 70), (10, 0)))
    # the agent loop itself, without a model: the most live + pending tokens of the episode's stream
    full, window = (episode_peaks([ep], renderer, CompactionConfig(strategy=s, window_turns=2, stride=1))[0]
                    for s in ("full_context", "sliding_window"))
    assert full == ep.total == 100 + 40 + 180
    # window 2: after turn 2 completes the oldest (60 tokens) is evicted: live 100+70, then +80, then +10; the
    # peak is turn 3's observation appended before turn 2 is evicted, less the next assistant header (counted in
    # a recorded observation, appended by the loop with the next turn, after the compaction)
    assert window == 100 + 70 + 80 - len(renderer.assistant_header())
    pool = load_episode_pool()
    assert len(pool) >= 48 and {e.source.split("/")[1] for e in pool} == {"expert", "detour", "random"}
    a, b = sample_episodes(pool, 16, 3), sample_episodes(pool, 16, 3)
    assert a == b and all(e.turns[-1][1] == 0 for e in a)
    template = Template.of(renderer)
    scaled = sample_episodes(pool, 16, 3, length_scale=0.3, template=template)
    assert all(s.first - template.first == max(1, round((e.first - template.first) * 0.3))
               for s, e in zip(scaled, a, strict=True))


def test_fakequant_regions_follow_the_engine_rule():
    # prompt [0, 6) in one extend; sampled tokens at 6, 7, 8 (6, 7 decoded; 8 pending), then 4 appended
    st = SampledStream(list(range(13)), 6, [(3, 4)], [None] * 13)
    start, dec, queries = st.schedule()
    assert queries == [5, 6, 7]
    assert dec.tolist() == [False] * 6 + [True, True] + [False] * 5
    assert start.tolist() == [0] * 6 + [6, 7] + [8] * 5
    fq = FakeQuant("kv4", 1, 2, start, dec)
    full, int8, int4 = regions(fq, torch.arange(13), 13)
    assert torch.equal(full | int8 | int4, torch.ones(13, 13, dtype=torch.bool).tril())
    assert not (full & int8).any() and not (full & int4).any() and not (int8 & int4).any()
    # decode query 7 sees keys 0..7 quantised: protected p < 1 or p > 7 - 2
    assert full[7].sum() == 0 and int8[7].nonzero().flatten().tolist() == [0, 6, 7]
    # extend query 10 (step started at 8): keys 8..10 in full precision, earlier split at end 8
    assert full[10].nonzero().flatten().tolist() == [8, 9, 10]
    assert int8[10].nonzero().flatten().tolist() == [0, 6, 7]
    assert int4[10].nonzero().flatten().tolist() == [1, 2, 3, 4, 5]


def test_chained_episodes_play_recorded_games_back_to_back(tiny_model_path):
    from transformers import AutoTokenizer

    from bench.sampler_fidelity import chained_episodes, text_episodes
    from envs.rollout.chat import ChatRenderer
    from envs.textworld.env import SYSTEM_PROMPT

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_path), SYSTEM_PROMPT)
    eps = text_episodes()
    chains = chained_episodes(eps, renderer, n=3, min_tokens=4000)
    for i, c in enumerate(chains):
        assert c["text_tokens"] >= 4000 and c["games"] > 1
        assert c["text"]["first"] == eps[i]["text"]["first"]  # chain i opens with game i
        turns = c["text"]["turns"]
        assert turns[-1][1] is None and all(obs is not None for _, obs in turns[:-1])  # one end, the chain's
        # the first game's last command is answered by the second game's opening text
        k = len(eps[i]["text"]["turns"])
        assert turns[k - 1] == [eps[i]["text"]["turns"][-1][0], eps[i + 1]["text"]["first"]]
