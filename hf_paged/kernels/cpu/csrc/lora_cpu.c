/*
 * Multi-LoRA deltas on the CPU, one call per linear (punica's "bgmv" per token): for every token t whose slot
 * s = token_slot[t] is >= 0 (-1: a base row, skipped) and whose slot's rank r = ranks[s] is > 0,
 *
 *     y[t] += scale[s] * ((A[s][:r] @ x[t]) @ Bt[s][:r])          (Bt = B transposed: B[s][:, :r] @ h)
 *
 * in PEFT's order: the shrink h = A x, the expand d = B h, then the scale, then the add into y (in place; y may
 * be a column view of a group GEMM's output: its row stride is an argument). A is the slot's stacked
 * [L, R, in] and Bt its [L, R, out] (R: the padded rank, zeros past each slot's rank; B kept transposed so the
 * expand runs along contiguous output columns); only the slot's own rank is computed. bf16 rounds what PEFT's
 * bf16 modules round: h, d, d * scale and the sum.
 *
 * Tokens are grouped by slot (a counting sort per call) and taken up to four at a time, so a group shares each
 * load of A and Bt. The shrink keeps eight dot products in flight (rows x tokens) and reduces the eight at
 * once; the expand keeps up to 64 output columns per token in registers over the rank, one load of a Bt row
 * serving every token of the group. A call with little work runs on one thread; else the tokens are split over
 * the threads, or, with fewer tokens than that, the output columns (each thread then computes the small shrink
 * of every token itself, so no thread waits on another).
 *
 * AVX2 + FMA where the compiler's target has them, else a portable scalar loop (the same order of the
 * operations per token, so the results differ only in the sums' order). Built and loaded like the other
 * kernels (hf_paged/kernels/cpu/native.py), called through ctypes (hf_paged/kernels/cpu/lora_ops.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_AVX2 1
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };
#define GMAX 4          /* tokens of one slot computed together */
#define RMAX_STACK 256  /* padded ranks up to this keep h on the stack (larger: malloc) */
/* below this many multiply-adds (sum over the adapter tokens of r * (in + out)) one thread does the call */
#define PAR_WORK (1 << 17)

#include "bf16_common.h"

static inline float ld1(const void* p, int64_t i, int dt) {
    return dt == DT_F32 ? ((const float*)p)[i] : bf16_to_f32(((const uint16_t*)p)[i]);
}

static inline float rnd(float x, int dt) { return dt == DT_F32 ? x : bf16_to_f32(f32_to_bf16(x)); }

static inline void st1(void* p, int64_t i, int dt, float x) {
    if (dt == DT_F32) ((float*)p)[i] = x;
    else ((uint16_t*)p)[i] = f32_to_bf16(x);
}

static inline int64_t elem(int dt) { return dt == DT_F32 ? 4 : 2; }

typedef struct {
    const char* x; int64_t ldx;   /* [T, in], row stride in elements */
    const char* a; const char* b; /* A [L, R, in], Bt [L, R, out] */
    char* y; int64_t ldy;         /* [T, out] */
    const float* scales; const int32_t* ranks;
    int in, out, R, dt;
} Args;

#ifdef LORA_AVX2
static inline __m256 ld8(const char* p, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline __m256 rnd8(__m256 v, int dt) {
    if (dt == DT_F32) return v;
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

/* lane i of the result = the sum of the lanes of v[i] */
static inline __m256 sum8x8(const __m256* v) {
    const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 lo4 = _mm256_hadd_ps(s01, s23), hi4 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20), _mm256_permute2f128_ps(lo4, hi4, 0x31));
}
#endif

#ifdef LORA_AVX2
/* h[g][j0:j0+8/GS] for GS tokens (constant: the accumulators stay in registers), eight dot products in flight */
static inline __attribute__((always_inline)) void shrink_block(const char* a, int64_t in, int r, int j0,
                                                                const char* const* xg, int G, float* h,
                                                                int hstride, int dt, const int GS) {
    const int rows = 8 / GS;
    const int64_t es = elem(dt);
    const char* ar[8];
    for (int i = 0; i < rows; ++i) ar[i] = a + (int64_t)(j0 + i < r ? j0 + i : j0) * in * es;  /* past r: dropped */
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= in; k += 8) {
        __m256 xv[4];  /* fixed sizes (not GS): an array sized by a parameter is a VLA, kept in memory */
        for (int g = 0; g < GS; ++g) xv[g] = ld8(xg[g] + k * es, dt);
        for (int i = 0; i < rows; ++i) {
            const __m256 av = ld8(ar[i] + k * es, dt);
            for (int g = 0; g < GS; ++g) acc[i * GS + g] = _mm256_fmadd_ps(av, xv[g], acc[i * GS + g]);
        }
    }
    float sums[8];
    _mm256_storeu_ps(sums, sum8x8(acc));
    for (int i = 0; i < rows && j0 + i < r; ++i)
        for (int g = 0; g < G; ++g) {
            float s = sums[i * GS + g];
            for (int64_t kk = k; kk < in; ++kk) s += ld1(ar[i], kk, dt) * ld1(xg[g], kk, dt);
            h[g * hstride + j0 + i] = rnd(s, dt);
        }
}
#endif

