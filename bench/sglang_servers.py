"""SGLang servers for the GPU benchmarks: one process per configuration, driven over HTTP.

A ``Server`` starts ``python -m <module> --model-path M --port P <flags>`` in its own process group
(stock ``sglang.launch_server`` or ours, ``kvstreams_sglang.launch_server``), logs to a file, waits
for ``/health_generate``, and is stopped with its whole group. What a benchmark reads from it:
``server_info()`` (SGLang's resolved arguments and the KV pool's ``max_total_num_tokens``), the
scheduler's "Decode batch" log lines (running requests, KV tokens, whether the step ran a CUDA
graph, the generation throughput of the last interval) and "Prefill batch" lines (one per prefill step:
new sequences, tokens computed and found cached, queued requests), its Prometheus ``/metrics``
(``--enable-metrics``; with ``SGLANG_ENABLE_METRICS_DEVICE_TIMER=1`` on a GPU the forward passes' device time
per mode, ``sglang:forward_execution_seconds_total{category=extend|decode}``), and its own timed requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STOCK = "sglang.launch_server"
OURS = "kvstreams_sglang.launch_server"
# Every server: no grammar backend (the device's xgrammar is a stub), token ids in and out (the random
# checkpoints' byte tokenizer cannot detokenize ids past 258), a decode log line every 10 steps.
COMMON = ["--grammar-backend", "none", "--skip-tokenizer-init", "--decode-log-interval", "10"]

_DECODE = re.compile(
    r"Decode batch[^,]*,\s+#running-req:\s*(?P<running>\d+),\s+#token:\s*(?P<tokens>\d+),\s+"
    r"token usage:\s*(?P<usage>[0-9.]+),.*?(?P<graph>cuda graph|graph[^:]*):\s*(?P<graph_on>True|False),\s+"
    r"gen throughput \(token/s\):\s*(?P<thr>[0-9.]+)")


def cpu_flags_env(max_total_tokens: int) -> tuple[list[str], dict]:
    """Flags and environment of a server on the CPU (CI): SGLang's CPU build with the test shims
    (``tests/sglang_cpu_shims``), fp32, torch sampling, a pool of ``max_total_tokens``, no warm-up."""
    flags = ["--device", "cpu", "--dtype", "float32", "--sampling-backend", "pytorch", "--max-total-tokens",
             str(max_total_tokens), "--skip-server-warmup"]
    env = {"SGLANG_USE_CPU_ENGINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "sglang_cpu_shims"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    return flags, env


_SIGTERM = {"deferring": 0, "pending": False}


def unwind_on_sigterm() -> None:
    """A SIGTERM (``timeout`` around a bench) raises SystemExit(143) in the main thread, so ``with server`` blocks
    and ``Server.start`` stop their servers: each runs in its own process group and would otherwise keep its GPU
    memory after the bench is gone (a device call once found 62% of an H100 held by the previous call's server).
    Inside ``sigterm_deferred`` the exit waits for the block's end."""
    def exit_143(*_):
        if _SIGTERM["deferring"]:
            _SIGTERM["pending"] = True
        else:
            sys.exit(143)

    signal.signal(signal.SIGTERM, exit_143)


@contextlib.contextmanager
def sigterm_deferred():
    """A SIGTERM (under ``unwind_on_sigterm``) inside the block raises its SystemExit(143) at the block's end: a
    process started inside is held by its ``Server`` by then, so the unwinding stops it (raised between ``Popen``'s
    return and the assignment of its result, it left the process running: CI, 2026-12-07). Off the main thread
    nothing to defer: the signal interrupts only the main thread (a server started in another thread is the
    caller's to stop)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _SIGTERM["deferring"] += 1
    try:
        yield
    finally:
        _SIGTERM["deferring"] -= 1
        if not _SIGTERM["deferring"] and _SIGTERM["pending"]:
            _SIGTERM["pending"] = False
            sys.exit(143)


@dataclass(frozen=True)
class ServerConfig:
    name: str
    module: str  # STOCK or OURS
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class DecodeLine:
    running: int
    tokens: int
    usage: float
    cuda_graph: bool
    throughput: float  # generated tokens per second over the last log interval

    @property
    def ms_per_step(self) -> float:
        """Each decode step generates one token per running request."""
        return 1000.0 * self.running / self.throughput if self.throughput else float("nan")


_PREFILL_THROUGHPUT = re.compile(r"Prefill batch[^,]*,\s+#new-seq:\s*(?P<seqs>\d+),\s+#new-token:\s*(?P<new>\d+),\s+"
                      r"#cached-token:\s*(?P<cached>\d+),.*?input throughput \(token/s\):\s*(?P<thr>[0-9.]+)")


def prefill_throughputs(text: str) -> list[tuple[int, int, float]]:
    """(new tokens, cached tokens, input tokens/s since the previous prefill line) of every "Prefill batch" line."""
    return [(int(m["new"]), int(m["cached"]), float(m["thr"])) for m in _PREFILL_THROUGHPUT.finditer(text)]


def decode_lines(text: str) -> list[DecodeLine]:
    return [DecodeLine(int(m["running"]), int(m["tokens"]), float(m["usage"]), m["graph_on"] == "True",
                       float(m["thr"])) for m in _DECODE.finditer(text)]


_PREFILL = re.compile(
    r"Prefill batch[^,]*,\s+#new-seq:\s*(?P<seqs>\d+),\s+#new-token:\s*(?P<new>\d+),\s+"
    r"#cached-token:\s*(?P<cached>\d+),\s+token usage:\s*(?P<usage>[0-9.]+),\s+#running-req:\s*(?P<running>\d+),"
    r"\s+#queue-req:\s*(?P<queue>\d+)")


@dataclass(frozen=True)
class PrefillLine:
    """One prefill (extend) step of the scheduler."""

    seqs: int  # requests the step extends
    new_tokens: int  # tokens it computes
    cached_tokens: int  # prompt tokens of those requests found in the cache (not computed)
    usage: float
    running: int  # requests decoding beside it
    queued: int  # requests waiting (memory or the running-request cap)


def prefill_lines(text: str) -> list[PrefillLine]:
    return [PrefillLine(int(m["seqs"]), int(m["new"]), int(m["cached"]), float(m["usage"]), int(m["running"]),
                        int(m["queue"])) for m in _PREFILL.finditer(text)]


_METRIC = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    """Prometheus text exposition -> ``(name, labels, value)`` samples."""
    return [(m["name"], dict(_LABEL.findall(m["labels"] or "")), float(m["value"])) for m in _METRIC.finditer(text)]


def metric_total(samples: list[tuple[str, dict, float]], name: str, **labels) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels`` (None: no such sample)."""
    hits = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    return sum(hits) if hits else None


# uvicorn's line when the HTTP port is taken; SGLang's process then stays up without serving
BIND_FAILED = "error while attempting to bind on address"


class PortTaken(RuntimeError):
    """The server's HTTP port was bound by another process before the server bound it."""


def answers(url: str, timeout_s: float = 10) -> bool:
    """``url`` answers 200 (False while the server starts: refused, or 503)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def wait_serving(proc: subprocess.Popen, log_path: Path, ready, timeout_s: float, name: str = "SGLang server") -> None:
    """Poll ``ready()`` until it holds. Raises RuntimeError (with the log's tail) if the process exits, ``PortTaken``
    if its log says its HTTP port was taken (SGLang's process then stays up without serving), TimeoutError after
    ``timeout_s``; the caller stops the process."""
    def tail(n: int) -> str:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-n:])

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: server exited ({proc.returncode}) during start; last log lines:\n{tail(80)}")
        if ready():
            return
        if BIND_FAILED in log_path.read_text(errors="replace"):
            raise PortTaken(f"{name}: its port is taken; last log lines:\n{tail(5)}")
        time.sleep(1)
    raise TimeoutError(f"{name}: not serving after {timeout_s:.0f} s; last log lines:\n{tail(80)}")


@dataclass
class Server:
    config: ServerConfig
    model_path: str
    port: int
    log_path: Path
    flags: list[str] = field(default_factory=list)  # per-run flags (memory fraction, ...)
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    launch_env: dict | None = None  # the process's whole environment, set at launch

    def kvstreams_env(self) -> dict[str, str]:
        """Our servers' A/B switches (``KVSTREAMS_PLAN_GRAPH``, ``KVSTREAMS_PLAN_KERNEL``, ...) the process was
        launched with: part of what a run measured."""
        return {k: v for k, v in sorted((self.launch_env or {}).items()) if k.startswith("KVSTREAMS_")}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.config.module, "--model-path", self.model_path, "--port", str(self.port),
                *COMMON, *self.config.flags, *self.flags]

    def start(self, timeout_s: float = 900.0, port_retries: int = 3) -> Server:
        """Launch and wait until it serves. A port another process took between choosing and binding it (the
        server logs the bind error and hangs on) is retried on a fresh free port, ``port_retries`` times."""
        from harness.trainer import free_port

        for attempt in range(port_retries + 1):
            try:
                return self.launch().wait_ready(timeout_s)
            except PortTaken:
                if attempt == port_retries:
                    raise
                self.port = free_port()
            except BaseException:  # a bench stopped during the start (SIGTERM: ``unwind_on_sigterm``, Ctrl-C): a
                self.stop()  # ``with server`` block never entered stops nothing, so the process would outlive it
                raise
        raise AssertionError("unreachable")

    def launch(self) -> Server:
        """Start the process (``wait_ready`` waits for it to serve)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        log.write(" ".join(self.command()) + "\n")
        log.flush()
        self.launch_env = {**os.environ, **self.env}
        with sigterm_deferred():  # the process is ours to stop from the moment it exists
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=self.launch_env)
        return self

    def wait_ready(self, timeout_s: float = 900.0) -> Server:
        try:
            wait_serving(self.proc, self.log_path, self.healthy, timeout_s, self.config.name)
        except (PortTaken, TimeoutError):
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def healthy(self) -> bool:
        """``/health_generate`` answers 200 (an empty body) once the server has generated a token."""
        return answers(self.url + "/health_generate")

    def _get(self, route: str, timeout: float = 30):
        import urllib.request

        with urllib.request.urlopen(self.url + route, timeout=timeout) as r:
            return json.loads(r.read() or b"null")

    def post_sync(self, route: str, payload: dict, timeout: float = 600):
        import urllib.request

        req = urllib.request.Request(self.url + route, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"null")

    def host_clock(self) -> dict:
        """Ours: the scheduler's host time so far per hook (``/kvstreams/host_clock``; difference two reads)."""
        return self.post_sync("/kvstreams/host_clock", {}, timeout=60)

    def server_info(self) -> dict:
        return self._get("/server_info")

    def metrics(self) -> list[tuple[str, dict, float]]:
        """``/metrics`` samples (``--enable-metrics``)."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def flush_cache(self) -> None:
        """Drop the radix cache (SGLang refuses while requests run, and says so in plain text)."""
        import urllib.request

        req = urllib.request.Request(self.url + "/flush_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
        if "Cache flushed" not in text:
            raise RuntimeError(f"{self.config.name}: flush_cache refused: {text!r}")


async def post_many(url: str, route: str, payloads: list[dict], *, timeout_s: float = 1800) -> list[dict]:
    """All ``payloads`` at once (one connection each), in order; raises on any non-200 answer."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one(p):
            async with http.post(url + route, json=p) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise RuntimeError(f"{route} answered {resp.status}: {body[:500]}")
                return json.loads(body)

        return list(await asyncio.gather(*(one(p) for p in payloads)))
