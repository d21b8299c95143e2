/* Attention on CPU for sgrec (issue 23): extend (prefill) attention under causal or bipartite (rank)
 * masks, and decode attention, both reading cached K/V from the KV pool through slot indices.
 *
 * Extend: the contract of the Triton kernel sgrec.model.kernels.bipartite_attention.
 *
 *   q        [T, Hq, D]    the batch's new tokens (token stride s_q elements, heads contiguous)
 *   k, v     [T, Hkv, D]   their K/V as computed (token strides s_k, s_v)
 *   kb, vb   [slots, Hkv, D]   one layer of the KV pool (cached columns are read from it by slot)
 *   q_start, q_len [B]     sequence b's new tokens are rows q_start[b] .. q_start[b] + q_len[b] - 1
 *   q_order, q_block [T]   every new token's order (offset in its layout) and block (-1: none)
 *   c_idx, c_order, c_block   every sequence's cached columns (slot, order, block), concatenated;
 *   c_ptr [B + 1]          sequence b's are c_ptr[b] .. c_ptr[b + 1] - 1
 *   out      [T, Hq, D]
 *
 * A new token (order o, block b) attends to a column (order o', block b') iff o' <= o and not
 * (b >= 0 and b' >= 0 and b != b'). A plain causal sequence is the case every block is -1 and the
 * orders are positions. New tokens come in ascending order, so a row never sees a new column after
 * its tile's last row.
 *
 * One task per (tile of new tokens of one sequence, KV head) holds the tile's rows for the G = Hq/Hkv
 * query heads of that KV head (GQA), walks the cached columns then the new ones BN at a time, and
 * keeps a running max, sum and output (online softmax). A column tile that no row may see is
 * skipped from its integers alone; one every row sees whole needs no mask. Scores are kept in
 * base 2 (q is scaled by scale * log2 e) and exponentiated by a degree-7 polynomial (relative error
 * about 1e-7); products accumulate in float32 whatever the storage type, and bfloat16 output rounds
 * to nearest even. The two products are register-blocked GEMM micro-kernels over GCC vector types,
 * which the compiler lowers to the vector ISA of the -march this file is built for (AVX-512 zmm,
 * AVX2 ymm, or SSE/NEON), chosen by the loader from the CPU's own report; a bfloat16 extend runs on the
 * CPU's bf16 units where the build has them (vdpbf16ps, or AMX tiles: run_task_dp). Tasks run under
 * OpenMP, on the runtime torch has already loaded.
 *
 * Decode: see sgrec_decode_attention below.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512F__)
#define NR 4 /* query rows per micro-kernel step (register blocking) */
#else
#define NR 2
#endif
#define DV 4 /* output vectors per row in the P V micro-kernel */
#define BN 32 /* KV columns per step */
#define NB (BN / VW) /* vectors of scores per row */
#define ROWS_PER_TASK 192 /* query rows (tokens x G heads) per task, about */

