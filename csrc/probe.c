/* The probe of spec §2.2 for one KV head group. */
#include "probe.h"

#include "probe_rows.h"
#include "rows.h"

size_t sa_probe_tmp_floats(int seq_len, int block_size, int n_probe)
{
    int step;
    const int cnt = sa_probe_rows_geometry(block_size, n_probe, &step);
    /* The full blocks' sampled dots, cnt per block (the per-offset path,
     * taken only when cnt >= 2, needs NB <= full + 1 <= 2 * full per head),
     * or the last block's (at most min(block_size, seq_len)). */
    const size_t full = (size_t)sa_max(seq_len / block_size, 1) * (size_t)cnt;
    const size_t last = (size_t)sa_min(block_size, seq_len);
    return full > last ? full : last;
}

/* s->probe[g*NB + b] = the largest of the cnt dots d[b*cnt + i] of head g,
 * for the first `full` blocks; head g's dots start at s->sp[g].  Each
 * block's maximum is taken in its own order (i = 0, 1, ...), four blocks
 * side by side: one block at a time is a chain of dependent compares (at
 * 32K tokens a tenth of a selection's time; docs/design.md, "Where a
 * selection's time goes"), four are independent chains.  The values are
 * the same either way. */
static void block_max(sa_scratch *s, int full, int cnt)
{
    for (int g = 0; g < s->G; g++) {
        const float *d = s->sp[g];
        float *best = s->probe + (ptrdiff_t)g * s->NB;
        int b = 0;
        for (; b <= full - 4; b += 4) {    /* not b + 4 <= full: full may be INT_MAX */
            const float *d0 = d + (ptrdiff_t)b * cnt;
            const float *d1 = d0 + cnt, *d2 = d1 + cnt, *d3 = d2 + cnt;
            float m0 = d0[0], m1 = d1[0], m2 = d2[0], m3 = d3[0];
            for (int i = 1; i < cnt; i++) {
                m0 = d0[i] > m0 ? d0[i] : m0;
                m1 = d1[i] > m1 ? d1[i] : m1;
                m2 = d2[i] > m2 ? d2[i] : m2;
                m3 = d3[i] > m3 ? d3[i] : m3;
            }
            best[b] = m0;
            best[b + 1] = m1;
            best[b + 2] = m2;
            best[b + 3] = m3;
        }
        for (; b < full; b++) {
            const float *db = d + (ptrdiff_t)b * cnt;
            float m = db[0];
            for (int i = 1; i < cnt; i++)
                m = db[i] > m ? db[i] : m;
            best[b] = m;
        }
    }
}

void sa_probe_group(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, int kh,
                    const float *qf, int seq_len, int block_size, int n_probe,
                    const sa_probe_rows *rows)
{
    const int G = s->G, NB = s->NB;
    for (int g = 0; g < G; g++)
        s->heads[g] = g;
    /* Full blocks all sample the offsets j*step.  From copies of the probe
     * rows, the samples of all full blocks are one contiguous run of rows.
     * In K, when the samples tile the block evenly (the default 32 / 8:
     * every 4th row) they are one run of rows `step` apart; both are read
     * front to back in one kernel call.  Otherwise one call per offset j
     * takes that offset's row of every block.  The dots are the same either
     * way (kernels.h: a row's dot does not depend on the batch it is in).
     * full * cnt <= seq_len, so the counts fit an int. */
    const int full = seq_len / block_size;
    int step;
    const int cnt = sa_probe_rows_geometry(block_size, n_probe, &step);
    if (full > 0 && rows) {
        const sa_kv view = sa_probe_rows_view(rows, full);
        for (int g = 0; g < G; g++)
            s->sp[g] = s->probe_tmp + (ptrdiff_t)g * full * cnt;
        sa_score_rows(kern, s, &view, kh, qf, s->heads, G, 0, 1, full * cnt, NULL);
        block_max(s, full, cnt);
    } else if (full > 0 && (int64_t)cnt * step == block_size) {
        for (int g = 0; g < G; g++)
            s->sp[g] = s->probe_tmp + (ptrdiff_t)g * full * cnt;
        sa_score_rows(kern, s, k, kh, qf, s->heads, G, 0, step, full * cnt, NULL);
        block_max(s, full, cnt);
    } else {
        for (int j = 0; j < cnt && full > 0; j++) {
            for (int g = 0; g < G; g++)
                s->sp[g] = (j == 0 ? s->probe : s->probe_tmp) + (ptrdiff_t)g * NB;
            sa_score_rows(kern, s, k, kh, qf, s->heads, G, j * step, block_size, full, NULL);
            if (j == 0)
                continue;
            for (int g = 0; g < G; g++) {
                float *best = s->probe + (ptrdiff_t)g * NB;
                const float *d = s->probe_tmp + (ptrdiff_t)g * NB;
                for (int b = 0; b < full; b++)
                    best[b] = d[b] > best[b] ? d[b] : best[b];
            }
        }
    }
    if (full < NB) {
        /* The partial last block has its own step. */
        const int p0 = sa_block_start(full, block_size), len = seq_len - p0;
        const int pstep = sa_max(1, len / n_probe), pcnt = sa_ceil_div(len, pstep);
        for (int g = 0; g < G; g++)
            s->sp[g] = s->probe_tmp + (ptrdiff_t)g * pcnt;
        sa_score_rows(kern, s, k, kh, qf, s->heads, G, p0, pstep, pcnt, NULL);
        for (int g = 0; g < G; g++) {
            const float *d = s->sp[g];
            float best = d[0];
            for (int i = 1; i < pcnt; i++)
                best = d[i] > best ? d[i] : best;
            s->probe[(ptrdiff_t)g * NB + full] = best;
        }
    }
}
