"""Native CPU kernels for the int8 wire format of the token all-to-all, compiled at first use.

Why native code: on a CPU host the int8 encode in torch takes eight passes over the rows
(abs, amax, divide, round, clamp, cast, then a ``cat`` with the scales) and the decode
four, about 1 ms each way for 512 rows of 256 values: as long as the int8 transfer itself
at 1 Gbit/s, and every rank pays it on every exchange. These loops do one pass per row
each way (absmax, scale, round half to even, pack the scale after the row's bytes), with
results identical to the torch path in ``moebit.comm.all_to_all`` (tested).

Built and cached by ``moebit.comm._native``, like the bit-packing kernels (same cache, same
``MOEBIT_NATIVE=0`` switch); without gcc ``load()`` returns None and the torch path runs.

Row layout: d int8 values, then the row's float32 scale (absmax / 127) in 4 bytes. A row
holding NaN or inf gets a non-finite scale and zero values, so it decodes to NaN rather
than to finite numbers that would hide the fault.
"""

from __future__ import annotations

import ctypes

import torch

from moebit.comm._native import open_library

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* the ISA level this library was compiled for (checked by the tests) */
int rq_isa(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

static inline float bf_to_f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}

/* round to nearest even, as torch's float -> bfloat16 cast (NaN -> 0x7fc0) */
static inline uint16_t f_to_bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* max |x| of a row; returns NaN when the row holds a NaN */
static float amax_f32(const float *x, int64_t d) {
    float m = 0.0f;
    int nan = 0;
    int64_t j = 0;
#if defined(__AVX2__)
    const __m256 absm8 = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 n0 = _mm256_setzero_ps(), n1 = _mm256_setzero_ps(), un = _mm256_setzero_ps();
    for (; j + 16 <= d; j += 16) {
        __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + 8);
        un = _mm256_or_ps(un, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q),
                                           _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
        n0 = _mm256_max_ps(n0, _mm256_and_ps(a, absm8));
        n1 = _mm256_max_ps(n1, _mm256_and_ps(b, absm8));
    }
    float t8[8];
    _mm256_storeu_ps(t8, _mm256_max_ps(n0, n1));
    for (int k = 0; k < 8; k++) m = t8[k] > m ? t8[k] : m;
    nan = _mm256_movemask_ps(un) != 0;
#endif
#ifdef __SSE2__
    const __m128 absm = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    __m128 m0 = _mm_setzero_ps(), m1 = _mm_setzero_ps(), u = _mm_setzero_ps();
    for (; j + 8 <= d; j += 8) {
        __m128 a = _mm_loadu_ps(x + j), b = _mm_loadu_ps(x + j + 4);
        u = _mm_or_ps(u, _mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)));
        m0 = _mm_max_ps(m0, _mm_and_ps(a, absm));
        m1 = _mm_max_ps(m1, _mm_and_ps(b, absm));
    }
    float t[4];
    _mm_storeu_ps(t, _mm_max_ps(m0, m1));
    for (int k = 0; k < 4; k++) m = t[k] > m ? t[k] : m;
    nan |= _mm_movemask_ps(u) != 0;
#endif
    for (; j < d; j++) {
        float a = fabsf(x[j]);
        if (a != a) nan = 1;
        m = a > m ? a : m;
    }
    return nan ? NAN : m;
}

/* bf16 -> float is exact: the bf16 bits are the float's top half */
static void widen_bf16(const uint16_t *x, int64_t m, float *out) {
    int64_t j = 0;
#ifdef __SSE2__
    const __m128i z = _mm_setzero_si128();
    for (; j + 8 <= m; j += 8) {
        __m128i v = _mm_loadu_si128((const __m128i *)(x + j));
        _mm_storeu_si128((__m128i *)(out + j), _mm_unpacklo_epi16(z, v));
        _mm_storeu_si128((__m128i *)(out + j + 4), _mm_unpackhi_epi16(z, v));
    }
#endif
    for (; j < m; j++) out[j] = bf_to_f(x[j]);
}

