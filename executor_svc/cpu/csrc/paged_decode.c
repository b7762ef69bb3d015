/* Paged decode attention for the CPU: one query token per request, keys and values read in place
 * from the block-paged cache (no gathered copy), softmax and sums in float32.
 *
 * Layout (executor_svc/attention/base.py): q and out [num_seqs, num_heads, head_dim] contiguous;
 * k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; block_tables
 * [num_seqs, max_blocks] int32; context_lens [num_seqs] int32. Tensors are float32, or bfloat16
 * when `bf16` is set. Query head i reads KV head i / (num_heads / num_kv_heads) (GQA). Requests are
 * shared out among OpenMP threads; executor_svc/cpu/kernels.py builds this file and links it to the OpenMP
 * runtime torch has loaded.
 *
 * With AVX-512 or AVX2 (and head_dim 64, 128 or 256) the tiled, flash-decoding kernel of
 * paged_decode_avx512.c or paged_decode_avx2.c runs (see paged_decode.h). Otherwise a portable two-pass
 * version (all scores, softmax, then values) that the compiler vectorises.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "paged_decode.h"

/* Let `omp simd` loops call glibc's vector expf (libmvec). glibc declares it only under -ffast-math,
 * and a library built with -ffast-math sets flush-to-zero for the whole process when it loads. */
#pragma omp declare simd notinbranch
float expf(float);

/* Row `row` of a [rows, n] tensor as float32: in place for float32, converted into `buf` for bfloat16. */
static inline const float *load_row(const void *base, int64_t row, int n, int bf16, float *buf) {
    if (!bf16) return (const float *)base + row * n;
    const uint16_t *src = (const uint16_t *)base + row * n;
    for (int i = 0; i < n; i++) buf[i] = bf16_to_float(src[i]);
    return buf;
}

/* Row `row` of a [rows, n] output in its dtype, from float32 `src`. */
static void store_output(void *out, int64_t row, int n, int bf16, const float *src) {
    for (int i = 0; i < n; i++) {
        if (bf16)
            ((uint16_t *)out)[row * n + i] = float_to_bf16(src[i]);
        else
            ((float *)out)[row * n + i] = src[i];
    }
}

/* Slots are scattered over the cache, out of reach of the CPU's own prefetcher: ask for the slot this
 * many tokens ahead while working on the current one (4 measured fastest of 1-8). */
#define PREFETCH_DISTANCE 4

static inline void prefetch_slot(const void *cache, int64_t slot, int64_t slot_bytes) {
    const char *p = (const char *)cache + slot * slot_bytes;
    for (int64_t i = 0; i < slot_bytes; i += 64) __builtin_prefetch(p + i);
}

/* Attention of one request's queries `q` [num_heads, head_dim] over its `len` context tokens, whose
 * cache slots come from `table`; writes `acc` [num_heads, head_dim]. A slot holds all KV heads of a
 * token ([num_kv_heads, head_dim]), read whole so that a block is one contiguous run of memory (reading
 * one head's rows apart from the others' measured several times slower). `scores` holds [num_heads, stride]
 * floats and `buf` one slot. */
static void attend(const float *q, const void *k_cache, const void *v_cache, const int32_t *table, int len,
                   int num_heads, int num_kv_heads, int head_dim, int block_size, int bf16, float scale,
                   float *scores, int stride, float *buf, float *acc) {
    int group = num_heads / num_kv_heads, slot_size = num_kv_heads * head_dim;
    int64_t slot_bytes = (int64_t)slot_size * (bf16 ? 2 : 4);
    for (int t = 0; t < len; t++) {
        if (t + PREFETCH_DISTANCE < len)
            prefetch_slot(k_cache, slot_of(table, t + PREFETCH_DISTANCE, block_size), slot_bytes);
        const float *k = load_row(k_cache, slot_of(table, t, block_size), slot_size, bf16, buf);
        for (int head = 0; head < num_heads; head++) {
            const float *qh = q + head * head_dim, *kh = k + (head / group) * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
            scores[head * stride + t] = dot * scale;
        }
    }
    for (int head = 0; head < num_heads; head++) {
        float *s = scores + head * stride, top = s[0], sum = 0.0f;
#pragma omp simd reduction(max : top)
        for (int t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; t++) {
            s[t] = expf(s[t] - top);
            sum += s[t];
        }
        float inverse = 1.0f / sum;
#pragma omp simd
        for (int t = 0; t < len; t++) s[t] *= inverse;
    }
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int t = 0; t < len; t++) {
        if (t + PREFETCH_DISTANCE < len)
            prefetch_slot(v_cache, slot_of(table, t + PREFETCH_DISTANCE, block_size), slot_bytes);
        const float *v = load_row(v_cache, slot_of(table, t, block_size), slot_size, bf16, buf);
        for (int head = 0; head < num_heads; head++) {
            const float *vh = v + (head / group) * head_dim;
            float p = scores[head * stride + t], *a = acc + head * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) a[d] += p * vh[d];
        }
    }
}

