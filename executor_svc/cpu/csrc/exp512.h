/* exp for AVX-512 kernels (paged_decode_avx512.c, prefill_attention.c). */
#ifndef NANOSERVE_EXP512_H
#define NANOSERVE_EXP512_H

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x) for x <= 0 (NaN stays NaN): Cephes' expf polynomial on x - n ln 2, scaled by 2^n. Inputs below
 * -104, where expf underflows to 0, are clamped so that -inf gives 0 rather than NaN. */
static inline __attribute__((always_inline)) __m512 exp_nonpositive(__m512 x) {
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

#endif
#endif
