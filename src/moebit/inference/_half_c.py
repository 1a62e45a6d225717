"""float16 keys and values for the native step: the C that ``_fused_c`` builds in.

Why: at a decode step each row reads its whole key/value cache once per layer, and past a
few hundred positions those reads outweigh the weights' (a serving batch of 32 rows at
300 positions reads 30 MB of float32 keys and values a step on the serving benchmark's
model, against 14 MB of weights). A float16 cache (``--kv-cache float16``, llama.cpp's
default) halves them. Keys and values are rounded to float16 once, where the step writes
them (round to nearest even, as torch's ``.half()``), and widened to float32 where they
are read; all arithmetic stays float32.

Conversions: F16C (``vcvtps2ph`` / ``vcvtph2ps``) in AVX2 and AVX-512 builds, scalar and
vector alike, and the same rounding in portable C (Giesen's float_to_half_fast3_rtne).
``fd_to_half`` / ``fd_from_half`` convert arrays, for the tests.
"""

SOURCE = r"""
#include <string.h>

static inline uint16_t f2h(float f) {
#if defined(__AVX2__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else   /* round to nearest even; overflow to inf; NaN to a quiet NaN */
    const uint32_t inf32 = 255u << 23, max16 = (127u + 16u) << 23;
    const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint16_t o;
    if (u >= max16) {
        o = u > inf32 ? 0x7e00 : 0x7c00;
    } else if (u < (113u << 23)) {   /* a subnormal half or zero: let a float add round */
        float fu, fm;
        memcpy(&fu, &u, 4);
        memcpy(&fm, &magic, 4);
        fu += fm;
        memcpy(&u, &fu, 4);
        o = (uint16_t)(u - magic);
    } else {
        const uint32_t odd = (u >> 13) & 1u;
        u += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
        o = (uint16_t)(u >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
#endif
}

static inline float h2f(uint16_t h) {
#if defined(__AVX2__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    float f;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        u = sign | ((e + 112u) << 23) | (m << 13);
    } else {   /* zero or subnormal: m * 2^-24 is exact in float */
        f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* dst[i] = float16(src[i]) for i < n */
static void store_half(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = f2h(src[i]);
}

/* acc[i] += p * v[i] for i < n, v float16 */
static inline void axpy_half(float *restrict acc, float p, const uint16_t *restrict v,
                             int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 pv = _mm512_set1_ps(p);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(v + i))), _mm512_loadu_ps(acc + i)));
#elif defined(__AVX2__)
    const __m256 pv = _mm256_set1_ps(p);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(v + i))), _mm256_loadu_ps(acc + i)));
#endif
    for (; i < n; i++) acc[i] += p * h2f(v[i]);
}

void fd_to_half(const float *x, uint16_t *y, int64_t n) { store_half(x, y, n); }

void fd_from_half(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = 0.0f;
    axpy_half(y, 1.0f, x, n);
}
"""
