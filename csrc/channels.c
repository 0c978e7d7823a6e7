/*
 * The channel-major copy of K for scoring="channels" (spec §6, after
 * SparQ): kept up to date, checked, and scored.
 *
 * Each channel of a KV head has one row over all blocks; a block's part of
 * it is the block's bs values of that channel as one q8 group (bs int8 and
 * one float32 scale).  Scoring r of D channels then reads r * (bs + 4)
 * bytes of a block instead of the whole K block (with D = 64 and r = 16 a
 * quarter of a q8 block's bytes), as r streams read front to back.  The
 * copy costs about K's own size (q8 K: the same bytes; float32 K: a
 * quarter).  Each block is recomputed from its own rows, so appending a
 * token at a time never lets rounding drift; nothing here allocates, so a
 * cache append cannot fail half way through.
 */
/* No floating-point traps are ever looked at: saying so lets GCC turn the
 * comparisons of the maximum and of the rounding (sa_round_q8) into
 * selects and vectorise those loops (several times faster; the values are
 * the same IEEE operations either way). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include <math.h>

#include "channels.h"

/* A block is copied in tiles of up to COPY_ROWS rows x COPY_CHANNELS
 * channels: the tile's values are read row by row (K's layout) into a
 * float tile in L1, and each channel's values are then taken from it.
 * Reading K a channel at a time instead (one strided load per value,
 * twice) made a 4096-token copy of 8 KV heads of head_dim 128 take 34 ms
 * (CHANGELOG.md, 0.2.0); the values, their maximum and their rounding are the same
 * operations either way, so the copy is bitwise the same. */
#define COPY_ROWS 32
#define COPY_CHANNELS 64

/* K[kh, r0 + t, i0 + j] for t < n, j < m into tile[t * COPY_CHANNELS + j],
 * as the copy quantises it: the float value, or scale * int8 (one
 * rounding) for q8. */
static void load_tile(const sa_kv *k, int kh, int r0, int n, int i0, int m, float *tile)
{
    for (int t = 0; t < n; t++) {
        float *dst = tile + (ptrdiff_t)t * COPY_CHANNELS;
        if (k->dtype == SA_DTYPE_F32) {
            const float *src = sa_kv_f32_row(k, kh, r0 + t) + i0;
            for (int j = 0; j < m; j++)
                dst[j] = src[j];
            continue;
        }
        const int8_t *src = sa_kv_q8_row(k, kh, r0 + t) + i0;
        const float *sc = sa_kv_scale_row(k, kh, r0 + t);
        const int gs = k->group_size;
        for (int j = 0; j < m;) {          /* a scale group (or its part) at a time */
            const int g = (i0 + j) / gs, end = sa_min(m, (g + 1) * gs - i0);
            const float d = sc[g];
            for (; j < end; j++)
                dst[j] = d * (float)src[j];
        }
    }
}

/* The copy of channels [i0, i0 + COPY_CHANNELS) of rows [r0, r1)
 * (r1 - r0 <= bs) of KV head kh into block blk of those channels' rows
 * (cs values, one scale): per channel the q8 recipe of spec §4 over its
 * values (the missing rows of a partial block count as zeros and are not
 * written: scoring reads a block's valid rows only).  NaN in K (only K
 * given directly can hold it) is ignored by the maximum and quantises to
 * -127, as in sa_quantize_row. */
static void block_copy(const sa_kv *k, int kh, int i0, int r0, int r1, const sa_channels *c,
                       int blk)
{
    const int D = k->head_dim, n = r1 - r0, cs = c->block_rows;
    const int m = sa_min(COPY_CHANNELS, D - i0);
    float tile[COPY_ROWS * COPY_CHANNELS], amax[COPY_CHANNELS], id[COPY_CHANNELS];
    int8_t qt[COPY_ROWS * COPY_CHANNELS];
    for (int j = 0; j < m; j++)
        amax[j] = 0.0f;
    for (int t0 = 0; t0 < n; t0 += COPY_ROWS) {
        const int nt = sa_min(COPY_ROWS, n - t0);
        load_tile(k, kh, r0 + t0, nt, i0, m, tile);
        for (int t = 0; t < nt; t++)
            for (int j = 0; j < m; j++) {
                const float a = fabsf(tile[t * COPY_CHANNELS + j]);
                amax[j] = a > amax[j] ? a : amax[j];
            }
    }
    for (int j = 0; j < m; j++) {
        const float d = amax[j] / 127.0f;
        id[j] = sa_q8_inverse(d);
        c->scales[((ptrdiff_t)kh * D + i0 + j) * c->head_stride + blk] = d;
    }
    for (int t0 = 0; t0 < n; t0 += COPY_ROWS) {
        const int nt = sa_min(COPY_ROWS, n - t0);
        if (n > COPY_ROWS)          /* else the tile still holds the rows */
            load_tile(k, kh, r0 + t0, nt, i0, m, tile);
        /* rounded along the rows (the loop the compiler vectorises), then
         * written out a channel at a time */
        for (int t = 0; t < nt; t++)
            for (int j = 0; j < m; j++)
                qt[t * COPY_CHANNELS + j] = sa_round_q8(tile[t * COPY_CHANNELS + j] * id[j]);
        for (int j = 0; j < m; j++) {
            int8_t *row = c->q8 + (((ptrdiff_t)kh * D + i0 + j) * c->head_stride + blk) * cs;
            for (int t = 0; t < nt; t++)
                row[t0 + t] = qt[t * COPY_CHANNELS + j];
        }
    }
}

