/* The memory cap (Registered.memory_cap_bytes): allocations are reserved against it before
 * the driver is called (past it the answer is CUDA_ERROR_OUT_OF_MEMORY and the driver is not
 * called), counted until freed, and cuMemGetInfo_v2 and NVML's nvmlDeviceGetMemoryInfo(_v2)
 * answer the same view within it; the allocation, free, mapping and query hooks.
 *
 * What is counted (docs/dispatcher.md, "The memory cap"):
 *   cuMemAlloc_v2, cuMemAllocPitch_v2 (the pitched size), cuMemAllocManaged (the full size, at
 *   allocation: managed memory may all become resident on the GPU), cuMemAllocAsync and
 *   cuMemAllocFromPoolAsync (+_ptsz; the bytes live from allocation to cuMemFreeAsync, not what
 *   a pool keeps reserved after frees), cuMemCreate (the physical allocation: counted until it
 *   is both released and unmapped everywhere in the process, as the driver frees it).
 *   CUDA arrays (cuArrayCreate, cuArray3DCreate, cuMipmappedArrayCreate, the _v2 and legacy
 *   entry points: the size the driver reports after creation, at least the unpadded size, until
 *   destroyed), graph memory nodes (cuGraphAddMemAllocNode, cuGraphAddNode(_v2) of type
 *   MEM_ALLOC: from the node's creation until the program frees the pointer; a graph destroyed
 *   without that keeps it counted, erring on the side of refusing), the legacy un-suffixed
 *   cuMemAlloc/cuMemAllocPitch/cuMemFree/cuMemGetInfo (32-bit sizes), and what stream-ordered
 *   pools keep after frees (their release threshold: see "pools" below).
 *   Not counted here: IPC-opened memory (cuIpcOpenMemHandle) and mappings of handles this
 *   process did not create (imported shareable handles): they are counted once, by the process
 *   that allocated them. shim/memcap_entry_points.txt lists every other allocating entry point
 *   of cuda.h with the reason it needs no hook; tests/shim/test_memcap_coverage.py fails on one
 *   that is neither hooked nor listed.
 * The count cannot underflow: every subtraction is of bytes an entry of the tables below added
 * (taken out of the table once), and the subtraction saturates at 0 (logged) all the same.
 * Every change of the count is also sampled into the region's memory ring (wire.h), at most one
 * entry per sample period the dispatcher sets, for its training introspection (the mini-batch
 * cycle); and a suspended process waits at its next allocation (suspend_point), so that it stops
 * where the dispatcher suspended it, at a low-memory point.
 * Owns: g_cap, g_allocated, g_mem, g_vmm, g_maps, g_arrays, g_pools, g_mem_lock, the
 * g_sample_* state. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "shim_internal.h"

typedef struct mem_entry {
    uint64_t key;
    uint64_t size;
    uint64_t extra; /* g_vmm: references (1 until released, +1 per mapping); g_maps: handle */
    struct mem_entry *next;
} mem_entry;

#define MEM_BUCKETS 4096
typedef struct {
    mem_entry *bucket[MEM_BUCKETS];
} mem_table;

static mem_table g_mem;  /* device pointers -> bytes counted, their pool (0: none) */
static mem_table g_arrays; /* CUarray / CUmipmappedArray handles -> bytes counted */
static mem_table g_vmm;  /* cuMemCreate handles -> bytes counted, references */
static mem_table g_maps; /* cuMemMap'd addresses (of counted handles) -> size, handle */
static pthread_mutex_t g_mem_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_cap;       /* memory cap in bytes; 0 = none (atomic) */
static uint64_t g_allocated; /* atomic */
#define MEM_DENIED 1u        /* the cap of a process not admitted: no allocation fits */

void mem_set_cap(uint64_t cap_bytes) { __atomic_store_n(&g_cap, cap_bytes, __ATOMIC_RELEASE); }

