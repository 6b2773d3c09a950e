"""Where an SFT step's time goes (issue 24): the learning bench's SFT ran ~104k tokens a step in ~4 s on the H200
(~26k tokens/s for a 74M-parameter model), an order of magnitude under its FLOPs. This times ``harness.sft.sft_step``
on records shaped like that bench's (``configs/textworld/gpu_small.toml``: coin25 episodes as one Sliding Window
KV stream, as full context, and as re-prefilled windows), split per micro-batch into packing, the block mask, the
forward and the backward, counts torch.compile's recompiles, and writes the profiler's top operators.

    python -m bench.sft_throughput --config configs/textworld/gpu_small.toml --steps 6 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from harness.config import load_config
from harness.trainer import micro_batches
from trainer_masks import StreamRecord
from trainer_masks.masks import flex_block_mask, pack
from trainer_masks.scoring import score_packed


def episode(rng: random.Random, vocab: int, *, turns: int = 30, obs: int = 70, act: int = 6,
            window: int | None = None) -> StreamRecord:
    """A synthetic agent stream: a 60-token prompt, then ``turns`` of (model act, env observation); with ``window``
    each turn from the ``window``-th evicts the oldest kept turn (Sliding Window, stride 1)."""
    ids, sources, spans, events = [], [], [], []

    def add(n, source):
        start = len(ids)
        ids.extend(rng.randrange(vocab) for _ in range(n))
        sources.extend([source] * n)
        return start, len(ids)

    add(60, "prompt")
    for _ in range(turns):
        a = add(act, "model")
        o = add(obs, "env")
        spans.append((a[0], o[1]))
        if window is not None and len(spans) > window:
            events.append({"at_index": len(ids), "spans": [spans.pop(0)]})
    n = len(ids)
    return StreamRecord(token_ids=ids, positions=list(range(n)), sources=sources,
                        loss_mask=[s == "model" for s in sources],
                        logprobs=[0.0 if s == "model" else None for s in sources],
                        policy_versions=[0 if s == "model" else None for s in sources], evictions=events)


def batch(rng: random.Random, vocab: int, episodes: int) -> list[list[StreamRecord]]:
    """One SFT step's parts: KV streams, full context, re-prefilled windows (~1k tokens each) of the same size."""
    streams = [episode(rng, vocab, window=10) for _ in range(episodes)]
    full = [episode(rng, vocab) for _ in range(episodes)]
    budget = sum(map(len, streams))
    windows, used = [], 0
    while used + 1000 <= budget:
        windows.append(episode(rng, vocab, turns=12))
        used += len(windows[-1])
    return [streams, full, windows]


def main(argv: list[str] | None = None) -> int:
    from harness.trainer import Trainer, TrainerConfig
    from kvstreams_sglang.checkpoints import build_tiny_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/textworld/gpu_small.toml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--episodes", type=int, default=None, help="per rendering (default: the config's sft)")
    p.add_argument("--micro-batch-tokens", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from bench.learning import LearningConfig

    cfg = load_config(args.config, schema=LearningConfig)
    sft, t = cfg.sft, cfg.model.tiny
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    tokens_cap = args.micro_batch_tokens or sft.micro_batch_tokens
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "m", num_layers=t.num_layers, hidden_size=t.hidden_size,
                                num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                                intermediate_size=t.intermediate_size)
        trainer = Trainer(str(path), TrainerConfig(lr=sft.lr, impl=cfg.trainer.impl), device)
    vocab = 250
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for step in range(args.steps):
        parts = batch(rng, vocab, args.episodes or sft.episodes_per_step)
        trainer.model.train()
        trainer.optimizer.zero_grad(set_to_none=True)
        split = {"pack": 0.0, "mask": 0.0, "forward": 0.0, "backward": 0.0}
        sync()
        t0 = time.perf_counter()
        n_micro = 0
        for part in parts:
            for chunk in micro_batches(part, sft.micro_batch_records, tokens_cap):
                n_micro += 1
                a = time.perf_counter()
                packed = pack(chunk).to(device)
                sync()
                b = time.perf_counter()
                if device.type == "cuda":
                    flex_block_mask(packed, device)  # timed alone; score_packed builds its own
                sync()
                c = time.perf_counter()
                scores = score_packed(trainer.model, packed)
                loss = -sum(s.logprobs[s.loss_mask].sum() for s in scores) / 1e4
                sync()
                d = time.perf_counter()
                loss.backward()
                sync()
                e = time.perf_counter()
                for k, v in zip(split, (b - a, c - b, d - c, e - d), strict=True):
                    split[k] += v
        trainer.optimizer.step()
        sync()
        total = time.perf_counter() - t0
        tokens = sum(len(r) for part in parts for r in part)
        rows.append({"step": step, "s": total, "tokens": tokens, "tokens_per_s": tokens / total,
                     "micro_batches": n_micro, **{f"{k}_s": v for k, v in split.items()}})
        print(json.dumps(rows[-1]), flush=True)
    top = None
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        parts = batch(rng, vocab, args.episodes or sft.episodes_per_step)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for part in parts:
                for chunk in micro_batches(part, sft.micro_batch_records, tokens_cap):
                    scores = score_packed(trainer.model, pack(chunk))
                    (-sum(s.logprobs[s.loss_mask].sum() for s in scores)).backward()
            sync()
        top = {"by_cuda": prof.key_averages().table(sort_by="cuda_time_total", row_limit=25),
               "by_cpu": prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)}
        print(top["by_cuda"])
        print(top["by_cpu"])
    counters = {}
    try:
        from torch._dynamo.utils import counters as dyn

        counters = {k: dict(v) for k, v in dyn.items() if k in ("stats", "recompiles", "frames")}
    except Exception:  # diagnostics only
        pass
    result = {"config": args.config, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "micro_batch_tokens": tokens_cap, "rows": rows, "dynamo": counters, "profile": top}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
