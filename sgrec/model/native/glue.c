/* The element-wise glue of a decoder layer on CPU, fused (sgrec, issue 23): each op reads and writes
 * its rows once, where torch's ops make several passes (RMSNorm: square, mean, add, rsqrt, two
 * multiplies; RoPE: a negated half, a concatenation, two multiplies, an add; SiLU and the gate
 * product). float32 or bfloat16 rows (bf16 = 1: every operand bfloat16), any row stride (elements);
 * rows are split over OpenMP threads, and every row is computed the same way whatever the number of
 * rows (a token's values do not depend on the batch it is in). Arithmetic is float32; in bfloat16
 * each op rounds where torch's bfloat16 ops (and HF's) round: RMSNorm's normalised row before the
 * weight multiplies it, RoPE's two products before their sum, SiLU before the product with up (the
 * rounding points of the Triton glue, sgrec.model.kernels.glue).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vec.h"

#define PAR_ROWS 8 /* fewer rows run on the calling thread alone */

static inline float round_bf16(float x) { return bf16_load(bf16_store(x)); }

/* x[t] += res[t] in place, rounded to bfloat16 where bf16, then the row's sum of squares (float32) */
static inline float add_sumsq(void *x, const void *res, int n, int bf16) {
    int d = 0;
    if (!bf16) {
        float *xr = (float *)x;
        if (res) {
            const float *rr = (const float *)res;
            for (; d + VW <= n; d += VW) vstore(xr + d, vload(xr + d) + vload(rr + d));
            for (; d < n; d++) xr[d] += rr[d];
        }
        return sumsq(xr, n);
    }
    uint16_t *xr = (uint16_t *)x;
    if (res) {
        const uint16_t *rr = (const uint16_t *)res;
        for (; d + VW <= n; d += VW) vstore_bf16(xr + d, vload_bf16(xr + d) + vload_bf16(rr + d));
        for (; d < n; d++) xr[d] = bf16_store(bf16_load(xr[d]) + bf16_load(rr[d]));
    }
    vf acc = vset(0.f);
    for (d = 0; d + VW <= n; d += VW) {
        vf v = vload_bf16(xr + d);
        acc += v * v;
    }
    float ss = 0.f;
    for (int u = 0; u < VW; u++) ss += acc[u];
    for (; d < n; d++) ss += bf16_load(xr[d]) * bf16_load(xr[d]);
    return ss;
}

/* out = w * (x / sqrt(mean(x^2) + eps)); x += res first (in place) where res is given */
static inline void norm_row(float *x, const float *res, const float *w, float *out, int n, float eps) {
    float r = 1.f / sqrtf(add_sumsq(x, res, n, 0) / (float)n + eps);
    vf rv = vset(r);
    int d = 0;
    for (; d + VW <= n; d += VW) vstore(out + d, vload(w + d) * (vload(x + d) * rv));
    for (; d < n; d++) out[d] = w[d] * (x[d] * r);
}

/* norm_row over bfloat16: x += res first (rounded, in place) where res is given */
static inline void norm_row_bf16(uint16_t *x, const uint16_t *res, const uint16_t *w, uint16_t *out, int n,
                                 float eps) {
    float r = 1.f / sqrtf(add_sumsq(x, res, n, 1) / (float)n + eps);
    vf rv = vset(r);
    int d = 0;
    for (; d + VW <= n; d += VW) vstore_bf16(out + d, vload_bf16(w + d) * vround_bf16(vload_bf16(x + d) * rv));
    for (; d < n; d++) out[d] = bf16_store(bf16_load(w[d]) * round_bf16(bf16_load(x[d]) * r));
}

/* RMSNorm: out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)). With res (not NULL): x[t] += res[t] first,
 * in place (the residual stream), then the norm of the sum. */
void sgrec_rmsnorm(void *x, int64_t sx, const void *res, int64_t sr, const void *w, void *out, int64_t so,
                   int64_t T, int n, float eps, int bf16) {
#pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        if (bf16) {
            norm_row_bf16((uint16_t *)x + t * sx, res ? (const uint16_t *)res + t * sr : NULL, w,
                          (uint16_t *)out + t * so, n, eps);
            continue;
        }
        norm_row((float *)x + t * sx, res ? (const float *)res + t * sr : NULL, w, (float *)out + t * so, n, eps);
    }
}