void mem_deny_uncapped(void) {
    uint64_t none = 0;
    __atomic_compare_exchange_n(&g_cap, &none, MEM_DENIED, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

uint64_t mem_allocated(void) { return __atomic_load_n(&g_allocated, __ATOMIC_RELAXED); }

static pthread_mutex_t g_sample_lock = PTHREAD_MUTEX_INITIALIZER;
static const uint8_t *g_sample_region; /* the region the count below is for (guarded) */
static uint32_t g_sample_count;        /* entries written into it */
static uint64_t g_sample_at;           /* when the latest entry was started */

/* The count now, into the region's memory ring (off when the dispatcher set no period). Read
 * under the lock, so the last writer writes the latest total. */
static void mem_sample(void) {
    uint8_t *r = region();
    if (r == NULL || conn_state() != CONN_CONNECTED) return;
    uint64_t period = (uint64_t)r_u32(r, GL_OFF_SAMPLE_PERIOD) * 1000u;
    if (period == 0) return;
    uint64_t now = now_ns();
    pthread_mutex_lock(&g_sample_lock);
    if (r != g_sample_region) { /* a new registration: a fresh ring */
        g_sample_region = r;
        g_sample_count = 0;
    }
    uint64_t allocated = __atomic_load_n(&g_allocated, __ATOMIC_ACQUIRE);
    if (g_sample_count > 0 && now - g_sample_at < period) {
        int entry = GL_OFF_MS_RING + 16 * (int)((g_sample_count - 1) % GL_REGION_SAMPLES);
        w_u64(r, entry + 8, allocated);
    } else {
        int entry = GL_OFF_MS_RING + 16 * (int)(g_sample_count % GL_REGION_SAMPLES);
        w_u64(r, entry, now);
        w_u64(r, entry + 8, allocated);
        w_u32(r, GL_OFF_MS_HEAD, ++g_sample_count);
        g_sample_at = now;
    }
    pthread_mutex_unlock(&g_sample_lock);
}

static size_t mem_bucket(uint64_t key) { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 52); }

/* Reserve `size` against the cap; 0 when it does not fit. */
static int mem_reserve(uint64_t size) {
    uint64_t cap = __atomic_load_n(&g_cap, __ATOMIC_ACQUIRE);
    uint64_t used = __atomic_load_n(&g_allocated, __ATOMIC_RELAXED);
    for (;;) {
        if (cap && (size > cap || used > cap - size)) return 0;
        if (__atomic_compare_exchange_n(&g_allocated, &used, used + size, 1, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED)) {
            if (size) mem_sample();
            return 1;
        }
    }
}

/* Saturates at 0: a count below what was really allocated would let the process past its cap,
 * so a subtraction of more than is counted (a bug, not an input) is logged and clamped. */
static void mem_unreserve(uint64_t size) {
    if (size == 0) return;
    uint64_t used = __atomic_load_n(&g_allocated, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(&g_allocated, &used, used >= size ? used - size : 0, 1,
                                        __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
    }
    if (used < size)
        say(LOG_WARN, "memory count underflow: %llu bytes freed, %llu counted; clamped to 0",
            (unsigned long long)size, (unsigned long long)used);
    mem_sample();
}

/* Table operations: called with g_mem_lock held. */
static int table_put(mem_table *t, uint64_t key, uint64_t size, uint64_t extra) {
    mem_entry *e = malloc(sizeof *e);
    if (e == NULL) return 0;
    *e = (mem_entry){key, size, extra, t->bucket[mem_bucket(key)]};
    t->bucket[mem_bucket(key)] = e;
    return 1;
}

static mem_entry *table_find(mem_table *t, uint64_t key) {
    for (mem_entry *e = t->bucket[mem_bucket(key)]; e; e = e->next)
        if (e->key == key) return e;
    return NULL;
}

/* Unlinks the entry of `key` and returns it (the caller frees it), or NULL. */
static mem_entry *table_take(mem_table *t, uint64_t key) {
    for (mem_entry **p = &t->bucket[mem_bucket(key)]; *p; p = &(*p)->next)
        if ((*p)->key == key) {
            mem_entry *e = *p;
            *p = e->next;
            return e;
        }
    return NULL;
}

/* Counted bytes that could not be tracked (no memory for an entry) stay counted: the cap errs
 * on the side of refusing. */
static void mem_track(mem_table *t, uint64_t key, uint64_t size, uint64_t extra) {
    pthread_mutex_lock(&g_mem_lock);
    table_put(t, key, size, extra);
    pthread_mutex_unlock(&g_mem_lock);
}

/* ---- pools: what a stream-ordered pool keeps after frees ----
 * A pool keeps freed memory for reuse up to its release threshold (CU_MEMPOOL_ATTR_RELEASE_
 * THRESHOLD; 0 by default: it gives back what is freed; PyTorch's async allocator sets it to
 * the maximum: it keeps everything). The shim counts, per pool, `held`: what the pool holds,
 * live allocations included. An allocation takes retained bytes first (only what exceeds
 * `held` is new); a free keeps up to the threshold (held = max(live, min(held, threshold)));
 * lowering the threshold, cuMemPoolTrimTo and cuMemPoolDestroy give back what they release.
 * The driver gives memory back at the next synchronisation, the shim at the free: between the
 * two a freed allocation above the threshold is not counted. Called with g_mem_lock held. */
typedef struct pool_state {
    uint64_t pool, threshold, live, held;
    struct pool_state *next;
} pool_state;
static pool_state *g_pools;

static pool_state *pool_find(uint64_t pool, int create) {
    for (pool_state *p = g_pools; p; p = p->next)
        if (p->pool == pool) return p;
    if (!create) return NULL;
    pool_state *p = calloc(1, sizeof *p);
    if (p == NULL) return NULL;
    p->pool = pool;
    p->next = g_pools;
    g_pools = p;
    return p;
}

/* The pool keeps at most max(live, cap_to) of what it holds; returns the bytes given back. */
static uint64_t pool_shrink(pool_state *p, uint64_t cap_to) {
    uint64_t keep = p->held < cap_to ? p->held : cap_to;
    if (keep < p->live) keep = p->live;
    uint64_t released = p->held > keep ? p->held - keep : 0;
    p->held = keep;
    return released;
}

/* Reserve an allocation of `size` from `pool` (0: no pool): the bytes it newly takes, in
 * *need. 0 when that does not fit under the cap. */
static int mem_reserve_for(uint64_t pool, uint64_t size, uint64_t *need) {
    if (pool == 0) {
        *need = size;
        return mem_reserve(size);
    }
    pthread_mutex_lock(&g_mem_lock);
    pool_state *p = pool_find(pool, 1);
    if (p == NULL) { /* no memory to follow the pool: counted as a plain allocation */
        pthread_mutex_unlock(&g_mem_lock);
        *need = size;
        return mem_reserve(size);
    }
    uint64_t after = p->live + size;
    *need = after > p->held ? after - p->held : 0;
    int ok = mem_reserve(*need);
    if (ok) {
        p->live = after;
        if (p->held < after) p->held = after;
    }
    pthread_mutex_unlock(&g_mem_lock);
    return ok;
}

/* The allocation reserved by mem_reserve_for did not happen (the driver refused it). */
static void mem_unreserve_for(uint64_t pool, uint64_t size, uint64_t need) {
    if (pool != 0) {
        pthread_mutex_lock(&g_mem_lock);
        pool_state *p = pool_find(pool, 0);
        if (p) {
            p->live = p->live >= size ? p->live - size : 0;
            p->held = p->held >= need ? p->held - need : 0;
            if (p->held < p->live) p->held = p->live;
        }
        pthread_mutex_unlock(&g_mem_lock);
    }
    mem_unreserve(need);
}

/* A pool allocation freed: the pool keeps up to its threshold. Returns the bytes to unreserve. */
static uint64_t pool_free_locked(uint64_t pool, uint64_t size) {
    pool_state *p = pool_find(pool, 0);
    if (p == NULL) return size;
    p->live = p->live >= size ? p->live - size : 0;
    return pool_shrink(p, p->threshold);
}

static void mem_untrack(uint64_t key) {
    pthread_mutex_lock(&g_mem_lock);
    mem_entry *e = table_take(&g_mem, key);
    uint64_t freed = e ? (e->extra ? pool_free_locked(e->extra, e->size) : e->size) : 0;
    pthread_mutex_unlock(&g_mem_lock);
    free(e);
    mem_unreserve(freed);
}

static void array_untrack(uint64_t key) {
    pthread_mutex_lock(&g_mem_lock);
    mem_entry *e = table_take(&g_arrays, key);
    pthread_mutex_unlock(&g_mem_lock);
    if (e) mem_unreserve(e->size);
    free(e);
}

/* The pool cuMemAllocAsync allocates from: the current device's (0: the driver cannot say). */
static uint64_t current_pool(void) {
    CUdevice device;
    CUmemoryPool pool = NULL;
    if (!g_aux.ctx_get_device || !g_aux.device_get_mem_pool ||
        g_aux.ctx_get_device(&device) != CUDA_SUCCESS ||
        g_aux.device_get_mem_pool(&pool, device) != CUDA_SUCCESS)
        return 0;
    return (uint64_t)(uintptr_t)pool;
}

/* Drops one reference of a cuMemCreate handle; the last one gives its bytes back. Called with
 * g_mem_lock held; returns the bytes to unreserve. */
static uint64_t vmm_unref(uint64_t handle) {
    mem_entry *e = table_find(&g_vmm, handle);
    if (e == NULL || --e->extra > 0) return 0;
    e = table_take(&g_vmm, handle);
    uint64_t size = e->size;
    free(e);
    return size;
}

void mem_capped_view(uint64_t *free_bytes, uint64_t *total_bytes) {
    uint64_t cap = __atomic_load_n(&g_cap, __ATOMIC_ACQUIRE);
    if (!cap) return;
    uint64_t used = __atomic_load_n(&g_allocated, __ATOMIC_ACQUIRE);
    uint64_t left = used < cap ? cap - used : 0;
    if (cap < *total_bytes) *total_bytes = cap;
    if (left < *free_bytes) *free_bytes = left;
}

static CUresult over_cap(const char *hook, uint64_t size) {
    trace("alloc %s %llu out_of_memory", hook, (unsigned long long)size);
    uint64_t cap = __atomic_load_n(&g_cap, __ATOMIC_RELAXED);
    if (cap == MEM_DENIED)
        say(LOG_INFO, "%s of %llu bytes refused: the dispatcher does not admit this process",
            hook, (unsigned long long)size);
    else
        say(LOG_INFO, "%s of %llu bytes refused: over the memory cap of %llu bytes", hook,
            (unsigned long long)size, (unsigned long long)cap);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Hand the call to the driver as it is (what the hook cannot read, the driver answers). */
#define PASS_ON(symbol, args)                                               \
    do {                                                                    \
        init();                                                             \
        return REAL(symbol) ? REAL(symbol) args : CUDA_ERROR_NOT_FOUND;     \
    } while (0)

/* The common shape of an allocation hook (`hook`: its index in the list; the new allocation
 * goes into `table` under `out_key`, with `extra`; `capturing`: recorded into a graph, not run,
 * so never held by a suspension; `pool`: the stream-ordered pool it comes from, 0: none; then
 * `extra` is the pool). */
#define ALLOC_HOOK_POOL(hook, size, table, out_key, extra, capturing, pool, call)       \
    do {                                                                                \
        init();                                                                         \
        if (!g_real[hook]) return CUDA_ERROR_NOT_FOUND;                                 \
        ensure_registered();                                                            \
        uint8_t *r_ = region(); /* is_capturing is a driver call: only when suspended */  \
        if (UNLIKELY(r_ != NULL && r_u64(r_, GL_OFF_SUSPEND_UNTIL) != 0) && !(capturing)) \
            suspend_wait(r_);                                                           \
        uint64_t size_ = (size), pool_ = (pool), need_ = 0;                             \
        if (!mem_reserve_for(pool_, size_, &need_))                                     \
            return over_cap(g_hooks[hook].symbol, size_);                               \
        CUresult result_ = (call);                                                      \
        if (result_ == CUDA_SUCCESS) {                                                  \
            mem_track((table), (uint64_t)(out_key), size_, pool_ ? pool_ : (extra));    \
            trace("alloc %s %llu ok", g_hooks[hook].symbol, (unsigned long long)size_); \
        } else {                                                                        \
            mem_unreserve_for(pool_, size_, need_);                                     \
        }                                                                               \
        return result_;                                                                 \
    } while (0)
#define ALLOC_HOOK(hook, size, table, out_key, extra, capturing, call) \
    ALLOC_HOOK_POOL(hook, size, table, out_key, extra, capturing, 0, call)

/* Free what `hook` (a SETTLED_HOOK) made, through the real driver (not counted). */
static void give_back(int hook, uint64_t key) {
    switch (hook) {
    case H_cuMemAllocPitch_v2:
        if (REAL(cuMemFree_v2)) REAL(cuMemFree_v2)((CUdeviceptr)key);
        break;
    case H_cuMemAllocPitch:
        if (REAL(cuMemFree)) REAL(cuMemFree)((gl_deviceptr_v1)key);
        break;
    case H_cuMipmappedArrayCreate:
        if (REAL(cuMipmappedArrayDestroy))
            REAL(cuMipmappedArrayDestroy)((CUmipmappedArray)(uintptr_t)key);
        break;
    default: /* the other array constructors */
        if (REAL(cuArrayDestroy)) REAL(cuArrayDestroy)((CUarray)(uintptr_t)key);
    }
}

/* After the driver made an allocation whose size it fixes itself (a pitch, an array's
 * layout; `hook`: the entry point that made it, `key`: the allocation, `counted`: the bytes
 * already reserved): count `size`, what it really takes, if that is more; if that does not
 * fit, the allocation is given back to the driver and the answer is out of memory. */
static CUresult settle(int hook, mem_table *table, uint64_t key, uint64_t counted,
                       uint64_t size) {
    const char *symbol = g_hooks[hook].symbol;
    if (size > counted && !mem_reserve(size - counted)) {
        mem_unreserve(counted);
        give_back(hook, key);
        return over_cap(symbol, size);
    }
    if (size < counted) size = counted;
    mem_track(table, key, size, 0);
    trace("alloc %s %llu ok", symbol, (unsigned long long)size);
    return CUDA_SUCCESS;
}

/* The common shape of a hook whose size the driver fixes (`hook`: its index in the list): reserve
 * `counted`, what is known before the call, make the call (given back if it fails), then settle
 * `out`, the new allocation, at `size` (read after the call). */
#define SETTLED_HOOK(hook, table, counted, call, out, size)                           \
    do {                                                                              \
        init();                                                                       \
        if (!g_real[hook]) return CUDA_ERROR_NOT_FOUND;                               \
        ensure_registered();                                                          \
        suspend_point();                                                              \
        uint64_t counted_ = (counted);                                                \
        if (!mem_reserve(counted_)) return over_cap(g_hooks[hook].symbol, counted_);  \
        CUresult result_ = (call);                                                    \
        if (result_ != CUDA_SUCCESS) {                                                \
            mem_unreserve(counted_);                                                  \
            return result_;                                                           \
        }                                                                             \
        return settle(hook, (table), (uint64_t)(uintptr_t)(out), counted_, (size));  \
    } while (0)

EXPORT CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    ALLOC_HOOK(H_cuMemAlloc_v2, bytes, &g_mem, *dptr, 0, 0, REAL(cuMemAlloc_v2)(dptr, bytes));
}

EXPORT CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    ALLOC_HOOK(H_cuMemAllocManaged, bytes, &g_mem, *dptr, 0, 0,
               REAL(cuMemAllocManaged)(dptr, bytes, flags));
}

/* A captured allocation becomes a graph node (counted as such: no pool); a run one comes from
 * the device's current pool. */
static ALWAYS_INLINE CUresult cuMemAllocAsync_body(int hook, int per_thread, CUdeviceptr *dptr,
                                                   size_t bytes, CUstream stream) {
    int capturing = is_capturing(stream_key(stream, per_thread));
    ALLOC_HOOK_POOL(hook, bytes, &g_mem, *dptr, 0, capturing, capturing ? 0 : current_pool(),
                    REAL_AT(cuMemAllocAsync, hook)(dptr, bytes, stream));
}

GL_TWIN_HOOKS(cuMemAllocAsync, _ptsz, (CUdeviceptr *dptr, size_t bytes, CUstream stream),
              (dptr, bytes, stream))

static ALWAYS_INLINE CUresult cuMemAllocFromPoolAsync_body(int hook, int per_thread,
                                                           CUdeviceptr *dptr, size_t bytes,
                                                           CUmemoryPool pool, CUstream stream) {
    int capturing = is_capturing(stream_key(stream, per_thread));
    ALLOC_HOOK_POOL(hook, bytes, &g_mem, *dptr, 0, capturing,
                    capturing ? 0 : (uint64_t)(uintptr_t)pool,
                    REAL_AT(cuMemAllocFromPoolAsync, hook)(dptr, bytes, pool, stream));
}

GL_TWIN_HOOKS(cuMemAllocFromPoolAsync, _ptsz,
              (CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream),
              (dptr, bytes, pool, stream))

/* One reference for the handle itself (until cuMemRelease), one per mapping (cuMemMap). */
EXPORT CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                                    const CUmemAllocationProp *prop, unsigned long long flags) {
    ALLOC_HOOK(H_cuMemCreate, bytes, &g_vmm, *handle, 1, 0,
               REAL(cuMemCreate)(handle, bytes, prop, flags));
}

