/* Fused bf16 kernels for small decode steps on CPU (see cpu_kernels.py).

   At batch 1 a decode step is ~120 small torch ops per layer-pass whose fixed cost (dispatch,
   allocation, thread fork/join) rivals the matmuls. These three kernels replace the small ops of
   a decode-only step; the matmuls stay in oneDNN. Plain C (no torch headers), built in well under
   a second with the system C compiler and loaded with ctypes. Attention is split over OpenMP
   threads; loaded into a torch process, libgomp.so.1 resolves to the copy torch already loaded,
   so it shares torch's thread pool (and its thread count) rather than adding a second one.

   bf16 is handled as uint16_t; arithmetic is fp32, rounded once to bf16 (nearest even) on store. */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (scores minus their max), relative error < 2e-6, in plain arithmetic that
   the compiler vectorises (libm's expf is a scalar call). */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x; /* keeps 2^n normal; exp(-87) is below bf16's interest anyway */
    const int n = (int)(x * 1.44269504f); /* truncates toward 0: n in [x / ln2, 0] */
    const float r = x - (float)n * 0.693147182f; /* r in (-ln2, 0] */
    float p = 1.f / 40320.f;
    p = p * r + 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#define MAX_DIM 256
#define MAX_GROUP 16

/* OpenMP threads for the parallel kernels: set from torch's thread count before each step, since
   OpenMP's own default is per calling thread (the worker's forward thread would get every core). */
static int kernel_threads = 1;

void set_threads(int threads) { kernel_threads = threads > 0 ? threads : 1; }

/* The pool row of cached position t of a request: `off` holds each position's offset into the
   pool, worked out once per request from its block table (position_offsets), so that no
   position costs a division by the block size (a 64-bit division: tens of cycles, several per
   position and KV head before). */
static inline const uint16_t *position_row(const uint16_t *pool, const int64_t *off, int64_t t) {
    return pool + off[t];
}

/* off[t] = the pool offset of position t's row, t in [0, len), from the block table. */
static void position_offsets(const int64_t *table, int64_t len, int64_t block_size,
                             int64_t pos_stride, int64_t *off) {
    for (int64_t b = 0, t = 0; t < len; b++)
        for (int64_t i = 0, base = table[b] * block_size; i < block_size && t < len; i++, t++)
            off[t] = (base + i) * pos_stride;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
/* The most value-row bytes of one task that qk_scores_bf16_64 asks for while it scores the keys
   (a quarter of a 2 MB L2: they must still be there when P @ V reads them). */
#ifndef EARLY_VALUE_BYTES
#define EARLY_VALUE_BYTES (512 * 1024)
#endif
#ifndef AHEAD
#define AHEAD 16
#endif

/* Asks for the cache lines of `values` bf16 values from `row` on, into L2: with the lines of 16
   positions (6 KB for SmolLM2) in flight at once, asking for them into L1 held the loads up on
   L1's few miss buffers; into L2 a 64-request decode's attention at 256 positions ran 1.4-1.7x
   faster (memory at 8-9 GB/s on one thread against 5), one request's the same
   (docs/benchmarks.md, "This project's own int4 and int8 kernels"). */
static inline void prefetch_row(const uint16_t *row, int64_t values) {
    for (int64_t b = 0; b < values * 2; b += 64) _mm_prefetch((const char *)row + b, _MM_HINT_T1);
}

/* exp_nonpositive on 16 lanes: the same steps, so the same values as the scalar path. */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512i n = _mm512_cvttps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)));
    const __m512 nf = _mm512_cvtepi32_ps(n);
    const __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693147182f), x);
    __m512 p = _mm512_set1_ps(1.f / 40320.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 5040.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* row[t] = exp(row[t] - m) for t in [0, len rounded down to 16), their sum added to *sum.
   Returns the positions done. (The scalar loop compiles to one exp at a time: its float-to-int
   step keeps the compiler from vectorising it.) */
static inline int64_t exp_rows16(float *row, int64_t len, float m, float *sum) {
    const int64_t done = len & ~(int64_t)15;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < done; t += 16) {
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + t), mv));
        _mm512_storeu_ps(row + t, e);
        total = _mm512_add_ps(total, e);
    }
    *sum += _mm512_reduce_add_ps(total);
    return done;
}

/* 16 bf16 values as floats (exact). */
static inline __m512 load_bf16x16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* f2bf on 16 lanes, in integer steps, so bit for bit f2bf (vcvtneps2bf16 would flush
   denormals to zero). */
static inline __m256i f2bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000)); /* NaN stays NaN */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* dst[i] = src[i] rounded to bf16 (nearest even, as f2bf), 16 at a time. */
static inline void to_bf16(const float *src, int64_t n, uint16_t *dst) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = f2bf(src[i]);
}

/* Lane i of the result: the sum of v[i]'s 16 lanes (a transposing reduction: 30 shuffles and
   adds for 16 sums, where 16 separate horizontal sums would take ~100). */
static inline __m512 sum_lanes16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: the lane's sums of v[4i .. 4i+3] */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                    _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                                    _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}

/* Scores of `heads` query heads (bf16, head_dim 64, heads / kv_heads per KV head) against the
   cached keys of positions [0, len rounded down to 16), 16 positions at a time, with bf16 dot
   products (vdpbf16ps: exact products, fp32 sums). scores: [heads, len]; mx: running maxima.
   Returns the number of positions done. */
