/* A decode step's whole stack of Llama decoder layers in one call: for each layer, RMSNorm (with the
 * residual add), the qkv projection, rotary, the KV store, paged decode attention, the o projection, RMSNorm,
 * gate-up, SiLU-and-mul and down, through the same kernels, in the same order and with the same roundings as
 * the layers' Python code (executor_svc/models/llama.py) calls them one by one.
 *
 * Those calls each cost a Python wrapper, a large share of a 1-sequence decode step of a small model
 * (docs/benchmarks-history.md). Here they cost a C function call.
 *
 * Shapes and layouts are executor_svc/cpu/decode_stack.py's, which checks that a model and a step
 * fit them: for decode_stack, weights packed for linear_forward; biases of the qkv and gate-up projections
 * only (NULL where there are none), caches [num_blocks, block_size, num_kv_heads, head_dim], every row a
 * decode row. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    const void *input_norm, *post_norm; /* [hidden] */
    const void *qkv, *qkv_bias, *o, *gate_up, *gate_up_bias, *down;
    void *k_cache, *v_cache;
} stack_layer;

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, block_size, bf16, threads;
    int64_t num_slots, num_positions;
    float eps, scale;
    const void *cos, *sin; /* [num_positions, head_dim] */
} stack_shape;

typedef struct {
    int64_t rows;
    int max_blocks;
    const int64_t *positions, *slots;
    const int32_t *block_tables, *context_lens;
    void *hidden;   /* [rows, hidden]: the embeddings in, the last layer's output out */
    void *residual; /* [rows, hidden]: the running residual out */
    void *scratch;  /* decode_stack_scratch_bytes */
} stack_step;

/* Scratch per step, rows of: normed [hidden], qkv [(heads + 2 kv_heads) head_dim], q and attention output
 * [heads head_dim] each, o [hidden], gate-up [2 intermediate], act [intermediate]. */
static int64_t scratch_elements(const stack_shape *s) {
    int64_t q = (int64_t)s->heads * s->head_dim, qkv = q + 2 * (int64_t)s->kv_heads * s->head_dim;
    return 2 * (int64_t)s->hidden + qkv + 2 * q + 3 * (int64_t)s->intermediate;
}

int64_t decode_stack_scratch_bytes(const stack_shape *s, int64_t rows) {
    return rows * scratch_elements(s) * (s->bf16 ? 2 : 4);
}

/* One layer from its qkv projection's rows [rows, (heads + 2 kv_heads) head_dim] (rotated in place) to the
 * attention output attn [rows, heads head_dim]: rotary, the KV store, paged decode attention. Returns 0, or
 * decode_stack's error codes. Exported for the steps whose projections run in torch (oneDNN's AMX GEMMs):
 * between them the layer then makes four C calls instead of ten from Python. */
int decode_stack_attention(const stack_layer *l, const stack_shape *s, const stack_step *step, void *qkv,
                           void *attn) {
    const int64_t rows = step->rows, esize = s->bf16 ? 2 : 4;
    const int64_t q_size = (int64_t)s->heads * s->head_dim, kv_size = (int64_t)s->kv_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    char *q = (char *)step->scratch, *k = (char *)qkv + q_size * esize, *v = k + kv_size * esize;
    if (rotary(qkv, qkv_size, k, qkv_size, step->positions, s->cos, s->sin, s->num_positions, rows, s->heads,
               s->kv_heads, s->head_dim, s->bf16, s->threads))
        return 2;
    if (store_kv(k, qkv_size, v, qkv_size, l->k_cache, l->v_cache, step->slots, rows, s->num_slots, (int)kv_size,
                 (int)esize))
        return 3;
    for (int64_t r = 0; r < rows; r++) /* decode reads q rows packed */
        memcpy(q + r * q_size * esize, (char *)qkv + r * qkv_size * esize, (size_t)(q_size * esize));
    return paged_decode(q, l->k_cache, l->v_cache, step->block_tables, step->context_lens, attn, (int)rows, s->heads,
                        s->kv_heads, s->head_dim, s->block_size, step->max_blocks, s->bf16, s->scale, s->threads)
               ? 1
               : 0;
}

/* Returns 0; 1 when a kernel could not allocate its scratch memory, 2 when a position is past the rotary
 * table, 3 when a slot is past the cache. Layers before the failing one have run. */
int decode_stack(const stack_layer *layers, int num_layers, const stack_shape *s, const stack_step *step) {
    const int64_t rows = step->rows, esize = s->bf16 ? 2 : 4;
    const int64_t q_size = (int64_t)s->heads * s->head_dim, kv_size = (int64_t)s->kv_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, gate_up = 2 * (int64_t)s->intermediate;
    char *normed = step->scratch, *qkv = normed + rows * s->hidden * esize, *q = qkv + rows * qkv_size * esize;
    char *attn = q + rows * q_size * esize, *o = attn + rows * q_size * esize, *gu = o + rows * s->hidden * esize;
    char *act = gu + rows * gate_up * esize;
    const int bf16 = s->bf16, threads = s->threads;
    stack_step with_q = *step; /* decode_stack_attention packs q rows at the start of its step's scratch */
    with_q.scratch = q;
    for (int i = 0; i < num_layers; i++) {
        const stack_layer *l = &layers[i];
        if (i == 0) { /* the embeddings are the residual; the first norm adds nothing */
            memcpy(step->residual, step->hidden, (size_t)(rows * s->hidden * esize));
            rms_norm(step->hidden, s->hidden, NULL, l->input_norm, normed, rows, s->hidden, s->eps, bf16, threads);
        } else {
            rms_norm(step->hidden, s->hidden, step->residual, l->input_norm, normed, rows, s->hidden, s->eps, bf16,
                     threads);
        }
        if (linear_forward(normed, s->hidden, l->qkv, l->qkv_bias, qkv, rows, qkv_size, s->hidden, bf16, threads))
            return 1;
        int failed = decode_stack_attention(l, s, &with_q, qkv, attn);
        if (failed) return failed;
        if (linear_forward(attn, q_size, l->o, NULL, o, rows, s->hidden, q_size, bf16, threads)) return 1;
        rms_norm(o, s->hidden, step->residual, l->post_norm, normed, rows, s->hidden, s->eps, bf16, threads);
        if (linear_forward(normed, s->hidden, l->gate_up, l->gate_up_bias, gu, rows, gate_up, s->hidden, bf16,
                           threads))
            return 1;
        silu_and_mul(gu, act, rows, s->intermediate, bf16, threads);
        if (linear_forward(act, s->intermediate, l->down, NULL, step->hidden, rows, s->hidden, s->intermediate,
                           bf16, threads))
            return 1;
    }
    return 0;
}
