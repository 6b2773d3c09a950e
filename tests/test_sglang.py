"""The real SGLang engine (``sglang==0.5.17``) with kv-streams and kv4rl, on CPU.

Each engine runs in a subprocess (``tests/sglang_session.py``: SGLang spawns its scheduler and
a scheduler crash SIGQUITs its parent) with the CPU import shims of ``tests/sglang_cpu_shims``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvstreams_sglang.engine import Engine
from trainer_masks import StreamRecord
from trainer_masks.scoring import stream_logprobs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="sglang not installed (make sglang-cpu)")

TESTS = Path(__file__).parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))
import sglang_session as script  # noqa: E402
from ports import free_port  # noqa: E402


def sglang_env() -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "sglang_cpu_shims"), str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    return env


def run_session(model: Path, out: Path, *flags: str) -> dict:
    proc = subprocess.run([sys.executable, str(TESTS / "sglang_session.py"), str(model), str(out), *flags],
                          env=sglang_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"sglang session failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def bf16_run(tiny_model_path, tmp_path_factory):
    return run_session(tiny_model_path, tmp_path_factory.mktemp("sgl") / "bf16.json")


@pytest.fixture(scope="module")
def kv4_run(tiny_model_path, tmp_path_factory):
    return run_session(tiny_model_path, tmp_path_factory.mktemp("sgl") / "kv4.json", "--kv4rl")


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def model_logprobs(run) -> torch.Tensor:
    return torch.tensor([lp for t in run["turns"] for lp in t["logprobs"]], dtype=torch.float64)


def test_sglang_logprobs_equal_trainer_replay(bf16_run, hf_model):
    """Model-dtype KV: the engine's logprobs over a session with an in-place eviction equal
    ``stream_logprobs`` on the session's StreamRecord (positions kept, eviction mask)."""
    record = StreamRecord.model_validate(bf16_run["record"])
    assert [e.at_index for e in record.evictions] and record.meta["engine"] == "sglang"
    with torch.no_grad():
        lp = stream_logprobs(hf_model, record, impl="sdpa").double()
    idx = [i for i, s in enumerate(record.sources) if s == "model"]
    assert len(idx) == 4 * 6
    diff = (lp[idx] - model_logprobs(bf16_run)).abs()
    print(f"sglang bf16-format KV vs trainer: max |diff| {diff.max():.2e}")
    assert float(diff.max()) <= 1e-4


def builtin_kv4_turns(model: Path) -> list[tuple[list[int], list[float]]]:
    """The same session on our built-in engine with kv4rl KV."""
    eng = Engine(str(model), kv_dtype="kv4rl", max_tokens=2048, max_streams=4, dtype=torch.float32)
    sid = eng.open_stream(script.PROMPT)
    out = []
    for t, obs in enumerate([None, *script.OBS[:3]]):
        if obs is not None:
            eng.append(sid, obs)
        gen = eng.generate(sid, max_new_tokens=6, temperature=0.0)
        out.append((gen.token_ids, gen.logprobs))
        if t == 1:
            eng.evict(sid, script.EVICT)
    return out


def test_kv4rl_logprobs_equal_builtin_engine(kv4_run, tiny_model_path, hf_model):
    builtin = builtin_kv4_turns(tiny_model_path)
    assert [t["tokens"] for t in kv4_run["turns"]] == [toks for toks, _ in builtin]
    ours = torch.tensor([lp for _, lps in builtin for lp in lps], dtype=torch.float64)
    diff = (model_logprobs(kv4_run) - ours).abs()
    record = StreamRecord.model_validate(kv4_run["record"])
    with torch.no_grad():
        lp = stream_logprobs(hf_model, record, impl="sdpa").double()
    idx = [i for i, s in enumerate(record.sources) if s == "model"]
    gap = (lp[idx] - model_logprobs(kv4_run)).abs()
    print(f"sglang kv4rl vs built-in kv4rl: max |diff| {diff.max():.2e}; train/infer gap (kv4rl vs trainer) "
          f"mean {gap.mean():.2e} max {gap.max():.2e}")
    assert kv4_run["pool_start"]["pool"] == "KV4TokenToKVPool"
    assert float(diff.max()) <= 1e-4


@pytest.mark.parametrize("run", ["bf16_run", "kv4_run"])
def test_no_reprefill_after_eviction(run, request):
    r = request.getfixturevalue(run)
    t1, t2, t3, t4 = r["turns"]
    live_after_evict = r["evict"]["live_tokens"]
    assert live_after_evict == r["before_evict"]["live_tokens"] - sum(b - a for a, b in script.EVICT)
    # turn 3 reuses every kept token; only the pending sampled token and the observation run
    assert t3["cached_tokens"] == live_after_evict
    assert t3["prompt_tokens"] == live_after_evict + 1 + len(script.OBS[1])
    assert t2["cached_tokens"] == len(script.PROMPT) + len(t1["tokens"]) - 1  # no re-prefill between turns either
    assert t4["cached_tokens"] > t3["cached_tokens"]


