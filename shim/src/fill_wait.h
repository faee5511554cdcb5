/* A FIKIT filler's sleep, shared by the shim (fikit_gate.c) and the benchmark client
 * (scripts/bench_fikit_client.c), so the benchmark measures the shim's own wait. */
#ifndef GL_FILL_WAIT_H
#define GL_FILL_WAIT_H

#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "wire.h"

/* Sleeps until the grant word, the arm word or the board's launch word (board may be NULL)
 * moves, or `ns` pass. Before Linux 5.16 (no futex_waitv) it waits on the grant word alone:
 * no early release by the holder's launch. */
static inline void gl_wait_fill_words(uint8_t *r, uint32_t granted, uint32_t arm_wait,
                                      uint8_t *board, uint32_t launch, long ns) {
    struct futex_waitv w[3] = {
        {.val = granted, .uaddr = (uintptr_t)(r + GL_OFF_FK_GRANT), .flags = FUTEX_32},
        {.val = arm_wait, .uaddr = (uintptr_t)(r + GL_OFF_FK_ARM_WAIT), .flags = FUTEX_32},
        {.val = launch, .uaddr = (uintptr_t)(board + GL_BOARD_LAUNCH), .flags = FUTEX_32},
    };
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_nsec += ns;
    while (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    if (syscall(SYS_futex_waitv, w, board ? 3u : 2u, 0u, &until, CLOCK_MONOTONIC) < 0 &&
        errno == ENOSYS)
        syscall(SYS_futex, (uint32_t *)(r + GL_OFF_FK_GRANT), FUTEX_WAIT, granted,
                &(struct timespec){.tv_sec = 0, .tv_nsec = ns}, NULL, 0);
}

#endif