static int64_t qk_scores_bf16_64(const uint16_t *q, const uint16_t *k_pool,
                                 const uint16_t *v_pool, const int64_t *off, int64_t len,
                                 int64_t kv_count, int64_t group, float scale, float *scores,
                                 float *mx) {
    const int64_t done = len & ~(int64_t)15;
    const __m512 scale_v = _mm512_set1_ps(scale);
    /* positions outer, heads inner: each cached key row is read from memory once, and the next
       16 positions' rows are prefetched while these are scored (a block table scatters them,
       which the hardware prefetcher cannot follow); so are these 16 positions' value rows, so
       that P @ V later finds them all in L2 (prefetched only AHEAD positions before their use
       there, with little work between, they came too late: half of attention's time was
       spent waiting on value rows) */
    for (int64_t t0 = 0; t0 < done; t0 += 16) {
        const uint16_t *rows[16];
        for (int i = 0; i < 16; i++) {
            rows[i] = position_row(k_pool, off, t0 + i);
            if (t0 + AHEAD + i < len)
                prefetch_row(position_row(k_pool, off, t0 + AHEAD + i),
                             kv_count * 64);
            if (v_pool) prefetch_row(position_row(v_pool, off, t0 + i), kv_count * 64);
        }
        for (int64_t g = 0; g < kv_count; g++) {
            for (int64_t j = 0; j < group; j++) {
                const int64_t h = g * group + j;
                const __m512i q_lo = _mm512_loadu_si512(q + h * 64);
                const __m512i q_hi = _mm512_loadu_si512(q + h * 64 + 32);
                __m512 acc[16];
                for (int i = 0; i < 16; i++) {
                    const uint16_t *kr = rows[i] + g * 64;
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(),
                                                (__m512bh)_mm512_loadu_si512(kr),
                                                (__m512bh)q_lo);
                    acc[i] = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(kr + 32),
                                              (__m512bh)q_hi);
                }
                const __m512 s = _mm512_mul_ps(sum_lanes16(acc), scale_v);
                _mm512_storeu_ps(scores + h * len + t0, s);
                const float m = _mm512_reduce_max_ps(s);
                if (m > mx[h]) mx[h] = m;
            }
        }
    }
    for (int64_t t = done; v_pool && t < len; t++)
        prefetch_row(position_row(v_pool, off, t), kv_count * 64);
    return done;
}

/* acc[h] = sum over positions [0, len rounded down to 2) of p[h][t] * V[t] for head_dim 64, two
   positions per vdpbf16ps. probs: [heads, len] bf16 (rounded, as torch's bf16 P @ V rounds
   them); acc: [heads, 64] fp32, overwritten. Returns the positions done. */
static inline __attribute__((always_inline)) int64_t pv_bf16_64_group(
    const uint16_t *probs, const uint16_t *v_pool, const int64_t *off, int64_t len,
    int64_t kv_count, const int64_t group, int ahead, float *acc) {
    const int64_t done = len & ~(int64_t)1;
    for (int64_t g = 0; g < kv_count; g++) {
        /* sums[j][0..3]: dims interleaved by the 16-bit unpacks, put back in order below */
        __m512 sums[MAX_GROUP][4];
        for (int64_t j = 0; j < group; j++)
            for (int c = 0; c < 4; c++) sums[j][c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < done; t += 2) {
            const int64_t u = t + 1;
            /* the rows AHEAD positions on, all KV heads', where qk_scores_bf16_64 did not ask
               for every row already (a context too long for L2 to keep them all) */
            if (ahead && g == 0 && t + AHEAD + 1 < len) {
                prefetch_row(position_row(v_pool, off, t + AHEAD), kv_count * 64);
                prefetch_row(position_row(v_pool, off, t + AHEAD + 1), kv_count * 64);
            }
            const uint16_t *v0 = position_row(v_pool, off, t) + g * 64;
            const uint16_t *v1 = position_row(v_pool, off, u) + g * 64;
            __m512i pairs[4];
            for (int c = 0; c < 2; c++) {
                const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
                const __m512i b = _mm512_loadu_si512(v1 + 32 * c);
                pairs[2 * c] = _mm512_unpacklo_epi16(a, b);
                pairs[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
            }
            for (int64_t j = 0; j < group; j++) {
                uint32_t pair; /* (p[t], p[t + 1]) as two bf16 in one 32-bit lane */
                memcpy(&pair, probs + (g * group + j) * len + t, 4);
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int c = 0; c < 4; c++)
                    sums[j][c] = _mm512_dpbf16_ps(sums[j][c], (__m512bh)pairs[c], p);
            }
        }
        for (int64_t j = 0; j < group; j++) {
            float lanes[4][16];
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(lanes[c], sums[j][c]);
            float *a = acc + (g * group + j) * 64;
            /* register c = 2 * half + (0: unpacklo, 1: unpackhi); lane 4k + i holds dim
               32 * half + 8k + 4 * (c & 1) + i */
            for (int c = 0; c < 4; c++)
                for (int k = 0; k < 4; k++)
                    for (int i = 0; i < 4; i++)
                        a[32 * (c >> 1) + 8 * k + 4 * (c & 1) + i] = lanes[c][4 * k + i];
        }
    }
    return done;
}

/* pv_bf16_64_group with the group size a constant where it is a common one (SmolLM2's 3, and 1,
   2, 4, 8): its 4 x group sums then stay in registers; with a group known only at run time the
   compiler kept them on the stack, and every vdpbf16ps waited on a store and a load (the sums'
   loop ran about 2x slower). */
