/*
 * What the quantized linear kernels share (quant_gemm.c: float activations; quant_q8.c: int8 activations):
 * the block formats, the fp16 scale reader and the vector type. Row n of a weight is K / 32 blocks of 32 weights
 * in GGUF's exact layouts:
 *   Q8_0 (34 bytes): fp16 d, 32 x int8 q                        w = q * d
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles                w = (q - 8) * d
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles        w = q * d + m
 * (nibbles: byte j holds weight j in its low half and weight j + 16 in its high half), and our own
 *   INT8 (32 bytes per block, no header): int8 q, with one fp32 scale s[n] per output row    w = q * s[n]
 */
#ifndef HF_PAGED_QUANT_COMMON_H
#define HF_PAGED_QUANT_COMMON_H
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#include "vec_common.h"
#define NV (32 / VW) /* vectors per block */

enum { QK = 32 };
enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2, FMT_INT8 = 3 };

static inline int block_bytes(int fmt) {
    switch (fmt) {
    case FMT_Q8_0: return 34;
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    case FMT_INT8: return 32;
    default: return 0;
    }
}

/* where a block's quants start (after its fp16 d, and m for Q4_1) */
static inline int quant_offset(int fmt) { return fmt == FMT_Q4_1 ? 4 : fmt == FMT_INT8 ? 0 : 2; }

/* IEEE half -> float, exactly (subnormals, infinities and NaN included) */
static inline float h2f(const uint8_t* p) {
#if defined(__F16C__)
    uint16_t bits;
    memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
#else
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t f;
    if (e == 0) {
        if (m == 0) f = s;
        else { /* subnormal: m * 2^-24, exact in fp32 */
            float v = (float)m * (1.0f / 16777216.0f);
            memcpy(&f, &v, 4);
            f |= s;
        }
    } else if (e == 31) f = s | 0x7f800000u | (m << 13);
    else f = s | ((e + 112) << 23) | (m << 13);
    float r;
    memcpy(&r, &f, 4);
    return r;
#endif
}

/* The int8-activation kernels take a 4-bit block's nibbles q as they are, unsigned, with an offset term m per weight:
 * Q4_1's stored m; Q4_0's (q - 8) d = q d + (-8 d), so its m is d * Q4_0_M, made in fp32 (exact). Every kernel (the
 * block kernel's vectors, the AMX tiles, the rows8 groups) makes Q4_0's m with this one rule, whatever layout it
 * reads d from: a row's bits do not depend on which kernel ran it. */
#define Q4_0_M (-8.0f)

/* a block's offset term per weight (see Q4_0_M): 0 for the 8-bit formats */
static inline float block_m(const int fmt, const uint8_t* blk) {
    return fmt == FMT_Q4_1 ? h2f(blk + 2) : fmt == FMT_Q4_0 ? h2f(blk) * Q4_0_M : 0.0f;
}

#if defined(__AVX2__)
/* a 4-bit block's 16 bytes of nibbles as its 32 weights q (0..15) in order: the low halves (weights 0..15), then
 * the high halves (16..31) */
static inline __m256i nibbles(const __m128i raw) {
    const __m128i mask = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}
#endif

#if defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_TILE 1
/* AMX tile configuration (palette 1): per tile its rows and bytes per row */
struct amx_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

/* whether Linux grants this process the AMX tile state (asked once: arch_prctl ARCH_REQ_XCOMP_PERM) */
static __attribute__((unused)) int amx_allowed(void) {
    static int state = 0; /* 0 unknown, 1 granted, -1 refused */
    if (state == 0) {
        const long rc = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
        state = rc == 0 ? 1 : -1;
    }
    return state == 1;
}
#else
#define HAVE_AMX_TILE 0
#endif

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int l = 0; l < VW; ++l) s += v[l];
    return s;
}
#endif
