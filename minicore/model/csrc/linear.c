/* Linear layers of CPU models at decode batch sizes: out = x W^T (+ bias) for a few rows of x,
 * reading each weight once, in place (no packing: MKL packs the whole weight on every call,
 * which at 16 rows costs as much as the product). x, bias and out are float32; W is float32 or
 * bfloat16 (widened as read, the sums in float32). Built and loaded by minicore/model/native.py;
 * used by minicore/model/cpu_linear.py. */
#include <stdlib.h>

#include "bf16.h"

/* Output rows (weight rows) per block: 6 rows by 16 columns of x keep 12 accumulators, the two
 * loads of x and a broadcast in the 16 AVX registers. */
#define ROWS 6
/* Rows of x per pass: their transpose (k_len x 128 floats, 288 KB at 576 features) stays in cache
 * while every weight block streams past it; many rows at once (a prefill) would stream it from
 * memory once per weight block. An output element's sum is the same in any pass. */
#define SLAB 128

/* Load into a register: left to itself the compiler folds each load into every multiply-add
 * that uses it, and the loads, not the multiply-adds, then bound the loop. */
static inline v8 load(const float *p) {
    v8 x = *(const v8 *)p;
#if defined(__AVX__)
    __asm__("" : "+x"(x));
#endif
    return x;
}

/* acc[h][r] = sum over k of w[r][k] * xt[k][m0 + 8h .. m0 + 8h + 8), for h < 2 (h < 1 when one),
 * from xt, x transposed and padded to mp columns. */
INLINE void block(const float *xt, int mp, int m0, int one, const void *const *w, int k_len,
                  v8 acc[2][ROWS], int bf16) {
    const void *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3], *w4 = w[4], *w5 = w[5];
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0};
    v8 b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, b4 = {0}, b5 = {0};
    const float *xk = xt + m0;
    if (one) {
        for (int k = 0; k < k_len; k++, xk += mp) {
            v8 x0 = load(xk);
            a0 += elem(w0, k, bf16) * x0; a1 += elem(w1, k, bf16) * x0;
            a2 += elem(w2, k, bf16) * x0; a3 += elem(w3, k, bf16) * x0;
            a4 += elem(w4, k, bf16) * x0; a5 += elem(w5, k, bf16) * x0;
        }
    } else {
        for (int k = 0; k < k_len; k++, xk += mp) {
            v8 x0 = load(xk), x1 = load(xk + 8);
            float c0 = elem(w0, k, bf16), c1 = elem(w1, k, bf16), c2 = elem(w2, k, bf16);
            float c3 = elem(w3, k, bf16), c4 = elem(w4, k, bf16), c5 = elem(w5, k, bf16);
            a0 += c0 * x0; b0 += c0 * x1;
            a1 += c1 * x0; b1 += c1 * x1;
            a2 += c2 * x0; b2 += c2 * x1;
            a3 += c3 * x0; b3 += c3 * x1;
            a4 += c4 * x0; b4 += c4 * x1;
            a5 += c5 * x0; b5 += c5 * x1;
        }
    }
    v8 all[2][ROWS] = {{a0, a1, a2, a3, a4, a5}, {b0, b1, b2, b3, b4, b5}};
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < ROWS; r++)
            acc[h][r] = all[h][r];
}

/* Output rows [n0, n0 + ROWS) of out, for every row of x. */
INLINE void row_block(const float *xt, int mp, const void *w, const float *bias, float *out,
                      int m_len, int n_len, int k_len, int n0, int bf16) {
    int rows = n_len - n0 < ROWS ? n_len - n0 : ROWS;
    /* A last block's missing rows read its first row: computed, never stored. */
    const void *rows_w[ROWS];
    for (int r = 0; r < ROWS; r++)
        rows_w[r] = (const char *)w + (size_t)(n0 + (r < rows ? r : 0)) * k_len * elem_size(bf16);
    for (int m0 = 0; m0 < mp; m0 += 16) {
        int one = m0 + 8 >= mp;
        v8 acc[2][ROWS];
        block(xt, mp, m0, one, rows_w, k_len, acc, bf16);
        for (int h = 0; h <= !one; h++)
            for (int i = 0; i < 8 && m0 + 8 * h + i < m_len; i++)
                for (int r = 0; r < rows; r++)
                    out[(size_t)(m0 + 8 * h + i) * n_len + n0 + r] =
                        acc[h][r][i] + (bias ? bias[n0 + r] : 0.0f);
    }
}

/* out[m, n] = bias[n] + sum over k of x[m, k] w[n, k]; x [m_len, k_len], w [n_len, k_len] (float32,
 * or bfloat16 when bf16) and out [m_len, n_len] row-major; bias may be NULL. Returns 0, or -1 if
 * out of memory. */
int linear_rows(const float *x, const void *w, const float *bias, float *out, int m_len,
                int n_len, int k_len, int threads, int bf16) {
    int slab = m_len < SLAB ? m_len : SLAB;
    float *xt = malloc(sizeof(float) * (size_t)k_len * ((slab + 7) / 8 * 8));
    if (!xt)
        return -1;
    int blocks = (n_len + ROWS - 1) / ROWS;
    for (int m0 = 0; m0 < m_len; m0 += SLAB) {
        int rows = m_len - m0 < SLAB ? m_len - m0 : SLAB, mp = (rows + 7) / 8 * 8;
        const float *xs = x + (size_t)m0 * k_len;
        float *os = out + (size_t)m0 * n_len;
        for (int k = 0; k < k_len; k++)
            for (int m = 0; m < mp; m++)
                xt[(size_t)k * mp + m] = m < rows ? xs[(size_t)m * k_len + k] : 0.0f;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int nb = 0; nb < blocks; nb++) {
            if (bf16)
                row_block(xt, mp, w, bias, os, rows, n_len, k_len, nb * ROWS, 1);
            else
                row_block(xt, mp, w, bias, os, rows, n_len, k_len, nb * ROWS, 0);
        }
    }
    free(xt);
    return 0;
}
