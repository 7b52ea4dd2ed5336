/*
 * Paged attention for CPU: each (sequence, KV head) pair reads its keys and values straight from the
 * block pool, once, with an online softmax in fp32. Meant for short query lengths (decode, speculative
 * verification); long prefill chunks go through SDPA, where the matmuls dominate.
 *
 * Built on first use by hf_paged/kernels/cpu/attention.py with the host compiler (-O3 -march=native
 * -fopenmp) and called through ctypes. What -march=native enables picks the code: 16-float vectors and a
 * masked vector exp with AVX-512, 8-float vectors and an AVX2 exp without it, scalar exp elsewhere; bf16
 * scores straight from the bf16 rows (VDPBF16PS) with AVX-512 BF16. Per (row, block), keys visible to every
 * query of the item skip the mask; measured on a Zen 4 host (64 sequences x ~90 keys, 9 query / 3 KV heads,
 * one layer with its blocks in cache): fp32 0.29 -> 0.22 ms, bf16 0.36 -> 0.23 ms. With AVX-512, bf16 scores
 * sixteen keys at a time (one accumulator per key, summed by a transpose-and-add tree) and accumulates the
 * values of all the query rows of a KV head at once, each value row widened once for them; measured on a
 * Zen 5 host (64 sequences x ~190 keys, 30 layers' pools in DRAM): 0.46-0.48 -> 0.35-0.36 ms a layer. That grouped
 * path takes the keys a chunk of blocks at a time (up to 256): all the rows' scores for the chunk, one softmax
 * update per row, then the chunk's values, the chunk's values fetched while its keys are scored; an int8 pool
 * takes it too (keys converted to bf16, exactly, for bf16 queries, else to fp32; values widened in registers).
 * Measured on a Xeon with AMX, one process calling the two builds in turns (64 sequences x 220 keys, 9 query / 3
 * KV heads of 64, 30 layers' pools in DRAM): int8 pool 0.61-0.68x the time of the block-by-block row path
 * (bf16 and fp32 queries), a 3000-key batch-1 decode 0.75x; bf16 pool 0.97x, and 0.73x with the pool in cache
 * (block by block, each row's softmax bookkeeping cost more than its sixteen keys' arithmetic). Linked against
 * libgomp.so.1, so in a torch process it shares torch's OpenMP runtime (same soname) instead of starting a
 * second thread pool.
 *
 * Layouts (element strides where noted):
 *   query      [num_tokens, num_heads, head_dim]        strides q_stride_t, q_stride_h, 1
 *   k/v_cache  [num_blocks, block_size, num_kv_heads, head_dim]  contiguous, in kv_dtype; an int8 pool
 *              (DT_I8) has rows of head_dim + 4 bytes: the int8 values, then their fp32 scale, dequantized
 *              row by row into fp32 as the blocks are read (hf_paged/kernels/kv_quant.py has the format)
 *   out        [num_tokens, num_heads, head_dim]        strides o_stride_t, o_stride_h, 1
 *   block_tables [num_seqs, bt_stride] int32; seq_lens [num_seqs] int32; cu_seqlens_q [num_seqs + 1] int32
 *   seq_ids    [n_seq_ids] int32: the sequences this call processes
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_I8 = 3 };

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN stays NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(v.u >> 16);
}

/* Convert n elements starting at element index idx of a tensor of dtype dt into dst (fp32). */
static inline const float* load_row(const void* base, int64_t idx, int n, int dt, float* dst) {
    if (dt == DT_F32) return (const float*)base + idx;
    if (dt == DT_I8) {
        /* an int8 pool row: the values, then their fp32 scale */
        const int8_t* p = (const int8_t*)base + idx;
        float scale;
        memcpy(&scale, p + n, sizeof scale);
#pragma omp simd
        for (int d = 0; d < n; ++d) dst[d] = (float)p[d] * scale;
    } else if (dt == DT_BF16) {
        /* bf16 is the top half of an fp32: widen the bits (vectorizes to shifts) */
        const uint16_t* p = (const uint16_t*)base + idx;
        uint32_t* u = (uint32_t*)dst;
#pragma omp simd
        for (int d = 0; d < n; ++d) u[d] = (uint32_t)p[d] << 16;
    } else {
        const _Float16* p = (const _Float16*)base + idx;
        for (int d = 0; d < n; ++d) dst[d] = (float)p[d];
    }
    return dst;
}

static inline void store_row(void* base, int64_t idx, int n, int dt, const float* src, float mul) {
    if (dt == DT_F32) {
        float* p = (float*)base + idx;
        for (int d = 0; d < n; ++d) p[d] = src[d] * mul;
    } else if (dt == DT_BF16) {
        uint16_t* p = (uint16_t*)base + idx;
        for (int d = 0; d < n; ++d) p[d] = f32_to_bf16(src[d] * mul);
    } else {
        _Float16* p = (_Float16*)base + idx;
        for (int d = 0; d < n; ++d) p[d] = (_Float16)(src[d] * mul);
    }
}

/* exp(x) for x <= 0 (scores minus their running max), with exp(-inf) = 0. Cephes' polynomial, ~1 ulp:
 * unlike libm's expf it inlines and vectorizes, and the softmax weights are most of the kernel's math. */
static inline float exp_nonpos(float x) {
    const float xc = x < -87.0f ? -87.0f : x;
    const float n = floorf(xc * 1.44269504088896341f + 0.5f);
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return x == -INFINITY ? 0.0f : p * scale.f;
}

/* One vector of VW floats: 16 (a zmm register) where the compiler targets AVX-512, else 8 (AVX, or two SSE
 * registers without it). Loads and stores need no alignment. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
#define LD(p) (*(const vf*)(p))
#define ST(p, x) (*(vf*)(p) = (x))
#define ACC_COLS 64 /* columns of the value accumulator held in registers at once */
#define NACC (ACC_COLS / VW)

