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
