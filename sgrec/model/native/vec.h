/* Vector helpers shared by sgrec's CPU kernels (attention.c, glue.c, decode.c, delta.c): GCC vector types
 * of the width of the ISA the file is built for (-march chosen by the loader from the CPU's report), 2^x,
 * a row's sum of squares, bfloat16. */
#ifndef SGREC_VEC_H
#define SGREC_VEC_H
#include <stdint.h>

#if defined(__AVX512F__)
#define VW 16 /* floats per vector value: one zmm */
#elif defined(__AVX__)
#define VW 8 /* one ymm */
#else
#define VW 4 /* SSE, NEON */
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

#define LOG2E 1.4426950408889634f

static inline vf vload(const float *p) { return *(const vfu *)p; }
static inline void vstore(float *p, vf x) { *(vfu *)p = x; }
static inline vf vset(float s) {
    vf r = {0};
    return r + s;
}
static inline vf vselect(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); } /* m ? a : b */

/* 2^x, for x <= 126 (exactly 0 below -126, so a masked -inf score weighs nothing); relative error
 * about 1e-7 (a degree-7 polynomial on [-0.5, 0.5]). */
static inline vf vexp2(vf x) {
    const vf lo = vset(-126.f), magic = vset(12582912.f); /* 1.5 * 2^23: round to integer */
    vi under = x < lo;
    vf xc = vselect(under, lo, x);
    vf t = xc + magic;
    vf n = t - magic;
    vf f = xc - n; /* in [-0.5, 0.5] */
    vf p = vset(1.525273380405984e-05f);
    p = p * f + 1.5403530393381608e-04f;
    p = p * f + 1.3333558146428443e-03f;
    p = p * f + 9.618129107628477e-03f;
    p = p * f + 5.550410866482158e-02f;
    p = p * f + 2.402265069591007e-01f;
    p = p * f + 6.931471805599453e-01f;
    p = p * f + 1.0f;
    vi e = ((vi)t - 0x4b400000) << 23;
    return (vf)(((vi)p + e) & ~under);
}

/* sum of x[0 .. n) squared, vector lanes then lanes in order */
static inline float sumsq(const float *x, int n) {
    vf acc = vset(0.f);
    int d = 0;
    for (; d + VW <= n; d += VW) {
        vf v = vload(x + d);
        acc += v * v;
    }
    float s = 0.f;
    for (int u = 0; u < VW; u++) s += acc[u];
    for (; d < n; d++) s += x[d] * x[d];
    return s;
}

typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint16_t vhu __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

/* VW bfloat16 values widened to float32 (exact) */
static inline vf vload_bf16(const uint16_t *p) { return (vf)(__builtin_convertvector(*(const vhu *)p, vu) << 16); }

/* x rounded to bfloat16 (to nearest even; a NaN stays a NaN), as float32 */
static inline vf vround_bf16(vf x) {
    vu u = (vu)x;
    vu r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    return (vf)((r & ~nan) | ((u | 0x400000u) & 0xffff0000u & nan));
}

/* VW float32 values rounded to bfloat16 (as vround_bf16) into p */
static inline void vstore_bf16(uint16_t *p, vf x) { *(vhu *)p = __builtin_convertvector((vu)vround_bf16(x) >> 16, vh); }

static inline float bf16_load(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t bf16_store(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}
#endif
