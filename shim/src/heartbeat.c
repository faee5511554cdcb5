/* The dispatcher's heartbeat (see heartbeat.h). One mutex: add and remove take it, and the
 * thread holds it while it writes, so no beat lands in a region after its removal. */
#define _GNU_SOURCE
#include "heartbeat.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "native.h"
#include "wire.h"

#define API __attribute__((visibility("default")))

struct gl_heart {
    pthread_mutex_t lock;
    pthread_cond_t stopped;
    pthread_t thread;
    int stop;
    uint64_t period_ns;
    uint8_t *regions[GL_BEAT_MAX_REGIONS];
};

static void *run(void *arg) {
    gl_heart *h = arg;
    pthread_mutex_lock(&h->lock);
    while (!h->stop) {
        uint64_t now = now_ns();
        for (int i = 0; i < GL_BEAT_MAX_REGIONS; i++)
            if (h->regions[i] != NULL) store64(h->regions[i], GL_OFF_BEAT, now);
        uint64_t next = now + h->period_ns;
        struct timespec until = {.tv_sec = (time_t)(next / 1000000000u),
                                 .tv_nsec = (long)(next % 1000000000u)};
        pthread_cond_timedwait(&h->stopped, &h->lock, &until);
    }
    pthread_mutex_unlock(&h->lock);
    return NULL;
}

API gl_heart *gl_heart_start(uint64_t period_ns) {
    if (period_ns == 0) {
        errno = EINVAL;
        return NULL;
    }
    gl_heart *h = calloc(1, sizeof *h);
    if (h == NULL) return NULL;
    h->period_ns = period_ns;
    pthread_mutex_init(&h->lock, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC); /* the clock the shims compare with */
    pthread_cond_init(&h->stopped, &attr);
    pthread_condattr_destroy(&attr);
    int error = pthread_create(&h->thread, NULL, run, h);
    if (error != 0) {
        pthread_cond_destroy(&h->stopped);
        pthread_mutex_destroy(&h->lock);
        free(h);
        errno = error;
        return NULL;
    }
    return h;
}

API int gl_heart_add(gl_heart *h, int region_fd) {
    if (h == NULL || region_fd < 0) {
        errno = EINVAL;
        return -1;
    }
    void *mapped = mmap(NULL, GL_REGION_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, region_fd, 0);
    if (mapped == MAP_FAILED) return -1;
    pthread_mutex_lock(&h->lock);
    int slot = -1;
    for (int i = 0; i < GL_BEAT_MAX_REGIONS && slot < 0; i++)
        if (h->regions[i] == NULL) slot = i;
    if (slot >= 0) {
        store64(mapped, GL_OFF_BEAT, now_ns());
        h->regions[slot] = mapped;
    }
    pthread_mutex_unlock(&h->lock);
    if (slot < 0) {
        munmap(mapped, GL_REGION_BYTES);
        errno = ENOSPC;
    }
    return slot;
}

API void gl_heart_remove(gl_heart *h, int slot) {
    if (h == NULL || slot < 0 || slot >= GL_BEAT_MAX_REGIONS) return;
    pthread_mutex_lock(&h->lock);
    uint8_t *mapped = h->regions[slot];
    h->regions[slot] = NULL;
    pthread_mutex_unlock(&h->lock);
    if (mapped != NULL) munmap(mapped, GL_REGION_BYTES);
}

API void gl_heart_stop(gl_heart *h) {
    if (h == NULL) return;
    pthread_mutex_lock(&h->lock);
    h->stop = 1;
    pthread_cond_signal(&h->stopped);
    pthread_mutex_unlock(&h->lock);
    pthread_join(h->thread, NULL);
    for (int i = 0; i < GL_BEAT_MAX_REGIONS; i++)
        if (h->regions[i] != NULL) munmap(h->regions[i], GL_REGION_BYTES);
    pthread_cond_destroy(&h->stopped);
    pthread_mutex_destroy(&h->lock);
    free(h);
}
