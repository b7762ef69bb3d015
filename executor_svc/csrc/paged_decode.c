/* Paged decode attention for the CPU: one query token per request, keys and values read in place
 * from the block-paged cache (no gathered copy), softmax and sums in float32.
 *
 * Layout (executor_svc/attention/base.py): q and out [num_seqs, num_heads, head_dim] contiguous;
 * k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; block_tables
 * [num_seqs, max_blocks] int32; context_lens [num_seqs] int32. Tensors are float32, or bfloat16
 * when `bf16` is set. Query head i reads KV head i / (num_heads / num_kv_heads) (GQA). Requests are
 * shared out among OpenMP threads; cpu_kernels.py builds this file and links it to the OpenMP
 * runtime torch has loaded.
 *
 * Two implementations. With AVX-512 (and head_dim 64, 128 or 256) a request is read once, in tiles of
 * 16 tokens, flash-decoding style: for each KV head, the 16 scores of every query head of its group
 * fill one vector (16 partial dot products per head, summed by a transpose-add tree instead of 16
 * horizontal reductions; bfloat16 pairs multiplied with vdpbf16ps where the CPU has it), an online
 * softmax (running max and sum) rescales the output accumulators, which stay in registers while the
 * tile's values, still in cache, are added in; the next tile is prefetched into L2 meanwhile. Otherwise a
 * portable two-pass version (all scores, softmax, then values) that the compiler vectorises.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* Let `omp simd` loops call glibc's vector expf (libmvec). glibc declares it only under -ffast-math,
 * and a library built with -ffast-math sets flush-to-zero for the whole process when it loads. */
#pragma omp declare simd notinbranch
float expf(float);

/* Row `row` of a [rows, n] tensor as float32: in place for float32, converted into `buf` for bfloat16. */
static inline const float *load_row(const void *base, int64_t row, int n, int bf16, float *buf) {
    if (!bf16) return (const float *)base + row * n;
    const uint16_t *src = (const uint16_t *)base + row * n;
    for (int i = 0; i < n; i++) buf[i] = bf16_to_float(src[i]);
    return buf;
}

/* Row `row` of a [rows, n] output in its dtype, from float32 `src`. */
static void store_output(void *out, int64_t row, int n, int bf16, const float *src) {
    for (int i = 0; i < n; i++) {
        if (bf16)
            ((uint16_t *)out)[row * n + i] = float_to_bf16(src[i]);
        else
            ((float *)out)[row * n + i] = src[i];
    }
}

/* Slots are scattered over the cache, out of reach of the CPU's own prefetcher: ask for the slot this
 * many tokens ahead while working on the current one (4 measured fastest of 1-8). */
#define PREFETCH_DISTANCE 4

static inline int64_t slot_of(const int32_t *table, int t, int block_size) {
    return (int64_t)table[t / block_size] * block_size + t % block_size;
}

static inline void prefetch_slot(const void *cache, int64_t slot, int64_t slot_bytes) {
    const char *p = (const char *)cache + slot * slot_bytes;
    for (int64_t i = 0; i < slot_bytes; i += 64) __builtin_prefetch(p + i);
}

/* Attention of one request's queries `q` [num_heads, head_dim] over its `len` context tokens, whose
 * cache slots come from `table`; writes `acc` [num_heads, head_dim]. A slot holds all KV heads of a
 * token ([num_kv_heads, head_dim]), read whole so that a block is one contiguous run of memory (reading
 * one head's rows apart from the others' measured 3-5x slower). `scores` holds [num_heads, stride]
 * floats and `buf` one slot. */
static void attend(const float *q, const void *k_cache, const void *v_cache, const int32_t *table, int len,
                   int num_heads, int num_kv_heads, int head_dim, int block_size, int bf16, float scale,
                   float *scores, int stride, float *buf, float *acc) {
    int group = num_heads / num_kv_heads, slot_size = num_kv_heads * head_dim;
    int64_t slot_bytes = (int64_t)slot_size * (bf16 ? 2 : 4);
    for (int t = 0; t < len; t++) {
        if (t + PREFETCH_DISTANCE < len)
            prefetch_slot(k_cache, slot_of(table, t + PREFETCH_DISTANCE, block_size), slot_bytes);
        const float *k = load_row(k_cache, slot_of(table, t, block_size), slot_size, bf16, buf);
        for (int head = 0; head < num_heads; head++) {
            const float *qh = q + head * head_dim, *kh = k + (head / group) * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
            scores[head * stride + t] = dot * scale;
        }
    }
    for (int head = 0; head < num_heads; head++) {
        float *s = scores + head * stride, top = s[0], sum = 0.0f;
#pragma omp simd reduction(max : top)
        for (int t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; t++) {
            s[t] = expf(s[t] - top);
            sum += s[t];
        }
        float inverse = 1.0f / sum;
#pragma omp simd
        for (int t = 0; t < len; t++) s[t] *= inverse;
    }
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int t = 0; t < len; t++) {
        if (t + PREFETCH_DISTANCE < len)
            prefetch_slot(v_cache, slot_of(table, t + PREFETCH_DISTANCE, block_size), slot_bytes);
        const float *v = load_row(v_cache, slot_of(table, t, block_size), slot_size, bf16, buf);
        for (int head = 0; head < num_heads; head++) {
            const float *vh = v + (head / group) * head_dim;
            float p = scores[head * stride + t], *a = acc + head * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) a[d] += p * vh[d];
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))
#define TILE 16 /* tokens per tile: one score per lane of a 16-float vector */

