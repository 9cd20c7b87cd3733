/*
 * Train-mode kernels of the SLT sampler's working copy (gradsketch.slt._fast):
 * seeded dropout, the tanh form of GELU, attention weights' softmax with dropout, the
 * per-token cross-entropy, RMSNorm, SwiGLU and the rotary embedding, each forward and backward
 * in one memory pass.
 * A library of its own, compiled at first use by gradsketch._native_build and loaded by
 * gradsketch.slt._fast._native (GRADSKETCH_NATIVE_TRAIN=0 turns it off). Every loop is
 * written so that the compiler vectorizes it.
 */
#include <math.h>
/* GCC keeps a compare-and-select (the dropout test, a row's max) as control flow while
 * floating compares may trap, and then vectorizes none of these loops; no kernel here relies
 * on traps, and the values are the same element by element (no reassociation). GS_FAST_SELECTS
 * opens such a region and GS_END_SELECTS closes it. The element-wise activations (GELU,
 * SwiGLU) stay outside: there GCC 12 turns gs_expf's two clamps into three copies of the
 * whole expression under masks, 7 to 9 times slower than plain selects, for the same bits. */
#if defined(__GNUC__) && !defined(__clang__)
#define GS_PRAGMA(x) _Pragma(#x)
#define GS_FAST_SELECTS GS_PRAGMA(GCC push_options) GS_PRAGMA(GCC optimize("no-trapping-math"))
#define GS_END_SELECTS GS_PRAGMA(GCC pop_options)
#else
#define GS_FAST_SELECTS
#define GS_END_SELECTS
#endif
GS_FAST_SELECTS
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* SplitMix64's output function (Steele, Lea and Flood 2014) of a counter: 64 well-mixed
 * bits per block of four elements, from which each element takes one 16-bit lane. */
static inline uint64_t gs_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The 64 random bits of block b (elements 4b .. 4b + 3) under seed. */
static inline uint64_t gs_block_bits(uint64_t seed, uint64_t b) {
    return gs_mix64(seed + b * 0x9E3779B97F4A7C15ULL);
}

/* Elements per block of hashed bits. */
#define GS_DROP_CHUNK 1024

/* The 16 mask bits of elements first .. first + m - 1 (m <= GS_DROP_CHUNK): element i's are
 * lane i % 4 of its block's word gs_block_bits(seed, i / 4). The words of the blocks that
 * cover the elements are hashed once each and read as 16-bit lanes (little-endian: lane l
 * of word b is element 4b + l). Returns where element `first` is, inside `lanes`. */
static inline const uint16_t *gs_lanes(uint64_t seed, uint64_t first, int64_t m,
                                       uint64_t words[GS_DROP_CHUNK / 4 + 1],
                                       uint16_t lanes[GS_DROP_CHUNK + 4]) {
    uint64_t b0 = first >> 2;
    int64_t blocks = (int64_t)(((first + (uint64_t)m + 3) >> 2) - b0);
    for (int64_t b = 0; b < blocks; b++) words[b] = gs_block_bits(seed, b0 + (uint64_t)b);
    memcpy(lanes, words, (size_t)blocks * sizeof(uint64_t));
    return lanes + (first & 3);
}

/* y[i] = x[i] * scale when element i's bits (gs_lanes) are >= q, else 0 (whole blocks at a time).
 * The mask depends on (seed, i) only, so the backward pass applies the same call to the
 * incoming gradient. x and y may be the same array. */
void gs_dropout_f32(const float *x, float *y, int64_t n, uint64_t seed, uint32_t q,
                    float scale) {
    uint64_t words[GS_DROP_CHUNK / 4 + 1];
    uint16_t lanes[GS_DROP_CHUNK + 4];
    for (int64_t i0 = 0; i0 < n; i0 += GS_DROP_CHUNK) {
        int64_t m = n - i0 < GS_DROP_CHUNK ? n - i0 : GS_DROP_CHUNK;
        const uint16_t *bits = gs_lanes(seed, (uint64_t)i0, m, words, lanes);
        for (int64_t j = 0; j < m; j++)
            y[i0 + j] = bits[j] >= q ? x[i0 + j] * scale : 0.0f;
    }
}

