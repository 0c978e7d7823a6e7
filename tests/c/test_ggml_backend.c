/*
 * The ggml backend (csrc/ggml/backend.c, loaded as llama.cpp loads it)
 * against llama.cpp's own CPU backend, on ggml graphs of one
 * ggml_flash_attn_ext node laid out as llama.cpp lays them out: K and V
 * permuted views of a cache whose row per cell holds every KV head, a
 * permuted Q, an f16 mask of several sequences with freed cells and unused
 * cells (which hold NaN here: neither backend may read them), padded query
 * rows, two streams, f16 and q8_0 K/V, GQA, decode (n_q = 1) and batches.
 *
 *   test_ggml_backend PATH/libsparse_attn_ggml.so
 *
 * Built and run by scripts/test-llama-backend.sh against the pinned
 * llama.cpp's headers and libraries.  Per case it prints the normwise
 * relative error of each backend against a float64 reference over the
 * same K and V values, and fails when
 *  - the backend and llama.cpp's CPU backend differ by more than the
 *    tolerance of the K/V type (below: llama.cpp's CPU rounds the query to
 *    f16 or q8_0 and, for f16 V in decode, adds V into an f16 accumulator;
 *    the backend computes in float32),
 *  - an f16 case's backend result is off the float64 reference by more
 *    than float32 rounding (its inputs are exact in float32),
 *  - a rerun with another thread count changes a bit,
 *  - supports_op accepts a node the core does not compute (ALiBi, softcap,
 *    sinks, n_kv_max, K/V types or head sizes it does not take) or declines
 *    one it does.
 *  - spec §8's settings (sa_ggml_configure) keep a layer named dense, by
 *    the name of its cache (cache_k_l<il>), other than exact, make another
 *    layer's decode exact or leave it uncounted, or a refused text changes
 *    them.
 * Exits 0 only if nothing failed.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

/* Normwise relative error of the backend against llama.cpp's CPU backend.
 * f16: llama.cpp's CPU path for decode and batches under 32 rows rounds the
 * query to f16 and keeps V's weighted sum in f16, rounding it at every
 * cell (2^-11 relative each): measured 2.7e-3 off float64 at 512 cells,
 * 9.2e-3 at 1024, where the backend is 4e-7 off; its tiled path (32 rows
 * or more) sums in float32 and agrees with the backend to 9e-7. */
#define TOL_F16_VS_CPU 2e-2
/* q8_0: both quantise the query to 8 bits per value, llama.cpp with an
 * fp16 scale, the core with a float32 one (spec §4), and sum V in float32:
 * measured at most 4.9e-4 apart (each ~1e-2 off float64, from the query's
 * quantisation). */
#define TOL_Q8_0_VS_CPU 2e-3
/* The backend's f16 result against float64 over the same values: float32
 * rounding (spec §5's float32 tolerance). */
#define TOL_F16_VS_EXACT 1e-5

static int failures;

#define CHECK(cond, ...)                                                                    \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            failures++;                                                                     \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                     \
            printf(__VA_ARGS__);                                                            \
            printf("\n");                                                                   \
        }                                                                                   \
    } while (0)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static double uniform(void) /* [0, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static float normal(void)
{
    const double u = uniform() + 1e-12, v = uniform();
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

typedef struct {
    const char *name;
    enum ggml_type kv;
    int ns, H, Hkv, D, n_q, n_kv, n_seqs;
    int head_masks;           /* a mask plane per query head instead of one */
    int empty_row;            /* query row 0 of stream 0 reads no cell */
} fa_case;

/* One case's tensors, in a context that owns their memory. */
typedef struct {
    struct ggml_context *ctx;
    struct ggml_tensor *q, *k, *v, *mask, *out;
    struct ggml_tensor *kc, *vc;  /* the caches K and V view */
    struct ggml_cgraph *graph;
    float *kf, *vf;           /* the K and V values, float [ns][n_kv][Hkv][D] */
    unsigned char *read;      /* per stream and cell: some row may read it */
} fa_graph;

static void fill_rows(struct ggml_tensor *t, const float *src, int64_t rows, int per_row)
{
    if (t->type == GGML_TYPE_F16)
        ggml_fp32_to_fp16_row(src, t->data, rows * per_row);
    else
        ggml_quantize_chunk(t->type, src, t->data, 0, rows, per_row, NULL);
}

