/* A test program that drives the driver API the way a CUDA application does.
 *
 *   cudart_like [--proc] [--ptds] OP...
 *
 * --proc  resolve every entry point as cudart does: dlsym(libcuda, "cuGetProcAddress_v2"),
 *         then cuGetProcAddress itself and everything else through it. Without it the program
 *         calls the -lcuda symbols directly.
 * --ptds  per-thread default stream: the _ptsz/_ptds entry points (direct), or the
 *         CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM flag (--proc).
 *
 * OPs (results go to stdout as "key value..." lines):
 *   module NAME:US[:SM][,...]       load a module (cuModuleLoadData/cuModuleGetFunction); SM:
 *                                   the percent of the SMs the kernel can use (fake driver)
 *   library NAME:US[,...]           load a library (cuLibraryLoadData/GetKernel/KernelGetFunction)
 *                                   (both print "function NAME handle=ADDRESS" per function)
 *   unload                          unload the last module
 *   unloadlib                       unload the last library
 *   stream                          create a stream and use it from now on
 *   launch KIND NAME N GX GY GZ BX BY BZ   KIND: kernel | ex | coop
 *   loop SECONDS NAME SYNC_EVERY    launch NAME (1x1) until SECONDS pass, stream-sync every
 *                                   SYNC_EVERY launches; stops at the first failed launch
 *   infer N PAUSE_US GAP_US NAME[,NAME...]   N requests: each launches the NAMEs (1x1) in
 *                                   order, stream-syncing after each and sleeping GAP_US between
 *                                   them (the host's work); PAUSE_US between requests. Prints
 *                                   the request latencies' mean, p50, p99 (ms) and the failures,
 *                                   then the same as the JSON line `gpuloom profile sweep` reads
 *                                   ({"requests_per_s": ..., "p50_latency_ms": ..., ...})
 *   train N PERIOD_US LAYERS BYTES NAME   a fake training loop: N mini-batches, one started
 *                                   every PERIOD_US (the host sleeps in between: data loading;
 *                                   after a stall the schedule restarts). Each: forward (per
 *                                   layer cuMemAlloc BYTES of activations, launch NAME, stream
 *                                   sync), backward (per layer launch NAME, stream sync,
 *                                   cuMemFree its activations), then cuCtxSynchronize. Prints
 *                                   "train step I t=NS" after each (NS: when it began,
 *                                   CLOCK_MONOTONIC), then "train minibatches=N done=D failed=F"
 *                                   (F: mini-batches with a failed allocation or launch: lost
 *                                   work) and exits 3 if F > 0. With CUDART_LIKE_TRAIN_STATE=FILE
 *                                   it checkpoints: it starts at the step saved in FILE (if
 *                                   any), and SIGUSR1 makes it save the next step to FILE at
 *                                   the next mini-batch boundary, print "train checkpoint
 *                                   step=I" and stop the loop (D: mini-batches of this run)
 *   steady N PERIOD_US LAYERS BYTES FWD[,BWD[,OPT]]   a training loop that allocates once
 *                                   and reuses (PyTorch's caching allocator): LAYERS buffers of
 *                                   BYTES filled with a known pattern and an 8-byte step counter,
 *                                   allocated first ("steady allocated bytes=B"); each of N
 *                                   mini-batches (one every PERIOD_US) launches FWD per layer, BWD
 *                                   per layer in reverse, OPT once, syncs, and checks and advances
 *                                   the device counter ("steady step I t=NS"); at the end every
 *                                   byte of every buffer is checked: "steady minibatches=N done=D
 *                                   failed=F corrupt=C damaged_layers=L" (exit 3 unless all 0);
 *                                   CUDART_LIKE_SYNC_EACH=1: a stream sync after every launch
 *                                   (launches spread over the mini-batch, as a CPU-bound loop's)
 *   burst NAME N                    launch NAME (1x1) N times without synchronising: prints
 *                                   the time the launch calls took (total and longest)
 *   sleep US                        sleep on the host (idle time between kernels)
 *   sync | ssync | esync | dtoh     cuCtxSynchronize | cuStreamSynchronize | event record +
 *                                   cuEventSynchronize | cuMemcpyDtoH
 *   alloc KIND BYTES                KIND: alloc | pitch | managed | async | create | pool
 *                                   (cuMemAllocFromPoolAsync from a pool made at first use) |
 *                                   vmm (cuMemCreate, cuMemAddressReserve, cuMemMap,
 *                                   cuMemSetAccess) | array | array3d | mipmap (rows of 1,000
 *                                   floats) | graphnode (cuGraphAddMemAllocNode) | addnode
 *                                   (cuGraphAddNode_v2, MEM_ALLOC) | legacy | legacypitch |
 *                                   legacyarray (the pre-3.2 32-bit entry points)
 *   poolthreshold BYTES | pooltrim BYTES | defaultthreshold BYTES   the release threshold of
 *                                   the `pool` allocations' pool (made if needed), cuMemPoolTrimTo
 *                                   of it, the threshold of the device's current pool
 *   freelast | freeagain            free the last pointer or async allocation | free it again
 *   vmmrelease                      cuMemRelease every vmm handle (their mappings stay)
 *   freeall                         free every allocation (async ones with cuMemFreeAsync, vmm
 *                                   ones unmapped and released)
 *   meminfo                         cuMemGetInfo
 *   nvml                            dlopen libnvidia-ml.so.1 and dlsym its functions (as pynvml
 *                                   does): nvmlDeviceGetMemoryInfo and _v2 of device 0, then
 *                                   nvmlDeviceGetMemoryInfo of device 1 ("nvml_other"), if any
 *   ipcget FILE                     cuIpcGetMemHandle of the last allocation, written to FILE
 *   ipcopen FILE                    cuIpcOpenMemHandle of the handle in FILE
 *   ipcclose                        cuIpcCloseMemHandle of every opened handle
 *   fill BYTE | peek                cuMemcpyHtoD BYTE into the first 4 KiB of the last
 *                                   allocation | cuMemcpyDtoH of them: prints the bytes seen
 *   ipcfill BYTE | ipcpeek          the same on the last IPC-opened memory
 *   waitfile PATH                   wait (up to 60 s) until PATH exists
 *   capture NAME N                  capture N launches into a graph, then cuGraphLaunch it
 *   glaunch | gdestroy              cuGraphLaunch | cuGraphExecDestroy the last captured graph
 *   gsetparams NAME                 its first kernel node runs NAME instead
 *                                   (cuGraphExecKernelNodeSetParams)
 *   gupdate                         cuGraphExecUpdate it from its graph
 *   gloop SECONDS PAUSE_US          launch it and stream-sync until SECONDS pass, sleeping
 *                                   PAUSE_US after each: "gloop launches=N rc=R mean_ms=M"
 *                                   (M: a launch to its sync, on average)
 *   timed NAME N                    events around N launches: prints the elapsed ms
 * Exit status: 0, or 3 when a launch failed (the code is printed), 2 on a usage error.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gl_cuda.h"
#include "gl_nvml.h"

#define API(X)                                                                                  \
    X(cuInit) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName) X(cuCtxCreate)              \
    X(cuCtxSynchronize) X(cuModuleLoadData) X(cuModuleGetFunction) X(cuModuleUnload)           \
    X(cuLibraryLoadData) X(cuLibraryGetKernel) X(cuKernelGetFunction) X(cuLibraryUnload)       \
    X(cuLaunchKernel)                                                                           \
    X(cuLaunchKernelEx) X(cuLaunchCooperativeKernel) X(cuGraphLaunch) X(cuStreamCreate)        \
    X(cuStreamSynchronize) X(cuStreamBeginCapture) X(cuStreamEndCapture)                       \
    X(cuGraphInstantiate) X(cuEventCreate) X(cuEventRecord) X(cuEventSynchronize)              \
    X(cuEventElapsedTime) X(cuMemAlloc) X(cuMemAllocPitch) X(cuMemAllocManaged)                \
    X(cuMemAllocAsync) X(cuMemCreate) X(cuMemRelease) X(cuMemFree) X(cuMemGetInfo)             \
    X(cuMemcpyDtoH) X(cuMemFreeAsync) X(cuMemAllocFromPoolAsync) X(cuMemPoolCreate)            \
    X(cuMemAddressReserve) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuIpcGetMemHandle)    \
    X(cuIpcOpenMemHandle) X(cuIpcCloseMemHandle) X(cuMemcpyHtoD) X(cuArrayCreate)             \
    X(cuArray3DCreate) X(cuMipmappedArrayCreate) X(cuArrayDestroy) X(cuMipmappedArrayDestroy)  \
    X(cuGraphCreate) X(cuGraphAddMemAllocNode) X(cuGraphAddNode_v2) X(cuMemPoolSetAttribute)   \
    X(cuMemPoolTrimTo) X(cuDeviceGetMemPool) X(cuGraphGetNodes)                               \
    X(cuGraphExecKernelNodeSetParams) X(cuGraphExecUpdate) X(cuGraphExecDestroy)

/* The legacy (pre-3.2, 32-bit) entry points, by their exported names. */
CUresult legacy_cuMemAlloc(unsigned int *dptr, unsigned int bytes) __asm__("cuMemAlloc");
CUresult legacy_cuMemAllocPitch(unsigned int *dptr, unsigned int *pitch, unsigned int width,
                                unsigned int height, unsigned int element)
    __asm__("cuMemAllocPitch");
