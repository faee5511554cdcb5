/* The admission engine's thread (see engine.h and docs/dispatcher.md).
 *
 * One round: the lease half first (a renewed shim wakes and may post its kernel at once), then
 * the FIKIT half. The thread sleeps on the doorbell until the next ring or the FIKIT half's
 * next timed round (its heartbeat cadence, or the core's wake-up time). Every call from Python
 * takes the same mutex, so the two halves and the dispatcher never see each other mid-way. */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "native.h"

#define API __attribute__((visibility("default")))

struct gl_engine {
    pthread_mutex_t lock;
    pthread_t thread;
    int stop;
    int doorbell;
    gl_desk *leases;
    gl_arbiter *fikit;
};

/* Sleeps on the doorbell until `until` (or a ring). A ring between the round and the poll
 * stays counted in the eventfd: not lost. */
static void sleep_on_doorbell(gl_engine *e, uint64_t now, uint64_t until) {
    uint64_t wait = until > now ? until - now : 0;
    struct timespec timeout = {.tv_sec = (time_t)(wait / 1000000000u),
                               .tv_nsec = (long)(wait % 1000000000u)};
    struct pollfd p = {.fd = e->doorbell, .events = POLLIN};
    if (wait > 0 && ppoll(&p, 1, &timeout, NULL) > 0) {
        uint64_t count;
        if (read(e->doorbell, &count, sizeof count) < 0) { /* drained by another read */
        }
    }
}

static void *run(void *arg) {
    gl_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->lock);
        if (e->stop) {
            pthread_mutex_unlock(&e->lock);
            return NULL;
        }
        uint64_t now = now_ns();
        gl_desk_round(e->leases, now);
        gl_arbiter_round(e->fikit, now);
        uint64_t until = gl_arbiter_next_round(e->fikit);
        pthread_mutex_unlock(&e->lock);
        sleep_on_doorbell(e, now_ns(), until);
    }
}

static void ring(gl_engine *e) { ring_eventfd(e->doorbell); }

API gl_engine *gl_engine_start(const gl_fk_config *config, int doorbell_fd, int notify_fd,
                               uint64_t beat_ns, const gl_sp_config *harvest) {
    if (config == NULL || doorbell_fd < 0 || notify_fd < 0 || beat_ns == 0) {
        errno = EINVAL;
        return NULL;
    }
    gl_engine *e = calloc(1, sizeof *e);
    if (e == NULL) return NULL;
    e->doorbell = doorbell_fd;
    e->leases = gl_desk_new(notify_fd);
    e->fikit = e->leases == NULL ? NULL : gl_arbiter_new(config, beat_ns, harvest);
    if (e->fikit == NULL) {
        int error = errno;
        gl_desk_free(e->leases);
        free(e);
        errno = error;
        return NULL;
    }
    pthread_mutex_init(&e->lock, NULL);
    int error = pthread_create(&e->thread, NULL, run, e);
    if (error != 0) {
        pthread_mutex_destroy(&e->lock);
        gl_arbiter_free(e->fikit);
        gl_desk_free(e->leases);
        free(e);
        errno = error;
        return NULL;
    }
    pthread_setname_np(e->thread, "gl-engine"); /* so top -H and perf name it */
    return e;
}