/* The values the cache holds (dequantised), to compute the reference from. */
static void read_back(const struct ggml_tensor *t, float *dst, int64_t rows, int per_row)
{
    const struct ggml_type_traits *tr = ggml_get_type_traits(t->type);
    for (int64_t r = 0; r < rows; r++)
        tr->to_float((const char *)t->data + r * ggml_row_size(t->type, per_row),
                     dst + r * per_row, per_row);
}

/* Sequences per stream as llama.cpp's cache holds them: each used cell
 * belongs to a sequence (or was freed), in order, the tail unused; the
 * batch is the last n_q cells; a row sees its sequence's cells up to its
 * own position.  Padded rows (beyond n_q) see nothing. */
static void build_mask(const fa_case *c, fa_graph *g)
{
    const int n_rows = (int)g->mask->ne[1], planes = (int)g->mask->ne[2];
    ggml_fp16_t *m = g->mask->data;
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    int *seq = malloc(sizeof(int) * c->n_kv), *pos = malloc(sizeof(int) * c->n_kv);
    for (int s = 0; s < c->ns; s++) {
        const int used = c->n_kv - 1 - (int)(uniform() * 200);
        int count[8] = {0};
        for (int cell = 0; cell < c->n_kv; cell++) {
            seq[cell] = cell >= used ? -1 : cell >= used - c->n_q || uniform() > 0.1
                                                ? (int)(uniform() * c->n_seqs) : -1;
            pos[cell] = seq[cell] >= 0 ? count[seq[cell]]++ : 0;
        }
        for (int p = 0; p < planes; p++)
            for (int i = 0; i < n_rows; i++) {
                ggml_fp16_t *row = m + (((int64_t)s * planes + p) * n_rows + i) * c->n_kv;
                const int me = used - c->n_q + i;
                for (int cell = 0; cell < c->n_kv; cell++) {
                    int sees = i < c->n_q && seq[cell] >= 0 && seq[cell] == seq[me] &&
                               pos[cell] <= pos[me];
                    if (planes > 1 && cell != me && uniform() < 0.3)
                        sees = 0; /* per-head planes differ */
                    if (c->empty_row && s == 0 && i == 0)
                        sees = 0;
                    row[cell] = sees ? zero : ninf;
                    if (sees)
                        g->read[(int64_t)s * c->n_kv + cell] = 1;
                }
            }
    }
    free(seq);
    free(pos);
}

static fa_graph build(const fa_case *c, float max_bias, float softcap, int with_sinks,
                      int n_kv_max, enum ggml_type k_type, int dv)
{
    fa_graph g = {0};
    const int64_t kv_rows = (int64_t)c->ns * c->n_kv * c->Hkv;
    const size_t bytes = 64 * 1024 * 1024;
    g.ctx = ggml_init((struct ggml_init_params){.mem_size = bytes, .no_alloc = false});
    /* the cache: [D, Hkv, n_kv, ns], a row per cell holding every KV head */
    struct ggml_tensor *kc = ggml_new_tensor_4d(g.ctx, k_type, c->D, c->Hkv, c->n_kv, c->ns);
    struct ggml_tensor *vc = ggml_new_tensor_4d(g.ctx, c->kv, dv, c->Hkv, c->n_kv, c->ns);
    struct ggml_tensor *qc = ggml_new_tensor_4d(g.ctx, GGML_TYPE_F32, c->D, c->H, c->n_q, c->ns);
    const int q_pad = (c->n_q + 63) / 64 * 64;
    g.mask = ggml_new_tensor_4d(g.ctx, GGML_TYPE_F16, c->n_kv, q_pad,
                                c->head_masks ? c->H : 1, c->ns);
    g.kf = malloc(sizeof(float) * kv_rows * c->D);
    g.vf = malloc(sizeof(float) * kv_rows * dv);
    g.read = calloc((size_t)c->ns * c->n_kv, 1);
    for (int64_t i = 0; i < kv_rows * c->D; i++)
        g.kf[i] = normal();
    for (int64_t i = 0; i < kv_rows * dv; i++)
        g.vf[i] = normal();
    for (int64_t i = 0; i < ggml_nelements(qc); i++)
        ((float *)qc->data)[i] = normal();
    if (k_type == GGML_TYPE_F32)
        memcpy(kc->data, g.kf, sizeof(float) * kv_rows * c->D);
    else
        fill_rows(kc, g.kf, kv_rows, c->D);
    fill_rows(vc, g.vf, kv_rows, dv);
    if (k_type != GGML_TYPE_F32)
        read_back(kc, g.kf, kv_rows, c->D);
    read_back(vc, g.vf, kv_rows, dv);
    build_mask(c, &g);
    g.kc = kc;
    g.vc = vc;
    g.q = ggml_permute(g.ctx, qc, 0, 2, 1, 3);       /* [D, n_q, H, ns] */
    g.k = ggml_permute(g.ctx, kc, 0, 2, 1, 3);       /* [D, n_kv, Hkv, ns] */
    g.v = ggml_permute(g.ctx, vc, 0, 2, 1, 3);
    g.out = ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, g.mask, 1.0f / sqrtf((float)c->D),
                                max_bias, softcap);
    ggml_prec_set_acc(g.out, GGML_PREC_F32); /* as llama.cpp sets it */
    if (with_sinks) {
        struct ggml_tensor *sinks = ggml_new_tensor_1d(g.ctx, GGML_TYPE_F32, c->H);
        memset(sinks->data, 0, ggml_nbytes(sinks));
        ggml_flash_attn_ext_add_sinks(g.out, sinks);
    }
    if (n_kv_max)
        ggml_flash_attn_ext_set_n_kv_max(g.out, n_kv_max);
    g.graph = ggml_new_graph(g.ctx);
    ggml_build_forward_expand(g.graph, g.out);
    return g;
}

