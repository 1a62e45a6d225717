"""float32 weights times float32 activations: the C that ``_fused_c``'s decode step builds in.

Why register tiles: a step of many rows (a serving batch, a prompt chunk) multiplies each
row by the same weight rows, which stay in L1 / L2 between rows, so the product is bound
by arithmetic. A dot product per (row, output) with one 16-lane accumulator, summed
across its lanes at the end, spends as much on that horizontal sum as on the
multiply-adds at the usual widths (128-1024); summed lane by lane in C order (no
``-ffast-math``), it is a chain of 32 dependent scalar adds, about 128 cycles per output.
Here a tile of up to 4 weight rows times up to 4 (AVX-512) or 2 (AVX2) activation rows
keeps one vector accumulator per pair: each k-step loads each weight and activation
vector once for the whole tile, and the tile's sums are reduced together by a tree of
horizontal adds, four outputs per reduction.

Every output's arithmetic is the same whatever tile it falls in (its lanes are
accumulated over k in order, the tail of K masked, and reduced by the same tree), so a
row gets bitwise the same result alone, in a batch, or in a prompt chunk.

``fd_f32`` runs one product, for the tests.
"""

SOURCE = r"""
#if defined(__AVX512F__)
#define F32_ROWS 4
#define F32_W 16
typedef __m512 f32v;
#elif defined(__AVX2__)
#define F32_ROWS 2
#define F32_W 8
typedef __m256 f32v;
#endif

#if defined(__AVX2__)
/* the four sums of a, b, c, d's eight lanes: (l0 + l1) + (l2 + l3) + ((l4 + l5) + (l6 + l7))
   for each, wherever it sits in the call */
static inline __m128 f32_sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

#if defined(__AVX512F__)
static inline __m256 f32_fold(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
static inline f32v f32_load(const float *p, int64_t n) {  /* n < 16: the rest are zeros */
    return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline f32v f32_load_h(const uint16_t *p, int64_t n) {  /* float16, widened */
    return _mm512_cvtph_ps(n >= 16 ? _mm256_loadu_si256((const __m256i *)p)
                                   : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p));
}
#define f32_fma _mm512_fmadd_ps
#define f32_zero _mm512_setzero_ps
#else
static inline __m256 f32_fold(__m256 v) { return v; }
static inline f32v f32_load(const float *p, int64_t n) {  /* n < 8: the rest are zeros */
    if (n >= 8) return _mm256_loadu_ps(p);
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx));
}
static inline f32v f32_load_h(const uint16_t *p, int64_t n) {  /* float16, widened */
    if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    uint16_t b[8] = {0};
    for (int64_t i = 0; i < n; i++) b[i] = p[i];
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
}
#define f32_fma _mm256_fmadd_ps
#define f32_zero _mm256_setzero_ps
#endif

/* nr activation rows (x, row stride K) times nc weight rows (w, row stride K; float16
   with wh): y[r * N + j] for r < nr, j < nc; nr, nc and wh are constants where this is
   inlined */
static inline __attribute__((always_inline)) void f32_tile(
    const int wh, const int nr, const int nc, const void *w, const float *x, int64_t K,
    float *y, int64_t N) {
    f32v acc[F32_ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = f32_zero();
    for (int64_t k = 0; k < K; k += F32_W) {
        const int64_t n = K - k;
        f32v wv[4];
        for (int j = 0; j < nc; j++)
            wv[j] = wh ? f32_load_h((const uint16_t *)w + j * K + k, n)
                       : f32_load((const float *)w + j * K + k, n);
        for (int r = 0; r < nr; r++) {
            const f32v xv = f32_load(x + r * K + k, n);
            for (int j = 0; j < nc; j++) acc[r][j] = f32_fma(wv[j], xv, acc[r][j]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float s[4];
        _mm_storeu_ps(s, f32_sum4(f32_fold(acc[r][0]), f32_fold(acc[r][1]),
                                  f32_fold(acc[r][2]), f32_fold(acc[r][3])));
        for (int j = 0; j < nc; j++) y[r * N + j] = s[j];
    }
}

/* nr rows against columns [n0, n1), four at a time (the last 1-3 alone) */
static inline __attribute__((always_inline)) void f32_rows(
    const int wh, const int nr, const void *w, const float *x, int64_t N, int64_t K,
    float *y, int64_t n0, int64_t n1) {
    const int64_t es = wh ? 2 : 4;   /* bytes a weight */
    const char *wb = (const char *)w;
    int64_t c = n0;
    for (; c + 4 <= n1; c += 4) f32_tile(wh, nr, 4, wb + c * K * es, x, K, y + c, N);
    switch (n1 - c) {
        case 3: f32_tile(wh, nr, 3, wb + c * K * es, x, K, y + c, N); break;
        case 2: f32_tile(wh, nr, 2, wb + c * K * es, x, K, y + c, N); break;
        case 1: f32_tile(wh, nr, 1, wb + c * K * es, x, K, y + c, N); break;
        default: break;
    }
}
#endif

/* y[r, c] = x[r] . w[c] for r < R and c in [n0, n1): weights [n, K] float32, or float16
   with wh (a cache's keys) */
static inline __attribute__((always_inline)) void cols_any(
    const int wh, const void *w, const float *x, int64_t R, int64_t N, int64_t K, float *y,
    int64_t n0, int64_t n1) {
#if defined(__AVX2__)
    int64_t r = 0;
    for (; r + F32_ROWS <= R; r += F32_ROWS)
        f32_rows(wh, F32_ROWS, w, x + r * K, N, K, y + r * N, n0, n1);
    switch (R - r) {
#if F32_ROWS == 4
        case 3: f32_rows(wh, 3, w, x + r * K, N, K, y + r * N, n0, n1); break;
        case 2: f32_rows(wh, 2, w, x + r * K, N, K, y + r * N, n0, n1); break;
#endif
        case 1: f32_rows(wh, 1, w, x + r * K, N, K, y + r * N, n0, n1); break;
        default: break;
    }
#else   /* 16 lanes a row, summed by a fixed tree the compiler can vectorise */
    for (int64_t c = n0; c < n1; c++) {
        for (int64_t r = 0; r < R; r++) {
            const float *xr = x + r * K;
            float lane[16] = {0};
            for (int64_t k = 0; k < K; k += 16)
                for (int i = 0; i < 16 && k + i < K; i++)
                    lane[i] += (wh ? h2f(((const uint16_t *)w)[c * K + k + i])
                                   : ((const float *)w)[c * K + k + i]) * xr[k + i];
            for (int h = 8; h; h >>= 1)
                for (int i = 0; i < h; i++) lane[i] += lane[i + h];
            y[r * N + c] = lane[0];
        }
    }
#endif
}

static void cols_f(const float *w, const float *x, int64_t R, int64_t N, int64_t K,
                   float *y, int64_t n0, int64_t n1) {
    cols_any(0, w, x, R, N, K, y, n0, n1);
}

static void cols_fh(const uint16_t *w, const float *x, int64_t R, int64_t N, int64_t K,
                    float *y, int64_t n0, int64_t n1) {
    cols_any(1, w, x, R, N, K, y, n0, n1);
}

/* y[R, N] = x[R, K] @ w[N, K]^T (the tests hold cols_f to a reference with it) */
void fd_f32(const float *w, const float *x, int64_t R, int64_t N, int64_t K, float *y) {
    cols_f(w, x, R, N, K, y, 0, N);
}
"""