int decode_tiled(tiled_attend_fn attend, int tile, const void *q, const void *k_cache, const void *v_cache,
                 const int32_t *block_tables, const int32_t *context_lens, void *out, int num_seqs, int num_heads,
                 int num_kv_heads, int head_dim, int block_size, int max_blocks, int bf16, float scale,
                 int num_threads) {
    int width = num_heads * head_dim, group = num_heads / num_kv_heads, failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* each part a whole number of 64-byte lines */
        size_t acc_floats = (size_t)(width + 15) / 16 * 16, head_floats = (size_t)(num_heads + 15) / 16 * 16,
               sums_floats = (size_t)(num_heads * tile + 15) / 16 * 16,
               p_floats = (size_t)(group * tile + 15) / 16 * 16, group_floats = (size_t)(group + 15) / 16 * 16;
        size_t floats = 2 * acc_floats + sums_floats + head_floats + p_floats + group_floats;
        float *acc = aligned_alloc(64, sizeof(float) * floats);
        if (acc == NULL) {
            failed = 1;
        } else {
            tiled_scratch s = {.acc = acc, .res = acc + acc_floats, .sums = acc + 2 * acc_floats};
            s.top = s.sums + sums_floats;
            s.p = s.top + head_floats;
            s.corr = s.p + p_floats;
#pragma omp for schedule(dynamic)
            for (int seq = 0; seq < num_seqs; seq++) {
                tiled_request r = {(const char *)q + (int64_t)seq * width * (bf16 ? 2 : 4), k_cache, v_cache,
                                   block_tables + (int64_t)seq * max_blocks, context_lens[seq], num_heads,
                                   num_kv_heads, block_size, scale};
                attend(&r, &s);
                store_output(out, seq, width, bf16, s.res);
            }
            free(acc);
        }
    }
    return failed;
}

/* Returns 0, or 1 when a thread could not allocate its scratch memory (out is then incomplete). */
int paged_decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                 const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                 int head_dim, int block_size, int max_blocks, int bf16, float scale, int num_threads) {
#if defined(PAGED_DECODE_TILED)
    if (head_dim == 64 || head_dim == 128 || head_dim == 256)
        return paged_decode_tiled(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads,
                                  num_kv_heads, head_dim, block_size, max_blocks, bf16, scale, num_threads);
#endif
    int stride = max_blocks * block_size, width = num_heads * head_dim, failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        size_t floats = (size_t)num_heads * stride + 2 * (size_t)width + (size_t)num_kv_heads * head_dim;
        float *scores = malloc(sizeof(float) * floats);
        if (scores == NULL) {
            failed = 1;
        } else {
            float *qf = scores + (size_t)num_heads * stride, *acc = qf + width, *buf = acc + width;
#pragma omp for schedule(dynamic)
            for (int seq = 0; seq < num_seqs; seq++) {
                memcpy(qf, load_row(q, seq, width, bf16, acc), sizeof(float) * width);
                attend(qf, k_cache, v_cache, block_tables + (int64_t)seq * max_blocks, context_lens[seq],
                       num_heads, num_kv_heads, head_dim, block_size, bf16, scale, scores, stride, buf, acc);
                store_output(out, seq, width, bf16, acc);
            }
            free(scores);
        }
    }
    return failed;
}
