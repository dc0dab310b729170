/* Decode attention over the per-request KV pools of minicore/model/decode_kv.py, for float32 on
 * CPU: the two passes that read keys and values, each reading a request's live rows once.
 * Built and loaded by minicore/model/native.py; the softmax between them stays in torch. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float dot(const float *a, const float *b, int n) {
    /* Two accumulators: one would chain every multiply-add on the one before. */
    v8 acc0 = {0}, acc1 = {0};
    int d = 0;
    for (; d + 16 <= n; d += 16) {
        acc0 += *(const v8 *)(a + d) * *(const v8 *)(b + d);
        acc1 += *(const v8 *)(a + d + 8) * *(const v8 *)(b + d + 8);
    }
    for (; d + 8 <= n; d += 8)
        acc0 += *(const v8 *)(a + d) * *(const v8 *)(b + d);
    v8 acc = acc0 + acc1;
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; d++)
        s += a[d] * b[d];
    return s;
}

/* First position attended to: len - window with a sliding window, else 0. */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* The positions [start, end) of request b that lie in chunk c, and where the first one's row of
 * head h is in that chunk's pool ([slots, heads, chunk, dim]). */
typedef struct {
    int64_t start, end;
    const float *rows;
} span;

static inline span chunk_span(const int64_t *pools, const int64_t *slots, int64_t b, int64_t c,
                              int64_t first, int64_t len, int h, int heads, int chunk,
                              int max_chunks, int dim) {
    span s;
    s.start = first > c * chunk ? first : c * chunk;
    s.end = len < (c + 1) * chunk ? len : (c + 1) * chunk;
    const float *pool = (const float *)(intptr_t)pools[c];
    s.rows = pool + ((slots[b * max_chunks + c] * heads + h) * chunk + s.start - c * chunk) * dim;
    return s;
}

/* scores[b, h, g, p] = scale * q[b, h, g] . key(b, h, p) for p in [first, len), -inf elsewhere;
 * first = len - window when window > 0. softcap > 0 caps: cap * tanh(s / cap). */
void decode_scores(const float *q, const int64_t *key_pools, const int64_t *slots,
                   const int64_t *seq_lens, int batch, int heads, int group, int dim,
                   int chunk, int max_chunks, int max_len, float scale, float softcap,
                   int64_t window, float *scores, int threads) {
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
    for (int bh = 0; bh < batch * heads; bh++) {
        int b = bh / heads, h = bh % heads;
        int64_t len = seq_lens[b], first = window_start(len, window);
        const float *qb = q + (int64_t)bh * group * dim;
        float *out = scores + (int64_t)bh * group * max_len;
        for (int64_t i = 0; i < (int64_t)group * max_len; i++)
            out[i] = -INFINITY;
        for (int64_t c = first / chunk; c * chunk < len; c++) {
            span s = chunk_span(key_pools, slots, b, c, first, len, h, heads, chunk, max_chunks,
                                dim);
            const float *k = s.rows;
            for (int64_t p = s.start; p < s.end; p++, k += dim)
                for (int g = 0; g < group; g++) {
                    float x = dot(qb + g * dim, k, dim) * scale;
                    out[g * max_len + p] = softcap > 0 ? softcap * tanhf(x / softcap) : x;
                }
        }
    }
}

/* out[b, h, g] = sum over p in [first, len) of probs[b, h, g, p] * value(b, h, p). */
void decode_values(const float *probs, const int64_t *value_pools, const int64_t *slots,
                   const int64_t *seq_lens, int batch, int heads, int group, int dim,
                   int chunk, int max_chunks, int max_len, int64_t window, float *out,
                   int threads) {
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
    for (int bh = 0; bh < batch * heads; bh++) {
        int b = bh / heads, h = bh % heads;
        int64_t len = seq_lens[b], first = window_start(len, window);
        const float *pb = probs + (int64_t)bh * group * max_len;
        float *ob = out + (int64_t)bh * group * dim;
        memset(ob, 0, sizeof(float) * group * dim);
        for (int64_t c = first / chunk; c * chunk < len; c++) {
            span s = chunk_span(value_pools, slots, b, c, first, len, h, heads, chunk,
                                max_chunks, dim);
            const float *v = s.rows;
            for (int64_t p = s.start; p < s.end; p++, v += dim)
                for (int g = 0; g < group; g++) {
                    float w = pb[g * max_len + p], *o = ob + g * dim;
                    for (int d = 0; d < dim; d++)
                        o[d] += w * v[d];
                }
        }
    }
}
