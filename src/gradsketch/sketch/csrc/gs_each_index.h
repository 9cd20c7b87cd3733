/*
 * Includes the header named by GS_INDEX_BODY once per index type (int16, int32, int64),
 * with I the index type and INAME its name suffix defined around each inclusion.
 */
#define I int16_t
#define INAME i16
#include GS_INDEX_BODY
#undef I
#undef INAME

#define I int32_t
#define INAME i32
#include GS_INDEX_BODY
#undef I
#undef INAME

#define I int64_t
#define INAME i64
#include GS_INDEX_BODY
#undef I
#undef INAME
