"""The native one-call decode step behind ``moebit.inference.fused_decode``.

Why one call: at batch 1 a Mixtral-style step is 8-10 native GEMVs per layer, and the
torch modules around them (RMSNorm, RoPE, the cache write, attention, routing, the expert
loop) cost more than the GEMVs themselves: about 20 us of dispatch per quantized linear
and a few ms per step in all, measured against 3.5 ms of weight reads (docs/benchmarks/
decode.md). Here the whole step, every layer and the head, runs inside one OpenMP
parallel region: each matrix product is split by blocks of output columns over the
threads (``omp for``), the small per-row work (norms, routing, the residual) runs on one
thread (``omp single``), and an implicit barrier separates the phases. No thread pool is
started or joined between products.

The products reuse the GEMV column loops of ``_qgemv_c`` (int8 / int4, per-group scales,
1-16 rows, ISA dispatch by build), ``_q4q8_c`` and ``_q8q8_c`` (int4 and int8 on 8-bit
activations) and ``_f32_c`` (float32, in register tiles of rows and columns), so the
weights are read in the very buffers ``QuantLinear`` / ``QuantExperts`` / ``nn.Linear``
hold, never copied.

Per layer: RMSNorm -> q, k, v (one parallel phase over all three) -> (Qwen3's per-head
k norm) RoPE on k and the cache write (per row and key/value head) -> (q norm) RoPE on q
and attention over the row's keys (per row and query head; GQA) -> o -> residual and
RMSNorm -> router (float32) -> top-k, weights, rows grouped by expert -> gate/up for
every (chosen expert, column block) with SiLU(gate) * up fused -> down -> weighted
combine into the residual. Then the final norm and the head. Activations are float32
throughout, as the module path computes them.
"""

from __future__ import annotations

import ctypes

from moebit.comm._native import open_library
from moebit.inference import _f32_c, _greedy_c, _half_c, _q4q8_c, _q8q8_c, _qgemv_c, _vexp_c

