/*
 * fp32 linear layers for CPU engine steps: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), with W packed once.
 *
 * W is stored as panels of NR output columns, each panel K-major ([panel][k][NR], zero-padded past N), so a
 * micro-kernel streams one panel front to back while MR rows of x stay in registers as broadcasts and the
 * MR x NR outputs accumulate in registers (6 x 2 vectors: 12 of AVX2's 16 registers, or of AVX-512's 32).
 * Threads split the panels (each reads its share of the weights once; x is shared and small), and a K-block
 * of one panel (at most KC x NR floats; K is cut into equal blocks) stays in L1 while every row block of x
 * passes over it. Batches of more than MC_MAX rows (prefill) go in blocks of MC rows, so the x rows a panel
 * meets stay in L2.
 *
 * The weights come from DRAM once per call, and the hardware prefetchers stop at every 4 KiB page, so while
 * the row blocks compute on one K-block they fetch the next one (it follows in memory, in the same panel or
 * the next): row block j of the first T (a power of two) prefetches the j-th T-th of it, one NR-float row
 * every T k-steps. A single row block (M <= MR, bandwidth-bound) leaves it to the hardware.
 *
 * Every output is summed over k in order 0..K-1, one multiply-add per term (fused where the CPU has FMA),
 * whatever M is: a row's result does not depend on the other rows of the batch.
 *
 * Built and loaded like paged_attention_cpu.c (NATIVE_GEMM in hf_paged/kernels/cpu/native_gemm.py), through ctypes.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "vec_common.h"
/* into L2 (prefetcht1): the next K-block would not fit in L1 beside the current one */
#define PREFETCH(p) __builtin_prefetch((p), 0, 2)

enum { MR = 6, NRV = 2, NR = NRV * VW, KC = 256, MC = 48, MC_MAX = 96 };

int hfp_gemm_nr(void) { return NR; }

/* Rows of 32-bit units (fp32 values, or bf16 pairs) into panels of nr rows: out[p * K * nr + k * nr + j] =
 * W[p * nr + j, k], zero past N. PKB k-steps of a panel at a time go through a tile in L1, so the panel is
 * written front to back (one store per unit at a stride of nr units was twice as slow, start-up's largest C
 * cost); nr is a constant after inlining. */
enum { PKB = 16 };
typedef uint32_t unit32 __attribute__((may_alias));
static inline __attribute__((always_inline)) void pack_panels32(
    const unit32* w, const int64_t ldw, const int N, const int K, const int nr, unit32* out)
{
    const int panels = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        unit32* dst = out + (size_t)p * K * nr;
        const int n0 = p * nr, rows = N - n0 < nr ? N - n0 : nr;
        uint32_t tile[PKB * nr];
        for (int k0 = 0; k0 < K; k0 += PKB) {
            const int kb = K - k0 < PKB ? K - k0 : PKB;
            for (int j = 0; j < nr; ++j) {
                if (j < rows) {
                    const unit32* src = w + (size_t)(n0 + j) * ldw + k0;
                    for (int kk = 0; kk < kb; ++kk) tile[kk * nr + j] = src[kk];
                } else {
                    for (int kk = 0; kk < kb; ++kk) tile[kk * nr + j] = 0;
                }
            }
            memcpy(dst + (size_t)k0 * nr, tile, (size_t)kb * nr * sizeof(uint32_t));
        }
    }
}

/* W [N, K] (row stride ldw) into panels: out[p * K * NR + k * NR + j] = W[p * NR + j, k], zero past N. */
void hfp_gemm_pack(const float* w, int64_t ldw, int N, int K, float* out) {
    pack_panels32((const unit32*)w, ldw, N, K, NR, (unit32*)out);
}

/* C[0:mr, 0:NR] (+)= A[0:mr, 0:kc] @ B[0:kc, 0:NR]; mr is a constant after inlining, so the loops unroll.
 * With pf, one NR-float row from pf onwards is prefetched every 2^pf_shift k-steps. */
