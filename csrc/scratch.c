/* The per-worker scratch arena (scratch.h). */
#include <stdlib.h>

#include "scratch.h"

/* One allocation, carved into 64-byte aligned pieces (sa_carve_take);
 * sizes are checked products, so a call with absurd sizes fails with
 * SA_ERR_SIZE instead of wrapping around to a short buffer. */
typedef sa_carve layout;

static size_t take(layout *l, size_t count, size_t elem)
{
    return sa_carve_take(l, count, 1, elem);
}

static size_t times(layout *l, size_t a, size_t b)
{
    size_t r;
    if (__builtin_mul_overflow(a, b, &r)) {
        l->overflow = 1;
        return 0;
    }
    return r;
}

static int scratch_new(const sa_scratch_sizes *z, sa_scratch **out)
{
    const size_t g = (size_t)z->G, d = (size_t)z->D, nb = (size_t)z->NB;
    const size_t ng = (size_t)(z->D / z->group_size);
    layout l = {sizeof(sa_scratch), 0};
    const size_t gd = times(&l, g, d), gng = times(&l, g, ng), gnb = times(&l, g, nb);
    size_t o_qq = take(&l, gd, 1), o_qd = take(&l, gng, sizeof(float));
    size_t o_qsub = take(&l, gd, sizeof(float)), o_qqsub = take(&l, gd, 1);
    size_t o_qdsub = take(&l, gng, sizeof(float));
    size_t o_probe = take(&l, gnb, sizeof(float));
    size_t o_qpos = take(&l, gd, sizeof(float)), o_qneg = take(&l, gd, sizeof(float));
    size_t o_ptmp = take(&l, times(&l, g, z->probe_tmp_per_head), sizeof(float));
    size_t o_score = take(&l, nb, sizeof(double)), o_top = take(&l, nb, sizeof(int32_t));
    size_t o_used = take(&l, nb, 1), o_sel = take(&l, (size_t)z->n_sel, sizeof(int32_t));
    size_t o_chosen = take(&l, gnb, 1), o_uni = take(&l, nb, sizeof(int32_t));
    size_t lines = ((size_t)z->max_tok + 15) / 16;
    lines += !(lines & 1);
    const size_t stride = lines * 16;
    size_t o_scores = take(&l, times(&l, g, stride), sizeof(float));
    size_t o_sp = take(&l, g, sizeof(float *)), o_pp = take(&l, g, sizeof(float *));
    size_t o_op = take(&l, g, sizeof(float *)), o_z = take(&l, g, sizeof(float));
    size_t o_off = take(&l, g, sizeof(int)), o_heads = take(&l, g, sizeof(int));
    size_t o_heads2 = take(&l, g, sizeof(int));
    size_t o_csum = take(&l, times(&l, 2, d), sizeof(float)), o_cidx = take(&l, d, sizeof(int32_t));
    /* channel_scores' acc (kernels.h, sa_channel_acc_floats) for r <= D */
    const size_t cacc = z->channel_rows > 0
        ? times(&l, g, (size_t)z->channel_rows + times(&l, d, SA_CHANNEL_TILE)) + 2 * d + 2
        : 0;
    size_t o_cacc = take(&l, cacc, sizeof(float));
    const size_t total = take(&l, 0, 1);
    if (l.overflow)
        return SA_ERR_SIZE;
    char *base = aligned_alloc(64, total);
    if (!base)
        return SA_ERR_NOMEM;
    sa_scratch *s = (sa_scratch *)base;
    *s = (sa_scratch){
        .G = z->G, .D = z->D, .NB = z->NB, .n_sel = z->n_sel, .max_tok = z->max_tok,
        .score_stride = (ptrdiff_t)stride,
        .qq = (int8_t *)(base + o_qq), .qd = (float *)(base + o_qd),
        .qsub = (float *)(base + o_qsub), .qqsub = (int8_t *)(base + o_qqsub),
        .qdsub = (float *)(base + o_qdsub), .probe = (float *)(base + o_probe),
        .qpos = (float *)(base + o_qpos), .qneg = (float *)(base + o_qneg),
        .probe_tmp = (float *)(base + o_ptmp), .score = (double *)(base + o_score),
        .top = (int32_t *)(base + o_top), .used = (uint8_t *)(base + o_used),
        .sel = (int32_t *)(base + o_sel), .chosen = (uint8_t *)(base + o_chosen),
        .uni = (int32_t *)(base + o_uni), .n_uni = -1,
        .scores = (float *)(base + o_scores),
        .sp = (float **)(base + o_sp), .pp = (const float **)(base + o_pp),
        .op = (float **)(base + o_op), .z = (float *)(base + o_z),
        .off = (int *)(base + o_off), .heads = (int *)(base + o_heads),
        .heads2 = (int *)(base + o_heads2), .chan_sum = (float *)(base + o_csum),
        .chan_idx = (int32_t *)(base + o_cidx), .chan_acc = (float *)(base + o_cacc),
    };
    *out = s;
    return SA_OK;
}

int sa_scratch_array(int n_workers, const sa_scratch_sizes *z, sa_scratch ***out)
{
    sa_scratch **arr = calloc((size_t)n_workers, sizeof *arr);
    if (!arr)
        return SA_ERR_NOMEM;
    for (int w = 0; w < n_workers; w++) {
        const int rc = scratch_new(z, &arr[w]);
        if (rc) {
            sa_scratch_array_free(arr, n_workers);
            return rc;
        }
    }
    *out = arr;
    return SA_OK;
}

void sa_scratch_array_free(sa_scratch **s, int n_workers)
{
    if (!s)
        return;
    for (int w = 0; w < n_workers; w++)
        free(s[w]);
    free(s);
}
