/* The counter-based direction stream of zo_byzantine.directions, fused with the sum it feeds.
 *
 * Element k of a direction tensor with key K (64 bits, from the direction seed and the tensor index) is a
 * pure function of (K, k):
 *
 *     x = splitmix64(K + (k / 2 + 1) * GAMMA)             one 64-bit word per pair of elements
 *     gaussian:   (z[2p], z[2p+1]) = r (cos theta, sin theta)   Box-Muller, r^2 = -2 ln u, theta = 2 pi v
 *                 u = (x[63:40] + 1) / 2^24,  octant of theta = x[23:21],  angle within it from x[20:0]
 *     rademacher: z[2p] = -1 if x[63] else 1,  z[2p+1] = -1 if x[31] else 1
 *
 * ln, sin and cos are the fixed polynomials below, evaluated in float32 with +, -, *, / and sqrt only, each
 * rounded once (build with -ffp-contract=off: no fused multiply-add), so every IEEE-754 device gives the same
 * bits. directions.py holds the same arithmetic in plain torch; the tests check the two bitwise.
 *
 * combine: out = base + sum_k c_k z_k (accumulated in the order of the terms, in float or double), one pass
 * over base/out per tile of pairs, z never stored. generate: out = z.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define GAMMA 0x9E3779B97F4A7C15ULL
#define TILE 256 /* pairs per tile: the accumulator stays in L1 */

#define SQRT2F ((float)1.4142135623730951)
#define LN2F ((float)0.6931471805599453)
#define QUARTER_PIF ((float)0.7853981633974483)