static inline __attribute__((always_inline)) void micro(
    const int mr, const int kc, const float* a, const int64_t lda, const float* b, float* c, const int64_t ldc,
    const int first, const float* bias, const float* pf, const int pf_shift)
{
    vf acc[MR][NRV];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NRV; ++j)
            acc[i][j] = first ? (bias ? LD(bias + j * VW) : (vf){0}) : LD(c + i * ldc + j * VW);
#define STEP_K(k)                                                                 \
    do {                                                                          \
        const vf b0 = LD(b + (size_t)(k) * NR), b1 = LD(b + (size_t)(k) * NR + VW); \
        for (int i = 0; i < mr; ++i) {                                            \
            const float ai = a[i * lda + (k)]; /* scalar * vector: a broadcast load */ \
            acc[i][0] += ai * b0;                                                 \
            acc[i][1] += ai * b1;                                                 \
        }                                                                         \
    } while (0)
    if (pf == NULL) {
        for (int k = 0; k < kc; ++k) STEP_K(k);
    } else {
        const int step = 1 << pf_shift;
        for (int k0 = 0; k0 < kc; k0 += step) {
            const float* row = pf + (size_t)(k0 >> pf_shift) * NR;
            for (int l = 0; l < NR; l += 16) PREFETCH(row + l); /* 64-byte lines */
            const int k1 = kc - k0 < step ? kc : k0 + step;
            for (int k = k0; k < k1; ++k) STEP_K(k);
        }
    }
#undef STEP_K
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NRV; ++j) ST(c + i * ldc + j * VW, acc[i][j]);
}

