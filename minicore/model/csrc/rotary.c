/* The rotary embedding of transformers' Llama-family attention (apply_rotary_pos_emb), float32 or
 * bfloat16 storage: out = x * cos + rotate_half(x) * sin, each product and the sum rounded to the
 * storage's type as torch's three element-wise ops round them, and no fused multiply-add: the
 * same bits as transformers' own. Built and loaded by minicore/model/native.py; used by
 * minicore/model/cpu_layers.py. */
#include "bf16.h"

/* No fused multiply-add here (torch rounds each product); rotate, inlined into rotary, must
 * share its options. */
#define UNFUSED __attribute__((optimize("fp-contract=off")))

UNFUSED INLINE void rotate(const void *x, const void *cos, const void *sin, void *out, int64_t at,
                           int64_t out_at, int64_t trig_at, int dim, int bf16) {
    int half = dim / 2;
    for (int i = 0; i < dim; i++) {
        float partner = i < half ? -elem(x, at + i + half, bf16) : elem(x, at + i - half, bf16);
        float a = rounded(elem(x, at + i, bf16) * elem(cos, trig_at + i, bf16), bf16);
        float b = rounded(partner * elem(sin, trig_at + i, bf16), bf16);
        put(out, out_at + i, rounded(a + b, bf16), bf16);
    }
}

/* x and out [heads, tokens, dim] by their strides in elements (the last one 1), cos and sin
 * [tokens, dim] contiguous. */
UNFUSED void rotary(const void *x, int64_t head_stride, int64_t token_stride, const void *cos,
                    const void *sin, void *out, int64_t out_head_stride,
                    int64_t out_token_stride, int heads, int tokens, int dim, int threads,
                    int bf16) {
#pragma omp parallel for schedule(static) num_threads(threads) if (heads * tokens >= 256)
    for (int i = 0; i < heads * tokens; i++) {
        int h = i / tokens, t = i % tokens;
        int64_t at = h * head_stride + t * token_stride;
        int64_t out_at = h * out_head_stride + t * out_token_stride;
        if (bf16)
            rotate(x, cos, sin, out, at, out_at, (int64_t)t * dim, dim, 1);
        else
            rotate(x, cos, sin, out, at, out_at, (int64_t)t * dim, dim, 0);
    }
}
