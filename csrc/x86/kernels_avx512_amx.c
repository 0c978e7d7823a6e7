/*
 * The avx512-vnni kernels with prefill's q8 scores on AMX tiles
 * (tdpbssd): kernels_avx512_vnni.c compiled again with SA_AMX, which names
 * the table sa_kernels_avx512_amx and routes scores_q8's many-heads case
 * (a prefill tile's query vectors against a K block) to scores_q8_amx.
 * Everything else, decode included, is the avx512-vnni code.  The table is
 * handed out only when the CPU has AMX-TILE and AMX-INT8 and the OS granted
 * this process the tile state (cpu_features.c).
 */
#define SA_AMX 1
#include "kernels_avx512_vnni.c"
