/* The int8 KV pool's kernels (--kv-cache-dtype int8), included by cpu_kernels.c after its bf16
   helpers and rope_store_bf16: the rows' quantization and store, a fresh chunk's K/V as the pool
   holds them, the cached rows dequantized for a prompt chunk, and the pieces of decode
   attention over the codes (cpu_kernels.c's `attend` puts them together, with q8 set). */

#ifdef HAVE_AVX512_BF16
/* Asks for `bytes` bytes from `row` on into L2 (prefetch_row for int8 rows). */
static inline void prefetch_bytes(const void *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)row + b, _MM_HINT_T1);
}

/* 16 int8 codes as floats (exact). */
static inline __m512 load_q8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#endif

/* int8 KV (--kv-cache-dtype int8): a layer's K (or V) pool holds int8 codes [slots, kv_heads,
   dim] and fp32 scales [slots, kv_heads]; a cached value is code * scale. Each (position, KV
   head) row is quantized alone, symmetrically, from its bf16 values: scale = max |x| / 127,
   code = x * (127 / max |x|) rounded to nearest even (kv_pool.quantize_kv does the same in torch,
   operation for operation, so both paths store the same codes). */
static inline void quantize_row_q8(const uint16_t *x, int64_t dim, int8_t *codes, float *scale) {
#ifdef HAVE_AVX512_BF16
    if (dim % 16 == 0 && dim <= MAX_DIM) { /* the same operations, 16 lanes at a time */
        __m512 m = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load_bf16x16(x + d)));
        const float amax = _mm512_reduce_max_ps(m);
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        for (int64_t d = 0; d < dim; d += 16) /* cvtps_epi32: to nearest even, as nearbyintf */
            _mm_storeu_si128((__m128i *)(codes + d),
                             _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(
                                 _mm512_mul_ps(load_bf16x16(x + d), inv))));
        *scale = amax / 127.f;
        return;
    }
#endif
    float amax = 0.f;
    for (int64_t d = 0; d < dim; d++) {
        const float a = fabsf(bf2f(x[d]));
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t d = 0; d < dim; d++) codes[d] = (int8_t)nearbyintf(bf2f(x[d]) * inv);
    *scale = amax / 127.f;
}

/* rope_store_bf16 into an int8 pool: k_pool, v_pool: [slots, kv_heads, dim] int8 codes;
   k_scale, v_scale: [slots, kv_heads] fp32 (one layer). q_out and k_out as there (bf16). */
void rope_store_q8(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin,
                   const int64_t *positions, const int64_t *slots, int64_t n, int64_t heads,
                   int64_t kv_heads, int64_t dim, uint16_t *q_out, int8_t *k_pool, int8_t *v_pool,
                   float *k_scale, float *v_scale, uint16_t *k_out) {
    const int64_t width = (heads + 2 * kv_heads) * dim;
#pragma omp parallel for schedule(static) if (n >= 16) num_threads(kernel_threads)
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *row = qkv + t * width;
        const uint16_t *c = cos + positions[t] * dim, *s = sin + positions[t] * dim;
        uint16_t key[MAX_DIM];
        for (int64_t hd = 0; hd < heads + kv_heads; hd++) {
            const int64_t g = hd - heads, at = slots[t] * kv_heads + g;
            uint16_t *dst = hd < heads ? q_out + (t * heads + hd) * dim
                            : k_out    ? k_out + (t * kv_heads + g) * dim
                                       : key;
            rope_row(row + hd * dim, c, s, dim, dst);
            if (hd >= heads) quantize_row_q8(dst, dim, k_pool + at * dim, k_scale + at);
        }
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t at = slots[t] * kv_heads + g;
            quantize_row_q8(row + (heads + kv_heads + g) * dim, dim, v_pool + at * dim,
                            v_scale + at);
        }
    }
}

/* x's rows as an int8 pool holds them: quantize_row_q8's codes times its scale, rounded to bf16
   (bit for bit kv_pool.as_stored). x: n tokens of `heads` rows of `dim` bf16 values, a token's
   rows contiguous, tokens `stride` values apart (a view into the qkv projection's output);
   out: [n, heads, dim]. */
