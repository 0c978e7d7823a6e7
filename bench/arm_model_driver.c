/*
 * Driver of bench/arm_model.py: dense q8 decode of one KV head (G query
 * heads, head_dim D, q8 group 32, n tokens), built with the package's own
 * core and kernel files (csrc/) and the package's compile flags, natively
 * (x86-64, for timing) and statically for aarch64 (run under qemu-aarch64
 * with bench/arm_model_plugin.c, which counts and traces the instructions
 * between the marker calls below).
 *
 *   arm_model_driver trace ISA G D N
 *       window 0: one sa_dense_decode (1 thread; after an untraced warm-up
 *                 call), the whole step of one KV head
 *       window 1: one scores_q8 call of 32 rows, as rows.c makes it (rows
 *                 32..63 of a longer run, the next 32 rows' prefetch hint)
 *       window 2: one accumulate_v_q8 call, likewise
 *       window 3: one softmax_exp call over the N scores of one head
 *       window 4: exact q8 prefill's scores of one tile (TILE_ROWS rows x G
 *                 heads = PV query vectors) against CALL keys: the table's
 *                 scores_q8_panels over K in its panels (panels.c), else
 *                 scores_q8 over the rows in place, as prefill calls them
 *       window 5: prefill's V for the same tile: one accumulate_v_f32 call
 *                 of CALL float rows (q8 V dequantised once per worker and
 *                 KV head, prefill.c) for the PV vectors
 *   arm_model_driver time ISA G D N REPS
 *       in-cache timing on this CPU, one thread: the kernel calls of a
 *       dense decode (scores_q8 / softmax_exp / accumulate_v_q8 in 32-row
 *       calls with prefetch hints, as rows.c and attend.c make them) and
 *       sa_dense_decode itself, best of REPS passes each; then prefill's
 *       scores and V kernels over N keys for one tile's PV vectors; prints
 *       one JSON object (ns per token and KV head; prefill: ns per
 *       (vector, key)).
 *   arm_model_driver clock
 *       x86-64 only: the core clock in GHz, from chains of dependent adds
 *       and multiplies of known latency, best of several tries (for a VM
 *       without perf counters).
 *
 * Not part of the package; built by bench/arm_model.py.
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_clock.h"
#include "kernels.h"
#include "sparse_attn.h"

enum { GS = 32, CALL = 32, MAX_G = 16, TILE_ROWS = 32, MAX_PV = TILE_ROWS * MAX_G };

/* The plugin starts a window when the first instruction of sa_model_begin
 * runs and ends it at sa_model_end.  The volatile stores keep the two from
 * being folded into one function (GCC's identical-code folding). */
volatile int sa_model_sink;
__attribute__((noinline)) void sa_model_begin(void) { sa_model_sink = 1; }
__attribute__((noinline)) void sa_model_end(void) { sa_model_sink = 2; }

typedef struct {
    const sa_kernels *kern;
    int G, D, ng, n;
    int8_t *k, *v, *qq;
    float *kd, *vd, *qd, *qf, *out;
    float *s[MAX_G], *o[MAX_G];
    /* prefill: a tile's PV = TILE_ROWS * G query vectors, K in the table's
     * q8 panels (k8p, kdp; NULL without scores_q8_panels), V as float rows */
    int pv;
    int8_t *pqq, *k8p;
    float *pqd, *kdp, *vf;
    float *ps[MAX_PV], *po[MAX_PV];
} shape;

/* rows.c's hint for a call ending at row end of a run of n rows: the next
 * CALL rows of the same tensor and their scales (none past the run). */
static const sa_prefetch *drv_hint(const shape *sh, sa_prefetch *pf, const int8_t *x,
                               const float *xd, int end)
{
    memset(pf, 0, sizeof *pf);
    const int m = sh->n - end < CALL ? sh->n - end : CALL;
    if (m <= 0)
        return NULL;
    pf->at[0] = (const char *)(x + (size_t)end * sh->D);
    pf->len[0] = (size_t)m * sh->D;
    pf->at[1] = (const char *)(xd + (size_t)end * sh->ng);
    pf->len[1] = (size_t)m * sh->ng * sizeof(float);
    return pf;
}

