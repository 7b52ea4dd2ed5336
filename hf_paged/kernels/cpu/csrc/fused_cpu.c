/*
 * Fused elementwise CPU kernels for the decoder layers of Llama-family models: RMSNorm (optionally after the
 * residual add) and rotary embedding of q and k in place; and greedy sampling's row argmax. Each replaces several torch ops (and their Python
 * dispatch) with one call and one pass over the rows; and the MLP's SiLU-mul in bf16, in explicit vectors with
 * a polynomial exp (a portable scalar exp was slower than torch's vectorized one).
 *
 * Rounding follows the torch code they replace op by op: every intermediate that torch materializes in the
 * model's dtype is rounded to it here too (bf16/fp16), and the file is built with -ffp-contract=off so no
 * multiply-add is fused where torch rounds in between, and the RMSNorm's sum of squares adds in the order of
 * torch's CPU sum: its results are torch's bits in every dtype. The fp32 SiLU is not here (its exp would differ
 * by ~1 ulp); the bf16 one rounds to torch's bits.
 *
 * fp32 and bf16 loops are written for the compiler's vectorizer (bf16 is a 16-bit shift to fp32 and a
 * branch-free round-to-nearest-even back), so each build gets the host's vector width; fp16 stays scalar.
 *
 * Built and loaded like paged_attention_cpu.c (hf_paged/kernels/cpu/fused_ops.py), called through ctypes.
 * Row strides are in elements; the last dimension of every tensor is contiguous.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
/* below this many elements one thread does the whole call (64 x 576 bf16 RMSNorm with the residual on a
 * Zen 5 host: 11 us on one thread, 6 on two) */
#define PAR_ELEMS (1 << 14)

#include "bf16_common.h"

static inline float ld(const void* p, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float*)p)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t*)p)[i]);
    return (float)((const _Float16*)p)[i];
}

/* round to the storage dtype and back (what torch does between two ops) */
static inline float rnd(float x, int dt) {
    if (dt == DT_F32) return x;
    if (dt == DT_BF16) return bf16_to_f32(f32_to_bf16(x));
    return (float)(_Float16)x;
}

static inline void st(void* p, int64_t i, int dt, float x) {
    if (dt == DT_F32) ((float*)p)[i] = x;
    else if (dt == DT_BF16) ((uint16_t*)p)[i] = f32_to_bf16(x);
    else ((_Float16*)p)[i] = (_Float16)x;
}

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* AW lanes: one register of the build's ISA. Wider generic vectors than the target has are not split into
 * registers by GCC 12 for these compares and blends: with 16 lanes on AVX2 the argmax loop became scalar code
 * with a branch per lane, 6.8 ms for 64 x 49152 fp32 logits on a Zen 3 (torch.max: 3.6 ms). */
#if defined(__AVX512F__)
#define AW 16
#elif defined(__AVX__)
#define AW 8
#else
#define AW 4
#endif
typedef float vaf __attribute__((vector_size(AW * 4), aligned(4)));
typedef int32_t vai __attribute__((vector_size(AW * 4), aligned(4)));
typedef uint16_t vah __attribute__((vector_size(AW * 2), aligned(2)));

typedef uint32_t vau __attribute__((vector_size(AW * 4), aligned(4)));

static inline vaf vsel(vai m, vaf a, vaf b) { return (vaf)(((vai)a & m) | ((vai)b & ~m)); }

static inline vaf vround_bf16_sw(vaf f) { /* f32_to_bf16 and back, lane-wise */
    const vau u = (vau)f;
    const vau rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const vai nan = (vai)((u & 0x7fffffffu) > 0x7f800000u);
    return (vaf)(((vai)((u | 0x400000u) & 0xffff0000u) & nan) | ((vai)rounded & ~nan));
}

