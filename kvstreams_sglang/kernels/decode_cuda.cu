// KV4 decode, INT4 region, one CUDA program (CTA) per (split, request) over all KV heads (v5).
//
// Compiled at run time by NVRTC (decode_cuda.py) with -DHKV=<KV heads> -DQTYPE=<0 fp32 | 1 bf16 | 2 fp16>;
// no headers (NVRTC ships none of the CUDA headers by default): half arithmetic is inline PTX.
// Fixed shape: head dim 128, GQA group 4 (4 query heads per KV head).
//
// Warp h of the CTA owns KV head h and streams the split's slots in tiles of 32, alone: every reduction
// (row max, row sum) stays inside the warp, no barrier in the loop (the Triton kernel's 4-row score tile
// spread over 4 warps needed 12 per tile). Tensor cores by mma.sync, fed straight from the global loads:
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
//   partial output and log2-domain LSE are written in the Triton kernel's partial layout. FUSE (v6 default):
//   each split CTA first takes its share of the INT8 side region into the same softmax state, and the CTA that
//   finishes last merges the splits (ticket counter): one launch. Otherwise the Triton kernel (SIDE_MERGE mode)
//   adds the INT8 side region and merges.
// Tile i+1's codes/meta are loaded into registers before tile i's math, tile i+2's slot ids before that.

#include "kv4_ptx.cuh"  // u32/u16/u8, HKV / QTYPE defaults, FULL, h2f, f2h, prmt
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
#ifndef WARPS
#define WARPS HKV  // KV heads (warps) per CTA; grid (HKV / WARPS, splits, B)
#endif
#ifndef PIPE
#define PIPE 0  // 0: tile i+1 prefetched into registers; S >= 2: S-stage cp.async ring in shared memory
#endif
// Shared-memory ring, per warp and stage, structure of arrays (each thread reads back only what its own cp.async
// wrote: no barrier, only cp.async.wait_group): K 4 x [32 lanes x 16 B], V 8 x [32 x 8 B], meta 4 x [32 x 4 B].
#define STAGE_BYTES 4608
#ifndef TMA
#define TMA 0  // 1: PIPE-stage ring per CTA filled by bulk copies (cp.async.bulk + mbarrier; needs PIPE >= 2, WARPS >= 4)
#endif
#ifndef FUSE
#define FUSE 0  // 1: each split CTA also takes its share (1 / splits) of the request's INT8 side region into the same
                // online softmax before its INT4 loop (while the ring's first copies are in flight), and the CTA
                // that finishes its (request, head set) last merges all parts (ticket counter): one launch per step
#endif
#ifndef ISSUE
#define ISSUE 0  // TMA producers: 0 one bulk copy per row of K/V codes and K/V meta, issued lane by lane (v5);
                 // 1 code copies with uniform operands (redux.sync) from lane 0, meta by 4-byte cp.async per thread
#endif
#ifndef EARLY
#define EARLY 0  // v7, TMA only: the mbarriers, the INT4 slot ids and ALL PIPE ring stages issued at kernel start, before
                 // the query rotation and the side share (the query codes get their own shared memory after the ring)
#endif
#ifndef MERGE
#define MERGE 0  // v7: 1 the merging CTA reads the parts in one pass (online over parts, 4 parts' loads at once)
#endif
#ifndef SIDE_CTAS
#define SIDE_CTAS 0  // v7, FUSE only: 0 each split CTA takes a share of the side region before its INT4 loop (v6);
                     // S > 0: S more CTAs per request take the side region alone (grid y = splits + S)
#endif
#ifndef WGROUPS
#define WGROUPS 1  // v8, TMA + FUSE + ISSUE only: warps per KV head. With 2, a CTA of 2 x WARPS warps (one per SM, 128
                   // registers each) streams 32 * WGROUPS-slot ring stages; warp group p takes rows 32p..32p+31 of each
                   // stage (alternate 32-slot tiles) and its own share of the side region, into its own online-softmax
                   // state, and writes its own part (parts = splits x WGROUPS): twice the warps per SM where one CTA per
                   // SM is all the grid has (64x2k: 128 CTAs), for the prologue, side share and merge of one CTA
