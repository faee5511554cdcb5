/* A C benchmark client of the shim channel: registers, then measures lease round trips.
 *
 * It speaks the protocol with the shim's own wire code (shim/src/wire.c), so that
 * scripts/bench_dispatcher measures the dispatcher and not a Python client's own overhead.
 *
 *   bench_dispatcher_client SOCKET TOKEN SECONDS PAUSE_US SPIN_US desk|socket OUT
 *   bench_dispatcher_client --pingpong SECONDS PAUSE_US OUT
 *   bench_dispatcher_client --pingpong-futex SECONDS PAUSE_US OUT
 * writes one int64 latency in nanoseconds per round trip to OUT. `desk` asks as the shim does
 * when the dispatcher runs its lease desk (request words in the region, the doorbell rung);
 * `socket` sends LeaseRequest frames to the Python channel thread.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "wire.h"

static void die(const char *what) {
    fprintf(stderr, "bench_dispatcher_client: %s: %s\n", what, errno ? strerror(errno) : "");
    exit(1);
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static uint32_t load_epoch(volatile uint8_t *region) {
    return __atomic_load_n((uint32_t *)(region + GL_OFF_EPOCH), __ATOMIC_ACQUIRE);
}

static uint64_t load_u64(volatile uint8_t *region, size_t offset) {
    return __atomic_load_n((uint64_t *)(region + offset), __ATOMIC_ACQUIRE);
}

static void wait_change(volatile uint8_t *region, uint32_t seen) {
    struct timespec timeout = {.tv_sec = 1, .tv_nsec = 0};
    syscall(SYS_futex, (uint32_t *)(region + GL_OFF_EPOCH), FUTEX_WAIT, seen, &timeout, NULL, 0);
}

static int ask(int use_desk, int sock, volatile uint8_t *region, int doorbell,
               const gl_usage *report) {
    if (use_desk) return gl_post_lease_request(region, doorbell, report, now_ns());
    return gl_send_lease_request(sock, report);
}

/* The floor: the same round trip between two C processes over a socketpair, blocking
 * send/recv and no dispatcher, so the machine's own wake-up latency shows beside ours. */
static int pingpong(double seconds, long pause_us, const char *out_path) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, pair) != 0) die("socketpair");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        char byte;
        close(pair[0]);
        while (recv(pair[1], &byte, 1, 0) == 1)
            if (send(pair[1], &byte, 1, 0) != 1) break;
        _exit(0);
    }
    close(pair[1]);
    size_t capacity = 1 << 20, count = 0;
    int64_t *latencies = malloc(capacity * sizeof *latencies);
    if (latencies == NULL) die("malloc");
    uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9);
    while (now_ns() < stop && count < capacity) {
        char byte = 'x';
        uint64_t started = now_ns();
        if (send(pair[0], &byte, 1, 0) != 1 || recv(pair[0], &byte, 1, 0) != 1) die("pingpong");
        latencies[count++] = (int64_t)(now_ns() - started);
        if (pause_us > 0) {
            struct timespec pause = {.tv_sec = pause_us / 1000000,
                                     .tv_nsec = (pause_us % 1000000) * 1000};
            nanosleep(&pause, NULL);
        }
    }
    close(pair[0]);
    waitpid(child, NULL, 0);
    FILE *out = fopen(out_path, "wb");
    if (out == NULL) die("open output");
    if (fwrite(latencies, sizeof *latencies, count, out) != count) die("write output");
    fclose(out);
    return 0;
}

/* The floor of the desk's own mechanism: ring an eventfd that another process sleeps on, which
 * bumps a shared word and FUTEX_WAKEs us asleep on it. No dispatcher, same pauses. */