static void drv_scores_call(shape *sh, int c, int m)
{
    sa_prefetch pf;
    float *s[MAX_G];
    for (int g = 0; g < sh->G; g++)
        s[g] = sh->s[g] + c;
    sh->kern->scores_q8(sh->qq, sh->qd, sh->G, sh->D, GS, sh->k + (size_t)c * sh->D,
                        sh->kd + (size_t)c * sh->ng, sh->D, sh->ng, m, s,
                        drv_hint(sh, &pf, sh->k, sh->kd, c + m));
}

static void drv_v_call(shape *sh, int c, int m)
{
    sa_prefetch pf;
    const float *p[MAX_G];
    for (int g = 0; g < sh->G; g++)
        p[g] = sh->s[g] + c;
    sh->kern->accumulate_v_q8(sh->o, p, sh->G, sh->D, GS, sh->v + (size_t)c * sh->D,
                              sh->vd + (size_t)c * sh->ng, sh->D, sh->ng, m,
                              drv_hint(sh, &pf, sh->v, sh->vd, c + m));
}

static void drv_scores_pass(shape *sh)
{
    for (int c = 0; c < sh->n; c += CALL)
        drv_scores_call(sh, c, sh->n - c < CALL ? sh->n - c : CALL);
}

static void drv_softmax_pass(shape *sh)
{
    for (int g = 0; g < sh->G; g++)
        sh->kern->softmax_exp(sh->s[g], sh->n, 0.088f, NULL);
}

static void drv_v_pass(shape *sh)
{
    for (int c = 0; c < sh->n; c += CALL)
        drv_v_call(sh, c, sh->n - c < CALL ? sh->n - c : CALL);
}

static int drv_decode(shape *sh)
{
    const sa_kv k = {.dtype = SA_DTYPE_Q8, .n_kv_heads = 1, .head_stride = sh->n,
                     .n_rows = sh->n, .head_dim = sh->D, .group_size = GS,
                     .q8 = sh->k, .scales = sh->kd};
    sa_kv v = k;
    v.q8 = sh->v;
    v.scales = sh->vd;
    return sa_dense_decode(sh->qf, sh->G, &k, &v, sh->n, 0.088f, sh->out, 1);
}

/* Prefill's operands: the tile's quantised query vectors, K in the q8
 * panels (the layout of kernels.h, filled from the rows: any bytes do, the
 * work does not depend on them), V as float rows, and PV score rows of n. */
static int drv_setup_prefill(shape *sh)
{
    const int D = sh->D, ng = sh->ng, n = sh->n, PV = TILE_ROWS * sh->G;
    const int nt = sh->kern->q8_panel_keys;
    const size_t keys = nt ? ((size_t)n + (size_t)nt - 1) / (size_t)nt * (size_t)nt : 0;
    sh->pv = PV;
    sh->pqq = malloc((size_t)PV * D);
    sh->pqd = malloc((size_t)PV * ng * sizeof(float));
    sh->vf = malloc((size_t)n * D * sizeof(float));
    if (!sh->pqq || !sh->pqd || !sh->vf)
        return -1;
    sh->k8p = NULL, sh->kdp = NULL;
    if (sh->kern->scores_q8_panels) {
        sh->k8p = malloc(keys * (size_t)D);
        sh->kdp = malloc(keys * (size_t)ng * sizeof(float));
        if (!sh->k8p || !sh->kdp)
            return -1;
        for (size_t i = 0; i < keys * (size_t)D; i++)
            sh->k8p[i] = sh->k[i % ((size_t)n * D)];
        for (size_t i = 0; i < keys * (size_t)ng; i++)
            sh->kdp[i] = sh->kd[i % ((size_t)n * ng)];
    }
    for (int i = 0; i < PV * D; i++)
        sh->pqq[i] = (int8_t)(i % 201 - 100);
    for (int i = 0; i < PV * ng; i++)
        sh->pqd[i] = 0.01f;
    for (size_t i = 0; i < (size_t)n * D; i++)
        sh->vf[i] = sh->vd[i / D * ng + i % D / GS] * (float)sh->v[i];
    for (int j = 0; j < PV; j++) {
        sh->ps[j] = malloc((size_t)n * sizeof(float));
        sh->po[j] = calloc((size_t)D, sizeof(float));
        if (!sh->ps[j] || !sh->po[j])
            return -1;
        for (int t = 0; t < n; t++)
            sh->ps[j][t] = 0.001f * (float)((t * 7 + j) % 101);
    }
    return 0;
}

