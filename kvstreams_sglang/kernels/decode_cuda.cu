// KV4 decode, one CUDA program (CTA) per (split, request) over the KV heads of the request, one launch per step:
// the INT4 region, the INT8 side region and the merge of the splits (bench/NOTES.md v5-v7).
//
// Compiled at run time by NVRTC (decode_cuda.py) with -DHKV=<KV heads> -DQTYPE=<0 fp32 | 1 bf16 | 2 fp16>;
// no headers (NVRTC ships none of the CUDA headers by default): half arithmetic is inline PTX.
// Fixed shape: head dim 128, GQA group 4 (4 query heads per KV head).
//
// Warp h of the CTA owns KV head h and streams the split's slots in tiles of 32, alone: every reduction
// (row max, row sum) stays inside the warp, no barrier in the loop (the Triton kernel's 4-row score tile
// spread over 4 warps needed 12 per tile). Tensor cores by mma.sync:
//   QK (int8 m16n8k32): S^T[16 slot rows, 8 columns] = K codes x Q^T. The 8 columns are 2 slot groups x
//     4 query heads: group 0 sees tile rows 0..15, group 1 rows 16..31 (the K operand row i holds both
//     groups' codes, 256 k; Q^T is block-diagonal, zero where a column's group does not match): no padding
//     columns. A thread's K operand bytes are 16 contiguous code bytes of a slot: the dot's k order is
//     free, so the split-half nibbles (byte j = dims j, j+64) need one AND (low) or SHR+AND (high) and no
//     permutation; Q's int8 codes are laid out in the same order once per program.
//   Softmax of each column (group, query head) online, in the log2 domain, per thread then across the 8
//     lanes of a column (shuffles).
//   PV (fp16 m16n8k16, fp32 accumulators): O^T[16 dims, 8 columns] = V^T x P^T; P^T comes from the QK
//     accumulator fragment by movmatrix.trans (no shared memory), block-diagonal by group. V nibbles of two
//     slots are paired into fp16x2 by PRMT, then 0x6400|n (fp16 1024+n) and one HSUB2/HFMA2: centred codes
//     n-8 exactly (as the Triton kernel; the 0x6400 magic is a run-time argument so ptxas keeps the trick).
//   The two slot groups of a query head are merged at the end (lanes t, t^2), and the split's normalised
//   partial output and log2-domain LSE are written in the Triton kernel's partial layout. Each split CTA first
//   takes its share of the INT8 side region into the same softmax state (v6), and the CTA that finishes last
//   merges the splits (ticket counter).
// Loads (PIPE): on sm_90 with 4+ warps per CTA, a PIPE-stage ring in shared memory filled by bulk copies (the
// shipped kernel, PIPE 2); elsewhere tile i+1's codes/meta are loaded into registers before tile i's math.
// Split sizes (``chunk``): > 0 the same for every request (the eager plan: the longest request's length over the
// splits); <= 0 each request's own, ceil(len / splits) rounded up to a tile, computed here from its indptr: a
// CUDA graph replays a fixed grid and fixed scalar arguments while the lengths change every step.

#include "kv4_ptx.cuh"  // u32/u16/u8, HKV / QTYPE defaults, FULL, h2f, f2h, prmt
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
#ifndef WARPS
#define WARPS HKV  // KV heads (warps) per CTA; grid (HKV / WARPS, splits, B)
#endif
#ifndef PIPE
#define PIPE 0  // 0: tile i+1 prefetched into registers; S >= 2: S-stage bulk-copy ring (sm_90, 32 % WARPS == 0)
#endif
#if PIPE == 1 || (PIPE && (WARPS < 4 || 32 % WARPS))
#error "the bulk-copy ring needs PIPE >= 2 stages and a WARPS (4, 8, 16 or 32) that divides the 32 rows of a stage"
#endif
#if PIPE
// Per stage: K rows [32 slots][WARPS heads x 64 B + 16 B pad], V rows likewise, K meta [32][WARPS x 4 B], V meta.
// One slot's codes of the CTA's heads are contiguous in the cache (slot-major), so each is one bulk copy; the
// 16-byte row pad staggers the banks of the warps' 8- and 16-byte reads.
#define ROW_T (WARPS * 64 + 16)
#define META_T (WARPS * 4)
#define ROWS 32  // slots per stage
#define STAGE_T (2 * ROWS * ROW_T + 2 * ROWS * META_T)
#endif
#define WARP_SMEM 512  // query codes (aliased with the start of the ring: read before the first copy)

#define NEG_INF __int_as_float(0xff800000)
#define SLOT_BYTES (HKV * 64)

