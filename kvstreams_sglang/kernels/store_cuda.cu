// KV4 store as one CUDA kernel (v7): rotate K by the 128x128 Sylvester Hadamard, quantise K and V per token-head
// vector to INT4 (split-half packing) + fp16 (scale, offset), scatter to shuffled slots; INT8 side copies for rows
// whose side slot is >= 0. Reference: kv4.reference.store_reference; Triton twin: store._store_kernel.
//
// Compiled at run time by NVRTC (store_cuda.py) with -DHKV=<KV heads> -DQTYPE=<0 fp32 | 1 bf16 | 2 fp16>; shared
// helpers in kv4_ptx.cuh. Fixed head dim 128; the cache tensors are contiguous (slot-major, kv4/cache.py).
//
// One warp owns 16 consecutive token-head vectors v = t * HKV + h (rows g and g + 8 of an mma tile; lane = 4 g + q).
// Lane q holds, of each of its two vectors, the four 16-byte chunks j = 0..3 at elements 8 (4 j + q) .. + 7: every
// load instruction reads 64 contiguous bytes per vector (full sectors), and element i and i + 64 (the two nibbles
// of code byte i) sit in the same thread (chunks j and j + 2).
// Rotation: element index bits {0, 1, 3, 4} are spread over the mma k dimension (k bit 0 = element bit 0, k bits
// 1-2 = q = element bits 3-4, k bit 3 = element bit 1: the A fragment is the loaded registers as they come), so
// one bf16/fp16 m16n8k16 mma per (j, element bit 2, n-tile) with B[k][n] = (-1)^popc(k & n) (exact +-1 products,
// fp32 accumulation) applies H16 on those bits, and its C fragment lands on the same thread positions as the input;
// the remaining bits {2, 5, 6} are an in-thread 3-stage butterfly in fp32. 1/sqrt(128) is folded into the
// quantiser. fp32 inputs are split exactly into three bf16 terms (three mmas).
// Quantisation: min/max over the thread's 32 elements, then over the 4 lanes of the vector (2 shuffles); fp16
// scale/offset exactly as kv4.quant; codes floor(q + 0.5) by add.rm to 1.5 * 2^23 (the code lands in the low
// mantissa byte), clamped in float. V (and unrotated K) codes are bit-exact: q = (x - offset) / scale correctly
// rounded via a reciprocal and one Markstein correction (residual by fma, exact); rotated K codes use one fma
// against the folded reciprocal (its rotation differs from the reference's GEMM by rounding anyway).

#include "kv4_ptx.cuh"  // u32/u16/u8, HKV / QTYPE defaults, FULL, h2f, f2h, prmt
#ifndef WARPS
#define WARPS 1  // warps per CTA (v7 bench: 1 warp per CTA, 16 CTAs per SM, 1.6% faster than 4 x 4)
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS ((QTYPE == 0 ? 8 : 16) / WARPS)  // 16 warps per SM: <= 128 registers (bf16/fp16, no spills)
#endif

#define MAGIC 12582912.0f  // 1.5 * 2^23: add.rm(t, MAGIC) = MAGIC + floor(t) for |t| < 2^22
#define RSQRT128 0.0883883461356163f  // fp32(1 / sqrt(128)), the reference matrix's entry
#define CR (QTYPE == 0 ? 8 : 4)  // 32-bit registers per 8-element chunk

