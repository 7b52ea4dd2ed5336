/*
 * Weight-only quantized linear layers for CPU with float activations (the exact reference mode):
 * y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), fp32 x and y, W in one of the block formats of quant_common.h.
 *
 * Up to SMALL_M rows (decode): per block and row of x the kernel sums q * x over the block's 32 weights in fp32
 * vectors, then scales the block sum by d (and adds m * sum(x) over the block for Q4_1): the dequantized weights
 * times x, up to the order of the fp32 sums and products. One row reads 4 weight rows per pass and prefetches 4
 * groups ahead. Above SMALL_M rows: tiles of weight rows dequantized exactly into an L2-resident buffer that
 * every row of x meets (tiled() below). Within each path every output is computed the same way whatever M is
 * and whatever other rows share the batch, so a row's result does not depend on the batch.
 *
 * Threads split the output rows (OpenMP). Built for the host like gemm_cpu.c (AVX2+FMA, AVX-512 where present:
 * the vector width follows the compiler's target) and loaded through ctypes by hf_paged/model/layers/quant_linear.py.
 */
#include "quant_common.h"
#include <math.h>
#include <omp.h>
#include <stdlib.h>

enum { MR = 4 };

int hfq_vector_width(void) { return VW; }

int hfq_block_bytes(int fmt) { return block_bytes(fmt); }

/* the block's 32 integer weights as floats (q - 8 for Q4_0) in NV vectors, its scale d and its min m (0 but for
 * Q4_1); the widening is one instruction per 8 or 16 weights where the ISA has it */
static inline __attribute__((always_inline)) void unpack(const int fmt, const uint8_t* b, vf* q, float* d, float* m) {
    const uint8_t* p = b + (fmt == FMT_Q4_1 ? 4 : fmt == FMT_INT8 ? 0 : 2);
    *d = fmt == FMT_INT8 ? 1.0f : h2f(b);
    *m = fmt == FMT_Q4_1 ? h2f(b + 2) : 0.0f;
#if defined(__AVX512F__) || defined(__AVX2__)
    if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
        const __m128i raw = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(15);
        __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        if (fmt == FMT_Q4_0) lo = _mm_sub_epi8(lo, _mm_set1_epi8(8)), hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
#if defined(__AVX512F__)
        q[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
        q[1] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
#else
        q[0] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        q[1] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        q[3] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
#endif
    } else {
        for (int v = 0; v < NV; ++v) {
#if defined(__AVX512F__)
            q[v] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + v * 16))));
#else
            q[v] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + v * 8))));
#endif
        }
    }
#else
    float t[QK] __attribute__((aligned(64)));
    for (int j = 0; j < QK / 2; ++j) {
        if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
            const int off = fmt == FMT_Q4_0 ? 8 : 0;
            t[j] = (float)((int)(p[j] & 15) - off);
            t[j + QK / 2] = (float)((int)(p[j] >> 4) - off);
        } else {
            t[j] = (float)(int8_t)p[j];
            t[j + QK / 2] = (float)(int8_t)p[j + QK / 2];
        }
    }
    for (int v = 0; v < NV; ++v) q[v] = LD(t + v * VW);
#endif
}

/* y[m0:m0+mr, n] for one weight row w (nb blocks); xs[i * nb + b]: sum of x row i over block b (Q4_1 only) */
static inline __attribute__((always_inline)) void row_tile(
    const int fmt, const int mr, const int nb, const uint8_t* w, const float* x, const int64_t ldx,
    const float* xs, float* out)
{
    const int bb = block_bytes(fmt);
    vf acc[MR];
    float macc[MR];
    for (int i = 0; i < mr; ++i) acc[i] = (vf){0}, macc[i] = 0.0f;
    for (int b = 0; b < nb; ++b) {
        vf q[NV];
        float d, m;
        unpack(fmt, w + (size_t)b * bb, q, &d, &m);
        for (int i = 0; i < mr; ++i) {
            const float* xb = x + i * ldx + b * QK;
            vf s = q[0] * LD(xb);
            for (int v = 1; v < NV; ++v) s += q[v] * LD(xb + v * VW);
            if (fmt == FMT_INT8) acc[i] += s;
            else acc[i] += d * s;
            if (fmt == FMT_Q4_1) macc[i] = fmaf(m, xs[i * nb + b], macc[i]);
        }
    }
    for (int i = 0; i < mr; ++i) out[i] = hsum(acc[i]) + macc[i];
}

