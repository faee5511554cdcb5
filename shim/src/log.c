/* Logging (stderr, by GPULOOM_SHIM_LOG) and the trace file (GPULOOM_SHIM_TRACE, tests only).
 * Owns no state: the level and the trace fd are the configuration's (config.c). */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

#include "shim_internal.h"

void say(int level, const char *fmt, ...) {
    if (level > g_config.log_level) return;
    char line[768];
    int n = snprintf(line, sizeof line, "gpuloom shim[%d]: ", (int)getpid());
    va_list args;
    va_start(args, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, args);
    va_end(args);
    if (m < 0) return;
    n += m;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (write(2, line, (size_t)n) < 0) { /* nothing to do */
    }
}

void trace(const char *fmt, ...) {
    if (g_config.trace_fd < 0) return;
    char line[GL_NAME_MAX + 256];
    va_list args;
    va_start(args, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, args);
    va_end(args);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (write(g_config.trace_fd, line, (size_t)n) < 0) { /* best effort */
    }
}
