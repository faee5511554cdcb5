/* The FIKIT part of the admission engine (see arbiter.h, engine.c and docs/fikit.md).
 *
 * One round: read every slot's shim-written words, turn what changed into core calls
 * (gl_fk_request for a launch or a request, gl_fk_completed for fill kernels known done), ask
 * the core what may go (gl_fk_decide), write the grants and wake their shims, then refresh
 * roles, notify flags and heartbeats. The engine's thread runs it after every doorbell ring
 * and at gl_arbiter_next_round; a round costs microseconds.
 *
 * Ringing the doorbell changes no decision: a round it causes reads every request and launch
 * (which can only queue a request or make the holder busy), but the holder's completions only
 * in timed rounds (its heartbeat, on a fixed cadence, and the core's wake-up times): a holder
 * found idle sooner would mean idle fill sooner, and when the arbiter looks must not depend on
 * how often someone rings. */
#define _GNU_SOURCE
#include "arbiter.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "native.h"
#include "spatial.h"
#include "wire.h"

#define GRANTS_TRACKED 64u /* granted fill kernels remembered per task until known done */
#define RUNNING_WEIGHED 256u /* kernels the spatial rule weighs at most */

typedef struct {
    uint64_t id, duration_ns, gap_ns;
    uint32_t sm_usage; /* SMs its launch shape occupies (0: unknown, taken as all) */
    uint32_t bound;    /* GL_SP_*: what limits it */
} kernel_entry;

typedef struct {
    int used;
    uint8_t *region;
    uint32_t priority;
    uint32_t sm_percent;  /* its SM partition (MPS caps its kernels at it), 1..100 */
    uint32_t seen_req;    /* REQ_SEQ last handed to the core */
    uint32_t seen_done;   /* DONE last read */
    int queued;           /* a request of this task waits in the core */
    uint32_t queued_seq;  /* ... with this sequence number */
    uint64_t queued_kernel; /* ... and this kernel ID */
    uint32_t granted[GRANTS_TRACKED]; /* sequence numbers of granted kernels not known done */
    uint32_t granted_head, granted_count;
    /* ... and, for spatial harvesting, each one's kernel ID and predicted start and end on the
     * task's stream (GL_FK_UNKNOWN: behind a kernel of unknown duration, or unknown itself) */
    uint64_t granted_kernel[GRANTS_TRACKED];
    uint64_t granted_start[GRANTS_TRACKED], granted_end[GRANTS_TRACKED];
    kernel_entry *table; /* open addressing, id 0 = empty; capacity mask+1 (power of two) */
    uint64_t mask;
    uint32_t role;
    /* Its window-opening kernels (known duration, gap >= the threshold): all of them when
     * there are at most GL_ARM_KERNELS (openers_all), else the latest it launched. */
    uint64_t openers[GL_ARM_KERNELS];
    int openers_all;
    /* As a filler: the kernels it asked for last (known durations), for an arm ahead. */
    uint64_t asked[GL_ARM_KERNELS];
    /* As a filler: the last arm it was given, for a release it reports after the arm died. */
    uint64_t armed_nonce;
    uint32_t armed_seq;
    uint32_t arm_wait;
    /* Suspended by the dispatcher (Gandiva): out of the core, so it neither holds the GPU nor
     * waits for it; what its shim writes meanwhile is not read. */
    int suspended;
} slot_state;

/* The live arm: `holder`'s next launch of one of `kernels` releases `filler`'s request
 * `filler_seq` (docs/fikit.md, "The holder's launch releases the filler"). */
typedef struct {
    int live;
    uint32_t holder, filler, filler_seq;
    uint64_t nonce;
    uint64_t kernels[GL_ARM_KERNELS];
    /* An arm ahead (the filler's next request, not posted yet): the kernel IDs it may be. */
    uint64_t filler_kernels[GL_ARM_KERNELS];
} arm_state;

struct gl_arbiter {
    uint64_t beat_ns, next_beat; /* the heartbeat's cadence, whatever wakes the thread */
    uint64_t next_wake; /* the core's next decision time (UINT64_MAX: none) */
    uint64_t gap_threshold_ns, fill_guard_ns;
    int board_fd[GL_BOARDS], board_ro_fd[GL_BOARDS];
    uint8_t *board[GL_BOARDS];
    arm_state arm;
    int harvest_given;    /* started with the spatial rule's config (the GPU runs MPS) */
    int harvest_on;       /* ... and its MPS daemon runs now: ask the rule (spatial.h) */
    gl_sp_config harvest;
    gl_arbiter_stats stats;
    slot_state slots[GL_FK_MAX_TASKS];
    gl_fk_core *core; /* gl_fk_core_size() bytes */
};

static inline uint64_t mix(uint64_t id) { return id * 0x9E3779B97F4A7C15ull; }

static const kernel_entry *lookup(const slot_state *s, uint64_t id) {
    if (s->table == NULL || id == 0) return NULL;
    for (uint64_t i = mix(id) & s->mask;; i = (i + 1) & s->mask) {
        const kernel_entry *e = &s->table[i];
        if (e->id == id) return e;
        if (e->id == 0) return NULL;
    }
}

/* ---- one round ---- */

/* A profiled time as the core takes it (at most 60 s): sums of clock times and a few of these
 * cannot overflow. */
