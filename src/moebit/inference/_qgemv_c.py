"""The native weight-only int8 / int4 GEMV-GEMM kernels behind ``moebit.inference.qgemv``.

Why native code: a decode step multiplies 1-16 activation rows by every weight it uses,
so it is bound by the bytes of weight read, not by arithmetic. torch's int8 path
(``torch._weight_int8pack_mm``) is compute-bound at these row counts on CPU, and torch has
no int4 CPU kernel for float activations at all. These loops read each weight byte once
per call, dequantize it in registers (int8: sign-extend and convert; int4: two nibbles per
byte) and feed up to 8 activation rows per pass, over OpenMP threads split by output
column.

Layout (``qgemv.quantize_weight`` writes it): weights [N, Kp] output-major, K padded with
zeros to Kp, a multiple of the scale group; int8: one signed byte per weight, any group
(per output channel: group = Kp = K); int4 (group a multiple of 32): per 32-element
chunk 16 bytes, byte i holding element i in its low nibble and element i + 16 in its high
nibble, each stored as q + 8 (q in [-8, 7]).
Scales: float32 [N, Kp / group]. Activations float32 [R, Kp] (zero-padded), output
float32 [R, N]: y[r, n] = sum_k x[r, k] * (q[n, k] * s[n, k / group]).

Built by ``moebit.comm._native`` for the CPU's ISA level (portable C, AVX2+FMA, AVX-512),
cached like the comm kernels.
"""

from __future__ import annotations

import ctypes

from moebit.comm._native import open_library

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define RT 8 /* activation rows per pass over a weight row */

/* Software prefetch of the weight streams, PF_W bytes ahead (the scales' stream a
   proportionate distance): one thread streaming packed weights with loads alone keeps
   too few cache misses in flight to reach the core's read rate. A fixed distance of a
   few KB, not a host's tuning: the products read every stream strictly forward. */
#ifndef PF_W
#define PF_W 4096
#endif
#if defined(__GNUC__)
#define PREFETCH_AT(p, d) __builtin_prefetch((const char *)(p) + (d), 0, 3)
#else
#define PREFETCH_AT(p, d) ((void)0)
#endif
#define PREFETCH(p) PREFETCH_AT(p, PF_W)

int qg_isa(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
/* rt rows of x times one weight row (q, its scales s) -> out[r * N] */
static inline __attribute__((always_inline)) void col(
    const int bits, const int rt, const uint8_t *q, const float *s, const float *x,
    int64_t Kp, int64_t group, float *out, int64_t N) {
    __m512 acc[RT][2];
    float tail[RT] = {0};
    for (int r = 0; r < rt; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int64_t g = 0, k = 0; k < Kp; g++) {
        const __m512 sv = _mm512_set1_ps(s[g]), off = _mm512_set1_ps(-8.0f * s[g]);
        const int64_t k1 = k + group;
        PREFETCH_AT(s + g, PF_W / 8);
        for (; k + 32 <= k1; k += 32) {
            __m512 w0, w1;
            PREFETCH(q + (bits == 8 ? k : k / 2));
            if (bits == 8) {
                w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                         _mm_loadu_si128((const __m128i *)(q + k)))), sv);
                w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                         _mm_loadu_si128((const __m128i *)(q + k + 16)))), sv);
            } else {
                __m128i v = _mm_loadu_si128((const __m128i *)(q + k / 2));
                __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
                w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), sv, off);
                w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), sv, off);
            }
            for (int r = 0; r < rt; r++) {
                const float *xr = x + r * Kp + k;
                acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
            }
        }
        for (; k < k1; k++) { /* int8 only: a group that is not a multiple of 32 */
            const float wv = (float)((const int8_t *)q)[k] * s[g];
            for (int r = 0; r < rt; r++) tail[r] += wv * x[r * Kp + k];
        }
    }
    for (int r = 0; r < rt; r++)
        out[r * N] = tail[r] + _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#elif defined(__AVX2__)
static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