/* ld_bf16v: AW bf16 values from p widened to fp32; st_bf16v: AW fp32 values rounded to bf16 and stored at p;
 * vround_bf16: rounded to bf16 and back (no alignment). The vector types are aligned(4)/(2), so these are
 * unaligned loads and stores; a memcpy through a stack copy instead made GCC 12 store two halves and load the
 * whole, a store-forwarding stall per vector. With AVX-512 GCC 12 lowers the generic conversions to permutes of
 * two registers: one instruction each instead. With AVX-512 BF16, VCVTNEPS2BF16 rounds: it gives f32_to_bf16's
 * bits for every fp32 value but the subnormals, which it flushes to zero (all 2^32 inputs compared on the Xeon
 * AMX host), so a vector holding a subnormal takes the software rounding. 64 x 576 bf16 RMSNorm with the
 * residual, one thread, there: 44 -> 25-29 us (without it 29 -> 15-19). */
#if AW == 16
static inline __m256i bf16_bits(vaf f) {
#if defined(__AVX512BF16__)
    const __m512i u = (__m512i)f;
    const __mmask16 plain = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x7f800000)) |
                            _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7fffffff));
    if (__builtin_expect(plain == 0xffff, 1)) return (__m256i)_mm512_cvtneps_pbh((__m512)f);
#endif
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)vround_bf16_sw(f), 16));
}
static inline vaf widen_bf16(__m256i h) { return (vaf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16); }
static inline vaf ld_bf16v(const uint16_t* p) { return widen_bf16(_mm256_loadu_si256((const __m256i*)p)); }
static inline void st_bf16v(uint16_t* p, vaf f) { _mm256_storeu_si256((__m256i*)p, bf16_bits(f)); }
static inline vaf vround_bf16(vaf f) { return widen_bf16(bf16_bits(f)); }
#else
static inline vaf ld_bf16v(const uint16_t* p) { return (vaf)(__builtin_convertvector(*(const vah*)p, vai) << 16); }
static inline void st_bf16v(uint16_t* p, vaf f) { *(vah*)p = __builtin_convertvector((vau)vround_bf16_sw(f) >> 16, vah); }
static inline vaf vround_bf16(vaf f) { return vround_bf16_sw(f); }
#endif
static inline vaf ld_f32v(const float* p) { return *(const vaf*)p; }
static inline void st_f32v(float* p, vaf f) { *(vaf*)p = f; }

/* ceil(log2(x)) as torch's utils::CeilLog2 counts it (1 for x <= 2) */
static inline int ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int bits = 0;
    for (uint64_t v = (uint64_t)x - 1; v; v >>= 1) ++bits;
    return bits;
}

/*
 * The sum of h[i]^2 (each square rounded before it is added, as pow(2) then sum) in the order of torch's CPU sum
 * over a contiguous row of W-float vectors (W: the width of torch's sum, 8 or 16, measured by the caller:
 * fused_ops.torch_sum_lanes): the row is W-float vectors read 4 at a time into 4 accumulators, which add
 * up in a cascade of 4 levels of 2^lp steps (lp = max(4, ceil_log2(steps) / 4)); the vectors past the last
 * group of 4 join the first accumulator, the 4 accumulators add left to right, then a scalar sum from zero
 * takes the elements past the last vector and then the W lanes in order (a row shorter than W: torch's scalar
 * sum, 4 running sums). Same bits as torch's pow(2).sum(-1)
 * (and its mean, which divides that sum by n) for rows of fewer than 32768 elements, where torch sums a row in
 * one pass; tests/test_fused_layers.py checks it against torch.
 */
