/* K packed in the kernels' panels for prefill's GEMM-form scores
 * (kernels.h: scores_f32_panels, scores_q8_panels): the layout of a call,
 * and one worker's buffer of packed keys. */
#ifndef SA_PANELS_H
#define SA_PANELS_H

#include "scratch.h"

typedef struct sa_panels {
    const sa_kernels *kern; /* the call's table: the panels are laid out for it */
    const sa_kv *k;
    int keys;               /* keys [0, keys) may be read, later ones are zero */
    int nt;                 /* keys per panel; 0: K is read in place */
    int count;              /* panels over [0, keys) */
} sa_panels;

/* One worker's packed keys. */
typedef struct sa_panel_buf {
    char *data;  /* count panels (q8: every panel's bytes, then every one's scales) */
    int *head;   /* [count] the KV head + 1 each panel holds, 0 for none */
} sa_panel_buf;

/* The layout for K's keys [0, keys) under table kern, for a call whose
 * query vectors per KV head repay a worker's copy of a head's keys
 * (`amortized`; else none, and K is read in place by the decode kernels):
 * float32 K always, q8 K where the table has q8 panels and the group size
 * is a multiple of 4 (else scores_q8, the same bits, kernels.h). */
sa_panels sa_panels_layout(const sa_kernels *kern, const sa_kv *k, int keys, int amortized);

/* Bytes of one panel (0 without panels). */
size_t sa_panel_bytes(const sa_panels *pl);

/* Scores of the cnt vectors s->heads[] (indices into the rows of qt, or of
 * s->qq / s->qd for q8) against keys [row, row + n) of KV head kh into
 * s->sp: from buf's panels of kh, packing those not packed yet (buf->head
 * must start zeroed), or with sa_score_rows when the layout has none. */
void sa_panel_scores(const sa_panels *pl, sa_panel_buf *buf, sa_scratch *s, const float *qt,
                     int kh, int cnt, int row, int n);

#endif