CUresult legacy_cuMemFree(unsigned int dptr) __asm__("cuMemFree");
CUresult legacy_cuArrayCreate(CUarray *handle, const void *desc) __asm__("cuArrayCreate");
static struct {
    __typeof__(&legacy_cuMemAlloc) alloc;
    __typeof__(&legacy_cuMemAllocPitch) pitch;
    __typeof__(&legacy_cuMemFree) free;
    __typeof__(&legacy_cuArrayCreate) array;
} L;

static struct {
#define FIELD(name) __typeof__(&name) name;
    API(FIELD)
#undef FIELD
} D;

static const char *const NAMES[] = {
#define NAME(name) #name,
    API(NAME)
#undef NAME
};

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void resolve_direct(int ptds) {
#define DIRECT(name) D.name = name;
    API(DIRECT)
#undef DIRECT
    L.alloc = legacy_cuMemAlloc;
    L.pitch = legacy_cuMemAllocPitch;
    L.free = legacy_cuMemFree;
    L.array = legacy_cuArrayCreate;
    if (ptds) {
        D.cuLaunchKernel = cuLaunchKernel_ptsz;
        D.cuLaunchKernelEx = cuLaunchKernelEx_ptsz;
        D.cuLaunchCooperativeKernel = cuLaunchCooperativeKernel_ptsz;
        D.cuGraphLaunch = cuGraphLaunch_ptsz;
        D.cuStreamSynchronize = cuStreamSynchronize_ptsz;
        D.cuStreamBeginCapture = cuStreamBeginCapture_v2_ptsz;
        D.cuStreamEndCapture = cuStreamEndCapture_ptsz;
        D.cuEventRecord = cuEventRecord_ptsz;
        D.cuMemAllocAsync = cuMemAllocAsync_ptsz;
        D.cuMemAllocFromPoolAsync = cuMemAllocFromPoolAsync_ptsz;
        D.cuMemFreeAsync = cuMemFreeAsync_ptsz;
        D.cuMemcpyDtoH = cuMemcpyDtoH_v2_ptds;
    }
}

/* cudart's way: only cuGetProcAddress_v2 comes from dlsym; the rest from it. */
static int resolve_proc(int ptds) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == NULL) {
        printf("resolve error dlopen %s\n", dlerror());
        return -1;
    }
    __typeof__(&cuGetProcAddress_v2) gpa = dlsym(lib, "cuGetProcAddress_v2");
    if (gpa == NULL) {
        printf("resolve error no cuGetProcAddress_v2\n");
        return -1;
    }
    cuuint64_t flags = ptds ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                            : CU_GET_PROC_ADDRESS_LEGACY_STREAM;
    void *self = NULL;
    CUdriverProcAddressQueryResult status;
    if (gpa("cuGetProcAddress", &self, CUDA_VERSION, flags, &status) != CUDA_SUCCESS || !self) {
        printf("resolve error cuGetProcAddress\n");
        return -1;
    }
    printf("resolve cuGetProcAddress %s\n", self == (void *)gpa ? "same" : "different");
    gpa = (__typeof__(gpa))self;
    void **slots = (void **)&D;
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++) {
        /* cudart asks by base name: strip the _v2 that cuda.h's macros added. */
        char name[128];
        snprintf(name, sizeof name, "%s", NAMES[i]);
        if (strcmp(name, "cuGraphInstantiate") == 0) snprintf(name, sizeof name, "%s",
                                                              "cuGraphInstantiateWithFlags");
        if (strcmp(name, "cuGraphAddNode_v2") == 0) snprintf(name, sizeof name, "cuGraphAddNode");
        if (strcmp(name, "cuGraphExecKernelNodeSetParams_v2") == 0)
            snprintf(name, sizeof name, "cuGraphExecKernelNodeSetParams");
        if (strcmp(name, "cuGraphExecUpdate_v2") == 0)
            snprintf(name, sizeof name, "cuGraphExecUpdate");
        slots[i] = NULL;
        CUresult r = gpa(name, &slots[i], CUDA_VERSION, flags, &status);
        if (r != CUDA_SUCCESS) printf("resolve missing %s %d\n", name, (int)r);
    }
    /* A program built against a pre-3.2 cuda.h asks with its old version. */
    gpa("cuMemAlloc", (void **)&L.alloc, 2000, flags, &status);
    gpa("cuMemAllocPitch", (void **)&L.pitch, 2000, flags, &status);
    gpa("cuMemFree", (void **)&L.free, 2000, flags, &status);
    gpa("cuArrayCreate", (void **)&L.array, 2000, flags, &status);
    return 0;
}

