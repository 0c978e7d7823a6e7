/*
 * TEST-ONLY.  Never part of the package build.
 *
 * Lets scripts/test-c.sh --avx512-emulated compile csrc/x86/avx512_vnni.h (the
 * AVX-512 kernels) for an AVX2 machine: the script copies that file into the
 * build directory,
 * swaps its `#pragma GCC target(...)` for "avx2,fma" and its
 * `#include <immintrin.h>` for this header, so every _mm512_* intrinsic
 * resolves to SIMDe's portable model (Debian: libsimde-dev, header-only) and
 * the AVX-512 kernels run, and are checked, on a CPU without AVX-512.
 *
 * SIMDe 0.7.4 lacks (or has no native alias for) a few intrinsics the file
 * uses; they are modelled below as scalar loops.  The masked loads and stores
 * and the gather touch only the enabled lanes / addressed elements, like the
 * hardware (which never faults on a masked-off lane), rather than loading
 * the full vector and blending: so under AddressSanitizer a wrong mask or
 * index in the kernels is reported instead of being hidden by, or wrongly
 * blamed on, the emulation.
 */
#ifndef SA_TEST_SIMDE_AVX512_SHIM_H
#define SA_TEST_SIMDE_AVX512_SHIM_H

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <string.h>
#include <stdint.h>

static inline simde__m512i emu_shuffle_i64x2(simde__m512i a, simde__m512i b, int imm) {
    simde__m512i_private A = simde__m512i_to_private(a), B = simde__m512i_to_private(b), R;
    for (int i = 0; i < 4; i++) {
        int sel = (imm >> (2 * i)) & 3;
        const simde__m512i_private *src = i < 2 ? &A : &B;
        R.i64[2 * i] = src->i64[2 * sel]; R.i64[2 * i + 1] = src->i64[2 * sel + 1];
    }
    return simde__m512i_from_private(R);
}
#undef _mm512_shuffle_i64x2
#define _mm512_shuffle_i64x2(a, b, imm) emu_shuffle_i64x2(a, b, imm)

/* A zero-masking load of LANES elements of type T into field F: lane i is
 * p[i] when bit i of k is set, else 0, and p[i] is read only then. */
#define SA_EMU_MASKZ_LOAD(name, vec, T, F, LANES)                               \
    static inline simde__##vec emu_##name(uint64_t k, const void *p) {          \
        simde__##vec##_private R; const T *x = p;                               \
        for (int i = 0; i < LANES; i++) R.F[i] = (k >> i) & 1 ? x[i] : 0;       \
        return simde__##vec##_from_private(R);                                  \
    }

SA_EMU_MASKZ_LOAD(maskz_loadu_epi8, m512i, int8_t, i8, 64)
#undef _mm512_maskz_loadu_epi8
#define _mm512_maskz_loadu_epi8(k, p) emu_maskz_loadu_epi8(k, p)

SA_EMU_MASKZ_LOAD(maskz_loadu_ps, m512, float, f32, 16)
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) emu_maskz_loadu_ps(k, p)

static inline void emu_mask_storeu_ps(void *p, uint16_t k, simde__m512 a) {
    simde__m512_private A = simde__m512_to_private(a); float *x = p;
    for (int i = 0; i < 16; i++) if ((k >> i) & 1) x[i] = A.f32[i];
}
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) emu_mask_storeu_ps(p, k, a)

static inline simde__m512 emu_i32gather_ps(simde__m512i idx, const void *base, int scale) {
    simde__m512i_private I = simde__m512i_to_private(idx); simde__m512_private R;
    for (int i = 0; i < 16; i++) memcpy(&R.f32[i], (const char *)base + (ptrdiff_t)I.i32[i] * scale, 4);
    return simde__m512_from_private(R);
}
#undef _mm512_i32gather_ps
#define _mm512_i32gather_ps(idx, base, scale) emu_i32gather_ps(idx, base, scale)

/* A conversion lane by lane: lane i of the IN vector's field FI, converted
 * to the OUT vector's field FO, for LANES lanes. */
#define SA_EMU_CONVERT(name, OUT, FO, IN, FI, LANES)                            \
    static inline simde__##OUT emu_##name(simde__##IN a) {                      \
        simde__##IN##_private A = simde__##IN##_to_private(a);                  \
        simde__##OUT##_private R;                                               \
        for (int i = 0; i < LANES; i++) R.FO[i] = A.FI[i];                      \
        return simde__##OUT##_from_private(R);                                  \
    }

SA_EMU_CONVERT(cvtepi32_ps, m512, f32, m512i, i32, 16)
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps(a) emu_cvtepi32_ps(a)

SA_EMU_CONVERT(cvtepi8_epi32, m512i, i32, m128i, i8, 16)
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a) emu_cvtepi8_epi32(a)

SA_EMU_CONVERT(cvtps_pd, m512d, f64, m256, f32, 8)
#undef _mm512_cvtps_pd
#define _mm512_cvtps_pd(a) emu_cvtps_pd(a)

/* 16 IEEE halves -> 16 floats as vcvtph2ps converts them: exact, a NaN
 * made quiet (SIMDe 0.7.4 has no _mm512_cvtph_ps). */