/* exp(x) for x <= 0 (NaN stays NaN): Cephes' expf polynomial on x - n ln 2, scaled by 2^n. Inputs below
 * -104, where expf underflows to 0, are clamped so that -inf gives 0 rather than NaN. */
INLINE __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Lane i of the result is the sum of the 16 lanes of v[i]: a transpose-add tree, 15 adds for 16 sums. */
INLINE __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [v0+v2, w0+w2, v1+v3, w1+w3] for v, w = v[2i], v[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane's partial sums of tokens 4i..4i+3 */
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* sum pairs of 128-bit lanes: tokens 8i..8i+7 */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 32 bfloat16 as two float vectors, without a cross-lane shuffle: the even elements, then the odd ones. */
INLINE __m512 bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
INLINE __m512 bf16_odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Partial sums of the dot product of a query row with a key row of `dim` elements, over 16 lanes. */
INLINE __m512 row_dot(const void *q, const void *k, int dim, int bf16) {
    __m512 s = _mm512_setzero_ps();
    if (!bf16) {
        for (int d = 0; d < dim; d += 16)
            s = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)q + d), _mm512_loadu_ps((const float *)k + d), s);
        return s;
    }
    for (int d = 0; d < dim; d += 32) {
        __m512i qv = _mm512_loadu_si512((const uint16_t *)q + d), kv = _mm512_loadu_si512((const uint16_t *)k + d);
#if defined(__AVX512BF16__)
        s = _mm512_dpbf16_ps(s, (__m512bh)qv, (__m512bh)kv); /* exact products, float32 sums */
#else
        s = _mm512_fmadd_ps(bf16_even(qv), bf16_even(kv), s);
        s = _mm512_fmadd_ps(bf16_odd(qv), bf16_odd(kv), s);
#endif
    }
    return s;
}

/* acc[h] = acc[h] * corr[h] + sum over the tile's n tokens of p[h][t] * v[t], for `heads` (constant
 * after inlining) query heads, so that their heads * dim / 16 <= 16 accumulators stay in registers.
 * bfloat16 accumulators hold each 32 elements as even ones then odd ones (see bf16_even). */
INLINE void add_values(float *acc, const float *corr, const float *p, const void *const *rows, int n, int heads,
                       int dim, int bf16) {
    enum { MAX_VECTORS = 16 };
    int vectors = dim / 16;
    __m512 a[MAX_VECTORS], v[MAX_VECTORS];
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < vectors; c++)
            a[h * vectors + c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * dim + c * 16), _mm512_set1_ps(corr[h]));
    for (int t = 0; t < n; t++) {
        for (int c = 0; c < vectors; c += 2) {
            if (bf16) {
                __m512i x = _mm512_loadu_si512((const uint16_t *)rows[t] + c * 16);
                v[c] = bf16_even(x);
                v[c + 1] = bf16_odd(x);
            } else {
                v[c] = _mm512_loadu_ps((const float *)rows[t] + c * 16);
                v[c + 1] = _mm512_loadu_ps((const float *)rows[t] + c * 16 + 16);
            }
        }
        for (int h = 0; h < heads; h++) {
            __m512 w = _mm512_set1_ps(p[h * TILE + t]);
            for (int c = 0; c < vectors; c++) a[h * vectors + c] = _mm512_fmadd_ps(w, v[c], a[h * vectors + c]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < vectors; c++) _mm512_storeu_ps(acc + h * dim + c * 16, a[h * vectors + c]);
}

/* Cache offsets (in elements) of the slots of tokens t0..t0+TILE-1; past `len`, token t0's again. */
static inline void tile_slots(const int32_t *table, int t0, int len, int block_size, int slot_size, int64_t *slots) {
    for (int i = 0; i < TILE; i++) slots[i] = slot_of(table, t0 + i < len ? t0 + i : t0, block_size) * slot_size;
}

/* An asm statement, as GCC 12 deletes some loops whose only statements are __builtin_prefetch. */
static inline void prefetch_l2(const void *p) { __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)p)); }

