/* What the dispatcher's native threads (arbiter.c, leasedesk.c) share: the clock, atomic access
 * to the words of a process's region, and the two wake-ups (a futex word, an eventfd). */
#ifndef GL_NATIVE_H
#define GL_NATIVE_H

#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline uint32_t load32(const uint8_t *r, int offset) {
    return __atomic_load_n((const uint32_t *)(r + offset), __ATOMIC_ACQUIRE);
}
static inline uint64_t load64(const uint8_t *r, int offset) {
    return __atomic_load_n((const uint64_t *)(r + offset), __ATOMIC_ACQUIRE);
}
static inline void store32(uint8_t *r, int offset, uint32_t value) {
    __atomic_store_n((uint32_t *)(r + offset), value, __ATOMIC_RELEASE);
}
static inline void store64(uint8_t *r, int offset, uint64_t value) {
    __atomic_store_n((uint64_t *)(r + offset), value, __ATOMIC_RELEASE);
}

/* Wakes every shim sleeping on the u32 futex word at `offset` of region `r`. */
static inline void wake_word(uint8_t *r, int offset) {
    syscall(SYS_futex, (uint32_t *)(r + offset), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Adds one to an eventfd; a full counter means a wake-up is pending anyway. */
static inline void ring_eventfd(int fd) {
    uint64_t one = 1;
    if (write(fd, &one, sizeof one) < 0) {
    }
}

#endif
