"""int4 weights times 8-bit activations: the C that ``_fused_c``'s decode step builds in.

Why: with float activations an int4 GEMV widens every nibble to a float and scales it
before the product, about 14 vector operations per 32 weights, and it is bound by that
arithmetic rather than by the bytes it reads. Rounding the activations to 8 bits in
blocks of 32 (llama.cpp's Q8_0: d = max|x| / 127, q = round(x / d)) turns a block's
product into one integer dot product of the unsigned nibbles and the signed activations
(AVX-512 VNNI ``vpdpbusd``, four groups per 512-bit pass; AVX2 ``vpmaddubsw`` +
``vpmaddwd``, which cannot saturate: 15 x 127 x 2 fits 16 bits; portable C), scaled once
by the weight's and the block's scales. The nibbles are stored q + 8; the +8 comes off
once per output as sum_g s_w[g] * 8 d[g] sum(q_x[g]). One load of nibbles brings the
first 16 weights of each of its groups in its low nibbles and the last 16 in its high
ones, so the activation blocks are stored in that order: in quads where 512-bit VNNI
passes take four groups at once, in pairs for the 256-bit passes (``q8_pos``).

``fd_q4q8`` runs one product, for the tests.
"""

SOURCE = r"""
#include <math.h>

#include <stdint.h>

/* an activation matrix [R, kp] as a product reads it: float32, and with act8 its 8-bit
   blocks (q [R, kp], d and c [R, kp / 32]) */
typedef struct {
    const float *x;
    const int8_t *q;
    const float *d, *c;
} fd_act;

static inline fd_act act_at(const float *x, const int8_t *q, const float *d, const float *c,
                            int64_t off) {
    fd_act a = {x + off, q ? q + off : 0, q ? d + off / 32 : 0, q ? c + off / 32 : 0};
    return a;
}

/* Where the 8-bit activation blocks lie in a row of nblk blocks. The products read a
   block's first 16 and last 16 values apart, in the order the weights' halves come:
   - where 512-bit VNNI passes run (QUAD8), blocks go in quads from the row's first: a
     quad's 128 bytes hold the first 16 of each of its four blocks, then the last 16 of
     each (the low and high nibbles of one 64-byte load of four int4 groups);
   - the blocks after the last whole quad (all of them elsewhere) go in pairs, 64 bytes:
     the first 16 of each, then the last 16 of each (two int4 groups in one 32-byte
     load); a last odd block alone, in natural order.
   The position depends only on the block's index and the row's length, so a row may be
   quantized in any pieces, by any threads. */
#if defined(__AVX2__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QUAD8 1
#else
#define QUAD8 0
#endif
static inline int64_t q8_whole_quads(int64_t nblk) { return QUAD8 ? nblk & ~(int64_t)3 : 0; }

static inline int64_t q8_pos(int64_t b, int64_t nblk, int i) {
    const int64_t full = q8_whole_quads(nblk), lo = i < 16 ? i : i - 16;
    if (b < full)
        return (b & ~(int64_t)3) * 32 + (i < 16 ? 0 : 64) + (b & 3) * 16 + lo;
    const int64_t bl = b - full, rem = nblk - full;
    if ((bl | 1) >= rem)  /* a last odd block */
        return b * 32 + i;
    return (full + (bl & ~(int64_t)1)) * 32 + (i < 16 ? 0 : 32) + (bl & 1) * 16 + lo;
}

/* blocks [b0, b1) of a row of nblk blocks of 32 activations (x its first value) to 8 bits,
   as llama.cpp's Q8_0: d = max|x| / 127, q = round(x / d) (to nearest even, as lrintf),
   each block's two halves at q8_pos in the row's q; c = 8 * d * sum(q) is what the +8 of
   the int4 nibbles adds to a block's product */
static void quant8(const float *x, int64_t nblk, int64_t b0, int64_t b1, int8_t *q, float *d,
                   float *c) {
    for (int64_t b = b0; b < b1; b++) {
        const float *xb = x + b * 32;
        int8_t *lo = q + q8_pos(b, nblk, 0), *hi = q + q8_pos(b, nblk, 16);
        int sum = 0;
        float amax = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
        const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        _mm_storeu_si128((__m128i *)lo, _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)hi, _mm512_cvtsepi32_epi8(i1));
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < 32; i++) {
            const int v = (int)lrintf(xb[i] * inv);
            (i < 16 ? lo : hi - 16)[i] = (int8_t)v;
            sum += v;
        }
#endif
        d[b] = amax / 127.0f;
        c[b] = 8.0f * d[b] * (float)sum;
    }
}

/* int4 weights in groups of 32 (the nibble layout of ``_qgemv_c``, stored q + 8) times
   8-bit activation blocks: per block an integer dot product of the unsigned nibbles and
   the signed activations (one instruction with AVX-512 VNNI, two with AVX2), scaled
   once by s_w * d_x; the nibbles' +8 is taken off once per output through c */
#if defined(__AVX2__)
static inline float fd_hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

/* the sums of 4 adjacent products of u (unsigned, <= 15) and x (signed) */
static inline __m256i dot_u4s8(__m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else   /* u <= 15, |x| <= 127: a pair's sum fits int16 without saturating */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

#endif

/* sum over blocks [0, n) of s[i] * c[i] (s NULL: of c[i]): the correction an offset in the
   weights' integers (the int4 nibbles' +8, the int8 flip's +128) adds to a product */
static inline float scaled_csum(const float *s, const float *c, int64_t n) {
    float t = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 v = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 c16 = _mm512_loadu_ps(c + i);
        v = s ? _mm512_fmadd_ps(_mm512_loadu_ps(s + i), c16, v) : _mm512_add_ps(v, c16);
    }
    t = _mm512_reduce_add_ps(v);
#elif defined(__AVX2__)
    __m256 v = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 c8 = _mm256_loadu_ps(c + i);
        v = s ? _mm256_fmadd_ps(_mm256_loadu_ps(s + i), c8, v) : _mm256_add_ps(v, c8);
    }
    t = fd_hsum8(v);
#endif
    for (; i < n; i++) t += (s ? s[i] : 1.0f) * c[i];
    return t;
}

/* one weight row (nibbles qc, group scales sc) against one 8-bit activation row, from
   group g on (the 256-bit passes and the portable loop; exact, no +8 correction) */
static inline float q4q8_from(const uint8_t *qc, const float *sc, int64_t G, int64_t g,
                              const int8_t *xq, const float *xd) {
    float tot = 0.0f;
#if defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    /* two groups a pass: lanes 0-3 of the integer sums are group g's, 4-7 g+1's */
    for (int p = 0; g + 2 <= G; g += 2, p ^= 1) {
        PREFETCH(qc + g * 16);
        if (!(g & 14)) PREFETCH_AT(sc + g, PF_W / 4);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qc + g * 16));
        const __m256i dlo = dot_u4s8(_mm256_and_si256(v, m4),
                                     _mm256_loadu_si256((const __m256i *)(xq + g * 32)));
        const __m256i dhi = dot_u4s8(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                     _mm256_loadu_si256((const __m256i *)(xq + g * 32 + 32)));
        const __m128 sw = _mm_castpd_ps(_mm_load_sd((const double *)(sc + g)));
        const __m128 sx = _mm_castpd_ps(_mm_load_sd((const double *)(xd + g)));
        const __m256 s8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(sw, sx)), lanes);
        acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(dlo, dhi)), s8, acc[p]);
    }
    if (g < G) {  /* a last group alone, in natural order */
        const __m128i v0 = _mm_loadu_si128((const __m128i *)(qc + g * 16));
        const __m128i m4x = _mm_set1_epi8(0x0F);
        const __m256i u0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v0, 4), m4x),
                                            _mm_and_si128(v0, m4x));
        const __m256i d0 = dot_u4s8(u0, _mm256_loadu_si256((const __m256i *)(xq + g * 32)));
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(sc[g] * xd[g]), acc[0]);
    }
    tot = fd_hsum8(_mm256_add_ps(acc[0], acc[1]));
#else
    for (; g + 2 <= G; g += 2) {
        int d0 = 0, d1 = 0;
        for (int i = 0; i < 16; i++) {
            const uint8_t b0 = qc[g * 16 + i], b1 = qc[g * 16 + 16 + i];
            d0 += (b0 & 15) * xq[g * 32 + i] + (b0 >> 4) * xq[g * 32 + 32 + i];
            d1 += (b1 & 15) * xq[g * 32 + 16 + i] + (b1 >> 4) * xq[g * 32 + 48 + i];
        }
        tot += (float)d0 * sc[g] * xd[g] + (float)d1 * sc[g + 1] * xd[g + 1];
    }
    if (g < G) {
        int d0 = 0;
        for (int i = 0; i < 16; i++) {
            const uint8_t b = qc[g * 16 + i];
            d0 += (b & 15) * xq[g * 32 + i] + (b >> 4) * xq[g * 32 + 16 + i];
        }
        tot += (float)d0 * sc[g] * xd[g];
    }
#endif
    return tot;
}

/* one weight row against nr (1-4) activation rows r0.. of a: y[r * N] for each; the
   weight's nibbles are loaded and unpacked once for all nr rows (on 512-bit vectors, four
   groups a pass), each row keeps its own sums, so nr independent chains hide the latency
   of the integer product, the conversion and the FMA */
static inline __attribute__((always_inline)) void q4q8_rows(
    const int nr, const uint8_t *qc, const float *sc, int64_t G, const fd_act *a, int64_t r0,
    int64_t Kp, float *y, int64_t N) {
    float tot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(__AVX2__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    int64_t g = 0;
    {   /* four groups a pass over the whole quads: one 64-byte load of nibbles, its low
           nibbles against the quad's first 64 bytes, its high against the last 64; lanes
           4i..4i+3 of the integer sums are group g+i's */
        const __m512i m4z = _mm512_set1_epi8(0x0F);
        const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        __m512 acc[4];
        for (int j = 0; j < nr; j++) acc[j] = _mm512_setzero_ps();
        for (const int64_t full = q8_whole_quads(G); g < full; g += 4) {
            PREFETCH(qc + g * 16);
            if (!(g & 12)) PREFETCH_AT(sc + g, PF_W / 4);
            const __m512i v = _mm512_loadu_si512((const void *)(qc + g * 16));
            const __m512i lo = _mm512_and_si512(v, m4z);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4z);
            const __m128 sw = _mm_loadu_ps(sc + g);
            for (int j = 0; j < nr; j++) {
                const int8_t *xp = a->q + (r0 + j) * Kp + g * 32;
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                _mm512_loadu_si512((const void *)xp));
                d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512((const void *)(xp + 64)));
                const __m128 s4 = _mm_mul_ps(sw, _mm_loadu_ps(a->d + (r0 + j) * (Kp / 32) + g));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d),
                                         _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(s4)),
                                         acc[j]);
            }
        }
        for (int j = 0; j < nr; j++) tot[j] = _mm512_reduce_add_ps(acc[j]);
    }
    for (int j = 0; j < nr && g < G; j++) {
        const int64_t r = r0 + j;
        tot[j] += q4q8_from(qc, sc, G, g, a->q + r * Kp, a->d + r * (Kp / 32));
    }
#else
    for (int j = 0; j < nr; j++) {
        const int64_t r = r0 + j;
        tot[j] = q4q8_from(qc, sc, G, 0, a->q + r * Kp, a->d + r * (Kp / 32));
    }
#endif
    /* the nibbles' +8 over every group */
    for (int j = 0; j < nr; j++)
        y[(r0 + j) * N] = tot[j] - scaled_csum(sc, a->c + (r0 + j) * (Kp / 32), G);
}

static void cols_4q8(const uint8_t *q, const float *s, const fd_act *a, int64_t R, int64_t N,
                     int64_t Kp, float *y, int64_t n0, int64_t n1) {
    const int64_t G = Kp / 32, rowb = Kp / 2;
    for (int64_t c = n0; c < n1; c++) {
        const uint8_t *qc = q + c * rowb;
        const float *sc = s + c * G;
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) q4q8_rows(4, qc, sc, G, a, r, Kp, y + c, N);
        switch (R - r) {
            case 3: q4q8_rows(3, qc, sc, G, a, r, Kp, y + c, N); break;
            case 2: q4q8_rows(2, qc, sc, G, a, r, Kp, y + c, N); break;
            case 1: q4q8_rows(1, qc, sc, G, a, r, Kp, y + c, N); break;
            default: break;
        }
    }
}

/* y[R, N] = x[R, kp] @ W^T for int4 weights in groups of 32 on 8-bit activation blocks
   (the tests hold cols_4q8 to a reference with it) */
void fd_q4q8(const uint8_t *q, const float *s, const float *x, int64_t R, int64_t N,
             int64_t Kp, int8_t *xq, float *xd, float *xc, float *y) {
    for (int64_t r = 0; r < R; r++)
        quant8(x + r * Kp, Kp / 32, 0, Kp / 32, xq + r * Kp, xd + r * Kp / 32, xc + r * Kp / 32);
    const fd_act a = {x, xq, xd, xc};
    cols_4q8(q, s, &a, R, N, Kp, y, 0, N);
}

"""
