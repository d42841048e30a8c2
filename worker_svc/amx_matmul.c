/* y = x @ W.T on AMX tiles for a 4-bit weight in int4_matmul_bf16's layout (included by
   cpu_kernels.c; built where -march has AMX: amx_tile and amx_bf16).

   The weight stays 4-bit in memory (blocked_matmul.int4_layout: per block of 16 outputs and
   group of 32 inputs, 256 bytes of codes and the outputs' scales and zeros in bf16). For each
   pair of output blocks a thread turns the codes of all groups into their bf16 values,
   bf16((code - 8) * scale + zero) (the values --quantization auto's dense copy holds: the
   product is exact in fp32, so one rounding), laid out as AMX B tiles: a chunk of 32 code bytes
   widened gives 16 outputs x 2 inputs as pairs, which is one row of a bf16 B tile (K pairs x N),
   so no shuffle is needed. Then every 16 rows of x run against those tiles with tdpbf16ps (fp32
   sums over all inputs), 2 x 2 tiles at a time (32 rows x 32 outputs), the B tiles read from
   L1/L2 as often as there are row tiles. The conversion costs the same whatever the rows, the
   tile products grow with them: from a few dozen rows on this beats both the blocked AVX-512
   kernel (each row's products by vdpbf16ps) and oneDNN on the dense copy (which reads 2 bytes
   per weight, and 3.2x the memory of these codes).

   Rows are not computed alone here: tdpbf16ps sums pairs of products in its own order, so a
   row's bits may differ from what it gives with other row counts. Used above the row split
   (QuantizedLinear.max_rows), where the dense path ran before, whose sums were not row-invariant
   either. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(HAVE_AVX512_BF16)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every tile 16 rows of 64 bytes: C 0-3 (fp32 16 x 16), A 4-5 (16 rows x 32 bf16), B 6-7
   (16 input pairs x 16 outputs x 2). */
static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* One B tile: a block's group of 16 outputs x 32 inputs as bf16 values (1 KB), row 2c the
   inputs 4c, 4c + 1 and row 2c + 1 the inputs 4c + 2, 4c + 3 (c the code chunk), each row's
   element 2o + e output o's value for input pair element e. blk: the group's 320 bytes. */
static inline __attribute__((always_inline)) void int4_b_tile(const uint8_t *blk, uint16_t *tile) {
    /* code n -> n - 8 in fp32 by a 16-entry table (vpermps reads an index's low 4 bits, so the
       low nibble needs no mask) */
    const __m512 table = _mm512_set_ps(7.f, 6.f, 5.f, 4.f, 3.f, 2.f, 1.f, 0.f,
                                       -1.f, -2.f, -3.f, -4.f, -5.f, -6.f, -7.f, -8.f);
    /* lane i of a 16-lane half: output i / 2 (first half) or 8 + i / 2 (second) */
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 scale = load_bf16x16((const uint16_t *)(blk + 256));
    const __m512 zero = load_bf16x16((const uint16_t *)(blk + 288));
    /* value = (code - 8) * scale + zero: the product is exact, so fused or not it is rounded
       once, as the dense copy's values were */
    const __m512 s0 = _mm512_permutexvar_ps(first, scale), s1 = _mm512_permutexvar_ps(second, scale);
    const __m512 z0 = _mm512_permutexvar_ps(first, zero), z1 = _mm512_permutexvar_ps(second, zero);
    for (int c = 0; c < 8; c++) {
        const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * c)));
        const __m512i v1 =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * c + 16)));
        const __m512 lo0 = _mm512_permutexvar_ps(v0, table);
        const __m512 lo1 = _mm512_permutexvar_ps(v1, table);
        const __m512 hi0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), table);
        const __m512 hi1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), table);
        _mm512_store_si512(tile + 64 * c, (__m512i)_mm512_cvtne2ps_pbh(
            _mm512_fmadd_ps(lo1, s1, z1), _mm512_fmadd_ps(lo0, s0, z0)));
        _mm512_store_si512(tile + 64 * c + 32, (__m512i)_mm512_cvtne2ps_pbh(
            _mm512_fmadd_ps(hi1, s1, z1), _mm512_fmadd_ps(hi0, s0, z0)));
    }
}

/* The B tiles still to be made for the next pair of output blocks, made a few at a time between
   the current pair's tile products, so that the vector units convert while the tiles multiply
   (the two overlap; one after the other, the conversion cost about as much as the products at
   64 rows). Tile i: block i / groups of the pair, group i % groups. */
