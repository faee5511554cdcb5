/* FIKIT kernel admission, the shim's side (mode FIKIT; docs/fikit.md has the protocol).
 *
 * A holder launches at once: it bumps its sequence number and stamps the time, and only while
 * the arbiter sets `notify` (somebody waits, or fill kernels are in flight) also writes the
 * kernel ID, rings the GPU's doorbell and watches the kernel with an event like a grant. A
 * filler posts a request (kernel ID, time, waiting flag, then the sequence number), rings, and
 * sleeps on its grant word until the arbiter writes its sequence number there. After a granted
 * launch it records an event; the sequence number of the latest granted kernel known done goes
 * back to the arbiter, which bounds the fill work queued on the GPU with it.
 * Owns: g_fk_doorbell, g_fk_seq, the ring of granted kernels in flight and its event pool. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "admission.h"

#define FK_TRACKED 64 /* granted kernels in flight watched with events (more: not tracked) */

typedef struct {
    uint32_t seq;
    CUevent done;
} fk_flight;

static int g_fk_doorbell = -1; /* the GPU's eventfd; replaced on reconnection */
static uint32_t g_fk_seq;      /* atomic: the last sequence number posted */
static pthread_mutex_t g_fk_lock = PTHREAD_MUTEX_INITIALIZER;
/* Guarded by g_fk_lock: */
static fk_flight g_fk_ring[FK_TRACKED];
static unsigned g_fk_head, g_fk_count;
static uint32_t g_fk_done; /* the last `done` written */
static CUevent g_fk_pool[FK_TRACKED];
static int g_fk_pool_count;

static void ring_doorbell(void) {
    int fd = __atomic_load_n(&g_fk_doorbell, __ATOMIC_ACQUIRE);
    uint64_t one = 1;
    if (fd >= 0 && write(fd, &one, sizeof one) < 0) { /* a full counter: a wake-up is pending */
    }
}

static void pool_return(CUevent e) {
    if (g_fk_pool_count < FK_TRACKED) g_fk_pool[g_fk_pool_count++] = e;
}

void fikit_adopt(uint8_t *r, int doorbell) {
    pthread_mutex_lock(&g_fk_lock);
    int old = __atomic_exchange_n(&g_fk_doorbell, doorbell, __ATOMIC_ACQ_REL);
    if (old >= 0) close(old);
    /* A fresh region: sequence numbers go on from what it holds; the old connection's
     * kernels in flight are owed to nobody. */
    __atomic_store_n(&g_fk_seq, r ? r_u32(r, GL_OFF_FK_REQ_SEQ) : 0, __ATOMIC_RELEASE);
    g_fk_done = r ? r_u32(r, GL_OFF_FK_DONE) : 0;
    for (; g_fk_count > 0; g_fk_count--) {
        pool_return(g_fk_ring[g_fk_head].done);
        g_fk_head = (g_fk_head + 1) % FK_TRACKED;
    }
    pthread_mutex_unlock(&g_fk_lock);
}

int gpu_doorbell(void) { return __atomic_load_n(&g_fk_doorbell, __ATOMIC_ACQUIRE); }

unsigned fikit_harvest(void) {
    uint8_t *r = region();
    if (g_mode != GL_MODE_FIKIT || r == NULL || g_aux.event_query == NULL) return 0;
    pthread_mutex_lock(&g_fk_lock);
    uint32_t done = g_fk_done;
    while (g_fk_count > 0) {
        fk_flight *f = &g_fk_ring[g_fk_head];
        if (g_aux.event_query(f->done) == CUDA_ERROR_NOT_READY) break;
        done = f->seq; /* complete, or failed: either way it holds the GPU no longer */
        pool_return(f->done);
        g_fk_head = (g_fk_head + 1) % FK_TRACKED;
        g_fk_count--;
    }
    unsigned left = g_fk_count;
    int changed = done != g_fk_done;
    g_fk_done = done;
    pthread_mutex_unlock(&g_fk_lock);
    if (changed) {
        w_u32(r, GL_OFF_FK_DONE, done);
        ring_doorbell();
    }
    return left;
}

