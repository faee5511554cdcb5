/* The memory cap (Registered.memory_cap_bytes): allocations are reserved against it before
 * the driver is called (past it the answer is CUDA_ERROR_OUT_OF_MEMORY), tracked until freed,
 * and cuMemGetInfo_v2 answers within it; the allocation and free hooks.
 * Owns: g_cap, g_allocated, g_mem, g_mem_lock. */
#define _GNU_SOURCE
#include <stdlib.h>

#include "shim_internal.h"

typedef struct mem_entry {
    uint64_t key;
    uint64_t size;
    struct mem_entry *next;
} mem_entry;

#define MEM_BUCKETS 4096
static mem_entry *g_mem[MEM_BUCKETS];
static pthread_mutex_t g_mem_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_cap;       /* memory cap in bytes; 0 = none (atomic) */
static uint64_t g_allocated; /* atomic */

void mem_set_cap(uint64_t cap_bytes) {
    if (cap_bytes) __atomic_store_n(&g_cap, cap_bytes, __ATOMIC_RELEASE);
}

uint64_t mem_allocated(void) { return __atomic_load_n(&g_allocated, __ATOMIC_RELAXED); }

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

/* The common shape of an allocation hook (`hook`: its index in the list). */
#define ALLOC_HOOK(hook, size, out_key, call)                                           \
    do {                                                                                \
        init();                                                                         \
        if (!g_real[hook]) return CUDA_ERROR_NOT_FOUND;                                 \
        ensure_registered();                                                            \
        uint64_t size_ = (size);                                                        \
        if (!mem_reserve(size_)) return over_cap(g_hooks[hook].symbol, size_);          \
        CUresult result_ = (call);                                                      \
        if (result_ == CUDA_SUCCESS) {                                                  \
            mem_track((uint64_t)(out_key), size_);                                      \
            trace("alloc %s %llu ok", g_hooks[hook].symbol, (unsigned long long)size_); \
        } else {                                                                        \
            mem_unreserve(size_);                                                       \
        }                                                                               \
        return result_;                                                                 \
    } while (0)

EXPORT CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    ALLOC_HOOK(H_cuMemAlloc_v2, bytes, *dptr, REAL(cuMemAlloc_v2)(dptr, bytes));
}

EXPORT CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    ALLOC_HOOK(H_cuMemAllocManaged, bytes, *dptr, REAL(cuMemAllocManaged)(dptr, bytes, flags));
}

static ALWAYS_INLINE CUresult cuMemAllocAsync_body(int hook, int per_thread, CUdeviceptr *dptr,
                                                   size_t bytes, CUstream stream) {
    (void)per_thread; /* the cap is per process, whichever stream */
    ALLOC_HOOK(hook, bytes, *dptr, REAL_AT(cuMemAllocAsync, hook)(dptr, bytes, stream));
}

GL_TWIN_HOOKS(cuMemAllocAsync, _ptsz, (CUdeviceptr *dptr, size_t bytes, CUstream stream),
              (dptr, bytes, stream))

EXPORT CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                                    const CUmemAllocationProp *prop, unsigned long long flags) {
    ALLOC_HOOK(H_cuMemCreate, bytes, *handle, REAL(cuMemCreate)(handle, bytes, prop, flags));
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

static ALWAYS_INLINE CUresult cuMemFreeAsync_body(int hook, int per_thread, CUdeviceptr dptr,
                                                  CUstream stream) {
    (void)per_thread; /* the cap is per process, whichever stream */
    init();
    if (!REAL_AT(cuMemFreeAsync, hook)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL_AT(cuMemFreeAsync, hook)(dptr, stream);
    if (result == CUDA_SUCCESS) mem_untrack(dptr);
    return result;
}

GL_TWIN_HOOKS(cuMemFreeAsync, _ptsz, (CUdeviceptr dptr, CUstream stream), (dptr, stream))

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
