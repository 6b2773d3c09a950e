"""The Triton kernels (KV4, the region planner, the HF-rounding norm) compile for the H200 (sm_90) anywhere.

CI runs the kernels under Triton's interpreter, which accepts code the compiler rejects (a string default of a
``tl.constexpr`` helper parameter passed the interpreter and failed on the H200: 2026-12-03). Each case here goes
through Triton's real front end and NVIDIA back end (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``: TTIR,
TTGIR, LLVM, PTX, cubin with the ptxas Triton ships) in a subprocess without the interpreter, with the
constexprs of the launches the rollouts make."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvstreams_sglang.kernels import decode, extend, hf_rms_norm, quantize, region_plan, store

    KERNELS = dict(query=quantize._query_kernel, decode=decode._decode_kernel, extend=extend._extend_kernel,
                   merge=extend._merge_splits_kernel, store=store._store_kernel,
                   hf_rms_norm=hf_rms_norm._hf_rms_norm_kernel, plan_count=region_plan._count_kernel,
                   plan_write=region_plan._write_kernel)
    INTS = {"H", "R", "N", "num_heads", "chunk", "magic", "splits", "num_req", "sink", "recent", "ring", "width"}
    case = json.loads(sys.argv[1])
    fn = KERNELS[case["kernel"]]
    signature = {}
    for name in fn.arg_names:
        if name in case["constexprs"]:
            signature[name] = "constexpr"
        elif name in case["pointers"]:
            signature[name] = "*" + case["pointers"][name]
        elif name.startswith("stride_") or name in INTS:
            signature[name] = "i32"
        elif name in ("sm_scale_log2", "inv_n", "eps"):
            signature[name] = "fp32"
        else:
            raise SystemExit(f"no type for {case['kernel']}'s argument {name}")
    kernel = triton.compile(ASTSource(fn, signature=signature, constexprs=case["constexprs"]),
                            target=GPUTarget("cuda", 90, 32))
    print(json.dumps({"registers": kernel.n_regs if hasattr(kernel, "n_regs") else None,
                      "cubin_bytes": len(kernel.asm["cubin"])}))
""")

CACHE = dict(KCodes="u8", VCodes="u8", KSide="i8", VSide="i8", KSideScale="fp16", VSideScale="fp16")
Q = dict(Q="bf16", Hmat="fp32")
CASES = {
    "query": dict(kernel="query", pointers=dict(**Q, Codes="i8", Scale="fp16"),
                  constexprs=dict(HALF=64, BLOCK_R=64, ROTATE=True)),
    "decode_rotate": dict(kernel="decode", pointers=dict(
        **Q, KvIndptr="i32", KvIndices="i32", SideIndptr="i32", SideIndices="i32", **CACHE, KMeta32="i32",
        VMeta32="i32", PartOut="fp32", PartLse="fp32", Counter="i32", Out="bf16", LseOut="fp32"),
        constexprs=dict(HKV=8, GROUP=4, BLOCK_H=16, BLOCK_N=64, HALF=64, NUM_SPLITS=4, PREFETCH=False, USE_ASM=True,
                        OFF64=False, ROTATE=True)),
    "extend_grid": dict(kernel="extend", pointers=dict(
        Q="bf16", Q8="i8", QScale="fp16", KNew="bf16", VNew="bf16", QoIndptr="i32", KvIndptr="i32", KvIndices="i32",
        SideIndptr="i32", SideIndices="i32", **CACHE, KMeta="i32", VMeta="i32", Out="bf16", Lse="bf16"),
        constexprs=dict(GROUP=4, TOK=32, BLOCK_R=128, BLOCK_N=32, HALF=64, DOT_PREC="tf32", WORDS=True,
                        USE_ASM=True)),
    "extend_split_bytes": dict(kernel="extend", pointers=dict(
        Q="bf16", Q8="i8", QScale="fp16", KNew="bf16", VNew="bf16", QoIndptr="i32", KvIndptr="i32", KvIndices="i32",
        SideIndptr="i32", SideIndices="i32", **CACHE, KMeta="fp16", VMeta="fp16", Out="fp32", Lse="fp32"),
        constexprs=dict(GROUP=4, TOK=32, BLOCK_R=128, BLOCK_N=64, HALF=64, DOT_PREC="tf32", WORDS=False,
                        USE_ASM=False)),
    "merge": dict(kernel="merge", pointers=dict(Part="fp32", Lse="fp32", Out="bf16"),
                  constexprs=dict(SPLITS_P2=16, BLOCK_H=16, D=128)),
    "store": dict(kernel="store", pointers=dict(K="bf16", V="bf16", Slots="i64", SideSlots="i64", Hmat="fp32", **CACHE,
                                                KMeta="fp16", VMeta="fp16"),
                  constexprs=dict(HALF=64, BLOCK_T=64, ROTATE=True, ROT_PREC="tf32x3")),
    "plan_count": dict(kernel="plan_count", pointers=dict(rows="i64", lengths="i64", ends="i64", req_to_token="i32",
                                                         slot_positions="i32", counts="i32"),
                       constexprs=dict(BLOCK=256)),
    "plan_write": dict(kernel="plan_write", pointers=dict(rows="i64", lengths="i64", ends="i64", req_to_token="i32",
                                                         slot_positions="i32", kv_indptr="i32", side_indptr="i32",
                                                         kv_indices="i32", side_indices="i32"),
                       constexprs=dict(BLOCK=256)),
    "hf_rms_norm": dict(kernel="hf_rms_norm", pointers=dict(X="bf16", R="bf16", W="bf16", OUT="bf16", SUM="bf16"),
                        constexprs=dict(HAS_RESIDUAL=True, BF16=True, BLOCK=4096)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_compiles_for_sm90(name):
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES[name])], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["cubin_bytes"] > 0
