/* Declarations shared by the shim's files (see shim/README.md for the file map): the state one
 * file owns and others read, and the static inline helpers of the launch path, which must stay
 * inline across files. Grouped by the file that owns them. Not installed; nothing here is
 * exported from libgpuloom.so (everything declared below the includes is hidden). */
#ifndef GL_SHIM_INTERNAL_H
#define GL_SHIM_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "gl_cuda.h"
#include "gl_cuda_legacy.h" /* from here on cuMemAlloc & co. are the legacy entry points */
#include "gl_nvml.h"
#include "hooks.h"
#include "wire.h"

#pragma GCC visibility push(hidden)

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* ---- driver.c: the hook table, the real driver, initialisation ---- */

enum {
#define GL_ENUM(symbol, query, version, per_thread) H_##symbol,
    GL_HOOKS(GL_ENUM)
#undef GL_ENUM
        H_COUNT
};

/* PT_<symbol>: the list's per_thread flag, as a constant the twin generator can check. */
#define GL_PT(symbol, query, version, per_thread) enum { PT_##symbol = per_thread };
GL_HOOKS(GL_PT)
#undef GL_PT

typedef struct {
    const char *symbol;
    const char *query;
    int min_version;
    int per_thread;
    void *hook;
} hook_info;

extern const hook_info g_hooks[H_COUNT];
extern void *g_real[H_COUNT]; /* the real driver's functions; NULL when missing */

/* The real function behind list entry `hook`, typed as `symbol` (the entry itself or its
 * twin: both have the same signature). */
#define REAL_AT(symbol, hook) ((__typeof__(&symbol))g_real[hook])
#define REAL(symbol) REAL_AT(symbol, H_##symbol)

/* Real functions the shim calls but does not hook (resolved at run time; may be missing). */
extern struct gl_aux {
    __typeof__(&cuFuncGetName) func_get_name;
    __typeof__(&cuKernelGetName) kernel_get_name;
    __typeof__(&cuEventCreate) event_create;
    __typeof__(&cuEventRecord) event_record;
    __typeof__(&cuEventQuery) event_query;
    __typeof__(&cuEventElapsedTime) event_elapsed;
    __typeof__(&cuStreamIsCapturing) is_capturing;
    __typeof__(&cuCtxGetCurrent) ctx_get_current;
    __typeof__(&cuCtxSetCurrent) ctx_set_current;
    __typeof__(&cuThreadExchangeStreamCaptureMode) exchange_capture_mode;
    __typeof__(&cuCtxGetDevice) ctx_get_device;
    __typeof__(&cuDeviceGetMemPool) device_get_mem_pool;
    __typeof__(&cuArrayGetMemoryRequirements) array_requirements;
    __typeof__(&cuMipmappedArrayGetMemoryRequirements) mipmap_requirements;
    __typeof__(&cuGraphGetNodes) graph_get_nodes;
    __typeof__(&cuGraphNodeGetType) node_get_type;
    __typeof__(&cuGraphKernelNodeGetParams) kernel_node_get_params;
} g_aux;

typedef void *(*dlsym_fn)(void *, const char *);
extern dlsym_fn g_real_dlsym;
void resolve_real_dlsym(void);

extern pthread_once_t g_init_once;
void init_once(void);
/* Every hook starts here: read the configuration and load the real driver, once. */
static inline void init(void) { pthread_once(&g_init_once, init_once); }

/* 1 when list entry `i` is an NVML function (resolved by nvml_resolve, not from libcuda). */
int is_nvml_hook(int i);
/* Resolve the real NVML's hooked functions, once (every NVML hook starts here). */
void nvml_resolve(void);
/* After nvml_resolve: the real nvmlDeviceGetUUID (NULL when missing) and the UUID (prefix)
 * CUDA_VISIBLE_DEVICES gives the process ("" when it names no single GPU by UUID). */
typedef nvmlReturn_t (*nvml_uuid_fn)(nvmlDevice_t, char *, unsigned int);
extern nvml_uuid_fn g_nvml_uuid;
extern char g_nvml_assigned[96];

/* 1 when `key` is capturing into a graph (a driver without graphs: 0). */
int is_capturing(CUstream key);

/* ---- per-thread-default-stream twins, generated from the list ---- */

/* A hook whose list entry has a _ptsz/_ptds twin is written once, as
 *   static ALWAYS_INLINE CUresult <base>_body(int hook, int per_thread, <parameters>)
 * and GL_TWIN_HOOKS(base, suffix, (parameters), (arguments)) defines both exported entry
 * points from it: each passes its own list index (for its real function and its name) and its
 * per_thread flag from hooks.h. The assertion holds the list and the pair together. */