static inline float load1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_load(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* S[Mp][BN] = Qf[Mp][Dp] . Kt[Dp][BN] */
static inline void qk_kernel(const float *Qf, const float *Kt, float *S, int Mp, int Dp) {
    for (int i = 0; i < Mp; i += NR) {
        vf acc[NR][NB];
        for (int r = 0; r < NR; r++)
            for (int u = 0; u < NB; u++) acc[r][u] = vset(0.f);
        for (int d = 0; d < Dp; d++) {
            vf kv[NB];
            for (int u = 0; u < NB; u++) kv[u] = vload(Kt + (int64_t)d * BN + u * VW);
            for (int r = 0; r < NR; r++) {
                vf qb = vset(Qf[(int64_t)(i + r) * Dp + d]);
                for (int u = 0; u < NB; u++) acc[r][u] += qb * kv[u];
            }
        }
        for (int r = 0; r < NR; r++)
            for (int u = 0; u < NB; u++) vstore(S + (int64_t)(i + r) * BN + u * VW, acc[r][u]);
    }
}

/* O[i .. i+NR)[d0 .. d0 + nv*VW) += P[rows][BN] . V[BN][those columns], nv a constant once inlined;
 * with L (the deterministic kernel's first chunk), also L[row] += each p, one column after another */
static inline __attribute__((always_inline)) void pv_chunk(const float *P, const float *V, float *O, int i,
                                                           int d0, int Dp, const int nv, float *L) {
    vf acc[NR][DV];
    float l[NR];
    for (int r = 0; r < NR; r++) {
        for (int u = 0; u < nv; u++) acc[r][u] = vload(O + (int64_t)(i + r) * Dp + d0 + u * VW);
        l[r] = L ? L[i + r] : 0.f;
    }
    for (int j = 0; j < BN; j++) {
        vf vv[DV];
        for (int u = 0; u < nv; u++) vv[u] = vload(V + (int64_t)j * Dp + d0 + u * VW);
        for (int r = 0; r < NR; r++) {
            float pj = P[(int64_t)(i + r) * BN + j];
            vf p = vset(pj);
            for (int u = 0; u < nv; u++) acc[r][u] += p * vv[u];
            if (L) l[r] += pj;
        }
    }
    for (int r = 0; r < NR; r++) {
        for (int u = 0; u < nv; u++) vstore(O + (int64_t)(i + r) * Dp + d0 + u * VW, acc[r][u]);
        if (L) L[i + r] = l[r];
    }
}

static inline void pv_kernel(const float *P, const float *V, float *O, int Mp, int Dp) {
    for (int i = 0; i < Mp; i += NR) {
        int d0 = 0;
        for (; d0 + DV * VW <= Dp; d0 += DV * VW) pv_chunk(P, V, O, i, d0, Dp, DV, NULL);
        for (; d0 < Dp; d0 += VW) pv_chunk(P, V, O, i, d0, Dp, 1, NULL);
    }
}

/* pv_kernel, and each row's sum of its weights into L in column order (in the first chunk's loop, where
 * the vector products hide the scalar adds) */
static inline void pv_kernel_sum(const float *P, const float *V, float *O, float *L, int Mp, int Dp) {
    for (int i = 0; i < Mp; i += NR) {
        int d0 = 0;
        if (Dp >= DV * VW) pv_chunk(P, V, O, i, d0, Dp, DV, L), d0 += DV * VW;
        else pv_chunk(P, V, O, i, d0, Dp, 1, L), d0 += VW;
        for (; d0 + DV * VW <= Dp; d0 += DV * VW) pv_chunk(P, V, O, i, d0, Dp, DV, NULL);
        for (; d0 < Dp; d0 += VW) pv_chunk(P, V, O, i, d0, Dp, 1, NULL);
    }
}

typedef struct {
    int64_t b, m0;
    int h;
} task_t;

typedef struct {
    const void *q, *k, *v, *kb, *vb;
    int64_t s_q, s_k, s_v;
    const int64_t *q_start, *q_len, *q_order, *q_block, *c_idx, *c_order, *c_block, *c_ptr;
    void *out;
    int Hq, Hkv, D, G, bm, bf16;
    float scale;
    const int64_t *m_ptr; /* deterministic extend only: per sequence its dense mask's offset in `mask`, or -1 */
    const uint8_t *mask;
} args_t;

typedef struct {
    float *Qf, *S, *Kt, *V, *O, *m, *l;
    int64_t *ro, *rb;
    float *s_all; /* deterministic extend: a task's scores of every tile, kept from pass 1 for pass 2 */
    size_t s_cap; /* floats s_all holds (grown as tasks need, up to det_keep_bytes) */
    uint8_t *seen; /* per tile of s_all: whether pass 1 computed it (some row sees a column of it) */
    uint32_t *P;   /* bfloat16 extend on dot products: P as bfloat16 pairs of keys [BN / 2][Mp] */
    uint32_t *T;   /* and on AMX: V's pairs of keys transposed [Dp][BN / 2] */
    int32_t *r32;  /* and the rows' orders and blocks as int32 [2][Mp] */
} scratch_t;

typedef struct {
    int64_t omin, omax, bmin, bmax; /* the rows' orders, and blocks (of rows in one) */
    int any_free; /* a row in no block (it sees every earlier column) */
} rows_t;

/* The task's rows into w (token-major: row i is token i / G, head h * G + i % G): Qf scaled for base 2
 * and zero-padded to Mp rows (unless the caller lays Q out itself: !with_q), their orders and blocks
 * (padding rows repeat the last token's), each row's max and sum reset, O zeroed; returns the rows'
 * ranges. */
static rows_t load_rows(const args_t *a, const task_t *t, scratch_t *w, int nrows, int M, int Mp, int with_q) {
    const int G = a->G, D = a->D, Dp = (a->D + VW - 1) / VW * VW;
    const float qscale = a->scale * LOG2E;
    rows_t rs = {INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN, 0};
    if (with_q) memset(w->Qf, 0, sizeof(float) * (size_t)Mp * Dp);
    memset(w->O, 0, sizeof(float) * (size_t)Mp * Dp);
    for (int i = 0; i < Mp; i++) {
        int tok = i < M ? i / G : nrows - 1;
        int64_t row = a->q_start[t->b] + t->m0 + tok;
        w->ro[i] = a->q_order[row];
        w->rb[i] = a->q_block[row];
        w->m[i] = -INFINITY;
        w->l[i] = 0.f;
        if (i >= M) continue;
        int64_t base = row * a->s_q + (int64_t)(t->h * G + i % G) * D;
        for (int d = 0; with_q && d < D; d++) w->Qf[(int64_t)i * Dp + d] = load1(a->q, base + d, a->bf16) * qscale;
        int64_t o = w->ro[i], b = w->rb[i];
        rs.omin = o < rs.omin ? o : rs.omin;
        rs.omax = o > rs.omax ? o : rs.omax;
        if (b < 0) rs.any_free = 1;
        else {
            rs.bmin = b < rs.bmin ? b : rs.bmin;
            rs.bmax = b > rs.bmax ? b : rs.bmax;
        }
    }
    return rs;
}

/* The task's M rows of output, O / l, into out (bfloat16 rounded to nearest even) */
static void store_rows(const args_t *a, const task_t *t, const float *O, const float *lrow, int M) {
    const int G = a->G, D = a->D, Dp = (a->D + VW - 1) / VW * VW;
    for (int i = 0; i < M; i++) {
        int64_t row = a->q_start[t->b] + t->m0 + i / G;
        int64_t base = row * (int64_t)a->Hq * D + (int64_t)(t->h * G + i % G) * D;
        float inv = 1.f / lrow[i];
        const float *o = O + (int64_t)i * Dp;
        if (a->bf16)
            for (int d = 0; d < D; d++) ((uint16_t *)a->out)[base + d] = bf16_store(o[d] * inv);
        else
            for (int d = 0; d < D; d++) ((float *)a->out)[base + d] = o[d] * inv;
    }
}

/* Columns n0 .. n0 + nc - 1 of task t's stream (the cached ones from the pool by slot, then the new
 * ones as computed): each one's K and V row (kr, vr), order and block (co, cb). Returns -1 where no row
 * of the task may see any of them (the tile is skipped), 1 where every row sees all of them (no mask
 * needed), else 0. */
static int tile_columns(const args_t *a, const task_t *t, const rows_t *rs, int64_t n0, int nc, int64_t *co,
                        int64_t *cb, const void **kr, const void **vr) {
    const int64_t c_lo = a->c_ptr[t->b], n_cached = a->c_ptr[t->b + 1] - c_lo, qs = a->q_start[t->b];
    const int64_t hstep = (int64_t)a->Hkv * a->D, hoff = (int64_t)t->h * a->D;
    const int es = a->bf16 ? 2 : 4; /* bytes per element */
    int64_t c_omin = INT64_MAX, c_omax = INT64_MIN, c_bmin = INT64_MAX, c_bmax = INT64_MIN;
    int c_free = 0; /* columns in no block */
    for (int j = 0; j < nc; j++) {
        int64_t c = n0 + j, o, bl;
        if (c < n_cached) {
            int64_t off = (a->c_idx[c_lo + c] * hstep + hoff) * es;
            o = a->c_order[c_lo + c], bl = a->c_block[c_lo + c];
            kr[j] = (const char *)a->kb + off, vr[j] = (const char *)a->vb + off;
        } else {
            int64_t row = qs + c - n_cached;
            o = a->q_order[row], bl = a->q_block[row];
            kr[j] = (const char *)a->k + (row * a->s_k + hoff) * es;
            vr[j] = (const char *)a->v + (row * a->s_v + hoff) * es;
        }
        co[j] = o, cb[j] = bl;
        c_omin = o < c_omin ? o : c_omin;
        c_omax = o > c_omax ? o : c_omax;
        if (bl < 0) c_free++;
        else {
            c_bmin = bl < c_bmin ? bl : c_bmin;
            c_bmax = bl > c_bmax ? bl : c_bmax;
        }
    }
    if (c_omin > rs->omax) return -1; /* every column comes after every row */
    if (!rs->any_free && c_free == 0 && (c_bmax < rs->bmin || c_bmin > rs->bmax))
        return -1; /* only candidates' tokens, none of the rows' candidates */
    /* a block row against a column of another block, possible here? else only order masks */
    int conflict = rs->bmin <= rs->bmax && c_free < nc &&
                   !(rs->bmin == rs->bmax && c_bmin == rs->bmin && c_bmax == rs->bmin);
    return nc == BN && c_omax <= rs->omin && !conflict;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && BN == 32
/* ---- bfloat16 extend on the CPU's bf16 dot products (vdpbf16ps; a build with -mavx512bf16) -------
 *
 * The same tasks, column stream (so the same tiles whatever part is cached), masks and online softmax
 * as run_task, computed transposed: a vector holds 16 of the task's rows, so the masks, the running
 * max and sum, and the rescale are element-wise, with no reduction across a vector. vdpbf16ps adds
 * a[2i] b[2i] + a[2i+1] b[2i+1] into float32 lane i:
 *   scores   St[key][rows] = sum over dim pairs of Qp[pair][rows] x (K's pair of that key, broadcast),
 *            Q taken as it came (exact) and the scores scaled afterwards in float32; K read in place;
 *   output   Ot[dim][rows] += sum over key pairs of Pp[pair][rows] x (V's two keys at that dim,
 *            broadcast), P rounded to bfloat16 (as flash attention does on GPUs; each row's sum of
 *            weights is kept in float32), V interleaved by key pairs per tile.
 * Head dims must be even (the caller's check); the kernel reads D, not a padded width. */
#include <immintrin.h>
#define SGREC_DPBF16 1
#define RV 4 /* row vectors (16 rows each) per micro-kernel block */
#define NK 4 /* keys per score block */
#define ND 4 /* output dims per P V block */
#define LAZY 8.f /* base-2 units a row's reference max may lag its running max by */

static inline uint32_t pair_at(const uint16_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    return x;
}

/* St[j0 .. j0+NK)[r0 .. r0 + nv*16) = Qp[.][rows] . K pairs of keys kr[j0 ..] (unscaled) */
static inline __attribute__((always_inline)) void qk_dp_block(const uint32_t *Qp, const uint16_t *const *kr,
                                                              float *St, int Mp, int D2, int j0, int r0,
                                                              const int nv) {
    __m512 acc[NK][RV];
    for (int jj = 0; jj < NK; jj++)
        for (int u = 0; u < nv; u++) acc[jj][u] = _mm512_setzero_ps();
    for (int d = 0; d < D2; d++) {
        __m512bh q[RV];
        for (int u = 0; u < nv; u++) q[u] = (__m512bh)_mm512_loadu_si512(Qp + (int64_t)d * Mp + r0 + u * 16);
        for (int jj = 0; jj < NK; jj++) {
            __m512bh kb = (__m512bh)_mm512_set1_epi32((int)pair_at(kr[j0 + jj] + 2 * d));
            for (int u = 0; u < nv; u++) acc[jj][u] = _mm512_dpbf16_ps(acc[jj][u], q[u], kb);
        }
    }
    for (int jj = 0; jj < NK; jj++)
        for (int u = 0; u < nv; u++) _mm512_storeu_ps(St + (int64_t)(j0 + jj) * Mp + r0 + u * 16, acc[jj][u]);
}

/* Ot[d0 .. d0+nd)[r0 .. r0 + nv*16) += Pp[pairs][rows] . Vp[pairs][those dims] */
static inline __attribute__((always_inline)) void pv_dp_block(const uint32_t *Pp, const uint32_t *Vp, float *Ot,
                                                              int Mp, int D, int npairs, int d0, int r0,
                                                              const int nd, const int nv) {
    __m512 acc[ND][RV];
    for (int dd = 0; dd < nd; dd++)
        for (int u = 0; u < nv; u++) acc[dd][u] = _mm512_loadu_ps(Ot + (int64_t)(d0 + dd) * Mp + r0 + u * 16);
    for (int j = 0; j < npairs; j++) {
        __m512bh p[RV];
        for (int u = 0; u < nv; u++) p[u] = (__m512bh)_mm512_loadu_si512(Pp + (int64_t)j * Mp + r0 + u * 16);
        for (int dd = 0; dd < nd; dd++) {
            __m512bh vb = (__m512bh)_mm512_set1_epi32((int)Vp[(int64_t)j * D + d0 + dd]);
            for (int u = 0; u < nv; u++) acc[dd][u] = _mm512_dpbf16_ps(acc[dd][u], p[u], vb);
        }
    }
    for (int dd = 0; dd < nd; dd++)
        for (int u = 0; u < nv; u++) _mm512_storeu_ps(Ot + (int64_t)(d0 + dd) * Mp + r0 + u * 16, acc[dd][u]);
}

#define BY_NV(call) /* call(nv) with nv the constant 1 .. RV that the row block needs */          \
    do {                                                                                      \
        int nv_ = (Mp - r0) / 16 < RV ? (Mp - r0) / 16 : RV;                                 \
        if (nv_ == 4) call(4); else if (nv_ == 3) call(3); else if (nv_ == 2) call(2); else call(1); \
    } while (0)

static void qk_dp(const uint32_t *Qp, const uint16_t *const *kr, float *St, int Mp, int D2, int nk) {
    for (int r0 = 0; r0 < Mp; r0 += RV * 16)
        for (int j0 = 0; j0 < nk; j0 += NK) {
#define QK(nv) qk_dp_block(Qp, kr, St, Mp, D2, j0, r0, nv)
            BY_NV(QK);
#undef QK
        }
}

static void pv_dp(const uint32_t *Pp, const uint32_t *Vp, float *Ot, int Mp, int D, int npairs) {
    for (int r0 = 0; r0 < Mp; r0 += RV * 16) {
        int d0 = 0;
        for (; d0 + ND <= D; d0 += ND) {
#define PV(nv) pv_dp_block(Pp, Vp, Ot, Mp, D, npairs, d0, r0, ND, nv)
            BY_NV(PV);
#undef PV
        }
        for (; d0 < D; d0++) {
#define PV1(nv) pv_dp_block(Pp, Vp, Ot, Mp, D, npairs, d0, r0, 1, nv)
            BY_NV(PV1);
#undef PV1
        }
    }
}

/* lo and hi rounded to bfloat16 (nearest even) and paired: lane i holds lo[i] in its low half, hi[i] in
 * its high half */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)); /* hi's in the upper half */
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* ---- the same two products on AMX tiles (a build with -mamx-tile -mamx-bf16, where the CPU reports
 * amx_tile and amx_bf16 and the kernel grants this process the tile data: amx_ready) ----------------
 *
 * TDPBF16PS adds C[m][n] += sum over k of A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1] on 16 x 16 float32
 * tiles. Kept in run_task_dp's transposed layout, both products take the task's rows as the tile's
 * columns, so the B operands are the pair layouts run_task_dp already builds:
 *   scores   St[key][rows] = K[key][dims] (A: the tile's K rows copied contiguous, dims zero-padded to
 *            a multiple of 32) x Qp[dim pair][rows] (B);
 *   output   Ot[dim][rows] += Vt[dim][key pairs] (A: V's key pairs transposed) x Pp[key pair][rows] (B).
 * Eight tiles of 16 rows x 64 bytes: 0-3 accumulate a 2 x 2 block of C, 4-5 hold A, 6-7 hold B. */
#define SGREC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused (the dot-product path runs) */

/* Whether this process may use the tile data (Linux asks for it once per process: arch_prctl) */
static int amx_ready(void) {
    if (!amx_state) amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state > 0;
}

static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}