static void micro_any(int mr, int kc, const float* a, int64_t lda, const float* b, float* c, int64_t ldc, int first,
                      const float* bias, const float* pf, int pf_shift) {
    switch (mr) {
    case 6: micro(6, kc, a, lda, b, c, ldc, first, bias, pf, pf_shift); break;
    case 5: micro(5, kc, a, lda, b, c, ldc, first, bias, pf, pf_shift); break;
    case 4: micro(4, kc, a, lda, b, c, ldc, first, bias, pf, pf_shift); break;
    case 3: micro(3, kc, a, lda, b, c, ldc, first, bias, pf, pf_shift); break;
    case 2: micro(2, kc, a, lda, b, c, ldc, first, bias, pf, pf_shift); break;
    default: micro(1, kc, a, lda, b, c, ldc, first, bias, pf, pf_shift); break;
    }
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T + bias (NULL: none), W packed by hfp_gemm_pack. */
int hfp_gemm(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t ldy,
             int M, int N, int K, int num_threads)
{
    const int panels = (N + NR - 1) / NR;
    /* rows per pass over the panels: all of a decode batch; for prefill, blocks whose x rows stay in L2 */
    const int mc = M <= MC_MAX ? M : MC;
    /* K in equal blocks of at most KC (576 -> 3 x 192 rather than 256 + 256 + 64) */
    const int k_blocks = (K + KC - 1) / KC, kb = k_blocks > 0 ? (K + k_blocks - 1) / k_blocks : 1;
    /* row blocks that prefetch the next K-block: the largest power of two <= row blocks per pass */
    const int row_blocks = (mc + MR - 1) / MR;
    int pf_shift = 0;
    while ((2 << pf_shift) <= row_blocks) ++pf_shift;
    const int pf_blocks = 1 << pf_shift;
#pragma omp parallel num_threads(num_threads)
    {
        /* each thread owns a contiguous range of panels (its share of the weights) for every row block */
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int p_lo = (int)((int64_t)panels * t / nt), p_hi = (int)((int64_t)panels * (t + 1) / nt);
        float tile[MR * NR] __attribute__((aligned(64)));
        float bias_tile[NR] __attribute__((aligned(64)));
        for (int m0 = 0; m0 < M; m0 += mc) {
            const int m1 = M - m0 < mc ? M : m0 + mc;
            for (int p = p_lo; p < p_hi; ++p) {
                const int n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
                const float* bp = NULL;
                if (bias) {
                    if (cols == NR) bp = bias + n0;
                    else {
                        memset(bias_tile, 0, sizeof bias_tile);
                        memcpy(bias_tile, bias + n0, cols * sizeof(float));
                        bp = bias_tile;
                    }
                }
                const float* w = packed + (size_t)p * K * NR;
                for (int k0 = 0; k0 < K; k0 += kb) {
                    const int kc = K - k0 < kb ? K - k0 : kb;
                    /* the next K-block (this panel's, else the next panel's first) starts right after this one */
                    const float* next = w + (size_t)(k0 + kc) * NR;
                    const int next_rows = K - k0 - kc > 0 ? (K - k0 - kc < kb ? K - k0 - kc : kb) : kb;
                    for (int i0 = m0, j = 0; i0 < m1; i0 += MR, ++j) {
                        const int mr = m1 - i0 < MR ? m1 - i0 : MR;
                        const float* a = x + (size_t)i0 * ldx + k0;
                        const float* pf = pf_blocks > 1 && j < pf_blocks ? next + (size_t)j * (next_rows >> pf_shift) * NR : NULL;
                        if (cols == NR) {
                            micro_any(mr, kc, a, ldx, w + (size_t)k0 * NR, y + (size_t)i0 * ldy + n0, ldy, k0 == 0, bp, pf, pf_shift);
                        } else { /* the last, partial panel: through a full-width tile */
                            if (k0 > 0)
                                for (int i = 0; i < mr; ++i) memcpy(tile + i * NR, y + (size_t)(i0 + i) * ldy + n0, cols * sizeof(float));
                            micro_any(mr, kc, a, ldx, w + (size_t)k0 * NR, tile, NR, k0 == 0, bp, pf, pf_shift);
                            for (int i = 0; i < mr; ++i) memcpy(y + (size_t)(i0 + i) * ldy + n0, tile + i * NR, cols * sizeof(float));
                        }
                    }
                }
            }
        }
    }
    return 0;
}

/*
 * bf16 weights and activations (CPUs with AVX-512 BF16): the same scheme, with VDPBF16PS, which multiplies
 * 16 pairs of bf16 and adds both products to 16 fp32 lanes. The weight goes in panels of BNR = 48 columns
 * (three vectors; 32 measured ~5% slower) with each column's k pairs side by side ([panel][k/2][column][2];
 * K even, zero past N); the x pair (x[i][2kk], x[i][2kk+1]) is broadcast as one 32-bit value, and BMR x BNR
 * fp32 sums stay in registers over all of K (a panel is K x 96 bytes, ~150 KB at K = 1536: it stays in L2
 * while the row blocks pass over it). The sums are rounded to bf16 (nearest even) once, at the end; bias is
 * added in fp32 first.
 *
 * While one panel computes, its row blocks prefetch the next panel into L2, each an equal share spread over
 * its k-steps: the weights come from DRAM once per call, and this hides most of it. 30 layers' GEMMs of the
 * default model at 64 rows on a Zen 5 host: 19-20 ms with the weights coming from DRAM, against oneDNN's
 * 25.5 (both ~19-20 with them in cache).
 */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_BF16_GEMM 1
enum { BMR = 8, BNV = 3, BNR = 16 * BNV }; /* 8 x 3 = 24 accumulators (of 32 registers): 24 VDPBF16PS per 11 loads */
typedef int32_t pair_t __attribute__((may_alias, aligned(2)));

static inline __m256i round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); /* NaN stays NaN (quiet) */
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* y[0:mr, 0:cols] = round(bias + A[0:mr, 0:2kp] @ panel); pf_lines 64-byte lines from pf prefetched on the way */
static inline __attribute__((always_inline)) void micro_bf16(
    const int mr, const int kp, const uint16_t* a, const int64_t lda, const uint16_t* b, uint16_t* y, const int64_t ldy,
    const int cols, const float* bias, const char* pf, const int pf_lines)
{
    __m512 acc[BMR][BNV];
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < BNV; ++v) acc[i][v] = bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
    const char* pf_next = pf;
    int pf_due = 0; /* pf_lines per kp k-steps, in integer steps: a line each time pf_due passes kp */
    for (int kk = 0; kk < kp; ++kk) {
        __m512bh bv[BNV];
        for (int v = 0; v < BNV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + (size_t)kk * 2 * BNR + 32 * v);
        for (int i = 0; i < mr; ++i) {
            const __m512bh ai = (__m512bh)_mm512_set1_epi32(*(const pair_t*)(a + i * lda + 2 * kk));
            for (int v = 0; v < BNV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], ai, bv[v]);
        }
        if (pf != NULL)
            for (pf_due += pf_lines; pf_due >= kp; pf_due -= kp, pf_next += 64) __builtin_prefetch(pf_next, 0, 2);
    }
    __mmask16 mask[BNV];
    for (int v = 0; v < BNV; ++v) {
        const int c = cols - 16 * v;
        mask[v] = c >= 16 ? (__mmask16)0xffff : c <= 0 ? (__mmask16)0 : (__mmask16)((1u << c) - 1u);
    }
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < BNV; ++v) _mm256_mask_storeu_epi16(y + i * ldy + 16 * v, mask[v], round_bf16(acc[i][v]));
}

