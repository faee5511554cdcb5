/* The configuration: the environment, parsed once (at init). A bad value is one line on
 * stderr and pass-through. Owns: C. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shim_internal.h"

struct gl_config C = {.log_level = LOG_WARN, .wait_ms = 2000, .trace_fd = -1, .event_pool = 4096};

static int valid_token(const char *token) {
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

/* Parse the environment once. A bad value: one line on stderr, and pass-through. */
void read_config(void) {
    const char *trace_path = getenv("GPULOOM_SHIM_TRACE");
    if (trace_path && *trace_path)
        C.trace_fd = open(trace_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);

    char problem[512] = "";
    const char *level = getenv("GPULOOM_SHIM_LOG");
    if (level && *level) {
        if (strcmp(level, "error") == 0) C.log_level = LOG_ERROR;
        else if (strcmp(level, "warn") == 0) C.log_level = LOG_WARN;
        else if (strcmp(level, "info") == 0) C.log_level = LOG_INFO;
        else if (strcmp(level, "debug") == 0) C.log_level = LOG_DEBUG;
        else
            snprintf(problem, sizeof problem,
                     "GPULOOM_SHIM_LOG=%.64s is not one of error, warn, info, debug", level);
    }
    const char *loss = getenv("GPULOOM_ON_DISPATCHER_LOSS");
    if (loss && *loss && !*problem) {
        if (strcmp(loss, "open") == 0) C.closed = 0;
        else if (strcmp(loss, "closed") == 0) C.closed = 1;
        else
            snprintf(problem, sizeof problem,
                     "GPULOOM_ON_DISPATCHER_LOSS=%.64s is not open or closed", loss);
    }
    const char *wait = getenv("GPULOOM_SHIM_WAIT_MS");
    if (wait && *wait && !*problem) {
        char *end;
        errno = 0;
        long value = strtol(wait, &end, 10);
        if (errno || *end || end == wait || value < 1 || value > 600000)
            snprintf(problem, sizeof problem,
                     "GPULOOM_SHIM_WAIT_MS=%.64s is not a whole number of milliseconds in "
                     "1..600000", wait);
        else
            C.wait_ms = (int)value;
    }
    const char *pool = getenv("GPULOOM_SHIM_EVENT_POOL");
    if (pool && *pool && !*problem) {
        char *end;
        errno = 0;
        long value = strtol(pool, &end, 10);
        if (errno || *end || end == pool || value < 1 || value > 65536)
            snprintf(problem, sizeof problem,
                     "GPULOOM_SHIM_EVENT_POOL=%.64s is not a whole number of event pairs in "
                     "1..65536", pool);
        else
            C.event_pool = (int)value;
    }
    const char *socket_path = getenv("GPULOOM_DISPATCHER_SOCKET");
    const char *token = getenv("GPULOOM_ASSIGNMENT_TOKEN");
    int have_socket = socket_path && *socket_path, have_token = token && *token;
    if (!*problem && have_socket != have_token)
        snprintf(problem, sizeof problem, "%s is set but %s is not",
                 have_socket ? "GPULOOM_DISPATCHER_SOCKET" : "GPULOOM_ASSIGNMENT_TOKEN",
                 have_socket ? "GPULOOM_ASSIGNMENT_TOKEN" : "GPULOOM_DISPATCHER_SOCKET");
    if (!*problem && have_socket && strlen(socket_path) >= sizeof C.socket_path)
        snprintf(problem, sizeof problem,
                 "GPULOOM_DISPATCHER_SOCKET is longer than a Unix socket path may be (107 bytes)");
    if (!*problem && have_token && !valid_token(token))
        snprintf(problem, sizeof problem,
                 "GPULOOM_ASSIGNMENT_TOKEN is not 32..128 URL-safe characters");
    if (*problem) {
        C.log_level = C.log_level < LOG_ERROR ? LOG_ERROR : C.log_level;
        say(LOG_ERROR, "bad configuration: %s; passing through (no sharing, no memory cap)",
            problem);
        trace("config invalid");
        C.active = 0;
        return;
    }
    if (!have_socket) {
        trace("config passthrough");
        C.active = 0;
        return;
    }
    snprintf(C.socket_path, sizeof C.socket_path, "%s", socket_path);
    snprintf(C.token, sizeof C.token, "%s", token);
    C.active = 1;
    trace("config active");
}
