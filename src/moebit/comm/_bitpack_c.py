"""The native CPU kernels behind ``moebit.comm.bitpack``, compiled with gcc at first use.

Why native code: packing signs is the hot spot of a 1-bit allreduce on CPU. An elementwise
torch pack costs about 2 s per 32M elements; these loops run at memory speed and fuse the
error-feedback update, the norm and the packing into one pass over the data.

Why compiled lazily instead of by pip: the package stays pure Python (no build step, no
pyproject change), and any machine with gcc gets the kernels within a second at first use.
The shared object is cached under ``$MOEBIT_NATIVE_CACHE`` (default
``~/.cache/moebit/native``), keyed by a hash of the source and flags, built under a file lock
so ranks starting together compile once. Without gcc, or with ``MOEBIT_NATIVE=0``,
``load()`` returns None and bitpack falls back to torch/numpy code with identical results.

Bit convention everywhere: bit k of byte j holds element 8*j+k, set where the value >= 0
(an IEEE comparison: -0.0 counts as >= 0, NaN does not).
"""

from __future__ import annotations

import ctypes

from moebit.comm._native import open_library

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

static float PM1[256][8];

/* the ISA level this library was compiled for (checked by the tests) */
int mb_isa(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

void mb_init(void) {
    for (int b = 0; b < 256; b++)
        for (int k = 0; k < 8; k++) PM1[b][k] = ((b >> k) & 1) ? 1.0f : -1.0f;
}

static inline uint8_t pack8(const float *v) {
#if defined(__AVX2__)
    return (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v), _mm256_setzero_ps(),
                                                     _CMP_GE_OQ));
#elif defined(__SSE2__)
    __m128 z = _mm_setzero_ps();
    int lo = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(v), z));
    int hi = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(v + 4), z));
    return (uint8_t)(lo | (hi << 4));
#else
    uint8_t b = 0;
    for (int k = 0; k < 8; k++) b |= (uint8_t)(v[k] >= 0.0f) << k;
    return b;
#endif
}

static inline uint8_t pack_tail(const float *v, int64_t r) {
    uint8_t b = 0;
    for (int64_t k = 0; k < r; k++) b |= (uint8_t)(v[k] >= 0.0f) << k;
    return b;
}

/* out[j] = signs of x[8j..8j+7]; the unused high bits of a last partial byte are 0. */
void mb_pack(const float *x, int64_t n, uint8_t *out) {
    int64_t nb = n / 8, j = 0;
#if defined(__AVX512F__)
    /* 64 floats -> 8 bytes: four 16-lane compares straight into mask registers */
    for (; j + 8 <= nb; j += 8) {
        const float *v = x + 8 * j;
        const __m512 z = _mm512_setzero_ps();
        uint64_t m = (uint64_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(v), z, _CMP_GE_OQ)
                   | (uint64_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(v + 16), z, _CMP_GE_OQ) << 16
                   | (uint64_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(v + 32), z, _CMP_GE_OQ) << 32
                   | (uint64_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(v + 48), z, _CMP_GE_OQ) << 48;
        memcpy(out + j, &m, 8); /* little-endian: byte q holds elements 8q..8q+7 */
    }
#elif defined(__AVX2__)
    /* 32 floats -> 4 bytes, one 32-bit store */
    for (; j + 4 <= nb; j += 4) {
        const float *v = x + 8 * j;
        const __m256 z = _mm256_setzero_ps();
        uint32_t m = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v), z, _CMP_GE_OQ))
            | (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + 8), z, _CMP_GE_OQ)) << 8
            | (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + 16), z, _CMP_GE_OQ)) << 16
            | (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + 24), z, _CMP_GE_OQ)) << 24;
        memcpy(out + j, &m, 4);
    }
#endif
    for (; j < nb; j++) out[j] = pack8(x + 8 * j);
    if (n % 8) out[nb] = pack_tail(x + 8 * nb, n % 8);
}

/* out[i] = bit i ? s : -s */
void mb_unpack_scaled(const uint8_t *p, int64_t n, float s, float *out) {
    float t[256][8];
    for (int b = 0; b < 256; b++)
        for (int k = 0; k < 8; k++) t[b][k] = s * PM1[b][k];
    int64_t nb = n / 8;
#if defined(__AVX2__)
    if (((uintptr_t)out & 31) == 0) {
        for (int64_t j = 0; j < nb; j++) _mm256_stream_ps(out + 8 * j, _mm256_loadu_ps(t[p[j]]));
        _mm_sfence();
    } else
#endif
#ifdef __SSE2__
    if (((uintptr_t)out & 15) == 0) {
        /* Streaming stores: the output is far larger than the caches, and skipping the
           read-for-ownership of every line nearly doubles the write speed. */
        for (int64_t j = 0; j < nb; j++) {
            _mm_stream_ps(out + 8 * j, _mm_loadu_ps(t[p[j]]));
            _mm_stream_ps(out + 8 * j + 4, _mm_loadu_ps(t[p[j]] + 4));
        }
        _mm_sfence();
    } else
#endif
        for (int64_t j = 0; j < nb; j++) memcpy(out + 8 * j, t[p[j]], 8 * sizeof(float));
    for (int64_t k = 0; k < n % 8; k++) out[8 * nb + k] = t[p[nb]][k];
}

