/* Admission: whether a launch may run now. The check every launch makes is inline here (one
 * clock read and one atomic load while a lease lasts); the rest, asking for a lease and
 * waiting for it, is admission.c. */
#ifndef GL_ADMISSION_H
#define GL_ADMISSION_H

#include "shim_internal.h"

#pragma GCC visibility push(hidden)

/* What is being launched: a kernel (its function and dimensions, for its kernel ID), or a
 * graph (f NULL, its ID in `graph`: 0 when it has none, graphs.c). */
typedef struct {
    CUfunction f;
    unsigned dims[6];
    uint64_t graph;
} gl_launch;

/* Everything after the fast check: refusal, loss, eviction, modes, waiting for a lease or a
 * FIKIT grant. *granted_seq is set to a FIKIT grant's sequence number (else 0): pass it to
 * fikit_track after the launch. */
CUresult gate_slow(CUstream key, const gl_launch *launch, uint32_t *granted_seq);

/* The launch path: CUDA_SUCCESS when a launch on `key` may run (waiting if need be, bounded),
 * else what the loss policy answers. In mode FIKIT admit_until stays 0: every launch takes
 * the slow path, whose holder branch is a few stores. */
static inline CUresult gate(CUstream key, const gl_launch *launch, uint32_t *granted_seq) {
    *granted_seq = 0;
    if (!g_config.active) return CUDA_SUCCESS;
    ensure_registered();
    uint8_t *r = region();
    if (LIKELY(r != NULL && conn_state() == CONN_CONNECTED)) {
        uint64_t now = now_ns(), until = r_u64(r, GL_OFF_ADMIT_UNTIL);
        /* A lease ends by itself; admitted until further notice, the dispatcher's heartbeat
         * must be fresh (a hung dispatcher is a lost one). */
        /* (Mode FIKIT under leases: a lease admits nothing by itself, the arbiter decides.) */
        if (now < until && (until != GL_ADMIT_FOREVER || now - r_u64(r, GL_OFF_BEAT) < g_config.alive_ns) &&
            LIKELY(!g_leased))
            return CUDA_SUCCESS;
    }
    return gate_slow(key, launch, granted_seq);
}

/* Whether the dispatcher's heartbeat in region `r` is older than the bound at `now` (a
 * dispatcher that gives none, 0, is not judged by it). */
static inline int dispatcher_silent(const uint8_t *r, uint64_t now) {
    uint64_t beat = r_u64(r, GL_OFF_BEAT);
    return beat != 0 && now > beat && now - beat >= g_config.alive_ns;
}

/* ---- fikit_gate.c: FIKIT kernel admission ---- */

/* A holder posts and goes; a filler requests and waits for its grant (with wait_lock held). */
CUresult fikit_admit(uint8_t *r, CUstream key, const gl_launch *launch, uint32_t *granted_seq,
                     pthread_mutex_t *wait_lock);
/* After a granted launch on `key`: watch it with an event until it completes (quiet, a
 * holder's: its end rings no doorbell). */
void fikit_track(CUstream key, uint32_t seq, int quiet);
/* After an admitted launch (launched: it succeeded): fikit_track, and the doorbell when the
 * holder's fire released it (the arbiter then settles the fire). */
void fikit_after_launch(CUstream key, uint32_t seq, int launched);
/* Report granted kernels that completed; returns how many are still in flight. */
unsigned fikit_harvest(void);
/* A (re)registration: its region, the GPU's doorbell (-1 when the dispatcher gave none) and
 * the priority boards mapped into `reg` (taken over: reg->board_count becomes 0). */
void fikit_adopt(uint8_t *r, int doorbell, gl_registration *reg);
/* The GPU's doorbell: the admission engine's (for kernels and leases alike); -1 if none (a
 * SHARE shim then asks for leases over the socket). */
int gpu_doorbell(void);

#pragma GCC visibility pop

#endif