#endif
#ifndef WSIDE
#define WSIDE 0  // v8, WGROUPS 2 only: warp group 0 streams the INT4 region alone (32-slot stages) while warp group 1
                 // takes the split's share of the INT8 side region alone, beside it (warp specialisation: the side
                 // region's dependent loads no longer sit in front of the INT4 loop); each group writes its own part
#endif
#if WSIDE && WGROUPS != 2
#error "WSIDE needs WGROUPS 2"
#endif
#if WGROUPS > 1 && (!TMA || !FUSE || !ISSUE || EARLY || SIDE_CTAS)
#error "WGROUPS > 1 needs the fused bulk-copy ring with the v6 producers (TMA, FUSE, ISSUE), without EARLY or SIDE_CTAS"
#endif
#ifndef ABLATE
#define ABLATE 0  // bench attribution only (wrong results): 1 no side share, 2 no merge, 4 no INT4 region, 8 no rotation
#endif
#if TMA
// Per stage: K rows [32 slots][WARPS heads x 64 B + 16 B pad], V rows likewise, K meta [32][WARPS x 4 B], V meta.
// One slot's codes of the CTA's heads are contiguous in the cache (slot-major), so each is one bulk copy; the
// 16-byte row pad staggers the banks of the warps' 8- and 16-byte reads.
#define ROW_T (WARPS * 64 + 16)
#define META_T (WARPS * 4)
#if WSIDE
#define ROWS 32  // slots per stage (warp group 0's)
#else
#define ROWS (32 * WGROUPS)  // slots per stage
#endif
#define STAGE_T (2 * ROWS * ROW_T + 2 * ROWS * META_T)
#define WARP_SMEM 512  // query codes, aliased with the start of the ring (used before the first copy)
#if EARLY
#define QSM_OFF ((PIPE * STAGE_T + 8 * PIPE + 15) / 16 * 16)  // after the ring and its barriers
#endif
#else
#define WARP_SMEM (PIPE ? PIPE * STAGE_BYTES : 512)
#endif
#ifndef QSM_OFF
#define QSM_OFF 0
#endif

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

__device__ __forceinline__ void cp16(u32 dst, const u8* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp8(u32 dst, const u8* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(dst), "l"(src) : "memory");
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
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
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

// cp.async form of ``issue``: the same loads into stage ``st`` (shared address of this warp's ring) at this lane.
__device__ __forceinline__ void issue_async(u32 st, int lane, int sid, const u8* kb, const u8* vb, const u32* kmb,
                                            const u32* vmb, int g, int t) {
    const int gt = t >> 1;
#pragma unroll
    for (int gr = 0; gr < 2; ++gr)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int s = __shfl_sync(FULL, sid, 16 * gr + g + 8 * r);
            cp16(st + (2 * gr + r) * 512 + lane * 16, kb + (size_t)(unsigned)s * SLOT_BYTES);
            if (gr == 0) {
                const int s1 = __shfl_sync(FULL, sid, 16 + g + 8 * r);
                const int sm = gt ? s1 : s;
                cp4(st + 4096 + r * 128 + lane * 4, kmb + (size_t)(unsigned)sm * HKV);
                cp4(st + 4096 + (2 + r) * 128 + lane * 4, vmb + (size_t)(unsigned)sm * HKV);
            }
        }
#pragma unroll
    for (int sg = 0; sg < 2; ++sg)
#pragma unroll
        for (int gr = 0; gr < 2; ++gr)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int s = __shfl_sync(FULL, sid, 16 * gr + 8 * sg + 2 * t + e);
                cp8(st + 2048 + (4 * sg + 2 * gr + e) * 256 + lane * 8, vb + (size_t)(unsigned)s * SLOT_BYTES);
            }
}

