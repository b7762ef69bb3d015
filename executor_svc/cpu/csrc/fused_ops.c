/* The decoder layer's elementwise work on the CPU, one pass over memory each instead of torch's chain of
 * small ops (and, in bfloat16, their conversions to float32 and back): RMSNorm with the residual add,
 * rotary embedding in place, SiLU-and-mul, and the store of keys and values into the paged cache.
 *
 * Every kernel rounds where the torch code it replaces rounds (executor_svc/layers/), so float32 results
 * match torch's up to the order of a sum, and bfloat16 results round each intermediate to bfloat16 as torch
 * does. Tensors are float32, or bfloat16 when `bf16` is set; rows may be strided (`*_stride`, in elements).
 * Rows are shared among `num_threads` OpenMP threads when a call is large enough to pay for waking them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

/* Let `omp simd` loops call glibc's vector expf (libmvec), as paged_decode.c does. */
#pragma omp declare simd notinbranch
float expf(float);

/* Below this many elements a call runs on the calling thread: waking the others costs more than they save
 * (measured: a decode batch of 64 rows of 576 already gains from two threads). */
#define PARALLEL_MIN_ELEMENTS (1 << 15)

/* One row of n elements into float32 `dst`. */
static void load_row(const void *src, float *dst, int n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    const uint16_t *s = src;
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
}

/* One row of n float32 values into `dst` in the tensor's dtype (already rounded when bfloat16). */
static void store_row(const float *src, void *dst, int n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    uint16_t *d = dst;
#pragma omp simd
    for (int i = 0; i < n; i++) d[i] = float_to_bf16(src[i]);
}

/* Round every value of a row to the dtype (a no-op in float32). */
static void round_row(float *row, int n, int bf16) {
    if (!bf16) return;
#pragma omp simd
    for (int i = 0; i < n; i++) row[i] = bf16_round(row[i]);
}

static inline size_t element_size(int bf16) { return bf16 ? 2 : 4; }

static inline const void *row_at(const void *base, int64_t element, int bf16) {
    return (const char *)base + element * element_size(bf16);
}

/* Element i of a float32 or bfloat16 row, as float32; v stored there, rounded to the dtype; v that is a bfloat16
 * value already stored there without rounding it again. */
static inline float element(const void *row, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}
static inline void put(void *row, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)row)[i] = float_to_bf16(v);
    else
        ((float *)row)[i] = v;
}
static inline void put_exact(void *row, int64_t i, float v, int bf16) {
    if (bf16) {
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        ((uint16_t *)row)[i] = (uint16_t)(bits >> 16);
    } else {
        ((float *)row)[i] = v;
    }
}

/* One row of rms_norm below, in three vectorised passes (x + residual, the squares, the scaling) instead of ten
 * over the row, faster in both dtypes. The squares are summed in a pass of their own over float32 values, in 16
 * lanes as before: folded into the first pass, bfloat16 loads made it 32 lanes in two sums, another rounding of
 * the same sum, and a greedy token of SmolLM2 in bfloat16 no longer matched torch's kernels'
 * (tests/test_kernel_choice.py). `bf16` is a constant in each copy. */
static inline __attribute__((always_inline)) void rms_norm_row(const void *x, void *residual, const void *weight,
                                                               void *out, float *h, int dim, float eps, int bf16) {
    if (residual != NULL) {
#pragma omp simd
        for (int i = 0; i < dim; i++) {
            float v = element(x, i, bf16) + element(residual, i, bf16);
            v = bf16 ? bf16_round(v) : v;
            put_exact(residual, i, v, bf16);
            h[i] = v;
        }
    } else {
#pragma omp simd
        for (int i = 0; i < dim; i++) h[i] = element(x, i, bf16);
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int i = 0; i < dim; i++) squares += h[i] * h[i];
    float inverse = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
    for (int i = 0; i < dim; i++) {
        float v = h[i] * inverse;
        put(out, i, (bf16 ? bf16_round(v) : v) * element(weight, i, bf16), bf16);
    }
}

/* out = weight * dtype(h * rsqrt(mean(h^2) + eps)) with h = x, or with residual given h = dtype(x + residual),
 * written back to residual. x [rows, dim] with row stride x_stride; residual, out and weight contiguous. */
void rms_norm(const void *x, int64_t x_stride, void *residual, const void *weight, void *out, int64_t rows, int dim,
              float eps, int bf16, int num_threads) {
    int threads = rows * dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
    size_t esize = element_size(bf16);
#pragma omp parallel num_threads(threads)
    {
        float h[dim];
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            const void *in = row_at(x, row * x_stride, bf16);
            void *res = residual == NULL ? NULL : (char *)residual + row * dim * esize;
            void *dst = (char *)out + row * dim * esize;
            if (bf16)
                rms_norm_row(in, res, weight, dst, h, dim, eps, 1);
            else
                rms_norm_row(in, res, weight, dst, h, dim, eps, 0);
        }
    }
}

/* out [rows, d] = silu(x[:, :d]) * x[:, d:], x [rows, 2d] contiguous; silu(g) = g / (1 + exp(-g)), rounded to the
 * dtype before the product. One vectorised pass a row (it was six), faster in both dtypes; expf and the division
 * are most of what is left. */
