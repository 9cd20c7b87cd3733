/*
 * Train-mode kernels of the SLT sampler's working copy (gradsketch.slt._train_forward):
 * seeded dropout, the tanh form of GELU, attention weights' softmax with dropout and the
 * per-token cross-entropy, each forward and backward in one memory pass.
 * Included by gs_kernels.c. Every loop is written so that the compiler vectorizes it.
 */
#include <math.h>
#include <stdint.h>

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

/* Element idx's 16 bits: lane idx % 4 of its block's word, as gs_dropout_f32 reads them. */
static inline uint32_t gs_element_bits(uint64_t seed, uint64_t idx) {
    return (uint32_t)(gs_block_bits(seed, idx >> 2) >> (16 * (idx & 3))) & 0xFFFFu;
}

/* Elements per block of hashed bits. */
#define GS_DROP_CHUNK 1024

/* y[i] = x[i] * scale when gs_element_bits(seed, i) >= q, else 0 (whole blocks at a time).
 * The mask depends on (seed, i) only, so the backward pass applies the same call to the
 * incoming gradient. x and y may be the same array. */
void gs_dropout_f32(const float *x, float *y, int64_t n, uint64_t seed, uint32_t q,
                    float scale) {
    for (int64_t i0 = 0; i0 < n; i0 += GS_DROP_CHUNK) {
        uint64_t words[GS_DROP_CHUNK / 4];
        uint16_t lanes[GS_DROP_CHUNK];
        int64_t m = n - i0 < GS_DROP_CHUNK ? n - i0 : GS_DROP_CHUNK;
        int64_t b0 = i0 / 4;
        for (int64_t b = 0; b < (m + 3) / 4; b++)
            words[b] = gs_block_bits(seed, (uint64_t)(b0 + b));
        memcpy(lanes, words, sizeof lanes); /* little-endian: lane l of word b is element 4b + l */
        for (int64_t j = 0; j < m; j++)
            y[i0 + j] = lanes[j] >= q ? x[i0 + j] * scale : 0.0f;
    }
}

/* e^t, relative error a few ulp: 2^k e^r with |r| <= ln(2) / 2 and a degree-6 Taylor
 * polynomial of e^r (its remainder is below 2^-27); t is clamped to [-87, 88] so that
 * 2^k stays a normal float. */
static inline float gs_expf(float t) {
    t = t < -87.0f ? -87.0f : (t > 88.0f ? 88.0f : t);
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

/* Attention weights with dropout, for scores without a mask or with the causal one: for each
 * of `rows` rows of `cols` scores (row r is query r % q_len, which sees keys <= its position
 * + cols - q_len when causal), probs = softmax(scale * scores) (masked keys 0) and out =
 * probs with gs_dropout_f32's mask of element r * cols + j under `seed` (gs_element_bits). */
void gs_softmax_dropout_f32(const float *scores, float *probs, float *out, int64_t rows,
                            int64_t cols, int64_t q_len, int causal, float scale,
                            uint64_t seed, uint32_t q, float dscale) {
    for (int64_t r = 0; r < rows; r++) {
        const float *s = scores + r * cols;
        float *p = probs + r * cols, *o = out + r * cols;
        int64_t seen = causal ? (r % q_len) + cols - q_len + 1 : cols;
        if (seen > cols) seen = cols;
        if (seen < 1) seen = 1;
        float m = s[0] * scale;
        for (int64_t j = 1; j < seen; j++) m = s[j] * scale > m ? s[j] * scale : m;
        float total = 0.0f;
        for (int64_t j = 0; j < seen; j++) {
            p[j] = gs_expf(s[j] * scale - m);
            total += p[j];
        }
        float inv = 1.0f / total;
        for (int64_t j = 0; j < seen; j++) p[j] *= inv;
        for (int64_t j = seen; j < cols; j++) p[j] = 0.0f;
        uint64_t first = (uint64_t)(r * cols);
        for (int64_t j = 0; j < cols; j++) {
            o[j] = gs_element_bits(seed, first + (uint64_t)j) >= q ? p[j] * dscale : 0.0f;
        }
    }
}

/* The gradient of the scores: with gp = the dropout mask times dscale times grad_out,
 * grad_scores = scale * probs * (gp - sum_j gp_j probs_j), row by row. */
void gs_softmax_dropout_backward_f32(const float *grad_out, const float *probs,
                                     float *grad_scores, int64_t rows, int64_t cols,
                                     float scale, uint64_t seed, uint32_t q, float dscale) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = grad_out + r * cols, *p = probs + r * cols;
        float *d = grad_scores + r * cols;
        uint64_t first = (uint64_t)(r * cols);
        float dot = 0.0f;
        for (int64_t j = 0; j < cols; j++) {
            d[j] = gs_element_bits(seed, first + (uint64_t)j) >= q ? g[j] * dscale : 0.0f;
            dot += d[j] * p[j];
        }
        for (int64_t j = 0; j < cols; j++) d[j] = scale * p[j] * (d[j] - dot);
    }
}

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
