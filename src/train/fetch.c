/* The parameter-offload fetch worker (dp.h, fl_fetch_*): one thread that copies a unit's piece out of the
 * offload tier (the host tier or the NVMe files) into the buffer its gather will read, while the model computes
 * the unit before it. Why a thread and not only MADV_WILLNEED: the read-ahead hint starts the disk, but the copy
 * itself (the page faults of a file mapping, the memcpy) ran on the model's thread when the next unit was posted,
 * right before this unit's compute, so nothing overlapped; here the model's thread posts the job and goes on.
 *
 * Jobs are served in the order they are posted (FIFO); fl_fetch_wait blocks until the job is done. A job copies
 * bytes and nothing else (no pool, no backend, no collective), so the bytes that arrive are the bytes the
 * synchronous copy would have moved: the overlap changes when a copy happens, never what it copies. The caller
 * owns the job (it lives until it is waited for) and the two buffers (neither touched by the model until then).
 * A job may instead run a function (fl_fetch_post_run: a unit's host optimizer update, fsdp.c): it runs in the same
 * FIFO, so a fetch posted after it waits for it, and its status and error message come back in the job. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dp.h"

struct fl_fetch {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    fl_fetch_job *head, *tail; /* queued, not yet started */
    int stop;
};

static pthread_mutex_t g_count_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long g_count; /* copies done by every worker of the process (the tests' evidence that it ran) */
static unsigned long g_runs;  /* functions run (fl_fetch_post_run) */

unsigned long fl_fetch_count(void) {
    pthread_mutex_lock(&g_count_mu);
    unsigned long n = g_count;
    pthread_mutex_unlock(&g_count_mu);
    return n;
}

unsigned long fl_fetch_run_count(void) {
    pthread_mutex_lock(&g_count_mu);
    unsigned long n = g_runs;
    pthread_mutex_unlock(&g_count_mu);
    return n;
}

static void *worker(void *arg) {
    fl_fetch *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->head && !w->stop) pthread_cond_wait(&w->work, &w->mu);
        if (!w->head) break; /* stopping, nothing left */
        fl_fetch_job *j = w->head;
        w->head = j->next;
        if (!w->head) w->tail = NULL;
        pthread_mutex_unlock(&w->mu);
        if (j->run) { /* a unit's optimizer update (fsdp.c): its status and message travel back in the job */
            j->st = j->run(j->ud);
            if (j->st != FL_OK) snprintf(j->msg, sizeof j->msg, "%s", fl_error_message());
        } else if (j->bytes) {
            memcpy(j->dst, j->src, j->bytes);
        }
        pthread_mutex_lock(&g_count_mu);
        g_count += j->run == NULL;
        g_runs += j->run != NULL;
        pthread_mutex_unlock(&g_count_mu);
        pthread_mutex_lock(&w->mu);
        j->state = 2;
        pthread_cond_broadcast(&w->done);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

fl_status fl_fetch_start(fl_fetch **out) {
    *out = NULL;
    fl_fetch *w = calloc(1, sizeof *w);
    if (!w) return fl_errorf(FL_ERR_OOM, "parameter offload: the fetch worker: out of host memory");
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->work, NULL);
    pthread_cond_init(&w->done, NULL);
    if (pthread_create(&w->th, NULL, worker, w) != 0) {
        pthread_cond_destroy(&w->done), pthread_cond_destroy(&w->work), pthread_mutex_destroy(&w->mu);
        free(w);
        return fl_errorf(FL_ERR_IO, "parameter offload: cannot start the fetch worker thread");
    }
    *out = w;
    return FL_OK;
}

static void enqueue(fl_fetch *w, fl_fetch_job *j) {
    pthread_mutex_lock(&w->mu);
    j->state = 1;
    if (w->tail) w->tail->next = j;
    else w->head = j;
    w->tail = j;
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->mu);
}

void fl_fetch_post(fl_fetch *w, fl_fetch_job *j, void *dst, const void *src, size_t bytes) {
    j->dst = dst, j->src = src, j->bytes = bytes, j->next = NULL, j->run = NULL, j->ud = NULL;
    enqueue(w, j);
}

void fl_fetch_post_run(fl_fetch *w, fl_fetch_job *j, fl_status (*run)(void *ud), void *ud) {
    j->dst = NULL, j->src = NULL, j->bytes = 0, j->next = NULL, j->run = run, j->ud = ud, j->st = FL_OK;
    j->msg[0] = '\0';
    enqueue(w, j);
}

void fl_fetch_wait(fl_fetch *w, fl_fetch_job *j) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    while (j->state == 1) pthread_cond_wait(&w->done, &w->mu);
    j->state = 0;
    pthread_mutex_unlock(&w->mu);
}

int fl_fetch_posted(fl_fetch *w, const fl_fetch_job *j) {
    pthread_mutex_lock(&w->mu); /* the worker writes the state: read it under the lock */
    const int posted = j->state != 0;
    pthread_mutex_unlock(&w->mu);
    return posted;
}

int fl_fetch_done(fl_fetch *w, const fl_fetch_job *j) {
    pthread_mutex_lock(&w->mu);
    const int done = j->state == 2;
    pthread_mutex_unlock(&w->mu);
    return done;
}

void fl_fetch_stop(fl_fetch *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1; /* the queued jobs still run: their buffers are the caller's until waited for */
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->th, NULL);
    pthread_cond_destroy(&w->done), pthread_cond_destroy(&w->work), pthread_mutex_destroy(&w->mu);
    free(w);
}