static void micro_bf16_any(int mr, int kp, const uint16_t* a, int64_t lda, const uint16_t* b, uint16_t* y, int64_t ldy,
                           int cols, const float* bias, const char* pf, int pf_lines) {
    switch (mr) {
#define MICRO_CASE(R) case R: micro_bf16(R, kp, a, lda, b, y, ldy, cols, bias, pf, pf_lines); break;
    MICRO_CASE(8) MICRO_CASE(7) MICRO_CASE(6) MICRO_CASE(5) MICRO_CASE(4) MICRO_CASE(3) MICRO_CASE(2)
    default: micro_bf16(1, kp, a, lda, b, y, ldy, cols, bias, pf, pf_lines); break;
#undef MICRO_CASE
    }
}
#else
#define HAVE_BF16_GEMM 0
enum { BNR = 48 };
#endif

/*
 * The same panels on CPUs with AMX-BF16 (the OS granting the tile state): the panel layout is already AMX's
 * B operand, 16 k pairs of 16 columns being a 1 KiB tile at a row stride of BNR pairs, so a 16-row tile of x
 * (32 k, straight from its rows) times the panel's three column tiles is three TDPBF16PS. A thread takes its
 * share of the panels in order and passes every 16-row tile of x over each (the panel stays in L2 from the first
 * pass), prefetching its next panel into L2 in equal shares over the passes: at decode's 16-64 rows the weights
 * stream from DRAM once, which is the whole cost. K past the last multiple of 32 (an even tail) is added to the
 * tile sums with VDPBF16PS, then the fp32 sums + bias are rounded to bf16 once, as above. A row's sums do not
 * depend on the other rows (an AMX row is its own dot products), so the batch-independence holds here too.
 */