/* Prefill's scores of the tile against keys [c, c + m), as panels.c calls
 * the kernels (one call for the run; scores_q8 in place without panels). */
static void drv_prefill_scores(shape *sh, int c, int m)
{
    const sa_kernels *kern = sh->kern;
    const int D = sh->D, ng = sh->ng;
    float *s[MAX_PV];
    for (int j = 0; j < sh->pv; j++)
        s[j] = sh->ps[j] + c;
    if (sh->k8p) {
        const int nt = kern->q8_panel_keys, p0 = c / nt;
        kern->scores_q8_panels(sh->pqq, sh->pqd, sh->pv, D, GS, sh->k8p + (size_t)p0 * D * nt,
                               sh->kdp + (size_t)p0 * ng * nt, c % nt, m, s);
    } else {
        kern->scores_q8(sh->pqq, sh->pqd, sh->pv, D, GS, sh->k + (size_t)c * D,
                        sh->kd + (size_t)c * ng, D, ng, m, s, NULL);
    }
}

/* Prefill's V for the tile: keys [c, c + m), float rows. */
static void drv_prefill_v(shape *sh, int c, int m)
{
    const float *p[MAX_PV];
    for (int j = 0; j < sh->pv; j++)
        p[j] = sh->ps[j] + c;
    sh->kern->accumulate_v_f32(sh->po, p, sh->pv, sh->D, sh->vf + (size_t)c * sh->D, sh->D, m,
                               NULL);
}

static void drv_prefill_scores_pass(shape *sh)
{
    drv_prefill_scores(sh, 0, sh->n);
}

static void drv_prefill_v_pass(shape *sh)
{
    for (int c = 0; c < sh->n; c += CALL)
        drv_prefill_v(sh, c, sh->n - c < CALL ? sh->n - c : CALL);
}

/* Random int8 rows with scales near what sa_quantize_q8 gives (the kernels'
 * work does not depend on the values). */
static int drv_setup(shape *sh, int G, int D, int n)
{
    sh->kern = sa_active_kernels();
    sh->G = G, sh->D = D, sh->ng = D / GS, sh->n = n;
    const size_t nv = (size_t)n * D, ns = (size_t)n * sh->ng;
    sh->k = malloc(nv), sh->v = malloc(nv), sh->qq = malloc((size_t)G * D);
    sh->kd = malloc(ns * sizeof(float)), sh->vd = malloc(ns * sizeof(float));
    sh->qd = malloc((size_t)G * sh->ng * sizeof(float));
    sh->qf = malloc((size_t)G * D * sizeof(float));
    sh->out = malloc((size_t)G * D * sizeof(float));
    if (!sh->k || !sh->v || !sh->qq || !sh->kd || !sh->vd || !sh->qd || !sh->qf || !sh->out)
        return -1;
    for (int g = 0; g < G; g++) {
        sh->s[g] = malloc((size_t)n * sizeof(float));
        sh->o[g] = calloc((size_t)D, sizeof(float));
        if (!sh->s[g] || !sh->o[g])
            return -1;
    }
    uint32_t x = 12345;
    for (size_t i = 0; i < nv; i++) {
        x = x * 1664525u + 1013904223u;
        sh->k[i] = (int8_t)((x >> 24) % 255 - 127);
        sh->v[i] = (int8_t)((x >> 16) % 255 - 127);
    }
    for (size_t i = 0; i < ns; i++)
        sh->kd[i] = 0.01f + 1e-6f * (float)(i % 97), sh->vd[i] = 0.02f - 1e-6f * (float)(i % 89);
    for (int i = 0; i < G * D; i++) {
        sh->qq[i] = (int8_t)(i % 201 - 100);
        sh->qf[i] = 0.01f * (float)(i % 37 - 18);
    }
    for (int i = 0; i < G * sh->ng; i++)
        sh->qd[i] = 0.01f;
    /* scores of a plausible size for the V pass (softmax_exp makes them
     * weights in (0, 1]) */
    for (int g = 0; g < G; g++)
        for (int t = 0; t < n; t++)
            sh->s[g][t] = 0.001f * (float)((t * 7 + g) % 101);
    return drv_setup_prefill(sh);
}

