/* Causal prefill attention for the CPU (AVX-512, or AVX2 with FMA): each request's query tokens over its
 * context, the cached prefix read through the block table and this step's keys and values read where the
 * projection left them.
 *
 * torch's CPU SDPA runs W1's prefill (prompts of 32-256 tokens, head_dim 64) far below the machine's peak; this
 * kernel runs GEMM-shaped loops on float32 copies instead, faster there (bench.kernels). First each request's
 * context is copied once per KV head, keys transposed in tiles of TILE ([head_dim, TILE] each, so that a
 * vector holds TILE keys' scores with no horizontal sums) and values as they are. Then a work item is one
 * request's KV head and a block of Q_BLOCK query tokens: the query rows of the KV head's group (GQA: the group
 * shares the copies) go through the copy ROWS at a time: all their scores, an exact softmax over them, then
 * the values. Sums are float32 for float32 and bfloat16 alike. Copying once per KV head instead of once per
 * block of queries cut the copy's share of the kernel's time. The inner loops, and
 * TILE, ROWS, VALUE_ROWS and KEYS, are the instruction set's: prefill_avx512.h, prefill_avx2.h.
 *
 * Layout (executor_svc/attention/base.py): q rows [tokens, num_heads, head_dim] at q_stride elements apart,
 * k and v rows [tokens, num_kv_heads, head_dim] at k_stride and v_stride; caches [num_blocks, block_size,
 * num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks] int32; cu_q and cu_k [num_seqs + 1] int32;
 * out [tokens, num_heads, head_dim] contiguous. Request i's queries are the last of its context's tokens,
 * and the rest of the context is in the cache. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__)
#include "prefill_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "prefill_avx2.h"
#endif

#define Q_BLOCK 64 /* query tokens per work item */

static inline int padded(int keys) { return (keys + KEYS - 1) / KEYS * KEYS; }

int prefill_attention_supported(int head_dim) {
#if defined(TILE)
    return head_dim > 0 && head_dim <= 256 && head_dim % 64 == 0;
#else
    (void)head_dim;
    return 0;
#endif
}

#if defined(TILE)

typedef struct {
    const void *q, *k, *v, *k_cache, *v_cache;
    const int32_t *block_tables, *cu_q, *cu_k;
    void *out;
    int64_t q_stride, k_stride, v_stride;
    int max_blocks, num_heads, num_kv_heads, dim, block_size, bf16;
    float scale;
} prefill_args;

/* Per thread: query rows [Q_BLOCK * group + ROWS, dim] (scaled) and scores [ROWS, keys], as float32. */
typedef struct {
    float *qs, *scores;
    int keys;
} prefill_scratch;

INLINE void load_floats(float *dst, const void *src, int n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    for (int i = 0; i < n; i++) dst[i] = bf16_to_float(((const uint16_t *)src)[i]);
}

/* Request `seq`'s context for KV head `kv` as float32: keys in tiles of TILE transposed ([dim, TILE] each,
 * so that a vector holds TILE keys' products), zero past the context up to a whole number of KEYS, then values
 * [keys, dim]. Tokens before `cached` are in the cache, the rest in this step's k and v. */
static void copy_context(const prefill_args *a, float *kt, float *vals, int seq, int kv) {
    int dim = a->dim, esize = a->bf16 ? 2 : 4, n = a->cu_k[seq + 1] - a->cu_k[seq];
    int cached = n - (a->cu_q[seq + 1] - a->cu_q[seq]);
    int64_t slot_size = (int64_t)a->num_kv_heads * dim, first = a->cu_q[seq];
    const int32_t *table = a->block_tables + (int64_t)seq * a->max_blocks;
    float row[256];
    for (int t = 0; t < n; t++) {
        const char *k, *v;
        if (t < cached) {
            int64_t slot = (int64_t)table[t / a->block_size] * a->block_size + t % a->block_size;
            k = (const char *)a->k_cache + (slot * slot_size + (int64_t)kv * dim) * esize;
            v = (const char *)a->v_cache + (slot * slot_size + (int64_t)kv * dim) * esize;
        } else {
            int64_t token = first + t - cached;
            k = (const char *)a->k + (token * a->k_stride + (int64_t)kv * dim) * esize;
            v = (const char *)a->v + (token * a->v_stride + (int64_t)kv * dim) * esize;
        }
        load_floats(row, k, dim, a->bf16);
        float *tile = kt + (int64_t)(t / TILE) * TILE * dim + t % TILE;
        for (int d = 0; d < dim; d++) tile[d * TILE] = row[d];
        load_floats(vals + (int64_t)t * dim, v, dim, a->bf16);
    }
    for (int t = n; t < padded(n); t++)
        for (int d = 0; d < dim; d++) kt[(int64_t)(t / TILE) * TILE * dim + d * TILE + t % TILE] = 0.0f;
}

/* One work item: query tokens [i0, i1) of request `seq` for the query heads of KV head `kv`, whose
 * context copy_context left in kt and vals. */
