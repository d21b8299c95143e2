/* A whole bfloat16 decode step on CPU in one call (sgrec, issue 39): every decoder layer of a batch of
 * B new tokens (one per sequence), then the final norm and the output layer, where the Python path
 * makes about a dozen torch and kernel calls per layer. At batch 1 a decode step reads every weight
 * once and little else, so its time is the time the weights take to come from memory: the matrix-
 * vector products here stream them with the CPU's bf16 dot products (vdpbf16ps) and prefetch the next
 * rows ahead of the hardware's own prefetcher (measured on a 2-core Zen 4: 40 GB/s against 23 GB/s
 * without, BENCHMARKS.md).
 *
 * Built only where the CPU has avx512_bf16 (the loader's -mavx512bf16): sgrec_fused_decode() says
 * whether this build has it. Weights are plain row-major bf16 [N, K] (nn.Linear's layout). Every product
 * accumulates in float32 and is rounded to bf16 once, with its bias added first (as oneDNN's bf16 linear
 * does); the glue (RMSNorm, RoPE, SiLU-times-up) and attention are glue.c's and attention.c's own entry
 * points, so they round where torch's bf16 ops round. The summation order of a product is not oneDNN's:
 * like any other bf16 implementation, a step is not torch's bit for bit (tests/test_fused_decode.py
 * bounds the difference). A row's values do not depend on the other rows of the batch: each output is
 * one row of weights against one row of activations, in the same order at any B.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512BF16__)
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

int sgrec_fused_decode(void) {
#ifdef SGREC_FUSED_DECODE
    return 1;
#else
    return 0;
#endif
}

#ifdef SGREC_FUSED_DECODE
#define ROWS 4 /* weight rows per block: one x chunk feeds four dot products */
#define XB 4 /* activation rows per pass over a block: ROWS x XB float32 sums in registers */

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

/* y[b, r] (b < B, r in [r0, r1)) = bf16(bias[r] + sum_k W[r, k] x[b, k]): each block of ROWS weight rows
 * is read from memory once and kept in cache while XB activation rows at a time pass over it */
static void gemv_rows(const uint16_t *W, const uint16_t *bias, const uint16_t *x, int64_t sx, uint16_t *y,
                      int64_t sy, int r0, int r1, int K, int B) {
    const int Kv = K / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (K - Kv)) - 1);
    float s[XB][ROWS];
    for (int n0 = r0; n0 < r1; n0 += ROWS) {
        const int rows = r1 - n0 < ROWS ? r1 - n0 : ROWS;
        const uint16_t *w[ROWS]; /* a last block of fewer rows reads its first row again */
        w[0] = W + (size_t)n0 * K;
        for (int i = 1; i < ROWS; i++) w[i] = i < rows ? w[i - 1] + K : w[0];
        /* the next block, fetched now (spelled this way, GCC 12's code streams 38 GB/s on a 2-core Zen 4;
         * with an int64 counter, or the pointers chosen per row in a loop, it ran at 21: no prefetch's speed) */
        const char *next = (const char *)(w[0] + ROWS * K);
        for (int c = 0; c < ROWS * K * 2; c += 64) _mm_prefetch(next + c, _MM_HINT_T0);
        for (int b = 0; b < B; b += XB) {
            const int nb = B - b < XB ? B - b : XB;
            const uint16_t *xb = x + b * sx;
            switch (nb) { /* constant counts: every sum stays in a register */
            case 1: block_dots(w, xb, sx, 1, Kv, tail, s); break;
            case 2: block_dots(w, xb, sx, 2, Kv, tail, s); break;
            case 3: block_dots(w, xb, sx, 3, Kv, tail, s); break;
            default: block_dots(w, xb, sx, 4, Kv, tail, s); break;
            }
            for (int j = 0; j < nb; j++)
                for (int i = 0; i < rows; i++)
                    y[(b + j) * sy + n0 + i] = bf16_store(bias ? s[j][i] + bf16_load(bias[n0 + i]) : s[j][i]);
        }
    }
}

/* y [B, N] (row stride sy) = x [B, K] (row stride sx) times W [N, K] transposed, plus bias (or NULL);
 * the rows of W split over the OpenMP threads in blocks of ROWS */
void sgrec_gemv_bf16(const void *W, const void *bias, const void *x, int64_t sx, void *y, int64_t sy, int N, int K,
                     int B) {
#pragma omp parallel
    {
        int nt = omp_get_num_threads(), th = omp_get_thread_num();
        int blocks = (N + ROWS - 1) / ROWS, per = (blocks + nt - 1) / nt;
        int r0 = th * per * ROWS, r1 = (th + 1) * per * ROWS;
        if (r1 > N) r1 = N;
        if (r0 < r1) gemv_rows(W, bias, x, sx, y, sy, r0, r1, K, B);
    }
}

