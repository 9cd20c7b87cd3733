/*
 * One instantiation of gradsketch's reduction kernel, included by gs_reduce_index.h once per
 * (value type T, index type I). T's vector type VEC of VLANES lanes and its loader VLOAD,
 * and NAME(base) (base suffixed by the types) are defined by the includers.
 */

/* dst[q][idx[i]] += src[q][i] for NR rows and i < len; skips and flags bad indices. */
#define GS_GROUP(NR)                                                                         \
    static int NAME(group##NR)(const T *const *src, T *const *dst, const I *idx,             \
                               int64_t width, int64_t len) {                                 \
        const T *s[NR];                                                                      \
        T *d[NR];                                                                            \
        int bad = 0;                                                                         \
        for (int q = 0; q < NR; q++) {                                                       \
            s[q] = src[q];                                                                   \
            d[q] = dst[q];                                                                   \
        }                                                                                    \
        for (int64_t i = 0; i < len; i++) {                                                  \
            int64_t j = (int64_t)idx[i];                                                     \
            if ((uint64_t)j >= (uint64_t)width) {                                            \
                bad = 1;                                                                     \
                continue;                                                                    \
            }                                                                                \
            for (int q = 0; q < NR; q++) d[q][j] += s[q][i];                                 \
        }                                                                                    \
        return bad;                                                                          \
    }

GS_GROUP(1)
GS_GROUP(2)
GS_GROUP(3)
GS_GROUP(4)

#undef GS_GROUP

/*
 * The scatter of `rows` rows (src[q] points at column 0 of the piece) over `len` columns,
 * a chunk of columns at a time (the chunk's indices stay in cache) and four rows at a time
 * (one index load serves four rows). dst[q] is the output row of src[q].
 */
static int NAME(scatter_piece)(const T *const *src, T *const *dst, int64_t rows, const I *idx,
                               int64_t width, int64_t len, int64_t chunk) {
    int bad = 0;
    const T *s[4];
    for (int64_t cs = 0; cs < len; cs += chunk) {
        int64_t n = cs + chunk < len ? chunk : len - cs;
        for (int64_t q = 0; q < rows; q += 4) {
            int64_t nr = rows - q < 4 ? rows - q : 4;
            for (int64_t e = 0; e < nr; e++) s[e] = src[q + e] + cs;
            switch (nr) {
                case 4: bad |= NAME(group4)(s, dst + q, idx + cs, width, n); break;
                case 3: bad |= NAME(group3)(s, dst + q, idx + cs, width, n); break;
                case 2: bad |= NAME(group2)(s, dst + q, idx + cs, width, n); break;
                default: bad |= NAME(group1)(s, dst + q, idx + cs, width, n); break;
            }
        }
    }
    return bad;
}

/*
 * The transposed scatter of VLANES rows: acc[j * VLANES + q] += src[q][i] where j = idx[i],
 * for i < len. acc holds the output transposed ([width, VLANES]), so each column of the
 * input adds one contiguous VLANES-wide vector: the index is loaded once for all rows and
 * the adds are vector adds. Input tiles are transposed in registers (AVX) or through a
 * small buffer. Each acc element sums its inputs in increasing i, as the row-wise scatter
 * does. Skips and flags bad indices.
 */
#ifndef GS_PF
#define GS_PF 32
#endif
static int NAME(tgroup)(const T *const *src, T *acc, const I *idx, int64_t width,
                        int64_t len) {
    int bad = 0;
    int64_t i = 0;
#if GS_F32 && defined(__AVX__)
    for (; i + 8 <= len; i += 8) {
        int64_t j[8];
        for (int c = 0; c < 8; c++) {
            j[c] = (int64_t)idx[i + c];
            if ((uint64_t)j[c] >= (uint64_t)width) bad = 1;
        }
        if (i + GS_PF + 8 <= len)
            for (int c = 0; c < 8; c++) {
                uint64_t jp = (uint64_t)(int64_t)idx[i + GS_PF + c];
                if (jp < (uint64_t)width) __builtin_prefetch(acc + jp * 16, 1, 3);
            }
        for (int h = 0; h < 16; h += 8) {
            __m256 v[8];
            for (int q = 0; q < 8; q++) v[q] = _mm256_loadu_ps(src[h + q] + i);
            gs_transpose8(v);
            for (int c = 0; c < 8; c++) {
                if ((uint64_t)j[c] >= (uint64_t)width) continue;
                float *o = acc + j[c] * 16 + h;
                _mm256_store_ps(o, _mm256_add_ps(_mm256_load_ps(o), v[c]));
            }
        }
    }
#else
    enum { TC = 16 };
    T buf[TC][VLANES] __attribute__((aligned(64)));
    for (; i + TC <= len; i += TC) {
        for (int q = 0; q < VLANES; q++) {
            const T *s = src[q] + i;
            for (int c = 0; c < TC; c++) buf[c][q] = s[c];
        }
        for (int c = 0; c < TC; c++) {
            int64_t j = (int64_t)idx[i + c];
            if ((uint64_t)j >= (uint64_t)width) {
                bad = 1;
                continue;
            }
            VEC o = VLOAD(acc + j * VLANES);
            o += VLOAD(buf[c]);
            memcpy(acc + j * VLANES, &o, sizeof o);
        }
    }
#endif
    for (; i < len; i++) {
        int64_t j = (int64_t)idx[i];
        if ((uint64_t)j >= (uint64_t)width) {
            bad = 1;
            continue;
        }
        for (int q = 0; q < VLANES; q++) acc[j * VLANES + q] += src[q][i];
    }
    return bad;
}