/* One row of x against NR_1 weight rows at once (M = 1, decode): the same operations per output as row_tile
 * with mr = 1, in the same order (so the same bits), interleaved so that NR_1 independent chains hide the
 * multiply-add latency and the x block is loaded once for all of them. */
enum { NR_1 = 4 };
static inline __attribute__((always_inline)) void rows_m1(
    const int fmt, const int nb, const uint8_t* w, const size_t row_bytes, const float* x, const float* xs, float* out)
{
    const int bb = block_bytes(fmt);
    vf acc[NR_1];
    float macc[NR_1];
    for (int r = 0; r < NR_1; ++r) acc[r] = (vf){0}, macc[r] = 0.0f;
    for (int b = 0; b < nb; ++b) {
        const float* xb = x + b * QK;
        vf xv[NV];
        for (int v = 0; v < NV; ++v) xv[v] = LD(xb + v * VW);
        for (int r = 0; r < NR_1; ++r) {
            vf q[NV];
            float d, m;
            /* 4 groups of rows ahead: the rows are short (360 bytes at K = 576) and the hardware lags */
            __builtin_prefetch(w + (r + 4 * NR_1) * row_bytes + (size_t)b * bb, 0, 3);
            unpack(fmt, w + r * row_bytes + (size_t)b * bb, q, &d, &m);
            vf s = q[0] * xv[0];
            for (int v = 1; v < NV; ++v) s += q[v] * xv[v];
            if (fmt == FMT_INT8) acc[r] += s;
            else acc[r] += d * s;
            if (fmt == FMT_Q4_1) macc[r] = fmaf(m, xs[b], macc[r]); /* one rounding in both paths */
        }
    }
    for (int r = 0; r < NR_1; ++r) out[r] = hsum(acc[r]) + macc[r];
}

static void rows_m1_any(int fmt, int nb, const uint8_t* w, size_t row_bytes, const float* x, const float* xs,
                        float* out) {
    switch (fmt) {
    case FMT_Q8_0: rows_m1(FMT_Q8_0, nb, w, row_bytes, x, xs, out); break;
    case FMT_Q4_0: rows_m1(FMT_Q4_0, nb, w, row_bytes, x, xs, out); break;
    case FMT_Q4_1: rows_m1(FMT_Q4_1, nb, w, row_bytes, x, xs, out); break;
    default: rows_m1(FMT_INT8, nb, w, row_bytes, x, xs, out); break;
    }
}

static void row_tile_any(int fmt, int mr, int nb, const uint8_t* w, const float* x, int64_t ldx, const float* xs,
                         float* out) {
#define CASE_FMT(F)                                                        \
    case F:                                                                \
        switch (mr) {                                                      \
        case 4: row_tile(F, 4, nb, w, x, ldx, xs, out); break;             \
        case 3: row_tile(F, 3, nb, w, x, ldx, xs, out); break;             \
        case 2: row_tile(F, 2, nb, w, x, ldx, xs, out); break;             \
        default: row_tile(F, 1, nb, w, x, ldx, xs, out); break;            \
        }                                                                  \
        break;
    switch (fmt) {
        CASE_FMT(FMT_Q8_0)
        CASE_FMT(FMT_Q4_0)
        CASE_FMT(FMT_Q4_1)
        CASE_FMT(FMT_INT8)
    }
#undef CASE_FMT
}

/* one weight row dequantized to out[K], the reference math per weight (q * d, (q - 8) * d, q * d + m, q * s[n])
 * with two roundings as gguf's numpy reference (no fused multiply-add: bitwise equal to it) */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#else
__attribute__((optimize("fp-contract=off")))
#endif
static void dequant_row(const int fmt, const uint8_t* w, const float scale, const int nb, float* out) {
    const int bb = block_bytes(fmt);
    for (int b = 0; b < nb; ++b) {
        vf q[NV];
        float d, m;
        unpack(fmt, w + (size_t)b * bb, q, &d, &m);
        if (fmt == FMT_INT8) d = scale;
        for (int v = 0; v < NV; ++v) *(vf*)(out + b * QK + v * VW) = q[v] * d + m;
    }
}

