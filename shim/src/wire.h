/* The shim channel (protos/gpuloom/v1/shim.proto) in C: hand-encoded protobuf for the few
 * messages the shim sends, a decoder for what the dispatcher sends, registration. */
#ifndef GL_WIRE_H
#define GL_WIRE_H

#include <stddef.h>
#include <stdint.h>

/* The admission region (layout in shim.proto; gpuloom/shimwire.py has the same constants, and
 * tests/shim/test_layout.py holds the two together). */
#define GL_REGION_MAGIC 0x4D534C47u
#define GL_REGION_VERSION 6u
#define GL_REGION_BYTES 4096u
#define GL_OFF_MAGIC 0
#define GL_OFF_VERSION 4
/* Lease words: written by the dispatcher. */
#define GL_OFF_EPOCH 8
#define GL_OFF_STATE 12
#define GL_OFF_ADMIT_UNTIL 16
#define GL_OFF_LEASE_ID 24
/* 32..47: unused (zero). The memory cap, the priority and the mode come on the Registered
 * frame, once (gl_registration). */
/* Suspension (SuspendClient; docs/dispatcher.md "Suspend and resume"): CLOCK_MONOTONIC ns
 * until which the process is suspended, renewed by the dispatcher while it lasts; 0 = not
 * suspended. A suspended shim waits at its next launch or allocation, without the
 * GPULOOM_SHIM_WAIT_MS bound, until it is cleared, the deadline passes unrenewed (a hung
 * dispatcher) or the connection is lost. */
#define GL_OFF_SUSPEND_UNTIL 48
/* u32: the shortest interval (us) between two memory samples the shim writes; 0 = none. */
#define GL_OFF_SAMPLE_PERIOD 56
/* FIKIT words written by the arbiter (docs/fikit.md). */
#define GL_OFF_FK_GRANT 64   /* u32 futex word: the request sequence number granted last */
#define GL_OFF_FK_ROLE 68    /* u32 GL_ROLE_* */
#define GL_OFF_FK_NOTIFY 72  /* u32 1: post every launch and ring the doorbell */
#define GL_OFF_FK_LEASED 76  /* u32 1: its level's time leases bound it too (policy composed) */
#define GL_OFF_FK_BEAT 80    /* u64 the arbiter's heartbeat (CLOCK_MONOTONIC ns) */
/* The dispatcher's heartbeat (CLOCK_MONOTONIC ns), every mode: written every GL_BEAT_PERIOD_NS
 * by its own native thread (heartbeat.c). A shim that asks for nothing (admitted until further
 * notice, a FIKIT holder) takes a beat older than its bound for the loss of the dispatcher. */
#define GL_OFF_BEAT 88
#define GL_BEAT_PERIOD_NS 25000000ull
/* The oldest beat a shim still takes for a live dispatcher: GPULOOM_SHIM_WAIT_MS, but at least
 * this many periods (a bound shorter than a few beats would take a busy host for a dead one). */
#define GL_BEAT_MIN_PERIODS 4u
#define GL_ADMIT_FOREVER UINT64_MAX /* admit_until: until further notice */
/* FIKIT words written by the shim; the arbiter validates every read. On their own cache line. */
#define GL_OFF_FK_REQ_SEQ 128 /* u32 sequence number of the shim's latest launch or request */
#define GL_OFF_FK_DONE 132    /* u32 sequence number of the latest granted kernel known done */
#define GL_OFF_FK_KERNEL 136  /* u64 kernel ID of that launch or request (0: not computed) */
#define GL_OFF_FK_POST_NS 144 /* u64 when it was posted (CLOCK_MONOTONIC ns) */
#define GL_OFF_FK_WAITING 152 /* u32 what REQ_SEQ is: a GL_POST_* */
/* Lease request words written by the shim in mode SHARE when the dispatcher runs its native
 * lease desk (docs/dispatcher.md); the desk validates every read. On their own cache line. */
#define GL_OFF_LR_SEQ 192      /* u32 sequence number of the latest request (stored last) */
#define GL_OFF_LR_FLAGS 196    /* u32 GL_LR_* */
#define GL_OFF_LR_LEASE 200    /* u64 the lease the report is for */
#define GL_OFF_LR_GPU_NS 208   /* u64 GPU time measured under that lease */
#define GL_OFF_LR_BURST_NS 216 /* u64 the longest burst under it (0: none measured) */
#define GL_OFF_LR_POST_NS 224  /* u64 when the request was posted (CLOCK_MONOTONIC ns) */
#define GL_OFF_LR_ALLOCATED 232 /* u64 device memory the process holds (with a report) */
/* The one-wake-up path (docs/fikit.md, "The holder's launch releases the filler"). Written by
 * the arbiter, on their own cache line: */
