/* Symbol resolution: the interposed dlsym (a hooked cu* or nvml* name gets its hook) and
 * cuGetProcAddress/cuGetProcAddress_v2 (the pointer the driver answers is mapped to the hook of
 * the same real function, else by queried name, cudaVersion and the per-thread flag), so that
 * cudart-style resolution lands in the hooks. Owns no state. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "shim_internal.h"

static int hook_index(const char *symbol) {
    for (int i = 0; i < H_COUNT; i++)
        if (strcmp(g_hooks[i].symbol, symbol) == 0) return i;
    return -1;
}

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
    if (found && ((name[0] == 'c' && name[1] == 'u') || strncmp(name, "nvml", 4) == 0)) {
        int i = hook_index(name);
        if (i >= 0) {
            init();
            trace("dlsym %s hooked", name);
            return g_hooks[i].hook;
        }
    }
    return found;
}