/* RMSNorm with a float32 weight that multiplies before the one rounding: out[t] = (x[t] * r) * w, r =
 * 1 / sqrt(mean(x[t]^2) + eps), in float32, rounded to bfloat16 once where bf16 (Qwen3.5's zero-centred
 * norm, whose weight is 1 + its parameter in float32). res as in sgrec_rmsnorm. */
void sgrec_rmsnorm_f32w(void *x, int64_t sx, const void *res, int64_t sr, const float *w, void *out, int64_t so,
                        int64_t T, int n, float eps, int bf16) {
    size_t es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        char *xr = (char *)x + (size_t)t * sx * es, *o = (char *)out + (size_t)t * so * es;
        float r = 1.f / sqrtf(add_sumsq(xr, res ? (const char *)res + (size_t)t * sr * es : NULL, n, bf16) / (float)n
                              + eps);
        vf rv = vset(r);
        int d = 0;
        if (bf16) {
            for (; d + VW <= n; d += VW) vstore_bf16((uint16_t *)o + d, vload_bf16((uint16_t *)xr + d) * rv * vload(w + d));
            for (; d < n; d++) ((uint16_t *)o)[d] = bf16_store(bf16_load(((uint16_t *)xr)[d]) * r * w[d]);
        } else {
            for (; d + VW <= n; d += VW) vstore((float *)o + d, vload((float *)xr + d) * rv * vload(w + d));
            for (; d < n; d++) ((float *)o)[d] = ((float *)xr)[d] * r * w[d];
        }
    }
}

/* The gated RMSNorm of the Gated DeltaNet's output: for each token t and group h < H of n channels
 * (x at x + t sx + h n, its gate at gate + t sg + h n, out at out + t so + h n):
 *   out = w * (x * r) * silu(gate), r = 1 / sqrt(mean(x^2) + eps), silu(g) = g / (1 + e^-g),
 * in float32; in bfloat16 (w too) the normalised row is rounded, then its product with w, then the
 * gated product, as torch's bfloat16 ops round them. */
