"""A vector exp for the native step's SiLU and softmax: the C that ``_fused_c`` builds in.

Why: a decode step takes one exp per expert hidden unit (SiLU) and per attended
position (softmax), 32K a row a step on the decode benchmark's E=8 model. libm's scalar
``expf`` costs about as much as a 16-lane vector exp does for all 16, and it took 5-10%
of a step on 1-16 rows.

The vector exp is Cephes' ``expf``: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts,
so r is exact), e^r by its degree-7 polynomial, times 2^n. Its error is within 2 ulp of
``expf`` over the range where e^x is a normal float; inputs are clamped to that range
(e^x for x < -87.3 gives about 1e-38 rather than a denormal or 0, which no SiLU or
softmax weight tells apart). Portable builds keep libm's ``expf``.
"""

SOURCE = r"""
#if defined(__AVX2__)
#if defined(__AVX512F__)
#define VX_W 16
typedef __m512 vxf;
#define vx_set1 _mm512_set1_ps
#define vx_load _mm512_loadu_ps
#define vx_store _mm512_storeu_ps
#define vx_add _mm512_add_ps
#define vx_sub _mm512_sub_ps
#define vx_mul _mm512_mul_ps
#define vx_div _mm512_div_ps
#define vx_fma _mm512_fmadd_ps
#define vx_fnma _mm512_fnmadd_ps
#define vx_min _mm512_min_ps
#define vx_max _mm512_max_ps
#define vx_round(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vxf vx_pow2(vxf p, vxf n) { return _mm512_scalef_ps(p, n); }
static inline float vx_hsum(vxf v) { return _mm512_reduce_add_ps(v); }
#else
#define VX_W 8
typedef __m256 vxf;
#define vx_set1 _mm256_set1_ps
#define vx_load _mm256_loadu_ps
#define vx_store _mm256_storeu_ps
#define vx_add _mm256_add_ps
#define vx_sub _mm256_sub_ps
#define vx_mul _mm256_mul_ps
#define vx_div _mm256_div_ps
#define vx_fma _mm256_fmadd_ps
#define vx_fnma _mm256_fnmadd_ps
#define vx_min _mm256_min_ps
#define vx_max _mm256_max_ps
#define vx_round(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vxf vx_pow2(vxf p, vxf n) {  /* n in [-126, 127]: 2^n built in the exponent */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline float vx_hsum(vxf v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}
#endif

static inline vxf vx_exp(vxf x) {
    x = vx_min(vx_max(x, vx_set1(-87.3f)), vx_set1(88.3f));
    const vxf n = vx_round(vx_mul(x, vx_set1(1.44269504088896341f)));
    vxf r = vx_fnma(n, vx_set1(0.693359375f), x);
    r = vx_fnma(n, vx_set1(-2.12194440e-4f), r);
    vxf p = vx_set1(1.9875691500E-4f);
    p = vx_fma(p, r, vx_set1(1.3981999507E-3f));
    p = vx_fma(p, r, vx_set1(8.3334519073E-3f));
    p = vx_fma(p, r, vx_set1(4.1665795894E-2f));
    p = vx_fma(p, r, vx_set1(1.6666665459E-1f));
    p = vx_fma(p, r, vx_set1(5.0000001201E-1f));
    p = vx_fma(p, vx_mul(r, r), vx_add(r, vx_set1(1.0f)));
    return vx_pow2(p, n);
}
#endif

/* h[i] = SiLU(g[i]) * u[i] = g / (1 + e^-g) * u for i < n (a last part vector through a
   padded copy, so every element gets the same arithmetic) */
static void silu_mul(const float *g, const float *u, float *h, int64_t n) {
#if defined(__AVX2__)
    const vxf one = vx_set1(1.0f), zero = vx_set1(0.0f);
    for (int64_t i = 0; i < n; i += VX_W) {
        const int64_t k = n - i < VX_W ? n - i : VX_W;
        float gb[VX_W] = {0}, ub[VX_W] = {0}, hb[VX_W];
        for (int64_t j = 0; j < k; j++) { gb[j] = g[i + j]; ub[j] = u[i + j]; }
        const vxf gv = k == VX_W ? vx_load(g + i) : vx_load(gb);
        const vxf uv = k == VX_W ? vx_load(u + i) : vx_load(ub);
        const vxf hv = vx_mul(vx_div(gv, vx_add(one, vx_exp(vx_sub(zero, gv)))), uv);
        if (k == VX_W) vx_store(h + i, hv);
        else { vx_store(hb, hv); for (int64_t j = 0; j < k; j++) h[i + j] = hb[j]; }
    }
#else
    for (int64_t i = 0; i < n; i++) h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
#endif
}

/* p[i] = e^(p[i] - mx) for i < n; returns their sum */
static float exp_shifted(float *p, int64_t n, float mx) {
    float den = 0.0f;
#if defined(__AVX2__)
    const vxf m = vx_set1(mx);
    vxf acc = vx_set1(0.0f);
    int64_t i = 0;
    for (; i + VX_W <= n; i += VX_W) {
        const vxf e = vx_exp(vx_sub(vx_load(p + i), m));
        vx_store(p + i, e);
        acc = vx_add(acc, e);
    }
    den = vx_hsum(acc);
    if (i < n) {
        float b[VX_W] = {0};
        for (int64_t j = i; j < n; j++) b[j - i] = p[j];
        vx_store(b, vx_exp(vx_sub(vx_load(b), m)));
        for (int64_t j = i; j < n; j++) { p[j] = b[j - i]; den += p[j]; }
    }
#else
    for (int64_t i = 0; i < n; i++) { p[i] = expf(p[i] - mx); den += p[i]; }
#endif
    return den;
}

/* vx_exp of n values, for the tests (libm's expf in portable builds) */
void fd_exp(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i];
    exp_shifted(y, n, 0.0f);
}
"""
