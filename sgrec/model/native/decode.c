/* A whole decode step on CPU in one call (sgrec, issue 39), in bfloat16 or float32: every decoder
 * layer of a batch of B new tokens (one per sequence), then the final norm and the output layer, where
 * the Python path makes about a dozen torch and kernel calls per layer. At batch 1 a decode step reads
 * every weight once and little else, so its time is the time the weights take to come from memory: the
 * matrix-vector products here stream them and prefetch the next rows ahead of the hardware's own
 * prefetcher (measured on a 2-core Zen 4: bf16 40 GB/s against 23 GB/s without; torch's own float32
 * M=1 linear streams 12 GB/s there; BENCHMARKS.md).
 *
 * bfloat16: built only where the CPU has avx512_bf16 (the loader's -mavx512bf16); the products run on
 * the CPU's bf16 dot products (vdpbf16ps), accumulate in float32 and are rounded to bf16 once, with
 * their bias added first (as oneDNN's bf16 linear does). float32: built where the ISA is AVX2 + FMA or
 * AVX-512 (x86-64-v3 / v4); fused multiply-adds on vec.h's vectors. sgrec_fused_decode() says which
 * (bit 0: float32, bit 1: bfloat16). Weights are plain row-major [N, K] (nn.Linear's layout) in the
 * step's dtype. The glue (RMSNorm, RoPE, SiLU-times-up) and attention are glue.c's and attention.c's
 * own entry points, so they round where torch's ops round. The summation order of a product is not
 * oneDNN's: like any other implementation, a step is not torch's bit for bit (tests/test_fused_decode.py
 * bounds the difference). A row's values do not depend on the other rows of the batch: each output is
 * one row of weights against one row of activations, in the same order at any B.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512BF16__)
#define SGREC_DECODE_BF16 1
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define SGREC_DECODE_F32 1
#endif
#if defined(SGREC_DECODE_BF16) || defined(SGREC_DECODE_F32)
#include <immintrin.h>
#include <omp.h>
#define SGREC_FUSED_DECODE 1
#endif

void sgrec_rmsnorm(void *x, int64_t sx, const void *res, int64_t sr, const void *w, void *out, int64_t so,
                   int64_t T, int n, float eps, int bf16);
void sgrec_rope(void *q, int64_t sq, int Hq, void *k, int64_t sk, int Hk, const void *cos, const void *sin,
                int64_t T, int D, int bf16);
void sgrec_silu_mul(const void *gu, int64_t sg, void *out, int64_t so, int64_t T, int I, int bf16);
int sgrec_decode_attention(const void *q, const void *kb, const void *vb, const int64_t *idx, const int64_t *ptr,
                           void *out, int B, int Hq, int Hkv, int D, float scale, int bf16);

/* which dtypes this build's step runs: bit 0 float32, bit 1 bfloat16 */
int sgrec_fused_decode(void) {
    int dtypes = 0;
#ifdef SGREC_DECODE_F32
    dtypes |= 1;
#endif
#ifdef SGREC_DECODE_BF16
    dtypes |= 2;
#endif
    return dtypes;
}

#ifdef SGREC_FUSED_DECODE
#define ROWS 4 /* weight rows per block: one x chunk feeds four dot products */
#define XB 4 /* activation rows per pass over a block at most: ROWS x XB float32 sums in registers */

#ifdef SGREC_DECODE_BF16
/* s[j][i] = sum_k w[i][k] x[j * sx + k] for j < nb (a constant where it is inlined: the loops unroll) */
static inline __attribute__((always_inline)) void block_dots(const uint16_t *const *w, const uint16_t *x, int64_t sx,
                                                             int nb, int Kv, __mmask32 tail, float s[XB][ROWS]) {
    __m512 a[XB][ROWS];
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < ROWS; i++) a[j][i] = _mm512_setzero_ps();
    for (int k = 0; k < Kv; k += 32) {
        __m512bh wv[ROWS];
        for (int i = 0; i < ROWS; i++) wv[i] = (__m512bh)_mm512_loadu_si512(w[i] + k);
        for (int j = 0; j < nb; j++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + j * sx + k);
            for (int i = 0; i < ROWS; i++) a[j][i] = _mm512_dpbf16_ps(a[j][i], wv[i], xv);
        }
    }
    if (tail) {
        __m512bh wv[ROWS];
        for (int i = 0; i < ROWS; i++) wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w[i] + Kv);
        for (int j = 0; j < nb; j++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + j * sx + Kv);
            for (int i = 0; i < ROWS; i++) a[j][i] = _mm512_dpbf16_ps(a[j][i], wv[i], xv);
        }
    }
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < ROWS; i++) s[j][i] = _mm512_reduce_add_ps(a[j][i]);
}

