/*
 * The ggml backend's settings (spec §8, "Settings"): the texts of
 * SPARSE_ATTN_K_BLOCKS, SPARSE_ATTN_POLICY and SPARSE_ATTN_DENSE_LAYERS into
 * an sa_ggml_settings.  The backend reads the environment with it when it
 * is loaded, and sa_ggml_configure (what
 * sparse_attn.integrations.llama_cpp.configure calls) hands it the texts
 * the Python layer made, so one parser and one table of presets serve
 * both; the table is sparse_attn/selection.py's POLICIES, which
 * tests/test_ggml_sparse.py compares it with.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

typedef struct {
    const char *name;
    double importance_fraction;
    int sink_blocks, scoring, share, n_probe; /* n_probe 0: "all" */
} preset;

/* selection.py's POLICIES (n_channels is not read here: channel scoring is
 * refused). */
static const preset presets[] = {
    {"seed", 0.5, 0, SA_SCORING_PROBE, SA_SHARE_HEAD, 8},
    {"recall", 0.0, 0, SA_SCORING_PROBE, SA_SHARE_HEAD, 0},
    {"fast", 0.0, 1, SA_SCORING_MINMAX, SA_SHARE_GROUP, 8},
    {"balanced", 0.0, 0, SA_SCORING_CHANNELS, SA_SHARE_GROUP, 8},
};
/* The path's default (selection.py's LLAMA_CPP_POLICY): recall's probe
 * with 8 rows a block and one choice per KV head group. */
static const preset path_default = {"", 0.0, 0, SA_SCORING_PROBE, SA_SHARE_GROUP, 8};

static int fail(char *why, int why_len, int rc, const char *fmt, ...)
{
    if (why && why_len > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, (size_t)why_len, fmt, ap);
        va_end(ap);
    }
    return rc;
}

/* A whole decimal int in [lo, INT_MAX] from s[0, n). */
static int parse_int(const char *s, size_t n, int lo, int *out)
{
    char buf[24];
    if (n == 0 || n >= sizeof buf)
        return 0;
    memcpy(buf, s, n);
    buf[n] = 0;
    char *end;
    errno = 0;
    const long v = strtol(buf, &end, 10);
    if (*end || errno || v < lo || v > INT_MAX || buf[0] == ' ' || buf[0] == '+')
        return 0;
    *out = (int)v;
    return 1;
}

static int is_word(const char *s, size_t n, const char *word)
{
    return strlen(word) == n && strncasecmp(s, word, n) == 0;
}

static int add_layers(const char *text, size_t len, sa_ggml_settings *st, char *why, int why_len)
{
    size_t i = 0;
    while (i < len) {
        size_t j = i;
        while (j < len && text[j] != '+')
            j++;
        int layer;
        if (j > i) {
            if (!parse_int(text + i, j - i, 0, &layer))
                return fail(why, why_len, SA_ERR_PARAM,
                            "dense layers: %.*s is not a layer index (integers >= 0 joined "
                            "by '+')", (int)(j - i), text + i);
            int at = 0;
            while (at < st->n_dense && st->dense[at] < layer)
                at++;
            if (at == st->n_dense || st->dense[at] != layer) {
                if (st->n_dense == SA_GGML_MAX_DENSE)
                    return fail(why, why_len, SA_ERR_PARAM, "dense layers: more than %d",
                                SA_GGML_MAX_DENSE);
                memmove(st->dense + at + 1, st->dense + at,
                        (size_t)(st->n_dense - at) * sizeof(int));
                st->dense[at] = layer;
                st->n_dense++;
            }
        }
        i = j + 1;
    }
    return SA_OK;
}

