/*
 * The per-worker scratch arena of decode and prefill: one allocation per
 * worker, carved into the arrays the stages of a call write.  A "group" is
 * one KV head with its G query heads.
 */
#ifndef SA_SCRATCH_H
#define SA_SCRATCH_H

#include "internal.h"

typedef struct sa_scratch {
    int G, D, NB, n_sel, max_tok;
    ptrdiff_t score_stride; /* floats from one head's scores to the next: at
                               least max_tok, an odd number of cache lines,
                               so that many heads' rows do not all fall in
                               the same L1 sets */
    int8_t *qq;        /* G*D   quantised query rows of the group (q8 KV) */
    float *qd;         /* G*ng  their scales */
    float *qsub;       /* G*D   query rows of the heads sharing a run */
    int8_t *qqsub;     /* G*D */
    float *qdsub;      /* G*ng */
    float *probe;      /* G*NB  probe score per head and block */
    float *qpos;       /* G*D   max(q, 0) per head (minmax), or their group sum */
    float *qneg;       /* G*D   min(q, 0) likewise */
    float *probe_tmp;  /* G*probe_tmp_per_head  sampled dots */
    double *score;     /* NB    the probe score (or group sum) being ranked */
    int32_t *top;      /* NB    the ranked picks */
    uint8_t *used;     /* NB */
    int32_t *sel;      /* n_sel */
    uint8_t *chosen;   /* G*NB  chosen[g*NB + b] */
    int32_t *uni;      /* NB    the blocks any head chose, ascending ... */
    int n_uni;         /*       ... this many; -1: walk s->chosen instead */
    float *scores;     /* G*score_stride: scores, then softmax weights */
    float **sp;        /* G pointers handed to kernels */
    const float **pp;  /* G */
    float **op;        /* G */
    float *z;          /* G softmax sums */
    int *off;          /* G tokens scored so far per head */
    int *heads;        /* G heads of the current run */
    int *heads2;       /* G heads of the run after it */
    float *chan_sum;   /* 2D    the group's summed |q| per channel, then the best
                        * r of them as top_channels ranks (channels) */
    int32_t *chan_idx; /* D     the channels scored, ascending */
    float *chan_acc;   /* channel_scores' acc: sa_channel_acc_floats(G, D, channel_rows) */
} sa_scratch;

/* What a call needs per worker: probe_tmp_per_head is
 * sa_probe_tmp_floats() when the call probes, else 0; max_tok the most
 * tokens one head attends to; channel_rows min(block_size, seq_len) when
 * the call scores channels, else 0. */
typedef struct sa_scratch_sizes {
    int G, D, group_size, NB, n_sel, max_tok;
    size_t probe_tmp_per_head;
    int channel_rows;
} sa_scratch_sizes;

/* One arena per worker into *out.  SA_OK, SA_ERR_NOMEM, or SA_ERR_SIZE when
 * the sizes do not fit size_t. */
int sa_scratch_array(int n_workers, const sa_scratch_sizes *z, sa_scratch ***out);
void sa_scratch_array_free(sa_scratch **s, int n_workers);

#endif
