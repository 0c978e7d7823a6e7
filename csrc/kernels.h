/*
 * The per-ISA kernel table.  Every ISA file (portable/, x86/, arm/) defines
 * one sa_kernels with these exact signatures, named sa_kernels_<id> after
 * its line in isa_list.h, with SA_DEFINE_KERNELS(<id>) from functions named
 * <kernel>_<id>.
 *
 * The rule that makes sparse decode with every block chosen bitwise equal to
 * dense decode: the arithmetic for one (query head, token) pair must not
 * depend on which other heads or tokens share the call.  A kernel may batch
 * heads and tokens to share loads, but never let the batch change the order
 * of the operations that produce one head's score for one token, and V
 * accumulation adds tokens into `out` strictly in token order.
 *
 * Kernels prefetch only what they are told: rows.c, which knows which rows
 * are read next (the next stretch of a run, or the first rows of the next
 * chosen run), hands each call an sa_prefetch, and the kernel spreads those
 * lines over its iterations (sa_prefetch_part), so the loads overlap the
 * arithmetic instead of stalling it in one burst.
 *
 * Heads are passed as G pointers so a caller can hand any subset of a GQA
 * group to a kernel without copying outputs.
 */
#ifndef SA_KERNELS_H
#define SA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* channel_scores' scratch: G row sums per row of a block, then the SIMD
 * files' weights q[g][c] * scale(c, b) for r channels, G heads and a tile
 * of SA_CHANNEL_TILE blocks, then r channel offsets (8-byte aligned). */
#define SA_CHANNEL_TILE 8
static inline size_t sa_channel_acc_floats(int G, int r, int rows)
{
    return (size_t)G * ((size_t)rows + (size_t)r * SA_CHANNEL_TILE) + 2 * (size_t)r + 2;
}
static inline ptrdiff_t *sa_channel_offsets(float *weights, int G, int r)
{
    const uintptr_t end = (uintptr_t)(weights + (size_t)G * r * SA_CHANNEL_TILE);
    return (ptrdiff_t *)((end + 7) & ~(uintptr_t)7);
}

/* Byte ranges to bring into L2 during a kernel call: up to two ranges of
 * rows, each with (q8) the range of their scales; len 0 means none. */
typedef struct sa_prefetch {
    const char *at[4];
    size_t len[4];
} sa_prefetch;

/* One line to L2 (the C tests define it to count or record the lines:
 * tests/c/test_walk_lines.c builds every file with SA_TEST_COUNT_PREFETCH). */
#ifdef SA_TEST_COUNT_PREFETCH
void sa_test_line(const void *p);
#define SA_PREFETCH_LINE(p) sa_test_line(p)
#endif
#ifndef SA_PREFETCH_LINE
#define SA_PREFETCH_LINE(p) __builtin_prefetch((p), 0, 2)
#endif

/* Prefetch part i of n of pf's ranges (every line once over i = 0 .. n-1).
 * n is a power of two in a kernel's full calls (two blocks of 16 tokens,
 * eight of 4): there the parts' bounds are shifts, not the two 64-bit
 * divisions per range and iteration that took a few percent of a kernel's
 * time (docs/design.md); the bounds are the same either way. */
static inline void sa_prefetch_part(const sa_prefetch *pf, int i, int n)
{
    if (!pf)
        return;
    const int pow2 = n > 0 && (n & (n - 1)) == 0;
    const int shift = pow2 ? __builtin_ctz((unsigned)n) : 0;
    for (int r = 0; r < 4; r++) {
        if (!pf->len[r])
            continue;
        const uintptr_t base = (uintptr_t)pf->at[r], len = pf->len[r];
        uintptr_t a, z;
        if (pow2) {
            a = base + ((len * (uintptr_t)i) >> shift);
            z = base + ((len * (uintptr_t)(i + 1)) >> shift);
        } else {
            a = base + len * (uintptr_t)i / (uintptr_t)n;
            z = base + len * (uintptr_t)(i + 1) / (uintptr_t)n;
        }
        a = i ? (a + 63) & ~(uintptr_t)63 : a & ~(uintptr_t)63;
        for (; a < z; a += 64)
            SA_PREFETCH_LINE((const void *)a);
    }
}

