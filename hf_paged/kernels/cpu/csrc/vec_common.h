/*
 * The float vector type the C kernels share (gemm_cpu.c, quant_*.c): as wide as the compiler's target, 16 lanes
 * with AVX-512, 8 with AVX, else 4, with unaligned loads and stores.
 */
#ifndef HF_PAGED_VEC_COMMON_H
#define HF_PAGED_VEC_COMMON_H

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
#define LD(p) (*(const vf*)(p))
#define ST(p, v) (*(vf*)(p) = (v))
#endif