/* h[g][0:r] = A[s][0:r] @ x[tok[g]] for the G tokens of one slot (zeros from r to the next multiple of 8) */
static inline __attribute__((always_inline)) void shrink(const Args* p, const char* a, int r, const int* tok,
                                                          int G, float* h, int hstride, int dt) {
    const int64_t es = elem(dt), in = p->in;
    const char* xr[GMAX];
    for (int g = 0; g < GMAX; ++g) xr[g] = p->x + (int64_t)tok[g < G ? g : G - 1] * p->ldx * es;  /* 3 as 4 */
#ifdef LORA_AVX2
    /* eight accumulators: rows x tokens = 8 x 1, 4 x 2 or 2 x 4 */
    if (G == 1)
        for (int j0 = 0; j0 < r; j0 += 8) shrink_block(a, in, r, j0, xr, G, h, hstride, dt, 1);
    else if (G == 2)
        for (int j0 = 0; j0 < r; j0 += 4) shrink_block(a, in, r, j0, xr, G, h, hstride, dt, 2);
    else
        for (int j0 = 0; j0 < r; j0 += 2) shrink_block(a, in, r, j0, xr, G, h, hstride, dt, 4);
#else
    for (int g = 0; g < G; ++g)
        for (int j = 0; j < r; ++j) {
            const char* ar = a + (int64_t)j * in * es;
            float s = 0.f;
            for (int64_t k = 0; k < in; ++k) s += ld1(ar, k, dt) * ld1(xr[g], k, dt);
            h[g * hstride + j] = rnd(s, dt);
        }
#endif
    for (int g = 0; g < G; ++g)
        for (int j = r; j < ((r + 7) & ~7); ++j) h[g * hstride + j] = 0.f;
}

#ifdef LORA_AVX2
/* y[tok[g]][o:o+8NV] += scale * (h[g] @ Bt[0:r, o:o+8NV]) for GS tokens: GS x NV accumulators in registers, one
 * load of Bt per vector shared by the tokens, h[g][c] broadcast */
static inline __attribute__((always_inline)) void expand_block(const char* bt, int64_t out, int r, __m256 sv,
                                                                char* const* yr, const float* h, int hstride,
                                                                int64_t o, int dt, const int GS, const int NV) {
    const int64_t es = elem(dt);
    __m256 acc[8];  /* GS * NV <= 8; fixed sizes keep them in registers (a VLA would not) */
    for (int i = 0; i < GS * NV; ++i) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < r; ++c) {
        const char* row = bt + ((int64_t)c * out + o) * es;
        __m256 bv[8];
        for (int v = 0; v < NV; ++v) bv[v] = ld8(row + (int64_t)v * 8 * es, dt);
        for (int g = 0; g < GS; ++g) {
            const __m256 hv = _mm256_broadcast_ss(h + g * hstride + c);
            for (int v = 0; v < NV; ++v) acc[g * NV + v] = _mm256_fmadd_ps(bv[v], hv, acc[g * NV + v]);
        }
    }
    for (int g = 0; g < GS; ++g)
        for (int v = 0; v < NV; ++v) {
            /* PEFT's order: d rounded (bf16), times the scale, rounded, then added */
            const __m256 d = rnd8(_mm256_mul_ps(rnd8(acc[g * NV + v], dt), sv), dt);
            const int64_t oo = o + 8 * v;
            if (dt == DT_F32) {
                float* yp = (float*)yr[g] + oo;
                _mm256_storeu_ps(yp, _mm256_add_ps(_mm256_loadu_ps(yp), d));
            } else {
                uint16_t* yp = (uint16_t*)yr[g] + oo;
                const __m256 sum = rnd8(_mm256_add_ps(ld8((const char*)yp, DT_BF16), d), DT_BF16);
                /* rounded already: the high halves are the bf16 values */
                const __m256i w = _mm256_srli_epi32(_mm256_castps_si256(sum), 16);
                const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
                _mm_storeu_si128((__m128i*)yp, packed);
            }
        }
}
#endif