#define MAX_FUNCS 64
static struct {
    char name[128];
    CUfunction f;
} g_funcs[MAX_FUNCS];
static int g_func_count;
static CUmodule g_module;
static CUlibrary g_library;
static CUstream g_stream;
static CUgraph g_graph;    /* the last captured graph */
static CUgraphExec g_exec; /* its executable */

enum { A_POINTER, A_HANDLE, A_ASYNC, A_VMM, A_ARRAY, A_MIPMAP, A_LEGACY };

typedef struct {
    int kind;
    uint64_t value;   /* device pointer, or handle */
    uint64_t address; /* A_VMM: where it is mapped */
    uint64_t size;    /* A_VMM: the mapping's size */
    int released;     /* A_VMM: the handle was released */
} allocation;
static CUmemoryPool g_pool;
static CUdeviceptr g_opened[64];
static int g_opened_count;
static allocation g_allocs[256];
static int g_alloc_count;

static CUfunction find(const char *name) {
    for (int i = 0; i < g_func_count; i++)
        if (strcmp(g_funcs[i].name, name) == 0) return g_funcs[i].f;
    return NULL;
}

/* "a:100,b:200" -> "a 100\nb 200\n" */
static char *image_from(const char *spec) {
    char *image = calloc(1, strlen(spec) * 2 + 8), *out = image;
    for (const char *p = spec; *p; p++) *out++ = *p == ',' ? '\n' : *p == ':' ? ' ' : *p;
    *out++ = '\n';
    return image;
}

static void add_names(const char *spec, int library) {
    char *copy = strdup(spec), *save = NULL;
    char *image = image_from(spec);
    CUresult r = library ? D.cuLibraryLoadData(&g_library, image, NULL, NULL, 0, NULL, NULL, 0)
                         : D.cuModuleLoadData(&g_module, image);
    printf("%s rc=%d\n", library ? "library" : "module", (int)r);
    for (char *item = strtok_r(copy, ",", &save); item && r == CUDA_SUCCESS;
         item = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(item, ':');
        if (colon) *colon = 0;
        if (g_func_count == MAX_FUNCS) break;
        CUfunction f = NULL;
        CUresult got;
        if (library) {
            CUkernel k = NULL;
            got = D.cuLibraryGetKernel(&k, g_library, item);
            if (got == CUDA_SUCCESS) got = D.cuKernelGetFunction(&f, k);
        } else {
            got = D.cuModuleGetFunction(&f, g_module, item);
        }
        if (got != CUDA_SUCCESS) printf("function %s rc=%d\n", item, (int)got);
        else printf("function %s handle=%p\n", item, (void *)f);
        snprintf(g_funcs[g_func_count].name, sizeof g_funcs[0].name, "%s", item);
        g_funcs[g_func_count++].f = f;
    }
    free(copy);
    free(image);
}

static CUresult launch_one(const char *kind, CUfunction f, unsigned d[6]) {
    if (strcmp(kind, "ex") == 0) {
        if (D.cuLaunchKernelEx == NULL) return CUDA_ERROR_NOT_FOUND;
        CUlaunchConfig c = {.gridDimX = d[0], .gridDimY = d[1], .gridDimZ = d[2],
                            .blockDimX = d[3], .blockDimY = d[4], .blockDimZ = d[5],
                            .hStream = g_stream};
        return D.cuLaunchKernelEx(&c, f, NULL, NULL);
    }
    if (strcmp(kind, "coop") == 0)
        return D.cuLaunchCooperativeKernel(f, d[0], d[1], d[2], d[3], d[4], d[5], 0, g_stream,
                                           NULL);
    return D.cuLaunchKernel(f, d[0], d[1], d[2], d[3], d[4], d[5], 0, g_stream, NULL, NULL);
}

static volatile sig_atomic_t g_checkpoint_asked;

static void ask_checkpoint(int sig) {
    (void)sig;
    g_checkpoint_asked = 1;
}

/* A mini-batch every `period` ns: sleep until `next` (a loop stalled past a period, as a
 * suspended one is, starts its schedule again); returns when the one after is due. */
static uint64_t pace(uint64_t next, uint64_t period) {
    uint64_t now = now_ns();
    if (now < next) {
        struct timespec t = {(time_t)((next - now) / 1000000000u), (long)((next - now) % 1000000000u)};
        nanosleep(&t, NULL);
    } else if (now - next > period) {
        next = now;
    }
    return next + period;
}

