/*
 * The avx512-vnni kernels (avx512_vnni.h) with prefill's q8 scores on AMX
 * tiles (tdpbssd): scores_q8's many-heads case (a prefill tile's query
 * vectors against a K block) goes to scores_q8_amx when it takes the
 * shape.  Everything else, decode included, is the avx512-vnni code.  The
 * table is handed out only when the CPU has AMX-TILE and AMX-INT8 and the
 * OS granted this process the tile state (cpu_features.c).
 */
#define SA_ISA_ID avx512_amx
#include "avx512_vnni.h"

#define scores_q8_panels_avx512_amx NULL /* SA_Q8_PANEL_KEYS 0 (kernels.h) */

/* A compiler without the AMX intrinsics (GCC < 11, clang < 12) builds this
 * table as avx512-vnni's and cpu_features.c never hands it out. */
#if !defined(SA_AMX_COMPILED) && defined(__has_include)
#if __has_include(<amxtileintrin.h>) && __has_include(<amxint8intrin.h>)
#define SA_AMX_COMPILED 1
#endif
#endif
#ifndef SA_AMX_COMPILED
#define SA_AMX_COMPILED 0
#endif
const int sa_amx_compiled = SA_AMX_COMPILED;

#if SA_AMX_COMPILED
/* -------------------------------------------------------------------------
 * Prefill's q8 scores on AMX tiles.
 *
 * tdpbssd multiplies a 16 x cb tile of signed bytes (16 query vectors, cb
 * bytes of a group) by a cb/4 x 64 tile whose row r holds bytes 4r .. 4r+3
 * of 16 K rows, which is the transposed block k_block_t makes
 * (without the flip: both operands are signed here), into 16 x 16 exact
 * int32 sums.  A group's sums go through memory to the same group term as
 * every other path, in group order, so the scores are bitwise those of the
 * avx512-vnni kernels (and of the portable one).  Groups of more than 64
 * bytes are summed over 64-byte chunks in the int32 tile, exactly.
 * ---------------------------------------------------------------------- */

/* The tile configuration (palette 1): tmm0 = A, tmm1 = B, tmm2 = C. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* At most SA_AMX_GROUPS groups per row (one C tile each, tmm2 ..). */
#define SA_AMX_GROUPS 6

SA_INLINE int amx_takes(int gs, int D)
{
    return gs % 16 == 0 && (gs <= 64 || gs % 64 == 0) && D <= SA_Q8_MANY_MAX_D &&
           D / gs <= SA_AMX_GROUPS;
}

#define SA_AMX_FN __attribute__((target("amx-tile,amx-int8"), noinline))

/* Group g's sums of the 16 query vectors at a (row stride D) against the
 * block kt, into C tile `tile` (= 2 + g, a literal: the intrinsics paste it
 * into the instruction). */
#define SA_AMX_GROUP(g, tile)                                                    \
    do {                                                                         \
        if ((g) < ng) {                                                          \
            _tile_zero(tile);                                                    \
            for (int o = (g) * gs; o < ((g) + 1) * gs; o += cb) {                \
                _tile_loadd(0, a + o, D);                                        \
                _tile_loadd(1, (const char *)kt + (ptrdiff_t)o * 16, 64);        \
                _tile_dpbssd(tile, 0, 1);                                        \
            }                                                                    \
        }                                                                        \
    } while (0)
#define SA_AMX_STORE(g, tile, dst)                                               \
    do {                                                                         \
        if ((g) < ng)                                                            \
            _tile_stored(tile, (dst) + 256 * (g), 64);                           \
    } while (0)

/* The 16 x 16 group sums at c (c[256 g + 16 i + j]: vector i, token j) ->
 * the scores of the vectors h0 .. h0+nh-1 for tokens t .. t+cnt-1. */
SA_INLINE void amx_group_terms(const int32_t *c, const float *qd, int ng, int h0, int nh,
                               const __m512 *kds, float *const *s, int t, int cnt)
{
    for (int i = 0; i < nh; i++) {
        const float *qdh = qd + (ptrdiff_t)(h0 + i) * ng;
        __m512 res = _mm512_setzero_ps();
        for (int g = 0; g < ng; g++)
            res = add_group_term(res, qdh[g], kds[g], _mm512_load_si512(c + 256 * g + 16 * i));
        vf_store_first(s[h0 + i] + t, cnt, res);
    }
}

