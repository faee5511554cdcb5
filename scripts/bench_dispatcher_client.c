/* A C benchmark client of the shim channel: registers, then measures lease round trips.
 *
 * It speaks the protocol with the shim's own wire code (shim/src/wire.c), so that
 * scripts/bench_dispatcher measures the dispatcher and not a Python client's own overhead.
 *
 *   bench_dispatcher_client SOCKET TOKEN SECONDS PAUSE_US SPIN_US desk|socket OUT
 *   bench_dispatcher_client --pingpong SECONDS PAUSE_US OUT
 *   bench_dispatcher_client --pingpong-futex SECONDS PAUSE_US OUT
 *   bench_dispatcher_client --desk-alone CLIENTS SECONDS PAUSE_US SPIN_US OUT
 * writes one int64 latency in nanoseconds per round trip to OUT. `--desk-alone` runs the
 * admission engine (shim/src/engine.c and its lease half leasedesk.c, the dispatcher's own code)
 * in this bare C process, with open-ended standing terms for CLIENTS forked clients that ask as
 * `desk` does: the engine's lease mechanism without the dispatcher's Python around it. `desk`
 * asks as the shim does when the dispatcher gave it the engine's doorbell (request words in the
 * region, the doorbell rung);
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

#include "engine.h"
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

static void sleep_us(long pause_us) {
    if (pause_us <= 0) return;
    struct timespec pause = {.tv_sec = pause_us / 1000000, .tv_nsec = (pause_us % 1000000) * 1000};
    nanosleep(&pause, NULL);
}

enum { LATENCIES_CAPACITY = 1 << 20 };

static int64_t *latency_buffer(void) {
    int64_t *latencies = malloc(LATENCIES_CAPACITY * sizeof *latencies);
    if (latencies == NULL) die("malloc");
    return latencies;
}

/* The latencies (ns), raw int64s, to `out_path`. */
static void write_latencies(const char *out_path, const int64_t *latencies, size_t count) {
    FILE *out = fopen(out_path, "wb");
    if (out == NULL) die("open output");
    if (fwrite(latencies, sizeof *latencies, count, out) != count) die("write output");
    fclose(out);
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

/* Lease round trips until `seconds` pass: release the previous lease with its usage and ask
 * for the next one, then wait for it in the region. Latencies (ns) to `out_path`. */
static void measure(volatile uint8_t *region, int sock, int doorbell, int use_desk,
                    double seconds, long pause_us, uint64_t spin_ns, const char *out_path) {
    size_t count = 0;
    int64_t *latencies = latency_buffer();
    uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9);
    int first = 1;
    while (now_ns() < stop && count < LATENCIES_CAPACITY) {
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
        sleep_us(pause_us);
    }
    write_latencies(out_path, latencies, count);
    free(latencies);
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
    size_t count = 0;
    int64_t *latencies = latency_buffer();
    uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9);
    while (now_ns() < stop && count < LATENCIES_CAPACITY) {
        char byte = 'x';
        uint64_t started = now_ns();
        if (send(pair[0], &byte, 1, 0) != 1 || recv(pair[0], &byte, 1, 0) != 1) die("pingpong");
        latencies[count++] = (int64_t)(now_ns() - started);
        sleep_us(pause_us);
    }
    close(pair[0]);
    waitpid(child, NULL, 0);
    write_latencies(out_path, latencies, count);
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
    size_t count = 0;
    int64_t *latencies = latency_buffer();
    uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9), one = 1;
    while (now_ns() < stop && count < LATENCIES_CAPACITY) {
        uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        uint64_t started = now_ns();
        if (write(bell, &one, sizeof one) != (ssize_t)sizeof one) die("eventfd");
        while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == seen)
            syscall(SYS_futex, word, FUTEX_WAIT, seen, NULL, NULL, 0);
        latencies[count++] = (int64_t)(now_ns() - started);
        sleep_us(pause_us);
    }
    __atomic_store_n(word + 1, 1, __ATOMIC_RELEASE);
    if (write(bell, &one, sizeof one) != (ssize_t)sizeof one) die("eventfd");
    waitpid(child, NULL, 0);
    write_latencies(out_path, latencies, count);
    return 0;
}