/* The pitch (and so the size) is known only after the call: the unpadded size is reserved
 * first, then the padding (SETTLED_HOOK, below). */
EXPORT CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                           size_t height, unsigned int element_bytes) {
    SETTLED_HOOK(H_cuMemAllocPitch_v2, &g_mem, (uint64_t)width * height,
                 REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, element_bytes), *dptr,
                 (uint64_t)*pitch * height);
}

/* The common shape of a free hook: the driver's answer; `untrack` once it has freed. */
#define FREE_HOOK(hook, call, untrack)                  \
    do {                                                \
        init();                                         \
        if (!g_real[hook]) return CUDA_ERROR_NOT_FOUND; \
        CUresult result_ = (call);                      \
        if (result_ == CUDA_SUCCESS) untrack;           \
        return result_;                                 \
    } while (0)

EXPORT CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr) {
    FREE_HOOK(H_cuMemFree_v2, REAL(cuMemFree_v2)(dptr), mem_untrack(dptr));
}

static ALWAYS_INLINE CUresult cuMemFreeAsync_body(int hook, int per_thread, CUdeviceptr dptr,
                                                  CUstream stream) {
    (void)per_thread; /* the cap is per process, whichever stream */
    FREE_HOOK(hook, REAL_AT(cuMemFreeAsync, hook)(dptr, stream), mem_untrack(dptr));
}