static inline uint64_t clamp_ns(uint64_t ns) { return ns < GL_FK_MAX_NS ? ns : GL_FK_MAX_NS; }

/* A kernel of this task (ID `kernel`, on the GPU from `at` or after the task's earlier kernels)
 * now counts as outstanding until `done` reaches its sequence number. */
static void track(gl_arbiter *a, uint32_t task, uint32_t seq, uint64_t kernel, uint64_t at) {
    slot_state *s = &a->slots[task];
    if (s->granted_count == GRANTS_TRACKED) { /* the oldest is taken as done, by both */
        s->granted_head = (s->granted_head + 1) % GRANTS_TRACKED;
        s->granted_count--;
        gl_fk_completed(a->core, task, 1, now_ns());
    }
    uint32_t i = (s->granted_head + s->granted_count) % GRANTS_TRACKED;
    uint64_t start = at, end = GL_FK_UNKNOWN;
    if (s->granted_count > 0) {
        uint64_t before = s->granted_end[(i + GRANTS_TRACKED - 1) % GRANTS_TRACKED];
        if (before == GL_FK_UNKNOWN || before > start) start = before;
    }
    const kernel_entry *e = lookup(s, kernel);
    if (start != GL_FK_UNKNOWN && e != NULL && e->duration_ns != GL_FK_UNKNOWN)
        end = start + clamp_ns(e->duration_ns);
    s->granted[i] = seq;
    s->granted_kernel[i] = kernel;
    s->granted_start[i] = start;
    s->granted_end[i] = end;
    s->granted_count++;
}

static void grant(gl_arbiter *a, uint32_t task) {
    slot_state *s = &a->slots[task];
    if (!s->used || !s->queued) return;
    s->queued = 0;
    track(a, task, s->queued_seq, s->queued_kernel, now_ns());
    store32(s->region, GL_OFF_FK_GRANT, s->queued_seq);
    wake_word(s->region, GL_OFF_FK_GRANT);
    a->stats.grants++;
}

static void note_opener(gl_arbiter *a, slot_state *s, const kernel_entry *e);
static void take_request(gl_arbiter *a, uint32_t task, uint64_t now);

/* The shim says granted kernels up to `done` completed (a sequence number, so a kernel the
 * shim launched without a grant, after giving up, cannot keep work outstanding forever). */
static void take_done(gl_arbiter *a, uint32_t task, uint32_t done, uint64_t now) {
    slot_state *s = &a->slots[task];
    if (done == s->seen_done) return;
    if ((int32_t)(done - s->seen_req) > 0) {
        /* A launch this round has not read yet (a holder's that fired an arm rings no
         * doorbell): read it first. Beyond anything posted: garbage. */
        if ((int32_t)(done - load32(s->region, GL_OFF_FK_REQ_SEQ)) <= 0 && !s->queued)
            take_request(a, task, now);
        if ((int32_t)(done - s->seen_req) > 0) {
            a->stats.invalid_writes++;
            return;
        }
    }
    s->seen_done = done;
    uint32_t count = 0;
    while (s->granted_count > 0 && (int32_t)(s->granted[s->granted_head] - done) <= 0) {
        s->granted_head = (s->granted_head + 1) % GRANTS_TRACKED;
        s->granted_count--;
        count++;
    }
    if (count) gl_fk_completed(a->core, task, count, now);
}


/* A filler released by an arm for request `armed_seq` posted a later one before this thread
 * read that one: its kernel (RELEASED_KERNEL) is on the GPU all the same, counted as fill
 * work launched and watched until `done` passes it. */
static void take_skipped_release(gl_arbiter *a, uint32_t task, uint32_t req, uint64_t now) {
    slot_state *s = &a->slots[task];
    if (s->armed_nonce == 0 || s->queued || load64(s->region, GL_OFF_FK_RELEASED) != s->armed_nonce)
        return;
    if ((int32_t)(s->armed_seq - s->seen_req) <= 0 || (int32_t)(req - s->armed_seq) <= 0) return;
    uint64_t kernel = load64(s->region, GL_OFF_FK_RELEASED_KERNEL);
    const kernel_entry *e = lookup(s, kernel);
    s->armed_nonce = 0;
    if (gl_fk_launched(a->core, task, e ? e->duration_ns : GL_FK_UNKNOWN,
                       e ? e->gap_ns : GL_FK_UNKNOWN, now) < 0)
        return;
    track(a, task, s->armed_seq, kernel, now);
    a->stats.late_releases++;
}

