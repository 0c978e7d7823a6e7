/*
 * Work split over KV heads, on a small pool of persistent worker threads.
 *
 * Starting threads per call cost ~65 us per thread on the development VM,
 * which is a fifth of a 4K-token decode step at the memory floor; the pool
 * pays it once.  One call owns the pool at a time; a call that finds it busy
 * (another Python thread is inside the core) runs its items on the calling
 * thread instead.  Items never depend on which thread runs them, so that
 * changes nothing but speed.
 */
#include <pthread.h>
#include <stdlib.h>

#include "internal.h"

#define SA_MAX_WORKERS 64

typedef struct {
    sa_item_fn fn;
    void *ctx;
    int first, last, worker;
    int status;
} chunk;

static void run_chunk(chunk *c)
{
    c->status = SA_OK;
    for (int i = c->first; i < c->last; i++) {
        int rc = c->fn(c->ctx, i, c->worker);
        if (rc) {
            c->status = rc;
            break;
        }
    }
}

static struct {
    pthread_mutex_t owner;     /* held by the call using the pool */
    pthread_mutex_t lock;      /* guards the fields below */
    pthread_cond_t wake, done;
    int started;               /* workers 1..started exist */
    unsigned long generation;  /* bumped once per job */
    chunk *chunks;             /* chunks[w] for worker w of the current job */
    int n_chunks;
    int pending;               /* workers still running the current job */
    unsigned long born[SA_MAX_WORKERS]; /* the generation each worker started at */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, NULL, 0, 0, {0}};

static void *worker_main(void *arg)
{
    const int w = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    /* Not pool.generation: a job may have been posted before this thread
     * first got the lock, and it must not be skipped. */
    unsigned long seen = pool.born[w];
    for (;;) {
        while (pool.generation == seen)
            pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        if (w < pool.n_chunks) {
            chunk *c = &pool.chunks[w];
            pthread_mutex_unlock(&pool.lock);
            run_chunk(c);
            pthread_mutex_lock(&pool.lock);
            if (--pool.pending == 0)
                pthread_cond_signal(&pool.done);
        }
    }
    return NULL;
}

/* A forked child has none of the parent's workers: start from scratch. */
static void reset_in_child(void)
{
    pthread_mutex_init(&pool.owner, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
    pool.n_chunks = 0;
    pool.pending = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) { pthread_atfork(NULL, NULL, reset_in_child); }

/* Start workers up to index `want - 1`; returns how many chunks can run in
 * parallel (1 + started workers). Called with pool.owner held. */
static int ensure_workers(int want)
{
    pthread_once(&atfork_once, install_atfork);
    while (pool.started + 1 < want) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* The new worker treats the current generation as already done. */
        pthread_mutex_lock(&pool.lock);
        pool.born[pool.started + 1] = pool.generation;
        const int ok = pthread_create(&tid, &attr, worker_main,
                                      (void *)(intptr_t)(pool.started + 1)) == 0;
        if (ok)
            pool.started++;
        pthread_mutex_unlock(&pool.lock);
        pthread_attr_destroy(&attr);
        if (!ok)
            break;
    }
    return pool.started + 1;
}

int sa_workers_for(int n_items, int threads)
{
    if (threads < 1)
        threads = 1;
    if (threads > SA_MAX_WORKERS)
        threads = SA_MAX_WORKERS;
    return n_items < threads ? (n_items < 1 ? 1 : n_items) : threads;
}

int sa_parallel_for(int n_items, int n_workers, sa_item_fn fn, void *ctx)
{
    n_workers = sa_workers_for(n_items, n_workers);
    chunk local[SA_MAX_WORKERS];
    for (int w = 0; w < n_workers; w++)
        local[w] = (chunk){fn, ctx, (int)((int64_t)n_items * w / n_workers),
                           (int)((int64_t)n_items * (w + 1) / n_workers), w, SA_OK};

    int parallel = 1;
    if (n_workers > 1 && pthread_mutex_trylock(&pool.owner) == 0) {
        parallel = sa_min(n_workers, ensure_workers(n_workers));
        if (parallel > 1) {
            pthread_mutex_lock(&pool.lock);
            pool.chunks = local;
            pool.n_chunks = parallel;
            pool.pending = parallel - 1;
            pool.generation++;
            pthread_cond_broadcast(&pool.wake);
            pthread_mutex_unlock(&pool.lock);
        }
        run_chunk(&local[0]);
        if (parallel > 1) {
            pthread_mutex_lock(&pool.lock);
            while (pool.pending > 0)
                pthread_cond_wait(&pool.done, &pool.lock);
            pool.n_chunks = 0;
            pthread_mutex_unlock(&pool.lock);
        }
        pthread_mutex_unlock(&pool.owner);
    } else {
        run_chunk(&local[0]);
    }
    /* Chunks no worker took run here, in order. */
    for (int w = parallel; w < n_workers; w++)
        run_chunk(&local[w]);
    int rc = SA_OK;
    for (int w = 0; w < n_workers && rc == SA_OK; w++)
        rc = local[w].status;
    return rc;
}