/* The same lines a few at a time from a kernel's inner loop: a call
 * announces how many steps it will take (sa_pf_walk_start) and each step
 * (sa_pf_walk_step) prefetches its even share of pf's lines.  Where a call
 * streams from DRAM this is what lets its loads overlap the arithmetic: a
 * burst of prefetches holds the L1's fill buffers for a DRAM round trip,
 * and the kernel's own loads (of rows already in L2) queue behind them.
 * Measured on a Xeon (Emerald Rapids), AVX2, one thread, K and V streamed
 * (bench/kernel_costs.c): the q8 V pass of a G = 2 head took 20.5 ns per
 * token with a burst per 16 tokens, 15.7-16.5 with the walk (docs/design.md).
 * A step past the announced count prefetches nothing more than the ranges
 * hold; fewer steps leave lines to the hardware.  The x86 decode kernels
 * walk; the NEON q8 decode kernels walk in bursts (below); the other
 * kernels take sa_prefetch_part per block. */

typedef struct sa_pf_walk {
    const sa_prefetch *pf; /* NULL once every line is issued (or none) */
    const char *a, *z;     /* the current range: its next line, its end */
    int r;                 /* the current range's index */
    /* sa_pf_walk_step: a line each time acc, advanced by lines per step,
     * passes steps; sa_pf_burst_step: lines per step, and acc the steps
     * left that take one more */
    long lines, steps, acc;
} sa_pf_walk;

static inline void sa_pf_walk_start(sa_pf_walk *w, const sa_prefetch *pf, long steps)
{
    *w = (sa_pf_walk){.r = -1, .steps = steps > 0 ? steps : 1};
    if (!pf)
        return;
    for (int r = 0; r < 4; r++)
        if (pf->len[r])
            w->lines += (long)((((uintptr_t)pf->at[r] & 63) + pf->len[r] + 63) / 64);
    if (w->lines)
        w->pf = pf;
}

/* The next line of the walk, if any. */
static inline void sa_pf_walk_line(sa_pf_walk *w)
{
    while (w->a >= w->z) {
        if (++w->r >= 4) {
            w->pf = NULL;
            return;
        }
        w->a = w->z = NULL;
        if (w->pf->len[w->r]) {
            w->a = (const char *)((uintptr_t)w->pf->at[w->r] & ~(uintptr_t)63);
            w->z = w->pf->at[w->r] + w->pf->len[w->r];
        }
    }
    SA_PREFETCH_LINE((const void *)w->a);
    w->a += 64;
}

/* One step of a kernel's loop: the lines whose turn has come.  The kernel
 * copies the walk to a local for the loop (so it stays in registers) and
 * back after it. */
static inline void sa_pf_walk_step(sa_pf_walk *w)
{
    if (!w->pf)
        return;
    for (w->acc += w->lines; w->acc >= w->steps && w->pf; w->acc -= w->steps)
        sa_pf_walk_line(w);
}

/* The walk in bursts, for kernels that step a few times per call (NEON q8
 * decode: per quad of K rows, per chunk of V columns): step i of `steps`
 * takes lines / steps lines, one more while i < lines % steps, and where
 * the current range holds them all they go out at fixed offsets from one
 * address.  The same lines in the same order as sa_pf_walk, as many per
 * step as the per-block sa_prefetch_part these kernels took before (which
 * took a share of every range per step), without its per-range
 * arithmetic: a chain of dependent loads, multiplies and compares per step
 * that an in-order core (the A55) waits out.  By
 * bench/arm_model.py (llvm-mca, cortex-a55, neon-dotprod, G = 2, D = 128)
 * that took the q8 scores from 144 to 128 cycles per token and V from 265
 * to 230 (with no prefetch at all: 111 and 194). */