#if TMA
// Producers: every warp copies 32 / WARPS tile rows (one bulk copy each of the row's slot's K and V codes and
// meta of the CTA's heads; the copy instruction takes uniform operands, so one lane issues them); warp 0 arms the
// stage's mbarrier with the byte count of the whole tile.
__device__ __forceinline__ void produce_v5(u32 st, u32 bar, int lane, int w_, int sid, const u8* kc, const u8* vc,
                                        const u32* km, const u32* vm) {
    if (w_ == 0 && lane == 0) mbar_expect(bar, 32 * (2 * WARPS * 64 + 2 * META_T));
    const int row = w_ * (32 / WARPS) + (lane & (32 / WARPS - 1));
    const size_t s = (size_t)(unsigned)__shfl_sync(FULL, sid, row);
    if (lane < 32 / WARPS) {  // the compiler issues each copy once per active lane (uniform operands)
        bulk(st + row * ROW_T, kc + s * SLOT_BYTES, WARPS * 64, bar);
        bulk(st + 32 * ROW_T + row * ROW_T, vc + s * SLOT_BYTES, WARPS * 64, bar);
        bulk(st + 64 * ROW_T + row * META_T, km + s * HKV, META_T, bar);
        bulk(st + 64 * ROW_T + 32 * META_T + row * META_T, vm + s * HKV, META_T, bar);
    }
}

#if ISSUE
// The copy instruction takes uniform operands; a lane-dependent address makes ptxas issue it in a loop over the
// active lanes. Here the slot id of each of the warp's rows comes out of redux.sync (a uniform register), so
// lane 0 issues each K / V code copy once; the 32-byte meta rows (2 x 32 per tile) are 4-byte cp.async, one word
// per thread, whose completion the stage's mbarrier also waits for (cp.async.mbarrier.arrive.noinc: the barrier
// expects WARPS * 32 such arrivals besides warp 0's expect_tx arrival).
// With WGROUPS > 1, a warp group produces rows wrow..wrow+31 of the stage from its own slot ids ``sid``.
__device__ __forceinline__ void produce(u32 st, u32 bar, int lane, int w_, int wrow, int sid, const u8* kc,
                                        const u8* vc, const u32* km, const u32* vm) {
    constexpr int RPW = 32 / WARPS;  // rows per warp
    if (w_ == 0 && wrow == 0 && lane == 0) mbar_expect(bar, ROWS * 2 * WARPS * 64);
    {
        const int mrow = w_ * RPW + lane / WARPS, mh = lane % WARPS, arow = wrow + mrow;
        const size_t ms = (size_t)(unsigned)__shfl_sync(FULL, sid, mrow);
        cp4(st + 2 * ROWS * ROW_T + arow * META_T + mh * 4, km + ms * HKV + mh);
        cp4(st + 2 * ROWS * ROW_T + ROWS * META_T + arow * META_T + mh * 4, vm + ms * HKV + mh);
        cp_arrive_noinc(bar);
    }
    const int wu = __reduce_max_sync(FULL, (unsigned)w_);  // the warp index in a uniform register
    size_t s[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) s[r] = __reduce_max_sync(FULL, lane == wu * RPW + r ? (unsigned)sid : 0u);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int row = wrow + wu * RPW + r;
            bulk(st + row * ROW_T, kc + s[r] * SLOT_BYTES, WARPS * 64, bar);
            bulk(st + ROWS * ROW_T + row * ROW_T, vc + s[r] * SLOT_BYTES, WARPS * 64, bar);
        }
    }
}
#define MBAR_COUNT (WARPS * (ROWS / 32) * 32 + 1)  // the producing warps' threads + the expect_tx arrival
#else
#define produce(st, bar, lane, w_, wrow, sid, kc, vc, km, vm) produce_v5(st, bar, lane, w_, sid, kc, vc, km, vm)
#define MBAR_COUNT 1
#endif