#define TORCH_SUM_SQUARES(NAME, VT, W)                                                                        \
    static float NAME(const float* h, int n) {                                                                \
        if (n < (W)) { /* torch's scalar sum: 4 running sums of every 4th element, the rest into the first */  \
            float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                                            \
            for (int e = 0; e < n / 4 * 4; ++e) p[e % 4] += h[e] * h[e];                                       \
            for (int e = n / 4 * 4; e < n; ++e) p[0] += h[e] * h[e];                                           \
            return 0.0f + (((p[0] + p[1]) + p[2]) + p[3]);                                                    \
        }                                                                                                     \
        const int vs = n / (W), steps = vs / 4;                                                               \
        const int lp = ceil_log2(steps) / 4 > 4 ? ceil_log2(steps) / 4 : 4;                                    \
        const int64_t step = (int64_t)1 << lp, mask = step - 1;                                               \
        VT acc[4][4];                                                                                         \
        for (int l = 0; l < 4; ++l)                                                                           \
            for (int k = 0; k < 4; ++k) acc[l][k] = (VT){0};                                                  \
        int64_t i = 0;                                                                                        \
        while (i + step <= steps) {                                                                           \
            for (int64_t j = 0; j < step; ++j, ++i)                                                           \
                for (int k = 0; k < 4; ++k) {                                                                 \
                    VT x;                                                                                     \
                    __builtin_memcpy(&x, h + (4 * i + k) * (W), sizeof x);                                    \
                    acc[0][k] += x * x;                                                                       \
                }                                                                                             \
            for (int l = 1; l < 4; ++l) {                                                                     \
                for (int k = 0; k < 4; ++k) acc[l][k] += acc[l - 1][k], acc[l - 1][k] = (VT){0};              \
                if ((i & (mask << (l * lp))) != 0) break;                                                     \
            }                                                                                                 \
        }                                                                                                     \
        for (; i < steps; ++i)                                                                                \
            for (int k = 0; k < 4; ++k) {                                                                     \
                VT x;                                                                                         \
                __builtin_memcpy(&x, h + (4 * i + k) * (W), sizeof x);                                        \
                acc[0][k] += x * x;                                                                           \
            }                                                                                                 \
        for (int l = 1; l < 4; ++l)                                                                           \
            for (int k = 0; k < 4; ++k) acc[0][k] += acc[l][k];                                               \
        VT p = acc[0][0];                                                                                     \
        for (int v = steps * 4; v < vs; ++v) {                                                                \
            VT x;                                                                                             \
            __builtin_memcpy(&x, h + (int64_t)v * (W), sizeof x);                                             \
            p += x * x;                                                                                       \
        }                                                                                                     \
        for (int k = 1; k < 4; ++k) p += acc[0][k];                                                           \
        float s = 0.0f;                                                                                       \
        for (int e = vs * (W); e < n; ++e) s += h[e] * h[e];                                                  \
        for (int k = 0; k < (W); ++k) s += p[k];                                                              \
        return 0.0f + s;                                                                                      \
    }
TORCH_SUM_SQUARES(sum_squares8, v8, 8)
TORCH_SUM_SQUARES(sum_squares16, v16, 16)
#undef TORCH_SUM_SQUARES

/*
 * out[r] = w * (h * rsqrt(mean(h^2) + eps)) with h = x[r], or, given add, h = x[r] + add[r], also written to
 * sum_out[r] (the new residual). Torch's order: h rounded to the dtype, the normalized row rounded to it
 * before the weight multiplies, the product rounded; the sum of squares in the order of torch's sum with
 * lanes-float vectors (8 or 16: see sum_squares8).
 */