static inline void sa_pf_burst_start(sa_pf_walk *w, const sa_prefetch *pf, long steps)
{
    sa_pf_walk_start(w, pf, steps);
    if (w->pf) {
        w->acc = w->lines % w->steps; /* the first acc steps take one more */
        w->lines /= w->steps;         /* lines per step */
    }
}

static inline void sa_pf_burst_step(sa_pf_walk *w)
{
    if (!w->pf)
        return;
    long k = w->lines + (w->acc > 0);
    w->acc--;
    for (; k > 0 && w->pf; k--) {
        const uintptr_t a = (uintptr_t)w->a, z = (uintptr_t)w->z;
        if (a < z && z - a > (uintptr_t)(k - 1) * 64) { /* the range holds all k */
            const char *p = w->a;
            for (; k >= 4; k -= 4, p += 256) {
                SA_PREFETCH_LINE((const void *)p);
                SA_PREFETCH_LINE((const void *)(p + 64));
                SA_PREFETCH_LINE((const void *)(p + 128));
                SA_PREFETCH_LINE((const void *)(p + 192));
            }
            for (; k > 0; k--, p += 64)
                SA_PREFETCH_LINE((const void *)p);
            w->a = p;
            return;
        }
        sa_pf_walk_line(w);
    }
}

typedef struct sa_kernels {
    /* s[g][t] = dot(q[g], k[t * row_stride]) for t < n; q is G x D compact.
     * pf (may be NULL): lines to prefetch meanwhile. */
    void (*scores_f32)(const float *q, int G, int D, const float *k,
                       ptrdiff_t row_stride, int n, float *const *s, const sa_prefetch *pf);

    /* The same scores in GEMM form, for prefill's tiles of many query
     * vectors: K packed in panels of panel_keys keys, a panel's D x
     * panel_keys values channel by channel (panel p, channel d, key j at
     * kt[(p * D + d) * panel_keys + j]), the keys of a call from key `first`
     * (< panel_keys) of panel 0 on.  s[g][t] for t < n is the score of key
     * first + t: one multiply-add chain over d = 0 .. D-1 from 0 (the FMA on
     * the SIMD ISAs), whatever the batch.  The panels' other keys may be read
     * but are not stored. */
    void (*scores_f32_panels)(const float *q, int G, int D, const float *kt, int first, int n,
                              float *const *s);
    int panel_keys;

    /* scores_q8 in GEMM form, bitwise scores_q8 (the same group terms in
     * the same order), for gs a multiple of 4.  K packed in panels of
     * q8_panel_keys = NT keys: panel p's bytes k8[p * D * NT ...] hold, per 4
     * channels c4, the NT keys' 4 bytes side by side (channel 4 * c4 + i of
     * key j at k8[(p * D + 4 * c4) * NT + 4 * j + i]); its scales
     * kd[(p * ng + grp) * NT + j].  Keys, `first` and n as in
     * scores_f32_panels.  NULL in a table without it (prefill then scores
     * q8 K with scores_q8). */
    void (*scores_q8_panels)(const int8_t *qq, const float *qd, int G, int D, int gs,
                             const int8_t *k8, const float *kd, int first, int n,
                             float *const *s);
    int q8_panel_keys;

    /* The q8 dot of spec §4: qq/qd are the G quantised query rows (D int8,
     * D/gs scales each), k/kd the key rows with strides in elements. */
    void (*scores_q8)(const int8_t *qq, const float *qd, int G, int D, int gs,
                      const int8_t *k, const float *kd, ptrdiff_t row_stride,
                      ptrdiff_t scale_stride, int n, float *const *s, const sa_prefetch *pf);

    /* s[t] <- exp(scale * (s[t] - max(s))) for t < n; returns the sum (taken
     * in double).  Subtracting before scaling cannot overflow for finite
     * scores and any finite scale, and the maximum maps to exactly 1.  A
     * NaN score makes the sum NaN (never a dropped token), on every ISA.
     * max_out (may be NULL): the maximum subtracted, or NaN if a score is
     * NaN (split-KV decode merges chunks with it). */
    float (*softmax_exp)(float *s, int n, float scale, float *max_out);

    /* out[g][d] += p[g][t] * v[t][d], t ascending. */
    void (*accumulate_v_f32)(float *const *out, const float *const *p, int G, int D,
                             const float *v, ptrdiff_t row_stride, int n,
                             const sa_prefetch *pf);

    /* The same with q8 V (spec §4): per head, token and group the weight
     * p[g][t] * vd[t][grp] (one rounding), then per element that weight
     * times (float)vq[t][d] (exact), added exactly as accumulate_v_f32 adds
     * a float row: bit for bit accumulate_v_f32 of the same ISA over each
     * group's columns of the rows converted to float, with those weights;
     * no element is scaled.  Every table takes this order (q8_v_scaled 0);
     * q8_v_scaled 1 would mean each element first v[t][d] = vd[t][d/gs] *
     * (float)vq[t][d], then accumulate_v_f32 (dequantize_rows followed by
     * accumulate_v_f32, prefill's order). */
    void (*accumulate_v_q8)(float *const *out, const float *const *p, int G, int D,
                            int gs, const int8_t *v, const float *vd,
                            ptrdiff_t row_stride, ptrdiff_t scale_stride, int n,
                            const sa_prefetch *pf);

    /* out[t][i] = scales[t][i / gs] * (float)q[t][i] for n rows of dim
     * values (out compact, n x dim; the inputs row_stride / scale_stride
     * elements apart): one rounding per element, the same bits on every
     * ISA.  Prefill reads each q8 V row for many query rows, so it
     * dequantises the rows once and adds them as float rows (a q8 prefill
     * row's V sums round differently from accumulate_v_q8's, spec §3). */
    void (*dequantize_rows)(const int8_t *q, const float *scales, int dim, int gs, int n,
                            ptrdiff_t row_stride, ptrdiff_t scale_stride, float *out);
    int q8_v_scaled; /* accumulate_v_q8's order: 0 the weights (every table), 1 each element */

    /* Quest's bound per block (spec §6) from the query split by sign:
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

    /* scoring="channels" (spec §6) over n blocks of a channel copy that
     * keeps cs values per block and channel, a channel's blocks adjacent:
     * channel i of block b at d + (i*cstride + b)*cs, its scale at
     * sc[i*cstride + b].  s[g][b] = the max over the block's rows t (bs of
     * them, last_rows for block n-1) of the sum over j < r, from 0 in j
     * order, of (q[g][c] * scale(c, b)) * (float)value(c, b, t), c = idx[j]:
     * per (head, row) one product rounding, then the add (or the fused
     * multiply-add of the SIMD files).  acc: sa_channel_acc_floats(G, r,
     * rows) floats of scratch, rows = n > 1 ? bs : last_rows (the row sums,
     * then the weights of a tile of SA_CHANNEL_TILE blocks). */
    void (*channel_scores)(const float *q, int G, int D, const int32_t *idx, int r,
                           const int8_t *d, const float *sc, int cs, ptrdiff_t cstride,
                           int bs, int n, int last_rows, float *acc, float *const *s);

    /* The sum of the n_words 64-bit words at buf (8-byte aligned), read once
     * front to back with the widest loads of the ISA: the bandwidth probe. */
    uint64_t (*stream_sum)(const uint64_t *buf, size_t n_words);

    /* out[i] = the IEEE half h[i] as a float, i < n (h 2-byte aligned):
     * exact, every half being a float, subnormals included; a NaN keeps its
     * sign and payload and is made quiet (what F16C's and NEON's conversions
     * do).  The same bits on every ISA.  llama.cpp's f16 K and V rows
     * (ggml_attn.c). */
    void (*halves_to_floats)(const uint16_t *h, float *out, int n);
} sa_kernels;

