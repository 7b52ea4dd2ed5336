/*
 * Int8 activations on quantized weights in an interleaved copy ("rows8"): the AVX2 kernel for CPUs without
 * VNNI (AMD Zen 2/3, Intel before Ice Lake). Included by quant_q8.c, whose activation rounding it shares.
 *
 * Why: quant_q8.c's kernel sums each (activation row, weight row, block) on its own and turns it into a float
 * there: without VNNI that is ~7 vector and scalar operations per 32 multiply-adds, half the rate of fp32 FMAs.
 * Here 8 weight rows sit side by side, one per 32-bit lane of a 256-bit vector, so a block of 8 rows x 32 weights
 * is 4 loads of 32 bytes; each 4-byte group of an activation block is broadcast to all lanes, VPMADDUBSW
 * multiplies it with 4 weights of every row, and the int16 pair sums of the 8 quads of a block add up in int16
 * (nibbles <= 15, |q_x| <= 127: at most 16 * 15 * 127 = 30480, no overflow) before one VPMADDWD, one
 * conversion and two FMAs per 8 outputs: ~3x fewer operations per weight at one row, and the lanes are the
 * outputs (no horizontal sums).
 *
 * Layout, per group of 8 output rows g (groups in order): the scales of the group's nb blocks as the fp16 values
 * of the GGUF blocks (converted to fp32 where a tile uses them: exact), 8 per block, one per row, padded to a
 * multiple of 32 bytes; then the nb blocks of weights:
 * - Q4_0/Q4_1: d[nb][8], then (Q4_1) m[nb][8]; nb x 128 bytes of nibbles: 144 or 160 bytes per block of 8 rows,
 *   the GGUF bytes (Q4_0's m = -8 d is made in fp32, as (q - 8) d = q d - 8 d). Byte 32 L + 4 j + c of a block
 *   is byte 4 L + c of row j's GGUF block (low nibble: weight 4 L + c, high nibble: weight 16 + 4 L + c).
 * - Q8_0/INT8: d[nb][8] (INT8: 1, its per-row scale multiplies the output); nb x 256 bytes of int8 weights, byte
 *   32 t + 4 j + c = row j's weight 4 t + c: 272 bytes per block of 8 rows. Signed weights cannot use
 *   the int16 sums (|w q_x| pairs reach 32258): each VPMADDUBSW takes |w| against q_x with w's sign and goes
 *   through VPMADDWD at once (|w| is formed once per 8 rows, the sign once per activation row).
 * Rows past N are zero. Keeping the scales in fp16 makes the copy the size of the GGUF bytes (it used fp32 scales:
 * 1.2x for Q4_1), and a one-row call, which streams the copy from memory, reads that much less.
 *
 * With VNNI (AVX512-VNNI with VL, or AVX-VNNI) each quad goes through one VPDPBUSD into int32 lanes instead: the
 * same exact integer sums. A one-row call prefetches PF_ROWS8 bytes ahead (on a Xeon the hardware's prefetcher
 * alone left the rows8 walk slower than hfq8_linear's four prefetched row streams once the weight came from
 * memory); above 16 rows, where the host has AMX-INT8, the copy feeds quant_amx.h's tiles.
 *
 * Per output the operations and their order do not depend on M or on which rows share a tile, and they are
 * quant_q8.c's and the AMX tiles' (per block: the exact integer dot as fp32 times d_w * d_x in one rounding,
 * then m_w * d_x * sum(q_x) in one rounding; Q4_0's m is -8 d): a row's result is the same bits whatever the
 * batch, the kernel or the build.
 */
#if HAVE_I8 && defined(__F16C__)
#define HAVE_ROWS8 1
#else
#define HAVE_ROWS8 0
#endif
enum { IR = 8 };
#ifndef PF_ROWS8
#define PF_ROWS8 2048 /* bytes ahead to prefetch in a one-row walk over the copy */
#endif

static inline int wide(int fmt) { return fmt == FMT_Q8_0 || fmt == FMT_INT8; }
/* bytes of a group's block of weights; of its scales for nb blocks (a multiple of 32: the weights stay aligned);
 * of a group */
static inline int wbytes(int fmt) { return wide(fmt) ? 256 : 128; }
static inline size_t sbytes(int fmt, int nb) { return ((size_t)nb * (fmt == FMT_Q4_1 ? 32 : 16) + 31) / 32 * 32; }
static inline size_t gbytes(int fmt, int nb) { return sbytes(fmt, nb) + (size_t)nb * wbytes(fmt); }