static void attend_block(const prefill_args *a, const prefill_scratch *s, const float *kt, const float *vals,
                         int seq, int kv, int i0, int i1) {
    int dim = a->dim, group = a->num_heads / a->num_kv_heads, esize = a->bf16 ? 2 : 4;
    int q_len = a->cu_q[seq + 1] - a->cu_q[seq], cached = a->cu_k[seq + 1] - a->cu_k[seq] - q_len;
    int rows = (i1 - i0) * group;
    for (int r = 0; r < rows; r++) { /* row r: token i0 + r / group, query head kv * group + r % group */
        int64_t token = a->cu_q[seq] + i0 + r / group, head = (int64_t)kv * group + r % group;
        float *qs = s->qs + (int64_t)r * dim;
        load_floats(qs, (const char *)a->q + (token * a->q_stride + head * dim) * esize, dim, a->bf16);
        for (int d = 0; d < dim; d++) qs[d] *= a->scale;
    }
    memset(s->qs + (int64_t)rows * dim, 0, sizeof(float) * ROWS * dim); /* the last pass's missing rows */
    float res[ROWS * 256], inverse[ROWS];
    for (int r0 = 0; r0 < rows; r0 += ROWS) {
        int last = r0 + ROWS < rows ? r0 + ROWS - 1 : rows - 1;
        int n = cached + i0 + last / group + 1; /* the keys the pass's last row sees; earlier rows see fewer */
        score_rows(s->qs + (int64_t)r0 * dim, kt, s->keys, n, dim, s->scores);
        for (int r = 0; r < ROWS; r++) {
            int seen = r0 + r <= last ? cached + i0 + (r0 + r) / group + 1 : 0;
            inverse[r] = softmax_row(s->scores + (int64_t)r * s->keys, seen, n);
        }
        for (int r = 0; r < ROWS && r0 + r <= last; r += VALUE_ROWS)
            add_value_rows(s->scores + (int64_t)r * s->keys, s->keys, vals, n, dim, res + r * dim);
        for (int r = 0; r <= last - r0; r++) {
            int64_t token = a->cu_q[seq] + i0 + (r0 + r) / group, head = (int64_t)kv * group + (r0 + r) % group;
            int64_t at = (token * a->num_heads + head) * dim;
            for (int d = 0; d < dim; d++) {
                float x = res[r * dim + d] * inverse[r];
                if (a->bf16) ((uint16_t *)a->out)[at + d] = float_to_bf16(x);
                else ((float *)a->out)[at + d] = x;
            }
        }
    }
}
#endif

/* Returns 0; 1 when the scratch memory could not be allocated, 2 when this build or head_dim is not
 * supported (prefill_attention_supported); out is untouched then. */
int prefill_attention(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                      int64_t v_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                      int max_blocks, const int32_t *cu_q, const int32_t *cu_k, int num_seqs, void *out,
                      int num_heads, int num_kv_heads, int head_dim, int block_size, int bf16, float scale,
                      int num_threads) {
    if (!prefill_attention_supported(head_dim)) return 2;
#if defined(TILE)
    prefill_args a = {q, k, v, k_cache, v_cache, block_tables, cu_q, cu_k, out, q_stride, k_stride, v_stride,
                      max_blocks, num_heads, num_kv_heads, head_dim, block_size, bf16, scale};
    int blocks = 0, longest = 0, group = num_heads / num_kv_heads;
    int64_t *context = malloc(sizeof(int64_t) * (num_seqs + 1)); /* where each request's copies start */
    if (context == NULL) return 1;
    context[0] = 0;
    for (int i = 0; i < num_seqs; i++) {
        int n = cu_k[i + 1] - cu_k[i];
        blocks += (cu_q[i + 1] - cu_q[i] + Q_BLOCK - 1) / Q_BLOCK;
        longest = n > longest ? n : longest;
        context[i + 1] = context[i] + (int64_t)2 * num_kv_heads * head_dim * padded(n);
    }
    int keys = padded(longest);
    size_t floats = ((size_t)(Q_BLOCK * group + ROWS) * head_dim + (size_t)ROWS * keys + 15) / 16 * 16;
    float *copies = aligned_alloc(64, sizeof(float) * ((size_t)context[num_seqs] + floats * num_threads));
    int32_t *items = malloc(sizeof(int32_t) * 2 * (blocks > 0 ? blocks : 1)); /* (request, block), last first */
    if (copies == NULL || items == NULL) {
        free(context), free(copies), free(items);
        return 1;
    }
    for (int i = num_seqs - 1, at = 0; i >= 0; i--)
        for (int b = (cu_q[i + 1] - cu_q[i] + Q_BLOCK - 1) / Q_BLOCK - 1; b >= 0; b--, at++) {
            items[2 * at] = i;
            items[2 * at + 1] = b;
        }
#pragma omp parallel num_threads(num_threads)
    {
        /* each KV head's context is copied once, for all the blocks of queries that see it */
#pragma omp for schedule(dynamic) collapse(2)
        for (int i = 0; i < num_seqs; i++)
            for (int kv = 0; kv < num_kv_heads; kv++) {
                int64_t size = (int64_t)head_dim * padded(cu_k[i + 1] - cu_k[i]);
                float *kt = copies + context[i] + 2 * kv * size;
                copy_context(&a, kt, kt + size, i, kv);
            }
        float *scratch = copies + context[num_seqs] + floats * omp_get_thread_num();
        prefill_scratch s = {scratch, scratch + (size_t)(Q_BLOCK * group + ROWS) * head_dim, keys};
#pragma omp for schedule(dynamic) collapse(2)
        for (int item = 0; item < blocks; item++)
            for (int kv = 0; kv < num_kv_heads; kv++) {
                int seq = items[2 * item], i0 = items[2 * item + 1] * Q_BLOCK, q_len = cu_q[seq + 1] - cu_q[seq];
                int64_t size = (int64_t)head_dim * padded(cu_k[seq + 1] - cu_k[seq]);
                const float *kt = copies + context[seq] + 2 * kv * size;
                attend_block(&a, &s, kt, kt + size, seq, kv, i0, i0 + Q_BLOCK < q_len ? i0 + Q_BLOCK : q_len);
            }
    }
    free(context), free(copies), free(items);
    return 0;
#endif
}
