/*
 * Which kernels run: decided once from what the CPU (and OS) report, never
 * from the build machine, and overridable by name so tests and users can
 * force a lower path (the Python layer reads SPARSE_ATTN_ISA).  The paths
 * and their order come from isa_list.h; each has a CPU test runs_<id>().
 */
#include <stdatomic.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

static int runs_portable(void) { return 1; }

#if defined(__x86_64__) || defined(_M_X64)
/* libgcc's cpu model also checks XGETBV, so these are false when the OS does
 * not save the AVX / AVX-512 register state. */
static int runs_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

static int runs_avx512_vnni(void)
{
#ifdef SA_TEST_EMULATED_AVX512
    /* Only for scripts/test-c.sh --avx512-emulated, whose avx512 table is
     * compiled for AVX2 through SIMDe (tests/c/simde_avx512_shim.h); the
     * package build never defines this. */
    return runs_avx2();
#else
    return runs_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
#endif
}

/* AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 24, 25), the OS saving the tile
 * state (XCR0 bits 17, 18), and Linux's per-process permission for it
 * (arch_prctl ARCH_REQ_XCOMP_PERM; granted once, inherited by threads and
 * forked children).  Asked once; elsewhere than Linux, never. */
#ifndef SA_TEST_EMULATED_AVX512
static int amx_granted(void)
{
#if defined(__linux__) && defined(SYS_arch_prctl)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) /* OSXSAVE */
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17))
        return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}
#endif

static int runs_avx512_amx(void)
{
#ifdef SA_TEST_EMULATED_AVX512
    /* scripts/test-c.sh --avx512-emulated: the tile operations are
     * modelled in C there (tests/c/simde_avx512_shim.h). */
    return sa_amx_compiled && runs_avx512_vnni();
#else
    if (!sa_amx_compiled || !runs_avx512_vnni())
        return 0;
    static atomic_int granted; /* 0: not asked yet, 1: yes, -1: no */
    int g = atomic_load(&granted);
    if (!g) {
        g = amx_granted() ? 1 : -1;
        atomic_store(&granted, g);
    }
    return g == 1;
#endif
}
#endif

#if defined(__aarch64__)
static unsigned long hwcap(void)
{
#if defined(__linux__)
    return getauxval(AT_HWCAP);
#else
    return 0;
#endif
}
static int runs_neon(void) { return (hwcap() & HWCAP_ASIMD) != 0; }
static int runs_neon_dotprod(void) { return runs_neon() && (hwcap() & HWCAP_ASIMDDP); }
#endif

typedef struct {
    const char *name;
    const sa_kernels *table;
    int (*runs)(void);
} isa_entry;

/* Lowest to highest; the default is the last one the CPU can run. */
static const isa_entry all_isas[] = {
#define SA_ISA(id, name, arch, file) SA_IF_##arch({name, &sa_kernels_##id, runs_##id},)
#include "isa_list.h"
#undef SA_ISA
};
#define N_ISAS ((int)(sizeof all_isas / sizeof all_isas[0]))

static _Atomic(const sa_kernels *) active = NULL;

static const sa_kernels *best_kernels(void)
{
    for (int i = N_ISAS - 1; i > 0; i--)
        if (all_isas[i].runs())
            return all_isas[i].table;
    return all_isas[0].table;
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

const char *sa_isa_name(void)
{
    const sa_kernels *k = sa_active_kernels();
    for (int i = 0; i < N_ISAS; i++)
        if (all_isas[i].table == k)
            return all_isas[i].name;
    return "unknown";
}

int sa_isa_count(void) { return N_ISAS; }

const char *sa_isa_name_at(int index)
{
    return index >= 0 && index < N_ISAS ? all_isas[index].name : NULL;
}

static const isa_entry *find(const char *name)
{
    if (!name)
        return NULL;
    for (int i = 0; i < N_ISAS; i++)
        if (strcmp(all_isas[i].name, name) == 0)
            return &all_isas[i];
    return NULL;
}

int sa_isa_available(const char *name)
{
    const isa_entry *e = find(name);
    return e != NULL && e->runs();
}

int sa_set_isa(const char *name)
{
    const isa_entry *e = find(name);
    if (!e || !e->runs())
        return SA_ERR_ISA;
    atomic_store(&active, e->table);
    return SA_OK;
}