/* The walk of the GEMM-form scores over a call's panels (keys from `first`
 * of panel 0, n of them) and its G query vectors in blocks of R, then 4, 2
 * and 1 (constant sizes, so each block unrolls): BLOCK(g, HB, p, at) scores
 * vectors g .. g+HB-1 against panel p, whose key 0 is key `at` of the call
 * (negative in panel 0 when first > 0). */
#define SA_PANEL_WALK(NT, R, G, first, n, BLOCK)                                  \
    do {                                                                          \
        const int64_t end_ = (int64_t)(first) + (n);                              \
        for (int64_t p_ = 0; p_ * (NT) < end_; p_++) {                             \
            const ptrdiff_t at_ = (ptrdiff_t)(p_ * (NT) - (first));                \
            int g_ = 0;                                                           \
            for (; g_ + (R) <= (G); g_ += (R))                                    \
                BLOCK(g_, (R), p_, at_);                                          \
            for (; g_ + 4 <= (G); g_ += 4)                                        \
                BLOCK(g_, 4, p_, at_);                                            \
            for (; g_ + 2 <= (G); g_ += 2)                                        \
                BLOCK(g_, 2, p_, at_);                                            \
            if (g_ < (G))                                                         \
                BLOCK(g_, 1, p_, at_);                                            \
        }                                                                         \
    } while (0)

