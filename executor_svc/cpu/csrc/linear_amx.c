/* bfloat16 linear layer on AMX tiles (Intel Xeon from Sapphire Rapids on), on linear.c's packed layout.
 *
 * linear.c packs a bfloat16 weight as panels of 16 output columns, each [ceil(k/2)][16][2]: 16 k steps of a
 * panel are 1 KiB, 16 rows of 64 bytes, exactly the B operand of TDPBF16PS (16 pairs of k by 16 columns). So
 * the AMX kernel reads the same packed weight: a panel's k steps in tiles of 1 KiB, x in tiles of up to 16 rows
 * by 32 k, sums in float32 tiles of 16 rows by 16 columns.
 *
 * A decode step's GEMMs are a stream of the weights, and on a Xeon the AVX-512 kernel's FMAs fall behind the
 * stream from a few rows up (each k step broadcasts x once per row). A tile multiply does 16 rows by 16 columns
 * by 32 k at once, so the weight stream sets the pace up to 64 rows. Each thread owns a contiguous range of
 * panels and walks it two panels at a time, the rows two tiles at a time: 4 float32 tiles of sums, 2 of x, 2 of
 * weights, the 8 AMX tiles. A pair of panels is read from memory for the first two row tiles and from L2 for
 * the others. Software prefetching made it slower: the hardware prefetcher follows the contiguous panels.
 * Prefill's thousands of rows go in blocks of AMX_BLOCK_TILES row tiles, each block over all the thread's
 * panels: x's rows then come from L2 rather than from further out (all rows at once ran slower from 2048 rows,
 * blocks of 2 tiles slower at all row counts, blocks of 16 no better than all rows).
 *
 * The tiles' configuration is per thread and shared with oneDNN, which runs its AMX GEMMs on the same OpenMP
 * threads (torch's): each call saves the configuration it finds and puts it back, so neither sees the other's.
 * Linux hands AMX's tile state to a process only on request (arch_prctl), once.
 *
 * Only built where the compiler targets AMX (-march=native on such a CPU); elsewhere linear_amx declines. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16.h"

#define AMX_ROWS 16              /* rows of a tile */
#define AMX_K 32                 /* bfloat16 k of an x tile, 16 pairs of a weight tile */
#define AMX_PANEL_STEP 1024      /* bytes of one panel's 16 k steps */
#define AMX_BLOCK_TILES 8        /* row tiles a pass over the panels takes (an even number) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_permitted;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_request(void) { amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

int linear_amx_ready(void) {
    pthread_once(&amx_once, amx_request);
    return amx_permitted;
}

/* Adds bias and writes rows [row0, row0 + rows) of a 16-column tile of float32 sums as bfloat16. */
static inline void amx_store(const float *sums, int rows, int64_t row0, int64_t col, int64_t n, const uint16_t *bias,
                             uint16_t *y) {
    const int64_t left = n - col;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + col)), 16))
                          : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++)
        _mm512_mask_cvtepi32_storeu_epi16(y + (row0 + r) * n + col, mask,
                                          bf16_round_512(_mm512_add_ps(_mm512_load_ps(sums + r * 16), b)));
}

typedef struct {
    const uint16_t *tile_x[2];   /* the first row of each of the two row tiles */
    int64_t tile_stride[2];      /* their row strides in bytes */
    int tile_rows[2];            /* their rows to write (0: no second tile) */
    int64_t row0;
} amx_rows;