/* St[key 0 .. 32)[rows] = Kc[32][Dk] . Qp[Dk / 2][Mp] (Mp a multiple of 16, Dk of 32) */
static void qk_amx(const uint16_t *Kc, const uint32_t *Qp, float *St, int Mp, int Dk) {
    const int64_t sq = (int64_t)Mp * 4, sk = (int64_t)Dk * 2, k16 = (int64_t)16 * Mp;
    for (int r0 = 0; r0 < Mp; r0 += 32) {
        const int two = r0 + 32 <= Mp; /* two row tiles here, else one */
        _tile_zero(0);
        _tile_zero(2);
        if (two) {
            _tile_zero(1);
            _tile_zero(3);
        }
        for (int k0 = 0; k0 < Dk; k0 += 32) {
            const uint32_t *b = Qp + (int64_t)(k0 / 2) * Mp + r0;
            _tile_loadd(4, Kc + k0, sk);
            _tile_loadd(5, Kc + 16 * (int64_t)Dk + k0, sk);
            _tile_loadd(6, b, sq);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
                _tile_loadd(7, b + 16, sq);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, St + r0, sq);
        _tile_stored(2, St + k16 + r0, sq);
        if (two) {
            _tile_stored(1, St + r0 + 16, sq);
            _tile_stored(3, St + k16 + r0 + 16, sq);
        }
    }
}

/* Ot[Dt][rows] += Vt[Dt][16 key pairs] . Pp[16 key pairs][Mp] (Dt and Mp multiples of 16) */
static void pv_amx(const uint32_t *Vt, const uint32_t *Pp, float *Ot, int Mp, int Dt) {
    const int64_t so = (int64_t)Mp * 4, o16 = (int64_t)16 * Mp;
    for (int r0 = 0; r0 < Mp; r0 += 32) {
        const int two_r = r0 + 32 <= Mp;
        _tile_loadd(6, Pp + r0, so);
        if (two_r) _tile_loadd(7, Pp + r0 + 16, so);
        for (int d0 = 0; d0 < Dt; d0 += 32) { /* loads, products, stores: the four products overlap */
            const int two_d = d0 + 32 <= Dt;
            float *o = Ot + (int64_t)d0 * Mp + r0;
            _tile_loadd(4, Vt + (int64_t)d0 * 16, 64);
            _tile_loadd(0, o, so);
            if (two_r) _tile_loadd(1, o + 16, so);
            if (two_d) {
                _tile_loadd(5, Vt + (int64_t)(d0 + 16) * 16, 64);
                _tile_loadd(2, o + o16, so);
                if (two_r) _tile_loadd(3, o + o16 + 16, so);
            }
            _tile_dpbf16ps(0, 4, 6);
            if (two_r) _tile_dpbf16ps(1, 4, 7);
            if (two_d) {
                _tile_dpbf16ps(2, 5, 6);
                if (two_r) _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, o, so);
            if (two_r) _tile_stored(1, o + 16, so);
            if (two_d) {
                _tile_stored(2, o + o16, so);
                if (two_r) _tile_stored(3, o + o16 + 16, so);
            }
        }
    }
}

