/*
 * The sampler's count sketch of its update components in devinterp's order of rounding
 * (gradsketch.sketch._ordered). Component c of a step is a_c * (b_c * x_c) elementwise, x_c a
 * row of the step's workspace (a raw gradient, noise, w - w0, ...), a_c and b_c scalars. devinterp
 * 2.0.1 computes each element of a component in the parameter's dtype, multiplying by b_c first
 * and then by a_c, converts it to float32 and adds it, times its sign, into its bucket:
 * parameters in order, elements in order (torch's CPU scatter_add_ sums sequentially). Its tests
 * compare that with atol=0, so this kernel does the same operations in the same order, on the
 * element it has just read: one pass, no scaled copy of any row. Buckets are float32.
 *
 * The table is folded: idx[i] = bucket + k * [sign < 0], or 2k for a coordinate outside the
 * sketch (an unselected entry of a mask), which is skipped.
 *
 * Every product and sum rounds once, as torch's do. No fused multiply-add can change that:
 * the only product that meets an addition is sign * v, which is exact.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* Most components one call takes (a sampler step has five). */
#define GS_MAX_COMPONENTS 8
/* Elements per chunk: the chunk's buckets, signs and values (8 rows) fit in L1. */
#define GS_ORDERED_CHUNK 512

#define GS_CAT(a, b) a##_##b
#define GS_NAME(base, suffix) GS_CAT(base, suffix)

#define T float
#define TNAME f32
#include "gs_ordered.h"
#undef T
#undef TNAME

#define T double
#define TNAME f64
#include "gs_ordered.h"
#undef T
#undef TNAME

/* The interface version; gradsketch.sketch._ordered refuses a library that reports another. */
int gs_abi_version(void) { return 1; }