API void gl_engine_stop(gl_engine *e) {
    if (e == NULL) return;
    pthread_mutex_lock(&e->lock);
    e->stop = 1;
    pthread_mutex_unlock(&e->lock);
    ring(e);
    pthread_join(e->thread, NULL);
    gl_arbiter_free(e->fikit);
    gl_desk_free(e->leases);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

/* ---- kernels ---- */

API int gl_engine_board_fd(gl_engine *e, uint32_t priority, int writable) {
    if (e == NULL) {
        errno = EINVAL;
        return -1;
    }
    /* The descriptors are fixed from the start to the stop: no lock needed. */
    return gl_arbiter_board_fd(e->fikit, priority, writable);
}

API int gl_engine_add_task(gl_engine *e, int region_fd, uint32_t priority, uint32_t sm_percent,
                           const gl_kernel_table *kernels) {
    pthread_mutex_lock(&e->lock);
    int slot = gl_arbiter_add_task(e->fikit, region_fd, priority, sm_percent, kernels);
    int error = errno;
    pthread_mutex_unlock(&e->lock);
    if (slot >= 0) ring(e); /* the others' roles may change */
    errno = error;
    return slot;
}

API int gl_engine_set_kernels(gl_engine *e, int slot, const gl_kernel_table *kernels) {
    pthread_mutex_lock(&e->lock);
    int result = gl_arbiter_set_kernels(e->fikit, slot, kernels);
    int error = errno;
    pthread_mutex_unlock(&e->lock);
    errno = error;
    return result;
}

API void gl_engine_remove_task(gl_engine *e, int slot) {
    pthread_mutex_lock(&e->lock);
    gl_arbiter_remove_task(e->fikit, slot);
    pthread_mutex_unlock(&e->lock);
    ring(e); /* the others' roles may change */
}

API int gl_engine_set_suspended(gl_engine *e, int slot, int on) {
    pthread_mutex_lock(&e->lock);
    int result = gl_arbiter_set_suspended(e->fikit, slot, on);
    pthread_mutex_unlock(&e->lock);
    ring(e);
    return result;
}

API int gl_engine_set_harvesting(gl_engine *e, int on) {
    pthread_mutex_lock(&e->lock);
    int result = gl_arbiter_set_harvesting(e->fikit, on);
    pthread_mutex_unlock(&e->lock);
    return result;
}

API void gl_engine_fikit_stats(gl_engine *e, gl_arbiter_stats *out) {
    pthread_mutex_lock(&e->lock);
    gl_arbiter_get_stats(e->fikit, out);
    pthread_mutex_unlock(&e->lock);
}

API void gl_engine_core_counters(gl_engine *e, gl_fk_counters *out) {
    pthread_mutex_lock(&e->lock);
    gl_arbiter_get_core_counters(e->fikit, out);
    pthread_mutex_unlock(&e->lock);
}

/* ---- leases ---- */

API int gl_engine_lease_add(gl_engine *e, int region_fd) {
    pthread_mutex_lock(&e->lock);
    int slot = gl_desk_add(e->leases, region_fd);
    int error = errno;
    pthread_mutex_unlock(&e->lock);
    errno = error;
    return slot;
}

API void gl_engine_lease_remove(gl_engine *e, int slot) {
    pthread_mutex_lock(&e->lock);
    gl_desk_remove(e->leases, slot);
    pthread_mutex_unlock(&e->lock);
}

API int gl_engine_set_terms(gl_engine *e, int slot, const gl_desk_terms *terms) {
    pthread_mutex_lock(&e->lock);
    int result = gl_desk_set_terms(e->leases, slot, terms);
    int error = errno;
    pthread_mutex_unlock(&e->lock);
    errno = error;
    return result;
}

API void gl_engine_revoke_all(gl_engine *e) {
    pthread_mutex_lock(&e->lock);
    gl_desk_revoke_all(e->leases);
    pthread_mutex_unlock(&e->lock);
}

API uint32_t gl_engine_take(gl_engine *e, gl_desk_event *out, uint32_t max) {
    int rescan = 0;
    pthread_mutex_lock(&e->lock);
    uint32_t n = gl_desk_take(e->leases, out, max, &rescan);
    pthread_mutex_unlock(&e->lock);
    if (rescan) ring(e); /* the requests left unread are read now */
    return n;
}

API void gl_engine_lease_stats(gl_engine *e, gl_desk_stats *out) {
    pthread_mutex_lock(&e->lock);
    gl_desk_get_stats(e->leases, out);
    pthread_mutex_unlock(&e->lock);
}
