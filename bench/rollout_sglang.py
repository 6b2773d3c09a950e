"""Issue 22: multi-turn agent rollouts on real SGLang servers -- stock SGLang re-prefilling the compacted
context vs ours evicting it in place (KV-streams), in bf16 / fp8 / KV4-RL KV.

    python -m bench.rollout_sglang --model /tmp/qwen3-4b --out $OUT/rollout_sglang_h200.json [--quick]
    python -m bench.rollout_sglang --model /tmp/qwen3-4b --study concentration --out $OUT/kv_conc.json
    python -m bench.rollout_sglang merge $OUT/a.json $OUT/b.json --out bench/results/rollout_sglang_h200.json
    bash bench/device/rollout_check.sh [quick|stock|ours|concentration]  # the H200 commands (bundle, checkpoint)

Recorded TextWorld episodes (``bench/data/textworld_turns.json``, texts scaled by ``--length-scale``; ``--games long``:
longer games of 30-60 recorded turns, the long-horizon regime KV-streams is for) are replayed
through the real agent loop (``bench.replay``: ``envs.rollout.agent_loop.run_episode`` with the real compaction
strategies; each episode is its own loop, an observation of its recorded length after every action, every
message bounded to its recorded length) against one server per configuration, started in turn (``SETUPS``):

1. ``stock_bf16``: ``python -m sglang.launch_server --attention-backend flashinfer``, bf16 KV, radix cache on;
   compaction by re-prefill (``PlainClient``: every turn sends the stream's whole context; after a compaction the
   kept tokens go as a new request, and whatever the radix cache no longer shares is prefilled again).
2. ``stock_fp8``: the same with ``--kv-cache-dtype fp8_e4m3``.
3. ``streams_bf16``: ours, ``--enable-kv-streams`` (flashinfer), bf16 KV; eviction in place (``SGLangClient``).
4. ``streams_kv4rl``: ours, ``--kv4rl --enable-kv-streams``.
5. ``kv4rl_full``: ours, ``--kv4rl --enable-kv-streams``, full context (no compaction). Sessions, not the radix
   cache: with the radix cache a request that shares a cached prefix gets a new request row, whose INT8 side
   cache (the kv4rl sink / recent copies, per row) does not hold the prefix's.

All: ``--grammar-backend none --skip-tokenizer-init`` (random weights, byte tokenizer), the same
``--mem-fraction-static`` (from ``--static-gib``: the same GiB on any card) and ``--max-running-requests``
(``--ours-max-running-requests``: the kv4rl servers' own, whose rows each hold an INT8 side row out of the KV
memory), CUDA graphs on where the server supports them (the
decode log says whether steps ran one), ``--enable-metrics`` with the device timer (GPU time per forward mode).
The same episodes, seeds and strategies (Sliding Window, Markovian Thinker, Summary: a random model writes a
random summary of ``--summary-tokens``) on every server.

A run (one server, one strategy) keeps a pool of episodes running (continuous refill): an episode starts when
its reservation -- the most tokens its stream holds at once, measured by the same loop without a model
(``bench.replay.episode_peaks``) -- fits the server's KV pool next to the running ones' (``Gate``), at most
``--max-running-requests`` less ``--free-rows`` at once (SGLang 0.5.17 admits a request only while a request row
is free, also a streaming session's next turn, which reuses the row its session holds: with every row held by
an open session no turn can start, a deadlock seen on the CPU build; free rows also bound how many turns one
prefill step can admit). The episode list is long enough that the KV pool, not the client, limits
concurrency; the JSON says what did (``concurrency.limited_by``: the share of time the next episode waited for
KV, for a batch slot, or did not wait). After ``--warmup`` s the run is measured for ``--duration`` s (shrunk to
fit ``--budget-s`` for the whole bench), then no episode starts and running ones end at their next turn.

Per run, over the measured window: output tokens/s; episodes/s (finished in the window); GPU-seconds per 100
episodes (the window's wall time on the one GPU over finished episodes); prefill tokens computed (the scheduler's
"Prefill batch" lines: #new-token) and re-prefilled (kept tokens computed again: the loop's count of kept,
already-computed tokens at each re-prefill compaction, less what the radix cache still shared at the new
request, plus tokens the server had lost from a live stream); resident KV tokens and bytes, peak and mean (the
live tokens of every open stream, sampled every 0.1 s; bytes from ``streams/pool.py``'s bytes per token; also
the scheduler's own count of non-evictable tokens from its "Decode batch" lines); mean concurrency (admitted
episodes, time-weighted; running requests from the decode lines); and time per engine step split into prefill
and decode (device time per forward mode from ``/metrics`` over the step counts of the log lines). Targets
(``targets``) are evaluated in the JSON, with the per-step profile of both sides where one is missed.

``--study concentration``: synchronous waves vs continuous refill (``bench.kv_concentration``) on one server,
full context, long-tailed episode lengths (``bench.replay.long_tailed_episodes``): C_KV and the step-latency
ratio next to the KV4-RL paper's 8.27x active batch and 4.52x step latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvstreams_sglang.sglang_ext.host_clock import clock_difference

from .replay import (
    DATA,
    SYSTEM_PROMPT,
    EpisodeSpec,
    Finished,
    Gate,
    Replay,
    Template,
    episode_config,
    episode_peaks,
    episode_peaks_in_processes,
    expected_max_over_mean,
    length_stats,
    load_episode_pool,
    long_tailed_episodes,
    sample_episodes,
    sizing_pool,
)
from .sglang_servers import (
    OURS,
    STOCK,
    Server,
    ServerConfig,
    cpu_flags_env,
    decode_lines,
    metric_total,
    prefill_lines,
    unwind_on_sigterm,
)
from .trace_summary import summarize_dir

DEFAULT_OUT = Path(__file__).parent / "results" / "rollout_sglang_h200.json"
DECODE_LOG_INTERVAL = 10  # sglang_servers.COMMON
FORWARD_SECONDS = "sglang:forward_execution_seconds_total"


@dataclass(frozen=True)
class Setup:
    """One configuration: its server, the client (``stock``: ``PlainClient``, re-prefill; ``streams``:
    ``SGLangClient``, in place) and its KV format."""

    server: ServerConfig
    label: str
    client: str
    kv: str  # bf16 | fp8 | kv4rl
    strategies: tuple[str, ...] | None = None  # None: the bench's strategies

    @property
    def name(self) -> str:
        return self.server.name

    @property
    def execution(self) -> str:
        return "reprefill" if self.client == "stock" else "kv_streams"


SETUPS = {s.name: s for s in (
    Setup(ServerConfig("stock_bf16", STOCK, ("--attention-backend", "flashinfer")), "1 stock bf16, re-prefill",
          "stock", "bf16"),
    Setup(ServerConfig("stock_fp8", STOCK, ("--attention-backend", "flashinfer", "--kv-cache-dtype", "fp8_e4m3")),
          "2 stock fp8, re-prefill", "stock", "fp8"),
    Setup(ServerConfig("streams_bf16", OURS, ("--enable-kv-streams", "--attention-backend", "flashinfer")),
          "3 ours bf16, KV-streams", "streams", "bf16"),
    Setup(ServerConfig("streams_kv4rl", OURS, ("--kv4rl", "--enable-kv-streams")), "4 ours kv4rl, KV-streams",
          "streams", "kv4rl"),
    Setup(ServerConfig("kv4rl_full", OURS, ("--kv4rl", "--enable-kv-streams")), "5 ours kv4rl, full context",
          "streams", "kv4rl", ("full_context",)),
)}
STRATEGIES = ("sliding_window", "markovian_thinker", "summary")


CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "textworld"


def compaction(strategy: str, execution: str, a) -> object:
    """The strategy's compaction as the project runs it: ``[compaction]`` of ``--strategy-configs``/STRATEGY.toml
    (TextWorld's, the KV-streams paper's settings: Sliding Window and Markovian Thinker evict at 10 live turns, Summary
    every 10 turns), with ``--window``, ``--markovian-turns`` and ``--summary-turns`` overriding the trigger. The
    replayed summary is ``--summary-tokens`` long (a random model writes to its cap; a config's cap is not a length)."""
    import tomllib

    from envs.rollout.compaction import CompactionConfig

    if strategy == "full_context":
        return CompactionConfig(strategy="full_context")
    path = Path(a.strategy_configs) / f"{strategy}.toml"
    if strategy not in STRATEGIES or not path.exists():
        raise ValueError(f"unknown strategy {strategy!r} (no {path})")
    c = tomllib.loads(path.read_text()).get("compaction", {})
    if c.get("strategy", strategy) != strategy:
        raise ValueError(f"{path}: [compaction] strategy is {c['strategy']!r}, not {strategy!r}")
    c = dict(c, strategy=strategy, execution=execution)
    turns = {"sliding_window": a.window, "markovian_thinker": a.markovian_turns, "summary": a.summary_turns}[strategy]
    if strategy == "summary":
        c["summary_max_tokens"] = a.summary_tokens
        if turns is not None:
            c.update(every_k_turns=turns)
    elif turns is not None:
        c.update(window_turns=turns, stride=1 if strategy == "sliding_window" else max(turns // 2, 1))
    return CompactionConfig(**c)


def compaction_settings(a, strategies) -> dict:
    """Each strategy's trigger as run (the JSON's ``settings.compaction``)."""
    keys = ("window_turns", "stride", "every_k_turns", "budget", "summary_max_tokens")
    out = {}
    for st in strategies:
        c = compaction(st, "kv_streams", a)
        out[st] = {k: getattr(c, k) for k in keys if k in c.model_fields_set or k in ("window_turns", "stride")}
    return out


# ---- one server's flags, per device ----


def server_for(setup: Setup, a, port: int, log_dir: Path) -> Server:
    rows = a.ours_max_running_requests if setup.kv == "kv4rl" and a.ours_max_running_requests else \
        a.max_running_requests
    flags = ["--max-running-requests", str(rows), "--enable-metrics"]
    env = {}
    cfg = setup.server
    if a.device == "cpu":  # CI: the CPU build of SGLang with the test shims (tests/sglang_cpu_shims)
        if setup.kv == "fp8":
            raise ValueError("fp8 KV needs a GPU")
        cfg = dataclasses.replace(cfg, flags=tuple("torch_native" if f == "flashinfer" else f for f in cfg.flags))
        cpu_flags, env = cpu_flags_env(a.max_total_tokens)
        flags += cpu_flags
    else:
        flags += ["--cuda-graph-max-bs-decode", str(rows)]
        flags += ["--mem-fraction-static", str(a.mem_fraction)] if a.mem_fraction is not None else []
        prefill_graph = a.ours_prefill_graph if setup.client != "stock" and a.ours_prefill_graph else a.prefill_graph
        if prefill_graph == "full" and setup.client != "stock" and a.ours_prefill_graph_slots:
            # SGLang's JSON form: the request slots a "full" prefill graph holds (default chunked_prefill_size // 512)
            flags += ["--cuda-graph-config", json.dumps({"prefill": {
                "backend": "full", "full_prefill_max_req": a.ours_prefill_graph_slots}})]
        elif prefill_graph != "default":
            flags += ["--cuda-graph-backend-prefill", prefill_graph]
        env = {"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"}
    flags += turn_batching_flags(a.turn_batching, a.turn_batch_max_delay_ms)
    return Server(cfg, a.model, port, log_dir / f"server_{setup.name}.log", flags=flags, env=env)


def turn_batching_flags(ratio: float, max_delay_ms: float) -> list[str]:
    """The same prefill-holding rule on every server, stock and ours (KV streams keep overlap scheduling, which it
    needs): SGLang's prefill delayer, queue trigger."""
    if not ratio:
        return []
    return ["--enable-prefill-delayer", "--prefill-delayer-queue-min-ratio", str(ratio),
            "--prefill-delayer-max-delay-ms", str(max_delay_ms)]


def model_dims(model: str) -> tuple[int, int, int, str]:
    """Layers, KV heads, head dim and dtype of a checkpoint (what KV bytes per token depend on)."""
    c = json.loads((Path(model) / "config.json").read_text())
    return (c["num_hidden_layers"], c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"]
            // c["num_attention_heads"], str(c.get("dtype") or c.get("torch_dtype") or "bfloat16"))


def kv_bytes(setup: Setup, model: str, device: str) -> dict:
    """Bytes per KV token of ``setup``'s pool and per open stream (kv4rl's INT8 side cache rows): the pools' own
    definitions (``kvstreams_sglang.streams.pool``, through ``rollout_common.kv_bytes``)."""
    import torch

    from .rollout_common import kv_bytes as pool_bytes

    dtype = {"fp8": torch.float8_e4m3fn, "kv4rl": None,
             "bf16": torch.float32 if device == "cpu" else torch.bfloat16}[setup.kv]  # the CPU build runs fp32
    return pool_bytes(setup.kv, *model_dims(model)[:3], dtype=dtype)


# ---- one run ----


class Meter:
    """An ``EngineClient`` proxy that knows the open streams (resident KV = their live tokens) and when each
    generation ended with how many tokens."""

    def __init__(self, client):
        self.client = client
        self.open_sids: set[int] = set()
        self.generated: list[tuple[float, int]] = []

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def open(self, stream):
        sid = await self.client.open(stream)
        self.open_sids.add(sid)
        return sid

    async def close(self, sid, **meta):
        self.open_sids.discard(sid)
        return await self.client.close(sid, **meta)

    async def generate(self, sid, params):
        gen = await self.client.generate(sid, params)
        self.generated.append((time.perf_counter(), len(gen.token_ids)))
        return gen

    def resident_tokens(self) -> int:
        return sum(self.client.ledger(s).num_live for s in self.open_sids)


@dataclass
class Snapshot:
    t: float
    log_offset: int
    metrics: list
    client_stats: dict
    cpu_s: float
    host_clock: dict | None = None  # ours: the scheduler's host time per hook so far (``sglang_ext.host_clock``)


def flush_or_why(server: Server) -> str | None:
    """Empty the server's radix cache; why not, when SGLang refuses (requests left behind by a run cut at its
    timeout), so the caller records it and goes on."""
    try:
        server.flush_cache()
    except (OSError, RuntimeError) as e:
        return repr(e)
    return None


def snapshot(server: Server, client) -> Snapshot:
    try:
        metrics = server.metrics()
    except OSError:
        metrics = []
    host_clock = None
    if server.config.module == OURS:
        try:
            host_clock = server.host_clock()
        except OSError:
            pass
    return Snapshot(time.perf_counter(), len(server.log_text()), metrics, dict(client.stats), time.process_time(),
                    host_clock)


def scheduler_host(s: Snapshot, e: Snapshot, window_s: float, turns: int, steps: int) -> dict | None:
    """Ours: the scheduler's host time in our hooks over the window (``host_clock``), per hook: calls, ms per call,
    ms per turn and per step, share of the window. ``handle_generate_request`` includes SGLang's request creation
    and the turn's ``evict_spans`` and ``begin_turn``."""
    diff = clock_difference(s.host_clock, e.host_clock)
    if not diff:
        return None
    return {name: dict(d, ms_per_turn=d["ms"] / turns if turns else None,
                       ms_per_step=d["ms"] / steps if steps else None,
                       share_of_window=d["ms"] / 1000.0 / window_s if window_s else None)
            for name, d in sorted(diff.items(), key=lambda kv: -kv[1]["ms"])}


def make_client(setup: Setup, url: str):
    if setup.client == "stock":
        from kvstreams_sglang.sglang_ext.plain_client import PlainClient

        return PlainClient(url, kv_dtype=setup.kv)
    from kvstreams_sglang.sglang_ext.client import SGLangClient

    return SGLangClient(url, kv_dtype=setup.kv)


async def run_once(server: Server, setup: Setup, replay: Replay, specs: list[EpisodeSpec], reserved: list[int], *,
                   capacity: int, max_batch: int, warmup_s: float, duration_s: float | None,
                   waves: bool = False, timeout_s: float = 300.0, profile: tuple[Path, int] | None = None,
                   pyspy_dir: Path | None = None) -> dict:
    """Replay ``specs`` against ``server``. ``duration_s``: measure ``[warmup, warmup + duration]`` and stop then;
    None: run every episode and measure all of it (the concentration study). A run still going ``timeout_s``
    after its window (a stuck server) is cancelled and says so (``hung``). ``profile`` (directory, steps): the
    server's torch profiler records that many steps from the window's start (``bench.trace_summary``).
    ``pyspy_dir``: py-spy samples the server's scheduler and this process (the client) over the window
    (``bench.pyspy``); the run's ``pyspy`` holds both summaries."""
    meter = Meter(make_client(setup, server.url))
    gate = Gate(capacity, max_batch, waves=waves)
    t0 = time.perf_counter()
    w0 = t0 + (warmup_s if duration_s is not None else 0.0)
    # the window's end: ``duration_s`` after its start as measured (the opening snapshot), however late the
    # monitor's tick took it on a loaded host
    w1 = w0 + duration_s if duration_s is not None else float("inf")
    marks: dict[str, Snapshot] = {}
    samples: list[tuple[float, int, int, str | None, int, int]] = []  # t, admitted, reserved, waiting, kv, open
    lag: list[float] = []
    spies: dict = {}

    def stopped() -> bool:
        return time.perf_counter() >= w1

    async def monitor():
        nonlocal w1
        if duration_s is None:
            marks["start"] = snapshot(server, meter)
        while True:
            due = time.perf_counter() + 0.1
            await asyncio.sleep(0.1)
            now = time.perf_counter()
            lag.append(now - due)
            if "start" not in marks and now >= w0:
                marks["start"] = snapshot(server, meter)
                w1 = marks["start"].t + duration_s
                if profile:
                    asyncio.get_running_loop().run_in_executor(None, start_profile, server, *profile)
                if pyspy_dir is not None and duration_s is not None:
                    spies.update(start_pyspy(server, pyspy_dir, duration_s))
            if w0 <= now <= w1:
                samples.append((now, gate.active, gate.reserved, gate.waiting_for, meter.resident_tokens(),
                                len(meter.open_sids)))
            if "end" not in marks and now >= w1:
                marks["end"] = snapshot(server, meter)
                await gate.close()

    from .replay import run_replay

    watcher = asyncio.create_task(monitor())
    hung = False
    try:
        done = await asyncio.wait_for(
            run_replay(meter, enumerate(specs), replay, gate, stop=stopped if duration_s else None,
                       reservations=dict(enumerate(reserved)), return_exceptions=True),
            timeout=(warmup_s + duration_s if duration_s is not None else 0.0) + timeout_s)
    except TimeoutError:
        done, hung = [TimeoutError(f"the run was still going {timeout_s:.0f} s after its window")], True
    finally:
        watcher.cancel()
        await meter.aclose()
    end = time.perf_counter()
    if "start" not in marks:
        marks["start"] = snapshot(server, meter)
    # every episode finished before the window closed (not: the replay stopped at the window's end before the
    # monitor's next tick took the closing snapshot)
    exhausted = end < w1
    if "end" not in marks:
        marks["end"] = snapshot(server, meter)
    s, e = marks["start"], marks["end"]
    spied = finish_pyspy(spies, duration_s) if spies else None
    failed = [x for x in done if isinstance(x, BaseException)]
    finished = [x for x in done if isinstance(x, Finished)]
    in_window = [f for f in finished if not f.truncated and s.t <= f.ended <= e.t]
    return dict(window=(s, e), wall_s=end - t0, samples=samples, finished=finished, in_window=in_window,
                failed=failed, exhausted=exhausted and not hung, hung=hung, lag=lag, meter=meter, gate=gate,
                episodes_offered=len(specs), pyspy=spied)


def start_pyspy(server: Server, directory: Path, seconds: float) -> dict:
    """py-spy recorders on ``server``'s scheduler and on this process, for ``seconds`` (a diagnostic: a recorder
    that cannot start is reported, the run goes on)."""
    from . import pyspy

    pids = {"client": os.getpid()}
    sched = pyspy.scheduler_pid(server.proc.pid) if server.proc is not None else None
    if sched is not None:
        pids["scheduler"] = sched
    try:
        procs = pyspy.start(list(pids.values()), seconds=seconds, out_dir=directory)
    except OSError as e:
        print(f"py-spy not started: {e}", flush=True)
        return {}
    return dict(pids=pids, procs=procs, directory=directory, missing=[] if sched else ["scheduler"])


def finish_pyspy(spies: dict, seconds: float) -> dict:
    from . import pyspy

    errors = pyspy.finish(spies["procs"])
    out = {name: pyspy.summarize(spies["directory"] / f"{pid}.txt", seconds=seconds)
           for name, pid in spies["pids"].items() if (spies["directory"] / f"{pid}.txt").exists()}
    return dict(out, errors=errors, not_found=spies["missing"])


def start_profile(server: Server, directory: Path, steps: int) -> None:
    """SGLang's torch profiler on ``server`` for its next ``steps`` steps (CPU and GPU activity), traces into
    ``directory``; it stops by itself."""
    import urllib.request

    directory.mkdir(parents=True, exist_ok=True)
    body = json.dumps(dict(output_dir=str(directory.resolve()), num_steps=steps, activities=["CPU", "GPU"],
                           record_shapes=False, with_stack=False)).encode()
    req = urllib.request.Request(server.url + "/start_profile", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
    except OSError as e:  # a profile is a diagnostic: the run goes on without it
        print(f"start_profile failed: {e!r}", flush=True)


def step_profile(text: str, m0: list, m1: list, window_s: float) -> dict:
    """Prefill and decode steps of a window of the scheduler's log, with the forward passes' device time per
    mode (``/metrics``, device timer; None where the server has none, e.g. on a CPU)."""
    pre, dec = prefill_lines(text), decode_lines(text)
    out = dict(window_s=window_s)

    def seconds(category: str) -> float | None:
        a, b = metric_total(m0, FORWARD_SECONDS, category=category), metric_total(m1, FORWARD_SECONDS,
                                                                                  category=category)
        return None if b is None else b - (a or 0.0)

    gpu_pre, gpu_dec = seconds("extend"), seconds("decode")
    steps_dec = len(dec) * DECODE_LOG_INTERVAL
    out["prefill"] = dict(steps=len(pre), tokens=sum(x.new_tokens for x in pre),
                          cached_tokens=sum(x.cached_tokens for x in pre),
                          tokens_per_step=statistics.fmean(x.new_tokens for x in pre) if pre else 0.0,
                          mean_queued_requests=statistics.fmean(x.queued for x in pre) if pre else 0.0,
                          gpu_s=gpu_pre, ms_per_step=1000 * gpu_pre / len(pre) if pre and gpu_pre else None)
    out["decode"] = dict(steps=steps_dec, mean_batch=statistics.fmean(x.running for x in dec) if dec else 0.0,
                         gpu_s=gpu_dec, ms_per_step=1000 * gpu_dec / steps_dec if steps_dec and gpu_dec else None,
                         # the log's own interval time (10 decode steps and the prefill steps between them)
                         ms_per_step_log=statistics.median(x.ms_per_step for x in dec) if dec else None,
                         cuda_graph=all(x.cuda_graph for x in dec) if dec else None)
    out["kv_tokens_server"] = dict(peak=max((x.tokens for x in dec), default=0),
                                   mean=statistics.fmean(x.tokens for x in dec) if dec else 0.0)
    if gpu_pre is not None and gpu_dec is not None:
        out["gpu_busy_s"] = gpu_pre + gpu_dec
        out["gpu_busy_share"] = (gpu_pre + gpu_dec) / window_s if window_s else None
        out["prefill_share_of_busy"] = gpu_pre / (gpu_pre + gpu_dec) if gpu_pre + gpu_dec else None
    return out


def summarize(run: dict, setup: Setup, strategy: str, server: Server, bytes_: dict, pool_tokens: int) -> dict:
    s, e = run["window"]
    window = e.t - s.t
    text = server.log_text()[s.log_offset:e.log_offset]
    eps = [f.episode for f in run["in_window"]]
    n = len(eps)
    out_tokens = sum(k for t, k in run["meter"].generated if s.t <= t <= e.t)
    client = {k: e.client_stats[k] - s.client_stats.get(k, 0) for k in e.client_stats}
    # re-prefill: kept tokens the loop re-opened already computed, less the prefix the radix cache still
    # shared with the new request (stock), plus tokens the server lost from a live stream (either client)
    by_compaction = sum(x.stats.tokens_reprefilled for x in eps)
    still_cached = sum(r.meta.get("server", {}).get("first_cached_tokens", 0) for x in eps for r in x.records[1:])
    lost = client.get("cached_tokens_lost", 0)
    reprefilled = by_compaction - still_cached + lost
    prof = step_profile(text, s.metrics, e.metrics, window)
    samples = run["samples"]
    kv = [x[4] for x in samples] or [0]
    kv_bytes_ = [x[4] * bytes_["per_token"] + x[5] * bytes_["per_stream"] for x in samples] or [0]
    waits = [x[3] for x in samples]
    wait_share = {k: (waits.count(k) / len(waits) if waits else 0.0) for k in ("kv", "batch", None)}
    limited_by = ("episode list" if run["exhausted"] else
                  max(("kv", "batch"), key=lambda k: wait_share[k]) if wait_share["kv"] + wait_share["batch"] > 0.5
                  else "client (the next episode rarely waited for admission)")
    row = dict(
        config=setup.name, label=setup.label, strategy=strategy, execution=setup.execution, kv_format=setup.kv,
        window_s=window, warmup_and_drain_s=run["wall_s"] - window, episodes_completed=n,
        episodes_per_s=n / window if window else 0.0, episodes_per_s_interval=completions_interval(n, window),
        gpu_s_per_100_episodes=100 * window / n if n else None,  # the GPU is the server's for the whole window
        gpu_busy_s_per_100_episodes=100 * prof["gpu_busy_s"] / n if n and "gpu_busy_s" in prof else None,
        output_tokens=out_tokens, output_tokens_per_s=out_tokens / window if window else 0.0,
        prefill_tokens_computed=prof["prefill"]["tokens"],
        prefill_tokens_computed_per_episode=prof["prefill"]["tokens"] / n if n else None,
        reprefilled_tokens=reprefilled, reprefilled_tokens_per_episode=reprefilled / n if n else None,
        reprefill_detail=dict(kept_computed_tokens_reopened=by_compaction, still_cached_at_reopen=still_cached,
                              lost_from_live_streams=lost),
        compactions_per_episode=statistics.fmean(x.stats.compactions for x in eps) if eps else 0.0,
        kv=dict(pool_tokens=pool_tokens, bytes_per_token=bytes_["per_token"],
                side_bytes_per_stream=bytes_["per_stream"],
                resident_peak_tokens=max(kv), resident_mean_tokens=statistics.fmean(kv),
                resident_peak_bytes=max(kv_bytes_), resident_mean_bytes=statistics.fmean(kv_bytes_),
                server_used_peak_tokens=prof["kv_tokens_server"]["peak"],
                server_used_mean_tokens=prof["kv_tokens_server"]["mean"]),
        concurrency=dict(mean_admitted=statistics.fmean(x[1] for x in samples) if samples else 0.0,
                         peak_admitted=run["gate"].peak_active, capacity_tokens=run["gate"].capacity,
                         max_batch=run["gate"].max_batch,
                         mean_running_requests=prof["decode"]["mean_batch"],
                         waiting_share={str(k): v for k, v in wait_share.items()}, limited_by=limited_by),
        step_profile=prof,
        scheduler_host=scheduler_host(s, e, window, client.get("turns", 0),
                                      prof["prefill"]["steps"] + prof["decode"]["steps"]),
        client=dict(stats=client, cpu_share=(e.cpu_s - s.cpu_s) / window if window else None,
                    loop_lag_ms_mean=1000 * statistics.fmean(run["lag"]) if run["lag"] else None,
                    loop_lag_ms_max=1000 * max(run["lag"], default=0.0)),
        episodes_failed=len(run["failed"]), first_failure=repr(run["failed"][0])[:500] if run["failed"] else None,
        episodes_truncated=sum(f.truncated for f in run["finished"]), episode_list_exhausted=run["exhausted"],
        hung=run["hung"],
    )
    return row


# ---- targets ----


def completions_interval(n: int, window_s: float) -> list[float]:
    """95% interval of an episode rate from ``n`` completions in ``window_s`` (Poisson, normal approximation):
    a 15 s window completes 15-40 long episodes, so one run's rate is uncertain by 30-50%."""
    if not window_s:
        return [0.0, 0.0]
    half = 1.96 * n ** 0.5
    return [max(0.0, n - half) / window_s, (n + half) / window_s]


def ratio_interval(ra: dict, rb: dict) -> list[float] | None:
    """The episodes/s ratio's range from both runs' completion intervals (conservative: the ends combined).
    The ratio of output tokens/s (``ratio_by_output_tokens``) measures the same work with far less noise:
    both servers replay the same episode list, so generated tokens per episode are alike."""
    (a0, a1), (b0, b1) = (completions_interval(r["episodes_completed"], r["window_s"]) for r in (ra, rb))
    return [a0 / b1, a1 / b0] if b0 > 0 else None


def targets(runs: list[dict]) -> list[dict]:
    """The issue's targets on ``runs`` (episodes per GPU-second = episodes/s on one GPU)."""
    by = {(r["config"], r["strategy"]): r for r in runs}
    strategies = sorted({r["strategy"] for r in runs if r["strategy"] != "full_context"})
    out = []

    def ratio_target(name, a, b, strategy, factor, strict=False):
        ra, rb = by.get((a, strategy)), by.get((b, strategy))
        t = dict(target=name, strategy=strategy, numerator=a, denominator=b, factor=factor)
        if not ra or not rb or not rb["episodes_per_s"]:
            return dict(t, met=None, why="not measured")
        x = ra["episodes_per_s"] / rb["episodes_per_s"]
        met = x > factor if strict else x >= factor
        t.update(ratio=x, met=met, ratio_interval=ratio_interval(ra, rb),
                 ratio_by_output_tokens=(ra["output_tokens_per_s"] / rb["output_tokens_per_s"]
                                         if rb["output_tokens_per_s"] else None))
        if not met:
            t["where_the_time_goes"] = {c: profile_line(r) for c, r in ((a, ra), (b, rb))}
        return t

    if "sliding_window" in strategies:
        out.append(ratio_target("config 4 >= 3x config 1 in episodes per GPU-second (Sliding Window)",
                                "streams_kv4rl", "stock_bf16", "sliding_window", 3.0))
    for st in strategies:
        out.append(ratio_target(f"config 3 > config 1 ({st})", "streams_bf16", "stock_bf16", st, 1.0, strict=True))
    for st in strategies:
        out.append(ratio_target(f"config 4 >= 2x config 2 ({st})", "streams_kv4rl", "stock_fp8", st, 2.0))
    ours = [r for r in runs if r["execution"] == "kv_streams"]
    out.append(dict(target="0 re-prefilled tokens in configs 3-5 while memory suffices",
                    met=all(r["reprefilled_tokens"] == 0 for r in ours) if ours else None,
                    reprefilled={f"{r['config']}/{r['strategy']}": r["reprefilled_tokens"] for r in ours}))
    return out


def print_targets(ts: list[dict]) -> None:
    for t in ts:
        line = f"target {t['target']}: {'met' if t['met'] else 'MISSED' if t['met'] is False else 'n/a'}"
        if "ratio" in t:
            lo_hi = t.get("ratio_interval")
            line += f" ({t['ratio']:.2f}x" + (f", 95% {lo_hi[0]:.2f}-{lo_hi[1]:.2f}x" if lo_hi else "")
            line += (f"; output tokens/s {t['ratio_by_output_tokens']:.2f}x)" if t.get("ratio_by_output_tokens")
                     else ")")
        print(line)


def profile_line(r: dict) -> dict:
    p = r["step_profile"]
    return dict(episodes_per_s=r["episodes_per_s"], mean_admitted=r["concurrency"]["mean_admitted"],
                limited_by=r["concurrency"]["limited_by"], decode_ms_per_step=p["decode"]["ms_per_step"],
                decode_ms_per_step_log=p["decode"]["ms_per_step_log"], decode_mean_batch=p["decode"]["mean_batch"],
                decode_steps=p["decode"]["steps"], decode_cuda_graph=p["decode"]["cuda_graph"],
                prefill_ms_per_step=p["prefill"]["ms_per_step"], prefill_steps=p["prefill"]["steps"],
                prefill_tokens_per_episode=r["prefill_tokens_computed_per_episode"],
                reprefilled_tokens_per_episode=r["reprefilled_tokens_per_episode"],
                gpu_busy_share=p.get("gpu_busy_share"), prefill_share_of_busy=p.get("prefill_share_of_busy"),
                output_tokens_per_s=r["output_tokens_per_s"])


# ---- plot ----


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    configs = list(dict.fromkeys(r["config"] for r in runs))
    strategies = list(dict.fromkeys(r["strategy"] for r in runs))
    by = {(r["config"], r["strategy"]): r for r in runs}
    panels = (("episodes/s", lambda r: r["episodes_per_s"]), ("output tokens/s", lambda r: r["output_tokens_per_s"]),
              ("mean admitted episodes", lambda r: r["concurrency"]["mean_admitted"]),
              ("decode ms/step", lambda r: r["step_profile"]["decode"]["ms_per_step"]
               or r["step_profile"]["decode"]["ms_per_step_log"] or 0.0),
              ("prefill tokens / episode", lambda r: r["prefill_tokens_computed_per_episode"] or 0.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4))
    width = 0.8 / max(1, len(strategies))
    for ax, (title, get) in zip(axes, panels, strict=True):
        for j, st in enumerate(strategies):
            xs = [i + j * width for i, c in enumerate(configs) if (c, st) in by]
            ys = [get(by[(c, st)]) for c in configs if (c, st) in by]
            ax.bar(xs, ys, width, label=st)
        ax.set_xticks([i + width * (len(strategies) - 1) / 2 for i in range(len(configs))], configs, rotation=30,
                      ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Rollouts on SGLang ({result.get('device', '')}, {result['model_shape']}): "
                 f"{result['settings']['duration_s']:.0f} s windows", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ----


def turn_range(text: str) -> tuple[int, int]:
    """``--long-turns MIN,MAX``: 1 <= MIN <= MAX."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {lo},{hi}")
    return lo, hi


def gpu_total_bytes() -> int:
    """The first GPU's memory in bytes, 0 without one."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


def mem_fraction_for(static_gib: float, total_bytes: int) -> float:
    """The ``--mem-fraction-static`` that gives a server ``static_gib`` of the GPU's memory: the same pool on
    any card (a fixed fraction of an H100's 80 GB leaves 4x fewer KV bytes than of an H200's 141 GB beside
    the same weights)."""
    f = static_gib * 2**30 / total_bytes
    if not 0.0 < f < 0.95:
        raise ValueError(f"--static-gib {static_gib} is {f:.2f} of this GPU's {total_bytes / 2**30:.1f} GiB; "
                         "give a value that leaves the GPU room for activations and CUDA graphs")
    return round(f, 4)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.rollout_sglang", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint (python -m kvstreams_sglang.checkpoints DIR --shape "
                                                  "qwen3-4b --dtype bfloat16 --device cuda)")
    p.add_argument("--out", type=Path, default=None, help=f"results JSON (default $OUT/{DEFAULT_OUT.name}); PNG and "
                                                          "server logs beside it")
    p.add_argument("--study", choices=("rollouts", "concentration"), default="rollouts")
    p.add_argument("--quick", action="store_true", help="smoke run, about 2 minutes: configs 1 and 4, Sliding Window, "
                                                        "short windows")
    p.add_argument("--configs", default=None, help=f"comma-separated, from {','.join(SETUPS)} (default: all)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the CPU build (tests)")
    p.add_argument("--port", type=int, default=31100)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("servers")
    g.add_argument("--static-gib", type=float, default=16.8,
                   help="every server's static memory (weights, KV pool, side cache) in GiB:\n"
                        "--mem-fraction-static is this over the GPU's total memory, so an H100 and an H200 run the\n"
                        "same pool (16.8 GiB: 0.12 of an H200, about 9 GiB of KV beside a 4B model's weights, so that\n"
                        "the pool bounds concurrency)")
    g.add_argument("--mem-fraction", type=float, default=None,
                   help="--mem-fraction-static of every server instead of --static-gib's (device-dependent)")
    g.add_argument("--max-running-requests", type=int, default=256,
                   help="every server's request rows; also sizes kv4rl's INT8 side cache (144 positions x 73 KiB per\n"
                        "row with the Qwen3-4B shape)")
    g.add_argument("--ours-max-running-requests", type=int, default=None,
                   help="request rows of the kv4rl servers instead (each row holds an INT8 side row, taken from the\n"
                        "same memory as the KV pool: 257 rows are 2.6 GiB of the 9 GiB --mem-fraction 0.12 leaves a\n"
                        "4B model on an H200; rows the KV cannot fill anyway give their bytes to the pool)")
    g.add_argument("--free-rows", type=int, default=32,
                   help="request rows the admission keeps free (see the module docstring)")
    g.add_argument("--prefill-graph", default="default", choices=("default", "breakable", "disabled"),
                   help="every server's --cuda-graph-backend-prefill (default: SGLang's choice, breakable on CUDA: "
                        "each layer's attention runs eagerly between graph segments)")
    g.add_argument("--ours-prefill-graph", default=None, choices=("default", "breakable", "full", "disabled"),
                   help="our servers' --cuda-graph-backend-prefill instead of --prefill-graph's (full: whole prefill "
                        "steps captured, our attention included; stock keeps its own)")
    g.add_argument("--ours-prefill-graph-slots", type=int, default=None,
                   help="with --ours-prefill-graph full: the request slots each captured prefill graph holds\n"
                        "(SGLang's full_prefill_max_req; default 16 at chunked prefill 8192); larger steps run eagerly")
    g.add_argument("--turn-batching", type=float, default=0.0,
                   help="hold prefills back while fewer than RATIO x running requests wait, on every server\n"
                        "(SGLang's --enable-prefill-delayer --prefill-delayer-queue-min-ratio)")
    g.add_argument("--turn-batch-max-delay-ms", type=float, default=30.0)
    g.add_argument("--max-total-tokens", type=int, default=12288, help="KV pool tokens on a CPU (--device cpu)")
    g = p.add_argument_group("episodes")
    g.add_argument("--data", type=Path, default=DATA)
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="scale the recorded texts (byte-tokenizer counts; 0.3 is about what a BPE makes of them). 1:\n"
                        "the recorded counts, whose longer messages stand in for a model that writes more than a\n"
                        "bare command; with 0.3 a turn is ~6 sampled tokens and the client's per-turn work dominates")
    g.add_argument("--max-turns", type=int, default=None)
    g.add_argument("--games", choices=("recorded", "long"), default="recorded",
                   help="recorded: the recorded episodes (TextWorld games, 12 turns on average);\n"
                        "long: longer games (the KV-streams paper's regime), a recorded first message and\n"
                        "--long-turns MIN,MAX recorded turns (long-tailed: bench.replay.long_tailed_episodes)")
    g.add_argument("--long-turns", type=turn_range, default=(30, 60), metavar="MIN,MAX",
                   help="--games long: fewest and most turns of a game")
    g.add_argument("--episodes", type=int, default=1500, help="episodes in each strategy's list (the same list for "
                                                              "every server); a run stops when it runs out")
    g.add_argument("--strategy-configs", type=Path, default=CONFIGS,
                   help="a folder of STRATEGY.toml configs whose [compaction] the replay runs (default: TextWorld's,\n"
                        "the paper's settings: evict at 10 live turns, Summary every 10 turns)")
    g.add_argument("--window", type=int, default=None,
                   help="Sliding Window: live turns that trigger an eviction of one (default: the config's, 10;\n"
                        "runs before 2026-12-06 used 4)")
    g.add_argument("--markovian-turns", type=int, default=None, help="Markovian Thinker: live turns at the trigger "
                                                                     "(half are evicted; default: the config's)")
    g.add_argument("--summary-turns", type=int, default=None, help="Summary: every this many turns (default: the "
                                                                    "config's)")
    g.add_argument("--summary-tokens", type=int, default=64)
    g.add_argument("--sizing-workers", type=int, default=8, help="processes that measure the episodes' peaks")
    g = p.add_argument_group("timing")
    g.add_argument("--warmup", type=float, default=4.0, help="seconds before each measured window")
    g.add_argument("--duration", type=float, default=10.0, help="seconds of each measured window")
    g.add_argument("--min-duration", type=float, default=5.0)
    g.add_argument("--budget-s", type=float, default=470.0,
                   help="the whole bench's wall time: windows shrink (to --min-duration) to fit it")
    g.add_argument("--profile-steps", type=int, default=0,
                   help="record this many steps of each --profile-configs server with SGLang's torch profiler from\n"
                        "its window's start; the trace is summarised into the run's 'profile' (bench.trace_summary)")
    g.add_argument("--profile-configs", default="stock_bf16,streams_kv4rl")
    g.add_argument("--pyspy", action="store_true",
                   help="py-spy samples each --profile-configs server's scheduler and the bench's client over the\n"
                        "window: the share of the window each ran, per function (bench.pyspy), in the run's 'pyspy'")
    g = p.add_argument_group("--study concentration")
    g.add_argument("--conc-config", default="streams_bf16")
    g.add_argument("--conc-batch", type=int, default=32)
    g.add_argument("--conc-episodes", type=int, default=96)
    g.add_argument("--conc-mem-fraction", type=float, default=0.55)
    g.add_argument("--conc-max-turns", type=int, default=80)
    g.add_argument("--conc-alpha", type=float, default=1.1)
    g.add_argument("--conc-timeout", type=float, default=150.0, help="seconds one mode may take")
    a = p.parse_args(argv)
    if a.mem_fraction is not None:
        a.static_gib = None  # the fraction given stands
    elif a.study == "rollouts" and a.device == "cuda" and (total := gpu_total_bytes()):  # no GPU: tests build flags
        a.mem_fraction = mem_fraction_for(a.static_gib, total)
    if a.quick:
        a.configs = a.configs or "stock_bf16,streams_kv4rl"
        a.strategies = "sliding_window"
        a.warmup, a.duration, a.min_duration = min(a.warmup, 2.0), min(a.duration, 5.0), min(a.min_duration, 3.0)
        a.episodes = min(a.episodes, 500)
        a.budget_s = min(a.budget_s, 110.0)
        a.conc_episodes, a.conc_max_turns = min(a.conc_episodes, 48), min(a.conc_max_turns, 30)
    a.configs = [c for c in (a.configs or ",".join(SETUPS)).split(",") if c]
    unknown = [c for c in a.configs if c not in SETUPS]
    if unknown:
        p.error(f"unknown configs {unknown}")
    a.strategies = [s for s in a.strategies.split(",") if s]
    if a.out is None:
        name = DEFAULT_OUT.name if a.study == "rollouts" else "kv_concentration_sglang_h200.json"
        a.out = Path(os.environ["OUT"]) / name if os.environ.get("OUT") else DEFAULT_OUT.with_name(name)
    return a


def renderer_for(model: str):
    from transformers import AutoTokenizer

    from envs.rollout.chat import ChatRenderer

    return ChatRenderer(AutoTokenizer.from_pretrained(model), SYSTEM_PROMPT)


def device_name(device: str) -> str:
    """The GPU's name, without a CUDA context in this process (it would hold memory the servers profile)."""
    if device == "cpu":
        return "cpu"
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "cuda"


def header(a, argv) -> dict:
    dims = model_dims(a.model)
    return dict(command="python -m bench.rollout_sglang " + " ".join(argv if argv is not None else sys.argv[1:]),
                date=time.strftime("%Y-%m-%d %H:%M"), device=device_name(a.device), model=a.model,
                model_shape=f"{dims[0]} layers, {dims[1]} KV heads x {dims[2]} (random weights)")


def merge(parts: list[Path], out: Path) -> dict:
    """One result from the JSONs of several calls of the same bench (one device call cannot start five servers):
    their runs and servers side by side, targets and plot made again. The parts must share the episode list
    (settings.episodes, seed, template), or the comparison would not be of the same work."""
    results = [json.loads(p.read_text()) for p in parts]
    first = results[0]
    key = ("episodes", "games", "seed", "template", "window", "markovian_turns", "length_scale",
           "mem_fraction_static", "prefill_graph")
    compaction = {}  # per strategy: parts that ran other strategies add theirs, the same strategy must agree
    for p, r in zip(parts, results, strict=True):
        if r.get("device") != first.get("device"):
            raise ValueError(f"{p} ran on {r.get('device')}, {parts[0]} on {first.get('device')}: timings of "
                             "different GPUs are not comparable")
        diff = [k for k in key if r["settings"].get(k) != first["settings"].get(k)]
        for strategy, settings in (r["settings"].get("compaction") or {}).items():
            if compaction.setdefault(strategy, settings) != settings:
                diff.append(f"compaction of {strategy}")
        if diff:
            raise ValueError(f"{p} was run with other settings than {parts[0]} ({', '.join(diff)}): not comparable")

    def flat(r: dict, field: str, own) -> list:  # a part that is itself a merge adds its parts
        return r[field] if "merged_from" in r else [own]

    merged = dict(first, command=[c for r in results for c in flat(r, "command", r["command"])],
                  date=[d for r in results for d in flat(r, "date", r["date"])],
                  merged_from=[f for p, r in zip(parts, results, strict=True) for f in flat(r, "merged_from", str(p))],
                  servers={}, runs=[])
    for r in results:
        merged["servers"].update(r["servers"])
        merged["runs"] += r["runs"]
    merged["settings"] = dict(first["settings"], configs=list(merged["servers"]), compaction=compaction,
                              strategies=list(dict.fromkeys(r["strategy"] for r in merged["runs"])))
    merged["targets"] = targets(merged["runs"])
    out.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    plot(merged, out.with_suffix(".png"))
    print_targets(merged["targets"])
    return merged


def main(argv: list[str] | None = None) -> dict:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["merge"]:  # python -m bench.rollout_sglang merge A.json B.json --out C.json
        p = argparse.ArgumentParser(prog="python -m bench.rollout_sglang merge")
        p.add_argument("parts", type=Path, nargs="+")
        p.add_argument("--out", type=Path, required=True)
        m = p.parse_args(args[1:])
        return merge(m.parts, m.out)
    a = parse_args(argv)
    unwind_on_sigterm()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    return (rollouts if a.study == "rollouts" else concentration)(a, argv)


def rollouts(a, argv, servers: dict[str, Server] | None = None) -> dict:
    """The rollout comparison; ``servers``: already started servers by configuration name (used as they are, not
    stopped), the others are started here in turn."""
    t_start = time.perf_counter()
    renderer = renderer_for(a.model)
    template = Template.of(renderer)
    pool = load_episode_pool(a.data)
    if a.games == "long":
        lo, hi = a.long_turns
        specs = long_tailed_episodes(pool, a.episodes, a.seed, min_turns=lo, max_turns=hi,
                                     length_scale=a.length_scale, template=template)
    else:
        specs = sample_episodes(pool, a.episodes, a.seed, length_scale=a.length_scale, max_turns=a.max_turns,
                                template=template)
    setups = [SETUPS[c] for c in a.configs]
    plan = [(s, st) for s in setups for st in (s.strategies or a.strategies)]
    strategies = list(dict.fromkeys(st for _, st in plan))
    # the same loop without a model sizes every episode, while the first server starts
    sizer = sizing_pool(a.model, a.sizing_workers) if a.sizing_workers else None
    peaks = {}
    for st in strategies:
        c = compaction(st, "kv_streams", a)  # the peak does not depend on the execution
        peaks[st] = (episode_peaks_in_processes(sizer, specs, c) if sizer else None)
    result = dict(header(a, argv), study="rollouts", settings=dict(
        configs=a.configs, strategies=strategies, mem_fraction_static=a.mem_fraction if a.device != "cpu" else None,
        static_gib=a.static_gib if a.device != "cpu" else None,
        max_total_tokens=a.max_total_tokens if a.device == "cpu" else None,
        max_running_requests=a.max_running_requests, ours_max_running_requests=a.ours_max_running_requests,
        prefill_graph=a.prefill_graph,
        ours_prefill_graph=a.ours_prefill_graph, ours_prefill_graph_slots=a.ours_prefill_graph_slots,
        turn_batching=a.turn_batching, turn_batch_max_delay_ms=a.turn_batch_max_delay_ms,
        games=a.games if a.games == "recorded" else "long {},{} turns".format(*a.long_turns),
        length_scale=a.length_scale, window=a.window, markovian_turns=a.markovian_turns,
        summary_turns=a.summary_turns, summary_tokens=a.summary_tokens,
        compaction=compaction_settings(a, [st for st in strategies if st != "full_context"]),
        warmup_s=a.warmup, duration_s=a.duration, budget_s=a.budget_s, seed=a.seed, template=dataclasses.asdict(
            template), episodes=dict(count=len(specs), turns=length_stats([len(e.turns) for e in specs]),
                                     total_tokens=length_stats([e.total for e in specs]),
                                     generated_tokens=length_stats([e.generated for e in specs]), data=str(a.data))),
        servers={}, runs=[])

    def save() -> None:
        a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    done_runs = 0
    for i, setup in enumerate(setups):
        given = (servers or {}).get(setup.name)
        server = given or server_for(setup, a, a.port + i, a.out.parent / "logs")
        t0 = time.perf_counter()
        with contextlib.nullcontext(given) if given else server:
            start_s = time.perf_counter() - t0
            info = server.server_info()
            pool_tokens = int(info["max_total_num_tokens"])
            rows = int(info.get("max_running_requests") or a.max_running_requests)
            max_batch = max(1, rows - a.free_rows)
            metrics = server.metrics()
            result["servers"][setup.name] = dict(
                label=setup.label, module=server.config.module, flags=[*server.config.flags, *server.flags],
                kvstreams_env=server.kvstreams_env(), start_s=start_s, pool_tokens=pool_tokens,
                max_running_requests=rows, admission_max_batch=max_batch,
                kv_pool_gib=metric_total(metrics, "sglang:kv_cache_memory_usage_gb"),
                weights_gib=metric_total(metrics, "sglang:weight_memory_usage_gb"))
            print(f"{setup.name}: up in {start_s:.0f}s, KV pool {pool_tokens} tokens, {rows} request rows",
                  flush=True)
            bytes_ = kv_bytes(setup, a.model, a.device)
            for st in setup.strategies or a.strategies:
                if peaks[st] is None:
                    peaks[st] = episode_peaks(specs, renderer, compaction(st, "kv_streams", a))
                elif not isinstance(peaks[st], list):
                    peaks[st] = peaks[st].result()
                # windows shrink so that the rest of the plan fits the budget
                left = len(plan) - done_runs
                starts_left = len(setups) - i - 1
                spare = a.budget_s - (time.perf_counter() - t_start) - starts_left * max(start_s, 20.0)
                duration = max(a.min_duration, min(a.duration, spare / left - a.warmup - 3.0))
                capacity = int(0.92 * pool_tokens)  # headroom for the scheduler's own decode reservations
                replay = Replay(renderer, compaction(st, setup.execution, a), episode_config(), seed=a.seed)
                prof_dir = a.out.parent / "profiles" / f"{setup.name}_{st}"
                profiled = a.profile_steps > 0 and setup.name in a.profile_configs.split(",")
                spied = a.pyspy and setup.name in a.profile_configs.split(",")
                run = asyncio.run(run_once(server, setup, replay, specs, peaks[st], capacity=capacity,
                                           max_batch=max_batch, warmup_s=a.warmup, duration_s=duration,
                                           profile=(prof_dir, a.profile_steps) if profiled else None,
                                           pyspy_dir=prof_dir / "pyspy" if spied else None))
                row = summarize(run, setup, st, server, bytes_, pool_tokens)
                if profiled:
                    row["profile"] = dict(steps=a.profile_steps, traces=summarize_dir(prof_dir))
                if run["pyspy"] is not None:
                    row["pyspy"] = run["pyspy"]
                result["runs"].append(row)
                done_runs += 1
                save()
                dec = row["step_profile"]["decode"]
                print(f"  {st}: {row['episodes_per_s']:.2f} episodes/s, {row['output_tokens_per_s']:.0f} tok/s, "
                      f"{row['concurrency']['mean_admitted']:.1f} admitted ({row['concurrency']['limited_by']}), "
                      f"re-prefilled {row['reprefilled_tokens']}, decode {dec['ms_per_step'] or dec['ms_per_step_log']}"
                      f" ms/step, failed {row['episodes_failed']}", flush=True)
                if row["scheduler_host"]:
                    print("    scheduler host ms/turn: " + ", ".join(
                        f"{k} {v['ms_per_turn']:.3f}" for k, v in row["scheduler_host"].items() if v["ms_per_turn"]),
                        flush=True)
                # the next strategy starts from an empty radix cache (ours too: closed streams leave their prompts in
                # the tree, and the next strategy replays the same episodes)
                if refused := flush_or_why(server):
                    row["flush_cache_failed"] = refused
                    save()
    if sizer is not None:
        sizer.shutdown(cancel_futures=True)
    result["targets"] = targets(result["runs"])
    result["total_s"] = time.perf_counter() - t_start
    save()
    try:
        plot(result, a.out.with_suffix(".png"))
    except Exception as e:  # a plotting problem must not lose the numbers
        print(f"plot failed: {e!r}")
    print_targets(result["targets"])
    print(f"wrote {a.out} in {result['total_s']:.0f}s")
    return result


def concentration(a, argv, server: Server | None = None) -> dict:
    """Synchronous waves vs continuous refill on one server (``--conc-config``; ``server``: one already started with
    that config's flags, as the tests pass), full context, long tails."""
    from . import kv_concentration

    t_start = time.perf_counter()
    renderer = renderer_for(a.model)
    template = Template.of(renderer)
    specs = long_tailed_episodes(load_episode_pool(a.data), a.conc_episodes, a.seed, alpha=a.conc_alpha,
                                 max_turns=a.conc_max_turns, length_scale=a.length_scale, template=template)
    setup = SETUPS[a.conc_config]
    comp = compaction("full_context", setup.execution, a)
    reserved = episode_peaks(specs, renderer, comp)
    a.mem_fraction = a.conc_mem_fraction
    result = dict(header(a, argv), study="concentration", config=setup.name, max_batch=a.conc_batch,
                  episodes=len(specs), strategy="full_context", kv_dtype=setup.kv, cache="flushed before each mode",
                  episode_stats=dict(turns=length_stats([len(e.turns) for e in specs]),
                                     total=length_stats([e.total for e in specs]),
                                     generated=length_stats([e.generated for e in specs]),
                                     alpha=a.conc_alpha, max_turns=a.conc_max_turns))
    given = server
    server = given or server_for(setup, a, a.port, a.out.parent / "logs")
    modes = {}
    with contextlib.nullcontext(given) if given else server:
        info = server.server_info()
        pool_tokens = int(info["max_total_num_tokens"])
        rows = int(info.get("max_running_requests") or a.max_running_requests)
        if a.conc_batch > rows - a.free_rows:
            raise SystemExit(f"--conc-batch {a.conc_batch} needs {a.conc_batch + a.free_rows} request rows "
                             f"(--free-rows {a.free_rows}); the server has {rows}")
        need = sum(sorted(reserved, reverse=True)[:a.conc_batch])
        if need > pool_tokens:
            raise SystemExit(f"memory must not bind: {a.conc_batch} of the longest episodes need {need} KV tokens, "
                             f"the pool holds {pool_tokens}; raise --conc-mem-fraction or lower --conc-max-turns")
        result["pool_tokens"] = pool_tokens
        replay = Replay(renderer, comp, episode_config(), seed=a.seed)
        for mode in ("refill", "waves"):
            # each mode from an empty radix cache: closed streams leave their prompts in the tree, and waves replays
            # refill's episodes (an H100 run before this computed 249k prefill tokens in waves against refill's 335k)
            refused = flush_or_why(server)
            run = asyncio.run(run_once(server, setup, replay, specs, reserved, capacity=pool_tokens,
                                       max_batch=a.conc_batch, warmup_s=0.0, duration_s=None, waves=mode == "waves",
                                       timeout_s=a.conc_timeout))
            s, e = run["window"]
            prof = step_profile(server.log_text()[s.log_offset:e.log_offset], s.metrics, e.metrics, e.t - s.t)
            dec = prof["decode"]
            modes[mode] = dict(
                wall_s=e.t - s.t, waves=run["gate"].num_waves, episodes_failed=len(run["failed"]),
                mean_decode_batch=dec["mean_batch"], decode_calls=dec["steps"],
                mean_resident_kv_tokens=prof["kv_tokens_server"]["mean"],
                mean_decode_step_ms=dec["ms_per_step"] or dec["ms_per_step_log"] or 0.0,
                decode_step_ms_source="device timer" if dec["ms_per_step"] else "log interval",
                tokens_per_s=sum(k for _, k in run["meter"].generated) / (e.t - s.t), step_profile=prof)
            if refused:
                modes[mode]["flush_cache_failed"] = refused
            print(f"{mode}: {modes[mode]['wall_s']:.1f}s, batch {dec['mean_batch']:.1f}, {dec['steps']} decode "
                  f"steps, {modes[mode]['mean_decode_step_ms']:.2f} ms/step", flush=True)
            if mode == "refill":  # a call cut during waves still brings refill back
                a.out.write_text(json.dumps(dict(result, partial=True, modes=modes), indent=1, default=str) + "\n")
    result.update(kv_concentration.concentration(modes["refill"], modes["waves"], specs, a.conc_batch))
    result["theory"]["e_max_over_e_l_turns"] = expected_max_over_mean([len(e.turns) for e in specs], a.conc_batch)
    result["total_s"] = time.perf_counter() - t_start
    a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    try:
        kv_concentration.plot(result, a.out.with_suffix(".png"))
    except Exception as e:
        print(f"plot failed: {e!r}")
    print(f"C_KV {result['c_kv_measured']:.2f}x, step latency refill/waves "
          f"{1 / result['ratios']['mean_decode_step_ms']['waves_over_refill']:.2f}x (paper 8.27x batch, 4.52x "
          f"latency); wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