/* One knob=value of a policy spec into the fields. */
static int knob(const char *key, size_t kn, const char *val, size_t vn, preset *p,
                int *block_size, double *fraction, sa_ggml_settings *st, char *why, int why_len)
{
    int v;
    if (is_word(key, kn, "n_probe")) {
        if (is_word(val, vn, "all"))
            p->n_probe = 0;
        else if (parse_int(val, vn, 1, &v))
            p->n_probe = v;
        else
            return fail(why, why_len, SA_ERR_PARAM,
                        "policy: n_probe=%.*s is not an int >= 1 or 'all'", (int)vn, val);
    } else if (is_word(key, kn, "sink_blocks")) {
        if (!parse_int(val, vn, 0, &p->sink_blocks))
            return fail(why, why_len, SA_ERR_PARAM,
                        "policy: sink_blocks=%.*s is not an int >= 0", (int)vn, val);
    } else if (is_word(key, kn, "block_size")) {
        if (!parse_int(val, vn, 1, block_size))
            return fail(why, why_len, SA_ERR_PARAM,
                        "policy: block_size=%.*s is not an int >= 1", (int)vn, val);
    } else if (is_word(key, kn, "n_channels")) {
        if (!parse_int(val, vn, 1, &v)) /* not read: channel scoring is refused */
            return fail(why, why_len, SA_ERR_PARAM,
                        "policy: n_channels=%.*s is not an int >= 1", (int)vn, val);
    } else if (is_word(key, kn, "share")) {
        if (is_word(val, vn, "head") || is_word(val, vn, "group"))
            p->share = is_word(val, vn, "head") ? SA_SHARE_HEAD : SA_SHARE_GROUP;
        else
            return fail(why, why_len, SA_ERR_PARAM,
                        "policy: share=%.*s is not 'head' or 'group'", (int)vn, val);
    } else if (is_word(key, kn, "scoring")) {
        if (is_word(val, vn, "probe"))
            p->scoring = SA_SCORING_PROBE;
        else if (is_word(val, vn, "minmax"))
            p->scoring = SA_SCORING_MINMAX;
        else if (is_word(val, vn, "channels"))
            p->scoring = SA_SCORING_CHANNELS;
        else
            return fail(why, why_len, SA_ERR_PARAM,
                        "policy: scoring=%.*s is not 'probe', 'minmax' or 'channels'", (int)vn,
                        val);
    } else if (is_word(key, kn, "recency")) {
        if (is_word(val, vn, "1") || is_word(val, vn, "true") || is_word(val, vn, "yes"))
            st->select.recency = 1;
        else if (is_word(val, vn, "0") || is_word(val, vn, "false") || is_word(val, vn, "no"))
            st->select.recency = 0;
        else
            return fail(why, why_len, SA_ERR_PARAM,
                        "policy: recency=%.*s is not 1/0, true/false or yes/no", (int)vn, val);
    } else if (is_word(key, kn, "importance_fraction")) {
        char buf[32];
        char *end;
        if (vn == 0 || vn >= sizeof buf)
            return fail(why, why_len, SA_ERR_PARAM,
                        "policy: importance_fraction=%.*s is not a number", (int)vn, val);
        memcpy(buf, val, vn);
        buf[vn] = 0;
        errno = 0;
        *fraction = strtod(buf, &end);
        if (*end || errno || !(*fraction >= 0.0 && *fraction <= 1.0))
            return fail(why, why_len, SA_ERR_PARAM,
                        "policy: importance_fraction=%s is not a number in [0, 1]", buf);
    } else if (is_word(key, kn, "dense_layers")) {
        return add_layers(val, vn, st, why, why_len);
    } else {
        return fail(why, why_len, SA_ERR_PARAM,
                    "policy: unknown knob '%.*s' (knobs: n_probe, sink_blocks, share, scoring, "
                    "recency, importance_fraction, n_channels, block_size, dense_layers)",
                    (int)kn, key);
    }
    return SA_OK;
}

