"""int8 weights times 8-bit activations: the C that ``_fused_c``'s decode step builds in.

Why: with float activations an int8 product sign-extends and converts every weight to a
float and multiplies it per activation row, so at a batch of rows it is bound by that
arithmetic, not by the bytes it reads. With the activations rounded to 8 bits in blocks
of 32 (``_q4q8_c``'s ``quant8``: llama.cpp's Q8_0) a block's product is one integer dot
product, scaled once: llama.cpp's Q8_0 x Q8_0 arithmetic.

Signed times signed: AVX-512 VNNI multiplies unsigned by signed bytes, so the weights are
flipped to unsigned on load (w + 128: one xor with 0x80) and the +128 comes off once per
output through the activation blocks' sums, ``quant8``'s c = 8 d sum(q) times 16. The
256-bit passes instead take llama.cpp's sign trick (|x| times w with x's sign), which is
exact with no correction and which ``vpmaddubsw`` cannot saturate: 127 x 127 x 2 fits 16
bits (weights are quantized to [-127, 127]). Weights are in natural order; the
activation blocks are stored as ``_q4q8_c.q8_pos`` lays them out (the first 16 of each
block of a quad or pair, then the last 16 of each), so the weights' 16-byte lanes are
shuffled into that order before the product.

Scales: one per 32 weights (group 32) or one per output channel (``pc``: the block
products are summed with the activation scales only and scaled once at the end).

``fd_q8q8`` runs one product, for the tests.
"""

