/*
 * Every kernel path the project has, lowest first: the one list that the C
 * core (kernels.h, cpu_features.c), the cffi builder (csrc/build_ffi.py),
 * the C harness and scripts/test-c.sh read.  Adding an ISA is a line here,
 * its kernel file, and its CPU test in cpu_features.c.
 *
 *   SA_ISA(id, "name", arch, "source file under csrc/")
 *
 * arch is ANY (always built), X86_64 or AARCH64 (built for that target
 * only).  The table of a path is sa_kernels_<id>; its CPU test in
 * cpu_features.c is runs_<id>().  One entry per line, nothing else on it:
 * the Python builder and the shell script parse these lines as text.
 */
SA_ISA(portable, "portable", ANY, "portable/kernels_portable.c")
SA_ISA(avx2, "avx2", X86_64, "x86/kernels_avx2.c")
SA_ISA(avx512_vnni, "avx512-vnni", X86_64, "x86/kernels_avx512_vnni.c")
SA_ISA(avx512_amx, "avx512-amx", X86_64, "x86/kernels_avx512_amx.c")
SA_ISA(neon, "neon", AARCH64, "arm/kernels_neon.c")
SA_ISA(neon_dotprod, "neon-dotprod", AARCH64, "arm/kernels_neon_dotprod.c")