/* exp_nonpos's range reduction and polynomial on a vector: xc clamped, nn = floor(xc * log2(e) + 1/2) */
static inline vf exp_poly(vf xc, vf nn) {
    const vf r = (xc - nn * 0.693359375f) + nn * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * r * r + r + 1.0f;
}

/* s[t] = exp(s[t] - m) for t < n (s[t] - m <= 0; exp(-inf) = 0), returning their sum: exp_nonpos on a vector
 * of 16 (AVX-512) or 8 (AVX2) scores at once (exp_poly), the same clamping, scalar elsewhere. */
#if defined(__AVX512F__)
static inline float exp_block(float* s, int n, float m) {
    __m512 total = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
        const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), _mm512_set1_ps(m));
        const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
        const __m512 nn = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                               _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const __m512 p = (__m512)exp_poly((vf)xc, (vf)nn);
        const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(nn), _mm512_set1_epi32(127)), 23);
        const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) & k;
        const __m512 w = _mm512_maskz_mul_ps(finite, p, _mm512_castsi512_ps(e));
        _mm512_mask_storeu_ps(s + t, k, w);
        total = _mm512_add_ps(total, w);
    }
    return _mm512_reduce_add_ps(total);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float exp_block(float* s, int n, float m) {
    __m256 total = _mm256_setzero_ps();
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(m));
        const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
        const __m256 nn = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
        const __m256 p = (__m256)exp_poly((vf)xc, (vf)nn);
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nn), _mm256_set1_epi32(127)), 23);
        const __m256 finite = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m256 w = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), finite);
        _mm256_storeu_ps(s + t, w);
        total = _mm256_add_ps(total, w);
    }
    float buf[8], sum;
    _mm256_storeu_ps(buf, total);
    sum = ((buf[0] + buf[4]) + (buf[1] + buf[5])) + ((buf[2] + buf[6]) + (buf[3] + buf[7]));
    for (; t < n; ++t) {
        s[t] = exp_nonpos(s[t] - m);
        sum += s[t];
    }
    return sum;
}
#else
static inline float exp_block(float* s, int n, float m) {
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) {
        s[t] = exp_nonpos(s[t] - m);
        sum += s[t];
    }
    return sum;
}
#endif

static inline float hsum(vf a) {
#if VW == 16
    return _mm512_reduce_add_ps((__m512)a);
#else
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
#endif
}

static inline float dot(const float* a, const float* b, int n) {
    vf acc = {0};
    int d = 0;
    for (; d + VW <= n; d += VW) acc += LD(a + d) * LD(b + d);
    float s = hsum(acc);
    for (; d < n; ++d) s += a[d] * b[d];
    return s;
}

/* out[j] = q . k[j] for four keys at once: four independent accumulators keep the FMA units busy where one
 * dot product would wait on its own chain, and each vector of q is loaded once for the four. */
static inline void dot4(const float* q, const float* const* k, int n, float* out) {
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int d = 0;
    for (; d + VW <= n; d += VW) {
        const vf qv = LD(q + d);
        a0 += qv * LD(k[0] + d);
        a1 += qv * LD(k[1] + d);
        a2 += qv * LD(k[2] + d);
        a3 += qv * LD(k[3] + d);
    }
    float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
    for (; d < n; ++d) {
        s0 += q[d] * k[0][d];
        s1 += q[d] * k[1][d];
        s2 += q[d] * k[2][d];
        s3 += q[d] * k[3][d];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

#if defined(__AVX512BF16__)
/* bf16 scores straight from the bf16 query and cache rows (no conversion pass): VDPBF16PS multiplies 32 bf16
 * pairs exactly and adds them into 16 fp32 lanes. n must be a multiple of 32. */
#define HAVE_DPBF16 1
static inline __m512 dot_bf16_acc(__m512 acc, const uint16_t* q, const uint16_t* k, int n) {
    for (int d = 0; d < n; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
    return acc;
}

static inline void dot4_bf16(const uint16_t* q, const uint16_t* const* k, int n, float* out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int d = 0; d < n; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
        a0 = _mm512_dpbf16_ps(a0, qv, (__m512bh)_mm512_loadu_si512(k[0] + d));
        a1 = _mm512_dpbf16_ps(a1, qv, (__m512bh)_mm512_loadu_si512(k[1] + d));
        a2 = _mm512_dpbf16_ps(a2, qv, (__m512bh)_mm512_loadu_si512(k[2] + d));
        a3 = _mm512_dpbf16_ps(a3, qv, (__m512bh)_mm512_loadu_si512(k[3] + d));
    }
    out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
}
#else
#define HAVE_DPBF16 0
#endif

#if VW == 16
/* Lane j of the result = the sum of a[j]'s sixteen lanes: a transpose-and-add tree (45 shuffles and adds) in
 * place of sixteen horizontal reductions. */
static inline __m512 reduce16(const __m512* a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of x = a[2i], y = a[2i+1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) /* per 128-bit lane: that lane's sums of a[4i .. 4i+3] */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

/* s[0:16] = q . k[j] for sixteen keys, one accumulator each (n a multiple of 16; bf16: of 32, VDPBF16PS) */
static inline void dot16(const float* q, const float* const* k, int n, float* s) {
    __m512 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[j] + d), a[j]);
    }
    _mm512_storeu_ps(s, reduce16(a));
}

#if HAVE_DPBF16
static inline void dot16_bf16(const uint16_t* q, const uint16_t* const* k, int n, float* s) {
    __m512 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_loadu_si512(k[j] + d));
    }
    _mm512_storeu_ps(s, reduce16(a));
}
#endif

