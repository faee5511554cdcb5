/* The lease part of the admission engine (engine.h): it hands out token leases to the shims
 * of one GPU without waking Python (docs/dispatcher.md). Nothing here locks or sleeps:
 * engine.c calls every function below with its one mutex held.
 *
 * A shim in mode SHARE posts a lease request into its own admission region (the GL_OFF_LR_*
 * words, with the usage report of the lease that ended) and rings the GPU's doorbell. The
 * desk renews the lease at once when the dispatcher's token policy has given that process
 * standing terms (a lease length, a budget of lease time, a validity): the policy's answer,
 * decided in Python beforehand, to "what would you grant this process if it alone asked
 * now". Anything else (no terms, budget spent, terms expired) is forwarded to Python as an
 * event and answered by the token scheduler as before. Every renewal is journaled, so the
 * scheduler's books follow the desk's.
 *
 * Who writes what: the shim writes only its LR_* words; the desk validates them and writes the
 * lease words (epoch, state, admit_until, lease_id) of a process only while that process has
 * standing terms. Python withdraws all terms (gl_desk_revoke_all) before it writes any lease
 * word itself, so the two never write one region at the same time. */
#ifndef GL_LEASEDESK_H
#define GL_LEASEDESK_H

#include <stdint.h>

#pragma GCC visibility push(hidden)

#define GL_DESK_MAX_SLOTS 256u
#define GL_DESK_JOURNAL 4096u     /* events held until Python takes them */
#define GL_DESK_SLOT_EVENTS 512u  /* at most this many untaken events per process */
#define GL_DESK_FOREVER UINT64_MAX /* an open-ended lease, or a budget without bound */
/* Native lease ids carry this bit; the token scheduler counts its own from 1. */
#define GL_DESK_LEASE_BASE (1ull << 62)

typedef struct gl_desk gl_desk;

/* What a process with standing terms gets on request: a lease of min(lease_ns, what is left of
 * budget_ns), unless that is shorter than min_lease_ns (then the request goes to Python).
 * lease_ns GL_DESK_FOREVER: open-ended, budget_ns GL_DESK_FOREVER: no bound. The budget is
 * what is left of the quota limit in the window ending at window_end_ns; at each window's end
 * it grows as the scheduler's does (by limit_ns per window passed, to at most limit_ns), so
 * terms stay good across windows. */
typedef struct {
    uint64_t lease_ns;
    uint64_t budget_ns;
    uint64_t min_lease_ns;
    uint64_t limit_ns;
    uint64_t window_ns;
    uint64_t window_end_ns;
} gl_desk_terms;

enum { GL_DESK_RENEWED = 1, GL_DESK_FORWARDED = 2 };
/* In a forwarded event's flags: the request words failed validation (Python closes the
 * connection, as it does for an implausible report on the socket). */
#define GL_DESK_INVALID 0x80000000u

/* One journal entry: a lease the desk granted, or a request it left to Python. */
typedef struct {
    uint32_t kind;   /* GL_DESK_* */
    uint32_t slot;
    uint32_t flags;  /* the request's GL_LR_* (validated: a report's words are sane) */
    uint32_t seq;
    uint64_t report_lease, gpu_ns, burst_ns; /* the usage report (flags & GL_LR_REPORT) */
    uint64_t allocated_bytes;                /* ... and the device memory it holds */
    uint64_t posted_ns, at_ns;               /* when the shim posted; when the desk took it */
    uint64_t lease_id, until_ns;             /* RENEWED: the lease written into the region */
    int64_t charge_ns; /* what it took from the budget, net of what its report gave back */
} gl_desk_event;

typedef struct {
    uint64_t rounds;         /* times the engine's thread woke and looked at the slots */
    uint64_t requests;       /* requests read from the regions */
    uint64_t renewed;        /* ... answered by the desk */
    uint64_t forwarded;      /* ... left to Python */
    uint64_t invalid_writes; /* request words rejected (implausible report) */
    uint64_t throttled;      /* requests left unread while their process had too many untaken
                                events (read once Python takes them) */
    uint32_t slots;          /* processes now registered */
    uint32_t pending;        /* events not yet taken */
} gl_desk_stats;

/* A lease part. `notify_fd`: an eventfd it writes when Python should take events (a
 * forwarded request, or a journal filling up); it stays the caller's. NULL (errno set) on
 * failure. */
gl_desk *gl_desk_new(int notify_fd);
/* Unmaps every region and frees the part. */
void gl_desk_free(gl_desk *desk);

/* One round at `now`: every request posted since the last one, renewed or forwarded. */
void gl_desk_round(gl_desk *desk, uint64_t now);

/* Registers a process: maps its region (region_fd stays the caller's). Its current request
 * sequence number is history, not a request. Returns its slot, or -1 with errno EINVAL or
 * ENOSPC (all slots taken). It starts without terms. */
int gl_desk_add(gl_desk *desk, int region_fd);
/* Forgets a process and unmaps its region; its untaken events are dropped. */
void gl_desk_remove(gl_desk *desk, int slot);

/* Gives (terms != NULL) or withdraws (NULL) a process's standing terms. The budget given is
 * taken as computed from the events taken so far: what the untaken ones charged comes off it.
 * -1 with errno EINVAL (bad slot or terms) or ENOENT (no such process). */
int gl_desk_set_terms(gl_desk *desk, int slot, const gl_desk_terms *terms);
/* Withdraws every process's terms: when it returns, the desk writes no lease word until new
 * terms are given. */
void gl_desk_revoke_all(gl_desk *desk);

/* Takes up to `max` events, oldest first; returns how many. *rescan is set when requests were
 * left unread for want of journal room: the caller rings the doorbell so they are read now. */
uint32_t gl_desk_take(gl_desk *desk, gl_desk_event *out, uint32_t max, int *rescan);

void gl_desk_get_stats(const gl_desk *desk, gl_desk_stats *out);

#pragma GCC visibility pop

#endif
