/* The gated delta rule on CPU (the hybrid family's recurrent layers, sgrec.model.delta_rule): its decode
 * step, its chunked form and the pass that prepares its inputs for prefill, the floating-point mode of
 * torch's CPU threads, and the float32 FMA limit the benchmarks measure the kernels against.
 *
 * sgrec_gdr_step: one token of each of B sequences, H heads each, against states kept in place in the
 * state pool (float32 [slots, H, dk, dv], row `slot[b]` for sequence b; a beam fork reads its parent's
 * row `src[b]` and writes its own). Per head the state S is read
 * twice and written once, where torch's form of the step makes a pass over it per operation:
 *
 *     sk = S^T k,  sq = S^T q                          (one pass over S's rows)
 *     u  = beta (v - e^g sk)
 *     o  = e^g sq + (k . q) u                          (= (e^g S + k u^T)^T q)
 *     S  = e^g S + k u^T                               (a second pass, in place)
 *
 * Every (sequence, head) is computed the same way whatever B is, so a sequence's step does not depend
 * on the batch it is in. All float32.
 *
 * sgrec_gdr_chunked: one sequence of L tokens (prefill), every head, in chunks of C tokens (C <= 64), the
 * state carried from chunk to chunk (sgrec.model.delta_rule.chunked's algebra; its docstring derives it).
 * Per head and chunk, with gamma_i the cumulative log-decay from the chunk's start state S:
 *
 *     KS = K S, QS = Q S                                          (two [n, dk] x [dk, dv] products)
 *     A[i, m] = beta_i e^(gamma_i - gamma_m) (k_i . k_m)   (m < i),   P[i, m] = e^(gamma_i - gamma_m) (q_i . k_m)   (m <= i)
 *     U[i] = beta_i (v_i - e^gamma_i KS[i]) - sum_{m<i} A[i, m] U[m]          (the unit lower-triangular solve)
 *     O[i] = e^gamma_i QS[i] + sum_{m<=i} P[i, m] U[m]
 *     S    = e^gamma_last S + K^T (U scaled by e^(gamma_last - gamma_i) row by row)
 *
 * torch's form (delta_rule.chunked) solves for the state-free parts of all chunks first and multiplies
 * by the state after; here the state enters the right-hand side directly, which saves the [n, dk] x [dk, dv]
 * product of W = (I + A)^-1 diag(beta e^gamma) K with S. A partial last chunk needs no padding. The
 * products are register-tiled (4 rows x 4 vectors of accumulators); the heads run in parallel, each the
 * same way whatever the others are, so a head's result never depends on the thread count.
 *
 * sgrec_gdr_prefill: a sequence's prefill of the layer from the input projection's rows (token-major
 * [L, C], bf16 or float32, rows `x_stride` apart): the causal short convolution, SiLU and per-head L2
 * normalisation (q, k and v of the rule), then the chunked rule, a head's chunk at a time, its q, k, v
 * made in scratch right before the chunk's step reads them (they never go through memory). The
 * convolution is vectorised over channels, its window sliding in registers along the tokens; in bf16
 * its sum and its SiLU are rounded to bf16 as torch's bf16 conv1d and silu round them; the norms and
 * the rule are float32.
 *
 * sgrec_flush_denormals: flush-to-zero and denormals-are-zero (or neither) on the calling thread and
 * its OpenMP team (torch's intra-op threads: the kernels bind to the OpenMP runtime torch loaded). The
 * delta rule's decays e^(cumulative g) underflow into denormal floats, which x86 multiplies tens of times
 * slower; torch.set_flush_denormal sets the calling thread only. The runner sets it around a forward and
 * restores it after, so nothing else in the process sees the mode.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif
#include <omp.h>

#include "vec.h"

static int set_mode(int on) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned int csr = _mm_getcsr();
    csr = on ? (csr | 0x8040u) : (csr & ~0x8040u); /* FTZ (bit 15) and DAZ (bit 6) */
    _mm_setcsr(csr);
    return 1;
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    fpcr = on ? (fpcr | (1ull << 24)) : (fpcr & ~(1ull << 24)); /* FZ */
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
    return 1;