@pytest.mark.parametrize("run", ["bf16_run", "kv4_run"])
def test_eviction_frees_exactly_those_slots_and_compacts_the_row(run, request):
    r = request.getfixturevalue(run)
    before, after = r["before_evict"], r["evict"]
    dead = {p for a, b in script.EVICT for p in range(a, b)}
    kept = [(s, p) for s, p in zip(before["slots"], before["positions"], strict=True) if p not in dead]
    assert after["slots"] == [s for s, _ in kept]
    assert after["positions"] == [p for _, p in kept]
    assert r["pool_after_evict"]["available_tokens"] - r["pool_before_evict"]["available_tokens"] == len(dead)
    assert after["evicted"] == len(dead) and after["stream_length"] == before["stream_length"]


@pytest.mark.parametrize("run", ["bf16_run", "kv4_run"])
def test_invalid_spans_are_rejected_and_change_nothing(run, request):
    r = request.getfixturevalue(run)
    for name, message in r["invalid"].items():
        assert message != "accepted" and "EvictionError" in message, (name, message)
    assert "were already evicted" in r["invalid"]["already_evicted"]
    assert "pending" in r["invalid"]["pending"]
    assert "overlap" in r["invalid"]["overlapping"]
    assert r["after_invalid"] == {k: v for k, v in r["evict"].items() if k != "evicted"}
    assert r["pool_after_invalid"] == r["pool_after_evict"]


@pytest.mark.parametrize("run", ["bf16_run", "kv4_run"])
def test_weight_update_without_flush_keeps_the_session(run, request):
    r = request.getfixturevalue(run)
    t4 = r["turns"][3]
    assert r["after_update"]["live_tokens"] > r["evict"]["live_tokens"]
    assert t4["cached_tokens"] == r["after_update"]["live_tokens"]


@pytest.mark.parametrize("run", ["bf16_run", "kv4_run"])
def test_pool_back_to_its_start_after_close(run, request):
    r = request.getfixturevalue(run)
    assert r["pool_end"]["available_tokens"] == r["pool_start"]["available_tokens"] == r["pool_start"]["total_tokens"]
    assert r["pool_end"]["open_sessions"] == 0


def test_kv4rl_capacity_sizing(kv4_run, bf16_run, tiny_model_path):
    """Capacity is computed with INT4's real bytes per token, and the pool allocates what was assumed."""
    cfg = json.loads((tiny_model_path / "config.json").read_text())
    layers, heads, d = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    bf16_cell = 2 * layers * heads * d * 2  # SGLang's MHA cell size for a bf16 KV cache
    info = kv4_run["pool_start"]
    ratio = bf16_cell / info["cell_bytes"]
    print(f"token capacity per byte: kv4rl / bf16 = {ratio:.3f}")
    assert 3.6 <= ratio <= 3.8
    side = (info["max_running_requests"] + 1) * (16 + 128) * 2 * layers * heads * (d + 2)  # rows 1..max (0 pads)
    assert info["kv_bytes"] == info["cell_bytes"] * (info["total_tokens"] + 1) + side
    assert bf16_run["pool_start"]["cell_bytes"] == bf16_cell * 2  # fp32 KV in the parity run: 4 bytes/element


def test_server_args_validation(tiny_model_path):
    code = """
import sys
from kvstreams_sglang.sglang_ext.server_args import KVStreamsServerArgs, ServerArgsError
cases = {
    "page": dict(enable_kv_streams=True, page_size=16),
    "backend": dict(kv4rl=True, attention_backend="triton"),
    "dtype": dict(kv4rl=True, kv_cache_dtype="fp8_e5m2"),
    "sink": dict(kv4rl=True, kv4rl_sink=-1),
}
for name, kw in cases.items():
    try:
        KVStreamsServerArgs(model_path=sys.argv[1], device="cpu", **kw)
        print(name, "ACCEPTED")
    except ServerArgsError as e:
        print(name, "|", e)
a = KVStreamsServerArgs(model_path=sys.argv[1], device="cpu", kv4rl=True, enable_kv_streams=True)
print("ok", a.attention_backend, a.page_size, a.disable_radix_cache, a.enable_streaming_session,
      a.disable_overlap_schedule, a.max_running_requests)
"""
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_model_path)], env=sglang_env(), capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ACCEPTED" not in out, out
    assert "--page-size must be 1" in out and "drop --attention-backend" in out and "--kv-cache-dtype" in out
    assert "ok kv4rl 1 True True True 256" in out


