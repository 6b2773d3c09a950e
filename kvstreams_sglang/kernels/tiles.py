"""One key tile of each KV4 region, folded into an online softmax.

Shared by the decode and extend kernels: the rows of ``q`` are query heads (decode) or
(token, head) pairs (extend); a tile never needs to know which. Scores are in the log2
domain (``qs`` already holds ``s_q * sm_scale * log2(e)``).
"""

import triton
import triton.language as tl


@triton.jit
def online_update(s, m_i, l_i, acc_lo, acc_hi):
    """Rescale the running state to the tile's new row maxima; returns p and the state."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc_lo * alpha[:, None], acc_hi * alpha[:, None], alpha


@triton.jit
def centred_fp16(nibble):
    """``nibble - 8`` as fp16 without an int-to-float conversion: ``0x6400 | n`` is the fp16 bit
    pattern of ``1024 + n`` (exact), so one OR and one subtract replace the slow I2F."""
    return (nibble.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0


@triton.jit
def int4_load(slot, nmask, hk, KCodes, KMeta, VCodes, VMeta, stride_cs, stride_ch, stride_ms, stride_mh,
              HALF: tl.constexpr):
    """Issue the loads of one INT4 tile at ``slot [BLOCK_N]``: codes (split-half packed) and the
    per-vector fp16 scale/offset of keys and values. Separate from ``int4_math`` so a loop can
    issue tile i+1's loads before doing tile i's math (page-size-1 gathers are latency bound)."""
    d = tl.arange(0, HALF)
    code_ptr = slot[:, None] * stride_cs + hk * stride_ch + d[None, :]
    meta_ptr = slot * stride_ms + hk * stride_mh
    kc = tl.load(KCodes + code_ptr, mask=nmask[:, None], other=0)  # [BLOCK_N, HALF] uint8
    k_scale = tl.load(KMeta + meta_ptr, mask=nmask, other=0.0).to(tl.float32)
    k_off = tl.load(KMeta + meta_ptr + 1, mask=nmask, other=0.0).to(tl.float32)
    vc = tl.load(VCodes + code_ptr, mask=nmask[:, None], other=0)
    v_scale = tl.load(VMeta + meta_ptr, mask=nmask, other=0.0).to(tl.float32)
    v_off = tl.load(VMeta + meta_ptr + 1, mask=nmask, other=0.0).to(tl.float32)
    return kc, k_scale, k_off, vc, v_scale, v_off


@triton.jit
def int4_math(q_lo, q_hi, qs, q_sum, m_i, l_i, acc_lo, acc_hi, acc_off, nmask, kc, k_scale, k_off, vc, v_scale,
              v_off):
    """``q.k ~ s_q (scale (q8 . c) + offset sum(q8))`` as an integer dot; ``P V = (P scale_v) (c_v - 8) +
    P . (offset_v + 8 scale_v)`` as an fp16 dot plus a row sum (``acc_off``). Centring the codes keeps
    both terms O(|v|): with raw codes they are each ~range/2 and cancel, and the fp16 rounding of
    ``P scale_v`` then dominates long averages (rel. error 4e-2 at 32k tokens of random data)."""
    qk = tl.dot(q_lo, tl.trans((kc & 15).to(tl.int8))) + tl.dot(q_hi, tl.trans((kc >> 4).to(tl.int8)))
    s = qs[:, None] * (k_scale[None, :] * qk.to(tl.float32) + k_off[None, :] * q_sum[:, None])
    s = tl.where(nmask[None, :], s, float("-inf"))
    p, m_i, l_i, acc_lo, acc_hi, alpha = online_update(s, m_i, l_i, acc_lo, acc_hi)
    pv = (p * v_scale[None, :]).to(tl.float16)
    acc_lo += tl.dot(pv, centred_fp16(vc & 15))
    acc_hi += tl.dot(pv, centred_fp16(vc >> 4))
    acc_off = acc_off * alpha + tl.sum(p * (v_off + 8.0 * v_scale)[None, :], 1)
    return m_i, l_i, acc_lo, acc_hi, acc_off


@triton.jit
def int4_tile(q_lo, q_hi, qs, q_sum, m_i, l_i, acc_lo, acc_hi, acc_off, slot, nmask, hk,
              KCodes, KMeta, VCodes, VMeta, stride_cs, stride_ch, stride_ms, stride_mh, HALF: tl.constexpr):
    """One INT4 tile, loads then math (the extend kernel's form)."""
    kc, k_scale, k_off, vc, v_scale, v_off = int4_load(slot, nmask, hk, KCodes, KMeta, VCodes, VMeta, stride_cs,
                                                       stride_ch, stride_ms, stride_mh, HALF)
    return int4_math(q_lo, q_hi, qs, q_sum, m_i, l_i, acc_lo, acc_hi, acc_off, nmask, kc, k_scale, k_off, vc,
                     v_scale, v_off)


@triton.jit
def int8_tile(q_lo, q_hi, qs, m_i, l_i, acc_lo, acc_hi, slot, nmask, hk,
              KSide, KSideScale, VSide, VSideScale, stride_ss, stride_sh, stride_scs, stride_sch,
              HALF: tl.constexpr):
    """INT8 side-cache keys/values at side ``slot [BLOCK_N]``: ``q.k ~ s_q s_k (q8 . k8)``."""
    d = tl.arange(0, HALF)
    ptr = slot[:, None] * stride_ss + hk * stride_sh + d[None, :]
    k_lo = tl.load(KSide + ptr, mask=nmask[:, None], other=0)
    k_hi = tl.load(KSide + ptr + HALF, mask=nmask[:, None], other=0)
    k_scale = tl.load(KSideScale + slot * stride_scs + hk * stride_sch, mask=nmask, other=0.0).to(tl.float32)
    v_lo = tl.load(VSide + ptr, mask=nmask[:, None], other=0)
    v_hi = tl.load(VSide + ptr + HALF, mask=nmask[:, None], other=0)
    v_scale = tl.load(VSideScale + slot * stride_scs + hk * stride_sch, mask=nmask, other=0.0).to(tl.float32)
    qk = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
    s = qs[:, None] * k_scale[None, :] * qk.to(tl.float32)
    s = tl.where(nmask[None, :], s, float("-inf"))
    p, m_i, l_i, acc_lo, acc_hi, alpha = online_update(s, m_i, l_i, acc_lo, acc_hi)
    pv = (p * v_scale[None, :]).to(tl.float16)
    acc_lo += tl.dot(pv, v_lo.to(tl.float16))
    acc_hi += tl.dot(pv, v_hi.to(tl.float16))
    return m_i, l_i, acc_lo, acc_hi


@triton.jit
def int8_region(q_lo, q_hi, qs, m_i, l_i, acc_lo, acc_hi, SideIndptr, SideIndices, b, hk,
                KSide, KSideScale, VSide, VSideScale, stride_ss, stride_sh, stride_scs, stride_sch,
                BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """Request ``b``'s whole INT8 side region (its sink and recent positions, CSR list ``SideIndices``),
    ``BLOCK_N`` side slots at a time, into the online-softmax state."""
    start = tl.load(SideIndptr + b)
    length = tl.load(SideIndptr + b + 1) - start
    for n0 in range(0, length, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < length
        slot = tl.load(SideIndices + start + n, mask=nmask, other=0).to(tl.int64)
        m_i, l_i, acc_lo, acc_hi = int8_tile(
            q_lo, q_hi, qs, m_i, l_i, acc_lo, acc_hi, slot, nmask, hk,
            KSide, KSideScale, VSide, VSideScale, stride_ss, stride_sh, stride_scs, stride_sch, HALF)
    return m_i, l_i, acc_lo, acc_hi


# ---- Decode fast path (v3): word-wide nibble unpack, one 32-bit meta load per vector ----
# Triton unpacks a uint8 tile one byte per 32-bit register (AND, SHIFT, then PRMT to repack: ~800 of
# the ~1440 instructions of a 128-token tile in v2). On the GPU the helpers below instead run one
# short PTX sequence per 4 packed bytes (``inline_asm_elementwise`` with ``pack=4``: the 4 bytes
# arrive as one 32-bit register); the Triton interpreter, which has no inline assembly, takes the
# element-wise form of the same arithmetic.

@triton.jit
def nibbles_int8(c, USE_ASM: tl.constexpr):
    """Low and high nibbles of ``c`` (uint8) as int8 codes 0..15."""
    if USE_ASM:
        lo = tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [c], dtype=tl.int8,
                                       is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise("{.reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F;}", "=r,r", [c],
                                       dtype=tl.int8, is_pure=True, pack=4)
    else:
        lo = (c & 15).to(tl.int8)
        hi = (c >> 4).to(tl.int8)
    return lo, hi


@triton.jit
def nibbles_centred_fp16(c, magic, USE_ASM: tl.constexpr):
    """Low and high nibbles ``n`` of ``c`` (uint8) as fp16 ``n - 8``: per two values one PRMT (spread two
    bytes to the two fp16 halves), one LOP3 (``n | 0x6400`` = fp16 ``1024 + n``) and one packed HSUB2
    (high nibbles: ``16 n | 0x6400``, then one HFMA2 ``x / 16 - 72``; all exact). ``magic`` is the
    run-time value 0x64006400 (a kernel argument): with it as an immediate, ptxas recognises the trick
    and emits one quarter-rate I2F.F16 per value instead."""
    if USE_ASM:
        lo = tl.inline_asm_elementwise(
            "{.reg .b32 t0, t1, k; add.u32 k, $3, 0x00080008;"
            " prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342;"
            " lop3.b32 t0, t0, 0x000F000F, $3, 0xEA; lop3.b32 t1, t1, 0x000F000F, $3, 0xEA;"
            " sub.f16x2 $0, t0, k; sub.f16x2 $1, t1, k;}",
            "=r,=r,r,r,r,r,r", [c, magic], dtype=tl.float16, is_pure=False, pack=4)
        hi = tl.inline_asm_elementwise(
            "{.reg .b32 t0, t1, a, b; sub.u32 a, $3, 0x38003800; add.u32 b, $3, 0x70807080;"
            " prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342;"
            " lop3.b32 t0, t0, 0x00F000F0, $3, 0xEA; lop3.b32 t1, t1, 0x00F000F0, $3, 0xEA;"
            " fma.rn.f16x2 $0, t0, a, b; fma.rn.f16x2 $1, t1, a, b;}",
            "=r,=r,r,r,r,r,r", [c, magic], dtype=tl.float16, is_pure=False, pack=4)
    else:
        lo = centred_fp16(c & 15)
        hi = centred_fp16(c >> 4)
    return lo, hi


@triton.jit
def meta_pair(w):
    """(scale, offset) as fp32 from the 32-bit word holding the two fp16 values (scale in the low half)."""
    scale = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    offset = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, offset


@triton.jit
def int4_load_w(slot, nmask, hk, KCodes, KMeta32, VCodes, VMeta32, stride_cs, stride_ch, stride_ws, stride_wh,
                HALF: tl.constexpr):
    """One INT4 tile's loads: codes ``[BLOCK_N, HALF]`` uint8 and one 32-bit meta word per K and V vector.
    ``slot`` is int32 when every offset fits in 32 bits (the launcher checks): 32-bit address math."""
    d = tl.arange(0, HALF)
    code_ptr = slot[:, None] * stride_cs + d[None, :]
    meta_ptr = slot * stride_ws
    kc = tl.load(KCodes + hk * stride_ch + code_ptr, mask=nmask[:, None], other=0)
    vc = tl.load(VCodes + hk * stride_ch + code_ptr, mask=nmask[:, None], other=0)
    kw = tl.load(KMeta32 + hk * stride_wh + meta_ptr, mask=nmask, other=0)
    vw = tl.load(VMeta32 + hk * stride_wh + meta_ptr, mask=nmask, other=0)
    return kc, kw, vc, vw


@triton.jit
def int4_math_w(q_lo, q_hi, qs, q_sum, m_i, l_i, acc_lo, acc_hi, acc_off, nmask, kc, kw, vc, vw, magic,
                USE_ASM: tl.constexpr):
    """``int4_math`` on the word-wide unpack (same arithmetic, same rounding)."""
    k_scale, k_off = meta_pair(kw)
    v_scale, v_off = meta_pair(vw)
    k_lo, k_hi = nibbles_int8(kc, USE_ASM)
    qk = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
    s = qs[:, None] * (k_scale[None, :] * qk.to(tl.float32) + k_off[None, :] * q_sum[:, None])
    s = tl.where(nmask[None, :], s, float("-inf"))
    p, m_i, l_i, acc_lo, acc_hi, alpha = online_update(s, m_i, l_i, acc_lo, acc_hi)
    pv = (p * v_scale[None, :]).to(tl.float16)
    v_lo, v_hi = nibbles_centred_fp16(vc, magic, USE_ASM)
    acc_lo += tl.dot(pv, v_lo)
    acc_hi += tl.dot(pv, v_hi)
    acc_off = acc_off * alpha + tl.sum(p * (v_off + 8.0 * v_scale)[None, :], 1)
    return m_i, l_i, acc_lo, acc_hi, acc_off