static int64_t pv_bf16_64(const uint16_t *probs, const uint16_t *v_pool, const int64_t *off,
                          int64_t len, int64_t kv_count, int64_t group, int ahead, float *acc) {
    switch (group) {
    case 1: return pv_bf16_64_group(probs, v_pool, off, len, kv_count, 1, ahead, acc);
    case 2: return pv_bf16_64_group(probs, v_pool, off, len, kv_count, 2, ahead, acc);
    case 3: return pv_bf16_64_group(probs, v_pool, off, len, kv_count, 3, ahead, acc);
    case 4: return pv_bf16_64_group(probs, v_pool, off, len, kv_count, 4, ahead, acc);
    case 8: return pv_bf16_64_group(probs, v_pool, off, len, kv_count, 8, ahead, acc);
    default: return pv_bf16_64_group(probs, v_pool, off, len, kv_count, group, ahead, acc);
    }
}

#endif


/* out[r] = silu(gate[r]) * up[r], rounded to bf16 once, where gate_up[r] = [gate | up] (the
   fused gate/up projection's row). gate_up: [rows, 2 * inter]; out: [rows, inter]. silu(x) =
   x / (1 + e^-x), with e^-|x| from exp_nonpositive so that neither side overflows. */
static inline float silu(float x) {
    const float t = exp_nonpositive(x < 0.f ? x : -x);
    return x >= 0.f ? x / (1.f + t) : x * t / (1.f + t);
}

void silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t inter, uint16_t *out) {
#pragma omp parallel for schedule(static) if (rows >= 16) num_threads(kernel_threads)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
#ifdef HAVE_AVX512_BF16
        for (; i + 16 <= inter; i += 16) {
            const __m512 x = load_bf16x16(g + i), y = load_bf16x16(u + i);
            const __m512 neg = _mm512_min_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 t = exp_nonpositive16(neg), one = _mm512_set1_ps(1.f);
            const __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
            const __m512 top = _mm512_mask_blend_ps(positive, _mm512_mul_ps(x, t), x);
            const __m512 s = _mm512_div_ps(top, _mm512_add_ps(one, t));
            _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, y)));
        }
#endif
        for (; i < inter; i++) o[i] = f2bf(silu(bf2f(g[i])) * bf2f(u[i]));
    }
}

/* One row of the fused residual add and RMSNorm: x += delta (if delta), then h = x / rms(x) *
   weight rounded to bf16. The residual x is bf16 (F32 0: the sum rounded to bf16, as torch's
   bf16 add) or fp32 (F32 1: kept unrounded). A constant F32 in each caller. */
static inline __attribute__((always_inline)) void add_rms_norm_row(
    const int F32, void *x, const uint16_t *dr, const uint16_t *weight, int64_t hidden, float eps,
    uint16_t *hr) {
    uint16_t *xb = x;
    float *xf = x;
    float sum = 0.f;
    int64_t i = 0;
#ifdef HAVE_AVX512_BF16
    __m512 squares = _mm512_setzero_ps();
    for (; i + 16 <= hidden; i += 16) {
        __m512 v = F32 ? _mm512_loadu_ps(xf + i) : load_bf16x16(xb + i);
        if (dr) {
            v = _mm512_add_ps(v, load_bf16x16(dr + i));
            if (F32) {
                _mm512_storeu_ps(xf + i, v);
            } else {
                _mm256_storeu_si256((__m256i *)(xb + i), f2bf16(v));
                v = load_bf16x16(xb + i);
            }
        }
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    sum = _mm512_reduce_add_ps(squares);
#endif
    for (; i < hidden; i++) {
        if (dr && F32) xf[i] += bf2f(dr[i]);
        if (dr && !F32) xb[i] = f2bf(bf2f(xb[i]) + bf2f(dr[i]));
        const float v = F32 ? xf[i] : bf2f(xb[i]);
        sum += v * v;
    }
    const float scale = 1.f / sqrtf(sum / (float)hidden + eps);
    i = 0;
#ifdef HAVE_AVX512_BF16
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (; i + 16 <= hidden; i += 16) {
        const __m512 v = F32 ? _mm512_loadu_ps(xf + i) : load_bf16x16(xb + i);
        _mm256_storeu_si256((__m256i *)(hr + i),
                            f2bf16(_mm512_mul_ps(_mm512_mul_ps(v, scale_v), load_bf16x16(weight + i))));
    }
#endif
    for (; i < hidden; i++) hr[i] = f2bf((F32 ? xf[i] : bf2f(xb[i])) * scale * bf2f(weight[i]));
}

/* x[r] += delta[r] (if delta), rounded to bf16; h[r] = x[r] / rms(x[r]) * weight.
   x, delta, h: [rows, hidden]; weight: [hidden]. */
void add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight, int64_t rows,
                       int64_t hidden, float eps, uint16_t *h) {
#pragma omp parallel for schedule(static) if (rows >= 16) num_threads(kernel_threads)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(0, x + r * hidden, delta ? delta + r * hidden : NULL, weight, hidden, eps,
                         h + r * hidden);
}

/* add_rms_norm_bf16 with the residual stream x kept in fp32: x[r] += delta[r] (bf16), not
   rounded; h[r] = x[r] / rms(x[r]) * weight rounded to bf16 (the next matmul's input). A bf16
   residual rounds every layer's sum twice (after attention, after the MLP); kept in fp32 the
   next-token distributions of SmolLM2 sit closer to an fp32 run's (mean KL 0.0006 against
   0.0016 nats unquantized, 0.0015 against 0.0022 under auto), as llama.cpp keeps its
   activations in fp32 too. */
void add_rms_norm_f32(float *x, const uint16_t *delta, const uint16_t *weight, int64_t rows,
                      int64_t hidden, float eps, uint16_t *h) {
#pragma omp parallel for schedule(static) if (rows >= 16) num_threads(kernel_threads)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(1, x + r * hidden, delta ? delta + r * hidden : NULL, weight, hidden, eps,
                         h + r * hidden);
}