/* The `train` op: returns the number of failed mini-batches. */
static long train(long steps, long period_us, int layers, size_t bytes, const char *name) {
    CUfunction f = find(name);
    unsigned d[6] = {1, 1, 1, 1, 1, 1};
    CUdeviceptr act[64];
    if (layers < 1 || layers > 64) layers = 64;
    long done = 0, failed = 0, first = 0;
    const char *state = getenv("CUDART_LIKE_TRAIN_STATE");
    if (state != NULL && state[0] != '\0') {
        FILE *saved = fopen(state, "r");
        if (saved != NULL) {
            if (fscanf(saved, "%ld", &first) != 1 || first < 0) first = 0;
            fclose(saved);
        }
        struct sigaction on_usr1;
        memset(&on_usr1, 0, sizeof on_usr1);
        on_usr1.sa_handler = ask_checkpoint;
        sigemptyset(&on_usr1.sa_mask);
        sigaction(SIGUSR1, &on_usr1, NULL);
        printf("train start step=%ld\n", first);
        fflush(stdout);
    }
    uint64_t period = (uint64_t)period_us * 1000u, next = now_ns();
    for (long step = first; step < steps; step++) {
        if (g_checkpoint_asked) {
            FILE *saved = fopen(state, "w");
            if (saved == NULL || fprintf(saved, "%ld\n", step) < 0 || fclose(saved) != 0) {
                fprintf(stderr, "cudart_like: cannot save the checkpoint to %s\n", state);
                return failed + 1;
            }
            printf("train checkpoint step=%ld\n", step);
            break;
        }
        next = pace(next, period);
        uint64_t began = now_ns();
        int ok = 1, held = 0;
        for (int l = 0; l < layers; l++) {
            if (D.cuMemAlloc(&act[l], bytes) != CUDA_SUCCESS) {
                ok = 0;
                break;
            }
            held++;
            if (launch_one("kernel", f, d) != CUDA_SUCCESS) ok = 0;
            if (D.cuStreamSynchronize(g_stream) != CUDA_SUCCESS) ok = 0;
        }
        for (int l = held - 1; l >= 0; l--) {
            if (launch_one("kernel", f, d) != CUDA_SUCCESS) ok = 0;
            if (D.cuStreamSynchronize(g_stream) != CUDA_SUCCESS) ok = 0;
            if (D.cuMemFree(act[l]) != CUDA_SUCCESS) ok = 0;
        }
        if (D.cuCtxSynchronize() != CUDA_SUCCESS) ok = 0;
        if (ok) done++;
        else failed++;
        printf("train step %ld t=%llu\n", step, (unsigned long long)began);
        fflush(stdout);
    }
    printf("train minibatches=%ld done=%ld failed=%ld\n", steps, done, failed);
    return failed;
}

static unsigned char pattern_byte(int layer, uint64_t offset) {
    return (unsigned char)(layer * 31 + (offset >> 12) * 7 + (offset & 0xff));
}

/* The `steady` op: a training loop that allocates once and reuses (as PyTorch's caching
 * allocator does); returns the failed or corrupt mini-batches. */
static long steady(long steps, long period_us, int layers, size_t bytes, char *names) {
    CUfunction kernels[3] = {NULL, NULL, NULL};
    int count = 0;
    for (char *save = NULL, *name = strtok_r(names, ",", &save); name && count < 3;
         name = strtok_r(NULL, ",", &save))
        kernels[count++] = find(name);
    if (layers < 1 || layers > 64 || count == 0 || bytes < 8) {
        fprintf(stderr, "steady needs 1..64 layers, 8+ bytes and a kernel\n");
        return 1;
    }
    for (int k = count; k < 3; k++) kernels[k] = kernels[0];
    CUdeviceptr buffer[64], counter = 0;
    unsigned char *host = malloc(bytes), *back = malloc(bytes);
    long failed = 0, corrupt = 0, done = 0;
    for (int l = 0; l < layers; l++) {
        for (uint64_t o = 0; o < bytes; o++) host[o] = pattern_byte(l, o);
        if (D.cuMemAlloc(&buffer[l], bytes) != CUDA_SUCCESS ||
            D.cuMemcpyHtoD(buffer[l], host, bytes) != CUDA_SUCCESS) {
            fprintf(stderr, "steady: cannot allocate layer %d\n", l);
            return 1;
        }
    }
    const char *each = getenv("CUDART_LIKE_SYNC_EACH");
    int sync_each = each != NULL && strcmp(each, "1") == 0;
    uint64_t expected = 0;
    if (D.cuMemAlloc(&counter, sizeof expected) != CUDA_SUCCESS ||
        D.cuMemcpyHtoD(counter, &expected, sizeof expected) != CUDA_SUCCESS)
        return 1;
    printf("steady allocated bytes=%llu\n", (unsigned long long)(bytes * layers + 8));
    fflush(stdout);
    unsigned d[6] = {1, 1, 1, 1, 1, 1};
    uint64_t period = (uint64_t)period_us * 1000u, next = now_ns();
    for (long step = 0; step < steps; step++) {
        next = pace(next, period);
        uint64_t began = now_ns();
        int ok = 1;
        for (int l = 0; l < layers; l++) {
            ok &= launch_one("kernel", kernels[0], d) == CUDA_SUCCESS;
            if (sync_each) ok &= D.cuStreamSynchronize(g_stream) == CUDA_SUCCESS;
        }
        for (int l = layers - 1; l >= 0; l--) {
            ok &= launch_one("kernel", kernels[1], d) == CUDA_SUCCESS;
            if (sync_each) ok &= D.cuStreamSynchronize(g_stream) == CUDA_SUCCESS;
        }
        ok &= launch_one("kernel", kernels[2], d) == CUDA_SUCCESS;
        ok &= D.cuStreamSynchronize(g_stream) == CUDA_SUCCESS;
        uint64_t seen = UINT64_MAX;
        ok &= D.cuMemcpyDtoH(&seen, counter, sizeof seen) == CUDA_SUCCESS;
        if (seen != expected) corrupt++; /* a step lost, repeated or its state damaged */
        expected = (uint64_t)step + 1;
        ok &= D.cuMemcpyHtoD(counter, &expected, sizeof expected) == CUDA_SUCCESS;
        if (ok) done++;
        else failed++;
        printf("steady step %ld t=%llu\n", step, (unsigned long long)began);
        fflush(stdout);
    }
    long damaged = 0;
    for (int l = 0; l < layers; l++) {
        if (D.cuMemcpyDtoH(back, buffer[l], bytes) != CUDA_SUCCESS) {
            damaged++;
            continue;
        }
        for (uint64_t o = 0; o < bytes; o++)
            if (back[o] != pattern_byte(l, o)) {
                damaged++;
                break;
            }
        D.cuMemFree(buffer[l]);
    }
    D.cuMemFree(counter);
    free(host);
    free(back);
    printf("steady minibatches=%ld done=%ld failed=%ld corrupt=%ld damaged_layers=%ld\n", steps,
           done, failed, corrupt, damaged);
    return failed + corrupt + damaged;
}

