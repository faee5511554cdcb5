#define _GNU_SOURCE
#include "wire.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ---- encoding ---- */

static size_t put_varint(uint8_t *out, uint64_t value) {
    size_t n = 0;
    while (value >= 0x80) {
        out[n++] = (uint8_t)(value | 0x80);
        value >>= 7;
    }
    out[n++] = (uint8_t)value;
    return n;
}

static size_t put_uint_field(uint8_t *out, unsigned field, uint64_t value) {
    if (value == 0) return 0; /* proto3: defaults are not sent */
    size_t n = put_varint(out, (uint64_t)field << 3);
    return n + put_varint(out + n, value);
}

static size_t put_bytes_field(uint8_t *out, unsigned field, const void *data, size_t length) {
    size_t n = put_varint(out, ((uint64_t)field << 3) | 2);
    n += put_varint(out + n, length);
    memcpy(out + n, data, length);
    return n + length;
}

static int send_all(int sock, const uint8_t *data, size_t length) {
    while (length > 0) {
        ssize_t sent = send(sock, data, length, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        data += sent;
        length -= (size_t)sent;
    }
    return 0;
}

/* Frame = u32 little-endian length + payload (x86-64 and aarch64 Linux are little-endian). */
static int send_frame(int sock, const uint8_t *payload, size_t length) {
    uint8_t frame[1024];
    uint32_t n = (uint32_t)length;
    if (length + 4 > sizeof frame) { /* a Register with a long command line: two sends */
        return send_all(sock, (const uint8_t *)&n, 4) == 0 ? send_all(sock, payload, length)
                                                           : -1;
    }
    memcpy(frame, &n, 4);
    memcpy(frame + 4, payload, length);
    return send_all(sock, frame, length + 4);
}

static size_t encode_usage(uint8_t *out, const gl_usage *u) {
    size_t n = 0;
    n += put_uint_field(out + n, 1, u->lease_id);
    n += put_uint_field(out + n, 2, u->gpu_time_ns);
    n += put_uint_field(out + n, 3, u->longest_burst_ns);
    n += put_uint_field(out + n, 4, u->release ? 1 : 0);
    n += put_uint_field(out + n, 5, u->allocated_bytes);
    return n;
}

int gl_send_lease_request(int sock, const gl_usage *report) {
    uint8_t usage[64], request[80], message[96];
    size_t q = 0;
    if (report) q = put_bytes_field(request, 1, usage, encode_usage(usage, report));
    size_t m = put_bytes_field(message, 2, request, q); /* ShimMessage.lease_request */
    return send_frame(sock, message, m);
}

int gl_send_usage(int sock, const gl_usage *report) {
    uint8_t usage[64], message[80];
    size_t m = put_bytes_field(message, 3, usage, encode_usage(usage, report));
    return send_frame(sock, message, m);
}

static size_t put_dim3(uint8_t *out, unsigned field, const uint32_t d[3]) {
    uint8_t body[3 * 6];
    size_t n = 0;
    for (unsigned i = 0; i < 3; i++) n += put_uint_field(body + n, i + 1, d[i]);
    return put_bytes_field(out, field, body, n);
}

size_t gl_encode_kernel_record(uint8_t *out, const gl_kernel_record *r) {
    uint8_t body[GL_KERNEL_RECORD_MAX];
    size_t n = 0, name_length = r->name ? strnlen(r->name, GL_NAME_MAX - 1) : 0;
    n += put_uint_field(body + n, 1, r->kernel_id);
    n += put_bytes_field(body + n, 2, r->name ? r->name : "", name_length);
    n += put_dim3(body + n, 3, r->dims);
    n += put_dim3(body + n, 4, r->dims + 3);
    n += put_uint_field(body + n, 5, r->start_ns);
    n += put_uint_field(body + n, 6, r->end_ns);
    return put_bytes_field(out, 1, body, n); /* MeasurementBatch.records */
}

int gl_send_measurement_batch(int sock, const uint8_t *records, size_t length) {
    uint8_t head[4 + 1 + 10];
    size_t n = 4;
    head[n++] = (4 << 3) | 2; /* ShimMessage.measurements */
    n += put_varint(head + n, length);
    uint32_t frame = (uint32_t)(n - 4 + length);
    memcpy(head, &frame, 4);
    if (send_all(sock, head, n) != 0) return -1;
    return send_all(sock, records, length);
}

int gl_send_goodbye(int sock) {
    uint8_t message[2];
    size_t m = put_bytes_field(message, 5, "", 0);
    return send_frame(sock, message, m);
}

/* ---- the lease desk's request words ---- */

int gl_post_lease_request(volatile uint8_t *region, int doorbell, const gl_usage *report,
                          uint64_t now_ns) {
    uint8_t *r = (uint8_t *)region;
    uint32_t flags = 0;
    if (report != NULL) {
        flags = GL_LR_REPORT | (report->release ? GL_LR_RELEASE : 0u);
        __atomic_store_n((uint64_t *)(r + GL_OFF_LR_LEASE), report->lease_id, __ATOMIC_RELAXED);
        __atomic_store_n((uint64_t *)(r + GL_OFF_LR_GPU_NS), report->gpu_time_ns,
                         __ATOMIC_RELAXED);
        __atomic_store_n((uint64_t *)(r + GL_OFF_LR_BURST_NS), report->longest_burst_ns,
                         __ATOMIC_RELAXED);
        __atomic_store_n((uint64_t *)(r + GL_OFF_LR_ALLOCATED), report->allocated_bytes,
                         __ATOMIC_RELAXED);
    }
    __atomic_store_n((uint32_t *)(r + GL_OFF_LR_FLAGS), flags, __ATOMIC_RELAXED);
    __atomic_store_n((uint64_t *)(r + GL_OFF_LR_POST_NS), now_ns, __ATOMIC_RELAXED);
    /* Only this process writes the sequence number: its own last value, plus one. */
    uint32_t seq = __atomic_load_n((uint32_t *)(r + GL_OFF_LR_SEQ), __ATOMIC_RELAXED) + 1;
    __atomic_store_n((uint32_t *)(r + GL_OFF_LR_SEQ), seq, __ATOMIC_RELEASE);
    uint64_t one = 1;
    return write(doorbell, &one, sizeof one) == (ssize_t)sizeof one ? 0 : -1;
}

/* ---- decoding ---- */

static int get_varint(const uint8_t *data, size_t length, size_t *pos, uint64_t *out) {
    uint64_t value = 0;
    for (unsigned shift = 0; shift < 64; shift += 7) {
        if (*pos >= length) return -1;
        uint8_t byte = data[(*pos)++];
        value |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *out = value;
            return 0;
        }
    }
    return -1;
}

