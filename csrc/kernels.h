/*
 * The per-ISA kernel table.  Every ISA file (portable/, x86/, arm/) defines
 * one sa_kernels with these exact signatures.
 *
 * The rule that makes sparse decode with every block chosen bitwise equal to
 * dense decode: the arithmetic for one (query head, token) pair must not
 * depend on which other heads or tokens share the call.  A kernel may batch
 * heads and tokens to share loads, but never let the batch change the order
 * of the operations that produce one head's score for one token, and V
 * accumulation adds tokens into `out` strictly in token order.
 *
 * Heads are passed as G pointers so a caller can hand any subset of a GQA
 * group to a kernel without copying outputs.
 */
#ifndef SA_KERNELS_H
#define SA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

typedef struct sa_kernels {
    const char *name;

    /* s[g][t] = dot(q[g], k[t * row_stride]) for t < n; q is G x D compact. */
    void (*scores_f32)(const float *q, int G, int D, const float *k,
                       ptrdiff_t row_stride, int n, float *const *s);

    /* The q8 dot of SPEC §4: qq/qd are the G quantised query rows (D int8,
     * D/gs scales each), k/kd the key rows with strides in elements. */
    void (*scores_q8)(const int8_t *qq, const float *qd, int G, int D, int gs,
                      const int8_t *k, const float *kd, ptrdiff_t row_stride,
                      ptrdiff_t scale_stride, int n, float *const *s);

    /* s[t] <- exp(scale * s[t] - scale * max(s)) for t < n; returns the sum. */
    float (*softmax_exp)(float *s, int n, float scale);

    /* out[g][d] += p[g][t] * v[t][d], t ascending. */
    void (*accumulate_v_f32)(float *const *out, const float *const *p, int G, int D,
                             const float *v, ptrdiff_t row_stride, int n);

    /* The same with q8 V, dequantised on the fly: v[t][d] = vd[t][d/gs] * vq[t][d]. */
    void (*accumulate_v_q8)(float *const *out, const float *const *p, int G, int D,
                            int gs, const int8_t *v, const float *vd,
                            ptrdiff_t row_stride, ptrdiff_t scale_stride, int n);

    /* Quest's bound per block (SPEC §6) from the query split by sign:
     * s[g][b] = sum over groups grp of sc[b][grp] * sum over i in grp of
     * (qn[g][i] * mn[b][i] + qp[g][i] * mx[b][i]), for n blocks whose rows
     * are block_stride elements apart (scale rows block_stride / gs apart).
     * With qp = max(q, 0) and qn = min(q, 0) one of the two terms is zero and
     * the other is max(q*mn, q*mx), so this is sum_i max(q_i*mn_i, q_i*mx_i);
     * with qp, qn summed over a GQA group's heads it is the sum of their
     * bounds (share="group") at the cost of one head. */
    void (*minmax_scores)(const float *qp, const float *qn, int G, int D, int gs,
                          const int8_t *mn, const int8_t *mx, const float *sc,
                          ptrdiff_t block_stride, int n, float *const *s);
} sa_kernels;

extern const sa_kernels sa_kernels_portable;
#if defined(__x86_64__) || defined(_M_X64)
extern const sa_kernels sa_kernels_avx2;
extern const sa_kernels sa_kernels_avx512_vnni;
#endif
#if defined(__aarch64__)
extern const sa_kernels sa_kernels_neon;
extern const sa_kernels sa_kernels_neon_dotprod;
#endif

/* The table in use; read once per call so a concurrent sa_set_isa never mixes
 * two ISAs inside one call. */
const sa_kernels *sa_active_kernels(void);

/* Quantise one row (SPEC §4); shared by the cache writer and the query path. */
void sa_quantize_row(const float *x, int dim, int gs, int8_t *q, float *scales);

#endif
