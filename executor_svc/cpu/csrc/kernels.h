/* The kernels one C function calls from another (decode_stack.c); their files include this too, so that the
 * compiler checks each definition against its declaration. */
#ifndef NANOSERVE_KERNELS_H
#define NANOSERVE_KERNELS_H

#include <stdint.h>

int linear_forward(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int64_t m,
                   int64_t n, int64_t k, int bf16, int num_threads);
int linear_amx_ready(void);
int linear_amx(const void *x, int64_t x_stride, const void *packed, const void *bias, void *y, int64_t m, int64_t n,
               int64_t k, int num_threads);
void rms_norm(const void *x, int64_t x_stride, void *residual, const void *weight, void *out, int64_t rows, int dim,
              float eps, int bf16, int num_threads);
void silu_and_mul(const void *x, void *out, int64_t rows, int d, int bf16, int num_threads);
void argmax_rows(const void *x, int64_t stride, int64_t rows, int64_t n, int64_t *out, int bf16, int num_threads);
int64_t rotary(void *q, int64_t q_stride, void *k, int64_t k_stride, const int64_t *positions,
               const void *cos_table, const void *sin_table, int64_t num_positions, int64_t tokens, int num_heads,
               int num_kv_heads, int head_dim, int bf16, int num_threads);
int64_t store_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
                 const int64_t *slots, int64_t tokens, int64_t num_slots, int width, int element_bytes);
int paged_decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                 const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                 int head_dim, int block_size, int max_blocks, int bf16, float scale, int num_threads);

#endif