SA_AMX_FN static void scores_q8_amx(const int8_t *qq, const float *qd, int G, int D, int gs,
                                    const int8_t *k, const float *kd, ptrdiff_t row_stride,
                                    ptrdiff_t scale_stride, int n, float *const *s,
                                    const sa_prefetch *pf)
{
    __m512i kt[SA_Q8_MANY_MAX_D / 4];           /* B: chunk c of 16 K rows */
    __m512 kds[SA_AMX_GROUPS];
    int32_t c16[2][SA_AMX_GROUPS * 256] __attribute__((aligned(64)));
    int8_t qpad[16 * SA_Q8_MANY_MAX_D] __attribute__((aligned(64)));
    const int ng = D / gs, iters = (n + 15) / 16;
    const int cb = gs < 64 ? gs : 64, tail = G % 16;

    /* The last, partial block of query vectors, zero-padded to 16 rows. */
    if (tail) {
        memset(qpad, 0, (size_t)16 * D);
        memcpy(qpad, qq + (ptrdiff_t)(G - tail) * D, (size_t)tail * D);
    }
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.colsb[0] = (uint16_t)cb, cfg.rows[0] = 16;
    cfg.colsb[1] = 64, cfg.rows[1] = (uint8_t)(cb / 4);
    for (int g = 0; g < ng; g++)
        cfg.colsb[2 + g] = 64, cfg.rows[2 + g] = 16;
    _tile_loadconfig(&cfg);

    for (int t = 0, it = 0; t < n; t += 16, it++) {
        const int cnt = n - t < 16 ? n - t : 16;
        const int8_t *rows[16];
        SA_BLOCK_ROWS(rows, k, t, cnt, row_stride);
        sa_prefetch_part(pf, it, iters);
        k_block_t(rows, kd + (ptrdiff_t)t * scale_stride, scale_stride, cnt, D, gs, kt, kds);

        /* A pipeline over blocks of 16 query vectors: block x's tiles are
         * issued, then block x - 1's sums (stored before) become scores
         * while the tile unit works. */
        int prev = -1;
        for (int h0 = 0, x = 0;; h0 += 16, x ^= 1) {
            if (h0 < G) {
                const int8_t *a = G - h0 >= 16 ? qq + (ptrdiff_t)h0 * D : qpad;
                SA_AMX_GROUP(0, 2);
                SA_AMX_GROUP(1, 3);
                SA_AMX_GROUP(2, 4);
                SA_AMX_GROUP(3, 5);
                SA_AMX_GROUP(4, 6);
                SA_AMX_GROUP(5, 7);
            }
            if (prev >= 0) {
                const int nh = G - prev < 16 ? G - prev : 16;
                amx_group_terms(c16[x ^ 1], qd, ng, prev, nh, kds, s, t, cnt);
            }
            if (h0 >= G)
                break;
            SA_AMX_STORE(0, 2, c16[x]);
            SA_AMX_STORE(1, 3, c16[x]);
            SA_AMX_STORE(2, 4, c16[x]);
            SA_AMX_STORE(3, 5, c16[x]);
            SA_AMX_STORE(4, 6, c16[x]);
            SA_AMX_STORE(5, 7, c16[x]);
            prev = h0;
        }
    }
    _tile_release();
}
#undef SA_AMX_GROUP
#undef SA_AMX_STORE
#endif

static void scores_q8_many(const int8_t *qq, const float *qd, int G, int D, int gs,
                           const int8_t *k, const float *kd, ptrdiff_t row_stride,
                           ptrdiff_t scale_stride, int n, float *const *s,
                           const sa_prefetch *pf)
{
#if SA_AMX_COMPILED
    if (amx_takes(gs, D)) {
        scores_q8_amx(qq, qd, G, D, gs, k, kd, row_stride, scale_stride, n, s, pf);
        return;
    }
#endif
    scores_q8_gemm_many(qq, qd, G, D, gs, k, kd, row_stride, scale_stride, n, s, pf);
}

#include "x86_common.h"