typedef struct {
    const uint8_t *w; /* the pair's first block's codes */
    uint16_t *b;      /* its tiles: [block][group][512] */
    int64_t groups, next, total; /* tiles made, tiles to make */
} tile_maker;

static inline __attribute__((always_inline)) void make_tiles(tile_maker *mk, int64_t count) {
    for (int64_t end = mk->next + count < mk->total ? mk->next + count : mk->total;
         mk->next < end; mk->next++) {
        const uint8_t *blk = mk->w + mk->next * INT4_BLOCK_BYTES; /* blocks follow each other */
        /* 12 groups ahead (3.8 KB): 2 ahead left the conversion waiting on memory (alone it ran
           1.7x slower) */
        for (int k = 0; k < INT4_BLOCK_BYTES; k += 64)
            _mm_prefetch((const char *)blk + 12 * INT4_BLOCK_BYTES + k, _MM_HINT_T0);
        int4_b_tile(blk, mk->b + mk->next * 512);
    }
}

/* c: 16 x 16 fp32 -> rows [0, valid) of y (row stride `out` values), rounded to bf16. */
static inline void store_rows(const float *c, int64_t valid, uint16_t *y, int64_t out) {
    for (int64_t r = 0; r < valid; r++)
        _mm256_storeu_si256((__m256i *)(y + r * out),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + 16 * r)));
}

/* 16 * MB rows of x (a0, a1: the first row of each 16, `stride` bytes from row to row) against
   NB blocks of B tiles (b: [block][group][512]); y's columns [0, 16 * NB) of those rows (valid:
   real rows left), `per_group` of the next pair's tiles made after each group's products. */