/* float -> bf16, round to nearest even; the vector part is for finite values only */
static void narrow_bf16(const float *x, int64_t m, int finite, uint16_t *out) {
    int64_t j = 0;
#ifdef __SSE2__
    const __m128i one = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7fff);
    const __m128i off = _mm_set1_epi32(0x8000), flip = _mm_set1_epi16((short)0x8000);
    for (; finite && j + 8 <= m; j += 8) {
        __m128i u = _mm_castps_si128(_mm_loadu_ps(x + j));
        __m128i v = _mm_castps_si128(_mm_loadu_ps(x + j + 4));
        u = _mm_add_epi32(u, _mm_add_epi32(bias, _mm_and_si128(_mm_srli_epi32(u, 16), one)));
        v = _mm_add_epi32(v, _mm_add_epi32(bias, _mm_and_si128(_mm_srli_epi32(v, 16), one)));
        /* shift down, centre on 0 so the signed pack does not saturate, undo the centring */
        u = _mm_sub_epi32(_mm_srli_epi32(u, 16), off);
        v = _mm_sub_epi32(_mm_srli_epi32(v, 16), off);
        _mm_storeu_si128((__m128i *)(out + j), _mm_xor_si128(_mm_packs_epi32(u, v), flip));
    }
#endif
    for (; j < m; j++) out[j] = f_to_bf(x[j]);
}

static inline int8_t q8(float v) {
    /* |v| <= 127 (plus rounding), so adding 1.5 * 2^23 rounds half to even, as torch.round */
    const float magic = 12582912.0f;
    return (int8_t)(int32_t)((v + magic) - magic);
}

/* q[j] = round_half_even(r[j] * inv), inv = 1 / scale; |r[j] * inv| <= 127 plus rounding */
static void quant_f32(const float *r, int64_t d, float inv, int8_t *q) {
    int64_t j = 0;
#if defined(__AVX2__)
    const __m256 sv8 = _mm256_set1_ps(inv);
    /* packs work within 128-bit lanes: this permutation puts the 32 bytes back in order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; j + 32 <= d; j += 32) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + j), sv8));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + j + 8), sv8));
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + j + 16), sv8));
        __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + j + 24), sv8));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
        _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(p, order));
    }
#endif
#ifdef __SSE2__
    /* cvtps2dq rounds in the current mode, round to nearest even unless changed */
    const __m128 sv = _mm_set1_ps(inv);
    for (; j + 16 <= d; j += 16) {
        __m128i a = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(r + j), sv));
        __m128i b = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(r + j + 4), sv));
        __m128i c = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(r + j + 8), sv));
        __m128i e = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(r + j + 12), sv));
        _mm_storeu_si128((__m128i *)(q + j),
                         _mm_packs_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, e)));
    }
#endif
    for (; j < d; j++) q[j] = q8(r[j] * inv);
}

/* absmax / 127; 1 for an all-zero row; NaN and inf stay (the row is then sent as zeros) */
static inline float scale_of(float amax) {
    return amax > 0.0f ? amax / 127.0f : (amax == 0.0f ? 1.0f : amax);
}

void rq_encode_f32(const float *x, int64_t n, int64_t d, uint8_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * d;
        int8_t *q = (int8_t *)(out + i * (d + 4));
        float s = scale_of(amax_f32(r, d));
        if (isfinite(s)) quant_f32(r, d, 1.0f / s, q);
        else memset(q, 0, (size_t)d);
        memcpy(q + d, &s, 4);
    }
}