static int pingpong_futex(double seconds, long pause_us, const char *out_path) {
    uint32_t *word = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int bell = eventfd(0, EFD_CLOEXEC);
    if (word == MAP_FAILED || bell < 0) die("futex floor setup");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        uint64_t count;
        while (read(bell, &count, sizeof count) == (ssize_t)sizeof count) {
            if (__atomic_load_n(word + 1, __ATOMIC_ACQUIRE)) break;
            __atomic_add_fetch(word, 1, __ATOMIC_RELEASE);
            syscall(SYS_futex, word, FUTEX_WAKE, 1, NULL, NULL, 0);
        }
        _exit(0);
    }
    size_t capacity = 1 << 20, count = 0;
    int64_t *latencies = malloc(capacity * sizeof *latencies);
    if (latencies == NULL) die("malloc");
    uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9), one = 1;
    while (now_ns() < stop && count < capacity) {
        uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        uint64_t started = now_ns();
        if (write(bell, &one, sizeof one) != (ssize_t)sizeof one) die("eventfd");
        while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == seen)
            syscall(SYS_futex, word, FUTEX_WAIT, seen, NULL, NULL, 0);
        latencies[count++] = (int64_t)(now_ns() - started);
        if (pause_us > 0) {
            struct timespec pause = {.tv_sec = pause_us / 1000000,
                                     .tv_nsec = (pause_us % 1000000) * 1000};
            nanosleep(&pause, NULL);
        }
    }
    __atomic_store_n(word + 1, 1, __ATOMIC_RELEASE);
    if (write(bell, &one, sizeof one) != (ssize_t)sizeof one) die("eventfd");
    waitpid(child, NULL, 0);
    FILE *out = fopen(out_path, "wb");
    if (out == NULL) die("open output");
    if (fwrite(latencies, sizeof *latencies, count, out) != count) die("write output");
    fclose(out);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "--pingpong") == 0)
        return pingpong(atof(argv[2]), atol(argv[3]), argv[4]);
    if (argc == 5 && strcmp(argv[1], "--pingpong-futex") == 0)
        return pingpong_futex(atof(argv[2]), atol(argv[3]), argv[4]);
    if (argc != 8 || (strcmp(argv[6], "desk") != 0 && strcmp(argv[6], "socket") != 0)) {
        fprintf(stderr, "usage: %s SOCKET TOKEN SECONDS PAUSE_US SPIN_US desk|socket OUT\n",
                argv[0]);
        return 2;
    }
    double seconds = atof(argv[3]);
    long pause_us = atol(argv[4]);
    uint64_t spin_ns = (uint64_t)atol(argv[5]) * 1000u;
    int sock, refused, doorbell;
    volatile uint8_t *region;
    gl_registration registration;
    char why[256];
    if (gl_register(argv[1], argv[2], "bench", 5000, &sock, &region, &doorbell, &registration,
                    &refused, why, sizeof why) != 0) {
        fprintf(stderr, "bench_dispatcher_client: %s\n", why);
        return 1;
    }
    int use_desk = strcmp(argv[6], "desk") == 0;
    if (use_desk && doorbell < 0) {
        fprintf(stderr, "bench_dispatcher_client: the dispatcher runs no lease desk\n");
        return 1;
    }

    size_t capacity = 1 << 20, count = 0;
    int64_t *latencies = malloc(capacity * sizeof *latencies);
    if (latencies == NULL) die("malloc");
    uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9);
    int first = 1;
    while (now_ns() < stop && count < capacity) {
        uint64_t previous = load_u64(region, GL_OFF_LEASE_ID);
        gl_usage report = {.lease_id = previous, .gpu_time_ns = 1000, .release = 1};
        uint64_t started = now_ns();
        uint32_t epoch = load_epoch(region);
        if (ask(use_desk, sock, region, doorbell, first ? NULL : &report) != 0) die("send");
        for (;;) {
            uint64_t lease = load_u64(region, GL_OFF_LEASE_ID);
            if (lease != previous && lease != 0) {
                if (now_ns() < load_u64(region, GL_OFF_ADMIT_UNTIL)) break;
                /* Granted and expired before we looked (we were descheduled): ask again. */
                previous = lease;
                gl_usage unused = {.lease_id = lease};
                if (ask(use_desk, sock, region, doorbell, &unused) != 0) die("send");
            }
            /* Optionally spin before sleeping: waking a sleeping process costs the dispatcher
             * a system call several times dearer than a FUTEX_WAKE nobody waits on, but a
             * spinner takes a CPU the dispatcher may need. */
            if (now_ns() - started < spin_ns) {
                __builtin_ia32_pause();
                continue;
            }
            wait_change(region, epoch);
            epoch = load_epoch(region);
        }
        if (!first) latencies[count++] = (int64_t)(now_ns() - started);
        first = 0;
        if (pause_us > 0) {
            struct timespec pause = {.tv_sec = pause_us / 1000000,
                                     .tv_nsec = (pause_us % 1000000) * 1000};
            nanosleep(&pause, NULL);
        }
    }
    FILE *out = fopen(argv[7], "wb");
    if (out == NULL) die("open output");
    if (fwrite(latencies, sizeof *latencies, count, out) != count) die("write output");
    fclose(out);
    close(sock);
    return 0;
}
