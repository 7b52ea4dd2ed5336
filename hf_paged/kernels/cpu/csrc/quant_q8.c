/*
 * Quantized linear layers with int8 activations (llama.cpp's "Q8" scheme, our own code): y[M, N] =
 * q8(x)[M, K] @ dequant(W)[N, K]^T (+ bias). A faster mode than quant_gemm.c's float activations, not the exact
 * reference: each row of x is first quantized in blocks of 32, d = max|x| / 127 and q = round(x / d) (nearest,
 * ties to even; d in fp32), and the kernel computes exactly the dequantized activations q * d times the dequantized
 * weights, up to fp32 rounding: per weight block and x block the 32 products are summed as integers (exact),
 * then scaled by d_w * d_x (and the Q4_1 min adds m_w * d_x * sum(q_x)). hfq8_quantize exposes the activation
 * rounding so the tests can build the reference.
 *
 * The integer dot of 32 unsigned by 32 signed bytes is one VPDPBUSD where the CPU has VNNI (AVX512-VNNI with VL,
 * or AVX-VNNI), else VPMADDUBSW + VPMADDWD (AVX2; no overflow: |u| <= 128, |s| <= 127). Nibbles are the unsigned
 * side as they are (Q4_0's q - 8 is q plus its m = -8 d); signed weights (Q8_0, INT8) go in as |w| with the sign
 * moved onto x.
 * Threads split the output rows, 4 weight rows at a time; each 4 x 4 (or 4 x 2 without AVX-512) tile of x rows
 * and weight rows keeps its sums in registers and unpacks each weight block once for all its x rows. Every
 * output is computed by the same operations in the same order whatever M is (a row's result does not depend on
 * the batch). Built for the host, loaded through ctypes by hf_paged/model/layers/quant_linear.py.
 */
#include "quant_common.h"
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#if defined(__AVX2__)
#define HAVE_I8 1
#if defined(__AVX512F__) && defined(__AVX512VL__)
enum { MRQ = 4 };
#else
enum { MRQ = 2 };
#endif
/* 8 int32 sums, lane l = sum of u[4l..4l+3] * s[4l..4l+3] */
static inline __m256i dot32(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#else
#define HAVE_I8 0
enum { MRQ = 1 };
#endif
enum { NRQ = 4, AMX_MIN_ROWS = 16 };
#ifndef PF_GROUPS
#define PF_GROUPS 4 /* weight-row groups ahead to prefetch: the rows are short (360 bytes at K = 576), the hardware lags */
#endif

#include "quant_amx.h"

int hfq8_has_simd(void) { return HAVE_I8; }

/* whether batches above 16 rows take AMX tiles here (built for AMX-INT8, and the OS grants its state) */
int hfq8_amx(void) {
#if HAVE_AMX
    return amx_allowed();
#else
    return 0;
#endif
}

#if HAVE_I8
/* one block of 32 activations rounded as below, with AVX2: the same operations on 8 lanes (max is exact, the
 * product x * (1 / d) is rounded once either way, and VCVTPS2DQ rounds to nearest even like nearbyintf under the
 * default rounding mode), so q, d and s are the scalar loop's bitwise */
static inline void quantize_block(const float* xb, int8_t* qb, float* d, float* s) {
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
                 v3 = _mm256_loadu_ps(xb + 24), sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float db = _mm_cvtss_f32(h) / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid)),
                  i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
    /* packs interleave the 128-bit halves: 32-bit group k of p is x[4 j .. 4 j + 3] for j = (0 4 1 5 2 6 3 7)[k] */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256((__m256i*)qb, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_unpackhi_epi64(u, u));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 1));
    *d = db;
    *s = db * (float)_mm_cvtsi128_si32(u);
}
#else
static inline void quantize_block(const float* xb, int8_t* qb, float* d, float* s) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = fmaxf(amax, fabsf(xb[j]));
    const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
        const int v = (int)nearbyintf(xb[j] * id);
        qb[j] = (int8_t)v;
        sum += v;
    }
    *d = db;
    *s = db * (float)sum;
}
#endif

/* x[M, K] -> q[M, K] int8 and d[M, K / 32] fp32 (see the header comment); s[M, K / 32] = d * sum(q) per block */
int hfq8_quantize(const float* x, int64_t ldx, int M, int K, int8_t* q, float* d, float* s, int num_threads) {
    if (K % QK) return -1;
    const int nb = K / QK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int i = 0; i < M; ++i)
        for (int b = 0; b < nb; ++b)
            quantize_block(x + i * ldx + b * QK, q + (size_t)i * K + b * QK, d + (size_t)i * nb + b,
                           s + (size_t)i * nb + b);
    return 0;
}

#if HAVE_I8
/* one weight block as the unsigned side u (and, for signed formats, the signs w to move onto x); 4-bit blocks are
 * their nibbles q as they are (Q4_0's -8 is its m, see Q4_0_M) */
