/*
 * Quantized linear layers with bf16 activations on AMX-BF16 tiles: y[M, N] = bf16(x)[M, K] @ bf16(dequant(W))[N, K]^T
 * (+ bias), fp32 x and y. The third kernel mode next to quant_gemm.c (float activations, the exact reference) and
 * quant_q8.c (int8 activations): each x value and each dequantized weight (dequant_row's fp32 q * d + m, then rounded)
 * is rounded to bf16 (nearest, ties to even), their products are exact in fp32 and summed in fp32. Unlike int8
 * activations the block scales are folded into the weights before the dot products, so one tile accumulates a
 * whole row of K and is read back once: the product tiles run at AMX's rate instead of waiting on per-block scaling.
 *
 * The product is taken transposed, y^T = W x^T, so that both operands are rows as they come:
 *   A (tile 4): 16 weight rows x 32 k, bf16 - one block of each of 16 weight rows, dequantized in place, no shuffle;
 *   B (tiles 5-7): 16 k pairs x 16 x rows x 2, bf16 - AMX's pair-interleaved layout, packed from x once per call;
 *   C (tiles 0-3): 16 weight rows x 16 x rows, fp32 - up to 64 x rows per pass over a weight tile.
 * Per thread, a tile of 16 weight rows is dequantized for the whole K into a buffer that stays in L2 (1 KB per
 * block: 48 KB at K = 1536), then every group of up to 64 x rows meets it there. Each output is the same sum in the
 * same order whatever M is, so a row's result does not depend on the batch.
 *
 * AMX rounds like VCVTNE2PS2BF16 (denormal inputs read as zero) and flushes denormal results; the tests compare with
 * torch's bf16 rounding on normal values. Built only where the compiler targets AMX-BF16 and AVX512-BF16
 * (hfqb_available() says whether this build has the kernel and Linux grants the AMX state); elsewhere the engine
 * uses the float-activation kernel (quant_linear.py).
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off") /* the dequantized weights as dequant_row rounds them: q * d, then + m */
#endif
#include "quant_common.h"
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#if HAVE_AMX_TILE && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX_BF16 1

enum { T = 16, CT = 4 }; /* tile edge; C tiles (groups of 16 x rows) per pass */

static void configure(void) { /* every tile 16 rows of 64 bytes */
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.rows[t] = T, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* x rows as B tiles: xb[((g * nb + b) * 16 + p) * 32 + 2 j + e] = bf16(x[16 g + j][32 b + 2 p + e]), zero past M */
static void pack_x(const float* x, int64_t ldx, int M, int K, uint16_t* xb, int num_threads) {
    const int nb = K / QK, groups = (M + T - 1) / T;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int gb = 0; gb < groups * nb; ++gb) {
        const int g = gb / nb, b = gb % nb;
        uint32_t* dst = (uint32_t*)(xb + (size_t)gb * T * QK);
        for (int j = 0; j < T; ++j) {
            const int i = g * T + j;
            uint32_t pairs[T] __attribute__((aligned(64)));
            if (i < M) {
                const float* src = x + (size_t)i * ldx + b * QK;
                _mm512_store_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src)));
            } else {
                memset(pairs, 0, sizeof pairs);
            }
            for (int p = 0; p < T; ++p) dst[p * T + j] = pairs[p];
        }
    }
}

/* 16 weight rows n0.. (nr of them; zeros past) as A tiles: a[(b * 16 + r) * 32 + k] = bf16(dequant(w)[n0 + r][32 b + k]);
 * dequant as quant_gemm.c's dequant_row: q * d + m with two roundings (no fused multiply-add) */
static inline __attribute__((always_inline)) void pack_w(const int fmt, const uint8_t* w, size_t row_bytes,
                                                         const float* scales, int nr, int nb, uint16_t* a) {
    const int bb = block_bytes(fmt), off = quant_offset(fmt);
    for (size_t l = 0; l < T * row_bytes; l += 64) __builtin_prefetch(w + T * row_bytes + l, 0, 3); /* next tile */
    for (int b = 0; b < nb; ++b) {
        const uint8_t* blk = w + (size_t)b * bb;
        uint16_t* dst = a + (size_t)b * T * QK;
        for (int r = 0; r < nr; ++r, blk += row_bytes, dst += QK) {
            const uint8_t* p = blk + off;
            __m512 lo, hi;
            if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
                const __m128i raw = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(15);
                __m128i l4 = _mm_and_si128(raw, mask), h4 = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
                if (fmt == FMT_Q4_0) l4 = _mm_sub_epi8(l4, _mm_set1_epi8(8)), h4 = _mm_sub_epi8(h4, _mm_set1_epi8(8));
                lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(l4));
                hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h4));
            } else {
                lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
                hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
            }
            const __m512 d = _mm512_set1_ps(fmt == FMT_INT8 ? scales[r] : h2f(blk));
            lo = _mm512_mul_ps(lo, d), hi = _mm512_mul_ps(hi, d);
            if (fmt == FMT_Q4_1) {
                const __m512 m = _mm512_set1_ps(h2f(blk + 2));
                lo = _mm512_add_ps(lo, m), hi = _mm512_add_ps(hi, m);
            }
            _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
    for (int r = nr; r < T; ++r)
        for (int b = 0; b < nb; ++b) memset(a + ((size_t)b * T + r) * QK, 0, QK * 2);
}

static void pack_w_any(int fmt, const uint8_t* w, size_t row_bytes, const float* scales, int nr, int nb, uint16_t* a) {
    switch (fmt) {
    case FMT_Q8_0: pack_w(FMT_Q8_0, w, row_bytes, scales, nr, nb, a); break;
    case FMT_Q4_0: pack_w(FMT_Q4_0, w, row_bytes, scales, nr, nb, a); break;
    case FMT_Q4_1: pack_w(FMT_Q4_1, w, row_bytes, scales, nr, nb, a); break;
    default: pack_w(FMT_INT8, w, row_bytes, scales, nr, nb, a); break;
    }
}