/* out[N, K] fp32 = dequant(w) (see dequant_row) */
int hfq_dequantize(const uint8_t* w, int fmt, const float* scales, float* out, int N, int K, int num_threads) {
    const int bb = block_bytes(fmt);
    if (bb == 0 || K % QK != 0 || (fmt == FMT_INT8 && scales == NULL)) return -1;
    const int nb = K / QK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int n = 0; n < N; ++n)
        dequant_row(fmt, w + (size_t)n * nb * bb, fmt == FMT_INT8 ? scales[n] : 0.0f, nb, out + (size_t)n * K);
    return 0;
}

/*
 * Batches above SMALL_M rows (prefill, large decode batches): tiles of TN weight rows are dequantized into a
 * per-thread fp32 buffer (dequant_row: the exact dequantized weights; TN x K floats stay in L2) and every row of
 * x meets them there, TM x rows by TR weight rows at a time with the TM x TR sums in registers (dot products
 * along k, reduced at the end). The weights come from memory once per call, as quantized bytes.
 */
#ifndef TM_ROWS
#define TM_ROWS 4
#endif
enum { SMALL_M = 16, TN = 16, TM = VW == 16 ? TM_ROWS : 4, TR = VW == 16 ? 4 : 2 };

static inline float reduce(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    return hsum(v);
#endif
}

#if defined(__AVX512F__)
/* out[j] = sum of the 16 lanes of a[j], j < 16: halves, then quarters of pairs of vectors added, then the 4 x 4
 * left in each 128-bit lane transposed and added */
static inline __attribute__((always_inline)) void reduce16(const __m512* a, float* out) {
    __m512 b[8], c[4];
    for (int p = 0; p < 8; ++p) /* lanes 0-7: a[2p]'s halves added; 8-15: a[2p + 1]'s */
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; ++p) /* 128-bit lane L: 4 partial sums of a[4p + L] */
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xDD));
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
    const __m512d l01 = _mm512_castps_pd(s01), l23 = _mm512_castps_pd(s23);
    const __m512 f = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(l01, l23)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(l01, l23)));
    float t[16] __attribute__((aligned(64)));
    _mm512_store_ps(t, f); /* lane 4L + p holds a[4p + L] */
    for (int j = 0; j < 16; ++j) out[j] = t[4 * (j & 3) + (j >> 2)];
}
#endif

static inline __attribute__((always_inline)) void dot_tile(
    const int mr, const int nr, const int K, const float* x, const int64_t ldx, const float* w, float out[TM][TR])
{
    vf acc[TM][TR];
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) acc[i][r] = (vf){0};
    for (int k = 0; k < K; k += VW) {
        vf wv[TR];
        for (int r = 0; r < nr; ++r) wv[r] = LD(w + (size_t)r * K + k);
        for (int i = 0; i < mr; ++i) {
            const vf xv = LD(x + i * ldx + k);
            for (int r = 0; r < nr; ++r) acc[i][r] += xv * wv[r];
        }
    }
#if defined(__AVX512F__)
    if (nr == TR) { /* 4 x rows' 16 sums at once: 45 shuffles and adds rather than 16 reductions */
        int i = 0;
        for (; i + 4 <= mr; i += 4) reduce16((__m512*)acc[i], &out[i][0]);
        for (; i < mr; ++i)
            for (int r = 0; r < nr; ++r) out[i][r] = reduce(acc[i][r]);
        return;
    }
#endif
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) out[i][r] = reduce(acc[i][r]);
}

static void dot_tile_any(int mr, int nr, int K, const float* x, int64_t ldx, const float* w, float out[TM][TR]) {
#define DOT_NR(MR_) if (nr == TR) dot_tile(MR_, TR, K, x, ldx, w, out); else dot_tile(MR_, 1, K, x, ldx, w, out);
    if (mr == TM) { DOT_NR(TM) }
    else if (TM > 5 && mr == 5) { DOT_NR(5) }
    else if (TM > 4 && mr == 4) { DOT_NR(4) }
    else if (mr == 3) { DOT_NR(3) }
    else if (mr == 2) { DOT_NR(2) }
    else { DOT_NR(1) }
#undef DOT_NR
}

