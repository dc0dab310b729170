/* Decode attention over the per-request KV pools of minicore/model/decode_kv.py, on CPU, with
 * pools of float32 or bfloat16 (queries, scores and sums in float32): per item (a request's KV
 * head), the scores, their softmax and the values, each pass reading the request's live rows
 * once for all the query heads of the KV head, its scores in a scratch row of the thread's. A
 * score is a dot product in eight lanes and one fixed tree (sum8), a softmax's sum eight lanes and
 * one tree over the row alone, an output element a sum over the positions in order: the same for
 * a query whoever else is in the batch and however the work is split between threads (batch
 * invariance), whether its token is decoded, a draft or a prompt's. Built and loaded by
 * minicore/model/native.py. */
#include <math.h>
#include <stdlib.h>

#include "bf16.h"

typedef int32_t v8i __attribute__((vector_size(32)));

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

/* What an item reads: the key and value pools, each request's slots and length, shapes. */
typedef struct {
    const int64_t *pools[2], *slots, *seq_lens;
    int heads, group, dim, chunk, max_chunks;
    int64_t window;
} reads;

/* The positions [start, end) of request b that lie in chunk c, and where the first one's row of
 * head h is in that chunk's key (kv 0) or value (kv 1) pool ([slots, heads, chunk, dim]). */
typedef struct {
    int64_t start, end;
    const char *rows;
} span;

INLINE span chunk_span(const reads *r, int kv, int64_t b, int64_t c, int64_t first, int64_t len,
                       int h, int bf16) {
    span s;
    int64_t chunk = r->chunk;
    s.start = first > c * chunk ? first : c * chunk;
    s.end = len < (c + 1) * chunk ? len : (c + 1) * chunk;
    const char *pool = (const char *)(intptr_t)r->pools[kv][c];
    int64_t row = (r->slots[b * r->max_chunks + c] * r->heads + h) * chunk + s.start - c * chunk;
    s.rows = pool + row * r->dim * elem_size(bf16);
    return s;
}

/* Ask for the rows of chunk c (if the sequence reaches it) before they are read: each chunk's
 * rows are a pool of their own, so a walk over small chunks (one block, with batch invariance)
 * starts a new stream at every chunk, which the hardware prefetcher picks up only after some
 * misses (measured: 12 us a layer of a 200-position decode in the runner). */
INLINE void prefetch_chunk(const reads *r, int kv, int64_t b, int64_t c, int64_t first,
                           int64_t len, int h, int bf16) {
    if (c * r->chunk >= len)
        return;
    span s = chunk_span(r, kv, b, c, first, len, h, bf16);
    for (int64_t off = 0; off < (s.end - s.start) * r->dim * elem_size(bf16); off += 64)
        __builtin_prefetch(s.rows + off);
}

/* scores[g][p - first] = scale * q[b, h, g] . key(b, h, p) for p in [first, len), rows n apart;
 * softcap > 0 caps: cap * tanh(s / cap). Each block of eight keys serves every query head of
 * the item while it is in cache, TILE of them while it is in registers. */
INLINE void scores_of(const reads *r, int b, int h, int g0, int g1, int64_t first, int64_t len,
                      const float *qb, float scale, float softcap, float *scores, int bf16) {
    int dim = r->dim;
    int64_t n = len - first, row_bytes = dim * elem_size(bf16);
    for (int64_t c = first / r->chunk; c * r->chunk < len; c++) {
        span s = chunk_span(r, 0, b, c, first, len, h, bf16);
        prefetch_chunk(r, 0, b, c + 1, first, len, h, bf16);
        prefetch_chunk(r, 1, b, c, first, len, h, bf16); /* for the values pass */
        for (int64_t p = s.start; p < s.end; p += 8) {
            int count = s.end - p < 8 ? (int)(s.end - p) : 8;
            const char *keys = s.rows + (p - s.start) * row_bytes;
            for (int g = g0; g < g1; g += TILE) {
                float *o = scores + (g - g0) * n + p - first;
                const float *qg = qb + g * dim;
                switch (g1 - g < TILE ? g1 - g : TILE) {
                case 1: dot8(qg, 1, keys, row_bytes, count, dim, o, n, bf16); break;
                case 2: dot8(qg, 2, keys, row_bytes, count, dim, o, n, bf16); break;
                default: dot8(qg, TILE, keys, row_bytes, count, dim, o, n, bf16);
                }
            }
        }
    }
    for (int64_t i = 0; i < (g1 - g0) * n; i++) {
        float x = scores[i] * scale;
        scores[i] = softcap > 0 ? softcap * tanhf(x / softcap) : x;
    }
}

/* e^x in eight lanes: Cephes' expf (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-5 polynomial in
 * r, then 2^n added into the exponent bits), within 2 ulp of expf; 0 below -80, where e^x is
 * under 2e-35 (a softmax's exponents are x - max <= 0: their sum is at least 1). n is x log2 e
 * rounded to nearest by adding and subtracting 1.5 * 2^23, so that the kernels need no
 * intrinsics. */
INLINE v8 exp8(v8 x) {
    v8i under = (v8i)(x < -80.0f);
    x = (v8)((v8i)x & ~under); /* those lanes' results are zeroed below */
    v8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    v8i bits = (v8i)p + (__builtin_convertvector(n, v8i) << 23);
    return (v8)(bits & ~under);
}

