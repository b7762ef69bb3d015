/* Small-M linear layer: y [m, n] = x [m, k] @ w.T (+ bias), float32 or bfloat16.
 *
 * Decode steps multiply a few rows (one per running sequence) by large weights, so the cost is streaming
 * the weight from memory once while keeping the FMA units busy. The weight is packed once into panels of
 * 16 output columns, each panel stored k-major so that one 64-byte vector holds the weights of 16 outputs
 * for one "k step":
 *   float32:  [ceil(n/16)][k][16]                    (w[p*16 + j][i] at ((p*k + i)*16 + j))
 *   bfloat16: [ceil(n/16)][ceil(k/2)][16][2]         (pairs of k, the layout vdpbf16ps consumes)
 * Columns past n and the odd k of bfloat16 are zero. In both cases a k step is one 32-bit unit per
 * output (one float, or a pair of bfloat16), so the same loops serve both dtypes.
 *
 * Threads split the panels in contiguous ranges, so each streams its own part of the weight once. A
 * thread walks its range in groups of NR panels; for each group it runs the register-blocked micro-kernel
 * (up to MR rows x NR panels of float32 accumulators, one broadcast of x per row and k step) over all row
 * tiles, so the group's weights come from memory once and from L2 for the other tiles. While it computes
 * a group it prefetches the next one into L2, spreading the prefetches over the group's tiles, which
 * overlaps the memory stream with the compute when there are several tiles. Sums over blocks of k are
 * added up separately (shorter rounding chains, as in torch's blocked GEMM); results are rounded to
 * bfloat16 once, at the end (nearest-even, as torch does).
 *
 * Without AVX-512 a plain C version of the same loops runs on the same layout. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"
#include "kernels.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define LIN_LANES 16             /* outputs per panel: one 512-bit vector of float32 */
#define LIN_MR 8                 /* rows per micro-kernel tile */
#define LIN_NR 3                 /* panels per micro-kernel tile: 8 x 3 = 24 accumulators */
#define LIN_KC 64                /* k steps summed in registers before adding to the total */
#define LIN_X_BLOCK_BYTES 393216 /* rows of x processed per pass are capped so they stay in L2 */
#define LIN_MIN_PARALLEL (1 << 18) /* below this many multiply-adds threads cost more than they save */

static inline int64_t lin_panels(int64_t n) { return (n + LIN_LANES - 1) / LIN_LANES; }
static inline int64_t lin_ksteps(int64_t k, int bf16) { return bf16 ? (k + 1) / 2 : k; }

/* 1 when this build has the AVX-512 or the AVX2 kernel: the portable loops below are correct but slower
 * than a vendor BLAS, so the caller keeps torch's GEMM without either. */
int linear_is_vectorised(void) {
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

int64_t linear_packed_bytes(int64_t n, int64_t k, int bf16) {
    return lin_panels(n) * lin_ksteps(k, bf16) * LIN_LANES * 4;
}

void linear_pack(const void *w, void *packed, int64_t n, int64_t k, int bf16) {
    const int64_t np = lin_panels(n), ks = lin_ksteps(k, bf16);
    if (bf16) {
        const uint16_t *src = w;
        uint16_t *dst = packed;
        for (int64_t p = 0; p < np; p++)
            for (int64_t s = 0; s < ks; s++)
                for (int j = 0; j < LIN_LANES; j++)
                    for (int h = 0; h < 2; h++) {
                        const int64_t row = p * LIN_LANES + j, col = 2 * s + h;
                        dst[((p * ks + s) * LIN_LANES + j) * 2 + h] = row < n && col < k ? src[row * k + col] : 0;
                    }
    } else {
        const float *src = w;
        float *dst = packed;
        for (int64_t p = 0; p < np; p++)
            for (int64_t s = 0; s < ks; s++)
                for (int j = 0; j < LIN_LANES; j++) {
                    const int64_t row = p * LIN_LANES + j;
                    dst[(p * ks + s) * LIN_LANES + j] = row < n ? src[row * k + s] : 0.0f;
                }
    }
}

/* x is read in 32-bit units whatever its dtype, and a bfloat16 x may be only 2-byte aligned */
typedef uint32_t lin_unit __attribute__((may_alias, aligned(2)));

/* Everything one thread needs to compute rows [0, m) of the panels it owns. x is in 32-bit units (floats,
 * or pairs of bfloat16), rows x_stride units apart; w points at the first panel, panels ks * 16 units apart. */
typedef struct {
    const lin_unit *x;
    int64_t x_stride, m, n, ks;
    const uint32_t *w;
    const void *bias;
    void *y;
    int bf16;
} lin_args;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

#define LIN_INLINE static inline __attribute__((always_inline))

/* Adds bias and writes one 16-column vector of a row, masking the columns past n. */
LIN_INLINE void lin_store(const lin_args *a, int64_t row, int64_t col, __m512 v) {
    const int64_t left = a->n - col;
    const __mmask16 mask = left >= LIN_LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    if (a->bf16) {
        if (a->bias) {
            const __m256i b = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)a->bias + col);
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
        }
        _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)a->y + row * a->n + col, mask, bf16_round_512(v));
    } else {
        if (a->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, (const float *)a->bias + col));
        _mm512_mask_storeu_ps((float *)a->y + row * a->n + col, mask, v);
    }
}