/* Fetch the key and value slots of tokens from..to-1 (up to len) into L2. attend_tiled asks for the next
 * tile's while it works on one: slots are scattered over the cache, out of reach of the CPU's prefetcher. Into
 * L2, as L1 cannot hold two float32 tiles (24 KB each); two tiles ahead, or into L1, measured slower. */
static inline void prefetch_tokens(const void *k_cache, const void *v_cache, const int32_t *table, int from, int to,
                                   int len, int block_size, int64_t slot_bytes) {
    for (int t = from; t < to && t < len; t++) {
        int64_t offset = slot_of(table, t, block_size) * slot_bytes;
        for (int64_t b = 0; b < slot_bytes; b += 64) {
            prefetch_l2((const char *)k_cache + offset + b);
            prefetch_l2((const char *)v_cache + offset + b);
        }
    }
}

/* One request, see the top of the file. `dim` and `bf16` are constants in each inlined copy. Scratch:
 * acc [num_heads, dim], sums [num_heads, TILE], top [num_heads], p [group, TILE], corr [group]. */
INLINE void attend_tiled(const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int len,
                         int num_heads, int num_kv_heads, int dim, int block_size, int bf16, float scale, float *acc,
                         float *sums, float *top, float *p, float *corr, float *out) {
    int group = num_heads / num_kv_heads, slot_size = num_kv_heads * dim, esize = bf16 ? 2 : 4;
    int max_heads = 256 / dim; /* query heads per add_values call */
    int64_t slot_bytes = (int64_t)slot_size * esize, slots[TILE];
    const char *k_base = k_cache, *v_base = v_cache;
    memset(acc, 0, sizeof(float) * num_heads * dim);
    memset(sums, 0, sizeof(float) * num_heads * TILE);
    for (int h = 0; h < num_heads; h++) top[h] = -INFINITY;
    prefetch_tokens(k_cache, v_cache, table, 0, TILE, len, block_size, slot_bytes);
    for (int t0 = 0; t0 < len; t0 += TILE) {
        int n = len - t0 < TILE ? len - t0 : TILE, ahead = t0 + TILE;
        __mmask16 valid = (__mmask16)((1u << n) - 1);
        tile_slots(table, t0, len, block_size, slot_size, slots);
        for (int kv = 0; kv < num_kv_heads; kv++) {
            const void *k_rows[TILE], *v_rows[TILE];
            for (int i = 0; i < TILE; i++) {
                k_rows[i] = k_base + (slots[i] + (int64_t)kv * dim) * esize;
                v_rows[i] = v_base + (slots[i] + (int64_t)kv * dim) * esize;
            }
            for (int g = 0; g < group; g++) {
                int h = kv * group + g;
                /* the next tile's slots, a share per query head: a burst of prefetches holds up the loads */
                prefetch_tokens(k_cache, v_cache, table, ahead + h * TILE / num_heads,
                                ahead + (h + 1) * TILE / num_heads, len, block_size, slot_bytes);
                const char *qh = (const char *)q + (int64_t)h * dim * esize;
                __m512 part[TILE];
                for (int i = 0; i < TILE; i++) part[i] = row_dot(qh, k_rows[i], dim, bf16);
                __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,
                                              _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale)));
                /* online softmax: a new maximum rescales what was summed under the old one */
                float tile_top = _mm512_reduce_max_ps(s);
                corr[g] = 1.0f;
                if (tile_top > top[h]) {
                    corr[g] = _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(top[h] - tile_top)));
                    top[h] = tile_top;
                }
                __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(top[h]))));
                _mm512_storeu_ps(sums + h * TILE,
                                 _mm512_fmadd_ps(_mm512_loadu_ps(sums + h * TILE), _mm512_set1_ps(corr[g]), e));
                _mm512_storeu_ps(p + g * TILE, e);
            }
            float *a = acc + (int64_t)kv * group * dim;
            for (int g = 0; g < group; g += max_heads) {
                int heads = group - g < max_heads ? group - g : max_heads;
                /* a constant head count per call keeps the accumulators in registers */
                if (max_heads >= 4 && heads == 4) add_values(a + g * dim, corr + g, p + g * TILE, v_rows, n, 4, dim, bf16);
                else if (max_heads >= 3 && heads == 3) add_values(a + g * dim, corr + g, p + g * TILE, v_rows, n, 3, dim, bf16);
                else if (max_heads >= 2 && heads == 2) add_values(a + g * dim, corr + g, p + g * TILE, v_rows, n, 2, dim, bf16);
                else add_values(a + g * dim, corr + g, p + g * TILE, v_rows, n, 1, dim, bf16);
            }
        }
    }
    /* interleave bfloat16 accumulators (even elements, then odd ones) back into order */
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int h = 0; h < num_heads; h++) {
        /* an empty context gives zeros, as in the portable version */
        float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(sums + h * TILE));
        __m512 inverse = _mm512_set1_ps(len > 0 ? 1.0f / sum : 0.0f);
        for (int d = 0; d < dim; d += 32) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(acc + h * dim + d), inverse);
            __m512 y = _mm512_mul_ps(_mm512_loadu_ps(acc + h * dim + d + 16), inverse);
            _mm512_storeu_ps(out + h * dim + d, bf16 ? _mm512_permutex2var_ps(x, first, y) : x);
            _mm512_storeu_ps(out + h * dim + d + 16, bf16 ? _mm512_permutex2var_ps(x, second, y) : y);
        }
    }
}