#define GL_UNPAREN(...) __VA_ARGS__
#define GL_TWIN_ENTRY(base, symbol, params, args)                                              \
    EXPORT CUresult CUDAAPI symbol params {                                                    \
        return base##_body(H_##symbol, PT_##symbol, GL_UNPAREN args);                          \
    }
#define GL_TWIN_HOOKS(base, suffix, params, args)                                              \
    _Static_assert(PT_##base == 0 && PT_##base##suffix == 1,                                   \
                   "hooks.h lists " #base " with per_thread 0 and " #base #suffix " with 1"); \
    GL_TWIN_ENTRY(base, base, params, args)                                                    \
    GL_TWIN_ENTRY(base, base##suffix, params, args)

/* The stream a launch or sync on `stream` really uses (the NULL stream of a per-thread entry
 * point is the thread's own default stream). */
static inline CUstream stream_key(CUstream stream, int per_thread) {
    return stream == NULL && per_thread ? CU_STREAM_PER_THREAD : stream;
}

/* ---- log.c: time, logging, the trace ---- */

static inline uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

enum { LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG };

/* One line on stderr, when `level` is within GPULOOM_SHIM_LOG. */
void say(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* One line in GPULOOM_SHIM_TRACE (tests only); nothing when it is not set. */
void trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- config.c: the configuration, read once from the environment ---- */

extern struct gl_config {
    int active; /* 1: talk to the dispatcher; 0: pass through */
    char socket_path[108];
    char token[160];
    int closed; /* GPULOOM_ON_DISPATCHER_LOSS=closed */
    /* Set but unusable (a bad or missing socket or token, named here): the process cannot
     * register, so it is refused (launches fail, nothing is allocated). "" when usable. */
    char unusable[256];
    int wait_ms;
    uint64_t alive_ns; /* the oldest dispatcher heartbeat taken for a live dispatcher */
    int log_level;
    int trace_fd;
    int event_pool; /* measure mode: event pairs (GPULOOM_SHIM_EVENT_POOL) */
} g_config;

void read_config(void);
/* A token as an assignment's: 32..128 URL-safe characters. */
int config_valid_token(const char *token);

/* ---- names.c: kernel names and IDs ---- */

uint64_t kernel_id(const char *name, const unsigned dims[6]);
/* kernel_id(function_name(f), dims), the name's part kept per thread and function. */
uint64_t function_kernel_id(CUfunction f, const unsigned dims[6]);
/* The name of `f` (cuFuncGetName, else the table the identity hooks fill, else "?"). */
void function_name(CUfunction f, char *out, size_t size);

/* ---- graphs.c: graph identity ---- */

/* The kernel ID of executable graph `exec` and its structure hash (*structure), or 0 (and 0)
 * when it has none. */
uint64_t graph_identity(CUgraphExec exec, uint64_t *structure);
/* A graph's record name: "<graph:HHHHHHHHHHHHHHHH>", or "<graph>" for structure 0. */
void graph_name(uint64_t structure, char *out, size_t size);

/* ---- conn.c: the dispatcher connection, registration, the background thread ---- */

enum { CONN_NONE, CONN_CONNECTED, CONN_LOST, CONN_REFUSED, CONN_EVICTED };

extern int g_conn;        /* atomic */
extern uint8_t *g_region; /* atomic pointer; old regions stay mapped */
extern uint32_t g_mode;   /* ShimMode from Registered */
extern uint32_t g_leased; /* mode FIKIT under policy composed: leases bound it too */
extern pthread_once_t g_register_once;

static inline int conn_state(void) { return __atomic_load_n(&g_conn, __ATOMIC_ACQUIRE); }
static inline uint8_t *region(void) { return __atomic_load_n(&g_region, __ATOMIC_ACQUIRE); }
static inline uint64_t r_u64(const uint8_t *r, int offset) {
    return __atomic_load_n((const uint64_t *)(r + offset), __ATOMIC_ACQUIRE);
}
static inline uint32_t r_u32(const uint8_t *r, int offset) {
    return __atomic_load_n((const uint32_t *)(r + offset), __ATOMIC_ACQUIRE);
}
/* A shim writes only its FIKIT request words, its lease request words and its memory samples. */
static inline void w_u32(uint8_t *r, int offset, uint32_t value) {
    __atomic_store_n((uint32_t *)(r + offset), value, __ATOMIC_RELEASE);
}
static inline void w_u64(uint8_t *r, int offset, uint64_t value) {
    __atomic_store_n((uint64_t *)(r + offset), value, __ATOMIC_RELEASE);
}
/* A spin-wait's pause. */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

void register_once(void);
/* Register with the dispatcher at first use (cuInit, the first launch or allocation). */
static inline void ensure_registered(void) {
    if (g_config.active) pthread_once(&g_register_once, register_once);
}

/* What a launch gets when the dispatcher is lost (unreachable, closed, silent past the bound):
 * the loss policy's answer. Logged once per episode. */
CUresult on_loss(const char *why);
/* What a launch gets when the dispatcher took the process's admission away (evicted, refused,
 * or settings it cannot register with): CUDA_ERROR_NOT_PERMITTED, whatever the loss policy.
 * Logged once. */
CUresult on_refusal(const char *why);
/* The wait is over: the next loss is announced again. */
void loss_rearm(void);
/* Sends; a failed one means the dispatcher is gone (marked lost). Each returns 0 or -1. */
int send_locked(int (*sender)(int, const gl_usage *), const gl_usage *usage);
int send_batch(const uint8_t *records, size_t length);
/* Wake the background thread (measure mode: records to send). */
void background_wake(void);

/* ---- usage.c: GPU time measured in bursts between synchronisation points ---- */

/* Mode FIKIT under policy composed, holding a lease that ends (an open-ended one, on an
 * uncontended level with a 100% limit, is charged nothing: no usage to measure). */
static inline int leased_and_bounded(void) {
    const uint8_t *r = region();
    return g_leased && r != NULL && r_u64(r, GL_OFF_ADMIT_UNTIL) != GL_ADMIT_FOREVER;
}

/* Usage is measured in share mode (and in mode FIKIT under bounded leases), while connected,
 * when the driver has the event functions. */
static inline int measuring(void) {
    if (g_mode != GL_MODE_SHARE && !leased_and_bounded()) return 0;
    return conn_state() == CONN_CONNECTED &&
           g_aux.event_create &&
           g_aux.event_record && g_aux.event_query && g_aux.event_elapsed;
}

void note_launch_measured(CUstream key);
/* Before a launch on `key`: open a burst (start event) if none is open on that stream. */
static inline void note_launch(CUstream key) {
    if (measuring()) note_launch_measured(key);
}
/* The usage to report with lease `lease_id` (once per lease); 0 when there is none to send. */
int take_report(uint64_t lease_id, int release, gl_usage *out);

/* ---- measure.c: measure mode, a record per kernel ---- */

typedef struct mslot mslot;

extern int g_measure_broken; /* setup failed: measure nothing */
extern int g_measure_closed; /* atomic: the exit flush began */

static inline int measure_on(void) {
    return g_mode == GL_MODE_MEASURE && !__atomic_load_n(&g_measure_broken, __ATOMIC_RELAXED) &&
           !__atomic_load_n(&g_measure_closed, __ATOMIC_RELAXED) &&
           conn_state() == CONN_CONNECTED;
}

/* Before a launch: a slot whose start event is recorded on `key`, or NULL (not measured). */
mslot *measure_begin(CUstream key, const char *name, const unsigned dims[6], uint64_t id);
/* After the launch: record the end event and hand the pair to the harvester. */
void measure_end(mslot *slot, CUresult launched);
/* At a sync point whose real call succeeded: collect what completed. */
void measure_sync_point(void);
/* The background thread's share: harvest, send what is due. */
void measure_background(void);
/* 1 once measure mode set up its pool (the background thread then polls every 50 ms). */
int measure_ready(void);

/* ---- memcap.c: the memory cap ---- */

void mem_set_cap(uint64_t cap_bytes); /* a registration's cap, exactly (0: none) */
/* A process the dispatcher does not admit and that never had a cap (refused, or lost before
 * its first registration under the closed policy): nothing may be allocated until a
 * registration gives it one. */
void mem_deny_uncapped(void);
uint64_t mem_allocated(void);
/* The process's view of the GPU's memory under the cap (cuMemGetInfo and NVML both answer
 * it): total = min(cap, real total), free = min(real free, cap - counted). Unchanged when
 * there is no cap. */
void mem_capped_view(uint64_t *free_bytes, uint64_t *total_bytes);

/* ---- kperiod.c: iteration boundaries from the kernel stream ---- */

/* Every launch (before admission): its kernel into the ring, a detection now and then. */
void kp_note_launch(CUfunction f, const unsigned dims[6]);

/* ---- admission.c: suspension (SuspendClient) ---- */

/* Wait while region `r` says the process is suspended (without the GPULOOM_SHIM_WAIT_MS bound):
 * until the dispatcher clears the word, stops renewing it, evicts, or is lost. */
void suspend_wait(const uint8_t *r);
/* At an allocation or launch: one load when not suspended. */
static inline void suspend_point(void) {
    uint8_t *r = region();
    if (UNLIKELY(r != NULL && r_u64(r, GL_OFF_SUSPEND_UNTIL) != 0)) suspend_wait(r);
}

#pragma GCC visibility pop

#endif