/*
 * Rows [r0, r1) of a segmented block scattered with the transposed kernel, VLANES rows at
 * a time through the [width, VLANES] buffer acc: the rows' outputs are copied in,
 * accumulated, and copied back, so each output element sums in the order of the row-wise
 * scatter. A last group of fewer rows repeats its first row in the spare lanes (read from
 * cache, never copied back).
 */
static int NAME(tscatter)(const T *const *ptrs, const int64_t *starts, int64_t nseg, int64_t r,
                          int64_t r0, int64_t r1, const I *idx, T *out, int64_t width,
                          int64_t os, T *acc) {
    int bad = 0;
    const T *src[VLANES];
    for (int64_t g0 = r0; g0 < r1; g0 += VLANES) {
        int64_t nr = r1 - g0 < VLANES ? r1 - g0 : VLANES;
        for (int64_t j = 0; j < width; j++)
            for (int64_t q = 0; q < VLANES; q++)
                acc[j * VLANES + q] = q < nr ? out[(g0 + q) * os + j] : (T)0;
        for (int64_t seg = 0; seg < nseg; seg++) {
            for (int64_t q = 0; q < VLANES; q++) src[q] = ptrs[seg * r + g0 + (q < nr ? q : 0)];
            bad |= NAME(tgroup)(src, acc, idx + starts[seg], width,
                                starts[seg + 1] - starts[seg]);
        }
        for (int64_t q = 0; q < nr; q++)
            for (int64_t j = 0; j < width; j++) out[(g0 + q) * os + j] = acc[j * VLANES + q];
    }
    return bad;
}

/*
 * g[a * r + b] += <src[a], src[b]> over `len` columns for a <= b. Products are summed in
 * four independent vectors of T (callers pass at most a few thousand columns, so each lane
 * sums a few dozen products); the lanes and every call are summed in double.
 */
static void NAME(gram_piece)(const T *const *src, int64_t r, int64_t len, double *g) {
    for (int64_t a = 0; a < r; a++) {
        for (int64_t b = a; b < r; b++) {
            const T *xa = src[a], *xb = src[b];
            VEC s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            int64_t i = 0;
            for (; i + 4 * VLANES <= len; i += 4 * VLANES) {
                s0 += VLOAD(xa + i) * VLOAD(xb + i);
                s1 += VLOAD(xa + i + VLANES) * VLOAD(xb + i + VLANES);
                s2 += VLOAD(xa + i + 2 * VLANES) * VLOAD(xb + i + 2 * VLANES);
                s3 += VLOAD(xa + i + 3 * VLANES) * VLOAD(xb + i + 3 * VLANES);
            }
            for (; i + VLANES <= len; i += VLANES) s0 += VLOAD(xa + i) * VLOAD(xb + i);
            double s = 0.0;
            for (; i < len; i++) s += (double)xa[i] * (double)xb[i];
            for (int l = 0; l < VLANES; l++)
                s += ((double)s0[l] + (double)s1[l]) + ((double)s2[l] + (double)s3[l]);
            g[a * r + b] += s;
        }
    }
}

/*
 * Columns [c0, c1) of a segmented block: segment s spans columns [starts[s], starts[s+1])
 * and its row q starts at ptrs[s * r + q]. The leading srows rows are scattered into
 * dst[0..srows) and, when g is not NULL, the Gram of all r rows is added into g, chunk by
 * chunk so that the Gram reads what the scatter has just brought into cache.
 */
static int NAME(reduce_columns)(const T *const *ptrs, const int64_t *starts, int64_t nseg,
                                int64_t r, int64_t srows, const I *idx, T *const *dst,
                                int64_t width, double *g, int64_t c0, int64_t c1,
                                int64_t chunk) {
    int bad = 0;
    const T *src[GS_MAX_ROWS];
    for (int64_t seg = 0; seg < nseg; seg++) {
        int64_t lo = starts[seg] > c0 ? starts[seg] : c0;
        int64_t hi = starts[seg + 1] < c1 ? starts[seg + 1] : c1;
        for (int64_t cs = lo; cs < hi; cs += chunk) {
            int64_t n = cs + chunk < hi ? chunk : hi - cs;
            for (int64_t q = 0; q < r; q++) src[q] = ptrs[seg * r + q] + (cs - starts[seg]);
            if (srows > 0) bad |= NAME(scatter_piece)(src, dst, srows, idx + cs, width, n, n);
            if (g != NULL) NAME(gram_piece)(src, r, n, g);
        }
    }
    return bad;
}