static inline __attribute__((always_inline)) void unpack_i8(const int fmt, const uint8_t* p, __m256i* u, __m256i* w) {
    if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
        *u = nibbles(_mm_loadu_si128((const __m128i*)p));
        return;
    }
    *w = _mm256_loadu_si256((const __m256i*)p);
    *u = _mm256_sign_epi8(*w, *w);
}

/* d (and m, see block_m) of the blocks at w + r * row_bytes for the tile's rows r < nr (0 past them) as 4 lanes:
 * each block's first 4 bytes (its fp16 d, then Q4_1's fp16 m) in one vector, converted together */
static inline __attribute__((always_inline)) void scales4(const int fmt, const int nr, const uint8_t* w,
                                                          const size_t row_bytes, __m128* d, __m128* m) {
    if (fmt == FMT_INT8) {
        *d = _mm_set1_ps(1.0f), *m = _mm_setzero_ps();
        return;
    }
    int32_t h[NRQ] = {0};
    for (int r = 0; r < nr; ++r) memcpy(&h[r], w + r * row_bytes, 4);
    /* fp16 lanes (d0 m0 d1 m1 d2 m2 d3 m3) -> (d0 d1 d2 d3 m0 m1 m2 m3) */
    const __m128i v = _mm_shuffle_epi8(_mm_setr_epi32(h[0], h[1], h[2], h[3]),
                                       _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    *d = _mm_cvtph_ps(v);
    *m = fmt == FMT_Q4_1 ? _mm_cvtph_ps(_mm_unpackhi_epi64(v, v))
       : fmt == FMT_Q4_0 ? _mm_mul_ps(*d, _mm_set1_ps(Q4_0_M)) : _mm_setzero_ps();
}

/* lane r = the sum of v[r]'s 8 lanes (exact int32 sums) */
static inline __m128i sum4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

/*
 * y[i][r] for mr x rows and nr weight rows (4, or 1). Per output, block by block: the block's integer dot (exact),
 * as fp32, times d_w * d_x added in one rounding, then (4-bit) m_w * (d_x * sum(q_x)) in one rounding. These are
 * the operations and the order of the AMX tiles (quant_amx.h) and of the rows8 kernel (quant_q8_rows8.h), so a
 * row's result is the same bits whichever of them serves its batch. The 4 weight rows of a tile are the 4 lanes
 * of one vector.
 */
static inline __attribute__((always_inline)) void tile(
    const int fmt, const int mr, const int nr, const int nb, const uint8_t* w, const size_t row_bytes,
    const int8_t* xq, const int64_t K, const float* xd, const float* xs, float out[MRQ][NRQ])
{
    const int bb = block_bytes(fmt), off = quant_offset(fmt), q4 = fmt == FMT_Q4_0 || fmt == FMT_Q4_1;
    __m128 acc[MRQ];
    for (int i = 0; i < mr; ++i) acc[i] = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        __m256i u[NRQ], sg[NRQ];
        for (int r = 0; r < nr; ++r) {
            const uint8_t* blk = w + r * row_bytes + (size_t)b * bb;
            if (PF_GROUPS) __builtin_prefetch(blk + PF_GROUPS * NRQ * row_bytes, 0, 3);
            unpack_i8(fmt, blk + off, &u[r], &sg[r]);
        }
        __m128 dwv, mwv;
        scales4(fmt, nr, w + (size_t)b * bb, row_bytes, &dwv, &mwv);
        for (int i = 0; i < mr; ++i) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + i * K + b * QK));
            __m256i dot[NRQ];
            for (int r = 0; r < NRQ; ++r)
                dot[r] = r >= nr ? _mm256_setzero_si256() : dot32(u[r], q4 ? x : _mm256_sign_epi8(x, sg[r]));
            const __m128 f = _mm_cvtepi32_ps(sum4(dot[0], dot[1], dot[2], dot[3]));
            acc[i] = _mm_fmadd_ps(f, _mm_mul_ps(dwv, _mm_set1_ps(xd[i * nb + b])), acc[i]);
            if (q4) acc[i] = _mm_fmadd_ps(mwv, _mm_set1_ps(xs[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < mr; ++i) {
        float lanes[NRQ];
        _mm_storeu_ps(lanes, acc[i]);
        for (int r = 0; r < nr; ++r) out[i][r] = lanes[r];
    }
}
#else
/* the same operations one output at a time (no SIMD build) */
static inline void tile(const int fmt, const int mr, const int nr, const int nb, const uint8_t* w,
                        const size_t row_bytes, const int8_t* xq, const int64_t K, const float* xd, const float* xs,
                        float out[MRQ][NRQ]) {
    const int bb = block_bytes(fmt), off = quant_offset(fmt), q4 = fmt == FMT_Q4_0 || fmt == FMT_Q4_1;
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) {
            float acc = 0.0f;
            for (int b = 0; b < nb; ++b) {
                const uint8_t* blk = w + r * row_bytes + (size_t)b * bb;
                const uint8_t* p = blk + off;
                const int8_t* xb = xq + i * K + b * QK;
                int dot = 0;
                for (int j = 0; j < QK / 2; ++j) {
                    int lo, hi;
                    if (q4) lo = p[j] & 15, hi = p[j] >> 4;
                    else lo = (int8_t)p[j], hi = (int8_t)p[j + QK / 2];
                    dot += lo * xb[j] + hi * xb[j + QK / 2];
                }
                acc = fmaf((float)dot, (fmt == FMT_INT8 ? 1.0f : h2f(blk)) * xd[i * nb + b], acc);
                if (q4) acc = fmaf(block_m(fmt, blk), xs[i * nb + b], acc);
            }
            out[i][r] = acc;
        }
}
#endif