static inline __attribute__((always_inline)) void col_prescaled(
    const int bits, const int rt, const uint8_t *q, const float *s, const float *x,
    int64_t Kp, int64_t group, float *out, int64_t N) {
    /* na independent sums per row, so that at least 8 FMA chains hide the FMA latency */
    const int na = rt >= 8 ? 1 : rt >= 4 ? 2 : 4;
    __m256 acc[RT][4];
    float tail[RT] = {0};
    for (int r = 0; r < rt; r++)
        for (int a = 0; a < na; a++) acc[r][a] = _mm256_setzero_ps();
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int64_t g = 0, k = 0; k < Kp; g++) {
        const __m256 sv = _mm256_set1_ps(s[g]), off = _mm256_set1_ps(-8.0f * s[g]);
        const int64_t k1 = k + group;
        PREFETCH_AT(s + g, PF_W / 8);
        for (; k + 32 <= k1; k += 32) {
            __m256 w[4];
            PREFETCH(q + (bits == 8 ? k : k / 2));
            if (bits == 8) {
                for (int j = 0; j < 4; j++)
                    w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                               _mm_loadl_epi64((const __m128i *)(q + k + 8 * j)))), sv);
            } else {
                __m128i v = _mm_loadu_si128((const __m128i *)(q + k / 2));
                __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
                w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), sv, off);
                w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                           _mm_srli_si128(lo, 8))), sv, off);
                w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), sv, off);
                w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                           _mm_srli_si128(hi, 8))), sv, off);
            }
            for (int r = 0; r < rt; r++) {
                const float *xr = x + r * Kp + k;
                for (int j = 0; j < 4; j++)
                    acc[r][j % na] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j),
                                                     acc[r][j % na]);
            }
        }
        for (; k < k1; k++) { /* int8 only: a group that is not a multiple of 32 */
            const float wv = (float)((const int8_t *)q)[k] * s[g];
            for (int r = 0; r < rt; r++) tail[r] += wv * x[r * Kp + k];
        }
    }
    for (int r = 0; r < rt; r++) {
        __m256 t = acc[r][0];
        for (int a = 1; a < na; a++) t = _mm256_add_ps(t, acc[r][a]);
        out[r * N] = tail[r] + hsum8(t);
    }
}

/* weights of 32 consecutive K as signed integers in float lanes, not yet scaled */
static inline __attribute__((always_inline)) void unpack32(const int bits, const uint8_t *q,
                                                          int64_t k, __m256 w[4]) {
    if (bits == 8) {
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                       _mm_loadl_epi64((const __m128i *)(q + k + 8 * j))));
    } else {
        const __m128i m4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
        __m128i v = _mm_loadu_si128((const __m128i *)(q + k / 2));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m4), eight);
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m4), eight);
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    }
}

/* up to 4 rows: sums of q * x per group, scaled once at the group's end (one FMA per
   row and group instead of one multiply per 8 weights); registers: rt * (na + 1) + 5 */
static inline __attribute__((always_inline)) void col_grouped(
    const int bits, const int rt, const uint8_t *q, const float *s, const float *x,
    int64_t Kp, int64_t group, float *out, int64_t N) {
    const int na = rt == 1 ? 4 : rt == 2 ? 4 : rt == 3 ? 2 : 1;
    __m256 tot[4], ga[4][4];
    float tail[4] = {0};
    for (int r = 0; r < rt; r++) tot[r] = _mm256_setzero_ps();
    for (int64_t g = 0, k = 0; k < Kp; g++) {
        const int64_t k1 = k + group;
        for (int r = 0; r < rt; r++)
            for (int a = 0; a < na; a++) ga[r][a] = _mm256_setzero_ps();
        PREFETCH_AT(s + g, PF_W / 8);
        for (; k + 32 <= k1; k += 32) {
            __m256 w[4];
            PREFETCH(q + (bits == 8 ? k : k / 2));
            unpack32(bits, q, k, w);
            for (int r = 0; r < rt; r++) {
                const float *xr = x + r * Kp + k;
                for (int j = 0; j < 4; j++)
                    ga[r][j % na] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j),
                                                    ga[r][j % na]);
            }
        }
        const __m256 sv = _mm256_set1_ps(s[g]);
        for (int r = 0; r < rt; r++) {
            __m256 t = ga[r][0];
            for (int a = 1; a < na; a++) t = _mm256_add_ps(t, ga[r][a]);
            tot[r] = _mm256_fmadd_ps(t, sv, tot[r]);
        }
        for (; k < k1; k++) { /* int8 only: a group that is not a multiple of 32 */
            const float wv = (float)((const int8_t *)q)[k] * s[g];
            for (int r = 0; r < rt; r++) tail[r] += wv * x[r * Kp + k];
        }
    }
    for (int r = 0; r < rt; r++) out[r * N] = tail[r] + hsum8(tot[r]);
}

