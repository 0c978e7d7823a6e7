/*
 * Work split into items (KV heads, chunks of a group's rows, prefill
 * tiles), run on a small pool of persistent worker threads.
 *
 * Starting threads per call cost ~65 us per thread on the development VM,
 * which is a fifth of a 4K-token decode step at the memory floor; the pool
 * pays it once.
 *
 * Items are claimed one at a time from an atomic counter by the calling
 * thread and by whichever workers wake up in time.  The caller never waits
 * for a worker that has not started: when the cores are oversubscribed (a
 * torch model's own threads spinning beside us), a late worker finds nothing
 * left and the caller has done the work itself.  Items never depend on which
 * thread runs them (each thread has its own scratch), so none of this
 * changes a result, only the time.
 *
 * One call owns the pool at a time; a call that finds it busy (another
 * Python thread is inside the core) runs its items on its own thread.
 *
 * Between jobs a worker first polls for SPIN_NS, then sleeps on a condition
 * variable; the caller polls the same way for workers finishing their last
 * item.  Back-to-back calls then find their workers awake; calls a model's
 * layer apart (~1 ms) find them asleep and pay the wake-up, ~28 us of the
 * caller's time on the development VM (docs/design.md, Threads).
 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* pthread_setaffinity_np, cpu_set_t */
#endif
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "internal.h"

#ifdef SA_PARALLEL_OPENMP
#include <omp.h>
#endif

#define SA_MAX_WORKERS 64

typedef struct {
    sa_item_fn fn;
    void *ctx;
    int n_items;
    atomic_int next;          /* the next unclaimed item */
    int *status;              /* per item */
} job;

/* Claim and run items until none is left. */
static void run_items(job *j, int worker)
{
    for (;;) {
        const int i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n_items)
            return;
        j->status[i] = j->fn(j->ctx, i, worker);
    }
}

static struct {
    pthread_mutex_t owner;     /* held by the call using the pool */
    pthread_mutex_t lock;      /* guards the fields below */
    pthread_cond_t wake, idle;
    int started;               /* workers 1..started exist */
    atomic_ulong generation;   /* bumped once per job (under lock; read by spinners) */
    job *open;                 /* the job workers may join, or NULL once closed */
    int max_worker;            /* workers 1..max_worker may join it */
    atomic_int busy;           /* workers inside the open job (changed under lock) */
    unsigned long born[SA_MAX_WORKERS]; /* the generation each worker started at */
    pthread_t tid[SA_MAX_WORKERS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, NULL, 0, 0, {0}, {0}};

/* Workers 1 .. pinned - 1 run on pin_set (sa_set_worker_cpus); guarded by
 * pool.owner. */
#ifdef __linux__
static cpu_set_t pin_set;
#endif
static int pinned;

/* Keep worker w on pin_set if it is one of the pinned ones, else let it run
 * on any CPU the process may use. */
static void place_worker(int w)
{
#ifdef __linux__
    if (w < pinned) {
        pthread_setaffinity_np(pool.tid[w], sizeof pin_set, &pin_set);
    } else {
        cpu_set_t any;
        if (sched_getaffinity(0, sizeof any, &any) == 0)
            pthread_setaffinity_np(pool.tid[w], sizeof any, &any);
    }
#else
    (void)w;
#endif
}

int sa_set_worker_cpus(const int *cpus, int n_cpus)
{
    if (n_cpus < 0 || n_cpus > SA_MAX_WORKERS || (n_cpus && !cpus))
        return SA_ERR_PARAM;
#ifdef __linux__
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int i = 0; i < n_cpus; i++) {
        if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE)
            return SA_ERR_PARAM;
        CPU_SET(cpus[i], &set);
    }
    pthread_mutex_lock(&pool.owner);
    pin_set = set;
    const int before = pinned;
    pinned = n_cpus;
    for (int w = 1; w <= pool.started; w++)
        if (w < pinned || w < before)
            place_worker(w);
    pthread_mutex_unlock(&pool.owner);
#else
    (void)cpus;
#endif
    return SA_OK;
}

/* How long a thread polls before it sleeps on a condition variable.  On the
 * development VM (2 threads, 4096 tokens, seed k=32, in cache) polling took
 * a sparse decode call from ~275 to ~190 us, and the same call alternating
 * with a small torch matmul on torch's 2 threads (a model's layer) from
 * ~445 to ~400 us; polling longer would take more of a core from whatever
 * runs between two calls. */
#define SPIN_NS 50000L

static long elapsed_ns(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)(t.tv_sec - t0->tv_sec) * 1000000000L + (t.tv_nsec - t0->tv_nsec);
}