#if TMA
// Thread 0 initialises the ring's PIPE stage barriers (the caller syncs before any warp uses them).
__device__ __forceinline__ void init_ring_barriers(u32 bars) {
    if (threadIdx.x == 0) {
#pragma unroll
        for (int st = 0; st < PIPE; ++st) mbar_init(bars + 8 * st, MBAR_COUNT);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
}
#endif

__device__ __forceinline__ void read_stage_t(Tile& T, u32 st, int hl, int g, int t, int rb) {  // rb: first row
    const int gt = t >> 1;
#pragma unroll
    for (int gr = 0; gr < 2; ++gr)
#pragma unroll
        for (int r = 0; r < 2; ++r) T.k[gr][r] = lds16(st + (rb + 16 * gr + g + 8 * r) * ROW_T + hl * 64 + 16 * t);
#pragma unroll
    for (int sg = 0; sg < 2; ++sg)
#pragma unroll
        for (int gr = 0; gr < 2; ++gr)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                T.v[sg][gr][e] = lds8(st + (ROWS + rb + 16 * gr + 8 * sg + 2 * t + e) * ROW_T + hl * 64 + 8 * g);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = rb + 16 * gt + g + 8 * r;
        T.kw[r] = lds4(st + 2 * ROWS * ROW_T + row * META_T + hl * 4);
        T.vw[r] = lds4(st + 2 * ROWS * ROW_T + ROWS * META_T + row * META_T + hl * 4);
    }
}
#endif

__device__ __forceinline__ void read_stage(Tile& T, u32 st, int lane) {
#pragma unroll
    for (int gr = 0; gr < 2; ++gr)
#pragma unroll
        for (int r = 0; r < 2; ++r) T.k[gr][r] = lds16(st + (2 * gr + r) * 512 + lane * 16);
#pragma unroll
    for (int sg = 0; sg < 2; ++sg)
#pragma unroll
        for (int gr = 0; gr < 2; ++gr)
#pragma unroll
            for (int e = 0; e < 2; ++e) T.v[sg][gr][e] = lds8(st + 2048 + (4 * sg + 2 * gr + e) * 256 + lane * 8);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        T.kw[r] = lds4(st + 4096 + r * 128 + lane * 4);
        T.vw[r] = lds4(st + 4096 + (2 + r) * 128 + lane * 4);
    }
}

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

#if FUSE
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
__device__ __forceinline__ void merge_parts(const float* PartOut, const float* PartLse, int* Counter, void* Out,
                                            float* LseOut, int b, int parts) {
    __shared__ int ticket;
    __threadfence();  // this thread's part stores, visible device-wide before the ticket
    __syncthreads();
    int* cnt = Counter + b * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) ticket = atomicAdd(cnt, 1);
    __syncthreads();
#if WGROUPS > 1
    if (ticket != (int)gridDim.y - 1) return;  // the CTAs of this request (each writes WGROUPS of the parts)
    if (threadIdx.x >= WARPS * 32) return;      // the merge's layout: WARPS * 32 threads
#else
    if (ticket != parts - 1) return;
#endif
    __threadfence();
    const int rr = threadIdx.x >> 3, seg = threadIdx.x & 7;  // WARPS * 4 rows x 8 segments of 16 dims
    const size_t row = (size_t)b * (HKV * 4) + blockIdx.x * (WARPS * 4) + rr;