static inline __attribute__((always_inline)) void col(
    const int bits, const int rt, const uint8_t *q, const float *s, const float *x,
    int64_t Kp, int64_t group, float *out, int64_t N) {
    if (rt <= 4) col_grouped(bits, rt, q, s, x, Kp, group, out, N);
    else col_prescaled(bits, rt, q, s, x, Kp, group, out, N);
}

#define HAVE_COL4 1
/* one activation row (decoding at batch 1) against 4 output columns at once: each x
   vector is loaded once for 4 weight rows, and the 4 columns are 4 independent chains */
static inline __attribute__((always_inline)) void col4_row1(
    const int bits, const uint8_t *q, int64_t rowb, const float *s, int64_t G,
    const float *x, int64_t Kp, int64_t group, float *out) {
    __m256 tot[4], ga[4];
    float tail[4] = {0};
    for (int c = 0; c < 4; c++) tot[c] = _mm256_setzero_ps();
    for (int64_t g = 0, k = 0; k < Kp; g++) {
        const int64_t k1 = k + group;
        for (int c = 0; c < 4; c++) ga[c] = _mm256_setzero_ps();
        for (; k + 32 <= k1; k += 32) {
            __m256 xv[4];
            for (int j = 0; j < 4; j++) xv[j] = _mm256_loadu_ps(x + k + 8 * j);
            for (int c = 0; c < 4; c++) {
                __m256 w[4];
                unpack32(bits, q + c * rowb, k, w);
                for (int j = 0; j < 4; j++) ga[c] = _mm256_fmadd_ps(w[j], xv[j], ga[c]);
            }
        }
        for (int c = 0; c < 4; c++)
            tot[c] = _mm256_fmadd_ps(ga[c], _mm256_set1_ps(s[c * G + g]), tot[c]);
        for (; k < k1; k++) /* int8 only: a group that is not a multiple of 32 */
            for (int c = 0; c < 4; c++)
                tail[c] += (float)((const int8_t *)(q + c * rowb))[k] * s[c * G + g] * x[k];
    }
    for (int c = 0; c < 4; c++) out[c] = tail[c] + hsum8(tot[c]);
}
#else
static inline __attribute__((always_inline)) void col(
    const int bits, const int rt, const uint8_t *q, const float *s, const float *x,
    int64_t Kp, int64_t group, float *out, int64_t N) {
    float acc[RT] = {0}, lane[RT][8] = {{0}};
    for (int64_t g = 0, k = 0; k < Kp; g++) {
        const float sc = s[g];
        const int64_t k1 = k + group;
        for (; k + 32 <= k1; k += 32) {
            float w[32];
            if (bits == 8) {
                for (int i = 0; i < 32; i++) w[i] = (float)((const int8_t *)q)[k + i] * sc;
            } else {
                const uint8_t *b = q + k / 2;
                for (int i = 0; i < 16; i++) {
                    w[i] = (float)((int)(b[i] & 15) - 8) * sc;
                    w[i + 16] = (float)((int)(b[i] >> 4) - 8) * sc;
                }
            }
            for (int r = 0; r < rt; r++) { /* 8 lanes of sums: the compiler can vectorise */
                const float *xr = x + r * Kp + k;
                for (int i = 0; i < 32; i++) lane[r][i % 8] += w[i] * xr[i];
            }
        }
        for (; k < k1; k++) { /* int8 only: a group that is not a multiple of 32 */
            const float wv = (float)((const int8_t *)q)[k] * s[g];
            for (int r = 0; r < rt; r++) acc[r] += wv * x[r * Kp + k];
        }
    }
    for (int r = 0; r < rt; r++) {
        float t = acc[r];
        for (int i = 0; i < 8; i++) t += lane[r][i];
        out[r * N] = t;
    }
}
#endif