#else
    (void)on;
    return 0;
#endif
}

static int get_mode(void) {
#if defined(__x86_64__) || defined(__i386__)
    return (_mm_getcsr() & 0x8040u) == 0x8040u;
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    return (int)((fpcr >> 24) & 1u);
#else
    return 0;
#endif
}

/* Sets the mode (on: flush) on the calling thread and its OpenMP team; returns the calling thread's
 * mode before (1: it flushed), or -1 where this architecture has no such mode. */
int sgrec_flush_denormals(int on) {
    int before = get_mode(), n = 0;
    set_mode(on);
#pragma omp parallel reduction(+ : n)
    n += set_mode(on);
    return n ? before : -1;
}

static inline void zero(float *x, int n) {
    int j = 0;
    for (; j + VW <= n; j += VW) vstore(x + j, vset(0.f));
    for (; j < n; j++) x[j] = 0.f;
}

/* S_in -> S_out (the same pointer: in place) */
static void head_step(const float *S_in, float *S_out, const float *q, const float *k, const float *v, float g,
                      float beta, float *o, int dk, int dv) {
    float sk[dv], sq[dv], u[dv];
    zero(sk, dv);
    zero(sq, dv);
    for (int i = 0; i < dk; i++) {
        const float *row = S_in + (size_t)i * dv;
        vf ki = vset(k[i]), qi = vset(q[i]);
        int j = 0;
        for (; j + VW <= dv; j += VW) {
            vf r = vload(row + j);
            vstore(sk + j, vload(sk + j) + r * ki);
            vstore(sq + j, vload(sq + j) + r * qi);
        }
        for (; j < dv; j++) {
            sk[j] += row[j] * k[i];
            sq[j] += row[j] * q[i];
        }
    }
    float eg = expf(g), kq = 0.f;
    for (int i = 0; i < dk; i++) kq += k[i] * q[i];
    for (int j = 0; j < dv; j++) {
        u[j] = beta * (v[j] - eg * sk[j]);
        o[j] = eg * sq[j] + kq * u[j];
    }
    vf egv = vset(eg);
    for (int i = 0; i < dk; i++) {
        const float *row = S_in + (size_t)i * dv;
        float *dst = S_out + (size_t)i * dv;
        vf ki = vset(k[i]);
        int j = 0;
        for (; j + VW <= dv; j += VW) vstore(dst + j, egv * vload(row + j) + ki * vload(u + j));
        for (; j < dv; j++) dst[j] = eg * row[j] + k[i] * u[j];
    }
}

/* q, k [B, H, dk], v and o [B, H, dv], g and beta [B, H] (contiguous float32); states: the pool's
 * [slots, H, dk, dv]; slot[b]: sequence b's row (distinct), src[b]: the row its state is read from
 * (slot[b] itself, or a beam fork's parent's row). The forks (src != slot) run first, all of them, so
 * they read their parents' states before any sequence updates its own in place; a fork's own row is
 * no sequence's src. */
void sgrec_gdr_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                    float *states, const int64_t *slot, const int64_t *src, float *o, int B, int H, int dk, int dv) {
    int forks = 0;
    for (int b = 0; b < B; b++) forks |= src[b] != slot[b];
    for (int phase = forks ? 0 : 1; phase < 2; phase++) { /* no forks (decode): one pass */
#pragma omp parallel for schedule(static) if (B * H >= 4)
        for (int bh = 0; bh < B * H; bh++) {
            int b = bh / H, h = bh % H;
            if ((src[b] != slot[b]) != (phase == 0)) continue;
            size_t head = (size_t)h * dk * dv, per = (size_t)H * dk * dv;
            head_step(states + (size_t)src[b] * per + head, states + (size_t)slot[b] * per + head, q + (size_t)bh * dk,
                      k + (size_t)bh * dk, v + (size_t)bh * dv, g[bh], beta[bh], o + (size_t)bh * dv, dk, dv);
        }
    }
}