static void take_request(gl_arbiter *a, uint32_t task, uint64_t now) {
    slot_state *s = &a->slots[task];
    uint8_t *r = s->region;
    uint32_t req = load32(r, GL_OFF_FK_REQ_SEQ);
    if (req == s->seen_req) return;
    take_skipped_release(a, task, req, now);
    if (s->queued) {
        /* One request at a time: a new sequence number while one is queued means the shim
         * gave up waiting (fail-open) or misbehaves. Its old request is answered on grant. */
        if (load32(r, GL_OFF_FK_WAITING) != GL_POST_REQUEST) s->seen_req = req;
        return;
    }
    uint32_t waiting = load32(r, GL_OFF_FK_WAITING);
    if (waiting > GL_POST_TRACKED) {
        a->stats.invalid_writes++;
        waiting = GL_POST_LAUNCHED;
    }
    uint64_t kernel = load64(r, GL_OFF_FK_KERNEL);
    uint64_t posted = load64(r, GL_OFF_FK_POST_NS);
    /* A post time from the future or from long ago is not believed. */
    if (posted > now || now - posted > 1000000000ull) posted = now;
    s->seen_req = req;
    uint64_t duration = GL_FK_UNKNOWN, gap = GL_FK_UNKNOWN;
    const kernel_entry *e = lookup(s, kernel);
    if (e != NULL) {
        duration = e->duration_ns;
        gap = e->gap_ns;
    } else if (kernel != 0) {
        a->stats.unknown_kernels++;
    }
    a->stats.requests++;
    if (waiting == GL_POST_REQUEST && e != NULL && e->duration_ns != GL_FK_UNKNOWN) {
        int at = GL_ARM_KERNELS - 1; /* the kernels it asks for, latest first */
        for (int k = 0; k < GL_ARM_KERNELS; k++)
            if (s->asked[k] == e->id) at = k;
        memmove(&s->asked[1], &s->asked[0], (size_t)at * sizeof s->asked[0]);
        s->asked[0] = e->id;
    }
    if (waiting == GL_POST_REQUEST) {
        int admitted = gl_fk_request(a->core, task, duration, gap, posted);
        if (admitted < 0) {
            a->stats.invalid_writes++;
            return;
        }
        s->queued = 1;
        s->queued_seq = req;
        s->queued_kernel = kernel;
        if (admitted == 1) grant(a, task);
        return;
    }
    /* A holder's launch, reported after the fact. */
    note_opener(a, s, e);
    int launched = gl_fk_launched(a->core, task, duration, gap, posted);
    if (launched < 0) {
        a->stats.invalid_writes++;
        return;
    }
    if (launched == 0) a->stats.role_races++; /* a better task arrived meanwhile */
    if (waiting == GL_POST_TRACKED)
        track(a, task, req, kernel, posted); /* the shim reports its completion with `done` */
    else
        gl_fk_completed(a->core, task, 1, now); /* alone on the GPU: nobody needs to know */
}

/* ---- the arm: one wake-up from the holder's launch to the filler's release ---- */

static void set_armed(slot_state *s, uint32_t board, uint64_t nonce, uint32_t seq,
                      const uint64_t *kernels) {
    for (int k = 0; k < GL_ARM_KERNELS; k++)
        store64(s->region, GL_OFF_FK_ARMED_KERNELS + 8 * k, kernels ? kernels[k] : 0);
    store32(s->region, GL_OFF_FK_ARMED_SEQ, seq);
    store32(s->region, GL_OFF_FK_ARM_BOARD, board);
    store64(s->region, GL_OFF_FK_ARMED, nonce);
    store32(s->region, GL_OFF_FK_ARM_WAIT, ++s->arm_wait);
    wake_word(s->region, GL_OFF_FK_ARM_WAIT);
}

/* Did the live arm fire? The holder's shim writes its nonce into its priority board; the
 * filler writes it into its own region when it takes the release. Either is enough: the
 * filler's request then goes (through the board or, if it missed that, its grant word). */
static int arm_fired(const gl_arbiter *a) {
    const slot_state *h = &a->slots[a->arm.holder], *f = &a->slots[a->arm.filler];
    return load64(a->board[h->priority], GL_BOARD_FIRED) == a->arm.nonce ||
           load64(f->region, GL_OFF_FK_RELEASED) == a->arm.nonce;
}

/* The filler's request went: the core admits it as fill (gl_fk_release), and the grant word
 * is written as for any grant (it wakes the filler if the board did not). */
static void release(gl_arbiter *a, uint32_t task, uint64_t now) {
    slot_state *s = &a->slots[task];
    s->armed_nonce = 0;
    if (!s->used || !s->queued || gl_fk_release(a->core, task, now) != 0) return;
    grant(a, task);
}

/* An arm given ahead holds only for the kernels it names (an arm for a queued request names
 * none: it holds for that request). */
static int ahead_allows(const arm_state *arm, uint64_t kernel) {
    int any = 0;
    for (int k = 0; k < GL_ARM_KERNELS; k++) {
        any |= arm->filler_kernels[k] != 0;
        if (arm->filler_kernels[k] != 0 && arm->filler_kernels[k] == kernel) return 1;
    }
    return !any;
}

/* Takes the live arm back (the holder can no longer fire it, the filler no longer take it),
 * then settles a fire that came first: the holder's launch reaches the core before the
 * filler's release, as they happened. */
static void withdraw(gl_arbiter *a, uint64_t now) {
    if (!a->arm.live) return;
    slot_state *h = &a->slots[a->arm.holder], *f = &a->slots[a->arm.filler];
    store64(h->region, GL_OFF_FK_ARM, 0);
    set_armed(f, 0, 0, 0, NULL);
    a->arm.live = 0;
    if (!arm_fired(a)) return;
    a->stats.fired++;
    take_done(a, a->arm.holder, load32(h->region, GL_OFF_FK_DONE), now);
    take_request(a, a->arm.holder, now);
    take_request(a, a->arm.filler, now); /* an arm ahead: the request it released */
    /* An arm ahead released the request only if the filler says so: one posted after the
     * fire is not released by it (the window has been running since); the core decides. */
    int ahead = a->arm.filler_kernels[0] != 0;
    if (f->queued && f->queued_seq == a->arm.filler_seq &&
        ahead_allows(&a->arm, f->queued_kernel) &&
        (!ahead || load64(f->region, GL_OFF_FK_RELEASED) == a->arm.nonce))
        release(a, a->arm.filler, now);
}

