/*
 * A ggml backend that runs llama.cpp's attention op (GGML_OP_FLASH_ATTN_EXT)
 * with this project's C core (sa_ggml_flash_attn); everything else stays on
 * llama.cpp's CPU backend.  Built as a shared object by
 * scripts/build-llama-backend.sh against a llama.cpp source tree (its
 * ggml/include and ggml/src/ggml-backend-impl.h, not part of this
 * repository) and loaded at run time: ggml_backend_load(path) (what
 * sparse_attn.integrations.llama_cpp.load() calls in llama-cpp-python's
 * libggml), or GGML_BACKEND_PATH=path for llama.cpp's own tools built with
 * GGML_BACKEND_DL=ON.  docs/design.md, "The ggml backend", says how the
 * scheduler hands it the attention nodes.
 *
 * The device is an ACCEL device on host memory, the way ggml's BLAS backend
 * is: llama.cpp adds every ACCEL device's backend to each new context, ahead
 * of the CPU backend, and the scheduler moves to it each node it supports
 * whose inputs sit in a buffer type it shares with the CPU backend.  It
 * supports what sa_ggml_flash_attn_check accepts (f16 or q8_0 K and V, one
 * head size, no ALiBi, softcap, sinks or n_kv_max), so the nodes it declines
 * run on llama.cpp's CPU backend, and no node is computed differently from
 * what the core's tests check.
 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#endif
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend-impl.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "sparse_attn.h"

#define SA_EXPORT __attribute__((visibility("default")))

_Static_assert((int)SA_GGML_F32 == (int)GGML_TYPE_F32 &&
                   (int)SA_GGML_F16 == (int)GGML_TYPE_F16 &&
                   (int)SA_GGML_Q8_0 == (int)GGML_TYPE_Q8_0,
               "sa_ggml_type's ids are ggml's");

/* Attention nodes computed since the plugin was loaded (the tests check
 * that llama.cpp really handed them over), and of them the ones whose rows
 * had blocks chosen (spec §8: decode steps of a layer not kept dense). */
static atomic_llong calls, sparse_calls;

SA_EXPORT long long sa_ggml_calls(void) { return atomic_load(&calls); }
SA_EXPORT long long sa_ggml_sparse_calls(void) { return atomic_load(&sparse_calls); }

/* ---------------------------------------------------------------- settings */

/* What every attention node runs with (spec §8, "Settings"): read from
 * SPARSE_ATTN_K_BLOCKS, SPARSE_ATTN_POLICY and SPARSE_ATTN_DENSE_LAYERS
 * when the backend is loaded, replaced by sa_ggml_configure; a graph reads
 * them once, so a change applies from the next graph on.  Process-wide:
 * every context of the process shares them. */
static pthread_mutex_t settings_lock = PTHREAD_MUTEX_INITIALIZER;
static sa_ggml_settings settings; /* k_blocks 0: exact */

/* Replace the settings with those the three texts give (NULL or "": the
 * default: exact, the path's default policy, no dense layers).  0, or a
 * status with the reason in why and the settings unchanged. */
SA_EXPORT int sa_ggml_configure(const char *k_blocks, const char *policy,
                                const char *dense_layers, char *why, int why_len)
{
    sa_ggml_settings st;
    const int rc = sa_ggml_settings_parse(k_blocks, policy, dense_layers, &st, why, why_len);
    if (rc == SA_OK) {
        pthread_mutex_lock(&settings_lock);
        settings = st;
        pthread_mutex_unlock(&settings_lock);
    }
    return rc;
}

static sa_ggml_settings current_settings(void)
{
    pthread_mutex_lock(&settings_lock);
    const sa_ggml_settings st = settings;
    pthread_mutex_unlock(&settings_lock);
    return st;
}

/* The settings as text ("k_blocks=32 policy=... dense_layers=..."): the
 * length it needs. */
SA_EXPORT int sa_ggml_settings_text(char *buf, int len)
{
    const sa_ggml_settings st = current_settings();
    return sa_ggml_settings_format(&st, buf, len);
}