static inline __attribute__((always_inline)) void dots_bf16(const void *const *w, const void *x, int64_t sx, int nb, int K, float s[XB][ROWS]) {
    const int Kv = K / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (K - Kv)) - 1);
    const uint16_t *const *wh = (const uint16_t *const *)w;
    switch (nb) { /* constant counts: every sum stays in a register */
    case 1: block_dots(wh, x, sx, 1, Kv, tail, s); break;
    case 2: block_dots(wh, x, sx, 2, Kv, tail, s); break;
    case 3: block_dots(wh, x, sx, 3, Kv, tail, s); break;
    default: block_dots(wh, x, sx, 4, Kv, tail, s); break;
    }
}
#endif

#ifdef SGREC_DECODE_F32
/* float32: as block_dots, on vec.h's vectors (fused multiply-adds at this ISA's width) and a scalar
 * tail; with 16 registers (AVX2) at most two activation rows per pass keep the sums in registers */
#define XB_F32 (VW == 16 ? 4 : 2)

static inline float hsum(vf v) { /* a shuffle tree: a serial loop over the lanes was the products' bottleneck */
#if VW == 16
    return _mm512_reduce_add_ps((__m512)v);
#else
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#endif
}
static inline __attribute__((always_inline)) void block_dots_f32(const float *const *w, const float *x, int64_t sx,
                                                                 int nb, int K, float s[XB][ROWS]) {
    const int Kv = K / VW * VW;
    vf a[XB][ROWS];
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < ROWS; i++) a[j][i] = vset(0.f);
    for (int k = 0; k < Kv; k += VW) {
        vf wv[ROWS];
        for (int i = 0; i < ROWS; i++) wv[i] = vload(w[i] + k);
        for (int j = 0; j < nb; j++) {
            const vf xv = vload(x + j * sx + k);
            for (int i = 0; i < ROWS; i++) a[j][i] += wv[i] * xv;
        }
    }
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < ROWS; i++) {
            float t = hsum(a[j][i]);
            for (int k = Kv; k < K; k++) t += w[i][k] * x[j * sx + k];
            s[j][i] = t;
        }
}

static inline __attribute__((always_inline)) void dots_f32(const void *const *w, const void *x, int64_t sx, int nb, int K, float s[XB][ROWS]) {
    const float *const *wf = (const float *const *)w;
    switch (nb) {
    case 1: block_dots_f32(wf, x, sx, 1, K, s); break;
#if XB_F32 == 4
    case 2: block_dots_f32(wf, x, sx, 2, K, s); break;
    case 3: block_dots_f32(wf, x, sx, 3, K, s); break;
    default: block_dots_f32(wf, x, sx, 4, K, s); break;
#else
    default: block_dots_f32(wf, x, sx, 2, K, s); break;
#endif
    }
}
#endif

/* y[b, r] (b < B, r in [r0, r1)) = bias[r] + sum_k W[r, k] x[b, k], rounded once to the dtype (bf16:
 * 2-byte elements, else float32): each block of ROWS weight rows is read from memory once and kept in
 * cache while a few activation rows at a time pass over it */