/* A filler that says it took the release of an arm already withdrawn (a holder that fired
 * after the arbiter took the arm back, or wrote its board by hand): its request went, so the
 * core is told, once, and only for the request that arm was for. */
static void take_late_release(gl_arbiter *a, uint32_t task, uint64_t now) {
    slot_state *s = &a->slots[task];
    if (s->armed_nonce == 0 || (a->arm.live && a->arm.filler == task)) return;
    if (load64(s->region, GL_OFF_FK_RELEASED) != s->armed_nonce) return;
    if (s->queued && s->queued_seq == s->armed_seq) {
        a->stats.late_releases++;
        release(a, task, now);
    }
    s->armed_nonce = 0;
}

static uint64_t fresh_nonce(void) {
    uint64_t n = 0;
    while (n == 0)
        if (getrandom(&n, sizeof n, 0) != (ssize_t)sizeof n) n = now_ns() * 0x9E3779B97F4A7C15ull;
    return n;
}

/* Fills want->kernels with the holder's window-opening kernels whose gap is at least
 * `min_gap`; returns how many. */
static int holder_kernels(const slot_state *h, uint64_t min_gap, arm_state *want) {
    int n = 0;
    for (int k = 0; k < GL_ARM_KERNELS; k++) {
        const kernel_entry *e = lookup(h, h->openers[k]);
        if (e != NULL && e->duration_ns != GL_FK_UNKNOWN && e->gap_ns != GL_FK_UNKNOWN &&
            e->gap_ns >= min_gap)
            want->kernels[n++] = e->id;
    }
    return n;
}

/* The arm the core's next decision calls for: 0 when there is none. For a queued request
 * (gl_fk_next_fill), or else one request ahead (gl_fk_next_asker): the filler's next request,
 * if it asks for one of the kernels it asked for last (durations known), whose longest fits
 * the holder kernels named. */
static int desired_arm(gl_arbiter *a, arm_state *want) {
    uint32_t filler;
    uint64_t min_gap;
    memset(want, 0, sizeof *want);
    int queued = gl_fk_next_fill(a->core, &filler, &min_gap) == 1;
    if (!queued && gl_fk_next_asker(a->core, &filler) != 1) return 0;
    if (filler >= GL_FK_MAX_TASKS) return 0;
    int best = gl_fk_holder_priority(a->core), holder = -1;
    for (uint32_t t = 0; t < GL_FK_MAX_TASKS && holder < 0; t++)
        if (a->slots[t].used && (int)a->slots[t].priority == best) holder = (int)t;
    const slot_state *h = holder >= 0 ? &a->slots[holder] : NULL, *f = &a->slots[filler];
    if (h == NULL || !f->used || h->priority >= GL_BOARDS || h->priority >= f->priority)
        return 0;
    if (queued) {
        if (!f->queued || holder_kernels(h, min_gap, want) == 0) return 0;
        want->filler_seq = f->queued_seq;
    } else {
        if (f->queued) return 0;
        uint64_t longest = 0;
        int n = 0;
        for (int k = 0; k < GL_ARM_KERNELS; k++) {
            const kernel_entry *e = lookup(f, f->asked[k]);
            if (e == NULL || e->duration_ns == GL_FK_UNKNOWN) continue;
            want->filler_kernels[n++] = e->id;
            if (e->duration_ns > longest) longest = e->duration_ns;
        }
        longest += a->fill_guard_ns; /* both at most an hour: no overflow */
        min_gap = longest > a->gap_threshold_ns ? longest : a->gap_threshold_ns;
        if (n == 0 || holder_kernels(h, min_gap > 0 ? min_gap : 1, want) == 0) return 0;
        want->filler_seq = f->seen_req + 1;
    }
    want->live = 1;
    want->holder = (uint32_t)holder;
    want->filler = filler;
    return 1;
}

/* At the end of a round: keep the live arm if it is still what the core would decide, else
 * withdraw it and publish the new one (filler's words first; a fire is kept in the board). */
static void rearm(gl_arbiter *a, uint64_t now) {
    arm_state want;
    int wanted = desired_arm(a, &want);
    if (wanted && a->arm.live && a->arm.holder == want.holder &&
        a->arm.filler == want.filler && a->arm.filler_seq == want.filler_seq &&
        memcmp(a->arm.kernels, want.kernels, sizeof want.kernels) == 0 &&
        memcmp(a->arm.filler_kernels, want.filler_kernels, sizeof want.filler_kernels) == 0)
        return;
    /* An arm given ahead for the request now queued, of a kernel it names, already is this
     * arm: its holder kernels' gaps fit the longest kernel it names. Withdrawing it would
     * leave a moment with no arm just before the launch it waits for. */
    slot_state *f = &a->slots[want.filler];
    if (wanted && a->arm.live && a->arm.holder == want.holder &&
        a->arm.filler == want.filler && a->arm.filler_seq == want.filler_seq && f->queued &&
        want.filler_kernels[0] == 0 && a->arm.filler_kernels[0] != 0 &&
        ahead_allows(&a->arm, f->queued_kernel))
        return;
    if (a->arm.live) {
        withdraw(a, now);
        if (!desired_arm(a, &want)) return; /* a fire changed what is queued */
    } else if (!wanted) {
        return;
    }
    want.nonce = fresh_nonce();
    slot_state *h = &a->slots[want.holder];
    f = &a->slots[want.filler];
    f->armed_nonce = want.nonce;
    f->armed_seq = want.filler_seq;
    set_armed(f, h->priority, want.nonce, want.filler_seq, want.filler_kernels);
    for (int k = 0; k < GL_ARM_KERNELS; k++)
        store64(h->region, GL_OFF_FK_ARM_KERNELS + 8 * k, want.kernels[k]);
    store64(h->region, GL_OFF_FK_ARM, want.nonce);
    a->arm = want;
    a->stats.arms++;
}

