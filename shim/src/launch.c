/* The launch hooks (cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel,
 * cuGraphLaunch, each with its _ptsz twin): admission, the usage burst, and in measure mode
 * the kernel's event pair, around the real launch. The share-mode path is gate()'s inline
 * check plus note_launch; names and IDs are computed only for the trace and measure mode.
 * Owns no state. */
#define _GNU_SOURCE
#include "admission.h"

/* What a launch carries from before the real call to after it. */
typedef struct {
    mslot *measured; /* measure mode: the kernel's event pair, or NULL */
    uint32_t granted; /* FIKIT: the grant's sequence number, or 0 */
    CUstream key;
} launch_state;

/* Everything a kernel launch does before calling the real function. */
static CUresult before_launch(int hook, CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                              unsigned bx, unsigned by, unsigned bz, CUstream key,
                              launch_state *st) {
    st->measured = NULL;
    st->key = key;
    const gl_launch launch = {f, {gx, gy, gz, bx, by, bz}, 0};
    kp_note_launch(f, launch.dims);
    CUresult result = gate(key, &launch, &st->granted);
    int measure = result == CUDA_SUCCESS && measure_on();
    if (UNLIKELY(g_config.trace_fd >= 0) || measure) {
        char name[GL_NAME_MAX];
        function_name(f, name, sizeof name);
        uint64_t id = function_kernel_id(f, launch.dims); /* the ID admission looks up */
        trace("launch %s %016llx %s %u %u %u %u %u %u%s", g_hooks[hook].symbol,
              (unsigned long long)id, name, gx, gy, gz, bx, by, bz,
              result == CUDA_SUCCESS ? "" : " refused");
        if (measure) st->measured = measure_begin(key, name, launch.dims, id);
    }
    if (result == CUDA_SUCCESS) note_launch(key);
    return result;
}

static inline CUresult after_launch(const launch_state *st, CUresult result) {
    if (st->measured) measure_end(st->measured, result);
    if (UNLIKELY(st->granted != 0)) fikit_after_launch(st->key, st->granted, result == CUDA_SUCCESS);
    return result;
}

static ALWAYS_INLINE CUresult cuLaunchKernel_body(int hook, int per_thread, CUfunction f,
                                                  unsigned int gx, unsigned int gy,
                                                  unsigned int gz, unsigned int bx,
                                                  unsigned int by, unsigned int bz,
                                                  unsigned int shared, CUstream stream,
                                                  void **params, void **extra) {
    init();
    if (!REAL_AT(cuLaunchKernel, hook)) return CUDA_ERROR_NOT_FOUND;
    launch_state m;
    CUresult r = before_launch(hook, f, gx, gy, gz, bx, by, bz, stream_key(stream, per_thread),
                               &m);
    if (r != CUDA_SUCCESS) return r;
    return after_launch(&m, REAL_AT(cuLaunchKernel, hook)(f, gx, gy, gz, bx, by, bz, shared,
                                                         stream, params, extra));
}

GL_TWIN_HOOKS(cuLaunchKernel, _ptsz,
              (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
               unsigned int by, unsigned int bz, unsigned int shared, CUstream stream,
               void **params, void **extra),
              (f, gx, gy, gz, bx, by, bz, shared, stream, params, extra))

static ALWAYS_INLINE CUresult cuLaunchKernelEx_body(int hook, int per_thread,
                                                    const CUlaunchConfig *c, CUfunction f,
                                                    void **params, void **extra) {
    init();
    if (!REAL_AT(cuLaunchKernelEx, hook)) return CUDA_ERROR_NOT_FOUND;
    if (c == NULL) return REAL_AT(cuLaunchKernelEx, hook)(c, f, params, extra);
    launch_state m;
    CUresult r = before_launch(hook, f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX,
                               c->blockDimY, c->blockDimZ, stream_key(c->hStream, per_thread),
                               &m);
    if (r != CUDA_SUCCESS) return r;
    return after_launch(&m, REAL_AT(cuLaunchKernelEx, hook)(c, f, params, extra));
}

GL_TWIN_HOOKS(cuLaunchKernelEx, _ptsz,
              (const CUlaunchConfig *c, CUfunction f, void **params, void **extra),
              (c, f, params, extra))

static ALWAYS_INLINE CUresult cuLaunchCooperativeKernel_body(int hook, int per_thread,
                                                             CUfunction f, unsigned int gx,
                                                             unsigned int gy, unsigned int gz,
                                                             unsigned int bx, unsigned int by,
                                                             unsigned int bz, unsigned int shared,
                                                             CUstream stream, void **params) {
    init();
    if (!REAL_AT(cuLaunchCooperativeKernel, hook)) return CUDA_ERROR_NOT_FOUND;
    launch_state m;
    CUresult r = before_launch(hook, f, gx, gy, gz, bx, by, bz, stream_key(stream, per_thread),
                               &m);
    if (r != CUDA_SUCCESS) return r;
    return after_launch(&m, REAL_AT(cuLaunchCooperativeKernel, hook)(f, gx, gy, gz, bx, by, bz,
                                                                    shared, stream, params));
}

GL_TWIN_HOOKS(cuLaunchCooperativeKernel, _ptsz,
              (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
               unsigned int by, unsigned int bz, unsigned int shared, CUstream stream,
               void **params),
              (f, gx, gy, gz, bx, by, bz, shared, stream, params))

/* A graph launch is one unit under its graph ID (graphs.c), all dimensions 0; measured as one
 * record, from before its first node to after its last, when it has an ID. */
static CUresult before_graph(int hook, CUgraphExec exec, CUstream key, launch_state *st) {
    st->measured = NULL;
    st->key = key;
    uint64_t structure;
    const gl_launch launch = {NULL, {0}, graph_identity(exec, &structure)};
    CUresult result = gate(key, &launch, &st->granted);
    int measure = result == CUDA_SUCCESS && launch.graph != 0 && measure_on();
    if (UNLIKELY(g_config.trace_fd >= 0) || measure) {
        char name[40];
        graph_name(structure, name, sizeof name);
        trace("launch %s %016llx %s 0 0 0 0 0 0%s", g_hooks[hook].symbol,
              (unsigned long long)launch.graph, name, result == CUDA_SUCCESS ? "" : " refused");
        if (measure) st->measured = measure_begin(key, name, launch.dims, launch.graph);
    }
    if (result == CUDA_SUCCESS) note_launch(key);
    return result;
}

static ALWAYS_INLINE CUresult cuGraphLaunch_body(int hook, int per_thread, CUgraphExec exec,
                                                 CUstream stream) {
    init();
    if (!REAL_AT(cuGraphLaunch, hook)) return CUDA_ERROR_NOT_FOUND;
    launch_state m;
    CUresult r = before_graph(hook, exec, stream_key(stream, per_thread), &m);
    return r != CUDA_SUCCESS ? r : after_launch(&m, REAL_AT(cuGraphLaunch, hook)(exec, stream));
}

GL_TWIN_HOOKS(cuGraphLaunch, _ptsz, (CUgraphExec exec, CUstream stream), (exec, stream))