GL_TWIN_HOOKS(cuMemFreeAsync, _ptsz, (CUdeviceptr dptr, CUstream stream), (dptr, stream))

/* The driver frees a cuMemCreate allocation when it is released and no mapping is left. */
EXPORT CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
    init();
    if (!REAL(cuMemRelease)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuMemRelease)(handle);
    if (result == CUDA_SUCCESS) {
        pthread_mutex_lock(&g_mem_lock);
        uint64_t freed = vmm_unref(handle);
        pthread_mutex_unlock(&g_mem_lock);
        if (freed) mem_unreserve(freed);
    }
    return result;
}

/* Mapping costs no new memory (the handle was counted when created); it holds the allocation
 * alive until unmapped. A handle this process did not create (imported) is not followed. */
EXPORT CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                                 CUmemGenericAllocationHandle handle, unsigned long long flags) {
    init();
    if (!REAL(cuMemMap)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuMemMap)(ptr, size, offset, handle, flags);
    if (result == CUDA_SUCCESS) {
        pthread_mutex_lock(&g_mem_lock);
        mem_entry *e = table_find(&g_vmm, handle);
        if (e && table_put(&g_maps, ptr, size, handle)) e->extra++;
        pthread_mutex_unlock(&g_mem_lock);
    }
    return result;
}

