/* Admission in share mode: asking the dispatcher for a lease (through the admission engine's
 * request words in the region, or a LeaseRequest frame; either carries the usage of the lease
 * that ended) and waiting for it on the region's epoch (a short spin, then FUTEX_WAIT), bounded
 * by GPULOOM_SHIM_WAIT_MS; mode FIKIT goes to fikit_gate.c (under policy composed after a
 * lease of its level, asked for the same way); what a
 * refused or evicted process's launches get (an error, whatever the loss policy) and a lost
 * one's (the loss policy); and suspension (SuspendClient): a suspended
 * process waits at its next launch (any mode) or allocation (memcap.c) until resumed, without
 * the GPULOOM_SHIM_WAIT_MS bound, while the dispatcher keeps renewing the suspension. The inline
 * fast check is admission.h's gate().
 * Owns: g_wait_lock, g_stall_epoch, g_stalled, g_last_request_ns, g_suspend_logged. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "admission.h"

static pthread_mutex_t g_wait_lock = PTHREAD_MUTEX_INITIALIZER; /* one waiter asks at a time */
/* Guarded by g_wait_lock: the last wait timed out at this epoch; when the last request went. */
static uint32_t g_stall_epoch;
static int g_stalled;
static uint64_t g_last_request_ns;
static int g_suspend_logged; /* atomic: a lapsed suspension was announced (once per episode) */

/* Through the admission engine when the dispatcher gave its doorbell (request words in the
 * region and the doorbell: no socket, no Python on the way), else a LeaseRequest frame on the
 * socket. Mode FIKIT under composed rings the same doorbell: one engine serves its kernels
 * and its level's leases. */
static int send_request(const uint8_t *r) {
    gl_usage usage;
    int has = take_report(r_u64(r, GL_OFF_LEASE_ID), 0, &usage);
    g_last_request_ns = now_ns();
    int doorbell = gpu_doorbell();
    if (doorbell >= 0)
        return gl_post_lease_request((uint8_t *)r, doorbell, has ? &usage : NULL,
                                     g_last_request_ns);
    return send_locked(gl_send_lease_request, has ? &usage : NULL);
}

static void futex_wait(const uint8_t *r, uint32_t seen, uint64_t timeout_ns) {
    struct timespec t = {.tv_sec = (time_t)(timeout_ns / 1000000000u),
                         .tv_nsec = (long)(timeout_ns % 1000000000u)};
    syscall(SYS_futex, (const uint32_t *)(r + GL_OFF_EPOCH), FUTEX_WAIT, seen, &t, NULL, 0);
}

/* The suspension's deadline (0 = none) as of now: one that has lapsed (the dispatcher stopped
 * renewing it) is announced once and no longer holds the process. */
static uint64_t suspended_until(const uint8_t *r, uint64_t now) {
    uint64_t until = r_u64(r, GL_OFF_SUSPEND_UNTIL);
    if (until == 0) return 0;
    if (now < until) return until;
    if (!__atomic_exchange_n(&g_suspend_logged, 1, __ATOMIC_ACQ_REL))
        say(LOG_WARN, "the dispatcher stopped renewing this process's suspension; running again");
    return 0;
}

void suspend_wait(const uint8_t *r) {
    if (suspended_until(r, now_ns()) == 0) return;
    trace("suspended");
    say(LOG_INFO, "suspended by the dispatcher; waiting to be resumed");
    for (;;) {
        /* Lost (the dispatcher died), evicted or re-registered: the usual paths decide. */
        if (conn_state() != CONN_CONNECTED || region() != r) break;
        if (r_u32(r, GL_OFF_STATE) == GL_STATE_EVICTED) break;
        uint32_t epoch = r_u32(r, GL_OFF_EPOCH);
        uint64_t now = now_ns(), until = suspended_until(r, now);
        if (until == 0) break;
        uint64_t left = until - now;
        futex_wait(r, epoch, left < 20000000u ? left : 20000000u);
    }
    if (r_u64(r, GL_OFF_SUSPEND_UNTIL) == 0) __atomic_store_n(&g_suspend_logged, 0, __ATOMIC_RELEASE);
    trace("resumed");
}