static inline __attribute__((always_inline)) void amx_block(
    const int MB, const int NB, const uint16_t *a0, const uint16_t *a1, int64_t stride,
    const uint16_t *b, int64_t groups, float *c, int64_t valid, uint16_t *y, int64_t out,
    tile_maker *mk, int64_t per_group) {
    _tile_zero(0);
    if (NB == 2) _tile_zero(1);
    if (MB == 2) _tile_zero(2);
    if (MB == 2 && NB == 2) _tile_zero(3);
    for (int64_t g = 0; g < groups; g++) {
        _tile_loadd(6, b + g * 512, 64);
        if (NB == 2) _tile_loadd(7, b + (groups + g) * 512, 64);
        _tile_loadd(4, a0 + g * 32, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (NB == 2) _tile_dpbf16ps(1, 4, 7);
        if (MB == 2) {
            _tile_loadd(5, a1 + g * 32, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (NB == 2) _tile_dpbf16ps(3, 5, 7);
        }
        make_tiles(mk, per_group);
    }
    /* the real rows of each row tile: at most 16 */
    const int64_t first = valid < 16 ? valid : 16, second = valid - 16 < 16 ? valid - 16 : 16;
    _tile_stored(0, c, 64);
    store_rows(c, first, y, out);
    if (NB == 2) {
        _tile_stored(1, c, 64);
        store_rows(c, first, y + 16, out);
    }
    if (MB == 2) {
        _tile_stored(2, c, 64);
        store_rows(c, second, y + 16 * out, out);
        if (NB == 2) {
            _tile_stored(3, c, 64);
            store_rows(c, second, y + 16 * out + 16, out);
        }
    }
}

/* A thread's scratch memory, kept from call to call (the OpenMP threads live as long as the
   process): grown where a call needs more, never freed. A malloc per call of these sizes (tens
   to hundreds of KB) was an mmap and its page faults every time. */
typedef struct {
    void *data;
    size_t bytes;
} scratch_space;

static __thread scratch_space tile_buffer, tail_buffer;

static void *scratch(scratch_space *space, size_t bytes) {
    if (space->bytes < bytes) {
        free(space->data);
        space->bytes = (bytes + 4095) & ~(size_t)4095;
        space->data = aligned_alloc(64, space->bytes);
        if (!space->data) space->bytes = 0;
    }
    return space->data;
}

/* Pairs [p0, p1) of output blocks (the last pair of an odd count is one block). */
static void amx_pairs(const uint16_t *x, const uint16_t *tail, int64_t rows, int64_t in,
                      const uint8_t *w, int64_t blocks, int64_t p0, int64_t p1, uint16_t *bufs,
                      float *c, uint16_t *y, int64_t out) {
    const int64_t groups = in / INT4_GROUP, padded = (rows + 15) & ~(int64_t)15;
    const int64_t pair_tiles = 2 * groups, passes = (padded + 31) / 32;
    /* the next pair's tiles spread over this pair's passes and groups, rounded up */
    const int64_t per_group = (pair_tiles + passes * groups - 1) / (passes * groups);
    tile_maker mk = {w + 2 * p0 * groups * INT4_BLOCK_BYTES, bufs, groups, 0, 0};
    mk.total = (2 * p0 + 1 < blocks ? 2 : 1) * groups;
    make_tiles(&mk, mk.total);
    for (int64_t p = p0; p < p1; p++) {
        uint16_t *b = bufs + ((p - p0) & 1) * pair_tiles * 512;
        const int64_t ob = 2 * p, nb = ob + 1 < blocks ? 2 : 1;
        mk.b = bufs + ((p - p0 + 1) & 1) * pair_tiles * 512;
        mk.w = w + 2 * (p + 1) * groups * INT4_BLOCK_BYTES;
        mk.next = 0;
        mk.total = p + 1 >= p1 ? 0 : (2 * (p + 1) + 1 < blocks ? 2 : 1) * groups;
        for (int64_t m0 = 0; m0 < padded; m0 += 32) {
            /* a row tile past the last whole one reads the padded copy of its rows */
            const uint16_t *a0 = m0 + 16 <= rows ? x + m0 * in : tail;
            const uint16_t *a1 = m0 + 32 <= rows ? x + (m0 + 16) * in : tail;
            uint16_t *ym = y + m0 * out + ob * 16;
            const int64_t valid = rows - m0, st = in * 2;
            const int mb = padded - m0 >= 32 ? 2 : 1;
#define BLOCK(MB, NB) amx_block(MB, NB, a0, a1, st, b, groups, c, valid, ym, out, &mk, per_group)
            if (mb == 2 && nb == 2) BLOCK(2, 2);
            else if (mb == 2) BLOCK(2, 1);
            else if (nb == 2) BLOCK(1, 2);
            else BLOCK(1, 1);
#undef BLOCK
        }
        make_tiles(&mk, mk.total); /* any left */
    }
}
#endif

static int amx_permitted = -1; /* -1: not asked yet */

/* 1 where this build has the AMX kernel and the kernel let this process use the tiles (Linux
   asks each process to request them: arch_prctl ARCH_REQ_XCOMP_PERM). */
int amx_kernels_ready(void) {
#ifdef HAVE_AMX
    if (amx_permitted < 0)
        amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_permitted;
#else
    return 0;
#endif
}

/* As int4_matmul_bf16 (same layout and arguments), on AMX tiles. Returns 0; -1 for a shape it
   does not take or where AMX is not ready; -2 when out of memory. */
int int4_matmul_amx(const uint16_t *x, int64_t rows, int64_t in, const uint8_t *w, int64_t out,
                    uint16_t *y) {
#ifndef HAVE_AMX
    (void)x, (void)rows, (void)in, (void)w, (void)out, (void)y;
    return -1;
#else
    if (in % INT4_GROUP || out % 16 || rows < 0 || !amx_kernels_ready()) return -1;
    if (rows == 0) return 0;
    const int64_t groups = in / INT4_GROUP, blocks = out / 16, pairs = (blocks + 1) / 2;
    /* the rows past the last whole 16, padded with zeros to 16 (their results not stored) */
    const int64_t whole = rows & ~(int64_t)15;
    uint16_t *tail = NULL;
    if (whole < rows) {
        tail = scratch(&tail_buffer, (size_t)(16 * in * 2));
        if (!tail) return -2;
        memcpy(tail, x + whole * in, (size_t)((rows - whole) * in * 2));
        memset(tail + (rows - whole) * in, 0, (size_t)((16 - rows + whole) * in * 2));
    }
    int failed = 0;
    const int threads = pairs >= 2 && kernel_threads > 1 ? kernel_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        /* two pairs' B tiles: the current pair's, and the next one's being made; then a C tile */
        uint16_t *bufs = scratch(&tile_buffer, (size_t)(4 * groups * 1024 + 1024));
        if (!bufs) {
#pragma omp atomic write
            failed = 1;
        } else {
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
            const int64_t p0 = pairs * me / team, p1 = pairs * (me + 1) / team;
            configure_tiles();
            float *c = (float *)(bufs + 4 * groups * 512);
            if (p0 < p1) amx_pairs(x, tail, rows, in, w, blocks, p0, p1, bufs, c, y, out);
            _tile_release();
        }
    }
    return failed ? -2 : 0;
#endif
}