/* dst[c][r] = src[r][c] for a 16 x 16 block of 32-bit values (row strides ss, ds) */
static void transpose16(const uint32_t *src, int64_t ss, uint32_t *dst, int64_t ds) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * ss);
    for (int i = 0; i < 16; i += 2) /* pairs of rows interleaved by 32 bits */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) /* then by 64 bits: each 128-bit lane holds a 4 x 4 block, transposed */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]),
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    /* r[4g + c] lane l: rows 4g .. 4g+3 of column 4l + c; gather the four groups' lanes l */
    const __m512i lo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    const __m512i l01 = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0), l23 = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    for (int c = 0; c < 4; c++) {
        __m512i a = _mm512_permutex2var_epi64(r[c], lo, r[4 + c]), b = _mm512_permutex2var_epi64(r[c], hi, r[4 + c]);
        __m512i e = _mm512_permutex2var_epi64(r[8 + c], lo, r[12 + c]);
        __m512i f = _mm512_permutex2var_epi64(r[8 + c], hi, r[12 + c]);
        /* a: lanes (l0 g0, l0 g1, l1 g0, l1 g1); e: the same of groups 2, 3 */
        __m512i x0 = _mm512_permutex2var_epi64(a, l01, e), x1 = _mm512_permutex2var_epi64(a, l23, e);
        __m512i x2 = _mm512_permutex2var_epi64(b, l01, f), x3 = _mm512_permutex2var_epi64(b, l23, f);
        _mm512_storeu_si512(dst + (0 * 4 + c) * ds, x0);
        _mm512_storeu_si512(dst + (1 * 4 + c) * ds, x1);
        _mm512_storeu_si512(dst + (2 * 4 + c) * ds, x2);
        _mm512_storeu_si512(dst + (3 * 4 + c) * ds, x3);
    }
}
#endif

/* One (sequence, tile, KV head) of a bfloat16 extend with an even head dim: the products on AMX tiles
 * where `amx` (amx_ready), else on vdpbf16ps. */
static void run_task_dp(const args_t *a, const task_t *t, scratch_t *w, int amx) {
    const int G = a->G, D = a->D, D2 = a->D / 2, Dk = (a->D + 31) / 32 * 32, Dt = (a->D + 15) / 16 * 16;
    const int64_t qs = a->q_start[t->b], qn = a->q_len[t->b];
    const int nrows = (int)(qn - t->m0 < a->bm ? qn - t->m0 : a->bm);
    const int M = nrows * G, Mp = (M + 15) / 16 * 16;
    float *St = w->S, *Ot = w->O, *mrow = w->m, *lrow = w->l;
    uint32_t *Qp = (uint32_t *)w->Qf, *Vp = (uint32_t *)w->V, *Pp = w->P;
    int32_t *ro = w->r32, *rb = w->r32 + Mp;
    const rows_t rs = load_rows(a, t, w, nrows, M, Mp, 0); /* orders, blocks, m, l; zeroes O (as Ot) */
    for (int i = 0; i < Mp; i++) ro[i] = (int32_t)w->ro[i], rb[i] = (int32_t)w->rb[i];
    /* Q's pairs of dims, transposed, unscaled; zero past D (AMX: up to Dk) */
    memset(Qp, 0, sizeof(uint32_t) * (size_t)Mp * (amx ? Dk / 2 : D2));
    for (int i = 0; i < M; i++) {
        const uint16_t *q = (const uint16_t *)a->q + (qs + t->m0 + i / G) * a->s_q + (int64_t)(t->h * G + i % G) * D;
        for (int d = 0; d < D2; d++) Qp[(int64_t)d * Mp + i] = pair_at(q + 2 * d);
    }
    const __m512 qscale = _mm512_set1_ps(a->scale * LOG2E);
    const __m512 ninf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
    const __m512 lazy = _mm512_set1_ps(LAZY);
    uint16_t *Kc = (uint16_t *)w->Kt; /* AMX: the tile's K rows [BN][Dk], contiguous */
    uint32_t *Vt = w->T;              /* AMX: V's key pairs transposed [Dt][BN / 2] */
#ifdef SGREC_AMX
    if (amx) memset(Kc, 0, sizeof(uint16_t) * BN * (size_t)Dk), amx_configure();
#endif
    const int vstride = amx ? Dt : D; /* Vp's row: AMX pads it to whole 16-column blocks */

    const int64_t total = a->c_ptr[t->b + 1] - a->c_ptr[t->b] + t->m0 + nrows; /* the stream's columns */
    int64_t co[BN], cb[BN];
    const uint16_t *kr[BN], *vr[BN];
    for (int64_t n0 = 0; n0 < total; n0 += BN) {
        int nc = (int)(total - n0 < BN ? total - n0 : BN);
        int full = tile_columns(a, t, &rs, n0, nc, co, cb, (const void **)kr, (const void **)vr);
        if (full < 0) continue;
        /* keys computed: nc rounded up (AMX: all BN), the extra ones masked, their V zero */
        const int nk = amx ? BN : (nc + NK - 1) / NK * NK, npairs = nk / 2;
        for (int j = nc; j < nk; j++) kr[j] = kr[0], vr[j] = NULL;

#ifdef SGREC_AMX
        if (amx) {
            for (int j = 0; j < BN; j++) memcpy(Kc + (int64_t)j * Dk, kr[j], sizeof(uint16_t) * (size_t)D);
            qk_amx(Kc, Qp, St, Mp, Dk);
        } else
#endif
            qk_dp(Qp, kr, St, Mp, D2, nk);
        if (!full) /* -inf where a row may not see the column */
            for (int j = 0; j < nk; j++) {
                float *s = St + (int64_t)j * Mp;
                if (j >= nc) {
                    for (int r = 0; r < Mp; r += 16) _mm512_storeu_ps(s + r, ninf);
                    continue;
                }
                const __m512i coj = _mm512_set1_epi32((int32_t)co[j]), cbj = _mm512_set1_epi32((int32_t)cb[j]);
                for (int r = 0; r < Mp; r += 16) {
                    __m512i ro_v = _mm512_loadu_si512(ro + r), rb_v = _mm512_loadu_si512(rb + r);
                    __mmask16 ok = _mm512_cmpge_epi32_mask(ro_v, coj);
                    if (cb[j] >= 0)
                        ok &= _mm512_cmplt_epi32_mask(rb_v, _mm512_setzero_si512()) | _mm512_cmpeq_epi32_mask(rb_v, cbj);
                    _mm512_storeu_ps(s + r, _mm512_mask_blend_ps(ok, ninf, _mm512_loadu_ps(s + r)));
                }
            }
        /* online softmax, 16 rows at a time, on the scores scaled for base 2 (scale * log2 e > 0, so the
         * max of the scaled scores is the scaled max): P = 2^(S - m) against a reference max m, what came
         * before rescaled by 2^(m_old - m) when m moves. m moves only where the tile's max exceeds it by
         * more than LAZY (a weight is then at most 2^LAZY: exact to the same relative precision in
         * float32 and bfloat16), so most tiles skip the rescale. */
        for (int r = 0; r < Mp; r += 16) {
            __m512 mold = _mm512_loadu_ps(mrow + r), mx4[4] = {ninf, ninf, ninf, ninf}; /* 4 chains of maxes */
            for (int j = 0; j < nk; j++)
                mx4[j % 4] = _mm512_max_ps(mx4[j % 4], _mm512_loadu_ps(St + (int64_t)j * Mp + r));
            __m512 mx = _mm512_max_ps(_mm512_max_ps(mx4[0], mx4[1]), _mm512_max_ps(mx4[2], mx4[3]));
            mx = _mm512_mul_ps(mx, qscale);
            mx = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, _mm512_add_ps(mold, lazy), _CMP_GT_OQ), mold, mx);
            __mmask16 none = _mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ); /* rows that have seen nothing yet */
            __m512 mu = _mm512_mask_blend_ps(none, mx, zero);             /* 2^(-inf - 0) = 0 for them */
            __m512 alpha = (__m512)vexp2((vf)_mm512_sub_ps(mold, mu)), sum0 = zero, sum1 = zero;
            for (int j = 0; j + 1 < nk; j += 2) {
                const float *s0 = St + (int64_t)j * Mp + r, *s1 = s0 + Mp;
                __m512 p0 = (__m512)vexp2((vf)_mm512_fmsub_ps(_mm512_loadu_ps(s0), qscale, mu));
                __m512 p1 = (__m512)vexp2((vf)_mm512_fmsub_ps(_mm512_loadu_ps(s1), qscale, mu));
                sum0 = _mm512_add_ps(sum0, p0), sum1 = _mm512_add_ps(sum1, p1);
                _mm512_storeu_si512(Pp + (int64_t)(j / 2) * Mp + r, bf16_pairs(p0, p1));
            }
            __m512 sum = _mm512_add_ps(sum0, sum1);
            _mm512_storeu_ps(lrow + r, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(lrow + r), alpha), sum));
            _mm512_storeu_ps(mrow + r, mx);
            if (_mm512_cmp_ps_mask(alpha, one, _CMP_NEQ_UQ))
                for (int d = 0; d < D; d++) {
                    float *o = Ot + (int64_t)d * Mp + r;
                    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha));
                }
        }
        /* V by key pairs: Vp[pair][d] = (v[2 pair][d], v[2 pair + 1][d]); missing keys zero */
        for (int j = 0; j < nk; j += 2) {
            const uint16_t *v0 = vr[j], *v1 = vr[j + 1];
            uint32_t *dst = Vp + (int64_t)(j / 2) * vstride;
            int d = 0;
            for (; d + 16 <= D; d += 16) {
                __m512i lo = v0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + d))) : _mm512_setzero_si512();
                __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + d))) : _mm512_setzero_si512();
                _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
            for (; d < D; d++) dst[d] = (v0 ? (uint32_t)v0[d] : 0u) | (v1 ? (uint32_t)v1[d] << 16 : 0u);
            for (; d < vstride; d++) dst[d] = 0u;
        }