#if MERGE
    // v7: one pass, online over the parts, the L2 loads of 4 parts issued together (v6: a max pass, then a pass
    // with a dependent load per part)
    float m_run = NEG_INF, tot = 0.f, acc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = 0.f;
    for (int s0 = 0; s0 < parts; s0 += 4) {
        float ls[4];
        float4 v[4][4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int s = min(s0 + k, parts - 1);
            ls[k] = ldcg_f(PartLse + row * parts + s);
            const float* src = PartOut + (row * parts + s) * 128 + seg * 16;
#pragma unroll
            for (int i = 0; i < 4; ++i) v[k][i] = ldcg_f4(src + 4 * i);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (s0 + k < parts) {
                const float mn = fmaxf(m_run, ls[k]);
                const float ms_ = mn == NEG_INF ? 0.f : mn;
                const float a = ex2(m_run - ms_), w = ex2(ls[k] - ms_);  // 0 for empty parts
                tot = tot * a + w;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    acc[4 * i] = acc[4 * i] * a + w * v[k][i].x; acc[4 * i + 1] = acc[4 * i + 1] * a + w * v[k][i].y;
                    acc[4 * i + 2] = acc[4 * i + 2] * a + w * v[k][i].z; acc[4 * i + 3] = acc[4 * i + 3] * a + w * v[k][i].w;
                }
                m_run = mn;
            }
        }
    }
    const float ms = m_run == NEG_INF ? 0.f : m_run;
#else
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
#endif
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
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32 * WGROUPS, MIN_BLOCKS)
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
    extern __shared__ __align__(16) u8 smem[];  // WARPS x WARP_SMEM (dynamic)
    // warp group wg (WGROUPS > 1): its 32-slot tiles, side share and part (a constant 0 otherwise: the v7 kernel)
    const int wg = WGROUPS > 1 ? (int)(threadIdx.x >> 5) / WARPS : 0;
    const int lane = threadIdx.x & 31, w_ = (threadIdx.x >> 5) - wg * WARPS, h = blockIdx.x * WARPS + w_;
    const int wrow = WSIDE ? 0 : 32 * wg;  // the group's first row in a ring stage
#if SIDE_CTAS
    // v7: grid y = INT4 splits + SIDE_CTAS; in launch (dispatch) order all INT4 CTAs come first, one per SM while
    // they fit, then the side CTAs, which take the side region alone (SIDE_CTAS shares per request) and land in the
    // second CTA slot of the SMs: the side region's dependent-load latency runs beside the INT4 streams instead of
    // before them. Part index of a side CTA: splits + its share.
    const int nsplit = (int)gridDim.y - SIDE_CTAS;
    const int lyz = blockIdx.y + blockIdx.z * gridDim.y;
    const bool side_cta = lyz >= nsplit * (int)gridDim.z;
    const int lsd = lyz - nsplit * (int)gridDim.z;
    const int b = side_cta ? lsd / SIDE_CTAS : lyz / nsplit;
    const int split = side_cta ? nsplit + lsd % SIDE_CTAS : lyz % nsplit;
#else
    const bool side_cta = false;
    const int b = blockIdx.z;
    const int split = blockIdx.y;
#endif
    const int part = split * WGROUPS + wg;  // this warp's partial state
#if FUSE
    // This split's share of the side region (splits = gridDim.y) and its first slot ids, loaded first: the
    // latency hides behind the query's loads and rotation.
    const int s_start = SideIndptr[b];
    const int s_total = SideIndptr[b + 1] - s_start;
#if SIDE_CTAS
    const int s_per = (s_total + SIDE_CTAS - 1) / SIDE_CTAS;
    const int s_lo = side_cta ? (split - nsplit) * s_per : 0, s_hi = side_cta ? min(s_lo + s_per, s_total) : 0;
#else
#if WSIDE
    const int s_per = (s_total + (int)gridDim.y - 1) / (int)gridDim.y;  // group 1 takes the split's whole share
    const int s_lo = wg ? split * s_per : 0, s_hi = wg ? min(s_lo + s_per, s_total) : 0;
#else
    const int s_per = (s_total + (int)gridDim.y * WGROUPS - 1) / ((int)gridDim.y * WGROUPS);
    const int s_lo = part * s_per, s_hi = min(s_lo + s_per, s_total);