/*
 * out[q][idx[i]] += x[q][i] for the leading `srows` rows (the count-sketch scatter of a
 * folded table) and, when gram is not NULL, gram = the [r, r] float64 Gram matrix of all r
 * rows. The block x is given as nseg segments of columns: segment s spans the columns
 * [starts[s], starts[s + 1]) and its row q is the contiguous array ptrs[s * r + q] (one
 * segment for a strided [r, n] tensor; one per parameter for a sampler's rows, so that
 * gradients are read where autograd left them). os is out's row stride and width its
 * columns; r is at most GS_MAX_ROWS. Work is split over `threads` OpenMP threads: whole rows
 * each when there are at least two per thread and no Gram (scattered transposed when there
 * are at least `tmin` per thread; tmin = 0 never), else column ranges whose partial sums are
 * added at the end. Returns 0; 1 when an index lay outside [0, width) (those entries
 * are skipped); -1 when the partial sums could not be allocated or r is too large (nothing
 * was written).
 */
int NAME(gs_reduce)(const T *const *ptrs, const int64_t *starts, int64_t nseg, int64_t r,
                    int64_t srows, const I *idx, T *out, int64_t width, int64_t os,
                    double *gram, int threads, int64_t chunk, int64_t tmin) {
    int bad = 0;
    int64_t n = starts[nseg];
    if (threads < 1) threads = 1;
    if (chunk < 1) chunk = 2048;
    if (r > GS_MAX_ROWS || srows > r) return -1;
    if (gram == NULL && tmin > 0 && srows >= tmin * (int64_t)threads) {
        /* Whole rows per thread, scattered transposed (many rows, a small output). */
        size_t asize = (size_t)width * VLANES;
        T *accs = (T *)aligned_alloc(64, (size_t)threads * asize * sizeof(T));
        if (accs == NULL) return -1;
#pragma omp parallel num_threads(threads) reduction(| : bad)
        {
            int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            int64_t r0 = srows * t / nt, r1 = srows * (t + 1) / nt;
            bad |= NAME(tscatter)(ptrs, starts, nseg, r, r0, r1, idx, out, width, os,
                                  accs + (size_t)t * asize);
        }
        free(accs);
        return bad;
    }
    if (gram == NULL && srows >= 2 * (int64_t)threads) {
        /* Whole rows per thread: no partial sums. */
#pragma omp parallel num_threads(threads) reduction(| : bad)
        {
            int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            int64_t r0 = srows * t / nt, r1 = srows * (t + 1) / nt;
            const T *src[GS_MAX_ROWS];
            T *dst[GS_MAX_ROWS];
            for (int64_t q = r0; q < r1; q++) dst[q - r0] = out + q * os;
            for (int64_t seg = 0; seg < nseg && r1 > r0; seg++) {
                for (int64_t q = r0; q < r1; q++) src[q - r0] = ptrs[seg * r + q];
                bad |= NAME(scatter_piece)(src, dst, r1 - r0, idx + starts[seg], width,
                                           starts[seg + 1] - starts[seg], chunk);
            }
        }
        return bad;
    }
    size_t psize = (size_t)srows * (size_t)width, gsize = (size_t)(r * r);
    T *part = NULL;
    double *gpart = NULL;
    if (threads > 1) {
        part = psize ? (T *)calloc((size_t)(threads - 1) * psize, sizeof(T)) : NULL;
        gpart = gram ? (double *)calloc((size_t)threads * gsize, sizeof(double)) : NULL;
        if ((psize && part == NULL) || (gram && gpart == NULL)) {
            free(part);
            free(gpart);
            return -1;
        }
    }
    if (gram != NULL) memset(gram, 0, gsize * sizeof(double));
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        T *dst[GS_MAX_ROWS];
        for (int64_t q = 0; q < srows; q++)
            dst[q] = t == 0 ? out + q * os : part + (size_t)(t - 1) * psize + (size_t)q * width;
        double *g = gpart != NULL ? gpart + (size_t)t * gsize : gram;
        bad |= NAME(reduce_columns)(ptrs, starts, nseg, r, srows, idx, dst, width, g,
                                    n * t / nt, n * (t + 1) / nt, chunk);
    }
    for (int64_t t = 1; t < threads && part != NULL; t++)
        for (int64_t q = 0; q < srows; q++) {
            T *o = out + q * os;
            const T *p = part + (size_t)(t - 1) * psize + (size_t)q * (size_t)width;
            for (int64_t j = 0; j < width; j++) o[j] += p[j];
        }
    for (int64_t t = 0; t < threads && gpart != NULL; t++)
        for (size_t e = 0; e < gsize; e++) gram[e] += gpart[(size_t)t * gsize + e];
    if (gram != NULL)
        for (int64_t a = 0; a < r; a++)
            for (int64_t b = 0; b < a; b++) gram[a * r + b] = gram[b * r + a];
    free(part);
    free(gpart);
    return bad;
}
