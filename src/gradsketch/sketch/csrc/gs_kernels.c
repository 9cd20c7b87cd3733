/*
 * gradsketch's native CPU kernels: the count-sketch scatter of a folded table (the fast path
 * of gradsketch.sketch._countsketch.scatter_folded_) and the sampler's fused Gram + scatter
 * pass (gradsketch.sampling._reduce). gradsketch.sketch._native compiles this file at first
 * use with the system C compiler and falls back to torch's scatter when it cannot. The
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

/* Most rows one call reduces (a sampler records at most eight vectors; projectors pass
 * batches in slices of this many rows). */
#define GS_MAX_ROWS 64

#define GS_CAT(a, b) a##_##b
#define GS_NAME(base, suffix) GS_CAT(base, suffix)

#define T float
#define VEC gs_v16f
#define VLANES 16
#define VLOAD gs_load_f32
#define I int16_t
#define NAME(base) GS_NAME(base, f32_i16)
#include "gs_reduce.h"
#undef I
#undef NAME
#define I int32_t
#define NAME(base) GS_NAME(base, f32_i32)
#include "gs_reduce.h"
#undef I
#undef NAME
#define I int64_t
#define NAME(base) GS_NAME(base, f32_i64)
#include "gs_reduce.h"
#undef I
#undef NAME
#undef T
#undef VEC
#undef VLANES
#undef VLOAD

#define T double
#define VEC gs_v8d
#define VLANES 8
#define VLOAD gs_load_f64
#define I int16_t
#define NAME(base) GS_NAME(base, f64_i16)
#include "gs_reduce.h"
#undef I
#undef NAME
#define I int32_t
#define NAME(base) GS_NAME(base, f64_i32)
#include "gs_reduce.h"
#undef I
#undef NAME
#define I int64_t
#define NAME(base) GS_NAME(base, f64_i64)
#include "gs_reduce.h"
#undef I
#undef NAME
#undef T
#undef VEC
#undef VLANES
#undef VLOAD

/* The interface version; gradsketch.sketch._native refuses a library that reports another. */
int gs_abi_version(void) { return 2; }
