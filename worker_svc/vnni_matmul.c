/* int4 matmuls on int8 activations by VNNI (vpdpbusd: 64 byte products an instruction, against
   vdpbf16ps's 32 bf16 ones), included by cpu_kernels.c after int4_matmul_bf16, whose layout
   they read (blocked_matmul.int4_layout; the AMX kernel reads it too, so one copy serves all).

   Each row's activations are rounded to int8 per group of 32 inputs, symmetrically (scale s =
   max |x| / 127, code = x * (127 / max |x|) to nearest even), as llama.cpp rounds them for its
   4-bit weights (Q8_0). Each group's products are summed exactly in int32: with the weight's
   codes u in [0, 15], w = scale * (u - 8) + zero, and a = s * q,
       sum_k w_k a_k = s * (scale * sum_k u_k q_k + (zero - 8 * scale) * sum_k q_k),
   so a group costs each row 8 vpdpbusd and 4 vector ops (the int4 kernel: 16 vdpbf16ps and 2).
   Every row is still computed alone: a row's result does not depend on the rows beside it. */

#if defined(HAVE_AVX512_BF16) && defined(__AVX512VNNI__)
#define HAVE_VNNI_MATMUL 1

/* A group whose largest |x| is more than a8_outlier_ratio times its second largest keeps that
   value apart (exact, added as value x its weights' column at the end of the tile) and rounds
   the rest on the rest's own scale: rounded with it, the other 31 values would lose up to that
   factor in precision. On SmolLM2 (the RMS norms' outputs and the MLP's products carry such
   values) 9% of the groups at 3, and the KL to fp32 falls from 0.0066 to 0.002 nats. */
static float a8_outlier_ratio = 3.f;

void set_a8_outlier_ratio(float ratio) { a8_outlier_ratio = ratio; }

/* An outlier kept apart: its group, its input within the group, its value. */
typedef struct {
    int32_t group, input;
    float value;
} A8Outlier;

/* Row r's group g of x [rows, in] bf16 -> codes q[r * in + 32 g ...] and, at r * groups + g,
   its scale s and the sum of its values as rounded (s * the codes' sum, plus an outlier kept
   apart); row r's outliers at out[r * groups ...], their count at counts[r]. */
static void quantize_groups_a8(const uint16_t *x, int64_t rows, int64_t in, int8_t *q, float *s,
                               float *sq, A8Outlier *out, int32_t *counts) {
    const int64_t groups = in / INT4_GROUP;
    for (int64_t r = 0; r < rows; r++) {
        int32_t n = 0;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = r * in + g * INT4_GROUP;
            __m512 a = load_bf16x16(x + at), b = load_bf16x16(x + at + 16);
            const __m512 abs_a = _mm512_abs_ps(a), abs_b = _mm512_abs_ps(b);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));
            float apart = 0.f;
            if (amax > 0.f) {
                const __mmask16 in_a = _mm512_cmp_ps_mask(abs_a, _mm512_set1_ps(amax), _CMP_EQ_OQ);
                const __mmask16 in_b = _mm512_cmp_ps_mask(abs_b, _mm512_set1_ps(amax), _CMP_EQ_OQ);
                const int lane = in_a ? __builtin_ctz(in_a) : 16 + __builtin_ctz(in_b);
                const __mmask16 keep_a = lane < 16 ? (__mmask16) ~(1u << lane) : 0xFFFF;
                const __mmask16 keep_b = lane < 16 ? 0xFFFF : (__mmask16) ~(1u << (lane - 16));
                const float second = _mm512_reduce_max_ps(_mm512_max_ps(
                    _mm512_maskz_mov_ps(keep_a, abs_a), _mm512_maskz_mov_ps(keep_b, abs_b)));
                if (amax > a8_outlier_ratio * second) {
                    apart = bf2f(x[at + lane]);
                    out[r * groups + n++] = (A8Outlier){(int32_t)g, lane, apart};
                    a = _mm512_maskz_mov_ps(keep_a, a), b = _mm512_maskz_mov_ps(keep_b, b);
                    amax = second;
                }
            }
            const float scale = amax / 127.f;
            const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)); /* to nearest even */
            const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
            _mm_storeu_si128((__m128i *)(q + at), _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(q + at + 16), _mm512_cvtsepi32_epi8(qb));
            s[r * groups + g] = scale;
            sq[r * groups + g] =
                scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)) + apart;
        }
        counts[r] = n;
    }
}

/* An outlier's share of the 16 outputs: value * scale * u for its input's codes u (chunk input /
   4, byte 2o + input % 2, nibble (input % 4) / 2); the rest of its weights, (zero - 8 scale) *
   value, comes with its group's sum (sq). */
static inline __m512 outlier_column(const uint8_t *w, const A8Outlier *o) {
    const uint8_t *blk = w + o->group * INT4_BLOCK_BYTES;
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(blk + 32 * (o->input / 4))));
    const int shift = 8 * (o->input % 2) + 4 * ((o->input % 4) / 2);
    const __m512i u = _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(15));
    const __m512 scale = load_bf16x16((const uint16_t *)(blk + 256));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(u), scale), _mm512_set1_ps(o->value));
}

