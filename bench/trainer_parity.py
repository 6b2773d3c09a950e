"""Trainer/sampler parity on the GPU (bf16), the KV4 train-infer gap, and FlexAttention vs
the dense mask at 32k tokens.

1. A Qwen3-0.6B-shaped model (28 layers, random weights, byte vocab) samples scripted
   episodes under each eviction pattern on the built-in engine (bf16 KV, Triton paged
   decode); `stream_logprobs` (flex and sdpa) scores the records; we report max/mean
   |trainer - sampler| over model tokens.
2. The same with `kv4rl` KV: mean/max |diff| and the token-level KL estimate.
3. One 32k-token stream with evictions every few hundred tokens: flex vs dense logprobs and
   forward times.
Usage: ``python -m bench.trainer_parity [--model-path DIR] [--no-long]``; writes
``trainer_parity_h200.json`` (with ``--model-path``: ``trainer_parity_<dir name>_h200.json``,
e.g. the demo-trained model, whose peaked distributions are the realistic case).
"""

from __future__ import annotations

import json
import os
import random
import time

import torch


def parity(record, lp):
    idx = [i for i, s in enumerate(record.sources) if s == "model"]
    sampler = torch.tensor([record.logprobs[i] for i in idx])
    trainer = lp.float().cpu()[idx]
    d = (trainer - sampler).abs()
    return dict(tokens=len(record), model_tokens=len(idx), evictions=len(record.evictions),
                max_abs=float(d.max()), mean_abs=float(d.mean()), kl_k1=float((sampler - trainer).mean()))


def long_record(n_tokens: int, seed: int = 0):
    """A synthetic 32k stream: model/env turns of ~200 tokens, a sliding window of 8 turns."""
    from trainer_masks import StreamRecord

    rng = random.Random(seed)
    ids, sources, turns, evictions = [], [], [], []
    while len(ids) < n_tokens:
        start = len(ids)
        for src, n in (("model", rng.randint(50, 150)), ("env", rng.randint(50, 150))):
            ids.extend(rng.randrange(256) for _ in range(n))
            sources.extend([src] * n)
        turns.append((start, len(ids)))
        if len(turns) > 8:
            evictions.append(dict(at_index=len(ids) - 1, spans=[turns.pop(0)]))
    ids, sources = ids[:n_tokens], sources[:n_tokens]
    evictions = [e for e in evictions if e["at_index"] <= n_tokens]
    return StreamRecord(token_ids=ids, positions=list(range(n_tokens)), sources=sources,
                        loss_mask=[s == "model" for s in sources], logprobs=[None] * n_tokens,
                        policy_versions=[None] * n_tokens, evictions=evictions)


