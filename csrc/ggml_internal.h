/*
 * What the two halves of sa_ggml_flash_attn share (not part of the API):
 * ggml_attn.c, the attention over a chunk of cells at a time, and
 * ggml_select.c, the sparse decode's choice of blocks (spec §8) that tells
 * it which cells a decode row reads.
 */
#ifndef SA_GGML_INTERNAL_H
#define SA_GGML_INTERNAL_H

#include <stdatomic.h>
#include <string.h>

#include "internal.h"

/* Cells converted at a time: a chunk's K and V in float32 at D = 128 are
 * 64 KB each, which an L2 holds beside the item's query rows and state
 * (chosen, not yet tuned by measurement).  The probe converts its sampled
 * rows in batches of the same size. */
#define SA_GGML_CHUNK_CELLS 128
/* Q8_0: values per block, bytes per block (an fp16 scale, 32 int8). */
#define SA_GGML_Q8_0_GROUP 32
#define SA_GGML_Q8_0_BYTES 34
/* The fp16 bits of -Inf: a mask cell that is not attended. */
#define SA_GGML_HALF_NEG_INF 0xFC00u
/* Floats between two heads' scores in the scratch: more than a chunk, an
 * odd number of cache lines, so the heads' rows do not share L1 sets. */
#define SA_GGML_SCORE_STRIDE (SA_GGML_CHUNK_CELLS + 16)

static inline const char *sa_ggml_row(const sa_ggml_tensor *t, int64_t i1, int64_t i2,
                                      int64_t i3)
{
    return (const char *)t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

/* The mask row (row, plane of `head`, plane of stream s) of a. */
static inline const uint16_t *sa_ggml_mask_row(const sa_ggml_attn *a, int row, int head, int s)
{
    const sa_ggml_tensor *m = a->mask;
    return (const uint16_t *)sa_ggml_row(m, row, head % m->ne[2], s % m->ne[3]);
}

/* Cell `cell` of KV head kh, stream s of t into scratch row j: F16 to
 * float32 rows f (the table's exact conversion), Q8_0 to int8 rows q and
 * float32 scales d (halves: ng scratch halves on the way). */
static inline void sa_ggml_convert_row(const sa_kernels *kern, const sa_ggml_tensor *t, int q8,
                                       int D, int cell, int kh, int s, uint16_t *halves,
                                       float *f, int8_t *q, float *d, int j)
{
    const char *src = sa_ggml_row(t, cell, kh, s);
    if (!q8) {
        kern->halves_to_floats((const uint16_t *)src, f + (ptrdiff_t)j * D, D);
        return;
    }
    const int ng = D / SA_GGML_Q8_0_GROUP;
    for (int b = 0; b < ng; b++, src += SA_GGML_Q8_0_BYTES) {
        memcpy(&halves[b], src, sizeof halves[b]);
        memcpy(q + (ptrdiff_t)j * D + (ptrdiff_t)b * SA_GGML_Q8_0_GROUP, src + 2,
               SA_GGML_Q8_0_GROUP);
    }
    kern->halves_to_floats(halves, d + (ptrdiff_t)j * ng, ng);
}

/* The G query rows of KV head kh, row `row`, stream s into qf (G x D),
 * quantised into qq / qd as spec §4 quantises a query when q8. */
static inline void sa_ggml_load_group(const sa_ggml_attn *a, int q8, int D, int G, int row,
                                      int kh, int s, float *qf, int8_t *qq, float *qd)
{
    const int ng = D / SA_GGML_Q8_0_GROUP;
    for (int g = 0; g < G; g++) {
        memcpy(qf + (ptrdiff_t)g * D, sa_ggml_row(&a->q, row, (int64_t)kh * G + g, s),
               (size_t)D * sizeof(float));
        if (q8)
            sa_quantize_row(qf + (ptrdiff_t)g * D, D, SA_GGML_Q8_0_GROUP, qq + (ptrdiff_t)g * D,
                            qd + (ptrdiff_t)g * ng);
    }
}

/* Spec §8's choice for the rows of a decode call: which cells each row's
 * heads read.  Rows are numbered s * n_q + i. */
typedef struct sa_ggml_choice {
    int n_rows, n_kv, H, Hkv, G, bs, nb_max;
    int share_group;
    int *n_valid;      /* per row: its valid cells */
    int32_t *cells;    /* per row, n_kv apart: its valid cells, ascending */
    uint8_t *sparse;   /* per row: 1 when it reads the chosen blocks only */
    int cap;           /* entries per (row, KV head) in upos */
    int *n_upos;       /* per (row, kh): positions its group reads */
    int32_t *upos;     /* per (row, kh), cap apart: those positions of the
                        * row's sequence, ascending (cells[upos[x]] ascending) */
    uint8_t *marks;    /* share head: per (row, head), nb_max apart, 1 for
                        * the blocks the head chose (NULL with share group) */
    float *probe;      /* scratch: per (row, kh), G * nb_max probe scores */
    atomic_int *left;  /* scratch: per (row, kh), its probe items not done */
} sa_ggml_choice;

/* Choose the blocks of every sparse row of a (a->select != NULL, a call of
 * at most SA_GGML_DECODE_ROWS rows, one mask plane per group), writing
 * a->blocks if given.  *any = 0 when no row is sparse (the call is then
 * the exact path's, and *out holds nothing to free).  SA_OK, SA_ERR_NOMEM
 * or SA_ERR_SIZE. */
int sa_ggml_choose(const sa_ggml_attn *a, const sa_kernels *kern, int threads,
                   sa_ggml_choice *out, int *any);
void sa_ggml_choice_free(sa_ggml_choice *c);

#endif
