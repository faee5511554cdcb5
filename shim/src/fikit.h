/* The FIKIT kernel-admission decision core (Fill Inter-Kernel Idle Time).
 *
 * Pure: no I/O, no clock reads, no allocation, no threads. The caller owns the memory
 * (gl_fk_core is fixed-size and holds no pointers, so it may live in static memory or in a
 * shared mapping) and passes the time with every call. The caller serialises calls on one
 * core (the arbiter thread holds it; the simulator is single-threaded).
 *
 * The live arbiter and the kernel-level simulator (gpuloom/sim/kernels.py, through
 * gpuloom/policies/fikit/core.py) both call this code. docs/fikit.md explains the rules.
 */
#ifndef GL_FIKIT_H
#define GL_FIKIT_H

#include <stddef.h>
#include <stdint.h>

#define GL_FK_API __attribute__((visibility("default")))

#define GL_FK_MAX_TASKS 64          /* task ids are 0..63 (the arbiter's slot indices) */
#define GL_FK_PRIORITIES 10         /* 0 = highest .. 9 */
#define GL_FK_UNKNOWN UINT64_MAX    /* a duration or gap the task's profile does not know */
#define GL_FK_MAX_OUTSTANDING 64    /* predicted durations remembered per task; see below */
#define GL_FK_MAX_NS 60000000000ULL /* durations and gaps above 60 s are clamped to it */
#define GL_FK_MAX_CONFIG_NS 3600000000000ULL /* a config time above one hour is refused */

typedef struct {
    uint64_t gap_threshold_ns; /* holder gaps shorter than this are not filled (100 us) */
    uint64_t idle_margin_ns;   /* holder idle once no launch came for its predicted gap + this
                                  after its last kernel's predicted end (200 us) */
    uint64_t idle_backlog_ns;  /* holder idle: predicted fill work allowed outstanding (0) */
    uint64_t max_wait_ns;      /* anti-starvation: a request queued this long is granted
                                  anyway (0 = never; default 0) */
    uint64_t fill_guard_ns;    /* a window fill must be predicted to end this long before the
                                  window does: room for the filler's own delay from its grant
                                  to its launch, which the prediction does not see (0) */
} gl_fk_config;

/* Counters for metrics; they only grow (until gl_fk_init). */
typedef struct {
    uint64_t admitted_holder;      /* holder requests admitted */
    uint64_t queued;               /* requests that had to wait */
    uint64_t granted_window;       /* fill kernels granted inside a gap window */
    uint64_t granted_idle;         /* fill kernels granted while the holder idled */
    uint64_t granted_starved;      /* granted by max_wait_ns */
    uint64_t unknown_requests;     /* requests with an unknown duration (never fill a window) */
    uint64_t windows_opened;       /* gap windows opened by holder kernels */
    uint64_t windows_closed_early; /* closed by the holder's next request before their end */
    uint64_t holder_switches;      /* the holder priority changed */
    uint64_t overflowed;           /* admitted kernels beyond GL_FK_MAX_OUTSTANDING per task */
    uint64_t rejected_calls;       /* calls refused or ignored for bad arguments */
    uint64_t launched_unadmitted;  /* gl_fk_launched by a task no longer a holder */
    uint64_t granted_released;     /* granted by gl_fk_release: the shim was already released
                                      (by the holder's launch, before the arbiter decided) */
} gl_fk_counters;

/* One task's state. Outstanding kernels (admitted, not yet reported completed) are a FIFO of
 * at most GL_FK_MAX_OUTSTANDING predicted durations; kernels admitted beyond that (and all
 * admitted while any such overflow is outstanding, to keep the order) count as
 * unknown-length: they block idle fill like an unknown fill kernel does. */
typedef struct {
    uint8_t active;
    uint8_t priority;
    uint8_t has_request;
    uint8_t last_gap_known;
    uint32_t out_head;         /* index of the oldest entry of out_dur */
    uint32_t out_count;        /* entries in out_dur */
    uint32_t overflow;         /* outstanding kernels not in out_dur (newer than all of it) */
    uint32_t overflow_fill;    /* of those, granted as fill */
    uint32_t fill_count;       /* outstanding fill kernels (in out_dur or overflow) */
    uint32_t fill_unknown;     /* outstanding fill kernels of unknown length */
    uint32_t known_unknown;    /* outstanding kernels of any kind of unknown length */
    uint64_t fill_ns;          /* predicted ns of outstanding known fill kernels */
    uint64_t out_ns;           /* predicted ns of all outstanding known kernels */
    uint64_t req_duration_ns;  /* the queued request */
    uint64_t req_gap_ns;
    uint64_t req_time_ns;
    uint64_t req_seq;          /* request order: grant ties and "longest waiting" */
    uint64_t last_gap_ns;      /* predicted gap after its last admitted kernel */
    uint64_t idle_at_ns;       /* it counts as idle from here (when nothing is outstanding) */
    uint64_t out_dur[GL_FK_MAX_OUTSTANDING]; /* GL_FK_UNKNOWN or a predicted duration; */
    uint64_t out_fill_mask;    /* bit i: out_dur[i] was granted as fill */
} gl_fk_task;

