/* The tiled decode kernel of paged_decode.h with AVX2 and FMA (e.g. AMD Zen 2/3), for CPUs without AVX-512:
 * tiles of 8 tokens, one score per lane of a 256-bit vector. With 16 vector registers the values are added
 * 16 elements of head_dim at a time, for up to 4 query heads at once (8 accumulators). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp256.h"
#include "paged_decode.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))
#define TILE PAGED_DECODE_TILED
#define HEADS_PER_PASS 4 /* query heads whose value sums share one pass over the tile */

/* Lane i of the result is the sum of the 8 lanes of v[i]: 6 horizontal adds, 2 lane swaps and one add. */
INLINE __m256 sum8(const __m256 *v) {
    /* per 128-bit lane: the sums of lanes 0-3 (low half) or 4-7 (high half) of v[0..3], then of v[4..7] */
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* 16 bfloat16 as two float vectors, without a cross-lane shuffle: the even elements, then the odd ones. */
INLINE __m256 bf16_even(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
INLINE __m256 bf16_odd(__m256i x) {
    return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
}

/* Partial sums of the dot product of a query row with a key row of `dim` elements, over 8 lanes. */
INLINE __m256 row_dot(const void *q, const void *k, int dim, int bf16) {
    __m256 s = _mm256_setzero_ps();
    if (!bf16) {
        for (int d = 0; d < dim; d += 8)
            s = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)q + d), _mm256_loadu_ps((const float *)k + d), s);
        return s;
    }
    for (int d = 0; d < dim; d += 16) {
        __m256i qv = _mm256_loadu_si256((const __m256i *)((const uint16_t *)q + d));
        __m256i kv = _mm256_loadu_si256((const __m256i *)((const uint16_t *)k + d));
        s = _mm256_fmadd_ps(bf16_even(qv), bf16_even(kv), s);
        s = _mm256_fmadd_ps(bf16_odd(qv), bf16_odd(kv), s);
    }
    return s;
}

/* acc[h] = acc[h] * corr[h] + sum over the tile's n tokens of p[h][t] * v[t], for `heads` (constant after
 * inlining, at most HEADS_PER_PASS) query heads, 16 elements at a time so that the accumulators stay in
 * registers. bfloat16 accumulators hold each 16 elements as even ones then odd ones (see bf16_even). */
INLINE void add_values(float *acc, const float *corr, const float *p, const void *const *rows, int n, int heads,
                       int dim, int bf16) {
    for (int c = 0; c < dim; c += 16) {
        __m256 a[HEADS_PER_PASS][2];
        for (int h = 0; h < heads; h++) {
            __m256 w = _mm256_set1_ps(corr[h]);
            a[h][0] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * dim + c), w);
            a[h][1] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * dim + c + 8), w);
        }
        for (int t = 0; t < n; t++) {
            __m256 v0, v1;
            if (bf16) {
                __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)rows[t] + c));
                v0 = bf16_even(x);
                v1 = bf16_odd(x);
            } else {
                v0 = _mm256_loadu_ps((const float *)rows[t] + c);
                v1 = _mm256_loadu_ps((const float *)rows[t] + c + 8);
            }
            for (int h = 0; h < heads; h++) {
                __m256 w = _mm256_set1_ps(p[h * TILE + t]);
                a[h][0] = _mm256_fmadd_ps(w, v0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(w, v1, a[h][1]);
            }
        }
        for (int h = 0; h < heads; h++) {
            _mm256_storeu_ps(acc + h * dim + c, a[h][0]);
            _mm256_storeu_ps(acc + h * dim + c + 8, a[h][1]);
        }
    }
}