/* Fill the cells no query row reads (a cache's unused and freed cells,
 * which hold anything) with `byte`: 0xFF is an f16 NaN and a q8_0 block
 * with a NaN scale; 0x5F a finite f16 (about 487) and a finite block. */
static void fill_unread(const fa_case *c, fa_graph *g, int byte)
{
    for (int s = 0; s < c->ns; s++)
        for (int cell = 0; cell < c->n_kv; cell++)
            if (!g->read[(int64_t)s * c->n_kv + cell]) {
                const struct ggml_tensor *t[2] = {g->kc, g->vc};
                for (int i = 0; i < 2; i++)
                    memset((char *)t[i]->data + cell * t[i]->nb[2] + s * t[i]->nb[3], byte,
                           t[i]->nb[2]);
            }
}

static void release(fa_graph *g)
{
    ggml_free(g->ctx);
    free(g->kf);
    free(g->vf);
    free(g->read);
}

/* out [ns][n_q][H][D] in float64 from the cache's values (the query not
 * rounded), rows that read nothing 0. */
static void reference(const fa_case *c, const fa_graph *g, double *out)
{
    const int G = c->H / c->Hkv, D = c->D, planes = (int)g->mask->ne[2];
    const int n_rows = (int)g->mask->ne[1];
    const double scale = (double)(1.0f / sqrtf((float)D));
    double *p = malloc(sizeof(double) * c->n_kv);
    for (int s = 0; s < c->ns; s++)
        for (int i = 0; i < c->n_q; i++)
            for (int h = 0; h < c->H; h++) {
                const float *q = (const float *)((const char *)g->q->data + i * g->q->nb[1] +
                                                 h * g->q->nb[2] + s * g->q->nb[3]);
                const ggml_fp16_t *m = (const ggml_fp16_t *)g->mask->data +
                                       (((int64_t)s * planes + h % planes) * n_rows + i) * c->n_kv;
                double mx = -INFINITY, sum = 0;
                for (int cell = 0; cell < c->n_kv; cell++) {
                    p[cell] = -INFINITY;
                    if (ggml_fp16_to_fp32(m[cell]) == -INFINITY)
                        continue;
                    const float *k = g->kf + (((int64_t)s * c->n_kv + cell) * c->Hkv + h / G) * D;
                    double dot = 0;
                    for (int d = 0; d < D; d++)
                        dot += (double)q[d] * k[d];
                    p[cell] = dot * scale + ggml_fp16_to_fp32(m[cell]);
                    mx = p[cell] > mx ? p[cell] : mx;
                }
                double *o = out + (((int64_t)s * c->n_q + i) * c->H + h) * D;
                memset(o, 0, sizeof(double) * D);
                for (int cell = 0; cell < c->n_kv; cell++) {
                    if (p[cell] == -INFINITY)
                        continue;
                    const double w = exp(p[cell] - mx);
                    const float *v = g->vf + (((int64_t)s * c->n_kv + cell) * c->Hkv + h / G) * D;
                    sum += w;
                    for (int d = 0; d < D; d++)
                        o[d] += w * v[d];
                }
                for (int d = 0; d < D; d++)
                    o[d] = sum > 0 ? o[d] / sum : 0.0;
            }
    free(p);
}

