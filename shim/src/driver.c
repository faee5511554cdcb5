/* The real driver: the hook table built from hooks.h, loading the real libcuda and resolving
 * its functions (hooked and auxiliary), the real NVML's hooked functions (when first used), the
 * real dlsym, initialisation, cuInit.
 * Owns: g_hooks, g_real, g_aux, g_real_dlsym, g_init_once, g_nvml_once. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shim_internal.h"

const hook_info g_hooks[H_COUNT] = {
#define GL_INFO(symbol, query, version, per_thread) \
    {#symbol, query, version, per_thread, (void *)symbol},
    GL_HOOKS(GL_INFO)
#undef GL_INFO
};

void *g_real[H_COUNT];
struct gl_aux g_aux;
dlsym_fn g_real_dlsym;
pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
static pthread_once_t g_nvml_once = PTHREAD_ONCE_INIT;
char g_nvml_assigned[96];
nvml_uuid_fn g_nvml_uuid;

int is_nvml_hook(int i) { return strncmp(g_hooks[i].symbol, "nvml", 4) == 0; }

void resolve_real_dlsym(void) {
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !g_real_dlsym; i++)
        g_real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

void init_once(void) {
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
        if (is_nvml_hook(i)) continue; /* NVML's: nvml_resolve() */
        void *p = g_real_dlsym(lib, g_hooks[i].symbol);
        g_real[i] = p == g_hooks[i].hook ? NULL : p; /* never call ourselves */
    }
    /* The driver functions the shim calls itself, unhooked: NULL where the driver has none. */
#define RESOLVE_AUX(field, symbol) g_aux.field = (__typeof__(g_aux.field))g_real_dlsym(lib, symbol)
    RESOLVE_AUX(func_get_name, "cuFuncGetName");
    RESOLVE_AUX(kernel_get_name, "cuKernelGetName");
    RESOLVE_AUX(event_create, "cuEventCreate");
    RESOLVE_AUX(event_record, "cuEventRecord");
    RESOLVE_AUX(event_query, "cuEventQuery");
    RESOLVE_AUX(event_elapsed, "cuEventElapsedTime");
    RESOLVE_AUX(is_capturing, "cuStreamIsCapturing");
    RESOLVE_AUX(ctx_get_current, "cuCtxGetCurrent");
    RESOLVE_AUX(ctx_set_current, "cuCtxSetCurrent");
    RESOLVE_AUX(exchange_capture_mode, "cuThreadExchangeStreamCaptureMode");
    RESOLVE_AUX(ctx_get_device, "cuCtxGetDevice");
    RESOLVE_AUX(device_get_mem_pool, "cuDeviceGetMemPool");
    RESOLVE_AUX(array_requirements, "cuArrayGetMemoryRequirements");
    RESOLVE_AUX(mipmap_requirements, "cuMipmappedArrayGetMemoryRequirements");
    RESOLVE_AUX(graph_get_nodes, "cuGraphGetNodes");
    RESOLVE_AUX(node_get_type, "cuGraphNodeGetType");
    RESOLVE_AUX(kernel_node_get_params, "cuGraphKernelNodeGetParams_v2");
#undef RESOLVE_AUX
}

/* NVML is loaded by the application, usually after cuInit (pynvml dlopens it when first used),
 * so its functions are resolved when an NVML hook is first called: the library already loaded
 * (RTLD_NOLOAD), else loaded by name (GPULOOM_REAL_LIBNVML, default libnvidia-ml.so.1). */
static void nvml_resolve_once(void) {
    if (!g_real_dlsym) return;
    const char *path = getenv("GPULOOM_REAL_LIBNVML");
    if (path == NULL || *path == 0) path = "libnvidia-ml.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (lib == NULL) {
        say(LOG_ERROR, "cannot load the real NVML %s: %s; NVML memory queries fail", path,
            dlerror());
        return;
    }
    for (int i = 0; i < H_COUNT; i++) {
        if (!is_nvml_hook(i)) continue;
        void *p = g_real_dlsym(lib, g_hooks[i].symbol);
        g_real[i] = p == g_hooks[i].hook ? NULL : p;
    }
    g_nvml_uuid = (nvml_uuid_fn)g_real_dlsym(lib, "nvmlDeviceGetUUID");
    /* The GPU the process was given, when CUDA_VISIBLE_DEVICES names exactly one by UUID (as
     * the dispatcher's Reserve answer does on real GPUs): only that device gets the capped
     * view. Otherwise the shim cannot tell which NVML device is the process's. */
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    if (visible && (strncmp(visible, "GPU-", 4) == 0 || strncmp(visible, "MIG-", 4) == 0) &&
        strchr(visible, ',') == NULL && strlen(visible) < sizeof g_nvml_assigned)
        snprintf(g_nvml_assigned, sizeof g_nvml_assigned, "%s", visible);
}

void nvml_resolve(void) {
    init();
    pthread_once(&g_nvml_once, nvml_resolve_once);
}

int is_capturing(CUstream key) {
    if (g_aux.is_capturing == NULL) return 0;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    return g_aux.is_capturing(key, &status) == CUDA_SUCCESS &&
           status != CU_STREAM_CAPTURE_STATUS_NONE;
}

EXPORT CUresult CUDAAPI cuInit(unsigned int flags) {
    init();
    if (!REAL(cuInit)) return CUDA_ERROR_NOT_FOUND;
    CUresult result = REAL(cuInit)(flags);
    if (result == CUDA_SUCCESS) ensure_registered();
    return result;
}