#endif
#endif
    const int* s_idx = SideIndices + s_start;
    const int s_sid0 = s_lo + (threadIdx.x & 31) < s_hi ? s_idx[s_lo + (threadIdx.x & 31)] : 0;
#endif
#if TMA && EARLY
    // v7: the INT4 ring is filled first (all PIPE stages); its data lands while the query is rotated and the side
    // share is taken, so the INT4 loop starts on full stages.
    const int start = KvIndptr[b];
    const int len = KvIndptr[b + 1] - start;
    const int lo = split * chunk;
    const int hi = ((ABLATE & 4) || side_cta) ? lo : min(lo + chunk, len);
    const int* idx = KvIndices + start;
    const u32 ring = (u32)__cvta_generic_to_shared(smem);
    const u32 bars = ring + PIPE * STAGE_T;
    init_ring_barriers(bars);
    const int h0 = blockIdx.x * WARPS;
    const u8* kc = KCodes + h0 * 64;
    const u8* vc = VCodes + h0 * 64;
    const u32* km = KMeta + h0;
    const u32* vm = VMeta + h0;
    int sids[PIPE];
#pragma unroll
    for (int st = 0; st < PIPE; ++st) sids[st] = lo + 32 * st + lane < hi ? idx[lo + 32 * st + lane] : 0;
    __syncthreads();  // barriers initialised
#pragma unroll
    for (int st = 0; st < PIPE; ++st)
        if (lo + 32 * st < hi) produce(ring + st * STAGE_T, bars + 8 * st, lane, w_, 0, sids[st], kc, vc, km, vm);
    int sid_next = lo + 32 * PIPE + lane < hi ? idx[lo + 32 * PIPE + lane] : 0;