/* One request, see paged_decode.h. `dim` and `bf16` are constants in each inlined copy. */
INLINE void attend_tiled(const tiled_request *r, const tiled_scratch *s, int dim, int bf16) {
    int num_heads = r->num_heads, group = num_heads / r->num_kv_heads, len = r->len, esize = bf16 ? 2 : 4;
    int slot_size = r->num_kv_heads * dim;
    int64_t slot_bytes = (int64_t)slot_size * esize, slots[TILE];
    float *acc = s->acc, *sums = s->sums, *top = s->top, *p = s->p, *corr = s->corr;
    memset(acc, 0, sizeof(float) * num_heads * dim);
    memset(sums, 0, sizeof(float) * num_heads * TILE);
    for (int h = 0; h < num_heads; h++) top[h] = -INFINITY;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    prefetch_tokens(r->k_cache, r->v_cache, r->table, 0, TILE, len, r->block_size, slot_bytes);
    for (int t0 = 0; t0 < len; t0 += TILE) {
        int n = len - t0 < TILE ? len - t0 : TILE, ahead = t0 + TILE;
        __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
        tile_slots(r->table, t0, len, r->block_size, slot_size, TILE, slots);
        for (int kv = 0; kv < r->num_kv_heads; kv++) {
            const void *k_rows[TILE], *v_rows[TILE];
            for (int i = 0; i < TILE; i++) {
                k_rows[i] = (const char *)r->k_cache + (slots[i] + (int64_t)kv * dim) * esize;
                v_rows[i] = (const char *)r->v_cache + (slots[i] + (int64_t)kv * dim) * esize;
            }
            for (int g = 0; g < group; g++) {
                int h = kv * group + g;
                /* the next tile's slots, a share per query head: a burst of prefetches holds up the loads */
                prefetch_tokens(r->k_cache, r->v_cache, r->table, ahead + h * TILE / num_heads,
                                ahead + (h + 1) * TILE / num_heads, len, r->block_size, slot_bytes);
                const char *qh = (const char *)r->q + (int64_t)h * dim * esize;
                __m256 part[TILE];
                for (int i = 0; i < TILE; i++) part[i] = row_dot(qh, k_rows[i], dim, bf16);
                __m256 scores = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                                 _mm256_mul_ps(sum8(part), _mm256_set1_ps(r->scale)), valid);
                /* online softmax: a new maximum rescales what was summed under the old one */
                float tile_top = max8(scores);
                corr[g] = 1.0f;
                if (tile_top > top[h]) {
                    __m256 c = exp_nonpositive(_mm256_set1_ps(top[h] - tile_top));
                    corr[g] = _mm_cvtss_f32(_mm256_castps256_ps128(c));
                    top[h] = tile_top;
                }
                __m256 e = _mm256_and_ps(valid, exp_nonpositive(_mm256_sub_ps(scores, _mm256_set1_ps(top[h]))));
                _mm256_storeu_ps(sums + h * TILE,
                                 _mm256_fmadd_ps(_mm256_loadu_ps(sums + h * TILE), _mm256_set1_ps(corr[g]), e));
                _mm256_storeu_ps(p + g * TILE, e);
            }
            float *a = acc + (int64_t)kv * group * dim;
            for (int g = 0; g < group; g += HEADS_PER_PASS) {
                int heads = group - g < HEADS_PER_PASS ? group - g : HEADS_PER_PASS;
                /* a constant head count per call keeps the accumulators in registers */
                if (heads == 4) add_values(a + g * dim, corr + g, p + g * TILE, v_rows, n, 4, dim, bf16);
                else if (heads == 3) add_values(a + g * dim, corr + g, p + g * TILE, v_rows, n, 3, dim, bf16);
                else if (heads == 2) add_values(a + g * dim, corr + g, p + g * TILE, v_rows, n, 2, dim, bf16);
                else add_values(a + g * dim, corr + g, p + g * TILE, v_rows, n, 1, dim, bf16);
            }
        }
    }
    for (int h = 0; h < num_heads; h++) {
        /* an empty context gives zeros, as in the portable version */
        float sum = add8(_mm256_loadu_ps(sums + h * TILE));
        __m256 inverse = _mm256_set1_ps(len > 0 ? 1.0f / sum : 0.0f);
        for (int d = 0; d < dim; d += 16) {
            __m256 x = _mm256_mul_ps(_mm256_loadu_ps(acc + h * dim + d), inverse);
            __m256 y = _mm256_mul_ps(_mm256_loadu_ps(acc + h * dim + d + 8), inverse);
            if (bf16) { /* interleave even and odd elements back into order */
                __m256 lo = _mm256_unpacklo_ps(x, y), hi = _mm256_unpackhi_ps(x, y);
                x = _mm256_permute2f128_ps(lo, hi, 0x20);
                y = _mm256_permute2f128_ps(lo, hi, 0x31);
            }
            _mm256_storeu_ps(s->res + h * dim + d, x);
            _mm256_storeu_ps(s->res + h * dim + d + 8, y);
        }
    }
}

/* One copy of attend_tiled per head_dim and dtype, so that the loops over dim unroll. */
#define ATTEND(dim, is_bf16)                                                                                   \
    static void attend_##dim##_##is_bf16(const tiled_request *r, const tiled_scratch *s) {                     \
        attend_tiled(r, s, dim, is_bf16);                                                                      \
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