/* rows of bf16, widened block by block (exact) and quantized as float rows */
void rq_encode_bf16(const uint16_t *x, int64_t n, int64_t d, uint8_t *out) {
    float buf[256];
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *r = x + i * d;
        int8_t *q = (int8_t *)(out + i * (d + 4));
        float m = 0.0f;
        for (int64_t j0 = 0; j0 < d; j0 += 256) {
            int64_t k = d - j0 < 256 ? d - j0 : 256;
            widen_bf16(r + j0, k, buf);
            float a = amax_f32(buf, k);
            m = (a != a || m != m) ? NAN : (a > m ? a : m);
        }
        float s = scale_of(m);
        if (isfinite(s)) {
            for (int64_t j0 = 0; j0 < d; j0 += 256) {
                int64_t k = d - j0 < 256 ? d - j0 : 256;
                widen_bf16(r + j0, k, buf);
                quant_f32(buf, k, 1.0f / s, q + j0);
            }
        } else memset(q, 0, (size_t)d);
        memcpy(q + d, &s, 4);
    }
}

void rq_decode_f32(const uint8_t *p, int64_t n, int64_t d, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const int8_t *q = (const int8_t *)(p + i * (d + 4));
        float s, *o = out + i * d;
        memcpy(&s, q + d, 4);
        for (int64_t j = 0; j < d; j++) o[j] = (float)q[j] * s;
    }
}

void rq_decode_bf16(const uint8_t *p, int64_t n, int64_t d, uint16_t *out) {
    float buf[256];
    for (int64_t i = 0; i < n; i++) {
        const int8_t *q = (const int8_t *)(p + i * (d + 4));
        float s;
        memcpy(&s, q + d, 4);
        for (int64_t j0 = 0; j0 < d; j0 += 256) {
            int64_t k = d - j0 < 256 ? d - j0 : 256;
            for (int64_t j = 0; j < k; j++) buf[j] = (float)q[j0 + j] * s;
            narrow_bf16(buf, k, isfinite(s), out + i * d + j0);
        }
    }
}
"""
_KERNELS = {torch.float32: ("rq_encode_f32", "rq_decode_f32"),
            torch.bfloat16: ("rq_encode_bf16", "rq_decode_bf16")}
_lib: ctypes.CDLL | None = None
_tried = False
_by_isa: dict[str, ctypes.CDLL | None] = {}


_ROW_SIGNATURE = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p], None)


def _open(isa: str | None) -> ctypes.CDLL | None:
    names = [n for pair in _KERNELS.values() for n in pair]
    sigs = {**dict.fromkeys(names, _ROW_SIGNATURE), "rq_isa": ([], ctypes.c_int)}
    return open_library("rowquant", _SOURCE, sigs, "int8 row quantization", libs=["-lm"],
                        isa=isa)


def load() -> ctypes.CDLL | None:
    """The compiled kernels for this CPU's ISA level, built on first use; None when
    unavailable (warns once)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        _lib = _open(None)
    return _lib


def load_isa(isa: str) -> ctypes.CDLL | None:
    """The kernels compiled for one ISA level (tests compare the levels); the caller checks
    ``_native.supported_isas()`` first: a level the CPU lacks crashes."""
    if isa not in _by_isa:
        _by_isa[isa] = _open(isa)
    return _by_isa[isa]


def _usable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and dtype in _KERNELS and load() is not None


def encode_int8(x_ND: torch.Tensor) -> torch.Tensor | None:
    """[N, d + 4] uint8 rows (values, then the scale), or None where no kernel applies."""
    if x_ND.dim() != 2 or not _usable(x_ND, x_ND.dtype):
        return None
    x = x_ND.contiguous()
    n, d = x.shape
    out = torch.empty(n, d + 4, dtype=torch.uint8)
    if n:
        getattr(_lib, _KERNELS[x.dtype][0])(x.data_ptr(), n, d, out.data_ptr())
    return out


def decode_int8(p_NB: torch.Tensor, dtype: torch.dtype, d: int) -> torch.Tensor | None:
    """[N, d] rows of ``dtype`` from ``encode_int8``'s bytes, or None where no kernel applies."""
    if not _usable(p_NB, dtype):
        return None
    p = p_NB.contiguous()
    n = p.shape[0]
    out = torch.empty(n, d, dtype=dtype)
    if n:
        getattr(_lib, _KERNELS[dtype][1])(p.data_ptr(), n, d, out.data_ptr())
    return out