/* One head's row x rotated by position (c, s) into dst, rounded to bf16 once (HF rotate_half). */
static inline void rope_row(const uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t dim,
                            uint16_t *dst) {
    const int64_t half = dim / 2;
    int64_t done = 0; /* dims of each half done by the SIMD path */
#ifdef HAVE_AVX512_BF16
    /* rotate_half's two halves at once, 16 dims of each; a (x * c) + (y * s) as the scalar loop
       below compiles (one product fused into the add), rounded once */
    for (; half % 16 == 0 && done < half; done += 16) {
        const int64_t d = done;
        const __m512 lo = load_bf16x16(x + d), hi = load_bf16x16(x + d + half);
        const __m512 lo_out = _mm512_fmadd_ps(lo, load_bf16x16(c + d),
                                              _mm512_mul_ps(hi, load_bf16x16(s + d)));
        const __m512 hi_out = _mm512_fmadd_ps(hi, load_bf16x16(c + d + half),
                                              _mm512_mul_ps(lo, load_bf16x16(s + d + half)));
        _mm256_storeu_si256((__m256i *)(dst + d), f2bf16(lo_out));
        _mm256_storeu_si256((__m256i *)(dst + d + half), f2bf16(hi_out));
    }
#endif
    for (int64_t d = done; d < half; d++) /* rotate_half: (x_lo, x_hi) -> (-x_hi, x_lo) */
        dst[d] = f2bf(bf2f(x[d]) * bf2f(c[d]) + bf2f(x[d + half]) * bf2f(s[d]));
    for (int64_t d = half + done; d < dim; d++)
        dst[d] = f2bf(bf2f(x[d]) * bf2f(c[d]) + bf2f(x[d - half]) * bf2f(s[d]));
}

/* Rotary embedding of q and k (HF rotate_half layout) and the K/V store into one layer's pool.
   qkv: [n, (heads + 2 * kv_heads) * dim]; cos, sin: [max_positions, dim], sin sign-folded
   ([-sin_lo, sin_hi]); positions, slots: [n]; q_out: [n, heads, dim];
   k_pool, v_pool: [slots, kv_heads, dim] (one layer); k_out: NULL, or [n, kv_heads, dim] that
   gets the rotated keys too (a prompt chunk's attention reads them from there). */
void rope_store_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin,
                     const int64_t *positions, const int64_t *slots, int64_t n, int64_t heads,
                     int64_t kv_heads, int64_t dim, uint16_t *q_out, uint16_t *k_pool,
                     uint16_t *v_pool, uint16_t *k_out) {
    const int64_t width = (heads + 2 * kv_heads) * dim;
#pragma omp parallel for schedule(static) if (n >= 16) num_threads(kernel_threads)
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *row = qkv + t * width;
        const uint16_t *c = cos + positions[t] * dim, *s = sin + positions[t] * dim;
        for (int64_t hd = 0; hd < heads + kv_heads; hd++) {
            uint16_t *pool_row = k_pool + (slots[t] * kv_heads + hd - heads) * dim;
            uint16_t *dst = hd < heads ? q_out + (t * heads + hd) * dim
                            : k_out    ? k_out + (t * kv_heads + hd - heads) * dim
                                       : pool_row;
            rope_row(row + hd * dim, c, s, dim, dst);
            if (hd >= heads && k_out) memcpy(pool_row, dst, (size_t)dim * sizeof(uint16_t));
        }
        memcpy(v_pool + slots[t] * kv_heads * dim, row + (heads + kv_heads) * dim,
               (size_t)(kv_heads * dim) * sizeof(uint16_t));
    }
}

#include "kv_int8.c"

/* The fewest tasks (requests, or a few requests' KV heads) that attention shares out in fixed
   runs per thread; below, the threads take them one at a time. */
#ifndef SHARED_TASKS
#define SHARED_TASKS 4
#endif

/* The first task of thread `part` of `parts` (part == parts: the end): tasks are
   `split` per request, each costing its request's length; a part's tasks start at the first
   whose preceding cost reaches part / parts of the total. */
static int64_t task_share(const int64_t *lengths, int64_t split, int64_t tasks, int64_t total,
                          int64_t part, int64_t parts) {
    if (part >= parts) return tasks;
    int64_t task = 0;
    for (int64_t before = 0; task < tasks && before * parts < total * part; task++)
        before += lengths[task / split];
    return task;
}

#ifdef HAVE_AVX512_BF16
/* Asks for the rows (values [from, from + values) of each) of the first AHEAD positions of a
   request from its block table. */
static void prefetch_first_rows(const void *pool, int64_t element, const int64_t *table,
                                int64_t len, int64_t block_size, int64_t pos_stride, int64_t from,
                                int64_t values) {
    for (int64_t t = 0; t < len && t < AHEAD; t++)
        prefetch_bytes((const char *)pool +
                           ((table[t / block_size] * block_size + t % block_size) * pos_stride +
                            from) * element,
                       values * element);
}
#endif

/* Cached position t's row of KV head g as fp32: from a bf16 pool, or (q8) from an int8 pool's
   codes times the row's scale. */
