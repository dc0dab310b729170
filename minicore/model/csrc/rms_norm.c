/* RMSNorm of transformers' Llama-family layers, float32 or bfloat16 storage: per row, in
 * float32, y = x / sqrt(mean(x^2) + eps) rounded to the storage's type, times the weight, rounded
 * again (torch's steps in LlamaRMSNorm). A row's mean sums its squares in one fixed order (eight
 * lanes, then one tree), whatever the other rows: batch invariance. Built and loaded by
 * minicore/model/native.py; used by minicore/model/cpu_layers.py. */
#include <math.h>

#include "bf16.h"

INLINE void norm_row(const void *x, const void *weight, void *out, int64_t row, int dim, float eps,
                     int bf16) {
    int64_t base = row * dim;
    v8 acc = {0};
    int d = 0;
    for (; d + 8 <= dim; d += 8) {
        v8 v = elems8(x, base + d, bf16);
        acc += v * v;
    }
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < dim; d++)
        sum += elem(x, base + d, bf16) * elem(x, base + d, bf16);
    float scale = 1.0f / sqrtf(sum / dim + eps);
    for (d = 0; d < dim; d++) {
        float y = rounded(elem(x, base + d, bf16) * scale, bf16);
        put(out, base + d, rounded(elem(weight, d, bf16) * y, bf16), bf16);
    }
}

void rms_norm(const void *x, const void *weight, void *out, int rows, int dim, float eps,
              int threads, int bf16) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int row = 0; row < rows; row++) {
        if (bf16)
            norm_row(x, weight, out, row, dim, eps, 1);
        else
            norm_row(x, weight, out, row, dim, eps, 0);
    }
}
