/* The gated delta rule's decode step on CPU (the hybrid family's recurrent layers, sgrec.model.delta_rule),
 * and the floating-point mode of torch's CPU threads.
 *
 * sgrec_gdr_step: one token of each of B sequences, H heads each, against states kept in place in the
 * state pool (float32 [slots, H, dk, dv], row `slot[b]` for sequence b). Per head the state S is read
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
 * sgrec_flush_denormals: flush-to-zero and denormals-are-zero (or neither) on the calling thread and
 * its OpenMP team (torch's intra-op threads: the kernels bind to the OpenMP runtime torch loaded). The
 * delta rule's decays e^(cumulative g) underflow into denormal floats, which x86 multiplies tens of times
 * slower; torch.set_flush_denormal sets the calling thread only. The runner sets it around a forward and
 * restores it after, so nothing else in the process sees the mode.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
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

static void head_step(float *S, const float *q, const float *k, const float *v, float g, float beta, float *o,
                      int dk, int dv) {
    float sk[dv], sq[dv], u[dv];
    zero(sk, dv);
    zero(sq, dv);
    for (int i = 0; i < dk; i++) {
        const float *row = S + (size_t)i * dv;
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
        float *row = S + (size_t)i * dv;
        vf ki = vset(k[i]);
        int j = 0;
        for (; j + VW <= dv; j += VW) vstore(row + j, egv * vload(row + j) + ki * vload(u + j));
        for (; j < dv; j++) row[j] = eg * row[j] + k[i] * u[j];
    }
}

/* q, k [B, H, dk], v and o [B, H, dv], g and beta [B, H] (contiguous float32); states: the pool's
 * [slots, H, dk, dv]; slot[b]: sequence b's row (distinct). */
void sgrec_gdr_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                    float *states, const int64_t *slot, float *o, int B, int H, int dk, int dv) {
#pragma omp parallel for schedule(static) if (B * H >= 4)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        float *S = states + ((size_t)slot[b] * H + h) * (size_t)dk * dv;
        head_step(S, q + (size_t)bh * dk, k + (size_t)bh * dk, v + (size_t)bh * dv, g[bh], beta[bh],
                  o + (size_t)bh * dv, dk, dv);
    }
}