/* The admission engine alone: its thread in this process (its FIKIT half idle, as under a token
 * policy), CLIENTS forked clients on regions of their own with open-ended standing terms, this
 * process taking the journal as the dispatcher's channel thread does (else the engine would
 * throttle). No Python, no socket. */
static int desk_alone(int clients, double seconds, long pause_us, uint64_t spin_ns,
                      const char *out_path) {
    if (clients < 1 || clients > (int)GL_DESK_MAX_SLOTS) die("--desk-alone: CLIENTS out of range");
    int doorbell = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    int notify = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (doorbell < 0 || notify < 0) die("eventfd");
    gl_fk_config config;
    gl_fk_default_config(&config);
    gl_engine *engine = gl_engine_start(&config, doorbell, notify, 20 * 1000000ull, NULL);
    if (engine == NULL) die("gl_engine_start");
    volatile uint8_t **regions = calloc((size_t)clients, sizeof *regions);
    if (regions == NULL) die("calloc");
    uint64_t window_ns = 1000000000ull;
    for (int i = 0; i < clients; i++) {
        int fd = memfd_create("gl-bench-region", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, GL_REGION_BYTES) != 0) die("region");
        regions[i] = mmap(NULL, GL_REGION_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (regions[i] == MAP_FAILED) die("mmap region");
        int slot = gl_engine_lease_add(engine, fd);
        gl_desk_terms terms = {.lease_ns = GL_DESK_FOREVER,
                               .budget_ns = GL_DESK_FOREVER,
                               .min_lease_ns = 1,
                               .limit_ns = GL_DESK_FOREVER,
                               .window_ns = window_ns,
                               .window_end_ns = now_ns() + window_ns};
        if (slot < 0 || gl_engine_set_terms(engine, slot, &terms) != 0) die("desk terms");
        close(fd);
    }
    size_t name_size = strlen(out_path) + 16;
    char *name = malloc(name_size);
    if (name == NULL) die("malloc");
    for (int i = 0; i < clients; i++) {
        pid_t child = fork();
        if (child < 0) die("fork");
        if (child == 0) {
            snprintf(name, name_size, "%s.%d", out_path, i);
            measure(regions[i], -1, doorbell, 1, seconds, pause_us, spin_ns, name);
            _exit(0);
        }
    }
    gl_desk_event events[256];
    int running = clients, failed = 0;
    while (running > 0) {
        struct timespec tick = {.tv_sec = 0, .tv_nsec = 20 * 1000000};
        nanosleep(&tick, NULL);
        uint64_t rung;  /* clear the desk's notification; the journal is taken either way */
        ssize_t cleared = read(notify, &rung, sizeof rung);
        (void)cleared;
        while (gl_engine_take(engine, events, 256) > 0) {
        }
        int status;
        pid_t done;
        while ((done = waitpid(-1, &status, WNOHANG)) > 0) {
            running--;
            failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
        }
    }
    gl_engine_stop(engine);
    if (failed) die("a desk client failed");
    FILE *out = fopen(out_path, "wb");
    if (out == NULL) die("open output");
    for (int i = 0; i < clients; i++) {
        snprintf(name, name_size, "%s.%d", out_path, i);
        FILE *part = fopen(name, "rb");
        if (part == NULL) die("open a client's output");
        int64_t latency;
        while (fread(&latency, sizeof latency, 1, part) == 1)
            if (fwrite(&latency, sizeof latency, 1, out) != 1) die("write output");
        fclose(part);
        unlink(name);
    }
    fclose(out);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "--pingpong") == 0)
        return pingpong(atof(argv[2]), atol(argv[3]), argv[4]);
    if (argc == 5 && strcmp(argv[1], "--pingpong-futex") == 0)
        return pingpong_futex(atof(argv[2]), atol(argv[3]), argv[4]);
    if (argc == 7 && strcmp(argv[1], "--desk-alone") == 0)
        return desk_alone(atoi(argv[2]), atof(argv[3]), atol(argv[4]),
                          (uint64_t)atol(argv[5]) * 1000u, argv[6]);
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

    measure(region, sock, doorbell, use_desk, seconds, pause_us, spin_ns, argv[7]);
    close(sock);
    return 0;
}