void as_stored_q8_bf16(const uint16_t *x, int64_t n, int64_t heads, int64_t dim, int64_t stride,
                       uint16_t *out) {
#pragma omp parallel for schedule(static) if (n >= 64) num_threads(kernel_threads)
    for (int64_t t = 0; t < n; t++) {
        int8_t codes[MAX_DIM];
        for (int64_t g = 0; g < heads; g++) {
            float sc;
            quantize_row_q8(x + t * stride + g * dim, dim, codes, &sc);
            uint16_t *o = out + (t * heads + g) * dim;
            int64_t d = 0;
#ifdef HAVE_AVX512_BF16
            for (const __m512 scv = _mm512_set1_ps(sc); d + 16 <= dim; d += 16)
                _mm256_storeu_si256((__m256i *)(o + d),
                                    f2bf16(_mm512_mul_ps(load_q8x16(codes + d), scv)));
#endif
            for (; d < dim; d++) o[d] = f2bf((float)codes[d] * sc);
        }
    }
}

/* out[i] = codes[rows[i]] * scales[rows[i]], rounded to bf16 (nearest even, as torch's
   `(codes.float() * scale).to(bfloat16)`, bit for bit): rows of `dim` values of an int8 pool
   (rows numbered as KvPool.rows), for a prompt chunk's attention to its cached context. */
void gather_q8_bf16(const int8_t *codes, const float *scales, const int64_t *rows, int64_t n,
                    int64_t dim, uint16_t *out) {
#pragma omp parallel for schedule(static) if (n >= 1024) num_threads(kernel_threads)
    for (int64_t i = 0; i < n; i++) {
        const int8_t *c = codes + rows[i] * dim;
        const float sc = scales[rows[i]];
        uint16_t *o = out + i * dim;
        int64_t d = 0;
#ifdef HAVE_AVX512_BF16
        const __m512 scv = _mm512_set1_ps(sc);
        for (; d + 16 <= dim; d += 16)
            _mm256_storeu_si256((__m256i *)(o + d),
                                f2bf16(_mm512_mul_ps(load_q8x16(c + d), scv)));
#endif
        for (; d < dim; d++) o[d] = f2bf((float)c[d] * sc);
    }
}

#ifdef HAVE_AVX512_BF16
/* the int8 pool's scores: by VNNI where the build has it */
#ifdef __AVX512VNNI__
#define QK_SCORES_Q8_64 qk_scores_q8_64_vnni
#else
#define QK_SCORES_Q8_64 qk_scores_q8_64
#endif

/* qk_scores_bf16_64 over an int8 pool (head_dim 64): qf [heads, 64] the fp32 queries, already
   scaled; k_pool, v_pool the task's first KV head's codes, k_scale its first scale (the scale of
   position t, KV head g: k_scale[off[t] / 64 + g]). Each 16 positions' key rows of a KV head
   are widened to fp32 once, into L1, and scored against the group's query heads in fp32 (the
   products exact, as vdpbf16ps's); the sums times the positions' scales are the scores. */
static __attribute__((unused)) int64_t qk_scores_q8_64(const float *qf, const int8_t *k_pool, const float *k_scale,
                               const int8_t *v_pool, const int64_t *off, int64_t len,
                               int64_t kv_count, int64_t group, float *scores, float *mx) {
    const int64_t done = len & ~(int64_t)15;
    float keys[16 * 64] __attribute__((aligned(64)));
    for (int64_t t0 = 0; t0 < done; t0 += 16) {
        for (int i = 0; i < 16; i++) {
            if (t0 + AHEAD + i < len) prefetch_bytes(k_pool + off[t0 + AHEAD + i], kv_count * 64);
            if (v_pool) prefetch_bytes(v_pool + off[t0 + i], kv_count * 64);
        }
        for (int64_t g = 0; g < kv_count; g++) {
            float ks[16];
            for (int i = 0; i < 16; i++) {
                const int8_t *kr = k_pool + off[t0 + i] + g * 64;
                ks[i] = k_scale[off[t0 + i] / 64 + g];
                for (int c = 0; c < 4; c++)
                    _mm512_store_ps(keys + i * 64 + 16 * c, load_q8x16(kr + 16 * c));
            }
            const __m512 ksv = _mm512_loadu_ps(ks);
            for (int64_t j = 0; j < group; j++) {
                const int64_t h = g * group + j;
                const float *qh = qf + h * 64;
                const __m512 q0 = _mm512_loadu_ps(qh), q1 = _mm512_loadu_ps(qh + 16);
                const __m512 q2 = _mm512_loadu_ps(qh + 32), q3 = _mm512_loadu_ps(qh + 48);
                __m512 acc[16];
                for (int i = 0; i < 16; i++) {
                    const float *kr = keys + i * 64;
                    __m512 a = _mm512_mul_ps(_mm512_load_ps(kr), q0);
                    a = _mm512_fmadd_ps(_mm512_load_ps(kr + 16), q1, a);
                    a = _mm512_fmadd_ps(_mm512_load_ps(kr + 32), q2, a);
                    acc[i] = _mm512_fmadd_ps(_mm512_load_ps(kr + 48), q3, a);
                }
                const __m512 sc = _mm512_mul_ps(sum_lanes16(acc), ksv);
                _mm512_storeu_ps(scores + h * len + t0, sc);
                const float m = _mm512_reduce_max_ps(sc);
                if (m > mx[h]) mx[h] = m;
            }
        }
    }
    for (int64_t t = done; v_pool && t < len; t++) prefetch_bytes(v_pool + off[t], kv_count * 64);
    return done;
}