void hfp_rms_norm(const void* x, int64_t x_stride, const void* add, int64_t add_stride, void* sum_out,
                  int64_t sum_stride, const void* w, void* out, int64_t out_stride, int rows, int n, float eps,
                  int dt, int lanes, int threads) {
    const int nt = (int64_t)rows * n >= PAR_ELEMS ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int r = 0; r < rows; ++r) {
        float buf[n]; /* n is a hidden size: a few KiB of stack */
        const float* h = buf;
        const int64_t x0 = (int64_t)r * x_stride, a0 = (int64_t)r * add_stride, s0 = (int64_t)r * sum_stride;
        int i = 0;
        if (dt == DT_BF16) {
            const uint16_t* xb = (const uint16_t*)x + x0;
            if (add != NULL) {
                const uint16_t* ab = (const uint16_t*)add + a0;
                uint16_t* sb = (uint16_t*)sum_out + s0;
                for (; i + AW <= n; i += AW) {
                    const vaf t = vround_bf16(ld_bf16v(xb + i) + ld_bf16v(ab + i));
                    st_bf16v(sb + i, t); /* exact: t is a bf16 value */
                    st_f32v(buf + i, t);
                }
                for (; i < n; ++i) {
                    const uint16_t r16 = f32_to_bf16(bf16_to_f32(xb[i]) + bf16_to_f32(ab[i]));
                    sb[i] = r16;
                    buf[i] = bf16_to_f32(r16);
                }
            } else {
                for (; i + AW <= n; i += AW) {
                    const vaf t = ld_bf16v(xb + i);
                    st_f32v(buf + i, t);
                }
                for (; i < n; ++i) buf[i] = bf16_to_f32(xb[i]);
            }
        } else if (dt == DT_F32 && add != NULL) {
            const float* xf = (const float*)x + x0;
            const float* af = (const float*)add + a0;
            float* sf = (float*)sum_out + s0;
            for (; i + AW <= n; i += AW) {
                const vaf t = ld_f32v(xf + i) + ld_f32v(af + i);
                st_f32v(sf + i, t);
                st_f32v(buf + i, t);
            }
            for (; i < n; ++i) sf[i] = buf[i] = xf[i] + af[i];
        } else if (add != NULL) {
            for (; i < n; ++i) {
                buf[i] = rnd(ld(x, x0 + i, dt) + ld(add, a0 + i, dt), dt);
                st(sum_out, s0 + i, dt, buf[i]);
            }
        } else if (dt == DT_F32) {
            h = (const float*)x + x0;
        } else {
            for (; i < n; ++i) buf[i] = ld(x, x0 + i, dt);
        }
        const float inv = 1.0f / sqrtf((lanes == 16 ? sum_squares16(h, n) : sum_squares8(h, n)) / (float)n + eps);
        const int64_t o0 = (int64_t)r * out_stride;
        int j = 0;
        if (dt == DT_F32) {
            const float* wf = (const float*)w;
            float* o = (float*)out + o0;
            for (; j + AW <= n; j += AW) {
                st_f32v(o + j, ld_f32v(wf + j) * (ld_f32v(h + j) * inv));
            }
            for (; j < n; ++j) o[j] = wf[j] * (h[j] * inv);
        } else if (dt == DT_BF16) {
            const uint16_t* wb = (const uint16_t*)w;
            uint16_t* o = (uint16_t*)out + o0;
            for (; j + AW <= n; j += AW) st_bf16v(o + j, ld_bf16v(wb + j) * vround_bf16(ld_f32v(h + j) * inv));
            for (; j < n; ++j) o[j] = f32_to_bf16(bf16_to_f32(wb[j]) * bf16_to_f32(f32_to_bf16(h[j] * inv)));
        } else {
            for (; j < n; ++j) st(out, o0 + j, dt, ld(w, j, dt) * rnd(h[j] * inv, dt));
        }
    }
}

/*
 * Rotary embedding in place, "rotate half" layout: for each of q's nq heads and k's nk heads of token t,
 * x'[i] = x[i] * cos[i] - x[i + d/2] * sin[i] and x'[i + d/2] = x[i + d/2] * cos[i + d/2] + x[i] * sin[i + d/2]
 * (cos, sin: [tokens, d] in the dtype). Rounded like torch's (x * cos) + (rotate_half(x) * sin).
 */
