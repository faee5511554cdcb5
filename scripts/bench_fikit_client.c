/* A C client of the FIKIT admission path for scripts/bench_fikit: registers with the shim's own
 * wire code (shim/src/wire.c) and speaks the region protocol as the shim does (docs/fikit.md).
 *
 *   bench_fikit_client holder SOCKET TOKEN SECONDS PERIOD_US KERNEL_ID OUT
 *       launches KERNEL_ID every PERIOD_US (posts as the holder shim does: tracked while
 *       somebody waits, its end reported at the next launch); OUT gets the
 *       CLOCK_MONOTONIC time of every launch (u64 ns)
 *       (and fires the arm the arbiter gave it, as the shim's fire_arm does)
 *   bench_fikit_client holder-nofire ...
 *       the same, but never fires an arm: every release takes the arbiter's grant (the two
 *       wake-ups of the path before the arm, measured in the same run)
 *   bench_fikit_client filler SOCKET TOKEN SECONDS KERNEL_ID KERNEL_US OUT
 *       requests KERNEL_ID, and once granted (or released by the holder's fire of its arm)
 *       "runs" it for KERNEL_US (sleeps), reports it done and asks again; OUT gets, per
 *       grant, the time the request was posted, the time the grant was seen, and 1 if the
 *       holder's fire released it, 0 if the arbiter's grant did (three u64)
 *   bench_fikit_client filler-async SOCKET TOKEN SECONDS KERNEL_ID KERNEL_US OUT
 *       the same, but as an application that launches asynchronously (as training does): it
 *       asks for the next kernel right after a release, while the ones released before it
 *       still "run" one after another; each one's end is reported as it comes
 *   bench_fikit_client --futex-pingpong SECONDS PERIOD_US OUT
 *       the floor: one process stamps the time and FUTEX_WAKEs another, asleep on FUTEX_WAIT,
 *       which records how long the wake-up took (u64 ns)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fill_wait.h"
#include "wire.h"

#define CAPACITY (1u << 20)

static void die(const char *what) {
    fprintf(stderr, "bench_fikit_client: %s: %s\n", what, errno ? strerror(errno) : "");
    exit(1);
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static uint32_t load32(volatile uint8_t *r, int offset) {
    return __atomic_load_n((uint32_t *)(r + offset), __ATOMIC_ACQUIRE);
}
static void store32(volatile uint8_t *r, int offset, uint32_t value) {
    __atomic_store_n((uint32_t *)(r + offset), value, __ATOMIC_RELEASE);
}
static void store64(volatile uint8_t *r, int offset, uint64_t value) {
    __atomic_store_n((uint64_t *)(r + offset), value, __ATOMIC_RELEASE);
}

static void futex_wait(volatile void *word, uint32_t seen, long timeout_ns) {
    struct timespec t = {.tv_sec = 0, .tv_nsec = timeout_ns};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &t, NULL, 0);
}

static uint64_t load64(volatile uint8_t *r, int offset) {
    return __atomic_load_n((uint64_t *)(r + offset), __ATOMIC_ACQUIRE);
}

static void ring(int doorbell) {
    uint64_t one = 1;
    if (write(doorbell, &one, sizeof one) < 0) { /* a full counter: a wake-up is pending */
    }
}

static void sleep_until(uint64_t when) {
    struct timespec t = {.tv_sec = (time_t)(when / 1000000000u), .tv_nsec = (long)(when % 1000000000u)};
    clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL);
}

static void write_out(const char *path, const uint64_t *values, size_t count) {
    FILE *out = fopen(path, "wb");
    if (out == NULL) die("open output");
    if (fwrite(values, sizeof *values, count, out) != count) die("write output");
    fclose(out);
}

