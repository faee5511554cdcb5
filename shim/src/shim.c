/* libgpuloom.so: the LD_PRELOAD launch shim. See shim/README.md. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gl_cuda.h"
#include "hooks.h"
#include "wire.h"

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ======== the hook table ======== */

enum {
#define GL_ENUM(symbol, query, version, per_thread) H_##symbol,
    GL_HOOKS(GL_ENUM)
#undef GL_ENUM
        H_COUNT
};

typedef struct {
    const char *symbol;
    const char *query;
    int min_version;
    int per_thread;
    void *hook;
} hook_info;

static const hook_info g_hooks[H_COUNT] = {
#define GL_INFO(symbol, query, version, per_thread) \
    {#symbol, query, version, per_thread, (void *)symbol},
    GL_HOOKS(GL_INFO)
#undef GL_INFO
};

static void *g_real[H_COUNT];
#define REAL(symbol) ((__typeof__(&symbol))g_real[H_##symbol])

/* Real functions the shim calls but does not hook (resolved at run time; may be missing). */
static struct {
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
} g_aux;

static int hook_index(const char *symbol) {
    for (int i = 0; i < H_COUNT; i++)
        if (strcmp(g_hooks[i].symbol, symbol) == 0) return i;
    return -1;
}

/* ======== basics: time, logging, trace ======== */

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

enum { LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG };

static struct {
    int active; /* 1: talk to the dispatcher; 0: pass through */
    char socket_path[108];
    char token[160];
    int closed; /* GPULOOM_ON_DISPATCHER_LOSS=closed */
    int wait_ms;
    int log_level;
    int trace_fd;
    int event_pool; /* measure mode: event pairs (GPULOOM_SHIM_EVENT_POOL) */
} C = {.log_level = LOG_WARN, .wait_ms = 2000, .trace_fd = -1, .event_pool = 4096};

static void say(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(int level, const char *fmt, ...) {
    if (level > C.log_level) return;
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

static void trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void trace(const char *fmt, ...) {
    if (C.trace_fd < 0) return;
    char line[GL_NAME_MAX + 256];
    va_list args;
    va_start(args, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, args);
    va_end(args);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (write(C.trace_fd, line, (size_t)n) < 0) { /* best effort */
    }
}

/* Kernel ID: FNV-1a 64 over the name's bytes, then the six u32 dimensions (grid x y z, block
 * x y z) as little-endian bytes. */
static uint64_t kernel_id(const char *name, const unsigned dims[6]) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        h ^= *p;
        h *= 0x100000001b3ull;
    }
    for (int i = 0; i < 6; i++)
        for (int b = 0; b < 4; b++) {
            h ^= (dims[i] >> (8 * b)) & 0xff;
            h *= 0x100000001b3ull;
        }
    return h;
}

/* ======== real dlsym, real libcuda ======== */

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn g_real_dlsym;

static void resolve_real_dlsym(void) {
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !g_real_dlsym; i++)
        g_real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

/* ======== kernel names ======== */

typedef struct name_entry {
    const void *key; /* CUfunction or CUkernel */
    const void *module;
    char *name;
    struct name_entry *next;
} name_entry;

#define NAME_BUCKETS 1024
static name_entry *g_names[NAME_BUCKETS];
static pthread_mutex_t g_names_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t name_bucket(const void *key) {
    return (size_t)(((uintptr_t)key >> 4) * 0x9E3779B97F4A7C15ull >> 54) % NAME_BUCKETS;
}

static void names_put(const void *key, const void *module, const char *name) {
    if (key == NULL || name == NULL) return;
    pthread_mutex_lock(&g_names_lock);
    name_entry **slot = &g_names[name_bucket(key)];
    for (name_entry *e = *slot; e; e = e->next)
        if (e->key == key) {
            pthread_mutex_unlock(&g_names_lock);
            return;
        }
    name_entry *e = malloc(sizeof *e);
    if (e && (e->name = strdup(name)) != NULL) {
        e->key = key;
        e->module = module;
        e->next = *slot;
        *slot = e;
    } else {
        free(e);
    }
    pthread_mutex_unlock(&g_names_lock);
}

/* Copies the name into `out` (the entry may be evicted concurrently). */
static int names_get(const void *key, char *out, size_t size, const void **module) {
    int found = 0;
    pthread_mutex_lock(&g_names_lock);
    for (name_entry *e = g_names[name_bucket(key)]; e; e = e->next)
        if (e->key == key) {
            snprintf(out, size, "%s", e->name);
            if (module) *module = e->module;
            found = 1;
            break;
        }
    pthread_mutex_unlock(&g_names_lock);
    return found;
}

static void names_evict_module(const void *module) {
    pthread_mutex_lock(&g_names_lock);
    for (size_t b = 0; b < NAME_BUCKETS; b++) {
        name_entry **p = &g_names[b];
        while (*p) {
            if ((*p)->module == module) {
                name_entry *dead = *p;
                *p = dead->next;
                free(dead->name);
                free(dead);
            } else {
                p = &(*p)->next;
            }
        }
    }
    pthread_mutex_unlock(&g_names_lock);
}

static void function_name(CUfunction f, char *out, size_t size) {
    const char *name = NULL;
    if (g_aux.func_get_name && g_aux.func_get_name(&name, f) == CUDA_SUCCESS && name) {
        snprintf(out, size, "%s", name);
        return;
    }
    if (names_get(f, out, size, NULL)) return;
    snprintf(out, size, "?");
}

/* ======== configuration ======== */

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
static void read_config(void) {
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

/* ======== initialisation ======== */

static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;

static void init_once(void) {
    if (!g_real_dlsym) resolve_real_dlsym();
    read_config();
    const char *path = getenv("GPULOOM_REAL_LIBCUDA");
    if (path == NULL || *path == 0) path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (lib == NULL || g_real_dlsym == NULL) {
        say(LOG_ERROR, "cannot load the real driver %s: %s; every CUDA call fails", path,
            lib ? "no dlsym" : dlerror());
        return;
    }
    for (int i = 0; i < H_COUNT; i++) {
        void *p = g_real_dlsym(lib, g_hooks[i].symbol);
        g_real[i] = p == g_hooks[i].hook ? NULL : p; /* never call ourselves */
    }
    g_aux.func_get_name = (__typeof__(g_aux.func_get_name))g_real_dlsym(lib, "cuFuncGetName");
    g_aux.kernel_get_name =
        (__typeof__(g_aux.kernel_get_name))g_real_dlsym(lib, "cuKernelGetName");
    g_aux.event_create = (__typeof__(g_aux.event_create))g_real_dlsym(lib, "cuEventCreate");
    g_aux.event_record = (__typeof__(g_aux.event_record))g_real_dlsym(lib, "cuEventRecord");
    g_aux.event_query = (__typeof__(g_aux.event_query))g_real_dlsym(lib, "cuEventQuery");
    g_aux.event_elapsed =
        (__typeof__(g_aux.event_elapsed))g_real_dlsym(lib, "cuEventElapsedTime");
    g_aux.is_capturing =
        (__typeof__(g_aux.is_capturing))g_real_dlsym(lib, "cuStreamIsCapturing");
    g_aux.ctx_get_current =
        (__typeof__(g_aux.ctx_get_current))g_real_dlsym(lib, "cuCtxGetCurrent");
    g_aux.ctx_set_current =
        (__typeof__(g_aux.ctx_set_current))g_real_dlsym(lib, "cuCtxSetCurrent");
    g_aux.exchange_capture_mode = (__typeof__(g_aux.exchange_capture_mode))g_real_dlsym(
        lib, "cuThreadExchangeStreamCaptureMode");
}

static inline void init(void) { pthread_once(&g_init_once, init_once); }

/* ======== connection state ======== */

enum { CONN_NONE, CONN_CONNECTED, CONN_LOST, CONN_REFUSED, CONN_EVICTED };

static int g_conn = CONN_NONE;        /* atomic */
static int g_sock = -1;               /* guarded by g_send_lock for writers */
static uint8_t *g_region;             /* atomic pointer; old regions stay mapped */
static uint32_t g_mode;               /* ShimMode from Registered */
static uint64_t g_cap;                /* memory cap in bytes; 0 = none (atomic) */
static uint64_t g_allocated;          /* atomic */
static int g_loss_logged;             /* atomic: the policy was announced this episode */
static int g_exiting;                 /* atomic: Goodbye is said; the close that follows is ours */
static pthread_mutex_t g_send_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_wait_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_register_once = PTHREAD_ONCE_INIT;

static inline int conn_state(void) { return __atomic_load_n(&g_conn, __ATOMIC_ACQUIRE); }
static inline uint8_t *region(void) { return __atomic_load_n(&g_region, __ATOMIC_ACQUIRE); }
static inline uint64_t r_u64(const uint8_t *r, int offset) {
    return __atomic_load_n((const uint64_t *)(r + offset), __ATOMIC_ACQUIRE);
}
static inline uint32_t r_u32(const uint8_t *r, int offset) {
    return __atomic_load_n((const uint32_t *)(r + offset), __ATOMIC_ACQUIRE);
}

static const char *policy_text(void) {
    return C.closed ? "refusing launches with CUDA_ERROR_NOT_PERMITTED "
                      "(GPULOOM_ON_DISPATCHER_LOSS=closed)"
                    : "running UNTHROTTLED (GPULOOM_ON_DISPATCHER_LOSS=open)";
}

/* What a launch gets when the dispatcher cannot admit it. Logged once per episode. */
static CUresult on_loss(const char *why) {
    if (!__atomic_exchange_n(&g_loss_logged, 1, __ATOMIC_ACQ_REL))
        say(LOG_WARN, "%s; %s", why, policy_text());
    trace("loss %s", C.closed ? "closed" : "open");
    return C.closed ? CUDA_ERROR_NOT_PERMITTED : CUDA_SUCCESS;
}

static void adopt_registration(int sock, uint8_t *r, const gl_registration *reg) {
    pthread_mutex_lock(&g_send_lock);
    g_sock = sock;
    g_mode = reg->mode;
    if (reg->memory_cap_bytes) __atomic_store_n(&g_cap, reg->memory_cap_bytes, __ATOMIC_RELEASE);
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

/* Send under the lock; a failed send means the dispatcher is gone. */
static int send_locked(int (*sender)(int, const gl_usage *), const gl_usage *usage) {
    pthread_mutex_lock(&g_send_lock);
    int result = g_sock >= 0 ? sender(g_sock, usage) : -1;
    int error = errno;
    pthread_mutex_unlock(&g_send_lock);
    if (result != 0) mark_lost(strerror(error));
    return result;
}

/* ======== usage: bursts of kernels measured with events ======== */

#define MAX_BURSTS 64
#define EVENT_POOL 128

typedef struct {
    CUstream key;
    CUevent start, end;
    int open, end_pending;
} burst;

static burst g_bursts[MAX_BURSTS];
static CUevent g_pool[EVENT_POOL];
static int g_pool_count;
static uint64_t g_pending_ns, g_longest_ns, g_last_reported; /* guarded by g_usage_lock */
static pthread_mutex_t g_usage_lock = PTHREAD_MUTEX_INITIALIZER;

static int measuring(void) {
    return g_mode == GL_MODE_SHARE && conn_state() == CONN_CONNECTED && g_aux.event_create &&
           g_aux.event_record && g_aux.event_query && g_aux.event_elapsed;
}

static CUevent pool_get(void) {
    if (g_pool_count > 0) return g_pool[--g_pool_count];
    CUevent e = NULL;
    if (g_aux.event_create(&e, CU_EVENT_DEFAULT) != CUDA_SUCCESS) return NULL;
    return e;
}

static void pool_put(CUevent e) {
    if (e && g_pool_count < EVENT_POOL) g_pool[g_pool_count++] = e;
    /* else: leaked (at most a few events beyond the pool) */
}

static int is_capturing(CUstream key) {
    if (g_aux.is_capturing == NULL) return 0;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    return g_aux.is_capturing(key, &status) == CUDA_SUCCESS &&
           status != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* Before a launch on `key`: open a burst (start event) if none is open on that stream. */
static void note_launch(CUstream key) {
    if (!measuring()) return;
    pthread_mutex_lock(&g_usage_lock);
    burst *slot = NULL;
    for (int i = 0; i < MAX_BURSTS; i++) {
        if (g_bursts[i].open && g_bursts[i].key == key) {
            pthread_mutex_unlock(&g_usage_lock);
            return;
        }
        if (!g_bursts[i].open && slot == NULL) slot = &g_bursts[i];
    }
    if (slot && !is_capturing(key)) {
        CUevent start = pool_get(), end = pool_get();
        if (start && end && g_aux.event_record(start, key) == CUDA_SUCCESS) {
            *slot = (burst){.key = key, .start = start, .end = end, .open = 1};
        } else {
            pool_put(start);
            pool_put(end);
        }
    }
    pthread_mutex_unlock(&g_usage_lock);
}

/* Before a synchronisation: end the bursts it covers (all = -1 for every stream). */
static void sync_begin(CUstream key, int all) {
    if (!measuring()) return;
    pthread_mutex_lock(&g_usage_lock);
    for (int i = 0; i < MAX_BURSTS; i++) {
        burst *b = &g_bursts[i];
        if (!b->open || b->end_pending || (!all && b->key != key)) continue;
        if (g_aux.event_record(b->end, b->key) == CUDA_SUCCESS) b->end_pending = 1;
    }
    pthread_mutex_unlock(&g_usage_lock);
}

static void report_expired_lease(void);

static void measure_sync_point(void);

/* After a synchronisation: collect the bursts whose end has passed (and, in measure mode, the
 * completed kernel records, when the real call succeeded). */
static void sync_end(CUresult synced) {
    if (synced == CUDA_SUCCESS) measure_sync_point();
    if (!measuring()) return;
    pthread_mutex_lock(&g_usage_lock);
    for (int i = 0; i < MAX_BURSTS; i++) {
        burst *b = &g_bursts[i];
        if (!b->open || !b->end_pending) continue;
        if (g_aux.event_query(b->end) != CUDA_SUCCESS) continue;
        float ms = 0;
        if (g_aux.event_elapsed(&ms, b->start, b->end) == CUDA_SUCCESS && ms > 0) {
            uint64_t ns = (uint64_t)((double)ms * 1e6);
            g_pending_ns += ns;
            if (ns > g_longest_ns) g_longest_ns = ns;
        }
        pool_put(b->start);
        pool_put(b->end);
        *b = (burst){0};
    }
    pthread_mutex_unlock(&g_usage_lock);
    report_expired_lease();
}

/* The usage to report with lease `lease_id` (once per lease); 0 when there is none to send. */
static int take_report(uint64_t lease_id, int release, gl_usage *out) {
    int has = 0;
    pthread_mutex_lock(&g_usage_lock);
    if (lease_id != 0 && lease_id != g_last_reported) {
        *out = (gl_usage){.lease_id = lease_id,
                          .gpu_time_ns = g_pending_ns,
                          .longest_burst_ns = g_longest_ns,
                          .release = release,
                          .allocated_bytes = __atomic_load_n(&g_allocated, __ATOMIC_RELAXED)};
        g_pending_ns = g_longest_ns = 0;
        g_last_reported = lease_id;
        has = 1;
    }
    pthread_mutex_unlock(&g_usage_lock);
    return has;
}

/* At a sync point: if the lease is over, report its usage now (the dispatcher's books stay
 * current even if no launch follows). */
static void report_expired_lease(void) {
    uint8_t *r = region();
    if (r == NULL || conn_state() != CONN_CONNECTED) return;
    uint64_t lease = r_u64(r, GL_OFF_LEASE_ID);
    if (lease == 0 || now_ns() < r_u64(r, GL_OFF_ADMIT_UNTIL)) return;
    gl_usage usage;
    if (take_report(lease, 0, &usage)) send_locked(gl_send_usage, &usage);
}

/* ======== measure mode: a record per kernel, timed with a bounded pool of event pairs ======== */

/* Each measured launch is bracketed by two events from the pool (recorded on the launch's
 * stream). Nothing waits for them: completed pairs are harvested with cuEventQuery at sync
 * points (after a successful real sync) and by the background thread, timed against one
 * reference event, encoded into batches and sent by the background thread (or at exit). */

#define BATCH_RECORDS 1000           /* records per MeasurementBatch frame, at most */
#define BATCH_BYTES (256 * 1024)     /* bytes per frame, at most (the dispatcher allows 1 MiB) */
#define MAX_QUEUED_BATCHES 256       /* beyond this, new records are dropped */
#define FLUSH_AFTER_NS 100000000ull  /* a partial batch waits at most this long */
#define REBASE_MS 1000.0f            /* keep float offsets from the reference below ~1 s */
#define SEEN_MAX (1u << 20)          /* kernel IDs remembered (first-launch dropping) */

typedef struct mslot {
    CUevent start, end;
    CUstream stream;
    uint64_t id;
    const char *name; /* interned (never freed) */
    unsigned dims[6];
    struct mslot *next;
} mslot;

typedef struct batch {
    struct batch *next;
    uint8_t *data;
    size_t length, capacity;
    uint32_t count;
} batch;

typedef struct {
    uint64_t id;
    const char *name; /* NULL: empty */
} seen_entry;

/* Guarded by g_measure_lock: the pool's free list, the list of launched pairs, the seen set. */
static pthread_mutex_t g_measure_lock = PTHREAD_MUTEX_INITIALIZER;
static mslot *g_slots, *g_free, *g_new_head, *g_new_tail;
static size_t g_new_count;
static seen_entry *g_seen;
static size_t g_seen_capacity, g_seen_count;
static CUevent g_ref;          /* the reference event (first use); replaced when rebasing */
static int64_t g_base_ns;      /* CLOCK_MONOTONIC when the reference was first recorded, +
                                  the offsets of later references */
static CUcontext g_ctx;        /* current context at first use (for the background thread) */
static int g_measure_ready;    /* atomic: the pool exists */
static int g_measure_broken;   /* setup failed: measure nothing */
/* Guarded by g_harvest_lock: pairs being harvested and the batches to send. */
static pthread_mutex_t g_harvest_lock = PTHREAD_MUTEX_INITIALIZER;
static mslot *g_inflight;
static size_t g_inflight_count;
static batch *g_out_head, *g_out_tail;
static size_t g_out_batches, g_out_records;
static uint64_t g_out_since_ns;
static int g_flush_due;        /* atomic: a sync point harvested records */
/* Held while batches are taken and sent: the exit flush waits for one in progress, so that
 * every batch is on the socket before Goodbye. */
static pthread_mutex_t g_flush_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_measure_closed;   /* atomic: the exit flush began; nothing more is measured,
                                  harvested or sent but by it */
static int g_wake_fd = -1;     /* eventfd: wakes the background thread */
/* Counters (atomic). */
static uint64_t g_m_skipped, g_m_dropped, g_m_sent, g_m_failed, g_m_untracked;
static int g_drop_logged;

static inline uint64_t add_u64(uint64_t *counter, uint64_t n) {
    return __atomic_add_fetch(counter, n, __ATOMIC_RELAXED);
}

static inline int measure_on(void) {
    return g_mode == GL_MODE_MEASURE && !__atomic_load_n(&g_measure_broken, __ATOMIC_RELAXED) &&
           !__atomic_load_n(&g_measure_closed, __ATOMIC_RELAXED) &&
           conn_state() == CONN_CONNECTED;
}

static void measure_wake(void) {
    uint64_t one = 1;
    if (g_wake_fd >= 0 && write(g_wake_fd, &one, sizeof one) < 0) { /* already pending */
    }
}

/* Insert `id` (guarded): 1 inserted (its first launch), 0 known (*interned set), -1 full. */
static int seen_insert(uint64_t id, const char *name, const char **interned) {
    if (g_seen_count * 2 >= g_seen_capacity) {
        size_t capacity = g_seen_capacity ? g_seen_capacity * 2 : 1024;
        seen_entry *grown = capacity <= 2 * (size_t)SEEN_MAX ? calloc(capacity, sizeof *grown)
                                                             : NULL;
        if (grown != NULL) {
            for (size_t i = 0; i < g_seen_capacity; i++) {
                if (g_seen[i].name == NULL) continue;
                size_t j = (size_t)(g_seen[i].id * 0x9E3779B97F4A7C15ull) & (capacity - 1);
                while (grown[j].name) j = (j + 1) & (capacity - 1);
                grown[j] = g_seen[i];
            }
            free(g_seen);
            g_seen = grown;
            g_seen_capacity = capacity;
        }
    }
    if (g_seen_capacity == 0) return -1;
    size_t mask = g_seen_capacity - 1, j = (size_t)(id * 0x9E3779B97F4A7C15ull) & mask;
    for (; g_seen[j].name; j = (j + 1) & mask)
        if (g_seen[j].id == id) {
            *interned = g_seen[j].name;
            return 0;
        }
    if (g_seen_count >= SEEN_MAX || g_seen_count + 1 >= g_seen_capacity) return -1; /* full */
    char *copy = strdup(name);
    if (copy == NULL) return -1;
    g_seen[j] = (seen_entry){.id = id, .name = copy};
    g_seen_count++;
    return 1;
}

static void measure_atexit(void);

/* First use (guarded): the pool, the reference event on `key`, the exit handler. */
static int measure_setup(CUstream key) {
    if (!g_aux.event_create || !g_aux.event_record || !g_aux.event_query ||
        !g_aux.event_elapsed) {
        say(LOG_WARN, "measure mode: the driver lacks the event functions; measuring nothing");
        return -1;
    }
    g_slots = calloc((size_t)C.event_pool, sizeof *g_slots);
    if (g_slots == NULL || g_aux.event_create(&g_ref, CU_EVENT_DEFAULT) != CUDA_SUCCESS ||
        g_aux.event_record(g_ref, key) != CUDA_SUCCESS) {
        say(LOG_WARN, "measure mode: cannot set up the event pool; measuring nothing");
        return -1;
    }
    g_base_ns = (int64_t)now_ns();
    if (g_aux.ctx_get_current) g_aux.ctx_get_current(&g_ctx);
    for (int i = C.event_pool - 1; i >= 0; i--) {
        g_slots[i].next = g_free;
        g_free = &g_slots[i];
    }
    atexit(measure_atexit);
    __atomic_store_n(&g_measure_ready, 1, __ATOMIC_RELEASE);
    trace("measure start pool %d", C.event_pool);
    return 0;
}

/* Never record into a capture; when the driver cannot say, do not measure. */
static int measure_capturing(CUstream key) {
    if (g_aux.is_capturing == NULL) return 0; /* a driver without graphs */
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    return g_aux.is_capturing(key, &status) != CUDA_SUCCESS ||
           status != CU_STREAM_CAPTURE_STATUS_NONE;
}

static void slot_release(mslot *slot) {
    pthread_mutex_lock(&g_measure_lock);
    slot->next = g_free;
    g_free = slot;
    pthread_mutex_unlock(&g_measure_lock);
}

/* Before a launch: a slot whose start event is recorded on `key`, or NULL (not measured: a
 * capture, the first launch of its kernel ID, or the pool is exhausted). Never waits. */
static mslot *measure_begin(CUstream key, const char *name, const unsigned dims[6], uint64_t id) {
    if (measure_capturing(key)) return NULL;
    const char *interned = NULL;
    pthread_mutex_lock(&g_measure_lock);
    if (!g_measure_ready && (g_measure_broken || measure_setup(key) != 0)) {
        __atomic_store_n(&g_measure_broken, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&g_measure_lock);
        return NULL;
    }
    int fresh = seen_insert(id, name, &interned);
    mslot *slot = NULL;
    if (fresh == 0) {
        slot = g_free;
        if (slot) g_free = slot->next;
    }
    pthread_mutex_unlock(&g_measure_lock);
    if (fresh != 0) { /* the first launch of an ID (warm-up) is not measured */
        if (fresh < 0) add_u64(&g_m_untracked, 1);
        return NULL;
    }
    if (slot == NULL) {
        if (add_u64(&g_m_skipped, 1) == 1)
            say(LOG_INFO, "measure mode: all %d event pairs in flight; skipping launches",
                C.event_pool);
        return NULL;
    }
    if ((slot->start == NULL &&
         g_aux.event_create(&slot->start, CU_EVENT_DEFAULT) != CUDA_SUCCESS) ||
        (slot->end == NULL && g_aux.event_create(&slot->end, CU_EVENT_DEFAULT) != CUDA_SUCCESS) ||
        g_aux.event_record(slot->start, key) != CUDA_SUCCESS) {
        add_u64(&g_m_failed, 1);
        slot_release(slot);
        return NULL;
    }
    slot->stream = key;
    slot->id = id;
    slot->name = interned;
    memcpy(slot->dims, dims, sizeof slot->dims);
    return slot;
}

/* After the launch: record the end event and hand the pair to the harvester. */
static void measure_end(mslot *slot, CUresult launched) {
    if (launched != CUDA_SUCCESS || g_aux.event_record(slot->end, slot->stream) != CUDA_SUCCESS) {
        slot_release(slot);
        return;
    }
    slot->next = NULL;
    pthread_mutex_lock(&g_measure_lock);
    if (g_new_tail)
        g_new_tail->next = slot;
    else
        g_new_head = slot;
    g_new_tail = slot;
    g_new_count++;
    pthread_mutex_unlock(&g_measure_lock);
}

/* Append one record to the batches to send (g_harvest_lock held). */
static void emit(const gl_kernel_record *record) {
    batch *b = g_out_tail;
    if (b == NULL || b->count >= BATCH_RECORDS ||
        b->length + GL_KERNEL_RECORD_MAX > BATCH_BYTES) {
        if (g_out_batches >= MAX_QUEUED_BATCHES || (b = calloc(1, sizeof *b)) == NULL) {
            add_u64(&g_m_dropped, 1);
            return;
        }
        if (g_out_tail)
            g_out_tail->next = b;
        else
            g_out_head = b;
        g_out_tail = b;
        g_out_batches++;
    }
    if (b->capacity - b->length < GL_KERNEL_RECORD_MAX) {
        size_t capacity = b->capacity ? b->capacity * 2 : 16384;
        if (capacity > BATCH_BYTES) capacity = BATCH_BYTES;
        uint8_t *grown = realloc(b->data, capacity);
        if (grown == NULL) {
            add_u64(&g_m_dropped, 1);
            return;
        }
        b->data = grown;
        b->capacity = capacity;
    }
    if (g_out_records == 0) g_out_since_ns = now_ns();
    b->length += gl_encode_kernel_record(b->data + b->length, record);
    b->count++;
    g_out_records++;
}

static inline int64_t ms_to_ns(float ms) {
    double ns = (double)ms * 1e6;
    return (int64_t)(ns < 0 ? ns - 0.5 : ns + 0.5);
}

/* Collect every completed pair (g_harvest_lock held); never waits. Streams run in order, so
 * after a pair that is not done, later pairs of the same stream are not asked about. */
static void harvest(void) {
    if (__atomic_load_n(&g_measure_closed, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&g_measure_lock);
    mslot *fresh = g_new_head;
    size_t fresh_count = g_new_count;
    g_new_head = g_new_tail = NULL;
    g_new_count = 0;
    pthread_mutex_unlock(&g_measure_lock);
    if (fresh) { /* append, keeping launch order */
        mslot **tail = &g_inflight;
        while (*tail) tail = &(*tail)->next;
        *tail = fresh;
        g_inflight_count += fresh_count;
    }
    if (g_inflight == NULL || g_aux.event_query(g_ref) != CUDA_SUCCESS) return;
    CUstream blocked[16];
    int nblocked = 0;
    mslot *done = NULL, **link = &g_inflight;
    while (*link) {
        mslot *slot = *link;
        int skip = 0;
        for (int i = 0; i < nblocked && !skip; i++) skip = blocked[i] == slot->stream;
        CUresult ready = skip ? CUDA_ERROR_NOT_READY : g_aux.event_query(slot->end);
        /* Both ends from the reference: events that share a GPU timestamp (one kernel's end,
         * the next one's start) get the same ns, so gaps are never negative. Far from the
         * reference (after a long pause) float ms are coarse: then the duration is measured
         * on its own. */
        float start_ms = 0, end_ms = 0, duration_ms = 0;
        if (ready == CUDA_SUCCESS) {
            CUresult a = g_aux.event_elapsed(&start_ms, g_ref, slot->start);
            CUresult b = g_aux.event_elapsed(&end_ms, g_ref, slot->end);
            if (a == CUDA_SUCCESS && b == CUDA_SUCCESS && end_ms > 2 * REBASE_MS)
                b = g_aux.event_elapsed(&duration_ms, slot->start, slot->end);
            if (a == CUDA_ERROR_NOT_READY || b == CUDA_ERROR_NOT_READY)
                ready = CUDA_ERROR_NOT_READY;
            else if (a != CUDA_SUCCESS || b != CUDA_SUCCESS)
                ready = a != CUDA_SUCCESS ? a : b;
        }
        if (ready == CUDA_ERROR_NOT_READY) {
            if (!skip && nblocked < (int)(sizeof blocked / sizeof blocked[0]))
                blocked[nblocked++] = slot->stream;
            link = &slot->next;
            continue;
        }
        *link = slot->next;
        g_inflight_count--;
        if (ready == CUDA_SUCCESS) {
            int64_t start = g_base_ns + ms_to_ns(start_ms);
            int64_t end = end_ms > 2 * REBASE_MS ? start + ms_to_ns(duration_ms)
                                                 : g_base_ns + ms_to_ns(end_ms);
            if (start < 1) start = 1;
            if (end < start) end = start;
            gl_kernel_record record = {.kernel_id = slot->id,
                                       .name = slot->name,
                                       .start_ns = (uint64_t)start,
                                       .end_ns = (uint64_t)end};
            for (int i = 0; i < 6; i++) record.dims[i] = slot->dims[i];
            emit(&record);
            /* Float ms lose precision far from the reference (61 ns at 1 s): move the
             * reference to this end event; its time is, by definition, the record's end. */
            if (end_ms > REBASE_MS) {
                CUevent old = g_ref;
                g_ref = slot->end;
                slot->end = old;
                g_base_ns = end;
            }
        } else {
            add_u64(&g_m_failed, 1);
        }
        slot->next = done;
        done = slot;
    }
    if (done) {
        mslot *last = done;
        while (last->next) last = last->next;
        pthread_mutex_lock(&g_measure_lock);
        last->next = g_free;
        g_free = done;
        pthread_mutex_unlock(&g_measure_lock);
    }
}

static void note_dropped(uint64_t count, const char *why) {
    if (count == 0) return;
    add_u64(&g_m_dropped, count);
    if (!__atomic_exchange_n(&g_drop_logged, 1, __ATOMIC_ACQ_REL))
        say(LOG_WARN, "measure mode: %s; dropping kernel measurements", why);
}

/* Send the queued batches when due (or `force`); drop them when the dispatcher is gone.
 * Sends are bounded by the socket's send timeout (GPULOOM_SHIM_WAIT_MS). */
static void measure_flush(int force) {
    pthread_mutex_lock(&g_flush_lock);
    if (!force && __atomic_load_n(&g_measure_closed, __ATOMIC_ACQUIRE)) {
        pthread_mutex_unlock(&g_flush_lock);
        return;
    }
    pthread_mutex_lock(&g_harvest_lock);
    int due = force || g_out_records >= BATCH_RECORDS ||
              __atomic_exchange_n(&g_flush_due, 0, __ATOMIC_ACQ_REL) ||
              (g_out_records && now_ns() - g_out_since_ns >= FLUSH_AFTER_NS);
    batch *list = due ? g_out_head : NULL;
    if (list) {
        g_out_head = g_out_tail = NULL;
        g_out_batches = g_out_records = 0;
    }
    pthread_mutex_unlock(&g_harvest_lock);
    while (list) {
        batch *b = list;
        list = b->next;
        if (conn_state() != CONN_CONNECTED) {
            note_dropped(b->count, "no dispatcher");
        } else {
            pthread_mutex_lock(&g_send_lock);
            int result = g_sock >= 0 ? gl_send_measurement_batch(g_sock, b->data, b->length) : -1;
            int error = errno;
            pthread_mutex_unlock(&g_send_lock);
            if (result == 0) {
                add_u64(&g_m_sent, b->count);
                trace("measure sent %u", b->count);
            } else {
                mark_lost(strerror(error));
                note_dropped(b->count, "cannot send to the dispatcher");
            }
        }
        free(b->data);
        free(b);
    }
    pthread_mutex_unlock(&g_flush_lock);
}

/* At a sync point, after the real call succeeded (so no capture forbids querying). */
static void measure_sync_point(void) {
    if (!__atomic_load_n(&g_measure_ready, __ATOMIC_ACQUIRE) ||
        __atomic_load_n(&g_measure_closed, __ATOMIC_RELAXED))
        return;
    if (pthread_mutex_trylock(&g_harvest_lock) != 0) return; /* the background is at it */
    harvest();
    int have = g_out_records > 0;
    pthread_mutex_unlock(&g_harvest_lock);
    if (have) {
        __atomic_store_n(&g_flush_due, 1, __ATOMIC_RELEASE);
        measure_wake();
    }
}

/* The background thread's share: harvest, send what is due. */
static void measure_background(void) {
    static __thread int prepared;
    if (!__atomic_load_n(&g_measure_ready, __ATOMIC_ACQUIRE) ||
        __atomic_load_n(&g_measure_closed, __ATOMIC_ACQUIRE))
        return;
    if (!prepared) {
        prepared = 1;
        /* Another thread's global-mode capture must not forbid (or be broken by) our queries. */
        if (g_aux.exchange_capture_mode) {
            CUstreamCaptureMode relaxed = CU_STREAM_CAPTURE_MODE_RELAXED;
            g_aux.exchange_capture_mode(&relaxed);
        }
        if (g_ctx && g_aux.ctx_set_current) g_aux.ctx_set_current(g_ctx);
    }
    pthread_mutex_lock(&g_harvest_lock);
    harvest();
    pthread_mutex_unlock(&g_harvest_lock);
    measure_flush(0);
}

/* At exit (before the driver's own exit handlers, registered earlier): wait a little for the
 * pairs in flight, send everything, report what was not measured. */
static void measure_atexit(void) {
    uint64_t wait_ns = (uint64_t)(C.wait_ms < 1000 ? C.wait_ms : 1000) * 1000000u;
    uint64_t deadline = now_ns() + wait_ns;
    size_t left;
    for (;;) {
        pthread_mutex_lock(&g_harvest_lock);
        harvest();
        left = g_inflight_count;
        pthread_mutex_unlock(&g_harvest_lock);
        if (left == 0 || conn_state() != CONN_CONNECTED || now_ns() >= deadline) break;
        struct timespec pause = {.tv_sec = 0, .tv_nsec = 1000000};
        nanosleep(&pause, NULL);
    }
    /* From here on nothing is harvested or sent but by this flush (which first waits for one
     * that the background thread may be in the middle of). */
    __atomic_store_n(&g_measure_closed, 1, __ATOMIC_RELEASE);
    measure_flush(1);
    pthread_mutex_lock(&g_harvest_lock);
    left = g_inflight_count;
    pthread_mutex_unlock(&g_harvest_lock);
    pthread_mutex_lock(&g_measure_lock);
    left += g_new_count;
    pthread_mutex_unlock(&g_measure_lock);
    uint64_t skipped = __atomic_load_n(&g_m_skipped, __ATOMIC_RELAXED);
    uint64_t dropped = __atomic_load_n(&g_m_dropped, __ATOMIC_RELAXED) + left;
    uint64_t failed = __atomic_load_n(&g_m_failed, __ATOMIC_RELAXED);
    uint64_t untracked = __atomic_load_n(&g_m_untracked, __ATOMIC_RELAXED);
    if (skipped)
        say(LOG_WARN,
            "measure mode: launches not measured: %llu (all %d event pairs were in flight; "
            "GPULOOM_SHIM_EVENT_POOL)",
            (unsigned long long)skipped, C.event_pool);
    if (dropped)
        say(LOG_WARN,
            "measure mode: kernel records dropped: %llu (no dispatcher, or not finished at "
            "exit)",
            (unsigned long long)dropped);
    if (failed || untracked)
        say(LOG_INFO, "measure mode: %llu event errors, %llu launches of untracked kernel IDs",
            (unsigned long long)failed, (unsigned long long)untracked);
    trace("measure exit sent %llu skipped %llu dropped %llu",
          (unsigned long long)__atomic_load_n(&g_m_sent, __ATOMIC_RELAXED),
          (unsigned long long)skipped, (unsigned long long)dropped);
}

/* ======== admission ======== */

static uint32_t g_stall_epoch;   /* guarded by g_wait_lock */
static int g_stalled;
static uint64_t g_last_request_ns;

static int send_request(const uint8_t *r) {
    gl_usage usage;
    int has = take_report(r_u64(r, GL_OFF_LEASE_ID), 0, &usage);
    g_last_request_ns = now_ns();
    return send_locked(gl_send_lease_request, has ? &usage : NULL);
}

static void futex_wait(const uint8_t *r, uint32_t seen, uint64_t timeout_ns) {
    struct timespec t = {.tv_sec = (time_t)(timeout_ns / 1000000000u),
                         .tv_nsec = (long)(timeout_ns % 1000000000u)};
    syscall(SYS_futex, (const uint32_t *)(r + GL_OFF_EPOCH), FUTEX_WAIT, seen, &t, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Called with g_wait_lock held. */
static CUresult wait_for_lease(const uint8_t *r) {
    uint64_t start = now_ns();
    if (start < r_u64(r, GL_OFF_ADMIT_UNTIL)) return CUDA_SUCCESS;
    uint32_t epoch = r_u32(r, GL_OFF_EPOCH);
    if (g_stalled && epoch == g_stall_epoch) {
        /* The dispatcher did not answer last time: do not wait again, ask now and then. */
        if (start - g_last_request_ns > 100000000u) send_request(r);
        return on_loss("the dispatcher grants no lease");
    }
    g_stalled = 0;
    uint64_t seen = r_u64(r, GL_OFF_LEASE_ID);
    if (send_request(r) != 0) return on_loss("lost the dispatcher");
    uint64_t deadline = start + (uint64_t)C.wait_ms * 1000000u;
    for (;;) {
        uint64_t now = now_ns();
        if (now < r_u64(r, GL_OFF_ADMIT_UNTIL)) {
            __atomic_store_n(&g_loss_logged, 0, __ATOMIC_RELEASE);
            return CUDA_SUCCESS;
        }
        if (r_u32(r, GL_OFF_STATE) == GL_STATE_EVICTED) return on_loss("assignment evicted");
        if (conn_state() != CONN_CONNECTED) return on_loss("lost the dispatcher");
        uint64_t lease = r_u64(r, GL_OFF_LEASE_ID);
        if (lease != 0 && lease != seen) {
            /* A lease came and went before we looked: report it (unused) and ask again. */
            seen = lease;
            if (send_request(r) != 0) return on_loss("lost the dispatcher");
        }
        if (now >= deadline) {
            g_stalled = 1;
            g_stall_epoch = r_u32(r, GL_OFF_EPOCH);
            __atomic_store_n(&g_loss_logged, 0, __ATOMIC_RELEASE);
            char why[96];
            snprintf(why, sizeof why, "no lease within GPULOOM_SHIM_WAIT_MS=%d ms", C.wait_ms);
            return on_loss(why);
        }
        if (now - start < 50000u) { /* a grant usually comes within tens of microseconds */
            cpu_relax();
            continue;
        }
        uint64_t left = deadline - now;
        futex_wait(r, epoch, left < 20000000u ? left : 20000000u);
        epoch = r_u32(r, GL_OFF_EPOCH);
    }
}

static void *background(void *arg);

static void register_once(void) {
    int sock = -1, refused = 0;
    uint8_t *r = NULL;
    gl_registration reg;
    char why[512];
    if (gl_register(C.socket_path, C.token, program_invocation_short_name, C.wait_ms, &sock,
                    (volatile uint8_t **)&r, &reg, &refused, why, sizeof why) == 0) {
        adopt_registration(sock, r, &reg);
        say(LOG_INFO, "registered: mode %u, memory cap %llu bytes", reg.mode,
            (unsigned long long)reg.memory_cap_bytes);
        trace("registered mode %u cap %llu", reg.mode, (unsigned long long)reg.memory_cap_bytes);
    } else if (refused) {
        __atomic_store_n(&g_conn, CONN_REFUSED, __ATOMIC_RELEASE);
        say(LOG_WARN, "%s; %s", why, policy_text());
        __atomic_store_n(&g_loss_logged, 1, __ATOMIC_RELEASE);
        trace("refused");
        return;
    } else {
        __atomic_store_n(&g_conn, CONN_LOST, __ATOMIC_RELEASE);
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

static inline void ensure_registered(void) {
    if (C.active) pthread_once(&g_register_once, register_once);
}

/* The launch path: one clock read and one load while a lease lasts. */
static inline CUresult gate(CUstream key) {
    if (!C.active) return CUDA_SUCCESS;
    ensure_registered();
    uint8_t *r = region();
    if (LIKELY(r != NULL && conn_state() == CONN_CONNECTED) &&
        now_ns() < r_u64(r, GL_OFF_ADMIT_UNTIL))
        return CUDA_SUCCESS;
    int state = conn_state();
    if (state == CONN_REFUSED) return on_loss("the dispatcher refused this process");
    if (state == CONN_EVICTED) return on_loss("assignment evicted");
    if (state != CONN_CONNECTED) return on_loss("no dispatcher");
    if (r_u32(r, GL_OFF_STATE) == GL_STATE_EVICTED) return on_loss("assignment evicted");
    if (g_mode != GL_MODE_SHARE) return CUDA_SUCCESS;
    if (is_capturing(key)) return CUDA_SUCCESS; /* recorded, not run: never block */
    pthread_mutex_lock(&g_wait_lock);
    CUresult result = wait_for_lease(r);
    pthread_mutex_unlock(&g_wait_lock);
    return result;
}

/* ======== the background thread: socket reading and reconnection ======== */

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
            int sock = -1, refused = 0;
            uint8_t *r = NULL;
            gl_registration reg;
            char why[512];
            if (gl_register(C.socket_path, C.token, program_invocation_short_name, C.wait_ms,
                            &sock, (volatile uint8_t **)&r, &reg, &refused, why,
                            sizeof why) == 0) {
                have = 0;
                failures = 0;
                adopt_registration(sock, r, &reg);
                say(LOG_WARN, "reconnected to the dispatcher; sharing again");
                trace("reconnected");
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
        /* Measure mode: harvest every 50 ms, and when a sync point has records to send. */
        int measure = __atomic_load_n(&g_measure_ready, __ATOMIC_ACQUIRE);
        struct pollfd p[2] = {{.fd = sock, .events = POLLIN}, {.fd = g_wake_fd, .events = POLLIN}};
        int n = poll(p, g_wake_fd >= 0 ? 2 : 1, measure ? 50 : 250);
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
                say(LOG_WARN, "assignment evicted by the dispatcher: %s; %s", text,
                    policy_text());
                __atomic_store_n(&g_loss_logged, 1, __ATOMIC_RELEASE);
                trace("evicted");
            } else if (kind == 3) {
                say(LOG_WARN, "dispatcher protocol error: %s", text);
            }
            memmove(buffer, buffer + 4 + length, have - 4 - length);
            have -= 4 + length;
        }
    }
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

/* ======== memory cap ======== */

typedef struct mem_entry {
    uint64_t key;
    uint64_t size;
    struct mem_entry *next;
} mem_entry;

#define MEM_BUCKETS 4096
static mem_entry *g_mem[MEM_BUCKETS];
static pthread_mutex_t g_mem_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t mem_bucket(uint64_t key) { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 52); }

/* Reserve `size` against the cap; 0 when it does not fit. */
static int mem_reserve(uint64_t size) {
    uint64_t cap = __atomic_load_n(&g_cap, __ATOMIC_ACQUIRE);
    uint64_t used = __atomic_load_n(&g_allocated, __ATOMIC_RELAXED);
    for (;;) {
        if (cap && (size > cap || used > cap - size)) return 0;
        if (__atomic_compare_exchange_n(&g_allocated, &used, used + size, 1, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            return 1;
    }
}

static void mem_unreserve(uint64_t size) {
    __atomic_fetch_sub(&g_allocated, size, __ATOMIC_ACQ_REL);
}

static void mem_track(uint64_t key, uint64_t size) {
    mem_entry *e = malloc(sizeof *e);
    if (e == NULL) return; /* untracked: its free will not be counted */
    e->key = key;
    e->size = size;
    pthread_mutex_lock(&g_mem_lock);
    e->next = g_mem[mem_bucket(key)];
    g_mem[mem_bucket(key)] = e;
    pthread_mutex_unlock(&g_mem_lock);
}

static void mem_untrack(uint64_t key) {
    pthread_mutex_lock(&g_mem_lock);
    for (mem_entry **p = &g_mem[mem_bucket(key)]; *p; p = &(*p)->next) {
        if ((*p)->key == key) {
            mem_entry *e = *p;
            *p = e->next;
            pthread_mutex_unlock(&g_mem_lock);
            mem_unreserve(e->size);
            free(e);
            return;
        }
    }
    pthread_mutex_unlock(&g_mem_lock);
}

static CUresult over_cap(const char *hook, uint64_t size) {
    trace("alloc %s %llu out_of_memory", hook, (unsigned long long)size);
    say(LOG_INFO, "%s of %llu bytes refused: over the memory cap of %llu bytes", hook,
        (unsigned long long)size, (unsigned long long)__atomic_load_n(&g_cap, __ATOMIC_RELAXED));
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The common shape of an allocation hook. */
#define ALLOC_HOOK(hook, size, out_key, call)                           \
    do {                                                                \
        init();                                                         \
        if (!g_real[H_##hook]) return CUDA_ERROR_NOT_FOUND;             \
        ensure_registered();                                            \
        uint64_t size_ = (size);                                        \
        if (!mem_reserve(size_)) return over_cap(#hook, size_);         \
        CUresult result_ = (call);                                      \
        if (result_ == CUDA_SUCCESS) {                                  \
            mem_track((uint64_t)(out_key), size_);                      \
            trace("alloc %s %llu ok", #hook, (unsigned long long)size_); \
        } else {                                                        \
            mem_unreserve(size_);                                       \
        }                                                               \
        return result_;                                                 \
    } while (0)

/* ======== hooks ======== */

static inline CUstream stream_key(CUstream stream, int per_thread) {
    return stream == NULL && per_thread ? CU_STREAM_PER_THREAD : stream;
}

/* Everything a kernel launch does before calling the real function. In measure mode *slot
 * gets the event pair to finish with measure_end after the real call (or NULL). */
static CUresult before_launch(const char *hook, CUfunction f, unsigned gx, unsigned gy,
                              unsigned gz, unsigned bx, unsigned by, unsigned bz, CUstream key,
                              mslot **slot) {
    *slot = NULL;
    CUresult result = gate(key);
    int measure = result == CUDA_SUCCESS && measure_on();
    if (UNLIKELY(C.trace_fd >= 0) || measure) {
        char name[GL_NAME_MAX];
        unsigned dims[6] = {gx, gy, gz, bx, by, bz};
        function_name(f, name, sizeof name);
        uint64_t id = kernel_id(name, dims);
        trace("launch %s %016llx %s %u %u %u %u %u %u%s", hook, (unsigned long long)id, name,
              gx, gy, gz, bx, by, bz, result == CUDA_SUCCESS ? "" : " refused");
        if (measure) *slot = measure_begin(key, name, dims, id);
    }
    if (result == CUDA_SUCCESS) note_launch(key);
    return result;
}

static inline CUresult after_launch(mslot *slot, CUresult result) {
    if (slot) measure_end(slot, result);
    return result;
}

EXPORT CUresult CUDAAPI cuInit(unsigned int flags) {
    init();
    if (!REAL(cuInit)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuInit)(flags);
    if (result == CUDA_SUCCESS) ensure_registered();
    return result;
}

EXPORT CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                       unsigned int gz, unsigned int bx, unsigned int by,
                                       unsigned int bz, unsigned int shared, CUstream stream,
                                       void **params, void **extra) {
    init();
    if (!REAL(cuLaunchKernel)) return CUDA_ERROR_NOT_FOUND;
    mslot *m;
    CUresult r =
        before_launch("cuLaunchKernel", f, gx, gy, gz, bx, by, bz, stream_key(stream, 0), &m);
    if (r != CUDA_SUCCESS) return r;
    return after_launch(
        m, REAL(cuLaunchKernel)(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra));
}

EXPORT CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                            unsigned int gz, unsigned int bx, unsigned int by,
                                            unsigned int bz, unsigned int shared,
                                            CUstream stream, void **params, void **extra) {
    init();
    if (!REAL(cuLaunchKernel_ptsz)) return CUDA_ERROR_NOT_FOUND;
    mslot *m;
    CUresult r = before_launch("cuLaunchKernel_ptsz", f, gx, gy, gz, bx, by, bz,
                               stream_key(stream, 1), &m);
    if (r != CUDA_SUCCESS) return r;
    return after_launch(
        m, REAL(cuLaunchKernel_ptsz)(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra));
}

EXPORT CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params,
                                         void **extra) {
    init();
    if (!REAL(cuLaunchKernelEx)) return CUDA_ERROR_NOT_FOUND;
    if (c == NULL) return REAL(cuLaunchKernelEx)(c, f, params, extra);
    mslot *m;
    CUresult r =
        before_launch("cuLaunchKernelEx", f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX,
                      c->blockDimY, c->blockDimZ, stream_key(c->hStream, 0), &m);
    if (r != CUDA_SUCCESS) return r;
    return after_launch(m, REAL(cuLaunchKernelEx)(c, f, params, extra));
}

EXPORT CUresult CUDAAPI cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f,
                                              void **params, void **extra) {
    init();
    if (!REAL(cuLaunchKernelEx_ptsz)) return CUDA_ERROR_NOT_FOUND;
    if (c == NULL) return REAL(cuLaunchKernelEx_ptsz)(c, f, params, extra);
    mslot *m;
    CUresult r =
        before_launch("cuLaunchKernelEx_ptsz", f, c->gridDimX, c->gridDimY, c->gridDimZ,
                      c->blockDimX, c->blockDimY, c->blockDimZ, stream_key(c->hStream, 1), &m);
    if (r != CUDA_SUCCESS) return r;
    return after_launch(m, REAL(cuLaunchKernelEx_ptsz)(c, f, params, extra));
}

EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                                  unsigned int gz, unsigned int bx,
                                                  unsigned int by, unsigned int bz,
                                                  unsigned int shared, CUstream stream,
                                                  void **params) {
    init();
    if (!REAL(cuLaunchCooperativeKernel)) return CUDA_ERROR_NOT_FOUND;
    mslot *m;
    CUresult r = before_launch("cuLaunchCooperativeKernel", f, gx, gy, gz, bx, by, bz,
                               stream_key(stream, 0), &m);
    if (r != CUDA_SUCCESS) return r;
    return after_launch(
        m, REAL(cuLaunchCooperativeKernel)(f, gx, gy, gz, bx, by, bz, shared, stream, params));
}

EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx,
                                                       unsigned int gy, unsigned int gz,
                                                       unsigned int bx, unsigned int by,
                                                       unsigned int bz, unsigned int shared,
                                                       CUstream stream, void **params) {
    init();
    if (!REAL(cuLaunchCooperativeKernel_ptsz)) return CUDA_ERROR_NOT_FOUND;
    mslot *m;
    CUresult r = before_launch("cuLaunchCooperativeKernel_ptsz", f, gx, gy, gz, bx, by, bz,
                               stream_key(stream, 1), &m);
    if (r != CUDA_SUCCESS) return r;
    return after_launch(m, REAL(cuLaunchCooperativeKernel_ptsz)(f, gx, gy, gz, bx, by, bz,
                                                                shared, stream, params));
}

/* A graph launch is one unit, named "<graph>" with all dimensions 0 (measured as one record:
 * from before its first node to after its last). */
static CUresult before_graph(const char *hook, CUstream key, mslot **slot) {
    *slot = NULL;
    CUresult result = gate(key);
    unsigned dims[6] = {0};
    if (UNLIKELY(C.trace_fd >= 0))
        trace("launch %s %016llx <graph> 0 0 0 0 0 0%s", hook,
              (unsigned long long)kernel_id("<graph>", dims),
              result == CUDA_SUCCESS ? "" : " refused");
    if (result == CUDA_SUCCESS && measure_on())
        *slot = measure_begin(key, "<graph>", dims, kernel_id("<graph>", dims));
    if (result == CUDA_SUCCESS) note_launch(key);
    return result;
}

EXPORT CUresult CUDAAPI cuGraphLaunch(CUgraphExec exec, CUstream stream) {
    init();
    if (!REAL(cuGraphLaunch)) return CUDA_ERROR_NOT_FOUND;
    mslot *m;
    CUresult r = before_graph("cuGraphLaunch", stream_key(stream, 0), &m);
    return r != CUDA_SUCCESS ? r : after_launch(m, REAL(cuGraphLaunch)(exec, stream));
}

EXPORT CUresult CUDAAPI cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream) {
    init();
    if (!REAL(cuGraphLaunch_ptsz)) return CUDA_ERROR_NOT_FOUND;
    mslot *m;
    CUresult r = before_graph("cuGraphLaunch_ptsz", stream_key(stream, 1), &m);
    return r != CUDA_SUCCESS ? r : after_launch(m, REAL(cuGraphLaunch_ptsz)(exec, stream));
}

/* -- kernel identity -- */

EXPORT CUresult CUDAAPI cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name) {
    init();
    if (!REAL(cuModuleGetFunction)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuModuleGetFunction)(f, module, name);
    if (result == CUDA_SUCCESS && f) names_put(*f, module, name);
    return result;
}

EXPORT CUresult CUDAAPI cuModuleUnload(CUmodule module) {
    init();
    if (!REAL(cuModuleUnload)) return CUDA_ERROR_NOT_FOUND;
    names_evict_module(module);
    return REAL(cuModuleUnload)(module);
}

EXPORT CUresult CUDAAPI cuLibraryGetKernel(CUkernel *kernel, CUlibrary library,
                                           const char *name) {
    init();
    if (!REAL(cuLibraryGetKernel)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuLibraryGetKernel)(kernel, library, name);
    if (result == CUDA_SUCCESS && kernel) names_put(*kernel, library, name);
    return result;
}

EXPORT CUresult CUDAAPI cuKernelGetFunction(CUfunction *f, CUkernel kernel) {
    init();
    if (!REAL(cuKernelGetFunction)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuKernelGetFunction)(f, kernel);
    if (result == CUDA_SUCCESS && f) {
        char name[GL_NAME_MAX];
        const void *library = NULL;
        const char *real_name = NULL;
        if (g_aux.kernel_get_name && g_aux.kernel_get_name(&real_name, kernel) == CUDA_SUCCESS &&
            real_name)
            names_put(*f, NULL, real_name);
        else if (names_get(kernel, name, sizeof name, &library))
            names_put(*f, library, name);
    }
    return result;
}

/* -- synchronisation points: usage is measured and reported here -- */

EXPORT CUresult CUDAAPI cuCtxSynchronize(void) {
    init();
    if (!REAL(cuCtxSynchronize)) return CUDA_ERROR_NOT_FOUND;
    sync_begin(NULL, 1);
    CUresult result = REAL(cuCtxSynchronize)();
    sync_end(result);
    return result;
}

EXPORT CUresult CUDAAPI cuStreamSynchronize(CUstream stream) {
    init();
    if (!REAL(cuStreamSynchronize)) return CUDA_ERROR_NOT_FOUND;
    sync_begin(stream_key(stream, 0), 0);
    CUresult result = REAL(cuStreamSynchronize)(stream);
    sync_end(result);
    return result;
}

EXPORT CUresult CUDAAPI cuStreamSynchronize_ptsz(CUstream stream) {
    init();
    if (!REAL(cuStreamSynchronize_ptsz)) return CUDA_ERROR_NOT_FOUND;
    sync_begin(stream_key(stream, 1), 0);
    CUresult result = REAL(cuStreamSynchronize_ptsz)(stream);
    sync_end(result);
    return result;
}

EXPORT CUresult CUDAAPI cuEventSynchronize(CUevent event) {
    init();
    if (!REAL(cuEventSynchronize)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuEventSynchronize)(event);
    /* Which streams the event covered is unknown: end every burst now; those still running
     * are collected at a later synchronisation. */
    sync_begin(NULL, 1);
    sync_end(result);
    return result;
}

EXPORT CUresult CUDAAPI cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes) {
    init();
    if (!REAL(cuMemcpyDtoH_v2)) return CUDA_ERROR_NOT_FOUND;
    sync_begin(NULL, 1);
    CUresult result = REAL(cuMemcpyDtoH_v2)(dst, src, bytes);
    sync_end(result);
    return result;
}

EXPORT CUresult CUDAAPI cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t bytes) {
    init();
    if (!REAL(cuMemcpyDtoH_v2_ptds)) return CUDA_ERROR_NOT_FOUND;
    sync_begin(NULL, 1);
    CUresult result = REAL(cuMemcpyDtoH_v2_ptds)(dst, src, bytes);
    sync_end(result);
    return result;
}

/* -- memory -- */

EXPORT CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    ALLOC_HOOK(cuMemAlloc_v2, bytes, *dptr, REAL(cuMemAlloc_v2)(dptr, bytes));
}

EXPORT CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    ALLOC_HOOK(cuMemAllocManaged, bytes, *dptr, REAL(cuMemAllocManaged)(dptr, bytes, flags));
}

EXPORT CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    ALLOC_HOOK(cuMemAllocAsync, bytes, *dptr, REAL(cuMemAllocAsync)(dptr, bytes, stream));
}

