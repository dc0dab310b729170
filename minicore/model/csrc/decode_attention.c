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

/* Query heads per tile: each key or value row read serves this many query heads while it is in
 * registers (three take 24 accumulators of the 32 vector registers). */
#define TILE 3

/* out[g][j] = a_g . b_j for the Q float32 query rows from a on (`n` apart) and the eight key rows
 * from b on (a row every `stride` bytes; the rows past `count` repeat the last and are not
 * stored), out[g] `out_stride` apart: eight lanes per dot product, one sum8 tree, the features
 * past the last multiple of eight added after it in order. Each dot product is computed the same
 * way whichever rows and queries share the call; each key vector is read once for the Q. */
INLINE void dot8(const float *a, const int Q, const char *b, int64_t stride, int count, int n,
                 float *out, int64_t out_stride, int bf16) {
    const char *rows[8];
    for (int j = 0; j < 8; j++)
        rows[j] = b + (j < count ? j : count - 1) * stride;
    v8 acc[TILE][8] = {{{0}}};
    int d = 0;
    for (; d + 8 <= n; d += 8) {
        v8 x[TILE];
        for (int g = 0; g < Q; g++)
            x[g] = *(const v8 *)(a + g * n + d);
        for (int j = 0; j < 8; j++) {
            v8 key = elems8(rows[j], d, bf16);
            for (int g = 0; g < Q; g++)
                acc[g][j] += x[g] * key;
        }
    }
    for (int g = 0; g < Q; g++) {
        v8 sums = sum8(acc[g]);
        for (int j = 0; j < count; j++) {
            float s = sums[j];
            for (int e = d; e < n; e++)
                s += a[g * n + e] * elem(rows[j], e, bf16);
            out[g * out_stride + j] = s;
        }
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
            const char *keys = s.rows + (p - s.start) * row_bytes;
            for (int g = g0; g < g1; g += TILE) {
                float *o = out + g * max_len + p;
                const float *qg = qb + g * dim;
                switch (g1 - g < TILE ? g1 - g : TILE) {
                case 1: dot8(qg, 1, keys, row_bytes, count, dim, o, max_len, bf16); break;
                case 2: dot8(qg, 2, keys, row_bytes, count, dim, o, max_len, bf16); break;
                default: dot8(qg, TILE, keys, row_bytes, count, dim, o, max_len, bf16);
                }
            }
            for (int g = g0; g < g1; g++)
                for (int j = 0; j < count; j++) {
                    float *o = out + g * max_len + p + j, x = *o * scale;
                    *o = softcap > 0 ? softcap * tanhf(x / softcap) : x;
                }
        }
    }
}

/* out[g] = sum over p of probs[g][p] * value(p), for the Q query heads from g on (probs `max_len`
 * apart, out `dim` apart) and 32 features from d0 on, each value vector read once for the Q:
 * each element summed over the positions in order, whichever heads share the call. */
INLINE void values32(const reads *r, int b, int h, int64_t first, int64_t len, const float *probs,
                     const int Q, int d0, float *out, int bf16) {
    int dim = r->dim, end = d0 + 32 < dim ? d0 + 32 : dim, vectors = (end - d0) / 8;
    int64_t row_bytes = dim * elem_size(bf16);
    v8 acc[TILE][4] = {{{0}}};
    float tail[TILE][7] = {{0}};
    for (int64_t c = first / r->chunk; c * r->chunk < len; c++) {
        span s = chunk_span(r, b, c, first, len, h, bf16);
        const char *v = s.rows;
        for (int64_t p = s.start; p < s.end; p++, v += row_bytes) {
            v8 value[4];
            for (int j = 0; j < 4; j++)
                if (j < vectors)
                    value[j] = elems8(v, d0 + 8 * j, bf16);
            for (int g = 0; g < Q; g++) {
                float w = probs[g * r->max_len + p];
                for (int j = 0; j < 4; j++)
                    if (j < vectors)
                        acc[g][j] += w * value[j];
                for (int e = d0 + 8 * vectors; e < end; e++)
                    tail[g][e - d0 - 8 * vectors] += w * elem(v, e, bf16);
            }
        }
    }
    for (int g = 0; g < Q; g++) {
        for (int j = 0; j < vectors; j++)
            memcpy(out + g * dim + d0 + 8 * j, &acc[g][j], sizeof acc[g][j]);
        for (int e = d0 + 8 * vectors; e < end; e++)
            out[g * dim + e] = tail[g][e - d0 - 8 * vectors];
    }
}

/* out[b, h, g] = sum over p in [first, len) of probs[b, h, g, p] * value(b, h, p): each element
 * summed over the positions in order, TILE heads and 32 features at a time in registers. */
INLINE void values_of(const reads *r, int bh, int g0, int g1, const float *probs, float *out,
                      int bf16) {
    int b = bh / r->heads, h = bh % r->heads, dim = r->dim;
    int64_t len = r->seq_lens[b], first = window_start(len, r->window);
    for (int g = g0; g < g1; g += TILE) {
        const float *pg = probs + ((int64_t)bh * r->group + g) * r->max_len;
        float *og = out + ((int64_t)bh * r->group + g) * dim;
        for (int d0 = 0; d0 < dim; d0 += 32)
            switch (g1 - g < TILE ? g1 - g : TILE) {
            case 1: values32(r, b, h, first, len, pg, 1, d0, og, bf16); break;
            case 2: values32(r, b, h, first, len, pg, 2, d0, og, bf16); break;
            default: values32(r, b, h, first, len, pg, TILE, d0, og, bf16);
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
