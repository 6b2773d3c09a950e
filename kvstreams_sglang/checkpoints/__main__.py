"""Build a tiny model directory from the command line: ``python -m kvstreams_sglang.checkpoints DIR``."""

from __future__ import annotations

import argparse

import torch

from kvstreams_sglang.checkpoints.tiny_model import build_tiny_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvstreams_sglang.checkpoints", description=__doc__)
    parser.add_argument("path", help="output directory (created if missing)")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=None)
    parser.add_argument("--max-position-embeddings", type=int, default=32768)
    parser.add_argument("--rope-theta", type=float, default=1e6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)

    path = build_tiny_model(
        args.path,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        seed=args.seed,
        dtype=DTYPES[args.dtype],
    )
    print(path)


if __name__ == "__main__":
    main()
