/* spec §4: symmetric int8 per group, the ggml q8_0 recipe with a float32 scale. */
#include <math.h>
#include <string.h>

#include "internal.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

/* q[i] = sa_round_q8(x[i] * id) for i < n, four at a time where the baseline
 * ISA has vectors (SSE2 on x86-64, NEON on AArch64), with the same result:
 * NaN becomes -127 as in the scalar code (maxps returns its second operand;
 * NEON selects it explicitly), and after the clamp vcvta rounds halfway
 * cases away from zero like roundf. */
static void round_group(const float *x, float id, int n, int8_t *q)
{
    int i = 0;
#if defined(__SSE2__)
    const __m128 vid = _mm_set1_ps(id), lo = _mm_set1_ps(-127.0f), hi = _mm_set1_ps(127.0f);
    const __m128 half = _mm_set1_ps(0.5f), mhalf = _mm_set1_ps(-0.5f);
    for (; i + 4 <= n; i += 4) {
        __m128 v = _mm_mul_ps(_mm_loadu_ps(x + i), vid);
        v = _mm_min_ps(_mm_max_ps(v, lo), hi);
        __m128i t = _mm_cvttps_epi32(v);
        const __m128 f = _mm_sub_ps(v, _mm_cvtepi32_ps(t));
        t = _mm_sub_epi32(t, _mm_castps_si128(_mm_cmpge_ps(f, half)));   /* mask = -1 */
        t = _mm_add_epi32(t, _mm_castps_si128(_mm_cmple_ps(f, mhalf)));
        const __m128i b = _mm_packs_epi16(_mm_packs_epi32(t, t), _mm_setzero_si128());
        const int32_t w = _mm_cvtsi128_si32(b);
        memcpy(q + i, &w, 4);
    }
#elif defined(__aarch64__)
    const float32x4_t vid = vdupq_n_f32(id), lo = vdupq_n_f32(-127.0f), hi = vdupq_n_f32(127.0f);
    for (; i + 4 <= n; i += 4) {
        float32x4_t v = vmulq_f32(vld1q_f32(x + i), vid);
        v = vbslq_f32(vceqq_f32(v, v), v, lo);  /* NaN (quiet or signalling) -> -127 */
        v = vminq_f32(vmaxq_f32(v, lo), hi);
        const int16x4_t h = vqmovn_s32(vcvtaq_s32_f32(v));
        const int8x8_t b = vqmovn_s16(vcombine_s16(h, h));
        const int32_t w = vget_lane_s32(vreinterpret_s32_s8(b), 0);
        memcpy(q + i, &w, 4);       /* q + i need not be 4-byte aligned */
    }
#endif
    for (; i < n; i++)
        q[i] = sa_round_q8(x[i] * id);
}

/* max(0, |x[i]|) over i < n, NaN ignored (a NaN never beats the running max,
 * in the vector lanes as in the scalar code; max is exact in any order). */
static float abs_max(const float *x, int n)
{
    float amax = 0.0f;
    int i = 0;
#if defined(__SSE2__)
    const __m128 sign = _mm_set1_ps(-0.0f);
    __m128 m = _mm_setzero_ps();
    for (; i + 4 <= n; i += 4)
        m = _mm_max_ps(_mm_andnot_ps(sign, _mm_loadu_ps(x + i)), m);
    float lanes[4];
    _mm_storeu_ps(lanes, m);
    for (int j = 0; j < 4; j++)
        amax = lanes[j] > amax ? lanes[j] : amax;
#endif
    for (; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

void sa_quantize_row(const float *x, int dim, int gs, int8_t *q, float *scales)
{
    for (int g = 0, i0 = 0; i0 < dim; g++, i0 += gs) {
        const float amax = abs_max(x + i0, gs);
        const float d = amax / 127.0f;
        /* x * id can land a hair above 127 */
        round_group(x + i0, sa_q8_inverse(d), gs, q + i0);
        scales[g] = d;
    }
}

int sa_quantize_q8(const float *x, int64_t n_rows, int dim, int group_size,
                   int8_t *q, float *scales)
{
    if (!x || !q || !scales)
        return SA_ERR_NULL;
    if (n_rows < 0 || dim < 1 || group_size < 1)
        return SA_ERR_SHAPE;
    if (dim % group_size)
        return SA_ERR_GROUP;
    if (!sa_values_ok(x, n_rows * dim))
        return SA_ERR_VALUES;
    const int ng = dim / group_size;
    for (int64_t r = 0; r < n_rows; r++)
        sa_quantize_row(x + r * dim, dim, group_size, q + r * dim, scales + r * ng);
    return SA_OK;
}