EXPORT CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    ALLOC_HOOK(cuMemAllocAsync_ptsz, bytes, *dptr,
               REAL(cuMemAllocAsync_ptsz)(dptr, bytes, stream));
}

EXPORT CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                                    const CUmemAllocationProp *prop, unsigned long long flags) {
    ALLOC_HOOK(cuMemCreate, bytes, *handle, REAL(cuMemCreate)(handle, bytes, prop, flags));
}

/* The pitch (and so the size) is known only after the call: reserve the unpadded size first,
 * then the padding, and give the allocation back if the padding does not fit. */
EXPORT CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                           size_t height, unsigned int element_bytes) {
    init();
    if (!REAL(cuMemAllocPitch_v2)) return CUDA_ERROR_NOT_FOUND;
    ensure_registered();
    uint64_t minimum = (uint64_t)width * height;
    if (!mem_reserve(minimum)) return over_cap("cuMemAllocPitch_v2", minimum);
    CUresult result = REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, element_bytes);
    if (result != CUDA_SUCCESS) {
        mem_unreserve(minimum);
        return result;
    }
    uint64_t size = (uint64_t)*pitch * height;
    if (size > minimum && !mem_reserve(size - minimum)) {
        mem_unreserve(minimum);
        if (REAL(cuMemFree_v2)) REAL(cuMemFree_v2)(*dptr);
        return over_cap("cuMemAllocPitch_v2", size);
    }
    mem_track(*dptr, size > minimum ? size : minimum);
    trace("alloc cuMemAllocPitch_v2 %llu ok", (unsigned long long)size);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr) {
    init();
    if (!REAL(cuMemFree_v2)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuMemFree_v2)(dptr);
    if (result == CUDA_SUCCESS) mem_untrack(dptr);
    return result;
}