GS_END_SELECTS

/* e^t, relative error a few ulp: 2^k e^r with |r| <= ln(2) / 2 and a degree-6 Taylor
 * polynomial of e^r (its remainder is below 2^-27); t is clamped to [-87, 88] so that
 * 2^k stays a normal float. always_inline: the kernels inside and outside GS_FAST_SELECTS
 * inline it alike (GCC declines to inline across differing optimize options otherwise). */
static inline __attribute__((always_inline)) float gs_expf(float t) {
    /* two plain selects (a nested one is control flow to the vectorizer) */
    t = t < -87.0f ? -87.0f : t;
    t = t > 88.0f ? 88.0f : t;
    /* k = round(t / ln 2) by adding and subtracting 1.5 * 2^23 (|t / ln 2| < 2^22) */
    float k = (t * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = t - k * 0.693145751953125f; /* ln 2 split in two for an exact product */
    r = r - k * 1.428606765330187045e-06f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f +
                  r * (0.041666667f + r * (0.0083333333f + r * 0.0013888889f)))));
    union {
        int32_t i;
        float f;
    } s = {.i = ((int32_t)k + 127) << 23};
    return p * s.f;
}

#define GS_GELU_C0 0.7978845608028654f /* sqrt(2 / pi) */
#define GS_GELU_C1 0.044715f

/* GELU's tanh form 0.5 x (1 + tanh u), u = sqrt(2 / pi) (x + 0.044715 x^3), computed as
 * x * sigmoid(2 u) = x / (1 + e^(-2u)), which has no cancellation for negative x. */
void gs_gelu_tanh_f32(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        float u2 = 2.0f * GS_GELU_C0 * v * (1.0f + GS_GELU_C1 * v * v);
        y[i] = v / (1.0f + gs_expf(-u2));
    }
}

/* dx = g * d/dx [x s], s = sigmoid(2u): g * (s + x s (1 - s) 2 u'), u' = sqrt(2/pi) (1 +
 * 3 * 0.044715 x^2). */
void gs_gelu_tanh_backward_f32(const float *g, const float *x, float *dx, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        float u2 = 2.0f * GS_GELU_C0 * v * (1.0f + GS_GELU_C1 * v * v);
        float e = gs_expf(-u2);
        float s = 1.0f / (1.0f + e); /* 1 - s = e s, without cancellation */
        float du2 = 2.0f * GS_GELU_C0 * (1.0f + 3.0f * GS_GELU_C1 * v * v);
        dx[i] = g[i] * (s + v * s * (e * s) * du2);
    }
}

GS_FAST_SELECTS

/* Sum and max of a row in 16 independent lanes (so that the loops vectorize), then lanes. */
#define GS_LANES 16