__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float lg2(float x) { float y; asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ u32 movtrans(u32 x) {
    u32 y; asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x)); return y;
}
__device__ __forceinline__ u32 lop_or_and(u32 a, u32 mask, u32 magic) {  // (a & mask) | magic
    u32 d; asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(magic)); return d;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) { u32 d; asm("sub.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}

__device__ __forceinline__ void imma(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void hmma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 ldg16(const u8* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ uint2 ldg8(const u8* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ldg4(const u32* p) {
    u32 r; asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p)); return r;
}


__device__ __forceinline__ void cp4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_arrive_noinc(u32 bar) {  // bar's arrival once this thread's cp.async are done
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ u32 lop_and_xor(u32 a, u32 mask, u32 x) {  // (a & mask) ^ x
    u32 d; asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(d) : "r"(a), "r"(mask), "r"(x)); return d;
}
__device__ __forceinline__ float ldcg_f(const float* p) {  // L2 (written by other CTAs of this launch)
    float r; asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p)); return r;
}
__device__ __forceinline__ float4 ldcg_f4(const float* p) {
    float4 r;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
    u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ uint4 lds16(u32 a) {
    uint4 r; asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a));
    return r;
}
__device__ __forceinline__ uint2 lds8(u32 a) {
    uint2 r; asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(a)); return r;
}
__device__ __forceinline__ u32 lds4(u32 a) { u32 r; asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(a)); return r; }

__device__ __forceinline__ void bulk(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n\t.reg .pred P1;\n\tLAB_WAIT:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
                 "@P1 bra DONE;\n\tbra LAB_WAIT;\n\tDONE:\n\t}" :: "r"(bar), "r"(parity) : "memory");
}

struct Tile {
    uint4 k[2][2];     // [group][row g / g+8]: 16 code bytes (dims 16t..16t+15 low, +64 high) of K
    uint2 v[2][2][2];  // [sigma][group][pair member]: 8 code bytes (dims 8g..8g+7, +64) of V
    u32 kw[2], vw[2];  // meta words (scale | offset << 16) of the thread's two score rows
};

#if PIPE
// Producers: every warp copies 32 / WARPS tile rows. The bulk copy instruction takes uniform operands; a
// lane-dependent address makes ptxas issue it in a loop over the active lanes. Here the slot id of each of the
// warp's rows comes out of redux.sync (a uniform register), so lane 0 issues each K / V code copy (the row's slot's
// codes of the CTA's heads) once; the 32-byte meta rows (2 x 32 per tile) are 4-byte cp.async, one word per thread,
// whose completion the stage's mbarrier also waits for (cp.async.mbarrier.arrive.noinc: the barrier expects
// WARPS * 32 such arrivals besides warp 0's expect_tx arrival with the byte count of the codes) (v6).
__device__ __forceinline__ void produce(u32 st, u32 bar, int lane, int w_, int sid, const u8* kc, const u8* vc,
                                        const u32* km, const u32* vm) {
    constexpr int RPW = 32 / WARPS;  // rows per warp
    if (w_ == 0 && lane == 0) mbar_expect(bar, ROWS * 2 * WARPS * 64);
    {
        const int mrow = w_ * RPW + lane / WARPS, mh = lane % WARPS;
        const size_t ms = (size_t)(unsigned)__shfl_sync(FULL, sid, mrow);
        cp4(st + 2 * ROWS * ROW_T + mrow * META_T + mh * 4, km + ms * HKV + mh);
        cp4(st + 2 * ROWS * ROW_T + ROWS * META_T + mrow * META_T + mh * 4, vm + ms * HKV + mh);
        cp_arrive_noinc(bar);
    }
    const int wu = __reduce_max_sync(FULL, (unsigned)w_);  // the warp index in a uniform register
    size_t s[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) s[r] = __reduce_max_sync(FULL, lane == wu * RPW + r ? (unsigned)sid : 0u);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int row = wu * RPW + r;
            bulk(st + row * ROW_T, kc + s[r] * SLOT_BYTES, WARPS * 64, bar);
            bulk(st + ROWS * ROW_T + row * ROW_T, vc + s[r] * SLOT_BYTES, WARPS * 64, bar);
        }
    }
}
#define MBAR_COUNT (WARPS * 32 + 1)  // the producing warps' threads + the expect_tx arrival

