/* The configuration: the environment, parsed once (at init). A bad value is one line on
 * stderr naming it, and only its own setting falls back (read_config). Owns: C. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shim_internal.h"

struct gl_config g_config = {.log_level = LOG_WARN, .wait_ms = 2000, .trace_fd = -1, .event_pool = 4096};

int config_valid_token(const char *token) {
    size_t n = strlen(token);
    if (n < 32 || n > 128) return 0;
    for (const char *p = token; *p; p++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

/* A bad value: named on stderr, the default (or the safe choice) kept for it alone. */
static void bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void bad(const char *fmt, ...) {
    char text[384];
    va_list args;
    va_start(args, fmt);
    vsnprintf(text, sizeof text, fmt, args);
    va_end(args);
    say(LOG_ERROR, "bad configuration: %s", text);
    trace("config bad");
}

/* A whole number in lo..hi, or -1. */
static long number(const char *text, long lo, long hi) {
    char *end;
    errno = 0;
    long value = strtol(text, &end, 10);
    return errno || *end || end == text || value < lo || value > hi ? -1 : value;
}

/* The whole number of `unit` in lo..hi that the variable `name` sets, into `*into`; unset,
 * empty or bad (named on stderr), `*into` keeps its default. */
static void whole_number(const char *name, long lo, long hi, const char *unit, int *into) {
    const char *text = getenv(name);
    if (text == NULL || *text == 0) return;
    long value = number(text, lo, hi);
    if (value < 0)
        bad("%s=%.64s is not a whole number of %s in %ld..%ld; using %d", name, text, unit, lo, hi,
            *into);
    else
        *into = (int)value;
}

/* Parse the environment once. A bad value is named on stderr and only its own setting falls
 * back (a log level to warn, the wait and the pool to their defaults, the loss policy to
 * closed); every other setting, the memory cap and the admission stay. A socket or token that
 * is set but unusable leaves nothing to register with: the process is refused (its launches
 * fail, it allocates nothing), never passed through. Neither set: not a gpuloom process, pass
 * through. */
void read_config(void) {
    const char *trace_path = getenv("GPULOOM_SHIM_TRACE");
    if (trace_path && *trace_path)
        g_config.trace_fd = open(trace_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);

    const char *level = getenv("GPULOOM_SHIM_LOG");
    if (level && *level) {
        if (strcmp(level, "error") == 0) g_config.log_level = LOG_ERROR;
        else if (strcmp(level, "warn") == 0) g_config.log_level = LOG_WARN;
        else if (strcmp(level, "info") == 0) g_config.log_level = LOG_INFO;
        else if (strcmp(level, "debug") == 0) g_config.log_level = LOG_DEBUG;
        else
            bad("GPULOOM_SHIM_LOG=%.64s is not one of error, warn, info, debug; logging at warn",
                level);
    }
    const char *loss = getenv("GPULOOM_ON_DISPATCHER_LOSS");
    if (loss && *loss) {
        if (strcmp(loss, "open") == 0) g_config.closed = 0;
        else if (strcmp(loss, "closed") == 0) g_config.closed = 1;
        else {
            g_config.closed = 1;
            bad("GPULOOM_ON_DISPATCHER_LOSS=%.64s is not open or closed; failing closed", loss);
        }
    }
    whole_number("GPULOOM_SHIM_WAIT_MS", 1, 600000, "milliseconds", &g_config.wait_ms);
    whole_number("GPULOOM_SHIM_EVENT_POOL", 1, 65536, "event pairs", &g_config.event_pool);
    g_config.alive_ns = (uint64_t)g_config.wait_ms * 1000000u;
    if (g_config.alive_ns < GL_BEAT_MIN_PERIODS * GL_BEAT_PERIOD_NS)
        g_config.alive_ns = GL_BEAT_MIN_PERIODS * GL_BEAT_PERIOD_NS;
    const char *socket_path = getenv("GPULOOM_DISPATCHER_SOCKET");
    const char *token = getenv("GPULOOM_ASSIGNMENT_TOKEN");
    int have_socket = socket_path && *socket_path, have_token = token && *token;
    if (!have_socket && !have_token) {
        trace("config passthrough");
        g_config.active = 0;
        return;
    }
    g_config.active = 1;
    if (have_socket != have_token)
        snprintf(g_config.unusable, sizeof g_config.unusable, "%s is set but %s is not",
                 have_socket ? "GPULOOM_DISPATCHER_SOCKET" : "GPULOOM_ASSIGNMENT_TOKEN",
                 have_socket ? "GPULOOM_ASSIGNMENT_TOKEN" : "GPULOOM_DISPATCHER_SOCKET");
    else if (strlen(socket_path) >= sizeof g_config.socket_path)
        snprintf(g_config.unusable, sizeof g_config.unusable,
                 "GPULOOM_DISPATCHER_SOCKET is longer than a Unix socket path may be (107 bytes)");
    else if (!config_valid_token(token))
        snprintf(g_config.unusable, sizeof g_config.unusable,
                 "GPULOOM_ASSIGNMENT_TOKEN is not 32..128 URL-safe characters");
    if (*g_config.unusable) {
        bad("%s", g_config.unusable);
        return;
    }
    snprintf(g_config.socket_path, sizeof g_config.socket_path, "%s", socket_path);
    snprintf(g_config.token, sizeof g_config.token, "%s", token);
    trace("config active");
}
