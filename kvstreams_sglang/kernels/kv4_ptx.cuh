// PTX helpers and defaults shared by the NVRTC kernels (decode_cuda.cu, store_cuda.cu); cuda_rtc.compile_cubin
// puts this directory on the include path.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#ifndef HKV
#define HKV 8
#endif
#ifndef QTYPE
#define QTYPE 1
#endif

#define FULL 0xffffffffu

__device__ __forceinline__ float h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel)); return d;
}