static double rel_err(const float *got, const float *want_f, const double *want_d, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        const double w = want_d ? want_d[i] : want_f[i];
        const double e = fabs((double)got[i] - w);
        num = e > num || e != e ? e : num;
        den = fabs(w) > den ? fabs(w) : den;
    }
    return num / (den > 0 ? den : 1e-30);
}

static void run_case(const fa_case *c, ggml_backend_t cpu, ggml_backend_t sa)
{
    fa_graph g = build(c, 0.0f, 0.0f, 0, 0, c->kv, c->D);
    const size_t n = (size_t)ggml_nelements(g.out);
    float *want = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
    double *exact = malloc(n * sizeof(double));
    CHECK(ggml_backend_supports_op(sa, g.out), "%s: supports_op declines it", c->name);
    /* llama.cpp's tiled CPU path (batches of 32 rows or more) multiplies
     * masked cells' values by 0, so NaN there would make its result NaN;
     * its own cache holds finite values (cleared when allocated) */
    fill_unread(c, &g, 0x5F);
    CHECK(ggml_backend_graph_compute(cpu, g.graph) == GGML_STATUS_SUCCESS, "%s: CPU", c->name);
    memcpy(want, g.out->data, n * sizeof(float));
    memset(g.out->data, 0xFF, n * sizeof(float));
    fill_unread(c, &g, 0xFF); /* the backend never reads them: NaN changes nothing */
    setenv("SPARSE_ATTN_NUM_THREADS", "2", 1);
    CHECK(ggml_backend_graph_compute(sa, g.graph) == GGML_STATUS_SUCCESS, "%s: backend",
          c->name);
    memcpy(got, g.out->data, n * sizeof(float));
    reference(c, &g, exact);

    const double vs_cpu = rel_err(got, want, NULL, n);
    const double cpu_exact = rel_err(want, NULL, exact, n), sa_exact = rel_err(got, NULL, exact, n);
    const double tol = c->kv == GGML_TYPE_F16 ? TOL_F16_VS_CPU : TOL_Q8_0_VS_CPU;
    printf("%-34s backend vs CPU %.2e   vs float64: backend %.2e, CPU %.2e\n", c->name, vs_cpu,
           sa_exact, cpu_exact);
    CHECK(vs_cpu <= tol, "%s: backend vs CPU %.3g > %.3g", c->name, vs_cpu, tol);
    if (c->kv == GGML_TYPE_F16)
        CHECK(sa_exact <= TOL_F16_VS_EXACT, "%s: backend vs float64 %.3g > %.3g", c->name,
              sa_exact, TOL_F16_VS_EXACT);
    if (c->empty_row)
        for (int h = 0; h < c->H * c->D; h++)
            CHECK(got[h] == 0.0f && want[h] == 0.0f, "%s: a row that reads nothing is not 0",
                  c->name);

    /* other thread counts: the same bits */
    const char *counts[] = {"1", "3"};
    for (int t = 0; t < 2; t++) {
        setenv("SPARSE_ATTN_NUM_THREADS", counts[t], 1);
        ggml_backend_graph_compute(sa, g.graph);
        CHECK(memcmp(got, g.out->data, n * sizeof(float)) == 0,
              "%s: %s threads change the result", c->name, counts[t]);
    }
    unsetenv("SPARSE_ATTN_NUM_THREADS");
    free(want);
    free(got);
    free(exact);
    release(&g);
}

/* Nodes the core does not compute: supports_op must decline them (llama.cpp
 * then runs them on its CPU backend). */