/* One error-feedback step on 8 values, in place.
   y holds the previous compressor input; its compression error is y - (y >= 0 ? s : -s).
   New input: v = a + that error. Stores v into y, adds v*v to acc, returns the sign byte. */
#ifdef __SSE2__
static inline uint8_t ef4x2(__m128 a0, __m128 a1, float *y, __m128 sv, __m128 *acc) {
    const __m128 z = _mm_setzero_ps();
    const __m128 sign = _mm_set1_ps(-0.0f);
    __m128 y0 = _mm_loadu_ps(y), y1 = _mm_loadu_ps(y + 4);
    __m128 q0 = _mm_xor_ps(sv, _mm_andnot_ps(_mm_cmpge_ps(y0, z), sign));
    __m128 q1 = _mm_xor_ps(sv, _mm_andnot_ps(_mm_cmpge_ps(y1, z), sign));
    __m128 v0 = _mm_add_ps(a0, _mm_sub_ps(y0, q0));
    __m128 v1 = _mm_add_ps(a1, _mm_sub_ps(y1, q1));
    _mm_storeu_ps(y, v0);
    _mm_storeu_ps(y + 4, v1);
    acc[0] = _mm_add_ps(acc[0], _mm_mul_ps(v0, v0));
    acc[1] = _mm_add_ps(acc[1], _mm_mul_ps(v1, v1));
    int bits = _mm_movemask_ps(_mm_cmpge_ps(v0, z)) | (_mm_movemask_ps(_mm_cmpge_ps(v1, z)) << 4);
    return (uint8_t)bits;
}
#endif

#ifdef __AVX2__
/* ef4x2 on one 8-lane vector */
static inline uint8_t ef8(__m256 a, float *y, __m256 sv, __m256 *acc) {
    const __m256 z = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 y0 = _mm256_loadu_ps(y);
    __m256 q = _mm256_xor_ps(sv, _mm256_andnot_ps(_mm256_cmp_ps(y0, z, _CMP_GE_OQ), sign));
    __m256 v = _mm256_add_ps(a, _mm256_sub_ps(y0, q));
    _mm256_storeu_ps(y, v);
    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(v, v));
    return (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v, z, _CMP_GE_OQ));
}

static inline double hsum8(__m256 *acc) {
    float t[8];
    _mm256_storeu_ps(t, *acc);
    *acc = _mm256_setzero_ps();
    return ((double)t[0] + t[1] + t[2] + t[3]) + ((double)t[4] + t[5] + t[6] + t[7]);
}
#endif

static inline float ef1(float a, float *y, float s, float *acc) {
    float yv = *y;
    float v = a + (yv >= 0.0f ? yv - s : yv + s);
    *y = v;
    *acc += v * v;
    return v;
}

static inline double hsum(
#ifdef __SSE2__
    __m128 *acc
#else
    float *acc
#endif
) {
#ifdef __SSE2__
    float t[4];
    __m128 a = _mm_add_ps(acc[0], acc[1]);
    _mm_storeu_ps(t, a);
    acc[0] = acc[1] = _mm_setzero_ps();
    return (double)t[0] + t[1] + t[2] + t[3];
#else
    double r = 0;
    for (int k = 0; k < 8; k++) { r += acc[k]; acc[k] = 0; }
    return r;
#endif
}

#define BLOCK 512 /* bytes per block: 4096 floats, 16 KiB of accumulators in L1 */