/* Each window holds one call and nothing else of the driver: the call's
 * arguments (rows.c's, for rows CALL .. 2*CALL of a run of n) are made
 * before the window opens. */
static int drv_trace(shape *sh)
{
    if (sh->n < 3 * CALL) {
        fprintf(stderr, "arm_model_driver: trace needs N >= %d\n", 3 * CALL);
        return 2;
    }
    if (drv_decode(sh) != SA_OK) /* warm-up: scratch allocation, first touch */
        return 1;
    sa_model_begin();
    const int st = drv_decode(sh);
    sa_model_end();
    if (st != SA_OK)
        return 1;
    const sa_kernels *kern = sh->kern;
    const int G = sh->G, D = sh->D, ng = sh->ng, c = CALL;
    sa_prefetch pk, pv;
    const sa_prefetch *hk = drv_hint(sh, &pk, sh->k, sh->kd, c + CALL);
    const sa_prefetch *hv = drv_hint(sh, &pv, sh->v, sh->vd, c + CALL);
    float *s[MAX_G];
    const float *p[MAX_G];
    for (int g = 0; g < G; g++)
        s[g] = sh->s[g] + c, p[g] = sh->s[g] + c;
    drv_scores_call(sh, 0, CALL); /* warm-up of the traced calls' code */
    drv_v_call(sh, 0, CALL);
    sa_model_begin();
    kern->scores_q8(sh->qq, sh->qd, G, D, GS, sh->k + (size_t)c * D, sh->kd + (size_t)c * ng, D,
                    ng, CALL, s, hk);
    sa_model_end();
    sa_model_begin();
    kern->accumulate_v_q8(sh->o, p, G, D, GS, sh->v + (size_t)c * D, sh->vd + (size_t)c * ng, D,
                          ng, CALL, hv);
    sa_model_end();
    for (int t = 0; t < sh->n; t++) /* scores again, not weights */
        sh->s[0][t] = 0.001f * (float)((t * 7) % 101);
    sa_model_begin();
    kern->softmax_exp(sh->s[0], sh->n, 0.088f, NULL);
    sa_model_end();
    drv_prefill_scores(sh, 0, CALL); /* warm-up */
    drv_prefill_v(sh, 0, CALL);
    sa_model_begin();
    drv_prefill_scores(sh, c, CALL);
    sa_model_end();
    sa_model_begin();
    drv_prefill_v(sh, c, CALL);
    sa_model_end();
    printf("{\"isa\": \"%s\", \"G\": %d, \"D\": %d, \"n\": %d, \"prefill_vectors\": %d, "
           "\"prefill_keys\": %d, \"q8_panels\": %d}\n", sa_isa_name(), G, D, sh->n, sh->pv, CALL,
           sh->k8p != NULL);
    return 0;
}

static double drv_best_of(shape *sh, void (*pass)(shape *), int reps)
{
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t0 = bench_now();
        pass(sh);
        const double t = bench_now() - t0;
        best = t < best ? t : best;
    }
    return best;
}

static void drv_decode_pass(shape *sh)
{
    if (drv_decode(sh) != SA_OK)
        abort();
}

/* The V pass needs weights, not raw scores: time softmax first (it turns
 * s into weights in place, and a second softmax of weights is the same
 * work). */
