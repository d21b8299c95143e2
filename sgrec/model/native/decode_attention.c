/* Decode attention on CPU that reads K/V through slot indices: one query token per sequence, its
 * keys and values wherever the KV pool holds them, no gathered copy (sgrec, issue 23 part 2).
 *
 *   q      [B, Hq, D]        one new token per sequence
 *   k, v   [slots, Hkv, D]   one layer of the pool
 *   idx    [sum of lengths]  every sequence's slots, concatenated; sequence b's are
 *   ptr    [B + 1]           idx[ptr[b] .. ptr[b + 1]) (at least one each)
 *   out    [B, Hq, D]
 *
 * One task per (sequence, KV head) handles the G = Hq / Hkv query heads sharing that KV head (GQA),
 * so each K and V row is read once: scores for the G heads, an exact softmax (max, then sum of
 * exponentials), then the weighted sum of V rows. Float32 arithmetic whatever the storage type;
 * bfloat16 rounds to nearest even on the way out. Tasks run under OpenMP (the runtime torch has
 * already loaded, so the threads are torch's own). The vector ISA is chosen at load time by GCC's
 * target_clones from what the CPU reports, never assumed.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef SGREC_NO_CLONES
#define CLONES
#else
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif

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

/* One (sequence, KV head): qf [G, D] already scaled, scores [G, L] and acc [G, D] are scratch. */
#define TASK(NAME, T, LOAD)                                                                          \
    CLONES static void NAME(const float *qf, const T *k, const T *v, const int64_t *slots, int64_t L, \
                            int h, int Hkv, int G, int D, float *scores, float *acc, float *row) {    \
        for (int64_t l = 0; l < L; l++) {                                                            \
            const T *kr = k + (slots[l] * Hkv + h) * (int64_t)D;                                      \
            for (int d = 0; d < D; d++) row[d] = LOAD(kr[d]);                                         \
            for (int g = 0; g < G; g++) {                                                            \
                const float *qg = qf + (int64_t)g * D;                                                \
                float s = 0.f;                                                                       \
                _Pragma("omp simd reduction(+ : s)") for (int d = 0; d < D; d++) s += qg[d] * row[d]; \
                scores[(int64_t)g * L + l] = s;                                                       \
            }                                                                                        \
        }                                                                                            \
        for (int g = 0; g < G; g++) {                                                                \
            float *sg = scores + (int64_t)g * L, m = -INFINITY, sum = 0.f;                            \
            for (int64_t l = 0; l < L; l++) m = sg[l] > m ? sg[l] : m;                                \
            for (int64_t l = 0; l < L; l++) {                                                        \
                sg[l] = expf(sg[l] - m);                                                              \
                sum += sg[l];                                                                        \
            }                                                                                        \
            float inv = 1.f / sum;                                                                   \
            for (int64_t l = 0; l < L; l++) sg[l] *= inv;                                             \
        }                                                                                            \
        memset(acc, 0, sizeof(float) * (size_t)G * D);                                               \
        for (int64_t l = 0; l < L; l++) {                                                            \
            const T *vr = v + (slots[l] * Hkv + h) * (int64_t)D;                                      \
            for (int d = 0; d < D; d++) row[d] = LOAD(vr[d]);                                         \
            for (int g = 0; g < G; g++) {                                                            \
                float p = scores[(int64_t)g * L + l], *ag = acc + (int64_t)g * D;                     \
                _Pragma("omp simd") for (int d = 0; d < D; d++) ag[d] += p * row[d];                  \
            }                                                                                        \
        }                                                                                            \
    }

#define IDENT(x) (x)
TASK(task_f32, float, IDENT)
TASK(task_bf16, uint16_t, bf16_load)

#define ENTRY(NAME, TASKFN, T, LOAD, STORE)                                                          \
    int NAME(const T *q, const T *k, const T *v, const int64_t *idx, const int64_t *ptr, T *out,     \
             int B, int Hq, int Hkv, int D, float scale) {                                           \
        int G = Hq / Hkv, failed = 0;                                                                \
        int64_t Lmax = 0;                                                                            \
        for (int b = 0; b < B; b++) Lmax = ptr[b + 1] - ptr[b] > Lmax ? ptr[b + 1] - ptr[b] : Lmax;  \
        _Pragma("omp parallel reduction(| : failed)") {                                              \
            float *buf = malloc(sizeof(float) * ((size_t)G * Lmax + 2 * (size_t)G * D + D));        \
            if (!buf) failed = 1;                                                                    \
            _Pragma("omp for schedule(dynamic)") for (int t = 0; t < B * Hkv; t++) {                 \
                if (!buf) continue;                                                                  \
                int b = t / Hkv, h = t % Hkv;                                                        \
                float *qf = buf + (size_t)G * Lmax, *acc = qf + (size_t)G * D, *row = acc + (size_t)G * D; \
                const T *qb = q + ((int64_t)b * Hq + (int64_t)h * G) * D;                             \
                for (int i = 0; i < G * D; i++) qf[i] = LOAD(qb[i]) * scale;                          \
                TASKFN(qf, k, v, idx + ptr[b], ptr[b + 1] - ptr[b], h, Hkv, G, D, buf, acc, row);     \
                T *ob = out + ((int64_t)b * Hq + (int64_t)h * G) * D;                                 \
                for (int i = 0; i < G * D; i++) ob[i] = STORE(acc[i]);                                \
            }                                                                                        \
            free(buf);                                                                               \
        }                                                                                            \
        return failed;                                                                               \
    }

ENTRY(sgrec_decode_attention_f32, task_f32, float, IDENT, IDENT)
ENTRY(sgrec_decode_attention_bf16, task_bf16, uint16_t, bf16_load, bf16_store)