/* R rows (a constant per call site) of one block of 16 outputs. A chunk of the int4 layout, 32
   bytes, holds for output o the bytes 2o (inputs 4c and 4c + 2 in its nibbles) and 2o + 1 (4c + 1,
   4c + 3); widened to 32 bits per output (v) and ORed with v << 12, masked to low nibbles, it is
   the 4 codes of inputs 4c .. 4c + 3 in order, one 32-bit lane per output: vpdpbusd's operand. */
static inline __attribute__((always_inline)) void int4_a8_tile(
    const int R, const int8_t *q, int64_t in, const float *s, const float *sq,
    const A8Outlier *outliers, const int32_t *counts, const uint8_t *w, int64_t groups,
    uint16_t *y, int64_t out) {
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
    __m512 total[INT4_TILE];
    for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = w + g * INT4_BLOCK_BYTES;
        if (g + 2 < groups) {
            for (int b = 0; b < INT4_BLOCK_BYTES; b += 64)
                _mm_prefetch((const char *)blk + 2 * INT4_BLOCK_BYTES + b, _MM_HINT_T0);
        }
        __m512i part[INT4_TILE];
        for (int r = 0; r < R; r++) part[r] = _mm512_setzero_si512();
        const int8_t *qg = q + g * INT4_GROUP;
        for (int c = 0; c < 8; c++) {
            const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(blk + 32 * c)));
            /* (v | v << 12) & 0x0F0F0F0F: 0xA8 is (A | B) & C */
            const __m512i codes = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), nibbles, 0xA8);
            for (int r = 0; r < R; r++) {
                int32_t a;
                memcpy(&a, qg + r * in + 4 * c, 4);
                part[r] = _mm512_dpbusd_epi32(part[r], codes, _mm512_set1_epi32(a));
            }
        }
        const __m512 scale = load_bf16x16((const uint16_t *)(blk + 256));
        const __m512 zero = load_bf16x16((const uint16_t *)(blk + 288));
        const __m512 shifted = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, zero); /* zero - 8 scale */
        for (int r = 0; r < R; r++) {
            const __m512 rs = _mm512_mul_ps(scale, _mm512_set1_ps(s[r * groups + g]));
            total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[r]), rs, total[r]);
            total[r] = _mm512_fmadd_ps(shifted, _mm512_set1_ps(sq[r * groups + g]), total[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        for (int32_t j = 0; j < counts[r]; j++)
            total[r] = _mm512_add_ps(total[r], outlier_column(w, outliers + r * groups + j));
        _mm256_storeu_si256((__m256i *)(y + r * out), (__m256i)_mm512_cvtneps_pbh(total[r]));
    }
}
#endif

/* 1 where this build has int4_matmul_a8 (a -march with AVX-512 BF16 and VNNI). */
int vnni_matmul_built(void) {
#ifdef HAVE_VNNI_MATMUL
    return 1;
#else
    return 0;
#endif
}

/* y = x @ W.T as int4_matmul_bf16, with x rounded to int8 per group of 32 (above). Returns 0; -1
   for a shape it does not take or a build without it; -2 without memory for the codes. */
int int4_matmul_a8(const uint16_t *x, int64_t rows, int64_t in, const uint8_t *w, int64_t out,
                   uint16_t *y) {
#ifndef HAVE_VNNI_MATMUL
    (void)x, (void)rows, (void)in, (void)w, (void)out, (void)y;
    return -1;
#else
    if (in % INT4_GROUP || out % 16 || rows < 0) return -1;
    const int64_t groups = in / INT4_GROUP, blocks = out / 16;
    int8_t *q = malloc((size_t)(rows * in + 4));
    float *s = malloc((size_t)(2 * rows * groups + 1) * sizeof(float));
    A8Outlier *outliers = malloc((size_t)(rows * groups + 1) * sizeof(A8Outlier));
    int32_t *counts = malloc((size_t)(rows + 1) * sizeof(int32_t));
    if (!q || !s || !outliers || !counts) {
        free(q), free(s), free(outliers), free(counts);
        return -2;
    }
    float *sq = s + rows * groups;
    quantize_groups_a8(x, rows, in, q, s, sq, outliers, counts);
#pragma omp parallel for schedule(static) if (blocks >= 8 && kernel_threads > 1) \
    num_threads(kernel_threads)
    for (int64_t ob = 0; ob < blocks; ob++) {
        const uint8_t *wb = w + ob * groups * INT4_BLOCK_BYTES;
        for (int64_t r0 = 0; r0 < rows; r0 += INT4_TILE) {
            const int64_t left = rows - r0;
            const int8_t *qr = q + r0 * in;
            const float *sr = s + r0 * groups, *sqr = sq + r0 * groups;
            const A8Outlier *outr = outliers + r0 * groups;
            uint16_t *yr = y + r0 * out + ob * 16;
#define TILE(R) int4_a8_tile(R, qr, in, sr, sqr, outr, counts + r0, wb, groups, yr, out)
            TILE_ROWS(left);
#undef TILE
        }
    }
    free(q), free(s), free(outliers), free(counts);
    return 0;
#endif
}
