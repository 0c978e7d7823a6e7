/*
 * Where a dense q8 decode step spends its time, kernel by kernel, on one
 * core: the q8 scores of K, the softmax, and the q8 V accumulation of one KV
 * head with G query heads (head_dim 128, q8 group 32), each reported as
 * nanoseconds per token, first with the rows in cache (compute alone), then
 * streamed from a buffer far larger than the last-level cache with the
 * prefetch hints rows.c gives (compute plus memory), beside a plain
 * streaming read of the same bytes (the memory alone).  The kernels are the
 * package's own (csrc/), called the way rows.c calls them: 32 rows a call.
 *
 * If "compute" is well below "stream", a step can run at the memory floor;
 * if it is close to it, the step is bound by the sum of the two unless they
 * overlap perfectly, and only cheaper arithmetic helps (docs/design.md,
 * "Where a selection's time goes", says what it showed).
 *
 * Build from the repository root with the core and the kernel files of the
 * target (csrc/isa_list.h lists them), e.g. on x86-64:
 *
 *   cc -DNDEBUG -O3 -fwrapv -fPIC -std=gnu11 -fvisibility=hidden \
 *      -ffp-contract=off -pthread -Icsrc csrc/?*.c \
 *      csrc/portable/kernels_portable.c csrc/x86/kernels_avx2.c \
 *      csrc/x86/kernels_avx512_vnni.c csrc/x86/kernels_avx512_amx.c \
 *      bench/kernel_costs.c -o kernel_costs -lm
 *
 * and on aarch64 the same with csrc/arm/kernels_neon.c and
 * csrc/arm/kernels_neon_dotprod.c instead of the two x86 files.  Those are
 * the flags the extension gets from Debian's Python 3.11 (setuptools'
 * CFLAGS and CCSHARED, then csrc/build_ffi.py's; bench/arm_model.py builds
 * its driver the same way): without -fwrapv -fPIC the AVX2 decode step
 * read 1.01-1.06x the time on a Zen 4, so time with them.  Run:
 *
 *   ./kernel_costs [isa] [G] [buffer_MB]     (defaults: the CPU's best, 2, 1024)
 */
#define _DEFAULT_SOURCE /* clock_gettime, posix_memalign, madvise under -std=gnu11 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "bench_clock.h"
#include "kernels.h"
#include "sparse_attn.h"

enum { D = 128, GS = 32, NG = D / GS, CALL = 32, MAX_G = 8 };

typedef struct {
    const sa_kernels *kern;
    int G, n;
    const int8_t *k, *v;
    const float *kd, *vd;
    int8_t qq[MAX_G * D];
    float qd[MAX_G * NG];
    float *s[MAX_G], *out[MAX_G];
} step;

/* n bytes on transparent huge pages where the kernel grants them, as a
 * KVCache's arena asks (sparse_attn/_storage.py): with 4 KiB pages the
 * streamed rows pay a TLB miss per page that the product's KV does not. */
static void *huge_alloc(size_t n)
{
    const size_t huge = (size_t)2 << 20, len = (n + huge - 1) / huge * huge;
    void *p = NULL;
    if (posix_memalign(&p, huge, len))
        return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, len, MADV_HUGEPAGE);
#endif
    return p;
}

/* The prefetch hint rows.c gives a call of CALL rows at row c: the next
 * CALL rows and their scales. */
static const sa_prefetch *hint(sa_prefetch *pf, const int8_t *x, const float *xd, int c, int n)
{
    memset(pf, 0, sizeof *pf);
    if (c + 2 * CALL > n)
        return NULL;
    pf->at[0] = (const char *)(x + (size_t)(c + CALL) * D);
    pf->len[0] = (size_t)CALL * D;
    pf->at[1] = (const char *)(xd + (size_t)(c + CALL) * NG);
    pf->len[1] = (size_t)CALL * NG * sizeof(float);
    return pf;
}

static double time_scores(step *st)
{
    sa_prefetch pf;
    const double t0 = bench_now();
    for (int c = 0; c < st->n; c += CALL) {
        float *s[MAX_G];
        for (int g = 0; g < st->G; g++)
            s[g] = st->s[g] + c;
        st->kern->scores_q8(st->qq, st->qd, st->G, D, GS, st->k + (size_t)c * D,
                            st->kd + (size_t)c * NG, D, NG, CALL, s,
                            hint(&pf, st->k, st->kd, c, st->n));
    }
    return bench_now() - t0;
}

static double time_softmax(step *st)
{
    const double t0 = bench_now();
    for (int g = 0; g < st->G; g++)
        st->kern->softmax_exp(st->s[g], st->n, 0.088f, NULL);
    return bench_now() - t0;
}