/* Poll until a job after generation `seen` is posted or SPIN_NS pass. */
static void spin_for_job(unsigned long seen)
{
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned i = 1; atomic_load_explicit(&pool.generation, memory_order_relaxed) == seen;
         i++) {
        sa_cpu_relax();
        if (i % 64 == 0 && elapsed_ns(&t0) > SPIN_NS)
            return;
    }
}

/* Poll until no worker is inside the job or SPIN_NS pass. */
static void spin_for_idle(void)
{
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned i = 1; atomic_load_explicit(&pool.busy, memory_order_relaxed) > 0; i++) {
        sa_cpu_relax();
        if (i % 64 == 0 && elapsed_ns(&t0) > SPIN_NS)
            return;
    }
}

static void *worker_main(void *arg)
{
    const int w = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    /* Not pool.generation: a job may have been posted before this thread
     * first got the lock, and it must not be skipped. */
    unsigned long seen = pool.born[w];
    for (;;) {
        if (pool.generation == seen) {
            pthread_mutex_unlock(&pool.lock);
            spin_for_job(seen);
            pthread_mutex_lock(&pool.lock);
        }
        while (pool.generation == seen)
            pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        job *j = pool.open;
        if (j && w <= pool.max_worker) {
            pool.busy++;
            pthread_mutex_unlock(&pool.lock);
            run_items(j, w);
            pthread_mutex_lock(&pool.lock);
            if (--pool.busy == 0)
                pthread_cond_signal(&pool.idle);
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
    pthread_cond_init(&pool.idle, NULL);
    pool.started = 0;
    pool.open = NULL;
    pool.busy = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) { pthread_atfork(NULL, NULL, reset_in_child); }

/* Start workers up to index `want - 1`; returns how many threads can take
 * part (1 + started workers).  Called with pool.owner held. */
static int ensure_workers(int want)
{
    pthread_once(&atfork_once, install_atfork);
    while (pool.started + 1 < want) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_mutex_lock(&pool.lock);
        pool.born[pool.started + 1] = pool.generation;
        const int ok = pthread_create(&tid, &attr, worker_main,
                                      (void *)(intptr_t)(pool.started + 1)) == 0;
        if (ok) {
            pool.started++;
            pool.tid[pool.started] = tid;
            if (pool.started < pinned)
                place_worker(pool.started);
        }
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

#ifdef SA_PARALLEL_OPENMP
/* A copy of the core built into a host that runs its own threads with
 * OpenMP (llama.cpp's CPU backend; scripts/build-llama-backend.sh builds
 * the ggml backend this way when the host's ggml links libgomp): the items
 * run on the host's OpenMP team.  Its threads spin for a while after each
 * of the host's parallel regions, so between two of them (where the ggml
 * backend computes) the pool's workers would compete with them for the
 * cores, and the caller would wait on a worker preempted inside an item.
 * Items are claimed as the pool claims them: no result changes. */
static void run_team(job *j, int n_workers)
{
#pragma omp parallel num_threads(n_workers)
    run_items(j, omp_get_thread_num());
}
#endif

int sa_parallel_for(int n_items, int n_workers, sa_item_fn fn, void *ctx)
{
    n_workers = sa_workers_for(n_items, n_workers);
    int *status = calloc((size_t)(n_items > 0 ? n_items : 1), sizeof *status);
    if (!status)
        return SA_ERR_NOMEM;
    job j = {fn, ctx, n_items, 0, status};

#ifdef SA_PARALLEL_OPENMP
    if (n_workers > 1) {
        run_team(&j, n_workers);
    } else
#endif
    if (n_workers > 1 && pthread_mutex_trylock(&pool.owner) == 0) {
        const int helpers = sa_min(n_workers, ensure_workers(n_workers)) - 1;
        if (helpers > 0) {
            pthread_mutex_lock(&pool.lock);
            pool.open = &j;
            pool.max_worker = helpers;
            pool.generation++;
            pthread_cond_broadcast(&pool.wake);
            pthread_mutex_unlock(&pool.lock);
        }
        run_items(&j, 0);
        if (helpers > 0) {
            /* Close the job to late workers; wait only for those inside it
             * (each is finishing an item it claimed). */
            pthread_mutex_lock(&pool.lock);
            pool.open = NULL;
            if (pool.busy > 0) {
                pthread_mutex_unlock(&pool.lock);
                spin_for_idle();
                pthread_mutex_lock(&pool.lock);
            }
            while (pool.busy > 0)
                pthread_cond_wait(&pool.idle, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        pthread_mutex_unlock(&pool.owner);
    } else {
        run_items(&j, 0);
    }
    int rc = SA_OK;
    for (int i = 0; i < n_items && rc == SA_OK; i++)
        rc = status[i];
    free(status);
    return rc;
}
