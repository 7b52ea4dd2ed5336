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

enum { T = 16 }; /* tile edge */

static void configure(void) { /* every tile 16 rows of 64 bytes */
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.rows[t] = T, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* x rows as B tiles: xb[((g * nb + b) * 16 + p) * 32 + 2 j + e] = bf16(x[16 g + j][32 b + 2 p + e]), zero past M;
 * x fp32 (rounded here) or, with bf16_in, bf16 already (copied) */
static void pack_x(const void* x, int bf16_in, int64_t ldx, int M, int K, uint16_t* xb, int num_threads) {
    const int nb = K / QK, groups = (M + T - 1) / T;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int gb = 0; gb < groups * nb; ++gb) {
        const int g = gb / nb, b = gb % nb;
        uint32_t* dst = (uint32_t*)(xb + (size_t)gb * T * QK);
        for (int j = 0; j < T; ++j) {
            const int i = g * T + j;
            uint32_t pairs[T] __attribute__((aligned(64)));
            if (i < M && bf16_in) {
                memcpy(pairs, (const uint16_t*)x + (size_t)i * ldx + b * QK, sizeof pairs);
            } else if (i < M) {
                const float* src = (const float*)x + (size_t)i * ldx + b * QK;
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
    const __m512 nib_q4_1 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 nib_q4_0 = _mm512_sub_ps(nib_q4_1, _mm512_set1_ps(8.0f));
    for (size_t l = 0; l < T * row_bytes; l += 64) __builtin_prefetch(w + T * row_bytes + l, 0, 3); /* next tile */
    for (int b = 0; b < nb; ++b) {
        const uint8_t* blk = w + (size_t)b * bb;
        uint16_t* dst = a + (size_t)b * T * QK;
        for (int r = 0; r < nr; ++r, blk += row_bytes, dst += QK) {
            const uint8_t* p = blk + off;
            __m512 lo, hi;
            if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
                /* the 16 values a nibble can stand for, q * d (+ m), rounded to bf16; the nibbles pick from them */
                __m512 v = _mm512_mul_ps(fmt == FMT_Q4_0 ? nib_q4_0 : nib_q4_1, _mm512_set1_ps(h2f(blk)));
                if (fmt == FMT_Q4_1) v = _mm512_add_ps(v, _mm512_set1_ps(h2f(blk + 2)));
                const __m128i raw = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(15);
                const __m128i l4 = _mm_and_si128(raw, mask), h4 = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
                const __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(h4, l4));
                const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
                _mm512_store_si512(dst, _mm512_permutexvar_epi16(idx, table));
                continue;
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
    for (int r = nr > 0 ? nr : 0; r < T; ++r)
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

/*
 * One pass: the C tiles of ni weight tiles by mj x groups (ni * mj <= 4; ni, mj constants after inlining, so the tile
 * numbers are) accumulate A(i, b) B(j, b) over the blocks b in order (C tile i * mj + j), then land in
 * out[ni * mj][16][16]. Each C tile
 * is a chain of nb dependent products; the 4 chains in flight hide the latency of one (a single chain would wait
 * on it), which is why small batches take 4 weight tiles at once and large ones 4 x groups. Every output is the same
 * chain whatever the shape, so the shape changes no number.
 *   ni = 1: A in tile 4, B in 5-7 (and 5 again);  ni = 2: A in 4-5, B in 6-7;  ni = 4 (mj = 1): B in 4, A in 5-7, 5.
 */
static inline __attribute__((always_inline)) void pass(const int ni, const int mj, const uint16_t* a, size_t as,
                                                       const uint16_t* xg, size_t gs, int nb, float* out) {
    _tile_zero(0);
    if (ni * mj > 1) _tile_zero(1);
    if (ni * mj > 2) _tile_zero(2);
    if (ni * mj > 3) _tile_zero(3);
    for (int b = 0; b < nb; ++b, a += T * QK, xg += T * QK) {
        if (ni == 1) {
            _tile_loadd(4, a, 64);
            _tile_loadd(5, xg, 64); _tile_dpbf16ps(0, 4, 5);
            if (mj > 1) { _tile_loadd(6, xg + gs, 64); _tile_dpbf16ps(1, 4, 6); }
            if (mj > 2) { _tile_loadd(7, xg + 2 * gs, 64); _tile_dpbf16ps(2, 4, 7); }
            if (mj > 3) { _tile_loadd(5, xg + 3 * gs, 64); _tile_dpbf16ps(3, 4, 5); }
        } else if (ni == 2 && mj == 2) {
            _tile_loadd(4, a, 64); _tile_loadd(6, xg, 64); _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, a + as, 64); _tile_dpbf16ps(2, 5, 6);
            _tile_loadd(7, xg + gs, 64); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7);
        } else if (ni == 2) {
            _tile_loadd(4, a, 64); _tile_loadd(6, xg, 64); _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, a + as, 64); _tile_dpbf16ps(1, 5, 6);
        } else {
            _tile_loadd(4, xg, 64);
            _tile_loadd(5, a, 64); _tile_dpbf16ps(0, 5, 4);
            _tile_loadd(6, a + as, 64); _tile_dpbf16ps(1, 6, 4);
            _tile_loadd(7, a + 2 * as, 64); _tile_dpbf16ps(2, 7, 4);
            _tile_loadd(5, a + 3 * as, 64); _tile_dpbf16ps(3, 5, 4);
        }
    }
    _tile_stored(0, out, 64);
    if (ni * mj > 1) _tile_stored(1, out + T * T, 64);
    if (ni * mj > 2) _tile_stored(2, out + 2 * T * T, 64);
    if (ni * mj > 3) _tile_stored(3, out + 3 * T * T, 64);
}

/* fp32 -> bf16, nearest, ties to even, as torch rounds (NaN stays a quiet NaN, subnormals kept) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* y = x W^T + bias; x and y fp32, or bf16 where bf16_io (y rounded once, from the fp32 sum plus the bias) */
static int amx_bf16_linear(const void* x, int64_t ldx, const uint8_t* w, int fmt, const float* scales,
                           const float* bias, void* y, int64_t ldy, int M, int N, int K, int bf16_io, int num_threads) {
    const int nb = K / QK, groups = (M + T - 1) / T;
    int ni = groups == 1 ? 4 : groups == 2 ? 2 : 1; /* weight tiles per unit of work */
    while (ni > 1 && (N + ni * T - 1) / (ni * T) < 4 * num_threads) ni /= 2; /* enough units to share out */
    const int units = (N + ni * T - 1) / (ni * T);
    const size_t row_bytes = (size_t)nb * block_bytes(fmt), as = (size_t)nb * T * QK, gs = as;
    uint16_t* xb = aligned_alloc(64, (size_t)groups * nb * T * QK * 2);
    if (xb == NULL) return -2;
    pack_x(x, bf16_io, ldx, M, K, xb, M >= 64 ? num_threads : 1);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        uint16_t* a = aligned_alloc(64, (size_t)ni * as * 2);
        if (a == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            configure();
        }
        float out[4 * T * T] __attribute__((aligned(64))); /* [C tile][weight row][x row] */
#pragma omp for schedule(static)
        for (int u = 0; u < units; ++u) {
            if (a == NULL) continue;
            const int n0 = u * ni * T;
            for (int i = 0; i < ni; ++i) {
                const int nt = n0 + i * T, nr = N - nt < T ? N - nt : T; /* nr <= 0: a zero tile */
                pack_w_any(fmt, w + (size_t)(nt < N ? nt : 0) * row_bytes, row_bytes,
                           fmt == FMT_INT8 && nt < N ? scales + nt : NULL, nr, nb, a + i * as);
            }
            for (int g = 0; g < groups; g += 4 / ni) {
                const int mj = groups - g < 4 / ni ? groups - g : 4 / ni;
                const uint16_t* xg = xb + (size_t)g * gs;
                if (ni == 4) pass(4, 1, a, as, xg, gs, nb, out); /* mj = 1 */
                else if (ni == 2) mj == 2 ? pass(2, 2, a, as, xg, gs, nb, out) : pass(2, 1, a, as, xg, gs, nb, out);
                else if (mj == 4) pass(1, 4, a, as, xg, gs, nb, out);
                else if (mj == 3) pass(1, 3, a, as, xg, gs, nb, out);
                else if (mj == 2) pass(1, 2, a, as, xg, gs, nb, out);
                else pass(1, 1, a, as, xg, gs, nb, out);
                for (int i = 0; i < ni; ++i)
                    for (int j = 0; j < mj; ++j) {
                        const int nt = n0 + i * T, mt = (g + j) * T;
                        const int nr = N - nt < T ? N - nt : T, mr = M - mt < T ? M - mt : T;
                        const float* c = out + (size_t)(i * mj + j) * T * T;
                        for (int jj = 0; jj < mr; ++jj) {
                            const size_t at = (size_t)(mt + jj) * ldy + nt;
                            for (int r = 0; r < nr; ++r) {
                                const float v = c[r * T + jj] + (bias ? bias[nt + r] : 0.0f);
                                if (bf16_io) ((uint16_t*)y)[at + r] = to_bf16(v);
                                else ((float*)y)[at + r] = v;
                            }
                        }
                    }
            }
        }
        if (a != NULL) _tile_release();
        free(a);
    }
    free(xb);
    return failed ? -2 : 0;
}
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

static int linear(const void* x, int64_t ldx, const uint8_t* w, int fmt, const float* scales, const float* bias,
                  void* y, int64_t ldy, int M, int N, int K, int bf16_io, int num_threads) {
    if (block_bytes(fmt) == 0 || K % QK != 0 || (fmt == FMT_INT8 && scales == NULL)) return -1;
    if (M <= 0 || N <= 0) return 0;
#if HAVE_AMX_BF16
    if (!amx_allowed()) return -3;
    return amx_bf16_linear(x, ldx, w, fmt, scales, bias, y, ldy, M, N, K, bf16_io, num_threads);
#else
    (void)x, (void)ldx, (void)w, (void)scales, (void)bias, (void)y, (void)ldy, (void)bf16_io, (void)num_threads;
    return -3;
#endif
}

/*
 * y[M, N] (row stride ldy) = bf16(x)[M, K] (row stride ldx, K a multiple of 32) @ bf16(dequant(w))^T + bias (NULL:
 * none), x and y fp32; w and scales as in quant_gemm.c's hfq_linear. Returns 0; -1 for an unknown format or K not a
 * multiple of 32; -2 when scratch cannot be allocated; -3 where this build or CPU has no AMX-BF16 (hfqb_available).
 */
int hfqb_linear(const float* x, int64_t ldx, const uint8_t* w, int fmt, const float* scales, const float* bias,
                float* y, int64_t ldy, int M, int N, int K, int num_threads) {
    return linear(x, ldx, w, fmt, scales, bias, y, ldy, M, N, K, 0, num_threads);
}

/* the same with bf16 x and y (a bf16 model's activations, no conversion): y = bf16(the fp32 sum + bias) */
int hfqb_linear_bf16(const uint16_t* x, int64_t ldx, const uint8_t* w, int fmt, const float* scales,
                     const float* bias, uint16_t* y, int64_t ldy, int M, int N, int K, int num_threads) {
    return linear(x, ldx, w, fmt, scales, bias, y, ldy, M, N, K, 1, num_threads);
}
