/*
 * Paged attention for CPU: each (sequence, KV head) pair reads its keys and values straight from the
 * block pool, once, with an online softmax in fp32. Meant for short query lengths (decode, speculative
 * verification); long prefill chunks go through SDPA, where the matmuls dominate.
 *
 * Built on first use by hf_paged/kernels/cpu_attention.py with the host compiler (-O3 -march=native
 * -fopenmp) and called through ctypes. Linked against libgomp.so.1, so in a torch process it shares
 * torch's OpenMP runtime (same soname) instead of starting a second thread pool.
 *
 * Layouts (element strides where noted):
 *   query      [num_tokens, num_heads, head_dim]        strides q_stride_t, q_stride_h, 1
 *   k/v_cache  [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
 *   out        [num_tokens, num_heads, head_dim]        strides o_stride_t, o_stride_h, 1
 *   block_tables [num_seqs, bt_stride] int32; seq_lens [num_seqs] int32; cu_seqlens_q [num_seqs + 1] int32
 *   seq_ids    [n_seq_ids] int32: the sequences this call processes
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

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
    if (dt == DT_BF16) {
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

static inline float dot(const float* a, const float* b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; ++d) s += a[d] * b[d];
    return s;
}

int hfp_paged_attention(
    const void* query, int64_t q_stride_t, int64_t q_stride_h,
    const void* k_cache, const void* v_cache,
    const int32_t* block_tables, int64_t bt_stride,
    const int32_t* seq_lens, const int32_t* cu_seqlens_q,
    const int32_t* seq_ids, int n_seq_ids,
    void* out, int64_t o_stride_t, int64_t o_stride_h,
    int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int window, float softcap, int dtype, int max_q, int num_threads)
{
    const int rep = num_heads / num_kv_heads;
    /* A work item is one sequence with all its heads, so a block is read front to back (the hardware
     * prefetcher follows); with fewer sequences than threads x 2, split each sequence by KV head. */
    const int splits = n_seq_ids >= 2 * num_threads ? 1 : num_kv_heads;
    const int heads_per_item = num_kv_heads / splits;
    const int max_rows = heads_per_item * rep * max_q;
    const int64_t n_items = (int64_t)n_seq_ids * splits;
    const int64_t tok_stride = (int64_t)num_kv_heads * head_dim; /* elements between consecutive slots */
    const size_t elem = dtype == DT_F32 ? 4 : 2;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        /* per-thread scratch: q rows, accumulators, softmax state, block scores, converted k/v rows */
        size_t floats = (size_t)max_rows * head_dim * 2 + (size_t)max_rows * (2 + block_size) + 2 * (size_t)head_dim;
        float* scratch = (float*)malloc(floats * sizeof(float));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float* qbuf = scratch;
        float* acc = qbuf + (size_t)max_rows * head_dim;
        float* m = acc + (size_t)max_rows * head_dim;
        float* l = m + max_rows;
        float* sc = l + max_rows; /* [rows, block_size] */
        float* kbuf = sc + (size_t)max_rows * block_size;
        float* vbuf = kbuf + head_dim;

#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; ++it) {
            if (scratch == NULL) continue;
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
                        m[r] = -INFINITY;
                        l[r] = 0.0f;
                    }
            memset(acc, 0, (size_t)rows * head_dim * sizeof(float));

            const int k_lo = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
            const int last_block = (seq_len - 1) / block_size;
            for (int jb = k_lo / block_size; jb <= last_block; ++jb) {
                const int64_t block = block_tables[(int64_t)s * bt_stride + jb];
                const int t0 = jb * block_size;
                const int nt = seq_len - t0 < block_size ? seq_len - t0 : block_size;
                const int64_t base = block * block_size * tok_stride + (int64_t)h_lo * head_dim;
                if (jb < last_block) { /* the next block lies elsewhere in the pool: start fetching it */
                    const int64_t next = (int64_t)block_tables[(int64_t)s * bt_stride + jb + 1] * block_size * tok_stride;
                    __builtin_prefetch((const char*)k_cache + next * elem);
                    __builtin_prefetch((const char*)v_cache + next * elem);
                }

                // -- scores of every row against the block's keys --
                for (int t = 0; t < nt; ++t) {
                    const int pos = t0 + t;
                    for (int hh = 0, r = 0; hh < heads_per_item; ++hh) {
                        const float* k = load_row(k_cache, base + t * tok_stride + (int64_t)hh * head_dim, head_dim, dtype, kbuf);
                        for (int i = 0; i < q_len; ++i) {
                            const int p = first_pos + i;
                            const int visible = pos <= p && (window <= 0 || pos > p - window);
                            for (int g = 0; g < rep; ++g, ++r) {
                                float x = -INFINITY;
                                if (visible) {
                                    x = dot(qbuf + (size_t)r * head_dim, k, head_dim) * scale;
                                    if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                                }
                                sc[(size_t)r * block_size + t] = x;
                            }
                        }
                    }
                }

                // -- update m and l, turn scores into weights --
                for (int r = 0; r < rows; ++r) {
                    float* srow = sc + (size_t)r * block_size;
                    float bm = -INFINITY;
                    for (int t = 0; t < nt; ++t) bm = srow[t] > bm ? srow[t] : bm;
                    if (bm == -INFINITY) {
                        for (int t = 0; t < nt; ++t) srow[t] = 0.0f;
                        continue;
                    }
                    const float new_m = bm > m[r] ? bm : m[r];
                    if (new_m > m[r] && l[r] > 0.0f) {
                        const float corr = exp_nonpos(m[r] - new_m);
                        float* a = acc + (size_t)r * head_dim;
                        l[r] *= corr;
                        for (int d = 0; d < head_dim; ++d) a[d] *= corr;
                    }
                    m[r] = new_m;
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int t = 0; t < nt; ++t) {
                        const float w = exp_nonpos(srow[t] - new_m);
                        srow[t] = w;
                        sum += w;
                    }
                    l[r] += sum;
                }

                // -- accumulate the block's values --
                for (int t = 0; t < nt; ++t) {
                    for (int hh = 0; hh < heads_per_item; ++hh) {
                        const float* v = load_row(v_cache, base + t * tok_stride + (int64_t)hh * head_dim, head_dim, dtype, vbuf);
                        const int r0 = hh * q_len * rep, r1 = r0 + q_len * rep;
                        for (int r = r0; r < r1; ++r) {
                            const float w = sc[(size_t)r * block_size + t];
                            if (w == 0.0f) continue;
                            float* a = acc + (size_t)r * head_dim;
#pragma omp simd
                            for (int d = 0; d < head_dim; ++d) a[d] += w * v[d];
                        }
                    }
                }
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
        free(scratch);
    }
    return failed ? -1 : 0;
}