// Thread 0 initialises the ring's PIPE stage barriers (the caller syncs before any warp uses them).
__device__ __forceinline__ void init_ring_barriers(u32 bars) {
    if (threadIdx.x == 0) {
#pragma unroll
        for (int st = 0; st < PIPE; ++st) mbar_init(bars + 8 * st, MBAR_COUNT);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
}

// Warp hl's operands of the tile in ring stage ``st``.
__device__ __forceinline__ void read_stage(Tile& T, u32 st, int hl, int g, int t) {
    const int gt = t >> 1;
#pragma unroll
    for (int gr = 0; gr < 2; ++gr)
#pragma unroll
        for (int r = 0; r < 2; ++r) T.k[gr][r] = lds16(st + (16 * gr + g + 8 * r) * ROW_T + hl * 64 + 16 * t);
#pragma unroll
    for (int sg = 0; sg < 2; ++sg)
#pragma unroll
        for (int gr = 0; gr < 2; ++gr)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                T.v[sg][gr][e] = lds8(st + (ROWS + 16 * gr + 8 * sg + 2 * t + e) * ROW_T + hl * 64 + 8 * g);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = 16 * gt + g + 8 * r;
        T.kw[r] = lds4(st + 2 * ROWS * ROW_T + row * META_T + hl * 4);
        T.vw[r] = lds4(st + 2 * ROWS * ROW_T + ROWS * META_T + row * META_T + hl * 4);
    }
}
#endif

__device__ __forceinline__ void issue(Tile& T, int sid, const u8* kb, const u8* vb, const u32* kmb, const u32* vmb,
                                      int g, int t) {
    const int gt = t >> 1;
#pragma unroll
    for (int gr = 0; gr < 2; ++gr)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int s = __shfl_sync(FULL, sid, 16 * gr + g + 8 * r);
            T.k[gr][r] = ldg16(kb + (size_t)(unsigned)s * SLOT_BYTES);
            if (gr == 0) {
                const int s1 = __shfl_sync(FULL, sid, 16 + g + 8 * r);
                const int sm = gt ? s1 : s;
                T.kw[r] = ldg4(kmb + (size_t)(unsigned)sm * HKV);
                T.vw[r] = ldg4(vmb + (size_t)(unsigned)sm * HKV);
            }
        }
#pragma unroll
    for (int sg = 0; sg < 2; ++sg)
#pragma unroll
        for (int gr = 0; gr < 2; ++gr)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int s = __shfl_sync(FULL, sid, 16 * gr + 8 * sg + 2 * t + e);
                T.v[sg][gr][e] = ldg8(vb + (size_t)(unsigned)s * SLOT_BYTES);
            }
}

__device__ __forceinline__ float q_elem(const void* Q, size_t i) {
#if QTYPE == 0
    return ((const float*)Q)[i];
#elif QTYPE == 1
    return __uint_as_float(((u32)((const u16*)Q)[i]) << 16);
#else
    return h2f(((const u16*)Q)[i]);
#endif
}

// One online-softmax step over a 16-slot x 8-column score tile, shared by the INT8 side region and the INT4 loop:
// this lane's scores sc[row g / g+8][its 2 columns] -> probabilities p (relative to the new running max), the
// running max m and sum l updated, alpha the old-to-new rescale, and the output accumulator o rescaled when any
// column's max grew (row maxima reduced over the 8 lanes of a column group by shuffles: no barrier).
__device__ __forceinline__ void online_softmax(const float (&sc)[2][2], float (&p)[2][2], float (&alpha)[2],
                                               float* m, float* l, float (&o)[8][4]) {
    bool grow = false;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        float mx = fmaxf(sc[0][c], sc[1][c]);
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 16));
        const float mn = fmaxf(m[c], mx);
        grow |= mn > m[c];
        const float ms = mn == NEG_INF ? 0.f : mn;
        alpha[c] = ex2(m[c] - ms);
        p[0][c] = ex2(sc[0][c] - ms);
        p[1][c] = ex2(sc[1][c] - ms);
        m[c] = mn;
        l[c] = l[c] * alpha[c] + p[0][c] + p[1][c];
    }
    if (__any_sync(FULL, grow)) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            o[i][0] *= alpha[0]; o[i][1] *= alpha[1]; o[i][2] *= alpha[0]; o[i][3] *= alpha[1];
        }
    }
}


