/* Decode attention over the per-request KV pools of minicore/model/decode_kv.py, on CPU, with
 * pools of float32 or bfloat16 (queries, scores and sums in float32): the two passes that read
 * keys and values, each reading a request's live rows once. Built and loaded by
 * minicore/model/native.py; the softmax between them stays in torch. */
#include <math.h>

#include "bf16.h"

/* a . b for a float32 query row and a key row of the pool's type. */
INLINE float dot(const float *a, const void *b, int n, int bf16) {
    /* Two accumulators: one would chain every multiply-add on the one before. */
    v8 acc0 = {0}, acc1 = {0};
    int d = 0;
    for (; d + 16 <= n; d += 16) {
        acc0 += *(const v8 *)(a + d) * elems8(b, d, bf16);
        acc1 += *(const v8 *)(a + d + 8) * elems8(b, d + 8, bf16);
    }
    for (; d + 8 <= n; d += 8)
        acc0 += *(const v8 *)(a + d) * elems8(b, d, bf16);
    v8 acc = acc0 + acc1;
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; d++)
        s += a[d] * elem(b, d, bf16);
    return s;
}

/* First position attended to: len - window with a sliding window, else 0. */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* What both passes read: the pools (keys or values), each request's slots and length, shapes. */
typedef struct {
    const int64_t *pools, *slots, *seq_lens;
    int heads, group, dim, chunk, max_chunks, max_len;
    int64_t window;
} reads;

/* The positions [start, end) of request b that lie in chunk c, and where the first one's row of
 * head h is in that chunk's pool ([slots, heads, chunk, dim]). */
typedef struct {
    int64_t start, end;
    const char *rows;
} span;

INLINE span chunk_span(const reads *r, int64_t b, int64_t c, int64_t first, int64_t len, int h,
                       int bf16) {
    span s;
    int64_t chunk = r->chunk;
    s.start = first > c * chunk ? first : c * chunk;
    s.end = len < (c + 1) * chunk ? len : (c + 1) * chunk;
    const char *pool = (const char *)(intptr_t)r->pools[c];
    int64_t row = (r->slots[b * r->max_chunks + c] * r->heads + h) * chunk + s.start - c * chunk;
    s.rows = pool + row * r->dim * elem_size(bf16);
    return s;
}

/* scores[b, h, g, p] = scale * q[b, h, g] . key(b, h, p) for p in [first, len), -inf elsewhere;
 * first = len - window when window > 0. softcap > 0 caps: cap * tanh(s / cap). */
INLINE void scores_of(const reads *r, int bh, const float *q, float scale, float softcap,
                      float *scores, int bf16) {
    int b = bh / r->heads, h = bh % r->heads, group = r->group, dim = r->dim;
    int64_t len = r->seq_lens[b], first = window_start(len, r->window), max_len = r->max_len;
    const float *qb = q + (int64_t)bh * group * dim;
    float *out = scores + (int64_t)bh * group * max_len;
    for (int64_t i = 0; i < group * max_len; i++)
        out[i] = -INFINITY;
    for (int64_t c = first / r->chunk; c * r->chunk < len; c++) {
        span s = chunk_span(r, b, c, first, len, h, bf16);
        const char *k = s.rows;
        for (int64_t p = s.start; p < s.end; p++, k += dim * elem_size(bf16))
            for (int g = 0; g < group; g++) {
                float x = dot(qb + g * dim, k, dim, bf16) * scale;
                out[g * max_len + p] = softcap > 0 ? softcap * tanhf(x / softcap) : x;
            }
    }
}

/* out[b, h, g] = sum over p in [first, len) of probs[b, h, g, p] * value(b, h, p). */
INLINE void values_of(const reads *r, int bh, const float *probs, float *out, int bf16) {
    int b = bh / r->heads, h = bh % r->heads, group = r->group, dim = r->dim;
    int64_t len = r->seq_lens[b], first = window_start(len, r->window), max_len = r->max_len;
    const float *pb = probs + (int64_t)bh * group * max_len;
    float *ob = out + (int64_t)bh * group * dim;
    memset(ob, 0, sizeof(float) * group * dim);
    for (int64_t c = first / r->chunk; c * r->chunk < len; c++) {
        span s = chunk_span(r, b, c, first, len, h, bf16);
        const char *v = s.rows;
        for (int64_t p = s.start; p < s.end; p++, v += dim * elem_size(bf16))
            for (int g = 0; g < group; g++) {
                float w = pb[g * max_len + p], *o = ob + g * dim;
                int d = 0;
                for (; d + 8 <= dim; d += 8)
                    *(v8 *)(o + d) += w * elems8(v, d, bf16);
                for (; d < dim; d++)
                    o[d] += w * elem(v, d, bf16);
            }
    }
}

/* The entry points, over every (request, KV head): pools of float32 (bf16 = 0) or bfloat16
 * (bf16 = 1), the type chosen per row so that each inlined body has it constant. */
void decode_scores(const float *q, const int64_t *key_pools, const int64_t *slots,
                   const int64_t *seq_lens, int batch, int heads, int group, int dim,
                   int chunk, int max_chunks, int max_len, float scale, float softcap,
                   int64_t window, float *scores, int threads, int bf16) {
    reads r = {key_pools, slots, seq_lens, heads, group, dim, chunk, max_chunks, max_len, window};
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
    for (int bh = 0; bh < batch * heads; bh++) {
        if (bf16)
            scores_of(&r, bh, q, scale, softcap, scores, 1);
        else
            scores_of(&r, bh, q, scale, softcap, scores, 0);
    }
}

void decode_values(const float *probs, const int64_t *value_pools, const int64_t *slots,
                   const int64_t *seq_lens, int batch, int heads, int group, int dim,
                   int chunk, int max_chunks, int max_len, int64_t window, float *out,
                   int threads, int bf16) {
    reads r = {value_pools, slots, seq_lens, heads, group, dim, chunk, max_chunks, max_len,
               window};
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
    for (int bh = 0; bh < batch * heads; bh++) {
        if (bf16)
            values_of(&r, bh, probs, out, 1);
        else
            values_of(&r, bh, probs, out, 0);
    }
}