STEP_SOURCE = r"""
#include <math.h>
#include <omp.h>

typedef struct {
    const void *w;         /* float32 [n, kp] (bits 32) or packed int8 / int4 rows */
    const float *s;        /* scales [n, kp / group] (bits 8 / 4) */
    const float *b;        /* bias [n] or NULL */
    int64_t n, kp, group, bits;
    int64_t wstride, sstride; /* stacked experts: bytes of w, floats of s per expert */
} fd_lin;

typedef struct {
    const float *ln1, *ln2;
    const float *qn, *kn;  /* per-head q / k RMSNorm weights [dh] (Qwen3) or NULL */
    fd_lin q, k, v, o, router, up, down;
} fd_layer;

typedef struct {
    int64_t n_layer, d, h, hkv, dh, e, topk, f, vocab, rows_max, threads_max, tmax_max;
    int64_t renorm;        /* weights renormalised over the k chosen */
    int64_t act8;          /* int4 (groups of 32) and int8 (groups of 32 or per channel)
                              weights take 8-bit activations */
    int64_t kvh;           /* the cache's keys and values are float16 (else float32) */
    float eps, scale, routed_scaling;
    const float *wte, *norm;
    fd_lin head;
    const fd_layer *layers;
    /* scratch, float32 unless named: x, xn [R, d]; qb [R, h*dh]; kb, vb [R, hkv*dh];
       att [R, h*dh]; ob [R, d]; lg [R, e]; xe [R*k, d]; hu [R*k, 2f]; ha [R*k, f];
       ye [R*k, d]; sc [threads, h / hkv, tmax]; ints: slot_row, slot_e [R*k]; act_e, act_off,
       act_n [e]; sw float [R*k] */
    float *x, *xn, *qb, *kb, *vb, *att, *ob, *lg, *xe, *hu, *ha, *ye, *sc, *sw;
    int64_t *slot_row, *act_e, *act_off, *act_n, *n_act;
    /* with act8: the 8-bit copies of xn, att, xe, ha (int8, same shapes) and per block of
       32 their scales d and offsets c (float32, a 32nd of the shape) */
    int8_t *xnq, *attq, *xeq, *haq;
    float *xnd, *xnc, *attd, *attc, *xed, *xec, *had, *hac;
} fd_model;

#define FB 16 /* output columns per work item */

/* columns [n0, n1) of x[R, kp] @ W^T (expert e of a stacked weight) into y[R, n]; int4
   weights in groups of 32 and int8 weights in groups of 32 or per channel read the 8-bit
   blocks of x where the caller made them */
static void lin_cols(const fd_lin *L, int64_t e, const fd_act *a, int64_t R, float *y,
                     int64_t n0, int64_t n1) {
    const uint8_t *w = (const uint8_t *)L->w + e * L->wstride;
    const float *s = L->s ? L->s + e * L->sstride : 0;
    const float *x = a->x;
    if (L->bits == 4 && L->group == 32 && a->q) cols_4q8(w, s, a, R, L->n, L->kp, y, n0, n1);
    else if (L->bits == 8 && a->q && (L->group == 32 || L->group == L->kp))
        cols_8q8((const int8_t *)w, s, L->group != 32, a, R, L->n, L->kp, y, n0, n1);
    else if (L->bits == 32) cols_f((const float *)w, x, R, L->n, L->kp, y, n0, n1);
    else if (L->bits == 8) cols_8(w, s, x, R, L->n, L->kp, L->group, y, n0, n1);
    else cols_4(w, s, x, R, L->n, L->kp, L->group, y, n0, n1);
    if (L->b)
        for (int64_t r = 0; r < R; r++)
            for (int64_t c = n0; c < n1; c++) y[r * L->n + c] += L->b[c];
}

static inline int64_t nblk(int64_t n) { return (n + FB - 1) / FB; }
static inline int64_t upto(int64_t a, int64_t n) { return a < n ? a : n; }

/* this thread's contiguous share [lo, hi) of n work items, in a parallel region */
static inline void share(int64_t n, int64_t *lo, int64_t *hi) {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    *lo = n * t / T;
    *hi = n * (t + 1) / T;
}

static void rmsnorm(const float *x, const float *w, float *y, int64_t d, float eps) {
    float lane[16] = {0}, ss = 0.0f;
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        for (int j = 0; j < 16; j++) lane[j] += x[i + j] * x[i + j];
    for (; i < d; i++) ss += x[i] * x[i];
    for (int j = 0; j < 16; j++) ss += lane[j];
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (i = 0; i < d; i++) y[i] = w[i] * (x[i] * r);
}

/* row r of x through RMSNorm (weight w) into row h of xn, and with act8 its 8-bit blocks:
   the input of every product that follows a norm (the head's rows are packed to the
   front) */
static void norm_row(const fd_model *m, const float *w, int64_t r, int64_t h) {
    const int64_t D = m->d;
    rmsnorm(m->x + r * D, w, m->xn + h * D, D, m->eps);
    if (m->act8)
        quant8(m->xn + h * D, D / 32, 0, D / 32, m->xnq + h * D, m->xnd + h * D / 32,
               m->xnc + h * D / 32);
}

/* transformers' rotate-half RoPE on the first rw dims of one head (the rest pass) */
static void rope(float *v, const float *cs, const float *sn, int64_t rw) {
    const int64_t half = rw / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cs[i] - b * sn[i];
        v[i + half] = b * cs[i + half] + a * sn[i + half];
    }
}

/* the grp query heads q [grp, dh] of one key/value head over its keys and values at
   columns t0 .. t1 (kb, vb: [tmax, dh], float16 with kvh; sc: scratch [grp, t1 - t0 + 1])
   into out [grp, dh].
   The scores are ``cols_f``'s register tiles: the keys as weight rows, the group's heads
   as activation rows, so each key is read once for the group. The weighted sum keeps
   four sums a lane, so that consecutive positions' FMAs do not wait on each other. At a
   decode step this is bound by reading the keys and values, which the streamed expert
   weights evict from the caches between steps. */
static void attend_group(const float *restrict q, const void *kb, const void *vb, int kvh,
                         int64_t t0, int64_t t1, int64_t dh, int64_t grp, float scale,
                         float *restrict sc, float *restrict out) {
    const int64_t n = t1 - t0 + 1;
    const float *restrict v0 = (const float *)vb + t0 * dh;
    const uint16_t *restrict h0 = (const uint16_t *)vb + t0 * dh;
    if (kvh) cols_fh((const uint16_t *)kb + t0 * dh, q, grp, n, dh, sc, 0, n);
    else cols_f((const float *)kb + t0 * dh, q, grp, n, dh, sc, 0, n);
    for (int64_t h = 0; h < grp; h++) {
        float *restrict p = sc + h * n, mx = -INFINITY;
        for (int64_t t = 0; t < n; t++) {
            p[t] *= scale;
            if (p[t] > mx) mx = p[t];
        }
        const float inv = 1.0f / exp_shifted(p, n, mx);
        float acc[4][dh];
        for (int u = 0; u < 4; u++)
            for (int64_t i = 0; i < dh; i++) acc[u][i] = 0.0f;
        int64_t t = 0;
        for (; t < n; t++) {   /* positions 4 apart share a sum; the last 1-3 the first */
            const int u = t < n - n % 4 ? (int)(t % 4) : 0;
            const float pu = p[t] * inv;
            if (kvh) {
                axpy_half(acc[u], pu, h0 + t * dh, dh);
            } else {
                const float *restrict vt = v0 + t * dh;
#pragma omp simd
                for (int64_t i = 0; i < dh; i++) acc[u][i] += pu * vt[i];
            }
        }
        for (int64_t i = 0; i < dh; i++)
            out[h * dh + i] = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
    }
}

/* one decode step of R rows, row r in cache row slot[r]: its keys are columns
   first[r] .. col[r] - 1, its new key and value go to column col[r], at position
   col[r] - first[r]. ids [R]; cos, sin [R, rw], or with ``tabled`` tables [tmax, rw] by
   position; live [R] or NULL (rows whose feed-forward still runs); kc, vc: per layer
   [rows of the cache, hkv, tmax, dh]; logits [nh, vocab] for the nh rows hrows names
   (nh < 0: all R rows; 0: none). Rows may share a cache row at consecutive columns (a prompt chunk): every
   row's key and value are written before any row attends, so each sees the ones before
   it. */
int fd_step(const fd_model *m, int64_t R, const int64_t *ids, const float *cos_,
            const float *sin_, int64_t rw, int64_t tabled, const int64_t *slot,
            const int64_t *first, const int64_t *col, const uint8_t *live,
            float *const *kc, float *const *vc, int64_t tmax, float *logits, int nthreads,
            const int64_t *hrows, int64_t nh) {
    if (R < 1 || R > m->rows_max || tmax > m->tmax_max) return 1;
    if (nh > R || (nh > 0 && !hrows)) return 4;
    if (nh < 0) { hrows = 0; nh = R; }   /* every row's logits */
    for (int64_t h = 0; hrows && h < nh; h++)
        if (hrows[h] < 0 || hrows[h] >= R) return 4;
    for (int64_t r = 0; r < R; r++)
        if (col[r] >= tmax || first[r] > col[r] || first[r] < 0) return 2;
    for (int64_t r = 0; r < R; r++)
        if (ids[r] < 0 || ids[r] >= m->vocab) return 3;
    const int64_t D = m->d, H = m->h, HKV = m->hkv, DH = m->dh, F = m->f, K = m->topk;
    const int64_t QN = H * DH, KN = HKV * DH, grp = H / HKV;
    int nt = nthreads < 1 ? 1 : nthreads;
    int64_t rot[R]; /* offset of each row's cos / sin */
    for (int64_t r = 0; r < R; r++) rot[r] = (tabled ? col[r] - first[r] : r) * rw;
    if (nt > m->threads_max) nt = (int)m->threads_max;
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < D; i++) m->x[r * D + i] = m->wte[ids[r] * D + i];

#pragma omp parallel num_threads(nt)
    {
        float *sc = m->sc + (int64_t)omp_get_thread_num() * m->tmax_max * grp;
        for (int64_t l = 0; l < m->n_layer; l++) {
            const fd_layer *ly = m->layers + l;
            float *kcl = kc[l], *vcl = vc[l];
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++) norm_row(m, ly->ln1, r, r);
            {
                const fd_act xa = act_at(m->xn, m->act8 ? m->xnq : 0, m->xnd, m->xnc, 0);
                const int64_t bq = nblk(QN), bk = nblk(KN);
#pragma omp for schedule(static)
                for (int64_t j = 0; j < bq + 2 * bk; j++) {
                    const fd_lin *L = j < bq ? &ly->q : j < bq + bk ? &ly->k : &ly->v;
                    float *y = j < bq ? m->qb : j < bq + bk ? m->kb : m->vb;
                    const int64_t b = j < bq ? j : j < bq + bk ? j - bq : j - bq - bk;
                    const int64_t n0 = b * FB, n1 = upto(n0 + FB, L->n);
                    lin_cols(L, 0, &xa, R, y, n0, n1);
                }
            }
#pragma omp for schedule(static)
            for (int64_t j = 0; j < R * HKV; j++) {
                const int64_t r = j / HKV, g = j % HKV;
                float *kr = m->kb + r * KN + g * DH;
                if (ly->kn) rmsnorm(kr, ly->kn, kr, DH, m->eps);
                rope(kr, cos_ + rot[r], sin_ + rot[r], rw);
                const int64_t at = ((slot[r] * HKV + g) * tmax + col[r]) * DH;
                const float *vr = m->vb + r * KN + g * DH;
                if (m->kvh) {
                    store_half(kr, (uint16_t *)kcl + at, DH);
                    store_half(vr, (uint16_t *)vcl + at, DH);
                } else {
                    memcpy((float *)kcl + at, kr, DH * sizeof(float));
                    memcpy((float *)vcl + at, vr, DH * sizeof(float));
                }
            }
#pragma omp for schedule(static)
            for (int64_t j = 0; j < R * HKV; j++) {   /* a row's query heads by key/value head */
                const int64_t r = j / HKV, g = j % HKV, h0 = g * grp;
                float *q = m->qb + r * QN + h0 * DH;
                for (int64_t hh = 0; hh < grp; hh++) {
                    if (ly->qn) rmsnorm(q + hh * DH, ly->qn, q + hh * DH, DH, m->eps);
                    rope(q + hh * DH, cos_ + rot[r], sin_ + rot[r], rw);
                }
                const int64_t at = (slot[r] * HKV + g) * tmax * DH, es = m->kvh ? 2 : 4;
                attend_group(q, (const char *)kcl + at * es, (const char *)vcl + at * es,
                             (int)m->kvh, first[r], col[r], DH, grp, m->scale, sc,
                             m->att + r * QN + h0 * DH);
                if (m->act8) {
                    const int64_t o0 = r * QN;  /* this group's blocks of the row */
                    quant8(m->att + o0, QN / 32, h0 * DH / 32, (h0 + grp) * DH / 32,
                           m->attq + o0, m->attd + o0 / 32, m->attc + o0 / 32);
                }
            }
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nblk(D); b++) {
                const int64_t n0 = b * FB, n1 = upto(n0 + FB, D);
                const fd_act aa = act_at(m->att, m->act8 ? m->attq : 0, m->attd, m->attc, 0);
                lin_cols(&ly->o, 0, &aa, R, m->ob, n0, n1);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++) {
                for (int64_t i = r * D; i < (r + 1) * D; i++) m->x[i] += m->ob[i];
                norm_row(m, ly->ln2, r, r);
            }
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nblk(m->e); b++) {
                const int64_t n0 = b * FB, n1 = upto(n0 + FB, m->e);
                const fd_act xa = act_at(m->xn, 0, 0, 0, 0);  /* the router stays float */
                lin_cols(&ly->router, 0, &xa, R, m->lg, n0, n1);
            }
#pragma omp single
            {   /* top-k of each live row, weights, then the rows grouped by expert */
                const int64_t E = m->e;
                int64_t cnt[E > 0 ? E : 1], slot_e[R * K];
                for (int64_t e = 0; e < E; e++) cnt[e] = 0;
                int64_t ns = 0;
                for (int64_t r = 0; r < R; r++) {
                    if (live && !live[r]) continue;
                    const float *lg = m->lg + r * E;
                    int64_t pick[K];
                    for (int64_t i = 0; i < K; i++) {
                        int64_t best = -1;
                        for (int64_t e = 0; e < E; e++) {
                            int taken = 0;
                            for (int64_t j = 0; j < i; j++) taken |= pick[j] == e;
                            if (!taken && (best < 0 || lg[e] > lg[best])) best = e;
                        }
                        pick[i] = best;
                    }
                    float mx = lg[0], den = 0.0f, chosen = 0.0f;
                    for (int64_t e = 1; e < E; e++) if (lg[e] > mx) mx = lg[e];
                    for (int64_t e = 0; e < E; e++) den += expf(lg[e] - mx);
                    for (int64_t i = 0; i < K; i++) chosen += expf(lg[pick[i]] - mx);
                    for (int64_t i = 0; i < K; i++) {
                        const float p = expf(lg[pick[i]] - mx) / (m->renorm ? chosen : den);
                        m->sw[ns] = p * m->routed_scaling;
                        m->slot_row[ns] = r;
                        slot_e[ns] = pick[i];
                        cnt[pick[i]]++;
                        ns++;
                    }
                }
                int64_t na = 0, off = 0;
                for (int64_t e = 0; e < E; e++) {
                    if (!cnt[e]) continue;
                    m->act_e[na] = e; m->act_off[na] = off; m->act_n[na] = 0;
                    off += cnt[e]; cnt[e] = na++;    /* cnt now maps expert -> active index */
                }
                int64_t order[R * K > 0 ? R * K : 1];
                float wsort[R * K > 0 ? R * K : 1];
                int64_t rsort[R * K > 0 ? R * K : 1];
                for (int64_t s = 0; s < ns; s++) {
                    const int64_t a = cnt[slot_e[s]];
                    const int64_t dst = m->act_off[a] + m->act_n[a]++;
                    order[dst] = s;
                }
                for (int64_t s = 0; s < ns; s++) {
                    wsort[s] = m->sw[order[s]];
                    rsort[s] = m->slot_row[order[s]];
                }
                for (int64_t s = 0; s < ns; s++) {
                    m->sw[s] = wsort[s];
                    m->slot_row[s] = rsort[s];
                    for (int64_t i = 0; i < D; i++) m->xe[s * D + i] = m->xn[rsort[s] * D + i];
                    if (m->act8) {
                        for (int64_t i = 0; i < D; i++) m->xeq[s * D + i] = m->xnq[rsort[s] * D + i];
                        for (int64_t i = 0; i < D / 32; i++) {
                            m->xed[s * D / 32 + i] = m->xnd[rsort[s] * D / 32 + i];
                            m->xec[s * D / 32 + i] = m->xnc[rsort[s] * D / 32 + i];
                        }
                    }
                }
                m->n_act[0] = na;
                m->n_act[1] = ns;
            }
            /* gate/up in blocks of UB columns: with act8 each block is whole 32-blocks of
               the activation the down projection reads, quantized where it is made */
            const int64_t UB = m->act8 ? 64 : FB;
            const int64_t na = m->n_act[0], ns = m->n_act[1], bf = (F + UB - 1) / UB, bd = nblk(D);
            {   /* each thread takes the same contiguous share of every active expert's
                   columns: balanced whatever the experts' rows, and each share one stream */
                int64_t b0, b1;
                share(bf, &b0, &b1);
                for (int64_t a = 0; a < na; a++) {
                    const int64_t e = m->act_e[a], off = m->act_off[a], n = m->act_n[a];
                    float *hu = m->hu + off * 2 * F;
                    const fd_act xa = act_at(m->xe, m->act8 ? m->xeq : 0, m->xed, m->xec, off * D);
                    for (int64_t b = b0; b < b1; b++) {
                        const int64_t n0 = b * UB, n1 = upto(n0 + UB, F);
                        lin_cols(&ly->up, e, &xa, n, hu, n0, n1);
                        lin_cols(&ly->up, e, &xa, n, hu, F + n0, F + n1);
                        for (int64_t r = 0; r < n; r++) {
                            float *h = m->ha + (off + r) * F;
                            silu_mul(hu + r * 2 * F + n0, hu + r * 2 * F + F + n0, h + n0, n1 - n0);
                            if (m->act8) {
                                const int64_t o0 = (off + r) * F;  /* this block's of the row */
                                quant8(h, F / 32, n0 / 32, n1 / 32, m->haq + o0,
                                       m->had + o0 / 32, m->hac + o0 / 32);
                            }
                        }
                    }
                }
            }
#pragma omp barrier
            {   /* down, then the weighted combine of the same columns: no barrier between */
                int64_t b0, b1;
                share(bd, &b0, &b1);
                const int64_t c0 = b0 * FB, c1 = upto(b1 * FB, D);
                for (int64_t a = 0; a < na && c0 < c1; a++) {
                    const int64_t e = m->act_e[a], off = m->act_off[a], n = m->act_n[a];
                    const fd_act ha = act_at(m->ha, m->act8 ? m->haq : 0, m->had, m->hac, off * F);
                    lin_cols(&ly->down, e, &ha, n, m->ye + off * D, c0, c1);
                }
                for (int64_t s = 0; s < ns; s++) {   /* rows in order */
                    float *xr = m->x + m->slot_row[s] * D;
                    const float w = m->sw[s], *y = m->ye + s * D;
                    for (int64_t c = c0; c < c1; c++) xr[c] += w * y[c];
                }
            }
#pragma omp barrier
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < nh; h++) norm_row(m, m->norm, hrows ? hrows[h] : h, h);
        const fd_act xa = act_at(m->xn, m->act8 ? m->xnq : 0, m->xnd, m->xnc, 0);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblk(m->vocab); b++) {
            const int64_t n0 = b * FB, n1 = upto(n0 + FB, m->vocab);
            lin_cols(&m->head, 0, &xa, nh, logits, n0, n1);
        }
    }
    return 0;
}
"""

