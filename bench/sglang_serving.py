"""Decode on real SGLang servers, side by side: stock bf16 KV, stock fp8 KV, ours with ``--kv4rl``.

    python -m bench.sglang_serving --model /tmp/qwen3-4b --out $OUT/sglang_serving_h200.json

Each configuration is its own server process (CUDA graphs on, the same ``--mem-fraction-static``),
driven with the same requests: per shape ``B x L``, ``B`` requests of ``L`` random prompt ids (no two
share a prefix) each decode ``--decode-tokens`` tokens greedily, all at once. The decode step time is
read from the scheduler's own "Decode batch" log lines while all ``B`` requests run (SGLang reports the
generation throughput of each interval, and whether the steps ran a CUDA graph). A shape that does not
fit a server's KV pool is reported as such. Also per server: how many 8k-token streams its pool holds
at once, and the byte floor of a step (weights + the step's KV bytes over the measured device-to-device
copy bandwidth). Last, the monitored logprob gap: greedy continuations of the same prompts on each
server against stock bf16, compared on their common prefix of tokens. ``--configs ...,kv4rl_hf`` adds ours
with ``--hf-numerics`` (HF's rounding in the model: what on-policy logprobs cost a step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from .sglang_servers import (
    OURS,
    STOCK,
    Server,
    ServerConfig,
    decode_lines,
    post_many,
    prefill_throughputs,
    unwind_on_sigterm,
)

CONFIGS = {
    "stock_bf16": ServerConfig("stock_bf16", STOCK, ("--attention-backend", "flashinfer")),
    "stock_fp8": ServerConfig("stock_fp8", STOCK, ("--attention-backend", "flashinfer",
                                                   "--kv-cache-dtype", "fp8_e4m3")),
    "kv4rl": ServerConfig("kv4rl", OURS, ("--kv4rl", "--enable-kv-streams")),
    # the same with HF's rounding in the model (``--hf-numerics``): what on-policy logprobs cost per step
    "kv4rl_hf": ServerConfig("kv4rl_hf", OURS, ("--kv4rl", "--enable-kv-streams", "--hf-numerics")),
    # only the norms (q/k norms too: SGLang's CUDA Qwen3 fuses them past the modules), each one HF-rounding kernel
    "kv4rl_hf_norms": ServerConfig("kv4rl_hf_norms", OURS, ("--kv4rl", "--enable-kv-streams", "--hf-numerics",
                                                            "--hf-numerics-parts", "norms,qk_prepare")),
    # batch-invariant GEMMs, norm means and attention plans (the GPU parity test's second server): their cost per step
    "kv4rl_invariant": ServerConfig("kv4rl_invariant", OURS, ("--kv4rl", "--enable-kv-streams", "--hf-numerics",
                                                              "--kv4rl-batch-invariant")),
}
DEFAULT_CONFIGS = "stock_bf16,stock_fp8,kv4rl"
STREAM_TOKENS = 8192


def kv_bytes_per_step(name: str, shape, batch: int, context: int) -> float:
    """KV bytes one decode step reads: every token of every request, K and V, all layers."""
    from kvstreams_sglang.streams.pool import KV4Pool

    dims = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
    if name.startswith("kv4rl"):  # the sink + recent positions are read from the INT8 side cache instead
        side = min(context, 16 + 128)
        return batch * ((context - side) * KV4Pool.bytes_per_token(*dims) + side * KV4Pool.side_bytes_per_token(*dims))
    return batch * context * shape.kv_bytes_per_token(1.0 if name == "stock_fp8" else 2.0)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the floor's denominator)."""
    import torch
    import triton

    buf = torch.empty(2, 2 << 30, dtype=torch.uint8, device="cuda").random_()
    ms = triton.testing.do_bench(lambda: buf[1].copy_(buf[0]), warmup=50, rep=300, return_mode="median")
    buf.resize_(0)
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / (ms / 1e3)


def weight_bytes(model: str) -> int:
    return sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))