def timed(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return out, sorted(times)[len(times) // 2]


def main():
    import argparse

    from kvstreams_sglang.checkpoints.episodes import EVICTION_PATTERNS, scripted_episode
    from transformers import AutoModelForCausalLM

    from kvstreams_sglang.checkpoints import build_tiny_model
    from kvstreams_sglang.engine import Engine
    from trainer_masks.scoring import stream_logprobs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="a local checkpoint (default: a random 0.6B-shaped model)")
    p.add_argument("--no-long", action="store_true", help="skip the 32k flex-vs-dense timing")
    p.add_argument("--batch-invariant", action="store_true",
                   help="only the batch-invariant mode: Engine(batch_invariant=True) vs impl='invariant' (and "
                        "the default kernels on the same episodes), plus its cost; writes "
                        "trainer_parity_invariant_h200.json")
    args = p.parse_args()
    if args.model_path:
        path, model = args.model_path, f"{args.model_path} (bf16)"
    else:
        path = build_tiny_model("/tmp/qwen3-0.6b-bytes", num_layers=28, hidden_size=1024, num_heads=16,
                                num_kv_heads=8, intermediate_size=3072, dtype=torch.bfloat16)
        model = "Qwen3-0.6B shape (28 layers, 16/8 heads, d=128), random, byte vocab, bf16"
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    command = "python -m bench.trainer_parity" + (f" --model-path {args.model_path}" if args.model_path else "")
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, command=command, model=model)
    if args.batch_invariant:
        return invariant_parity(path, trainer, result)
    for kv in ("bf16", "kv4rl"):
        eng = Engine(str(path), kv_dtype=kv, device="cuda", dtype=torch.bfloat16, kv_slots=65536, max_streams=8)
        rows = {}
        for name, spec in EVICTION_PATTERNS.items():
            rec = scripted_episode(eng, **spec, turns=12, max_turn_tokens=60, env_tokens=(20, 80), seed=3)
            with torch.no_grad():
                for impl in ("flex", "sdpa"):
                    rows[f"{name}/{impl}"] = parity(rec, stream_logprobs(trainer, rec, impl=impl))
            print(kv, name, rows[f"{name}/flex"], flush=True)
        result[f"engine_{kv}"] = rows
        del eng
        torch.cuda.empty_cache()

    name = f"trainer_parity_{os.path.basename(os.path.normpath(path))}_h200.json" if args.model_path \
        else "trainer_parity_h200.json"
    out = os.path.join(os.environ.get("OUT", "bench/results"), name)
    if args.no_long:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        return
    rec = long_record(32768)
    with torch.no_grad():
        lp_flex, t_flex = timed(lambda: stream_logprobs(trainer, rec, impl="flex"))
        lp_sdpa, t_sdpa = timed(lambda: stream_logprobs(trainer, rec, impl="sdpa"))
    d = (lp_flex.float() - lp_sdpa.float()).abs()[1:]
    result["flex_vs_dense_32k"] = dict(tokens=len(rec), evictions=len(rec.evictions), max_abs=float(d.max()),
                                       mean_abs=float(d.mean()), flex_s=t_flex, sdpa_dense_s=t_sdpa,
                                       speedup=t_sdpa / t_flex)
    print("flex vs dense 32k:", result["flex_vs_dense_32k"], flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def invariant_parity(path, trainer, result):
    """Engine(batch_invariant=True) + stream_logprobs(impl="invariant") on each eviction pattern; the
    default engine + flex on the same patterns beside it; then what the mode costs."""
    from kvstreams_sglang.checkpoints.episodes import EVICTION_PATTERNS, scripted_episode

    from kvstreams_sglang.engine import Engine
    from trainer_masks.scoring import stream_logprobs

    result["command"] += " --batch-invariant"
    for inv in (True, False):
        eng = Engine(str(path), kv_dtype="bf16", device="cuda", dtype=torch.bfloat16, kv_slots=65536, max_streams=8,
                     batch_invariant=inv)
        rows = {}
        for name, spec in EVICTION_PATTERNS.items():
            t = time.perf_counter()
            rec = scripted_episode(eng, **spec, turns=12, max_turn_tokens=60, env_tokens=(20, 80), seed=3)
            sample_s = time.perf_counter() - t
            with torch.no_grad():
                impl = "invariant" if inv else "flex"
                rows[f"{name}/{impl}"] = dict(parity(rec, stream_logprobs(trainer, rec, impl=impl)),
                                              sample_s=sample_s)
            print("invariant" if inv else "default", name, rows[f"{name}/{impl}"], flush=True)
        result["engine_bf16_invariant" if inv else "engine_bf16_default"] = rows
        del eng
        torch.cuda.empty_cache()
    cost = {}
    for n in (4096, 16384):
        rec = long_record(n)
        with torch.no_grad():
            lp_inv, t_inv = timed(lambda rec=rec: stream_logprobs(trainer, rec, impl="invariant"))
            lp_flex, t_flex = timed(lambda rec=rec: stream_logprobs(trainer, rec, impl="flex"))
        d = (lp_inv.float() - lp_flex.float()).abs()[1:]
        cost[f"score_{n}"] = dict(invariant_s=t_inv, flex_s=t_flex, ratio=t_inv / t_flex,
                                  max_abs_vs_flex=float(d.max()), mean_abs_vs_flex=float(d.mean()))
        print("score", n, cost[f"score_{n}"], flush=True)
    result["cost"] = cost
    out = os.path.join(os.environ.get("OUT", "bench/results"), "trainer_parity_invariant_h200.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