// This split's share of the INT8 side region of request b, KV head h (this warp): tiles of 32 side slots loaded
// straight into registers (the region is at most sink + recent slots), into the same online-softmax state as the
// INT4 slots (the side values are exact integers: no offset term). The same MMA shapes as the INT4 loop: a thread's K bytes of a slot
// are dims 16t..16t+15 and 64+16t..64+16t+15, the very k order of the INT4 operand, so the query operand qa / qb
// serves both; V codes (signed int8) become fp16 by PRMT, then (x & 0xff) ^ 0x80 | 0x6400 = 1152 + x, minus 1152.
// ``sidx`` [slo, slen): the share's side slot ids; ``sid``: those of its first tile (loaded early by the caller).
__device__ __forceinline__ void side_region(const int* sidx, int slo, int slen, int sid, const u8* KSide,
                                            const u16* KSideScale, const u8* VSide, const u16* VSideScale,
                                            int h, int lane, int g, int t, const u32* qa, const u32* qb,
                                            const float* qs, u32 magic, float* m, float* l, float (&o)[8][4]) {
    const int gt = t >> 1;
    const u32 x1152 = magic + 0x00800080u;  // fp16x2 1152 = 1024 + 128
    for (int n0 = slo; n0 < slen; n0 += 32) {
        const int sid_next = n0 + 32 + lane < slen ? sidx[n0 + 32 + lane] : 0;  // in flight during this tile
        uint4 k8[2][2][2];      // [group][row g / g+8][dims 16t.. / 64+16t..]
        uint2 v8[2][2][2][2];   // [sigma][group][pair member][dims 8g.. / 64+8g..]
        float ksc[2], vsc[2];
#pragma unroll
        for (int gr = 0; gr < 2; ++gr)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const size_t s = (size_t)(unsigned)__shfl_sync(FULL, sid, 16 * gr + g + 8 * r);
                const u8* p = KSide + (s * HKV + h) * 128 + 16 * t;
                k8[gr][r][0] = ldg16(p);
                k8[gr][r][1] = ldg16(p + 64);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const size_t s = (size_t)(unsigned)__shfl_sync(FULL, sid, 16 * gt + g + 8 * r);
            ksc[r] = h2f(KSideScale[s * HKV + h]);
            vsc[r] = h2f(VSideScale[s * HKV + h]);
        }
#pragma unroll
        for (int sg = 0; sg < 2; ++sg)
#pragma unroll
            for (int gr = 0; gr < 2; ++gr)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const size_t s = (size_t)(unsigned)__shfl_sync(FULL, sid, 16 * gr + 8 * sg + 2 * t + e);
                    const u8* p = VSide + (s * HKV + h) * 128 + 8 * g;
                    v8[sg][gr][e][0] = ldg8(p);
                    v8[sg][gr][e][1] = ldg8(p + 64);
                }
        int acc[4] = {0, 0, 0, 0};
#pragma unroll
        for (int gr = 0; gr < 2; ++gr) {
            const u32 w0[8] = {k8[gr][0][0].x, k8[gr][0][0].y, k8[gr][0][0].z, k8[gr][0][0].w,
                               k8[gr][0][1].x, k8[gr][0][1].y, k8[gr][0][1].z, k8[gr][0][1].w};
            const u32 w1[8] = {k8[gr][1][0].x, k8[gr][1][0].y, k8[gr][1][0].z, k8[gr][1][0].w,
                               k8[gr][1][1].x, k8[gr][1][1].y, k8[gr][1][1].z, k8[gr][1][1].w};
#pragma unroll
            for (int st = 0; st < 4; ++st)
                imma(acc, w0[2 * st], w1[2 * st], w0[2 * st + 1], w1[2 * st + 1], gr ? qb[2 * st] : qa[2 * st],
                     gr ? qb[2 * st + 1] : qa[2 * st + 1]);
        }
        float sc[2][2], p[2][2], vs[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const bool valid = n0 + 16 * gt + g + 8 * r < slen;
            vs[r] = valid ? vsc[r] : 0.f;
#pragma unroll
            for (int c = 0; c < 2; ++c) sc[r][c] = valid ? qs[c] * ksc[r] * (float)acc[2 * r + c] : NEG_INF;
        }
        float alpha[2];
        online_softmax(sc, p, alpha, m, l, o);
        const u32 T0 = movtrans(pack_h2(p[0][0] * vs[0], p[0][1] * vs[0]));
        const u32 T1 = movtrans(pack_h2(p[1][0] * vs[1], p[1][1] * vs[1]));
#pragma unroll
        for (int sg = 0; sg < 2; ++sg) {
            const u32 T = sg ? T1 : T0;
            const u32 pb0 = g < 4 ? T : 0u, pb1 = g < 4 ? 0u : T;
#pragma unroll
            for (int mt = 0; mt < 8; ++mt) {
                const int byte0 = 2 * (mt & 3), byte1 = byte0 + 1, half = mt < 4 ? 0 : 1;
                u32 a[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int gr = q >> 1, bb = q & 1 ? byte1 : byte0;
                    const uint2 X = v8[sg][gr][0][half], Y = v8[sg][gr][1][half];
                    const u32 xw = bb < 4 ? X.x : X.y, yw = bb < 4 ? Y.x : Y.y;
                    const u32 pidx = bb & 3;
                    const u32 t2 = prmt(xw, yw, pidx | (pidx << 4) | ((4 + pidx) << 8) | ((4 + pidx) << 12));
                    a[q] = hsub2(lop_and_xor(t2, 0x00FF00FFu, x1152), x1152);
                }
                hmma(o[mt], a[0], a[1], a[2], a[3], pb0, pb1);
            }
        }
        sid = sid_next;
    }
}

