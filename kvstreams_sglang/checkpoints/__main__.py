"""Build a model directory from the command line: ``python -m kvstreams_sglang.checkpoints DIR``
(tiny by default; ``--shape qwen3-4b`` for the benchmarks' random Qwen3-4B-shaped checkpoint)."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from kvstreams_sglang.checkpoints.tiny_model import QWEN3_4B, build_tiny_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SHAPES = {"qwen3-4b": QWEN3_4B}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvstreams_sglang.checkpoints", description=__doc__)
    parser.add_argument("path", help="output directory (created if missing)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="a named shape (its sizes override the size flags below)")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=None)
    parser.add_argument("--vocab-rows", type=int, default=None, help="embedding rows (default: the tokenizer's)")
    parser.add_argument("--max-position-embeddings", type=int, default=32768)
    parser.add_argument("--rope-theta", type=float, default=1e6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu", help="where to initialise the weights (cuda: fast for 4B)")
    args = parser.parse_args(argv)

    sizes = dict(num_layers=args.num_layers, hidden_size=args.hidden_size, num_heads=args.num_heads,
                 num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate_size,
                 vocab_rows=args.vocab_rows, max_position_embeddings=args.max_position_embeddings)
    if args.shape:
        sizes = dataclasses.replace(SHAPES[args.shape]).kwargs()
    path = build_tiny_model(args.path, **sizes, rope_theta=args.rope_theta, seed=args.seed, dtype=DTYPES[args.dtype],
                            device=args.device)
    print(path)


if __name__ == "__main__":
    main()