/* how accumulate_rows reads a value row: fp32 as is, bf16 widened (the top half of an fp32), int8 (a pool row
 * of kv_quant.py: the values, then their fp32 scale) widened and times the scale, as load_row dequantizes it */
enum { V_F32 = 0, V_BF16 = 1, V_I8 = 2 };

/* sixteen values of a value row from column d, as fp32; sc is the row's scale (V_I8) */
static inline __m512 load16(const void* row, int d, const int kind, const __m512 sc) {
    if (kind == V_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + d))), 16));
    if (kind == V_I8) return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)row + d)))), sc);
    return _mm512_loadu_ps((const float*)row + d);
}

/* the scale of value row t (int8 rows; 1 otherwise), n values long */
static inline __m512 row_scale(const void* row, int n, const int kind) {
    float scale = 1.0f;
    if (kind == V_I8) memcpy(&scale, (const int8_t*)row + n, sizeof scale);
    return _mm512_set1_ps(scale);
}

/* acc[i][0:n] += sum_t w[i][t] * v[t][0:n] for nr <= 4 rows at once: each value row is loaded (and widened)
 * once for all of them, 64 columns of every row in registers. n a multiple of 16; nr and kind (V_*) are
 * constants at each call, so the loops unroll. */
static inline __attribute__((always_inline)) void accumulate_rows(float* const* acc, const float* const* w, const void* const* v,
                                                                  int nt, int n, const int nr, const int kind) {
    int d = 0;
    for (; d + 64 <= n; d += 64) {
        __m512 c[4][4];
        for (int i = 0; i < nr; ++i)
            for (int j = 0; j < 4; ++j) c[i][j] = _mm512_loadu_ps(acc[i] + d + 16 * j);
        for (int t = 0; t < nt; ++t) {
            __m512 x[4];
            const __m512 sc = row_scale(v[t], n, kind);
            for (int j = 0; j < 4; ++j) x[j] = load16(v[t], d + 16 * j, kind, sc);
            for (int i = 0; i < nr; ++i) {
                const __m512 wt = _mm512_set1_ps(w[i][t]);
                for (int j = 0; j < 4; ++j) c[i][j] = _mm512_fmadd_ps(wt, x[j], c[i][j]);
            }
        }
        for (int i = 0; i < nr; ++i)
            for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc[i] + d + 16 * j, c[i][j]);
    }
    for (; d < n; d += 16) {
        __m512 c[4];
        for (int i = 0; i < nr; ++i) c[i] = _mm512_loadu_ps(acc[i] + d);
        for (int t = 0; t < nt; ++t) {
            const __m512 x = load16(v[t], d, kind, row_scale(v[t], n, kind));
            for (int i = 0; i < nr; ++i) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i][t]), x, c[i]);
        }
        for (int i = 0; i < nr; ++i) _mm512_storeu_ps(acc[i] + d, c[i]);
    }
}

/* load_row of an int8 pool row (n a multiple of 16) with 16-float vectors: the same values, (float)q * scale */
static inline const float* dequant_i8(const void* base, int64_t idx, int n, float* dst) {
    const int8_t* p = (const int8_t*)base + idx;
    const __m512 sc = row_scale(p, n, V_I8);
    for (int d = 0; d < n; d += 16) _mm512_storeu_ps(dst + d, load16(p, d, V_I8, sc));
    return dst;
}

#if HAVE_DPBF16
/* an int8 pool row's values as bf16 (exact: integers of at most 8 bits) into dst, its scale into *scale;
 * n a multiple of 32 */
static inline const uint16_t* i8_to_bf16(const void* base, int64_t idx, int n, uint16_t* dst, float* scale) {
    const int8_t* p = (const int8_t*)base + idx;
    memcpy(scale, p + n, sizeof *scale);
    for (int d = 0; d < n; d += 32) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + d))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + d + 16))));
        _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    return dst;
}
#endif

/* accumulate_rows over any number of rows, four at a time */
static void accumulate_grouped(float* const* acc, const float* const* w, const void* const* v, int nt, int n, int rows, int kind) {
    for (int i = 0; i < rows; i += 4) {
        const int nr = rows - i < 4 ? rows - i : 4;
#define ACC_CASE(NR) case NR: \
        if (kind == V_BF16) accumulate_rows(acc + i, w + i, v, nt, n, NR, V_BF16); \
        else if (kind == V_I8) accumulate_rows(acc + i, w + i, v, nt, n, NR, V_I8); \
        else accumulate_rows(acc + i, w + i, v, nt, n, NR, V_F32); \
        break;
        switch (nr) { ACC_CASE(1) ACC_CASE(2) ACC_CASE(3) ACC_CASE(4) }
#undef ACC_CASE
    }
}
#endif

/* acc[0:n] += sum_t w[t] * v[t][0:n], ACC_COLS columns at a time held in registers across all nt rows of v. */
static inline void accumulate(float* acc, const float* w, const float* const* v, int nt, int n) {
    int d = 0;
    for (; d + ACC_COLS <= n; d += ACC_COLS) {
        vf c[NACC];
#pragma GCC unroll 8
        for (int j = 0; j < NACC; ++j) c[j] = LD(acc + d + j * VW);
        for (int t = 0; t < nt; ++t) {
            if (w[t] == 0.0f) continue;
            const float* p = v[t] + d;
            const vf wt = w[t] - (vf){0}; /* broadcast */
#pragma GCC unroll 8
            for (int j = 0; j < NACC; ++j) c[j] += wt * LD(p + j * VW);
        }
#pragma GCC unroll 8
        for (int j = 0; j < NACC; ++j) ST(acc + d + j * VW, c[j]);
    }
    for (; d + VW <= n; d += VW) {
        vf c = LD(acc + d);
        for (int t = 0; t < nt; ++t) c += w[t] * LD(v[t] + d);
        ST(acc + d, c);
    }
    for (; d < n; ++d)
        for (int t = 0; t < nt; ++t) acc[d] += w[t] * v[t][d];
}