def random_prompts(n: int, length: int, seed: int, vocab: int = 150000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


def decode_shape(server: Server, batch: int, context: int, new_tokens: int, seed: int) -> dict:
    """``batch`` requests of ``context`` prompt tokens, ``new_tokens`` greedy tokens each, all at once."""
    before = len(server.log_text())
    payloads = [dict(input_ids=p, sampling_params=dict(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
                for p in random_prompts(batch, context, seed)]
    t0 = time.perf_counter()
    outs = asyncio.run(post_many(server.url, "/generate", payloads))
    wall = time.perf_counter() - t0
    text = server.log_text()[before:]
    prefills = [thr for new, _, thr in prefill_throughputs(text) if new >= 1024]  # full chunks, not the tail
    lines = [x for x in decode_lines(text) if x.running == batch]
    steady = lines[1:] or lines  # the first interval may straddle the last prefill
    row = dict(batch=batch, context=context, new_tokens=new_tokens, wall_s=wall,
               output_tokens=sum(len(o["output_ids"]) for o in outs), log_intervals=len(steady),
               prefill_tok_s=statistics.median(prefills) if prefills else None)
    if steady:
        ms = statistics.median(x.ms_per_step for x in steady)
        row.update(ms_per_step=ms, decode_tok_s=1000.0 * batch / ms, cuda_graph=all(x.cuda_graph for x in steady),
                   kv_tokens=steady[-1].tokens)
    return row


def greedy_logprobs(server: Server, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    payloads = [dict(input_ids=p, return_logprob=True,
                     sampling_params=dict(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
                for p in prompts]
    outs = asyncio.run(post_many(server.url, "/generate", payloads))
    return [dict(ids=o["output_ids"], logprobs=[lp for lp, *_ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def logprob_gap(ref: list[dict], other: list[dict]) -> dict:
    """|logprob difference| over each pair's common prefix of generated tokens (greedy paths part once the
    argmax flips; after that the contexts differ)."""
    diffs, common, total = [], 0, 0
    for a, b in zip(ref, other, strict=True):
        n = 0
        while n < min(len(a["ids"]), len(b["ids"])) and a["ids"][n] == b["ids"][n]:
            n += 1
        diffs += [abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n], strict=True)]
        common, total = common + n, total + len(a["ids"])
    return dict(tokens_compared=len(diffs), common_prefix_share=common / max(total, 1),
                mean_abs_diff=statistics.fmean(diffs) if diffs else None, max_abs_diff=max(diffs, default=None))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.sglang_serving", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint (python -m kvstreams_sglang.checkpoints DIR "
                                                   "--shape qwen3-4b --dtype bfloat16 --device cuda)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--shapes", default="64x4096,64x8192,128x8192,256x8192")
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--logprob-prompts", type=int, default=16)
    ap.add_argument("--port", type=int, default=31000)
    a = ap.parse_args(argv)
    unwind_on_sigterm()

    from kvstreams_sglang.checkpoints import QWEN3_4B

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    result = dict(command="python -m bench.sglang_serving " + " ".join(argv if argv is not None else sys.argv[1:]),
                  date=time.strftime("%Y-%m-%d"), model=a.model, shape="QWEN3_4B (random weights)",
                  mem_fraction_static=a.mem_fraction, decode_tokens=a.decode_tokens, servers={})
    import torch

    result["device"] = torch.cuda.get_device_name()
    result["copy_bytes_per_s"] = bw = copy_bandwidth()
    result["weight_bytes"] = wbytes = weight_bytes(a.model)
    prompts = random_prompts(a.logprob_prompts, 1024, seed=7)
    greedy = {}
    for i, name in enumerate(a.configs.split(",")):
        cfg = CONFIGS[name]
        server = Server(cfg, a.model, a.port + i, out.parent / f"server_{name}.log",
                        flags=["--mem-fraction-static", str(a.mem_fraction),
                               "--max-running-requests", str(a.max_running_requests)])
        row = dict(module=cfg.module, flags=[*cfg.flags, *server.flags], shapes={})
        t0 = time.perf_counter()
        with server:
            row["start_s"] = time.perf_counter() - t0
            row["kvstreams_env"] = server.kvstreams_env()
            info = server.server_info()
            capacity = int(info.get("max_total_num_tokens") or 0)
            row.update(max_total_num_tokens=capacity, max_running_requests=info.get("max_running_requests"),
                       concurrent_8k_streams=capacity // STREAM_TOKENS)  # what the KV pool holds; rows are a flag
            decode_shape(server, 8, 512, 16, seed=1)  # warm-up
            for b, length in shapes:
                key = f"{b}x{length}"
                need = b * (length + a.decode_tokens + 8)
                if need > capacity or b > a.max_running_requests:
                    row["shapes"][key] = dict(fits=False, tokens_needed=need, capacity=capacity)
                    print(f"{name} {key}: does not fit ({need} tokens > {capacity})", flush=True)
                    continue
                r = decode_shape(server, b, length, a.decode_tokens, seed=b * 100003 + length)
                floor_ms = 1000.0 * (wbytes + kv_bytes_per_step(name, QWEN3_4B, b, length)) / bw
                r.update(fits=True, byte_floor_ms=floor_ms,
                         over_floor=r["ms_per_step"] / floor_ms if "ms_per_step" in r else None)
                row["shapes"][key] = r
                result["servers"][name] = row
                out.write_text(json.dumps(result, indent=1))  # what is measured survives a timeout
                print(f"{name} {key}: {r.get('ms_per_step', float('nan')):.2f} ms/step "
                      f"({r.get('decode_tok_s', 0):.0f} tok/s, graph {r.get('cuda_graph')}, floor {floor_ms:.2f} ms)",
                      flush=True)
            greedy[name] = greedy_logprobs(server, prompts, 32)
        result["servers"][name] = row
        out.write_text(json.dumps(result, indent=1))
    if "stock_bf16" in greedy:
        result["logprob_gap_vs_stock_bf16"] = {n: logprob_gap(greedy["stock_bf16"], g) for n, g in greedy.items()
                                               if n != "stock_bf16"}
    result["ratios"] = ratios(result)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["ratios"], indent=1))


def ratios(result: dict) -> dict:
    """kv4rl over each stock server, per shape both ran (decode tokens/s), and in 8k streams held."""
    s = result["servers"]
    out = {}
    ours = s.get("kv4rl")
    if not ours:
        return out
    for name in ("kv4rl_hf", "kv4rl_hf_norms", "kv4rl_invariant"):  # what the numerics flags cost a decode step
        for key, r in s.get(name, {}).get("shapes", {}).items():
            b = ours["shapes"].get(key, {})
            if r.get("ms_per_step") and b.get("ms_per_step"):
                out[f"{name}_step_over_kv4rl_{key}"] = r["ms_per_step"] / b["ms_per_step"]
    for base in ("stock_bf16", "stock_fp8"):
        if base not in s:
            continue
        for key, r in ours["shapes"].items():
            b = s[base]["shapes"].get(key, {})
            if r.get("decode_tok_s") and b.get("decode_tok_s"):
                out[f"kv4rl_over_{base}_{key}"] = r["decode_tok_s"] / b["decode_tok_s"]
        if s[base]["concurrent_8k_streams"]:
            out[f"kv4rl_over_{base}_8k_streams"] = ours["concurrent_8k_streams"] / s[base]["concurrent_8k_streams"]
    return out


if __name__ == "__main__":
    main()
