"""One decode shape launched repeatedly, for Nsight Compute:
``ncu --kernel-name _decode_kernel --launch-skip 10 --launch-count 1 --section SpeedOfLight
--section WarpStateStats --section Occupancy python -m bench.profile_decode 128 8192``."""

from __future__ import annotations

import sys

import torch

from bench.decode_attention import build_kv4_case
from kvstreams_sglang.kernels import kv4_decode


def main() -> None:
    batch, length = (int(x) for x in sys.argv[1:3])
    cache, plan, _ = build_kv4_case([length] * batch, 32, 8, 128, 16, 128, torch.device("cuda"))
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        kv4_decode(q, cache, plan)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