/* bytes of the rows8 copy of an [N, K] weight of format fmt, or -1 where it has none (unknown format, K % 32) */
int64_t hfq8i_bytes(int fmt, int N, int K) {
    if (block_bytes(fmt) == 0 || K % QK != 0 || N <= 0) return -1;
    return (int64_t)((N + IR - 1) / IR) * (int64_t)gbytes(fmt, K / QK);
}

/* whether this build has the rows8 kernel (AVX2 with F16C, which every AVX2 CPU has) */
int hfq8i_available(void) { return HAVE_ROWS8; }

/* the rows8 copy (see above) of the GGUF-layout weight w [N, K] into out (hfq8i_bytes(fmt, N, K) bytes) */
int hfq8i_repack(const uint8_t* w, int fmt, int N, int K, uint8_t* out, int num_threads) {
    if (hfq8i_bytes(fmt, N, K) < 0) return -1;
    const int nb = K / QK, bb = block_bytes(fmt), off = quant_offset(fmt), groups = (N + IR - 1) / IR;
    const int wb = wbytes(fmt), quads = wb / 32;
    const size_t row_bytes = (size_t)nb * bb;
    const uint16_t one = 0x3c00; /* fp16 1.0: INT8's d */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int g = 0; g < groups; ++g) {
        uint8_t* dg = out + (size_t)g * gbytes(fmt, nb); /* d[nb][8], then Q4_1's m[nb][8], then padding */
        uint8_t* wg = dg + sbytes(fmt, nb);
        memset(dg, 0, sbytes(fmt, nb));
        for (int b = 0; b < nb; ++b) {
            uint8_t* rec = wg + (size_t)b * wb;
            for (int j = 0; j < IR; ++j) {
                const int n = g * IR + j;
                const uint8_t* blk = w + (size_t)n * row_bytes + (size_t)b * bb;
                uint8_t* d = dg + ((size_t)b * IR + j) * 2;
                for (int t = 0; t < quads; ++t) {
                    if (n < N) memcpy(rec + 32 * t + 4 * j, blk + off + 4 * t, 4);
                    else memset(rec + 32 * t + 4 * j, 0, 4);
                }
                if (n >= N) memset(d, 0, 2);
                else if (fmt == FMT_INT8) memcpy(d, &one, 2);
                else memcpy(d, blk, 2);
                if (fmt == FMT_Q4_1) {
                    if (n < N) memcpy(d + (size_t)nb * IR * 2, blk + 2, 2);
                    else memset(d + (size_t)nb * IR * 2, 0, 2);
                }
            }
        }
    }
    return 0;
}

#if HAVE_ROWS8
enum { MRI = 4, CG = 32 }; /* rows per tile; groups of 8 outputs per chunk of a batch */
/* with VNNI the quads multiply-add straight into int32 lanes: the same exact integer sums in half the operations */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif

/* the 4 bytes at p as one int32 (any alignment) */
static inline int32_t quad_at(const void* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(quad_at(p)); }

/* The 4 activation bytes of quad t (0..7) of block b of tile row i, in every lane: loaded from the tile's expanded
 * copy xe (expand_tile: each quad stored 8 times) where there is one, else broadcast from xq. On Zen 3 a
 * broadcast from memory takes a vector pipe like the multiply-adds (a plain load does not): with ~3 vector
 * operations issued per cycle the 4-row tile spent a quarter of them broadcasting. */
static inline __m256i xquad(const int8_t* xq, const int8_t* xe, int64_t K, int nb, int i, int b, int t) {
    if (xe) return _mm256_load_si256((const __m256i*)(xe + (((size_t)i * nb + b) * 8 + t) * 32));
    return bcast4(xq + i * K + b * QK + 4 * t);
}

/* xe = the rows' activation quads, each stored 8 times (32 bytes, 32-aligned): xquad's layout for mr rows */
static void expand_tile(const int8_t* xq, int64_t K, int mr, int8_t* xe) {
    const int64_t quads = K / 4;
    for (int i = 0; i < mr; ++i)
        for (int64_t q = 0; q < quads; ++q)
            _mm256_store_si256((__m256i*)(xe + ((size_t)i * quads + q) * 32), bcast4(xq + i * K + 4 * q));
}

/* v as it is, in a register: an empty asm the compiler cannot see through. Without it GCC re-associates each
 * row's chain of integer adds into a tree over all of a block's products at once, whose partial sums overflow
 * the 16 ymm registers: the 4-row tiles spilled about as many vectors as they multiplied, 1.4x the time. */