/* acc[h] = sum over all positions of p[h][t] * V[t] over an int8 pool (head_dim 64): each value
   row widened to fp32 once and added in with p times the row's scale, in fp32. probs: [heads,
   len] fp32; v_pool, v_scale as k_pool, k_scale in qk_scores_q8_64; acc: [heads, 64]. */
static inline __attribute__((always_inline)) void pv_q8_64_group(
    const float *probs, const int8_t *v_pool, const float *v_scale, const int64_t *off,
    int64_t len, int64_t kv_count, const int64_t group, int ahead, float *acc) {
    for (int64_t g = 0; g < kv_count; g++) {
        __m512 sums[MAX_GROUP][4];
        for (int64_t j = 0; j < group; j++)
            for (int c = 0; c < 4; c++) sums[j][c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            if (ahead && g == 0 && t + AHEAD < len)
                prefetch_bytes(v_pool + off[t + AHEAD], kv_count * 64);
            const int8_t *vr = v_pool + off[t] + g * 64;
            const float sv = v_scale[off[t] / 64 + g];
            __m512 vf[4];
            for (int c = 0; c < 4; c++) vf[c] = load_q8x16(vr + 16 * c);
            for (int64_t j = 0; j < group; j++) {
                const __m512 p = _mm512_set1_ps(probs[(g * group + j) * len + t] * sv);
                for (int c = 0; c < 4; c++) sums[j][c] = _mm512_fmadd_ps(vf[c], p, sums[j][c]);
            }
        }
        for (int64_t j = 0; j < group; j++)
            for (int c = 0; c < 4; c++)
                _mm512_storeu_ps(acc + (g * group + j) * 64 + 16 * c, sums[j][c]);
    }
}

#ifdef __AVX512VNNI__
/* Lane i of the result: the sum of v[i]'s 16 int32 lanes (sum_lanes16's shuffles, integer adds:
   exact while the sums fit 32 bits). */
static inline __m512i sum_lanes16_epi32(const __m512i v[16]) {
    __m512i t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_epi32(
            _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(t[2 * i]),
                                                  _mm512_castsi512_ps(t[2 * i + 1]), 0x44)),
            _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(t[2 * i]),
                                                  _mm512_castsi512_ps(t[2 * i + 1]), 0xEE)));
    const __m512i x0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x44),
                                        _mm512_shuffle_i32x4(u[0], u[1], 0xEE));
    const __m512i x1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x44),
                                        _mm512_shuffle_i32x4(u[2], u[3], 0xEE));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, 0x88), _mm512_shuffle_i32x4(x0, x1, 0xDD));
}

/* qk_scores_q8_64 by 16-bit integer dot products (vpdpwssd): each query head rounded to int16
   with its own scale (max |q| / 32767: a relative error below 2e-5, against bf16's 4e-3 in the
   bf16 kernel's queries), each key row widened from int8 to int16 once for the group's heads; a
   score's 64 products add up in int32, exactly (64 x 127 x 32767 < 2^31), and become a float
   once. Two vpdpwssd per query head and position, where the fp32 path spends 4 FMAs and 8
   conversions. */