static inline void kv_row_f32(const void *pool, const float *scales, const int q8,
                              const int64_t *off, int64_t t, int64_t g, int64_t dim, float *row) {
    if (q8) {
        const int8_t *r = (const int8_t *)pool + off[t] + g * dim;
        const float sc = scales[off[t] / dim + g];
        for (int64_t d = 0; d < dim; d++) row[d] = (float)r[d] * sc;
    } else {
        const uint16_t *r = (const uint16_t *)pool + off[t] + g * dim;
        for (int64_t d = 0; d < dim; d++) row[d] = bf2f(r[d]);
    }
}

/* One query token per request against its cached K/V in a paged pool.
   q, out: [nd, heads, dim]; k_pool, v_pool: [num_blocks, block_size, kv_heads, dim] (one layer),
   bf16, or (q8) int8 codes with k_scale, v_scale: [num_blocks, block_size, kv_heads] fp32;
   tables: [nd, max_blocks] block ids; lengths: [nd] cached positions, the new token's included.
   Returns 0, or -1 if scratch memory could not be had. */
static inline __attribute__((always_inline)) int attend(
    const uint16_t *q, const void *k_pool, const void *v_pool, const float *k_scale,
    const float *v_scale, const int q8, const int64_t *tables, const int64_t *lengths, int64_t nd,
    int64_t max_blocks, int64_t block_size, int64_t heads, int64_t kv_heads, const int64_t dim,
    float scale, uint16_t *out) {
    const int64_t group = heads / kv_heads;
    const int64_t pos_stride = kv_heads * dim;
    /* a task: one request's KV heads [g0, g1). Whole requests when there are enough of them, so
       each cached position is read as one contiguous row of all KV heads; else one KV head per
       task, so that even one request keeps every thread busy. */
    const int64_t split = nd >= 4 ? 1 : kv_heads;
    const int64_t task_kv = kv_heads / split, task_heads = task_kv * group, tasks = nd * split;
    int64_t total = 0, longest = 0;
    for (int64_t r = 0; r < nd; r++) {
        total += lengths[r];
        longest = lengths[r] > longest ? lengths[r] : longest;
    }
    int failed = 0;
    /* With many tasks each thread takes one run of them, with an even share of the positions (a
       request's KV read is its cost), so that it knows its next task and asks for that task's
       first rows while it finishes this one (dynamic scheduling: each task started on rows not
       yet asked for, twice, for K and for V). With few, the threads take the next task left as
       they come free (dynamic): a fixed share would leave the whole step waiting on a thread that
       the gateway or the scheduler has preempted, and a few tasks cannot be shared evenly. */
    const int shared = tasks >= SHARED_TASKS;
    int64_t taken = 0; /* dynamic: the tasks handed out so far */
#pragma omp parallel if (tasks >= 2) num_threads(kernel_threads)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = shared ? task_share(lengths, split, tasks, total * split, me, threads)
                                  : 0;
        const int64_t hi = shared ? task_share(lengths, split, tasks, total * split, me + 1,
                                               threads)
                                  : tasks;
        /* the positions' pool offsets: [longest] int64; then scores: [task_heads, len] fp32;
           qf, acc: [task_heads, dim]; then room for the probabilities in bf16:
           [task_heads, len] (rounded up to whole floats) */
        const int64_t floats = task_heads * (longest + 2 * dim) + (task_heads * longest + 1) / 2;
        int64_t *off = lo < hi ? malloc((size_t)longest * 8 + (size_t)floats * sizeof(float))
                               : NULL;
        if (lo < hi && !off) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t next = lo; off;) {
            const int64_t task = shared ? next++ : __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
            if (task >= hi) break;
            const int64_t r = task / split, g0 = (task % split) * task_kv;
            const int64_t len = lengths[r];
            const int64_t *table = tables + r * max_blocks;
            float *buffer = (float *)(off + longest);
            position_offsets(table, len, block_size, pos_stride, off);
            float *scores = buffer, *qf = buffer + task_heads * len, *acc = qf + task_heads * dim;
            float mx[MAX_GROUP * 64], kf[MAX_DIM];
            const uint16_t *qr = q + (r * heads + g0 * group) * dim; /* this task's query heads */
            for (int64_t i = 0; i < task_heads * dim; i++) {
                qf[i] = bf2f(qr[i]) * scale;
                acc[i] = 0.f;
            }
            for (int64_t h = 0; h < task_heads; h++) mx[h] = -INFINITY;
            int64_t first = 0; /* positions before this were scored by the SIMD path */
#ifdef HAVE_AVX512_BF16
            if (dim == 64) {
                /* a context whose value rows L2 keeps: all asked for while the keys are
                   scored; a longer one: each asked for AHEAD positions before P @ V reads it */
                const int64_t element = q8 ? 1 : 2; /* bytes of a cached value */
                const int early = len * task_kv * dim * element <= EARLY_VALUE_BYTES;
                if (q8)
                    first = QK_SCORES_Q8_64(
                        qf, (const int8_t *)k_pool + g0 * dim, k_scale + g0,
                        early ? (const int8_t *)v_pool + g0 * dim : NULL, off, len, task_kv, group,
                        scores, mx);
                else
                    first = qk_scores_bf16_64(
                        qr, (const uint16_t *)k_pool + g0 * dim,
                        early ? (const uint16_t *)v_pool + g0 * dim : NULL, off, len, task_kv,
                        group, scale, scores, mx);
                if (shared && task + 1 < hi) /* the next task's first keys, during this P @ V */
                    prefetch_first_rows(k_pool, element, tables + (task + 1) / split * max_blocks,
                                        lengths[(task + 1) / split], block_size, pos_stride,
                                        ((task + 1) % split) * task_kv * dim, task_kv * dim);
            }
#endif
            for (int64_t t = first; t < len; t++) {
                for (int64_t g = 0; g < task_kv; g++) {
                    kv_row_f32(k_pool, k_scale, q8, off, t, g0 + g, dim, kf);
                    for (int64_t j = 0; j < group; j++) {
                        const float *qh = qf + (g * group + j) * dim;
                        float s = 0.f;
                        for (int64_t d = 0; d < dim; d++) s += qh[d] * kf[d];
                        scores[(g * group + j) * len + t] = s;
                        if (s > mx[g * group + j]) mx[g * group + j] = s;
                    }
                }
            }
            float inv[MAX_GROUP * 64];
            for (int64_t h = 0; h < task_heads; h++) {
                float *row = scores + h * len, sum = 0.f;
                int64_t t = 0;
#ifdef HAVE_AVX512_BF16
                t = exp_rows16(row, len, mx[h], &sum);
#endif
                for (; t < len; t++) {
                    row[t] = exp_nonpositive(row[t] - mx[h]);
                    sum += row[t];
                }
                inv[h] = 1.f / sum;
            }
            first = 0;
#ifdef HAVE_AVX512_BF16
            if (dim == 64 && group <= MAX_GROUP && q8) {
                first = pv_q8_64(scores, (const int8_t *)v_pool + g0 * dim, v_scale + g0, off,
                                 len, task_kv, group,
                                 len * task_kv * dim > EARLY_VALUE_BYTES, acc);
            } else if (dim == 64 && group <= MAX_GROUP) {
                uint16_t *probs = (uint16_t *)(acc + task_heads * dim);
                to_bf16(scores, task_heads * len, probs);
                first = pv_bf16_64(probs, (const uint16_t *)v_pool + g0 * dim, off, len, task_kv,
                                   group, len * task_kv * dim * 2 > EARLY_VALUE_BYTES, acc);
            }
#endif
            for (int64_t t = first; t < len; t++) {
                for (int64_t g = 0; g < task_kv; g++) {
                    kv_row_f32(v_pool, v_scale, q8, off, t, g0 + g, dim, kf);
                    for (int64_t j = 0; j < group; j++) {
                        const float p = scores[(g * group + j) * len + t];
                        float *a = acc + (g * group + j) * dim;
                        for (int64_t d = 0; d < dim; d++) a[d] += p * kf[d];
                    }
                }
            }
            uint16_t *o = out + (r * heads + g0 * group) * dim;
            for (int64_t h = 0; h < task_heads; h++)
                for (int64_t d = 0; d < dim; d++) o[h * dim + d] = f2bf(acc[h * dim + d] * inv[h]);
        }
        free(off);
    }
    return failed ? -1 : 0;
}

