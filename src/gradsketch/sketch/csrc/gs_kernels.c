/*
 * gradsketch's native sketch kernels: the count-sketch scatter of a folded table (the fast
 * path of gradsketch.sketch._countsketch.scatter_folded_) and the sampler's fused Gram +
 * scatter pass (gradsketch.sketch._reduce). The SLT sampler's train-mode kernels are a
 * library of their own (gradsketch/slt/csrc/gs_train.c).
 * gradsketch._native_build compiles this file at first use with the system C compiler and
 * gradsketch.sketch._native falls back to torch's scatter when it cannot. The
 * OpenMP regions run on the OpenMP runtime torch has already loaded (libgomp.so.1), so they
 * share torch's threads; the loader checks that no second runtime got loaded.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 64-byte vectors (one AVX-512 register, two AVX2 ones) for the Gram's lanes. */
typedef float gs_v16f __attribute__((vector_size(64)));
typedef double gs_v8d __attribute__((vector_size(64)));

static inline gs_v16f gs_load_f32(const float *p) {
    gs_v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline gs_v8d gs_load_f64(const double *p) {
    gs_v8d v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX__)
#include <immintrin.h>

/* r[c] becomes column c of the 8x8 block whose row q was r[q]. */
static inline void gs_transpose8(__m256 *r) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif

/* Most rows one call reduces (a sampler records at most eight vectors; projectors pass
 * batches in slices of this many rows). */
#define GS_MAX_ROWS 64

#define GS_CAT(a, b) a##_##b
#define GS_NAME(base, suffix) GS_CAT(base, suffix)

/* One instance of gs_reduce.h per value type (its 64-byte vector and loader) and, through
 * gs_reduce_index.h, per index type: the exported names run gs_reduce_{f32,f64}_{i16,i32,i64}. */
#define GS_F32 1
#define T float
#define VEC gs_v16f
#define VLOAD gs_load_f32
#define TNAME f32
#include "gs_reduce_index.h"

#define GS_F32 0
#define T double
#define VEC gs_v8d
#define VLOAD gs_load_f64
#define TNAME f64
#include "gs_reduce_index.h"

/* The interface version; gradsketch.sketch._native refuses a library that reports another. */
int gs_abi_version(void) { return 6; }

/* lowbias32 (gradsketch._hash.mix32): wrapping 32-bit products, as numpy's uint32 and Triton's. */
static inline uint32_t gs_mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

/* The folded count-sketch table of the coordinates [offset, offset + length), all below
 * 2**32 (gradsketch.sketch._tables.buckets_and_signs): h = mix32(i ^ key), the bucket from
 * h's upper 31 bits by multiply-shift (51 bits: uint64), plus nb when h's lowest bit is set. */
int gs_buckets_and_signs(uint32_t key, int64_t offset, int64_t length, int64_t nb, int64_t *out) {
    const uint64_t buckets = (uint64_t)nb;
    for (int64_t i = 0; i < length; i++) {
        const uint32_t h = gs_mix32((uint32_t)(offset + i) ^ key);
        out[i] = (int64_t)((((uint64_t)(h >> 1)) * buckets) >> 31) + nb * (int64_t)(h & 1u);
    }
    return 0;
}
