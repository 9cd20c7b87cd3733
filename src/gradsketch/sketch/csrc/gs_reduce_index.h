/*
 * gs_reduce.h instantiated for each index type (int16, int32, int64) of one value type, which
 * the includer (gs_kernels.c) gives as GS_F32, T, VEC, VLOAD and TNAME (the names' suffix).
 * Those parameters are undefined at the end, so that the next value type can define its own.
 */
#define VLANES ((int)(sizeof(VEC) / sizeof(T)))
#define NAME(base) GS_NAME(GS_NAME(base, TNAME), INAME)

#define GS_INDEX_BODY "gs_reduce.h"
#include "gs_each_index.h"
#undef GS_INDEX_BODY

#undef NAME
#undef VLANES
#undef TNAME
#undef VLOAD
#undef VEC
#undef T
#undef GS_F32
