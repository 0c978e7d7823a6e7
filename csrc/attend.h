/*
 * The per-KV-head machinery shared by selection, decode and prefill: one
 * scratch arena per worker, the probe, the block choice, and exact attention
 * over chosen blocks.  A "group" is one KV head with its G query heads.
 */
#ifndef SA_ATTEND_H
#define SA_ATTEND_H

#include "internal.h"

typedef struct sa_scratch {
    int G, D, NB, n_sel, max_tok;
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
    float *scores;     /* G*max_tok: scores, then softmax weights */
    float **sp;        /* G pointers handed to kernels */
    const float **pp;  /* G */
    float **op;        /* G */
    float *z;          /* G softmax sums */
    int *off;          /* G tokens scored so far per head */
    int *heads;        /* G heads of the current run */
    int *heads2;       /* G heads of the run after it */
} sa_scratch;

/* One arena per worker; sizes from the call.  probe_tmp_per_head is
 * sa_probe_tmp_floats() when the call probes, else 0; max_tok the most
 * tokens one head attends to. */
sa_scratch *sa_scratch_new(int G, int D, int group_size, int NB, int n_sel,
                           size_t probe_tmp_per_head, int max_tok);
void sa_scratch_free(sa_scratch *s);
sa_scratch **sa_scratch_array(int n_workers, int G, int D, int group_size, int NB,
                              int n_sel, size_t probe_tmp_per_head, int max_tok);

/* Floats of probe_tmp per head that sa_probe_group needs for a context of
 * seq_len rows: every sampled dot of the full blocks, or the last block's. */
size_t sa_probe_tmp_floats(int seq_len, int block_size, int n_probe);

/* Probe rows (probe_rows.c): rows kept per full block (returned) and the
 * step between them; the K view of the copies of the first `blocks` full
 * blocks; the check that copies serve this call. */
int sa_probe_rows_geometry(int block_size, int n_probe, int *step);
sa_kv sa_probe_rows_view(const sa_probe_rows *p, int blocks);
int sa_check_probe_rows(const sa_probe_rows *p, const sa_kv *k, int seq_len,
                        int block_size, int n_probe);
void sa_scratch_array_free(sa_scratch **s, int n_workers);

/* Quantise the G query rows at q (G x D compact) into s->qq / s->qd. */
void sa_quantize_group(sa_scratch *s, const float *q, int group_size);

/* probe[g*NB + b] for the G heads of KV head kh; the full blocks' samples
 * are read from `rows` (checked copies) when it is not NULL, else from K. */
void sa_probe_group(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, int kh,
                    const float *qf, int seq_len, int block_size, int n_probe,
                    const sa_probe_rows *rows);

/* Quest's bound (SPEC §6) of every block for the G heads of KV head kh,
 * into s->probe like the probe's scores.  With `shared` (share="group")
 * head 0's row holds the group's summed bound, computed in one pass from the
 * heads' summed query signs, and the other rows are zero, so the group sum
 * sa_choose_group forms is that bound. */
void sa_minmax_group(const sa_kernels *kern, sa_scratch *s, const sa_bounds *b, int kh,
                     const float *qf, int shared);
int sa_check_bounds(const sa_bounds *b, const sa_kv *k, int seq_len, int block_size);

/* The importance reserve of SPEC §2.3: the blocks that importance picks
 * after the sinks, best first.  It depends on nothing per head, so a call
 * ranks it once. */
typedef struct {
    int32_t *blocks; /* n of them, malloc'd (NULL when n == 0) */
    int n;
} sa_reserve;

/* Block sums of importance[0, seq_len) and the top
 * min(importance_blocks, n_sel - sinks) of them past the sinks, into *out
 * (free out->blocks).  SA_ERR_NOMEM or SA_OK. */
int sa_importance_reserve(const float *importance, int seq_len, const sa_select_params *p,
                          int n_sel, sa_reserve *out);

/* Fill s->chosen for the G heads of KV head kh (sparse selection), and write
 * each head's ascending block list to blocks[g * n_sel] if blocks != NULL.
 * reserve: the call's importance reserve, or NULL without importance. */
void sa_choose_group(sa_scratch *s, const sa_select_params *sp, const sa_reserve *reserve,
                     int32_t *blocks);

/* Exact attention of the G query rows qf over the chosen blocks of size bs:
 * head g's output row is out + g * out_head_stride (written, not added to).  Leaves the softmax weights of
 * head g in s->scores + g * s->max_tok and the sums in s->z. */
void sa_attend_group(const sa_kernels *kern, sa_scratch *s, const sa_kv *k,
                     const sa_kv *v, int kh, const float *qf, int seq_len, int bs,
                     float scale, float *out, ptrdiff_t out_head_stride);

/* Scores of the `cnt` heads listed in `heads` (indices into the G rows of qf,
 * or of s->qq/s->qd for q8) against n rows of K from `row` on, every `step`
 * rows; head j's scores go to s->sp[j]. */
void sa_score_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, int kh,
                   const float *qf, const int *heads, int cnt, int row, int step, int n);

/* out s->op[j] += sum_t s->pp[j][t] * V[kh, r0 + t] for j < cnt, t < n. */
void sa_accumulate_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *v, int kh,
                        int cnt, int r0, int n);

/* Argument checks shared by select / decode. */
int sa_check_select_params(const sa_select_params *p);
int sa_check_query(const float *q, int n_heads, const sa_kv *k, int64_t n_rows_q);

#endif