/* Called with g_wait_lock held. */
static CUresult wait_for_lease(const uint8_t *r) {
    uint64_t start = now_ns();
    if (start < r_u64(r, GL_OFF_ADMIT_UNTIL)) return CUDA_SUCCESS;
    uint32_t epoch = r_u32(r, GL_OFF_EPOCH);
    if (g_stalled && epoch == g_stall_epoch) {
        /* The dispatcher did not answer last time: do not wait again, ask now and then. */
        if (start - g_last_request_ns > 100000000u) send_request(r);
        return on_loss("the dispatcher grants no lease");
    }
    g_stalled = 0;
    uint64_t seen = r_u64(r, GL_OFF_LEASE_ID);
    if (send_request(r) != 0) return on_loss("lost the dispatcher");
    uint64_t deadline = start + (uint64_t)g_config.wait_ms * 1000000u;
    for (;;) {
        uint64_t now = now_ns();
        if (now < r_u64(r, GL_OFF_ADMIT_UNTIL)) {
            loss_rearm();
            return CUDA_SUCCESS;
        }
        if (r_u32(r, GL_OFF_STATE) == GL_STATE_EVICTED) return on_refusal("assignment evicted");
        if (conn_state() != CONN_CONNECTED) return on_loss("lost the dispatcher");
        if (UNLIKELY(r_u64(r, GL_OFF_SUSPEND_UNTIL) != 0) && suspended_until(r, now) != 0) {
            /* Suspended while waiting: the dispatcher dropped the request. Wait unbounded, then
             * ask again with a fresh bound. */
            suspend_wait(r);
            if (conn_state() != CONN_CONNECTED) return on_loss("lost the dispatcher");
            start = now_ns();
            deadline = start + (uint64_t)g_config.wait_ms * 1000000u;
            seen = r_u64(r, GL_OFF_LEASE_ID);
            epoch = r_u32(r, GL_OFF_EPOCH);
            if (start < r_u64(r, GL_OFF_ADMIT_UNTIL)) continue;
            if (send_request(r) != 0) return on_loss("lost the dispatcher");
            continue;
        }
        uint64_t lease = r_u64(r, GL_OFF_LEASE_ID);
        if (lease != 0 && lease != seen) {
            /* A lease came and went before we looked: report it (unused) and ask again. */
            seen = lease;
            if (send_request(r) != 0) return on_loss("lost the dispatcher");
        }
        if (now >= deadline) {
            g_stalled = 1;
            g_stall_epoch = r_u32(r, GL_OFF_EPOCH);
            loss_rearm();
            char why[96];
            snprintf(why, sizeof why, "no lease within GPULOOM_SHIM_WAIT_MS=%d ms", g_config.wait_ms);
            return on_loss(why);
        }
        if (now - start < 50000u) { /* a grant usually comes within tens of microseconds */
            cpu_relax();
            continue;
        }
        uint64_t left = deadline - now;
        futex_wait(r, epoch, left < 20000000u ? left : 20000000u);
        epoch = r_u32(r, GL_OFF_EPOCH);
    }
}

CUresult gate_slow(CUstream key, const gl_launch *launch, uint32_t *granted_seq) {
    int state = conn_state();
    if (state == CONN_REFUSED) return on_refusal("the dispatcher refused this process");
    if (state == CONN_EVICTED) return on_refusal("assignment evicted");
    /* A region stays mapped once a registration gave one: this process had a dispatcher. (The
     * background thread says so too, but a fail-closed process may exit before it does.) */
    if (state != CONN_CONNECTED) return on_loss(region() ? "lost the dispatcher" : "no dispatcher");
    /* Read after the state: a registration publishes its region before CONN_CONNECTED, so
     * this is never NULL (the fast check's copy may predate a first, late registration). */
    const uint8_t *r = region();
    if (r_u32(r, GL_OFF_STATE) == GL_STATE_EVICTED) return on_refusal("assignment evicted");
    /* Suspended: held here in every mode (not on a capturing stream: recorded, not run). */
    if (UNLIKELY(r_u64(r, GL_OFF_SUSPEND_UNTIL) != 0) && !is_capturing(key)) {
        suspend_wait(r);
        state = conn_state();
        if (state != CONN_CONNECTED) return on_loss("lost the dispatcher");
        r = region();
        if (r_u32(r, GL_OFF_STATE) == GL_STATE_EVICTED) return on_refusal("assignment evicted");
    }
    if (dispatcher_silent(r, now_ns())) {
        char why[128];
        snprintf(why, sizeof why,
                 "the dispatcher stopped beating (no heartbeat within %llu ms: hung)",
                 (unsigned long long)(g_config.alive_ns / 1000000u));
        return on_loss(why);
    }
    if (g_mode == GL_MODE_FIKIT) {
        /* Policy composed: first a lease of its priority level (its quota), then the arbiter
         * (priority across levels). Not on a capturing stream: recorded, not run. A lease
         * held (wait_for_lease's own first check) costs no lock and no driver call. */
        if (g_leased && now_ns() >= r_u64(r, GL_OFF_ADMIT_UNTIL) && !is_capturing(key)) {
            pthread_mutex_lock(&g_wait_lock);
            CUresult leased = wait_for_lease(r);
            pthread_mutex_unlock(&g_wait_lock);
            if (leased != CUDA_SUCCESS) return leased;
        }
        return fikit_admit((uint8_t *)r, key, launch, granted_seq, &g_wait_lock);
    }
    if (g_mode != GL_MODE_SHARE) return CUDA_SUCCESS;
    if (is_capturing(key)) return CUDA_SUCCESS; /* recorded, not run: never block */
    pthread_mutex_lock(&g_wait_lock);
    CUresult result = wait_for_lease(r);
    pthread_mutex_unlock(&g_wait_lock);
    return result;
}