/* The range may cover several mappings laid end to end (each mapped whole, as the driver
 * requires): each drops its handle's reference. */
EXPORT CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
    init();
    if (!REAL(cuMemUnmap)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuMemUnmap)(ptr, size);
    if (result != CUDA_SUCCESS) return result;
    uint64_t freed = 0, at = ptr, end = (uint64_t)ptr + size;
    pthread_mutex_lock(&g_mem_lock);
    while (at < end) {
        mem_entry *m = table_take(&g_maps, at);
        if (m == NULL) break; /* not a mapping of a counted handle */
        freed += vmm_unref(m->extra);
        at += m->size ? m->size : end - at;
        free(m);
    }
    pthread_mutex_unlock(&g_mem_lock);
    if (freed) mem_unreserve(freed);
    return result;
}

/* ---- pools ---- */

/* `pool` keeps at most `keep` (pool_shrink) and the count gives back what it releases; with
 * `set_threshold`, `keep` is also its release threshold from now on (with `create`, a pool not
 * followed yet is followed from now on). */
static void pool_release(CUmemoryPool pool, uint64_t keep, int set_threshold, int create) {
    uint64_t released = 0;
    pthread_mutex_lock(&g_mem_lock);
    pool_state *p = pool_find((uint64_t)(uintptr_t)pool, create);
    if (p) {
        if (set_threshold) p->threshold = keep;
        released = pool_shrink(p, keep);
    }
    pthread_mutex_unlock(&g_mem_lock);
    mem_unreserve(released);
}