// The CTA that draws the last ticket of its (request, head set) merges the parts of its WARPS * 4 query rows
// (exact log2-domain LSE merge, as the Triton kernel's _merge_parts) into Out (the query's dtype) and LseOut.
// Empty parts (a split past the end of its request's INT4 list, with no side share) have LSE -inf: weight 0.
__device__ __forceinline__ void merge_parts(const float* PartOut, const float* PartLse, int* Counter, void* Out,
                                            float* LseOut, int b, int parts) {
    __shared__ int ticket;
    __threadfence();  // this thread's part stores, visible device-wide before the ticket
    __syncthreads();
    int* cnt = Counter + b * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) ticket = atomicAdd(cnt, 1);
    __syncthreads();
    if (ticket != parts - 1) return;
    __threadfence();
    const int rr = threadIdx.x >> 3, seg = threadIdx.x & 7;  // WARPS * 4 rows x 8 segments of 16 dims
    const size_t row = (size_t)b * (HKV * 4) + blockIdx.x * (WARPS * 4) + rr;
    float mx = NEG_INF;
    for (int s = 0; s < parts; ++s) mx = fmaxf(mx, ldcg_f(PartLse + row * parts + s));
    const float ms = mx == NEG_INF ? 0.f : mx;
    float acc[16], tot = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = 0.f;
    for (int s = 0; s < parts; ++s) {
        const float w = ex2(ldcg_f(PartLse + row * parts + s) - ms);  // 0 for empty parts
        tot += w;
        const float* src = PartOut + (row * parts + s) * 128 + seg * 16;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 v = ldcg_f4(src + 4 * i);
            acc[4 * i] += w * v.x; acc[4 * i + 1] += w * v.y; acc[4 * i + 2] += w * v.z; acc[4 * i + 3] += w * v.w;
        }
    }
    const float den = tot > 0.f ? tot : 1.f, inv = 1.f / den;
#if QTYPE == 0
    float4* dst = (float4*)((float*)Out + row * 128 + seg * 16);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        dst[i] = make_float4(acc[4 * i] * inv, acc[4 * i + 1] * inv, acc[4 * i + 2] * inv, acc[4 * i + 3] * inv);
#else
    u32 w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#if QTYPE == 1
        w[i] = pack_bf2(acc[2 * i] * inv, acc[2 * i + 1] * inv);
#else
        w[i] = pack_h2(acc[2 * i] * inv, acc[2 * i + 1] * inv);
#endif
    uint4* dst = (uint4*)((u16*)Out + row * 128 + seg * 16);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