/* Micro-kernel: rows [r0, r0 + mr) x panels [p, p + nr) over all k steps. mr, nr and bf16 are constants
 * after inlining, so the accumulators live in registers. Each k step also prefetches pf_lines cache lines
 * of the next group, pf_step bytes further each step. */
LIN_INLINE void lin_tile(const lin_args *a, const int mr, const int nr, const int bf16, int64_t r0, int64_t p,
                         const char *pf, int64_t pf_step, int pf_lines) {
    const int64_t ks = a->ks, panel = ks * LIN_LANES;
    const uint32_t *w = a->w + p * panel;
    const lin_unit *x = a->x + r0 * a->x_stride;
    /* sums of blocks of LIN_KC k steps are added up in memory: shorter chains of additions, so the
     * rounding error stays at the level of torch's blocked GEMM */
    __m512 acc[LIN_MR][LIN_NR], total[LIN_MR][LIN_NR];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) total[r][c] = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < ks; s0 += LIN_KC) {
        const int64_t s1 = s0 + LIN_KC < ks ? s0 + LIN_KC : ks;
        for (int r = 0; r < mr; r++)
            for (int c = 0; c < nr; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t s = s0; s < s1; s++) {
            for (int l = 0; l < pf_lines; l++) _mm_prefetch(pf + s * pf_step + 64 * l, _MM_HINT_T1);
            __m512i wv[LIN_NR];
            for (int c = 0; c < nr; c++) wv[c] = _mm512_load_si512(w + c * panel + s * LIN_LANES);
            for (int r = 0; r < mr; r++) {
                const __m512i xv = _mm512_set1_epi32((int)x[r * a->x_stride + s]);
                for (int c = 0; c < nr; c++) {
                    if (!bf16) {
                        acc[r][c] = _mm512_fmadd_ps(_mm512_castsi512_ps(xv), _mm512_castsi512_ps(wv[c]), acc[r][c]);
                    } else {
#if defined(__AVX512BF16__)
                        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)wv[c]);
#else
                        /* a pair's low half is the even k: widen each half to float32 and FMA both */
                        const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000);
                        acc[r][c] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(xv, 16)),
                                                    _mm512_castsi512_ps(_mm512_slli_epi32(wv[c], 16)), acc[r][c]);
                        acc[r][c] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(xv, hi)),
                                                    _mm512_castsi512_ps(_mm512_and_si512(wv[c], hi)), acc[r][c]);
#endif
                    }
                }
            }
        }
        for (int r = 0; r < mr; r++)
            for (int c = 0; c < nr; c++) total[r][c] = _mm512_add_ps(total[r][c], acc[r][c]);
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) lin_store(a, r0 + r, (p + c) * LIN_LANES, total[r][c]);
}

typedef void (*lin_tile_fn)(const lin_args *, int64_t, int64_t, const char *, int64_t, int);

#define LIN_TILE(mr, nr, bf16)                                                                                      \
    static void lin_tile_##mr##_##nr##_##bf16(const lin_args *a, int64_t r0, int64_t p, const char *pf,          \
                                              int64_t pf_step, int pf_lines) {                                    \
        lin_tile(a, mr, nr, bf16, r0, p, pf, pf_step, pf_lines);                                                 \
    }
