/*
 * Which kernels run: decided once from what the CPU (and OS) report, never
 * from the build machine, and overridable by name so tests and users can
 * force a lower path (the Python layer reads SPARSE_ATTN_ISA).
 */
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

/* Lowest to highest; the default is the last one the CPU can run. */
static const sa_kernels *const all_kernels[] = {
    &sa_kernels_portable,
#if defined(__x86_64__) || defined(_M_X64)
    &sa_kernels_avx2,
    &sa_kernels_avx512_vnni,
#endif
#if defined(__aarch64__)
    &sa_kernels_neon,
    &sa_kernels_neon_dotprod,
#endif
};
#define N_KERNELS ((int)(sizeof all_kernels / sizeof all_kernels[0]))

static int cpu_runs(const sa_kernels *k)
{
    if (k == &sa_kernels_portable)
        return 1;
#if defined(__x86_64__) || defined(_M_X64)
    /* libgcc's cpu model also checks XGETBV, so these are false when the OS
     * does not save the AVX / AVX-512 register state. */
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (k == &sa_kernels_avx2)
        return avx2;
#ifdef SA_TEST_EMULATED_AVX512
    /* Only for scripts/test-c.sh --avx512-emulated, whose avx512 table is
     * compiled for AVX2 through SIMDe (tests/c/simde_avx512_shim.h); the
     * package build never defines this. */
    if (k == &sa_kernels_avx512_vnni)
        return avx2;
#endif
    if (k == &sa_kernels_avx512_vnni)
        return avx2 && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni");
#endif
#if defined(__aarch64__) && defined(__linux__)
    const unsigned long hw = getauxval(AT_HWCAP);
    if (k == &sa_kernels_neon)
        return (hw & HWCAP_ASIMD) != 0;
    if (k == &sa_kernels_neon_dotprod)
        return (hw & HWCAP_ASIMD) && (hw & HWCAP_ASIMDDP);
#endif
    return 0;
}

static _Atomic(const sa_kernels *) active = NULL;

static const sa_kernels *best_kernels(void)
{
    for (int i = N_KERNELS - 1; i > 0; i--)
        if (cpu_runs(all_kernels[i]))
            return all_kernels[i];
    return &sa_kernels_portable;
}

const sa_kernels *sa_active_kernels(void)
{
    const sa_kernels *k = atomic_load(&active);
    if (!k) {
        /* Racing first calls all store the same table. */
        k = best_kernels();
        atomic_store(&active, k);
    }
    return k;
}

const char *sa_isa_name(void) { return sa_active_kernels()->name; }

int sa_isa_count(void) { return N_KERNELS; }

const char *sa_isa_name_at(int index)
{
    return index >= 0 && index < N_KERNELS ? all_kernels[index]->name : NULL;
}

static const sa_kernels *find(const char *name)
{
    if (!name)
        return NULL;
    for (int i = 0; i < N_KERNELS; i++)
        if (strcmp(all_kernels[i]->name, name) == 0)
            return all_kernels[i];
    return NULL;
}

int sa_isa_available(const char *name)
{
    const sa_kernels *k = find(name);
    return k != NULL && cpu_runs(k);
}

int sa_set_isa(const char *name)
{
    const sa_kernels *k = find(name);
    if (!k || !cpu_runs(k))
        return SA_ERR_ISA;
    atomic_store(&active, k);
    return SA_OK;
}