static int parse_policy(const char *text, sa_ggml_settings *st, char *why, int why_len)
{
    preset p = path_default;
    int block_size = 32;
    double fraction = p.importance_fraction;
    st->select.recency = 1;
    if (text && *text) {
        const char *colon = strchr(text, ':');
        const size_t nn = colon ? (size_t)(colon - text) : strlen(text);
        int found = 0;
        for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
            if (is_word(text, nn, presets[i].name)) {
                p = presets[i];
                found = 1;
            }
        if (!found && !colon)
            return fail(why, why_len, SA_ERR_PARAM,
                        "policy: unknown preset '%s' (presets: seed, recall, fast, balanced; "
                        "or name:knob=value,...)", text);
        if (!found)
            p = presets[0]; /* knobs over seed, as `sparse-attn eval --policies` reads them */
        fraction = p.importance_fraction;
        for (const char *at = colon ? colon + 1 : NULL; at && *at;) {
            const char *end = strchr(at, ',');
            const size_t n = end ? (size_t)(end - at) : strlen(at);
            const char *eq = memchr(at, '=', n);
            if (n && !eq)
                return fail(why, why_len, SA_ERR_PARAM, "policy: '%.*s' is not knob=value",
                            (int)n, at);
            if (n) {
                const int rc = knob(at, (size_t)(eq - at), eq + 1, n - (size_t)(eq + 1 - at),
                                    &p, &block_size, &fraction, st, why, why_len);
                if (rc)
                    return rc;
            }
            at = end ? end + 1 : NULL;
        }
    }
    /* spec §8: what needs state kept beside the cache is refused */
    if (fraction > 0.0)
        return fail(why, why_len, SA_ERR_UNSUPPORTED,
                    "policy: importance_fraction %g needs the importance prefill recorded, "
                    "which the ggml backend does not keep yet: give importance_fraction=0 "
                    "(or use recall)", fraction);
    if (p.scoring != SA_SCORING_PROBE)
        return fail(why, why_len, SA_ERR_UNSUPPORTED,
                    "policy: scoring=%s reads %s kept beside K as it is appended, which the "
                    "ggml backend does not keep yet: give scoring=probe (or use recall)",
                    p.scoring == SA_SCORING_MINMAX ? "minmax" : "channels",
                    p.scoring == SA_SCORING_MINMAX ? "key bounds" : "a channel copy");
    st->select.block_size = block_size;
    st->select.n_probe = p.n_probe ? p.n_probe : block_size;
    st->select.importance_blocks = 0;
    st->select.sink_blocks = p.sink_blocks;
    st->select.share = p.share;
    st->select.scoring = SA_SCORING_PROBE;
    st->select.n_channels = 16;
    return SA_OK;
}

int sa_ggml_settings_parse(const char *k_blocks, const char *policy, const char *dense_layers,
                           sa_ggml_settings *out, char *why, int why_len)
{
    sa_ggml_settings st;
    memset(&st, 0, sizeof st);
    if (why && why_len > 0)
        why[0] = 0;
    if (k_blocks && *k_blocks && !parse_int(k_blocks, strlen(k_blocks), 0, &st.k_blocks))
        return fail(why, why_len, SA_ERR_PARAM,
                    "k_blocks: '%s' is not an int >= 0 (0: exact attention)", k_blocks);
    int rc = parse_policy(policy, &st, why, why_len);
    if (!rc && dense_layers)
        rc = add_layers(dense_layers, strlen(dense_layers), &st, why, why_len);
    if (rc)
        return rc;
    st.select.k_blocks = st.k_blocks > 0 ? st.k_blocks : 1;
    *out = st;
    return SA_OK;
}

int sa_ggml_settings_format(const sa_ggml_settings *s, char *buf, int len)
{
    char layers[SA_GGML_MAX_DENSE * 12 + 1] = "";
    size_t at = 0;
    for (int i = 0; i < s->n_dense; i++)
        at += (size_t)snprintf(layers + at, sizeof layers - at, i ? "+%d" : "%d", s->dense[i]);
    const sa_select_params *p = &s->select;
    return snprintf(buf, len > 0 ? (size_t)len : 0,
                    "k_blocks=%d policy=recall:n_probe=%d,importance_fraction=0,sink_blocks=%d,"
                    "share=%s,scoring=probe,recency=%d,block_size=%d dense_layers=%s",
                    s->k_blocks, p->n_probe, p->sink_blocks,
                    p->share == SA_SHARE_GROUP ? "group" : "head", p->recency, p->block_size,
                    layers);
}

int sa_ggml_settings_exact(const sa_ggml_settings *s, int layer)
{
    if (s->k_blocks <= 0)
        return 1;
    for (int i = 0; i < s->n_dense; i++)
        if (s->dense[i] == layer)
            return 1;
    return 0;
}