void hfp_rope(void* q, int64_t q_stride, int nq, void* k, int64_t k_stride, int nk, const void* cos,
              const void* sin, int64_t cs_stride, int tokens, int d, int dt, int threads) {
    const int half = d / 2;
    const int nt = (int64_t)tokens * (nq + nk) * d >= PAR_ELEMS ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = 0; t < tokens; ++t) {
        const int64_t c0 = (int64_t)t * cs_stride;
        for (int h = 0; h < nq + nk; ++h) {
            void* base = h < nq ? q : k;
            const int64_t x0 = h < nq ? (int64_t)t * q_stride + (int64_t)h * d : (int64_t)t * k_stride + (int64_t)(h - nq) * d;
            if (dt == DT_F32) {
                float* x = (float*)base + x0;
                const float* c = (const float*)cos + c0;
                const float* s = (const float*)sin + c0;
#pragma omp simd
                for (int i = 0; i < half; ++i) {
                    const float a = x[i], b = x[i + half];
                    x[i] = a * c[i] + (-b) * s[i];
                    x[i + half] = b * c[i + half] + a * s[i + half];
                }
            } else if (dt == DT_BF16) {
                uint16_t* x = (uint16_t*)base + x0;
                const uint16_t* c = (const uint16_t*)cos + c0;
                const uint16_t* s = (const uint16_t*)sin + c0;
                int i = 0;
                for (; i + AW <= half; i += AW) {
                    const vaf a = ld_bf16v(x + i), b = ld_bf16v(x + i + half);
                    const vaf lo = vround_bf16(a * ld_bf16v(c + i)) + vround_bf16(-b * ld_bf16v(s + i));
                    const vaf hi = vround_bf16(b * ld_bf16v(c + i + half)) + vround_bf16(a * ld_bf16v(s + i + half));
                    st_bf16v(x + i, lo);
                    st_bf16v(x + i + half, hi);
                }
                for (; i < half; ++i) {
                    const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
                    const float lo = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(c[i]))) +
                                     bf16_to_f32(f32_to_bf16(-b * bf16_to_f32(s[i])));
                    const float hi = bf16_to_f32(f32_to_bf16(b * bf16_to_f32(c[i + half]))) +
                                     bf16_to_f32(f32_to_bf16(a * bf16_to_f32(s[i + half])));
                    x[i] = f32_to_bf16(lo);
                    x[i + half] = f32_to_bf16(hi);
                }
            } else {
                for (int i = 0; i < half; ++i) {
                    const float a = ld(base, x0 + i, dt), b = ld(base, x0 + i + half, dt);
                    const float lo = rnd(a * ld(cos, c0 + i, dt), dt) + rnd(-b * ld(sin, c0 + i, dt), dt);
                    const float hi = rnd(b * ld(cos, c0 + i + half, dt), dt) + rnd(a * ld(sin, c0 + i + half, dt), dt);
                    st(base, x0 + i, dt, lo);
                    st(base, x0 + i + half, dt, hi);
                }
            }
        }
    }
}

/*
 * Greedy decoding's argmax: for each row of x ([rows, n], fp32 or bf16), the first index of its maximum and
 * the maximum (as fp32), like torch.max(x, dim=-1): ties go to the lowest index; a row holding NaN gives
 * NaN and its first NaN's index. One pass with a running maximum and its index per vector lane (a lane
 * moves only on a strictly greater value, so it keeps its first maximum), then the lanes are merged.
 */
void hfp_argmax_rows(const void* x, int64_t stride, int rows, int n, int dt, int64_t* index, float* value, int threads) {
    const int nt = (int64_t)rows * n >= PAR_ELEMS ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const float* xf = (const float*)x + (int64_t)r * stride;
        const uint16_t* xb = (const uint16_t*)x + (int64_t)r * stride;
        vaf best;
        vai at = {0}, cur, nan = {0};
        for (int j = 0; j < AW; ++j) best[j] = -INFINITY, cur[j] = j;
        int i = 0;
        for (; i + AW <= n; i += AW) {
            vaf v;
            if (dt == DT_BF16) v = (vaf)(__builtin_convertvector(*(const vah*)(xb + i), vai) << 16);
            else v = *(const vaf*)(xf + i);
            const vai gt = v > best;
            nan |= v != v;
            best = (vaf)(((vai)v & gt) | ((vai)best & ~gt));
            at = (cur & gt) | (at & ~gt);
            cur += AW;
        }
        float m = -INFINITY;
        int64_t k = 0;
        int any_nan = 0;
        for (int j = 0; j < AW; ++j) {
            any_nan |= nan[j] != 0;
            if (best[j] > m || (best[j] == m && at[j] < k)) m = best[j], k = at[j];
        }
        for (; i < n; ++i) {
            const float v = dt == DT_BF16 ? bf16_to_f32(xb[i]) : xf[i];
            any_nan |= v != v;
            if (v > m) m = v, k = i;
        }
        if (any_nan)
            for (i = 0; i < n; ++i) {
                const float v = dt == DT_BF16 ? bf16_to_f32(xb[i]) : xf[i];
                if (v != v) { m = v, k = i; break; }
            }
        index[r] = k;
        value[r] = m;
    }
}