#ifdef SGREC_AMX
        if (amx) {
            for (int d0 = 0; d0 < Dt; d0 += 16) transpose16(Vp + d0, Dt, Vt + (int64_t)d0 * 16, 16);
            pv_amx(Vt, Pp, Ot, Mp, Dt);
        } else
#endif
            pv_dp(Pp, Vp, Ot, Mp, D, npairs);
    }
#ifdef SGREC_AMX
    if (amx) _tile_release();
#endif
    /* the task's M rows of output, Ot / l, into out (bfloat16 rounded to nearest even) */
    for (int i = 0; i < M; i++) {
        int64_t base = (qs + t->m0 + i / G) * (int64_t)a->Hq * D + (int64_t)(t->h * G + i % G) * D;
        float inv = 1.f / lrow[i];
        for (int d = 0; d < D; d++) ((uint16_t *)a->out)[base + d] = bf16_store(Ot[(int64_t)d * Mp + i] * inv);
    }
}

static void run_task_dot(const args_t *a, const task_t *t, scratch_t *w) { run_task_dp(a, t, w, 0); }
#ifdef SGREC_AMX
static void run_task_amx(const args_t *a, const task_t *t, scratch_t *w) { run_task_dp(a, t, w, 1); }
#endif
#endif

/* One (sequence, tile, KV head). */
static void run_task(const args_t *a, const task_t *t, scratch_t *w) {
    const int G = a->G, D = a->D, Dp = (a->D + VW - 1) / VW * VW, bf = a->bf16;
    const int64_t qn = a->q_len[t->b];
    const int nrows = (int)(qn - t->m0 < a->bm ? qn - t->m0 : a->bm);
    const int M = nrows * G, Mp = (M + NR - 1) / NR * NR;
    float *Qf = w->Qf, *S = w->S, *Kt = w->Kt, *V = w->V, *O = w->O, *mrow = w->m, *lrow = w->l;
    int64_t *ro = w->ro, *rb = w->rb;
    const rows_t rs = load_rows(a, t, w, nrows, M, Mp, 1);

    /* The columns as one stream: the cached ones (from the pool by slot), then the new ones (as
     * computed) up to the tile's last row; tiles cut the stream the same way whatever part of it is
     * cached, so a radix hit sums in the same order as the cold forward. */
    const int64_t total = a->c_ptr[t->b + 1] - a->c_ptr[t->b] + t->m0 + nrows;
    int64_t co[BN], cb[BN];
    const void *kr[BN], *vr[BN];
    for (int64_t n0 = 0; n0 < total; n0 += BN) {
        int nc = (int)(total - n0 < BN ? total - n0 : BN);
        int full = tile_columns(a, t, &rs, n0, nc, co, cb, kr, vr);
        if (full < 0) continue;

        /* K^T [Dp][BN] and V [BN][Dp], zero-padded */
        memset(Kt, 0, sizeof(float) * (size_t)Dp * BN);
        memset(V, 0, sizeof(float) * (size_t)BN * Dp);
        for (int j = 0; j < nc; j++) {
            if (!bf) {
                const float *k = kr[j];
                for (int d = 0; d < D; d++) Kt[(int64_t)d * BN + j] = k[d];
                memcpy(V + (int64_t)j * Dp, vr[j], sizeof(float) * (size_t)D);
            } else {
                const uint16_t *k = kr[j], *v = vr[j];
                for (int d = 0; d < D; d++) {
                    Kt[(int64_t)d * BN + j] = bf16_load(k[d]);
                    V[(int64_t)j * Dp + d] = bf16_load(v[d]);
                }
            }
        }
        qk_kernel(Qf, Kt, S, Mp, Dp);
        if (!full) {
            for (int i = 0; i < Mp; i++) {
                float *s = S + (int64_t)i * BN;
                for (int j = 0; j < BN; j++) {
                    int ok = j < nc;
                    if (ok) ok = co[j] <= ro[i] && (rb[i] < 0 || cb[j] < 0 || cb[j] == rb[i]);
                    if (!ok) s[j] = -INFINITY;
                }
            }
        }
        /* online softmax: P = 2^(S - m), rescale what came before */
        for (int i = 0; i < Mp; i++) {
            float *s = S + (int64_t)i * BN, mx = mrow[i];
            for (int j = 0; j < BN; j++) mx = s[j] > mx ? s[j] : mx;
            if (mx == -INFINITY) { /* this row has seen nothing yet: nothing to add */
                memset(s, 0, sizeof(float) * BN);
                continue;
            }
            vf mv = vset(mx), ps = vset(0.f);
            for (int u = 0; u < NB; u++) {
                vf p = vexp2(vload(s + u * VW) - mv);
                vstore(s + u * VW, p);
                ps += p;
            }
            float sum = 0.f;
            for (int u = 0; u < VW; u++) sum += ps[u];
            if (mx != mrow[i]) {
                float alpha = mrow[i] == -INFINITY ? 0.f : exp2f(mrow[i] - mx);
                lrow[i] *= alpha;
                float *o = O + (int64_t)i * Dp;
                vf av = vset(alpha);
                for (int d = 0; d < Dp; d += VW) vstore(o + d, vload(o + d) * av);
                mrow[i] = mx;
            }
            lrow[i] += sum;
        }
        pv_kernel(S, V, O, Mp, Dp);
    }
    store_rows(a, t, O, lrow, M);
}

/* ---- deterministic extend (--enable-deterministic-inference) ------------------------------------
 *
 * The same contract, except: every column of sequence b is listed in c_idx[c_ptr[b] .. c_ptr[b + 1])
 * (new ones too), in the order their terms are summed (a layout's order): a pool slot (>= 0) or a new
 * token (-1 - its row in q/k/v); and a sequence with m_ptr[b] >= 0 is masked by mask[m_ptr[b] +
 * r * C + c] (row r of its new tokens, column c of its C listed columns; orders and blocks unread).
 * An exact softmax in two passes: the row's max over its visible columns, then 2^(s - max) added to
 * the row's sum and weighted into its output one column after another, in the listed order. A masked
 * column adds exact zeros (2^-inf is 0) and a skipped tile only masked ones, so a row's output depends
 * on its visible columns and their order alone: not on the tiling, the other rows of its tile, the
 * masked columns between its visible ones, which columns were cached, or what else is in the batch. */