static double time_v(step *st)
{
    sa_prefetch pf;
    const double t0 = bench_now();
    for (int c = 0; c < st->n; c += CALL) {
        const float *p[MAX_G];
        for (int g = 0; g < st->G; g++)
            p[g] = st->s[g] + c;
        st->kern->accumulate_v_q8(st->out, p, st->G, D, GS, st->v + (size_t)c * D,
                                  st->vd + (size_t)c * NG, D, NG, CALL,
                                  hint(&pf, st->v, st->vd, c, st->n));
    }
    return bench_now() - t0;
}

/* Best of `reps` per kernel over rows [0, n) of one head, in ns per token;
 * the streaming read of the same bytes (K, V and their scales) likewise. */
static void measure(step *st, int reps, const char *label)
{
    double best[3] = {1e30, 1e30, 1e30};
    for (int r = 0; r < reps; r++) {
        const double t[3] = {time_scores(st), time_softmax(st), time_v(st)};
        for (int i = 0; i < 3; i++)
            best[i] = t[i] < best[i] ? t[i] : best[i];
    }
    const double per = 1e9 / st->n;
    printf("  %-30s scores %6.1f  softmax %5.1f  V %6.1f  total %6.1f ns/token\n", label,
           best[0] * per, best[1] * per, best[2] * per, (best[0] + best[1] + best[2]) * per);
}

int main(int argc, char **argv)
{
    if (argc > 1 && sa_set_isa(argv[1]) != SA_OK) {
        fprintf(stderr, "kernel_costs: ISA %s is not available here\n", argv[1]);
        return 2;
    }
    const int G = argc > 2 ? atoi(argv[2]) : 2;
    const size_t mb = argc > 3 ? (size_t)atol(argv[3]) : 1024;
    if (G < 1 || G > MAX_G || mb < 16 || mb > 65536) {
        fprintf(stderr, "usage: kernel_costs [isa] [G 1..%d] [buffer_MB 16..65536]\n", MAX_G);
        return 2;
    }
    const size_t row_bytes = D + NG * sizeof(float); /* one token of K or V with scales */
    const int big = (int)(mb * 1024 * 1024 / (2 * row_bytes)) / CALL * CALL, small = 512;
    int8_t *k = huge_alloc((size_t)big * D), *v = huge_alloc((size_t)big * D);
    float *kd = huge_alloc((size_t)big * NG * sizeof(float));
    float *vd = huge_alloc((size_t)big * NG * sizeof(float));
    step st = {.kern = sa_active_kernels(), .G = G};
    for (int g = 0; g < G; g++) {
        st.s[g] = malloc((size_t)big * sizeof(float));
        st.out[g] = calloc(D, sizeof(float));
    }
    if (!k || !v || !kd || !vd || !st.s[G - 1] || !st.out[G - 1]) {
        fprintf(stderr, "kernel_costs: out of memory\n");
        return 1;
    }
    uint32_t x = 12345;
    for (size_t i = 0; i < (size_t)big * D; i++) {
        x = x * 1664525u + 1013904223u;
        k[i] = (int8_t)((x >> 24) % 255 - 127);
        v[i] = (int8_t)((x >> 16) % 255 - 127);
    }
    for (size_t i = 0; i < (size_t)big * NG; i++)
        kd[i] = 0.01f, vd[i] = 0.02f;
    for (int i = 0; i < G * D; i++)
        st.qq[i] = (int8_t)(i % 201 - 100);
    for (int i = 0; i < G * NG; i++)
        st.qd[i] = 0.01f;
    st.k = k, st.v = v, st.kd = kd, st.vd = vd;

    printf("kernel_costs: ISA %s, one thread, G=%d query heads per KV head, head_dim %d, q8 group %d\n",
           sa_isa_name(), G, D, GS);
    st.n = small;
    measure(&st, 2000, "in cache (512 rows)");
    st.n = big;
    char label[64];
    snprintf(label, sizeof label, "streamed (%zu MB of K and V)", mb);
    measure(&st, 3, label);

    /* The memory alone: one streaming read over the same bytes. */
    const size_t words = (size_t)big * D / 8;
    double best = 1e30;
    uint64_t sink = 0;
    for (int r = 0; r < 3; r++) {
        const double t0 = bench_now();
        sink += st.kern->stream_sum((const uint64_t *)k, words);
        sink += st.kern->stream_sum((const uint64_t *)v, words);
        const double t = bench_now() - t0;
        best = t < best ? t : best;
    }
    /* The scales are 1/8 more bytes, read at the same rate. */
    const double ns = best * 1e9 / big * (double)row_bytes / D;
    printf("  %-30s %6.1f ns/token (%.1f GB/s)%s\n", "streaming read, same bytes", ns,
           2.0 * row_bytes / ns, sink == 42 ? " " : "");
    return 0;
}