/* attend() at the shape's common sizes (q8 a constant at each call). Returns 0; -1 when the
   shape is beyond the fixed buffer sizes; -2 when out of memory. Common shapes get code specialised on a constant head_dim (and group), which the compiler vectorises
   fully. */
static inline __attribute__((always_inline)) int attend_shape(
    const uint16_t *q, const void *k_pool, const void *v_pool, const float *k_scale,
    const float *v_scale, const int q8, const int64_t *tables, const int64_t *lengths, int64_t nd,
    int64_t max_blocks, int64_t block_size, int64_t heads, int64_t kv_heads, int64_t dim,
    float scale, uint16_t *out) {
    if (dim > MAX_DIM || kv_heads <= 0 || heads % kv_heads || heads > MAX_GROUP * 64) return -1;
#define ATTEND(H, D) \
    attend(q, k_pool, v_pool, k_scale, v_scale, q8, tables, lengths, nd, max_blocks, block_size, \
           H, kv_heads, D, scale, out)
    int status;
    if (dim == 64 && heads == 3 * kv_heads) status = ATTEND(3 * kv_heads, 64);
    else if (dim == 64) status = ATTEND(heads, 64);
    else if (dim == 128) status = ATTEND(heads, 128);
    else status = ATTEND(heads, dim);
#undef ATTEND
    return status ? -2 : 0;
}

int decode_attention_bf16(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool,
                          const int64_t *tables, const int64_t *lengths, int64_t nd,
                          int64_t max_blocks, int64_t block_size, int64_t heads,
                          int64_t kv_heads, int64_t dim, float scale, uint16_t *out) {
    return attend_shape(q, k_pool, v_pool, NULL, NULL, 0, tables, lengths, nd, max_blocks,
                        block_size, heads, kv_heads, dim, scale, out);
}

/* decode_attention_bf16 over an int8 pool (--kv-cache-dtype int8): k_pool, v_pool: [num_blocks,
   block_size, kv_heads, dim] int8 codes; k_scale, v_scale: [num_blocks, block_size, kv_heads]
   fp32 (one layer). The same returns. */
int decode_attention_q8(const uint16_t *q, const int8_t *k_pool, const int8_t *v_pool,
                        const float *k_scale, const float *v_scale, const int64_t *tables,
                        const int64_t *lengths, int64_t nd, int64_t max_blocks,
                        int64_t block_size, int64_t heads, int64_t kv_heads, int64_t dim,
                        float scale, uint16_t *out) {
    return attend_shape(q, k_pool, v_pool, k_scale, v_scale, 1, tables, lengths, nd, max_blocks,
                        block_size, heads, kv_heads, dim, scale, out);
}

static inline float exact_dot(const uint16_t *a, const uint16_t *b, int64_t n) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; i++) sum += bf2f(a[i]) * bf2f(b[i]);
    return sum;
}

/* Logits near each row's maximum made exact (near_ties.py): logits [rows, vocab] fp32 came from
   hidden [rows, in] bf16 @ weight [vocab, in].T bf16 through a kernel that rounds its output to
   bf16. Every entry within frac * max(|row max|, 1) of the row's maximum is replaced by its fp32
   dot product. Two passes over each row; rows split over threads. */