static int drv_time(shape *sh, int reps)
{
    drv_scores_pass(sh);
    drv_softmax_pass(sh);
    drv_v_pass(sh);
    drv_decode_pass(sh);
    const double ts = drv_best_of(sh, drv_scores_pass, reps);
    /* rescore before each softmax pass so the input is scores every time */
    double tx = 1e30;
    for (int r = 0; r < reps; r++) {
        drv_scores_pass(sh);
        const double t0 = bench_now();
        drv_softmax_pass(sh);
        const double t = bench_now() - t0;
        tx = t < tx ? t : tx;
    }
    const double tv = drv_best_of(sh, drv_v_pass, reps);
    const double td = drv_best_of(sh, drv_decode_pass, reps);
    const double per = 1e9 / sh->n;
    /* prefill: a tile's scores over all n keys in one call, V in CALL-key
     * calls, per (vector, key) */
    const int preps = reps / 8 > 2 ? reps / 8 : 2;
    drv_prefill_scores_pass(sh);
    drv_prefill_v_pass(sh);
    const double tps = drv_best_of(sh, drv_prefill_scores_pass, preps);
    const double tpv = drv_best_of(sh, drv_prefill_v_pass, preps);
    const double pper = 1e9 / ((double)sh->n * sh->pv);
    printf("{\"isa\": \"%s\", \"G\": %d, \"D\": %d, \"n\": %d, \"reps\": %d, "
           "\"scores_ns\": %.4f, \"softmax_ns\": %.4f, \"v_ns\": %.4f, \"decode_ns\": %.4f, "
           "\"prefill_vectors\": %d, \"prefill_scores_ns\": %.5f, \"prefill_v_ns\": %.5f}\n",
           sa_isa_name(), sh->G, sh->D, sh->n, reps, ts * per, tx * per, tv * per, td * per,
           sh->pv, tps * pper, tpv * pper);
    return 0;
}

/* The clock from two dependent chains of known latency: 16 register adds
 * per loop iteration (1 cycle each; register, not immediate, operands,
 * which recent Intel cores fold at rename) and 8 multiplies (3 cycles each
 * on every x86-64 core of the last decade).  Timed in many short chunks and
 * the fastest kept, as the kernels' best-of passes are: on a shared VM a
 * long interval loses time to other guests and reads low. */
static int drv_clock(void)
{
#if defined(__x86_64__)
    double best_add = 0.0, best_mul = 0.0;
    const long iters = 8000; /* 128k adds, ~45 us at 3 GHz */
    for (int r = 0; r < 400; r++) {
        uint64_t x = 0, one = 1, m = 3;
        double t0 = bench_now();
        for (long i = 0; i < iters; i++)
            __asm__ volatile("add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                             "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                             "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                             "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                             : "+r"(x) : "r"(one));
        double ghz = 16.0 * (double)iters / (bench_now() - t0) / 1e9;
        best_add = ghz > best_add ? ghz : best_add;
        t0 = bench_now();
        for (long i = 0; i < iters; i++)
            __asm__ volatile("imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0\n\t"
                             "imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0\n\t"
                             : "+r"(x) : "r"(m));
        ghz = 3.0 * 8.0 * (double)iters / (bench_now() - t0) / 1e9;
        best_mul = ghz > best_mul ? ghz : best_mul;
    }
    printf("{\"ghz_add\": %.4f, \"ghz_imul\": %.4f}\n", best_add, best_mul);
    return 0;
#else
    fprintf(stderr, "arm_model_driver: clock is x86-64 only\n");
    return 2;
#endif
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "clock"))
        return drv_clock();
    const int is_time = argc >= 2 && !strcmp(argv[1], "time");
    if (argc != (is_time ? 7 : 6) || (!is_time && strcmp(argv[1], "trace"))) {
        fprintf(stderr, "usage: arm_model_driver trace ISA G D N | time ISA G D N REPS | clock\n");
        return 2;
    }
    if (sa_set_isa(argv[2]) != SA_OK) {
        fprintf(stderr, "arm_model_driver: ISA %s is not available here\n", argv[2]);
        return 2;
    }
    const int G = atoi(argv[3]), D = atoi(argv[4]), n = atoi(argv[5]);
    if (G < 1 || G > MAX_G || D < GS || D % GS || n < 1) {
        fprintf(stderr, "arm_model_driver: need 1 <= G <= %d, D a multiple of %d, N >= 1\n",
                MAX_G, GS);
        return 2;
    }
    shape sh;
    if (drv_setup(&sh, G, D, n)) {
        fprintf(stderr, "arm_model_driver: out of memory\n");
        return 1;
    }
    return is_time ? drv_time(&sh, atoi(argv[6]) > 0 ? atoi(argv[6]) : 1) : drv_trace(&sh);
}