#define GL_OFF_FK_ARM 256         /* u64 holder: nonce of the arm its launch may fire (0: none) */
#define GL_OFF_FK_ARM_KERNELS 264 /* u64 x GL_ARM_KERNELS holder: kernel IDs that fire it */
#define GL_OFF_FK_ARMED 296       /* u64 filler: nonce of the arm that releases its request */
#define GL_OFF_FK_ARM_BOARD 304   /* u32 filler: the priority board it watches for that nonce */
#define GL_OFF_FK_ARM_WAIT 308    /* u32 filler: futex word, moves whenever ARMED changes */
/* Written by the filler shim, on their own cache line: */
#define GL_OFF_FK_RELEASED 320 /* u64 nonce of the arm its latest request was released by */
#define GL_OFF_FK_RELEASED_KERNEL 328 /* u64 that request's kernel ID */
/* Written by the arbiter (filler): which request the arm is for. */
/* The holder's window-opening kernels (predicted gap at least the threshold), from its table.
 * OPENERS_ALL = 1: these are all of them, so a launch of any other kernel is posted without a
 * doorbell or an event (nothing the arbiter decides waits for it; it reads the post at its next
 * round); else every launch rings. Written before the shim's first launch and on a table swap. */
#define GL_OFF_FK_OPENERS 336     /* u64 x GL_ARM_KERNELS */
#define GL_OFF_FK_OPENERS_ALL 368 /* u32, stored after the IDs */
#define GL_OFF_FK_ARMED_SEQ 384     /* u32 the request sequence number it releases */
#define GL_OFF_FK_ARMED_KERNELS 392 /* u64 x GL_ARM_KERNELS: an arm for its next request (not
                                       posted yet) holds only if that request's kernel ID is
                                       one of these; all 0: the arm is for its queued one */
#define GL_ARM_KERNELS 4
/* The training loop's period seen in the kernel stream (kperiod.c), written by the shim while
 * the dispatcher samples memory: kernels per iteration (0: none seen), the host gap before its
 * boundary launch, the iteration's mean duration and when its latest boundary launch was
 * (CLOCK_MONOTONIC ns). The dispatcher suspends a process in that gap (docs/training.md). */
#define GL_OFF_KP_PERIOD 424
#define GL_OFF_KP_GAP_US 428 /* u32 the host gap before the boundary launch, microseconds */
#define GL_OFF_KP_PERIOD_NS 432
#define GL_OFF_KP_BOUNDARY_NS 440

/* A priority board: one per priority per GPU (a memfd the arbiter creates). A process gets its
 * own priority's board read-write and the better priorities' read-only, after its region and
 * the doorbell on the Registered frame. Written by the holder shim of that priority. */
#define GL_BOARD_BYTES 64u
#define GL_BOARD_LAUNCH 0 /* u32 futex word: +1 each time a holder launch fires an arm */
#define GL_BOARD_FIRED 8  /* u64 the nonce it fired last */
#define GL_BOARDS 10      /* one per priority */
/* Memory samples written by the shim in every mode (when GL_OFF_SAMPLE_PERIOD is set), for the
 * dispatcher's training introspection; the dispatcher validates every read. A ring of
 * GL_REGION_SAMPLES entries {u64 CLOCK_MONOTONIC ns, u64 device memory the process holds}; entry
 * i lives at GL_OFF_MS_RING + 16 * (i % GL_REGION_SAMPLES). Each allocation or free writes the
 * new total: into a new entry (head + 1 stored after it) when the latest entry is at least the
 * sample period old, else over the latest entry's bytes (its time stays). */
#define GL_OFF_MS_HEAD 448 /* u32 entries written so far (wraps) */
#define GL_OFF_MS_RING 512
#define GL_REGION_SAMPLES 224

enum { GL_MODE_SHARE = 1, GL_MODE_MEASURE = 2, GL_MODE_OFF = 3, GL_MODE_FIKIT = 4 };
enum { GL_STATE_WAITING = 1, GL_STATE_LEASED = 2, GL_STATE_OPEN = 3, GL_STATE_EVICTED = 4 };
enum { GL_ROLE_NONE = 0, GL_ROLE_HOLDER = 1, GL_ROLE_FILL = 2 };
/* A post: a holder's launch (untracked: the arbiter takes it as done at once; tracked: `done`
 * will report it), or a filler's request waiting for its grant. */