void fikit_track(CUstream key, uint32_t seq) {
    if (g_aux.event_create == NULL || g_aux.event_record == NULL) return;
    pthread_mutex_lock(&g_fk_lock);
    if (g_fk_count < FK_TRACKED) {
        CUevent e = NULL;
        if (g_fk_pool_count > 0)
            e = g_fk_pool[--g_fk_pool_count];
        else if (g_aux.event_create(&e, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
            e = NULL;
        if (e != NULL && g_aux.event_record(e, key) == CUDA_SUCCESS) {
            g_fk_ring[(g_fk_head + g_fk_count) % FK_TRACKED] = (fk_flight){seq, e};
            g_fk_count++;
        } else if (e != NULL) {
            pool_return(e);
        }
    }
    /* Untracked: the arbiter counts it done once a later granted kernel is reported done. */
    pthread_mutex_unlock(&g_fk_lock);
}

static uint64_t launch_kernel_id(const gl_launch *launch) {
    if (launch == NULL) return 0; /* a graph: one unit, no kernel ID */
    char name[GL_NAME_MAX];
    function_name(launch->f, name, sizeof name);
    return kernel_id(name, launch->dims);
}

/* A filler's wait, under the caller's lock: bounded by the arbiter's liveness (its heartbeat,
 * and the connection the background thread watches), not by the holder: waiting behind a
 * busy holder is the policy. */
static CUresult wait_grant(uint8_t *r, uint64_t kernel, uint32_t *granted_seq) {
    fikit_harvest();
    uint32_t seq = __atomic_add_fetch(&g_fk_seq, 1, __ATOMIC_RELAXED);
    w_u64(r, GL_OFF_FK_KERNEL, kernel);
    w_u64(r, GL_OFF_FK_POST_NS, now_ns());
    w_u32(r, GL_OFF_FK_WAITING, GL_POST_REQUEST);
    w_u32(r, GL_OFF_FK_REQ_SEQ, seq);
    ring_doorbell();
    uint64_t bound = (uint64_t)C.wait_ms * 1000000u;
    CUresult result = CUDA_SUCCESS;
    for (unsigned spins = 0;; spins++) {
        uint32_t granted = r_u32(r, GL_OFF_FK_GRANT);
        if (granted == seq) {
            *granted_seq = seq;
            loss_rearm();
            break;
        }
        if (conn_state() != CONN_CONNECTED) {
            result = on_loss("lost the dispatcher");
            break;
        }
        if (r_u32(r, GL_OFF_STATE) == GL_STATE_EVICTED) {
            result = on_loss("assignment evicted");
            break;
        }
        uint64_t now = now_ns(), beat = r_u64(r, GL_OFF_FK_BEAT);
        if (now > beat && now - beat > bound) {
            char why[128];
            snprintf(why, sizeof why,
                     "the FIKIT arbiter stopped answering (no heartbeat within "
                     "GPULOOM_SHIM_WAIT_MS=%d ms)",
                     C.wait_ms);
            result = on_loss(why);
            break;
        }
        if (spins < 256) { /* a grant into an open gap comes within microseconds */
            cpu_relax();
            continue;
        }
        /* Sleep; while own kernels are in flight, wake often to report their completion. */
        unsigned in_flight = fikit_harvest();
        struct timespec t = {.tv_sec = 0, .tv_nsec = in_flight ? 50000 : 5000000};
        syscall(SYS_futex, (uint32_t *)(r + GL_OFF_FK_GRANT), FUTEX_WAIT, granted, &t, NULL, 0);
    }
    w_u32(r, GL_OFF_FK_WAITING, GL_POST_LAUNCHED);
    return result;
}

CUresult fikit_admit(uint8_t *r, CUstream key, const gl_launch *launch, uint32_t *granted_seq,
                     pthread_mutex_t *wait_lock) {
    *granted_seq = 0;
    if (r_u32(r, GL_OFF_FK_ROLE) == GL_ROLE_HOLDER) {
        uint32_t seq = __atomic_add_fetch(&g_fk_seq, 1, __ATOMIC_RELAXED);
        w_u64(r, GL_OFF_FK_POST_NS, now_ns());
        if (LIKELY(r_u32(r, GL_OFF_FK_NOTIFY) == 0)) { /* alone: nobody needs more */
            w_u64(r, GL_OFF_FK_KERNEL, 0);
            w_u32(r, GL_OFF_FK_WAITING, GL_POST_LAUNCHED);
            w_u32(r, GL_OFF_FK_REQ_SEQ, seq);
            return CUDA_SUCCESS;
        }
        /* Shared: the arbiter predicts this kernel's gap and hears when it completes. */
        w_u64(r, GL_OFF_FK_KERNEL, launch_kernel_id(launch));
        w_u32(r, GL_OFF_FK_WAITING, GL_POST_TRACKED);
        w_u32(r, GL_OFF_FK_REQ_SEQ, seq);
        ring_doorbell();
        *granted_seq = seq;
        return CUDA_SUCCESS;
    }
    if (is_capturing(key)) return CUDA_SUCCESS; /* recorded, not run: never block */
    uint64_t kernel = launch_kernel_id(launch);
    pthread_mutex_lock(wait_lock);
    CUresult result = wait_grant(r, kernel, granted_seq);
    pthread_mutex_unlock(wait_lock);
    return result;
}