static CUresult alloc(const char *kind, size_t bytes) {
    CUdeviceptr p = 0, address = 0;
    CUresult r;
    int handle = A_POINTER;
    if (strcmp(kind, "pitch") == 0) {
        size_t pitch = 0;
        r = D.cuMemAllocPitch(&p, &pitch, bytes / 64, 64, 4);
    } else if (strcmp(kind, "managed") == 0) {
        r = D.cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL);
    } else if (strcmp(kind, "async") == 0) {
        r = D.cuMemAllocAsync(&p, bytes, g_stream);
        handle = A_ASYNC;
    } else if (strcmp(kind, "pool") == 0) {
        CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
        r = g_pool ? CUDA_SUCCESS : D.cuMemPoolCreate(&g_pool, &props);
        if (r == CUDA_SUCCESS) r = D.cuMemAllocFromPoolAsync(&p, bytes, g_pool, g_stream);
        handle = A_ASYNC;
    } else if (strcmp(kind, "vmm") == 0) {
        CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
        CUmemAccessDesc access = {.location = prop.location,
                                  .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        CUmemGenericAllocationHandle h = 0;
        r = D.cuMemCreate(&h, bytes, &prop, 0);
        if (r == CUDA_SUCCESS) {
            CUresult m = D.cuMemAddressReserve(&address, bytes, 0, 0, 0);
            if (m == CUDA_SUCCESS) m = D.cuMemMap(address, bytes, 0, h, 0);
            if (m == CUDA_SUCCESS) m = D.cuMemSetAccess(address, bytes, &access, 1);
            if (m != CUDA_SUCCESS) printf("vmm map rc=%d\n", (int)m);
        }
        p = h;
        handle = A_VMM;
    } else if (strcmp(kind, "create") == 0) {
        CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
        CUmemGenericAllocationHandle h = 0;
        r = D.cuMemCreate(&h, bytes, &prop, 0);
        p = h;
        handle = A_HANDLE;
    } else if (strcmp(kind, "array") == 0 || strcmp(kind, "legacyarray") == 0) {
        /* rows of 1,000 floats: 4,000 bytes, padded to 4,096 by the fake */
        CUarray a = NULL;
        if (kind[0] == 'l') {
            struct { unsigned w, h; CUarray_format f; unsigned c; } d1 = {
                1000, (unsigned)(bytes / 4096), CU_AD_FORMAT_FLOAT, 1};
            r = L.array ? L.array(&a, &d1) : CUDA_ERROR_NOT_FOUND;
        } else {
            CUDA_ARRAY_DESCRIPTOR d = {.Width = 1000, .Height = bytes / 4096,
                                       .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
            r = D.cuArrayCreate(&a, &d);
        }
        p = (CUdeviceptr)(uintptr_t)a;
        handle = A_ARRAY;
    } else if (strcmp(kind, "array3d") == 0 || strcmp(kind, "mipmap") == 0) {
        CUDA_ARRAY3D_DESCRIPTOR d = {.Width = 1000, .Height = 64, .Depth = bytes / (4096 * 64),
                                     .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
        if (kind[0] == 'm') {
            CUmipmappedArray m = NULL;
            r = D.cuMipmappedArrayCreate(&m, &d, 1);
            p = (CUdeviceptr)(uintptr_t)m;
            handle = A_MIPMAP;
        } else {
            CUarray a = NULL;
            r = D.cuArray3DCreate(&a, &d);
            p = (CUdeviceptr)(uintptr_t)a;
            handle = A_ARRAY;
        }
    } else if (strcmp(kind, "graphnode") == 0 || strcmp(kind, "addnode") == 0) {
        /* an explicit graph's memory node; the pointer is freed with cuMemFree */
        CUgraph graph = NULL;
        CUgraphNode node = NULL;
        r = D.cuGraphCreate(&graph, 0);
        CUDA_MEM_ALLOC_NODE_PARAMS params = {
            .poolProps = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                          .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}},
            .bytesize = bytes};
        if (r == CUDA_SUCCESS && kind[0] == 'g') {
            r = D.cuGraphAddMemAllocNode(&node, graph, NULL, 0, &params);
            p = params.dptr;
        } else if (r == CUDA_SUCCESS) {
            CUgraphNodeParams np;
            memset(&np, 0, sizeof np);
            np.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
            np.alloc.poolProps = params.poolProps;
            np.alloc.bytesize = bytes;
            r = D.cuGraphAddNode_v2(&node, graph, NULL, NULL, 0, &np);
            p = np.alloc.dptr;
        }
    } else if (strcmp(kind, "legacy") == 0 || strcmp(kind, "legacypitch") == 0) {
        unsigned int p32 = 0, pitch = 0;
        if (kind[6] == 'p')
            r = L.pitch ? L.pitch(&p32, &pitch, (unsigned)(bytes / 64), 64, 4)
                        : CUDA_ERROR_NOT_FOUND;
        else
            r = L.alloc ? L.alloc(&p32, (unsigned)bytes) : CUDA_ERROR_NOT_FOUND;
        p = p32;
        handle = A_LEGACY;
    } else {
        r = D.cuMemAlloc(&p, bytes);
    }
    if (r == CUDA_SUCCESS && g_alloc_count < 256)
        g_allocs[g_alloc_count++] = (allocation){handle, p, address, bytes, 0};
    return r;
}

/* NVML as pynvml reaches it: dlopen, then dlsym of each function. */
static void nvml_query(void) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (lib == NULL) {
        printf("nvml error dlopen %s\n", dlerror());
        return;
    }
    int (*init)(void) = (int (*)(void))dlsym(lib, "nvmlInit_v2");
    int (*get)(unsigned, nvmlDevice_t *) =
        (int (*)(unsigned, nvmlDevice_t *))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    __typeof__(&nvmlDeviceGetMemoryInfo) info = dlsym(lib, "nvmlDeviceGetMemoryInfo");
    __typeof__(&nvmlDeviceGetMemoryInfo_v2) info2 = dlsym(lib, "nvmlDeviceGetMemoryInfo_v2");
    nvmlDevice_t device = NULL;
    if (!init || !get || !info || !info2 || init() != 0 || get(0, &device) != 0) {
        printf("nvml error setup\n");
        return;
    }
    nvmlMemory_t m = {0};
    int r = info(device, &m);
    printf("nvml rc=%d free=%llu total=%llu used=%llu\n", r, m.free, m.total, m.used);
    nvmlMemory_v2_t m2 = {.version = nvmlMemory_v2};
    r = info2(device, &m2);
    printf("nvml_v2 rc=%d free=%llu total=%llu used=%llu reserved=%llu\n", r, m2.free, m2.total,
           m2.used, m2.reserved);
    nvmlDevice_t other = NULL;
    if (get(1, &other) == 0) {
        nvmlMemory_t o = {0};
        r = info(other, &o);
        printf("nvml_other rc=%d free=%llu total=%llu used=%llu\n", r, o.free, o.total, o.used);
    }
}

#define PEEK_BYTES 4096

static void fill(const char *op, CUdeviceptr p, int value) {
    unsigned char buffer[PEEK_BYTES];
    memset(buffer, value, sizeof buffer);
    CUresult r = p ? D.cuMemcpyHtoD(p, buffer, sizeof buffer) : CUDA_ERROR_INVALID_VALUE;
    printf("%s rc=%d\n", op, (int)r);
}