#if HAVE_BF16_GEMM && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_GEMM 1
struct tile_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static int amx_granted(void) { /* asked once: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
    static int state = 0;  /* 0 unknown, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state == 1;
}

/* tiles 0-2: C, rows x 16 fp32; 3: A, rows x 32 bf16 (x); 4-6: B, 16 k pairs x 16 columns (the panel) */
static void amx_rows(int rows) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; ++t) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
    for (int t = 4; t < 7; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* c[0:mr][0:BNR] = x[0:mr, 0:K] @ panel, fp32 (row stride BNR); the tile rows configured = mr; kb32 = K / 32 */
static inline void amx_panel(const int mr, const uint16_t* x, const int64_t ldx, const uint16_t* w, const int kb32,
                             const int kp, float* c, const char* pf, const int pf_lines) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    const char* pf_next = pf;
    int pf_due = 0;
    for (int b = 0; b < kb32; ++b) {
        const uint16_t* wb = w + (size_t)b * 16 * BNR * 2;
        _tile_loadd(3, x + 32 * b, ldx * 2);
        _tile_loadd(4, wb, BNR * 4);
        _tile_dpbf16ps(0, 3, 4);
        _tile_loadd(5, wb + 32, BNR * 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_loadd(6, wb + 64, BNR * 4);
        _tile_dpbf16ps(2, 3, 6);
        if (pf != NULL)
            for (pf_due += pf_lines; pf_due >= kb32; pf_due -= kb32, pf_next += 64) __builtin_prefetch(pf_next, 0, 2);
    }
    _tile_stored(0, c, BNR * 4);
    _tile_stored(1, c + 16, BNR * 4);
    _tile_stored(2, c + 32, BNR * 4);
    for (int kk = 16 * kb32; kk < kp; ++kk) { /* the even tail of K */
        __m512bh bv[BNV];
        for (int v = 0; v < BNV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(w + (size_t)kk * 2 * BNR + 32 * v);
        for (int i = 0; i < mr; ++i) {
            const __m512bh ai = (__m512bh)_mm512_set1_epi32(*(const pair_t*)(x + i * ldx + 2 * kk));
            for (int v = 0; v < BNV; ++v)
                _mm512_storeu_ps(c + i * BNR + 16 * v, _mm512_dpbf16_ps(_mm512_loadu_ps(c + i * BNR + 16 * v), ai, bv[v]));
        }
    }
}

static void amx_gemm(const uint16_t* x, int64_t ldx, const uint16_t* packed, const float* bias, uint16_t* y,
                     int64_t ldy, int M, int N, int K, int num_threads) {
    const int panels = (N + BNR - 1) / BNR, kp = K / 2, kb32 = K / 32;
    const size_t panel_elems = (size_t)kp * BNR * 2;
    const int lines = (int)(panel_elems * 2 / 64);
    /* prefill: x in chunks of ~1 MiB of rows, so the rows a panel meets stay in L2 beside it */
    int mc = (int)((1 << 20) / ((int64_t)K * 2)) / 16 * 16;
    if (mc < 64) mc = 64;
#pragma omp parallel num_threads(num_threads)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int p_lo = (int)((int64_t)panels * t / nt), p_hi = (int)((int64_t)panels * (t + 1) / nt);
        float c[16 * BNR] __attribute__((aligned(64)));
        int configured = 0;
        for (int m0 = 0; m0 < M; m0 += mc) {
            const int m1 = M - m0 < mc ? M : m0 + mc, tiles = (m1 - m0 + 15) / 16;
            for (int p = p_lo; p < p_hi; ++p) {
                const int n0 = p * BNR, cols = N - n0 < BNR ? N - n0 : BNR;
                const uint16_t* w = packed + (size_t)p * panel_elems;
                const char* next = p + 1 < p_hi ? (const char*)(w + panel_elems) : NULL;
                __mmask16 mask[BNV];
                for (int v = 0; v < BNV; ++v) {
                    const int r = cols - 16 * v;
                    mask[v] = r >= 16 ? (__mmask16)0xffff : r <= 0 ? (__mmask16)0 : (__mmask16)((1u << r) - 1u);
                }
                for (int j = 0; j < tiles; ++j) {
                    const int i0 = m0 + 16 * j, mr = m1 - i0 < 16 ? m1 - i0 : 16;
                    if (mr != configured) amx_rows(mr), configured = mr;
                    const int lo = (int)((int64_t)lines * j / tiles), hi = (int)((int64_t)lines * (j + 1) / tiles);
                    amx_panel(mr, x + (size_t)i0 * ldx, ldx, w, kb32, kp, c, next ? next + (size_t)lo * 64 : NULL, hi - lo);
                    for (int i = 0; i < mr; ++i)
                        for (int v = 0; v < BNV; ++v) {
                            __m512 s = _mm512_load_ps(c + i * BNR + 16 * v);
                            if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask[v], bias + n0 + 16 * v));
                            _mm256_mask_storeu_epi16(y + (size_t)(i0 + i) * ldy + n0 + 16 * v, mask[v], round_bf16(s));
                        }
                }
            }
        }
        if (configured) _tile_release();
    }
}
#else
#define HAVE_AMX_GEMM 0
#endif

/* whether hfp_gemm_bf16 runs on AMX tiles here (this build has them, and the OS grants the tile state) */
int hfp_gemm_bf16_amx(void) {
#if HAVE_AMX_GEMM
    return amx_granted();
#else
    return 0;
#endif
}