static inline simde__m512 emu_cvtph_ps(simde__m256i a) {
    simde__m256i_private A = simde__m256i_to_private(a); simde__m512_private R;
    for (int i = 0; i < 16; i++) {
        const uint16_t h = (uint16_t)A.i16[i];
        const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
        uint32_t bits;
        if (e == 0x1f) {
            bits = 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0u);
        } else if (e == 0) {
            const float f = (float)m * 0x1p-24f;
            memcpy(&bits, &f, 4);
        } else {
            bits = ((e + 112u) << 23) | (m << 13);
        }
        bits |= sign;
        memcpy(&R.f32[i], &bits, 4);
    }
    return simde__m512_from_private(R);
}
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(a) emu_cvtph_ps(a)

/* AMX (the avx512-amx table's scores, kernels_avx512_amx.c).  The tile
 * state is modelled per thread, as the hardware keeps it: eight tiles of up
 * to 16 rows x 64 bytes shaped by the last _tile_loadconfig.  Loads and
 * stores touch exactly rows x colsb bytes per tile (so AddressSanitizer sees
 * every byte a tile reads or writes); any use outside a valid configuration,
 * or a tdpbssd whose shapes do not fit, aborts. */
#include <stdlib.h>
#include <stdio.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} emu_tilecfg;

static _Thread_local struct {
    emu_tilecfg cfg;
    int configured;
    uint8_t t[8][16][64];
} emu_amx;

static inline void emu_amx_fail(const char *what) {
    fprintf(stderr, "emulated AMX: %s\n", what);
    abort();
}

static inline void emu_tile_check(int d) {
    if (!emu_amx.configured) emu_amx_fail("tile used without a configuration");
    if (d < 0 || d > 7 || emu_amx.cfg.rows[d] == 0 || emu_amx.cfg.rows[d] > 16 ||
        emu_amx.cfg.colsb[d] == 0 || emu_amx.cfg.colsb[d] > 64)
        emu_amx_fail("tile not configured");
}

static inline void emu_tile_loadconfig(const void *c) {
    memcpy(&emu_amx.cfg, c, sizeof emu_amx.cfg);
    if (emu_amx.cfg.palette != 1) emu_amx_fail("palette is not 1");
    memset(emu_amx.t, 0, sizeof emu_amx.t);
    emu_amx.configured = 1;
}

static inline void emu_tile_release(void) {
    memset(&emu_amx, 0, sizeof emu_amx);
}

static inline void emu_tile_loadd(int d, const void *base, long stride) {
    emu_tile_check(d);
    memset(emu_amx.t[d], 0, sizeof emu_amx.t[d]);
    for (int r = 0; r < emu_amx.cfg.rows[d]; r++)
        memcpy(emu_amx.t[d][r], (const char *)base + (ptrdiff_t)r * stride, emu_amx.cfg.colsb[d]);
}

static inline void emu_tile_stored(int d, void *base, long stride) {
    emu_tile_check(d);
    for (int r = 0; r < emu_amx.cfg.rows[d]; r++)
        memcpy((char *)base + (ptrdiff_t)r * stride, emu_amx.t[d][r], emu_amx.cfg.colsb[d]);
}

static inline void emu_tile_zero(int d) {
    emu_tile_check(d);
    memset(emu_amx.t[d], 0, sizeof emu_amx.t[d]);
}

/* C[m][n] += sum_k sum_i A[m][4k+i] * B[k][4n+i], signed bytes, int32 lanes
 * wrapping like the hardware. */
static inline void emu_tile_dpbssd(int c, int a, int b) {
    emu_tile_check(c), emu_tile_check(a), emu_tile_check(b);
    const emu_tilecfg *f = &emu_amx.cfg;
    const int M = f->rows[c], N = f->colsb[c] / 4, K = f->colsb[a] / 4;
    if (f->rows[a] != M || f->rows[b] != K || f->colsb[b] != f->colsb[c] || f->colsb[c] % 4 ||
        f->colsb[a] % 4)
        emu_amx_fail("tdpbssd shapes do not fit");
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            int32_t acc;
            memcpy(&acc, &emu_amx.t[c][m][4 * n], 4);
            uint32_t u = (uint32_t)acc;
            for (int k = 0; k < K; k++)
                for (int i = 0; i < 4; i++)
                    u += (uint32_t)((int32_t)(int8_t)emu_amx.t[a][m][4 * k + i] *
                                    (int32_t)(int8_t)emu_amx.t[b][k][4 * n + i]);
            acc = (int32_t)u;
            memcpy(&emu_amx.t[c][m][4 * n], &acc, 4);
        }
}

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#define _tile_loadconfig(c) emu_tile_loadconfig(c)
#define _tile_release() emu_tile_release()
#define _tile_loadd(d, base, stride) emu_tile_loadd(d, base, stride)
#define _tile_stored(d, base, stride) emu_tile_stored(d, base, stride)
#define _tile_zero(d) emu_tile_zero(d)
#define _tile_dpbssd(c, a, b) emu_tile_dpbssd(c, a, b)

#endif
