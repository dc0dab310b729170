/* Decode attention over the per-request KV pools of minicore/model/decode_kv.py, on CPU, with
 * pools of float32 or bfloat16 (queries, scores and sums in float32): the two passes that read
 * keys and values, each reading a request's live rows once for all the query heads of a KV head.
 * A score is a dot product in eight lanes and one fixed tree (sum8), an output element a sum over
 * the positions in order: the same for a query whoever else is in the batch and however the work
 * is split between threads (batch invariance). Built and loaded by minicore/model/native.py; the
 * softmax between them stays in torch. */
#include <math.h>

#include "bf16.h"

/* The sums of eight vectors' lanes, [sum a0, ..., sum a7]: lanes paired (0 + 1), then pairs
 * paired, then halves, so every sum has the tree ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
 * whichever vectors share the instructions. */
INLINE v8 pair_sums(v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}

INLINE v8 sum8(const v8 *acc) {
    return pair_sums(pair_sums(pair_sums(acc[0], acc[1]), pair_sums(acc[2], acc[3])),
                     pair_sums(pair_sums(acc[4], acc[5]), pair_sums(acc[6], acc[7])));
}

/* out[j] = a . b_j for a float32 query row and the eight key rows from b on (a row every
 * `stride` bytes; the rows past `count` repeat the last and are not stored): eight lanes per
 * dot product, one sum8 tree, the features past the last multiple of eight added after it in
 * order. Each dot product is computed the same way whichever rows share the call. */
INLINE void dot8(const float *a, const char *b, int64_t stride, int count, int n, float *out,
                 int bf16) {
    const char *rows[8];
    for (int j = 0; j < 8; j++)
        rows[j] = b + (j < count ? j : count - 1) * stride;
    v8 acc[8] = {{0}};
    int d = 0;
    for (; d + 8 <= n; d += 8) {
        v8 x = *(const v8 *)(a + d);
        for (int j = 0; j < 8; j++)
            acc[j] += x * elems8(rows[j], d, bf16);
    }
    v8 sums = sum8(acc);
    for (int j = 0; j < count; j++) {
        float s = sums[j];
        for (int e = d; e < n; e++)
            s += a[e] * elem(rows[j], e, bf16);
        out[j] = s;
    }
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
 * first = len - window when window > 0. softcap > 0 caps: cap * tanh(s / cap). Each block of
 * eight keys serves every query head of the group while it is in cache. */
INLINE void scores_of(const reads *r, int bh, int g0, int g1, const float *q, float scale,
                      float softcap, float *scores, int bf16) {
    int b = bh / r->heads, h = bh % r->heads, dim = r->dim;
    int64_t len = r->seq_lens[b], first = window_start(len, r->window), max_len = r->max_len;
    const float *qb = q + (int64_t)bh * r->group * dim;
    float *out = scores + (int64_t)bh * r->group * max_len;
    int64_t row_bytes = dim * elem_size(bf16);
    for (int64_t i = g0 * max_len; i < g1 * max_len; i++)
        out[i] = -INFINITY;
    for (int64_t c = first / r->chunk; c * r->chunk < len; c++) {
        span s = chunk_span(r, b, c, first, len, h, bf16);
        for (int64_t p = s.start; p < s.end; p += 8) {
            int count = s.end - p < 8 ? (int)(s.end - p) : 8;
            for (int g = g0; g < g1; g++) {
                float *o = out + g * max_len + p;
                dot8(qb + g * dim, s.rows + (p - s.start) * row_bytes, row_bytes, count, dim, o,
                     bf16);
                for (int j = 0; j < count; j++) {
                    float x = o[j] * scale;
                    o[j] = softcap > 0 ? softcap * tanhf(x / softcap) : x;
                }
            }
        }
    }
}

/* out[b, h, g] = sum over p in [first, len) of probs[b, h, g, p] * value(b, h, p): each element
 * summed over the positions in order, 64 features at a time held in registers. */
INLINE void values_of(const reads *r, int bh, int g0, int g1, const float *probs, float *out,
                      int bf16) {
    int b = bh / r->heads, h = bh % r->heads, dim = r->dim;
    int64_t len = r->seq_lens[b], first = window_start(len, r->window);
    int64_t row_bytes = dim * elem_size(bf16);
    for (int g = g0; g < g1; g++) {
        const float *pg = probs + ((int64_t)bh * r->group + g) * r->max_len;
        float *og = out + ((int64_t)bh * r->group + g) * dim;
        for (int d0 = 0; d0 < dim; d0 += 64) {
            int end = d0 + 64 < dim ? d0 + 64 : dim, vectors = (end - d0) / 8;
            v8 acc[8] = {{0}};
            float tail[7] = {0};
            for (int64_t c = first / r->chunk; c * r->chunk < len; c++) {
                span s = chunk_span(r, b, c, first, len, h, bf16);
                const char *v = s.rows;
                for (int64_t p = s.start; p < s.end; p++, v += row_bytes) {
                    float w = pg[p];
                    for (int j = 0; j < 8; j++)
                        if (j < vectors)
                            acc[j] += w * elems8(v, d0 + 8 * j, bf16);
                    for (int e = d0 + 8 * vectors; e < end; e++)
                        tail[e - d0 - 8 * vectors] += w * elem(v, e, bf16);
                }
            }
            for (int j = 0; j < vectors; j++)
                memcpy(og + d0 + 8 * j, &acc[j], sizeof acc[j]);
            for (int e = d0 + 8 * vectors; e < end; e++)
                og[e] = tail[e - d0 - 8 * vectors];
        }
    }
}

/* Work items: a (request, KV head) with all its query heads, whose keys then serve each one
 * while in cache; or, with fewer than two such items per thread (a decode of one or two
 * requests), one query head each, so that every thread has work. The items do not change what
 * any output sums, nor in which order. */
static inline int group_split(int batch, int heads, int group, int threads) {
    return batch * heads >= 2 * threads ? 1 : group;
}

/* The entry points: pools of float32 (bf16 = 0) or bfloat16 (bf16 = 1), the type chosen per item
 * so that each inlined body has it constant. */
void decode_scores(const float *q, const int64_t *key_pools, const int64_t *slots,
                   const int64_t *seq_lens, int batch, int heads, int group, int dim,
                   int chunk, int max_chunks, int max_len, float scale, float softcap,
                   int64_t window, float *scores, int threads, int bf16) {
    reads r = {key_pools, slots, seq_lens, heads, group, dim, chunk, max_chunks, max_len, window};
    int split = group_split(batch, heads, group, threads), per = group / split;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int i = 0; i < batch * heads * split; i++) {
        int bh = i / split, g0 = i % split * per;
        if (bf16)
            scores_of(&r, bh, g0, g0 + per, q, scale, softcap, scores, 1);
        else
            scores_of(&r, bh, g0, g0 + per, q, scale, softcap, scores, 0);
    }
}

void decode_values(const float *probs, const int64_t *value_pools, const int64_t *slots,
                   const int64_t *seq_lens, int batch, int heads, int group, int dim,
                   int chunk, int max_chunks, int max_len, int64_t window, float *out,
                   int threads, int bf16) {
    reads r = {value_pools, slots, seq_lens, heads, group, dim, chunk, max_chunks, max_len,
               window};
    int split = group_split(batch, heads, group, threads), per = group / split;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int i = 0; i < batch * heads * split; i++) {
        int bh = i / split, g0 = i % split * per;
        if (bf16)
            values_of(&r, bh, g0, g0 + per, probs, out, 1);
        else
            values_of(&r, bh, g0, g0 + per, probs, out, 0);
    }
}
