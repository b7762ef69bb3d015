/* exp and horizontal reductions for AVX2 kernels (paged_decode_avx2.c, prefill_avx2.h). */
#ifndef NANOSERVE_EXP256_H
#define NANOSERVE_EXP256_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp(x) for x <= 0 (NaN stays NaN): Cephes' expf polynomial on x - n ln 2, times 2^n built in the exponent
 * bits. Inputs are clamped at -88, where 2^n's exponent field is 0: exp is then 0 (float32's normal range ends
 * at exp(-87.3)), and -inf gives 0 rather than NaN. */
static inline __attribute__((always_inline)) __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-88.0f), x); /* a NaN x is returned as is */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

static inline __attribute__((always_inline)) float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline __attribute__((always_inline)) float add8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#endif
#endif
