/* The AVX-512 inner loops of prefill_attention.c: key tiles of 16 (one score per lane), 8 query rows per
 * pass over the keys (16 score accumulators of 32 registers), values 64 columns at a time for 4 rows. */
#ifndef NANOSERVE_PREFILL_AVX512_H
#define NANOSERVE_PREFILL_AVX512_H

#include <immintrin.h>
#include <math.h>

#include "exp512.h"

#define INLINE static inline __attribute__((always_inline))
#define TILE 16      /* keys per transposed tile: one vector of scores */
#define ROWS 8       /* query rows per pass over the keys: 16 score accumulators */
#define VALUE_ROWS 4 /* rows per pass over the values: 16 accumulators */
#define KEYS 32      /* keys per score tile: two vectors */

/* scores[r][0..n) = qs[r] . key t for ROWS rows, in tiles of KEYS keys (past n: padding, never read). */
INLINE void score_rows(const float *qs, const float *kt, int stride, int n, int dim, float *scores) {
    for (int t0 = 0; t0 < n; t0 += KEYS) {
        __m512 acc[ROWS][2];
        const float *tile = kt + (int64_t)t0 * dim;
        for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int d = 0; d < dim; d++) {
            __m512 k0 = _mm512_loadu_ps(tile + d * 16), k1 = _mm512_loadu_ps(tile + 16 * dim + d * 16);
            for (int r = 0; r < ROWS; r++) {
                __m512 q = _mm512_set1_ps(qs[r * dim + d]);
                acc[r][0] = _mm512_fmadd_ps(q, k0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(q, k1, acc[r][1]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            _mm512_storeu_ps(scores + r * stride + t0, acc[r][0]);
            _mm512_storeu_ps(scores + r * stride + t0 + 16, acc[r][1]);
        }
    }
}

/* Softmax numerators of scores[0..seen) in place, zeros in [seen, n); returns 1 / their sum. */
INLINE float softmax_row(float *s, int seen, int n) {
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int t = 0; t < seen; t += 16) {
        __mmask16 m = seen - t >= 16 ? 0xffff : (__mmask16)((1u << (seen - t)) - 1);
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, m, s + t));
    }
    __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int t = 0; t < n; t += 16) {
        __mmask16 m = t >= seen ? 0 : seen - t >= 16 ? 0xffff : (__mmask16)((1u << (seen - t)) - 1);
        __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), max)));
        _mm512_storeu_ps(s + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* out[r] = sum over keys t < n of p[r][t] * value t, for VALUE_ROWS rows, 64 columns at a time. */
INLINE void add_value_rows(const float *p, int stride, const float *vals, int n, int dim, float *out) {
    for (int c = 0; c < dim; c += 64) {
        __m512 acc[VALUE_ROWS][4];
        for (int r = 0; r < VALUE_ROWS; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        for (int t = 0; t < n; t++) {
            __m512 v[4];
            for (int j = 0; j < 4; j++) v[j] = _mm512_loadu_ps(vals + (int64_t)t * dim + c + 16 * j);
            for (int r = 0; r < VALUE_ROWS; r++) {
                __m512 w = _mm512_set1_ps(p[r * stride + t]);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(w, v[j], acc[r][j]);
            }
        }
        for (int r = 0; r < VALUE_ROWS; r++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + r * dim + c + 16 * j, acc[r][j]);
    }
}

#endif