/*
 * The MLP's act(gate) * up for SiLU in bf16, in place in gate: gate[r] = bf16(bf16(g / (1 + exp(-g))) * up[r]),
 * torch's two roundings (silu's result, then the product). exp is Cephes' single-precision polynomial (about 1
 * ulp, where torch's Sleef exp is within 1 ulp too): the fp32 quotients may differ from torch's in their last
 * bit, but after the rounding to bf16 every one of the 65536 bf16 gate values gives torch's bits (tested
 * exhaustively, AVX-512 and AVX2 builds; the probe still compares each build); overflow, zeros, infinities and
 * NaN come out as torch's. That polynomial fills a table of silu's 65536 results once; the pass over the rows
 * then looks silu up, AW lanes at a time, where torch takes two passes and two dispatches.
 */
static inline vaf vexp(vaf t) {
    const vaf zero = {0};
    const vai over = t > 88.72283905f;  /* exp overflows to inf (ln FLT_MAX) */
    t = vsel(t < -86.0f, zero - 86.0f, t); /* below: exp is < 2^-124, 1 + exp(t) == 1 in fp32 */
    t = vsel(over, zero, t);
    const vaf k = (t * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const vaf r = (t - k * 0.693359375f) - k * -2.12194440e-4f;
    vaf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    const vai half = (__builtin_convertvector(k, vai) + 126) << 23; /* 2^(k - 1): k reaches 128 */
    const vaf e = (p * (vaf)half) * 2.0f;
    return vsel(over, zero + INFINITY, e);
}

static inline vaf silu_lanes(vaf x) { return vround_bf16(x / (1.0f + vexp(-x))); }

/* bf16 silu of every bf16 value, from silu_lanes (so, torch's bits), and two bytes past the end that the gathers
 * below read. Filled once when the library loads (~0.1 ms): silu of a bf16 gate is a table lookup then, five
 * times faster than the polynomial and its division on the Xeon AMX host (64 x 1536, one thread: 30 vs 150 us). */
static uint16_t silu_table[65536 + 2];

__attribute__((constructor)) static void fill_silu_table(void) {
    for (int h = 0; h < 65536; h += AW) {
        vai bits;
        for (int j = 0; j < AW; ++j) bits[j] = (int32_t)((uint32_t)(h + j) << 16);
        const vau s = (vau)silu_lanes((vaf)bits) >> 16;
        for (int j = 0; j < AW; ++j) silu_table[h + j] = (uint16_t)s[j];
    }
}

/* silu_table[g[j]] as fp32, j < AW: one gather of 32-bit words at byte offsets 2 g[j] (the low half is the
 * entry) where the ISA has one, else lane by lane */
static inline vaf silu_of(const uint16_t* g) {
#if AW == 16
    const __m512i at = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)g));
    const vai words = (vai)_mm512_i32gather_epi32(at, (const void*)silu_table, 2);
#elif AW == 8 && defined(__AVX2__)
    const __m256i at = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)g));
    const vai words = (vai)_mm256_i32gather_epi32((const int*)silu_table, at, 2);
#else
    vai words;
    for (int j = 0; j < AW; ++j) words[j] = silu_table[g[j]];
#endif
    return (vaf)((vau)words << 16);
}