static inline uint64_t mix(uint64_t key, uint64_t pair) {
    uint64_t x = key + (pair + 1) * GAMMA;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static inline void gaussian_pair(uint64_t x, float *za, float *zb) {
    uint32_t hi = (uint32_t)(x >> 40), lo = (uint32_t)(x & 0xFFFFFFu);
    float n = (float)(hi + 1u); /* u = n 2^-24 in (0, 1], n exact */
    uint32_t bits;
    memcpy(&bits, &n, 4);
    int32_t e = (int32_t)(bits >> 23) - 127;
    uint32_t mb = (bits & 0x7FFFFFu) | 0x3F800000u;
    float m;
    memcpy(&m, &mb, 4); /* n = m 2^e, m in [1, 2) */
    int32_t big = m > SQRT2F;
    m = big ? m * 0.5f : m;
    e = e + big; /* m in [sqrt(1/2), sqrt(2)] */
    float s = (m - 1.0f) / (m + 1.0f);
    float s2 = s * s;
    float t = s2 * (float)(1.0 / 7.0) + (float)(1.0 / 5.0);
    t = t * s2 + (float)(1.0 / 3.0);
    t = t * s2 + 1.0f;
    float lnm = (s * t) * 2.0f; /* ln m = 2 atanh(s) */
    float lnu = (float)(e - 24) * LN2F + lnm;
    float r = sqrtf(lnu * -2.0f);

    uint32_t o = lo >> 21; /* octant of theta */
    uint32_t f = lo & 0x1FFFFFu;
    f = (o & 1u) ? 0x1FFFFFu - f : f; /* odd octants: the angle from the octant's end (exact) */
    float a = (((float)f + 0.5f) * (float)(1.0 / 2097152.0)) * QUARTER_PIF; /* in (0, pi/4) */
    float a2 = a * a;
    float sn = a2 * (float)(-1.0 / 5040.0) + (float)(1.0 / 120.0);
    sn = sn * a2 + (float)(-1.0 / 6.0);
    sn = sn * a2 + 1.0f;
    sn = sn * a;
    float cs = a2 * (float)(1.0 / 40320.0) + (float)(-1.0 / 720.0);
    cs = cs * a2 + (float)(1.0 / 24.0);
    cs = cs * a2 + (float)(-1.0 / 2.0);
    cs = cs * a2 + 1.0f;
    float c0 = (o & 1u) ? sn : cs, s0 = (o & 1u) ? cs : sn; /* cos, sin of theta - q pi/2 */
    uint32_t q = o >> 1;
    float c = q == 0 ? c0 : q == 1 ? -s0 : q == 2 ? -c0 : s0;
    float d = q == 0 ? s0 : q == 1 ? c0 : q == 2 ? -s0 : -c0;
    *za = r * c;
    *zb = r * d;
}

static inline void rademacher_pair(uint64_t x, float *za, float *zb) {
    *za = (x >> 63) ? -1.0f : 1.0f;
    *zb = ((x >> 31) & 1u) ? -1.0f : 1.0f;
}

/* One tile of pairs [p0, p0 + np) of direction `key`, accumulated into acc (first term: assigned). */
#define TILE_LOOP(PAIR, T)                                                                                    \
    if (first_term) {                                                                                         \
        for (int64_t i = 0; i < np; i++) {                                                                    \
            float za, zb;                                                                                     \
            PAIR(mix(key, (uint64_t)(p0 + i)), &za, &zb);                                                     \
            acc[2 * i] = (T)za * c;                                                                           \
            acc[2 * i + 1] = (T)zb * c;                                                                       \
        }                                                                                                     \
    } else {                                                                                                  \
        for (int64_t i = 0; i < np; i++) {                                                                    \
            float za, zb;                                                                                     \
            PAIR(mix(key, (uint64_t)(p0 + i)), &za, &zb);                                                     \
            acc[2 * i] = acc[2 * i] + (T)za * c;                                                              \
            acc[2 * i + 1] = acc[2 * i + 1] + (T)zb * c;                                                      \
        }                                                                                                     \
    }

#define ACCUMULATE(NAME, T)                                                                                   \
    static void NAME(T *restrict acc, int64_t p0, int64_t np, uint64_t key, T c, int gaussian,               \
                     int first_term) {                                                                        \
        if (gaussian) {                                                                                       \
            TILE_LOOP(gaussian_pair, T)                                                                       \
        } else {                                                                                              \
            TILE_LOOP(rademacher_pair, T)                                                                     \
        }                                                                                                     \
    }

ACCUMULATE(accumulate_f32, float)
ACCUMULATE(accumulate_f64, double)

/* Pairs [pair_begin, pair_end) of a tensor of n elements. */
#define COMBINE(NAME, ACC, T)                                                                                 \
    void NAME(const T *base, T *out, int64_t n, const uint64_t *keys, const double *coeffs, int64_t K,      \
              int gaussian, int64_t pair_begin, int64_t pair_end) {                                           \
        T acc[2 * TILE];                                                                                      \
        if (K <= 0) { /* no terms: out = base */                                                              \
            for (int64_t i = 2 * pair_begin; i < 2 * pair_end && i < n; i++)                                  \
                out[i] = base[i];                                                                             \
            return;                                                                                           \
        }                                                                                                     \
        for (int64_t p0 = pair_begin; p0 < pair_end; p0 += TILE) {                                            \
            int64_t np = pair_end - p0 < TILE ? pair_end - p0 : TILE;                                         \
            for (int64_t k = 0; k < K; k++)                                                                   \
                ACC(acc, p0, np, keys[k], (T)coeffs[k], gaussian, k == 0);                                    \
            int64_t first = 2 * p0, count = 2 * np < n - first ? 2 * np : n - first;                          \
            for (int64_t i = 0; i < count; i++)                                                               \
                out[first + i] = base[first + i] + acc[i];                                                    \
        }                                                                                                     \
    }

COMBINE(zo_combine_f32, accumulate_f32, float)
COMBINE(zo_combine_f64, accumulate_f64, double)

void zo_generate(float *out, int64_t n, uint64_t key, int gaussian, int64_t pair_begin, int64_t pair_end) {
    float buf[2 * TILE];
    for (int64_t p0 = pair_begin; p0 < pair_end; p0 += TILE) {
        int64_t np = pair_end - p0 < TILE ? pair_end - p0 : TILE;
        accumulate_f32(buf, p0, np, key, 1.0f, gaussian, 1); /* z * 1 == z, signed zeros included */
        int64_t first = 2 * p0, count = 2 * np < n - first ? 2 * np : n - first;
        memcpy(out + first, buf, (size_t)count * sizeof(float));
    }
}

/* step_rounded_bf16: a bfloat16 weight's update, rounded stochastically, in one pass (rounding.py's arithmetic):
 *     x = float(w) * decay (when has_decay),  x = x + sum_k c_k z_k (when K > 0, the sum accumulated as combine's),
 *     w = upper 16 bits of (bits(x) + r) mod 2^32,  r = bits 16 (k mod 4) .. of mix(round_key, k / 4),
 * so the float32 update is never stored and the rounding bits are the ones rounding.uniform_bits draws. */
void zo_step_rounded_bf16(uint16_t *w, int64_t n, const uint64_t *keys, const double *coeffs, int64_t K,
                          int gaussian, float decay, int has_decay, uint64_t round_key, int64_t pair_begin,
                          int64_t pair_end) {
    float acc[2 * TILE];
    uint16_t r16[2 * TILE + 8]; /* the tile's rounding bits, from the word of its first element on */
    for (int64_t p0 = pair_begin; p0 < pair_end; p0 += TILE) {
        int64_t np = pair_end - p0 < TILE ? pair_end - p0 : TILE;
        for (int64_t k = 0; k < K; k++)
            accumulate_f32(acc, p0, np, keys[k], (float)coeffs[k], gaussian, k == 0);
        int64_t first = 2 * p0, count = 2 * np < n - first ? 2 * np : n - first;
        int64_t word0 = first / 4, words = (first + count + 3) / 4 - word0;
        for (int64_t j = 0; j < words; j++) {
            uint64_t x = mix(round_key, (uint64_t)(word0 + j));
            for (int q = 0; q < 4; q++)
                r16[4 * j + q] = (uint16_t)(x >> (16 * q));
        }
        for (int64_t i = 0; i < count; i++) {
            int64_t e = first + i;
            uint32_t bits = (uint32_t)w[e] << 16;
            float x;
            memcpy(&x, &bits, 4);
            if (has_decay)
                x = x * decay;
            if (K > 0)
                x = x + acc[i];
            memcpy(&bits, &x, 4);
            w[e] = (uint16_t)((bits + r16[e - 4 * word0]) >> 16);
        }
    }
}

/* generate_rows: out[i, c] = z[rows[i] * width + c] for c < width, the elements of a [*, width] tensor's rows (an
 * embedding table's rows a forward reads); a pair that straddles two rows is drawn for each. */
void zo_generate_rows(float *out, int64_t width, const int64_t *rows, int64_t row_begin, int64_t row_end,
                      uint64_t key, int gaussian) {
    float buf[2 * TILE];
    for (int64_t i = row_begin; i < row_end; i++) {
        int64_t start = rows[i] * width, end = start + width; /* elements [start, end) */
        for (int64_t p0 = start / 2; 2 * p0 < end; p0 += TILE) {
            int64_t np = (end + 1) / 2 - p0 < TILE ? (end + 1) / 2 - p0 : TILE;
            accumulate_f32(buf, p0, np, key, 1.0f, gaussian, 1);
            for (int64_t e = 2 * p0 > start ? 2 * p0 : start; e < 2 * (p0 + np) && e < end; e++)
                out[i * width + (e - start)] = buf[e - 2 * p0];
        }
    }
}
