/* Admission: whether a launch may run now. The check every launch makes is inline here (one
 * clock read and one atomic load while a lease lasts); the rest, asking for a lease and
 * waiting for it, is admission.c. */
#ifndef GL_ADMISSION_H
#define GL_ADMISSION_H

#include "shim_internal.h"

#pragma GCC visibility push(hidden)

/* Everything after the fast check: refusal, loss, eviction, modes, waiting for a lease. */
CUresult gate_slow(CUstream key);

/* The launch path: CUDA_SUCCESS when a launch on `key` may run (waiting if need be, bounded),
 * else what the loss policy answers. */
static inline CUresult gate(CUstream key) {
    if (!C.active) return CUDA_SUCCESS;
    ensure_registered();
    uint8_t *r = region();
    if (LIKELY(r != NULL && conn_state() == CONN_CONNECTED) &&
        now_ns() < r_u64(r, GL_OFF_ADMIT_UNTIL))
        return CUDA_SUCCESS;
    return gate_slow(key);
}

#pragma GCC visibility pop

#endif