void refine_near_max_bf16(float *logits, int64_t rows, int64_t vocab, float frac,
                          const uint16_t *hidden, const uint16_t *weight, int64_t in) {
#pragma omp parallel for schedule(static) if (rows >= 4) num_threads(kernel_threads)
    for (int64_t r = 0; r < rows; r++) {
        float *row = logits + r * vocab;
        float top = row[0];
        int64_t j = 0;
#ifdef HAVE_AVX512_BF16
        __m512 tops = _mm512_set1_ps(top);
        for (; j + 16 <= vocab; j += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(row + j));
        top = _mm512_reduce_max_ps(tops);
#endif
        for (; j < vocab; j++) top = row[j] > top ? row[j] : top;
        const float scale = fabsf(top) > 1.f ? fabsf(top) : 1.f;
        const float threshold = top - scale * frac;
        const uint16_t *h = hidden + r * in;
        j = 0;
#ifdef HAVE_AVX512_BF16
        const __m512 limit = _mm512_set1_ps(threshold);
        for (; j + 16 <= vocab; j += 16) {
            __mmask16 near = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), limit, _CMP_GE_OQ);
            while (near) {
                const int bit = __builtin_ctz(near);
                near &= near - 1;
                row[j + bit] = exact_dot(h, weight + (j + bit) * in, in);
            }
        }
#endif
        for (; j < vocab; j++)
            if (row[j] >= threshold) row[j] = exact_dot(h, weight + j * in, in);
    }
}

/* y = x @ W.T for a 4-bit weight in groups of 32 inputs, W[o][k] = (code - 8) * scale + zero,
   every row computed alone (the same operations in the same order whatever `rows` is, so a
   row's result does not depend on the rows beside it: a draft's rows equal a plain decode's).

   The weight stays 4-bit in memory and is read once per block of 16 outputs for up to 8 rows:
   a step of a few rows costs about what one row does, where torch's int4 kernel costs ~rows
   times one. Per block of 16 outputs (ob) and group of 32 inputs (g), `w` holds 320 bytes
   (int4_layout in blocked_matmul.py lays it out): 256 bytes of codes, then the 16 outputs'
   scales and zeros as bf16. Code byte j of chunk c (32 bytes) holds, for output j / 2, input
   4c + j % 2 in its low nibble and input 4c + 2 + j % 2 in its high one: widened to 16 bits,
   each nibble indexes a table of bf16(n - 8), which gives 16 outputs x 2 inputs as bf16 pairs,
   the operand vdpbf16ps multiplies against a pair of x's (the codes are small integers, exact
   in bf16). Per group: part = sum (code - 8) * x, then y += scale * part + zero * sum(x).
   x, y: [rows, in] / [rows, out] bf16. Returns 0; -1 for a shape it does not take or a build
   without AVX-512 BF16; -2 when out of memory. */
#define INT4_GROUP 32
#define INT4_BLOCK_BYTES 320
#define INT4_TILE 8
/* TILE(R) for the `left` rows of a tile (at most INT4_TILE), R a constant in each case so that the
   tile's loops over its rows unroll and its sums stay in registers. */
#define TILE_ROWS(left)                                                                          \
    switch ((left) >= INT4_TILE ? INT4_TILE : (left)) {                                        \
    case 1: TILE(1); break;                                                                      \
    case 2: TILE(2); break;                                                                      \
    case 3: TILE(3); break;                                                                      \
    case 4: TILE(4); break;                                                                      \
    case 5: TILE(5); break;                                                                      \
    case 6: TILE(6); break;                                                                      \
    case 7: TILE(7); break;                                                                      \
    default: TILE(8); break;                                                                     \
    }