/* A holder launched a window-opening kernel: remember it as a likely next one (when its table
 * has more of them than an arm can name). */
static void note_opener(gl_arbiter *a, slot_state *s, const kernel_entry *e) {
    if (s->openers_all || e == NULL || e->duration_ns == GL_FK_UNKNOWN ||
        e->gap_ns == GL_FK_UNKNOWN || e->gap_ns < a->gap_threshold_ns || e->gap_ns == 0)
        return;
    int at = GL_ARM_KERNELS - 1;
    for (int k = 0; k < GL_ARM_KERNELS; k++)
        if (s->openers[k] == e->id) at = k;
    memmove(&s->openers[1], &s->openers[0], (size_t)at * sizeof s->openers[0]);
    s->openers[0] = e->id;
}

/* ---- spatial harvesting: a filler's request beside the holder's running kernel (MPS) ---- */

/* The SMs a task's kernel asks for: its launch shape (the whole GPU when that is unknown),
 * capped by the task's SM partition, which MPS enforces (as gpuloom/sim/kernels.py's demand). */
static uint32_t demand_of(const gl_arbiter *a, const slot_state *s, const kernel_entry *e) {
    uint32_t sms = a->harvest.sms;
    uint32_t partition = (uint32_t)((uint64_t)sms * s->sm_percent / 100);
    if (partition == 0) partition = 1;
    uint32_t shape = e == NULL || e->sm_usage == 0 || e->sm_usage > sms ? sms : e->sm_usage;
    return shape < partition ? shape : partition;
}

/* What `candidate`'s rule needs from the GPU now: every other task's kernel predicted on the
 * GPU at `now` (started, not predicted or known done; one of unknown timing counts as on it),
 * and the holder's next launch: the end of its running kernel, plus the gap after it when
 * nothing of that task is queued behind it (GL_FK_UNKNOWN: not predictable). Returns how many
 * kernels it wrote into `out`. */
static uint32_t on_gpu(const gl_arbiter *a, uint32_t candidate, uint64_t now,
                       gl_sp_running *out, uint64_t *holder_next) {
    uint32_t n = 0, own_priority = a->slots[candidate].priority;
    *holder_next = GL_FK_UNKNOWN;
    int predictable = 1;
    for (uint32_t t = 0; t < GL_FK_MAX_TASKS; t++) {
        const slot_state *s = &a->slots[t];
        if (!s->used || s->suspended || t == candidate) continue;
        for (uint32_t k = 0; k < s->granted_count; k++) {
            uint32_t i = (s->granted_head + k) % GRANTS_TRACKED;
            uint64_t start = s->granted_start[i], end = s->granted_end[i];
            int known = start != GL_FK_UNKNOWN && end != GL_FK_UNKNOWN;
            if (known && (start > now || end <= now)) continue;
            const kernel_entry *e = lookup(s, s->granted_kernel[i]);
            if (n == RUNNING_WEIGHED) {
                predictable = 0; /* more than it can weigh: nothing goes beside them */
                continue;
            }
            out[n++] = (gl_sp_running){s->priority, demand_of(a, s, e), e ? e->bound : 0};
            if (s->priority >= own_priority) continue;
            /* A better task's kernel: the candidate must be off the SMs before its next one. */
            uint64_t at;
            if (!known) {
                predictable = 0;
                continue;
            } else if (k + 1 < s->granted_count) {
                at = end; /* its next kernel is queued behind this one */
            } else if (e == NULL || e->gap_ns == GL_FK_UNKNOWN) {
                predictable = 0;
                continue;
            } else {
                at = end + clamp_ns(e->gap_ns);
            }
            if (at < *holder_next) *holder_next = at;
        }
    }
    if (!predictable) *holder_next = GL_FK_UNKNOWN;
    return n;
}

/* The candidate's own outstanding work still to run (GL_FK_UNKNOWN: not predictable). */
static uint64_t queued_ahead(const slot_state *s, uint64_t now) {
    uint64_t ahead = 0;
    for (uint32_t k = 0; k < s->granted_count; k++) {
        uint32_t i = (s->granted_head + k) % GRANTS_TRACKED;
        uint64_t start = s->granted_start[i], end = s->granted_end[i];
        if (start == GL_FK_UNKNOWN || end == GL_FK_UNKNOWN) return GL_FK_UNKNOWN;
        if (end > now) ahead += end - (start > now ? start : now);
    }
    return ahead;
}

/* Each request the core left queued, best priority first, asks the spatial rule; one it
 * admits goes now as fill work (gl_fk_release, as a fired arm's does). Quota limits need no
 * check here: a composed shim asks for a kernel only while its level's lease allows it. */