/* paged_decode with attend_tiled, for head_dim 64, 128 or 256. */
static int paged_decode_tiled(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                              const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                              int head_dim, int block_size, int max_blocks, int bf16, float scale, int num_threads) {
    int width = num_heads * head_dim, group = num_heads / num_kv_heads, failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* each part a whole number of 64-byte lines */
        size_t acc_floats = (size_t)(width + 15) / 16 * 16, head_floats = (size_t)(num_heads + 15) / 16 * 16,
               group_floats = (size_t)(group + 15) / 16 * 16;
        size_t floats = 2 * acc_floats + (size_t)num_heads * TILE + head_floats + (size_t)group * TILE + group_floats;
        float *acc = aligned_alloc(64, sizeof(float) * floats);
        if (acc == NULL) {
            failed = 1;
        } else {
            float *res = acc + acc_floats, *sums = res + acc_floats, *top = sums + (size_t)num_heads * TILE;
            float *p = top + head_floats, *corr = p + (size_t)group * TILE;
#pragma omp for schedule(dynamic)
            for (int seq = 0; seq < num_seqs; seq++) {
                const void *qs = (const char *)q + (int64_t)seq * width * (bf16 ? 2 : 4);
                const int32_t *table = block_tables + (int64_t)seq * max_blocks;
                int len = context_lens[seq];
#define ATTEND(dim, is_bf16)                                                                                        \
    attend_tiled(qs, k_cache, v_cache, table, len, num_heads, num_kv_heads, dim, block_size, is_bf16, scale, acc, \
                 sums, top, p, corr, res)
                /* one copy per head_dim and dtype, so that the loops over dim unroll */
                if (head_dim == 64) bf16 ? ATTEND(64, 1) : ATTEND(64, 0);
                else if (head_dim == 128) bf16 ? ATTEND(128, 1) : ATTEND(128, 0);
                else bf16 ? ATTEND(256, 1) : ATTEND(256, 0);
#undef ATTEND
                store_output(out, seq, width, bf16, res);
            }
            free(acc);
        }
    }
    return failed;
}
#endif

/* Returns 0, or 1 when a thread could not allocate its scratch memory (out is then incomplete). */
int paged_decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                 const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                 int head_dim, int block_size, int max_blocks, int bf16, float scale, int num_threads) {
#if defined(__AVX512F__)
    if (head_dim == 64 || head_dim == 128 || head_dim == 256)
        return paged_decode_tiled(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads,
                                  num_kv_heads, head_dim, block_size, max_blocks, bf16, scale, num_threads);
#endif
    int stride = max_blocks * block_size, width = num_heads * head_dim, failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        size_t floats = (size_t)num_heads * stride + 2 * (size_t)width + (size_t)num_kv_heads * head_dim;
        float *scores = malloc(sizeof(float) * floats);
        if (scores == NULL) {
            failed = 1;
        } else {
            float *qf = scores + (size_t)num_heads * stride, *acc = qf + width, *buf = acc + width;
#pragma omp for schedule(dynamic)
            for (int seq = 0; seq < num_seqs; seq++) {
                memcpy(qf, load_row(q, seq, width, bf16, acc), sizeof(float) * width);
                attend(qf, k_cache, v_cache, block_tables + (int64_t)seq * max_blocks, context_lens[seq],
                       num_heads, num_kv_heads, head_dim, block_size, bf16, scale, scores, stride, buf, acc);
                store_output(out, seq, width, bf16, acc);
            }
            free(scores);
        }
    }
    return failed;
}