/* Iterate the fields of a message: returns 1 with field/type/value (or data/len), 0 at the
 * end, -1 malformed. */
static int next_field(const uint8_t *data, size_t length, size_t *pos, unsigned *field,
                      uint64_t *value, const uint8_t **bytes) {
    if (*pos >= length) return 0;
    uint64_t key;
    if (get_varint(data, length, pos, &key) != 0) return -1;
    *field = (unsigned)(key >> 3);
    *bytes = NULL;
    switch (key & 7) {
    case 0:
        return get_varint(data, length, pos, value) == 0 ? 1 : -1;
    case 1:
        if (*pos + 8 > length) return -1;
        memcpy(value, data + *pos, 8);
        *pos += 8;
        return 1;
    case 5: {
        uint32_t v;
        if (*pos + 4 > length) return -1;
        memcpy(&v, data + *pos, 4);
        *value = v;
        *pos += 4;
        return 1;
    }
    case 2:
        if (get_varint(data, length, pos, value) != 0 || *value > length - *pos) return -1;
        *bytes = data + *pos;
        *pos += *value;
        return 1;
    default:
        return -1;
    }
}

/* The first string field 1 of a submessage (Evicted.reason, ProtocolError.message). */
static void first_string(const uint8_t *data, size_t length, char *text, size_t size) {
    size_t pos = 0;
    unsigned field;
    uint64_t value;
    const uint8_t *bytes;
    if (size) text[0] = 0;
    while (next_field(data, length, &pos, &field, &value, &bytes) == 1) {
        if (field == 1 && bytes && size) {
            size_t n = value < size - 1 ? (size_t)value : size - 1;
            memcpy(text, bytes, n);
            text[n] = 0;
            return;
        }
    }
}