static void check_declined(ggml_backend_t sa)
{
    const fa_case c = {"declined", GGML_TYPE_F16, 1, 4, 2, 64, 3, 256, 1, 0, 0};
    struct {
        const char *what;
        float max_bias, softcap;
        int sinks, n_kv_max;
        enum ggml_type k_type;
        int dv;
    } nodes[] = {
        {"ALiBi (max_bias 8)", 8.0f, 0.0f, 0, 0, GGML_TYPE_F16, 64},
        {"logit softcap 30", 0.0f, 30.0f, 0, 0, GGML_TYPE_F16, 64},
        {"sinks", 0.0f, 0.0f, 1, 0, GGML_TYPE_F16, 64},
        {"n_kv_max 128", 0.0f, 0.0f, 0, 128, GGML_TYPE_F16, 64},
        {"f32 K", 0.0f, 0.0f, 0, 0, GGML_TYPE_F32, 64},
        {"q8_0 K with f16 V", 0.0f, 0.0f, 0, 0, GGML_TYPE_Q8_0, 64},
        {"V head size 32", 0.0f, 0.0f, 0, 0, GGML_TYPE_F16, 32},
    };
    for (size_t i = 0; i < sizeof nodes / sizeof nodes[0]; i++) {
        fa_graph g = build(&c, nodes[i].max_bias, nodes[i].softcap, nodes[i].sinks,
                           nodes[i].n_kv_max, nodes[i].k_type, nodes[i].dv);
        CHECK(!ggml_backend_supports_op(sa, g.out), "supports_op accepts %s", nodes[i].what);
        release(&g);
    }
    fa_graph g = build(&c, 0.0f, 0.0f, 0, 0, GGML_TYPE_F16, 64);
    struct ggml_tensor *other = ggml_add(g.ctx, g.out, g.out);
    CHECK(!ggml_backend_supports_op(sa, other), "supports_op accepts an ADD");
    release(&g);
    printf("%-34s supports_op declines ALiBi, softcap, sinks, n_kv_max, f32 K, mixed K/V, "
           "DV != DK, other ops\n", "declined");
}

/* Spec §8's settings through the registry's proc addresses: the layer of a
 * node is read from the name of the cache K is a view of (cache_k_l<il>),
 * a dense layer stays exact bit for bit, another one's decode chooses
 * blocks (sa_ggml_sparse_calls counts it, and k 2 of 16 blocks changes the
 * result), and a refused text leaves the settings as they were. */
typedef int (*configure_fn)(const char *, const char *, const char *, char *, int);
typedef long long (*count_fn)(void);
typedef int (*text_fn)(char *, int);