/* whether this build has the bf16 GEMM (AVX-512 BF16), and its panel width */
int hfp_gemm_bf16_ok(void) { return HAVE_BF16_GEMM; }
int hfp_gemm_bf16_nr(void) { return BNR; }

/* W [N, K] bf16 (row stride ldw, K even) into the bf16 panels: out[((p * K/2 + kk) * BNR + j) * 2 + h] =
 * W[p * BNR + j, 2 kk + h], zero past N. */
void hfp_gemm_bf16_pack(const uint16_t* w, int64_t ldw, int N, int K, uint16_t* out) {
    if ((uintptr_t)w % 4 == 0 && ldw % 2 == 0) { /* rows of whole (2 kk, 2 kk + 1) pairs: 32-bit units */
        pack_panels32((const unit32*)w, ldw / 2, N, K / 2, BNR, (unit32*)out);
        return;
    }
    const int panels = (N + BNR - 1) / BNR, kp = K / 2;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        uint16_t* dst = out + (size_t)p * kp * BNR * 2;
        for (int j = 0; j < BNR; ++j) {
            const int n = p * BNR + j;
            for (int kk = 0; kk < kp; ++kk)
                for (int h = 0; h < 2; ++h)
                    dst[((size_t)kk * BNR + j) * 2 + h] = n < N ? w[(size_t)n * ldw + 2 * kk + h] : 0;
        }
    }
}

/* y[M, N] bf16 (row stride ldy) = x[M, K] bf16 (row stride ldx) @ W^T + bias (fp32, NULL: none), W packed by
 * hfp_gemm_bf16_pack; K even. -1 (nothing done) where this build has no bf16 GEMM. */
int hfp_gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed, const float* bias, uint16_t* y, int64_t ldy,
                  int M, int N, int K, int num_threads)
{
#if HAVE_BF16_GEMM
    if (K % 2) return -1;
#if HAVE_AMX_GEMM
    if (amx_granted()) {
        amx_gemm(x, ldx, packed, bias, y, ldy, M, N, K, num_threads);
        return 0;
    }
#endif
    const int panels = (N + BNR - 1) / BNR, kp = K / 2;
    const size_t panel_elems = (size_t)kp * BNR * 2;
    const int mc = M <= MC_MAX ? M : MC;
#pragma omp parallel num_threads(num_threads)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int p_lo = (int)((int64_t)panels * t / nt), p_hi = (int)((int64_t)panels * (t + 1) / nt);
        float bias_tile[BNR] __attribute__((aligned(64)));
        for (int m0 = 0; m0 < M; m0 += mc) {
            const int m1 = M - m0 < mc ? M : m0 + mc;
            const int row_blocks = (m1 - m0 + BMR - 1) / BMR;
            for (int p = p_lo; p < p_hi; ++p) {
                const int n0 = p * BNR, cols = N - n0 < BNR ? N - n0 : BNR;
                const float* bp = NULL;
                if (bias) {
                    for (int j = 0; j < BNR; ++j) bias_tile[j] = j < cols ? bias[n0 + j] : 0.0f;
                    bp = bias_tile;
                }
                const uint16_t* w = packed + (size_t)p * panel_elems;
                /* the next panel of this thread (this row block pass), in equal shares of its lines */
                const char* next = p + 1 < p_hi ? (const char*)(w + panel_elems) : NULL;
                const int lines = (int)(panel_elems * 2 / 64);
                for (int i0 = m0, j = 0; i0 < m1; i0 += BMR, ++j) {
                    const int mr = m1 - i0 < BMR ? m1 - i0 : BMR;
                    const int lo = (int)((int64_t)lines * j / row_blocks), hi = (int)((int64_t)lines * (j + 1) / row_blocks);
                    micro_bf16_any(mr, kp, x + (size_t)i0 * ldx, ldx, w, y + (size_t)i0 * ldy + n0, ldy, cols, bp,
                                   next ? next + (size_t)lo * 64 : NULL, hi - lo);
                }
            }
        }
    }
    return 0;
#else
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
#endif
}