/* y[tok[g]][o0:o1] += scale * (h[g] @ Bt[s][0:r, o0:o1]) for the G tokens of one slot (Bt: B transposed) */
static inline __attribute__((always_inline)) void expand(const Args* p, const char* bt, int r, float scale,
                                                          const int* tok, int G, const float* h, int hstride,
                                                          int o0, int o1, int dt) {
    const int64_t es = elem(dt), out = p->out;
    char* yr[GMAX];
    for (int g = 0; g < G; ++g) yr[g] = p->y + (int64_t)tok[g] * p->ldy * es;
    int64_t o = o0;
#ifdef LORA_AVX2
    const __m256 sv = _mm256_set1_ps(scale);
    if (G == 1) {
        for (; o + 64 <= o1; o += 64) expand_block(bt, out, r, sv, yr, h, hstride, o, dt, 1, 8);
        for (; o + 8 <= o1; o += 8) expand_block(bt, out, r, sv, yr, h, hstride, o, dt, 1, 1);
    } else if (G == 2) {
        for (; o + 32 <= o1; o += 32) expand_block(bt, out, r, sv, yr, h, hstride, o, dt, 2, 4);
        for (; o + 8 <= o1; o += 8) expand_block(bt, out, r, sv, yr, h, hstride, o, dt, 2, 1);
    } else {  /* 3 or 4 tokens: one of the two blocks twice, or pairs */
        const int64_t start = o;
        for (int g0 = 0; g0 < G; g0 += 2) {
            const int pair = G - g0 >= 2;
            for (o = start; o + 32 <= o1; o += 32)
                if (pair) expand_block(bt, out, r, sv, yr + g0, h + g0 * hstride, hstride, o, dt, 2, 4);
                else expand_block(bt, out, r, sv, yr + g0, h + g0 * hstride, hstride, o, dt, 1, 4);
            for (; o + 8 <= o1; o += 8)
                if (pair) expand_block(bt, out, r, sv, yr + g0, h + g0 * hstride, hstride, o, dt, 2, 1);
                else expand_block(bt, out, r, sv, yr + g0, h + g0 * hstride, hstride, o, dt, 1, 1);
        }
    }
#endif
    for (int g = 0; g < G; ++g)  /* the columns past the last whole vector (all of them without AVX2) */
        for (int64_t oo = o; oo < o1; ++oo) {
            float s = 0.f;
            for (int c = 0; c < r; ++c) s += h[g * hstride + c] * ld1(bt, (int64_t)c * out + oo, dt);
            st1(yr[g], oo, dt, ld1(yr[g], oo, dt) + rnd(rnd(s, dt) * scale, dt));
        }
}

/* the tokens order[lo:hi) (sorted by slot), output columns o0:o1 */
static inline __attribute__((always_inline)) void run_range(const Args* p, const int32_t* token_slot,
                                                             const int* order, int lo, int hi, int o0, int o1,
                                                             float* h, int hstride, int dt) {
    const int64_t es = elem(dt);
    int i = lo;
    while (i < hi) {
        const int s = token_slot[order[i]];
        int G = 1;
        while (G < GMAX && i + G < hi && token_slot[order[i + G]] == s) ++G;
        const int r = p->ranks[s];
        const char* a = p->a + (int64_t)s * p->R * p->in * es;
        const char* bt = p->b + (int64_t)s * p->R * p->out * es;
        shrink(p, a, r, order + i, G, h, hstride, dt);
        expand(p, bt, r, p->scales[s], order + i, G, h, hstride, o0, o1, dt);
        i += G;
    }
}

typedef void (*RunFn)(const Args*, const int32_t*, const int*, int, int, int, int, float*, int);

static void run_f32(const Args* p, const int32_t* ts, const int* order, int lo, int hi, int o0, int o1, float* h,
                    int hs) {
    run_range(p, ts, order, lo, hi, o0, o1, h, hs, DT_F32);
}

static void run_bf16(const Args* p, const int32_t* ts, const int* order, int lo, int hi, int o0, int o1, float* h,
                     int hs) {
    run_range(p, ts, order, lo, hi, o0, o1, h, hs, DT_BF16);
}

/*
 * Add the LoRA deltas of T tokens into y (see the top of the file). x [T, in] (row stride ldx), a [L, R, in],
 * bt [L, R, out] contiguous (B transposed), token_slot int32 [T] (-1: none), scales fp32 [L], ranks int32 [L]
 * (0: the slot leaves this linear alone), y [T, out] (row stride ldy); dt 0 = fp32, 1 = bf16 (x, a, bt and y
 * alike).
 * Returns 0, or -1 for arguments it does not take (a rank above R, an unknown dtype) or out of memory.
 */
