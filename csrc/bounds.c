/*
 * Per-block key bounds for scoring="minmax" (SPEC §6, after Quest).
 *
 * Stored compactly, like q8: one scale per channel group and int8 minima and
 * maxima, rounded outwards so that scale * mn <= K <= scale * mx holds for
 * every valid row of the block.  At head_dim 128 and group 32 a block's
 * bounds take 272 bytes, a quarter of what the 8-of-32 probe reads from a q8
 * K block.  Each block is recomputed from its own rows, so appending a token
 * at a time never lets rounding drift accumulate.
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

static float row_value(const sa_kv *k, int kh, int row, int i)
{
    if (k->dtype == SA_DTYPE_F32)
        return sa_kv_f32_row(k, kh, row)[i];
    return sa_kv_scale_row(k, kh, row)[i / k->group_size] * (float)sa_kv_q8_row(k, kh, row)[i];
}

static void block_bounds(const sa_kv *k, int kh, int r0, int r1, const sa_bounds *b,
                         int8_t *mn, int8_t *mx, float *sc, float *lo, float *hi)
{
    const int D = k->head_dim, gs = b->group_size;
    for (int i = 0; i < D; i++) {
        lo[i] = INFINITY;
        hi[i] = -INFINITY;
    }
    for (int t = r0; t < r1; t++)
        for (int i = 0; i < D; i++) {
            const float x = row_value(k, kh, t, i);
            lo[i] = x < lo[i] ? x : lo[i];
            hi[i] = x > hi[i] ? x : hi[i];
        }
    for (int g = 0, i0 = 0; i0 < D; g++, i0 += gs) {
        float amax = 0.0f;
        for (int i = i0; i < i0 + gs; i++) {
            amax = fabsf(lo[i]) > amax ? fabsf(lo[i]) : amax;
            amax = fabsf(hi[i]) > amax ? fabsf(hi[i]) : amax;
        }
        float s = amax / 127.0f;
        if (127.0f * s < amax)      /* so that +-127 steps reach every value */
            s = nextafterf(s, INFINITY);
        sc[g] = s;
        for (int i = i0; i < i0 + gs; i++) {
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
}

int sa_bounds_update(const sa_kv *k, int from_row, int to_row, sa_bounds *b)
{
    int rc = sa_check_kv(k);
    if (rc)
        return rc;
    if (!b || !b->mn || !b->mx || !b->scales)
        return SA_ERR_NULL;
    if (b->n_kv_heads != k->n_kv_heads || b->head_dim != k->head_dim || b->block_size < 1 ||
        b->head_stride < 0)
        return SA_ERR_SHAPE;
    if (b->group_size < 1 || k->head_dim % b->group_size)
        return SA_ERR_GROUP;
    if (from_row < 0 || from_row > to_row || to_row > k->n_rows ||
        sa_ceil_div(to_row, b->block_size) > b->head_stride)
        return SA_ERR_SEQ_LEN;
    const int D = k->head_dim, ng = D / b->group_size, bs = b->block_size;
    float *tmp = malloc(2 * (size_t)D * sizeof(float));
    if (!tmp)
        return SA_ERR_NOMEM;
    for (int kh = 0; kh < k->n_kv_heads; kh++)
        for (int blk = from_row / bs; blk < sa_ceil_div(to_row, bs); blk++) {
            const ptrdiff_t at = (ptrdiff_t)kh * b->head_stride + blk;
            block_bounds(k, kh, blk * bs, sa_min(blk * bs + bs, to_row), b, b->mn + at * D,
                         b->mx + at * D, b->scales + at * ng, tmp, tmp + D);
        }
    free(tmp);
    b->n_rows = to_row;
    return SA_OK;
}
