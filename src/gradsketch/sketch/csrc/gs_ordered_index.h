/*
 * One instantiation of gs_ordered.c's kernel: value type T, index type I, names suffixed
 * TNAME_INAME.
 */
#define NAME(base) GS_NAME(GS_NAME(base, TNAME), INAME)

/*
 * acc[bucket(i) * nc + c] += sign(i) * (float)(a[c] * (b[c] * x[c][i])) for i < len, in
 * increasing i.
 * A chunk of GS_ORDERED_CHUNK elements at a time: its buckets, signs and signed values are
 * computed first with vector instructions into buffers that stay in L1, then added into the
 * buckets in order (the adds into one bucket stay sequential). Returns 1 when an index lay
 * outside [0, 2k] (skipped), else 0.
 */
/* The chunk's signed values added into their buckets, element after element (NC components
 * in acc's bucket-major layout: an element's adds share one cache line). */
#define GS_ADD(NC)                                                                           \
    for (int64_t i = 0; i < n; i++) {                                                        \
        int32_t j = jb[i];                                                                   \
        if (j < 0) continue;                                                                 \
        float *aj = acc + (int64_t)j * (NC);                                                 \
        for (int64_t c = 0; c < (NC); c++) aj[c] += vb[c][i];                                \
    }

static int NAME(gs_ordered_piece)(const T *const *x, int64_t nc, const T *a, const T *b,
                                  const I *idx, float *acc, int64_t k, int64_t len) {
    int bad = 0;
    const int64_t trash = 2 * k;
    const int32_t k32 = (int32_t)k, trash32 = (int32_t)trash;
    int32_t jb[GS_ORDERED_CHUNK];
    float sg[GS_ORDERED_CHUNK];
    float vb[GS_MAX_COMPONENTS][GS_ORDERED_CHUNK];
    for (int64_t i0 = 0; i0 < len; i0 += GS_ORDERED_CHUNK) {
        int64_t n = len - i0 < GS_ORDERED_CHUNK ? len - i0 : GS_ORDERED_CHUNK;
        const I *id = idx + i0;
        int odd = 0;
        for (int64_t i = 0; i < n; i++) {
            /* 2k + 1 buckets fit int32 (the table's own type is at most that wide in use). */
            int32_t f = (int32_t)id[i];
            int32_t neg = f >= k32;
            /* Outside [0, 2k): the trash bucket 2k (skipped) or a bad index (flagged). */
            int32_t out = (uint32_t)f >= (uint32_t)trash32;
            odd |= out;
            jb[i] = out ? -1 : f - (neg ? k32 : 0);
            sg[i] = neg ? -1.0f : 1.0f;
        }
        if (odd)
            for (int64_t i = 0; i < n; i++)
                if (jb[i] < 0 && (int64_t)id[i] != trash) bad = 1;
        for (int64_t c = 0; c < nc; c++) {
            const T *xc = x[c] + i0;
            const T ac = a[c], bc = b[c];
            float *v = vb[c];
            /* sign * value is exact: a fused multiply-add would round the same. */
            for (int64_t i = 0; i < n; i++) v[i] = sg[i] * (float)(ac * (bc * xc[i]));
        }
        switch (nc) {
            case 1: GS_ADD(1); break;
            case 2: GS_ADD(2); break;
            case 3: GS_ADD(3); break;
            case 4: GS_ADD(4); break;
            case 5: GS_ADD(5); break;
            default: GS_ADD(nc); break;
        }
    }
    return bad;
}

/*
 * The components of a block given as nseg segments of columns (segment s spans columns
 * [starts[s], starts[s + 1]); its row q is the contiguous array ptrs[s * r + q]): component c
 * reads row src[c] with factors b[c] then a[c] applied as above, and is added into out's row
 * dst_row[c] (float32, row stride os, k buckets; no two components share a row). With threads > 1 the components are shared out whole,
 * so that each bucket still sums in column order. Returns 0; 1 for an index outside
 * [0, 2k] (skipped); -1 for bad arguments (nothing written).
 */
int NAME(gs_ordered)(const T *const *ptrs, const int64_t *starts, int64_t nseg, int64_t r,
                     int64_t nc, const int64_t *dst_row, const int64_t *src, const double *a,
                     const double *b, const I *idx, float *out, int64_t k, int64_t os,
                     int threads) {
    T ta[GS_MAX_COMPONENTS], tb[GS_MAX_COMPONENTS];
    if (nc < 0 || nc > GS_MAX_COMPONENTS || k < 1) return -1;
    for (int64_t c = 0; c < nc; c++) {
        if (src[c] < 0 || src[c] >= r || dst_row[c] < 0) return -1;
        /* The factors rounded to T first, as torch rounds a Python scalar to the tensor's type. */
        ta[c] = (T)a[c];
        tb[c] = (T)b[c];
    }
    if (threads > nc) threads = (int)nc;
    if (threads < 1) threads = 1;
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const T *x[GS_MAX_COMPONENTS];
        T ma[GS_MAX_COMPONENTS], mb[GS_MAX_COMPONENTS];
        int64_t mine[GS_MAX_COMPONENTS], m = 0;
        for (int64_t c = t; c < nc; c += nt) mine[m++] = c;
        for (int64_t e = 0; e < m; e++) {
            ma[e] = ta[mine[e]];
            mb[e] = tb[mine[e]];
        }
        /* The running sums, bucket-major: copied in, accumulated, copied back (same values,
         * same order of additions as adding into out's rows directly). */
        float *acc = m > 0 ? (float *)malloc((size_t)(k * m) * sizeof(float)) : NULL;
        if (m > 0 && acc == NULL) {
            bad |= 2;
            m = 0;
        }
        for (int64_t e = 0; e < m; e++)
            for (int64_t j = 0; j < k; j++) acc[j * m + e] = out[dst_row[mine[e]] * os + j];
        for (int64_t s = 0; s < nseg && m > 0; s++) {
            for (int64_t e = 0; e < m; e++) x[e] = ptrs[s * r + src[mine[e]]];
            bad |= NAME(gs_ordered_piece)(x, m, ma, mb, idx + starts[s], acc, k,
                                         starts[s + 1] - starts[s]);
        }
        for (int64_t e = 0; e < m; e++)
            for (int64_t j = 0; j < k; j++) out[dst_row[mine[e]] * os + j] = acc[j * m + e];
        free(acc);
    }
    if (bad & 2) return -1;
    return bad;
}

#undef GS_ADD
#undef NAME