__device__ __forceinline__ float fmul_rn(float a, float b) { float d; asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
__device__ __forceinline__ float fadd_rn(float a, float b) { float d; asm("add.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
__device__ __forceinline__ float fsub_rn(float a, float b) { float d; asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
__device__ __forceinline__ float fadd_rm(float a, float b) { float d; asm("add.rm.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
__device__ __forceinline__ float fdiv_rn(float a, float b) { float d; asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
__device__ __forceinline__ float ffma_rn(float a, float b, float c) {
    float d; asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c)); return d;
}
__device__ __forceinline__ u32 bf16x2(float lo, float hi) {
    u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if QTYPE == 2
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#ifndef LDHINT
#define LDHINT 1  // 1: loads ask L2 for the whole 256-byte vector (prefetch-size hint; v7 bench: 0.5% faster)
#endif
__device__ __forceinline__ void ldg16(u32* r, const void* p) {
#if LDHINT
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
#endif
}
__device__ __forceinline__ void stg8(void* p, u32 a, u32 b) {
    asm volatile("st.global.v2.u32 [%0], {%1,%2};" :: "l"(p), "r"(a), "r"(b) : "memory");
}

// Element e (0..7) of an 8-element chunk held as CR registers.
__device__ __forceinline__ float elem(const u32* c, int e) {
#if QTYPE == 0
    return __uint_as_float(c[e]);
#elif QTYPE == 1
    return __uint_as_float(e & 1 ? c[e >> 1] & 0xffff0000u : c[e >> 1] << 16);
#else
    return h2f((u16)(e & 1 ? c[e >> 1] >> 16 : c[e >> 1] & 0xffffu));
#endif
}

// The 8 elements of chunk j of a vector at p (element units).
template <typename T>
__device__ __forceinline__ void load_chunks(u32 (&r)[4][CR], const T* p, int q, bool ok) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int i = 0; i < CR; ++i) r[j][i] = 0;
        if (ok) {
            const T* c = p + 8 * (4 * j + q);
            ldg16(r[j], c);
#if QTYPE == 0
            ldg16(r[j] + 4, c + 4);
#endif
        }
    }
}

__device__ __forceinline__ float frcp_rn(float a) { float d; asm("rcp.rn.f32 %0, %1;" : "=f"(d) : "f"(a)); return d; }
__device__ __forceinline__ u32 min_relu_s16x2(u32 a, u32 b) {  // per 16-bit half: max(min(a, b), 0)
    u32 d; asm("min.relu.s16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d;
}

// (hi - lo) / 15 correctly rounded: reciprocal constant, one Markstein correction (3 instructions, no division).
__device__ __forceinline__ float div15(float d) {
    const float r = 0.0666666701436042785644531f;  // RN(1 / 15)
    const float q0 = fmul_rn(d, r);
    return ffma_rn(ffma_rn(-q0, 15.0f, d), r, q0);
}

// INT4 codes: four floats MAGIC + c (c = floor(t) in the low mantissa bits, -1 <= c <= 16) -> c clamped to 0..15,
// one per byte. sm_90: two codes per 16-bit-pair clamp (min.relu.s16x2 on the low halves); else float clamps.
__device__ __forceinline__ u32 clamp_pack4(float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    const u32 p01 = min_relu_s16x2(prmt(__float_as_uint(a), __float_as_uint(b), 0x5410u), 0x000f000fu);
    const u32 p23 = min_relu_s16x2(prmt(__float_as_uint(c), __float_as_uint(d), 0x5410u), 0x000f000fu);
    return prmt(p01, p23, 0x6420u);
#else
    const float lo = MAGIC, hi = MAGIC + 15.0f;
    return prmt(prmt(__float_as_uint(fminf(fmaxf(a, lo), hi)), __float_as_uint(fminf(fmaxf(b, lo), hi)), 0x0040u),
                prmt(__float_as_uint(fminf(fmaxf(c, lo), hi)), __float_as_uint(fminf(fmaxf(d, lo), hi)), 0x0040u),
                0x5410u);
#endif
}

// Four codes (floats MAGIC + c, c the low byte) -> one word of bytes.
__device__ __forceinline__ u32 gather4(float a, float b, float c, float d) {
    return prmt(prmt(__float_as_uint(a), __float_as_uint(b), 0x0040u),
                prmt(__float_as_uint(c), __float_as_uint(d), 0x0040u), 0x5410u);
}

// The 32 elements a thread holds of vector X, x(X, j, e): raw loaded chunks (V, unrotated K) or rotated floats (K).
// minmax: the thread's min and max of vector X (16-bit inputs: packed min/max, exact).
template <typename Src>
__device__ __forceinline__ void minmax_f32(const Src& x, int X, float& mn, float& mx) {
    mn = x(X, 0, 0), mx = mn;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) { mn = fminf(mn, x(X, j, e)); mx = fmaxf(mx, x(X, j, e)); }
}
struct RawSrc {
    const u32 (&r)[2][4][CR];
    __device__ __forceinline__ float operator()(int X, int j, int e) const { return elem(r[X][j], e); }
    __device__ __forceinline__ void minmax(int X, float& mn, float& mx) const {
#if QTYPE == 0
        minmax_f32(*this, X, mn, mx);
#else
        u32 a = r[X][0][0], b = a;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#if QTYPE == 1
                asm("min.bf16x2 %0, %0, %1;" : "+r"(a) : "r"(r[X][j][i]));
                asm("max.bf16x2 %0, %0, %1;" : "+r"(b) : "r"(r[X][j][i]));
#else
                asm("min.f16x2 %0, %0, %1;" : "+r"(a) : "r"(r[X][j][i]));
                asm("max.f16x2 %0, %0, %1;" : "+r"(b) : "r"(r[X][j][i]));
#endif
            }
        const u32 pa[1] = {a}, pb[1] = {b};
        mn = fminf(elem(pa, 0), elem(pa, 1));
        mx = fmaxf(elem(pb, 0), elem(pb, 1));
#endif
    }
};
struct FloatSrc {
    const float (&x)[2][4][8];
    __device__ __forceinline__ float operator()(int X, int j, int e) const { return x[X][j][e]; }
    __device__ __forceinline__ void minmax(int X, float& mn, float& mx) const { minmax_f32(*this, X, mn, mx); }
};

// Per-vector INT4 quantisation of the values mul * x(X, j, e) and the stores: code rows at Codes (byte i of chunk
// j's word w: element 8 (4 j + q) + 4 w + i in the low nibble, + 64 in the high one), INT8 side copies for
// side[X] >= 0. FAST: one fma per code against the folded reciprocal; otherwise bit-exact kv4.quant (mul == 1).
// Returns meta[X] = scale | offset << 16.
template <bool FAST, typename Src>
__device__ __forceinline__ void quant_store(const Src& x, float mul, const long long (&slot)[2], const int (&head)[2],
                                            const bool (&ok)[2], const long long (&side)[2], bool any_side,
                                            u8* Codes, signed char* Side, u16* SideScale, int q, u32 (&meta)[2]) {
#pragma unroll
    for (int X = 0; X < 2; ++X) {
        float mn, mx;
        x.minmax(X, mn, mx);
        mn = fminf(mn, __shfl_xor_sync(FULL, mn, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
        mn = fminf(mn, __shfl_xor_sync(FULL, mn, 2));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
        if (FAST) { mn = fmul_rn(mn, mul); mx = fmul_rn(mx, mul); }
        u16 sh = f2h(div15(fsub_rn(mx, mn)));
        if ((sh & 0x7fffu) == 0) sh = 0x3c00u;  // zero range: scale 1, all codes 0
        const u16 oh = f2h(mn);
        meta[X] = (u32)sh | ((u32)oh << 16);
        if (any_side && side[X] >= 0) {  // INT8 copy (kv4.quant.quantize_int8 of mul * x)
            const size_t sv = (size_t)side[X] * HKV + head[X];
            u16 s8 = f2h(fdiv_rn(fmaxf(-mn, mx), 127.0f));
            if ((s8 & 0x7fffu) == 0) s8 = 0x3c00u;
            const float s = h2f(s8);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float c[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float v = FAST ? fmul_rn(x(X, j, e), mul) : x(X, j, e);
                    c[e] = fminf(fmaxf(fadd_rm(fadd_rn(fdiv_rn(v, s), 0.5f), MAGIC), MAGIC - 127.0f), MAGIC + 127.0f);
                }
                stg8(Side + sv * 128 + 8 * (4 * j + q), gather4(c[0], c[1], c[2], c[3]), gather4(c[4], c[5], c[6], c[7]));
            }
            if (q == 0) SideScale[sv] = s8;
        }
        const float s = h2f(sh), o = h2f(oh), r = frcp_rn(s);
        const float a = fmul_rn(mul, r), b = ffma_rn(-o, r, 0.5f);
        u32 code[2][2];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int w = 0; w < 2; ++w) {
                float u8[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float v = x(X, j + 2 * (i >> 2), 4 * w + (i & 3));
                    float u;
                    if (FAST) {
                        u = fadd_rm(ffma_rn(v, a, b), MAGIC);
                    } else {
                        const float d = fsub_rn(v, o);
                        const float q0 = fmul_rn(d, r);
                        const float qq = ffma_rn(ffma_rn(-q0, s, d), r, q0);  // = d / s correctly rounded (Markstein)
                        u = fadd_rm(fadd_rn(qq, 0.5f), MAGIC);
                    }
                    u8[i] = u;
                }
                code[j][w] = clamp_pack4(u8[0], u8[1], u8[2], u8[3]) + (clamp_pack4(u8[4], u8[5], u8[6], u8[7]) << 4);
            }
        if (ok[X]) {
            u8* p = Codes + (size_t)slot[X] * (HKV * 64) + head[X] * 64 + 8 * q;
            stg8(p, code[0][0], code[0][1]);
            stg8(p + 32, code[1][0], code[1][1]);
        }
    }
}

__device__ __forceinline__ long long load_index(const void* p, long long i, int is64) {
    return is64 ? ((const long long*)p)[i] : (long long)((const int*)p)[i];
}

#if QTYPE == 0
typedef float elem_t;
#else
typedef u16 elem_t;
#endif

struct Args {
    const elem_t* K;
    const elem_t* V;
    long long skt, skh, svt, svh;  // element strides of K and V (token, head)
    const void* Slots;
    const void* SideSlots;
    int slots64, side64;
    u8* KCodes;
    u32* KMeta;
    u8* VCodes;
    u32* VMeta;
    signed char* KSide;
    u16* KSideScale;
    signed char* VSide;
    u16* VSideScale;
    int nvec, rotate;
};

// One warp's 16 vectors base .. base + 15: their loaded K and V chunks, slot and side slot ids.
struct Group {
    int tok[2], head[2];
    bool ok[2];
    long long slot[2], side[2];
    u32 kr[2][4][CR], vr[2][4][CR];
};

__device__ __forceinline__ void load_group(Group& G, const Args& A, int base, int g, int q) {
#pragma unroll
    for (int X = 0; X < 2; ++X) {
        const int v = base + 8 * X + g;
        G.ok[X] = v < A.nvec;
        G.tok[X] = v / HKV;
        G.head[X] = v - G.tok[X] * HKV;
    }
#pragma unroll
    for (int X = 0; X < 2; ++X) load_chunks(G.kr[X], A.K + G.tok[X] * A.skt + G.head[X] * A.skh, q, G.ok[X]);
#pragma unroll
    for (int X = 0; X < 2; ++X) load_chunks(G.vr[X], A.V + G.tok[X] * A.svt + G.head[X] * A.svh, q, G.ok[X]);
#pragma unroll
    for (int X = 0; X < 2; ++X) {
        G.slot[X] = G.ok[X] ? load_index(A.Slots, G.tok[X], A.slots64) : 0;
        G.side[X] = G.ok[X] ? load_index(A.SideSlots, G.tok[X], A.side64) : -1;
    }
}

__device__ __forceinline__ void process_group(const Group& G, const Args& A, int g, int q) {
    const auto& slot = G.slot;
    const auto& side = G.side;
    const auto& head = G.head;
    const auto& ok = G.ok;
    const auto& kr = G.kr;
    const auto& vr = G.vr;
    u8* const KCodes = A.KCodes;
    u8* const VCodes = A.VCodes;
    u32* const KMeta = A.KMeta;
    u32* const VMeta = A.VMeta;
    signed char* const KSide = A.KSide;
    signed char* const VSide = A.VSide;
    u16* const KSideScale = A.KSideScale;
    u16* const VSideScale = A.VSideScale;
    const int rotate = A.rotate;
    const bool any_side = __any_sync(FULL, side[0] >= 0 || side[1] >= 0);
    u32 kmeta[2], vmeta[2];
    // ---- V (exact codes; its registers are free before the rotation needs its accumulators) ----
    quant_store<false>(RawSrc{vr}, 1.0f, slot, head, ok, side, any_side, VCodes, VSide, VSideScale, q, vmeta);

    // ---- K ----
    if (rotate) {
        u32 b[2][2];  // B[k][n] = (-1)^popc(k & n), k = 2q + {0, 1} (+ 8), n = 8 nt + g
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int hk = 0; hk < 2; ++hk) {
                const int k0 = 2 * q + 8 * hk, n = 8 * nt + g;
#if QTYPE == 2
                const u32 one = 0x3c00u, neg = 0xbc00u;
#else
                const u32 one = 0x3f80u, neg = 0xbf80u;
#endif
                const u32 e0 = __popc(k0 & n) & 1 ? neg : one, e1 = __popc((k0 + 1) & n) & 1 ? neg : one;
                b[nt][hk] = e0 | (e1 << 16);
            }
        float acc[4][2][2][4];  // [j][element bit 2][n-tile][c]: c = 2 X + element bit 0
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2)
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[j][e2][nt][c] = 0.0f;
#if QTYPE == 0
                    // x = hi + mid + lo exactly (three bf16 terms of 8 significant bits each)
                    u32 a[3][4];
#pragma unroll
                    for (int X = 0; X < 2; ++X)
#pragma unroll
                        for (int hk = 0; hk < 2; ++hk) {
                            const int e = 4 * e2 + 2 * hk;
                            float x0 = __uint_as_float(kr[X][j][e]), x1 = __uint_as_float(kr[X][j][e + 1]);
#pragma unroll
                            for (int t = 0; t < 3; ++t) {
                                const u32 p = bf16x2(x0, x1);
                                a[t][X + 2 * hk] = p;
                                x0 = fsub_rn(x0, __uint_as_float(p << 16));
                                x1 = fsub_rn(x1, __uint_as_float(p & 0xffff0000u));
                            }
                        }
#pragma unroll
                    for (int t = 0; t < 3; ++t)
                        mma16816(acc[j][e2][nt], a[t][0], a[t][1], a[t][2], a[t][3], b[nt][0], b[nt][1]);
#else
                    mma16816(acc[j][e2][nt], kr[0][j][2 * e2], kr[1][j][2 * e2], kr[0][j][2 * e2 + 1],
                             kr[1][j][2 * e2 + 1], b[nt][0], b[nt][1]);
#endif
                }
        // in-thread butterflies over element bits 2 (e2), 5 (j bit 0), 6 (j bit 1)
        float x[2][4][8];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                float y[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) y[i] = acc[i >> 1][i & 1][nt][c];
#pragma unroll
                for (int st = 1; st < 8; st <<= 1)
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                        if (!(i & st)) { const float a0 = y[i], a1 = y[i + st]; y[i] = a0 + a1; y[i + st] = a0 - a1; }
#pragma unroll
                for (int i = 0; i < 8; ++i) x[c >> 1][i >> 1][4 * (i & 1) + 2 * nt + (c & 1)] = y[i];
            }
        quant_store<true>(FloatSrc{x}, RSQRT128, slot, head, ok, side, any_side, KCodes, KSide, KSideScale, q, kmeta);
    } else {
        quant_store<false>(RawSrc{kr}, 1.0f, slot, head, ok, side, any_side, KCodes, KSide, KSideScale, q, kmeta);
    }
    // meta words: lane q writes K (q < 2) or V (q >= 2) meta of vector X = q & 1
    const bool x1 = q & 1;
    if (x1 ? ok[1] : ok[0]) {
        const size_t m = (size_t)(x1 ? slot[1] : slot[0]) * HKV + (x1 ? head[1] : head[0]);
        if (q < 2) KMeta[m] = x1 ? kmeta[1] : kmeta[0];
        else VMeta[m] = x1 ? vmeta[1] : vmeta[0];
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)
kv4_store(const elem_t* __restrict__ K, const elem_t* __restrict__ V, long long skt, long long skh, long long svt,
          long long svh, const void* __restrict__ Slots, const void* __restrict__ SideSlots, int slots64, int side64,
          u8* __restrict__ KCodes, u32* __restrict__ KMeta, u8* __restrict__ VCodes, u32* __restrict__ VMeta,
          signed char* __restrict__ KSide, u16* __restrict__ KSideScale, signed char* __restrict__ VSide,
          u16* __restrict__ VSideScale, int nvec, int rotate) {
    const Args A{K, V, skt, skh, svt, svh, Slots, SideSlots, slots64, side64, KCodes, KMeta, VCodes, VMeta,
                 KSide, KSideScale, VSide, VSideScale, nvec, rotate};
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int base = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * 16;
    if (base >= nvec) return;
    Group G;  // one group per warp: the grid covers all vectors
    load_group(G, A, base, g, q);
    process_group(G, A, g, q);
}
