/*
 * Per-block key bounds for scoring="minmax" (spec §6, after Quest): kept
 * up to date, checked, and scored.
 *
 * Stored compactly, like q8: one scale per group of channels and int8
 * minima and maxima, rounded outwards so that scale * mn <= K <= scale * mx
 * holds for every valid row of the block.  At head_dim 128 and a scale
 * group of 32 a block's bounds take 272 bytes, a quarter of what the
 * 8-of-32 probe reads from a q8 K block.  Each block is recomputed from its
 * own rows, so appending a token at a time never lets rounding drift
 * accumulate.  Nothing here allocates, so a cache append cannot fail half
 * way through.
 */
#include <math.h>
#include <string.h>

#include "bounds.h"

/* Channels whose minima and maxima one pass keeps (two stack arrays). */
#define CHUNK 256

/* lo/hi[i - c0] = min/max over rows [r0, r1) of K[kh, t, i], c0 <= i < c1,
 * reading the rows front to back (dequantised for q8). */
static void channel_range(const sa_kv *k, int kh, int r0, int r1, int c0, int c1,
                          float *restrict lo, float *restrict hi)
{
    const int w = c1 - c0;
    for (int i = 0; i < w; i++)
        lo[i] = INFINITY, hi[i] = -INFINITY;
    float x[CHUNK];
    for (int t = r0; t < r1; t++) {
        const float *row;
        if (k->dtype == SA_DTYPE_F32) {
            row = sa_kv_f32_row(k, kh, t) + c0;
        } else {
            /* dequantised q8 group by q8 group (no division per element),
             * so that the ranges below are one loop the compiler vectorises
             * (an append recomputes its block) */
            const int8_t *q = sa_kv_q8_row(k, kh, t);
            const float *sc = sa_kv_scale_row(k, kh, t);
            const int gs = k->group_size;
            for (int i = c0; i < c1;) {
                const int g = i / gs, e = sa_min(c1, (g + 1) * gs);
                const float s = sc[g];
                for (; i < e; i++)
                    x[i - c0] = s * (float)q[i];
            }
            row = x;
        }
        for (int i = 0; i < w; i++) {
            lo[i] = row[i] < lo[i] ? row[i] : lo[i];
            hi[i] = row[i] > hi[i] ? row[i] : hi[i];
        }
    }
}

/* The outward-rounded int8 multiples of scale s of the channel ranges. */
static void quantise_range(const float *lo, const float *hi, int w, float s, int8_t *mn,
                           int8_t *mx)
{
    for (int i = 0; i < w; i++) {
        if (s == 0.0f) {
            mn[i] = mx[i] = 0;
            continue;
        }
        float up = ceilf(hi[i] / s), down = floorf(lo[i] / s);
        while (up * s < hi[i])  /* the division may have rounded down */
            up += 1.0f;
        while (down * s > lo[i])
            down -= 1.0f;
        mx[i] = (int8_t)(up > 127.0f ? 127.0f : up);
        mn[i] = (int8_t)(down < -127.0f ? -127.0f : down);
    }
}

/* The scale of a group from its largest magnitude: +-127 steps reach every
 * value. */
static float group_scale(float amax)
{
    float s = amax / 127.0f;
    return 127.0f * s < amax ? nextafterf(s, INFINITY) : s;
}

/* Bounds of rows [r0, r1) of KV head kh, scale group by scale group.  A
 * group of up to CHUNK channels takes one pass over the rows; a wider one
 * a pass for its scale, then one per CHUNK channels. */
static void block_bounds(const sa_kv *k, int kh, int r0, int r1, int sg, int8_t *mn,
                         int8_t *mx, float *sc)
{
    const int D = k->head_dim;
    float lo[CHUNK], hi[CHUNK];
    for (int g = 0, i0 = 0; i0 < D; g++, i0 += sg) {
        float amax = 0.0f;
        for (int c0 = i0; c0 < i0 + sg; c0 += CHUNK) {
            const int c1 = sa_min(c0 + CHUNK, i0 + sg);
            channel_range(k, kh, r0, r1, c0, c1, lo, hi);
            for (int i = 0; i < c1 - c0; i++) {
                amax = fabsf(lo[i]) > amax ? fabsf(lo[i]) : amax;
                amax = fabsf(hi[i]) > amax ? fabsf(hi[i]) : amax;
            }
        }
        const float s = group_scale(amax);
        sc[g] = s;
        for (int c0 = i0; c0 < i0 + sg; c0 += CHUNK) {
            const int c1 = sa_min(c0 + CHUNK, i0 + sg);
            if (sg > CHUNK)     /* the ranges of this chunk again */
                channel_range(k, kh, r0, r1, c0, c1, lo, hi);
            quantise_range(lo, hi, c1 - c0, s, mn + c0, mx + c0);
        }
    }
}