static void settings_from_environment(void)
{
    char why[256];
    const char *k = getenv("SPARSE_ATTN_K_BLOCKS"), *p = getenv("SPARSE_ATTN_POLICY");
    const char *d = getenv("SPARSE_ATTN_DENSE_LAYERS");
    if (sa_ggml_configure(k, p, d, why, sizeof why) != SA_OK)
        fprintf(stderr, "sparse_attn: %s (from SPARSE_ATTN_K_BLOCKS / SPARSE_ATTN_POLICY / "
                        "SPARSE_ATTN_DENSE_LAYERS); attention stays exact\n", why);
}

/* The layer of an attention node: llama.cpp names the cache K is a view of
 * "cache_k_l<il>" ("cache_<tag>k_l<il>" for a tagged cache), and the view
 * chain's root is K's view_src.  -1 when the name says nothing. */
static int layer_of(const struct ggml_tensor *node)
{
    const struct ggml_tensor *k = node->src[1];
    const char *name = (k->view_src ? k->view_src : k)->name, *at = NULL;
    if (strncmp(name, "cache_", 6) != 0)
        return -1;
    for (const char *p = strstr(name, "k_l"); p; p = strstr(p + 1, "k_l"))
        at = p + 3;
    if (!at || !*at)
        return -1;
    long il = 0;
    for (; *at; at++) {
        if (*at < '0' || *at > '9' || il > INT_MAX / 10)
            return -1;
        il = il * 10 + (*at - '0');
    }
    return (int)il;
}

/* ------------------------------------------------------------------ a node */

static void describe_tensor(const struct ggml_tensor *t, sa_ggml_tensor *out)
{
    out->type = t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 ||
                        t->type == GGML_TYPE_Q8_0
                    ? (int)t->type
                    : -1; /* refused by the check as SA_ERR_DTYPE */
    out->data = t->data;
    for (int i = 0; i < 4; i++) {
        out->ne[i] = t->ne[i];
        out->nb[i] = t->nb[i] > INT64_MAX ? -1 : (int64_t)t->nb[i];
    }
}

/* The core's description of a FLASH_ATTN_EXT node (see ggml_flash_attn_ext
 * and ggml_flash_attn_ext_set_n_kv_max in ggml.c for its op_params). */
static void describe(const struct ggml_tensor *node, sa_ggml_attn *a, sa_ggml_tensor *mask)
{
    memset(a, 0, sizeof *a);
    describe_tensor(node->src[0], &a->q);
    describe_tensor(node->src[1], &a->k);
    describe_tensor(node->src[2], &a->v);
    describe_tensor(node, &a->out);
    if (node->src[3]) {
        describe_tensor(node->src[3], mask);
        a->mask = mask;
    }
    memcpy(&a->scale, (const float *)node->op_params + 0, sizeof(float));
    memcpy(&a->max_bias, (const float *)node->op_params + 1, sizeof(float));
    memcpy(&a->logit_softcap, (const float *)node->op_params + 2, sizeof(float));
    memcpy(&a->n_kv_max, (const int32_t *)node->op_params + 4, sizeof(int32_t));
    a->has_sinks = node->src[4] != NULL;
}

static int is_layout_op(enum ggml_op op)
{
    return op == GGML_OP_NONE || op == GGML_OP_RESHAPE || op == GGML_OP_VIEW ||
           op == GGML_OP_PERMUTE || op == GGML_OP_TRANSPOSE;
}

/* -------------------------------------------------------------- the backend */

typedef struct {
    int n_threads; /* what llama.cpp set (ggml_backend_set_n_threads), or 0 */
} backend_ctx;

/* The worker count: SPARSE_ATTN_NUM_THREADS if set, else the count
 * llama.cpp gives its own threads, else the CPUs this process may use. */
static int thread_count(const backend_ctx *ctx)
{
    const char *env = getenv("SPARSE_ATTN_NUM_THREADS");
    if (env && *env) {
        char *end;
        errno = 0;
        const long n = strtol(env, &end, 10);
        if (!*end && !errno && n >= 1 && n <= INT_MAX)
            return (int)n;
        static atomic_int warned;
        if (!atomic_exchange(&warned, 1))
            fprintf(stderr, "sparse_attn: SPARSE_ATTN_NUM_THREADS=%s is not a positive "
                            "integer; ignored\n", env);
    }
    if (ctx->n_threads > 0)
        return ctx->n_threads;
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
#endif
    return 1;
}