/*
 * The same in fp32, gate[r] = (g / (1 + exp(-g))) * up[r], with torch's bits where torch computes silu with its
 * vectorized exp: Sleef's expf_u10 (AVX2 and AVX-512 builds of torch; both with FMA), reproduced step by step
 * below: q = rint(d / ln 2), s = d - q ln 2 in two FMAs, a degree-6 polynomial in FMAs, the scale by 2^q in two
 * halves, 0 below -104 and inf above 100 (all 2^32 fp32 inputs gave torch's silu bits on both builds, a NaN
 * input a NaN, its bits not compared: here a NaN lane is zeroed before q, Sleef's q is INT_MIN). torch's
 * scalar loop (its remainder past a multiple of two vectors in a row or a thread's range) uses libm's expf, which
 * differs in ~0.2% of inputs: the caller (fused_ops.silu_f32_serves) only calls this where torch's loop would be
 * vectorized throughout.
 */
static inline vaf vfma(vaf a, vaf b, vaf c) {
#if AW == 16
    return (vaf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif AW == 8 && defined(__FMA__)
    return (vaf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vaf r;
    for (int j = 0; j < AW; ++j) r[j] = fmaf(a[j], b[j], c[j]);
    return r;
#endif
}

static inline vaf sleef_exp(vaf d) {
    const vaf zero = {0};
    vaf c = vsel(d < -104.0f, zero - 104.0f, vsel(d > 100.0f, zero + 100.0f, d)); /* lanes past are set below */
    c = vsel(c == c, c, zero);                                                     /* NaN: stays NaN through s */
    const vaf q = (c * 1.442695040888963407359924681001892137426645954152985934135449406931f + 12582912.0f)
                  - 12582912.0f;                                                   /* rint: |q| <= 151 */
    vaf s = vfma(q, zero - 0.693145751953125f, d);
    s = vfma(q, zero - 1.428606765330187045e-06f, s);
    vaf u = zero + 0.000198527617612853646278381f;
    u = vfma(u, s, zero + 0.00139304355252534151077271f);
    u = vfma(u, s, zero + 0.00833336077630519866943359f);
    u = vfma(u, s, zero + 0.0416664853692054748535156f);
    u = vfma(u, s, zero + 0.166666671633720397949219f);
    u = vfma(u, s, zero + 0.5f);
    u = 1.0f + vfma(s * s, u, s);
    const vai qi = __builtin_convertvector(q, vai), h = qi >> 1;
    u = (u * (vaf)((vau)(h + 0x7f) << 23)) * (vaf)((vau)(qi - h + 0x7f) << 23);
    u = vsel(d < -104.0f, zero, u);
    return vsel(d > 100.0f, zero + INFINITY, u);
}

void hfp_silu_mul_f32(void* gate, int64_t gate_stride, const void* up, int64_t up_stride, int rows, int n, int threads) {
    const int nt = (int64_t)rows * n >= PAR_ELEMS ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int r = 0; r < rows; ++r) {
        float* g = (float*)gate + (int64_t)r * gate_stride;
        const float* u = (const float*)up + (int64_t)r * up_stride;
        int i = 0;
        for (; i + AW <= n; i += AW) {
            const vaf x = ld_f32v(g + i);
            st_f32v(g + i, (x / (1.0f + sleef_exp(-x))) * ld_f32v(u + i));
        }
        if (i < n) { /* the rest as one vector of lanes, the unused ones zero */
            vaf x = {0}, w = {0};
            for (int j = 0; i + j < n; ++j) x[j] = g[i + j], w[j] = u[i + j];
            const vaf y = (x / (1.0f + sleef_exp(-x))) * w;
            for (int j = 0; i + j < n; ++j) g[i + j] = y[j];
        }
    }
}

void hfp_silu_mul_bf16(void* gate, int64_t gate_stride, const void* up, int64_t up_stride, int rows, int n, int threads) {
    const int nt = (int64_t)rows * n >= PAR_ELEMS ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int r = 0; r < rows; ++r) {
        uint16_t* g = (uint16_t*)gate + (int64_t)r * gate_stride;
        const uint16_t* u = (const uint16_t*)up + (int64_t)r * up_stride;
        int i = 0;
        for (; i + AW <= n; i += AW) st_bf16v(g + i, silu_of(g + i) * ld_bf16v(u + i));
        for (; i < n; ++i) g[i] = f32_to_bf16(bf16_to_f32(silu_table[g[i]]) * bf16_to_f32(u[i]));
    }
}