/* Prints the first byte and whether all 4 KiB are equal to it. */
static void peek(const char *op, CUdeviceptr p) {
    unsigned char buffer[PEEK_BYTES];
    CUresult r = p ? D.cuMemcpyDtoH(buffer, p, sizeof buffer) : CUDA_ERROR_INVALID_VALUE;
    int same = 1;
    for (size_t k = 1; k < sizeof buffer; k++) same &= buffer[k] == buffer[0];
    printf("%s rc=%d first=%d uniform=%d\n", op, (int)r, r == CUDA_SUCCESS ? buffer[0] : -1,
           same);
}

static int compare_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static void sleep_us(long us) {
    struct timespec pause = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
    if (us > 0) nanosleep(&pause, NULL);
}

/* Inference-like requests: a fixed kernel list, each kernel waited for, host work between. */
static int infer(long requests, long pause_us, long gap_us, char *names) {
    CUfunction kernels[64];
    int count = 0;
    for (char *save = NULL, *name = strtok_r(names, ",", &save); name && count < 64;
         name = strtok_r(NULL, ",", &save))
        kernels[count++] = find(name);
    if (requests <= 0 || count == 0) {
        fprintf(stderr, "infer needs N > 0 and at least one kernel\n");
        return 1;
    }
    uint64_t *latency = calloc((size_t)requests, sizeof *latency);
    unsigned d[6] = {1, 1, 1, 1, 1, 1};
    long failures = 0;
    double total = 0;
    uint64_t began = now_ns();
    for (long r = 0; r < requests; r++) {
        uint64_t t0 = now_ns();
        for (int k = 0; k < count; k++) {
            if (launch_one("kernel", kernels[k], d) != CUDA_SUCCESS) failures++;
            D.cuStreamSynchronize(g_stream);
            if (k + 1 < count) sleep_us(gap_us);
        }
        latency[r] = now_ns() - t0;
        total += (double)latency[r];
        sleep_us(pause_us);
    }
    qsort(latency, (size_t)requests, sizeof *latency, compare_u64);
    long p99 = (long)(0.99 * (double)(requests - 1) + 0.5);
    printf("infer requests=%ld failures=%ld mean_ms=%.4f p50_ms=%.4f p99_ms=%.4f\n", requests,
           failures, total / (double)requests / 1e6, latency[(requests - 1) / 2] / 1e6,
           latency[p99] / 1e6);
    printf("{\"requests_per_s\": %.3f, \"p50_latency_ms\": %.4f, \"p99_latency_ms\": %.4f}\n",
           (double)requests / ((double)(now_ns() - began) / 1e9), latency[(requests - 1) / 2] / 1e6,
           latency[p99] / 1e6);
    free(latency);
    return failures ? 1 : 0;
}