struct gl_fk_core {
    uint64_t magic;
    gl_fk_config config;
    uint64_t now_ns;           /* latest time seen; earlier times are taken as this */
    uint64_t tail_ns;          /* predicted end of everything admitted */
    uint64_t window_end_ns;    /* valid while window_open */
    uint32_t window_open;
    uint32_t window_owner;     /* the holder task whose kernel opened the window */
    int32_t holder_priority;   /* -1: no task */
    uint32_t pad;
    uint64_t next_seq;
    uint64_t fill_ns;          /* sums over tasks of the same-named task fields */
    uint64_t out_ns;
    uint32_t fill_count;
    uint32_t fill_unknown;
    uint32_t out_unknown;
    uint32_t out_count;        /* all outstanding kernels */
    gl_fk_counters counters;
    gl_fk_task tasks[GL_FK_MAX_TASKS];
};
typedef struct gl_fk_core gl_fk_core;

GL_FK_API void gl_fk_default_config(gl_fk_config *out);
GL_FK_API size_t gl_fk_core_size(void);
/* 0, or -1 on a null pointer or a config time above GL_FK_MAX_CONFIG_NS. */
GL_FK_API int gl_fk_init(gl_fk_core *core, const gl_fk_config *config);
/* -1: bad id/priority or taken. */
GL_FK_API int gl_fk_add_task(gl_fk_core *core, uint32_t task, uint32_t priority,
                             uint64_t now_ns);
/* Drops its queued request and its outstanding work. */
GL_FK_API void gl_fk_remove_task(gl_fk_core *core, uint32_t task, uint64_t now_ns);
/* The task wants to launch one kernel with these predictions (GL_FK_UNKNOWN: not known).
 * 1: admitted now, 0: queued (wait for gl_fk_decide), -1: bad task / already queued. */
GL_FK_API int gl_fk_request(gl_fk_core *core, uint32_t task, uint64_t duration_ns,
                            uint64_t gap_after_ns, uint64_t now_ns);
/* A kernel the task already launched without asking (a holder does not wait: its launches are
 * reported after the fact). 1: it was the holder's (admitted as gl_fk_request would); 0: the
 * task is no longer a holder (a better task arrived meanwhile): the kernel counts as
 * outstanding fill work; -1: bad task or a request is queued. */
GL_FK_API int gl_fk_launched(gl_fk_core *core, uint32_t task, uint64_t duration_ns,
                             uint64_t gap_after_ns, uint64_t now_ns);
/* `count` of the task's oldest admitted-and-not-yet-completed kernels completed (clamped to
 * what is outstanding). */
GL_FK_API void gl_fk_completed(gl_fk_core *core, uint32_t task, uint32_t count,
                               uint64_t now_ns);
/* Grants queued requests that may go now: writes up to `max` task ids into out (in grant
 * order), returns how many; *wake_at_ns (may be NULL) = the earliest time a decision may
 * change with no new event (UINT64_MAX: none). Call again when it returned `max`. */
GL_FK_API int gl_fk_decide(gl_fk_core *core, uint64_t now_ns, uint32_t *out, int max,
                           uint64_t *wake_at_ns);

/* The one-wake-up path (docs/fikit.md, "The holder's launch releases the filler"): the fill
 * request the holder's next window would grant first, decided in advance. Writes its task and
 * the least gap after a holder kernel (of known duration) for which that kernel's window
 * grants it first: BestPrioFit's first pick in a window of gap g is the best (priority, then
 * longest waiting) queued request of known duration d <= g - fill_guard_ns, so the pick for
 * every g >= d + fill_guard_ns is that request. 1: there is one; 0: none (no request of known
 * duration is queued, or the holder priority has more than one task or a queued request of
 * its own, or no task). */
GL_FK_API int gl_fk_next_fill(const gl_fk_core *core, uint32_t *task, uint64_t *min_gap_ns);
/* The same one request ahead: a task whose NEXT request (not posted yet) the holder's next
 * window grants first whatever its known duration d, if d + fill_guard_ns <= the window's
 * gap: the only task of the best priority below the holder's, with nothing queued (so no
 * queued request, and no other task's request to come, can come before it). 1: *task is it;
 * 0: none (or a holder request queued, or more than one holder task). The least gap is then
 * max(d + fill_guard_ns, gap_threshold_ns). */
GL_FK_API int gl_fk_next_asker(const gl_fk_core *core, uint32_t *task);
/* The task's queued request already went (its shim was released before the arbiter decided):
 * it is admitted as fill work now. 0, or -1 when the task has no queued request or holds. */
GL_FK_API int gl_fk_release(gl_fk_core *core, uint32_t task, uint64_t now_ns);

/* Introspection for metrics and tests. */
GL_FK_API void gl_fk_get_counters(const gl_fk_core *core, gl_fk_counters *out);
/* The holder priority, -1 with no task. */
GL_FK_API int gl_fk_holder_priority(const gl_fk_core *core);
/* The open gap window's end, or 0 with none open. */
GL_FK_API uint64_t gl_fk_window_end(const gl_fk_core *core);
/* The predicted device tail. */
GL_FK_API uint64_t gl_fk_tail(const gl_fk_core *core);
/* 1 if the task has a queued request, 0 if not, -1 if it is not an active task. */
GL_FK_API int gl_fk_has_request(const gl_fk_core *core, uint32_t task);
/* Outstanding (admitted, not completed) kernels of the task; 0 for a bad id. */
GL_FK_API uint32_t gl_fk_outstanding(const gl_fk_core *core, uint32_t task);

#endif
