/* The dispatcher connection: its state, registration (at first use) and re-registration,
 * sending under one lock, what a loss means (GPULOOM_ON_DISPATCHER_LOSS), the background thread
 * that reads the socket and reconnects, and the goodbye at exit.
 * Owns: g_conn, g_sock, g_region, g_mode, g_loss_logged, g_exiting, g_send_lock,
 * g_register_once, g_wake_fd. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "admission.h"

int g_conn = CONN_NONE;
static int g_sock = -1; /* guarded by g_send_lock for writers */
uint8_t *g_region;
uint32_t g_mode;
uint32_t g_leased;
static int g_loss_logged; /* atomic: the policy was announced this episode */
static int g_exiting;     /* atomic: Goodbye is said; the close that follows is ours */
static pthread_mutex_t g_send_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_once_t g_register_once = PTHREAD_ONCE_INIT;
static int g_wake_fd = -1; /* eventfd: wakes the background thread */

static const char *policy_text(void) {
    return g_config.closed ? "refusing launches with CUDA_ERROR_NOT_PERMITTED "
                      "(GPULOOM_ON_DISPATCHER_LOSS=closed)"
                    : "running UNTHROTTLED (GPULOOM_ON_DISPATCHER_LOSS=open)";
}

CUresult on_loss(const char *why) {
    if (!__atomic_exchange_n(&g_loss_logged, 1, __ATOMIC_ACQ_REL))
        say(LOG_WARN, "%s; %s", why, policy_text());
    trace("loss %s", g_config.closed ? "closed" : "open");
    return g_config.closed ? CUDA_ERROR_NOT_PERMITTED : CUDA_SUCCESS;
}

static const char REFUSING[] =
    "refusing launches with CUDA_ERROR_NOT_PERMITTED (the dispatcher's decision, not a loss: "
    "GPULOOM_ON_DISPATCHER_LOSS does not apply)";

CUresult on_refusal(const char *why) {
    if (!__atomic_exchange_n(&g_loss_logged, 1, __ATOMIC_ACQ_REL))
        say(LOG_WARN, "%s; %s", why, REFUSING);
    trace("refused launch");
    return CUDA_ERROR_NOT_PERMITTED;
}

/* The dispatcher answered and does not admit this process (or its settings cannot register):
 * for good. Its launches fail and, having never had a memory cap, it allocates nothing. */
static void mark_refused(const char *why) {
    __atomic_store_n(&g_conn, CONN_REFUSED, __ATOMIC_RELEASE);
    mem_deny_uncapped();
    say(LOG_WARN, "%s; %s", why, REFUSING);
    __atomic_store_n(&g_loss_logged, 1, __ATOMIC_RELEASE);
    trace("refused");
}

static void adopt_registration(int sock, uint8_t *r, int doorbell, gl_registration *reg) {
    fikit_adopt(r, doorbell, reg);
    pthread_mutex_lock(&g_send_lock);
    if (g_sock >= 0 && g_sock != sock) close(g_sock); /* moved: the old dispatcher's */
    g_sock = sock;
    g_mode = reg->mode;
    /* The region is complete before the registration is sent: the flag is final. */
    g_leased = reg->mode == GL_MODE_FIKIT && r_u32(r, GL_OFF_FK_LEASED) == 1;
    mem_set_cap(reg->memory_cap_bytes);
    __atomic_store_n(&g_region, r, __ATOMIC_RELEASE);
    __atomic_store_n(&g_loss_logged, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&g_conn, CONN_CONNECTED, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_send_lock);
}