/* C tiles 0..cnt-1 += A(b) B(g + c, b) over the blocks; cnt a constant at each call site so the tile numbers are */
#define PASS(cnt)                                                                                        \
    do {                                                                                                 \
        for (int c = 0; c < (cnt); ++c) {                                                                \
            if (c == 0) _tile_zero(0);                                                                   \
            if (c == 1) _tile_zero(1);                                                                   \
            if (c == 2) _tile_zero(2);                                                                   \
            if (c == 3) _tile_zero(3);                                                                   \
        }                                                                                                \
        for (int b = 0; b < nb; ++b) {                                                                   \
            _tile_loadd(4, a + (size_t)b * T * QK, 64);                                                  \
            const uint16_t* xg = xb + ((size_t)g * nb + b) * T * QK;                                     \
            const size_t gs = (size_t)nb * T * QK;                                                       \
            _tile_loadd(5, xg, 64);                                                                      \
            _tile_dpbf16ps(0, 4, 5);                                                                     \
            if ((cnt) > 1) { _tile_loadd(6, xg + gs, 64); _tile_dpbf16ps(1, 4, 6); }                     \
            if ((cnt) > 2) { _tile_loadd(7, xg + 2 * gs, 64); _tile_dpbf16ps(2, 4, 7); }                 \
            if ((cnt) > 3) { _tile_loadd(5, xg + 3 * gs, 64); _tile_dpbf16ps(3, 4, 5); }                 \
        }                                                                                                \
        _tile_stored(0, out, 64);                                                                        \
        if ((cnt) > 1) _tile_stored(1, out + T * T, 64);                                                 \
        if ((cnt) > 2) _tile_stored(2, out + 2 * T * T, 64);                                             \
        if ((cnt) > 3) _tile_stored(3, out + 3 * T * T, 64);                                             \
    } while (0)

static int amx_bf16_linear(const float* x, int64_t ldx, const uint8_t* w, int fmt, const float* scales,
                           const float* bias, float* y, int64_t ldy, int M, int N, int K, int num_threads) {
    const int nb = K / QK, groups = (M + T - 1) / T, wtiles = (N + T - 1) / T;
    const size_t row_bytes = (size_t)nb * block_bytes(fmt);
    uint16_t* xb = aligned_alloc(64, (size_t)groups * nb * T * QK * 2);
    if (xb == NULL) return -2;
    pack_x(x, ldx, M, K, xb, M >= 64 ? num_threads : 1);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        uint16_t* a = aligned_alloc(64, (size_t)nb * T * QK * 2);
        if (a == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            configure();
        }
        float out[CT * T * T] __attribute__((aligned(64))); /* [c][weight row][x row] */
#pragma omp for schedule(static)
        for (int wt = 0; wt < wtiles; ++wt) {
            if (a == NULL) continue;
            const int n0 = wt * T, nr = N - n0 < T ? N - n0 : T;
            pack_w_any(fmt, w + (size_t)n0 * row_bytes, row_bytes, fmt == FMT_INT8 ? scales + n0 : NULL, nr, nb, a);
            for (int g = 0; g < groups; g += CT) {
                const int cnt = groups - g < CT ? groups - g : CT;
                if (cnt == 4) PASS(4);
                else if (cnt == 3) PASS(3);
                else if (cnt == 2) PASS(2);
                else PASS(1);
                const int m0 = g * T, mr = M - m0 < cnt * T ? M - m0 : cnt * T;
                for (int j = 0; j < mr; ++j) {
                    const float* col = out + (size_t)(j / T) * T * T + j % T;
                    float* yr = y + (size_t)(m0 + j) * ldy + n0;
                    for (int r = 0; r < nr; ++r) yr[r] = col[r * T] + (bias ? bias[n0 + r] : 0.0f);
                }
            }
        }
        if (a != NULL) _tile_release();
        free(a);
    }
    free(xb);
    return failed ? -2 : 0;
}
#undef PASS
#else
#define HAVE_AMX_BF16 0
#endif

/* 1 where this build has the AMX-BF16 kernel and the OS grants the AMX state, else 0 */
int hfqb_available(void) {
#if HAVE_AMX_BF16
    return amx_allowed();
#else
    return 0;
#endif
}

/*
 * y[M, N] (row stride ldy) = bf16(x)[M, K] (row stride ldx, K a multiple of 32) @ bf16(dequant(w))^T + bias (NULL:
 * none); w and scales as in quant_gemm.c's hfq_linear. Returns 0; -1 for an unknown format or K not a multiple of 32;
 * -2 when scratch cannot be allocated; -3 where this build or CPU has no AMX-BF16 (see hfqb_available).
 */
int hfqb_linear(const float* x, int64_t ldx, const uint8_t* w, int fmt, const float* scales, const float* bias,
                float* y, int64_t ldy, int M, int N, int K, int num_threads) {
    if (block_bytes(fmt) == 0 || K % QK != 0 || (fmt == FMT_INT8 && scales == NULL)) return -1;
    if (M <= 0 || N <= 0) return 0;
#if HAVE_AMX_BF16
    if (!amx_allowed()) return -3;
    return amx_bf16_linear(x, ldx, w, fmt, scales, bias, y, ldy, M, N, K, num_threads);
#else
    (void)x, (void)ldx, (void)w, (void)scales, (void)bias, (void)y, (void)ldy, (void)num_threads;
    return -3;
#endif
}