/* a task whose scores fit in this many bytes keeps them for pass 2, else it computes them again */
static size_t det_keep_bytes = (size_t)32 << 20;
void sgrec_set_det_keep_bytes(int64_t n) { det_keep_bytes = (size_t)n; } /* tests: 0 recomputes */

/* Columns n0 .. n0 + nc - 1 of the task's stream into Kt and V (each when given), zero-padded; their
 * orders and blocks into co/cb. Returns 0 when no row of the tile can see any of them. */
static int det_columns(const args_t *a, const task_t *t, int64_t n0, int nc, float *Kt, float *V, int64_t *co,
                       int64_t *cb, int64_t r_omax, int64_t r_bmin, int64_t r_bmax, int r_any_free, int dense) {
    const int D = a->D, Dp = (a->D + VW - 1) / VW * VW, bf = a->bf16;
    const int64_t c_lo = a->c_ptr[t->b], hstep = (int64_t)a->Hkv * D;
    int64_t c_omin = INT64_MAX, c_bmin = INT64_MAX, c_bmax = INT64_MIN;
    int c_free = 0;
    for (int j = 0; j < nc; j++) {
        co[j] = a->c_order[c_lo + n0 + j], cb[j] = a->c_block[c_lo + n0 + j];
        c_omin = co[j] < c_omin ? co[j] : c_omin;
        if (cb[j] < 0) c_free++;
        else {
            c_bmin = cb[j] < c_bmin ? cb[j] : c_bmin;
            c_bmax = cb[j] > c_bmax ? cb[j] : c_bmax;
        }
    }
    if (!dense && (c_omin > r_omax || (!r_any_free && c_free == 0 && (c_bmax < r_bmin || c_bmin > r_bmax))))
        return 0;
    if (nc < BN || D < Dp) { /* zero padding only where a column or a dimension is missing */
        if (Kt) memset(Kt, 0, sizeof(float) * (size_t)Dp * BN);
        if (V) memset(V, 0, sizeof(float) * (size_t)BN * Dp);
    }
    for (int j = 0; j < nc; j++) {
        int64_t src = a->c_idx[c_lo + n0 + j], koff, voff;
        const void *kbase, *vbase;
        if (src >= 0) kbase = a->kb, vbase = a->vb, koff = voff = src * hstep + (int64_t)t->h * D;
        else {
            int64_t row = -1 - src;
            kbase = a->k, vbase = a->v;
            koff = row * a->s_k + (int64_t)t->h * D, voff = row * a->s_v + (int64_t)t->h * D;
        }
        if (Kt)
            for (int d = 0; d < D; d++) Kt[(int64_t)d * BN + j] = load1(kbase, koff + d, bf);
        if (V && !bf)
            memcpy(V + (int64_t)j * Dp, (const float *)vbase + voff, sizeof(float) * (size_t)D);
        else if (V)
            for (int d = 0; d < D; d++) V[(int64_t)j * Dp + d] = bf16_load(((const uint16_t *)vbase)[voff + d]);
    }
    return 1;
}

/* Scores of the tile's rows against the loaded columns, -inf where a row may not see a column. */
static void det_scores(const args_t *a, const task_t *t, const float *Qf, const float *Kt, float *S, int M, int Mp,
                       int nc, int64_t n0, const int64_t *co, const int64_t *cb, const int64_t *ro,
                       const int64_t *rb, int dense, int64_t ncols) {
    const int Dp = (a->D + VW - 1) / VW * VW, G = a->G;
    qk_kernel(Qf, Kt, S, Mp, Dp);
    const uint8_t *m = dense ? a->mask + a->m_ptr[t->b] : NULL;
    for (int i = 0; i < Mp; i++) {
        float *s = S + (int64_t)i * BN;
        int64_t r = t->m0 + (i < M ? i : M - 1) / G; /* padding rows: the last token's */
        for (int j = 0; j < BN; j++) {
            int ok = j < nc;
            if (ok) ok = dense ? m[r * ncols + n0 + j] != 0 : co[j] <= ro[i] && (rb[i] < 0 || cb[j] < 0 || cb[j] == rb[i]);
            if (!ok) s[j] = -INFINITY;
        }
    }
}

static void run_task_det(const args_t *a, const task_t *t, scratch_t *w) {
    const int G = a->G, Dp = (a->D + VW - 1) / VW * VW;
    const int64_t qn = a->q_len[t->b];
    const int nrows = (int)(qn - t->m0 < a->bm ? qn - t->m0 : a->bm);
    const int M = nrows * G, Mp = (M + NR - 1) / NR * NR;
    const int dense = a->m_ptr[t->b] >= 0;
    const int64_t ncols = a->c_ptr[t->b + 1] - a->c_ptr[t->b];
    float *Qf = w->Qf, *S = w->S, *Kt = w->Kt, *V = w->V, *O = w->O, *mrow = w->m, *lrow = w->l;
    int64_t *ro = w->ro, *rb = w->rb, co[BN], cb[BN];
    const rows_t rs = load_rows(a, t, w, nrows, M, Mp, 1);
    const int64_t r_omax = rs.omax, r_bmin = rs.bmin, r_bmax = rs.bmax;
    const int r_any_free = rs.any_free;
    /* Pass 1's scores are kept for pass 2 where they fit (one tile after another), else pass 2 computes
     * them again: the same numbers either way. */
    const int64_t ntiles = (ncols + BN - 1) / BN;
    const size_t keep = (size_t)ntiles * Mp * BN;
    if (keep > w->s_cap && keep * sizeof(float) <= det_keep_bytes) {
        float *grown = realloc(w->s_all, keep * sizeof(float));
        uint8_t *seen = grown ? realloc(w->seen, (size_t)ntiles) : NULL;
        if (grown) w->s_all = grown;
        if (seen) w->seen = seen, w->s_cap = keep;
    }
    float *kept = keep <= w->s_cap && keep * sizeof(float) <= det_keep_bytes ? w->s_all : NULL;
    /* pass 1: each row's max over the columns it sees (a max is exact in any order) */
    for (int64_t n0 = 0; n0 < ncols; n0 += BN) {
        int nc = (int)(ncols - n0 < BN ? ncols - n0 : BN);
        float *St = kept ? kept + (size_t)(n0 / BN) * Mp * BN : S;
        int seen = det_columns(a, t, n0, nc, Kt, NULL, co, cb, r_omax, r_bmin, r_bmax, r_any_free, dense);
        if (kept) w->seen[n0 / BN] = (uint8_t)seen;
        if (!seen) continue;
        det_scores(a, t, Qf, Kt, St, M, Mp, nc, n0, co, cb, ro, rb, dense, ncols);
        for (int i = 0; i < Mp; i++) {
            const float *s = St + (int64_t)i * BN;
            for (int j = 0; j < BN; j++) mrow[i] = s[j] > mrow[i] ? s[j] : mrow[i];
        }
    }
    /* pass 2: weights against that max, summed and weighted in column order */
    for (int64_t n0 = 0; n0 < ncols; n0 += BN) {
        int nc = (int)(ncols - n0 < BN ? ncols - n0 : BN);
        if (kept) {
            S = kept + (size_t)(n0 / BN) * Mp * BN;
            if (!w->seen[n0 / BN]) continue;
            det_columns(a, t, n0, nc, NULL, V, co, cb, r_omax, r_bmin, r_bmax, r_any_free, dense);
        } else {
            if (!det_columns(a, t, n0, nc, Kt, V, co, cb, r_omax, r_bmin, r_bmax, r_any_free, dense)) continue;
            det_scores(a, t, Qf, Kt, S, M, Mp, nc, n0, co, cb, ro, rb, dense, ncols);
        }
        for (int i = 0; i < Mp; i++) {
            float *s = S + (int64_t)i * BN;
            if (mrow[i] == -INFINITY) { /* the row sees nothing (a padding row): it adds nothing */
                memset(s, 0, sizeof(float) * BN);
                continue;
            }
            vf mv = vset(mrow[i]);
            for (int u = 0; u < NB; u++) vstore(s + u * VW, vexp2(vload(s + u * VW) - mv));
        }
        pv_kernel_sum(S, V, O, lrow, Mp, Dp);
    }
    store_rows(a, t, O, lrow, M);
}

