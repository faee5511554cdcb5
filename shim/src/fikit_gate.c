/* FIKIT kernel admission, the shim's side (mode FIKIT; docs/fikit.md has the protocol).
 *
 * A holder launches at once: it bumps its sequence number and stamps the time, and only while
 * the arbiter sets `notify` (somebody waits, or fill kernels are in flight) also writes the
 * kernel ID, rings the GPU's doorbell and watches the kernel with an event like a grant (whose
 * end rings nothing: the arbiter takes a holder's ends in its timed rounds only). A
 * filler posts a request (kernel ID, time, waiting flag, then the sequence number), rings, and
 * sleeps on its grant word until the arbiter writes its sequence number there. After a granted
 * launch it records an event; the sequence number of the latest granted kernel known done goes
 * back to the arbiter, which bounds the fill work queued on the GPU with it.
 * One wake-up (docs/fikit.md, "The holder's launch releases the filler"): when the arbiter has
 * armed the holder (a nonce and the kernel IDs that fire it), the holder's launch of one of
 * them writes the nonce into its priority board and wakes the board; a filler armed with that
 * nonce, asleep on the board too, goes at once, and says so in its region.
 * Owns: g_fk_doorbell, g_fk_seq, the boards, the ring of granted kernels in flight and its
 * event pool. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "admission.h"
#include "fill_wait.h"

#define FK_TRACKED 64 /* granted kernels in flight watched with events (more: not tracked) */

