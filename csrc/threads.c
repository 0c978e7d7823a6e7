/*
 * Work split over KV heads.  Threads are created per call: the work items are
 * whole KV heads (hundreds of microseconds to milliseconds each), so a
 * thread start (tens of microseconds) is small beside them and nothing has to
 * live between calls.
 */
#include <pthread.h>
#include <stdlib.h>

#include "internal.h"

typedef struct {
    sa_item_fn fn;
    void *ctx;
    int first, last, worker;
    int status, failed_item;
} chunk;

static void *run_chunk(void *arg)
{
    chunk *c = arg;
    c->status = SA_OK;
    c->failed_item = -1;
    for (int i = c->first; i < c->last; i++) {
        int rc = c->fn(c->ctx, i, c->worker);
        if (rc) {
            c->status = rc;
            c->failed_item = i;
            break;
        }
    }
    return NULL;
}

int sa_workers_for(int n_items, int threads)
{
    if (threads < 1)
        threads = 1;
    return n_items < threads ? (n_items < 1 ? 1 : n_items) : threads;
}

int sa_parallel_for(int n_items, int n_workers, sa_item_fn fn, void *ctx)
{
    n_workers = sa_workers_for(n_items, n_workers);
    if (n_workers == 1) {
        chunk c = {fn, ctx, 0, n_items, 0, 0, 0};
        run_chunk(&c);
        return c.status;
    }
    chunk *chunks = calloc((size_t)n_workers, sizeof *chunks);
    pthread_t *tids = calloc((size_t)n_workers, sizeof *tids);
    int *started = calloc((size_t)n_workers, sizeof *started);
    if (!chunks || !tids || !started) {
        free(chunks), free(tids), free(started);
        return SA_ERR_NOMEM;
    }
    for (int w = 0; w < n_workers; w++) {
        chunks[w] = (chunk){fn, ctx, (int)((int64_t)n_items * w / n_workers),
                            (int)((int64_t)n_items * (w + 1) / n_workers), w, 0, -1};
    }
    int rc = SA_OK;
    for (int w = 1; w < n_workers; w++) {
        if (pthread_create(&tids[w], NULL, run_chunk, &chunks[w]) == 0)
            started[w] = 1;
        else
            rc = SA_ERR_THREAD;
    }
    /* Worker 0 runs here; a chunk whose thread failed to start runs here
     * too, so the result never depends on how many threads the OS gave us. */
    run_chunk(&chunks[0]);
    for (int w = 1; w < n_workers; w++) {
        if (started[w])
            pthread_join(tids[w], NULL);
        else
            run_chunk(&chunks[w]);
    }
    rc = SA_OK;
    for (int w = 0; w < n_workers && rc == SA_OK; w++)
        rc = chunks[w].status;
    free(chunks), free(tids), free(started);
    return rc;
}
