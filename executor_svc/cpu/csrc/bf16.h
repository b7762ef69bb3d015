/* bfloat16 <-> float32 for the CPU kernels, rounding as torch does: to nearest, ties to even, NaN to a
 * quiet NaN. Branch-free, so that loops over rows vectorise. */
#ifndef NANOSERVE_BF16_H
#define NANOSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* f rounded to the nearest bfloat16, kept as a float32: what torch does to the result of a bfloat16 op. */
static inline float bf16_round(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits = f != f ? 0x7fc00000u : (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    f = bf16_round(f);
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* 16 float32 rounded to bfloat16 in integers, as bf16_round: the low 16 bits of each lane hold the result. */
static inline __m512i bf16_round_512(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
#endif

#endif