#define LIN_TILE_ROWS(mr, bf16) LIN_TILE(mr, 1, bf16) LIN_TILE(mr, 2, bf16) LIN_TILE(mr, 3, bf16)
#define LIN_TILE_ALL(bf16)                                                                                         \
    LIN_TILE_ROWS(1, bf16) LIN_TILE_ROWS(2, bf16) LIN_TILE_ROWS(3, bf16) LIN_TILE_ROWS(4, bf16)                  \
    LIN_TILE_ROWS(5, bf16) LIN_TILE_ROWS(6, bf16) LIN_TILE_ROWS(7, bf16) LIN_TILE_ROWS(8, bf16)
LIN_TILE_ALL(0)
LIN_TILE_ALL(1)

#define LIN_ROW(mr, bf16) {lin_tile_##mr##_1_##bf16, lin_tile_##mr##_2_##bf16, lin_tile_##mr##_3_##bf16}
#define LIN_TABLE(bf16)                                                                                            \
    {LIN_ROW(1, bf16), LIN_ROW(2, bf16), LIN_ROW(3, bf16), LIN_ROW(4, bf16),                                     \
     LIN_ROW(5, bf16), LIN_ROW(6, bf16), LIN_ROW(7, bf16), LIN_ROW(8, bf16)}
static const lin_tile_fn lin_tiles[2][LIN_MR][LIN_NR] = {LIN_TABLE(0), LIN_TABLE(1)};

/* Panels [p0, p1) for all rows: groups of NR panels, each over all row tiles of a block of rows. */
static void lin_range(const lin_args *a, int64_t p0, int64_t p1) {
    const int64_t panel_bytes = a->ks * LIN_LANES * 4;
    int64_t block = LIN_X_BLOCK_BYTES / (a->ks * 4) / LIN_MR * LIN_MR;
    if (block < LIN_MR) block = LIN_MR;
    for (int64_t b0 = 0; b0 < a->m; b0 += block) {
        const int64_t rows = a->m - b0 < block ? a->m - b0 : block;
        const int64_t tiles = (rows + LIN_MR - 1) / LIN_MR;
        for (int64_t p = p0; p < p1; p += LIN_NR) {
            const int nr = p1 - p < LIN_NR ? (int)(p1 - p) : LIN_NR;
            /* the next group (contiguous after this one) is prefetched in equal parts by this group's tiles */
            const int64_t next = p + nr, next_nr = p1 - next < LIN_NR ? p1 - next : LIN_NR;
            const int64_t part = next_nr * panel_bytes / tiles;
            const int64_t pf_step = (part + a->ks - 1) / a->ks;
            const int pf_lines = (int)((pf_step + 63) / 64);
            int64_t r0 = b0;
            for (int64_t t = 0; t < tiles; t++) {
                /* tiles of nearly equal size: 9 rows run as 5 + 4, not 8 + 1 */
                const int mr = (int)(rows / tiles + (t < rows % tiles));
                const char *pf = (const char *)(a->w + next * a->ks * LIN_LANES) + t * part;
                lin_tiles[a->bf16][mr - 1][nr - 1](a, r0, p, pf, pf_step, next_nr > 0 ? pf_lines : 0);
                r0 += mr;
            }
        }
    }
}

#else