static const char *backend_name(ggml_backend_t backend)
{
    (void)backend;
    return "sparse_attn";
}

static void backend_free(ggml_backend_t backend)
{
    free(backend->context);
    free(backend);
}

static enum ggml_status backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph *graph)
{
    const backend_ctx *ctx = backend->context;
    const int threads = thread_count(ctx);
    const sa_ggml_settings st = current_settings();
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor *node = ggml_graph_node(graph, i);
        if (is_layout_op(node->op))
            continue;
        if (node->op != GGML_OP_FLASH_ATTN_EXT) {
            fprintf(stderr, "sparse_attn: node %s is a %s, which this backend never claims\n",
                    node->name, ggml_op_name(node->op));
            return GGML_STATUS_FAILED;
        }
        sa_ggml_attn a;
        sa_ggml_tensor mask;
        describe(node, &a, &mask);
        if (st.k_blocks > 0) {
            const int layer = layer_of(node);
            if (layer < 0 && st.n_dense > 0) {
                static atomic_int warned;
                if (!atomic_exchange(&warned, 1))
                    fprintf(stderr, "sparse_attn: %s: K is not a view of a cache named "
                                    "cache_k_l<layer>, so dense layers cannot apply to it; "
                                    "its decode is sparse\n", node->name);
            }
            if (!sa_ggml_settings_exact(&st, layer))
                a.select = &st.select;
        }
        const int rc = sa_ggml_flash_attn(&a, threads);
        if (rc != SA_OK) {
            fprintf(stderr, "sparse_attn: %s: %s (status %d)\n", node->name, sa_strerror(rc),
                    rc);
            return rc == SA_ERR_NOMEM ? GGML_STATUS_ALLOC_FAILED : GGML_STATUS_FAILED;
        }
        atomic_fetch_add(&calls, 1);
        if (sa_ggml_sparse_call(&a))
            atomic_fetch_add(&sparse_calls, 1);
    }
    return GGML_STATUS_SUCCESS;
}

static ggml_guid_t backend_guid(void)
{
    static ggml_guid guid = {0x73, 0x70, 0x61, 0x72, 0x73, 0x65, 0x5f, 0x61,
                             0x74, 0x74, 0x6e, 0x2d, 0x67, 0x67, 0x6d, 0x6c};
    return &guid;
}

static const struct ggml_backend_i backend_iface = {
    .get_name = backend_name,
    .free = backend_free,
    .graph_compute = backend_graph_compute,
};

static void set_n_threads(ggml_backend_t backend, int n_threads)
{
    ((backend_ctx *)backend->context)->n_threads = n_threads;
}

/* --------------------------------------------------------------- the device */

static const char *dev_name(ggml_backend_dev_t dev)
{
    (void)dev;
    return "SPARSE_ATTN";
}

/* Set once, by ggml_backend_init, after the kernels are chosen. */
static char description[128] = "sparse_attn: llama.cpp's attention op on this project's C core";

static const char *dev_description(ggml_backend_dev_t dev)
{
    (void)dev;
    return description;
}

static void dev_memory(ggml_backend_dev_t dev, size_t *free_bytes, size_t *total)
{
    (void)dev;
    *free_bytes = 0; /* it allocates nothing of its own: host buffers only */
    *total = 0;
}

static enum ggml_backend_dev_type dev_type(ggml_backend_dev_t dev)
{
    (void)dev;
    return GGML_BACKEND_DEVICE_TYPE_ACCEL;
}

static void dev_props(ggml_backend_dev_t dev, struct ggml_backend_dev_props *props)
{
    memset(props, 0, sizeof *props);
    props->name = dev_name(dev);
    props->description = dev_description(dev);
    props->type = dev_type(dev);
    dev_memory(dev, &props->memory_free, &props->memory_total);
    props->caps.buffer_from_host_ptr = true;
    props->caps.mmap_support = true;
}

static ggml_backend_t dev_init_backend(ggml_backend_dev_t dev, const char *params)
{
    (void)params;
    ggml_backend_t backend = calloc(1, sizeof *backend);
    backend_ctx *ctx = calloc(1, sizeof *ctx);
    if (!backend || !ctx) {
        free(backend);
        free(ctx);
        return NULL;
    }
    backend->guid = backend_guid();
    backend->iface = backend_iface;
    backend->device = dev;
    backend->context = ctx;
    return backend;
}

