"""GPU diagnostic (v6): per-request LSE / output error of the decode kernels (Triton; the CUDA kernel's variants,
eager and graph plans) against the torch reference, over repeated calls (a race shows as a changing error).
``python -m bench.decode_lse_check``."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")
from kv4_cases import filled_cache

from kvstreams_sglang.kernels import CudaDecodeVariant, KV4DecodeWorkspace, plan_decode
from kvstreams_sglang.kv4.reference import decode_reference


def main():
    device = torch.device("cuda")
    lengths, hkv = [300, 17, 1000, 5000], 8
    cache, meta, _ = filled_cache(lengths, hkv=hkv, seed=len(lengths) + hkv, device=device)
    torch.manual_seed(0)
    variants = {"tri": (None, None), "p2": (CudaDecodeVariant(), None), "p3": (CudaDecodeVariant(pipe=3), None),
                "reg": (CudaDecodeVariant(pipe=0), None), "graph": (CudaDecodeVariant(), 8192)}
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(len(lengths), 4 * hkv, 128, device=device).to(dtype)
        ref_out, ref_lse = decode_reference(q.float(), cache, **meta)
        for name, (variant, max_context) in variants.items():
            plan = plan_decode(**meta, num_kv_heads=hkv, cuda_splits=3, max_context=max_context, cuda_variant=variant)
            ws = KV4DecodeWorkspace(len(lengths), 4 * hkv, hkv, 128, device=device)
            errs = []
            for _ in range(4):
                out, lse = ws.decode(q, cache, plan, return_lse=True)
                torch.cuda.synchronize()
                d = (lse - ref_lse).abs()
                tol = 1e-4 + 1e-4 * ref_lse.abs()
                bad = (d > tol).sum(1).tolist()
                oe = [float((out[i].float() - ref_out[i]).norm() / ref_out[i].norm()) for i in range(len(lengths))]
                errs.append((d.max(1).values.tolist(), bad, oe))
            print(f"{str(dtype)[6:]:9s} {name:5s}", " | ".join(
                "lse " + " ".join(f"{x:.1e}" for x in e[0]) + f" bad {e[1]} out " + " ".join(f"{x:.1e}" for x in e[2])
                for e in errs[:2]), "same" if all(e[0] == errs[0][0] for e in errs) else "VARIES", flush=True)


if __name__ == "__main__":
    main()
