/* Status texts and the argument checks every entry point shares. */
#include <string.h>

#include "internal.h"

const char *sa_strerror(int status)
{
    switch (status) {
    case SA_OK: return "ok";
    case SA_ERR_NULL: return "a required array is missing (NULL pointer)";
    case SA_ERR_SHAPE: return "a dimension is < 1 or shapes are inconsistent";
    case SA_ERR_DTYPE: return "unknown KV dtype, or K and V differ in dtype";
    case SA_ERR_SEQ_LEN: return "seq_len is < 1 or beyond the rows the KV holds";
    case SA_ERR_PARAM: return "a selection parameter is out of range";
    case SA_ERR_GROUP: return "q8 group_size does not divide head_dim";
    case SA_ERR_GQA: return "n_heads is not a multiple of n_kv_heads";
    case SA_ERR_NOMEM: return "out of memory for scratch buffers";
    case SA_ERR_THREAD: return "could not start a worker thread";
    case SA_ERR_ISA: return "unknown ISA name, or one this CPU cannot run";
    case SA_ERR_VALUES: return "input holds NaN, Inf or magnitudes >= 2^48";
    case SA_ERR_IMPORTANCE: return "importance is shorter than seq_len";
    case SA_ERR_SCALE: return "scale must be finite and > 0";
    case SA_ERR_BOUNDS:
        return "minmax bounds are missing or were not computed for this K, seq_len and block_size";
    case SA_ERR_PROBE_ROWS:
        return "probe rows were not copied for this K, seq_len, block_size and n_probe";
    case SA_ERR_IMPORTANCE_VALUES: return "importance holds NaN or Inf";
    case SA_ERR_Q_VALUES: return "q holds NaN, Inf or magnitudes >= 2^48";
    case SA_ERR_K_VALUES: return "the appended K rows hold NaN, Inf or magnitudes >= 2^48";
    case SA_ERR_V_VALUES: return "the appended V rows hold NaN, Inf or magnitudes >= 2^48";
    case SA_ERR_SIZE: return "the sizes need more scratch than size_t can address";
    case SA_ERR_CHANNELS:
        return "the channel copy is missing or was not made for this K, seq_len and block_size";
    case SA_ERR_UNSUPPORTED:
        return "an attention feature sa_ggml_flash_attn does not compute: ALiBi (max_bias), "
               "logit softcap, sinks, n_kv_max, or V's head size differing from K's";
    case SA_ERR_LAYOUT:
        return "a tensor's layout: rows not contiguous, a negative or misaligned stride or "
               "address, or an output that is not contiguous";
    default: return "unknown status";
    }
}

#ifndef SA_BUILD_FLAGS
#define SA_BUILD_FLAGS "(not recorded)"
#endif
#if defined(__x86_64__) || defined(_M_X64)
#define SA_TARGET "x86_64"
#elif defined(__aarch64__)
#define SA_TARGET "aarch64"
#else
#define SA_TARGET "other (portable kernels only)"
#endif

const char *sa_build_info(void)
{
#if defined(__clang__)
    return "clang " __clang_version__ ", target " SA_TARGET ", flags " SA_BUILD_FLAGS;
#elif defined(__GNUC__)
    return "gcc " __VERSION__ ", target " SA_TARGET ", flags " SA_BUILD_FLAGS;
#else
    return "unknown compiler, target " SA_TARGET ", flags " SA_BUILD_FLAGS;
#endif
}

int sa_check_kv(const sa_kv *kv)
{
    if (!kv)
        return SA_ERR_NULL;
    if (kv->n_kv_heads < 1 || kv->head_dim < 1 || kv->n_rows < 0 ||
        kv->head_stride < kv->n_rows || kv->head_stride < 1)
        return SA_ERR_SHAPE;
    if (kv->dtype == SA_DTYPE_F32) {
        if (!kv->f32)
            return SA_ERR_NULL;
    } else if (kv->dtype == SA_DTYPE_Q8) {
        if (!kv->q8 || !kv->scales)
            return SA_ERR_NULL;
        if (kv->group_size < 1 || kv->head_dim % kv->group_size)
            return SA_ERR_GROUP;
    } else {
        return SA_ERR_DTYPE;
    }
    return SA_OK;
}

int sa_check_kv_pair(const sa_kv *k, const sa_kv *v)
{
    int rc = sa_check_kv(k);
    if (rc)
        return rc;
    rc = sa_check_kv(v);
    if (rc)
        return rc;
    if (k->dtype != v->dtype)
        return SA_ERR_DTYPE;
    if (k->n_kv_heads != v->n_kv_heads || k->head_dim != v->head_dim)
        return SA_ERR_SHAPE;
    return SA_OK;
}

int sa_check_query(const float *q, int n_heads, const sa_kv *k, int64_t n_rows_q)
{
    if (!q)
        return SA_ERR_NULL;
    if (n_heads < 1)
        return SA_ERR_SHAPE;
    if (n_heads % k->n_kv_heads)
        return SA_ERR_GQA;
    return sa_values_ok(q, n_rows_q * k->head_dim) ? SA_OK : SA_ERR_Q_VALUES;
}

int sa_check_select_params(const sa_select_params *p)
{
    if (!p)
        return SA_ERR_NULL;
    if (p->block_size < 1 || p->k_blocks < 1 || p->n_probe < 1 || p->importance_blocks < 0 ||
        p->sink_blocks < 0 || p->exact_tail < 0 || (p->recency != 0 && p->recency != 1) ||
        (p->share != SA_SHARE_HEAD && p->share != SA_SHARE_GROUP) ||
        (p->scoring != SA_SCORING_PROBE && p->scoring != SA_SCORING_MINMAX &&
         p->scoring != SA_SCORING_CHANNELS) ||
        (p->scoring == SA_SCORING_CHANNELS && p->n_channels < 1))
        return SA_ERR_PARAM;
    return SA_OK;
}

/* Both scans work on the bits, without a branch per value, so the loops
 * vectorise.  With the sign bit cleared, NaN and Inf are the patterns from
 * 0x7f800000 up, and magnitudes of 2^48 or more those from 0x57800000 up
 * (exponent field 127 + 48). */
int sa_values_ok(const float *x, int64_t n)
{
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        bad |= (u & 0x7fffffffu) >= 0x57800000u;
    }
    return !bad;
}

int sa_all_finite(const float *x, int64_t n)
{
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}
