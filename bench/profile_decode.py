"""One decode shape launched repeatedly, for Nsight Compute:
``ncu --kernel-name kv4_int4_splits --launch-skip 10 --launch-count 1 --section SpeedOfLight
--section WarpStateStats --section Occupancy python -m bench.profile_decode 128 8192``."""

from __future__ import annotations

import sys

import torch

from bench.decode_attention import build_kv4_case
from kvstreams_sglang.kernels import KV4DecodeWorkspace


def main() -> None:
    batch, length = (int(x) for x in sys.argv[1:3])
    cache, meta = build_kv4_case([length] * batch, 32, 8, 128, 16, 128, torch.device("cuda"))
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    ws = KV4DecodeWorkspace(batch, 32, 8, 128, device="cuda")
    ws.plan(**meta)
    for _ in range(20):
        ws.run(q, cache)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
