/* Linear layers of bfloat16 models on CPUs with AVX512-BF16: out = x W^T (+ bias), x and W
 * bfloat16, out float32, by VDPBF16PS (two bfloat16 products summed into each float32 lane).
 * Each output element is the dot product of its weight row and its row of x: 16 lanes, lane i
 * summing features 32j + 2i and 32j + 2i + 1 over j, then one fixed horizontal sum; the same
 * for every row whatever the others (batch invariance), in any block. Rows of x go in slabs of
 * 128, whose 4-row blocks stay in cache while every block of 4 weight rows streams past; one
 * row (a decode step) reads each weight once at memory speed. Without AVX512-BF16 it reports
 * so and minicore/model/native.py uses linear.c. Built and loaded by native.py. */
#include <stdint.h>

#define SLAB 128

#ifdef __AVX512BF16__
#include <immintrin.h>

#define R 4 /* weight rows per block */

/* out[m0 + c][n0 + r] for r < rows, c < C: C rows of x against 4 weight rows (a last block's
 * missing weight rows read its first row: computed, never stored). */
static inline __attribute__((always_inline)) void block(const uint16_t *x, const uint16_t *w,
                                                        const float *bias, float *out, int n_len,
                                                        int k_len, int n0, int rows, int m0,
                                                        const int C) {
    const uint16_t *wr[R], *xr[4];
    for (int r = 0; r < R; r++)
        wr[r] = w + (int64_t)(n0 + (r < rows ? r : 0)) * k_len;
    for (int c = 0; c < C; c++)
        xr[c] = x + (int64_t)(m0 + c) * k_len;
    __m512 acc[R][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= k_len; k += 32) {
        __m512bh wv[R], xv[4];
        for (int r = 0; r < R; r++)
            wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + k);
        for (int c = 0; c < C; c++)
            xv[c] = (__m512bh)_mm512_loadu_si512(xr[c] + k);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[r], xv[c]);
    }
    if (k < k_len) { /* the last features, the lanes past them zero: the same sums */
        __mmask32 mask = (1u << (k_len - k)) - 1;
        __m512bh wv[R], xv[4];
        for (int r = 0; r < R; r++)
            wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[r] + k);
        for (int c = 0; c < C; c++)
            xv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[c] + k);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[r], xv[c]);
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < rows; r++)
            out[(int64_t)(m0 + c) * n_len + n0 + r] =
                _mm512_reduce_add_ps(acc[r][c]) + (bias ? bias[n0 + r] : 0.0f);
}

/* 0, or -2 where this CPU (this build) has no AVX512-BF16. */
int linear_rows_bf16(const uint16_t *x, const uint16_t *w, const float *bias, float *out,
                     int m_len, int n_len, int k_len, int threads) {
    int blocks = (n_len + R - 1) / R;
    for (int s0 = 0; s0 < m_len; s0 += SLAB) {
        int s1 = m_len - s0 < SLAB ? m_len : s0 + SLAB;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int nb = 0; nb < blocks; nb++) {
            int n0 = nb * R, rows = n_len - n0 < R ? n_len - n0 : R;
            int m0 = s0;
            for (; m0 + 4 <= s1; m0 += 4)
                block(x, w, bias, out, n_len, k_len, n0, rows, m0, 4);
            switch (s1 - m0) {
            case 3: block(x, w, bias, out, n_len, k_len, n0, rows, m0, 3); break;
            case 2: block(x, w, bias, out, n_len, k_len, n0, rows, m0, 2); break;
            case 1: block(x, w, bias, out, n_len, k_len, n0, rows, m0, 1); break;
            }
        }
    }
    return 0;
}
#else
int linear_rows_bf16(const uint16_t *x, const uint16_t *w, const float *bias, float *out,
                     int m_len, int n_len, int k_len, int threads) {
    (void)x, (void)w, (void)bias, (void)out, (void)m_len, (void)n_len, (void)k_len, (void)threads;
    return -2;
}
#endif