#ifdef HAVE_AVX512_BF16
static inline __attribute__((always_inline)) void int4_tile(
    const int R, const uint16_t *x, int64_t in, const float *xsum, const uint8_t *w,
    int64_t groups, __m512i table, uint16_t *y, int64_t out) {
    __m512 total[INT4_TILE];
    for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = w + g * INT4_BLOCK_BYTES;
        if (g + 2 < groups) {
            for (int b = 0; b < INT4_BLOCK_BYTES; b += 64)
                _mm_prefetch((const char *)blk + 2 * INT4_BLOCK_BYTES + b, _MM_HINT_T0);
        }
        __m512 part[INT4_TILE];
        for (int r = 0; r < R; r++) part[r] = _mm512_setzero_ps();
        const uint16_t *xg = x + g * INT4_GROUP;
        for (int c = 0; c < 8; c++) {
            const __m512i v =
                _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 * c)));
            const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(v, table);
            const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
            for (int r = 0; r < R; r++) {
                int32_t a, b;
                memcpy(&a, xg + r * in + 4 * c, 4);
                memcpy(&b, xg + r * in + 4 * c + 2, 4);
                part[r] = _mm512_dpbf16_ps(part[r], lo, (__m512bh)_mm512_set1_epi32(a));
                part[r] = _mm512_dpbf16_ps(part[r], hi, (__m512bh)_mm512_set1_epi32(b));
            }
        }
        const __m512 scale = load_bf16x16((const uint16_t *)(blk + 256));
        const __m512 zero = load_bf16x16((const uint16_t *)(blk + 288));
        for (int r = 0; r < R; r++) {
            total[r] = _mm512_fmadd_ps(part[r], scale, total[r]);
            total[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[r * groups + g]), total[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm256_storeu_si256((__m256i *)(y + r * out), (__m256i)_mm512_cvtneps_pbh(total[r]));
}
#endif

/* 1 where this build has int4_matmul_bf16's and int8_matmul_bf16's AVX-512 BF16 paths (a -march
   of a CPU with it). */
int blocked_kernels_built(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

int int4_matmul_bf16(const uint16_t *x, int64_t rows, int64_t in, const uint8_t *w, int64_t out,
                     uint16_t *y) {
#ifndef HAVE_AVX512_BF16
    (void)x, (void)rows, (void)in, (void)w, (void)out, (void)y;
    return -1;
#else
    if (in % INT4_GROUP || out % 16 || rows < 0) return -1;
    const int64_t groups = in / INT4_GROUP, blocks = out / 16;
    float *xsum = malloc((size_t)(rows * groups + 1) * sizeof(float));
    if (!xsum) return -2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const __m512 a = load_bf16x16(x + r * in + g * INT4_GROUP);
            const __m512 b = load_bf16x16(x + r * in + g * INT4_GROUP + 16);
            xsum[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        }
    uint16_t entries[32];
    for (int j = 0; j < 32; j++) entries[j] = f2bf((float)((j & 15) - 8));
    const __m512i table = _mm512_loadu_si512(entries);
#pragma omp parallel for schedule(static) if (blocks >= 8 && kernel_threads > 1) \
    num_threads(kernel_threads)
    for (int64_t ob = 0; ob < blocks; ob++) {
        const uint8_t *wb = w + ob * groups * INT4_BLOCK_BYTES;
        for (int64_t r0 = 0; r0 < rows; r0 += INT4_TILE) {
            const int64_t left = rows - r0;
            const uint16_t *xr = x + r0 * in;
            const float *sr = xsum + r0 * groups;
            uint16_t *yr = y + r0 * out + ob * 16;
#define TILE(R) int4_tile(R, xr, in, sr, wb, groups, table, yr, out)
            TILE_ROWS(left);
#undef TILE
        }
    }
    free(xsum);
    return 0;
#endif
}

/* y = x @ W.T for an int8 weight with one scale per output, W[o][k] = code * scale[o], each row
   computed alone (as int4_matmul_bf16). The codes are kept as u = code + 128 and split in two
   nibbles, code = 16 * (u / 16 - 8) + u % 16: each nibble indexes a table of bf16 values (exact:
   small multiples of 16, and 0..15), so a chunk of 32 bytes gives two bf16 operands for 16
   outputs x 2 inputs, both multiplied against the same pair of x's. Per block of 16 outputs,
   `w` holds in / 2 chunks of 32 bytes (byte j of chunk p: output j / 2, input 2p + j % 2), then
   the 16 scales as bf16 (int8_layout in blocked_matmul.py lays it out). Returns as
   int4_matmul_bf16. */
#ifdef HAVE_AVX512_BF16
static inline __attribute__((always_inline)) void int8_tile(
    const int R, const uint16_t *x, int64_t in, const uint8_t *w, __m512i table_lo,
    __m512i table_hi, uint16_t *y, int64_t out) {
    __m512 acc[INT4_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < in / 2; p++) {
        if ((p & 1) == 0 && p + 8 < in / 2) _mm_prefetch((const char *)(w + 32 * (p + 8)), _MM_HINT_T0);
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 * p)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(v, table_lo);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table_hi);
        for (int r = 0; r < R; r++) {
            int32_t a;
            memcpy(&a, x + r * in + 2 * p, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(a);
            acc[r] = _mm512_dpbf16_ps(acc[r], lo, xb);
            acc[r] = _mm512_dpbf16_ps(acc[r], hi, xb);
        }
    }
    const __m512 scale = load_bf16x16((const uint16_t *)(w + 16 * in));
    for (int r = 0; r < R; r++)
        _mm256_storeu_si256((__m256i *)(y + r * out),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r], scale)));
}
#endif

int int8_matmul_bf16(const uint16_t *x, int64_t rows, int64_t in, const uint8_t *w, int64_t out,
                     uint16_t *y) {
#ifndef HAVE_AVX512_BF16
    (void)x, (void)rows, (void)in, (void)w, (void)out, (void)y;
    return -1;
#else
    if (in % 2 || out % 16 || rows < 0) return -1;
    const int64_t blocks = out / 16, block_bytes = 16 * in + 32;
    uint16_t lo[32], hi[32];
    for (int j = 0; j < 32; j++) {
        lo[j] = f2bf((float)(j & 15));
        hi[j] = f2bf((float)(16 * ((j & 15) - 8)));
    }
    const __m512i table_lo = _mm512_loadu_si512(lo), table_hi = _mm512_loadu_si512(hi);
#pragma omp parallel for schedule(static) if (blocks >= 8 && kernel_threads > 1) \
    num_threads(kernel_threads)
    for (int64_t ob = 0; ob < blocks; ob++) {
        const uint8_t *wb = w + ob * block_bytes;
        for (int64_t r0 = 0; r0 < rows; r0 += INT4_TILE) {
            const int64_t left = rows - r0;
            const uint16_t *xr = x + r0 * in;
            uint16_t *yr = y + r0 * out + ob * 16;
#define TILE(R) int8_tile(R, xr, in, wb, table_lo, table_hi, yr, out)
            TILE_ROWS(left);
#undef TILE
        }
    }
    return 0;
#endif
}

/* int4 on int8 activations by VNNI (where -march has it), in its own file. */
#include "vnni_matmul.c"

/* The AMX tile kernels (where -march has them), in their own file. */
#include "amx_matmul.c"
