/* The AVX2 inner loops of prefill_attention.c (e.g. AMD Zen 2/3, no AVX-512): key tiles of 8 (one score per
 * lane), 6 query rows per pass over two tiles (12 score accumulators; with the two key vectors and a query
 * broadcast, 15 of the 16 registers), values 32 columns at a time for 3 rows (12 accumulators). */
#ifndef NANOSERVE_PREFILL_AVX2_H
#define NANOSERVE_PREFILL_AVX2_H

#include <immintrin.h>
#include <math.h>

#include "exp256.h"

#define INLINE static inline __attribute__((always_inline))
#define TILE 8       /* keys per transposed tile: one vector of scores */
#define ROWS 6       /* query rows per pass over the keys */
#define VALUE_ROWS 3 /* rows per pass over the values */
#define KEYS 16      /* keys per score tile: two vectors */

/* scores[r][0..n) = qs[r] . key t for ROWS rows, in tiles of KEYS keys (past n: padding, never read). */
INLINE void score_rows(const float *qs, const float *kt, int stride, int n, int dim, float *scores) {
    for (int t0 = 0; t0 < n; t0 += KEYS) {
        __m256 acc[ROWS][2];
        const float *tile = kt + (int64_t)t0 * dim;
        for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int d = 0; d < dim; d++) {
            __m256 k0 = _mm256_loadu_ps(tile + d * 8), k1 = _mm256_loadu_ps(tile + 8 * dim + d * 8);
            for (int r = 0; r < ROWS; r++) {
                __m256 q = _mm256_broadcast_ss(qs + r * dim + d);
                acc[r][0] = _mm256_fmadd_ps(q, k0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(q, k1, acc[r][1]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            _mm256_storeu_ps(scores + r * stride + t0, acc[r][0]);
            _mm256_storeu_ps(scores + r * stride + t0 + 8, acc[r][1]);
        }
    }
}

/* All ones in the lanes i < count, zeros elsewhere (count may be <= 0 or > 8). */
INLINE __m256 first_lanes(int count) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* Softmax numerators of scores[0..seen) in place, zeros in [seen, n); returns 1 / their sum. */
INLINE float softmax_row(float *s, int seen, int n) {
    __m256 lowest = _mm256_set1_ps(-INFINITY), top = lowest, sum = _mm256_setzero_ps();
    for (int t = 0; t < seen; t += 8)
        top = _mm256_max_ps(top, _mm256_blendv_ps(lowest, _mm256_loadu_ps(s + t), first_lanes(seen - t)));
    __m256 max = _mm256_set1_ps(max8(top));
    for (int t = 0; t < n; t += 8) {
        __m256 e = _mm256_and_ps(first_lanes(seen - t), exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), max)));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    return 1.0f / add8(sum);
}

/* out[r] = sum over keys t < n of p[r][t] * value t, for VALUE_ROWS rows, 32 columns at a time. */
INLINE void add_value_rows(const float *p, int stride, const float *vals, int n, int dim, float *out) {
    for (int c = 0; c < dim; c += 32) {
        __m256 acc[VALUE_ROWS][4];
        for (int r = 0; r < VALUE_ROWS; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
        for (int t = 0; t < n; t++) {
            const float *v = vals + (int64_t)t * dim + c;
            for (int r = 0; r < VALUE_ROWS; r++) {
                __m256 w = _mm256_broadcast_ss(p + r * stride + t);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * j), acc[r][j]);
            }
        }
        for (int r = 0; r < VALUE_ROWS; r++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + r * dim + c + 8 * j, acc[r][j]);
    }
}

#endif
