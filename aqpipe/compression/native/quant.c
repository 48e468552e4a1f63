/* Fused k-bit quantizer kernels for aqpipe (CPU).
 *
 * compression/kernels.py holds a pure-torch twin of each function that gives
 * bit-identical output: the same dither hash, the same float operations in the
 * same order, each rounded to float32 (built with -ffp-contract=off, so no FMA
 * contraction changes a result). Python splits the work across threads (ctypes
 * releases the GIL); each call takes an explicit range.
 *
 * Codes form a little-endian bit stream: code i holds bits [i*b, (i+1)*b), so
 * n codes take ceil(n*b/8) bytes and 8 codes always fill exactly b bytes.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

#define TILE 4096 /* codes staged in L1 between rounding and packing; a multiple of 8 */

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* Uniform dither in [0, 1) for element i under key (k0, k1): 24 random bits.
 * For a fixed element the dither is uniform over the random key (mix32 is a
 * bijection), which is what unbiased rounding needs; the hash decorrelates
 * neighbours. Indices repeat the pattern every 2**32 elements. */
static inline float dither(int64_t i, uint32_t k0, uint32_t k1) {
    uint32_t h = mix32((uint32_t)i * 0x9e3779b9U + k0) ^ k1;
    return (float)(h >> 8) * (1.0f / 16777216.0f);
}

#ifdef __BMI2__
#include <immintrin.h>
#endif

/* Mask of the low `bits` bits of each of 8 bytes: pext/pdep with it turn 8 codes
 * (one per byte) into 8*bits stream bits and back. */
static inline uint64_t lane_mask(int bits) { return 0x0101010101010101ULL * ((1ULL << bits) - 1ULL); }

static inline uint64_t squeeze8(uint64_t w, int bits) {
#ifdef __BMI2__
    return _pext_u64(w, lane_mask(bits));
#else
    uint64_t out = 0;
    for (int j = 0; j < 8; ++j) out |= ((w >> (8 * j)) & ((1ULL << bits) - 1ULL)) << (bits * j);
    return out;
#endif
}

static inline uint64_t spread8(uint64_t p, int bits) {
#ifdef __BMI2__
    return _pdep_u64(p, lane_mask(bits));
#else
    uint64_t out = 0;
    for (int j = 0; j < 8; ++j) out |= ((p >> (bits * j)) & ((1ULL << bits) - 1ULL)) << (8 * j);
    return out;
#endif
}

/* The loops below with `bits` a compile-time constant, so the memcpy of `bits`
 * bytes and the masks become a few instructions instead of library calls. */
#define BY_BITS(LOOP) switch (bits) { \
    case 1: LOOP(1); break; case 2: LOOP(2); break; case 3: LOOP(3); break; case 4: LOOP(4); break; \
    case 5: LOOP(5); break; case 6: LOOP(6); break; case 7: LOOP(7); break; default: LOOP(8); break; }

#define PACK_LOOP(B) for (int64_t c = 0; c < full; ++c) { \
        uint64_t w; \
        memcpy(&w, codes + 8 * c, 8); \
        w = squeeze8(w, B); \
        memcpy(out + (B) * c, &w, (B)); /* little-endian host (checked at load) */ \
    }

#define UNPACK_LOOP(B) for (int64_t c = 0; c < full; ++c) { \
        uint64_t w = 0; \
        memcpy(&w, src + (B) * c, (B)); \
        w = spread8(w, B); \
        memcpy(codes + 8 * c, &w, 8); \
    }

/* Pack `count` codes (a multiple of 8, or the stream's tail) into out. */
static void pack_codes(const uint8_t *codes, int64_t count, int bits, uint8_t *out) {
    int64_t full = count / 8;
    BY_BITS(PACK_LOOP)
    int64_t rest = count - 8 * full;
    if (rest) {
        uint64_t w = 0;
        memcpy(&w, codes + 8 * full, (size_t)rest);
        w = squeeze8(w, bits);
        memcpy(out + bits * full, &w, (size_t)((rest * bits + 7) / 8));
    }
}

/* Unpack codes [first, first + count) of the stream; `first` is a multiple of 8. */
static void unpack_codes(const uint8_t *packed, int64_t first, int64_t count, int bits, uint8_t *codes) {
    const uint8_t *src = packed + first / 8 * bits;
    int64_t full = count / 8;
    BY_BITS(UNPACK_LOOP)
    int64_t rest = count - 8 * full;
    if (rest) {
        uint64_t w = 0;
        memcpy(&w, src + bits * full, (size_t)((rest * bits + 7) / 8));
        w = spread8(w, bits);
        memcpy(codes + 8 * full, &w, (size_t)rest);
    }
}

/* Min, max and a NaN/inf flag of x[a, b). finite-math lets gcc vectorize the
 * min/max reduction; NaN and inf are caught from the raw exponent bits instead,
 * and the only freedom it takes (which zero wins, -0 or +0) decodes the same. */
__attribute__((optimize("finite-math-only", "no-signed-zeros")))
static void group_range(const float *x, int64_t a, int64_t b, float *lo_out, float *hi_out, int *bad_out) {
    const uint32_t *raw = (const uint32_t *)x;
    float lo = x[a], hi = x[a];
    uint32_t bad = 0;
    for (int64_t i = a; i < b; ++i) {
        float v = x[i];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        bad |= (uint32_t)(((raw[i] >> 23) & 0xFFu) == 0xFFu); /* exponent all ones */
    }
    *lo_out = lo;
    *hi_out = hi;
    *bad_out = (int)bad;
}

