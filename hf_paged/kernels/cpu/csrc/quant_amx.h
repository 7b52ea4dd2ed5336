/*
 * Batches above 16 rows with int8 activations on CPUs with AMX-INT8 (included by quant_q8.c): each 16 x 16 tile of
 * outputs (16 weight rows by 16 x rows) takes one TDPBSSD per 32-weight block, A = the 16 weight rows' int8 quants
 * (nibbles widened to bytes first: 0..15), B = the 16 x rows' quants in AMX's VNNI layout; the exact int32 block
 * sums are then scaled by d_w * d_x (and the 4-bit formats add m_w * d_x * sum(q_x), Q4_0's m = -8 d) into fp32
 * sums, the operations and order of the vector paths (quant_q8.c's tile, the rows8 kernel): a row's bits do not
 * depend on which of them its batch takes. Linux asks the kernel for the AMX state once (arch_prctl); where it refuses,
 * the vector path serves.
 */
#if HAVE_AMX_TILE && defined(__AMX_INT8__)
#define HAVE_AMX 1

enum { AT = 16, AG = 4 }; /* tile: 16 weight rows by 16 x rows; blocks in flight */

static void amx_configure(void) {
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < AG; ++t) c.rows[t] = AT, c.colsb[t] = AT * 4; /* C: int32 [16 weight rows][16 x rows] */
    for (int t = 4; t < 6; ++t) c.rows[t] = AT, c.colsb[t] = QK;      /* A: int8 [16 weight rows][32] */
    for (int t = 6; t < 8; ++t) c.rows[t] = QK / 4, c.colsb[t] = AT * 4; /* B: int8 [8][16 x rows x 4] */
    _tile_loadconfig(&c);
}

/* x quants of row tiles into B's layout: xb[((t * nb + b) * 8 + k4) * 64 + j * 4 + u] = q[16 t + j][32 b + 4 k4 + u],
 * zero past M; dxt / xst[(t * nb + b) * 16 + j] = the x block scale / d * sum(q) of row 16 t + j (zero past M) */
static void amx_pack_x(const int8_t* q, const float* d, const float* s, int M, int K, int8_t* xb, float* dxt, float* xst) {
    const int nb = K / QK, tiles = (M + AT - 1) / AT;
    for (int t = 0; t < tiles; ++t)
        for (int b = 0; b < nb; ++b) {
            int32_t* dst = (int32_t*)(xb + (size_t)(t * nb + b) * QK * AT);
            for (int j = 0; j < AT; ++j) {
                const int i = t * AT + j;
                for (int k4 = 0; k4 < QK / 4; ++k4) {
                    int32_t v = 0;
                    if (i < M) memcpy(&v, q + (size_t)i * K + b * QK + 4 * k4, 4);
                    dst[k4 * AT + j] = v;
                }
                dxt[(t * nb + b) * AT + j] = i < M ? d[(size_t)i * nb + b] : 0.0f;
                xst[(t * nb + b) * AT + j] = i < M ? s[(size_t)i * nb + b] : 0.0f;
            }
        }
}

/* one tile of weight rows n0..n0+nr as int8 [nb][16][32] (zero rows past nr), their d [nb][16] and m [nb][16] */
static void amx_pack_w(int fmt, const uint8_t* w, size_t row_bytes, int nr, int nb, int8_t* a, float* dw, float* mw) {
    const int bb = block_bytes(fmt), off = quant_offset(fmt);
    /* the next tile's bytes follow these: fetch them while this tile computes (the rows are read in order) */
    for (size_t l = 0; l < AT * row_bytes; l += 64) __builtin_prefetch(w + AT * row_bytes + l, 0, 3);
    for (int r = 0; r < AT; ++r)
        for (int b = 0; b < nb; ++b) {
            int8_t* dst = a + ((size_t)b * AT + r) * QK;
            const uint8_t* blk = w + r * row_bytes + (size_t)b * bb;
            if (r >= nr) {
                memset(dst, 0, QK);
                dw[b * AT + r] = mw[b * AT + r] = 0.0f;
                continue;
            }
            if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
                _mm256_storeu_si256((__m256i*)dst, nibbles(_mm_loadu_si128((const __m128i*)(blk + off))));
            } else {
                memcpy(dst, blk + off, QK);
            }
            dw[b * AT + r] = fmt == FMT_INT8 ? 1.0f : h2f(blk);
            mw[b * AT + r] = block_m(fmt, blk);
        }
}

/* acc[r] (lanes: x rows) += block sums c[u][r] of blocks g..g+cnt scaled by d_w * d_x (+ m_w * d_x * sum(q_x)) */
static inline void amx_scale(int fmt, const int32_t* c, int g, int cnt, int nr, const float* dxt, const float* xst,
                             const float* dw, const float* mw, __m512* acc) {
    for (int u = 0; u < cnt; ++u) {
        const int b = g + u;
        const __m512 dx = _mm512_loadu_ps(dxt + (size_t)b * AT), xs = _mm512_loadu_ps(xst + (size_t)b * AT);
        for (int r = 0; r < nr; ++r) {
            const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512(c + (u * AT + r) * AT));
            acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(dx, _mm512_set1_ps(dw[b * AT + r])), acc[r]);
            if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) acc[r] = _mm512_fmadd_ps(xs, _mm512_set1_ps(mw[b * AT + r]), acc[r]);
        }
    }
}