/* One layer's weights and KV buffers, as the Python side lays them out (sgrec.model.fused_decode). */
enum { W_IN_NORM, W_QKV, B_QKV, W_O, B_O, W_POST_NORM, W_GATE_UP, B_GATE_UP, W_DOWN, B_DOWN, W_Q_NORM, W_K_NORM,
       KV_K, KV_V, LAYER_PTRS };

/* The decode step: x [B, H] the new tokens' embeddings (overwritten: scratch), cos/sin [B, D] their
 * rotary rows, slots [B] where each token's K/V goes, idx/ptr the slots each sequence attends to (its
 * new one included; attention.c's decode contract); layers [L][LAYER_PTRS] (0: none), final_norm and
 * out_w [V, H] (the output layer); logits [B, V] out (bf16). dims: H, Hq, Hkv, D, I (the MLP's
 * width), V, L. Returns nonzero where scratch memory could not be had. */
int sgrec_decode_step(void *x, const void *cos, const void *sin, const int64_t *slots, const int64_t *idx,
                      const int64_t *ptr, const int64_t *layers, const void *final_norm, const void *out_w,
                      void *logits, const int *dims, int B, float eps, float scale) {
    const int H = dims[0], Hq = dims[1], Hkv = dims[2], D = dims[3], I = dims[4], V = dims[5], L = dims[6];
    const int Nq = Hq * D, Nkv = Hkv * D, Nqkv = Nq + 2 * Nkv, Na = Nq > I ? Nq : I;
    uint16_t *buf = malloc((size_t)B * (2 * H + Nqkv + Nq + Na + 2 * I) * 2);
    if (!buf) return 1;
    uint16_t *h = buf, *t = h + (size_t)B * H, *qkv = t + (size_t)B * H, *q = qkv + (size_t)B * Nqkv;
    uint16_t *att = q + (size_t)B * Nq, *gu = att + (size_t)B * Na, *res = x, *swap;
    for (int l = 0; l < L; l++) {
        const int64_t *p = layers + (size_t)l * LAYER_PTRS;
#define PTR(i) ((void *)(intptr_t)p[i])
        /* the residual stream: res; t, the last layer's MLP output, is added to it by the norm */
        if (l == 0) sgrec_rmsnorm(res, H, NULL, 0, PTR(W_IN_NORM), h, H, B, H, eps, 1);
        else {
            sgrec_rmsnorm(t, H, res, H, PTR(W_IN_NORM), h, H, B, H, eps, 1); /* t += res: the stream now */
            swap = res, res = t, t = swap;
        }
        sgrec_gemv_bf16(PTR(W_QKV), PTR(B_QKV), h, H, qkv, Nqkv, Nqkv, H, B);
        for (int b = 0; p[W_Q_NORM] && b < B; b++) { /* per-head RMSNorm of q and k (Qwen3), in place */
            uint16_t *row = qkv + (size_t)b * Nqkv;
            sgrec_rmsnorm(row, D, NULL, 0, PTR(W_Q_NORM), row, D, Hq, D, eps, 1);
            sgrec_rmsnorm(row + Nq, D, NULL, 0, PTR(W_K_NORM), row + Nq, D, Hkv, D, eps, 1);
        }
        sgrec_rope(qkv, Nqkv, Hq, qkv + Nq, Nqkv, Hkv, cos, sin, B, D, 1);
        for (int b = 0; b < B; b++) { /* K/V into the pool at the token's slot; q packed for attention */
            const uint16_t *row = qkv + (size_t)b * Nqkv;
            memcpy((uint16_t *)PTR(KV_K) + slots[b] * Nkv, row + Nq, (size_t)Nkv * 2);
            memcpy((uint16_t *)PTR(KV_V) + slots[b] * Nkv, row + Nq + Nkv, (size_t)Nkv * 2);
            memcpy(q + (size_t)b * Nq, row, (size_t)Nq * 2);
        }
        if (sgrec_decode_attention(q, PTR(KV_K), PTR(KV_V), idx, ptr, att, B, Hq, Hkv, D, scale, 1)) {
            free(buf);
            return 1;
        }
        sgrec_gemv_bf16(PTR(W_O), PTR(B_O), att, Nq, t, H, H, Nq, B);
        sgrec_rmsnorm(t, H, res, H, PTR(W_POST_NORM), h, H, B, H, eps, 1); /* t += res */
        swap = res, res = t, t = swap;
        sgrec_gemv_bf16(PTR(W_GATE_UP), PTR(B_GATE_UP), h, H, gu, 2 * I, 2 * I, H, B);
        sgrec_silu_mul(gu, 2 * I, att, I, B, I, 1);
        sgrec_gemv_bf16(PTR(W_DOWN), PTR(B_DOWN), att, I, t, H, H, I, B);
#undef PTR
    }
    sgrec_rmsnorm(t, H, res, H, final_norm, h, H, B, H, eps, 1);
    sgrec_gemv_bf16(out_w, NULL, h, H, logits, V, V, H, B);
    free(buf);
    return 0;
}
#endif