static int tiled(const float* x, int64_t ldx, const uint8_t* w, int fmt, const float* scales, const float* bias,
                 float* y, int64_t ldy, int M, int N, int K, int num_threads)
{
    const int nb = K / QK, tiles = (N + TN - 1) / TN;
    const size_t row_bytes = (size_t)nb * block_bytes(fmt);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float* buf = aligned_alloc(64, sizeof(float) * TN * (size_t)K);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; ++t) {
            if (buf == NULL) continue;
            const int n0 = t * TN, nt = N - n0 < TN ? N - n0 : TN;
            for (int r = 0; r < nt; ++r)
                dequant_row(fmt, w + (size_t)(n0 + r) * row_bytes, fmt == FMT_INT8 ? scales[n0 + r] : 0.0f, nb,
                            buf + (size_t)r * K);
            for (int r0 = 0; r0 < nt; r0 += TR) {
                const int nr = nt - r0 < TR ? 1 : TR;
                for (int r1 = r0; r1 < (nr == 1 ? nt : r0 + TR); r1 += nr) /* a partial group: one row at a time */
                    for (int m0 = 0; m0 < M; m0 += TM) {
                        const int mr = M - m0 < TM ? M - m0 : TM;
                        float out[TM][TR];
                        dot_tile_any(mr, nr, K, x + m0 * ldx, ldx, buf + (size_t)r1 * K, out);
                        for (int i = 0; i < mr; ++i)
                            for (int r = 0; r < nr; ++r)
                                y[(m0 + i) * ldy + n0 + r1 + r] = out[i][r] + (bias ? bias[n0 + r1 + r] : 0.0f);
                    }
            }
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

/*
 * y[M, N] (row stride ldy) = x[M, K] (row stride ldx, K a multiple of 32) @ dequant(w)^T + bias (NULL: none).
 * w: N rows of K / 32 blocks of format fmt; scales: N fp32 row scales (INT8 only, else NULL).
 * Returns 0, -1 for an unknown format or K not a multiple of 32, -2 when scratch cannot be allocated.
 */
int hfq_linear(const float* x, int64_t ldx, const uint8_t* w, int fmt, const float* scales, const float* bias,
               float* y, int64_t ldy, int M, int N, int K, int num_threads)
{
    const int bb = block_bytes(fmt);
    if (bb == 0 || K % QK != 0 || (fmt == FMT_INT8 && scales == NULL)) return -1;
    if (M > SMALL_M) return tiled(x, ldx, w, fmt, scales, bias, y, ldy, M, N, K, num_threads);
    const int nb = K / QK;
    float* xs = NULL;
    if (fmt == FMT_Q4_1) { /* per row and block sums of x, shared by every output row */
        xs = malloc(sizeof(float) * (size_t)M * (nb > 0 ? nb : 1));
        if (xs == NULL) return -2;
        for (int i = 0; i < M; ++i)
            for (int b = 0; b < nb; ++b) {
                const float* xb = x + i * ldx + b * QK;
                vf s = LD(xb);
                for (int v = 1; v < NV; ++v) s += LD(xb + v * VW);
                xs[(size_t)i * nb + b] = hsum(s);
            }
    }
    const size_t row_bytes = (size_t)nb * bb;
    const int n4 = M == 1 ? N / NR_1 * NR_1 : 0; /* decode: NR_1 weight rows per pass */
    if (n4) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int n = 0; n < n4; n += NR_1) {
            float out[NR_1];
            rows_m1_any(fmt, nb, w + (size_t)n * row_bytes, row_bytes, x, xs, out);
            for (int r = 0; r < NR_1; ++r)
                y[n + r] = fmt == FMT_INT8 ? fmaf(out[r], scales[n + r], bias ? bias[n + r] : 0.0f)
                                           : out[r] + (bias ? bias[n + r] : 0.0f);
        }
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int n = n4; n < N; ++n) {
        const uint8_t* wr = w + (size_t)n * row_bytes;
        const float s = fmt == FMT_INT8 ? scales[n] : 1.0f, bn = bias ? bias[n] : 0.0f;
        for (int m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? M - m0 : MR;
            float out[MR];
            row_tile_any(fmt, mr, nb, wr, x + m0 * ldx, ldx, xs ? xs + (size_t)m0 * nb : NULL, out);
            for (int i = 0; i < mr; ++i) /* fmaf: one rounding, as the M = 1 path */
                y[(m0 + i) * ldy + n] = fmt == FMT_INT8 ? fmaf(out[i], s, bn) : out[i] + bn;
        }
    }
    free(xs);
    return 0;
}