/* The largest bfloat16 value <= v, and the least >= v (as floats): bfloat16 is a
 * float's top 16 bits, so cutting the low 16 rounds toward zero; a negative
 * value then steps one further out. NaN and inf stay. */
static inline float bf16_down(float v) {
    uint32_t u, cut;
    memcpy(&u, &v, 4);
    if (((u >> 23) & 0xFFu) == 0xFFu) return v;
    cut = u & 0xFFFF0000u;
    if ((u & 0x80000000u) && cut != u) cut += 0x10000u;
    float r;
    memcpy(&r, &cut, 4);
    return r;
}

static inline float bf16_up(float v) { return -bf16_down(-v); }

/* Codes of x[a, b) with one group's min and inv, into codes[0, b - a). */
static void round_codes(const float *x, int64_t a, int64_t b, float mn, float inv, float levels,
                        int stochastic, uint32_t k0, uint32_t k1, uint8_t *codes) {
    if (stochastic) {
        for (int64_t i = a; i < b; ++i) {
            float v = (x[i] - mn) * inv;
            v = v + dither(i, k0, k1);
            v = v < 0.0f ? 0.0f : v;
            v = v > levels ? levels : v;
            codes[i - a] = (uint8_t)(int32_t)v;
        }
    } else {
        for (int64_t i = a; i < b; ++i) {
            float v = (x[i] - mn) * inv;
            v = v + 0.5f;
            v = v < 0.0f ? 0.0f : v;
            v = v > levels ? levels : v;
            codes[i - a] = (uint8_t)(int32_t)v;
        }
    }
}

/* Quantize groups [g0, g1) of x (group g is x[g*gs, min((g+1)*gs, n))):
 * per group min and max (min = NaN where the group holds NaN or inf), then
 * code = trunc(clamp((x - min) * inv + u, 0, levels)) with
 * inv = float(min(levels / double(max - min), FLT_MAX)) or 0 for a constant group,
 * u the dither (stochastic) or 0.5 (nearest); codes packed into `packed`.
 * With bf16_scales the min is rounded down to a bfloat16 value and the step,
 * (max - that min) / levels, up; inv = 1 / step (0 for a zero step), and `maxs`
 * receives the steps instead of the maxima.
 * The caller makes g0*gs a multiple of 8, and g1*gs too unless g1 is the last group. */
void aq_quantize(const float *x, int64_t n, int64_t gs, int64_t g0, int64_t g1, int bits,
                 int stochastic, uint32_t k0, uint32_t k1, int bf16_scales, float *mins, float *maxs,
                 uint8_t *packed) {
    uint8_t tile[TILE];
    const float levels = (float)((1 << bits) - 1);
    int64_t tile_first = g0 * gs; /* stream index of tile[0] */
    int64_t filled = 0;
    for (int64_t g = g0; g < g1; ++g) {
        int64_t a = g * gs, b = a + gs < n ? a + gs : n;
        float lo, hi;
        int bad;
        group_range(x, a, b, &lo, &hi, &bad);
        mins[g] = bad ? __builtin_nanf("") : lo;
        maxs[g] = hi;
        float inv = 0.0f;
        if (bf16_scales) {
            lo = bf16_down(lo);
            float step = bf16_up((hi - lo) / levels);
            mins[g] = bad ? __builtin_nanf("") : lo;
            maxs[g] = bad ? __builtin_nanf("") : step;
            if (step > 0.0f) { /* a step below 2**-128 has no float inverse: clamp, as the float32 path does */
                float r = 1.0f / step;
                inv = r > FLT_MAX ? FLT_MAX : r;
            }
        } else {
            float span = hi - lo;
            if (span > 0.0f) {
                double d = (double)levels / (double)span;
                inv = (float)(d > (double)FLT_MAX ? (double)FLT_MAX : d);
            }
        }
        if (bad) inv = 0.0f; /* the caller raises; keep the arithmetic finite meanwhile */
        while (a < b) {
            int64_t take = b - a < TILE - filled ? b - a : TILE - filled;
            round_codes(x, a, a + take, lo, inv, levels, stochastic, k0, k1, tile + filled);
            filled += take;
            a += take;
            if (filled == TILE) {
                pack_codes(tile, TILE, bits, packed + tile_first / 8 * bits);
                tile_first += TILE;
                filled = 0;
            }
        }
    }
    if (filled) pack_codes(tile, filled, bits, packed + tile_first / 8 * bits);
}

/* Decode elements [e0, e1) (e0 a multiple of 8): y = code * step + min, two float32 roundings. */
void aq_dequantize(const uint8_t *packed, int64_t gs, int64_t e0, int64_t e1, int bits,
                   const float *mins, const float *steps, float *y) {
    uint8_t tile[TILE];
    for (int64_t t = e0; t < e1; t += TILE) {
        int64_t end = t + TILE < e1 ? t + TILE : e1;
        unpack_codes(packed, t, end - t, bits, tile);
        for (int64_t a = t; a < end;) {
            int64_t g = a / gs, b = (g + 1) * gs < end ? (g + 1) * gs : end;
            const float mn = mins[g], st = steps[g];
            for (int64_t i = a; i < b; ++i) {
                float v = (float)tile[i - t] * st;
                y[i] = v + mn;
            }
            a = b;
        }
    }
}

/* The packed format is little-endian; the loader refuses other hosts. */
int aq_little_endian(void) {
    const uint16_t one = 1;
    return *(const uint8_t *)&one == 1;
}