int sa_check_bounds_update(const sa_kv *k, int from_row, int to_row, const sa_bounds *b)
{
    int rc = sa_check_kv(k);
    if (rc)
        return rc;
    if (!b || !b->mn || !b->mx || !b->scales)
        return SA_ERR_NULL;
    if (b->n_kv_heads != k->n_kv_heads || b->head_dim != k->head_dim || b->block_size < 1 ||
        b->head_stride < 0)
        return SA_ERR_SHAPE;
    if (b->scale_group < 1 || k->head_dim % b->scale_group)
        return SA_ERR_GROUP;
    if (from_row < 0 || from_row > to_row || to_row > k->n_rows ||
        sa_ceil_div(to_row, b->block_size) > b->head_stride)
        return SA_ERR_SEQ_LEN;
    return SA_OK;
}

void sa_bounds_compute(const sa_kv *k, int from_row, int to_row, sa_bounds *b)
{
    const int D = k->head_dim, sg = b->scale_group, ng = D / sg, bs = b->block_size;
    for (int kh = 0; kh < k->n_kv_heads; kh++)
        for (int blk = from_row / bs; blk < sa_ceil_div(to_row, bs); blk++) {
            const ptrdiff_t at = (ptrdiff_t)kh * b->head_stride + blk;
            block_bounds(k, kh, sa_block_start(blk, bs), sa_block_end(blk, bs, to_row), sg,
                         b->mn + at * D, b->mx + at * D, b->scales + at * ng);
        }
    b->k_rows = to_row;
}

int sa_bounds_update(const sa_kv *k, int from_row, int to_row, sa_bounds *b)
{
    const int rc = sa_check_bounds_update(k, from_row, to_row, b);
    if (rc)
        return rc;
    sa_bounds_compute(k, from_row, to_row, b);
    return SA_OK;
}

int sa_check_bounds(const sa_bounds *b, const sa_kv *k, int seq_len, int block_size)
{
    if (!b || !b->mn || !b->mx || !b->scales)
        return SA_ERR_BOUNDS;
    if (b->n_kv_heads != k->n_kv_heads || b->head_dim != k->head_dim ||
        b->block_size != block_size || b->k_rows != seq_len ||
        b->head_stride < sa_ceil_div(seq_len, block_size) || b->scale_group < 1 ||
        b->head_dim % b->scale_group)
        return SA_ERR_BOUNDS;
    return SA_OK;
}

void sa_minmax_group(const sa_kernels *kern, sa_scratch *s, const sa_bounds *b, int kh,
                     const float *qf, int shared)
{
    const int G = s->G, D = s->D, NB = s->NB, ng = D / b->scale_group;
    const ptrdiff_t at = (ptrdiff_t)kh * b->head_stride;
    /* Split each query row by sign; for a shared selection sum the heads'
     * parts (in head order), so one pass scores the group. */
    const int rows = shared ? 1 : G;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < D; i++) {
            const float x = qf[(ptrdiff_t)r * D + i];
            s->qpos[(ptrdiff_t)r * D + i] = x > 0.0f ? x : 0.0f;
            s->qneg[(ptrdiff_t)r * D + i] = x < 0.0f ? x : 0.0f;
        }
    for (int g = 1; shared && g < G; g++)
        for (int i = 0; i < D; i++) {
            const float x = qf[(ptrdiff_t)g * D + i];
            s->qpos[i] += x > 0.0f ? x : 0.0f;
            s->qneg[i] += x < 0.0f ? x : 0.0f;
        }
    for (int g = 0; g < rows; g++)
        s->sp[g] = s->probe + (ptrdiff_t)g * NB;
    kern->minmax_scores(s->qpos, s->qneg, rows, D, b->scale_group, b->mn + at * D,
                        b->mx + at * D, b->scales + at * ng, D, NB, s->sp);
    if (shared)
        memset(s->probe + NB, 0, (size_t)(G - 1) * NB * sizeof(float));
}