/* The softmax of a row of n scores, in place: its max (exact in any order), e^(x - max) in
 * eight lanes by position, their sum by lane then one tree, the last n % 8 added after it in
 * order, then each divided by the sum. Every step depends on the row alone. */
INLINE void softmax_row(float *x, int64_t n) {
    float max = -INFINITY;
    for (int64_t p = 0; p < n; p++)
        max = x[p] > max ? x[p] : max;
    v8 sums = {0};
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) {
        v8 e = exp8(*(v8 *)(x + p) - max);
        memcpy(x + p, &e, sizeof e);
        sums += e;
    }
    float sum = ((sums[0] + sums[1]) + (sums[2] + sums[3])) +
                ((sums[4] + sums[5]) + (sums[6] + sums[7]));
    for (; p < n; p++) {
        v8 e = exp8((v8){0} + (x[p] - max));
        x[p] = e[0];
        sum += e[0];
    }
    for (p = 0; p < n; p++)
        x[p] /= sum;
}

/* out[g] = sum over p of probs[g][p - first] * value(p), for the Q query heads from g on (probs
 * n apart, out dim apart) and 32 features from d0 on, each value vector read once for the Q:
 * each element summed over the positions in order, whichever heads share the call. */
INLINE void values32(const reads *r, int b, int h, int64_t first, int64_t len, const float *probs,
                     const int Q, int d0, float *out, int bf16) {
    int dim = r->dim, end = d0 + 32 < dim ? d0 + 32 : dim, vectors = (end - d0) / 8;
    int64_t n = len - first, row_bytes = dim * elem_size(bf16);
    v8 acc[TILE][4] = {{{0}}};
    float tail[TILE][7] = {{0}};
    for (int64_t c = first / r->chunk; c * r->chunk < len; c++) {
        span s = chunk_span(r, 1, b, c, first, len, h, bf16);
        const char *v = s.rows;
        for (int64_t p = s.start; p < s.end; p++, v += row_bytes) {
            v8 value[4] = {{0}};
            for (int j = 0; j < 4; j++)
                if (j < vectors)
                    value[j] = elems8(v, d0 + 8 * j, bf16);
            for (int g = 0; g < Q; g++) {
                float w = probs[g * n + p - first];
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

/* One item: query heads [g0, g1) of KV head h of sequence b. Their scores go into the thread's
 * scratch rows (the positions attended to only), their softmax stays there, then the values. */
INLINE void attend(const reads *r, int bh, int g0, int g1, const float *q, float scale,
                   float softcap, float *scratch, float *out, int bf16) {
    int b = bh / r->heads, h = bh % r->heads, dim = r->dim;
    int64_t len = r->seq_lens[b], first = window_start(len, r->window), n = len - first;
    const float *qb = q + (int64_t)bh * r->group * dim;
    scores_of(r, b, h, g0, g1, first, len, qb, scale, softcap, scratch, bf16);
    for (int g = g0; g < g1; g++)
        softmax_row(scratch + (g - g0) * n, n);
    float *ob = out + (int64_t)bh * r->group * dim;
    for (int g = g0; g < g1; g += TILE)
        for (int d0 = 0; d0 < dim; d0 += 32)
            switch (g1 - g < TILE ? g1 - g : TILE) {
            case 1: values32(r, b, h, first, len, scratch + (g - g0) * n, 1, d0, ob + g * dim,
                             bf16); break;
            case 2: values32(r, b, h, first, len, scratch + (g - g0) * n, 2, d0, ob + g * dim,
                             bf16); break;
            default: values32(r, b, h, first, len, scratch + (g - g0) * n, TILE, d0,
                              ob + g * dim, bf16);
            }
}

/* Work items: a (request, KV head) with all its query heads, whose keys then serve each one
 * while in cache; or, with fewer than two such items per thread (a decode of one or two
 * requests), one query head each, so that every thread has work. The items do not change what
 * any output sums, nor in which order. */
static inline int group_split(int batch, int heads, int group, int threads) {
    return batch * heads >= 2 * threads ? 1 : group;
}

/* The entry point: out[b, h, g] = softmax(scale * q . keys) . values for each sequence b of
 * length seq_lens[b] (max_len at most), pools of float32 (bf16 = 0) or bfloat16 (bf16 = 1), the
 * type chosen per item so that each inlined body has it constant. 0, or -1 out of memory. */
int decode_attention(const float *q, const int64_t *key_pools, const int64_t *value_pools,
                     const int64_t *slots, const int64_t *seq_lens, int batch, int heads,
                     int group, int dim, int chunk, int max_chunks, int max_len, float scale,
                     float softcap, int64_t window, float *out, int threads, int bf16) {
    reads r = {{key_pools, value_pools}, slots, seq_lens, heads, group, dim, chunk, max_chunks,
               window};
    int split = group_split(batch, heads, group, threads), per = group / split, failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = malloc(sizeof(float) * per * (max_len > 0 ? max_len : 1));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < batch * heads * split; i++) {
            int bh = i / split, g0 = i % split * per;
            if (!scratch)
                continue;
            if (bf16)
                attend(&r, bh, g0, g0 + per, q, scale, softcap, scratch, out, 1);
            else
                attend(&r, bh, g0, g0 + per, q, scale, softcap, scratch, out, 0);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