EXPORT CUresult CUDAAPI cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attribute,
                                              void *value) {
    init();
    if (!REAL(cuMemPoolSetAttribute)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuMemPoolSetAttribute)(pool, attribute, value);
    if (result != CUDA_SUCCESS || attribute != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD || !value)
        return result;
    uint64_t threshold = *(const cuuint64_t *)value;
    pool_release(pool, threshold, 1, 1);
    trace("pool threshold %llu", (unsigned long long)threshold);
    return result;
}

EXPORT CUresult CUDAAPI cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    init();
    if (!REAL(cuMemPoolTrimTo)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuMemPoolTrimTo)(pool, keep);
    if (result == CUDA_SUCCESS) pool_release(pool, keep, 0, 0);
    return result;
}

/* The driver frees what the pool keeps; allocations still live are freed as they are freed. */
EXPORT CUresult CUDAAPI cuMemPoolDestroy(CUmemoryPool pool) {
    init();
    if (!REAL(cuMemPoolDestroy)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuMemPoolDestroy)(pool);
    if (result == CUDA_SUCCESS) pool_release(pool, 0, 1, 0);
    return result;
}

/* ---- CUDA arrays ---- */

/* The unpadded size is reserved first, then what the driver reports the array takes. */
#define ARRAY_HOOK(hook, size, out_handle, mipmap, call)                \
    SETTLED_HOOK(hook, &g_arrays, size, call, out_handle,               \
                 array_bytes((uint64_t)(uintptr_t)(out_handle), mipmap))

/* What the array `handle` really takes (cuArrayGetMemoryRequirements, when the driver has
 * it); 0: not known. */
static uint64_t array_bytes(uint64_t handle, int mipmap) {
    CUDA_ARRAY_MEMORY_REQUIREMENTS need = {0};
    CUdevice device;
    CUresult asked = CUDA_ERROR_NOT_FOUND;
    if (g_aux.ctx_get_device && g_aux.ctx_get_device(&device) == CUDA_SUCCESS) {
        if (mipmap && g_aux.mipmap_requirements)
            asked = g_aux.mipmap_requirements(&need, (CUmipmappedArray)(uintptr_t)handle, device);
        else if (!mipmap && g_aux.array_requirements)
            asked = g_aux.array_requirements(&need, (CUarray)(uintptr_t)handle, device);
    }
    return asked == CUDA_SUCCESS ? need.size : 0;
}

