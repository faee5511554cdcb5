/* Kernel identity: the kernel ID, and names for functions the driver cannot name itself (a
 * table filled by cuModuleGetFunction, cuLibraryGetKernel and cuKernelGetFunction, emptied
 * per module by cuModuleUnload and cuLibraryUnload), with those hooks. Owns: g_names, g_names_lock. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shim_internal.h"

/* Kernel ID: FNV-1a 64 over the name's bytes, then the six u32 dimensions (grid x y z, block
 * x y z) as little-endian bytes. */
/* FNV-1a over the name, then over the six dimensions' bytes: split so that the name's part can
 * be kept per function. */
static uint64_t fnv_name(const char *name) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        h ^= *p;
        h *= 0x100000001b3ull;
    }
    return h;
}

static uint64_t fnv_dims(uint64_t h, const unsigned dims[6]) {
    for (int i = 0; i < 6; i++)
        for (int b = 0; b < 4; b++) {
            h ^= (dims[i] >> (8 * b)) & 0xff;
            h *= 0x100000001b3ull;
        }
    return h;
}

uint64_t kernel_id(const char *name, const unsigned dims[6]) {
    return fnv_dims(fnv_name(name), dims);
}

/* Per thread, per function: the hash state after its name. A launch then reads no name (a
 * PyTorch kernel's runs to hundreds of characters) and hashes its 24 bytes of dimensions.
 * A module unload moves the generation: a function address a later module reuses is named
 * again. Entries start at generation 0, which never matches. */
#define ID_CACHE 256
typedef struct {
    const void *f;
    uint32_t generation;
    uint64_t name_state;
} id_cache_entry;
static __thread id_cache_entry t_id_cache[ID_CACHE];
static uint32_t g_names_generation = 1; /* atomic */

uint64_t function_kernel_id(CUfunction f, const unsigned dims[6]) {
    uint32_t generation = __atomic_load_n(&g_names_generation, __ATOMIC_ACQUIRE);
    id_cache_entry *e = &t_id_cache[((uintptr_t)f >> 4) % ID_CACHE];
    if (e->f != f || e->generation != generation) {
        char name[GL_NAME_MAX];
        function_name(f, name, sizeof name);
        *e = (id_cache_entry){f, generation, fnv_name(name)};
    }
    return fnv_dims(e->name_state, dims);
}

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

void function_name(CUfunction f, char *out, size_t size) {
    const char *name = NULL;
    if (g_aux.func_get_name && g_aux.func_get_name(&name, f) == CUDA_SUCCESS && name) {
        snprintf(out, size, "%s", name);
        return;
    }
    if (names_get(f, out, size, NULL)) return;
    snprintf(out, size, "?");
}

EXPORT CUresult CUDAAPI cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name) {
    init();
    if (!REAL(cuModuleGetFunction)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuModuleGetFunction)(f, module, name);
    if (result == CUDA_SUCCESS && f) names_put(*f, module, name);
    return result;
}

/* A module or library going away: its names go, and every thread's kernel-ID cache is
 * invalidated, since the driver may hand its function addresses to the next one loaded. */
static void forget_module(const void *module) {
    names_evict_module(module);
    __atomic_add_fetch(&g_names_generation, 1, __ATOMIC_RELEASE);
}

EXPORT CUresult CUDAAPI cuModuleUnload(CUmodule module) {
    init();
    if (!REAL(cuModuleUnload)) return CUDA_ERROR_NOT_FOUND;
    forget_module(module);
    return REAL(cuModuleUnload)(module);
}

EXPORT CUresult CUDAAPI cuLibraryUnload(CUlibrary library) {
    init();
    if (!REAL(cuLibraryUnload)) return CUDA_ERROR_NOT_FOUND;
    forget_module(library);
    return REAL(cuLibraryUnload)(library);
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
        /* The function belongs to the kernel's library: its unload evicts both names. */
        char name[GL_NAME_MAX];
        const void *library = NULL;
        const char *real_name = NULL;
        int known = names_get(kernel, name, sizeof name, &library);
        if (g_aux.kernel_get_name && g_aux.kernel_get_name(&real_name, kernel) == CUDA_SUCCESS &&
            real_name)
            names_put(*f, library, real_name);
        else if (known)
            names_put(*f, library, name);
    }
    return result;
}