int hfp_paged_attention(
    const void* query, int64_t q_stride_t, int64_t q_stride_h,
    const void* k_cache, const void* v_cache,
    const int32_t* block_tables, int64_t bt_stride,
    const int32_t* seq_lens, const int32_t* cu_seqlens_q,
    const int32_t* seq_ids, int n_seq_ids,
    void* out, int64_t o_stride_t, int64_t o_stride_h,
    int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int window, float softcap, int dtype, int kv_dtype, int max_q, int num_threads)
{
    const int rep = num_heads / num_kv_heads;
    /* A work item is one sequence with all its heads, so a block is read front to back (the hardware
     * prefetcher follows); with fewer sequences than threads x 2, split each sequence into the fewest runs of
     * KV heads that make that many items (every KV head where none does): an item's part of a slot stays one
     * contiguous run of bytes. (Split into single heads, a batch-1 decode of SmolLM2-1.7B's 32 KV heads read
     * 256 bytes of every 8 KiB slot per item, and its attention took ~35% of the step on a Xeon.) */
    int splits = 1;
    if (n_seq_ids < 2 * num_threads) {
        splits = num_kv_heads;
        for (int c = 1; c < num_kv_heads; ++c)
            if (num_kv_heads % c == 0 && (int64_t)n_seq_ids * c >= 2 * (int64_t)num_threads) {
                splits = c;
                break;
            }
    }
    const int heads_per_item = num_kv_heads / splits;
    const int max_rows = heads_per_item * rep * max_q;
    const int64_t n_items = (int64_t)n_seq_ids * splits;
    const int kv_row = kv_dtype == DT_I8 ? head_dim + 4 : head_dim; /* elements of one (slot, KV head) row */
    const int64_t tok_stride = (int64_t)num_kv_heads * kv_row; /* elements between consecutive slots */
    const size_t elem = kv_dtype == DT_F32 ? 4 : kv_dtype == DT_I8 ? 1 : 2;
    const size_t block_bytes = (size_t)block_size * tok_stride * elem;
    int failed = 0;
    /* Few items for the threads (one or two long sequences: a batch-1 decode, a prompt chunk at long
     * context): each item's keys are split into `parts` ranges of at least PART_BLOCKS blocks, computed as
     * separate work with their own softmax state and merged after (flash-decoding). Otherwise 3 items on 2
     * threads leave one thread idle a third of the time. */
    enum { PART_BLOCKS = 8 };
    int parts = 1;
    if (n_items < 2 * (int64_t)num_threads) {
        int max_blocks = 0;
        for (int i = 0; i < n_seq_ids; ++i) {
            const int nb = (seq_lens[seq_ids[i]] + block_size - 1) / block_size;
            max_blocks = nb > max_blocks ? nb : max_blocks;
        }
        parts = (int)((2 * (int64_t)num_threads + n_items - 1) / n_items);
        if (parts > max_blocks / PART_BLOCKS) parts = max_blocks / PART_BLOCKS;
        if (parts < 1) parts = 1;
    }
    const int64_t n_work = n_items * parts;
    /* per (item, part): the rows' accumulators, then their running max and sum */
    const size_t part_floats = (size_t)max_rows * (head_dim + 2);
    float* partial = parts > 1 ? (float*)malloc((size_t)n_work * part_floats * sizeof(float)) : NULL;
    if (parts > 1 && partial == NULL) return -1;

    /* bf16 queries score bf16 keys in place, and int8 keys converted to bf16 (exact: |q| <= 127) with their
     * scale applied to the dot product */
    const int bf16_dot = HAVE_DPBF16 && dtype == DT_BF16 && (kv_dtype == DT_BF16 || kv_dtype == DT_I8) && head_dim % 32 == 0;
    /* AVX-512 with bf16 queries and pool, or an int8 pool: scores sixteen keys at a time (dot16), values
     * accumulated for all the rows of a KV head at once from the cache rows in place (accumulate_grouped), and
     * the keys taken a chunk of blocks at a time: every row's scores for the chunk first, one softmax update per
     * row for the whole chunk, then the chunk's values (block by block, the softmax bookkeeping of each row cost
     * more than its sixteen keys' arithmetic). fp32 keeps the row-by-row path: the grouped one computes faster
     * with the pool in cache but measured slower with it in DRAM (Zen 5). */
    const int grouped = VW == 16 && head_dim % 16 == 0
        && ((dtype == DT_BF16 && kv_dtype == DT_BF16) || kv_dtype == DT_I8);
    /* a chunk: up to GROUP_KEYS keys, whole blocks, its scores (rows x keys) within GROUP_SCORE_FLOATS */
    enum { GROUP_KEYS = 256, GROUP_SCORE_FLOATS = 16384 };
    int chunk_blocks = 1;
    if (grouped) {
        chunk_blocks = GROUP_KEYS / block_size;
        const int fit = max_rows > 0 ? GROUP_SCORE_FLOATS / (max_rows * block_size) : 1;
        chunk_blocks = chunk_blocks < fit ? chunk_blocks : fit;
        chunk_blocks = chunk_blocks > 1 ? chunk_blocks : 1;
    }
    const int sc_cols = chunk_blocks * block_size; /* columns of the per-row scores */

#pragma omp parallel num_threads(num_threads)
    {
        /* per-thread scratch: the block's row pointers for k and v, then (fp32) q rows, accumulators,
         * softmax state, scores (a block's, or a chunk's where grouped), the block's k and v rows converted */
        const size_t floats = (size_t)max_rows * head_dim * 2 + (size_t)max_rows * (2 + sc_cols) + 2 * (size_t)block_size * head_dim;
        const size_t qbf_floats = HAVE_DPBF16 ? ((size_t)max_rows * head_dim + 1) / 2 : 0; /* bf16 query rows */
        const float** kp = (const float**)malloc(4 * (size_t)block_size * sizeof(float*) + (floats + qbf_floats) * sizeof(float));
        const float** vp = kp + block_size;
        const uint16_t** kr = (const uint16_t**)(vp + block_size); /* raw bf16 key rows (bf16_dot) */
        const void** vr = (const void**)(kr + block_size);         /* raw value rows (grouped) */
        float* scratch = kp == NULL ? NULL : (float*)(vr + block_size);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float* qbuf = scratch;
        float* acc = qbuf + (size_t)max_rows * head_dim;
        float* m = acc + (size_t)max_rows * head_dim;
        float* l = m + max_rows;
        float* sc = l + max_rows; /* [rows, sc_cols] */
        float* kbuf = sc + (size_t)max_rows * sc_cols;
        float* vbuf = kbuf + (size_t)block_size * head_dim;
        uint16_t* qbf = (uint16_t*)(vbuf + (size_t)block_size * head_dim);
#if HAVE_DPBF16
        uint16_t* kbf = (uint16_t*)kbuf; /* int8 keys as bf16 (bf16_dot): [block_size, head_dim] */
        float* kscale = vbuf;             /* and their scales (vbuf is unused where grouped) */
#endif

        /* items taken one at a time; while a thread finishes one it fetches the first block of item it + nthr, the
         * one it most likely takes next (Zen 5, 64 sequences x ~100 keys, bf16: 0.23 -> 0.19 ms a layer; dealing
         * items round-robin instead, so the guess is always right, measured the same there and 5-8% slower with
         * two long sequences among short ones) */
        const int nthr = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n_work; ++w) {
            if (scratch == NULL) continue;
            const int64_t it = w / parts;
            const int part = (int)(w % parts);
            const int s = seq_ids[it / splits];
            const int h_lo = (int)(it % splits) * heads_per_item;
            const int seq_len = seq_lens[s];
            const int q0 = cu_seqlens_q[s];
            const int q_len = cu_seqlens_q[s + 1] - q0;
            if (q_len <= 0 || q_len > max_q) continue;
            /* row r = (hh * q_len + i) * rep + g: KV head h_lo + hh, query i, query head (h_lo + hh) * rep + g */
            const int rows = heads_per_item * q_len * rep;
            const int first_pos = seq_len - q_len;

            // -- load the query rows (fp32) and reset the softmax state --
            for (int hh = 0, r = 0; hh < heads_per_item; ++hh)
                for (int i = 0; i < q_len; ++i)
                    for (int g = 0; g < rep; ++g, ++r) {
                        const int head = (h_lo + hh) * rep + g;
                        const int64_t idx = (int64_t)(q0 + i) * q_stride_t + (int64_t)head * q_stride_h;
                        float* dst = qbuf + (size_t)r * head_dim;
                        const float* src = load_row(query, idx, head_dim, dtype, dst);
                        if (src != dst) memcpy(dst, src, head_dim * sizeof(float));
                        if (bf16_dot) memcpy(qbf + (size_t)r * head_dim, (const uint16_t*)query + idx, head_dim * sizeof(uint16_t));
                        m[r] = -INFINITY;
                        l[r] = 0.0f;
                    }
            memset(acc, 0, (size_t)rows * head_dim * sizeof(float));

            const int k_lo = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
            int jb_lo = k_lo / block_size, last_block = (seq_len - 1) / block_size;
            if (parts > 1) { /* this part's share of the item's blocks (maybe none) */
                const int n_blocks = last_block - jb_lo + 1;
                const int lo = jb_lo + (int)((int64_t)n_blocks * part / parts);
                last_block = jb_lo + (int)((int64_t)n_blocks * (part + 1) / parts) - 1;
                jb_lo = lo;
            }
            /* the item's part of a block's slots: a run of run_bytes in each slot (run_bytes == slot_bytes: the
             * whole block); prefetched pf_lines per slot */
            const size_t run_bytes = (size_t)heads_per_item * kv_row * elem, slot_bytes = (size_t)tok_stride * elem;
            const size_t pf_lines = (run_bytes + 63) / 64 + (run_bytes < slot_bytes); /* a run may straddle lines */
            const size_t pf_total = run_bytes == slot_bytes ? block_bytes / 64 : pf_lines * block_size;
#if VW == 16
            /* the first block of item it + nthr, the one this thread most likely takes next (none: NULL) */
            const char* next_item_k = NULL;
            if (w + nthr < n_work && parts == 1) {
                const int s2 = seq_ids[(it + nthr) / splits];
                const int64_t first = block_tables[(int64_t)s2 * bt_stride]; /* (a sliding window may start later) */
                if (seq_lens[s2] > 0 && first >= 0)
                    next_item_k = (const char*)k_cache + (size_t)first * block_bytes
                        + (size_t)((it + nthr) % splits) * heads_per_item * kv_row * elem;
            }
            for (int cb = jb_lo; grouped && cb <= last_block; cb += chunk_blocks) {
                const int ce = cb + chunk_blocks - 1 < last_block ? cb + chunk_blocks - 1 : last_block;
                const int c0 = cb * block_size, c1 = (ce + 1) * block_size < seq_len ? (ce + 1) * block_size : seq_len;
                const int nk = c1 - c0;
                const size_t run0 = (size_t)h_lo * kv_row * elem; /* the item's run within a slot */
#define BLOCK_AT(cache, jb) ((const char*)(cache) + (size_t)block_tables[(int64_t)s * bt_stride + (jb)] * block_bytes + run0)
                const char* next_chunk_or_item = ce < last_block ? BLOCK_AT(k_cache, ce + 1) : next_item_k;
                // -- pass 1: every row's scores for the chunk's keys, block by block --
                for (int jb = cb; jb <= ce; ++jb) {
                    const int t0 = jb * block_size, nt = seq_len - t0 < block_size ? seq_len - t0 : block_size;
                    const char* kb = BLOCK_AT(k_cache, jb);
                    /* fetched while this block computes: the next block's keys, and this block's values (read in
                     * pass 2; the chunk's values stay in L2) */
                    const char* pf = jb < ce ? BLOCK_AT(k_cache, jb + 1) : next_chunk_or_item;
                    const char* pf2 = BLOCK_AT(v_cache, jb);
                    size_t pf_line = 0;
                    const size_t pf_step = pf_total / rows + 1;
                    for (int hh = 0; hh < heads_per_item; ++hh) {
                        for (int t = 0; t < nt; ++t) {
                            const char* row = kb + (size_t)t * slot_bytes + (size_t)hh * kv_row * elem;
#if HAVE_DPBF16
                            if (bf16_dot) kr[t] = kv_dtype == DT_I8 ? i8_to_bf16(row, 0, head_dim, kbf + (size_t)t * head_dim, kscale + t)
                                                                    : (const uint16_t*)row;
                            else
#endif
                            if (kv_dtype == DT_I8) kp[t] = dequant_i8(row, 0, head_dim, kbuf + (size_t)t * head_dim);
                            else kp[t] = load_row(row, 0, head_dim, kv_dtype, kbuf + (size_t)t * head_dim);
                        }
                        const int r0 = hh * q_len * rep, r1 = r0 + q_len * rep;
                        for (int r = r0; r < r1; ++r) {
                            float* srow = sc + (size_t)r * sc_cols + (t0 - c0);
                            int t = 0;
#if HAVE_DPBF16
                            if (bf16_dot) {
                                const uint16_t* qb = qbf + (size_t)r * head_dim;
                                for (; t + 16 <= nt; t += 16) dot16_bf16(qb, kr + t, head_dim, srow + t);
                                for (; t + 4 <= nt; t += 4) dot4_bf16(qb, kr + t, head_dim, srow + t);
                                for (; t < nt; ++t) srow[t] = _mm512_reduce_add_ps(dot_bf16_acc(_mm512_setzero_ps(), qb, kr[t], head_dim));
                                if (kv_dtype == DT_I8)
#pragma omp simd
                                    for (t = 0; t < nt; ++t) srow[t] *= kscale[t];
                            } else
#endif
                            {
                                const float* q = qbuf + (size_t)r * head_dim;
                                for (; t + 16 <= nt; t += 16) dot16(q, kp + t, head_dim, srow + t);
                                for (; t + 4 <= nt; t += 4) dot4(q, kp + t, head_dim, srow + t);
                                for (; t < nt; ++t) srow[t] = dot(q, kp[t], head_dim);
                            }
                            for (const size_t end = pf_line + pf_step; pf_line < end && pf_line < pf_total; ++pf_line) {
                                const size_t off = run_bytes == slot_bytes ? 64 * pf_line
                                    : pf_line / pf_lines * slot_bytes + 64 * (pf_line % pf_lines);
                                if (pf != NULL) __builtin_prefetch(pf + off);
                                __builtin_prefetch(pf2 + off);
                            }
                        }
                    }
                }
                // -- the softmax update of each row for the whole chunk (online across chunks) --
                for (int r = 0; r < rows; ++r) {
                    const int p = first_pos + (r / rep) % q_len; /* the row's query position */
                    float* srow = sc + (size_t)r * sc_cols;
                    float bm = -INFINITY;
                    if (softcap <= 0.0f && c1 - 1 <= p && (window <= 0 || c0 > p - window)) { /* all visible */
#pragma omp simd reduction(max : bm)
                        for (int t = 0; t < nk; ++t) {
                            const float x = srow[t] * scale;
                            srow[t] = x;
                            bm = x > bm ? x : bm;
                        }
                    } else for (int t = 0; t < nk; ++t) {
                        const int pos = c0 + t;
                        float x = srow[t] * scale;
                        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                        x = pos <= p && (window <= 0 || pos > p - window) ? x : -INFINITY;
                        srow[t] = x;
                        bm = x > bm ? x : bm;
                    }
                    if (bm == -INFINITY) { /* nothing visible in this chunk: no weight */
                        memset(srow, 0, (size_t)nk * sizeof(float));
                        continue;
                    }
                    float* a = acc + (size_t)r * head_dim;
                    const float new_m = bm > m[r] ? bm : m[r];
                    if (new_m > m[r] && l[r] > 0.0f) {
                        const float corr = exp_nonpos(m[r] - new_m);
                        l[r] *= corr;
                        for (int d = 0; d < head_dim; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(corr)));
                    }
                    m[r] = new_m;
                    l[r] += exp_block(srow, nk, new_m);
                }
                // -- pass 2: the chunk's values, block by block, for all the rows of each KV head at once --
                for (int jb = cb; jb <= ce; ++jb) {
                    const int t0 = jb * block_size, nt = seq_len - t0 < block_size ? seq_len - t0 : block_size;
                    const char* vb = BLOCK_AT(v_cache, jb);
                    for (int hh = 0; hh < heads_per_item; ++hh) {
                        for (int t = 0; t < nt; ++t) vr[t] = vb + (size_t)t * slot_bytes + (size_t)hh * kv_row * elem;
                        const int r0 = hh * q_len * rep, n_rows = q_len * rep;
                        float* accs[n_rows];
                        const float* ws[n_rows];
                        for (int i = 0; i < n_rows; ++i)
                            accs[i] = acc + (size_t)(r0 + i) * head_dim, ws[i] = sc + (size_t)(r0 + i) * sc_cols + (t0 - c0);
                        accumulate_grouped(accs, ws, vr, nt, head_dim, n_rows, kv_dtype == DT_I8 ? V_I8 : V_BF16);
                    }
                }
#undef BLOCK_AT
            }
#endif
            // -- the row-by-row path (not grouped): block by block, each row's scores, softmax and values --
            for (int jb = jb_lo; !grouped && jb <= last_block; ++jb) {
                const int64_t block = block_tables[(int64_t)s * bt_stride + jb];
                const int t0 = jb * block_size;
                const int nt = seq_len - t0 < block_size ? seq_len - t0 : block_size;
                const int64_t base = block * block_size * tok_stride + (int64_t)h_lo * kv_row;
                /* the next block lies elsewhere in the pool: fetch this item's part of it (its KV heads' run of
                 * every slot) a few lines per row while this one computes (all at once would stall on the full
                 * miss queue instead) */
                const char *pf_k = NULL, *pf_v = NULL;
                if (jb < last_block) {
                    const size_t next = (size_t)block_tables[(int64_t)s * bt_stride + jb + 1] * block_bytes
                        + (size_t)h_lo * kv_row * elem;
                    pf_k = (const char*)k_cache + next, pf_v = (const char*)v_cache + next;
                }
                else if (w + nthr < n_work && parts == 1) {
                    const int s2 = seq_ids[(it + nthr) / splits];
                    const int64_t first = block_tables[(int64_t)s2 * bt_stride]; /* (a sliding window may start later) */
                    if (seq_lens[s2] > 0 && first >= 0) {
                        const size_t at = (size_t)first * block_bytes
                            + (size_t)((it + nthr) % splits) * heads_per_item * kv_row * elem;
                        pf_k = (const char*)k_cache + at, pf_v = (const char*)v_cache + at;
                    }
                }
                /* every key of the block visible to every query of the item (no causal or window mask) */
                const int all_visible = softcap <= 0.0f && t0 + nt - 1 <= first_pos
                    && (window <= 0 || t0 > seq_len - 1 - window);
                size_t pf_line = 0; /* the item's lines of the next block: pf_lines of each slot's run, slot by slot */
                const size_t pf_step = pf_total / rows + 1;
                for (int hh = 0; hh < heads_per_item; ++hh) {
                    // -- this KV head's keys and values in the block, as fp32 rows (or in place) --
                    for (int t = 0; t < nt; ++t) {
                        const int64_t idx = base + t * tok_stride + (int64_t)hh * kv_row;
                        kp[t] = load_row(k_cache, idx, head_dim, kv_dtype, kbuf + (size_t)t * head_dim);
                        vp[t] = load_row(v_cache, idx, head_dim, kv_dtype, vbuf + (size_t)t * head_dim);
                    }
                    const int r0 = hh * q_len * rep, r1 = r0 + q_len * rep;
                    for (int r = r0; r < r1; ++r) {
                        // -- the row's scores against the block's keys, four at a time --
                        const float* q = qbuf + (size_t)r * head_dim;
                        float* srow = sc + (size_t)r * sc_cols;
                        int t = 0;
                        for (; t + 4 <= nt; t += 4) dot4(q, kp + t, head_dim, srow + t);
                        for (; t < nt; ++t) srow[t] = dot(q, kp[t], head_dim);
                        const int p = first_pos + (r - r0) / rep; /* the row's query position */
                        float bm = -INFINITY;
                        if (all_visible) { /* no mask, no softcap: scale and max, vectorized */
#pragma omp simd reduction(max : bm)
                            for (t = 0; t < nt; ++t) {
                                const float x = srow[t] * scale;
                                srow[t] = x;
                                bm = x > bm ? x : bm;
                            }
                        } else for (t = 0; t < nt; ++t) {
                            const int pos = t0 + t;
                            float x = srow[t] * scale;
                            if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                            x = pos <= p && (window <= 0 || pos > p - window) ? x : -INFINITY;
                            srow[t] = x;
                            bm = x > bm ? x : bm;
                        }
                        if (bm == -INFINITY) continue; /* nothing visible in this block */

                        // -- online softmax: rescale what was accumulated, turn scores into weights --
                        float* a = acc + (size_t)r * head_dim;
                        const float new_m = bm > m[r] ? bm : m[r];
                        if (new_m > m[r] && l[r] > 0.0f) {
                            const float corr = exp_nonpos(m[r] - new_m);
                            l[r] *= corr;
                            const vf cv = corr - (vf){0};
                            int d = 0;
                            for (; d + VW <= head_dim; d += VW) ST(a + d, LD(a + d) * cv);
                            for (; d < head_dim; ++d) a[d] *= corr;
                        }
                        m[r] = new_m;
                        l[r] += exp_block(srow, nt, new_m);

                        // -- accumulate the block's values --
                        accumulate(a, srow, vp, nt, head_dim);
                        if (pf_k != NULL)
                            for (const size_t end = pf_line + pf_step; pf_line < end && pf_line < pf_total; ++pf_line) {
                                const size_t off = run_bytes == slot_bytes ? 64 * pf_line
                                    : pf_line / pf_lines * slot_bytes + 64 * (pf_line % pf_lines);
                                __builtin_prefetch(pf_k + off);
                                __builtin_prefetch(pf_v + off);
                            }
                    }
                }
            }

            if (parts > 1) { /* keep this part's state; the parts are merged below */
                float* dst = partial + (size_t)w * part_floats;
                memcpy(dst, acc, (size_t)rows * head_dim * sizeof(float));
                memcpy(dst + (size_t)max_rows * head_dim, m, (size_t)rows * sizeof(float));
                memcpy(dst + (size_t)max_rows * (head_dim + 1), l, (size_t)rows * sizeof(float));
                continue;
            }
            // -- normalize and write out --
            for (int hh = 0, r = 0; hh < heads_per_item; ++hh)
                for (int i = 0; i < q_len; ++i)
                    for (int g = 0; g < rep; ++g, ++r) {
                        const int head = (h_lo + hh) * rep + g;
                        const int64_t idx = (int64_t)(q0 + i) * o_stride_t + (int64_t)head * o_stride_h;
                        store_row(out, idx, head_dim, dtype, acc + (size_t)r * head_dim, l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
                    }
        }
        if (parts > 1) { /* (every thread reaches this worksharing loop) */
            /* merge each item's parts: rescale every part's sums to the rows' overall max, add, normalize */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < n_items; ++it) {
                if (scratch == NULL) continue;
                const int s = seq_ids[it / splits];
                const int h_lo = (int)(it % splits) * heads_per_item;
                const int q0 = cu_seqlens_q[s];
                const int q_len = cu_seqlens_q[s + 1] - q0;
                if (q_len <= 0 || q_len > max_q) continue;
                for (int hh = 0, r = 0; hh < heads_per_item; ++hh)
                    for (int i = 0; i < q_len; ++i)
                        for (int g = 0; g < rep; ++g, ++r) {
                            float mx = -INFINITY, sum = 0.0f;
                            for (int p = 0; p < parts; ++p) {
                                const float* src = partial + (size_t)(it * parts + p) * part_floats;
                                const float mp = src[(size_t)max_rows * head_dim + r];
                                if (src[(size_t)max_rows * (head_dim + 1) + r] > 0.0f && mp > mx) mx = mp;
                            }
                            memset(acc, 0, (size_t)head_dim * sizeof(float));
                            for (int p = 0; p < parts; ++p) {
                                const float* src = partial + (size_t)(it * parts + p) * part_floats;
                                const float lp = src[(size_t)max_rows * (head_dim + 1) + r];
                                if (!(lp > 0.0f)) continue;
                                const float c = exp_nonpos(src[(size_t)max_rows * head_dim + r] - mx);
                                sum += lp * c;
                                const float* ap = src + (size_t)r * head_dim;
                                for (int d = 0; d < head_dim; ++d) acc[d] += ap[d] * c;
                            }
                            const int head = (h_lo + hh) * rep + g;
                            const int64_t idx = (int64_t)(q0 + i) * o_stride_t + (int64_t)head * o_stride_h;
                            store_row(out, idx, head_dim, dtype, acc, sum > 0.0f ? 1.0f / sum : 0.0f);
                        }
            }
        }
        free(kp);
    }
    free(partial);
    return failed ? -1 : 0;
}