static inline __m256i kept(__m256i v) {
    __asm__("" : "+x"(v));
    return v;
}

/* block b's scales as fp32 (exact): d, and for 4-bit weights m, of the group's 8 rows, from the fp16 copy dg */
static inline __m256 scale_d(const uint8_t* dg, int b) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dg + (size_t)b * 16)));
}

static inline __m256 scale_m(int fmt, int nb, const uint8_t* dg, int b, __m256 d) {
    if (fmt == FMT_Q4_1) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dg + ((size_t)nb + b) * 16)));
    return _mm256_mul_ps(d, _mm256_set1_ps(Q4_0_M)); /* Q4_0 */
}

/* out[i] = the 8 outputs of group (wg, dg) for activation rows i < mr (without bias); xe: see xquad */
static inline __attribute__((always_inline)) void tile_rows8(
    const int mr, const int fmt, const int nb, const uint8_t* wg, const uint8_t* dg,
    const int8_t* xq, const int8_t* xe, const int64_t K, const float* xd, const float* xs, __m256 out[MRI])
{
    const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256 acc[MRI];
    for (int i = 0; i < mr; ++i) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* rec = wg + (size_t)b * 128;
        if (PF_ROWS8) { /* the groups follow each other in memory: fetch ahead of the hardware's prefetcher */
            __builtin_prefetch(rec + PF_ROWS8, 0, 3);
            __builtin_prefetch(rec + PF_ROWS8 + 64, 0, 3);
        }
        __m256i s[MRI]; /* int16 pair sums (VPMADDUBSW), or with VNNI int32 sums */
        for (int i = 0; i < mr; ++i) s[i] = _mm256_setzero_si256();
        for (int L = 0; L < 4; ++L) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(rec + 32 * L));
            const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            for (int i = 0; i < mr; ++i) {
#ifdef DPBUSD
                s[i] = kept(DPBUSD(s[i], lo, xquad(xq, xe, K, nb, i, b, L)));
                s[i] = kept(DPBUSD(s[i], hi, xquad(xq, xe, K, nb, i, b, 4 + L)));
#else
                s[i] = kept(_mm256_add_epi16(s[i], _mm256_maddubs_epi16(lo, xquad(xq, xe, K, nb, i, b, L))));
                s[i] = kept(_mm256_add_epi16(s[i], _mm256_maddubs_epi16(hi, xquad(xq, xe, K, nb, i, b, 4 + L))));
#endif
            }
        }
        const __m256 d = scale_d(dg, b), m = scale_m(fmt, nb, dg, b, d);
        for (int i = 0; i < mr; ++i) {
#ifdef DPBUSD
            const __m256 dot = _mm256_cvtepi32_ps(s[i]);
#else
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[i], ones));
#endif
            acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(xd[i * nb + b])), acc[i]);
            acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < mr; ++i) out[i] = acc[i];
}

/* the same for 8-bit weights (Q8_0, INT8): out[i] = sum over blocks of d_w * d_x * (integer dot) */
static inline __attribute__((always_inline)) void tile_rows8_wide(
    const int mr, const int nb, const uint8_t* wg, const uint8_t* dg, const int8_t* xq,
    const int8_t* xe, const int64_t K, const float* xd, __m256 out[MRI])
{
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256 acc[MRI];
    for (int i = 0; i < mr; ++i) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* rec = wg + (size_t)b * 256;
        if (PF_ROWS8)
            for (int l = 0; l < 256; l += 64) __builtin_prefetch(rec + PF_ROWS8 + l, 0, 3);
        __m256i s32[MRI];
        for (int i = 0; i < mr; ++i) s32[i] = _mm256_setzero_si256();
        for (int t = 0; t < 8; ++t) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(rec + 32 * t)), u = _mm256_abs_epi8(w);
            for (int i = 0; i < mr; ++i) {
                const __m256i sx = _mm256_sign_epi8(xquad(xq, xe, K, nb, i, b, t), w);
#ifdef DPBUSD
                s32[i] = kept(DPBUSD(s32[i], u, sx));
#else
                s32[i] = kept(_mm256_add_epi32(s32[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, sx), ones)));
#endif
            }
        }
        const __m256 d = scale_d(dg, b);
        for (int i = 0; i < mr; ++i)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i]), _mm256_mul_ps(d, _mm256_set1_ps(xd[i * nb + b])),
                                     acc[i]);
    }
    for (int i = 0; i < mr; ++i) out[i] = acc[i];
}

