/* Usage: the GPU time of this process, measured in bursts (from the first launch on a stream
 * after a synchronisation to the next synchronisation that covers it) with events, reported
 * once per lease; and the synchronisation hooks where bursts end and are collected.
 * Owns: g_bursts, g_pool, g_pool_count, g_pending_ns, g_longest_ns, g_last_reported,
 * g_usage_lock. */
#define _GNU_SOURCE
#include "admission.h"

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

void note_launch_measured(CUstream key) {
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

/* The usage to report with lease `lease_id` (once per lease); 0 when there is none to send. */
int take_report(uint64_t lease_id, int release, gl_usage *out) {
    int has = 0;
    pthread_mutex_lock(&g_usage_lock);
    if (lease_id != 0 && lease_id != g_last_reported) {
        *out = (gl_usage){.lease_id = lease_id,
                          .gpu_time_ns = g_pending_ns,
                          .longest_burst_ns = g_longest_ns,
                          .release = release,
                          .allocated_bytes = mem_allocated()};
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

/* After a synchronisation: collect the bursts whose end has passed (and, in measure mode, the
 * completed kernel records, when the real call succeeded). */
static void sync_end(CUresult synced) {
    if (synced == CUDA_SUCCESS) measure_sync_point();
    if (UNLIKELY(g_mode == GL_MODE_FIKIT)) fikit_harvest();
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

/* -- synchronisation points: usage is measured and reported here -- */

EXPORT CUresult CUDAAPI cuCtxSynchronize(void) {
    init();
    if (!REAL(cuCtxSynchronize)) return CUDA_ERROR_NOT_FOUND;
    sync_begin(NULL, 1);
    CUresult result = REAL(cuCtxSynchronize)();
    sync_end(result);
    return result;
}

static ALWAYS_INLINE CUresult cuStreamSynchronize_body(int hook, int per_thread,
                                                       CUstream stream) {
    init();
    if (!REAL_AT(cuStreamSynchronize, hook)) return CUDA_ERROR_NOT_FOUND;
    sync_begin(stream_key(stream, per_thread), 0);
    CUresult result = REAL_AT(cuStreamSynchronize, hook)(stream);
    sync_end(result);
    return result;
}

GL_TWIN_HOOKS(cuStreamSynchronize, _ptsz, (CUstream stream), (stream))

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

static ALWAYS_INLINE CUresult cuMemcpyDtoH_v2_body(int hook, int per_thread, void *dst,
                                                   CUdeviceptr src, size_t bytes) {
    (void)per_thread; /* the streams a copy waits for are not tracked: it ends every burst */
    init();
    if (!REAL_AT(cuMemcpyDtoH_v2, hook)) return CUDA_ERROR_NOT_FOUND;
    sync_begin(NULL, 1);
    CUresult result = REAL_AT(cuMemcpyDtoH_v2, hook)(dst, src, bytes);
    sync_end(result);
    return result;
}

GL_TWIN_HOOKS(cuMemcpyDtoH_v2, _ptds, (void *dst, CUdeviceptr src, size_t bytes),
              (dst, src, bytes))