int main(int argc, char **argv) {
    int proc = 0, ptds = 0, i = 1, failed = 0;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (strcmp(argv[i], "--proc") == 0) proc = 1;
        else if (strcmp(argv[i], "--ptds") == 0) ptds = 1;
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (proc) {
        if (resolve_proc(ptds) != 0) return 1;
    } else {
        resolve_direct(ptds);
    }
    CUresult r = D.cuInit(0);
    printf("init rc=%d pid=%d\n", (int)r, (int)getpid());
    fflush(stdout); /* a test may act on the pid while the ops run */
    if (r != CUDA_SUCCESS) return 1;
    CUdevice device;
    CUcontext context;
    D.cuDeviceGet(&device, 0);
    D.cuCtxCreate(&context, 0, device);
#define NEED(n)                                          \
    if (i + (n) >= argc) {                               \
        fprintf(stderr, "%s needs %d arguments\n", op, n); \
        return 2;                                        \
    }
    for (; i < argc; i++) {
        const char *op = argv[i];
        if (strcmp(op, "module") == 0 || strcmp(op, "library") == 0) {
            NEED(1);
            add_names(argv[++i], op[0] == 'l');
        } else if (strcmp(op, "unload") == 0) {
            printf("unload rc=%d\n", (int)D.cuModuleUnload(g_module));
        } else if (strcmp(op, "unloadlib") == 0) {
            printf("unloadlib rc=%d\n", (int)D.cuLibraryUnload(g_library));
        } else if (strcmp(op, "stream") == 0) {
            printf("stream rc=%d\n", (int)D.cuStreamCreate(&g_stream, 0));
        } else if (strcmp(op, "launch") == 0) {
            NEED(9);
            const char *kind = argv[i + 1], *name = argv[i + 2];
            long count = atol(argv[i + 3]);
            unsigned d[6];
            for (int k = 0; k < 6; k++) d[k] = (unsigned)atol(argv[i + 4 + k]);
            i += 9;
            CUresult last = CUDA_SUCCESS;
            for (long n = 0; n < count; n++) {
                last = launch_one(kind, find(name), d);
                if (last != CUDA_SUCCESS) break;
            }
            printf("launch %s %s rc=%d\n", kind, name, (int)last);
            if (last != CUDA_SUCCESS) failed = 1;
        } else if (strcmp(op, "loop") == 0) {
            NEED(3);
            double seconds = atof(argv[i + 1]);
            CUfunction f = find(argv[i + 2]);
            long every = atol(argv[i + 3]);
            i += 3;
            unsigned d[6] = {1, 1, 1, 1, 1, 1};
            uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9), worst = 0;
            long launches = 0;
            CUresult last = CUDA_SUCCESS;
            while (now_ns() < stop) {
                uint64_t t0 = now_ns();
                last = launch_one("kernel", f, d);
                uint64_t took = now_ns() - t0;
                if (took > worst) worst = took;
                if (last != CUDA_SUCCESS) break;
                if (++launches % (every > 0 ? every : 1) == 0) D.cuStreamSynchronize(g_stream);
            }
            D.cuStreamSynchronize(g_stream);
            printf("loop launches=%ld rc=%d max_launch_ms=%.3f\n", launches, (int)last,
                   worst / 1e6);
            if (last != CUDA_SUCCESS) {
                fprintf(stderr, "cudart_like: launch failed with CUresult %d\n", (int)last);
                failed = 1;
            }
        } else if (strcmp(op, "train") == 0 || strcmp(op, "steady") == 0) {
            NEED(5); /* steps period_us layers bytes kernel(s) */
            long steps = atol(argv[i + 1]), period_us = atol(argv[i + 2]);
            int layers = atoi(argv[i + 3]);
            size_t bytes = (size_t)strtoull(argv[i + 4], NULL, 10);
            if ((op[0] == 't' ? train(steps, period_us, layers, bytes, argv[i + 5])
                              : steady(steps, period_us, layers, bytes, argv[i + 5])) != 0)
                failed = 1;
            i += 5;
        } else if (strcmp(op, "infer") == 0) {
            NEED(4);
            if (infer(atol(argv[i + 1]), atol(argv[i + 2]), atol(argv[i + 3]), argv[i + 4]) != 0)
                failed = 1;
            i += 4;
        } else if (strcmp(op, "burst") == 0) {
            NEED(2);
            CUfunction f = find(argv[i + 1]);
            long count = atol(argv[i + 2]), n = 0;
            i += 2;
            unsigned d[6] = {1, 1, 1, 1, 1, 1};
            uint64_t begin = now_ns(), worst = 0;
            CUresult last = CUDA_SUCCESS;
            for (; n < count; n++) {
                uint64_t t0 = now_ns();
                last = launch_one("kernel", f, d);
                uint64_t took = now_ns() - t0;
                if (took > worst) worst = took;
                if (last != CUDA_SUCCESS) break;
            }
            printf("burst launches=%ld rc=%d launch_ms=%.3f max_launch_ms=%.3f\n", n, (int)last,
                   (now_ns() - begin) / 1e6, worst / 1e6);
            if (last != CUDA_SUCCESS) failed = 1;
        } else if (strcmp(op, "sleep") == 0) {
            NEED(1);
            long us = atol(argv[++i]);
            struct timespec pause = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
            nanosleep(&pause, NULL);
        } else if (strcmp(op, "sync") == 0) {
            printf("sync rc=%d\n", (int)D.cuCtxSynchronize());
        } else if (strcmp(op, "ssync") == 0) {
            printf("ssync rc=%d\n", (int)D.cuStreamSynchronize(g_stream));
        } else if (strcmp(op, "esync") == 0) {
            CUevent e;
            D.cuEventCreate(&e, 0);
            D.cuEventRecord(e, g_stream);
            printf("esync rc=%d\n", (int)D.cuEventSynchronize(e));
        } else if (strcmp(op, "dtoh") == 0) {
            char buffer[16];
            CUdeviceptr p = 0;
            if (D.cuMemAlloc(&p, sizeof buffer) == CUDA_SUCCESS)
                g_allocs[g_alloc_count++] = (allocation){A_POINTER, p, 0, 0, 0};
            printf("dtoh rc=%d\n", (int)D.cuMemcpyDtoH(buffer, p, sizeof buffer));
        } else if (strcmp(op, "alloc") == 0) {
            NEED(2);
            const char *kind = argv[i + 1];
            unsigned long long bytes = strtoull(argv[i + 2], NULL, 10);
            i += 2;
            printf("alloc %s %llu rc=%d\n", kind, bytes, (int)alloc(kind, bytes));
        } else if (strcmp(op, "freeall") == 0) {
            int bad = 0;
            for (int k = 0; k < g_alloc_count; k++) {
                allocation *a = &g_allocs[k];
                if (a->kind == A_VMM) {
                    bad |= D.cuMemUnmap(a->address, a->size) != CUDA_SUCCESS;
                    if (!a->released) bad |= D.cuMemRelease(a->value) != CUDA_SUCCESS;
                } else if (a->kind == A_HANDLE) {
                    bad |= D.cuMemRelease(a->value) != CUDA_SUCCESS;
                } else if (a->kind == A_ARRAY) {
                    bad |= D.cuArrayDestroy((CUarray)(uintptr_t)a->value) != CUDA_SUCCESS;
                } else if (a->kind == A_MIPMAP) {
                    bad |= D.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)a->value) !=
                           CUDA_SUCCESS;
                } else if (a->kind == A_LEGACY) {
                    bad |= L.free((unsigned int)a->value) != CUDA_SUCCESS;
                } else if (a->kind == A_ASYNC) {
                    bad |= D.cuMemFreeAsync(a->value, g_stream) != CUDA_SUCCESS;
                } else {
                    bad |= D.cuMemFree(a->value) != CUDA_SUCCESS;
                }
            }
            g_alloc_count = 0;
            printf("freeall rc=%d\n", bad);
        } else if (strcmp(op, "poolthreshold") == 0 || strcmp(op, "pooltrim") == 0 ||
                   strcmp(op, "defaultthreshold") == 0) {
            /* the release threshold (or a trim) of the pool `alloc pool` uses, or of the
             * device's current pool (the one cuMemAllocAsync uses) */
            NEED(1);
            cuuint64_t value = strtoull(argv[++i], NULL, 10);
            CUmemoryPool pool = g_pool;
            CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                                    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
            r = CUDA_SUCCESS;
            if (op[0] == 'd') r = D.cuDeviceGetMemPool(&pool, 0);
            else if (!pool) r = D.cuMemPoolCreate(&g_pool, &props), pool = g_pool;
            if (r == CUDA_SUCCESS)
                r = strcmp(op, "pooltrim") == 0 ? D.cuMemPoolTrimTo(pool, (size_t)value)
                                 : D.cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                                           &value);
            printf("%s %llu rc=%d\n", op, (unsigned long long)value, (int)r);
        } else if (strcmp(op, "freelast") == 0) {
            /* free the last allocation (a pointer: cuMemFree, async: cuMemFreeAsync) */
            r = CUDA_ERROR_INVALID_VALUE;
            if (g_alloc_count > 0) {
                allocation *a = &g_allocs[--g_alloc_count];
                r = a->kind == A_ASYNC ? D.cuMemFreeAsync(a->value, g_stream) : D.cuMemFree(a->value);
            }
            printf("freelast rc=%d\n", (int)r);
        } else if (strcmp(op, "freeagain") == 0) {
            /* free the pointer freelast freed, again (a double free) */
            r = D.cuMemFree(g_allocs[g_alloc_count].value);
            printf("freeagain rc=%d\n", (int)r);
        } else if (strcmp(op, "vmmrelease") == 0) {
            int bad = 0;
            for (int k = 0; k < g_alloc_count; k++)
                if (g_allocs[k].kind == A_VMM && !g_allocs[k].released) {
                    bad |= D.cuMemRelease(g_allocs[k].value) != CUDA_SUCCESS;
                    g_allocs[k].released = 1;
                }
            printf("vmmrelease rc=%d\n", bad);
        } else if (strcmp(op, "nvml") == 0) {
            nvml_query();
        } else if (strcmp(op, "ipcget") == 0) {
            NEED(1);
            const char *path = argv[++i];
            CUipcMemHandle handle;
            r = g_alloc_count ? D.cuIpcGetMemHandle(&handle, g_allocs[g_alloc_count - 1].value)
                              : CUDA_ERROR_INVALID_VALUE;
            FILE *f = r == CUDA_SUCCESS ? fopen(path, "wb") : NULL;
            if (f) {
                fwrite(&handle, sizeof handle, 1, f);
                fclose(f);
            }
            printf("ipcget rc=%d\n", (int)r);
        } else if (strcmp(op, "ipcopen") == 0) {
            NEED(1);
            CUipcMemHandle handle;
            FILE *f = fopen(argv[++i], "rb");
            size_t got = f ? fread(&handle, sizeof handle, 1, f) : 0;
            if (f) fclose(f);
            CUdeviceptr p = 0;
            r = got == 1 ? D.cuIpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                         : CUDA_ERROR_INVALID_VALUE;
            if (r == CUDA_SUCCESS && g_opened_count < 64) g_opened[g_opened_count++] = p;
            printf("ipcopen rc=%d\n", (int)r);
        } else if (strcmp(op, "fill") == 0 || strcmp(op, "ipcfill") == 0) {
            NEED(1);
            int ipc = op[0] == 'i';
            CUdeviceptr p = ipc ? (g_opened_count ? g_opened[g_opened_count - 1] : 0)
                                : (g_alloc_count ? g_allocs[g_alloc_count - 1].value : 0);
            fill(op, p, atoi(argv[++i]));
        } else if (strcmp(op, "peek") == 0 || strcmp(op, "ipcpeek") == 0) {
            int ipc = op[0] == 'i';
            CUdeviceptr p = ipc ? (g_opened_count ? g_opened[g_opened_count - 1] : 0)
                                : (g_alloc_count ? g_allocs[g_alloc_count - 1].value : 0);
            peek(op, p);
        } else if (strcmp(op, "waitfile") == 0) {
            NEED(1);
            const char *path = argv[++i];
            int waited = 0;
            while (access(path, F_OK) != 0 && waited++ < 6000) sleep_us(10000);
            printf("waitfile rc=%d\n", access(path, F_OK) == 0 ? 0 : 1);
        } else if (strcmp(op, "ipcclose") == 0) {
            int bad = 0;
            for (int k = 0; k < g_opened_count; k++)
                bad |= D.cuIpcCloseMemHandle(g_opened[k]) != CUDA_SUCCESS;
            g_opened_count = 0;
            printf("ipcclose rc=%d\n", bad);
        } else if (strcmp(op, "meminfo") == 0) {
            size_t free_bytes = 0, total = 0;
            r = D.cuMemGetInfo(&free_bytes, &total);
            printf("meminfo rc=%d free=%zu total=%zu\n", (int)r, free_bytes, total);
        } else if (strcmp(op, "capture") == 0) {
            NEED(2);
            CUfunction f = find(argv[i + 1]);
            long count = atol(argv[i + 2]);
            i += 2;
            unsigned d[6] = {1, 1, 1, 1, 1, 1};
            r = D.cuStreamBeginCapture(g_stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
            for (long n = 0; n < count && r == CUDA_SUCCESS; n++) r = launch_one("kernel", f, d);
            CUresult ended = D.cuStreamEndCapture(g_stream, &g_graph);
            if (r == CUDA_SUCCESS) r = ended;
            if (r == CUDA_SUCCESS) r = D.cuGraphInstantiate(&g_exec, g_graph, 0);
            printf("capture rc=%d\n", (int)r);
            if (r == CUDA_SUCCESS) printf("graph rc=%d\n", (int)D.cuGraphLaunch(g_exec, g_stream));
        } else if (strcmp(op, "glaunch") == 0) {
            printf("glaunch rc=%d\n", (int)D.cuGraphLaunch(g_exec, g_stream));
        } else if (strcmp(op, "gsetparams") == 0) {
            NEED(1);
            CUgraphNode node = NULL;
            size_t nodes = 1;
            r = D.cuGraphGetNodes(g_graph, &node, &nodes);
            CUDA_KERNEL_NODE_PARAMS params = {.func = find(argv[++i]), .gridDimX = 1,
                                              .gridDimY = 1, .gridDimZ = 1, .blockDimX = 1,
                                              .blockDimY = 1, .blockDimZ = 1};
            if (r == CUDA_SUCCESS) r = D.cuGraphExecKernelNodeSetParams(g_exec, node, &params);
            printf("gsetparams rc=%d\n", (int)r);
        } else if (strcmp(op, "gupdate") == 0) {
            CUgraphExecUpdateResultInfo info;
            printf("gupdate rc=%d\n", (int)D.cuGraphExecUpdate(g_exec, g_graph, &info));
        } else if (strcmp(op, "gdestroy") == 0) {
            printf("gdestroy rc=%d\n", (int)D.cuGraphExecDestroy(g_exec));
            g_exec = NULL;
        } else if (strcmp(op, "gloop") == 0) {
            NEED(2);
            double seconds = atof(argv[i + 1]);
            long pause_us = atol(argv[i + 2]);
            i += 2;
            uint64_t stop = now_ns() + (uint64_t)(seconds * 1e9), total = 0;
            long launches = 0;
            CUresult last = CUDA_SUCCESS;
            while (now_ns() < stop) {
                uint64_t t0 = now_ns();
                last = D.cuGraphLaunch(g_exec, g_stream);
                if (last != CUDA_SUCCESS) break;
                D.cuStreamSynchronize(g_stream);
                total += now_ns() - t0;
                launches++;
                if (pause_us > 0) sleep_us(pause_us);
            }
            printf("gloop launches=%ld rc=%d mean_ms=%.3f\n", launches, (int)last,
                   launches ? total / 1e6 / launches : 0.0);
            if (last != CUDA_SUCCESS) failed = 1;
        } else if (strcmp(op, "timed") == 0) {
            NEED(2);
            CUfunction f = find(argv[i + 1]);
            long count = atol(argv[i + 2]);
            i += 2;
            unsigned d[6] = {1, 1, 1, 1, 1, 1};
            CUevent a, b;
            D.cuEventCreate(&a, 0);
            D.cuEventCreate(&b, 0);
            D.cuEventRecord(a, g_stream);
            for (long n = 0; n < count; n++) launch_one("kernel", f, d);
            D.cuEventRecord(b, g_stream);
            D.cuEventSynchronize(b);
            float ms = 0;
            r = D.cuEventElapsedTime(&ms, a, b);
            printf("timed rc=%d ms=%.3f\n", (int)r, ms);
        } else {
            fprintf(stderr, "unknown op %s\n", op);
            return 2;
        }
        fflush(stdout);
    }
    return failed ? 3 : 0;
}