/* the weight tile from the rows8 copy instead (quant_q8_rows8.h) */
static void amx_pack_w_rows8(int fmt, const uint8_t* wi, int nb, int N, int n0, int8_t* a, float* dw, float* mw);

/* y as hfq8_linear, from x already quantized (q, d, s), on the GGUF blocks w or (rows8) the interleaved copy of
 * quant_q8_rows8.h; -2 when scratch cannot be allocated */
static int amx_linear(const int8_t* q, const float* d, const float* s, const uint8_t* w, int fmt, int rows8,
                      const float* scales, const float* bias, float* y, int64_t ldy, int M, int N, int K,
                      int num_threads) {
    const int nb = K / QK, xtiles = (M + AT - 1) / AT, wtiles = (N + AT - 1) / AT;
    const size_t row_bytes = (size_t)nb * block_bytes(fmt);
    int8_t* xb = aligned_alloc(64, (size_t)xtiles * nb * QK * AT);
    float* dxt = malloc(sizeof(float) * 2 * (size_t)xtiles * nb * AT);
    if (xb == NULL || dxt == NULL) {
        free(xb), free(dxt);
        return -2;
    }
    float* xst = dxt + (size_t)xtiles * nb * AT;
    amx_pack_x(q, d, s, M, K, xb, dxt, xst);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int8_t* a = aligned_alloc(64, (size_t)nb * AT * QK);
        float* dw = malloc(sizeof(float) * 2 * (size_t)nb * AT);
        if (a == NULL || dw == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            amx_configure();
        }
        float* mw = dw + (size_t)nb * AT;
        int32_t c[2][AG * AT * AT] __attribute__((aligned(64))); /* two groups' block sums */
#pragma omp for schedule(static)
        for (int wt = 0; wt < wtiles; ++wt) {
            if (a == NULL || dw == NULL) continue;
            const int n0 = wt * AT, nr = N - n0 < AT ? N - n0 : AT;
            if (rows8) amx_pack_w_rows8(fmt, w, nb, N, n0, a, dw, mw);
            else amx_pack_w(fmt, w + (size_t)n0 * row_bytes, row_bytes, nr, nb, a, dw, mw);
            for (int xt = 0; xt < xtiles; ++xt) {
                __m512 acc[AT];
                for (int r = 0; r < AT; ++r) acc[r] = _mm512_setzero_ps();
                /* groups of 4 blocks in tiles 0-3 (A and B alternating in tiles 4-7), the sums of the last group
                 * scaled while this one's products run */
                int prev = -1, prev_cnt = 0;
                for (int g = 0; g < nb; g += AG) {
                    const int cnt = nb - g < AG ? nb - g : AG;
                    const int8_t* ab = a + (size_t)g * AT * QK;
                    const int8_t* bb = xb + (size_t)(xt * nb + g) * QK * AT;
#define ISSUE(u, ta, tb)                                                       \
                    if (u < cnt) {                                            \
                        _tile_zero(u);                                        \
                        _tile_loadd(ta, ab + (size_t)(u) * AT * QK, QK);      \
                        _tile_loadd(tb, bb + (size_t)(u) * QK * AT, AT * 4);  \
                        _tile_dpbssd(u, ta, tb);                              \
                    }
                    ISSUE(0, 4, 6) ISSUE(1, 5, 7) ISSUE(2, 4, 6) ISSUE(3, 5, 7)
#undef ISSUE
                    if (prev_cnt) amx_scale(fmt, c[(prev / AG) & 1], prev, prev_cnt, nr, dxt + (size_t)xt * nb * AT,
                                            xst + (size_t)xt * nb * AT, dw, mw, acc);
                    int32_t* cg = c[(g / AG) & 1];
                    if (cnt > 0) _tile_stored(0, cg, AT * 4);
                    if (cnt > 1) _tile_stored(1, cg + AT * AT, AT * 4);
                    if (cnt > 2) _tile_stored(2, cg + 2 * AT * AT, AT * 4);
                    if (cnt > 3) _tile_stored(3, cg + 3 * AT * AT, AT * 4);
                    prev = g, prev_cnt = cnt;
                }
                if (prev_cnt) amx_scale(fmt, c[(prev / AG) & 1], prev, prev_cnt, nr, dxt + (size_t)xt * nb * AT,
                                        xst + (size_t)xt * nb * AT, dw, mw, acc);
                const int mr = M - xt * AT < AT ? M - xt * AT : AT;
                for (int r = 0; r < nr; ++r) {
                    float out[AT];
                    _mm512_storeu_ps(out, acc[r]);
                    const float sc = fmt == FMT_INT8 ? scales[n0 + r] : 1.0f, bn = bias ? bias[n0 + r] : 0.0f;
                    for (int j = 0; j < mr; ++j) y[(size_t)(xt * AT + j) * ldy + n0 + r] = fmaf(out[j], sc, bn);
                }
            }
        }
        if (a != NULL && dw != NULL) _tile_release();
        free(a);
        free(dw);
    }
    free(xb);
    free(dxt);
    return failed ? -2 : 0;
}
#else
#define HAVE_AMX 0
#endif
