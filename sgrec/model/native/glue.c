/* The element-wise glue of a decoder layer on CPU, fused (sgrec, issue 23): each op reads and writes
 * its rows once, where torch's ops make several passes (RMSNorm: square, mean, add, rsqrt, two
 * multiplies; RoPE: a negated half, a concatenation, two multiplies, an add; SiLU and the gate
 * product). float32 rows, any row stride (elements); rows are split over OpenMP threads, and every
 * row is computed the same way whatever the number of rows (a token's values do not depend on the
 * batch it is in).
 */
#include <math.h>
#include <stdint.h>

#include "vec.h"

#define PAR_ROWS 8 /* fewer rows run on the calling thread alone */

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

static inline void norm_row(const float *x, const float *w, float *out, int n, float eps) {
    float r = 1.f / sqrtf(sumsq(x, n) / (float)n + eps);
    vf rv = vset(r);
    int d = 0;
    for (; d + VW <= n; d += VW) vstore(out + d, vload(w + d) * (vload(x + d) * rv));
    for (; d < n; d++) out[d] = w[d] * (x[d] * r);
}

/* RMSNorm: out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)). With res (not NULL): x[t] += res[t] first,
 * in place (the residual stream), then the norm of the sum. */
void sgrec_rmsnorm(float *x, int64_t sx, const float *res, int64_t sr, const float *w, float *out, int64_t so,
                   int64_t T, int n, float eps) {
#pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float *xr = x + t * sx;
        if (res) {
            const float *rr = res + t * sr;
            int d = 0;
            for (; d + VW <= n; d += VW) vstore(xr + d, vload(xr + d) + vload(rr + d));
            for (; d < n; d++) xr[d] += rr[d];
        }
        norm_row(xr, w, out + t * so, n, eps);
    }
}

/* Rotary embedding in place, HF's rotate-half form: for each head of q [T, Hq, D] and k [T, Hk, D]
 * (token strides sq, sk; heads contiguous), with h = D / 2:
 *   x[:h] <- x[:h] * cos[:h] - x[h:] * sin[:h],   x[h:] <- x[h:] * cos[h:] + x[:h] * sin[h:]
 * cos, sin: [T, D] (token stride D). */
static inline void rope_row(float *x, const float *c, const float *s, int D) {
    int h = D / 2, d = 0;
    for (; d + VW <= h; d += VW) {
        vf a = vload(x + d), b = vload(x + h + d);
        vstore(x + d, a * vload(c + d) - b * vload(s + d));
        vstore(x + h + d, b * vload(c + h + d) + a * vload(s + h + d));
    }
    for (; d < h; d++) {
        float a = x[d], b = x[h + d];
        x[d] = a * c[d] - b * s[d];
        x[h + d] = b * c[h + d] + a * s[h + d];
    }
}

void sgrec_rope(float *q, int64_t sq, int Hq, float *k, int64_t sk, int Hk, const float *cos, const float *sin,
                int64_t T, int D) {
#pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int hd = 0; hd < Hq; hd++) rope_row(q + t * sq + (int64_t)hd * D, c, s, D);
        for (int hd = 0; hd < Hk; hd++) rope_row(k + t * sk + (int64_t)hd * D, c, s, D);
    }
}

/* out[t] = silu(gu[t][:I]) * gu[t][I:], silu(g) = g / (1 + e^-g); gu [T, 2I] (token stride sg),
 * out [T, I] (stride so). */
void sgrec_silu_mul(const float *gu, int64_t sg, float *out, int64_t so, int64_t T, int I) {
#pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * sg, *u = g + I;
        float *o = out + t * so;
        int d = 0;
        const vf one = vset(1.f), hi = vset(126.f), mlog2e = vset(-LOG2E);
        for (; d + VW <= I; d += VW) {
            vf gv = vload(g + d), e = gv * mlog2e;
            e = vselect(e > hi, hi, e); /* 2^126: the quotient is 0 to float precision, as e^-g overflows */
            vstore(o + d, gv / (one + vexp2(e)) * vload(u + d));
        }
        for (; d < I; d++) o[d] = g[d] / (1.f + expf(-g[d])) * u[d];
    }
}
