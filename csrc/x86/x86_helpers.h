/*
 * Small AVX2 helpers both x86 kernel files use (the AVX-512 file's target
 * includes AVX2).  Included after <immintrin.h> and the file's pragmas.
 */
#ifndef SA_X86_HELPERS_H
#define SA_X86_HELPERS_H

#include <stdint.h>

#define SA_INLINE static inline __attribute__((always_inline))

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