static inline float gs_row_max(const float *x, int64_t n) {
    float acc[GS_LANES];
    for (int l = 0; l < GS_LANES; l++) acc[l] = -3.4028234663852886e38f;
    int64_t j = 0;
    for (; j + GS_LANES <= n; j += GS_LANES)
        for (int l = 0; l < GS_LANES; l++) acc[l] = x[j + l] > acc[l] ? x[j + l] : acc[l];
    float m = -3.4028234663852886e38f;
    for (int l = 0; l < GS_LANES; l++) m = acc[l] > m ? acc[l] : m;
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

static inline float gs_row_sum(const float *x, int64_t n) {
    float acc[GS_LANES] = {0};
    int64_t j = 0;
    for (; j + GS_LANES <= n; j += GS_LANES)
        for (int l = 0; l < GS_LANES; l++) acc[l] += x[j + l];
    float s = 0.0f;
    for (int l = 0; l < GS_LANES; l++) s += acc[l];
    for (; j < n; j++) s += x[j];
    return s;
}

static inline float gs_row_dot(const float *x, const float *y, int64_t n) {
    float acc[GS_LANES] = {0};
    int64_t j = 0;
    for (; j + GS_LANES <= n; j += GS_LANES)
        for (int l = 0; l < GS_LANES; l++) acc[l] += x[j + l] * y[j + l];
    float s = 0.0f;
    for (int l = 0; l < GS_LANES; l++) s += acc[l];
    for (; j < n; j++) s += x[j] * y[j];
    return s;
}

static inline float gs_row_sum_exp(const float *x, int64_t n, float shift) {
    float acc[GS_LANES] = {0};
    int64_t j = 0;
    for (; j + GS_LANES <= n; j += GS_LANES)
        for (int l = 0; l < GS_LANES; l++) acc[l] += gs_expf(x[j + l] - shift);
    float s = 0.0f;
    for (int l = 0; l < GS_LANES; l++) s += acc[l];
    for (; j < n; j++) s += gs_expf(x[j] - shift);
    return s;
}

/* Keys query row `row` of `q_len` (aligned to the last of `cols` keys) sees: all when not
 * causal, else those <= row + cols - q_len (at least one). */
static inline int64_t gs_seen(int64_t row, int64_t q_len, int64_t cols, int causal) {
    int64_t seen = causal ? row + cols - q_len + 1 : cols;
    return seen > cols ? cols : (seen < 1 ? 1 : seen);
}

/* w = p with gs_dropout_f32's mask of elements first .. first + cols - 1 (scaled by dscale). */
static inline void gs_dropout_row(const float *p, float *w, int64_t cols, uint64_t seed,
                                  uint64_t first, uint32_t q, float dscale) {
    uint64_t words[GS_DROP_CHUNK / 4 + 1];
    uint16_t lanes[GS_DROP_CHUNK + 4];
    for (int64_t j0 = 0; j0 < cols; j0 += GS_DROP_CHUNK) {
        int64_t n = cols - j0 < GS_DROP_CHUNK ? cols - j0 : GS_DROP_CHUNK;
        const uint16_t *bits = gs_lanes(seed, first + (uint64_t)j0, n, words, lanes);
        const float *pc = p + j0;
        float *wc = w + j0;
        for (int64_t j = 0; j < n; j++) wc[j] = bits[j] >= q ? pc[j] * dscale : 0.0f;
    }
}

/* p = softmax(scale * s) over the first `seen` of `cols` keys, 0 after. Loops without a
 * carried dependency (the max and the sum in gs_row_* lanes), so that each vectorizes. */
static inline void gs_softmax_row(const float *s, float *p, int64_t cols, int64_t seen,
                                  float scale) {
    for (int64_t j = 0; j < seen; j++) p[j] = s[j] * scale;
    float m = gs_row_max(p, seen);
    for (int64_t j = 0; j < seen; j++) p[j] = gs_expf(p[j] - m);
    float inv = 1.0f / gs_row_sum(p, seen);
    for (int64_t j = 0; j < seen; j++) p[j] *= inv;
    for (int64_t j = seen; j < cols; j++) p[j] = 0.0f;
}

/* d = scale * p * (gm - sum_j gm_j p_j), gm = the dropout mask (of elements first ..) times
 * dscale times g: the gradient of the scores of one row. d may be g. */
static inline void gs_softmax_dropout_row_backward(const float *g, const float *p, float *d,
                                                   int64_t cols, float scale, uint64_t seed,
                                                   uint64_t first, uint32_t q, float dscale) {
    gs_dropout_row(g, d, cols, seed, first, q, dscale);
    float dot = gs_row_dot(d, p, cols);
    for (int64_t j = 0; j < cols; j++) d[j] = scale * p[j] * (d[j] - dot);
}

/* Attention weights with dropout, for scores without a mask or with the causal one: for each
 * of `rows` rows of `cols` scores (row r is query r % q_len, gs_seen), probs = softmax(scale
 * * scores) (masked keys 0) and out = probs with gs_dropout_f32's mask of element
 * r * cols + j under `seed`. */
void gs_softmax_dropout_f32(const float *scores, float *probs, float *out, int64_t rows,
                            int64_t cols, int64_t q_len, int causal, float scale,
                            uint64_t seed, uint32_t q, float dscale) {
    for (int64_t r = 0; r < rows; r++) {
        float *p = probs + r * cols;
        gs_softmax_row(scores + r * cols, p, cols, gs_seen(r % q_len, q_len, cols, causal), scale);
        gs_dropout_row(p, out + r * cols, cols, seed, (uint64_t)(r * cols), q, dscale);
    }
}

/* The gradient of gs_softmax_dropout_f32's scores, row by row
 * (gs_softmax_dropout_row_backward). */
void gs_softmax_dropout_backward_f32(const float *grad_out, const float *probs,
                                     float *grad_scores, int64_t rows, int64_t cols,
                                     float scale, uint64_t seed, uint32_t q, float dscale) {
    for (int64_t r = 0; r < rows; r++)
        gs_softmax_dropout_row_backward(grad_out + r * cols, probs + r * cols,
                                        grad_scores + r * cols, cols, scale, seed,
                                        (uint64_t)(r * cols), q, dscale);
}

/* ------------------------------------------------------------------ fused attention */

/* The Fortran BLAS sgemm (column-major; the caller passes the one torch or SciPy uses). */
typedef void (*gs_sgemm_fn)(const char *, const char *, const int *, const int *, const int *,
                            const float *, const float *, const int *, const float *,
                            const int *, const float *, float *, const int *);

/* Row-major C (m x n, row stride ldc) = alpha op(A) op(B) + beta C, with A (m x k after op)
 * and B (k x n after op) row-major of row strides lda and ldb (op: transposed when ta / tb
 * is 'T'): column-major sgemm of the transposes, C^T = op(B)^T op(A)^T. */
static inline void gs_gemm_rm(gs_sgemm_fn gemm, char ta, char tb, int64_t m, int64_t n,
                              int64_t k, float alpha, const float *a, int64_t lda,
                              const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
    int im = (int)m, in = (int)n, ik = (int)k, ia = (int)lda, ib = (int)ldb, ic = (int)ldc;
    gemm(&tb, &ta, &in, &im, &ik, &alpha, b, &ib, a, &ia, &beta, c, &ic);
}

/* Shapes and element strides of one attention call. Tensors are [batch, heads, tokens, d]
 * with unit stride along d; key and value have kv_heads heads, each serving heads / kv_heads
 * query heads (grouped-query attention); out is written [batch, heads, q_len, d] through its
 * strides. */
typedef struct {
    int64_t batch, heads, kv_heads, q_len, k_len, d;
    int64_t q[3], k[3], v[3], o[3]; /* batch, head and token strides */
} gs_attn_shape;

/* `floats` of scratch for one batch's rows of scores, or NULL with *failed set (any thread). */
static inline float *gs_attn_scratch(int64_t floats, int *failed) {
    float *p = malloc((size_t)floats * sizeof(float));
    if (!p) {
#pragma omp atomic write
        *failed = 1;
    }
    return p;
}

/* softmax(scale q k^T) (causal or not) with dropout, times v, for every (batch, head):
 * probs [batch, heads, q_len, k_len] (contiguous) receives the softmax when not NULL (for the
 * backward pass); the dropout mask of element ((b * heads + h) * q_len + i) * k_len + j is
 * gs_softmax_dropout_f32's. The products run in `gemm`, reading q, k and v where they lie;
 * batches are shared among `threads` OpenMP threads. Returns 0, or -1 when out of memory. */
int gs_attention_f32(gs_sgemm_fn gemm, int threads, const gs_attn_shape *sh, const float *q,
                     const float *k, const float *v, float *out, float *probs, int causal,
                     float scale, uint64_t seed, uint32_t qdrop, float dscale) {
    const int64_t tq = sh->q_len, tk = sh->k_len, group = sh->heads / sh->kv_heads;
    int failed = 0;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t b = 0; b < sh->batch; b++) {
        float *scratch = gs_attn_scratch(tq * tk * (probs ? 2 : 3), &failed);
        if (!scratch) continue;
        float *s = scratch, *w = scratch + tq * tk;
        for (int64_t h = 0; h < sh->heads; h++) {
            const int64_t g = h / group, bh = b * sh->heads + h;
            const float *qh = q + b * sh->q[0] + h * sh->q[1];
            const float *kh = k + b * sh->k[0] + g * sh->k[1];
            const float *vh = v + b * sh->v[0] + g * sh->v[1];
            float *p = probs ? probs + bh * tq * tk : scratch + 2 * tq * tk;
            gs_gemm_rm(gemm, 'N', 'T', tq, tk, sh->d, 1.0f, qh, sh->q[2], kh, sh->k[2], 0.0f, s,
                       tk);
            for (int64_t i = 0; i < tq; i++) {
                gs_softmax_row(s + i * tk, p + i * tk, tk, gs_seen(i, tq, tk, causal), scale);
                gs_dropout_row(p + i * tk, w + i * tk, tk, seed, (uint64_t)((bh * tq + i) * tk),
                               qdrop, dscale);
            }
            gs_gemm_rm(gemm, 'N', 'N', tq, sh->d, tk, 1.0f, w, tk, vh, sh->v[2], 0.0f,
                       out + b * sh->o[0] + h * sh->o[1], sh->o[2]);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* The backward pass of gs_attention_f32 from its probs: dq, dk and dv for the gradient dout
 * of out. sh gives the sizes and the strides of q, k and v; gr those of dq, dk, dv and dout
 * (in its q, k, v and o). dk and dv of a key/value head sum over the query heads it serves.
 * Returns 0, or -1 when out of memory. */
int gs_attention_backward_f32(gs_sgemm_fn gemm, int threads, const gs_attn_shape *sh,
                              const gs_attn_shape *gr, const float *dout, const float *q,
                              const float *k, const float *v, const float *probs, float *dq,
                              float *dk, float *dv, float scale, uint64_t seed, uint32_t qdrop,
                              float dscale) {
    const int64_t tq = sh->q_len, tk = sh->k_len, group = sh->heads / sh->kv_heads;
    int failed = 0;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t b = 0; b < sh->batch; b++) {
        float *scratch = gs_attn_scratch(tq * tk * 2, &failed);
        if (!scratch) continue;
        float *w = scratch, *ds = scratch + tq * tk;
        for (int64_t h = 0; h < sh->heads; h++) {
            const int64_t g = h / group, bh = b * sh->heads + h;
            const float beta = h % group ? 1.0f : 0.0f; /* a group's first head overwrites */
            const float *p = probs + bh * tq * tk;
            const float *qh = q + b * sh->q[0] + h * sh->q[1];
            const float *kh = k + b * sh->k[0] + g * sh->k[1];
            const float *vh = v + b * sh->v[0] + g * sh->v[1];
            const float *doh = dout + b * gr->o[0] + h * gr->o[1];
            float *dqh = dq + b * gr->q[0] + h * gr->q[1];
            float *dkh = dk + b * gr->k[0] + g * gr->k[1];
            float *dvh = dv + b * gr->v[0] + g * gr->v[1];
            for (int64_t i = 0; i < tq; i++)
                gs_dropout_row(p + i * tk, w + i * tk, tk, seed, (uint64_t)((bh * tq + i) * tk),
                               qdrop, dscale);
            /* dv += w^T dout; d(weights) = dout v^T, then the scores' gradient in place */
            gs_gemm_rm(gemm, 'T', 'N', tk, sh->d, tq, 1.0f, w, tk, doh, gr->o[2], beta, dvh,
                       gr->v[2]);
            gs_gemm_rm(gemm, 'N', 'T', tq, tk, sh->d, 1.0f, doh, gr->o[2], vh, sh->v[2], 0.0f,
                       ds, tk);
            for (int64_t i = 0; i < tq; i++)
                gs_softmax_dropout_row_backward(ds + i * tk, p + i * tk, ds + i * tk, tk, scale,
                                                seed, (uint64_t)((bh * tq + i) * tk), qdrop,
                                                dscale);
            /* dq = ds k; dk += ds^T q */
            gs_gemm_rm(gemm, 'N', 'N', tq, sh->d, tk, 1.0f, ds, tk, kh, sh->k[2], 0.0f, dqh,
                       gr->q[2]);
            gs_gemm_rm(gemm, 'T', 'N', tk, sh->d, tq, 1.0f, ds, tk, qh, sh->q[2], beta, dkh,
                       gr->k[2]);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* Per-row cross-entropy of logits x [rows, v] and targets t: loss[r] = lse[r] - x[r, t[r]],
 * lse[r] = log sum_j e^x[r, j] (kept for the backward pass); a negative target (ignored)
 * gives loss 0, as torch's ignore_index. */
void gs_token_xent_f32(const float *x, const int64_t *t, float *loss, float *lse,
                       int64_t rows, int64_t v) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * v;
        float m = gs_row_max(row, v);
        float l = m + logf(gs_row_sum_exp(row, v, m));
        lse[r] = l;
        loss[r] = t[r] >= 0 && t[r] < v ? l - row[t[r]] : 0.0f;
    }
}

/* dx[r, j] = g[r] (softmax(x[r])_j - [j == t[r]]), 0 for ignored rows. */
void gs_token_xent_backward_f32(const float *g, const float *x, const int64_t *t,
                                const float *lse, float *dx, int64_t rows, int64_t v) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * v;
        float *out = dx + r * v;
        int ignored = !(t[r] >= 0 && t[r] < v);
        float gr = ignored ? 0.0f : g[r], l = lse[r];
        for (int64_t j = 0; j < v; j++) out[j] = gr * gs_expf(row[j] - l);
        if (!ignored) out[t[r]] -= gr;
    }
}

/* RMSNorm of rows of d (Zhang and Sennrich 2019, as Llama's): y = w * (x * rstd),
 * rstd = 1 / sqrt(mean(x^2) + eps), kept per row for the backward pass. */
void gs_rmsnorm_f32(const float *x, const float *w, float *y, float *rstd, int64_t rows,
                    int64_t d, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * d;
        float *out = y + r * d;
        float s = 1.0f / sqrtf(gs_row_dot(row, row, d) / (float)d + eps);
        rstd[r] = s;
        for (int64_t j = 0; j < d; j++) out[j] = w[j] * (row[j] * s);
    }
}