/* In a file that defines SA_ISA_ID (a family body shared by several ISA
 * files, like arm/neon_common.h): the name <kernel>_<SA_ISA_ID>. */
#define SA_CAT_(a, b) a##_##b
#define SA_CAT(a, b) SA_CAT_(a, b)
#define SA_FN(kernel) SA_CAT(kernel, SA_ISA_ID)

/* A table from the functions <kernel>_<id> of one ISA file. */
#define SA_DEFINE_KERNELS(id)                                                        \
    const sa_kernels sa_kernels_##id = {                                             \
        .scores_f32 = scores_f32_##id, .scores_q8 = scores_q8_##id,                   \
        .scores_f32_panels = scores_f32_panels_##id, .panel_keys = panel_keys_##id,   \
        .scores_q8_panels = scores_q8_panels_##id, .q8_panel_keys = q8_panel_keys_##id, \
        .softmax_exp = softmax_exp_##id, .accumulate_v_f32 = accumulate_v_f32_##id,   \
        .accumulate_v_q8 = accumulate_v_q8_##id, .minmax_scores = minmax_scores_##id, \
        .dequantize_rows = dequantize_rows_##id, .q8_v_scaled = q8_v_scaled_##id,    \
        .channel_scores = channel_scores_##id, .stream_sum = stream_sum_##id,          \
        .halves_to_floats = halves_to_floats_##id,                                    \
    }

/* The same, for an id that is itself a macro (SA_ISA_ID). */
#define SA_DEFINE_KERNELS_OF(id) SA_DEFINE_KERNELS(id)

/* Which architectures this build targets: SA_IF_<arch>(x) is x or nothing. */
#define SA_IF_ANY(...) __VA_ARGS__
#if defined(__x86_64__) || defined(_M_X64)
#define SA_IF_X86_64(...) __VA_ARGS__
#else
#define SA_IF_X86_64(...)
#endif
#if defined(__aarch64__)
#define SA_IF_AARCH64(...) __VA_ARGS__
#else
#define SA_IF_AARCH64(...)
#endif

#define SA_ISA(id, name, arch, file) SA_IF_##arch(extern const sa_kernels sa_kernels_##id;)
#include "isa_list.h"
#undef SA_ISA

/* 1 if sa_kernels_avx512_amx was compiled with its AMX scores (the compiler
 * has the AMX intrinsics), else 0: that table is then avx512-vnni's. */
SA_IF_X86_64(extern const int sa_amx_compiled;)

/* The table in use; read once per call so a concurrent sa_set_isa never mixes
 * two ISAs inside one call. */
const sa_kernels *sa_active_kernels(void);

/* Quantise one row (spec §4); shared by the cache writer and the query path. */
void sa_quantize_row(const float *x, int dim, int gs, int8_t *q, float *scales);

#endif