static int64_t qk_scores_q8_64_vnni(const float *qf, const int8_t *k_pool, const float *k_scale,
                                    const int8_t *v_pool, const int64_t *off, int64_t len,
                                    int64_t kv_count, int64_t group, float *scores, float *mx) {
    const int64_t done = len & ~(int64_t)15, heads = kv_count * group;
    int16_t q16[heads * 64];
    float qs[heads];
    int16_t keys[16 * 64] __attribute__((aligned(64))); /* 16 positions' key rows, widened */
    for (int64_t h = 0; h < heads; h++) {
        float amax = 0.f;
        for (int d = 0; d < 64; d++) amax = fabsf(qf[h * 64 + d]) > amax ? fabsf(qf[h * 64 + d]) : amax;
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        for (int d = 0; d < 64; d++) q16[h * 64 + d] = (int16_t)nearbyintf(qf[h * 64 + d] * inv);
        qs[h] = amax / 32767.f;
    }
    for (int64_t t0 = 0; t0 < done; t0 += 16) {
        for (int i = 0; i < 16; i++) {
            if (t0 + AHEAD + i < len) prefetch_bytes(k_pool + off[t0 + AHEAD + i], kv_count * 64);
            if (v_pool) prefetch_bytes(v_pool + off[t0 + i], kv_count * 64);
        }
        for (int64_t g = 0; g < kv_count; g++) {
            float ks[16];
            for (int i = 0; i < 16; i++) {
                const int8_t *kr = k_pool + off[t0 + i] + g * 64;
                ks[i] = k_scale[off[t0 + i] / 64 + g];
                for (int c = 0; c < 2; c++)
                    _mm512_store_si512(
                        keys + i * 64 + 32 * c,
                        _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(kr + 32 * c))));
            }
            const __m512 ksv = _mm512_loadu_ps(ks);
            for (int64_t j = 0; j < group; j++) {
                const int64_t h = g * group + j;
                const __m512i q_lo = _mm512_loadu_si512(q16 + h * 64);
                const __m512i q_hi = _mm512_loadu_si512(q16 + h * 64 + 32);
                __m512i acc[16];
                for (int i = 0; i < 16; i++) {
                    const __m512i a = _mm512_dpwssd_epi32(
                        _mm512_setzero_si512(), _mm512_load_si512(keys + i * 64), q_lo);
                    acc[i] = _mm512_dpwssd_epi32(a, _mm512_load_si512(keys + i * 64 + 32), q_hi);
                }
                const __m512 dots = _mm512_cvtepi32_ps(sum_lanes16_epi32(acc));
                const __m512 sc = _mm512_mul_ps(_mm512_mul_ps(dots, ksv), _mm512_set1_ps(qs[h]));
                _mm512_storeu_ps(scores + h * len + t0, sc);
                const float m = _mm512_reduce_max_ps(sc);
                if (m > mx[h]) mx[h] = m;
            }
        }
    }
    for (int64_t t = done; v_pool && t < len; t++) prefetch_bytes(v_pool + off[t], kv_count * 64);
    return done;
}

/* pv_q8_64_group by 16-bit integer dot products, two positions per vpdpwssd (as
   pv_bf16_64_group pairs them): each query head's probabilities times the value rows' scales,
   rounded to int16 with the head's own scale (max / 32767), written over `probs` in place;
   value rows widened from int8 to int16. The int32 sums go into fp32 every 256 positions, before
   they could overflow (256 x 32767 x 127 < 2^31). probs: [heads, len] fp32, overwritten. */