static void harvest(gl_arbiter *a, uint64_t now) {
    int best = gl_fk_holder_priority(a->core);
    if (!a->harvest_on || best < 0) return;
    gl_sp_running running[RUNNING_WEIGHED];
    for (uint32_t p = (uint32_t)best + 1; p < GL_FK_PRIORITIES; p++) {
        for (uint32_t t = 0; t < GL_FK_MAX_TASKS; t++) {
            slot_state *s = &a->slots[t];
            if (!s->used || s->suspended || !s->queued || s->priority != p) continue;
            const kernel_entry *e = lookup(s, s->queued_kernel);
            uint64_t ahead = queued_ahead(s, now);
            if (e == NULL || e->duration_ns == GL_FK_UNKNOWN || ahead == GL_FK_UNKNOWN) continue;
            uint64_t holder_next;
            uint32_t n = on_gpu(a, t, now, running, &holder_next);
            gl_sp_candidate candidate = {.priority = s->priority,
                                         .demand = demand_of(a, s, e),
                                         .bound = e->bound,
                                         .duration_ns = e->duration_ns,
                                         .queued_ns = ahead,
                                         .quota_left_ns = GL_FK_UNKNOWN};
            if (!gl_sp_admit(&a->harvest, now, &candidate, running, n, holder_next)) continue;
            /* Its arm, if it has one, is taken back first (a fire that came first settles). */
            if (a->arm.live && a->arm.filler == t) withdraw(a, now);
            if (!s->queued || gl_fk_release(a->core, t, now) != 0) continue;
            grant(a, t);
            a->stats.harvested++;
        }
    }
}

void gl_arbiter_round(gl_arbiter *a, uint64_t now) {
    a->stats.rounds++;
    int beat = now >= a->next_beat;
    if (beat) a->next_beat = now - a->next_beat < a->beat_ns ? a->next_beat + a->beat_ns
                                                             : now + a->beat_ns;
    /* A timed round: the heartbeat, or a wake-up time the core asked for. Only these take
     * the holder's completions (see the top of this file). */
    int timed = beat || now >= a->next_wake;
    int holder = gl_fk_holder_priority(a->core);
    if (a->arm.live && arm_fired(a)) withdraw(a, now);
    for (uint32_t t = 0; t < GL_FK_MAX_TASKS; t++) {
        slot_state *s = &a->slots[t];
        if (!s->used || s->suspended) continue;
        if (timed || (int)s->priority != holder)
            take_done(a, t, load32(s->region, GL_OFF_FK_DONE), now);
        take_request(a, t, now);
        take_late_release(a, t, now);
    }
    uint32_t out[GL_FK_MAX_TASKS];
    uint64_t wake_at;
    int n = gl_fk_decide(a->core, now, out, GL_FK_MAX_TASKS, &wake_at);
    for (int i = 0; i < n; i++)
        if (out[i] < GL_FK_MAX_TASKS) grant(a, out[i]);
    harvest(a, now);
    /* Roles: the core's holder priority holds. Holders post every launch only while somebody
     * waits or fill work is outstanding: alone, a holder's launch costs a few stores. */
    int best = gl_fk_holder_priority(a->core);
    uint32_t waiting = 0, outstanding = 0, tasks = 0;
    for (uint32_t t = 0; t < GL_FK_MAX_TASKS; t++) {
        slot_state *s = &a->slots[t];
        if (!s->used) continue;
        tasks++;
        waiting += (uint32_t)s->queued;
        outstanding += s->granted_count;
    }
    uint32_t notify = waiting > 0 || outstanding > 0;
    for (uint32_t t = 0; t < GL_FK_MAX_TASKS; t++) {
        slot_state *s = &a->slots[t];
        if (!s->used) continue;
        uint32_t role = (int)s->priority == best ? GL_ROLE_HOLDER : GL_ROLE_FILL;
        if (role != s->role) {
            s->role = role;
            store32(s->region, GL_OFF_FK_ROLE, role);
        }
        if (load32(s->region, GL_OFF_FK_NOTIFY) != notify)
            store32(s->region, GL_OFF_FK_NOTIFY, notify);
        if (beat) store64(s->region, GL_OFF_FK_BEAT, now);
    }
    a->stats.tasks = tasks;
    a->stats.waiting = waiting;
    a->next_wake = wake_at;
    rearm(a, now);
}

uint64_t gl_arbiter_next_round(const gl_arbiter *a) {
    return a->next_wake < a->next_beat ? a->next_wake : a->next_beat;
}

/* ---- set-up and the dispatcher's calls ---- */

static void close_boards(gl_arbiter *a) {
    for (int p = 0; p < GL_BOARDS; p++) {
        if (a->board[p] != NULL) munmap(a->board[p], GL_BOARD_BYTES);
        if (a->board_fd[p] >= 0) close(a->board_fd[p]);
        if (a->board_ro_fd[p] >= 0) close(a->board_ro_fd[p]);
        a->board[p] = NULL;
        a->board_fd[p] = a->board_ro_fd[p] = -1;
    }
}

/* One board per priority: a memfd the arbiter maps read-write, a read-only descriptor of it
 * for the processes of worse priorities, and the inode made read-only so that descriptor cannot
 * be reopened for writing through /proc (by a process without CAP_DAC_OVERRIDE). */