/* Write one layer's new keys and values into the pool: token i's rows go to slot slots[i] (skipped when
 * negative, a padding row; -1 and nothing written if one is past the pool). k/v rows are row_bytes long and
 * row_stride bytes apart; the pool's slots are row_bytes apart (same dtype: a plain copy). One call replaces
 * two index_copy_ calls and their dispatch. */
int hfp_store_kv(const char* k, const char* v, int64_t k_row_stride, int64_t v_row_stride,
                 char* k_cache, char* v_cache, const int64_t* slots, int64_t n_tokens, int64_t row_bytes, int64_t n_slots)
{
    for (int64_t i = 0; i < n_tokens; ++i)
        if (slots[i] >= n_slots) return -1; /* nothing written */
    for (int64_t i = 0; i < n_tokens; ++i) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, k + i * k_row_stride, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, v + i * v_row_stride, (size_t)row_bytes);
    }
    return 0;
}

/* hfp_store_kv for an int8 pool: each (token, KV head) row of k/v (dtype dt, head_dim contiguous values, the
 * heads head_dim apart, tokens k/v_row_stride elements apart) is quantized symmetrically to int8 with its fp32
 * scale absmax / 127, q = clamp(floor(x / scale + 1/2), -127, 127), exactly as kv_quant.quantize_rows does, and
 * written with the scale after the values (rows of head_dim + 4 bytes). -1 and nothing written if a slot is
 * past the pool. */
