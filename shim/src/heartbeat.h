/* The dispatcher's heartbeat into the regions it serves (GL_OFF_BEAT, wire.h): a native thread
 * of its own, so nothing the dispatcher's Python does (a pause, a stall) stops it while the
 * process lives, and nothing else keeps it going once the process is hung or dead. A shim
 * admitted until further notice (modes MEASURE and OFF, an open-ended lease) or holding the GPU
 * under FIKIT asks for nothing, so this is how it learns its dispatcher is still there; a beat
 * older than its bound (GPULOOM_SHIM_WAIT_MS) is the loss of the dispatcher. In
 * libglfikit.so; services/dispatcher/heartbeat.py binds it. */
#ifndef GL_HEARTBEAT_H
#define GL_HEARTBEAT_H

#include <stdint.h>

#define GL_BEAT_MAX_REGIONS 1024 /* the shim channel's connections, at most */

typedef struct gl_heart gl_heart;

/* Starts the thread: every `period_ns`, the time into every region added. NULL, errno set, on
 * failure (EINVAL: a period of 0). */
gl_heart *gl_heart_start(uint64_t period_ns);
/* Maps the region of `region_fd` (the dispatcher keeps its fd) and beats into it at once and
 * from now on; its slot, or -1 (ENOSPC: every slot is taken). */
int gl_heart_add(gl_heart *h, int region_fd);
/* No beat into the slot's region after this returns; its mapping is released. */
void gl_heart_remove(gl_heart *h, int slot);
/* Stops the thread and releases everything. */
void gl_heart_stop(gl_heart *h);

#endif