/* Backward of gs_rmsnorm_f32: with h = g * w, dx = rstd * h - x * rstd^3 * (h . x) / d;
 * dw[j] += sum over rows of g * x * rstd, accumulated in double (dw is zeroed by the caller). */
void gs_rmsnorm_backward_f32(const float *g, const float *x, const float *w, const float *rstd,
                             float *dx, double *dw, int64_t rows, int64_t d) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gr = g + r * d, *xr = x + r * d;
        float *out = dx + r * d;
        float s = rstd[r];
        float acc[GS_LANES] = {0};
        int64_t j = 0;
        for (; j + GS_LANES <= d; j += GS_LANES)
            for (int l = 0; l < GS_LANES; l++) acc[l] += gr[j + l] * w[j + l] * xr[j + l];
        float dot = 0.0f;
        for (int l = 0; l < GS_LANES; l++) dot += acc[l];
        for (; j < d; j++) dot += gr[j] * w[j] * xr[j];
        float c = s * s * s * dot / (float)d;
        for (j = 0; j < d; j++) {
            out[j] = s * (gr[j] * w[j]) - c * xr[j];
            dw[j] += (double)(gr[j] * (xr[j] * s));
        }
    }
}

GS_END_SELECTS

/* SwiGLU (Shazeer 2020): y = silu(a) * u, silu(a) = a / (1 + e^-a), over rows of f; row r
 * of a and u starts at r * in_stride (the two halves of one [rows, 2f] product: stride 2f). */