#endif
    if (seg == 0) LseOut[row] = tot > 0.f ? ms + lg2(den) : NEG_INF;
    if (threadIdx.x == 0) *cnt = 0;  // ready for the next launch
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
kv4_int4_splits(const void* __restrict__ Q, const int* __restrict__ KvIndptr, const int* __restrict__ KvIndices,
                const u8* __restrict__ KCodes, const u32* __restrict__ KMeta,
                const u8* __restrict__ VCodes, const u32* __restrict__ VMeta,
                float* __restrict__ PartOut, float* __restrict__ PartLse,
                const int* __restrict__ SideIndptr, const int* __restrict__ SideIndices,
                const u8* __restrict__ KSide, const u16* __restrict__ KSideScale,
                const u8* __restrict__ VSide, const u16* __restrict__ VSideScale,
                int* __restrict__ Counter, void* __restrict__ Out, float* __restrict__ LseOut,
                int chunk, int parts, float sm_scale_log2, u32 magic, int rotate)
{
    extern __shared__ __align__(16) u8 smem[];  // WARPS x WARP_SMEM, or the ring (dynamic)
    const int lane = threadIdx.x & 31, w_ = threadIdx.x >> 5, h = blockIdx.x * WARPS + w_;
    const int b = blockIdx.z;
    const int split = blockIdx.y;
    // This split's share of the side region (splits = gridDim.y) and its first slot ids, loaded first: the
    // latency hides behind the query's loads and rotation.
    const int s_start = SideIndptr[b];
    const int s_total = SideIndptr[b + 1] - s_start;
    const int s_per = (s_total + (int)gridDim.y - 1) / (int)gridDim.y;
    const int s_lo = split * s_per, s_hi = min(s_lo + s_per, s_total);
    const int* s_idx = SideIndices + s_start;
    const int s_sid0 = s_lo + (threadIdx.x & 31) < s_hi ? s_idx[s_lo + (threadIdx.x & 31)] : 0;
    // the query codes (one WARP_SMEM per warp of the CTA); later the ring
    u8 (*qsm)[128] = (u8 (*)[128])(smem + (threadIdx.x >> 5) * WARP_SMEM);
    const int g = lane >> 2, t = lane & 3;

    // ---- query: rotate (fast Walsh-Hadamard, = x @ H of the normalised Sylvester matrix) and INT8 ----
    float qscale_row, qsum_row;
    {
        const int j = lane >> 3, s = lane & 7;  // row j of the warp's 4 query heads, elements 16s..16s+15
        const size_t base = ((size_t)b * (HKV * 4) + h * 4 + j) * 128 + s * 16;
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = q_elem(Q, base + i);
        if (rotate) {
#pragma unroll
            for (int st = 1; st < 16; st <<= 1)
#pragma unroll
                for (int i = 0; i < 16; ++i)
                    if (!(i & st)) { const float a = x[i], c = x[i + st]; x[i] = a + c; x[i + st] = a - c; }
#pragma unroll
            for (int st = 1; st < 8; st <<= 1) {
                const bool up = s & st;
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    const float o = __shfl_xor_sync(FULL, x[i], st);
                    x[i] = up ? (o - x[i]) : (x[i] + o);
                }
            }
#pragma unroll
            for (int i = 0; i < 16; ++i) x[i] *= 0.08838834764831845f;
        }
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 4));
        float sq = h2f(f2h(amax / 127.0f));
        if (sq == 0.f) sq = 1.f;
        int qsum = 0;
        u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            float c = floorf(x[i] / sq + 0.5f);
            c = fminf(fmaxf(c, -127.f), 127.f);
            const int ci = (int)c;
            qsum += ci;
            w[i >> 2] |= ((u32)(ci & 0xff)) << (8 * (i & 3));
        }
        qsum += __shfl_xor_sync(FULL, qsum, 1);
        qsum += __shfl_xor_sync(FULL, qsum, 2);
        qsum += __shfl_xor_sync(FULL, qsum, 4);
        *(uint4*)&qsm[j][s * 16] = make_uint4(w[0], w[1], w[2], w[3]);
        qscale_row = sq * sm_scale_log2;
        qsum_row = (float)qsum;
    }
    __syncwarp();
    // Columns of this thread: n = 2t + c, c in {0, 1}: slot group gt = t / 2, query head j = 2 (t & 1) + c.
    const int gt = t >> 1;
    float qs[2], qsm_f[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int j = 2 * (t & 1) + c;
        qs[c] = __shfl_sync(FULL, qscale_row, 8 * j);
        qsm_f[c] = __shfl_sync(FULL, qsum_row, 8 * j);
    }
    // Q^T operand (k32 x n8, column g = group g / 4, head g & 3): the k order of the K operand registers.
    u32 qa[8], qb[8];
    {
        const uint4 lo = *(const uint4*)&qsm[g & 3][16 * t];
        const uint4 hi = *(const uint4*)&qsm[g & 3][64 + 16 * t];
        const u32 qr[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int r = 0; r < 8; ++r) { qa[r] = g < 4 ? qr[r] : 0u; qb[r] = g < 4 ? 0u : qr[r]; }
    }

    const u32 k1032 = magic + 0x00080008u;   // fp16x2 1032
    const u32 a16 = magic - 0x38003800u;     // fp16x2 1/16
    const u32 b72 = magic + 0x70807080u;     // fp16x2 -72

    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, off[2] = {0.f, 0.f};
    float o[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) { o[i][0] = 0.f; o[i][1] = 0.f; o[i][2] = 0.f; o[i][3] = 0.f; }
    {
    const int start = KvIndptr[b];
    const int len = KvIndptr[b + 1] - start;
    // chunk <= 0: this request's own split size, ceil(len / splits) rounded up to the 32-slot tile (graph plans)
    const int ch = chunk > 0 ? chunk : ((len + (int)gridDim.y - 1) / (int)gridDim.y + 31) & ~31;
    const int lo = split * ch;
    const int hi = min(lo + ch, len);
    const int* idx = KvIndices + start;
    const u8* kb = KCodes + h * 64 + 16 * t;
    const u8* vb = VCodes + h * 64 + 8 * g;
    const u32* kmb = KMeta + h;
    const u32* vmb = VMeta + h;

#if PIPE
    const u32 ring = (u32)__cvta_generic_to_shared(smem);
    const u32 bars = ring + PIPE * STAGE_T;
    init_ring_barriers(bars);
    __syncthreads();  // barriers initialised; every warp has read its query operand (the ring overwrites it)
    const int h0 = blockIdx.x * WARPS;
    const u8* kc = KCodes + h0 * 64;
    const u8* vc = VCodes + h0 * 64;
    const u32* km = KMeta + h0;
    const u32* vm = VMeta + h0;
#pragma unroll
    for (int st = 0; st < PIPE - 1; ++st) {
        const int p0 = lo + ROWS * st, pw = p0 + lane;
        if (p0 < hi) produce(ring + st * STAGE_T, bars + 8 * st, lane, w_, pw < hi ? idx[pw] : 0, kc, vc, km, vm);
    }
    const int pn = lo + ROWS * (PIPE - 1) + lane;
    int sid_next = pn < hi ? idx[pn] : 0;
    int stage = 0;
    u32 phase = 0;
    side_region(s_idx, s_lo, s_hi, s_sid0, KSide, KSideScale, VSide, VSideScale, h, lane, g, t, qa, qb, qs, magic,
                m, l, o);
    for (int n0 = lo; n0 < hi; n0 += ROWS) {
        __syncthreads();  // every warp is done with the stage consumed last tile: refill it
        {
            const int p0 = n0 + ROWS * (PIPE - 1);
            const int ahead = stage == 0 ? PIPE - 1 : stage - 1;
            if (p0 < hi) produce(ring + ahead * STAGE_T, bars + 8 * ahead, lane, w_, sid_next, kc, vc, km, vm);
            sid_next = p0 + ROWS + lane < hi ? idx[p0 + ROWS + lane] : 0;
        }
        mbar_wait(bars + 8 * stage, phase);
        Tile cur;
        read_stage(cur, ring + stage * STAGE_T, w_, g, t);
        if (++stage == PIPE) { stage = 0; phase ^= 1u; }
#else
    Tile cur;
    if (lo < hi) {
        int sid = lo + lane < hi ? idx[lo + lane] : 0;
        issue(cur, sid, kb, vb, kmb, vmb, g, t);
    }
    int sid_next = lo + 32 + lane < hi ? idx[lo + 32 + lane] : 0;
    side_region(s_idx, s_lo, s_hi, s_sid0, KSide, KSideScale, VSide, VSideScale, h, lane, g, t, qa, qb, qs, magic,
                m, l, o);
    for (int n0 = lo; n0 < hi; n0 += 32) {
        Tile nxt;
        if (n0 + 32 < hi) issue(nxt, sid_next, kb, vb, kmb, vmb, g, t);
        sid_next = n0 + 64 + lane < hi ? idx[n0 + 64 + lane] : 0;
#endif


        // ---- scores: S^T[rows g, g+8][columns 2t, 2t+1] ----
        int acc[4] = {0, 0, 0, 0};
#pragma unroll
        for (int gr = 0; gr < 2; ++gr) {
            const u32 w0[4] = {cur.k[gr][0].x, cur.k[gr][0].y, cur.k[gr][0].z, cur.k[gr][0].w};
            const u32 w1[4] = {cur.k[gr][1].x, cur.k[gr][1].y, cur.k[gr][1].z, cur.k[gr][1].w};
#pragma unroll
            for (int st = 0; st < 4; ++st) {
                // registers 2st, 2st+1 of the order (lo w0..w3, hi w0..w3)
                const int r0 = 2 * st, r1 = 2 * st + 1;
                const u32 x0 = r0 < 4 ? (w0[r0 & 3] & 0x0F0F0F0Fu) : ((w0[r0 & 3] >> 4) & 0x0F0F0F0Fu);
                const u32 x1 = r1 < 4 ? (w0[r1 & 3] & 0x0F0F0F0Fu) : ((w0[r1 & 3] >> 4) & 0x0F0F0F0Fu);
                const u32 y0 = r0 < 4 ? (w1[r0 & 3] & 0x0F0F0F0Fu) : ((w1[r0 & 3] >> 4) & 0x0F0F0F0Fu);
                const u32 y1 = r1 < 4 ? (w1[r1 & 3] & 0x0F0F0F0Fu) : ((w1[r1 & 3] >> 4) & 0x0F0F0F0Fu);
                imma(acc, x0, y0, x1, y1, gr ? qb[r0] : qa[r0], gr ? qb[r1] : qa[r1]);
            }
        }
        float sc[2][2], p[2][2], vs[2], vo[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const bool valid = n0 + 16 * gt + g + 8 * r < hi;
            const float ks = h2f((u16)(cur.kw[r] & 0xffff)), ko = h2f((u16)(cur.kw[r] >> 16));
            vs[r] = valid ? h2f((u16)(cur.vw[r] & 0xffff)) : 0.f;
            vo[r] = valid ? h2f((u16)(cur.vw[r] >> 16)) : 0.f;
#pragma unroll
            for (int c = 0; c < 2; ++c)
                sc[r][c] = valid ? qs[c] * (ks * (float)acc[2 * r + c] + ko * qsm_f[c]) : NEG_INF;
        }
        float alpha[2];
        online_softmax(sc, p, alpha, m, l, o);
#pragma unroll
        for (int c = 0; c < 2; ++c)
            off[c] = off[c] * alpha[c] + p[0][c] * (vo[0] + 8.f * vs[0]) + p[1][c] * (vo[1] + 8.f * vs[1]);
        const u32 T0 = movtrans(pack_h2(p[0][0] * vs[0], p[0][1] * vs[0]));
        const u32 T1 = movtrans(pack_h2(p[1][0] * vs[1], p[1][1] * vs[1]));

        // ---- PV: O^T[dims][columns] += V^T[dims][kappa] P^T[kappa][columns] ----
#pragma unroll
        for (int sg = 0; sg < 2; ++sg) {
            const u32 T = sg ? T1 : T0;
            const u32 pb0 = g < 4 ? T : 0u, pb1 = g < 4 ? 0u : T;
#pragma unroll
            for (int mt = 0; mt < 8; ++mt) {
                const int byte0 = 2 * (mt & 3), byte1 = byte0 + 1;
                u32 a[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int gr = q >> 1, bb = q & 1 ? byte1 : byte0;
                    const uint2 X = cur.v[sg][gr][0], Y = cur.v[sg][gr][1];
                    const u32 xw = bb < 4 ? X.x : X.y, yw = bb < 4 ? Y.x : Y.y;
                    const u32 pidx = bb & 3;
                    const u32 t2 = prmt(xw, yw, pidx | (pidx << 4) | ((4 + pidx) << 8) | ((4 + pidx) << 12));
                    a[q] = mt < 4 ? hsub2(lop_or_and(t2, 0x000F000Fu, magic), k1032)
                                  : hfma2(lop_or_and(t2, 0x00F000F0u, magic), a16, b72);
                }
                // a0: (dim row g, kappa 2t..) group 0; a1: dim row g+8, group 0; a2: row g, group 1; a3.
                hmma(o[mt], a[0], a[1], a[2], a[3], pb0, pb1);
            }
        }
#if !PIPE
        cur = nxt;
#endif
    }
    }  // INT4 region


    // ---- merge the two slot groups of each query head (lanes t and t ^ 2), write the split's part ----
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        l[c] += __shfl_xor_sync(FULL, l[c], 4);
        l[c] += __shfl_xor_sync(FULL, l[c], 8);
        l[c] += __shfl_xor_sync(FULL, l[c], 16);
        off[c] += __shfl_xor_sync(FULL, off[c], 4);
        off[c] += __shfl_xor_sync(FULL, off[c], 8);
        off[c] += __shfl_xor_sync(FULL, off[c], 16);
    }
    float ws[2], wo[2], L[2], OFF[2], M[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const float mo = __shfl_xor_sync(FULL, m[c], 2);
        const float lo_ = __shfl_xor_sync(FULL, l[c], 2);
        const float oo = __shfl_xor_sync(FULL, off[c], 2);
        M[c] = fmaxf(m[c], mo);
        const float ms = M[c] == NEG_INF ? 0.f : M[c];
        ws[c] = ex2(m[c] - ms);
        wo[c] = ex2(mo - ms);
        L[c] = l[c] * ws[c] + lo_ * wo[c];
        OFF[c] = off[c] * ws[c] + oo * wo[c];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float other = __shfl_xor_sync(FULL, o[i][e], 2);
            o[i][e] = o[i][e] * ws[e & 1] + other * wo[e & 1];
        }
    if (t < 2) {
        const int parts_ = parts;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int j = 2 * t + c;
            const size_t row = (size_t)b * (HKV * 4) + h * 4 + j;
            const bool any = L[c] > 0.f;
            const float inv = any ? 1.f / L[c] : 0.f;
            float* dst = PartOut + (row * parts_ + split) * 128;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int d0 = i < 4 ? 8 * g + 2 * i : 64 + 8 * g + 2 * (i - 4);
                dst[d0] = (o[i][c] + OFF[c]) * inv;
                dst[d0 + 1] = (o[i][2 + c] + OFF[c]) * inv;
            }
            if (g == 0) PartLse[row * parts_ + split] = any ? M[c] + lg2(L[c]) : NEG_INF;
        }
    }
    merge_parts(PartOut, PartLse, Counter, Out, LseOut, b, parts);
}