enum { GL_POST_LAUNCHED = 0, GL_POST_REQUEST = 1, GL_POST_TRACKED = 2 };
/* What a lease request carries: a usage report (the LR_LEASE.. words are set), and whether
 * that lease is released. */
enum { GL_LR_REPORT = 1, GL_LR_RELEASE = 2 };

/* What the shim takes from the Registered frame (its other fields are for other clients). */
typedef struct {
    uint32_t mode;
    uint64_t memory_cap_bytes;
    uint32_t priority;
    /* Mode FIKIT: the priority boards that rode on the frame, mapped by gl_register (boards
     * 0..board_count-1; the last is this process's own priority, mapped read-write, the others
     * read-only); NULL/0 when the dispatcher sent none. */
    volatile uint8_t *boards[GL_BOARDS];
    uint32_t board_count;
} gl_registration;

typedef struct {
    uint64_t lease_id;
    uint64_t gpu_time_ns;
    uint64_t longest_burst_ns;
    int release;
    uint64_t allocated_bytes;
} gl_usage;

/* Connect and register; on success *sock and *region are set (the region is mapped read-write
 * shared, GL_REGION_BYTES), *doorbell to the GPU's doorbell eventfd in mode FIKIT (else
 * -1), and reg->boards as described there (gl_unmap_boards releases them). On failure returns -1 and writes why into `why`; *refused is set when the dispatcher
 * answered with a ProtocolError (as opposed to being unreachable). */
int gl_register(const char *socket_path, const char *token, const char *process_name,
                int timeout_ms, int *sock, volatile uint8_t **region, int *doorbell,
                gl_registration *reg, int *refused, char *why, size_t why_size);

/* Unmaps the priority boards gl_register mapped into `reg`. */
void gl_unmap_boards(gl_registration *reg);

/* One KernelRecord (measure mode); run_index is left 0 (the dispatcher assigns runs). */
typedef struct {
    uint64_t kernel_id;
    const char *name; /* at most GL_NAME_MAX - 1 bytes are encoded */
    uint32_t dims[6]; /* grid x y z, block x y z */
    uint64_t start_ns, end_ns;
} gl_kernel_record;

#define GL_NAME_MAX 1024
/* The most bytes gl_encode_kernel_record writes. */
#define GL_KERNEL_RECORD_MAX (GL_NAME_MAX + 128)

/* Frames; each returns 0 or -1 (errno set). */
int gl_send_lease_request(int sock, const gl_usage *report); /* report may be NULL */
int gl_send_usage(int sock, const gl_usage *report);
int gl_send_goodbye(int sock);
/* A lease request through shared memory (the native lease desk): writes the request words of
 * `region` (report may be NULL), the sequence number last, and rings `doorbell`. Returns 0 or
 * -1 (errno set by the doorbell write). */
int gl_post_lease_request(volatile uint8_t *region, int doorbell, const gl_usage *report,
                          uint64_t now_ns);

/* Appends `r` to `out` as one `records` field of a MeasurementBatch (so concatenated records
 * are a MeasurementBatch's bytes); returns the bytes written (at most GL_KERNEL_RECORD_MAX). */
size_t gl_encode_kernel_record(uint8_t *out, const gl_kernel_record *r);
/* Sends ShimMessage{measurements: MeasurementBatch} whose bytes are `records` (a concatenation
 * of gl_encode_kernel_record outputs). A failure may leave a partial frame: close the socket. */
int gl_send_measurement_batch(int sock, const uint8_t *records, size_t length);

/* Decode one DispatcherMessage: returns 2 evicted, 3 error (text in `text`), 1 registered,
 * 4 move_to (read it with gl_decode_move), 0 unknown, -1 malformed. */
int gl_decode_dispatcher(const uint8_t *data, size_t length, gl_registration *reg, char *text,
                         size_t text_size);
/* The MoveTo of a DispatcherMessage: its socket path and token, each NUL-terminated. 0: both
 * there and shorter than their buffers; -1 otherwise (nothing to act on). */
int gl_decode_move(const uint8_t *data, size_t length, char *socket_path, size_t path_size,
                   char *token, size_t token_size);

#endif
