"""Extend/prefill kernel: new tokens attend to the quantised cached prefix (INT4 and INT8
regions, INT8 query as in decode) and, in full precision, causally to each other.

Grid ``(query blocks, B x splits, Hkv)``. A program's rows are (token, query head) pairs of one
KV head: ``BLOCK_R`` rows = ``BLOCK_R // GROUP`` tokens x ``GROUP`` heads, so GQA heads share
every K/V tile. The three key sets (INT4 prefix, INT8 prefix, new tokens) are folded into
one online softmax, which is the exact LSE merge done incrementally.

Split-K: an agent's turn is a few hundred new tokens on a prefix of thousands, so the grid
has ~100 programs that each walk the whole prefix: the H200's 132 SMs sit at one program each,
latency bound. With ``splits > 1`` each program takes one contiguous chunk of the INT4 prefix
(the last split also takes the INT8 region and the new tokens), writes its normalised partial
output and log2-sum-exp, and ``_merge_splits_kernel`` combines them exactly (flash-decoding).
Reference: ``kv4.reference.extend_reference``.

One compiled variant per launch shape, whatever the batch: the split count is a runtime argument, and Triton
does not specialise on the arguments that follow the batch (``BATCH_INTS``: the partials' strides grow with its
tokens; ``INDEX_POINTERS``: the index lists are views at any offset). As constexprs and specialised values they
made 40 extend and 25 merge variants on a fresh H100 (2026-12-07), one every ~3 s in SGLang's scheduler thread:
at the server's start, through a learning run's first evaluation (84 s for 128 TextWorld games; with 64 games the
first took 38 s and the later ones 6.5-8 s) and into its first RL steps, on the run's clock.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..kv4.cache import KV4LayerCache
from .decode import FP16_MAGIC, LOG2E, meta_words, use_asm
from .quantize import kv4_quantize_query
from .tiles import int4_load_w, int4_math_w, int4_tile, int8_region, online_update

# launch arguments that change with the batch: not specialised on (module docstring)
BATCH_INTS = ("splits", "stride_os", "stride_ls", "stride_ps")
INDEX_POINTERS = ("QoIndptr", "KvIndptr", "KvIndices", "SideIndptr", "SideIndices")
MAX_SPLITS = 16  # extend_splits' cap: the merge loads every split's log2-sum-exp in one tile


@triton.jit(do_not_specialize=BATCH_INTS, do_not_specialize_on_alignment=INDEX_POINTERS)
def _extend_kernel(
    Q, stride_qt, stride_qh, Q8, QScale, stride_q8t, stride_q8h, stride_qst, stride_qsh,
    KNew, VNew, stride_kt, stride_kh, stride_vt, stride_vh, QoIndptr,
    KvIndptr, KvIndices, SideIndptr, SideIndices,
    KCodes, KMeta, VCodes, VMeta, KSide, KSideScale, VSide, VSideScale,
    stride_cs, stride_ch, stride_ms, stride_mh, stride_ss, stride_sh, stride_scs, stride_sch,
    Out, stride_os, stride_ot, stride_oh, Lse, stride_ls, stride_lt,
    sm_scale_log2, magic, splits,
    GROUP: tl.constexpr, TOK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF: tl.constexpr, DOT_PREC: tl.constexpr, WORDS: tl.constexpr, USE_ASM: tl.constexpr,
):
    mb = tl.program_id(0)
    b = tl.program_id(1) // splits
    split = tl.program_id(1) % splits
    hk = tl.program_id(2)
    q_start = tl.load(QoIndptr + b)
    n_new = tl.load(QoIndptr + b + 1) - q_start
    if mb * TOK >= n_new:
        return
    r = tl.arange(0, BLOCK_R)
    t_rel = mb * TOK + r // GROUP  # token index inside this request's new tokens
    qh = hk * GROUP + r % GROUP
    rmask = (r < TOK * GROUP) & (t_rel < n_new)
    t = q_start + t_rel
    d = tl.arange(0, HALF)

    q8_ptr = Q8 + t[:, None] * stride_q8t + qh[:, None] * stride_q8h + d[None, :]
    q8_lo = tl.load(q8_ptr, mask=rmask[:, None], other=0)
    q8_hi = tl.load(q8_ptr + HALF, mask=rmask[:, None], other=0)
    qs = tl.load(QScale + t * stride_qst + qh * stride_qsh, mask=rmask, other=0.0).to(tl.float32) * sm_scale_log2
    q_sum = (tl.sum(q8_lo.to(tl.int32), 1) + tl.sum(q8_hi.to(tl.int32), 1)).to(tl.float32)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc_lo = tl.zeros([BLOCK_R, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_R, HALF], tl.float32)

    # ---- INT4 prefix: this split's chunk (BLOCK_N-aligned) ----
    start = tl.load(KvIndptr + b)
    length = tl.load(KvIndptr + b + 1) - start
    chunk = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)
    acc_off = tl.zeros([BLOCK_R], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < hi
        slot = tl.load(KvIndices + start + n, mask=nmask, other=0).to(tl.int64)
        if WORDS:  # KMeta/VMeta are int32 words (scale, offset): the decode's word-wide unpack
            kc, kw, vc, vw = int4_load_w(slot, nmask, hk, KCodes, KMeta, VCodes, VMeta, stride_cs, stride_ch,
                                         stride_ms, stride_mh, HALF)
            m_i, l_i, acc_lo, acc_hi, acc_off = int4_math_w(q8_lo, q8_hi, qs, q_sum, m_i, l_i, acc_lo, acc_hi,
                                                            acc_off, nmask, kc, kw, vc, vw, magic, USE_ASM)
        else:
            m_i, l_i, acc_lo, acc_hi, acc_off = int4_tile(
                q8_lo, q8_hi, qs, q_sum, m_i, l_i, acc_lo, acc_hi, acc_off, slot, nmask, hk,
                KCodes, KMeta, VCodes, VMeta, stride_cs, stride_ch, stride_ms, stride_mh, HALF)
    acc_lo += acc_off[:, None]
    acc_hi += acc_off[:, None]

    # ---- INT8 prefix (last split) ----
    if split == splits - 1:
        m_i, l_i, acc_lo, acc_hi = int8_region(
            q8_lo, q8_hi, qs, m_i, l_i, acc_lo, acc_hi, SideIndptr, SideIndices, b, hk,
            KSide, KSideScale, VSide, VSideScale, stride_ss, stride_sh, stride_scs, stride_sch, BLOCK_N, HALF)

    # ---- new tokens, full precision, causal (last split) ----
    q_ptr = Q + t[:, None] * stride_qt + qh[:, None] * stride_qh + d[None, :]
    q_lo = tl.load(q_ptr, mask=rmask[:, None], other=0.0)
    q_hi = tl.load(q_ptr + HALF, mask=rmask[:, None], other=0.0)
    fs = sm_scale_log2
    kv_end = tl.where(split == splits - 1, tl.minimum(n_new, mb * TOK + TOK), 0)
    for j0 in range(0, kv_end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jmask = j < kv_end
        k_ptr = KNew + (q_start + j)[:, None] * stride_kt + hk * stride_kh + d[None, :]
        k_lo = tl.load(k_ptr, mask=jmask[:, None], other=0.0)
        k_hi = tl.load(k_ptr + HALF, mask=jmask[:, None], other=0.0)
        qk = tl.dot(q_lo, tl.trans(k_lo), input_precision=DOT_PREC) + \
            tl.dot(q_hi, tl.trans(k_hi), input_precision=DOT_PREC)
        s = qk * fs
        s = tl.where(jmask[None, :] & (j[None, :] <= t_rel[:, None]), s, float("-inf"))
        p, m_i, l_i, acc_lo, acc_hi, alpha = online_update(s, m_i, l_i, acc_lo, acc_hi)
        v_ptr = VNew + (q_start + j)[:, None] * stride_vt + hk * stride_vh + d[None, :]
        v_lo = tl.load(v_ptr, mask=jmask[:, None], other=0.0)
        v_hi = tl.load(v_ptr + HALF, mask=jmask[:, None], other=0.0)
        pv = p.to(v_lo.dtype)
        acc_lo += tl.dot(pv, v_lo, input_precision=DOT_PREC)
        acc_hi += tl.dot(pv, v_hi, input_precision=DOT_PREC)

    denom = tl.where(l_i > 0, l_i, 1.0)
    o_ptr = Out + split * stride_os + t[:, None] * stride_ot + qh[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, (acc_lo / denom[:, None]).to(Out.dtype.element_ty), mask=rmask[:, None])
    tl.store(o_ptr + HALF, (acc_hi / denom[:, None]).to(Out.dtype.element_ty), mask=rmask[:, None])
    if splits > 1:  # the split's log2-sum-exp (-inf when it saw no key) for the merge
        lse = tl.where(l_i > 0, m_i + tl.log2(denom), float("-inf"))
        tl.store(Lse + split * stride_ls + t * stride_lt + qh, lse, mask=rmask)


@triton.jit(do_not_specialize=BATCH_INTS)
def _merge_splits_kernel(Part, Lse, Out, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
                         num_heads, splits, SPLITS_P2: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr):
    """``out[t, h] = sum_s 2^(lse_s - M) part_s / sum_s 2^(lse_s - M)``: the exact merge of the splits, in split
    order (``SPLITS_P2``: a power of two >= ``splits``)."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < num_heads
    s = tl.arange(0, SPLITS_P2)
    lse = tl.load(Lse + s[:, None] * stride_ls + t * stride_lt + h[None, :],
                  mask=(s[:, None] < splits) & hmask[None, :], other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    for i in range(splits):
        lse_i = tl.load(Lse + i * stride_ls + t * stride_lt + h, mask=hmask, other=float("-inf"))
        w = tl.exp2(lse_i - m)
        part = tl.load(Part + i * stride_ps + t * stride_pt + h[:, None] * stride_ph + d[None, :], mask=hmask[:, None],
                       other=0.0)
        acc += w[:, None] * part.to(tl.float32)
        total += w
    total = tl.where(total > 0, total, 1.0)
    tl.store(Out + t * stride_ot + h[:, None] * stride_oh + d[None, :], (acc / total[:, None]).to(Out.dtype.element_ty),
             mask=hmask[:, None])


class ExtendTile(NamedTuple):
    """Launch shape of ``_extend_kernel``: ``block_r`` (token, query head) rows and ``block_n`` prefix keys per
    program, ``num_warps``, and ``words``: INT4 tiles unpacked word-wide as in decode (inline PTX on the GPU, the
    same arithmetic), else byte by byte."""
    block_r: int
    block_n: int
    num_warps: int = 4
    words: bool = True

    @classmethod
    def parse(cls, text: str) -> ExtendTile:
        """``"block_r,block_n,num_warps,words|bytes"``, e.g. ``"128,64,8,words"``."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 4 or parts[3] not in ("words", "bytes") or not all(p.isdigit() for p in parts[:3]):
            raise ValueError(f"extend tile {text!r}: expected 'block_r,block_n,num_warps,words|bytes'")
        return cls(int(parts[0]), int(parts[1]), int(parts[2]), parts[3] == "words")

    def name(self) -> str:
        return f"{self.block_r},{self.block_n},{self.num_warps},{'words' if self.words else 'bytes'}"


# The default launch shapes, from the H200 sweep (bench/results/extend_sweep_h200.json: 1.43x the byte-unpack
# 64-row tile in geometric mean over 8 shapes): 128 rows (32 tokens x 4 heads) halve the prefix unpacking per
# query; a grid that fills the GPU unsplit runs best with 32-key tiles and 4 warps (a rollout step's turns:
# 16 x 3072 + 192 new, 0.96 ms vs 1.50), a split-K grid with 64-key tiles and 8 warps (1 x 8192 + 64: 0.15 vs 0.29).
GRID_TILE = ExtendTile(128, 32, 4, True)
SPLIT_TILE = ExtendTile(128, 64, 8, True)
# batch-invariant extends (``attend.kv4_attention_step(invariant=True)``): one tile and no split-K whatever the grid,
# so that a request's sums run in the same order in any batch (the tile and the split otherwise follow the grid size)
INVARIANT_TILE = GRID_TILE
# KVSTREAMS_EXTEND_TILE="block_r,block_n,num_warps,words|bytes" replaces both process-wide (benchmarks: a tile
# from `bench.decode_attention --extend-sweep` tried in a rollout without a code change)
TILE_OVERRIDE = ExtendTile.parse(os.environ["KVSTREAMS_EXTEND_TILE"]) \
    if os.environ.get("KVSTREAMS_EXTEND_TILE") else None

_PARTIAL_BYTES = 64 << 20  # cap on the split partials' scratch (fp32 outputs of every split)


def _sm_count(device: torch.device) -> int:
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4


@functools.cache
def _cuda_sm_count(index: int) -> int:  # (asked once per layer of every prefill step otherwise)
    return torch.cuda.get_device_properties(index).multi_processor_count


def _kernel_operand(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` with unit stride in the last dim (the kernels take the other strides): no copy when it
    already is (SGLang's q/k/v are views of one projection)."""
    x = x if x.dtype == dtype else x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def extend_splits(programs: int, n: int, hq: int, d: int, device: torch.device) -> int:
    """How many chunks to cut each request's INT4 prefix into: none when the grid has a program per SM already,
    else enough for two per SM, no more than 16 chunks, and the partials within ``_PARTIAL_BYTES``. Decided on the
    host from the grid alone (the prefix lengths live on the device); a split whose chunk is empty costs one store.
    H200 (extend_sweep_h200.json, extend_auto_h200.json): 16-64 programs ran 1.3-3.9x faster split; 256 programs
    (1 x 8192 + 1024) ran 0.76 ms unsplit against 0.91 in two."""
    sms = _sm_count(device)
    if programs >= sms:
        return 1
    want = triton.cdiv(2 * sms, max(programs, 1))
    cap = max(_PARTIAL_BYTES // max(n * hq * d * 4, 1), 1)
    return int(max(1, min(want, MAX_SPLITS, cap)))


def kv4_extend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: torch.Tensor,
               cache: KV4LayerCache, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
               side_indptr: torch.Tensor, side_indices: torch.Tensor, *, max_new_tokens: int | None = None,
               sm_scale: float | None = None, rotate: bool = True, tile: ExtendTile | None = None,
               splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q [N, Hq, D]``, ``k_new, v_new [N, Hkv, D]`` (post-RoPE, unrotated) for the new
    tokens of ``B`` requests laid out by ``qo_indptr [B+1]``; the prefix index lists are
    CSR like in decode. Returns ``out [N, Hq, D]`` in q's dtype (fp32 for fp64).
    ``splits``: chunks of the INT4 prefix run by separate programs and merged (None: ``extend_splits``);
    ``tile``: the launch shape (None: ``TILE_OVERRIDE`` if set, else ``GRID_TILE`` or, when the grid needs
    split-K, ``SPLIT_TILE``). ``out``: an ``[N, Hq, D]`` buffer in the compute dtype (unit stride in D) to write into
    and return, e.g. a view of SGLang's attention output (``forward_batch._attn_output``), which then needs no copy."""
    n, hq, d = q.shape
    hkv = cache.num_kv_heads
    if hq % hkv or d != cache.head_dim or k_new.shape != (n, hkv, d) or v_new.shape != k_new.shape:
        raise ValueError(f"kv4_extend: q {tuple(q.shape)}, k_new {tuple(k_new.shape)}, v_new "
                         f"{tuple(v_new.shape)} do not fit cache Hkv={hkv}, D={cache.head_dim}")
    group = hq // hkv
    sm_scale = sm_scale if sm_scale is not None else d ** -0.5
    compute = torch.float32 if q.dtype == torch.float64 else q.dtype
    qc, kc, vc = (_kernel_operand(x, compute) for x in (q, k_new, v_new))
    q8 = kv4_quantize_query(q, rotate=rotate)
    codes, qscale = q8.codes.contiguous(), q8.scale.contiguous()
    if out is None:
        out = torch.empty(n, hq, d, dtype=compute, device=q.device)
    elif out.shape != (n, hq, d) or out.dtype != compute or out.stride(-1) != 1:
        raise ValueError(f"kv4_extend: out {tuple(out.shape)} {out.dtype} (stride {out.stride()}) is not an "
                         f"[{n}, {hq}, {d}] {compute} buffer with unit stride in D")
    if n == 0:
        return out
    if max_new_tokens is None:
        max_new_tokens = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    b = qo_indptr.numel() - 1

    def grid(block_r: int) -> tuple[int, int, int]:  # (block_r, tokens per program, query blocks)
        block_r = max(block_r, 16, triton.next_power_of_2(group))
        return block_r, block_r // group, triton.cdiv(max_new_tokens, block_r // group)

    if tile is None and TILE_OVERRIDE is None:  # GRID_TILE and SPLIT_TILE have the same rows: one grid decides
        _, _, blocks = grid(GRID_TILE.block_r)
        split = (splits or extend_splits(blocks * b * hkv, n, hq, d, q.device)) > 1
        tile = SPLIT_TILE if split else GRID_TILE
    tile = tile or TILE_OVERRIDE
    block_r, tok, q_blocks = grid(tile.block_r)
    if splits is None:
        splits = extend_splits(q_blocks * b * hkv, n, hq, d, q.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"kv4_extend: splits={splits}, expected 1..{MAX_SPLITS}")
    if splits > 1:
        part = torch.empty(splits, n, hq, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, n, hq, dtype=torch.float32, device=q.device)
        target, lse_strides = part, (lse.stride(0), lse.stride(1))
    else:
        part = lse = None
        target, lse_strides = out.unsqueeze(0), (0, 0)
    c = cache
    k_meta, v_meta = (meta_words(c.k_meta), meta_words(c.v_meta)) if tile.words else (c.k_meta, c.v_meta)
    _extend_kernel[(q_blocks, b * splits, hkv)](
        qc, qc.stride(0), qc.stride(1), codes, qscale, codes.stride(0), codes.stride(1),
        qscale.stride(0), qscale.stride(1),
        kc, vc, kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), qo_indptr.to(torch.int32),
        kv_indptr.to(torch.int32), kv_indices, side_indptr.to(torch.int32), side_indices,
        c.k_codes, k_meta, c.v_codes, v_meta, c.k_side, c.k_side_scale, c.v_side, c.v_side_scale,
        c.k_codes.stride(0), c.k_codes.stride(1), k_meta.stride(0), k_meta.stride(1),
        c.k_side.stride(0), c.k_side.stride(1), c.k_side_scale.stride(0), c.k_side_scale.stride(1),
        target, target.stride(0), target.stride(1), target.stride(2), lse if lse is not None else target,
        *lse_strides,
        sm_scale * LOG2E, FP16_MAGIC, splits,
        GROUP=group, TOK=tok, BLOCK_R=block_r, BLOCK_N=tile.block_n, HALF=d // 2,
        DOT_PREC="ieee" if compute == torch.float32 else "tf32", WORDS=tile.words,
        USE_ASM=use_asm(q.device), num_warps=tile.num_warps,
    )
    if splits > 1:
        block_h = min(triton.next_power_of_2(hq), 16)
        _merge_splits_kernel[(n, triton.cdiv(hq, block_h))](
            part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), hq, splits, SPLITS_P2=MAX_SPLITS, BLOCK_H=block_h, D=d)
    return out
