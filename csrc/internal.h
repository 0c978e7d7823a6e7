/* Helpers shared by the ISA-free parts of the core (not part of the API). */
#ifndef SA_INTERNAL_H
#define SA_INTERNAL_H

#include <math.h>

#include "kernels.h"
#include "sparse_attn.h"

/* Run fn(ctx, item, worker) for item in [0, n_items) on up to n_workers
 * threads.  Items are claimed one at a time; worker 0 is the calling
 * thread.  Returns SA_OK or the first failing status in item order, so the
 * status does not depend on the thread count either. */
typedef int (*sa_item_fn)(void *ctx, int item, int worker);
int sa_parallel_for(int n_items, int n_workers, sa_item_fn fn, void *ctx);

/* The number of workers a call will really use. */
int sa_workers_for(int n_items, int threads);

/* One step of a spin-wait: tells the core this thread is polling. */
static inline void sa_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Checks shared by every entry point (common.c).  sa_check_query returns
 * SA_ERR_Q_VALUES for q with NaN, Inf or magnitudes >= SA_VALUE_LIMIT. */
int sa_check_kv(const sa_kv *kv);
int sa_check_kv_pair(const sa_kv *k, const sa_kv *v);
int sa_check_query(const float *q, int n_heads, const sa_kv *k, int64_t n_rows_q);
int sa_check_select_params(const sa_select_params *p);
/* 1 if every value is finite with magnitude < SA_VALUE_LIMIT, else 0. */
int sa_values_ok(const float *x, int64_t n);
/* 1 if every value is finite, else 0. */
int sa_all_finite(const float *x, int64_t n);

static inline int sa_min(int a, int b) { return a < b ? a : b; }
static inline int sa_max(int a, int b) { return a > b ? a : b; }
/* a >= 0, b > 0; no a + b - 1, which overflows for b near INT_MAX. */
static inline int sa_ceil_div(int a, int b) { return a / b + (a % b != 0); }

/* Rows [start, end) of block b of a context of seq_len rows.  The start of
 * a block that exists is below seq_len; (b + 1) * bs may not fit an int
 * (2^31 - 1 rows in blocks of 2^30), so the end is taken in 64 bits and
 * clipped to seq_len. */
static inline int sa_block_start(int b, int bs) { return (int)((int64_t)b * bs); }
static inline int sa_block_end(int b, int bs, int seq_len)
{
    const int64_t e = ((int64_t)b + 1) * bs;
    return e < seq_len ? (int)e : seq_len;
}

/* roundf(v) (halfway cases away from zero) clamped to [-127, 127], without
 * a libm call or a branch per element (the call and its mispredicted
 * branches dominated a decode step's fixed cost): after the clamp,
 * t = (int)v truncates and v - t is exact (|v| <= 127), so comparing the
 * fraction with +-0.5 rounds exactly as roundf does (checked against roundf
 * for every float of magnitude < 200).  NaN, which every caller rejects
 * before quantising, clamps to -127 rather than reaching an undefined
 * conversion. */
static inline int8_t sa_round_q8(float v)
{
    v = v > -127.0f ? v : -127.0f;
    v = v < 127.0f ? v : 127.0f;
    const int t = (int)v;
    const float f = v - (float)t;
    return (int8_t)(t + (f >= 0.5f) - (f <= -0.5f));
}

/* The id of a q8 group (spec §4) from its scale d = amax / 127: 1 / d, or
 * 0 when that is not finite: d = 0 (an all-zero group), and d below
 * 1 / FLT_MAX (amax below about 3.7e-37), where x * Inf would make the
 * group's zeros 0 * Inf = NaN, which sa_round_q8 clamps to -127. */
static inline float sa_q8_inverse(float d)
{
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    return isfinite(id) ? id : 0.0f;
}

/* Row pointers into a KV tensor. */
static inline const float *sa_kv_f32_row(const sa_kv *kv, int kh, int row)
{
    return kv->f32 + ((ptrdiff_t)kh * kv->head_stride + row) * kv->head_dim;
}
static inline const int8_t *sa_kv_q8_row(const sa_kv *kv, int kh, int row)
{
    return kv->q8 + ((ptrdiff_t)kh * kv->head_stride + row) * kv->head_dim;
}
static inline const float *sa_kv_scale_row(const sa_kv *kv, int kh, int row)
{
    const int ng = kv->head_dim / kv->group_size;
    return kv->scales + ((ptrdiff_t)kh * kv->head_stride + row) * ng;
}

/* One allocation carved into 64-byte aligned pieces (the per-worker
 * scratch arenas): each piece's size is the checked product a * b * elem,
 * so absurd sizes set overflow instead of wrapping to a short buffer.
 * Returns the piece's offset; the arena's size is off once all are taken. */
typedef struct sa_carve {
    size_t off;
    int overflow;
} sa_carve;

static inline size_t sa_carve_take(sa_carve *l, size_t a, size_t b, size_t elem)
{
    size_t n, bytes, at;
    if (__builtin_mul_overflow(a, b, &n) || __builtin_mul_overflow(n, elem, &bytes) ||
        __builtin_add_overflow(l->off, (size_t)63, &at)) {
        l->overflow = 1;
        return 0;
    }
    at &= ~(size_t)63;
    if (__builtin_add_overflow(at, bytes, &l->off))
        l->overflow = 1;
    return at;
}

#endif