static int run_extend(args_t *a, int B, void (*task_fn)(const args_t *, const task_t *, scratch_t *));

/* 1 where this build extends bfloat16 with the CPU's bf16 dot products (run_task_dp), else 0 */
int sgrec_bf16_dot(void) {
#ifdef SGREC_DPBF16
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build extends bfloat16 on AMX tiles (built with -mamx-tile -mamx-bf16, and the kernel
 * granted this process the tile data), else 0 */
int sgrec_bf16_amx(void) {
#ifdef SGREC_AMX
    return amx_ready();
#else
    return 0;
#endif
}

int sgrec_extend_attention(const void *q, const void *k, const void *v, const void *kb, const void *vb,
                           int64_t s_q, int64_t s_k, int64_t s_v, const int64_t *q_start, const int64_t *q_len,
                           const int64_t *q_order, const int64_t *q_block, const int64_t *c_idx,
                           const int64_t *c_order, const int64_t *c_block, const int64_t *c_ptr, void *out, int B,
                           int Hq, int Hkv, int D, float scale, int bf16) {
    args_t a = {q, k, v, kb, vb, s_q, s_k, s_v, q_start, q_len, q_order, q_block, c_idx, c_order, c_block,
                c_ptr, out, Hq, Hkv, D, Hq / Hkv, 0, bf16, scale, NULL, NULL};
#ifdef SGREC_AMX
    if (bf16 && D % 2 == 0 && amx_ready()) return run_extend(&a, B, run_task_amx);
#endif
#ifdef SGREC_DPBF16
    if (bf16 && D % 2 == 0) return run_extend(&a, B, run_task_dot);
#endif
    return run_extend(&a, B, run_task);
}

int sgrec_extend_attention_det(const void *q, const void *k, const void *v, const void *kb, const void *vb,
                               int64_t s_q, int64_t s_k, int64_t s_v, const int64_t *q_start, const int64_t *q_len,
                               const int64_t *q_order, const int64_t *q_block, const int64_t *c_idx,
                               const int64_t *c_order, const int64_t *c_block, const int64_t *c_ptr,
                               const int64_t *m_ptr, const uint8_t *mask, void *out, int B, int Hq, int Hkv, int D,
                               float scale, int bf16) {
    args_t a = {q, k, v, kb, vb, s_q, s_k, s_v, q_start, q_len, q_order, q_block, c_idx, c_order, c_block,
                c_ptr, out, Hq, Hkv, D, Hq / Hkv, 0, bf16, scale, m_ptr, mask};
    return run_extend(&a, B, run_task_det);
}

/* Runs every (sequence, tile of new tokens, KV head) task of an extend under OpenMP. */
static int run_extend(args_t *ap, int B, void (*task_fn)(const args_t *, const task_t *, scratch_t *)) {
    args_t a = *ap;
    const int64_t *q_len = a.q_len;
    const int Hkv = a.Hkv, D = a.D;
    a.bm = ROWS_PER_TASK / a.G;
    a.bm = a.bm < 4 ? 4 : (a.bm > 64 ? 64 : a.bm);
    int64_t ntasks = 0;
    for (int b = 0; b < B; b++) ntasks += (q_len[b] + a.bm - 1) / a.bm * Hkv;
    task_t *tasks = malloc(sizeof(task_t) * (size_t)(ntasks ? ntasks : 1));
    if (!tasks) return 1;
    int64_t n = 0;
    for (int b = 0; b < B; b++) /* the last tiles of a sequence see the most columns: hand them out first */
        for (int64_t m0 = q_len[b] > 0 ? (q_len[b] - 1) / a.bm * a.bm : -1; m0 >= 0; m0 -= a.bm)
            for (int h = 0; h < Hkv; h++) tasks[n++] = (task_t){b, m0, h};
    const int Dp = (D + VW - 1) / VW * VW, Mp = (a.bm * a.G + 15) / 16 * 16; /* rows: a multiple of NR and 16 */
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        size_t floats = (size_t)Mp * Dp * 2 + (size_t)Mp * BN + (size_t)Dp * BN * 2 + (size_t)Mp * 2 + (size_t)Mp * BN / 2
                        + (size_t)Dp * BN / 2;
        float *buf = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        int64_t *ints = malloc(sizeof(int64_t) * (size_t)Mp * 3);
        scratch_t w = {0};
        if (!buf || !ints) failed = 1;
        else {
            w.Qf = buf;
            w.O = w.Qf + (size_t)Mp * Dp;
            w.S = w.O + (size_t)Mp * Dp;
            w.Kt = w.S + (size_t)Mp * BN;
            w.V = w.Kt + (size_t)Dp * BN;
            w.m = w.V + (size_t)Dp * BN;
            w.l = w.m + Mp;
            w.P = (uint32_t *)(w.l + Mp);
            w.T = w.P + (size_t)Mp * BN / 2;
            w.ro = ints;
            w.rb = ints + Mp;
            w.r32 = (int32_t *)(ints + 2 * Mp);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < ntasks; i++)
            if (buf && ints) task_fn(&a, &tasks[i], &w);
        free(buf);
        free(ints);
        free(w.s_all);
        free(w.seen);
    }
    free(tasks);
    return failed;
}

/* ---- decode: one new token per sequence, its keys read from the pool by slot ------------------
 *
 *   q        [B, Hq, D]    one new token per sequence
 *   kb, vb   [slots, Hkv, D]   one layer of the pool
 *   idx      [sum of lengths]  every sequence's slots, concatenated; sequence b's are
 *   ptr      [B + 1]       idx[ptr[b] .. ptr[b + 1]) (at least one each)
 *   out      [B, Hq, D]
 *
 * One task per (sequence, KV head) handles its G query heads. Scores: VW keys at a time, each key's
 * dot product accumulated across its row (a vector per key), then the VW vectors summed lane-wise
 * into one vector of VW scores by a shuffle tree (no transposed copy of K, no per-key horizontal
 * sum); an exact softmax (max, then 2^(s - max), sum) per head; the output sums V rows weighted four
 * keys at a time. K and V rows are read in place (float32, head dims a multiple of the vector width)
 * or through a converted, zero-padded copy (bfloat16, other head dims). */

/* the shuffle masks of the lane-sum tree: level t takes vectors holding VW >> t keys' partial sums,
 * w = VW >> t lanes... see reduce_lanes */
static void tree_masks(vi *m) {
    int level = 0;
    for (int w = VW; w > 1; w /= 2, level++) {
        int keys_in = VW / w, half = w / 2;
        for (int p = 0; p < VW; p++) {
            int kk = p / half, l = p % half;
            int src = kk < keys_in ? kk * w + l : VW + (kk - keys_in) * w + l;
            m[2 * level][p] = src;
            m[2 * level + 1][p] = src + half;
        }
    }
}

/* r[j] = the sum of acc[j]'s lanes, for the VW vectors acc[0 .. VW) (overwritten) */
static inline vf reduce_lanes(vf *acc, const vi *m) {
    int n = VW, level = 0;
    for (int w = VW; w > 1; w /= 2, level++, n /= 2)
        for (int i = 0; i < n / 2; i++)
            acc[i] = __builtin_shuffle(acc[2 * i], acc[2 * i + 1], m[2 * level]) +
                     __builtin_shuffle(acc[2 * i], acc[2 * i + 1], m[2 * level + 1]);
    return acc[0];
}

typedef struct {
    const void *q, *kb, *vb;
    const int64_t *idx, *ptr;
    void *out;
    int Hq, Hkv, D, G, Dp, bf16;
    float scale;
} dargs_t;

/* the row of `slot`'s head h in a pool buffer, as Dp floats: in place when it can be read so, else
 * converted into buf */