#ifndef HAVE_COL4
#define HAVE_COL4 0
static inline void col4_row1(const int bits, const uint8_t *q, int64_t rowb, const float *s,
                             int64_t G, const float *x, int64_t Kp, int64_t group,
                             float *out) {
    (void)bits; (void)q; (void)rowb; (void)s; (void)G; (void)x; (void)Kp; (void)group;
    (void)out;
}
#endif

/* one specialised copy per (bits, rows in the pass): rt and bits are constants inside */
#define COLS(B)                                                                            \
    static void cols_##B(const uint8_t *q, const float *s, const float *x, int64_t R,     \
                         int64_t N, int64_t Kp, int64_t group, float *y, int64_t n0,      \
                         int64_t n1) {                                                     \
        const int64_t rowb = B == 8 ? Kp : Kp / 2, G = Kp / group;                         \
        int64_t n = n0;                                                                    \
        if (HAVE_COL4 && R == 1)                                                           \
            for (; n + 4 <= n1; n += 4)                                                    \
                col4_row1(B, q + n * rowb, rowb, s + n * G, G, x, Kp, group, y + n);       \
        for (; n < n1; n++)                                                                \
            for (int64_t r0 = 0; r0 < R; r0 += RT) {                                       \
                const uint8_t *qn = q + n * rowb;                                          \
                const float *sn = s + n * G, *xr = x + r0 * Kp;                            \
                float *o = y + r0 * N + n;                                                 \
                switch (R - r0 < RT ? R - r0 : RT) {                                       \
                case 1: col(B, 1, qn, sn, xr, Kp, group, o, N); break;                     \
                case 2: col(B, 2, qn, sn, xr, Kp, group, o, N); break;                     \
                case 3: col(B, 3, qn, sn, xr, Kp, group, o, N); break;                     \
                case 4: col(B, 4, qn, sn, xr, Kp, group, o, N); break;                     \
                case 5: col(B, 5, qn, sn, xr, Kp, group, o, N); break;                     \
                case 6: col(B, 6, qn, sn, xr, Kp, group, o, N); break;                     \
                case 7: col(B, 7, qn, sn, xr, Kp, group, o, N); break;                     \
                default: col(B, 8, qn, sn, xr, Kp, group, o, N); break;                    \
                }                                                                          \
            }                                                                              \
    }
COLS(8)
COLS(4)

#define NBLOCK 16 /* output columns per work item */

/* y[R, N] = x[R, Kp] @ dequant(q, s)^T on up to nthreads OpenMP threads (by column) */
void qg_gemm(int bits, const uint8_t *q, const float *s, const float *x, int64_t R, int64_t N,
             int64_t Kp, int64_t group, float *y, int nthreads) {
    const int64_t nblk = (N + NBLOCK - 1) / NBLOCK;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (nt > nblk) nt = (int)nblk;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t n0 = b * NBLOCK, n1 = n0 + NBLOCK < N ? n0 + NBLOCK : N;
        if (bits == 8) cols_8(q, s, x, R, N, Kp, group, y, n0, n1);
        else cols_4(q, s, x, R, N, Kp, group, y, n0, n1);
    }
}
"""

_VP, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "qg_isa": ([], _INT),
    "qg_gemm": ([_INT, _VP, _VP, _VP, _I64, _I64, _I64, _I64, _VP, _INT], None),
}
_by_isa: dict[str | None, ctypes.CDLL | None] = {}


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels for ``isa`` (default: the CPU's best, ``_native.select_isa``), built on
    first use; None (one warning) where they cannot be built. A level the CPU lacks
    crashes: callers pass only levels from ``_native.supported_isas()``."""
    if isa not in _by_isa:
        _by_isa[isa] = open_library("qgemv", SOURCE, SIGNATURES, "int8/int4 GEMV", isa=isa,
                                    extra_flags=["-fopenmp"])
    return _by_isa[isa]