void gs_swiglu_f32(const float *a, const float *u, int64_t in_stride, float *y, int64_t rows,
                   int64_t f) {
    for (int64_t r = 0; r < rows; r++) {
        const float *ar = a + r * in_stride, *ur = u + r * in_stride;
        float *out = y + r * f;
        for (int64_t j = 0; j < f; j++) out[j] = ar[j] / (1.0f + gs_expf(-ar[j])) * ur[j];
    }
}

/* Backward of gs_swiglu_f32: with s = sigmoid(a), da = g * u * s * (1 + a (1 - s)) and
 * du = g * a * s; rows of da and du start at r * out_stride. */
void gs_swiglu_backward_f32(const float *g, const float *a, const float *u, int64_t in_stride,
                            float *da, float *du, int64_t out_stride, int64_t rows, int64_t f) {
    for (int64_t r = 0; r < rows; r++) {
        const float *ar = a + r * in_stride, *ur = u + r * in_stride, *gr = g + r * f;
        float *dar = da + r * out_stride, *dur = du + r * out_stride;
        for (int64_t j = 0; j < f; j++) {
            float e = gs_expf(-ar[j]);
            float s = 1.0f / (1.0f + e); /* 1 - s = e s, without cancellation */
            dar[j] = gr[j] * ur[j] * (s * (1.0f + ar[j] * (e * s)));
            dur[j] = gr[j] * (ar[j] * s);
        }
    }
}