/* the tile of mr rows: activations from the expanded copy xe or (NULL) broadcast from xq (the compiler makes both) */
static void tile_rows8_any(int fmt, int mr, int nb, const uint8_t* wg, const uint8_t* dg, const int8_t* xq,
                           const int8_t* xe, int64_t K, const float* xd, const float* xs, __m256 out[MRI]) {
#define TILE(R, F, E)                                                                                   \
    if (wide(F)) tile_rows8_wide(R, nb, wg, dg, xq, E, K, xd, out);                                      \
    else tile_rows8(R, F, nb, wg, dg, xq, E, K, xd, xs, out);
#define TILE_XE(R, F) if (xe) { TILE(R, F, xe) } else { TILE(R, F, NULL) }
#define TILE_MR(F)                                                                                      \
    switch (mr) {                                                                                       \
    case 4: TILE_XE(4, F) break;                                                                        \
    case 3: TILE_XE(3, F) break;                                                                        \
    case 2: TILE_XE(2, F) break;                                                                        \
    default: TILE_XE(1, F) break;                                                                       \
    }
    switch (fmt) {
    case FMT_Q4_0: TILE_MR(FMT_Q4_0) break;
    case FMT_Q4_1: TILE_MR(FMT_Q4_1) break;
    default: TILE_MR(FMT_Q8_0) break; /* Q8_0 and INT8 run the same code */
    }
#undef TILE_MR
#undef TILE_XE
#undef TILE
}
#endif

#if HAVE_AMX
/* quant_amx.h's weight tile (rows n0..n0+15, int8 [nb][16][32], d and m [nb][16]) from the rows8 copy wi: the
 * tile's two groups of 8 rows, each row's quads gathered back into the GGUF order of its block */
static void amx_pack_w_rows8(int fmt, const uint8_t* wi, int nb, int N, int n0, int8_t* a, float* dw, float* mw) {
    const size_t gb = gbytes(fmt, nb);
    const int g0 = n0 / IR, groups = (N + IR - 1) / IR;
    for (int g = g0 + 2; g < g0 + 4 && g < groups; ++g) /* the next tile's groups, fetched while this one computes */
        for (size_t l = 0; l < gb; l += 64) __builtin_prefetch(wi + (size_t)g * gb + l, 0, 3);
    for (int r = 0; r < AT; ++r) {
        const int n = n0 + r, j = r % IR;
        const uint8_t* dg = wi + (size_t)(g0 + r / IR) * gb, *wg = dg + sbytes(fmt, nb);
        for (int b = 0; b < nb; ++b) {
            int8_t* dst = a + ((size_t)b * AT + r) * QK;
            if (n >= N) {
                memset(dst, 0, QK);
                dw[b * AT + r] = mw[b * AT + r] = 0.0f;
                continue;
            }
            const uint8_t* rec = wg + (size_t)b * wbytes(fmt) + 4 * j;
            if (wide(fmt)) {
                _mm256_storeu_si256((__m256i*)dst, _mm256_setr_epi32(quad_at(rec), quad_at(rec + 32), quad_at(rec + 64),
                                                                     quad_at(rec + 96), quad_at(rec + 128),
                                                                     quad_at(rec + 160), quad_at(rec + 192),
                                                                     quad_at(rec + 224)));
            } else {
                const __m128i raw = _mm_setr_epi32(quad_at(rec), quad_at(rec + 32), quad_at(rec + 64), quad_at(rec + 96));
                _mm256_storeu_si256((__m256i*)dst, nibbles(raw));
            }
            const float d = h2f(dg + ((size_t)b * IR + j) * 2);
            dw[b * AT + r] = d;
            mw[b * AT + r] = fmt == FMT_Q4_1 ? h2f(dg + (((size_t)nb + b) * IR + j) * 2) : fmt == FMT_Q4_0 ? d * Q4_0_M : 0.0f;
        }
    }
}
#endif

/*
 * hfq8_linear's computation on the rows8 copy wi of a weight (same arguments; scales: INT8's per-row scales).
 * Returns 0, -1 for an unknown format, K % 32 or a build without AVX2 and F16C, -2 when scratch cannot be allocated.
 */