#define PV_FLUSH 256
static inline __attribute__((always_inline)) void pv_q8_64_group_vnni(
    float *probs, const int8_t *v_pool, const float *v_scale, const int64_t *off, int64_t len,
    int64_t kv_count, const int64_t group, int ahead, float *acc) {
    for (int64_t g = 0; g < kv_count; g++) {
        float ps[MAX_GROUP], top[MAX_GROUP];
        float *rows = probs + g * group * len;
        __m512 tops[MAX_GROUP];
        for (int64_t j = 0; j < group; j++) tops[j] = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) { /* p' = p times the value row's scale, 16 at a time */
            float sv[16];
            for (int i = 0; i < 16; i++) sv[i] = v_scale[off[t + i] / 64 + g];
            const __m512 svv = _mm512_loadu_ps(sv);
            for (int64_t j = 0; j < group; j++) {
                const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(rows + j * len + t), svv);
                _mm512_storeu_ps(rows + j * len + t, x);
                tops[j] = _mm512_max_ps(tops[j], x);
            }
        }
        for (int64_t j = 0; j < group; j++) top[j] = _mm512_reduce_max_ps(tops[j]);
        for (; t < len; t++) {
            const float sv = v_scale[off[t] / 64 + g];
            for (int64_t j = 0; j < group; j++) {
                const float x = rows[j * len + t] * sv;
                rows[j * len + t] = x;
                top[j] = x > top[j] ? x : top[j];
            }
        }
        for (int64_t j = 0; j < group; j++) {
            float *row = rows + j * len;
            const float inv = top[j] > 0.f ? 32767.f / top[j] : 0.f;
            const __m512 invv = _mm512_set1_ps(inv);
            int16_t *p16 = (int16_t *)row; /* in place: element t's bytes [2t, 2t + 2) were read */
            int64_t t = 0;
            for (; t + 16 <= len; t += 16) /* rounded to nearest even, as nearbyintf */
                _mm256_storeu_si256(
                    (__m256i *)(p16 + t),
                    _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + t), invv))));
            for (; t < len; t++) p16[t] = (int16_t)nearbyintf(row[t] * inv);
            if (len & 1) p16[len] = 0; /* the last pair's partner (row[len / 2 + 1] was read) */
            ps[j] = top[j] / 32767.f;
        }
        __m512 total[MAX_GROUP][4];
        __m512i sums[MAX_GROUP][4];
        for (int64_t j = 0; j < group; j++)
            for (int c = 0; c < 4; c++) {
                total[j][c] = _mm512_setzero_ps();
                sums[j][c] = _mm512_setzero_si512();
            }
        for (int64_t t = 0; t < len; t += 2) {
            if (ahead && g == 0 && t + AHEAD + 1 < len) {
                prefetch_bytes(v_pool + off[t + AHEAD], kv_count * 64);
                prefetch_bytes(v_pool + off[t + AHEAD + 1], kv_count * 64);
            }
            const int8_t *v0 = v_pool + off[t] + g * 64;
            const int8_t *v1 = t + 1 < len ? v_pool + off[t + 1] + g * 64 : v0; /* p = 0 */
            __m512i pairs[4];
            for (int c = 0; c < 2; c++) {
                const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(v0 + 32 * c)));
                const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(v1 + 32 * c)));
                pairs[2 * c] = _mm512_unpacklo_epi16(a, b);
                pairs[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
            }
            for (int64_t j = 0; j < group; j++) {
                int32_t pair; /* (p[t], p[t + 1]) as two int16 in one 32-bit lane */
                memcpy(&pair, (const int16_t *)(probs + (g * group + j) * len) + t, 4);
                const __m512i p = _mm512_set1_epi32(pair);
                for (int c = 0; c < 4; c++) sums[j][c] = _mm512_dpwssd_epi32(sums[j][c], pairs[c], p);
            }
            if ((t + 2) % PV_FLUSH == 0 || t + 2 >= len)
                for (int64_t j = 0; j < group; j++)
                    for (int c = 0; c < 4; c++) {
                        total[j][c] = _mm512_add_ps(total[j][c], _mm512_cvtepi32_ps(sums[j][c]));
                        sums[j][c] = _mm512_setzero_si512();
                    }
        }
        for (int64_t j = 0; j < group; j++) {
            float lanes[4][16];
            const __m512 scale = _mm512_set1_ps(ps[j]);
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(lanes[c], _mm512_mul_ps(total[j][c], scale));
            float *a = acc + (g * group + j) * 64;
            /* as pv_bf16_64_group: register c = 2 * half + (0: unpacklo, 1: unpackhi); lane
               4k + i holds dim 32 * half + 8k + 4 * (c & 1) + i */
            for (int c = 0; c < 4; c++)
                for (int k = 0; k < 4; k++)
                    for (int i = 0; i < 4; i++)
                        a[32 * (c >> 1) + 8 * k + 4 * (c & 1) + i] = lanes[c][4 * k + i];
        }
    }
}
#endif

/* pv_q8_64_group with the group a constant where it is a common one (as pv_bf16_64); by VNNI
   where the build has it (probs then overwritten). */
static int64_t pv_q8_64(float *probs, const int8_t *v_pool, const float *v_scale,
                        const int64_t *off, int64_t len, int64_t kv_count, int64_t group,
                        int ahead, float *acc) {
#ifdef __AVX512VNNI__
#define PV_GROUP pv_q8_64_group_vnni
#else
#define PV_GROUP pv_q8_64_group
#endif
    switch (group) {
    case 1: PV_GROUP(probs, v_pool, v_scale, off, len, kv_count, 1, ahead, acc); break;
    case 2: PV_GROUP(probs, v_pool, v_scale, off, len, kv_count, 2, ahead, acc); break;
    case 3: PV_GROUP(probs, v_pool, v_scale, off, len, kv_count, 3, ahead, acc); break;
    case 4: PV_GROUP(probs, v_pool, v_scale, off, len, kv_count, 4, ahead, acc); break;
    case 8: PV_GROUP(probs, v_pool, v_scale, off, len, kv_count, 8, ahead, acc); break;
    default: PV_GROUP(probs, v_pool, v_scale, off, len, kv_count, group, ahead, acc);
    }
#undef PV_GROUP
    return len;
}
#endif