/* The array constructors: one per descriptor type (`depth`: the descriptor's, 1 for the 2D
 * ones). */
#define ARRAY_CREATE_HOOK(symbol, descriptor, depth)                                        \
    EXPORT CUresult CUDAAPI symbol(CUarray *handle, const descriptor *d) {                  \
        if (!d || !handle) PASS_ON(symbol, (handle, d));                                    \
        ARRAY_HOOK(H_##symbol,                                                              \
                   gl_array_bytes(d->Width, d->Height, depth, d->Format, d->NumChannels),   \
                   *handle, 0, REAL(symbol)(handle, d));                                    \
    }
ARRAY_CREATE_HOOK(cuArrayCreate_v2, CUDA_ARRAY_DESCRIPTOR, 1)
ARRAY_CREATE_HOOK(cuArray3DCreate_v2, CUDA_ARRAY3D_DESCRIPTOR, d->Depth)
ARRAY_CREATE_HOOK(cuArrayCreate, gl_array_descriptor_v1, 1)
ARRAY_CREATE_HOOK(cuArray3DCreate, gl_array3d_descriptor_v1, d->Depth)

EXPORT CUresult CUDAAPI cuMipmappedArrayCreate(CUmipmappedArray *handle,
                                               const CUDA_ARRAY3D_DESCRIPTOR *d,
                                               unsigned int levels) {
    if (!d || !handle) PASS_ON(cuMipmappedArrayCreate, (handle, d, levels));
    ARRAY_HOOK(H_cuMipmappedArrayCreate, gl_mipmap_bytes(d, levels), *handle, 1,
               REAL(cuMipmappedArrayCreate)(handle, d, levels));
}

EXPORT CUresult CUDAAPI cuArrayDestroy(CUarray handle) {
    FREE_HOOK(H_cuArrayDestroy, REAL(cuArrayDestroy)(handle),
              array_untrack((uint64_t)(uintptr_t)handle));
}

EXPORT CUresult CUDAAPI cuMipmappedArrayDestroy(CUmipmappedArray handle) {
    FREE_HOOK(H_cuMipmappedArrayDestroy, REAL(cuMipmappedArrayDestroy)(handle),
              array_untrack((uint64_t)(uintptr_t)handle));
}

/* ---- graph memory nodes: counted from the node's creation (the driver answers its address
 * then) until the program frees the pointer (cuMemFree/cuMemFreeAsync); never held by a
 * suspension (nothing runs) ---- */

EXPORT CUresult CUDAAPI cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph,
                                               const CUgraphNode *dependencies, size_t count,
                                               CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    if (!params) PASS_ON(cuGraphAddMemAllocNode, (node, graph, dependencies, count, params));
    ALLOC_HOOK(H_cuGraphAddMemAllocNode, params->bytesize, &g_mem, params->dptr, 0, 1,
               REAL(cuGraphAddMemAllocNode)(node, graph, dependencies, count, params));
}