/* ------------------------------------------------------------------ rotary embedding */

GS_FAST_SELECTS

/* Rotary position embedding (Su et al. 2021) as transformers applies it: of each head's d
 * values the first r rotate in two halves of h = r / 2,
 *     y[j] = x[j] c[j] - x[j + h] s[j],   y[j + h] = x[j + h] c[j + h] + x[j] s[j + h],
 * and the rest pass through; with `backward` set it applies the transpose to a gradient,
 *     y[j] = x[j] c[j] + x[j + h] s[j + h],   y[j + h] = x[j + h] c[j + h] - x[j] s[j].
 * x and y are [batch, heads, tokens, d] with element strides xs and ys (batch, head, token;
 * unit along d); c and s are [batch or 1, tokens, r] with strides cs (batch, token; 0 for a
 * broadcast batch) and unit along r. Each element is one rounded product per term and one
 * rounded sum, never contracted to a fused multiply-add: the bits of torch's
 * x * c + rotate_half(x) * s and of its autograd transpose. */
#if defined(__clang__)
#pragma clang fp contract(off)
#define GS_NO_CONTRACT
#elif defined(__GNUC__)
#define GS_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define GS_NO_CONTRACT
#endif

GS_NO_CONTRACT
void gs_rotary_f32(const float *x, const int64_t *xs, const float *c, const float *s,
                   const int64_t *cs, float *y, const int64_t *ys, int64_t batch, int64_t heads,
                   int64_t tokens, int64_t d, int64_t r, int backward) {
    int64_t h = r / 2;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t t = 0; t < tokens; t++) {
            /* one row of cos and sin serves every head of the token */
            const float *cr = c + b * cs[0] + t * cs[1], *sr = s + b * cs[0] + t * cs[1];
            for (int64_t n = 0; n < heads; n++) {
                const float *xr = x + b * xs[0] + n * xs[1] + t * xs[2];
                float *yr = y + b * ys[0] + n * ys[1] + t * ys[2];
                if (!backward) {
                    for (int64_t j = 0; j < h; j++) {
                        yr[j] = xr[j] * cr[j] - xr[j + h] * sr[j];
                        yr[j + h] = xr[j + h] * cr[j + h] + xr[j] * sr[j + h];
                    }
                } else {
                    for (int64_t j = 0; j < h; j++) {
                        yr[j] = xr[j] * cr[j] + xr[j + h] * sr[j + h];
                        yr[j + h] = xr[j + h] * cr[j + h] - xr[j] * sr[j];
                    }
                }
                for (int64_t j = r; j < d; j++) yr[j] = xr[j];
            }
        }
}

GS_END_SELECTS

/* The interface version; gradsketch.slt._fast._native refuses a library that reports another. */
int gs_train_abi_version(void) { return 3; }