SOURCE = (_qgemv_c.SOURCE + _q4q8_c.SOURCE + _q8q8_c.SOURCE + _half_c.SOURCE + _f32_c.SOURCE
          + _vexp_c.SOURCE + STEP_SOURCE + _greedy_c.SOURCE)

_VP, _I64 = ctypes.c_void_p, ctypes.c_int64


class Lin(ctypes.Structure):
    _fields_ = [("w", _VP), ("s", _VP), ("b", _VP), ("n", _I64), ("kp", _I64),
                ("group", _I64), ("bits", _I64), ("wstride", _I64), ("sstride", _I64)]


class Layer(ctypes.Structure):
    _fields_ = [("ln1", _VP), ("ln2", _VP), ("qn", _VP), ("kn", _VP), *((n, Lin) for n in
                ("q", "k", "v", "o", "router", "up", "down"))]


SCRATCH = ("x", "xn", "qb", "kb", "vb", "att", "ob", "lg", "xe", "hu", "ha", "ye", "sc", "sw",
           "slot_row", "act_e", "act_off", "act_n", "n_act",
           "xnq", "attq", "xeq", "haq", "xnd", "xnc", "attd", "attc", "xed", "xec", "had", "hac")


class Model(ctypes.Structure):
    _fields_ = [*((n, _I64) for n in ("n_layer", "d", "h", "hkv", "dh", "e", "topk", "f",
                                      "vocab", "rows_max", "threads_max", "tmax_max",
                                      "renorm", "act8", "kvh")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("routed_scaling", ctypes.c_float),
                ("wte", _VP), ("norm", _VP), ("head", Lin), ("layers", _VP),
                *((n, _VP) for n in SCRATCH)]


SIGNATURES = {
    "fd_q4q8": ([_VP, _VP, _VP, _I64, _I64, _I64, _VP, _VP, _VP, _VP], None),
    "fd_q8q8": ([_VP, _VP, _I64, _VP, _I64, _I64, _I64, _VP, _VP, _VP, _VP], None),
    "fd_f32": ([_VP, _VP, _I64, _I64, _I64, _VP], None),
    "fd_exp": ([_VP, _VP, _I64], None),
    "fd_to_half": ([_VP, _VP, _I64], None),
    "fd_from_half": ([_VP, _VP, _I64], None),
    "fd_step": ([ctypes.POINTER(Model), _I64, _VP, _VP, _VP, _I64, _I64, _VP, _VP, _VP, _VP,
                 _VP, _VP, _I64, _VP, ctypes.c_int, _VP, _I64], ctypes.c_int),
    "fd_greedy": ([ctypes.POINTER(Model), _I64, _VP, _VP, _VP, _I64, _VP, _VP, _VP, _VP, _VP,
                   _VP, _I64, _VP, ctypes.c_int, _I64, _VP, _I64, _VP, _VP, _VP, _VP], _I64),
}
_by_isa: dict[str | None, ctypes.CDLL | None] = {}


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The step for ``isa`` (default: the CPU's best), built on first use; None (one
    warning) where it cannot be built."""
    if isa not in _by_isa:
        _by_isa[isa] = open_library("fused_decode", SOURCE, SIGNATURES, "fused decode step",
                                    isa=isa, extra_flags=["-fopenmp"])
    return _by_isa[isa]