int gl_decode_dispatcher(const uint8_t *data, size_t length, gl_registration *reg, char *text,
                         size_t text_size) {
    size_t pos = 0;
    unsigned field;
    uint64_t value;
    const uint8_t *bytes;
    int result = 0, status;
    while ((status = next_field(data, length, &pos, &field, &value, &bytes)) == 1) {
        if (bytes == NULL) continue;
        if (field == 1) {
            size_t inner = 0;
            unsigned f;
            uint64_t v;
            const uint8_t *b;
            int s;
            if (reg) memset(reg, 0, sizeof *reg);
            while ((s = next_field(bytes, (size_t)value, &inner, &f, &v, &b)) == 1) {
                if (reg == NULL || b != NULL) continue;
                if (f == 3) reg->mode = (uint32_t)v;
                if (f == 4) reg->memory_cap_bytes = v;
                if (f == 6) reg->priority = (uint32_t)v;
            }
            if (s < 0) return -1;
            result = 1;
        } else if (field == 2 || field == 3) {
            first_string(bytes, (size_t)value, text, text_size);
            result = (int)field;
        } else if (field == 4) {
            result = 4;
        }
    }
    return status < 0 ? -1 : result;
}

/* A string field into `out` (0: it fits with its NUL, and is not empty). */
static int copy_string(const uint8_t *bytes, uint64_t length, char *out, size_t size) {
    if (length == 0 || length >= size || memchr(bytes, 0, (size_t)length)) return -1;
    memcpy(out, bytes, (size_t)length);
    out[length] = 0;
    return 0;
}

int gl_decode_move(const uint8_t *data, size_t length, char *socket_path, size_t path_size,
                   char *token, size_t token_size) {
    size_t pos = 0;
    unsigned field;
    uint64_t value;
    const uint8_t *bytes;
    int status, found = 0;
    while ((status = next_field(data, length, &pos, &field, &value, &bytes)) == 1) {
        if (field != 4 || bytes == NULL) continue;
        size_t inner = 0;
        unsigned f;
        uint64_t v;
        const uint8_t *b;
        int s, have = 0;
        while ((s = next_field(bytes, (size_t)value, &inner, &f, &v, &b)) == 1) {
            if (b == NULL) continue;
            if (f == 1 && copy_string(b, v, socket_path, path_size) == 0) have |= 1;
            if (f == 2 && copy_string(b, v, token, token_size) == 0) have |= 2;
        }
        if (s < 0) return -1;
        found = have == 3;
    }
    return status == 0 && found ? 0 : -1;
}

/* ---- registration ---- */

static int wait_readable(int sock, int timeout_ms) {
    struct pollfd p = {.fd = sock, .events = POLLIN};
    for (;;) {
        int n = poll(&p, 1, timeout_ms);
        if (n < 0 && errno == EINTR) continue;
        return n;
    }
}