int sa_check_channels_update(const sa_kv *k, int from_row, int to_row, const sa_channels *c)
{
    int rc = sa_check_kv(k);
    if (rc)
        return rc;
    if (!c || !c->q8 || !c->scales)
        return SA_ERR_NULL;
    if (c->n_kv_heads != k->n_kv_heads || c->head_dim != k->head_dim || c->block_size < 1 ||
        c->head_stride < 0 || c->block_rows < 1)
        return SA_ERR_SHAPE;
    if (from_row < 0 || from_row > to_row || to_row > k->n_rows ||
        sa_ceil_div(to_row, c->block_size) > c->head_stride ||
        c->block_rows < sa_min(c->block_size, to_row))
        return SA_ERR_SEQ_LEN;
    return SA_OK;
}

void sa_channels_compute(const sa_kv *k, int from_row, int to_row, sa_channels *c)
{
    const int bs = c->block_size;
    /* a tile of channels over every block before the next: each channel's
     * row is then written front to back (block after block), where going
     * block by block over all channels wrote D places a row apart each time */
    for (int kh = 0; kh < k->n_kv_heads; kh++)
        for (int i0 = 0; i0 < k->head_dim; i0 += COPY_CHANNELS)
            for (int blk = from_row / bs; blk < sa_ceil_div(to_row, bs); blk++)
                block_copy(k, kh, i0, sa_block_start(blk, bs), sa_block_end(blk, bs, to_row), c,
                           blk);
    c->k_rows = to_row;
}

int sa_channels_update(const sa_kv *k, int from_row, int to_row, sa_channels *c)
{
    const int rc = sa_check_channels_update(k, from_row, to_row, c);
    if (rc)
        return rc;
    sa_channels_compute(k, from_row, to_row, c);
    return SA_OK;
}

int sa_check_channels(const sa_channels *c, const sa_kv *k, int seq_len, int block_size)
{
    if (!c || !c->q8 || !c->scales)
        return SA_ERR_CHANNELS;
    if (c->n_kv_heads != k->n_kv_heads || c->head_dim != k->head_dim ||
        c->block_size != block_size || c->k_rows != seq_len ||
        c->head_stride < sa_ceil_div(seq_len, block_size) ||
        c->block_rows < sa_min(block_size, seq_len))
        return SA_ERR_CHANNELS;
    return SA_OK;
}

/* idx[0 .. r) = the r channels of largest a[i] (ties to the lower channel),
 * ascending.  One pass keeps the best r so far in order (values in top,
 * r floats), as rank_unused does for blocks: a channel is inserted only when
 * it beats the current worst, and a later channel never beats an equal
 * value.  For the finite, non-negative sums this is given, the same channels
 * as picking the largest r times over all D (the earlier form: D * r
 * compares, 3.0 -> 1.6 us per KV head at D = 128, r = 16 on the Zen 4). */
static void top_channels(const float *a, int D, int r, int32_t *idx, float *top)
{
    int n = 0;
    float worst = 0.0f;     /* top[r - 1] once the list is full */
    for (int c = 0; c < D; c++) {
        const float v = a[c];
        if (n == r && !(v > worst))
            continue;
        int i = n < r ? n++ : n - 1;
        for (; i > 0 && v > top[i - 1]; i--) {
            top[i] = top[i - 1];
            idx[i] = idx[i - 1];
        }
        top[i] = v;
        idx[i] = c;
        worst = top[n - 1];
    }
    for (int j = 1; j < r; j++)     /* ascending: the order the sums run in */
        for (int m = j; m > 0 && idx[m - 1] > idx[m]; m--) {
            const int32_t x = idx[m];
            idx[m] = idx[m - 1];
            idx[m - 1] = x;
        }
}

void sa_channels_group(const sa_kernels *kern, sa_scratch *s, const sa_channels *c,
                       int n_channels, int kh, const float *qf, int seq_len)
{
    const int G = s->G, D = s->D, NB = s->NB, bs = c->block_size, cs = c->block_rows;
    const int r = sa_min(n_channels, D);
    /* The group's summed |q| per channel, in head order. */
    for (int i = 0; i < D; i++) {
        float a = 0.0f;
        for (int g = 0; g < G; g++)
            a += fabsf(qf[(ptrdiff_t)g * D + i]);
        s->chan_sum[i] = a;
    }
    top_channels(s->chan_sum, D, r, s->chan_idx, s->chan_sum + D);
    for (int g = 0; g < G; g++)
        s->sp[g] = s->probe + (ptrdiff_t)g * NB;
    const ptrdiff_t at = (ptrdiff_t)kh * D * c->head_stride;
    const int last_rows = seq_len - sa_block_start(NB - 1, bs);
    kern->channel_scores(qf, G, D, s->chan_idx, r, c->q8 + at * cs, c->scales + at, cs,
                         c->head_stride, bs, NB, last_rows, s->chan_acc, s->sp);
}