static inline __attribute__((always_inline)) void silu_and_mul_row(const void *x, void *out, int d, int bf16) {
    const char *up = (const char *)x + (size_t)d * element_size(bf16);
#pragma omp simd
    for (int i = 0; i < d; i++) {
        float g = element(x, i, bf16), s = g / (1.0f + expf(-g));
        put(out, i, (bf16 ? bf16_round(s) : s) * element(up, i, bf16), bf16);
    }
}

void silu_and_mul(const void *x, void *out, int64_t rows, int d, int bf16, int num_threads) {
    int threads = rows * d >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        const void *in = row_at(x, row * 2 * d, bf16);
        void *dst = (char *)out + row * d * element_size(bf16);
        if (bf16)
            silu_and_mul_row(in, dst, d, 1);
        else
            silu_and_mul_row(in, dst, d, 0);
    }
}

/* Rotate q [tokens, num_heads, head_dim] and k [tokens, num_kv_heads, head_dim] in place (rows strided by
 * q_stride and k_stride) by their positions: the rotate-half form, x * cos + rotate_half(x) * sin, with
 * cos and sin [num_positions, head_dim] in the model's dtype. Returns the number of positions outside the
 * tables; when there are any, nothing is rotated. */
int64_t rotary(void *q, int64_t q_stride, void *k, int64_t k_stride, const int64_t *positions,
               const void *cos_table, const void *sin_table, int64_t num_positions, int64_t tokens, int num_heads,
               int num_kv_heads, int head_dim, int bf16, int num_threads) {
    int64_t outside = 0;
    for (int64_t t = 0; t < tokens; t++) outside += positions[t] < 0 || positions[t] >= num_positions;
    if (outside) return outside;
    int half = head_dim / 2;
    int threads = tokens * (num_heads + num_kv_heads) * head_dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        float c[head_dim], s[head_dim], x[head_dim], a[head_dim], b[head_dim];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            load_row(row_at(cos_table, positions[t] * head_dim, bf16), c, head_dim, bf16);
            load_row(row_at(sin_table, positions[t] * head_dim, bf16), s, head_dim, bf16);
            for (int head = 0; head < num_heads + num_kv_heads; head++) {
                void *at = head < num_heads
                    ? (char *)q + (t * q_stride + (int64_t)head * head_dim) * element_size(bf16)
                    : (char *)k + (t * k_stride + (int64_t)(head - num_heads) * head_dim) * element_size(bf16);
                load_row(at, x, head_dim, bf16);
                /* Two rounded products and a rounded sum, as torch's x * cos + rotate_half(x) * sin. */
#pragma omp simd
                for (int i = 0; i < half; i++) {
                    a[i] = x[i] * c[i];
                    b[i] = -x[half + i] * s[i];
                    a[half + i] = x[half + i] * c[half + i];
                    b[half + i] = x[i] * s[half + i];
                }
                round_row(a, head_dim, bf16);
                round_row(b, head_dim, bf16);
#pragma omp simd
                for (int i = 0; i < head_dim; i++) a[i] += b[i];
                store_row(a, at, head_dim, bf16);
            }
        }
    }
    return 0;
}

/* Copy row t of k and v ([tokens, width] with row strides k_stride, v_stride) into slot slots[t] of
 * k_cache and v_cache ([num_slots, width] contiguous); a negative slot (a padded row) is skipped. Returns the
 * number of rows whose slot is past the cache; when there are any, nothing is written. */
int64_t store_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
                 const int64_t *slots, int64_t tokens, int64_t num_slots, int width, int element_bytes) {
    size_t bytes = (size_t)width * element_bytes;
    int64_t outside = 0;
    for (int64_t t = 0; t < tokens; t++) outside += slots[t] >= num_slots;
    if (outside) return outside;
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy((char *)k_cache + slots[t] * bytes, (const char *)k + t * k_stride * element_bytes, bytes);
        memcpy((char *)v_cache + slots[t] * bytes, (const char *)v + t * v_stride * element_bytes, bytes);
    }
    return 0;
}

/* out[r] = the index of row r's largest element (x [rows, n], rows `stride` elements apart), ties to the lowest
 * index and a NaN above everything, as torch.argmax: the greedy token. One vectorised pass finds the maximum,
 * a second the first chunk of ARGMAX_CHUNK that holds it, a scalar scan its index in the chunk: faster than
 * torch's CPU argmax. */
#define ARGMAX_CHUNK 256
static inline __attribute__((always_inline)) int64_t argmax_row(const void *row, int64_t n, int bf16) {
    float top = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        float v = element(row, i, bf16);
        nan |= v != v;
        top = v > top ? v : top;
    }
    for (int64_t c = 0; c < n; c += ARGMAX_CHUNK) {
        int64_t end = c + ARGMAX_CHUNK < n ? c + ARGMAX_CHUNK : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = c; i < end; i++) {
            float v = element(row, i, bf16);
            hit |= nan ? v != v : v == top;
        }
        for (int64_t i = c; hit && i < end; i++) {
            float v = element(row, i, bf16);
            if (nan ? v != v : v == top) return i;
        }
    }
    return 0;
}

void argmax_rows(const void *x, int64_t stride, int64_t rows, int64_t n, int64_t *out, int bf16, int num_threads) {
    int threads = rows * n >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const void *row = row_at(x, r * stride, bf16);
        out[r] = bf16 ? argmax_row(row, n, 1) : argmax_row(row, n, 0); /* one copy of the loops per dtype */
    }
}
