/*
 * What both x86 kernel files, and x86_common.h, use before any vector width
 * is chosen: AVX2 helpers (the AVX-512 file's target includes AVX2), the
 * scalar fallbacks (../scalar_kernels.h), the block shapes both keep.
 * Included after <immintrin.h>, ../kernels.h and the file's pragmas.
 */
#ifndef SA_X86_HELPERS_H
#define SA_X86_HELPERS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define SA_INLINE static inline __attribute__((always_inline))

/* Group sizes the vector steps do not take (not a multiple of the vector width): the
 * scalar loop with one fused multiply-add per element (fmaf is the FMA
 * instruction under this file's target), so the result is still bitwise
 * accumulate_v_f32 of the weights times the scales over the values
 * (kernels.h). */
#define SA_MULADD(a, b, c) fmaf((a), (b), (c))
#define SA_SCALAR_FN(kernel) kernel##_scalar
#define SA_Q8_V_SCALED 0 /* q8 V: the scale in the weight (kernels.h) */
#include "../scalar_kernels.h"


/* ln(FLT_MIN): below it exp_ps gives 0. */
#define SA_LN_FLT_MIN (-0x1.5d589ep+6f)

/* Keep a loaded vector in a register: without it GCC folds the load into
 * every FMA that uses it, so a row shared by several heads is loaded once
 * per head, and the tiles below become bound by loads instead of FMAs. */
#if defined(SIMDE_VERSION) /* the emulated test build: vectors are structs */
#define SA_KEEP(x) ((void)0)
#else
#define SA_KEEP(x) __asm__("" : "+x"(x))
#endif

/* 8 int8 -> 8 floats (exact). */
SA_INLINE __m256 load8_s8_ps(const int8_t *x)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)x)));
}

/* The first r (0..8) lanes of a vmaskmov mask set. */
static const int32_t sa_tail8_tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

SA_INLINE __m256i tail8(int r)
{
    return _mm256_loadu_si256((const __m256i *)(sa_tail8_tab + 8 - r));
}

/* The first n scales at sc (lanes past n 0 or unused): plain loads where
 * n allows, the masked load (m, the first n lanes) only for the other
 * counts: a masked load is slow enough to show in a sparse decode step
 * (docs/design.md, x86's measured choices). */
SA_INLINE __m256 load_groups(const float *sc, int n, __m256i m)
{
    if (n >= 8)
        return _mm256_loadu_ps(sc);
    if (n == 4)
        return _mm256_zextps128_ps256(_mm_loadu_ps(sc));
    return _mm256_maskload_ps(sc, m);
}

/* q8 V's weights (spec §4): a token's weight for a head times the token's
 * group scale, one float product, so the V loops multiply-add the int8
 * values converted (exactly) to float and never scale an element.  For the
 * HB heads, tokens [t0, t1) (at most SA_QV_TOKENS) and groups [g0, g0 + gn)
 * (gn at most SA_QV_GROUPS): w[((t - t0) * HB + h) * SA_QV_GROUPS + grp - g0]
 * = p[h][t] * vd[t * scale_stride + grp].  Per token a load of its scales
 * (load_groups: never past the group range) and a product per head and 8
 * groups. */
#define SA_QV_GROUPS 16
SA_INLINE void q8_v_weights(const float *const *p, int HB, const float *vd,
                            ptrdiff_t scale_stride, int t0, int t1, int g0, int gn, float *w)
{
    const __m256i m0 = tail8(gn < 8 ? gn : 8), m1 = tail8(gn > 8 ? gn - 8 : 0);
    for (int t = t0; t < t1; t++) {
        const float *sc = vd + (ptrdiff_t)t * scale_stride + g0;
        const __m256 s0 = load_groups(sc, gn, m0);
        float *wt = w + (ptrdiff_t)(t - t0) * HB * SA_QV_GROUPS;
        if (gn > 8) {
            const __m256 s1 = load_groups(sc + 8, gn - 8, m1);
            for (int h = 0; h < HB; h++) {
                const __m256 x = _mm256_broadcast_ss(p[h] + t);
                _mm256_storeu_ps(wt + h * SA_QV_GROUPS, _mm256_mul_ps(x, s0));
                _mm256_storeu_ps(wt + h * SA_QV_GROUPS + 8, _mm256_mul_ps(x, s1));
            }
        } else {
            for (int h = 0; h < HB; h++)
                _mm256_storeu_ps(wt + h * SA_QV_GROUPS,
                                 _mm256_mul_ps(_mm256_broadcast_ss(p[h] + t), s0));
        }
    }
}

/* Row pointers of a block of SA_VT tokens from t: slots past the last valid
 * row repeat it.  Each a stride past the one before: a multiply per row
 * showed in the q8 scores (docs/design.md, x86's measured choices). */
#define SA_BLOCK_ROWS(rows, base, t, cnt, stride)                                   \
    do {                                                                            \
        (rows)[0] = (base) + (ptrdiff_t)(t) * (stride);                             \
        for (int i_ = 1; i_ < SA_VT; i_++)                                          \
            (rows)[i_] = (rows)[i_ - 1] + (i_ < (cnt) ? (stride) : 0);              \
    } while (0)

/* The most heads of one q8 score block (scores_q8_tokens): pairs, and three
 * for an odd group (SmolLM2's 3, Qwen2.5's 7), so each row is loaded and
 * prepared once for the last three heads instead of for a pair and again for
 * one. */
#define SA_Q8_HEADS 3

/* V accumulation works on blocks of this many tokens: their rows stay in L1
 * while every slice of D and every head block walks over them, and each
 * tile's accumulators are loaded and stored once per block.  Decode's few
 * heads per call take V_TOKENS (its rows stream from memory, and the next
 * run's prefetch is spread over the blocks; longer blocks made q8 decode
 * slower, docs/design.md, x86's measured choices); prefill's many heads take longer blocks (x86_common.h,
 * V_TOKENS_MANY). */
#define V_TOKENS 16

/* Sum of 8 lanes in a fixed order. */
SA_INLINE float hsum8_ps(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* Maximum of 8 lanes, the same tree (maxps returns its second operand when
 * one is NaN, so a NaN lane survives). */
SA_INLINE float hmax8_ps(__m256 v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

/* Sum of 4 double lanes: (l0 + l2) + (l1 + l3). */
SA_INLINE double hsum4_pd(__m256d v)
{
    const __m128d x = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(x, _mm_unpackhi_pd(x, x)));
}

#endif