EXPORT CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    init();
    if (!REAL(cuMemFreeAsync)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuMemFreeAsync)(dptr, stream);
    if (result == CUDA_SUCCESS) mem_untrack(dptr);
    return result;
}

EXPORT CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) {
    init();
    if (!REAL(cuMemFreeAsync_ptsz)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuMemFreeAsync_ptsz)(dptr, stream);
    if (result == CUDA_SUCCESS) mem_untrack(dptr);
    return result;
}

EXPORT CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
    init();
    if (!REAL(cuMemRelease)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuMemRelease)(handle);
    if (result == CUDA_SUCCESS) mem_untrack(handle);
    return result;
}

EXPORT CUresult CUDAAPI cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    init();
    if (!REAL(cuMemGetInfo_v2)) return CUDA_ERROR_NOT_FOUND;
    ensure_registered();
    CUresult result = REAL(cuMemGetInfo_v2)(free_bytes, total_bytes);
    uint64_t cap = __atomic_load_n(&g_cap, __ATOMIC_ACQUIRE);
    if (result == CUDA_SUCCESS && cap && free_bytes && total_bytes) {
        uint64_t used = __atomic_load_n(&g_allocated, __ATOMIC_ACQUIRE);
        uint64_t left = used < cap ? cap - used : 0;
        *total_bytes = cap < *total_bytes ? cap : *total_bytes;
        if (left < *free_bytes) *free_bytes = left;
    }
    return result;
}