static inline const float *pool_row(const dargs_t *a, const void *pool, int64_t slot, int h, float *buf) {
    int64_t off = (slot * a->Hkv + h) * (int64_t)a->D;
    if (!a->bf16 && a->D == a->Dp) return (const float *)pool + off;
    int d = 0;
    if (a->bf16)
        for (; d + VW <= a->D; d += VW) vstore(buf + d, vload_bf16((const uint16_t *)pool + off + d));
    for (; d < a->D; d++) buf[d] = load1(pool, off + d, a->bf16);
    for (d = a->D; d < a->Dp; d++) buf[d] = 0.f;
    return buf;
}

static void decode_task(const dargs_t *a, int64_t b, int h, float *qf, float *s, float *o, float *rows_buf,
                        const float *zero, const vi *masks, int64_t Lp) {
    const int64_t SL = Lp + VW; /* a head's row of scores, then its 1 / sum */
    const int G = a->G, D = a->D, Dp = a->Dp, nvd = Dp / VW;
    const int64_t *slots = a->idx + a->ptr[b], L = a->ptr[b + 1] - a->ptr[b];
    const float qscale = a->scale * LOG2E;
    const int64_t esize = a->bf16 ? 2 : 4;
#ifdef SGREC_DPBF16
    /* bfloat16 with head dims a multiple of 32: Q.K on the bf16 dot products, K rows read in place and
     * Q as it came (the scores scaled afterwards, in float32), as the bf16 extend does */
    const int dp = a->bf16 && D % 32 == 0;
#else
    const int dp = 0;
#endif
    for (int g = 0; !dp && g < G; g++) {
        int64_t base = (b * a->Hq + (int64_t)h * G + g) * D;
        for (int d = 0; d < Dp; d++) qf[g * Dp + d] = d < D ? load1(a->q, base + d, a->bf16) * qscale : 0.f;
    }
    const float *rows[VW];
    for (int64_t j0 = 0; j0 < L; j0 += VW) {
        int nk = (int)(L - j0 < VW ? L - j0 : VW);
        for (int64_t j = j0 + VW; j < j0 + 2 * VW && j < L; j++) /* the next block's K rows */
            for (int64_t off = 0; off < (int64_t)D * esize; off += 64)
                __builtin_prefetch((const char *)a->kb + (slots[j] * a->Hkv + h) * (int64_t)D * esize + off);
#ifdef SGREC_DPBF16
        if (dp) {
            const uint16_t *kr[VW];
            for (int jj = 0; jj < VW; jj++) /* past L: zero is a row of Dp >= D float zeros, bf16 zeros too */
                kr[jj] = jj < nk ? (const uint16_t *)a->kb + (slots[j0 + jj] * a->Hkv + h) * (int64_t)D
                                 : (const uint16_t *)zero;
            for (int g = 0; g < G; g++) {
                const uint16_t *qg = (const uint16_t *)a->q + (b * a->Hq + (int64_t)h * G + g) * D;
                vf acc[VW];
                for (int jj = 0; jj < VW; jj++) acc[jj] = vset(0.f);
                for (int u = 0; u < D; u += 32) {
                    __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + u);
                    for (int jj = 0; jj < VW; jj++)
                        acc[jj] = (vf)_mm512_dpbf16_ps((__m512)acc[jj], (__m512bh)_mm512_loadu_si512(kr[jj] + u), qv);
                }
                vstore(s + g * SL + j0, reduce_lanes(acc, masks) * qscale);
            }
            continue;
        }
#endif
        for (int jj = 0; jj < VW; jj++)
            rows[jj] = jj < nk ? pool_row(a, a->kb, slots[j0 + jj], h, rows_buf + (int64_t)jj * Dp) : zero;
        for (int g = 0; g < G; g++) {
            vf acc[VW];
            for (int jj = 0; jj < VW; jj++) acc[jj] = vset(0.f);
            for (int u = 0; u < nvd; u++) {
                vf qv = vload(qf + g * Dp + u * VW);
                for (int jj = 0; jj < VW; jj++) acc[jj] += vload(rows[jj] + u * VW) * qv;
            }
            vstore(s + g * SL + j0, reduce_lanes(acc, masks));
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = s + g * SL, mx = -INFINITY, sum = 0.f;
        for (int64_t j = L; j < Lp; j++) sg[j] = -INFINITY;
        for (int64_t j = 0; j < L; j++) mx = sg[j] > mx ? sg[j] : mx;
        vf mv = vset(mx), ps = vset(0.f);
        for (int64_t j = 0; j < Lp; j += VW) {
            vf p = vexp2(vload(sg + j) - mv);
            vstore(sg + j, p);
            ps += p;
        }
        for (int u = 0; u < VW; u++) sum += ps[u];
        sg[Lp] = 1.f / sum;
    }
    memset(o, 0, sizeof(float) * (size_t)G * Dp);
    for (int64_t j0 = 0; j0 < L; j0 += 4) {
        const float *vrow[4];
        for (int jj = 0; jj < 4; jj++)
            vrow[jj] = j0 + jj < L ? pool_row(a, a->vb, slots[j0 + jj], h, rows_buf + (int64_t)jj * Dp) : zero;
        for (int64_t j = j0 + 8; j < j0 + 12 && j < L; j++) /* V rows two blocks ahead */
            for (int64_t off = 0; off < (int64_t)D * esize; off += 64)
                __builtin_prefetch((const char *)a->vb + (slots[j] * a->Hkv + h) * (int64_t)D * esize + off);
        for (int g = 0; g < G; g++) {
            const float *p = s + g * SL + j0; /* zero past L */
            vf p0 = vset(p[0]), p1 = vset(p[1]), p2 = vset(p[2]), p3 = vset(p[3]);
            float *og = o + g * Dp;
            for (int u = 0; u < nvd; u++) {
                vf acc = vload(og + u * VW);
                acc += p0 * vload(vrow[0] + u * VW);
                acc += p1 * vload(vrow[1] + u * VW);
                acc += p2 * vload(vrow[2] + u * VW);
                acc += p3 * vload(vrow[3] + u * VW);
                vstore(og + u * VW, acc);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        int64_t base = (b * a->Hq + (int64_t)h * G + g) * D;
        float inv = s[g * SL + Lp];
        for (int d = 0; d < D; d++) {
            float x = o[g * Dp + d] * inv;
            if (a->bf16) ((uint16_t *)a->out)[base + d] = bf16_store(x);
            else ((float *)a->out)[base + d] = x;
        }
    }
}

int sgrec_decode_attention(const void *q, const void *kb, const void *vb, const int64_t *idx, const int64_t *ptr,
                           void *out, int B, int Hq, int Hkv, int D, float scale, int bf16) {
    dargs_t a = {q, kb, vb, idx, ptr, out, Hq, Hkv, D, Hq / Hkv, (D + VW - 1) / VW * VW, bf16, scale};
    int64_t Lmax = 0;
    for (int b = 0; b < B; b++) Lmax = ptr[b + 1] - ptr[b] > Lmax ? ptr[b + 1] - ptr[b] : Lmax;
    const int64_t Lp = (Lmax + 4 + VW - 1) / VW * VW; /* room for the PV step's 4-key blocks past L */
    vi masks[64];
    tree_masks(masks);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        size_t floats = (size_t)a.G * (Lp + VW + 2 * (size_t)a.Dp) + (size_t)(VW + 1) * a.Dp;
        float *buf = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        if (!buf) failed = 1;
        else memset(buf, 0, sizeof(float) * floats);
        float *qf = buf, *o = buf + (size_t)a.G * a.Dp, *s = o + (size_t)a.G * a.Dp;
        float *rows_buf = s + (size_t)a.G * (Lp + VW), *zero = rows_buf + (size_t)VW * a.Dp;
        /* a task: one sequence's KV heads one after another (its rows come into this core's cache
         * once), or one (sequence, KV head) when there are too few sequences to keep threads busy */
        int per = B >= 4 * omp_get_num_threads() ? Hkv : 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < (int64_t)B * Hkv / per; t++)
            for (int h = (int)(t * per % Hkv); buf && h < (int)(t * per % Hkv) + per; h++)
                decode_task(&a, t * per / Hkv, h, qf, s, o, rows_buf, zero, masks, Lp);
        free(buf);
    }
    return failed;
}
