/* A C benchmark client of the shim channel: registers, then measures lease round trips.
 *
 * It speaks the protocol of protos/gpuloom/v1/shim.proto with hand-encoded protobuf (only the
 * few fields it needs), as the C shim will, so that scripts/bench_dispatcher measures the
 * dispatcher and not a Python client's own overhead.
 *
 *   bench_dispatcher_client SOCKET TOKEN SECONDS PAUSE_US SPIN_US OUT
 *   bench_dispatcher_client --pingpong SECONDS PAUSE_US OUT
 * writes one int64 latency in nanoseconds per round trip to OUT.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define REGION_MAGIC 0x4D534C47u
#define OFF_EPOCH 8
#define OFF_ADMIT_UNTIL 16
#define OFF_LEASE_ID 24

static void die(const char *what) {
    fprintf(stderr, "bench_dispatcher_client: %s: %s\n", what, errno ? strerror(errno) : "");
    exit(1);
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static size_t put_varint(uint8_t *out, uint64_t value) {
    size_t n = 0;
    while (value >= 0x80) {
        out[n++] = (uint8_t)(value | 0x80);
        value >>= 7;
    }
    out[n++] = (uint8_t)value;
    return n;
}

static void send_all(int fd, const uint8_t *data, size_t length) {
    while (length > 0) {
        ssize_t sent = send(fd, data, length, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            die("send");
        }
        data += sent;
        length -= (size_t)sent;
    }
}

/* Frame = u32 little-endian length + payload. */
static void send_frame(int fd, const uint8_t *payload, size_t length) {
    uint8_t frame[1024];
    uint32_t n = (uint32_t)length;
    memcpy(frame, &n, 4); /* x86-64 and aarch64 Linux are little-endian */
    memcpy(frame + 4, payload, length);
    send_all(fd, frame, length + 4);
}

static void recv_all(int fd, uint8_t *data, size_t length) {
    while (length > 0) {
        ssize_t got = recv(fd, data, length, 0);
        if (got == 0) die("dispatcher closed the connection");
        if (got < 0) {
            if (errno == EINTR) continue;
            die("recv");
        }
        data += got;
        length -= (size_t)got;
    }
}

static int register_and_map(int sock, const char *token, volatile uint8_t **region) {
    uint8_t body[512], message[600];
    size_t token_length = strlen(token), n = 0, m = 0;
    if (token_length > 256) die("token too long");
    body[n++] = 0x08; /* Register.protocol_version = 1 */
    body[n++] = 1;
    body[n++] = 0x12; /* Register.assignment_token */
    n += put_varint(body + n, token_length);
    memcpy(body + n, token, token_length);
    n += token_length;
    message[m++] = 0x0a; /* ShimMessage.register */
    m += put_varint(message + m, n);
    memcpy(message + m, body, n);
    m += n;
    send_frame(sock, message, m);

    /* The header and the memfd arrive together. */
    uint8_t header[4];
    char control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {.iov_base = header, .iov_len = sizeof header};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    ssize_t got = recvmsg(sock, &msg, MSG_WAITALL);
    if (got != 4) die("recvmsg of the registration header");
    uint32_t length;
    memcpy(&length, header, 4);
    if (length == 0 || length > 65536) die("bad registration frame");
    uint8_t *reply = malloc(length);
    if (reply == NULL) die("malloc");
    recv_all(sock, reply, length);
    if (reply[0] != 0x0a) { /* DispatcherMessage.registered */
        fprintf(stderr, "bench_dispatcher_client: registration refused\n");
        exit(1);
    }
    free(reply);
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    if (cmsg == NULL || cmsg->cmsg_type != SCM_RIGHTS) die("no shared memory descriptor");
    int fd;
    memcpy(&fd, CMSG_DATA(cmsg), sizeof fd);
    void *mapped = mmap(NULL, 64, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mapped == MAP_FAILED) die("mmap");
    close(fd);
    uint32_t magic;
    memcpy(&magic, mapped, 4);
    if (magic != REGION_MAGIC) die("not an admission region");
    *region = mapped;
    return 0;
}

static uint32_t load_epoch(volatile uint8_t *region) {
    return __atomic_load_n((uint32_t *)(region + OFF_EPOCH), __ATOMIC_ACQUIRE);
}

static uint64_t load_u64(volatile uint8_t *region, size_t offset) {
    return __atomic_load_n((uint64_t *)(region + offset), __ATOMIC_ACQUIRE);
}

static void wait_change(volatile uint8_t *region, uint32_t seen) {
    struct timespec timeout = {.tv_sec = 1, .tv_nsec = 0};
    syscall(SYS_futex, (uint32_t *)(region + OFF_EPOCH), FUTEX_WAIT, seen, &timeout, NULL, 0);
}

/* LeaseRequest{report{lease_id, gpu_time_ns, release}} (or an empty request for lease 0). */
static size_t lease_request(uint8_t *out, uint64_t lease_id) {
    uint8_t report[32], request[40];
    size_t r = 0, q = 0, n = 0;
    if (lease_id) {
        report[r++] = 0x08;
        r += put_varint(report + r, lease_id);
        report[r++] = 0x10;
        r += put_varint(report + r, 1000);
        report[r++] = 0x20;
        report[r++] = 1;
        request[q++] = 0x0a;
        q += put_varint(request + q, r);
        memcpy(request + q, report, r);
        q += r;
    }
    out[n++] = 0x12; /* ShimMessage.lease_request */
    n += put_varint(out + n, q);
    memcpy(out + n, request, q);
    return n + q;
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

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "--pingpong") == 0)
        return pingpong(atof(argv[2]), atol(argv[3]), argv[4]);
    if (argc != 7) {
        fprintf(stderr, "usage: %s SOCKET TOKEN SECONDS PAUSE_US SPIN_US OUT\n", argv[0]);
        return 2;
    }
    double seconds = atof(argv[3]);
    long pause_us = atol(argv[4]);
    uint64_t spin_ns = (uint64_t)atol(argv[5]) * 1000u;
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    if (strlen(argv[1]) >= sizeof address.sun_path) die("socket path too long");
    strcpy(address.sun_path, argv[1]);
    if (connect(sock, (struct sockaddr *)&address, sizeof address) != 0) die("connect");
    volatile uint8_t *region;
    register_and_map(sock, argv[2], &region);

    size_t capacity = 1 << 20, count = 0;
    int64_t *latencies = malloc(capacity * sizeof *latencies);
    if (latencies == NULL) die("malloc");
    uint8_t message[64];
    uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9);
    int first = 1;
    while (now_ns() < stop && count < capacity) {
        uint64_t previous = load_u64(region, OFF_LEASE_ID);
        size_t length = lease_request(message, first ? 0 : previous);
        uint64_t started = now_ns();
        uint32_t epoch = load_epoch(region);
        send_frame(sock, message, length);
        for (;;) {
            uint64_t lease = load_u64(region, OFF_LEASE_ID);
            if (lease != previous && lease != 0) {
                if (now_ns() < load_u64(region, OFF_ADMIT_UNTIL)) break;
                /* Granted and expired before we looked (we were descheduled): ask again. */
                previous = lease;
                length = lease_request(message, lease);
                send_frame(sock, message, length);
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
    FILE *out = fopen(argv[6], "wb");
    if (out == NULL) die("open output");
    if (fwrite(latencies, sizeof *latencies, count, out) != count) die("write output");
    fclose(out);
    close(sock);
    return 0;
}