/* ======== symbol resolution: dlsym and cuGetProcAddress ======== */

/* The hook for what the real cuGetProcAddress answered: the same function pointer as one of
 * our real symbols, else by the queried name, cudaVersion and stream flavour. */
static void *redirect(const char *symbol, void *found, int version, cuuint64_t flags) {
    if (found == NULL) return NULL;
    for (int i = 0; i < H_COUNT; i++)
        if (g_real[i] == found) return g_hooks[i].hook;
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    for (int pass = 0; pass < 2; pass++) {
        int best = -1;
        for (int i = 0; i < H_COUNT; i++) {
            const hook_info *h = &g_hooks[i];
            if (strcmp(h->query, symbol) != 0 || h->min_version > version) continue;
            if (h->per_thread != (pass == 0 ? want_ptds : 0)) continue;
            if (best < 0 || h->min_version > g_hooks[best].min_version) best = i;
        }
        if (best >= 0) return g_real[best] ? g_hooks[best].hook : found;
    }
    return found;
}

EXPORT CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                            cuuint64_t flags,
                                            CUdriverProcAddressQueryResult *status) {
    init();
    if (!REAL(cuGetProcAddress_v2)) {
        if (pfn) *pfn = NULL;
        if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    CUresult result = REAL(cuGetProcAddress_v2)(symbol, pfn, version, flags, status);
    if (result == CUDA_SUCCESS && pfn && symbol) {
        void *answer = redirect(symbol, *pfn, version, flags);
        if (answer != *pfn) trace("procaddr %s hooked", symbol);
        *pfn = answer;
    }
    return result;
}

EXPORT CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int version,
                                         cuuint64_t flags) {
    init();
    if (!REAL(cuGetProcAddress)) {
        if (pfn) *pfn = NULL;
        return CUDA_ERROR_NOT_FOUND;
    }
    CUresult result = REAL(cuGetProcAddress)(symbol, pfn, version, flags);
    if (result == CUDA_SUCCESS && pfn && symbol) {
        void *answer = redirect(symbol, *pfn, version, flags);
        if (answer != *pfn) trace("procaddr %s hooked", symbol);
        *pfn = answer;
    }
    return result;
}

EXPORT void *dlsym(void *handle, const char *name) {
    if (!g_real_dlsym) resolve_real_dlsym();
    if (!g_real_dlsym) return NULL;
    void *found = g_real_dlsym(handle, name);
    if (found && name[0] == 'c' && name[1] == 'u') {
        int i = hook_index(name);
        if (i >= 0) {
            init();
            trace("dlsym %s hooked", name);
            return g_hooks[i].hook;
        }
    }
    return found;
}
