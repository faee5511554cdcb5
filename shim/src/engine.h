/* The admission engine: one native thread per GPU, inside the dispatcher process, with one
 * state under one mutex, woken by one doorbell (an eventfd every shim of the GPU rings after
 * posting into its own region). Each round does both halves of admission (docs/dispatcher.md,
 * "The admission engine"):
 *
 * - leases (leasedesk.h): a lease request is renewed at once from the standing terms the
 *   dispatcher's token policy gave that process, or forwarded to Python; every event is
 *   journaled for the token scheduler's books. Under the composed policy these are the leases
 *   of a priority level; under a token policy, the only admission.
 * - kernels (arbiter.h): the FIKIT decision core admits the kernels of the processes that
 *   registered as FIKIT tasks, across priority levels. Under a token policy nobody does, and
 *   this half is inert.
 *
 * Python (ctypes) adds and removes processes, gives terms and takes the journal; it never sits
 * on the launch path. Garbage a process writes into its own region is validated by the half
 * that reads it and changes no other process's grants. */
#ifndef GL_ENGINE_H
#define GL_ENGINE_H

#include <stdint.h>

#include "arbiter.h"
#include "fikit.h"
#include "leasedesk.h"

typedef struct gl_engine gl_engine;

/* Starts the thread. `doorbell_fd`: a non-blocking eventfd the shims ring (the thread reads
 * it); `notify_fd`: an eventfd the engine writes when Python should take lease events; both
 * stay the caller's for the engine's life. `config`: the FIKIT core's; `beat_ns`: how often
 * every FIKIT region's heartbeat is refreshed (the thread wakes at least that often);
 * `harvest`: the spatial rule's config (the GPU's SMs included) where the GPU runs MPS, NULL
 * where it does not (the default: fill kernels go only into the holders' gaps). NULL (errno
 * set) on a bad config or when the thread cannot start. */
gl_engine *gl_engine_start(const gl_fk_config *config, int doorbell_fd, int notify_fd,
                           uint64_t beat_ns, const gl_sp_config *harvest);

/* Stops and joins the thread, unmaps every region, frees the engine. */
void gl_engine_stop(gl_engine *engine);

/* ---- kernels: the FIKIT half (arbiter.h says what each does) ---- */

int gl_engine_board_fd(gl_engine *engine, uint32_t priority, int writable);
int gl_engine_add_task(gl_engine *engine, int region_fd, uint32_t priority,
                       uint32_t sm_percent, const gl_kernel_table *kernels);
int gl_engine_set_kernels(gl_engine *engine, int slot, const gl_kernel_table *kernels);
void gl_engine_remove_task(gl_engine *engine, int slot);
int gl_engine_set_suspended(gl_engine *engine, int slot, int on);
int gl_engine_set_harvesting(gl_engine *engine, int on);
void gl_engine_fikit_stats(gl_engine *engine, gl_arbiter_stats *out);
void gl_engine_core_counters(gl_engine *engine, gl_fk_counters *out);

/* ---- leases: the lease half (leasedesk.h says what each does) ---- */

int gl_engine_lease_add(gl_engine *engine, int region_fd);
void gl_engine_lease_remove(gl_engine *engine, int slot);
int gl_engine_set_terms(gl_engine *engine, int slot, const gl_desk_terms *terms);
void gl_engine_revoke_all(gl_engine *engine);
uint32_t gl_engine_take(gl_engine *engine, gl_desk_event *out, uint32_t max);
void gl_engine_lease_stats(gl_engine *engine, gl_desk_stats *out);

#endif