static int futex_pingpong(double seconds, long period_us, const char *out_path) {
    uint64_t *shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) die("mmap");
    uint32_t *word = (uint32_t *)&shared[0];
    uint64_t *stamp = &shared[1];
    uint64_t *results = mmap(NULL, CAPACITY * sizeof *results, PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    uint64_t *count = &shared[2];
    if (results == MAP_FAILED) die("mmap");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        uint32_t seen = 0;
        while (__atomic_load_n(&shared[3], __ATOMIC_ACQUIRE) == 0) {
            uint32_t now = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            if (now == seen) {
                futex_wait(word, seen, 10000000);
                continue;
            }
            seen = now;
            uint64_t woke = now_ns();
            if (*count < CAPACITY) results[(*count)++] = woke - __atomic_load_n(stamp, __ATOMIC_ACQUIRE);
        }
        _exit(0);
    }
    uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9), next = now_ns();
    for (uint32_t n = 1; now_ns() < stop; n++) {
        next += (uint64_t)period_us * 1000u;
        sleep_until(next);
        __atomic_store_n(stamp, now_ns(), __ATOMIC_RELEASE);
        __atomic_store_n(word, n, __ATOMIC_RELEASE);
        syscall(SYS_futex, word, FUTEX_WAKE, 1, NULL, NULL, 0);
    }
    __atomic_store_n(&shared[3], 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(word, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, word, FUTEX_WAKE, 1, NULL, NULL, 0);
    waitpid(child, NULL, 0);
    write_out(out_path, results, *count);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "--futex-pingpong") == 0)
        return futex_pingpong(atof(argv[2]), atol(argv[3]), argv[4]);
    int no_fire = argc == 8 && strcmp(argv[1], "holder-nofire") == 0;
    int holder = argc == 8 && (strcmp(argv[1], "holder") == 0 || no_fire);
    int async = argc == 8 && strcmp(argv[1], "filler-async") == 0;
    int filler = argc == 8 && (strcmp(argv[1], "filler") == 0 || async);
    if (!holder && !filler) {
        fprintf(stderr,
                "usage: %s holder|holder-nofire SOCKET TOKEN SECONDS PERIOD_US KERNEL_ID OUT\n"
                "       %s filler|filler-async SOCKET TOKEN SECONDS KERNEL_ID KERNEL_US OUT\n"
                "       %s --futex-pingpong SECONDS PERIOD_US OUT\n",
                argv[0], argv[0], argv[0]);
        return 2;
    }
    int sock, refused, doorbell;
    volatile uint8_t *r;
    gl_registration registration;
    char why[256];
    if (gl_register(argv[2], argv[3], argv[1], 5000, &sock, &r, &doorbell, &registration,
                    &refused, why, sizeof why) != 0) {
        fprintf(stderr, "bench_fikit_client: %s\n", why);
        return 1;
    }
    if (registration.mode != GL_MODE_FIKIT) {
        fprintf(stderr, "bench_fikit_client: the dispatcher's policy is not fikit\n");
        return 1;
    }
    uint32_t want = holder ? GL_ROLE_HOLDER : GL_ROLE_FILL;
    for (uint64_t until = now_ns() + 2000000000u; load32(r, GL_OFF_FK_ROLE) != want;) {
        if (now_ns() > until) die("no role from the arbiter");
        usleep(100);
    }
    double seconds = atof(argv[4]);
    uint64_t kernel = strtoull(argv[holder ? 6 : 5], NULL, 0);
    uint64_t kernel_ns = holder ? 0 : (uint64_t)atol(argv[6]) * 1000u;
    uint64_t *times = malloc(CAPACITY * sizeof *times);
    if (times == NULL) die("malloc");
    size_t count = 0;
    uint32_t seq = load32(r, GL_OFF_FK_REQ_SEQ);
    uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9);
    uint64_t fired = 0, released = 0;
    if (holder) {
        long period_us = atol(argv[5]);
        for (uint64_t next = now_ns(); next < stop && count < CAPACITY;) {
            next += (uint64_t)period_us * 1000u;
            sleep_until(next);
            uint64_t t = now_ns();
            /* As the shim: while somebody waits (notify), the launch is tracked and its end
             * reported (here at the next launch; the shim's events say it within a ms). */
            uint32_t tracked = load32(r, GL_OFF_FK_NOTIFY);
            store32(r, GL_OFF_FK_DONE, seq);
            store64(r, GL_OFF_FK_POST_NS, t);
            store64(r, GL_OFF_FK_KERNEL, kernel);
            store32(r, GL_OFF_FK_WAITING, tracked ? GL_POST_TRACKED : GL_POST_LAUNCHED);
            store32(r, GL_OFF_FK_REQ_SEQ, ++seq);
            uint64_t nonce = load64(r, GL_OFF_FK_ARM);
            int match = 0;
            for (int k = 0; k < GL_ARM_KERNELS; k++)
                match |= load64(r, GL_OFF_FK_ARM_KERNELS + 8 * k) == kernel;
            int fire = !no_fire && nonce != 0 && nonce != fired && match &&
                       load64(r, GL_OFF_FK_ARM) == nonce && registration.board_count > 0;
            if (fire) {
                volatile uint8_t *board = registration.boards[registration.board_count - 1];
                fired = nonce;
                __atomic_store_n((uint64_t *)(board + GL_BOARD_FIRED), nonce, __ATOMIC_RELEASE);
                __atomic_add_fetch((uint32_t *)(board + GL_BOARD_LAUNCH), 1, __ATOMIC_RELEASE);
                syscall(SYS_futex, (uint32_t *)(board + GL_BOARD_LAUNCH), FUTEX_WAKE, INT_MAX,
                        NULL, NULL, 0);
            }
            if (load32(r, GL_OFF_FK_NOTIFY) && !fire) ring(doorbell); /* the filler rings */
            times[count++] = t;
        }
    } else {
        /* Kernels "in flight" (async): their sequence numbers and when they end, FIFO. */
        uint32_t flight_seq[64];
        uint64_t flight_end[64], device_free = 0;
        unsigned head = 0, in_flight = 0;
        while (now_ns() < stop && count + 3 <= CAPACITY) {
            uint64_t posted = now_ns();
            /* As the shim: an arm given ahead already fired when this request is posted does
             * not release it (read before the post: a fire after it releases the request). */
            uint64_t stale = load64(r, GL_OFF_FK_ARMED);
            uint32_t stale_board = load32(r, GL_OFF_FK_ARM_BOARD);
            if (stale == 0 || load32(r, GL_OFF_FK_ARMED_SEQ) != seq + 1 ||
                stale_board + 1 >= registration.board_count ||
                load64(registration.boards[stale_board], GL_BOARD_FIRED) != stale)
                stale = 0;
            store64(r, GL_OFF_FK_KERNEL, kernel);
            store64(r, GL_OFF_FK_POST_NS, posted);
            store32(r, GL_OFF_FK_WAITING, GL_POST_REQUEST);
            store32(r, GL_OFF_FK_REQ_SEQ, ++seq);
            ring(doorbell);
            unsigned spins = 0;
            uint32_t granted;
            uint64_t by_board = 0;
            /* The board is checked before the grant word: when the holder's fire woke this
             * filler but the arbiter settled it (and wrote the grant) before it ran, the
             * release still counts as the fire's. */
            for (;;) {
                granted = load32(r, GL_OFF_FK_GRANT);
                if (now_ns() >= stop) break;
                uint32_t arm_wait = load32(r, GL_OFF_FK_ARM_WAIT);
                uint64_t nonce = load64(r, GL_OFF_FK_ARMED);
                uint32_t index = load32(r, GL_OFF_FK_ARM_BOARD);
                volatile uint8_t *board = NULL;
                uint32_t launch = 0;
                int any = 0, match = 0; /* an arm ahead names the kernels it holds for */
                for (int k = 0; k < GL_ARM_KERNELS; k++) {
                    uint64_t allowed = load64(r, GL_OFF_FK_ARMED_KERNELS + 8 * k);
                    any |= allowed != 0;
                    match |= allowed != 0 && allowed == kernel;
                }
                int mine = load32(r, GL_OFF_FK_ARMED_SEQ) == seq && (!any || match);
                if (mine && nonce != 0 && nonce != released && nonce != stale &&
                    index + 1 < registration.board_count) {
                    board = registration.boards[index];
                    launch = load32(board, GL_BOARD_LAUNCH);
                    if (load64(board, GL_BOARD_FIRED) == nonce) {
                        released = nonce;
                        store64(r, GL_OFF_FK_RELEASED_KERNEL, kernel);
                        store64(r, GL_OFF_FK_RELEASED, nonce);
                        by_board = 1;
                        break;
                    }
                }
                if (granted == seq) break;
                if (++spins < 2000) continue; /* the shim spins briefly too */
                /* Report kernels that ended (as the shim's events do), then sleep. */
                uint64_t now = now_ns();
                long sleep_ns = 5000000;
                int moved = 0;
                while (in_flight > 0 && flight_end[head] <= now) {
                    store32(r, GL_OFF_FK_DONE, flight_seq[head]);
                    head = (head + 1) % 64;
                    in_flight--;
                    moved = 1;
                }
                if (moved) ring(doorbell);
                if (in_flight > 0 && flight_end[head] - now < (uint64_t)sleep_ns)
                    sleep_ns = (long)(flight_end[head] - now);
                gl_wait_fill_words((uint8_t *)r, granted, arm_wait, (uint8_t *)board, launch, sleep_ns);
            }
            if (!by_board && load32(r, GL_OFF_FK_GRANT) != seq) break;
            uint64_t granted_at = now_ns();
            times[count++] = posted;
            times[count++] = granted_at;
            times[count++] = by_board;
            if (!by_board) store32(r, GL_OFF_FK_WAITING, GL_POST_LAUNCHED);
            if (by_board) ring(doorbell); /* launched: now the arbiter may settle the fire */
            if (!async) {
                sleep_until(granted_at + kernel_ns); /* the kernel runs */
                store32(r, GL_OFF_FK_DONE, seq);
                continue;
            }
            /* Async: the kernel queues behind the ones in flight; ask for the next at once. */
            while (in_flight == 64) {
                sleep_until(flight_end[head]);
                store32(r, GL_OFF_FK_DONE, flight_seq[head]);
                head = (head + 1) % 64;
                in_flight--;
                ring(doorbell);
            }
            device_free = (device_free > granted_at ? device_free : granted_at) + kernel_ns;
            flight_seq[(head + in_flight) % 64] = seq;
            flight_end[(head + in_flight) % 64] = device_free;
            in_flight++;
        }
    }
    write_out(argv[7], times, count);
    return 0;
}