static void check_settings(ggml_backend_reg_t reg, ggml_backend_t sa)
{
    configure_fn configure = (configure_fn)ggml_backend_reg_get_proc_address(
        reg, "sa_ggml_configure");
    count_fn sparse_calls = (count_fn)ggml_backend_reg_get_proc_address(
        reg, "sa_ggml_sparse_calls");
    text_fn text = (text_fn)ggml_backend_reg_get_proc_address(reg, "sa_ggml_settings_text");
    CHECK(configure && sparse_calls && text, "the settings' proc addresses are missing");
    if (!configure || !sparse_calls || !text)
        return;
    const fa_case c = {"settings", GGML_TYPE_F16, 1, 9, 3, 64, 1, 512, 1, 0, 0};
    fa_graph g = build(&c, 0.0f, 0.0f, 0, 0, GGML_TYPE_F16, 64);
    const size_t n = (size_t)ggml_nelements(g.out);
    float *exact = malloc(n * sizeof(float));
    char why[256], before[512], after[512];
    CHECK(configure("0", NULL, NULL, why, sizeof why) == 0, "configure exact: %s", why);
    ggml_backend_graph_compute(sa, g.graph);
    memcpy(exact, g.out->data, n * sizeof(float));
    CHECK(configure("2", "recall:n_probe=4", "3+7", why, sizeof why) == 0, "configure: %s", why);
    const struct {
        const char *name;
        int sparse;
    } names[] = {{"cache_k_l3", 0}, {"cache_k_l7", 0}, {"cache_k_l30", 1}, {"cache_k_l4", 1},
                 {"cache_k_l3x", 1}, {"kc", 1}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        ggml_set_name(g.kc, names[i].name);
        const long long calls = sparse_calls();
        CHECK(ggml_backend_graph_compute(sa, g.graph) == GGML_STATUS_SUCCESS, "%s",
              names[i].name);
        CHECK(sparse_calls() - calls == names[i].sparse, "K named %s: %lld sparse calls, not %d",
              names[i].name, sparse_calls() - calls, names[i].sparse);
        const int same = memcmp(exact, g.out->data, n * sizeof(float)) == 0;
        CHECK(same == !names[i].sparse, "K named %s: the result is %s the exact one",
              names[i].name, same ? "bitwise" : "not");
    }
    text(before, sizeof before);
    CHECK(configure("x", NULL, NULL, why, sizeof why) != 0 && strstr(why, "k_blocks"),
          "k_blocks x: accepted, or the reason does not name it (%s)", why);
    CHECK(configure("2", "seed", NULL, why, sizeof why) != 0 &&
              strstr(why, "importance_fraction"), "policy seed: accepted (%s)", why);
    text(after, sizeof after);
    CHECK(strcmp(before, after) == 0, "a refused text changed the settings: %s", after);
    CHECK(strncmp(after, "k_blocks=2 policy=recall:n_probe=4,", 35) == 0 &&
              strstr(after, " dense_layers=3+7"), "settings read back as %s", after);
    configure("0", NULL, NULL, why, sizeof why);
    free(exact);
    release(&g);
    printf("%-34s dense layers by the cache's name, sparse calls counted, refusals\n",
           "settings");
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s PATH/libsparse_attn_ggml.so\n", argv[0]);
        return 2;
    }
    ggml_backend_reg_t reg = ggml_backend_load(argv[1]);
    if (!reg) {
        printf("FAIL: ggml_backend_load(%s)\n", argv[1]);
        return 1;
    }
    ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
    /* the kernels in use, and the ones SA_EXPECT_ISA says (SPARSE_ATTN_ISA's) */
    const char *desc = ggml_backend_dev_description(dev), *expect = getenv("SA_EXPECT_ISA");
    printf("%s\n", desc);
    if (expect && *expect) {
        char want[64];
        snprintf(want, sizeof want, "(kernels %s)", expect);
        CHECK(strstr(desc, want) != NULL, "the backend runs other kernels than %s", expect);
    }
    CHECK(ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_ACCEL,
          "the device is not an ACCEL device");
    CHECK(ggml_backend_dev_supports_buft(dev, ggml_backend_cpu_buffer_type()),
          "the device does not take the CPU buffer type");
    ggml_backend_t sa = ggml_backend_dev_init(dev, NULL);
    ggml_backend_t cpu = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, 2);

    const fa_case cases[] = {
        {"f16 decode, SmolLM2 heads", GGML_TYPE_F16, 1, 9, 3, 64, 1, 512, 1, 0, 0},
        {"f16 batch 64, SmolLM2 heads", GGML_TYPE_F16, 1, 9, 3, 64, 64, 768, 1, 0, 0},
        {"f16 decode, 2 streams, 1024 cells", GGML_TYPE_F16, 2, 8, 2, 128, 1, 1024, 1, 0, 0},
        {"f16 batch 37, 3 sequences, GQA 7", GGML_TYPE_F16, 1, 14, 2, 64, 37, 512, 3, 0, 1},
        {"f16 batch 5, head masks, 2 streams", GGML_TYPE_F16, 2, 6, 3, 64, 5, 512, 2, 1, 0},
        {"q8_0 decode, SmolLM2 heads", GGML_TYPE_Q8_0, 1, 9, 3, 64, 1, 512, 1, 0, 0},
        {"q8_0 batch 64, SmolLM2 heads", GGML_TYPE_Q8_0, 1, 9, 3, 64, 64, 768, 1, 0, 0},
        {"q8_0 decode, 2 streams, 1024 cells", GGML_TYPE_Q8_0, 2, 8, 2, 128, 1, 1024, 1, 0, 0},
        {"q8_0 batch 37, 3 sequences, GQA 7", GGML_TYPE_Q8_0, 1, 14, 2, 64, 37, 512, 3, 0, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i], cpu, sa);
    check_declined(sa);
    check_settings(reg, sa);

    ggml_backend_free(sa);
    ggml_backend_free(cpu);
    printf("%s (%d failed)\n", failures ? "FAILED" : "passed", failures);
    return failures ? 1 : 0;
}