static int open_boards(gl_arbiter *a) {
    for (int p = 0; p < GL_BOARDS; p++) a->board_fd[p] = a->board_ro_fd[p] = -1;
    for (int p = 0; p < GL_BOARDS; p++) {
        char path[64];
        int fd = memfd_create("gpuloom-board", MFD_CLOEXEC);
        if (fd < 0) return -1;
        a->board_fd[p] = fd;
        if (ftruncate(fd, GL_BOARD_BYTES) != 0) return -1;
        void *mapped = mmap(NULL, GL_BOARD_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (mapped == MAP_FAILED) return -1;
        a->board[p] = mapped;
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        a->board_ro_fd[p] = open(path, O_RDONLY | O_CLOEXEC);
        if (a->board_ro_fd[p] < 0 || fchmod(fd, 0400) != 0) return -1;
    }
    return 0;
}

int gl_arbiter_board_fd(gl_arbiter *a, uint32_t priority, int writable) {
    if (a == NULL || priority >= GL_BOARDS) {
        errno = EINVAL;
        return -1;
    }
    return writable ? a->board_fd[priority] : a->board_ro_fd[priority];
}

gl_arbiter *gl_arbiter_new(const gl_fk_config *config, uint64_t beat_ns,
                           const gl_sp_config *harvest) {
    if (beat_ns == 0 || (harvest != NULL && gl_sp_check_config(harvest) != 0)) {
        errno = EINVAL;
        return NULL;
    }
    gl_arbiter *a = calloc(1, sizeof *a);
    if (a == NULL) return NULL;
    a->core = calloc(1, gl_fk_core_size());
    if (a->core == NULL || gl_fk_init(a->core, config) != 0) {
        int error = a->core == NULL ? ENOMEM : EINVAL;
        free(a->core);
        free(a);
        errno = error;
        return NULL;
    }
    a->harvest_given = a->harvest_on = harvest != NULL;
    if (harvest != NULL) a->harvest = *harvest;
    a->gap_threshold_ns = config->gap_threshold_ns;
    a->fill_guard_ns = config->fill_guard_ns;
    if (open_boards(a) != 0) {
        int error = errno;
        close_boards(a);
        free(a->core);
        free(a);
        errno = error;
        return NULL;
    }
    a->beat_ns = beat_ns;
    a->next_beat = now_ns(); /* the first round beats */
    a->next_wake = UINT64_MAX;
    return a;
}

static void release_slot(slot_state *s) {
    if (s->region != NULL) munmap(s->region, GL_REGION_BYTES);
    free(s->table);
    memset(s, 0, sizeof *s);
}

void gl_arbiter_free(gl_arbiter *a) {
    if (a == NULL) return;
    for (uint32_t t = 0; t < GL_FK_MAX_TASKS; t++) release_slot(&a->slots[t]);
    close_boards(a);
    free(a->core);
    free(a);
}

static int fill_table(slot_state *s, uint64_t threshold, const gl_kernel_table *kernels) {
    const uint64_t *ids = kernels->ids, *durations = kernels->durations_ns,
                   *gaps = kernels->gaps_ns;
    uint32_t n = kernels->count;
    uint64_t capacity = 16;
    while (capacity < 2 * (uint64_t)n) capacity <<= 1;
    s->table = calloc(capacity, sizeof *s->table);
    if (s->table == NULL) return -1;
    s->mask = capacity - 1;
    for (uint32_t k = 0; k < n; k++) {
        if (ids[k] == 0) continue; /* 0 marks an empty bucket (and "not computed" in a post) */
        uint64_t i = mix(ids[k]) & s->mask;
        while (s->table[i].id != 0 && s->table[i].id != ids[k]) i = (i + 1) & s->mask;
        uint32_t sm_usage = kernels->sm_usage ? kernels->sm_usage[k] : 0;
        uint32_t bound = kernels->bounds ? kernels->bounds[k] : GL_SP_UNKNOWN;
        s->table[i] = (kernel_entry){ids[k], durations[k], gaps[k], sm_usage,
                                     bound <= GL_SP_MEMORY ? bound : GL_SP_UNKNOWN};
    }
    /* Its window-opening kernels: all of them fit an arm, or the latest launched are kept. */
    uint32_t openers = 0;
    memset(s->openers, 0, sizeof s->openers);
    for (uint64_t i = 0; i <= s->mask; i++) {
        const kernel_entry *e = &s->table[i];
        if (e->id == 0 || e->duration_ns == GL_FK_UNKNOWN || e->gap_ns == GL_FK_UNKNOWN ||
            e->gap_ns < threshold || e->gap_ns == 0)
            continue;
        if (openers < GL_ARM_KERNELS) s->openers[openers] = e->id;
        openers++;
    }
    s->openers_all = openers <= GL_ARM_KERNELS;
    if (!s->openers_all) memset(s->openers, 0, sizeof s->openers);
    return 0;
}

/* Tells the holder's shim which of its launches the arbiter needs at once: its window-opening
 * kernels, when they all fit the list; the flag goes last, so a shim that reads it set reads
 * the IDs of this table (on a swap, at worst one launch rings for nothing or goes unrung: the
 * arbiter reads that post at its next round all the same). */
static void publish_openers(const slot_state *s) {
    int all = s->openers_all;
    store32(s->region, GL_OFF_FK_OPENERS_ALL, 0);
    for (int k = 0; k < GL_ARM_KERNELS; k++)
        store64(s->region, GL_OFF_FK_OPENERS + 8 * k, all ? s->openers[k] : 0);
    store32(s->region, GL_OFF_FK_OPENERS_ALL, (uint32_t)all);
}

/* A table of `count` kernels needs its three u64 arrays; the u32 ones may be NULL. */
static int table_ok(const gl_kernel_table *t) {
    return t != NULL && (t->count == 0 || (t->ids != NULL && t->durations_ns != NULL &&
                                           t->gaps_ns != NULL));
}

int gl_arbiter_add_task(gl_arbiter *a, int region_fd, uint32_t priority, uint32_t sm_percent,
                        const gl_kernel_table *kernels) {
    struct stat st;
    if (priority >= GL_FK_PRIORITIES || sm_percent == 0 || sm_percent > 100 ||
        fstat(region_fd, &st) != 0 ||
        st.st_size < (off_t)GL_REGION_BYTES || !table_ok(kernels)) {
        errno = EINVAL;
        return -1;
    }
    void *mapped =
        mmap(NULL, GL_REGION_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, region_fd, 0);
    if (mapped == MAP_FAILED) return -1;
    int slot = -1;
    for (int t = 0; t < GL_FK_MAX_TASKS && slot < 0; t++)
        if (!a->slots[t].used) slot = t;
    if (slot < 0) {
        munmap(mapped, GL_REGION_BYTES);
        errno = ENOSPC;
        return -1;
    }
    slot_state *s = &a->slots[slot];
    withdraw(a, now_ns()); /* the holder may change */
    if (fill_table(s, a->gap_threshold_ns, kernels) != 0 ||
        gl_fk_add_task(a->core, (uint32_t)slot, priority, now_ns()) != 0) {
        release_slot(s);
        munmap(mapped, GL_REGION_BYTES);
        errno = ENOMEM;
        return -1;
    }
    s->used = 1;
    s->region = mapped;
    s->priority = priority;
    s->sm_percent = sm_percent;
    /* Whatever the region held before is history, not requests. */
    s->seen_req = load32(s->region, GL_OFF_FK_REQ_SEQ);
    s->seen_done = load32(s->region, GL_OFF_FK_DONE);
    publish_openers(s);
    store64(s->region, GL_OFF_FK_BEAT, now_ns());
    return slot;
}

int gl_arbiter_set_kernels(gl_arbiter *a, int slot, const gl_kernel_table *kernels) {
    if (a == NULL || slot < 0 || slot >= GL_FK_MAX_TASKS || !table_ok(kernels)) {
        errno = EINVAL;
        return -1;
    }
    slot_state fresh = {0};
    if (fill_table(&fresh, a->gap_threshold_ns, kernels) != 0) {
        errno = ENOMEM;
        return -1;
    }
    slot_state *s = &a->slots[slot];
    if (!s->used) {
        free(fresh.table);
        errno = ENOENT;
        return -1;
    }
    withdraw(a, now_ns()); /* its kernels may name another arm */
    free(s->table);
    s->table = fresh.table;
    s->mask = fresh.mask;
    memcpy(s->openers, fresh.openers, sizeof s->openers);
    s->openers_all = fresh.openers_all;
    publish_openers(s);
    return 0;
}

void gl_arbiter_remove_task(gl_arbiter *a, int slot) {
    if (a == NULL || slot < 0 || slot >= GL_FK_MAX_TASKS) return;
    slot_state *s = &a->slots[slot];
    if (s->used) {
        withdraw(a, now_ns());
        gl_fk_remove_task(a->core, (uint32_t)slot, now_ns());
        release_slot(s);
    }
}

int gl_arbiter_set_suspended(gl_arbiter *a, int slot, int on) {
    if (a == NULL || slot < 0 || slot >= GL_FK_MAX_TASKS) return -1;
    slot_state *s = &a->slots[slot];
    int result = s->used ? 0 : -1;
    if (s->used && s->suspended != (on != 0)) {
        uint64_t now = now_ns();
        withdraw(a, now); /* the holder may change */
        if (on) {
            /* Its queued request and the kernels it was granted go with it: it parks at a
             * low-memory point of its mini-batch, its work done. */
            gl_fk_remove_task(a->core, (uint32_t)slot, now);
            s->queued = 0;
            s->granted_head = s->granted_count = 0;
            s->armed_nonce = 0;
        } else if (gl_fk_add_task(a->core, (uint32_t)slot, s->priority, now) != 0) {
            result = -1;
        } else {
            /* What it wrote while suspended is history, not requests. */
            s->seen_req = load32(s->region, GL_OFF_FK_REQ_SEQ);
            s->seen_done = load32(s->region, GL_OFF_FK_DONE);
        }
        if (result == 0) s->suspended = on != 0;
    }
    return result;
}

int gl_arbiter_set_harvesting(gl_arbiter *a, int on) {
    if (a == NULL || (on && !a->harvest_given)) return -1;
    a->harvest_on = on != 0;
    return 0;
}

void gl_arbiter_get_stats(const gl_arbiter *a, gl_arbiter_stats *out) { *out = a->stats; }

void gl_arbiter_get_core_counters(const gl_arbiter *a, gl_fk_counters *out) {
    gl_fk_get_counters(a->core, out);
}