/* Worker step over n values of x: y <- x + error(y, s); packs y's signs; returns sum y^2. */
double mb_worker(const float *x, float *y, float s, int64_t n, uint8_t *out) {
    double total = 0.0;
    int64_t nb = n / 8;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    const __m256 sv = _mm256_set1_ps(s);
#elif defined(__SSE2__)
    __m128 acc[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
    const __m128 sv = _mm_set1_ps(s);
#else
    float acc[8] = {0};
#endif
    for (int64_t j0 = 0; j0 < nb; j0 += BLOCK) {
        int64_t j1 = j0 + BLOCK < nb ? j0 + BLOCK : nb;
        for (int64_t j = j0; j < j1; j++) {
#if defined(__AVX2__)
            out[j] = ef8(_mm256_loadu_ps(x + 8 * j), y + 8 * j, sv, &acc);
#elif defined(__SSE2__)
            out[j] = ef4x2(_mm_loadu_ps(x + 8 * j), _mm_loadu_ps(x + 8 * j + 4), y + 8 * j, sv,
                           acc);
#else
            uint8_t b = 0;
            for (int k = 0; k < 8; k++)
                b |= (uint8_t)(ef1(x[8 * j + k], y + 8 * j + k, s, acc + k) >= 0.0f) << k;
            out[j] = b;
#endif
        }
#if defined(__AVX2__)
        total += hsum8(&acc);
#else
        total += hsum(acc);
#endif
    }
    if (n % 8) {
        float a = 0.0f;
        uint8_t b = 0;
        for (int64_t k = 0; k < n % 8; k++)
            b |= (uint8_t)(ef1(x[8 * nb + k], y + 8 * nb + k, s, &a) >= 0.0f) << k;
        out[nb] = b;
        total += a;
    }
    return total;
}

/* Server step over m values: a_i = sum_r scales[r] * sign_r(i) decoded from rows
   (row r starts at rows + r * stride), then the same error-feedback step as mb_worker with
   a in place of x. Returns sum z^2 of the new values, or -1 when out of memory. */
double mb_server(const uint8_t *rows, int64_t stride, int64_t nrows, const float *scales,
                 int64_t m, float *z, float s, uint8_t *out) {
    float(*tab)[256][8] = malloc(sizeof(float[256][8]) * (size_t)(nrows > 0 ? nrows : 1));
    if (!tab) return -1.0;
    for (int64_t r = 0; r < nrows; r++)
        for (int b = 0; b < 256; b++)
            for (int k = 0; k < 8; k++) tab[r][b][k] = scales[r] * PM1[b][k];
    double total = 0.0;
    int64_t nb = m / 8;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    const __m256 sv = _mm256_set1_ps(s);
#elif defined(__SSE2__)
    __m128 acc[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
    const __m128 sv = _mm_set1_ps(s);
#else
    float acc[8] = {0};
#endif
    for (int64_t j0 = 0; j0 < nb; j0 += BLOCK) {
        int64_t j1 = j0 + BLOCK < nb ? j0 + BLOCK : nb;
        for (int64_t j = j0; j < j1; j++) {
#if defined(__AVX2__)
            __m256 a = _mm256_setzero_ps();
            for (int64_t r = 0; r < nrows; r++)
                a = _mm256_add_ps(a, _mm256_loadu_ps(tab[r][rows[r * stride + j]]));
            out[j] = ef8(a, z + 8 * j, sv, &acc);
#elif defined(__SSE2__)
            __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();
            for (int64_t r = 0; r < nrows; r++) {
                const float *tt = tab[r][rows[r * stride + j]];
                a0 = _mm_add_ps(a0, _mm_loadu_ps(tt));
                a1 = _mm_add_ps(a1, _mm_loadu_ps(tt + 4));
            }
            out[j] = ef4x2(a0, a1, z + 8 * j, sv, acc);
#else
            float a[8] = {0};
            for (int64_t r = 0; r < nrows; r++)
                for (int k = 0; k < 8; k++) a[k] += tab[r][rows[r * stride + j]][k];
            uint8_t b = 0;
            for (int k = 0; k < 8; k++)
                b |= (uint8_t)(ef1(a[k], z + 8 * j + k, s, acc + k) >= 0.0f) << k;
            out[j] = b;
#endif
        }
#if defined(__AVX2__)
        total += hsum8(&acc);
#else
        total += hsum(acc);
#endif
    }
    if (m % 8) {
        float t2 = 0.0f;
        uint8_t b = 0;
        for (int64_t k = 0; k < m % 8; k++) {
            float a = 0.0f;
            for (int64_t r = 0; r < nrows; r++) a += tab[r][rows[r * stride + nb]][k];
            b |= (uint8_t)(ef1(a, z + 8 * nb + k, s, &t2) >= 0.0f) << k;
        }
        out[nb] = b;
        total += t2;
    }
    free(tab);
    return total;
}

/* err[i] = y[i] - (y[i] >= 0 ? s : -s): materialises an error buffer (for state_dict). */
void mb_error(const float *y, float s, int64_t n, float *err) {
    for (int64_t i = 0; i < n; i++) err[i] = y[i] >= 0.0f ? y[i] - s : y[i] + s;
}
"""

_lib: ctypes.CDLL | None = None
_tried = False
_by_isa: dict[str, ctypes.CDLL | None] = {}


_VP, _I64, _F32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double
_SIGNATURES = {
    "mb_init": ([], None),
    "mb_isa": ([], ctypes.c_int),
    "mb_pack": ([_VP, _I64, _VP], None),
    "mb_unpack_scaled": ([_VP, _I64, _F32, _VP], None),
    "mb_worker": ([_VP, _VP, _F32, _I64, _VP], _F64),
    "mb_server": ([_VP, _I64, _I64, _VP, _I64, _VP, _F32, _VP], _F64),
    "mb_error": ([_VP, _F32, _I64, _VP], None),
}


def _open(isa: str | None) -> ctypes.CDLL | None:
    return open_library("bitpack", _SOURCE, _SIGNATURES, "bit packing",
                        init=lambda lib: lib.mb_init(), isa=isa)


def load() -> ctypes.CDLL | None:
    """The compiled kernels for this CPU's ISA level (``_native.select_isa``), building them
    on first use; None when unavailable (warns once)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        _lib = _open(None)
    return _lib


def load_isa(isa: str) -> ctypes.CDLL | None:
    """The kernels compiled for one ISA level (tests and benchmarks compare the levels);
    the caller checks ``_native.supported_isas()`` first: a level the CPU lacks crashes."""
    if isa not in _by_isa:
        _by_isa[isa] = _open(isa)
    return _by_isa[isa]