void sgrec_gated_rmsnorm(const void *x, int64_t sx, const void *gate, int64_t sg, const void *w, void *out,
                         int64_t so, int64_t T, int H, int n, float eps, int bf16) {
    size_t es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (T * H >= PAR_ROWS)
    for (int64_t th = 0; th < T * H; th++) {
        int64_t t = th / H, h = th % H;
        const char *xr = (const char *)x + ((size_t)t * sx + (size_t)h * n) * es,
                   *gr = (const char *)gate + ((size_t)t * sg + (size_t)h * n) * es;
        char *o = (char *)out + ((size_t)t * so + (size_t)h * n) * es;
        float r = 1.f / sqrtf(add_sumsq((void *)xr, NULL, n, bf16) / (float)n + eps);
        const vf rv = vset(r), one = vset(1.f), cap = vset(126.f), l2e = vset(-LOG2E);
        int d = 0;
        if (bf16) {
            const uint16_t *xb = (const uint16_t *)xr, *gb = (const uint16_t *)gr, *wb = (const uint16_t *)w;
            for (; d + VW <= n; d += VW) {
                vf g = vload_bf16(gb + d), e = l2e * g;
                e = vselect((vi)(e < cap), e, cap);
                vf normed = vround_bf16(vload_bf16(wb + d) * vround_bf16(vload_bf16(xb + d) * rv));
                vstore_bf16((uint16_t *)o + d, normed * (g / (one + vexp2(e))));
            }
            for (; d < n; d++) {
                float g = bf16_load(gb[d]);
                float normed = round_bf16(bf16_load(wb[d]) * round_bf16(bf16_load(xb[d]) * r));
                ((uint16_t *)o)[d] = bf16_store(normed * (g / (1.f + expf(-g))));
            }
            continue;
        }
        const float *xf = (const float *)xr, *gf = (const float *)gr, *wf = (const float *)w;
        for (; d + VW <= n; d += VW) {
            vf g = vload(gf + d), e = l2e * g;
            e = vselect((vi)(e < cap), e, cap);
            vstore((float *)o + d, vload(wf + d) * (vload(xf + d) * rv) * (g / (one + vexp2(e))));
        }
        for (; d < n; d++) ((float *)o)[d] = wf[d] * (xf[d] * r) * (gf[d] / (1.f + expf(-gf[d])));
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

/* rope_row over bfloat16 (cos and sin too): each product rounded, then their sum */
static inline void rope_row_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int D) {
    int h = D / 2, d = 0;
    for (; d + VW <= h; d += VW) {
        vf a = vload_bf16(x + d), b = vload_bf16(x + h + d);
        vstore_bf16(x + d, vround_bf16(a * vload_bf16(c + d)) + vround_bf16(-b * vload_bf16(s + d)));
        vstore_bf16(x + h + d, vround_bf16(b * vload_bf16(c + h + d)) + vround_bf16(a * vload_bf16(s + h + d)));
    }
    for (; d < h; d++) {
        float a = bf16_load(x[d]), b = bf16_load(x[h + d]);
        x[d] = bf16_store(round_bf16(a * bf16_load(c[d])) + round_bf16(-b * bf16_load(s[d])));
        x[h + d] = bf16_store(round_bf16(b * bf16_load(c[h + d])) + round_bf16(a * bf16_load(s[h + d])));
    }
}

void sgrec_rope(void *q, int64_t sq, int Hq, void *k, int64_t sk, int Hk, const void *cos, const void *sin,
                int64_t T, int D, int bf16) {
#pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        if (bf16) {
            const uint16_t *c = (const uint16_t *)cos + t * D, *s = (const uint16_t *)sin + t * D;
            for (int hd = 0; hd < Hq; hd++) rope_row_bf16((uint16_t *)q + t * sq + (int64_t)hd * D, c, s, D);
            for (int hd = 0; hd < Hk; hd++) rope_row_bf16((uint16_t *)k + t * sk + (int64_t)hd * D, c, s, D);
            continue;
        }
        const float *c = (const float *)cos + t * D, *s = (const float *)sin + t * D;
        for (int hd = 0; hd < Hq; hd++) rope_row((float *)q + t * sq + (int64_t)hd * D, c, s, D);
        for (int hd = 0; hd < Hk; hd++) rope_row((float *)k + t * sk + (int64_t)hd * D, c, s, D);
    }
}

/* out[t] = silu(gu[t][:I]) * gu[t][I:], silu(g) = g / (1 + e^-g); gu [T, 2I] (token stride sg),
 * out [T, I] (stride so). */
void sgrec_silu_mul(const void *gu, int64_t sg, void *out, int64_t so, int64_t T, int I, int bf16) {
#pragma omp parallel for schedule(static) if (T >= PAR_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const vf one = vset(1.f), hi = vset(126.f), mlog2e = vset(-LOG2E);
        int d = 0;
        if (bf16) { /* silu rounded, then the product */
            const uint16_t *g = (const uint16_t *)gu + t * sg, *u = g + I;
            uint16_t *o = (uint16_t *)out + t * so;
            for (; d + VW <= I; d += VW) {
                vf gv = vload_bf16(g + d), e = gv * mlog2e;
                e = vselect(e > hi, hi, e);
                vstore_bf16(o + d, vround_bf16(gv / (one + vexp2(e))) * vload_bf16(u + d));
            }
            for (; d < I; d++) {
                float gd = bf16_load(g[d]);
                o[d] = bf16_store(round_bf16(gd / (1.f + expf(-gd))) * bf16_load(u[d]));
            }
            continue;
        }
        const float *g = (const float *)gu + t * sg, *u = g + I;
        float *o = (float *)out + t * so;
        for (; d + VW <= I; d += VW) {
            vf gv = vload(g + d), e = gv * mlog2e;
            e = vselect(e > hi, hi, e); /* 2^126: the quotient is 0 to float precision, as e^-g overflows */
            vstore(o + d, gv / (one + vexp2(e)) * vload(u + d));
        }
        for (; d < I; d++) o[d] = g[d] / (1.f + expf(-g[d])) * u[d];
    }
}