int hfp_store_kv_int8(const void* k, const void* v, int64_t k_row_stride, int64_t v_row_stride,
                      int8_t* k_cache, int8_t* v_cache, const int64_t* slots, int64_t n_tokens,
                      int num_kv_heads, int head_dim, int dt, int64_t n_slots)
{
    for (int64_t i = 0; i < n_tokens; ++i)
        if (slots[i] >= n_slots) return -1; /* nothing written */
    const int row = head_dim + 4;
    float buf[head_dim];
    for (int64_t i = 0; i < n_tokens; ++i) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        for (int kv = 0; kv < 2; ++kv) {
            const void* src = kv ? v : k;
            int8_t* dst = (kv ? v_cache : k_cache) + slot * num_kv_heads * row;
            for (int h = 0; h < num_kv_heads; ++h, dst += row) {
                const float* x = load_row(src, i * (kv ? v_row_stride : k_row_stride) + (int64_t)h * head_dim, head_dim, dt, buf);
                float amax = 0.0f;
#pragma omp simd reduction(max : amax)
                for (int d = 0; d < head_dim; ++d) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
                const float scale = amax / 127.0f;
                const float div = scale > FLT_MIN ? scale : FLT_MIN;
#pragma omp simd
                for (int d = 0; d < head_dim; ++d) {
                    float q = floorf(x[d] / div + 0.5f);
                    q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
                    dst[d] = (int8_t)q;
                }
                memcpy(dst + head_dim, &scale, sizeof scale);
            }
        }
    }
    return 0;
}