static inline __attribute__((always_inline)) void gemv_rows(const void *W, const void *bias, const void *x, int64_t sx,
                                                            void *y, int64_t sy, int r0, int r1, int K, int B,
                                                            int bf16) {
    const int es = bf16 ? 2 : 4, xb = bf16 ? XB : XB_F32;
    float s[XB][ROWS];
    for (int n0 = r0; n0 < r1; n0 += ROWS) {
        const int rows = r1 - n0 < ROWS ? r1 - n0 : ROWS;
        const char *w[ROWS]; /* a last block of fewer rows reads its first row again */
        w[0] = (const char *)W + (size_t)n0 * K * es;
        for (int i = 1; i < ROWS; i++) w[i] = i < rows ? w[i - 1] + (size_t)K * es : w[0];
        /* the next block, fetched now (spelled this way, GCC 12's code streams 38 GB/s on a 2-core Zen 4;
         * with an int64 counter, or the pointers chosen per row in a loop, it ran at 21: no prefetch's speed) */
        const char *next = w[0] + ROWS * K * es;
        for (int c = 0; c < ROWS * K * es; c += 64) __builtin_prefetch(next + c, 0, 3);
        for (int b = 0; b < B; b += xb) {
            const int nb = B - b < xb ? B - b : xb;
            const char *xr = (const char *)x + (size_t)b * sx * es;
#ifdef SGREC_DECODE_BF16
            if (bf16) dots_bf16((const void *const *)w, xr, sx, nb, K, s);
#endif
#ifdef SGREC_DECODE_F32
            if (!bf16) dots_f32((const void *const *)w, xr, sx, nb, K, s);
#endif
            for (int j = 0; j < nb; j++)
                for (int i = 0; i < rows; i++) {
                    const size_t at = (size_t)(b + j) * sy + n0 + i;
                    if (bf16)
                        ((uint16_t *)y)[at] = bf16_store(bias ? s[j][i] + bf16_load(((const uint16_t *)bias)[n0 + i])
                                                              : s[j][i]);
                    else
                        ((float *)y)[at] = bias ? s[j][i] + ((const float *)bias)[n0 + i] : s[j][i];
                }
        }
    }
}

/* y [B, N] (row stride sy) = x [B, K] (row stride sx) times W [N, K] transposed, plus bias (or NULL), in
 * the dtype (bf16 or float32; the build must run it: sgrec_fused_decode); the rows of W split over the
 * OpenMP threads in blocks of ROWS */
static void gemv(const void *W, const void *bias, const void *x, int64_t sx, void *y, int64_t sy, int N, int K, int B,
                 int bf16) {
#pragma omp parallel
    {
        int nt = omp_get_num_threads(), th = omp_get_thread_num();
        int blocks = (N + ROWS - 1) / ROWS, per = (blocks + nt - 1) / nt;
        int r0 = th * per * ROWS, r1 = (th + 1) * per * ROWS;
        if (r1 > N) r1 = N;
        if (r0 < r1 && bf16) gemv_rows(W, bias, x, sx, y, sy, r0, r1, K, B, 1); /* a constant dtype: its own code */
        else if (r0 < r1) gemv_rows(W, bias, x, sx, y, sy, r0, r1, K, B, 0);
    }
}

/* the products alone, for tests and benchmarks: 0 done, 2 where this build does not run the dtype */
int sgrec_gemv(const void *W, const void *bias, const void *x, int64_t sx, void *y, int64_t sy, int N, int K, int B,
               int bf16) {
    if (!(sgrec_fused_decode() & (bf16 ? 2 : 1))) return 2;
    gemv(W, bias, x, sx, y, sy, N, K, B, bf16);
    return 0;
}

/* One layer's weights and KV buffers, as the Python side lays them out (sgrec.model.fused_decode). */
enum { W_IN_NORM, W_QKV, B_QKV, W_O, B_O, W_POST_NORM, W_GATE_UP, B_GATE_UP, W_DOWN, B_DOWN, W_Q_NORM, W_K_NORM,
       KV_K, KV_V, LAYER_PTRS };

/* The decode step: x [B, H] the new tokens' embeddings (overwritten: scratch), cos/sin [B, D] their
 * rotary rows, slots [B] where each token's K/V goes, idx/ptr the slots each sequence attends to (its
 * new one included; attention.c's decode contract); layers [L][LAYER_PTRS] (0: none), final_norm and
 * out_w [V, H] (the output layer); logits [B, V] out; every float array in one dtype (bf16 nonzero:
 * bfloat16, else float32). dims: H, Hq, Hkv, D, I (the MLP's width), V, L. Returns 1 where scratch
 * memory could not be had, 2 where this build does not run the dtype. */
