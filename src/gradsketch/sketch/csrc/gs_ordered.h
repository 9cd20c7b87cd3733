/*
 * gs_ordered.c's kernel for one value type T (suffix TNAME), instantiated per index type I.
 */
#define GS_INDEX_BODY "gs_ordered_index.h"
#include "gs_each_index.h"
#undef GS_INDEX_BODY