int hfq8i_linear(const float* x, int64_t ldx, const uint8_t* wi, int fmt, const float* scales, const float* bias,
                 float* y, int64_t ldy, int M, int N, int K, int num_threads)
{
#if HAVE_ROWS8
    if (hfq8i_bytes(fmt, N, K) < 0 || (fmt == FMT_INT8 && scales == NULL)) return -1;
    if (M <= 0) return 0;
    const int nb = K / QK, groups = (N + IR - 1) / IR;
    int8_t* xq = aligned_alloc(64, ((size_t)M * K + 63) / 64 * 64);
    float* xd = malloc(sizeof(float) * 2 * (size_t)M * nb);
    if (xq == NULL || xd == NULL) {
        free(xq), free(xd);
        return -2;
    }
    float* xs = xd + (size_t)M * nb;
    hfq8_quantize(x, ldx, M, K, xq, xd, xs, M >= 64 ? num_threads : 1);
#if HAVE_AMX
    if (M > AMX_MIN_ROWS && amx_allowed()) { /* the same bits as the vector path below, batch by batch */
        const int rc = amx_linear(xq, xd, xs, wi, fmt, 1, scales, bias, y, ldy, M, N, K, num_threads);
        free(xq);
        free(xd);
        return rc;
    }
#endif
    /* a batch of several tiles: each thread walks its groups in chunks of CG (their weights stay in L2) and, per
     * chunk, the 4-row tiles in turn, each expanded once (xquad) and read from L1 by the chunk's groups. Below
     * two tiles, where an expanded tile outgrows L1 (K > 768: 24 KiB; the default model's down_proj, K = 1536,
     * was 1.13x slower expanded on a Zen 3) and for 8-bit weights (their tile loads twice the bytes per quad; the
     * Q8_0 LM head was 1.06x slower expanded), the rows broadcast their quads instead. On a Zen 3 at 64 rows the
     * 4-bit linears with K = 576 went from 1.72-1.84x to 1.92-2.06x our fp32 GEMM (bench.quant_kernel). */
    const int expand = M >= 2 * MRI && (size_t)MRI * K * 8 <= 24576 && !wide(fmt);
    int rc = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int8_t* xe = expand ? aligned_alloc(32, (size_t)MRI * K * 8) : NULL;
        if (expand && xe == NULL) {
#pragma omp atomic write
            rc = -2;
        }
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        const int g0 = (int)((int64_t)groups * tid / nth), g1 = (int)((int64_t)groups * (tid + 1) / nth);
        for (int c0 = g0; c0 < g1 && (xe != NULL || !expand); c0 += CG) {
            const int c1 = c0 + CG < g1 ? c0 + CG : g1;
            for (int m0 = 0; m0 < M; m0 += MRI) {
                const int mr = M - m0 < MRI ? M - m0 : MRI;
                if (expand) expand_tile(xq + (size_t)m0 * K, K, mr, xe);
                for (int g = c0; g < c1; ++g) {
                    const int n0 = g * IR, nr = N - n0 < IR ? N - n0 : IR;
                    const uint8_t* dg = wi + (size_t)g * gbytes(fmt, nb), *wg = dg + sbytes(fmt, nb);
                    __m256 out[MRI];
                    tile_rows8_any(fmt, mr, nb, wg, dg, xq + (size_t)m0 * K, xe, K, xd + (size_t)m0 * nb,
                                   xs + (size_t)m0 * nb, out);
                    /* as hfq8_linear: out * s + bias in one rounding (s = 1 except INT8's row scale) */
                    float b8[IR] = {0}, s8[IR] = {1, 1, 1, 1, 1, 1, 1, 1};
                    if (bias != NULL) memcpy(b8, bias + n0, sizeof(float) * nr);
                    if (fmt == FMT_INT8) memcpy(s8, scales + n0, sizeof(float) * nr);
                    for (int i = 0; i < mr; ++i) {
                        const __m256 v = _mm256_fmadd_ps(out[i], _mm256_loadu_ps(s8), _mm256_loadu_ps(b8));
                        float* yr = y + (m0 + i) * ldy + n0;
                        if (nr == IR) _mm256_storeu_ps(yr, v);
                        else {
                            float tmp[IR];
                            _mm256_storeu_ps(tmp, v);
                            memcpy(yr, tmp, sizeof(float) * nr);
                        }
                    }
                }
            }
        }
        free(xe);
    }
    free(xq);
    free(xd);
    return rc;
#else
    (void)x, (void)ldx, (void)wi, (void)fmt, (void)scales, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K,
        (void)num_threads;
    return -1;
#endif
}