int sgrec_decode_step(void *x, const void *cos, const void *sin, const int64_t *slots, const int64_t *idx,
                      const int64_t *ptr, const int64_t *layers, const void *final_norm, const void *out_w,
                      void *logits, const int *dims, int B, float eps, float scale, int bf16) {
    const int H = dims[0], Hq = dims[1], Hkv = dims[2], D = dims[3], I = dims[4], V = dims[5], L = dims[6];
    const int Nq = Hq * D, Nkv = Hkv * D, Nqkv = Nq + 2 * Nkv, Na = Nq > I ? Nq : I;
    const size_t es = bf16 ? 2 : 4;
    if (!(sgrec_fused_decode() & (bf16 ? 2 : 1))) return 2;
    char *buf = malloc((size_t)B * (2 * H + Nqkv + Nq + Na + 2 * I) * es);
    if (!buf) return 1;
#define AT(p, i) ((char *)(p) + (size_t)(i) * es) /* element i of a float array in the step's dtype */
    char *h = buf, *t = AT(h, B * H), *qkv = AT(t, B * H), *q = AT(qkv, B * Nqkv);
    char *att = AT(q, B * Nq), *gu = AT(att, B * Na), *res = x, *swap;
    for (int l = 0; l < L; l++) {
        const int64_t *p = layers + (size_t)l * LAYER_PTRS;
#define PTR(i) ((void *)(intptr_t)p[i])
        /* the residual stream: res; t, the last layer's MLP output, is added to it by the norm */
        if (l == 0) sgrec_rmsnorm(res, H, NULL, 0, PTR(W_IN_NORM), h, H, B, H, eps, bf16);
        else {
            sgrec_rmsnorm(t, H, res, H, PTR(W_IN_NORM), h, H, B, H, eps, bf16); /* t += res: the stream now */
            swap = res, res = t, t = swap;
        }
        gemv(PTR(W_QKV), PTR(B_QKV), h, H, qkv, Nqkv, Nqkv, H, B, bf16);
        for (int b = 0; p[W_Q_NORM] && b < B; b++) { /* per-head RMSNorm of q and k (Qwen3), in place */
            char *row = AT(qkv, (size_t)b * Nqkv);
            sgrec_rmsnorm(row, D, NULL, 0, PTR(W_Q_NORM), row, D, Hq, D, eps, bf16);
            sgrec_rmsnorm(AT(row, Nq), D, NULL, 0, PTR(W_K_NORM), AT(row, Nq), D, Hkv, D, eps, bf16);
        }
        sgrec_rope(qkv, Nqkv, Hq, AT(qkv, Nq), Nqkv, Hkv, cos, sin, B, D, bf16);
        for (int b = 0; b < B; b++) { /* K/V into the pool at the token's slot; q packed for attention */
            const char *row = AT(qkv, (size_t)b * Nqkv);
            memcpy(AT(PTR(KV_K), slots[b] * Nkv), AT(row, Nq), Nkv * es);
            memcpy(AT(PTR(KV_V), slots[b] * Nkv), AT(row, Nq + Nkv), Nkv * es);
            memcpy(AT(q, (size_t)b * Nq), row, Nq * es);
        }
        if (sgrec_decode_attention(q, PTR(KV_K), PTR(KV_V), idx, ptr, att, B, Hq, Hkv, D, scale, bf16)) {
            free(buf);
            return 1;
        }
        gemv(PTR(W_O), PTR(B_O), att, Nq, t, H, H, Nq, B, bf16);
        sgrec_rmsnorm(t, H, res, H, PTR(W_POST_NORM), h, H, B, H, eps, bf16); /* t += res */
        swap = res, res = t, t = swap;
        gemv(PTR(W_GATE_UP), PTR(B_GATE_UP), h, H, gu, 2 * I, 2 * I, H, B, bf16);
        sgrec_silu_mul(gu, 2 * I, att, I, B, I, bf16);
        gemv(PTR(W_DOWN), PTR(B_DOWN), att, I, t, H, H, I, B, bf16);
#undef PTR
    }
    sgrec_rmsnorm(t, H, res, H, final_norm, h, H, B, H, eps, bf16);
    gemv(out_w, NULL, h, H, logits, V, V, H, B, bf16);
#undef AT
    free(buf);
    return 0;
}
#endif