typedef struct {
    uint32_t seq;
    CUevent done;
    int quiet; /* a holder's launch: its end rings no doorbell */
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
/* The priority boards, at fixed addresses once mapped (a reconnection moves the new mappings
 * onto them); g_fk_board_count (atomic) of them are this registration's, the last one its own
 * (read-write). */
static uint8_t *g_fk_boards[GL_BOARDS];
static uint32_t g_fk_board_count;
static uint64_t g_fk_fired;    /* atomic: the arm this holder fired last (never twice) */
static uint64_t g_fk_released; /* under the wait lock: the arm this filler went by last */
static int g_fk_ring_after;    /* atomic: a board release whose launch rings the doorbell */
static __thread uint32_t t_fk_quiet_seq; /* this thread's holder launch posted without a ring */
/* This thread's holder launch that opens a window: it fires or rings after the real launch. */
static __thread uint32_t t_fk_open_seq;
static __thread uint64_t t_fk_open_kernel;

static void ring_doorbell(void) {
    int fd = __atomic_load_n(&g_fk_doorbell, __ATOMIC_ACQUIRE);
    uint64_t one = 1;
    if (fd >= 0 && write(fd, &one, sizeof one) < 0) { /* a full counter: a wake-up is pending */
    }
}

static void pool_return(CUevent e) {
    if (g_fk_pool_count < FK_TRACKED) g_fk_pool[g_fk_pool_count++] = e;
}

static void adopt_boards(gl_registration *reg) {
    __atomic_store_n(&g_fk_board_count, 0, __ATOMIC_RELEASE);
    uint32_t count = 0;
    for (uint32_t i = 0; reg != NULL && i < reg->board_count && i < GL_BOARDS; i++) {
        void *fresh = (void *)reg->boards[i];
        reg->boards[i] = NULL;
        if (g_fk_boards[i] == NULL) {
            g_fk_boards[i] = fresh;
        } else if (mremap(fresh, GL_BOARD_BYTES, GL_BOARD_BYTES, MREMAP_MAYMOVE | MREMAP_FIXED,
                          g_fk_boards[i]) == MAP_FAILED) {
            munmap(fresh, GL_BOARD_BYTES);
            break;
        }
        count = i + 1;
    }
    if (reg != NULL) gl_unmap_boards(reg); /* any not taken */
    if (reg != NULL && count == reg->priority + 1)
        __atomic_store_n(&g_fk_board_count, count, __ATOMIC_RELEASE);
}

void fikit_adopt(uint8_t *r, int doorbell, gl_registration *reg) {
    pthread_mutex_lock(&g_fk_lock);
    adopt_boards(reg);
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
    int loud = 0;
    while (g_fk_count > 0) {
        fk_flight *f = &g_fk_ring[g_fk_head];
        if (g_aux.event_query(f->done) == CUDA_ERROR_NOT_READY) break;
        done = f->seq; /* complete, or failed: either way it holds the GPU no longer */
        loud |= !f->quiet;
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
        /* A holder's ends wait for the arbiter's next timed round, the only one that takes
         * them; a fill kernel's end rings (it may let the next fill go). */
        if (loud) ring_doorbell();
    }
    return left;
}

static int fire_arm(uint8_t *r, uint64_t kernel);

void fikit_after_launch(CUstream key, uint32_t seq, int launched) {
    /* A holder's kernel ends without a ring: the arbiter takes a holder's completions only in
     * its timed rounds (shim/src/arbiter.c), so a ring would wake it for a round that cannot
     * use them, on the holder's path from its kernel's end to its next launch. */
    int holder = seq == t_fk_quiet_seq || seq == t_fk_open_seq;
    if (seq == t_fk_open_seq) {
        /* Only now may a filler go: its kernel must reach the GPU behind this one, not race
         * it there (a fill launched first would run first, and the holder would wait). */
        t_fk_open_seq = 0;
        uint8_t *r = region();
        if (r == NULL || !launched || !fire_arm(r, t_fk_open_kernel)) ring_doorbell();
    }
    if (launched) fikit_track(key, seq, holder);
    /* Released by the holder's fire: the arbiter hears of it now, after the launch. */
    if (__atomic_exchange_n(&g_fk_ring_after, 0, __ATOMIC_ACQ_REL)) ring_doorbell();
}

void fikit_track(CUstream key, uint32_t seq, int quiet) {
    if (g_aux.event_create == NULL || g_aux.event_record == NULL) return;
    pthread_mutex_lock(&g_fk_lock);
    if (g_fk_count < FK_TRACKED) {
        CUevent e = NULL;
        if (g_fk_pool_count > 0)
            e = g_fk_pool[--g_fk_pool_count];
        else if (g_aux.event_create(&e, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
            e = NULL;
        if (e != NULL && g_aux.event_record(e, key) == CUDA_SUCCESS) {
            g_fk_ring[(g_fk_head + g_fk_count) % FK_TRACKED] = (fk_flight){seq, e, quiet};
            g_fk_count++;
        } else if (e != NULL) {
            pool_return(e);
        }
    }
    /* Untracked: the arbiter counts it done once a later granted kernel is reported done. */
    pthread_mutex_unlock(&g_fk_lock);
}

/* The holder's side of an arm: a launch of one of the armed kernels writes the arm's nonce
 * into this priority's board and wakes the fillers asleep on it (one wake-up, no arbiter in
 * between). The arbiter learns of it from the board, after the fact. */
static int fire_arm(uint8_t *r, uint64_t kernel) {
    uint64_t nonce = r_u64(r, GL_OFF_FK_ARM);
    uint32_t boards = __atomic_load_n(&g_fk_board_count, __ATOMIC_ACQUIRE);
    if (nonce == 0 || kernel == 0 || boards == 0 ||
        nonce == __atomic_load_n(&g_fk_fired, __ATOMIC_RELAXED))
        return 0;
    int match = 0;
    for (int k = 0; k < GL_ARM_KERNELS; k++)
        match |= r_u64(r, GL_OFF_FK_ARM_KERNELS + 8 * k) == kernel;
    /* The kernels must be this nonce's: the arbiter writes them before it. */
    if (!match || r_u64(r, GL_OFF_FK_ARM) != nonce) return 0;
    if (__atomic_exchange_n(&g_fk_fired, nonce, __ATOMIC_ACQ_REL) == nonce) return 0;
    uint8_t *board = g_fk_boards[boards - 1];
    w_u64(board, GL_BOARD_FIRED, nonce);
    __atomic_add_fetch((uint32_t *)(board + GL_BOARD_LAUNCH), 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, (uint32_t *)(board + GL_BOARD_LAUNCH), FUTEX_WAKE, INT_MAX, NULL, NULL,
            0);
    if (UNLIKELY(g_config.trace_fd >= 0)) trace("fikit fire %016llx", (unsigned long long)kernel);
    return 1;
}

/* Whether the arbiter needs this holder launch at once: a kernel of the published
 * window-opening list, a graph without an ID, or any launch while the list is not complete. */
static int opens_window(const uint8_t *r, uint64_t kernel) {
    if (r_u32(r, GL_OFF_FK_OPENERS_ALL) != 1 || kernel == 0) return 1;
    for (int k = 0; k < GL_ARM_KERNELS; k++)
        if (r_u64(r, GL_OFF_FK_OPENERS + 8 * k) == kernel) return 1;
    return 0;
}

static uint64_t launch_kernel_id(const gl_launch *launch) {
    if (launch->f == NULL) return launch->graph; /* a graph: one unit, its own ID */
    return function_kernel_id(launch->f, launch->dims);
}

/* The board the filler's arm names, if the arm is for this request (its sequence number, and
 * for an arm given ahead its kernel) and the board one of this registration's better
 * priorities (read-only to this process); NULL otherwise. */
static uint8_t *armed_board(uint8_t *r, uint32_t seq, uint64_t kernel, uint64_t *nonce) {
    *nonce = r_u64(r, GL_OFF_FK_ARMED);
    uint32_t index = r_u32(r, GL_OFF_FK_ARM_BOARD);
    uint32_t boards = __atomic_load_n(&g_fk_board_count, __ATOMIC_ACQUIRE);
    if (*nonce == 0 || *nonce == g_fk_released || boards == 0 || index >= boards - 1 ||
        r_u32(r, GL_OFF_FK_ARMED_SEQ) != seq)
        return NULL;
    int any = 0, match = 0;
    for (int k = 0; k < GL_ARM_KERNELS; k++) {
        uint64_t allowed = r_u64(r, GL_OFF_FK_ARMED_KERNELS + 8 * k);
        any |= allowed != 0;
        match |= allowed != 0 && allowed == kernel;
    }
    if (any && !match) return NULL;
    /* The arm's words are the nonce's: the arbiter writes them before it. */
    if (r_u64(r, GL_OFF_FK_ARMED) != *nonce) return NULL;
    return g_fk_boards[index];
}

#define FK_SPURIOUS_MAX 64 /* board wake-ups without a release before a wait stops watching it */

/* A filler's wait, under the caller's lock: bounded by the arbiter's liveness (its heartbeat,
 * and the connection the background thread watches), not by the holder: waiting behind a
 * busy holder is the policy. It ends with the grant, or earlier with the holder's launch that
 * fires the arm the arbiter gave this request. */
static CUresult wait_grant(uint8_t *r, uint64_t kernel, uint32_t *granted_seq) {
    fikit_harvest();
    uint32_t seq = __atomic_add_fetch(&g_fk_seq, 1, __ATOMIC_RELAXED);
    /* An arm given ahead that the holder fired before this request is posted does not release
     * it: the window it was decided for has been running since (the arbiter decides). Read
     * before the post, not after: a fire between the post and a later read (the doorbell's
     * write lies between, and may hand the CPU to the arbiter) released this request, and
     * taken for stale it left the request waiting for a grant with nothing to wake the
     * arbiter until its next timed round or ring (docs/benchmarks.md, "Kernel admission"). */
    uint64_t stale = 0;
    uint8_t *posted_board = armed_board(r, seq, kernel, &stale);
    if (posted_board == NULL || r_u64(posted_board, GL_BOARD_FIRED) != stale) stale = 0;
    w_u64(r, GL_OFF_FK_KERNEL, kernel);
    w_u64(r, GL_OFF_FK_POST_NS, now_ns());
    w_u32(r, GL_OFF_FK_WAITING, GL_POST_REQUEST);
    w_u32(r, GL_OFF_FK_REQ_SEQ, seq);
    ring_doorbell();
    uint64_t bound = (uint64_t)g_config.wait_ms * 1000000u;
    CUresult result = CUDA_SUCCESS;
    unsigned spurious = 0;
    int released = 0;
    for (unsigned spins = 0;; spins++) {
        /* Read the words before checking them, so a change after the check wakes the wait. */
        uint32_t granted = r_u32(r, GL_OFF_FK_GRANT);
        uint32_t arm_wait = r_u32(r, GL_OFF_FK_ARM_WAIT);
        uint64_t nonce = 0;
        uint8_t *board = spurious < FK_SPURIOUS_MAX ? armed_board(r, seq, kernel, &nonce) : NULL;
        uint32_t launch = board ? r_u32(board, GL_BOARD_LAUNCH) : 0;
        if (granted == seq) {
            *granted_seq = seq;
            loss_rearm();
            break;
        }
        if (board != NULL && nonce != stale && r_u64(board, GL_BOARD_FIRED) == nonce) {
            g_fk_released = nonce; /* the holder's launch fired this request's arm */
            w_u64(r, GL_OFF_FK_RELEASED_KERNEL, kernel);
            w_u64(r, GL_OFF_FK_RELEASED, nonce);
            released = 1;
            __atomic_store_n(&g_fk_ring_after, 1, __ATOMIC_RELEASE);
            *granted_seq = seq;
            loss_rearm();
            break;
        }
        if (conn_state() != CONN_CONNECTED) {
            result = on_loss("lost the dispatcher");
            break;
        }
        if (r_u32(r, GL_OFF_STATE) == GL_STATE_EVICTED) {
            result = on_refusal("assignment evicted");
            break;
        }
        uint64_t now = now_ns(), beat = r_u64(r, GL_OFF_FK_BEAT);
        if (now > beat && now - beat > bound) {
            char why[128];
            snprintf(why, sizeof why,
                     "the FIKIT arbiter stopped answering (no heartbeat within "
                     "GPULOOM_SHIM_WAIT_MS=%d ms)",
                     g_config.wait_ms);
            result = on_loss(why);
            break;
        }
        if (spins < 256) { /* a grant into an open gap comes within microseconds */
            cpu_relax();
            continue;
        }
        /* Sleep; while own kernels are in flight, wake often to report their completion. */
        unsigned in_flight = fikit_harvest();
        gl_wait_fill_words(r, granted, arm_wait, board, launch, in_flight ? 50000 : 5000000);
        /* The board moved without firing this arm: a holder may wake it at will, so a wait
         * watches it only so often (then the arbiter's grant alone). */
        if (board != NULL && r_u32(board, GL_BOARD_LAUNCH) != launch &&
            r_u64(board, GL_BOARD_FIRED) != nonce)
            spurious++;
    }
    /* Released by the board, the post stays a request: the arbiter may not have read it. */
    if (!released) w_u32(r, GL_OFF_FK_WAITING, GL_POST_LAUNCHED);
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
        uint64_t kernel = launch_kernel_id(launch);
        w_u64(r, GL_OFF_FK_KERNEL, kernel);
        w_u32(r, GL_OFF_FK_WAITING, GL_POST_TRACKED);
        if (!opens_window(r, kernel)) {
            /* No window follows it: nothing the arbiter decides waits for this launch, which
             * it reads at its next round (a filler's request or completion, its timer, another
             * ring), so no doorbell now nor at its end; its event still tells the holder busy. */
            t_fk_quiet_seq = seq;
            w_u32(r, GL_OFF_FK_REQ_SEQ, seq);
            *granted_seq = seq;
            return CUDA_SUCCESS;
        }
        w_u32(r, GL_OFF_FK_REQ_SEQ, seq);
        /* The fire (or the ring) waits for the real launch (fikit_after_launch): the arbiter
         * sees the launch before the fire. A fired arm rings no doorbell: the released filler
         * rings it after its launch, so the arbiter does not compete with the filler for a CPU
         * on the way to the release. */
        t_fk_open_seq = seq;
        t_fk_open_kernel = kernel;
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