EXPORT CUresult CUDAAPI cuGraphAddNode(CUgraphNode *node, CUgraph graph,
                                       const CUgraphNode *dependencies, size_t count,
                                       CUgraphNodeParams *params) {
    if (!params || params->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        PASS_ON(cuGraphAddNode, (node, graph, dependencies, count, params));
    ALLOC_HOOK(H_cuGraphAddNode, params->alloc.bytesize, &g_mem, params->alloc.dptr, 0, 1,
               REAL(cuGraphAddNode)(node, graph, dependencies, count, params));
}

EXPORT CUresult CUDAAPI cuGraphAddNode_v2(CUgraphNode *node, CUgraph graph,
                                          const CUgraphNode *dependencies,
                                          const CUgraphEdgeData *edges, size_t count,
                                          CUgraphNodeParams *params) {
    if (!params || params->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        PASS_ON(cuGraphAddNode_v2, (node, graph, dependencies, edges, count, params));
    ALLOC_HOOK(H_cuGraphAddNode_v2, params->alloc.bytesize, &g_mem, params->alloc.dptr, 0, 1,
               REAL(cuGraphAddNode_v2)(node, graph, dependencies, edges, count, params));
}

/* ---- the legacy entry points (32-bit pointers and sizes, gl_cuda_legacy.h) ---- */

EXPORT CUresult CUDAAPI cuMemAlloc(gl_deviceptr_v1 *dptr, unsigned int bytes) {
    ALLOC_HOOK(H_cuMemAlloc, bytes, &g_mem, *dptr, 0, 0, REAL(cuMemAlloc)(dptr, bytes));
}

EXPORT CUresult CUDAAPI cuMemAllocPitch(gl_deviceptr_v1 *dptr, unsigned int *pitch,
                                        unsigned int width, unsigned int height,
                                        unsigned int element_bytes) {
    SETTLED_HOOK(H_cuMemAllocPitch, &g_mem, (uint64_t)width * height,
                 REAL(cuMemAllocPitch)(dptr, pitch, width, height, element_bytes), *dptr,
                 (uint64_t)*pitch * height);
}

EXPORT CUresult CUDAAPI cuMemFree(gl_deviceptr_v1 dptr) {
    FREE_HOOK(H_cuMemFree, REAL(cuMemFree)(dptr), mem_untrack(dptr));
}

/* The driver's answer, within the cap (mem_capped_view; `free_bytes`, `total_bytes`: the
 * caller's pointers, of the entry point's own width). */
#define MEM_INFO_HOOK(hook, free_bytes, total_bytes, call)                   \
    do {                                                                     \
        init();                                                              \
        if (!g_real[hook]) return CUDA_ERROR_NOT_FOUND;                      \
        ensure_registered();                                                 \
        CUresult result_ = (call);                                           \
        if (result_ == CUDA_SUCCESS && (free_bytes) && (total_bytes)) {      \
            uint64_t free64_ = *(free_bytes), total64_ = *(total_bytes);     \
            mem_capped_view(&free64_, &total64_);                            \
            *(free_bytes) = (__typeof__(*(free_bytes)))free64_;              \
            *(total_bytes) = (__typeof__(*(total_bytes)))total64_;           \
        }                                                                    \
        return result_;                                                      \
    } while (0)

EXPORT CUresult CUDAAPI cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes) {
    /* never more than the driver's own 32-bit answer: the cast keeps the value */
    MEM_INFO_HOOK(H_cuMemGetInfo, free_bytes, total_bytes,
                  REAL(cuMemGetInfo)(free_bytes, total_bytes));
}

EXPORT CUresult CUDAAPI cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    MEM_INFO_HOOK(H_cuMemGetInfo_v2, free_bytes, total_bytes,
                  REAL(cuMemGetInfo_v2)(free_bytes, total_bytes));
}

/* Whether `device` is the process's GPU: the one CUDA_VISIBLE_DEVICES names by UUID, else (no
 * way to tell) every device. */
static int nvml_is_assigned(nvmlDevice_t device) {
    if (!g_nvml_assigned[0] || !g_nvml_uuid) return 1;
    char uuid[96];
    if (g_nvml_uuid(device, uuid, sizeof uuid) != NVML_SUCCESS) return 1;
    return strncmp(uuid, g_nvml_assigned, strlen(g_nvml_assigned)) == 0;
}

/* NVML: the same view as cuMemGetInfo_v2, with used = total - free (so the three add up), for
 * the process's GPU (see nvml_is_assigned); other devices are answered as they are. The _v2
 * struct's `reserved` (the driver's own reserve, outside the process's view) becomes 0, and
 * the struct is left as it is when the view does not change it. */
static void nvml_capped_view(nvmlDevice_t device, unsigned long long *free_bytes,
                             unsigned long long *total_bytes, unsigned long long *used,
                             unsigned long long *reserved) {
    if (!nvml_is_assigned(device)) return;
    uint64_t free64 = *free_bytes, total64 = *total_bytes;
    mem_capped_view(&free64, &total64);
    if (reserved) {
        if (free64 == *free_bytes && total64 == *total_bytes) return;
        *reserved = 0;
    }
    *free_bytes = free64;
    *total_bytes = total64;
    *used = total64 - free64;
}

#define NVML_MEMORY_HOOK(symbol, device, memory, reserved)                                 \
    do {                                                                                   \
        nvml_resolve();                                                                    \
        if (!REAL(symbol)) return NVML_ERROR_FUNCTION_NOT_FOUND;                           \
        ensure_registered();                                                               \
        nvmlReturn_t result_ = REAL(symbol)(device, memory);                               \
        if (result_ == NVML_SUCCESS && (memory))                                           \
            nvml_capped_view(device, &(memory)->free, &(memory)->total, &(memory)->used,   \
                             reserved);                                                    \
        return result_;                                                                    \
    } while (0)

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    NVML_MEMORY_HOOK(nvmlDeviceGetMemoryInfo, device, memory, NULL);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    NVML_MEMORY_HOOK(nvmlDeviceGetMemoryInfo_v2, device, memory, &memory->reserved);
}
