/*
 * AVX-512 VNNI kernels (avx512_vnni.h), prefill's many-heads q8 scores in
 * the form of an int8 GEMM of vpdpbusd.
 */
#define SA_ISA_ID avx512_vnni
#include "avx512_vnni.h"

#define scores_q8_panels_avx512_vnni NULL /* SA_Q8_PANEL_KEYS 0 (kernels.h) */

static void scores_q8_many(const int8_t *qq, const float *qd, int G, int D, int gs,
                           const int8_t *k, const float *kd, ptrdiff_t row_stride,
                           ptrdiff_t scale_stride, int n, float *const *s,
                           const sa_prefetch *pf)
{
    scores_q8_gemm_many(qq, qd, G, D, gs, k, kd, row_stride, scale_stride, n, s, pf);
}

#include "x86_common.h"