/* Sums of one or two row tiles by one or two panels (w0, w0 + panel) over all k, written to y. */
static inline void amx_block(const amx_rows *r, const char *w0, int two_panels, int64_t panel_bytes, int64_t k_tiles,
                             int64_t col, int64_t n, const uint16_t *bias, uint16_t *y) {
    float sums[AMX_ROWS * 16] __attribute__((aligned(64)));
    const char *w1 = w0 + panel_bytes;
    const int two_tiles = r->tile_rows[1] > 0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t q = 0; q < k_tiles; q++) {
        _tile_loadd(4, r->tile_x[0] + q * AMX_K, r->tile_stride[0]);
        _tile_loadd(6, w0 + q * AMX_PANEL_STEP, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_panels) {
            _tile_loadd(7, w1 + q * AMX_PANEL_STEP, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_tiles) {
            _tile_loadd(5, r->tile_x[1] + q * AMX_K, r->tile_stride[1]);
            _tile_dpbf16ps(2, 5, 6);
            if (two_panels) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums, 64);
    amx_store(sums, r->tile_rows[0], r->row0, col, n, bias, y);
    if (two_panels) {
        _tile_stored(1, sums, 64);
        amx_store(sums, r->tile_rows[0], r->row0, col + 16, n, bias, y);
    }
    if (two_tiles) {
        _tile_stored(2, sums, 64);
        amx_store(sums, r->tile_rows[1], r->row0 + AMX_ROWS, col, n, bias, y);
        if (two_panels) {
            _tile_stored(3, sums, 64);
            amx_store(sums, r->tile_rows[1], r->row0 + AMX_ROWS, col + 16, n, bias, y);
        }
    }
}

int linear_amx(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int64_t m, int64_t n,
               int64_t k, int num_threads) {
    if (k % AMX_K || !linear_amx_ready()) return -1;
    const int64_t panels = (n + 15) / 16, panel_bytes = k / 2 * 64, k_tiles = k / AMX_K;
    const int64_t tiles = (m + AMX_ROWS - 1) / AMX_ROWS, tail = m - (tiles - 1) * AMX_ROWS;
    /* one tile of fewer rows than 16 is configured so; a short last tile of several is read from a copy padded
     * with zero rows, so that every tile has 16 (the configuration holds one row count for x's tiles) */
    const int tile_rows = tiles == 1 ? (int)m : AMX_ROWS;
    const uint16_t *rows_x = x;
    uint16_t *padded = NULL;
    if (tiles > 1 && tail < AMX_ROWS) {
        padded = calloc((size_t)(AMX_ROWS * k), 2);
        if (padded == NULL) return 1;
        for (int64_t r = 0; r < tail; r++)
            memcpy(padded + r * k, rows_x + ((tiles - 1) * AMX_ROWS + r) * x_stride, (size_t)k * 2);
    }
#pragma omp parallel num_threads(num_threads) /* as linear_forward chose them: at most one a panel */
    {
        amx_config saved __attribute__((aligned(64))), config __attribute__((aligned(64)));
        _tile_storeconfig(&saved);
        memset(&config, 0, sizeof config);
        config.palette = 1;
        for (int t = 0; t < 8; t++) {
            config.rows[t] = t < 6 ? (uint8_t)tile_rows : AMX_ROWS;
            config.colsb[t] = 64;
        }
        _tile_loadconfig(&config);
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        for (int64_t b0 = 0; b0 < tiles; b0 += AMX_BLOCK_TILES) {
            const int64_t b1 = b0 + AMX_BLOCK_TILES < tiles ? b0 + AMX_BLOCK_TILES : tiles;
            for (int64_t p = p0; p < p1; p += 2) {
                const char *w0 = (const char *)packed + p * panel_bytes;
                for (int64_t tile = b0; tile < b1; tile += 2) {
                    amx_rows r = {.row0 = tile * AMX_ROWS};
                    for (int i = 0; i < 2; i++) {
                        const int64_t ti = tile + i;
                        const int is_padded = ti == tiles - 1 && padded != NULL;
                        r.tile_x[i] = is_padded ? padded : rows_x + ti * AMX_ROWS * x_stride;
                        r.tile_stride[i] = (is_padded ? k : x_stride) * 2;
                        r.tile_rows[i] = ti >= b1 ? 0 : ti == tiles - 1 ? (int)tail : AMX_ROWS;
                    }
                    amx_block(&r, w0, p + 1 < p1, panel_bytes, k_tiles, p * 16, n, bias, y);
                }
            }
        }
        if (saved.palette)
            _tile_loadconfig(&saved);
        else
            _tile_release();
    }
    free(padded);
    return 0;
}

#else

int linear_amx_ready(void) { return 0; }

int linear_amx(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int64_t m, int64_t n,
               int64_t k, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)num_threads;
    return -1;
}

#endif