static int recv_exact(int sock, uint8_t *data, size_t length, int timeout_ms) {
    while (length > 0) {
        if (wait_readable(sock, timeout_ms) <= 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        ssize_t got = recv(sock, data, length, 0);
        if (got == 0) {
            errno = ECONNRESET;
            return -1;
        }
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        data += got;
        length -= (size_t)got;
    }
    return 0;
}

/* Register.argv (field 4) from /proc/self/cmdline, so that the dispatcher can derive a task
 * key for a reservation that names none. Bounded as the dispatcher reads it: at most 64
 * arguments of at most 4 KiB, within `room` bytes. */
#define GL_MAX_ARGS 64
#define GL_MAX_ARG_BYTES 4096
#define GL_CMDLINE_BYTES 16384
static size_t put_cmdline(uint8_t *out, size_t room) {
    char *cmdline = malloc(GL_CMDLINE_BYTES);
    FILE *file = cmdline == NULL ? NULL : fopen("/proc/self/cmdline", "rb");
    if (file == NULL) {
        free(cmdline);
        return 0;
    }
    size_t length = fread(cmdline, 1, GL_CMDLINE_BYTES, file);
    fclose(file);
    size_t n = 0, at = 0;
    for (int count = 0; at < length && count < GL_MAX_ARGS; count++) {
        size_t arg = strnlen(cmdline + at, length - at);
        size_t use = arg > GL_MAX_ARG_BYTES ? GL_MAX_ARG_BYTES : arg;
        if (n + use + 16 > room) break;
        n += put_bytes_field(out + n, 4, cmdline + at, use);
        at += arg + 1;
    }
    free(cmdline);
    return n;
}

/* The Register frame: protocol version, token, program name and command line. */
static int send_register(int sock, const char *token, const char *process_name) {
    size_t room = GL_CMDLINE_BYTES + 1024;
    uint8_t *body = malloc(room), *message = malloc(room + 16);
    if (body == NULL || message == NULL) {
        free(body);
        free(message);
        errno = ENOMEM;
        return -1;
    }
    size_t token_length = strlen(token), name_length = strlen(process_name), n = 0;
    if (name_length > 128) name_length = 128;
    if (token_length > 256) token_length = 256;
    n += put_uint_field(body + n, 1, 1); /* protocol_version */
    n += put_bytes_field(body + n, 2, token, token_length);
    n += put_bytes_field(body + n, 3, process_name, name_length);
    n += put_cmdline(body + n, room - n);
    size_t m = put_bytes_field(message, 1, body, n); /* ShimMessage.register */
    int result = send_frame(sock, message, m);
    free(body);
    free(message);
    return result;
}

int gl_register(const char *socket_path, const char *token, const char *process_name,
                int timeout_ms, int *sock_out, volatile uint8_t **region_out, int *doorbell_out,
                gl_registration *reg, int *refused, char *why, size_t why_size) {
    *refused = 0;
    *doorbell_out = -1;
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0) {
        snprintf(why, why_size, "socket: %s", strerror(errno));
        return -1;
    }
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    snprintf(address.sun_path, sizeof address.sun_path, "%s", socket_path);
    struct timeval send_timeout = {.tv_sec = timeout_ms / 1000,
                                   .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof send_timeout);
    if (connect(sock, (struct sockaddr *)&address, sizeof address) != 0) {
        snprintf(why, why_size, "cannot reach the dispatcher at %s: %s", socket_path,
                 strerror(errno));
        close(sock);
        return -1;
    }
    if (send_register(sock, token, process_name) != 0) {
        snprintf(why, why_size, "cannot send registration: %s", strerror(errno));
        close(sock);
        return -1;
    }
    /* The header and the memfd arrive together; read no further than the header. */
    uint8_t header[4];
    size_t have = 0;
    int fd = -1, doorbell = -1, boards[GL_BOARDS];
    size_t board_fds = 0;
    while (have < 4) {
        if (wait_readable(sock, timeout_ms) <= 0) {
            snprintf(why, why_size, "no answer to registration within %d ms", timeout_ms);
            goto fail;
        }
        char control[CMSG_SPACE((2 + GL_BOARDS + 2) * sizeof(int))];
        struct iovec iov = {.iov_base = header + have, .iov_len = 4 - have};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = sizeof control};
        ssize_t got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            snprintf(why, why_size, "the dispatcher closed the connection during registration");
            goto fail;
        }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < count; i++) {
                int received;
                memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof received);
                if (fd < 0)
                    fd = received;
                else if (doorbell < 0)
                    doorbell = received;
                else if (board_fds < GL_BOARDS)
                    boards[board_fds++] = received;
                else
                    close(received);
            }
        }
        have += (size_t)got;
    }
    uint32_t length;
    memcpy(&length, header, 4);
    if (length == 0 || length > 65536) {
        snprintf(why, why_size, "bad registration frame (%u bytes)", length);
        goto fail;
    }
    uint8_t *reply = malloc(length);
    if (reply == NULL || recv_exact(sock, reply, length, timeout_ms) != 0) {
        snprintf(why, why_size, "registration reply cut short: %s", strerror(errno));
        free(reply);
        goto fail;
    }
    char text[256];
    int kind = gl_decode_dispatcher(reply, length, reg, text, sizeof text);
    free(reply);
    if (kind == 3 || kind == 2) {
        *refused = 1;
        snprintf(why, why_size, "dispatcher refused registration: %s", text);
        goto fail;
    }
    if (kind != 1 || fd < 0) {
        snprintf(why, why_size, "unexpected answer to registration");
        goto fail;
    }
    void *mapped = mmap(NULL, GL_REGION_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    fd = -1;
    if (mapped == MAP_FAILED) {
        snprintf(why, why_size, "cannot map the admission region: %s", strerror(errno));
        goto fail;
    }
    uint32_t magic, version;
    memcpy(&magic, (uint8_t *)mapped + GL_OFF_MAGIC, 4);
    memcpy(&version, (uint8_t *)mapped + GL_OFF_VERSION, 4);
    if (magic != GL_REGION_MAGIC || version != GL_REGION_VERSION) {
        munmap(mapped, GL_REGION_BYTES);
        snprintf(why, why_size, "not a gpuloom admission region (magic %#x v%u)", magic, version);
        goto fail;
    }
    if (reg->mode == GL_MODE_FIKIT && doorbell < 0) {
        munmap(mapped, GL_REGION_BYTES);
        snprintf(why, why_size, "FIKIT registration without the GPU's doorbell");
        goto fail;
    }
    /* Priority boards 0..priority, the own one last: with any other count (an older
     * dispatcher, another mode) none is used and the filler waits for the arbiter's grant. */
    if (reg->mode == GL_MODE_FIKIT && reg->priority < GL_BOARDS &&
        board_fds == reg->priority + 1) {
        for (size_t i = 0; i < board_fds; i++) {
            int own = i + 1 == board_fds;
            void *b = mmap(NULL, GL_BOARD_BYTES, own ? PROT_READ | PROT_WRITE : PROT_READ,
                           MAP_SHARED, boards[i], 0);
            if (b == MAP_FAILED) {
                gl_unmap_boards(reg);
                break;
            }
            reg->boards[i] = b;
            reg->board_count = (uint32_t)i + 1;
        }
    }
    for (size_t i = 0; i < board_fds; i++) close(boards[i]);
    board_fds = 0;
    *sock_out = sock;
    *region_out = mapped;
    *doorbell_out = doorbell;
    return 0;
fail:
    if (fd >= 0) close(fd);
    if (doorbell >= 0) close(doorbell);
    for (size_t i = 0; i < board_fds; i++) close(boards[i]);
    close(sock);
    return -1;
}

void gl_unmap_boards(gl_registration *reg) {
    for (uint32_t i = 0; i < reg->board_count && i < GL_BOARDS; i++)
        if (reg->boards[i] != NULL) munmap((void *)reg->boards[i], GL_BOARD_BYTES);
    memset(reg->boards, 0, sizeof reg->boards);
    reg->board_count = 0;
}
