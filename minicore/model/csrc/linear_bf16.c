/* Linear layers of bfloat16 models on CPUs with AVX512-BF16: out = x W^T (+ bias), x and W
 * bfloat16, out float32 or rounded to bfloat16 (out_bf16), by VDPBF16PS (two bfloat16 products
 * summed into each float32 lane). Each output element is the dot product of its weight row and
 * its row of x: 16 lanes, lane i summing features 32j + 2i and 32j + 2i + 1 over j, then one
 * fixed horizontal sum (four at a time: sum4); the same for every row whatever the others (batch
 * invariance), in any block. Rows of x go in slabs of
 * 128, whose 4-row blocks stay in cache while every block of 4 weight rows streams past; one
 * row (a decode step) reads each weight once at memory speed. Without AVX512-BF16 it reports
 * so and minicore/model/native.py uses linear.c. Built and loaded by native.py. */
#include <stdint.h>

#define SLAB 128

#ifdef __AVX512BF16__
#include <immintrin.h>

#define R 4 /* weight rows per block */
/* How far ahead of its reads each weight row is prefetched: with four rows streaming per thread
 * the hardware prefetcher alone leaves bandwidth unused (measured: 512 bytes ahead, 8% less time
 * for a decode step's products, docs/BENCHMARKS.md). */
#define PREFETCH_BYTES 512

/* The lane sums of four accumulators at once, [sum a, sum b, sum c, sum d]: within each 128-bit
 * lane (l0 + l2) + (l1 + l3), then the four lanes (0 + 2) + (1 + 3). Every sum has the same tree,
 * whichever accumulators share the instructions. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    __m512 all = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                               _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(all),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(all), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* bf16.h's rounded() of four floats at once (to nearest, ties to even; NaN kept), as bfloat16
 * in the low 64 bits: the same bits as the scalar rounding it replaced, whose stores, one element
 * at a time, took a quarter of a 64-row product's time. */
static inline __m128i rounded4(__m128 f) {
    __m128i u = _mm_castps_si128(f);
    __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i r = _mm_add_epi32(u, _mm_add_epi32(odd, _mm_set1_epi32(0x7fff)));
    r = _mm_mask_mov_epi32(r, _mm_cmp_ps_mask(f, f, _CMP_UNORD_Q), u);
    return _mm_cvtepi32_epi16(_mm_srli_epi32(r, 16));
}

/* out[m0 + c][n0 + r] for r < rows, c < C: C rows of x against 4 weight rows (a last block's
 * missing weight rows read its first row: computed, never stored). */
static inline __attribute__((always_inline)) void block(const uint16_t *x, const uint16_t *w,
                                                        const float *bias, void *out, int n_len,
                                                        int k_len, int n0, int rows, int m0,
                                                        const int C, int out_bf16) {
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
    /* The empty asm statements pin each loaded vector in a register: without them GCC 12 loads
     * every x vector again for each weight row, 16 loads for 16 products, which the load ports
     * cannot keep up with (measured: 7 to 10% slower at 64 rows and more). */
    for (; k + 32 <= k_len; k += 32) {
        __m512bh wv[R], xv[4];
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(wr[r] + k) + PREFETCH_BYTES, _MM_HINT_T0);
            wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + k);
            __asm__("" : "+v"(wv[r]));
        }
        for (int c = 0; c < C; c++) {
            xv[c] = (__m512bh)_mm512_loadu_si512(xr[c] + k);
            __asm__("" : "+v"(xv[c]));
        }
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
    __mmask8 stored = (1u << rows) - 1;
    __m128 b = bias ? _mm_maskz_loadu_ps(stored, bias + n0) : _mm_setzero_ps();
    for (int c = 0; c < C; c++) {
        __m128 sums = _mm_add_ps(sum4(acc[0][c], acc[1][c], acc[2][c], acc[3][c]), b);
        int64_t at = (int64_t)(m0 + c) * n_len + n0;
        if (out_bf16) {
            _mm_mask_storeu_epi16((uint16_t *)out + at, stored, rounded4(sums));
        } else {
            _mm_mask_storeu_ps((float *)out + at, stored, sums);
        }
    }
}

/* 0, or -2 where this CPU (this build) has no AVX512-BF16. */
int linear_rows_bf16(const uint16_t *x, const uint16_t *w, const float *bias, void *out,
                     int m_len, int n_len, int k_len, int threads, int out_bf16) {
    int blocks = (n_len + R - 1) / R;
    for (int s0 = 0; s0 < m_len; s0 += SLAB) {
        int s1 = m_len - s0 < SLAB ? m_len : s0 + SLAB;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int nb = 0; nb < blocks; nb++) {
            int n0 = nb * R, rows = n_len - n0 < R ? n_len - n0 : R;
            int m0 = s0;
            for (; m0 + 4 <= s1; m0 += 4)
                block(x, w, bias, out, n_len, k_len, n0, rows, m0, 4, out_bf16);
            switch (s1 - m0) {
            case 3: block(x, w, bias, out, n_len, k_len, n0, rows, m0, 3, out_bf16); break;
            case 2: block(x, w, bias, out, n_len, k_len, n0, rows, m0, 2, out_bf16); break;
            case 1: block(x, w, bias, out, n_len, k_len, n0, rows, m0, 1, out_bf16); break;
            }
        }
    }
    return 0;
}
#else
int linear_rows_bf16(const uint16_t *x, const uint16_t *w, const float *bias, void *out,
                     int m_len, int n_len, int k_len, int threads, int out_bf16) {
    (void)x, (void)w, (void)bias, (void)out, (void)m_len, (void)n_len, (void)k_len, (void)threads;
    (void)out_bf16;
    return -2;
}
#endif