/* C[r][j] = c_scale * C[r][j] + sum_p A(r, p) B[p][j] for R rows and V vectors of columns, A(r, p) at
 * A[r * a_r + p * a_p]: one register tile (R, V compile-time constants after inlining). */
static inline __attribute__((always_inline)) void tile(const float *A, long a_r, long a_p, const float *B, long ldb,
                                                       float *C, long ldc, int K, float c_scale, int R, int V) {
    vf acc[4][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = vset(0.f);
    for (int p = 0; p < K; p++) {
        vf b[4];
        for (int v = 0; v < V; v++) b[v] = vload(B + (long)p * ldb + v * VW);
        for (int r = 0; r < R; r++) {
            vf a = vset(A[r * a_r + p * a_p]);
            for (int v = 0; v < V; v++) acc[r][v] += a * b[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) {
            float *c = C + (long)r * ldc + v * VW;
            vstore(c, c_scale == 0.f ? acc[r][v] : vset(c_scale) * vload(c) + acc[r][v]);
        }
}

/* C [M, N] = c_scale * C + A B, A(r, p) at A[r * a_r + p * a_p] ([M, K]), B [K, N] row-major (ldb),
 * C row-major (ldc). c_scale 0: C is overwritten (never read). */
static void matmul(const float *A, long a_r, long a_p, const float *B, long ldb, float *C, long ldc, int M, int N, int K,
                   float c_scale) {
    int nv = N / VW, r = 0;
    for (; r + 4 <= M; r += 4) {
        int v = 0;
        for (; v + 4 <= nv; v += 4) tile(A + r * a_r, a_r, a_p, B + v * VW, ldb, C + r * ldc + v * VW, ldc, K, c_scale, 4, 4);
        for (; v < nv; v++) tile(A + r * a_r, a_r, a_p, B + v * VW, ldb, C + r * ldc + v * VW, ldc, K, c_scale, 4, 1);
    }
    for (; r < M; r++) {
        int v = 0;
        for (; v + 4 <= nv; v += 4) tile(A + r * a_r, a_r, a_p, B + v * VW, ldb, C + r * ldc + v * VW, ldc, K, c_scale, 1, 4);
        for (; v < nv; v++) tile(A + r * a_r, a_r, a_p, B + v * VW, ldb, C + r * ldc + v * VW, ldc, K, c_scale, 1, 1);
    }
    for (int j = nv * VW; j < N; j++) /* columns past the last whole vector */
        for (int i = 0; i < M; i++) {
            float acc = 0.f;
            for (int p = 0; p < K; p++) acc += A[i * a_r + p * a_p] * B[(long)p * ldb + j];
            C[(long)i * ldc + j] = c_scale == 0.f ? acc : c_scale * C[(long)i * ldc + j] + acc;
        }
}

/* C1 = A1 B and C2 = A2 B for 2 rows of A1 and A2 (rows lda apart, K = lda columns) and 4 vectors of B's
 * columns: each vector of B is loaded once for both products (K S and Q S share S). */
static inline void tile_pair(const float *A1, const float *A2, long lda, const float *B, long ldb, float *C1, float *C2,
                             long ldc, int K) {
    vf acc1[2][4], acc2[2][4];
    for (int r = 0; r < 2; r++)
        for (int v = 0; v < 4; v++) acc1[r][v] = acc2[r][v] = vset(0.f);
    for (int p = 0; p < K; p++) {
        vf b[4];
        for (int v = 0; v < 4; v++) b[v] = vload(B + (long)p * ldb + v * VW);
        for (int r = 0; r < 2; r++) {
            vf a1 = vset(A1[r * lda + p]), a2 = vset(A2[r * lda + p]);
            for (int v = 0; v < 4; v++) {
                acc1[r][v] += a1 * b[v];
                acc2[r][v] += a2 * b[v];
            }
        }
    }
    for (int r = 0; r < 2; r++)
        for (int v = 0; v < 4; v++) {
            vstore(C1 + r * ldc + v * VW, acc1[r][v]);
            vstore(C2 + r * ldc + v * VW, acc2[r][v]);
        }
}

/* C1 = A1 B and C2 = A2 B, A1 and A2 [M, K] (rows K apart), B [K, N] (ldb), C1 and C2 row-major (ldc):
 * tile_pair where 2 rows and 4 vectors fit, matmul on the rest; every sum in matmul's order. */
static void matmul_pair(const float *A1, const float *A2, const float *B, long ldb, float *C1, float *C2, long ldc,
                        int M, int N, int K) {
    int m2 = M / 2 * 2, n4 = N / (4 * VW) * 4 * VW;
    for (int r = 0; r < m2; r += 2)
        for (int j = 0; j < n4; j += 4 * VW)
            tile_pair(A1 + (long)r * K, A2 + (long)r * K, K, B + j, ldb, C1 + r * ldc + j, C2 + r * ldc + j, ldc, K);
    for (int i = 0; i < 2; i++) {
        const float *A = i ? A2 : A1;
        float *C = i ? C2 : C1;
        if (m2 < M) /* the last row */
            matmul(A + (long)m2 * K, K, 1, B, ldb, C + m2 * ldc, ldc, M - m2, n4, K, 0.f);
        if (n4 < N) /* the columns past the last 4 vectors */
            matmul(A, K, 1, B + n4, ldb, C + n4, ldc, M, N - n4, K, 0.f);
    }
}

#define GDR_CHUNK_MAX 64

/* C1 = A1 B and C2 = A2 B for R <= 4 rows of A1, A2 ([R, lda]: K = lda) and V <= 4 vectors of B's columns
 * (B [lda, ...] row-major, ldb; C1, C2 rows ldb apart): tile's register blocks, R and V constants in each
 * call (so they unroll). */
static void tri_tiles(const float *A1, const float *A2, long lda, const float *B, long ldb, float *C1, float *C2,
                      int R, int V) {
#define TRI_TILES(r, v)                                              \
    do {                                                             \
        tile(A1, lda, 1, B, ldb, C1, ldb, (int)lda, 0.f, r, v); \
        tile(A2, lda, 1, B, ldb, C2, ldb, (int)lda, 0.f, r, v); \
    } while (0)
    if (R == 4) {
        switch (V) {
        case 1: TRI_TILES(4, 1); return;
        case 2: TRI_TILES(4, 2); return;
        case 3: TRI_TILES(4, 3); return;
        default: TRI_TILES(4, 4); return;
        }
    }
    for (int r = 0; r < R; r++, A1 += lda, A2 += lda, C1 += ldb, C2 += ldb) switch (V) {
        case 1: TRI_TILES(1, 1); break;
        case 2: TRI_TILES(1, 2); break;
        case 3: TRI_TILES(1, 3); break;
        default: TRI_TILES(1, 4); break;
        }
#undef TRI_TILES
}

/* o[at .. at + VW) = x, o float32 or bf16 (rounded to nearest even) */
static inline void out_store(void *o, int bf16, size_t at, vf x) {
    if (bf16)
        vstore_bf16((uint16_t *)o + at, x);
    else
        vstore((float *)o + at, x);
}

static inline void out_store1(void *o, int bf16, size_t at, float x) {
    if (bf16)
        ((uint16_t *)o)[at] = bf16_store(x);
    else
        ((float *)o)[at] = x;
}

/* Row i of U (in ks, over KS there) and of O, columns j .. j + V VW: U[i] = beta_i (v_i - e^gamma_i KS[i]) -
 * sum_{m<i} A[i, m] U[m], O[i] = e^gamma_i QS[i] + sum_{m<=i} P[i, m] U[m]. The 2 V accumulators are
 * independent chains over m (V = 4: enough to keep the FMA units busy). */
static inline __attribute__((always_inline)) void solve_row(float *ks, const float *qs, const float *v, const float *a,
                                                            const float *pm, const float *beta, const float *eg,
                                                            void *o, long o_tok, int o_bf16, int i, int j, int dv,
                                                            int cm, int V) {
    vf r[4], out[4];
    float *u = ks + (long)i * dv + j;
    const float *ai = a + i * cm, *pi = pm + i * cm;
    for (int x = 0; x < V; x++) {
        r[x] = vset(beta[i]) * (vload(v + (long)i * dv + j + x * VW) - vset(eg[i]) * vload(u + x * VW));
        out[x] = vset(eg[i]) * vload(qs + (long)i * dv + j + x * VW);
    }
    for (int m = 0; m < i; m++) {
        vf am = vset(ai[m]), pmv = vset(pi[m]);
        const float *um = ks + (long)m * dv + j;
        for (int x = 0; x < V; x++) {
            vf t = vload(um + x * VW);
            r[x] -= am * t;
            out[x] += pmv * t;
        }
    }
    for (int x = 0; x < V; x++) {
        vstore(u + x * VW, r[x]);
        out_store(o, o_bf16, (size_t)i * o_tok + j + x * VW, out[x] + vset(pi[i]) * r[x]);
    }
}

/* One head's chunk of n tokens: q, k [n, dk], v [n, dv] (rows of the head's sequence), o: token i's dv
 * outputs at o + i * o_tok elements (float32, or bf16 where o_bf16); S [dk, dv] in place. Scratch: ks,
 * qs [n, dv], kt [dk, CM] (CM: n rounded up to vectors), a, pm [n, CM]. */
static void chunk_step(const float *q, const float *k, const float *v, const float *g, const float *beta, void *o,
                       long o_tok, int o_bf16, float *S, int n, int dk, int dv, float *ks, float *qs, float *kt,
                       float *a, float *pm) {
    int cm = (n + VW - 1) / VW * VW;
    float gamma[GDR_CHUNK_MAX] = {0}, eg[GDR_CHUNK_MAX]; /* gamma past n: read, never used */
    float acc = 0.f;
    for (int i = 0; i < n; i++) {
        acc += g[i];
        gamma[i] = acc;
        eg[i] = expf(acc);
    }
    for (int p = 0; p < dk; p++) { /* K^T, zero past n */
        for (int i = 0; i < n; i++) kt[p * cm + i] = k[(long)i * dk + p];
        for (int i = n; i < cm; i++) kt[p * cm + i] = 0.f;
    }
    matmul_pair(k, q, S, dv, ks, qs, dv, n, dv, dk); /* KS, QS */
    for (int i = 0; i < n; i += 4) { /* the k.k and q.k products of rows i.., vectors of m up to their last */
        int rows = n - i < 4 ? n - i : 4, nb = (i + rows - 1) / VW + 1;
        for (int b = 0; b < nb; b += 4) /* lanes past a row's own index: never read */
            tri_tiles(k + (long)i * dk, q + (long)i * dk, dk, kt + b * VW, cm, a + i * cm + b * VW, pm + i * cm + b * VW,
                      rows, nb - b < 4 ? nb - b : 4);
    }
    for (int i = 0; i < n; i++) { /* A and P: the products scaled by the decays (and beta) */
        vf gi = vset(gamma[i]), bi = vset(beta[i]);
        for (int b = 0; b <= i / VW; b++) {
            vf decay = vexp2((gi - vload(gamma + b * VW)) * LOG2E);
            vstore(a + i * cm + b * VW, bi * decay * vload(a + i * cm + b * VW));
            vstore(pm + i * cm + b * VW, decay * vload(pm + i * cm + b * VW));
        }
    }
    for (int i = 0; i < n; i++) { /* U (in ks) row by row, and O: 4 vectors of columns at a time */
        int j = 0;
        for (; j + 4 * VW <= dv; j += 4 * VW) solve_row(ks, qs, v, a, pm, beta, eg, o, o_tok, o_bf16, i, j, dv, cm, 4);
        for (; j + VW <= dv; j += VW) solve_row(ks, qs, v, a, pm, beta, eg, o, o_tok, o_bf16, i, j, dv, cm, 1);
        float *u = ks + (long)i * dv;
        const float *vi = v + (long)i * dv, *qsi = qs + (long)i * dv, *ai = a + i * cm, *pi = pm + i * cm;
        for (; j < dv; j++) {
            float r = beta[i] * (vi[j] - eg[i] * u[j]), out = eg[i] * qsi[j];
            for (int m = 0; m < i; m++) {
                float um = ks[(long)m * dv + j];
                r -= ai[m] * um;
                out += pi[m] * um;
            }
            u[j] = r;
            out_store1(o, o_bf16, (size_t)i * o_tok + j, out + pi[i] * r);
        }
    }
    float last = gamma[n - 1];
    for (int i = 0; i < n; i++) { /* U's rows scaled by e^(gamma_last - gamma_i), into qs */
        float s = expf(last - gamma[i]);
        for (int j = 0; j < dv; j++) qs[(long)i * dv + j] = s * ks[(long)i * dv + j];
    }
    matmul(k, 1, dk, qs, dv, S, dv, dk, dv, n, expf(last)); /* S = e^last S + K^T (scaled U) */
}

/* q, k [H, L, dk], v [H, L, dv], g and beta [H, L] (contiguous float32), state [H, dk, dv] in place (the
 * state after the last token on return); o: head h's token t's dv outputs at o + t * o_tok + h * o_head
 * elements, float32 or bf16 (o_bf16). chunk: tokens a chunk, 1..64. Returns 0, or -1 where scratch could
 * not be allocated or chunk is out of range (nothing written). */
int sgrec_gdr_chunked(const float *q, const float *k, const float *v, const float *g, const float *beta, float *state,
                      void *o, long o_tok, long o_head, int o_bf16, int H, int L, int dk, int dv, int chunk) {
    if (chunk < 1 || chunk > GDR_CHUNK_MAX) return -1;
    int cm = (chunk + VW - 1) / VW * VW, threads = omp_get_max_threads();
    size_t need = (size_t)2 * chunk * dv + (size_t)dk * cm + (size_t)2 * chunk * cm;
    float *scratch = malloc(need * threads * sizeof(float));
    if (!scratch) return -1;
#pragma omp parallel for schedule(static)
    for (int h = 0; h < H; h++) {
        float *ks = scratch + need * omp_get_thread_num(), *qs = ks + (size_t)chunk * dv, *kt = qs + (size_t)chunk * dv,
              *a = kt + (size_t)dk * cm, *pm = a + (size_t)chunk * cm;
        for (int t = 0; t < L; t += chunk) {
            int n = L - t < chunk ? L - t : chunk;
            long row = (long)h * L + t;
            size_t at = (size_t)t * o_tok + (size_t)h * o_head;
            void *oh = o_bf16 ? (void *)((uint16_t *)o + at) : (void *)((float *)o + at);
            chunk_step(q + row * dk, k + row * dk, v + row * dv, g + row, beta + row, oh, o_tok, o_bf16,
                       state + (size_t)h * dk * dv, n, dk, dv, ks, qs, kt, a, pm);
        }
    }
    free(scratch);
    return 0;
}

/* input row src's channels c .. c + VW (src < 0: the window's) as float32 */
static inline vf conv_in(const void *x, long x_stride, int x_bf16, const float *past, int K, int C, int src, int c) {
    if (src < 0) return vload(past + (size_t)(K - 1 + src) * C + c);
    if (x_bf16) return vload_bf16((const uint16_t *)x + (size_t)src * x_stride + c);
    return vload((const float *)x + (size_t)src * x_stride + c);
}

/* y[i * ldy .. + VW) for tokens t0 + i, i < n: channels c .. c + VW convolved (taps oldest first, one FMA
 * chain) and through SiLU, rounded to bf16 after each where x_bf16 (as torch's bf16 conv1d and silu
 * round). K a constant where inlined: the window slides in registers, so each input row is read and
 * widened once. */
static inline __attribute__((always_inline)) void conv_silu(const void *x, long x_stride, int x_bf16,
                                                            const float *past, const float *w, int C, int K, int t0,
                                                            int n, int c, float *y, long ldy) {
    vf taps[8], win[8];
    const vf one = vset(1.f), cap = vset(126.f), l2e = vset(-LOG2E);
    for (int j = 0; j < K; j++) taps[j] = vload(w + (size_t)j * C + c);
    for (int j = 0; j < K - 1; j++) win[j] = conv_in(x, x_stride, x_bf16, past, K, C, t0 - (K - 1) + j, c);
    for (int i = 0; i < n; i++) {
        win[K - 1] = conv_in(x, x_stride, x_bf16, past, K, C, t0 + i, c);
        vf acc = vset(0.f);
        for (int j = 0; j < K; j++) acc += taps[j] * win[j];
        for (int j = 0; j < K - 1; j++) win[j] = win[j + 1];
        if (x_bf16) acc = vround_bf16(acc);
        vf e = l2e * acc;
        e = vselect((vi)(e < cap), e, cap);
        acc = acc / (one + vexp2(e));
        if (x_bf16) acc = vround_bf16(acc);
        vstore(y + (size_t)i * ldy, acc);
    }
}

/* conv_silu of channels c0 .. c0 + m (any m: the last channels one at a time) into y [n, m] (row stride
 * ldy) */
static void conv_rows(const void *x, long x_stride, int x_bf16, const float *past, const float *w, int C, int K, int t0,
                      int n, int c0, int m, float *y, long ldy) {
    int c = 0;
    for (; c + VW <= m; c += VW) {
        if (K == 4)
            conv_silu(x, x_stride, x_bf16, past, w, C, 4, t0, n, c0 + c, y + c, ldy);
        else
            conv_silu(x, x_stride, x_bf16, past, w, C, K, t0, n, c0 + c, y + c, ldy);
    }
    for (; c < m; c++)
        for (int i = 0; i < n; i++) {
            float acc = 0.f;
            for (int j = 0; j < K; j++) {
                int src = t0 + i - (K - 1) + j; /* the input this tap reads */
                float in = src < 0 ? past[(size_t)(K - 1 + src) * C + c0 + c]
                           : x_bf16 ? bf16_load(((const uint16_t *)x)[(size_t)src * x_stride + c0 + c])
                                    : ((const float *)x)[(size_t)src * x_stride + c0 + c];
                acc += w[(size_t)j * C + c0 + c] * in;
            }
            if (x_bf16) acc = bf16_load(bf16_store(acc));
            acc = acc / (1.f + expf(-acc));
            if (x_bf16) acc = bf16_load(bf16_store(acc));
            y[(size_t)i * ldy + c] = acc;
        }
}

/* row [d] times scale / |row| (the L2 norm with delta_rule.l2norm's eps), in place */
static inline void l2_scale(float *row, int d, float scale) {
    float r = scale / sqrtf(sumsq(row, d) + 1e-6f);
    vf rv = vset(r);
    int j = 0;
    for (; j + VW <= d; j += VW) vstore(row + j, vload(row + j) * rv);
    for (; j < d; j++) row[j] *= r;
}

/* A sequence's prefill through a Gated DeltaNet layer's convolution and rule, head by head, chunk by
 * chunk: each head's q, k and v of a chunk are made (conv_rows, then the L2 norms of q and k, q times
 * q_scale) in scratch the chunk's step reads next, so they never go through memory.
 * x: rows t = 0..L-1 of the projection (first C channels: q, k, v), row t at x + t * x_stride elements,
 * bf16 (x_bf16) or float32; past [K - 1, C] float32: the inputs before row 0 (the state's window,
 * oldest first); w [K, C] float32: the depthwise taps, tap K - 1 on the newest input. Channels: q for
 * Hk heads of dk, then k, then v for Hv heads of dv (C = 2 Hk dk + Hv dv; value head h reads key head
 * h / (Hv / Hk)). g, beta [Hv, L]; state [Hv, dk, dv] in place; o as sgrec_gdr_chunked's. Returns 0, or
 * -1 where scratch could not be allocated or chunk or K is out of range (nothing written). */
int sgrec_gdr_prefill(const void *x, long x_stride, int x_bf16, const float *past, const float *w, int K, int C, int Hk,
                      int Hv, int dk, int dv, float q_scale, const float *g, const float *beta, float *state, void *o,
                      long o_tok, long o_head, int o_bf16, int L, int chunk) {
    if (chunk < 1 || chunk > GDR_CHUNK_MAX || K < 1 || K > 8) return -1;
    int cm = (chunk + VW - 1) / VW * VW, threads = omp_get_max_threads(), groups = Hv / Hk;
    size_t step = (size_t)2 * chunk * dv + (size_t)dk * cm + (size_t)2 * chunk * cm,
           need = step + (size_t)chunk * (2 * dk + dv);
    float *scratch = malloc(need * threads * sizeof(float));
    if (!scratch) return -1;
#pragma omp parallel for schedule(static)
    for (int h = 0; h < Hv; h++) {
        float *ks = scratch + need * omp_get_thread_num(), *qs = ks + (size_t)chunk * dv, *kt = qs + (size_t)chunk * dv,
              *a = kt + (size_t)dk * cm, *pm = a + (size_t)chunk * cm, *qh = ks + step, *kh = qh + (size_t)chunk * dk,
              *vh = kh + (size_t)chunk * dk;
        int kv = h / groups; /* its key head */
        for (int t = 0; t < L; t += chunk) {
            int n = L - t < chunk ? L - t : chunk;
            conv_rows(x, x_stride, x_bf16, past, w, C, K, t, n, kv * dk, dk, qh, dk);
            conv_rows(x, x_stride, x_bf16, past, w, C, K, t, n, Hk * dk + kv * dk, dk, kh, dk);
            conv_rows(x, x_stride, x_bf16, past, w, C, K, t, n, 2 * Hk * dk + h * dv, dv, vh, dv);
            for (int i = 0; i < n; i++) {
                l2_scale(qh + (size_t)i * dk, dk, q_scale);
                l2_scale(kh + (size_t)i * dk, dk, 1.f);
            }
            size_t at = (size_t)t * o_tok + (size_t)h * o_head;
            void *oh = o_bf16 ? (void *)((uint16_t *)o + at) : (void *)((float *)o + at);
            chunk_step(qh, kh, vh, g + (long)h * L + t, beta + (long)h * L + t, oh, o_tok, o_bf16,
                       state + (size_t)h * dk * dv, n, dk, dv, ks, qs, kt, a, pm);
        }
    }
    free(scratch);
    return 0;
}

/* The machine's float32 vector FMA limit, for the benchmarks' efficiency figures: every thread of the
 * team runs `iters` rounds of 16 independent vector FMAs (enough chains to cover the FMA units' latency)
 * on registers. Returns the floating-point operations done (2 per lane per FMA); the caller times it. */
double sgrec_fma_peak(long iters) {
    double flops = 0.;
#pragma omp parallel reduction(+ : flops)
    {
        vf acc[16], a = vset(0.999999f), b = vset(1e-7f);
        for (int i = 0; i < 16; i++) acc[i] = vset((float)i);
        for (long n = 0; n < iters; n++)
            for (int i = 0; i < 16; i++) acc[i] = acc[i] * a + b;
        float sink = 0.f;
        for (int i = 0; i < 16; i++) sink += acc[i][0];
        flops += 2.0 * 16 * VW * (double)iters + (sink == 12345.f); /* the sum keeps the loop */
    }
    return flops;
}
