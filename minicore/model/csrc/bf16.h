/* Reading float32 or bfloat16 storage as float32: a bfloat16 is a float32's upper half, so
 * widening is a shift. Each kernel body takes `bf16` as an argument that is constant at every
 * call (the exported float32 and bfloat16 entry points), so the compiler emits one loop per type,
 * with no branch inside it. */
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#define INLINE static inline __attribute__((always_inline))

INLINE float elem(const void *p, int64_t i, int bf16) {
    if (!bf16)
        return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Eight elements from p + i on. */
INLINE v8 elems8(const void *p, int64_t i, int bf16) {
    if (!bf16)
        return *(const v8 *)((const float *)p + i);
    v8u u = __builtin_convertvector(*(const v8h *)((const uint16_t *)p + i), v8u) << 16;
    return (v8)u;
}

/* Bytes per element. */
INLINE int64_t elem_size(int bf16) {
    return bf16 ? 2 : 4;
}

/* f rounded to the storage's type (bfloat16: to nearest, ties to even, as torch rounds; NaN
 * stays NaN), as a float32. */
INLINE float rounded(float f, int bf16) {
    if (!bf16 || f != f)
        return f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Store f, already rounded(f, bf16), at p[i]. */
INLINE void put(void *p, int64_t i, float f, int bf16) {
    if (!bf16) {
        ((float *)p)[i] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}