static void mark_lost(const char *why) {
    pthread_mutex_lock(&g_send_lock);
    int was = conn_state();
    if (was == CONN_CONNECTED) {
        if (g_sock >= 0) close(g_sock);
        g_sock = -1;
        __atomic_store_n(&g_conn, CONN_LOST, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_send_lock);
    if (was == CONN_CONNECTED && !__atomic_load_n(&g_exiting, __ATOMIC_ACQUIRE))
        say(LOG_WARN, "lost the dispatcher (%s); %s; reconnecting", why, policy_text());
}

int send_locked(int (*sender)(int, const gl_usage *), const gl_usage *usage) {
    pthread_mutex_lock(&g_send_lock);
    int result = g_sock >= 0 ? sender(g_sock, usage) : -1;
    int error = errno;
    pthread_mutex_unlock(&g_send_lock);
    if (result != 0) mark_lost(strerror(error));
    return result;
}

int send_batch(const uint8_t *records, size_t length) {
    pthread_mutex_lock(&g_send_lock);
    int result = g_sock >= 0 ? gl_send_measurement_batch(g_sock, records, length) : -1;
    int error = errno;
    pthread_mutex_unlock(&g_send_lock);
    if (result != 0) mark_lost(strerror(error));
    return result;
}

void loss_rearm(void) { __atomic_store_n(&g_loss_logged, 0, __ATOMIC_RELEASE); }

void background_wake(void) {
    uint64_t one = 1;
    if (g_wake_fd >= 0 && write(g_wake_fd, &one, sizeof one) < 0) { /* already pending */
    }
}

/* MoveTo: the process runs on another GPU now; register with its dispatcher (the socket and
 * token given) and take its region, closing the old connection. Settings that cannot be used
 * are refused and change nothing. A registration that fails leaves the connection lost, and
 * the reconnection goes on with the new dispatcher. */
static void move_to(const uint8_t *frame, size_t length) {
    char path[sizeof g_config.socket_path], token[sizeof g_config.token], why[512];
    if (gl_decode_move(frame, length, path, sizeof path, token, sizeof token) != 0 ||
        !config_valid_token(token)) {
        say(LOG_WARN, "dispatcher protocol error: a MoveTo without a usable socket and token");
        return;
    }
    snprintf(g_config.socket_path, sizeof g_config.socket_path, "%s", path);
    snprintf(g_config.token, sizeof g_config.token, "%s", token);
    int sock = -1, refused = 0, doorbell = -1;
    uint8_t *r = NULL;
    gl_registration reg;
    if (gl_register(g_config.socket_path, g_config.token, program_invocation_short_name,
                    g_config.wait_ms, &sock, (volatile uint8_t **)&r, &doorbell, &reg, &refused,
                    why, sizeof why) == 0) {
        adopt_registration(sock, r, doorbell, &reg);
        say(LOG_INFO, "moved to the dispatcher at %s: mode %u, memory cap %llu bytes", path,
            reg.mode, (unsigned long long)reg.memory_cap_bytes);
        trace("moved mode %u cap %llu", reg.mode, (unsigned long long)reg.memory_cap_bytes);
    } else if (refused) {
        mark_refused(why);
    } else {
        mark_lost(why);
    }
}

/* Reads the socket (Evicted, ProtocolError, MoveTo, close) and reconnects; in measure mode also
 * harvests and sends the kernel records. */
static void *background(void *arg) {
    (void)arg;
    static uint8_t buffer[65536 + 4];
    size_t have = 0;
    unsigned failures = 0;
    for (;;) {
        int state = conn_state();
        if (state == CONN_REFUSED || state == CONN_EVICTED) return NULL;
        if (__atomic_load_n(&g_exiting, __ATOMIC_ACQUIRE)) return NULL;
        if (state == CONN_LOST) {
            measure_background(); /* frees the events of pairs that are done; drops records */
            struct timespec pause = {.tv_sec = 0, .tv_nsec = failures < 5 ? 200000000 : 1000000000};
            nanosleep(&pause, NULL);
            int sock = -1, refused = 0, doorbell = -1;
            uint8_t *r = NULL;
            gl_registration reg;
            char why[512];
            if (gl_register(g_config.socket_path, g_config.token, program_invocation_short_name, g_config.wait_ms,
                            &sock, (volatile uint8_t **)&r, &doorbell, &reg, &refused, why,
                            sizeof why) == 0) {
                have = 0;
                failures = 0;
                adopt_registration(sock, r, doorbell, &reg);
                say(LOG_WARN, "reconnected to the dispatcher; sharing again");
                trace("reconnected");
            } else if (refused) { /* back, and it no longer admits this process */
                mark_refused(why);
                return NULL;
            } else if (failures++ == 0) {
                say(LOG_INFO, "reconnection failed: %s", why);
            }
            continue;
        }
        int sock = __atomic_load_n(&g_sock, __ATOMIC_ACQUIRE);
        if (sock < 0) {
            measure_background();
            struct timespec pause = {.tv_sec = 0, .tv_nsec = 50000000};
            nanosleep(&pause, NULL);
            continue;
        }
        /* Measure mode: harvest every 50 ms, and when a sync point has records to send.
         * FIKIT: report granted kernels' completion every millisecond while any are in flight
         * (the arbiter holds back idle fill until it hears of them). */
        int measure = measure_ready();
        int fills = fikit_harvest() > 0;
        struct pollfd p[2] = {{.fd = sock, .events = POLLIN}, {.fd = g_wake_fd, .events = POLLIN}};
        int n = poll(p, g_wake_fd >= 0 ? 2 : 1, fills ? 1 : measure ? 50 : 250);
        if (n > 0 && g_wake_fd >= 0 && (p[1].revents & POLLIN)) {
            uint64_t count;
            if (read(g_wake_fd, &count, sizeof count) < 0) { /* nothing pending */
            }
        }
        if (measure) measure_background();
        if (n <= 0 || !(p[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        ssize_t got = recv(sock, buffer + have, sizeof buffer - have, MSG_DONTWAIT);
        if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (got <= 0) {
            mark_lost(got == 0 ? "the dispatcher closed the connection" : strerror(errno));
            have = 0;
            continue;
        }
        have += (size_t)got;
        while (have >= 4) {
            uint32_t length;
            memcpy(&length, buffer, 4);
            if (length == 0 || length > 65536) {
                mark_lost("malformed frame from the dispatcher");
                have = 0;
                break;
            }
            if (have < 4 + (size_t)length) break;
            char text[256] = "";
            int kind = gl_decode_dispatcher(buffer + 4, length, NULL, text, sizeof text);
            if (kind == 2) {
                __atomic_store_n(&g_conn, CONN_EVICTED, __ATOMIC_RELEASE);
                say(LOG_WARN, "assignment evicted by the dispatcher: %s; %s", text, REFUSING);
                __atomic_store_n(&g_loss_logged, 1, __ATOMIC_RELEASE);
                trace("evicted");
            } else if (kind == 3) {
                say(LOG_WARN, "dispatcher protocol error: %s", text);
            } else if (kind == 4) {
                move_to(buffer + 4, length);
                have = 0; /* the rest was the old dispatcher's */
                break;
            }
            memmove(buffer, buffer + 4 + length, have - 4 - length);
            have -= 4 + length;
        }
    }
}

void register_once(void) {
    int sock = -1, refused = 0, doorbell = -1;
    uint8_t *r = NULL;
    gl_registration reg;
    char why[512];
    if (*g_config.unusable) { /* nothing to register with: refused by its own settings */
        snprintf(why, sizeof why, "cannot register with the dispatcher: %s", g_config.unusable);
        mark_refused(why);
        return;
    }
    if (gl_register(g_config.socket_path, g_config.token, program_invocation_short_name, g_config.wait_ms, &sock,
                    (volatile uint8_t **)&r, &doorbell, &reg, &refused, why, sizeof why) == 0) {
        adopt_registration(sock, r, doorbell, &reg);
        say(LOG_INFO, "registered: mode %u, memory cap %llu bytes", reg.mode,
            (unsigned long long)reg.memory_cap_bytes);
        trace("registered mode %u cap %llu", reg.mode, (unsigned long long)reg.memory_cap_bytes);
    } else if (refused) {
        mark_refused(why);
        return;
    } else {
        __atomic_store_n(&g_conn, CONN_LOST, __ATOMIC_RELEASE);
        /* Lost before it ever registered: no cap is known. Fail-open runs as configured;
         * fail-closed allocates nothing until a registration gives it a cap. */
        if (g_config.closed) mem_deny_uncapped();
        say(LOG_WARN, "%s; %s; retrying in the background", why, policy_text());
        __atomic_store_n(&g_loss_logged, 1, __ATOMIC_RELEASE);
        trace("unreachable");
    }
    g_wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&thread, &attr, background, NULL) != 0)
        say(LOG_WARN, "cannot start the background thread; no reconnection");
    pthread_attr_destroy(&attr);
}

__attribute__((destructor)) static void shim_exit(void) {
    if (conn_state() != CONN_CONNECTED) return;
    uint8_t *r = region();
    if (r == NULL) return;
    gl_usage usage;
    if (take_report(r_u64(r, GL_OFF_LEASE_ID), 1, &usage)) send_locked(gl_send_usage, &usage);
    pthread_mutex_lock(&g_send_lock);
    __atomic_store_n(&g_exiting, 1, __ATOMIC_RELEASE); /* the dispatcher closes after Goodbye */
    if (g_sock >= 0) gl_send_goodbye(g_sock);
    pthread_mutex_unlock(&g_send_lock);
}
