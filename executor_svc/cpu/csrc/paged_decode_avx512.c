/* The tiled decode kernel of paged_decode.h with AVX-512: tiles of 16 tokens, 16 partial dot products per
 * head summed by a transpose-add tree, bfloat16 pairs multiplied with vdpbf16ps where the CPU has it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp512.h"
#include "paged_decode.h"

#if defined(__AVX512F__)
#include <immintrin.h>


#define INLINE static inline __attribute__((always_inline))
#define TILE PAGED_DECODE_TILED

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

/* One request, see paged_decode.h. `dim` and `bf16` are constants in each inlined copy. Scratch:
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
        tile_slots(table, t0, len, block_size, slot_size, TILE, slots);
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

/* One copy of attend_tiled per head_dim and dtype, so that the loops over dim unroll. */
#define ATTEND(dim, is_bf16)                                                                                   \
    static void attend_##dim##_##is_bf16(const tiled_request *r, const tiled_scratch *s) {                     \
        attend_tiled(r->q, r->k_cache, r->v_cache, r->table, r->len, r->num_heads, r->num_kv_heads, dim,        \
                     r->block_size, is_bf16, r->scale, s->acc, s->sums, s->top, s->p, s->corr, s->res);        \
    }
ATTEND(64, 0) ATTEND(64, 1) ATTEND(128, 0) ATTEND(128, 1) ATTEND(256, 0) ATTEND(256, 1)
#undef ATTEND

int paged_decode_tiled(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                       const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                       int head_dim, int block_size, int max_blocks, int bf16, float scale, int num_threads) {
    tiled_attend_fn attend = head_dim == 64    ? (bf16 ? attend_64_1 : attend_64_0)
                             : head_dim == 128 ? (bf16 ? attend_128_1 : attend_128_0)
                                               : (bf16 ? attend_256_1 : attend_256_0);
    return decode_tiled(attend, TILE, q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads,
                        num_kv_heads, head_dim, block_size, max_blocks, bf16, scale, num_threads);
}
#endif
