/*
 * The tile loop of channel_scores for the SIMD files (x86/x86_common.h,
 * arm/neon_common.h), which include it after defining
 *
 *   SA_FN(name)                        the kernel's name in their table
 *   SA_C_HEADS                         the most heads of one block call (2 or 4)
 *   channel_weights8(dst, qv, sc)      dst[t] = qv * sc[t] for t < 8, one
 *                                      float product each
 *   channel_block_simd(G, r, db, cs, off, w, t, g0, HB, NB, s, b)
 *                                      s[g0 + h][b + k] for h < HB, k < NB of
 *                                      NB 32-row blocks whose channel j is at
 *                                      db + off[j] + k * cs, their weights at
 *                                      w[(j*G + g0 + h)*8 + t + k]
 *   SA_C_PAIR                          optional: the file scores two adjacent
 *                                      blocks at once (NB = 2); else NB = 1
 *
 * Per tile of SA_CHANNEL_TILE blocks it forms the weights q[g][c] *
 * scale(c, b) (kernels.h: the scalar loop's product) when a block of the
 * tile has 32 rows, then scores each
 * 32-row block through channel_block_simd and any other block through the
 * scalar loop (channel_block_scalar).  The r channel rows are r streams,
 * more than the hardware prefetchers follow: each row is prefetched 8
 * blocks (256 bytes) ahead, its scales 32 blocks ahead.
 */
#ifndef SA_CHANNEL_TILES_H
#define SA_CHANNEL_TILES_H

#define SA_C_PF 8   /* blocks ahead a channel row is prefetched */

/* Every head of the NB blocks b .. b + NB - 1 (NB a constant at each call),
 * SA_C_HEADS heads at a time, then pairs, then one. */
SA_INLINE void channel_heads(int G, int r, const int8_t *db, ptrdiff_t cs, const ptrdiff_t *off,
                             const float *w, int t, const int NB, float *const *s, int b)
{
    int g0 = 0;
    for (; g0 + SA_C_HEADS <= G; g0 += SA_C_HEADS)
        channel_block_simd(G, r, db, cs, off, w, t, g0, SA_C_HEADS, NB, s, b);
#if SA_C_HEADS > 2
    for (; g0 + 2 <= G; g0 += 2)
        channel_block_simd(G, r, db, cs, off, w, t, g0, 2, NB, s, b);
#endif
    for (; g0 < G; g0++)
        channel_block_simd(G, r, db, cs, off, w, t, g0, 1, NB, s, b);
}

static void SA_FN(channel_scores)(const float *q, int G, int D, const int32_t *idx, int r,
                                  const int8_t *d, const float *sc, int cs,
                                  ptrdiff_t cstride, int bs, int n, int last_rows,
                                  float *acc, float *const *s)
{
    enum { T = SA_CHANNEL_TILE };
    _Static_assert(T == 8, "channel_weights8 forms a tile's weights");
    float *const w = acc + (ptrdiff_t)G * (n > 1 ? bs : last_rows); /* [r][G][T] */
    ptrdiff_t *const off = sa_channel_offsets(w, G, r);               /* [r] */
    for (int j = 0; j < r; j++)
        off[j] = (ptrdiff_t)idx[j] * cstride * cs;
    for (int b0 = 0; b0 < n; b0 += T) {
        const int nt = n - b0 < T ? n - b0 : T;
        /* Only 32-row blocks read the weights: with another block size,
         * at most the last block (of last_rows == 32) does. */
        const int simd = bs == 32 || (b0 + nt == n && last_rows == 32);
        for (int j = 0; j < r && simd; j++) {
            const float *scj = sc + (ptrdiff_t)idx[j] * cstride + b0;
            float *wj = w + (ptrdiff_t)j * G * T;
            if (!(b0 & 8))     /* this channel's scales, 32 blocks ahead */
                __builtin_prefetch(scj + 32, 0, 2);
            if (nt == T) {
                for (int g = 0; g < G; g++)
                    channel_weights8(wj + g * T, q[(ptrdiff_t)g * D + idx[j]], scj);
            } else {
                for (int g = 0; g < G; g++)
                    for (int t = 0; t < nt; t++)
                        wj[g * T + t] = q[(ptrdiff_t)g * D + idx[j]] * scj[t];
            }
        }
        for (int t = 0; t < nt; t++) {
            const int b = b0 + t;
            const int rows = b == n - 1 ? last_rows : bs;
            if (rows != 32) {
                channel_block_scalar(q, G, D, idx, r, d, sc, cs, cstride, bs, b, rows, acc, s);
                continue;
            }
            const int8_t *db = d + (ptrdiff_t)b * cs;
            if (!(b & 1)) {     /* each channel's row, 8 blocks ahead */
                const int8_t *pf = db + SA_C_PF * (ptrdiff_t)cs;
                for (int j = 0; j < r; j++)
                    __builtin_prefetch(pf + off[j], 0, 2);
            }
#ifdef SA_C_PAIR
            if (t + 1 < nt && (b + 1 < n - 1 || last_rows == 32)) {   /* b + 1: 32 rows too */
                channel_heads(G, r, db, cs, off, w, t, 2, s, b);
                t++;
                continue;
            }
#endif
            channel_heads(G, r, db, cs, off, w, t, 1, s, b);
        }
    }
}

#endif