SOURCE = r"""
#if defined(__AVX2__)
/* the sums of 4 adjacent products of signed bytes w and x (|w|, |x| <= 127) */
static inline __m256i dot_s8s8(__m256i w, __m256i x) {
    return dot_u4s8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
}
#endif

/* one int8 weight row (w, scales sc: per block of 32, or none with pc) against one 8-bit
   activation row from block g on: the 256-bit passes (sign trick) and the portable loop;
   exact, no correction; with pc the sum is not yet scaled by the row's one scale */
static inline float q8q8_from(const int8_t *w, const float *sc, int pc, int64_t G, int64_t g,
                              const int8_t *xq, const float *xd) {
    float tot = 0.0f;
#if defined(__AVX2__)
    {   /* two blocks a pass, in the pairs' order: lanes 0-3 block g's, 4-7 g+1's */
        const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
        __m256 acc = _mm256_setzero_ps();
        for (; g + 2 <= G; g += 2) {
            const int8_t *wp = w + g * 32;
            PREFETCH(wp);
            if (!pc && !(g & 14)) PREFETCH_AT(sc + g, PF_W / 8);
            const __m256i wlo = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(wp + 32)),
                                                 _mm_loadu_si128((const __m128i *)wp));
            const __m256i whi = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(wp + 48)),
                                                 _mm_loadu_si128((const __m128i *)(wp + 16)));
            const __m256i d = _mm256_add_epi32(
                dot_s8s8(wlo, _mm256_loadu_si256((const __m256i *)(xq + g * 32))),
                dot_s8s8(whi, _mm256_loadu_si256((const __m256i *)(xq + g * 32 + 32))));
            __m128 s2 = _mm_castpd_ps(_mm_load_sd((const double *)(xd + g)));
            if (!pc) s2 = _mm_mul_ps(s2, _mm_castpd_ps(_mm_load_sd((const double *)(sc + g))));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                                  _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s2), lanes), acc);
        }
        if (g < G) {  /* a last block alone, in natural order */
            const __m256i d = dot_s8s8(_mm256_loadu_si256((const __m256i *)(w + g * 32)),
                                       _mm256_loadu_si256((const __m256i *)(xq + g * 32)));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                                  _mm256_set1_ps(pc ? xd[g] : xd[g] * sc[g]), acc);
        }
        tot = fd_hsum8(acc);
    }
#else
    for (; g + 2 <= G; g += 2) {
        const int8_t *w0 = w + g * 32, *w1 = w0 + 32, *x = xq + g * 32;
        int d0 = 0, d1 = 0;
        for (int i = 0; i < 16; i++) {
            d0 += w0[i] * x[i] + w0[16 + i] * x[32 + i];
            d1 += w1[i] * x[16 + i] + w1[16 + i] * x[48 + i];
        }
        tot += (float)d0 * xd[g] * (pc ? 1.0f : sc[g]) + (float)d1 * xd[g + 1] * (pc ? 1.0f : sc[g + 1]);
    }
    if (g < G) {
        int d0 = 0;
        for (int i = 0; i < 32; i++) d0 += w[g * 32 + i] * xq[g * 32 + i];
        tot += (float)d0 * xd[g] * (pc ? 1.0f : sc[g]);
    }
#endif
    return tot;
}

/* one weight row against nr (1-4) activation rows r0.. of a: y[r * N] for each; the
   weights are loaded, reordered and flipped once for all nr rows (on 512-bit vectors,
   four blocks a pass), each row keeps its own sums */
static inline __attribute__((always_inline)) void q8q8_rows(
    const int nr, const int8_t *w, const float *sc, int pc, int64_t G, const fd_act *a,
    int64_t r0, int64_t Kp, float *y, int64_t N) {
    float tot[4] = {0.0f, 0.0f, 0.0f, 0.0f}, corr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t g = 0;
#if defined(__AVX2__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    {   /* four blocks a pass over the whole quads: the weights' first 16 of each block
           (16-byte lanes 0 and 2 of both loads) against the quad's first 64 bytes, their
           last 16 against the last 64; lanes 4i..4i+3 of the sums are block g+i's; the
           flip's +128 comes off through c */
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        __m512 acc[4];
        for (int j = 0; j < nr; j++) acc[j] = _mm512_setzero_ps();
        for (const int64_t full = q8_whole_quads(G); g < full; g += 4) {
            PREFETCH(w + g * 32);
            PREFETCH(w + g * 32 + 64);
            if (!pc && !(g & 12)) PREFETCH_AT(sc + g, PF_W / 8);
            const __m512i l0 = _mm512_loadu_si512((const void *)(w + g * 32));
            const __m512i l1 = _mm512_loadu_si512((const void *)(w + g * 32 + 64));
            const __m512i ua = _mm512_xor_si512(_mm512_shuffle_i64x2(l0, l1, 0x88), flip);
            const __m512i ub = _mm512_xor_si512(_mm512_shuffle_i64x2(l0, l1, 0xDD), flip);
            const __m128 sw = pc ? _mm_set1_ps(1.0f) : _mm_loadu_ps(sc + g);
            for (int j = 0; j < nr; j++) {
                const int8_t *xp = a->q + (r0 + j) * Kp + g * 32;
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ua,
                                                _mm512_loadu_si512((const void *)xp));
                d = _mm512_dpbusd_epi32(d, ub, _mm512_loadu_si512((const void *)(xp + 64)));
                const __m512 sz = _mm512_castps128_ps512(
                    _mm_mul_ps(sw, _mm_loadu_ps(a->d + (r0 + j) * (Kp / 32) + g)));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(quad, sz),
                                         acc[j]);
            }
        }
        for (int j = 0; j < nr; j++) {  /* the flip's +128 over blocks [0, g): 16 c each */
            tot[j] = _mm512_reduce_add_ps(acc[j]);
            corr[j] = 16.0f * scaled_csum(pc ? 0 : sc, a->c + (r0 + j) * (Kp / 32), g);
        }
    }
#endif
    for (int j = 0; j < nr; j++) {
        const int64_t r = r0 + j;
        float t = tot[j] - corr[j];
        if (g < G) t += q8q8_from(w, sc, pc, G, g, a->q + r * Kp, a->d + r * (Kp / 32));
        y[r * N] = pc ? sc[0] * t : t;
    }
}

static void cols_8q8(const int8_t *q, const float *s, int pc, const fd_act *a, int64_t R,
                     int64_t N, int64_t Kp, float *y, int64_t n0, int64_t n1) {
    const int64_t G = Kp / 32, sn = pc ? 1 : G;
    for (int64_t c = n0; c < n1; c++) {
        const int8_t *wc = q + c * Kp;
        const float *sc = s + c * sn;
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) q8q8_rows(4, wc, sc, pc, G, a, r, Kp, y + c, N);
        switch (R - r) {
            case 3: q8q8_rows(3, wc, sc, pc, G, a, r, Kp, y + c, N); break;
            case 2: q8q8_rows(2, wc, sc, pc, G, a, r, Kp, y + c, N); break;
            case 1: q8q8_rows(1, wc, sc, pc, G, a, r, Kp, y + c, N); break;
            default: break;
        }
    }
}

/* y[R, N] = x[R, kp] @ W^T for int8 weights (scales per 32, or per channel with pc) on
   8-bit activation blocks (the tests hold cols_8q8 to a reference with it) */
void fd_q8q8(const int8_t *q, const float *s, int64_t pc, const float *x, int64_t R, int64_t N,
             int64_t Kp, int8_t *xq, float *xd, float *xc, float *y) {
    for (int64_t r = 0; r < R; r++)
        quant8(x + r * Kp, Kp / 32, 0, Kp / 32, xq + r * Kp, xd + r * Kp / 32, xc + r * Kp / 32);
    const fd_act a = {x, xq, xd, xc};
    cols_8q8(q, s, (int)pc, &a, R, N, Kp, y, 0, N);
}

"""
