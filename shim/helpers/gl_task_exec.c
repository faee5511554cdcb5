/* gl_task_exec COMMAND [ARG...]: run COMMAND so that it dies (SIGKILL) with the process that
 * started it. The dispatcher starts MIG batch tasks through it: a dispatcher killed mid-batch
 * leaves no task running in a MIG instance that its successor will reconfigure. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: gl_task_exec COMMAND [ARG...]\n");
        return 2;
    }
    pid_t parent = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) {
        fprintf(stderr, "gl_task_exec: prctl: %s\n", strerror(errno));
        return 127;
    }
    if (getppid() != parent) return 127; /* the parent died before the signal was armed */
    execvp(argv[1], argv + 1);
    fprintf(stderr, "cannot start '%s': %s\n", argv[1], strerror(errno));
    return 127;
}