/* The CPU backend's buffer type: the scheduler moves a node here only when
 * its inputs are in a buffer type this device and the CPU backend share. */
static ggml_backend_buffer_type_t dev_buffer_type(ggml_backend_dev_t dev)
{
    (void)dev;
    return ggml_backend_cpu_buffer_type();
}

static ggml_backend_buffer_t dev_buffer_from_host_ptr(ggml_backend_dev_t dev, void *ptr,
                                                      size_t size, size_t max_tensor_size)
{
    (void)dev;
    (void)max_tensor_size;
    return ggml_backend_cpu_buffer_from_ptr(ptr, size);
}

static bool dev_supports_op(ggml_backend_dev_t dev, const struct ggml_tensor *op)
{
    (void)dev;
    if (is_layout_op(op->op))
        return true;
    if (op->op != GGML_OP_FLASH_ATTN_EXT)
        return false;
    sa_ggml_attn a;
    sa_ggml_tensor mask;
    describe(op, &a, &mask);
    return sa_ggml_flash_attn_check(&a) == SA_OK;
}

static bool dev_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft)
{
    (void)dev;
    return ggml_backend_buft_is_host(buft);
}

static const struct ggml_backend_device_i dev_iface = {
    .get_name = dev_name,
    .get_description = dev_description,
    .get_memory = dev_memory,
    .get_type = dev_type,
    .get_props = dev_props,
    .init_backend = dev_init_backend,
    .get_buffer_type = dev_buffer_type,
    .buffer_from_host_ptr = dev_buffer_from_host_ptr,
    .supports_op = dev_supports_op,
    .supports_buft = dev_supports_buft,
};

/* ------------------------------------------------------------ the registry */

static const char *reg_name(ggml_backend_reg_t reg)
{
    (void)reg;
    return "sparse_attn";
}

static size_t reg_device_count(ggml_backend_reg_t reg)
{
    (void)reg;
    return 1;
}

static struct ggml_backend_device device;

static ggml_backend_dev_t reg_device(ggml_backend_reg_t reg, size_t index)
{
    (void)reg;
    return index == 0 ? &device : NULL;
}

static void *reg_proc_address(ggml_backend_reg_t reg, const char *name)
{
    (void)reg;
    if (strcmp(name, "ggml_backend_set_n_threads") == 0)
        return (void *)set_n_threads;
    if (strcmp(name, "sa_ggml_calls") == 0)
        return (void *)sa_ggml_calls;
    if (strcmp(name, "sa_ggml_sparse_calls") == 0)
        return (void *)sa_ggml_sparse_calls;
    if (strcmp(name, "sa_ggml_configure") == 0)
        return (void *)sa_ggml_configure;
    if (strcmp(name, "sa_ggml_settings_text") == 0)
        return (void *)sa_ggml_settings_text;
    return NULL;
}

static struct ggml_backend_reg registry = {
    .api_version = GGML_BACKEND_API_VERSION,
    .iface = {.get_name = reg_name, .get_device_count = reg_device_count,
              .get_device = reg_device, .get_proc_address = reg_proc_address},
};

/* The entry point ggml_backend_load() looks up. */
/* SPARSE_ATTN_ISA forces a lower kernel path, as it does for the Python
 * package; one this CPU cannot run is refused and the best one kept. */
static void isa_from_environment(void)
{
    const char *isa = getenv("SPARSE_ATTN_ISA");
    if (isa && *isa) {
        const int rc = sa_set_isa(isa);
        if (rc != SA_OK)
            fprintf(stderr, "sparse_attn: SPARSE_ATTN_ISA=%s: %s; the kernels stay %s\n", isa,
                    sa_strerror(rc), sa_isa_name());
    }
    snprintf(description, sizeof description,
             "sparse_attn (kernels %s): llama.cpp's attention op on this project's C core",
             sa_isa_name());
}

SA_EXPORT ggml_backend_reg_t ggml_backend_init(void)
{
    device = (struct ggml_backend_device){.iface = dev_iface, .reg = &registry};
    isa_from_environment();
    settings_from_environment();
    return &registry;
}
