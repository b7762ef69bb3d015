/* Shared by paged_decode.c (the portable kernel and the entry point) and its vectorised versions,
 * paged_decode_avx512.c and paged_decode_avx2.c, of which a build compiles in at most one (PAGED_DECODE_TILED).
 *
 * Those read a request once, in tiles of tokens, flash-decoding style: for each KV head, the scores of the
 * tile's tokens for each query head of its group fill one vector (a partial dot product per token, summed by
 * a transpose-add tree instead of one horizontal reduction per token), an online softmax (running max and
 * sum) rescales the output accumulators, and the tile's values, still in cache, are added in; the next
 * tile is prefetched into L2 meanwhile. */
#ifndef NANOSERVE_PAGED_DECODE_H
#define NANOSERVE_PAGED_DECODE_H

#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512F__)
#define PAGED_DECODE_TILED 16 /* tokens per tile: one score per lane of a 512-bit vector */
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGED_DECODE_TILED 8 /* of a 256-bit vector */
#endif

static inline int64_t slot_of(const int32_t *table, int t, int block_size) {
    return (int64_t)table[t / block_size] * block_size + t % block_size;
}

/* Cache offsets (in elements) of the slots of tokens t0..t0+tile-1; past `len`, token t0's again. */
static inline void tile_slots(const int32_t *table, int t0, int len, int block_size, int slot_size, int tile,
                              int64_t *slots) {
    for (int i = 0; i < tile; i++) slots[i] = slot_of(table, t0 + i < len ? t0 + i : t0, block_size) * slot_size;
}

/* An asm statement, as GCC 12 deletes some loops whose only statements are __builtin_prefetch. */
static inline void prefetch_l2(const void *p) { __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)p)); }

/* Fetch the key and value slots of tokens from..to-1 (up to len) into L2. The tiled kernels ask for the next
 * tile's while they work on one: slots are scattered over the cache, out of reach of the CPU's prefetcher.
 * Into L2, as L1 cannot hold two float32 tiles of 16 tokens (24 KB each); two tiles ahead, or into L1,
 * measured slower. */
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

/* One request of a tiled kernel: its queries, cache slots and length, and the model's shape. */
typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *table;
    int len, num_heads, num_kv_heads, block_size;
    float scale;
} tiled_request;

/* A thread's scratch: acc and res [num_heads, head_dim], sums [num_heads, tile], top [num_heads],
 * p [group, tile], corr [group]. The kernel writes the request's float32 output into res. */
typedef struct {
    float *acc, *res, *sums, *top, *p, *corr;
} tiled_scratch;

typedef void (*tiled_attend_fn)(const tiled_request *r, const tiled_scratch *s);

/* Runs `attend` (the kernel for this head_dim and dtype) on every request, shared out among OpenMP threads,
 * and writes out in q's dtype. Returns 0, or 1 when a thread could not allocate its scratch memory. */
int decode_tiled(tiled_attend_fn attend, int tile, const void *q, const void *k_cache, const void *v_cache,
                 const int32_t *block_tables, const int32_t *context_lens, void *out, int num_seqs, int num_heads,
                 int num_kv_heads, int head_dim, int block_size, int max_blocks, int bf16, float scale,
                 int num_threads);

#if defined(PAGED_DECODE_TILED)
/* The vectorised kernel, for head_dim 64, 128 or 256; arguments as paged_decode's. */
int paged_decode_tiled(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                       const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                       int head_dim, int block_size, int max_blocks, int bf16, float scale, int num_threads);
#endif

#endif