int hfp_lora_bgmv(const void* x, int64_t ldx, const void* a, const void* bt, const int32_t* token_slot,
                  const float* scales, const int32_t* ranks, void* y, int64_t ldy, int T, int L, int in, int out,
                  int R, int dt, int num_threads) {
    if ((dt != DT_F32 && dt != DT_BF16) || R <= 0 || T <= 0) return T <= 0 ? 0 : -1;
    /* -- the adapter tokens, sorted by slot (counting sort; batch order within a slot) -- */
    int count[65] = {0};
    int* cnt = L <= 64 ? count : calloc((size_t)L + 1, sizeof(int));
    int stack_order[256];
    int* order = T <= 256 ? stack_order : malloc((size_t)T * sizeof(int));
    int64_t work = 0;
    int n = cnt && order ? 0 : -1;
    for (int t = 0; t < T && n >= 0; ++t) {
        const int s = token_slot[t];
        if (s >= 0 && s < L && ranks[s] > 0) {
            if (ranks[s] > R) { n = -1; break; }
            ++cnt[s + 1], ++n;
            work += (int64_t)ranks[s] * (in + out);
        }
    }
    if (n > 0) {
        for (int s = 0; s < L; ++s) cnt[s + 1] += cnt[s];
        for (int t = 0; t < T; ++t) {
            const int s = token_slot[t];
            if (s >= 0 && s < L && ranks[s] > 0) order[cnt[s]++] = t;
        }
        const Args p = {(const char*)x, ldx, (const char*)a, (const char*)bt, (char*)y, ldy, scales, ranks,
                        in, out, R, dt};
        const RunFn run = dt == DT_F32 ? run_f32 : run_bf16;
        const int hs = (R + 7) & ~7;
        const int nt = work < PAR_WORK || num_threads < 1 ? 1 : num_threads;
        if (nt == 1) {
            float stack_h[GMAX * (RMAX_STACK + 8)];
            float* h = hs <= RMAX_STACK + 8 ? stack_h : malloc(sizeof(float) * GMAX * hs);
            if (h) run(&p, token_slot, order, 0, n, 0, out, h, hs);
            else n = -1;
            if (h != stack_h) free(h);
        } else {
            int failed = 0;
#pragma omp parallel num_threads(nt)
            {
                const int k = omp_get_num_threads(), t = omp_get_thread_num();
                float stack_h[GMAX * (RMAX_STACK + 8)];
                float* h = hs <= RMAX_STACK + 8 ? stack_h : malloc(sizeof(float) * GMAX * hs);
                if (!h) {
#pragma omp atomic write
                    failed = 1;
                } else                if (n >= 2 * k) {  /* tokens split over the threads */
                    const int lo = (int)((int64_t)n * t / k), hi = (int)((int64_t)n * (t + 1) / k);
                    run(&p, token_slot, order, lo, hi, 0, out, h, hs);
                } else {  /* few tokens: output columns split (blocks of 8), each thread doing every shrink */
                    const int blocks = (out + 7) / 8;
                    const int c0 = 8 * (int)((int64_t)blocks * t / k), c1 = 8 * (int)((int64_t)blocks * (t + 1) / k);
                    if (c0 < c1) run(&p, token_slot, order, 0, n, c0, c1 < out ? c1 : out, h, hs);
                }
                if (h && h != stack_h) free(h);
            }
            if (failed) n = -1;
        }
    }
    if (cnt && cnt != count) free(cnt);
    if (order && order != stack_order) free(order);
    return n < 0 ? -1 : 0;
}

/* hfp_lora_bgmv's arguments but the per-step ones, kept by a caller that replays the call (the native decode
 * program): three ctypes arguments a call instead of sixteen (~1 us less per linear at batch 1) */
typedef struct {
    const void* x; int64_t ldx; const void* a; const void* bt; const float* scales; const int32_t* ranks;
    void* y; int64_t ldy; int32_t L, in, out, R, dt, num_threads;
} LoraCall;

int hfp_lora_bgmv_call(const LoraCall* c, const int32_t* token_slot, int T) {
    return hfp_lora_bgmv(c->x, c->ldx, c->a, c->bt, token_slot, c->scales, c->ranks, c->y, c->ldy, T, c->L, c->in,
                         c->out, c->R, c->dt, c->num_threads);
}