static void tile_any(int fmt, int mr, int nr, int nb, const uint8_t* w, size_t row_bytes, const int8_t* xq,
                     int64_t K, const float* xd, const float* xs, float out[MRQ][NRQ]) {
#define TILE_NR(F, MR_)                                                                      \
    if (nr == NRQ) tile(F, MR_, NRQ, nb, w, row_bytes, xq, K, xd, xs, out);                  \
    else tile(F, MR_, 1, nb, w, row_bytes, xq, K, xd, xs, out);
#define TILE_MR(F)                                                                           \
    if (mr == MRQ) { TILE_NR(F, MRQ) }                                                       \
    else if (MRQ > 2 && mr == 3) { TILE_NR(F, 3) }                                           \
    else if (MRQ > 1 && mr == 2) { TILE_NR(F, 2) }                                           \
    else { TILE_NR(F, 1) }
    switch (fmt) {
    case FMT_Q8_0: TILE_MR(FMT_Q8_0) break;
    case FMT_Q4_0: TILE_MR(FMT_Q4_0) break;
    case FMT_Q4_1: TILE_MR(FMT_Q4_1) break;
    default: TILE_MR(FMT_INT8) break;
    }
#undef TILE_MR
#undef TILE_NR
}

/*
 * y[M, N] (row stride ldy) = q8(x)[M, K] (row stride ldx, K a multiple of 32) @ dequant(w)^T + bias (NULL: none);
 * w and scales as in quant_gemm.c's hfq_linear. Returns 0, -1 for an unknown format or K not a multiple of 32,
 * -2 when scratch cannot be allocated.
 */
int hfq8_linear(const float* x, int64_t ldx, const uint8_t* w, int fmt, const float* scales, const float* bias,
                float* y, int64_t ldy, int M, int N, int K, int num_threads)
{
    const int bb = block_bytes(fmt);
    if (bb == 0 || K % QK != 0 || (fmt == FMT_INT8 && scales == NULL)) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int nb = K / QK;
    int8_t* xq = aligned_alloc(64, ((size_t)M * K + 63) / 64 * 64);
    float* xd = malloc(sizeof(float) * 2 * (size_t)M * (nb > 0 ? nb : 1));
    if (xq == NULL || xd == NULL) {
        free(xq), free(xd);
        return -2;
    }
    float* xs = xd + (size_t)M * nb;
    hfq8_quantize(x, ldx, M, K, xq, xd, xs, M >= 64 ? num_threads : 1);
#if HAVE_AMX
    if (M > AMX_MIN_ROWS && amx_allowed()) {
        const int rc = amx_linear(xq, xd, xs, w, fmt, 0, scales, bias, y, ldy, M, N, K, num_threads);
        free(xq);
        free(xd);
        return rc;
    }
#endif
    const size_t row_bytes = (size_t)nb * bb;
    const int groups = (N + NRQ - 1) / NRQ;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int g = 0; g < groups; ++g) {
        const int n0 = g * NRQ, nr = N - n0 < NRQ ? 1 : NRQ;
        for (int n = n0; n < (nr == 1 ? N : n0 + NRQ); n += nr) { /* the last group: one row at a time */
            for (int m0 = 0; m0 < M; m0 += MRQ) {
                const int mr = M - m0 < MRQ ? M - m0 : MRQ;
                float out[MRQ][NRQ];
                tile_any(fmt, mr, nr, nb, w + (size_t)n * row_bytes, row_bytes, xq + (size_t)m0 * K, K,
                         xd + (size_t)m0 * nb, xs + (size_t)m0 * nb, out);
                for (int i = 0; i < mr; ++i)
                    for (int r = 0; r < nr; ++r) {
                        const float s = fmt == FMT_INT8 ? scales[n + r] : 1.0f, bn = bias ? bias[n + r] : 0.0f;
                        y[(m0 + i) * ldy + n + r] = fmaf(out[i][r], s, bn);
                    }
            }
        }
    }
    free(xq);
    free(xd);
    return 0;
}

#include "quant_q8_rows8.h"
