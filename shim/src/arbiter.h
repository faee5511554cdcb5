/* The FIKIT part of the admission engine (engine.h): the state and the round that admit the
 * kernels of every FIKIT shim of one GPU with the FIKIT decision core (fikit.h).
 *
 * Each shim shares two things with the engine: its own admission region (a memfd, see wire.h:
 * the engine writes the words at GL_OFF_FK_GRANT.., the shim those at GL_OFF_FK_REQ_SEQ..) and
 * the GPU's doorbell, an eventfd a shim writes to after posting a request. No memory is shared
 * between two shims, so one cannot write another's state; what a shim writes is validated
 * here before the core sees it. Nothing here locks or sleeps: engine.c calls every function
 * below with its one mutex held, from its one thread or from the dispatcher's calls. */
#ifndef GL_ARBITER_H
#define GL_ARBITER_H

#include <stdint.h>

#include "fikit.h"
#include "spatial.h"

#pragma GCC visibility push(hidden)

typedef struct gl_arbiter gl_arbiter;

typedef struct {
    uint64_t rounds;            /* times the thread woke and looked at the slots */
    uint64_t requests;          /* requests handed to the core (holder launches included) */
    uint64_t grants;            /* queued requests granted */
    uint64_t unknown_kernels;   /* requests whose kernel ID is not in the task's profile */
    uint64_t invalid_writes;    /* shim-written words rejected (out of range, going backwards) */
    uint64_t role_races;        /* holder launches the core had queued (task switching races) */
    uint64_t arms;              /* arms published: a filler's request released by the holder's
                                   next launch of a named kernel, decided in advance */
    uint64_t fired;             /* arms the holder's launch fired (the filler released at once) */
    uint64_t late_releases;     /* releases a filler reported for an arm already withdrawn */
    uint64_t harvested;         /* requests the spatial rule let go beside the holder (MPS) */
    uint32_t tasks;             /* tasks now registered */
    uint32_t waiting;           /* tasks now blocked on a grant */
} gl_arbiter_stats;

/* A task's kernel profile: per kernel its ID, mean duration and mean gap after it (ns;
 * GL_FK_UNKNOWN allowed), the SMs its launch shape occupies (0: unknown) and its bound class
 * (GL_SP_*); `sm_usage` and `bounds` may be NULL (all unknown). */
typedef struct {
    const uint64_t *ids;
    const uint64_t *durations_ns;
    const uint64_t *gaps_ns;
    const uint32_t *sm_usage;
    const uint32_t *bounds;
    uint32_t count;
} gl_kernel_table;

/* A FIKIT part: `beat_ns` is how often every region's heartbeat is refreshed; `harvest` the
 * spatial rule's config when the GPU runs MPS (NULL: off, the rule is never asked). NULL
 * (errno set) on a bad config or when its priority boards cannot be made. */
gl_arbiter *gl_arbiter_new(const gl_fk_config *config, uint64_t beat_ns,
                           const gl_sp_config *harvest);

/* Unmaps every region, closes the boards, frees the part. */
void gl_arbiter_free(gl_arbiter *arbiter);

/* One round at `now` (see arbiter.c). */
void gl_arbiter_round(gl_arbiter *arbiter, uint64_t now);

/* When the next timed round is due: the heartbeat or the core's next decision time. */
uint64_t gl_arbiter_next_round(const gl_arbiter *arbiter);

/* The priority board of `priority` (0..GL_BOARDS-1): the read-write descriptor (for the
 * processes of that priority) or the read-only one (for worse priorities). The part keeps
 * both open for its life; send copies. -1 (EINVAL) for a bad priority. */
int gl_arbiter_board_fd(gl_arbiter *arbiter, uint32_t priority, int writable);

/* Registers a task: maps its region (region_fd stays the caller's), takes a copy of its kernel
 * profile, its priority and its SM partition (1..100 percent: the spatial rule caps its
 * kernels' SMs at it). Returns the task's slot (0..GL_FK_MAX_TASKS-1), or -1 with errno:
 * EINVAL (bad priority, SM percent, region or table), ENOSPC (all slots taken), ENOMEM. */
int gl_arbiter_add_task(gl_arbiter *arbiter, int region_fd, uint32_t priority,
                        uint32_t sm_percent, const gl_kernel_table *kernels);

/* Replaces a task's kernel profile (it arrived after the task registered). -1 with errno
 * EINVAL, ENOENT (no such task) or ENOMEM. */
int gl_arbiter_set_kernels(gl_arbiter *arbiter, int slot, const gl_kernel_table *kernels);

/* Forgets a task (its queued request and outstanding work included) and unmaps its region. */
void gl_arbiter_remove_task(gl_arbiter *arbiter, int slot);

/* A task suspended (on) or resumed (off) by the dispatcher: suspended, it is out of the
 * decision core (better priorities' absence lets the next one hold the GPU at full speed) and
 * its posts are not read; resumed, it competes again from its current words. 0, or -1 for a
 * slot not in use. */
int gl_arbiter_set_suspended(gl_arbiter *arbiter, int slot, int on);

/* Pauses (off) or resumes (on) asking the spatial rule, as the GPU's MPS daemon stops or runs
 * again (a process reserved meanwhile is no MPS client). 0, or -1 to turn on a part started
 * without the rule's config. */
int gl_arbiter_set_harvesting(gl_arbiter *arbiter, int on);

void gl_arbiter_get_stats(const gl_arbiter *arbiter, gl_arbiter_stats *out);

/* The decision core's own counters (windows, fills granted in windows or while idle). */
void gl_arbiter_get_core_counters(const gl_arbiter *arbiter, gl_fk_counters *out);

#pragma GCC visibility pop

#endif