/* Adds bias and writes the float32 sums of one row's 16 columns from col, those before n. */
static inline void lin_store_lanes(const lin_args *a, int64_t row, int64_t col, const float *sums) {
    for (int j = 0; j < LIN_LANES && col + j < a->n; j++) {
        if (a->bf16) {
            const float b = a->bias ? bf16_to_float(((const uint16_t *)a->bias)[col + j]) : 0.0f;
            ((uint16_t *)a->y)[row * a->n + col + j] = float_to_bf16(sums[j] + b);
        } else {
            const float b = a->bias ? ((const float *)a->bias)[col + j] : 0.0f;
            ((float *)a->y)[row * a->n + col + j] = sums[j] + b;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* AVX2 (e.g. AMD Zen 2/3): a panel's k step is two 256-bit vectors. A tile is up to 6 float32 rows or 4
 * bfloat16 rows of one panel: 12 or 8 accumulators of the 16 registers, the bfloat16 tile also holding its
 * weights widened to float32 (each pair as two halves with zero-filled low bits, for two FMAs: the sums the
 * AVX-512 kernel makes without AVX512_BF16). Measured on a 2-core Zen 3 (docs/benchmarks-history.md): 6 float32
 * rows ran faster than 4 from 64 rows up; neither x widened to float32 once per call (instead of each broadcast
 * pair in registers) nor 6-row bfloat16 tiles over half panels ran faster. */

#define LIN_INLINE static inline __attribute__((always_inline))

static inline int lin_max_rows(int bf16) { return bf16 ? 4 : 6; }

LIN_INLINE void lin_tile2(const lin_args *a, const int mr, const int bf16, int64_t r0, int64_t p) {
    const int64_t ks = a->ks;
    const uint32_t *w = a->w + p * ks * LIN_LANES;
    const lin_unit *x = a->x + r0 * a->x_stride;
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000);
    __m256 acc[6][2], total[6][2];
    for (int r = 0; r < mr; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();
    for (int64_t s0 = 0; s0 < ks; s0 += LIN_KC) {
        const int64_t s1 = s0 + LIN_KC < ks ? s0 + LIN_KC : ks;
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t s = s0; s < s1; s++) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(w + s * LIN_LANES));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(w + s * LIN_LANES + 8));
            if (!bf16) {
                for (int r = 0; r < mr; r++) {
                    const __m256 xv = _mm256_broadcast_ss((const float *)(x + r * a->x_stride + s));
                    acc[r][0] = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(w0), acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(w1), acc[r][1]);
                }
            } else {
                /* a pair's low half is the even k */
                const __m256 w0l = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
                const __m256 w0h = _mm256_castsi256_ps(_mm256_and_si256(w0, hi));
                const __m256 w1l = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
                const __m256 w1h = _mm256_castsi256_ps(_mm256_and_si256(w1, hi));
                for (int r = 0; r < mr; r++) {
                    const __m256i xv = _mm256_set1_epi32((int)x[r * a->x_stride + s]);
                    const __m256 xl = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16));
                    const __m256 xh = _mm256_castsi256_ps(_mm256_and_si256(xv, hi));
                    acc[r][0] = _mm256_fmadd_ps(xh, w0h, _mm256_fmadd_ps(xl, w0l, acc[r][0]));
                    acc[r][1] = _mm256_fmadd_ps(xh, w1h, _mm256_fmadd_ps(xl, w1l, acc[r][1]));
                }
            }
        }
        for (int r = 0; r < mr; r++) {
            total[r][0] = _mm256_add_ps(total[r][0], acc[r][0]);
            total[r][1] = _mm256_add_ps(total[r][1], acc[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        float sums[LIN_LANES];
        _mm256_storeu_ps(sums, total[r][0]);
        _mm256_storeu_ps(sums + 8, total[r][1]);
        lin_store_lanes(a, r0 + r, p * LIN_LANES, sums);
    }
}

typedef void (*lin_tile2_fn)(const lin_args *, int64_t, int64_t);
#define LIN_TILE2(mr, bf16)                                                                                         \
    static void lin_tile2_##mr##_##bf16(const lin_args *a, int64_t r0, int64_t p) { lin_tile2(a, mr, bf16, r0, p); }
LIN_TILE2(1, 0) LIN_TILE2(2, 0) LIN_TILE2(3, 0) LIN_TILE2(4, 0) LIN_TILE2(5, 0) LIN_TILE2(6, 0)
LIN_TILE2(1, 1) LIN_TILE2(2, 1) LIN_TILE2(3, 1) LIN_TILE2(4, 1)
static const lin_tile2_fn lin_tiles2[2][6] = {
    {lin_tile2_1_0, lin_tile2_2_0, lin_tile2_3_0, lin_tile2_4_0, lin_tile2_5_0, lin_tile2_6_0},
    {lin_tile2_1_1, lin_tile2_2_1, lin_tile2_3_1, lin_tile2_4_1, NULL, NULL},
};

/* Panels [p0, p1) for all rows: each panel over all row tiles of a block of rows, so it comes from memory
 * once and from L2 for the other tiles (the hardware prefetcher follows the contiguous panels). */
static void lin_range(const lin_args *a, int64_t p0, int64_t p1) {
    const int mr_max = lin_max_rows(a->bf16);
    int64_t block = LIN_X_BLOCK_BYTES / (a->ks * 4) / mr_max * mr_max;
    if (block < mr_max) block = mr_max;
    for (int64_t b0 = 0; b0 < a->m; b0 += block) {
        const int64_t rows = a->m - b0 < block ? a->m - b0 : block;
        const int64_t tiles = (rows + mr_max - 1) / mr_max;
        for (int64_t p = p0; p < p1; p++) {
            int64_t r0 = b0;
            for (int64_t t = 0; t < tiles; t++) {
                const int mr = (int)(rows / tiles + (t < rows % tiles));
                lin_tiles2[a->bf16][mr - 1](a, r0, p);
                r0 += mr;
            }
        }
    }
}

#else /* portable C: the same layout, one panel and one row at a time */

static void lin_range(const lin_args *a, int64_t p0, int64_t p1) {
    const int64_t ks = a->ks;
    for (int64_t p = p0; p < p1; p++) {
        const uint32_t *w = a->w + p * ks * LIN_LANES;
        for (int64_t r = 0; r < a->m; r++) {
            const lin_unit *x = a->x + r * a->x_stride;
            float acc[LIN_LANES] = {0};
            for (int64_t s0 = 0; s0 < ks; s0 += LIN_KC) {
                float part[LIN_LANES] = {0};
                for (int64_t s = s0; s < s0 + LIN_KC && s < ks; s++) {
                    if (a->bf16) {
                        const uint16_t *xs = (const uint16_t *)(x + s), *ws = (const uint16_t *)(w + s * LIN_LANES);
                        const float x0 = bf16_to_float(xs[0]), x1 = bf16_to_float(xs[1]);
                        for (int j = 0; j < LIN_LANES; j++)
                            part[j] += x0 * bf16_to_float(ws[2 * j]) + x1 * bf16_to_float(ws[2 * j + 1]);
                    } else {
                        const float xs = ((const float *)x)[s], *ws = (const float *)(w + s * LIN_LANES);
                        for (int j = 0; j < LIN_LANES; j++) part[j] += xs * ws[j];
                    }
                }
                for (int j = 0; j < LIN_LANES; j++) acc[j] += part[j];
            }
            lin_store_lanes(a, r, p * LIN_LANES, acc);
        }
    }
}

#endif
#endif

/* Returns 0, or 1 when a copy of x could not be allocated (y is then not written). bfloat16 runs on AMX tiles
 * where this build and the CPU have them (linear_amx.c), for every k that is a multiple of 32. */
int linear_forward(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int64_t m,
                   int64_t n, int64_t k, int bf16, int num_threads) {
    const int64_t np = lin_panels(n), ks = lin_ksteps(k, bf16);
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > np) threads = (int)np;
    if (m * n * k < LIN_MIN_PARALLEL) threads = 1;
    if (bf16) {
        const int amx = linear_amx(x, x_stride, packed, bias, y, m, n, k, threads);
        if (amx >= 0) return amx;
    }
    lin_args a = {x, x_stride, m, n, ks, packed, bias, y, bf16};
    uint32_t *padded = NULL;
    if (bf16 && ((k & 1) || (x_stride & 1))) {
        /* odd k or odd row stride: copy x, with a zero after each odd row, so that every k step reads a
         * whole pair at a 4-byte offset */
        padded = malloc((size_t)(m * ks) * 4);
        if (padded == NULL) return 1;
        for (int64_t r = 0; r < m; r++) {
            uint16_t *dst = (uint16_t *)(padded + r * ks);
            memcpy(dst, (const uint16_t *)x + r * x_stride, (size_t)k * 2);
            if (k & 1) dst[k] = 0;
        }
        a.x = padded;
        a.x_stride = ks;
    } else if (bf16) {
        a.x_stride = x_stride / 2;
    }
    if (threads == 1) {
        lin_range(&a, 0, np);
    } else {
#pragma omp parallel num_threads(threads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            lin_range(&a, np * t / nt, np * (t + 1) / nt);
        }
    }
    free(padded);
    return 0;
}