def wait_ready(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"SGLang server exited ({server.returncode}):\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(url + "/get_model_info", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"SGLang server not ready after {timeout_s}s:\n{log.read_text()[-6000:]}")


@pytest.fixture(scope="module")
def kv4rl_server(tiny_model_path, tmp_path_factory):
    """A ``--kv4rl --enable-kv-streams`` SGLang HTTP server on the tiny model (its URL), shared by the tests below."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("sglang_server") / "server.log"
    with open(log, "w") as f:
        server = subprocess.Popen(
            [sys.executable, "-m", "kvstreams_sglang.launch_server", "--model-path", str(tiny_model_path),
             "--device", "cpu", "--dtype", "float32", "--kv4rl", "--enable-kv-streams", "--sampling-backend",
             "pytorch", "--grammar-backend", "none", "--max-total-tokens", "16384", "--max-running-requests", "16",
             "--port", str(port), "--skip-server-warmup", "--log-level", "warning"],
            env=sglang_env(), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_ready(url, server, log)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_a_stream_keeps_its_kv_across_a_weight_update_from_disk(kv4rl_server, tiny_model_path, tmp_path):
    """The harness's weight sync in a fixed order: a stream takes a turn, is compacted in place, the trainer's
    (changed) weights reach the server from disk with flush_cache=False, and the stream's next turn finds every
    kept token cached (nothing re-prefilled); the turn counts as one across an update and its tokens carry the
    new policy version."""
    import asyncio

    from harness.config import InferenceConfig
    from harness.inference import SGLangInference
    from kvstreams_sglang.engine import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    changed = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    inference = SGLangInference(InferenceConfig(engine="sglang", url=kv4rl_server, kv_dtype="kv4rl"),
                                str(tiny_model_path), tmp_path)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)

    async def episode():
        await inference.start()
        c = inference.client
        sid = await c.open(script.PROMPT)
        old = [await c.generate(sid, params)]
        await c.append(sid, script.OBS[0])
        old.append(await c.generate(sid, params))
        live = c.ledger(sid).num_live
        evicted = await c.evict(sid, script.EVICT)
        assert c.ledger(sid).num_live == live - evicted
        await inference.update_weights(changed, version=1)
        await c.append(sid, script.OBS[1])
        new = await c.generate(sid, params)
        record = await c.close(sid)
        await inference.close()
        return old, new, evicted, record, dict(c.stats)

    old, new, evicted, record, stats = asyncio.run(episode())
    assert evicted == sum(b - a for a, b in script.EVICT)
    assert stats == dict(turns=3, turns_across_updates=1, cached_tokens_lost=0), stats
    versions = [v for v, s in zip(record.policy_versions, record.sources, strict=True) if s == "model"]
    assert versions == [0] * sum(len(g.token_ids) for g in old) + [1] * len(new.token_ids)


def test_harness_trains_textworld_on_an_sglang_server(kv4rl_server, tiny_model_path, tmp_path):
    """Three trainer steps on real TextWorld games against the kv4rl + kv-streams SGLang server: weights go over
    with flush_cache=False, compaction evicts in place, and nothing is re-prefilled."""
    import asyncio

    from harness.config import load_config
    from harness.run import run

    cfg = load_config(str(ROOT / "configs/textworld/sliding_window.toml"), [
        "--run.output_dir", str(tmp_path / "run"), "--run.steps", "3", "--model.path", str(tiny_model_path),
        "--inference.engine", "sglang", "--inference.url", kv4rl_server, "--inference.kv_dtype", "kv4rl",
        "--compaction.max_turns", "2", "--compaction.budget", "4096", "--orchestrator.group_size", "2",
        "--orchestrator.groups_per_step", "1", "--orchestrator.oversubscription", "4",
        "--orchestrator.max_turns", "8", "--orchestrator.max_tokens",
        "4096", "--orchestrator.max_new_tokens", "6", "--orchestrator.env_in_thread", "false",
        "--environment.options", '{presets = ["short"], n_train = 4, n_eval = 0, max_steps = 6}',
        "--trainer.lr", "1e-3"])
    rows = asyncio.run(run(cfg))
    assert [r["step"] for r in rows] == [0, 1, 2]
    last = rows[-1]
    print({k: v for k, v in last.items() if k.startswith("sglang_")}, "compactions",
          sum(r["compactions"] for r in rows))
    assert sum(r["compactions"] for r in rows) > 0 and sum(r["tokens_reprefilled"] for r in rows) == 0
    assert last["sglang_turns"] > 0
    # Episodes that run across a weight update (how many depends on the trainer's speed against the server's:
    # the test above makes one in a fixed order) find all their kept KV still on the server.
    assert last["sglang_cached_tokens_lost"] == 0