#endif
    // the query codes (one WARP_SMEM per warp of the CTA); later the ring
    u8 (*qsm)[128] = (u8 (*)[128])(smem + QSM_OFF + (threadIdx.x >> 5) * WARP_SMEM);
    const int g = lane >> 2, t = lane & 3;

    // ---- query: rotate (fast Walsh-Hadamard, = x @ H of the normalised Sylvester matrix) and INT8 ----
    float qscale_row, qsum_row;
    {
        const int j = lane >> 3, s = lane & 7;  // row j of the warp's 4 query heads, elements 16s..16s+15
        const size_t base = ((size_t)b * (HKV * 4) + h * 4 + j) * 128 + s * 16;
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = q_elem(Q, base + i);
        if (rotate && !(ABLATE & 8)) {
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
#if FUSE && !(ABLATE & 1)
#define SIDE_SHARE() side_region(s_idx, s_lo, s_hi, s_sid0, KSide, KSideScale, VSide, VSideScale, h, lane, g, t, \
                                 qa, qb, qs, magic, m, l, o)
#else
#define SIDE_SHARE()
#endif
    {
#if !(TMA && EARLY)
    const int start = KvIndptr[b];
    const int len = KvIndptr[b + 1] - start;
    const int lo = split * chunk;
    const int hi = ((ABLATE & 4) || side_cta || (WSIDE && wg)) ? lo : min(lo + chunk, len);
    const int* idx = KvIndices + start;
#endif
    const u8* kb = KCodes + h * 64 + 16 * t;
    const u8* vb = VCodes + h * 64 + 8 * g;
    const u32* kmb = KMeta + h;
    const u32* vmb = VMeta + h;

#if TMA
#if !EARLY
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
        const int p0 = lo + ROWS * st, pw = p0 + wrow + lane;
        if (p0 < hi) produce(ring + st * STAGE_T, bars + 8 * st, lane, w_, wrow, pw < hi ? idx[pw] : 0, kc, vc, km, vm);
    }
    const int pn = lo + ROWS * (PIPE - 1) + wrow + lane;
    int sid_next = pn < hi ? idx[pn] : 0;
#endif
    int stage = 0;
    u32 phase = 0;
    SIDE_SHARE();
    for (int n0 = lo; n0 < hi; n0 += ROWS) {
#if EARLY
        if (n0 != lo) {  // all PIPE stages were filled at the start: nothing consumed yet at the first tile
#endif
#if WSIDE
        asm volatile("bar.sync 1, %0;" :: "n"(WARPS * 32) : "memory");  // the INT4 warps only (group 1: side)
#else
        __syncthreads();  // every warp is done with the stage consumed last tile: refill it
#endif
        {
            const int p0 = n0 + ROWS * (PIPE - 1);
            const int ahead = stage == 0 ? PIPE - 1 : stage - 1;
            if (p0 < hi) produce(ring + ahead * STAGE_T, bars + 8 * ahead, lane, w_, wrow, sid_next, kc, vc, km, vm);
            sid_next = p0 + ROWS + wrow + lane < hi ? idx[p0 + ROWS + wrow + lane] : 0;
        }
#if EARLY
        }
#endif
        mbar_wait(bars + 8 * stage, phase);
        Tile cur;
        read_stage_t(cur, ring + stage * STAGE_T, w_, g, t, wrow);
        if (++stage == PIPE) { stage = 0; phase ^= 1u; }
#elif PIPE
    __syncwarp();  // every lane has read its query operand before the ring overwrites the query codes
    const u32 ring = (u32)__cvta_generic_to_shared(smem + w_ * WARP_SMEM);
#pragma unroll
    for (int st = 0; st < PIPE - 1; ++st) {
        const int p0 = lo + 32 * st;
        if (p0 < hi) issue_async(ring + st * STAGE_BYTES, lane, p0 + lane < hi ? idx[p0 + lane] : 0, kb, vb, kmb,
                                 vmb, g, t);
        cp_commit();
    }
    int sid_next = lo + 32 * (PIPE - 1) + lane < hi ? idx[lo + 32 * (PIPE - 1) + lane] : 0;
    int stage = 0;
    SIDE_SHARE();
    for (int n0 = lo; n0 < hi; n0 += 32) {
        {
            const int p0 = n0 + 32 * (PIPE - 1);
            const int ahead = stage == 0 ? PIPE - 1 : stage - 1;  // (stage + PIPE - 1) % PIPE: consumed last tile
            if (p0 < hi) issue_async(ring + ahead * STAGE_BYTES, lane, sid_next, kb, vb, kmb, vmb, g, t);
            cp_commit();
            sid_next = p0 + 32 + lane < hi ? idx[p0 + 32 + lane] : 0;
        }
        cp_wait<PIPE - 1>();
        Tile cur;
        read_stage(cur, ring + stage * STAGE_BYTES, lane);
        stage = stage == PIPE - 1 ? 0 : stage + 1;
#else
    Tile cur;
    if (lo < hi) {
        int sid = lo + lane < hi ? idx[lo + lane] : 0;
        issue(cur, sid, kb, vb, kmb, vmb, g, t);
    }
    int sid_next = lo + 32 + lane < hi ? idx[lo + 32 + lane] : 0;
    SIDE_SHARE();
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
            const bool valid = n0 + wrow + 16 * gt + g + 8 * r < hi;
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
            float* dst = PartOut + (row * parts_ + part) * 128;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int d0 = i < 4 ? 8 * g + 2 * i : 64 + 8 * g + 2 * (i - 4);
                dst[d0] = (o[i][c] + OFF[c]) * inv;
                dst[d0 + 1] = (o[i][2 + c] + OFF[c]) * inv;
            }
            if (g == 0) PartLse[row * parts_ + part] = any ? M[c] + lg2(L[c]) : NEG_INF;
        }
    }
#if FUSE && !(ABLATE & 2)
    merge_parts(PartOut, PartLse, Counter, Out, LseOut, b, parts);
#endif
}
