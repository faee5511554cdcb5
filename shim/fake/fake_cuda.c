/* A fake libcuda.so.1 for testing the shim without a GPU.
 *
 * Built from the real cuda.h (prototypes and types), it implements the slice of the driver API
 * that the shim and its tests use. Kernels "run" on one engine per fake GPU shared by every
 * process: each kernel books its turn in a lock file under GPULOOM_FAKE_CUDA_DIR and sleeps
 * until its end (the times logged are an ideal GPU's: see engine_run). Launches are asynchronous
 * and stream-ordered: each stream has a worker thread that runs its queue; synchronisation
 * waits for the queue to drain. Events take the time at which
 * the work queued before them finished (the kernel's end on the engine, as logged in runs.log),
 * or the time they were recorded on an idle stream, so cuEventElapsedTime measures real time
 * and cuEventQuery answers CUDA_ERROR_NOT_READY until then.
 *
 * Kernel durations come from the module image: a text list of
 * "name duration_us [sm_need [bound]]" lines; a name listed without a duration, or ending in
 * "_<N>us" (k_sleep_250us), takes N microseconds; otherwise 100 us. `bound` is the unit the
 * kernel is bound by, compute, memory or unknown (default); another word makes the image
 * invalid.
 *
 * The partition timing model: `sm_need` (1..100, default 100) is the percentage of the GPU's
 * SMs the kernel can keep busy. A process whose CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (1..100;
 * unset or invalid: 100) is below a kernel's need runs it need/share times longer (a kernel
 * that fills the GPU takes twice as long on half of it); at or above its need it takes its
 * duration.
 *
 * Between processes, two GPUs (GPULOOM_FAKE_CUDA_MPS; give every process of a GPU the same):
 * without MPS (0 or unset) kernels of different processes take turns on the one engine, a
 * kernel at a time (a GPU time-slicing its contexts, with no preemption: a kernel longer than
 * a slice holds the engine to its end). With MPS (1) they run at once under the simulator's
 * model (engine_run_mps): SM shares, and a slowdown by the co-runners' bound classes
 * (GPULOOM_FAKE_CUDA_INTERFERENCE). Mixing the two on one GPU is not modelled: a process
 * without MPS does not see the MPS processes' kernels, nor they its.
 *
 * Environment:
 *   GPULOOM_FAKE_CUDA_DIR    directory of the engine lock and runs.log (default
 *                            /tmp/gpuloom-fake-cuda-UID); runs.log gets "run PID NAME T0 T1"
 *                            (CLOCK_MONOTONIC ns) for every kernel that ran: the ground truth.
 *   GPULOOM_FAKE_CUDA_TRACE  file that gets one line per driver entry point reached
 *                            ("fake ENTRY NAME GX GY GZ BX BY BZ" for launches).
 *   GPULOOM_FAKE_CUDA_MEM_MIB device memory (default 81920).
 *   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE  the SM share of the timing model above.
 *   GPULOOM_FAKE_CUDA_SWITCH_US  a context switch (default 0, at most 1000000): a kernel that
 *                            follows another process's on the engine starts this much later,
 *                            so processes whose kernels interleave lose time, as packed jobs
 *                            that interfere on a real GPU do.
 *   GPULOOM_FAKE_CUDA_MPS    1: the GPU runs an MPS server, kernels co-run (above); 0 or
 *                            unset: they take turns. Anything else fails cuInit.
 *   GPULOOM_FAKE_CUDA_INTERFERENCE  "SAME,OTHER,UNKNOWN": the MPS engine's interference factors
 *                            (1..100 each; default 2.5,1.5,2.0, the simulator's calibrated
 *                            ones): the slowdown beside a co-runner holding every SM, when both
 *                            are bound by the same unit, by different ones, or either is
 *                            unknown. A malformed list or a factor below 1 fails cuInit.
 *
 * Memory: every allocating entry point the shim hooks is here (pointers, pitched, managed,
 * async and pool allocations, cuMemCreate, CUDA arrays and mipmapped arrays with rows padded to
 * 512 bytes as cuArrayGetMemoryRequirements reports, graph memory nodes allocated when the node
 * is added, the legacy 32-bit entry points with addresses below 4 GiB); pools keep nothing
 * after frees whatever their release threshold (which they store and answer).
 *
 * One GPU's memory (GPULOOM_FAKE_CUDA_SHARED_MEMORY=1): the processes of one
 * GPULOOM_FAKE_CUDA_DIR share GPULOOM_FAKE_CUDA_MEM_MIB, through a ledger file there (a slot
 * per process, under flock; a dead process's slot counts nothing, as a real driver frees an
 * exited process's memory); cuMemGetInfo and the fake NVML answer the device's free memory.
 * Without it each process has the whole amount to itself (the default, for tests that run
 * unrelated processes side by side).
 *
 * The checkpoint API (cuCheckpointProcess*, the driver's "CUDA Checkpointing"), called by
 * another process with the target's pid: each process that called cuInit serves requests on a
 * control page (/dev/shm/gpuloom-fake-ckpt-PID, futex-woken) from a thread of its own, with the
 * driver's state machine: RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED
 * -unlock-> RUNNING (FAILED when a restore could not put the bytes back). Lock blocks every
 * further call that uses the GPU (launches, allocations, frees, copies, synchronisation) and
 * waits for calls in flight and queued work to finish (timeoutMs: then CUDA_ERROR_TIMEOUT, left
 * RUNNING). Checkpoint copies each allocation's written pages to host memory (a sparse memfd),
 * unmaps the device bytes and gives the process's device memory back (the ledger slot drops
 * to 0); restore takes it again (CUDA_ERROR_OUT_OF_MEMORY when the GPU has no room: still
 * CHECKPOINTED, restorable later) and copies every byte back to the same addresses. A request
 * in the wrong state gets CUDA_ERROR_ILLEGAL_STATE; one for a pid that is not a live CUDA
 * process of this fake, CUDA_ERROR_INVALID_VALUE. Memory another process opened through IPC
 * keeps the bytes it had at the checkpoint. GPULOOM_FAKE_CUDA_CKPT_FAIL=restore makes restores
 * fail (state FAILED).
 *
 * Several GPUs of one node (GPULOOM_FAKE_CUDA_GPUS="UUID=CHIP:MIB,..." , at most 8, UUIDs as
 * NVML writes them, GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx): each has its own memory ledger
 * (memory-UUID.ledger, shared by its processes as above) and its own engine (engine-UUID.lock);
 * a process runs on the one GPULOOM_FAKE_CUDA_GPU names (default: the first), which is its
 * device 0 (cuDeviceGetName answers its chip). A malformed list or an unknown GPU: cuInit fails
 * (CUDA_ERROR_INVALID_VALUE / CUDA_ERROR_INVALID_DEVICE) and says why on stderr. Without the
 * list there is one GPU, GPU-fa4e0000-0000-0000-0000-000000000000 (the fake NVML's device 0),
 * of GPULOOM_FAKE_CUDA_MEM_MIB. cuCheckpointProcessRestore honours the GPU pairs of CUDA 13.0's
 * CUcheckpointRestoreArgs (the layout is declared here: the cuda.h this build uses has only
 * reserved words there): the process's memory is taken on the new GPU (the old one's stays
 * given back) and it runs there from then on. A pair whose old UUID is not the process's GPU:
 * CUDA_ERROR_INVALID_VALUE; a new UUID that is not a GPU of the list, or one of another chip
 * type: CUDA_ERROR_INVALID_DEVICE; no room there: CUDA_ERROR_OUT_OF_MEMORY. Each leaves the
 * process CHECKPOINTED, restorable later (onto its own GPU or another).
 * Built with -DFAKE_MINIMAL it has no checkpoint API, like a driver older than r570.
 *
 * Built with -DFAKE_MINIMAL it lacks cuLaunchKernelEx, cuFuncGetName and cuKernelGetName, like
 * an older driver.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gl_cuda.h"
#include "gl_cuda_legacy.h"

#define EXPORT __attribute__((visibility("default")))

/* ---- time, trace, engine ---- */

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER; /* broadcast on every completion */
static int g_inited;
static int g_trace_fd = -1;
static int g_runs_fd = -1;
static int g_engine_fd = -1;
static uint64_t g_mem_total;
static uint64_t g_mem_used;
static unsigned g_sm_share = 100; /* CUDA_MPS_ACTIVE_THREAD_PERCENTAGE */
static uint64_t g_switch_us;       /* GPULOOM_FAKE_CUDA_SWITCH_US */
static int g_mps;                  /* GPULOOM_FAKE_CUDA_MPS=1: the GPU runs an MPS server */
/* GPULOOM_FAKE_CUDA_INTERFERENCE: same class, other class, either unknown (the simulator's
 * calibrated defaults, gpuloom/sim/device.py Interference). */
static double g_interference[3] = {2.5, 1.5, 2.0};
static int g_ledger_fd = -1;       /* GPULOOM_FAKE_CUDA_SHARED_MEMORY=1: the GPU's memory ledger */
static int g_fail_restore;         /* GPULOOM_FAKE_CUDA_CKPT_FAIL=restore */

/* The node's fake GPUs (GPULOOM_FAKE_CUDA_GPUS; one by default) and the one this process runs
 * on. */
#define FAKE_GPUS_MAX 8
typedef struct {
    unsigned char uuid[16];
    char chip[64];
    uint64_t total;
} fake_gpu;
static fake_gpu g_gpus[FAKE_GPUS_MAX];
static int g_gpu_count;
static int g_gpu;                /* index in g_gpus */
static int g_gpu_listed;         /* GPULOOM_FAKE_CUDA_GPUS was given */
static CUresult g_gpu_error;     /* the GPU settings were invalid: what cuInit answers */
static char g_dir[512];

static void trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void trace(const char *fmt, ...) {
    if (g_trace_fd < 0) return;
    char line[512];
    va_list args;
    va_start(args, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, args);
    va_end(args);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (write(g_trace_fd, line, (size_t)n) < 0) { /* best effort */
    }
}

/* "GPU-" and 32 hex digits (dashes between them ignored) -> 16 bytes. 0: parsed. */
static int uuid_parse(const char *text, size_t length, unsigned char out[16]) {
    if (length < 4 || strncmp(text, "GPU-", 4) != 0) return -1;
    int digits = 0;
    for (size_t i = 4; i < length; i++) {
        char c = text[i];
        if (c == '-') continue;
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (v < 0 || digits >= 32) return -1;
        if (digits % 2 == 0) out[digits / 2] = (unsigned char)(v << 4);
        else out[digits / 2] |= (unsigned char)v;
        digits++;
    }
    return digits == 32 ? 0 : -1;
}

/* 16 bytes -> GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (out: at least 41 bytes). */
static void uuid_format(const unsigned char uuid[16], char *out) {
    int n = sprintf(out, "GPU-");
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10) out[n++] = '-';
        n += sprintf(out + n, "%02x", uuid[i]);
    }
}

static int gpu_find(const unsigned char uuid[16]) {
    for (int i = 0; i < g_gpu_count; i++)
        if (memcmp(g_gpus[i].uuid, uuid, 16) == 0) return i;
    return -1;
}

static void gpu_settings_invalid(CUresult error, const char *fmt, const char *what) {
    fprintf(stderr, "gpuloom fake libcuda: ");
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\n");
    g_gpu_error = error;
}

/* GPULOOM_FAKE_CUDA_GPUS: "UUID=CHIP:MIB" entries, comma-separated. */
static void gpus_parse(const char *list) {
    g_gpu_listed = 1;
    const char *at = list;
    while (*at) {
        const char *end = strchr(at, ',');
        size_t length = end ? (size_t)(end - at) : strlen(at);
        char entry[160];
        if (length == 0 || length >= sizeof entry || g_gpu_count == FAKE_GPUS_MAX) {
            gpu_settings_invalid(CUDA_ERROR_INVALID_VALUE,
                                 "GPULOOM_FAKE_CUDA_GPUS: %s (want 1..8 UUID=CHIP:MIB entries)", list);
            return;
        }
        memcpy(entry, at, length);
        entry[length] = 0;
        char *equals = strchr(entry, '='), *colon = strrchr(entry, ':');
        fake_gpu *gpu = &g_gpus[g_gpu_count];
        char *mib_end = NULL;
        unsigned long long mib = colon ? strtoull(colon + 1, &mib_end, 10) : 0;
        if (!equals || !colon || colon < equals || colon == equals + 1 ||
            (size_t)(colon - equals - 1) >= sizeof gpu->chip || !mib_end || *mib_end || mib == 0 ||
            mib > (1ull << 24) || uuid_parse(entry, (size_t)(equals - entry), gpu->uuid) != 0 ||
            gpu_find(gpu->uuid) >= 0) {
            gpu_settings_invalid(CUDA_ERROR_INVALID_VALUE,
                                 "GPULOOM_FAKE_CUDA_GPUS: bad entry %s (want UUID=CHIP:MIB, UUIDs "
                                 "GPU-<32 hex digits>, each once)", entry);
            return;
        }
        memcpy(gpu->chip, equals + 1, (size_t)(colon - equals - 1));
        gpu->chip[colon - equals - 1] = 0;
        gpu->total = (uint64_t)mib << 20;
        g_gpu_count++;
        at = end ? end + 1 : at + length;
    }
    if (g_gpu_count == 0)
        gpu_settings_invalid(CUDA_ERROR_INVALID_VALUE, "GPULOOM_FAKE_CUDA_GPUS is empty%s", "");
}

/* The files of GPU `index`: its memory ledger, engine lock and MPS engine state (-1: could not
 * open). */
static int gpu_file(int index, const char *kind) {
    char file[700], uuid[48];
    if (!g_gpu_listed) {
        snprintf(file, sizeof file, "%s/%s", g_dir,
                 strcmp(kind, "memory") == 0 ? "memory.ledger"
                 : strcmp(kind, "mps") == 0  ? "mps-engine.state"
                                             : "engine.lock");
    } else {
        uuid_format(g_gpus[index].uuid, uuid);
        snprintf(file, sizeof file, "%s/%s-%s.%s", g_dir, kind, uuid,
                 strcmp(kind, "memory") == 0 ? "ledger" : strcmp(kind, "mps") == 0 ? "state" : "lock");
    }
    return open(file, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
}

__attribute__((constructor)) static void fake_setup(void) {
    const char *path = getenv("GPULOOM_FAKE_CUDA_TRACE");
    if (path && *path) g_trace_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const char *base = getenv("GPULOOM_FAKE_CUDA_DIR");
    if (base && *base)
        snprintf(g_dir, sizeof g_dir, "%s", base);
    else
        snprintf(g_dir, sizeof g_dir, "/tmp/gpuloom-fake-cuda-%u", (unsigned)getuid());
    mkdir(g_dir, 0755);
    const char *mem = getenv("GPULOOM_FAKE_CUDA_MEM_MIB");
    const char *gpus = getenv("GPULOOM_FAKE_CUDA_GPUS");
    if (gpus && *gpus) {
        gpus_parse(gpus);
    } else {
        g_gpu_count = 1;
        uuid_parse("GPU-fa4e0000-0000-0000-0000-000000000000", 40, g_gpus[0].uuid);
        snprintf(g_gpus[0].chip, sizeof g_gpus[0].chip, "gpuloom fake GPU");
        g_gpus[0].total = (uint64_t)(mem && *mem ? strtoull(mem, NULL, 10) : 81920) << 20;
    }
    const char *mine = getenv("GPULOOM_FAKE_CUDA_GPU");
    if (g_gpu_error == CUDA_SUCCESS && mine && *mine) {
        unsigned char uuid[16];
        g_gpu = uuid_parse(mine, strlen(mine), uuid) == 0 ? gpu_find(uuid) : -1;
        if (g_gpu < 0) {
            g_gpu = 0;
            gpu_settings_invalid(CUDA_ERROR_INVALID_DEVICE,
                                 "GPULOOM_FAKE_CUDA_GPU=%s is not a GPU of GPULOOM_FAKE_CUDA_GPUS", mine);
        }
    }
    g_engine_fd = gpu_file(g_gpu, "engine");
    char file[600];
    snprintf(file, sizeof file, "%s/runs.log", g_dir);
    g_runs_fd = open(file, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const char *shared = getenv("GPULOOM_FAKE_CUDA_SHARED_MEMORY");
    if (g_gpu_listed || (shared && strcmp(shared, "1") == 0)) g_ledger_fd = gpu_file(g_gpu, "memory");
    const char *fail = getenv("GPULOOM_FAKE_CUDA_CKPT_FAIL");
    g_fail_restore = fail && strcmp(fail, "restore") == 0;
    g_mem_total = g_gpus[g_gpu].total;
    const char *switch_us = getenv("GPULOOM_FAKE_CUDA_SWITCH_US");
    if (switch_us && *switch_us) {
        char *end = NULL;
        unsigned long long value = strtoull(switch_us, &end, 10);
        if (end && *end == 0 && value <= 1000000) g_switch_us = value;
    }
    const char *share = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    if (share && *share) {
        char *end = NULL;
        unsigned long value = strtoul(share, &end, 10);
        if (end && *end == 0 && value >= 1 && value <= 100) g_sm_share = (unsigned)value;
    }
    const char *mps = getenv("GPULOOM_FAKE_CUDA_MPS");
    if (mps && *mps && strcmp(mps, "0") != 0) {
        if (strcmp(mps, "1") == 0)
            g_mps = 1;
        else
            gpu_settings_invalid(CUDA_ERROR_INVALID_VALUE, "GPULOOM_FAKE_CUDA_MPS=%s (want 0 or 1)", mps);
    }
    const char *factors = getenv("GPULOOM_FAKE_CUDA_INTERFERENCE");
    if (factors && *factors) {
        double f[3];
        char tail;
        if (sscanf(factors, "%lf,%lf,%lf%c", &f[0], &f[1], &f[2], &tail) != 3 || !(f[0] >= 1 && f[0] <= 100) ||
            !(f[1] >= 1 && f[1] <= 100) || !(f[2] >= 1 && f[2] <= 100))
            gpu_settings_invalid(CUDA_ERROR_INVALID_VALUE,
                                 "GPULOOM_FAKE_CUDA_INTERFERENCE=%s (want SAME,OTHER,UNKNOWN factors in 1..100; "
                                 "below 1 would speed kernels up)",
                                 factors);
        else
            memcpy(g_interference, f, sizeof f);
    }
}

static void sleep_until(uint64_t deadline) {
    struct timespec t = {.tv_sec = (time_t)(deadline / 1000000000u),
                         .tv_nsec = (long)(deadline % 1000000000u)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR) {
    }
}

/* runs.log: the ground truth of what ran when. */
static void log_run(const char *name, uint64_t start, uint64_t end) {
    if (g_runs_fd < 0) return;
    char line[256];
    int n = snprintf(line, sizeof line, "run %d %s %llu %llu\n", (int)getpid(), name,
                     (unsigned long long)start, (unsigned long long)end);
    if (n > 0 && write(g_runs_fd, line, (size_t)n) < 0) { /* best effort */
    }
}

/* Run one kernel on the shared engine: book its turn, then wait for its end. The lock file
 * holds the engine's booking for every process of the GPU: the end of the last kernel booked,
 * its process, and the end of the last kernel of another process before that process's run
 * of bookings. It is locked only to read and move them, never while a kernel runs, so no
 * process's thread stands between one kernel's end and the next one's start: on a GPU the
 * next context's kernel starts by itself.
 *
 * The kernel starts as a GPU would start it, not when this thread got around to it: when it
 * was ready (`ready`: queued, and the work before it on its stream done) or when the other
 * processes' booked kernels end, whichever is later (plus GPULOOM_FAKE_CUDA_SWITCH_US when the
 * engine turns from another process to this one); this process's other streams' kernels run
 * beside it, as streams of one context do. It ends at start + duration, however late this
 * thread wakes from sleeping until then: a GPU ends a kernel without a CPU. So a worker thread
 * that the host's scheduler runs late, at a kernel's end or before its next, shows up neither
 * as GPU time a GPU would not have taken nor as a later start of another process's kernel
 * (nor as a difference between the log and the events); only its own host learns of the end
 * late, as a descheduled host would. Processes take the engine in the order their workers
 * book it. */
static uint64_t engine_run(const char *name, uint64_t duration_us, uint64_t ready) {
    uint64_t book[3] = {0, 0, 0}; /* last end, its process, the others' last end before */
    uint64_t me = (uint64_t)getpid();
    int fd = g_engine_fd;
    if (fd >= 0) {
        flock(fd, LOCK_EX);
        if (pread(fd, book, sizeof book, 0) != (ssize_t)sizeof book) {
            book[0] = book[1] = book[2] = 0;
        }
    }
    uint64_t start;
    if (book[1] == me) { /* this process's run goes on: after the others', beside its own */
        start = ready > book[2] ? ready : book[2];
    } else {
        start = ready > book[0] ? ready : book[0];
        if (book[1] != 0) start += g_switch_us * 1000u; /* the other context out */
        book[2] = book[0];
        book[1] = me;
    }
    uint64_t end = start + duration_us * 1000u;
    if (end > book[0]) book[0] = end;
    if (fd >= 0) {
        if (pwrite(fd, book, sizeof book, 0) != (ssize_t)sizeof book) { /* best effort */
        }
        flock(fd, LOCK_UN);
    }
    sleep_until(end);
    log_run(name, start, end); /* before the host can learn of the end, and exit */
    return end;
}

/* ---- the MPS engine (GPULOOM_FAKE_CUDA_MPS=1): the kernels of every process co-run ----
 *
 * The simulator's model (gpuloom/sim/device.py, docs/harvest.md "Device model") in SM percent:
 * a kernel asks for demand = min(sm_need, its process's partition) percent of the SMs; when
 * the running kernels ask for more than 100, each gets share = 100 / total of its demand; and
 * a kernel is slowed by its co-runners: rate = share / (1 + sum over co-runners j of
 * (F(mine, j's) - 1) * j's held percent / 100), F the interference factor of the two bound
 * classes. A kernel's work is its duration alone (run_us: a partition below its need already
 * stretches it, as the simulator's demand / want does), done at that rate (at most 1): alone
 * it takes exactly that duration. The running kernels of a GPU are kept in a file mapped by
 * every process (mps-engine[-UUID].state), changed under a lock (a mutex between this
 * process's streams, flock between processes); a change (a kernel started or ended) bumps a
 * futex word that wakes every waiting kernel to re-plan its end. Time in the model moves from
 * event to event: a kernel ends at the instant its work is done, whichever thread notices, so
 * a thread the host's scheduler wakes late neither stretches its own kernel nor slows the
 * others. */

enum { BOUND_UNKNOWN, BOUND_COMPUTE, BOUND_MEMORY };
#define MPS_SLOTS 64

static int bound_parse(const char *text) {
    if (strcmp(text, "unknown") == 0) return BOUND_UNKNOWN;
    if (strcmp(text, "compute") == 0) return BOUND_COMPUTE;
    if (strcmp(text, "memory") == 0) return BOUND_MEMORY;
    return -1;
}

typedef struct {
    int32_t pid;     /* 0: a free slot */
    uint32_t ended;  /* the kernel ended at `end`; its thread has not collected it yet */
    uint32_t demand; /* percent of the SMs it asks for */
    uint32_t bound;
    uint64_t start, end;
    double work;     /* ns left at rate 1 */
    double rate;
} mps_slot;

typedef struct {
    uint32_t generation; /* futex word: bumped on every change of what runs */
    uint32_t reserved;
    uint64_t now;        /* the model's time: its last update (CLOCK_MONOTONIC ns) */
    mps_slot slots[MPS_SLOTS];
} mps_engine;

static pthread_mutex_t g_mps_lock = PTHREAD_MUTEX_INITIALIZER;
static mps_engine *g_mps_maps[FAKE_GPUS_MAX];
static int g_mps_fds[FAKE_GPUS_MAX];

/* Locks GPU `gpu`'s engine (mapping it the first time); NULL: its file could not be used. */
static mps_engine *mps_lock(int gpu) {
    pthread_mutex_lock(&g_mps_lock);
    if (g_mps_maps[gpu] == NULL) {
        int fd = gpu_file(gpu, "mps");
        if (fd < 0 || ftruncate(fd, sizeof(mps_engine)) != 0) { /* zeros: nothing runs */
            if (fd >= 0) close(fd);
            pthread_mutex_unlock(&g_mps_lock);
            return NULL;
        }
        void *map = mmap(NULL, sizeof(mps_engine), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED) {
            close(fd);
            pthread_mutex_unlock(&g_mps_lock);
            return NULL;
        }
        g_mps_maps[gpu] = map;
        g_mps_fds[gpu] = fd;
    }
    flock(g_mps_fds[gpu], LOCK_EX);
    return g_mps_maps[gpu];
}

static void mps_unlock(int gpu) {
    flock(g_mps_fds[gpu], LOCK_UN);
    pthread_mutex_unlock(&g_mps_lock);
}

static int mps_running(const mps_slot *k) { return k->pid != 0 && !k->ended; }

static double mps_factor(unsigned mine, unsigned theirs) {
    if (mine == BOUND_UNKNOWN || theirs == BOUND_UNKNOWN) return g_interference[2];
    return g_interference[mine == theirs ? 0 : 1];
}

static void mps_rates(mps_engine *e) {
    double total = 0;
    for (int i = 0; i < MPS_SLOTS; i++)
        if (mps_running(&e->slots[i])) total += e->slots[i].demand;
    double share = total > 100 ? 100 / total : 1;
    for (int i = 0; i < MPS_SLOTS; i++) {
        mps_slot *k = &e->slots[i];
        if (!mps_running(k)) continue;
        double slow = 1;
        for (int j = 0; j < MPS_SLOTS; j++) {
            const mps_slot *other = &e->slots[j];
            if (j != i && mps_running(other))
                slow += (mps_factor(k->bound, other->bound) - 1) * other->demand * share / 100;
        }
        k->rate = share / slow;
    }
}

/* When the running kernel that ends first ends, at the current rates (0: none runs). */
static uint64_t mps_next_end(const mps_engine *e) {
    uint64_t next = 0;
    for (int i = 0; i < MPS_SLOTS; i++) {
        const mps_slot *k = &e->slots[i];
        if (!mps_running(k)) continue;
        double left = k->work / k->rate;
        uint64_t at = e->now + (uint64_t)left + ((double)(uint64_t)left < left);
        if (next == 0 || at < next) next = at;
    }
    return next;
}

/* Runs the model to `t`, ending each kernel at the instant its work is done. Returns whether
 * what runs changed. A dead process's kernels are dropped (as a real driver's are). */
static int mps_advance(mps_engine *e, uint64_t t) {
    int changed = 0;
    for (int i = 0; i < MPS_SLOTS; i++) {
        mps_slot *k = &e->slots[i];
        if (k->pid != 0 && k->pid != (int32_t)getpid() && kill(k->pid, 0) != 0 && errno == ESRCH) {
            memset(k, 0, sizeof *k);
            changed = 1;
        }
    }
    if (changed) mps_rates(e);
    for (;;) {
        uint64_t next = mps_next_end(e);
        uint64_t to = next != 0 && next <= t ? next : t;
        if (to > e->now) {
            for (int i = 0; i < MPS_SLOTS; i++)
                if (mps_running(&e->slots[i])) e->slots[i].work -= e->slots[i].rate * (double)(to - e->now);
            e->now = to;
        }
        if (next == 0 || next > t) return changed;
        for (int i = 0; i < MPS_SLOTS; i++) {
            mps_slot *k = &e->slots[i];
            if (mps_running(k) && k->work / k->rate < 1) { /* under a ns left: done now */
                k->ended = 1;
                k->end = e->now;
                k->work = 0;
            }
        }
        mps_rates(e);
        changed = 1;
    }
}

static void mps_changed(mps_engine *e) {
    __atomic_add_fetch(&e->generation, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &e->generation, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

static void mps_wait(mps_engine *e, uint32_t generation, uint64_t until) {
    uint64_t now = now_ns();
    if (until != 0 && until <= now) return;
    uint64_t wait = until != 0 ? until - now : 100000000u; /* none ends: look again later */
    struct timespec t = {(time_t)(wait / 1000000000u), (long)(wait % 1000000000u)};
    syscall(SYS_futex, &e->generation, FUTEX_WAIT, generation, &t, NULL, 0);
}

/* engine_run under MPS: the kernel starts when it was ready (or at the model's last change,
 * if that is later: the model does not go back) beside whatever runs, and ends when the model
 * says its work is done. Returns its end (the model's, not this thread's wake-up). */
static uint64_t engine_run_mps(const char *name, uint64_t duration_us, unsigned need,
                               unsigned bound, uint64_t ready) {
    int gpu = g_gpu;
    mps_engine *e = mps_lock(gpu);
    if (e == NULL) { /* no shared file: alone, beside nothing */
        sleep_until(ready + duration_us * 1000u);
        log_run(name, ready, ready + duration_us * 1000u);
        return ready + duration_us * 1000u;
    }
    mps_slot *mine = NULL;
    for (;;) {
        mps_advance(e, now_ns());
        for (int i = 0; i < MPS_SLOTS && mine == NULL; i++)
            if (e->slots[i].pid == 0) mine = &e->slots[i];
        if (mine) break;
        uint32_t generation = e->generation; /* every slot taken: wait for one to free */
        uint64_t until = mps_next_end(e);
        mps_unlock(gpu);
        mps_wait(e, generation, until);
        e = mps_lock(gpu);
    }
    uint64_t start = ready > e->now ? ready : e->now;
    uint64_t now = now_ns();
    if (start > now) start = now;
    mps_advance(e, start); /* the others up to its start, then it runs beside them */
    *mine = (mps_slot){.pid = (int32_t)getpid(),
                       .demand = need < g_sm_share ? need : g_sm_share,
                       .bound = bound,
                       .start = e->now,
                       .work = (double)duration_us * 1000.0};
    start = e->now;
    mps_rates(e);
    mps_advance(e, now);
    mps_changed(e);
    while (!mine->ended) {
        uint32_t generation = e->generation;
        uint64_t until = mps_next_end(e);
        mps_unlock(gpu);
        mps_wait(e, generation, until);
        mps_lock(gpu);
        if (mps_advance(e, now_ns())) mps_changed(e);
    }
    uint64_t end = mine->end;
    memset(mine, 0, sizeof *mine);
    mps_unlock(gpu);
    log_run(name, start, end);
    return end;
}

/* ---- the checkpoint lock: calls that use the GPU wait while the process is locked ---- */

static pthread_cond_t g_unlocked = PTHREAD_COND_INITIALIZER;
static int g_ckpt_locked; /* atomic (written under g_lock) */
static int g_inflight;    /* atomic: gated calls in progress */

/* The fast path is two atomic operations: count the call in, then look at the lock (the locker
 * sets the lock, then waits for the count to drop to 0: one of the two always sees the other).
 * A call that finds the process locked counts itself out and waits for the unlock. */
static void api_enter(void) {
    for (;;) {
        __atomic_add_fetch(&g_inflight, 1, __ATOMIC_SEQ_CST);
        if (!__atomic_load_n(&g_ckpt_locked, __ATOMIC_SEQ_CST)) return;
        pthread_mutex_lock(&g_lock);
        __atomic_sub_fetch(&g_inflight, 1, __ATOMIC_SEQ_CST);
        pthread_cond_broadcast(&g_done);
        while (__atomic_load_n(&g_ckpt_locked, __ATOMIC_SEQ_CST))
            pthread_cond_wait(&g_unlocked, &g_lock);
        pthread_mutex_unlock(&g_lock);
    }
}

static void api_leave(void) {
    __atomic_sub_fetch(&g_inflight, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&g_ckpt_locked, __ATOMIC_SEQ_CST)) { /* a locker may be waiting */
        pthread_mutex_lock(&g_lock);
        pthread_cond_broadcast(&g_done);
        pthread_mutex_unlock(&g_lock);
    }
}

/* ---- modules, functions ---- */

typedef struct fk_func {
    char name[128];
    uint64_t duration_us; /* on the whole GPU */
    unsigned sm_need;     /* percent of the SMs it can use */
    unsigned bound;       /* BOUND_*: the unit it is bound by (the MPS engine's interference) */
} fk_func;

/* Its duration under this process's SM share (the MPS timing model). */
static uint64_t run_us(const fk_func *f) {
    if (g_sm_share >= f->sm_need) return f->duration_us;
    return (f->duration_us * f->sm_need + g_sm_share - 1) / g_sm_share;
}

typedef struct fk_module {
    int count, capacity;
    fk_func *funcs;
    struct fk_module *next_free;
} fk_module;

/* Unloaded modules, reused by the next loads: like a real driver, the fake hands a later
 * module the function addresses of an unloaded one (what the shim's caches must survive). */
static fk_module *g_free_modules;
static pthread_mutex_t g_modules_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t duration_from_name(const char *name) {
    size_t n = strlen(name);
    if (n > 3 && strcmp(name + n - 2, "us") == 0) {
        size_t end = n - 2, start = end;
        while (start > 0 && name[start - 1] >= '0' && name[start - 1] <= '9') start--;
        if (start < end && start > 0 && name[start - 1] == '_')
            return strtoull(name + start, NULL, 10);
    }
    return 100;
}

static CUresult load_module(fk_module **out, const void *image) {
    if (out == NULL || image == NULL) return CUDA_ERROR_INVALID_VALUE;
    const char *text = image;
    pthread_mutex_lock(&g_modules_lock);
    fk_module *module = g_free_modules;
    if (module) g_free_modules = module->next_free;
    pthread_mutex_unlock(&g_modules_lock);
    if (module == NULL) module = calloc(1, sizeof *module);
    if (module == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    module->count = 0;
    while (*text) {
        const char *line_end = strchr(text, '\n');
        size_t length = line_end ? (size_t)(line_end - text) : strlen(text);
        char line[256];
        if (length >= sizeof line) length = sizeof line - 1;
        memcpy(line, text, length);
        line[length] = 0;
        text += length + (line_end ? 1 : 0);
        char name[128], bound[16] = "unknown";
        unsigned long long duration = 0;
        unsigned need = 100;
        int fields = sscanf(line, "%127s %llu %u %15s", name, &duration, &need, bound);
        if (fields < 1) continue;
        int bound_class = bound_parse(bound);
        if (bound_class < 0) { /* a typo must not pass as "unknown" */
            fprintf(stderr, "gpuloom fake libcuda: kernel %s: bound class %s (want compute, memory or unknown)\n",
                    name, bound);
            free(module->funcs);
            free(module);
            return CUDA_ERROR_INVALID_IMAGE;
        }
        if (module->count == module->capacity) {
            int capacity = module->capacity ? module->capacity * 2 : 8;
            fk_func *grown = realloc(module->funcs, (size_t)capacity * sizeof *grown);
            if (grown == NULL) {
                free(module->funcs);
                free(module);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            module->funcs = grown;
            module->capacity = capacity;
        }
        fk_func *f = &module->funcs[module->count++];
        snprintf(f->name, sizeof f->name, "%s", name);
        f->duration_us = fields >= 2 ? duration : duration_from_name(name);
        f->sm_need = need >= 1 && need <= 100 ? need : 100;
        f->bound = (unsigned)bound_class;
    }
    if (module->count == 0) {
        free(module->funcs);
        free(module);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    *out = module;
    return CUDA_SUCCESS;
}

static CUresult module_function(fk_func **out, fk_module *module, const char *name) {
    if (out == NULL || module == NULL || name == NULL) return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < module->count; i++)
        if (strcmp(module->funcs[i].name, name) == 0) {
            *out = &module->funcs[i];
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_NOT_FOUND;
}

/* ---- streams, events, graphs ---- */

typedef struct fk_event {
    uint64_t timestamp;
    uint64_t recorded; /* records made */
    uint64_t completed; /* records completed */
} fk_event;

enum { OP_KERNEL, OP_EVENT };

typedef struct fk_op {
    int kind;
    uint64_t queued_ns; /* when it was enqueued */
    const fk_func *func;
    fk_event *event;
    uint64_t event_seq;
    struct fk_op *next;
} fk_op;

/* A graph's kernel node: what it launches; in an executable graph, also the node of the
 * graph it was instantiated from (cuGraphExecKernelNodeSetParams names that one). */
typedef struct fk_node {
    const fk_func *func;
    unsigned dims[6];
    const struct fk_node *origin;
} fk_node;

typedef struct fk_graph {
    int count;
    fk_node *nodes;
} fk_graph;

typedef struct fk_stream {
    pthread_t thread;
    pthread_cond_t work;
    fk_op *head, *tail;
    int running; /* an op is being executed */
    uint64_t done_ns; /* when the last op finished (on the GPU's terms) */
    int stop;
    int capturing;
    fk_graph *capture;
    struct fk_stream *next_stream;
} fk_stream;

static fk_stream *g_streams;
static fk_stream *g_default;

/* Takes the stream's first op off its queue. Called with g_lock held. */
static void pop_op(fk_stream *s) {
    fk_op *op = s->head;
    s->head = op->next;
    if (s->head == NULL) s->tail = NULL;
    free(op);
}

/* An event completes when the work before it did (not when the worker got to it), or, on an
 * idle stream, when it was recorded. Called with g_lock held. */
static void complete_event(fk_stream *s, const fk_op *op) {
    uint64_t at = op->queued_ns > s->done_ns ? op->queued_ns : s->done_ns;
    s->done_ns = at;
    if (op->event_seq == op->event->recorded) {
        op->event->timestamp = at;
        op->event->completed = op->event_seq;
    }
}

static void *stream_worker(void *arg) {
    fk_stream *s = arg;
    pthread_mutex_lock(&g_lock);
    for (;;) {
        while (s->head == NULL && !s->stop) pthread_cond_wait(&s->work, &g_lock);
        if (s->head == NULL && s->stop) break;
        fk_op *op = s->head;
        s->running = 1;
        if (op->kind == OP_KERNEL) {
            uint64_t ready = op->queued_ns > s->done_ns ? op->queued_ns : s->done_ns;
            pthread_mutex_unlock(&g_lock);
            const fk_func *f = op->func;
            uint64_t end = g_mps ? engine_run_mps(f->name, run_us(f), f->sm_need, f->bound, ready)
                                 : engine_run(f->name, run_us(f), ready);
            pthread_mutex_lock(&g_lock);
            s->done_ns = end;
            pop_op(s);
            /* The events right behind it complete with it: one wake-up for a sync. */
            while (s->head != NULL && s->head->kind == OP_EVENT) {
                complete_event(s, s->head);
                pop_op(s);
            }
        } else {
            complete_event(s, op);
            pop_op(s);
        }
        s->running = 0;
        pthread_cond_broadcast(&g_done);
    }
    pthread_mutex_unlock(&g_lock);
    return NULL;
}

/* Called with g_lock held. */
static fk_stream *new_stream(void) {
    fk_stream *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    pthread_cond_init(&s->work, NULL);
    if (pthread_create(&s->thread, NULL, stream_worker, s) != 0) {
        free(s);
        return NULL;
    }
    s->next_stream = g_streams;
    g_streams = s;
    return s;
}

/* NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD all map to one default stream. Called with
 * g_lock held. */
static fk_stream *resolve_stream(CUstream handle) {
    if (handle == NULL || handle == CU_STREAM_LEGACY || handle == CU_STREAM_PER_THREAD) {
        if (g_default == NULL) g_default = new_stream();
        return g_default;
    }
    return (fk_stream *)handle;
}

static int stream_idle(const fk_stream *s) { return s->head == NULL && !s->running; }

static void enqueue(fk_stream *s, fk_op *op) {
    op->next = NULL;
    op->queued_ns = now_ns();
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    pthread_cond_signal(&s->work);
}

static CUresult launch_gated(const char *entry, CUfunction f, unsigned gx, unsigned gy,
                             unsigned gz, unsigned bx, unsigned by, unsigned bz, CUstream stream);

static CUresult launch(const char *entry, CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                       unsigned bx, unsigned by, unsigned bz, CUstream stream) {
    api_enter();
    CUresult r = launch_gated(entry, f, gx, gy, gz, bx, by, bz, stream);
    api_leave();
    return r;
}

static CUresult launch_gated(const char *entry, CUfunction f, unsigned gx, unsigned gy,
                             unsigned gz, unsigned bx, unsigned by, unsigned bz, CUstream stream) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (f == NULL) return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0)
        return CUDA_ERROR_INVALID_VALUE;
    const fk_func *func = (const fk_func *)f;
    pthread_mutex_lock(&g_lock);
    fk_stream *s = resolve_stream(stream);
    if (s == NULL) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (s->capturing) {
        fk_graph *g = s->capture;
        fk_node *grown = realloc(g->nodes, (size_t)(g->count + 1) * sizeof *grown);
        if (grown == NULL) {
            pthread_mutex_unlock(&g_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g->nodes = grown;
        g->nodes[g->count++] = (fk_node){func, {gx, gy, gz, bx, by, bz}, NULL};
        pthread_mutex_unlock(&g_lock);
        trace("fake %s %s %u %u %u %u %u %u captured", entry, func->name, gx, gy, gz, bx, by, bz);
        return CUDA_SUCCESS;
    }
    fk_op *op = calloc(1, sizeof *op);
    if (op == NULL) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    op->kind = OP_KERNEL;
    op->func = func;
    enqueue(s, op);
    pthread_mutex_unlock(&g_lock);
    trace("fake %s %s %u %u %u %u %u %u", entry, func->name, gx, gy, gz, bx, by, bz);
    return CUDA_SUCCESS;
}

static CUresult sync_stream(CUstream stream) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_lock);
    fk_stream *s = resolve_stream(stream);
    while (s && !stream_idle(s)) pthread_cond_wait(&g_done, &g_lock);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

static CUresult sync_all(void) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_lock);
    for (;;) {
        int busy = 0;
        for (fk_stream *s = g_streams; s; s = s->next_stream) busy |= !stream_idle(s);
        if (!busy) break;
        pthread_cond_wait(&g_done, &g_lock);
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* ---- the GPU's memory ledger (shared memory mode) ---- */

#define LEDGER_SLOTS 1024
typedef struct {
    int32_t pid;
    uint32_t unused;
    uint64_t bytes;
} ledger_slot;

static int pid_alive(int pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

/* Under the ledger's flock: the device memory every live process holds, and this process's
 * slot (-1: none free). */
static uint64_t ledger_scan(int fd, ledger_slot *slots, int *mine) {
    memset(slots, 0, sizeof(ledger_slot) * LEDGER_SLOTS);
    if (pread(fd, slots, sizeof(ledger_slot) * LEDGER_SLOTS, 0) < 0) { /* empty */
    }
    uint64_t used = 0;
    int me = (int)getpid(), empty = -1;
    *mine = -1;
    for (int i = 0; i < LEDGER_SLOTS; i++) {
        if (slots[i].pid == me) *mine = i;
        else if (slots[i].pid != 0 && pid_alive(slots[i].pid)) used += slots[i].bytes;
        else if (empty < 0) empty = i;
    }
    if (*mine < 0 && empty >= 0) {
        *mine = empty;
        slots[empty] = (ledger_slot){me, 0, 0};
    }
    if (*mine >= 0) used += slots[*mine].bytes;
    return used;
}

/* Take (delta > 0, if the GPU of ledger `fd`, `total` bytes, has room) or give back (delta < 0)
 * device memory. 0: no room. */
static int ledger_change_on(int fd, uint64_t total, int64_t delta) {
    if (fd < 0) return 1;
    ledger_slot slots[LEDGER_SLOTS];
    int mine, ok = 1;
    flock(fd, LOCK_EX);
    uint64_t used = ledger_scan(fd, slots, &mine);
    if (mine < 0 || (delta > 0 && used + (uint64_t)delta > total)) {
        ok = delta <= 0;
    } else {
        ledger_slot *slot = &slots[mine];
        slot->bytes = delta < 0 && (uint64_t)-delta > slot->bytes ? 0 : slot->bytes + delta;
        if (pwrite(fd, slot, sizeof *slot, (off_t)(mine * sizeof *slot)) < 0) {
        }
    }
    flock(fd, LOCK_UN);
    return ok;
}

/* The same on this process's GPU. */
static int ledger_change(int64_t delta) { return ledger_change_on(g_ledger_fd, g_mem_total, delta); }

/* The device memory in use: every live process's (shared mode), else this process's. */
static uint64_t device_used(void) {
    if (g_ledger_fd < 0) return g_mem_used;
    ledger_slot slots[LEDGER_SLOTS];
    int mine;
    flock(g_ledger_fd, LOCK_SH);
    uint64_t used = ledger_scan(g_ledger_fd, slots, &mine);
    flock(g_ledger_fd, LOCK_UN);
    return used;
}

/* ---- memory ---- */

/* An allocation: a device pointer, or (kind ALLOC_HANDLE) a cuMemCreate handle whose bytes are
 * freed once it is released and unmapped (`refs`: 1 until released, +1 per mapping), or (kind
 * ALLOC_IPC) memory opened from another process's IPC handle (its bytes are the exporter's). */
enum { ALLOC_POINTER, ALLOC_HANDLE, ALLOC_IPC, ALLOC_ARRAY };

typedef struct fk_alloc {
    uint64_t address;
    uint64_t size;
    int kind;
    int refs;
    int fd;      /* the memfd backing its bytes (-1: bookkeeping only) */
    void *bytes; /* its bytes, mapped shared (NULL: bookkeeping only) */
    struct fk_alloc *next;
} fk_alloc;

typedef struct fk_map {
    uint64_t address;
    uint64_t size;
    fk_alloc *handle;
    struct fk_map *next;
} fk_map;

static fk_alloc *g_allocs;
static fk_map *g_maps;
static int g_checkpointed; /* the device memory is in host memory (guarded by g_lock) */
static uint64_t g_next_address = 0x7f0000000000ull;
static uint64_t g_next_low = 0x10000000ull; /* legacy 32-bit pointers: below 4 GiB */
static __thread int t_low; /* the allocation being made is a legacy one */

/* The device memory this process holds (the fake NVML reads it). */
EXPORT uint64_t gl_fake_cuda_mem_used(void) {
    pthread_mutex_lock(&g_lock);
    uint64_t used = device_used();
    pthread_mutex_unlock(&g_lock);
    return used;
}

EXPORT uint64_t gl_fake_cuda_mem_total(void) { return g_mem_total; }

/* Called with g_lock held: a range of fake addresses, 1 MiB granules. */
static uint64_t take_addresses(uint64_t size) {
    if (t_low) {
        uint64_t low = g_next_low;
        g_next_low += (size + 0xfffffu) & ~0xfffffull;
        return low;
    }
    uint64_t address = g_next_address;
    g_next_address += (size + 0xfffffu) & ~0xfffffull;
    return address;
}

/* Device pointers are backed by a memfd mapped shared (sparse: only what is written takes
 * memory), so copies keep their bytes and another process can map the same bytes through an
 * IPC handle. Without a memfd (or past the address space) the allocation is bookkeeping only
 * and reads as zeros. */
static void back(fk_alloc *a) {
    int fd = memfd_create("gpuloom-fake-device", MFD_CLOEXEC);
    if (fd < 0) return;
    void *bytes = MAP_FAILED;
    if (ftruncate(fd, (off_t)a->size) == 0)
        bytes = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (bytes == MAP_FAILED) {
        close(fd);
        return;
    }
    a->fd = fd;
    a->bytes = bytes;
}

static void unback(fk_alloc *a) {
    if (a->bytes) munmap(a->bytes, a->size);
    if (a->fd >= 0) close(a->fd);
}

static CUresult mem_alloc_locked(const char *entry, uint64_t *out, uint64_t size, int kind);

static CUresult mem_alloc_kind(const char *entry, uint64_t *out, uint64_t size, int kind) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (out == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    api_enter();
    CUresult r = mem_alloc_locked(entry, out, size, kind);
    api_leave();
    return r;
}

static CUresult mem_alloc_locked(const char *entry, uint64_t *out, uint64_t size, int kind) {
    pthread_mutex_lock(&g_lock);
    uint64_t counted = kind == ALLOC_IPC ? 0 : size;
    if (g_mem_used + counted > g_mem_total || !ledger_change((int64_t)counted)) {
        pthread_mutex_unlock(&g_lock);
        trace("fake %s %llu out_of_memory", entry, (unsigned long long)size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    fk_alloc *a = malloc(sizeof *a);
    if (a == NULL) {
        ledger_change(-(int64_t)counted);
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->address = take_addresses(size);
    a->size = size;
    a->kind = kind;
    a->refs = 1;
    a->fd = -1;
    a->bytes = NULL;
    if (kind == ALLOC_POINTER) back(a);
    a->next = g_allocs;
    g_allocs = a;
    g_mem_used += counted;
    pthread_mutex_unlock(&g_lock);
    *out = a->address;
    trace("fake %s %llu ok", entry, (unsigned long long)size);
    return CUDA_SUCCESS;
}

static CUresult mem_alloc(const char *entry, uint64_t *out, uint64_t size) {
    return mem_alloc_kind(entry, out, size, ALLOC_POINTER);
}

/* Called with g_lock held. */
static fk_alloc *find_alloc(uint64_t address, int kind) {
    for (fk_alloc *a = g_allocs; a; a = a->next)
        if (a->address == address && a->kind == kind) return a;
    return NULL;
}

/* Called with g_lock held: drop a reference; the last one frees the bytes. */
static void alloc_unref(const char *entry, fk_alloc *a) {
    if (--a->refs > 0) return;
    for (fk_alloc **p = &g_allocs; *p; p = &(*p)->next)
        if (*p == a) {
            *p = a->next;
            break;
        }
    if (a->kind != ALLOC_IPC && !g_checkpointed) {
        g_mem_used -= a->size;
        ledger_change(-(int64_t)a->size);
    }
    trace("fake %s %llu", entry, (unsigned long long)a->size);
    unback(a);
    free(a);
}

static CUresult mem_free_kind(const char *entry, uint64_t address, int kind) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (address == 0 && kind == ALLOC_POINTER) return CUDA_SUCCESS;
    api_enter();
    pthread_mutex_lock(&g_lock);
    fk_alloc *a = find_alloc(address, kind);
    if (a != NULL) alloc_unref(entry, a);
    pthread_mutex_unlock(&g_lock);
    api_leave();
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult mem_free(const char *entry, uint64_t address) {
    return mem_free_kind(entry, address, ALLOC_POINTER);
}

/* ======== the driver API ======== */

#ifndef FAKE_MINIMAL
static void ckpt_start(void);
static pthread_once_t g_ckpt_once = PTHREAD_ONCE_INIT;
#endif

EXPORT CUresult CUDAAPI cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (g_gpu_error != CUDA_SUCCESS) return g_gpu_error;
#ifndef FAKE_MINIMAL
    pthread_once(&g_ckpt_once, ckpt_start);
#endif
    g_inited = 1;
    trace("fake cuInit");
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDriverGetVersion(int *version) {
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    *version = CUDA_VERSION;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceGetCount(int *count) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (count == NULL) return CUDA_ERROR_INVALID_VALUE;
    *count = 1;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (device == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceGetName(char *name, int length, CUdevice device) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (name == NULL || length <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    snprintf(name, (size_t)length, "%s", g_gpus[g_gpu].chip);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceTotalMem_v2(size_t *bytes, CUdevice device) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (bytes == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = g_mem_total;
    return CUDA_SUCCESS;
}

static int g_context_token;
static __thread CUcontext t_current;

EXPORT CUresult CUDAAPI cuCtxCreate_v2(CUcontext *context, unsigned int flags, CUdevice device) {
    (void)flags;
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (context == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
    *context = (CUcontext)&g_context_token;
    t_current = *context;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) {
    return cuCtxCreate_v2(context, 0, device);
}

EXPORT CUresult CUDAAPI cuCtxSetCurrent(CUcontext context) {
    t_current = context;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuCtxGetCurrent(CUcontext *context) {
    if (context == NULL) return CUDA_ERROR_INVALID_VALUE;
    *context = t_current;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuCtxDestroy_v2(CUcontext context) {
    if (context == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    sync_all();
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuCtxSynchronize(void) {
    trace("fake cuCtxSynchronize");
    api_enter();
    CUresult r = sync_all();
    api_leave();
    return r;
}

EXPORT CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    return load_module((fk_module **)module, image);
}

EXPORT CUresult CUDAAPI cuModuleGetFunction(CUfunction *function, CUmodule module,
                                            const char *name) {
    return module_function((fk_func **)function, (fk_module *)module, name);
}

/* Waits for queued work (a launch may still name its functions), then keeps the storage for
 * the next load. */
static CUresult unload_module(fk_module *module) {
    if (module == NULL) return CUDA_ERROR_INVALID_HANDLE;
    sync_all();
    pthread_mutex_lock(&g_modules_lock);
    module->next_free = g_free_modules;
    g_free_modules = module;
    pthread_mutex_unlock(&g_modules_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuModuleUnload(CUmodule module) {
    trace("fake cuModuleUnload");
    return unload_module((fk_module *)module);
}

EXPORT CUresult CUDAAPI cuLibraryLoadData(CUlibrary *library, const void *code,
                                          CUjit_option *jitOptions, void **jitOptionsValues,
                                          unsigned int numJitOptions,
                                          CUlibraryOption *libraryOptions,
                                          void **libraryOptionValues,
                                          unsigned int numLibraryOptions) {
    (void)jitOptions, (void)jitOptionsValues, (void)numJitOptions;
    (void)libraryOptions, (void)libraryOptionValues, (void)numLibraryOptions;
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    return load_module((fk_module **)library, code);
}

EXPORT CUresult CUDAAPI cuLibraryGetKernel(CUkernel *kernel, CUlibrary library, const char *name) {
    return module_function((fk_func **)kernel, (fk_module *)library, name);
}

EXPORT CUresult CUDAAPI cuKernelGetFunction(CUfunction *function, CUkernel kernel) {
    if (function == NULL || kernel == NULL) return CUDA_ERROR_INVALID_VALUE;
    *function = (CUfunction)kernel;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuLibraryUnload(CUlibrary library) {
    trace("fake cuLibraryUnload");
    return unload_module((fk_module *)library);
}

#ifndef FAKE_MINIMAL
EXPORT CUresult CUDAAPI cuFuncGetName(const char **name, CUfunction function) {
    if (name == NULL || function == NULL) return CUDA_ERROR_INVALID_VALUE;
    *name = ((const fk_func *)function)->name;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuKernelGetName(const char **name, CUkernel kernel) {
    if (name == NULL || kernel == NULL) return CUDA_ERROR_INVALID_VALUE;
    *name = ((const fk_func *)kernel)->name;
    return CUDA_SUCCESS;
}
#endif

/* -- launches -- */

EXPORT CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                       unsigned int gz, unsigned int bx, unsigned int by,
                                       unsigned int bz, unsigned int shared, CUstream stream,
                                       void **params, void **extra) {
    (void)shared, (void)params, (void)extra;
    return launch("cuLaunchKernel", f, gx, gy, gz, bx, by, bz, stream);
}

EXPORT CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                            unsigned int gz, unsigned int bx, unsigned int by,
                                            unsigned int bz, unsigned int shared,
                                            CUstream stream, void **params, void **extra) {
    (void)shared, (void)params, (void)extra;
    return launch("cuLaunchKernel_ptsz", f, gx, gy, gz, bx, by, bz, stream);
}

#ifndef FAKE_MINIMAL
EXPORT CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params,
                                         void **extra) {
    (void)params, (void)extra;
    if (c == NULL) return CUDA_ERROR_INVALID_VALUE;
    return launch("cuLaunchKernelEx", f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX,
                  c->blockDimY, c->blockDimZ, c->hStream);
}

EXPORT CUresult CUDAAPI cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f,
                                              void **params, void **extra) {
    (void)params, (void)extra;
    if (c == NULL) return CUDA_ERROR_INVALID_VALUE;
    return launch("cuLaunchKernelEx_ptsz", f, c->gridDimX, c->gridDimY, c->gridDimZ,
                  c->blockDimX, c->blockDimY, c->blockDimZ, c->hStream);
}
#endif

EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                                  unsigned int gz, unsigned int bx,
                                                  unsigned int by, unsigned int bz,
                                                  unsigned int shared, CUstream stream,
                                                  void **params) {
    (void)shared, (void)params;
    return launch("cuLaunchCooperativeKernel", f, gx, gy, gz, bx, by, bz, stream);
}

EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx,
                                                       unsigned int gy, unsigned int gz,
                                                       unsigned int bx, unsigned int by,
                                                       unsigned int bz, unsigned int shared,
                                                       CUstream stream, void **params) {
    (void)shared, (void)params;
    return launch("cuLaunchCooperativeKernel_ptsz", f, gx, gy, gz, bx, by, bz, stream);
}

/* -- streams and capture -- */

EXPORT CUresult CUDAAPI cuStreamCreate(CUstream *stream, unsigned int flags) {
    (void)flags;
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (stream == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    fk_stream *s = new_stream();
    pthread_mutex_unlock(&g_lock);
    if (s == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *stream = (CUstream)s;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuStreamDestroy_v2(CUstream stream) {
    if (stream == NULL) return CUDA_ERROR_INVALID_HANDLE;
    /* Streams live until exit: a destroyed stream's queued work still completes. */
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuStreamSynchronize(CUstream stream) {
    trace("fake cuStreamSynchronize");
    api_enter();
    CUresult r = sync_stream(stream);
    api_leave();
    return r;
}

EXPORT CUresult CUDAAPI cuStreamSynchronize_ptsz(CUstream stream) {
    trace("fake cuStreamSynchronize_ptsz");
    api_enter();
    CUresult r = sync_stream(stream);
    api_leave();
    return r;
}

static CUresult stream_query(CUstream stream) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_lock);
    fk_stream *s = resolve_stream(stream);
    int idle = s == NULL || stream_idle(s);
    pthread_mutex_unlock(&g_lock);
    return idle ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

EXPORT CUresult CUDAAPI cuStreamQuery(CUstream stream) { return stream_query(stream); }
EXPORT CUresult CUDAAPI cuStreamQuery_ptsz(CUstream stream) { return stream_query(stream); }

static CUresult is_capturing(CUstream stream, CUstreamCaptureStatus *status) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (status == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    fk_stream *s = resolve_stream(stream);
    *status = s && s->capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
    return is_capturing(stream, status);
}

EXPORT CUresult CUDAAPI cuStreamIsCapturing_ptsz(CUstream stream, CUstreamCaptureStatus *status) {
    return is_capturing(stream, status);
}

static CUresult begin_capture(CUstream stream) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    /* Like the real driver, the legacy default stream cannot be captured. */
    if (stream == NULL || stream == CU_STREAM_LEGACY) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    pthread_mutex_lock(&g_lock);
    fk_stream *s = resolve_stream(stream);
    CUresult result = CUDA_SUCCESS;
    if (s->capturing)
        result = CUDA_ERROR_ILLEGAL_STATE;
    else if ((s->capture = calloc(1, sizeof *s->capture)) == NULL)
        result = CUDA_ERROR_OUT_OF_MEMORY;
    else
        s->capturing = 1;
    pthread_mutex_unlock(&g_lock);
    return result;
}

EXPORT CUresult CUDAAPI cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode) {
    (void)mode;
    return begin_capture(stream);
}

EXPORT CUresult CUDAAPI cuStreamBeginCapture_v2_ptsz(CUstream stream, CUstreamCaptureMode mode) {
    (void)mode;
    return begin_capture(stream);
}

static CUresult end_capture(CUstream stream, CUgraph *graph) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (graph == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    fk_stream *s = resolve_stream(stream);
    CUresult result = CUDA_ERROR_ILLEGAL_STATE;
    if (s && s->capturing) {
        *graph = (CUgraph)s->capture;
        s->capture = NULL;
        s->capturing = 0;
        result = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

EXPORT CUresult CUDAAPI cuStreamEndCapture(CUstream stream, CUgraph *graph) {
    return end_capture(stream, graph);
}

EXPORT CUresult CUDAAPI cuStreamEndCapture_ptsz(CUstream stream, CUgraph *graph) {
    return end_capture(stream, graph);
}

EXPORT CUresult CUDAAPI cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph,
                                                    unsigned long long flags) {
    (void)flags;
    if (exec == NULL || graph == NULL) return CUDA_ERROR_INVALID_VALUE;
    const fk_graph *g = (const fk_graph *)graph;
    fk_graph *copy = calloc(1, sizeof *copy);
    if (copy == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    copy->count = g->count;
    copy->nodes = malloc((size_t)(g->count ? g->count : 1) * sizeof *copy->nodes);
    if (copy->nodes == NULL) {
        free(copy);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (int i = 0; i < g->count; i++) {
        copy->nodes[i] = g->nodes[i];
        copy->nodes[i].origin = &g->nodes[i];
    }
    *exec = (CUgraphExec)copy;
    return CUDA_SUCCESS;
}

static void free_graph(fk_graph *g) {
    if (g == NULL) return;
    free(g->nodes);
    free(g);
}

EXPORT CUresult CUDAAPI cuGraphDestroy(CUgraph graph) {
    free_graph((fk_graph *)graph);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuGraphExecDestroy(CUgraphExec exec) {
    free_graph((fk_graph *)exec);
    return CUDA_SUCCESS;
}

/* -- a graph's nodes, in the order they were added (every node of the fake's is a kernel) -- */

EXPORT CUresult CUDAAPI cuGraphGetNodes(CUgraph graph, CUgraphNode *nodes, size_t *count) {
    if (graph == NULL || count == NULL) return CUDA_ERROR_INVALID_VALUE;
    fk_graph *g = (fk_graph *)graph;
    if (nodes != NULL)
        for (size_t i = 0; i < *count && i < (size_t)g->count; i++)
            nodes[i] = (CUgraphNode)&g->nodes[i];
    *count = (size_t)g->count;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type) {
    if (node == NULL || type == NULL) return CUDA_ERROR_INVALID_VALUE;
    *type = CU_GRAPH_NODE_TYPE_KERNEL;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuGraphKernelNodeGetParams_v2(CUgraphNode node,
                                                      CUDA_KERNEL_NODE_PARAMS *params) {
    if (node == NULL || params == NULL) return CUDA_ERROR_INVALID_VALUE;
    const fk_node *n = (const fk_node *)node;
    memset(params, 0, sizeof *params);
    params->func = (CUfunction)n->func;
    params->gridDimX = n->dims[0], params->gridDimY = n->dims[1], params->gridDimZ = n->dims[2];
    params->blockDimX = n->dims[3], params->blockDimY = n->dims[4], params->blockDimZ = n->dims[5];
    return CUDA_SUCCESS;
}

/* The executable's copy of `node` (a node of the graph it was instantiated from) gets new
 * parameters. */
EXPORT CUresult CUDAAPI cuGraphExecKernelNodeSetParams_v2(CUgraphExec exec, CUgraphNode node,
                                                          const CUDA_KERNEL_NODE_PARAMS *params) {
    if (exec == NULL || node == NULL || params == NULL || params->func == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    fk_graph *g = (fk_graph *)exec;
    for (int i = 0; i < g->count; i++)
        if (g->nodes[i].origin == (const fk_node *)node) {
            g->nodes[i].func = (const fk_func *)params->func;
            unsigned dims[6] = {params->gridDimX,  params->gridDimY,  params->gridDimZ,
                                params->blockDimX, params->blockDimY, params->blockDimZ};
            memcpy(g->nodes[i].dims, dims, sizeof dims);
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_VALUE;
}

/* The executable takes the kernels of `graph`, which must have as many nodes. */
EXPORT CUresult CUDAAPI cuGraphExecUpdate_v2(CUgraphExec exec, CUgraph graph,
                                             CUgraphExecUpdateResultInfo *info) {
    if (exec == NULL || graph == NULL) return CUDA_ERROR_INVALID_VALUE;
    fk_graph *e = (fk_graph *)exec;
    const fk_graph *g = (const fk_graph *)graph;
    if (info != NULL) memset(info, 0, sizeof *info);
    if (e->count != g->count) {
        if (info != NULL) info->result = CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
        return CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
    }
    for (int i = 0; i < g->count; i++) {
        e->nodes[i] = g->nodes[i];
        e->nodes[i].origin = &g->nodes[i];
    }
    return CUDA_SUCCESS;
}

static CUresult graph_launch_gated(const char *entry, CUgraphExec exec, CUstream stream);

static CUresult graph_launch(const char *entry, CUgraphExec exec, CUstream stream) {
    api_enter();
    CUresult r = graph_launch_gated(entry, exec, stream);
    api_leave();
    return r;
}

static CUresult graph_launch_gated(const char *entry, CUgraphExec exec, CUstream stream) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (exec == NULL) return CUDA_ERROR_INVALID_VALUE;
    const fk_graph *g = (const fk_graph *)exec;
    pthread_mutex_lock(&g_lock);
    fk_stream *s = resolve_stream(stream);
    for (int i = 0; i < g->count; i++) {
        fk_op *op = calloc(1, sizeof *op);
        if (op == NULL) break;
        op->kind = OP_KERNEL;
        op->func = g->nodes[i].func;
        enqueue(s, op);
    }
    pthread_mutex_unlock(&g_lock);
    trace("fake %s %d", entry, g->count);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuGraphLaunch(CUgraphExec exec, CUstream stream) {
    return graph_launch("cuGraphLaunch", exec, stream);
}

EXPORT CUresult CUDAAPI cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream) {
    return graph_launch("cuGraphLaunch_ptsz", exec, stream);
}

/* -- events -- */

EXPORT CUresult CUDAAPI cuEventCreate(CUevent *event, unsigned int flags) {
    (void)flags;
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (event == NULL) return CUDA_ERROR_INVALID_VALUE;
    fk_event *e = calloc(1, sizeof *e);
    if (e == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *event = (CUevent)e;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuEventDestroy_v2(CUevent event) {
    if (event == NULL) return CUDA_ERROR_INVALID_HANDLE;
    fk_event *e = (fk_event *)event;
    pthread_mutex_lock(&g_lock);
    /* A record still queued keeps a pointer to the event: wait for it. */
    while (e->completed != e->recorded) pthread_cond_wait(&g_done, &g_lock);
    pthread_mutex_unlock(&g_lock);
    free(e);
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent event, CUstream stream) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (event == NULL) return CUDA_ERROR_INVALID_HANDLE;
    fk_event *e = (fk_event *)event;
    fk_op *op = calloc(1, sizeof *op);
    if (op == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    fk_stream *s = resolve_stream(stream);
    int captured = s->capturing;
    op->kind = OP_EVENT;
    op->event = e;
    op->event_seq = ++e->recorded;
    enqueue(s, op);
    pthread_mutex_unlock(&g_lock);
    /* A real driver would add a node to the capture: the tests see that the shim never does. */
    if (captured) trace("fake cuEventRecord captured");
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuEventRecord(CUevent event, CUstream stream) {
    return event_record(event, stream);
}

EXPORT CUresult CUDAAPI cuEventRecord_ptsz(CUevent event, CUstream stream) {
    return event_record(event, stream);
}

EXPORT CUresult CUDAAPI cuEventQuery(CUevent event) {
    if (event == NULL) return CUDA_ERROR_INVALID_HANDLE;
    fk_event *e = (fk_event *)event;
    pthread_mutex_lock(&g_lock);
    int done = e->completed == e->recorded;
    pthread_mutex_unlock(&g_lock);
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

EXPORT CUresult CUDAAPI cuEventSynchronize(CUevent event) {
    if (event == NULL) return CUDA_ERROR_INVALID_HANDLE;
    fk_event *e = (fk_event *)event;
    trace("fake cuEventSynchronize");
    pthread_mutex_lock(&g_lock);
    while (e->completed != e->recorded) pthread_cond_wait(&g_done, &g_lock);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuEventElapsedTime(float *ms, CUevent start, CUevent end) {
    if (ms == NULL || start == NULL || end == NULL) return CUDA_ERROR_INVALID_VALUE;
    fk_event *a = (fk_event *)start, *b = (fk_event *)end;
    pthread_mutex_lock(&g_lock);
    CUresult result = CUDA_SUCCESS;
    if (a->recorded == 0 || b->recorded == 0)
        result = CUDA_ERROR_INVALID_HANDLE;
    else if (a->completed != a->recorded || b->completed != b->recorded)
        result = CUDA_ERROR_NOT_READY;
    else
        *ms = (float)((double)((int64_t)(b->timestamp - a->timestamp)) / 1e6);
    pthread_mutex_unlock(&g_lock);
    return result;
}

/* -- memory -- */

EXPORT CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    return mem_alloc("cuMemAlloc_v2", (uint64_t *)dptr, bytes);
}

EXPORT CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                           size_t height, unsigned int element_bytes) {
    if (pitch == NULL || element_bytes == 0 || element_bytes > 16) return CUDA_ERROR_INVALID_VALUE;
    size_t rounded = (width + 511) & ~(size_t)511;
    CUresult result = mem_alloc("cuMemAllocPitch_v2", (uint64_t *)dptr, rounded * height);
    if (result == CUDA_SUCCESS) *pitch = rounded;
    return result;
}

EXPORT CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    (void)flags;
    return mem_alloc("cuMemAllocManaged", (uint64_t *)dptr, bytes);
}

EXPORT CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    (void)stream;
    return mem_alloc("cuMemAllocAsync", (uint64_t *)dptr, bytes);
}

EXPORT CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    (void)stream;
    return mem_alloc("cuMemAllocAsync_ptsz", (uint64_t *)dptr, bytes);
}

/* -- stream-ordered pools: a pool is a tag (the fake keeps nothing reserved after a free) -- */

typedef struct fk_pool {
    int device;
    cuuint64_t threshold; /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (stored, not acted on) */
} fk_pool;

static fk_pool g_default_pool;

EXPORT CUresult CUDAAPI cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (pool == NULL || props == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (props->location.type != CU_MEM_LOCATION_TYPE_DEVICE || props->location.id != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    fk_pool *p = calloc(1, sizeof *p);
    if (p == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemPoolDestroy(CUmemoryPool pool) {
    if (pool == NULL || pool == (CUmemoryPool)&g_default_pool) return CUDA_ERROR_INVALID_VALUE;
    free(pool);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    (void)keep;
    return pool ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult alloc_from_pool(const char *entry, CUdeviceptr *dptr, size_t bytes,
                                CUmemoryPool pool) {
    if (pool == NULL) return CUDA_ERROR_INVALID_VALUE;
    return mem_alloc(entry, (uint64_t *)dptr, bytes);
}

EXPORT CUresult CUDAAPI cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                                CUstream stream) {
    (void)stream;
    return alloc_from_pool("cuMemAllocFromPoolAsync", dptr, bytes, pool);
}

EXPORT CUresult CUDAAPI cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes,
                                                     CUmemoryPool pool, CUstream stream) {
    (void)stream;
    return alloc_from_pool("cuMemAllocFromPoolAsync_ptsz", dptr, bytes, pool);
}

EXPORT CUresult CUDAAPI cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attribute,
                                              void *value) {
    if (pool == NULL || value == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (attribute != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) return CUDA_ERROR_NOT_SUPPORTED;
    ((fk_pool *)pool)->threshold = *(cuuint64_t *)value;
    trace("fake cuMemPoolSetAttribute threshold %llu", (unsigned long long)*(cuuint64_t *)value);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attribute,
                                              void *value) {
    if (pool == NULL || value == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (attribute != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) return CUDA_ERROR_NOT_SUPPORTED;
    *(cuuint64_t *)value = ((fk_pool *)pool)->threshold;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice device) {
    if (pool == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
    *pool = (CUmemoryPool)&g_default_pool;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice device) {
    return cuDeviceGetMemPool(pool, device);
}

EXPORT CUresult CUDAAPI cuCtxGetDevice(CUdevice *device) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (device == NULL) return CUDA_ERROR_INVALID_VALUE;
    *device = 0;
    return CUDA_SUCCESS;
}

/* -- CUDA arrays: bookkeeping only (no bytes), rows padded to 512 bytes -- */

static uint64_t padded_array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format format,
                                   unsigned channels) {
    uint64_t element = gl_format_bytes(format);
    if (element == 0) element = 16;
    uint64_t row = (w * element * (channels ? channels : 1) + 511) & ~(uint64_t)511;
    return row * (h ? h : 1) * (d ? d : 1);
}

static CUresult array_create(const char *entry, CUarray *handle, uint64_t w, uint64_t h,
                             uint64_t d, CUarray_format format, unsigned channels) {
    if (handle == NULL || w == 0 || channels == 0 || channels > 4 || gl_format_bytes(format) == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t address = 0;
    CUresult r = mem_alloc_kind(entry, &address, padded_array_bytes(w, h, d, format, channels),
                                ALLOC_ARRAY);
    if (r == CUDA_SUCCESS) *handle = (CUarray)(uintptr_t)address;
    return r;
}

/* The array constructors, one per descriptor type (`depth`: the descriptor's, 1 for the 2D
 * ones). */
#define FAKE_ARRAY_CREATE(symbol, descriptor, depth)                                       \
    EXPORT CUresult CUDAAPI symbol(CUarray *handle, const descriptor *d) {                 \
        if (d == NULL) return CUDA_ERROR_INVALID_VALUE;                                    \
        return array_create(#symbol, handle, d->Width, d->Height, depth, d->Format,        \
                            d->NumChannels);                                               \
    }
FAKE_ARRAY_CREATE(cuArrayCreate_v2, CUDA_ARRAY_DESCRIPTOR, 1)
FAKE_ARRAY_CREATE(cuArray3DCreate_v2, CUDA_ARRAY3D_DESCRIPTOR, d->Depth)
FAKE_ARRAY_CREATE(cuArrayCreate, gl_array_descriptor_v1, 1)
FAKE_ARRAY_CREATE(cuArray3DCreate, gl_array3d_descriptor_v1, d->Depth)

static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
    uint64_t total = 0, w = d->Width, h = d->Height, z = d->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        total += padded_array_bytes(w, h, z, d->Format, d->NumChannels);
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        z = z > 1 ? z / 2 : z;
    }
    return total;
}

EXPORT CUresult CUDAAPI cuMipmappedArrayCreate(CUmipmappedArray *handle,
                                               const CUDA_ARRAY3D_DESCRIPTOR *d,
                                               unsigned int levels) {
    if (handle == NULL || d == NULL || d->Width == 0 || levels == 0 ||
        gl_format_bytes(d->Format) == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t address = 0;
    CUresult r = mem_alloc_kind("cuMipmappedArrayCreate", &address, mipmap_bytes(d, levels),
                                ALLOC_ARRAY);
    if (r == CUDA_SUCCESS) *handle = (CUmipmappedArray)(uintptr_t)address;
    return r;
}

EXPORT CUresult CUDAAPI cuArrayDestroy(CUarray handle) {
    return mem_free_kind("cuArrayDestroy", (uint64_t)(uintptr_t)handle, ALLOC_ARRAY);
}

EXPORT CUresult CUDAAPI cuMipmappedArrayDestroy(CUmipmappedArray handle) {
    return mem_free_kind("cuMipmappedArrayDestroy", (uint64_t)(uintptr_t)handle, ALLOC_ARRAY);
}

static CUresult array_requirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *out, uint64_t handle) {
    if (out == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    fk_alloc *a = find_alloc(handle, ALLOC_ARRAY);
    if (a) {
        memset(out, 0, sizeof *out);
        out->size = a->size;
        out->alignment = 512;
    }
    pthread_mutex_unlock(&g_lock);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult CUDAAPI cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *out,
                                                     CUarray array, CUdevice device) {
    if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
    return array_requirements(out, (uint64_t)(uintptr_t)array);
}

EXPORT CUresult CUDAAPI cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *out,
                                                              CUmipmappedArray mipmap,
                                                              CUdevice device) {
    if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
    return array_requirements(out, (uint64_t)(uintptr_t)mipmap);
}

/* -- the legacy 32-bit entry points -- */

/* An allocation at a 32-bit address, into *dptr. */
static CUresult mem_alloc_low(const char *entry, gl_deviceptr_v1 *dptr, uint64_t bytes) {
    uint64_t address = 0;
    t_low = 1;
    CUresult r = mem_alloc(entry, &address, bytes);
    t_low = 0;
    if (r == CUDA_SUCCESS) *dptr = (gl_deviceptr_v1)address;
    return r;
}

EXPORT CUresult CUDAAPI cuMemAlloc(gl_deviceptr_v1 *dptr, unsigned int bytes) {
    if (dptr == NULL) return CUDA_ERROR_INVALID_VALUE;
    return mem_alloc_low("cuMemAlloc", dptr, bytes);
}

EXPORT CUresult CUDAAPI cuMemAllocPitch(gl_deviceptr_v1 *dptr, unsigned int *pitch,
                                        unsigned int width, unsigned int height,
                                        unsigned int element_bytes) {
    if (dptr == NULL || pitch == NULL || element_bytes == 0 || element_bytes > 16)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned rounded = (width + 511u) & ~511u;
    CUresult r = mem_alloc_low("cuMemAllocPitch", dptr, (uint64_t)rounded * height);
    if (r == CUDA_SUCCESS) *pitch = rounded;
    return r;
}

EXPORT CUresult CUDAAPI cuMemFree(gl_deviceptr_v1 dptr) { return mem_free("cuMemFree", dptr); }

EXPORT CUresult CUDAAPI cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes) {
    size_t f = 0, t = 0;
    CUresult r = cuMemGetInfo_v2(&f, &t);
    if (r == CUDA_SUCCESS) {
        *free_bytes = f > UINT32_MAX ? UINT32_MAX : (unsigned)f;
        *total_bytes = t > UINT32_MAX ? UINT32_MAX : (unsigned)t;
    }
    return r;
}

/* -- explicit graphs: the fake runs kernels of captured graphs only; a memory node allocates
 * when it is added (the driver answers its address then), a free node does nothing -- */

EXPORT CUresult CUDAAPI cuGraphCreate(CUgraph *graph, unsigned int flags) {
    if (graph == NULL || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    fk_graph *g = calloc(1, sizeof *g);
    if (g == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *graph = (CUgraph)g;
    return CUDA_SUCCESS;
}

static CUresult graph_mem_node(const char *entry, CUgraphNode *node, CUgraph graph,
                               size_t bytes, CUdeviceptr *dptr) {
    if (node == NULL || graph == NULL) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = mem_alloc(entry, (uint64_t *)dptr, bytes);
    if (r == CUDA_SUCCESS) *node = (CUgraphNode)(uintptr_t)*dptr;
    return r;
}

EXPORT CUresult CUDAAPI cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph,
                                               const CUgraphNode *dependencies, size_t count,
                                               CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    (void)dependencies, (void)count;
    if (params == NULL) return CUDA_ERROR_INVALID_VALUE;
    return graph_mem_node("cuGraphAddMemAllocNode", node, graph, params->bytesize,
                          &params->dptr);
}

EXPORT CUresult CUDAAPI cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph graph,
                                              const CUgraphNode *dependencies, size_t count,
                                              CUdeviceptr dptr) {
    (void)dependencies, (void)count;
    if (node == NULL || graph == NULL || dptr == 0) return CUDA_ERROR_INVALID_VALUE;
    *node = (CUgraphNode)(uintptr_t)(dptr + 1);
    return CUDA_SUCCESS;
}

static CUresult graph_add_node(const char *entry, CUgraphNode *node, CUgraph graph,
                               CUgraphNodeParams *params) {
    if (params == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (params->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) return CUDA_ERROR_NOT_SUPPORTED;
    return graph_mem_node(entry, node, graph, params->alloc.bytesize, &params->alloc.dptr);
}

EXPORT CUresult CUDAAPI cuGraphAddNode(CUgraphNode *node, CUgraph graph,
                                       const CUgraphNode *dependencies, size_t count,
                                       CUgraphNodeParams *params) {
    (void)dependencies, (void)count;
    return graph_add_node("cuGraphAddNode", node, graph, params);
}

EXPORT CUresult CUDAAPI cuGraphAddNode_v2(CUgraphNode *node, CUgraph graph,
                                          const CUgraphNode *dependencies,
                                          const CUgraphEdgeData *edges, size_t count,
                                          CUgraphNodeParams *params) {
    (void)dependencies, (void)edges, (void)count;
    return graph_add_node("cuGraphAddNode_v2", node, graph, params);
}

static CUresult vmm_map(CUdeviceptr ptr, size_t size, size_t offset,
                        CUmemGenericAllocationHandle handle);
static CUresult vmm_unmap(CUdeviceptr ptr, size_t size);

/* -- virtual memory management: the bytes of a handle are freed when it is released and no
 * mapping of it is left, as the driver does -- */

EXPORT CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                                    const CUmemAllocationProp *prop, unsigned long long flags) {
    (void)prop, (void)flags;
    return mem_alloc_kind("cuMemCreate", (uint64_t *)handle, bytes, ALLOC_HANDLE);
}

EXPORT CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
    return mem_free_kind("cuMemRelease", handle, ALLOC_HANDLE);
}

EXPORT CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                            CUdeviceptr addr, unsigned long long flags) {
    (void)alignment, (void)addr, (void)flags;
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (ptr == NULL || size == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    *ptr = take_addresses(size);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    return ptr && size ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                                 CUmemGenericAllocationHandle handle, unsigned long long flags) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (ptr == 0 || size == 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    api_enter();
    CUresult r = vmm_map(ptr, size, offset, handle);
    api_leave();
    return r;
}

static CUresult vmm_map(CUdeviceptr ptr, size_t size, size_t offset,
                        CUmemGenericAllocationHandle handle) {
    pthread_mutex_lock(&g_lock);
    fk_alloc *a = find_alloc(handle, ALLOC_HANDLE);
    fk_map *m = a && offset + size <= a->size ? malloc(sizeof *m) : NULL;
    if (m == NULL) {
        pthread_mutex_unlock(&g_lock);
        return a ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_HANDLE;
    }
    *m = (fk_map){ptr, size, a, g_maps};
    g_maps = m;
    a->refs++;
    pthread_mutex_unlock(&g_lock);
    trace("fake cuMemMap %llu", (unsigned long long)size);
    return CUDA_SUCCESS;
}

/* Unmaps every mapping that starts within [ptr, ptr + size). */
EXPORT CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    api_enter();
    CUresult r = vmm_unmap(ptr, size);
    api_leave();
    return r;
}

static CUresult vmm_unmap(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&g_lock);
    int found = 0;
    for (fk_map **p = &g_maps; *p;) {
        fk_map *m = *p;
        if (m->address >= ptr && m->address < ptr + size) {
            *p = m->next;
            alloc_unref("cuMemUnmap", m->handle);
            free(m);
            found = 1;
        } else {
            p = &m->next;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                       size_t count) {
    return ptr && size && desc && count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* -- IPC: the handle carries the exporter's pid, address and size; opening it in another
 * process gives that process an address for the same allocation, which is the exporter's
 * memory (not counted again) -- */

#define FAKE_IPC_MAGIC "glfkipc"

typedef struct {
    char magic[8];
    uint64_t pid;
    uint64_t address;
    uint64_t size;
    int64_t fd; /* the exporter's memfd: the opener maps /proc/PID/fd/FD (-1: none) */
} fake_ipc;

EXPORT CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (handle == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    fk_alloc *a = find_alloc(dptr, ALLOC_POINTER);
    fake_ipc ipc = {FAKE_IPC_MAGIC, (uint64_t)getpid(), dptr, a ? a->size : 0, a ? a->fd : -1};
    pthread_mutex_unlock(&g_lock);
    if (a == NULL) return CUDA_ERROR_INVALID_VALUE;
    _Static_assert(sizeof ipc <= sizeof handle->reserved, "the fake IPC handle fits");
    memset(handle, 0, sizeof *handle);
    memcpy(handle->reserved, &ipc, sizeof ipc);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle handle,
                                              unsigned int flags) {
    (void)flags;
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (dptr == NULL) return CUDA_ERROR_INVALID_VALUE;
    fake_ipc ipc;
    memcpy(&ipc, handle.reserved, sizeof ipc);
    if (memcmp(ipc.magic, FAKE_IPC_MAGIC, sizeof ipc.magic) != 0 || ipc.size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    /* Like the driver: a process cannot open its own handles. */
    if (ipc.pid == (uint64_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT;
    /* The exporter's bytes: gone with the exporter (its memfd), as the fake cannot keep them. */
    void *bytes = NULL;
    int fd = -1;
    if (ipc.fd >= 0) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%llu/fd/%lld", (unsigned long long)ipc.pid,
                 (long long)ipc.fd);
        fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0) {
            trace("fake cuIpcOpenMemHandle_v2 exporter gone");
            return CUDA_ERROR_INVALID_HANDLE;
        }
        bytes = mmap(NULL, ipc.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
        if (bytes == MAP_FAILED) {
            close(fd);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    CUresult result =
        mem_alloc_kind("cuIpcOpenMemHandle_v2", (uint64_t *)dptr, ipc.size, ALLOC_IPC);
    if (result != CUDA_SUCCESS) {
        if (bytes) munmap(bytes, ipc.size);
        if (fd >= 0) close(fd);
        return result;
    }
    pthread_mutex_lock(&g_lock);
    fk_alloc *a = find_alloc(*dptr, ALLOC_IPC);
    a->fd = fd;
    a->bytes = bytes;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr) {
    return mem_free_kind("cuIpcCloseMemHandle", dptr, ALLOC_IPC);
}

EXPORT CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr) { return mem_free("cuMemFree_v2", dptr); }

EXPORT CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    (void)stream;
    return mem_free("cuMemFreeAsync", dptr);
}

EXPORT CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) {
    (void)stream;
    return mem_free("cuMemFreeAsync_ptsz", dptr);
}

EXPORT CUresult CUDAAPI cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (free_bytes == NULL || total_bytes == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    uint64_t used = device_used();
    *free_bytes = used < g_mem_total ? g_mem_total - used : 0;
    *total_bytes = g_mem_total;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* Called with g_lock held: the backed bytes at [address, address + bytes), or NULL (not in
 * one backed allocation). */
static unsigned char *device_bytes(CUdeviceptr address, size_t bytes) {
    for (fk_alloc *a = g_allocs; a; a = a->next)
        if (a->bytes && address >= a->address && address - a->address <= a->size &&
            bytes <= a->size - (address - a->address))
            return (unsigned char *)a->bytes + (address - a->address);
    return NULL;
}

/* The copy waits for all work (legacy default stream semantics); memory without bytes (VMM
 * mappings, or no memfd) reads as zeros. */
static CUresult copy_dtoh_gated(const char *entry, void *dst, CUdeviceptr src, size_t bytes);

static CUresult copy_dtoh(const char *entry, void *dst, CUdeviceptr src, size_t bytes) {
    api_enter();
    CUresult r = copy_dtoh_gated(entry, dst, src, bytes);
    api_leave();
    return r;
}

static CUresult copy_dtoh_gated(const char *entry, void *dst, CUdeviceptr src, size_t bytes) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (dst == NULL || src == 0) return CUDA_ERROR_INVALID_VALUE;
    trace("fake %s", entry);
    sync_all();
    pthread_mutex_lock(&g_lock);
    const unsigned char *from = device_bytes(src, bytes);
    if (from)
        memcpy(dst, from, bytes);
    else
        memset(dst, 0, bytes);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* Waits for all work too; bytes sent to memory without bytes are dropped. */
static CUresult copy_htod_gated(CUdeviceptr dst, const void *src, size_t bytes);

EXPORT CUresult CUDAAPI cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes) {
    api_enter();
    CUresult r = copy_htod_gated(dst, src, bytes);
    api_leave();
    return r;
}

static CUresult copy_htod_gated(CUdeviceptr dst, const void *src, size_t bytes) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (dst == 0 || src == NULL) return CUDA_ERROR_INVALID_VALUE;
    sync_all();
    pthread_mutex_lock(&g_lock);
    unsigned char *to = device_bytes(dst, bytes);
    if (to) memcpy(to, src, bytes);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes) {
    return copy_dtoh("cuMemcpyDtoH_v2", dst, src, bytes);
}

EXPORT CUresult CUDAAPI cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t bytes) {
    return copy_dtoh("cuMemcpyDtoH_v2_ptds", dst, src, bytes);
}

EXPORT CUresult CUDAAPI cuGetExportTable(const void **table, const CUuuid *id) {
    (void)id;
    if (table) *table = NULL;
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* -- the checkpoint API (see the top of the file; an older driver, FAKE_MINIMAL, lacks it) -- */
#ifndef FAKE_MINIMAL

#define CKPT_MAGIC 0x676c636bu /* "glck" */
enum { CK_NONE, CK_LOCK, CK_CHECKPOINT, CK_RESTORE, CK_UNLOCK };

typedef struct {
    uint32_t magic;
    uint32_t state;       /* CUprocessState, written by the process */
    uint32_t request_seq; /* a controller's request number (futex) */
    uint32_t done_seq;    /* the last request served (futex) */
    uint32_t op;
    uint32_t timeout_ms;
    int32_t result;
    uint32_t unused;
    uint64_t saved_bytes; /* device memory in host memory while checkpointed */
    uint32_t pair_count;  /* a restore's GPU pairs (old UUID, new UUID) */
    uint32_t unused2;
    unsigned char pairs[FAKE_GPUS_MAX][2][16];
} ckpt_page;

/* CUDA 13.0's CUcheckpointGpuPair and CUcheckpointRestoreArgs, whose layout the cuda.h this
 * build uses (12.9: reserved words only) does not declare: the pairs in its first words. */
typedef struct {
    CUuuid oldUuid;
    CUuuid newUuid;
} fake_gpu_pair;
typedef struct {
    fake_gpu_pair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(fake_gpu_pair *)];
    cuuint64_t reserved1;
} fake_restore_args;
_Static_assert(sizeof(fake_restore_args) == sizeof(CUcheckpointRestoreArgs),
               "CUDA 13.0's restore args are as large as the reserved words of older headers");

static ckpt_page *g_ckpt;    /* this process's page (NULL: not served) */
static char g_ckpt_path[64];

static void ckpt_page_path(char *out, size_t size, int pid) {
    snprintf(out, size, "/dev/shm/gpuloom-fake-ckpt-%d", pid);
}

static void futex_wait(uint32_t *word, uint32_t value, int ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    syscall(SYS_futex, word, FUTEX_WAIT, value, &t, NULL, 0);
}

static void futex_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0); }

/* Lock: no new GPU call starts; wait for those in flight and the queued work. */
static CUresult ckpt_lock(unsigned timeout_ms) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    uint64_t ns = (uint64_t)deadline.tv_nsec + (uint64_t)(timeout_ms ? timeout_ms : 3600000u) * 1000000u;
    deadline.tv_sec += (time_t)(ns / 1000000000u);
    deadline.tv_nsec = (long)(ns % 1000000000u);
    pthread_mutex_lock(&g_lock);
    __atomic_store_n(&g_ckpt_locked, 1, __ATOMIC_SEQ_CST);
    for (;;) {
        int busy = __atomic_load_n(&g_inflight, __ATOMIC_SEQ_CST) > 0;
        for (fk_stream *st = g_streams; st && !busy; st = st->next_stream) busy = !stream_idle(st);
        if (!busy) break;
        if (pthread_cond_timedwait(&g_done, &g_lock, &deadline) == ETIMEDOUT && timeout_ms) {
            __atomic_store_n(&g_ckpt_locked, 0, __ATOMIC_SEQ_CST);
            pthread_cond_broadcast(&g_unlocked);
            pthread_mutex_unlock(&g_lock);
            return CUDA_ERROR_TIMEOUT;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* Copies the nonzero pages of [from, from + size) into a new sparse memfd; -1 on failure. */
static int save_pages(const unsigned char *from, uint64_t size) {
    int fd = memfd_create("gpuloom-fake-checkpoint", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    static const unsigned char zero[4096];
    for (uint64_t at = 0; at < size; at += 4096) {
        size_t n = size - at < 4096 ? (size_t)(size - at) : 4096;
        if (memcmp(from + at, zero, n) == 0) continue;
        if (pwrite(fd, from + at, n, (off_t)at) != (ssize_t)n) {
            close(fd);
            return -1;
        }
    }
    return fd;
}

/* Called with g_lock held: every allocation's bytes to host memory, the device memory given
 * back. */
static CUresult ckpt_checkpoint(void) {
    for (fk_alloc *a = g_allocs; a; a = a->next) {
        if (a->kind != ALLOC_POINTER || a->bytes == NULL) continue;
        int saved = save_pages(a->bytes, a->size);
        if (saved < 0) return CUDA_ERROR_OUT_OF_MEMORY; /* nothing released yet for it */
        unback(a);
        a->bytes = NULL;
        a->fd = saved; /* while checkpointed: the host copy */
    }
    g_ckpt->saved_bytes = g_mem_used;
    ledger_change(-(int64_t)g_mem_used);
    g_mem_used = 0;
    g_checkpointed = 1;
    return CUDA_SUCCESS;
}

/* Called with g_lock held: the GPU a restore puts the process on (its own unless a pair moves
 * it), or an error (then nothing changed). */
static CUresult ckpt_target(int *target) {
    *target = g_gpu;
    for (uint32_t i = 0; i < g_ckpt->pair_count && i < FAKE_GPUS_MAX; i++) {
        if (memcmp(g_ckpt->pairs[i][0], g_gpus[g_gpu].uuid, 16) != 0) return CUDA_ERROR_INVALID_VALUE;
        int to = gpu_find(g_ckpt->pairs[i][1]);
        if (to < 0 || strcmp(g_gpus[to].chip, g_gpus[g_gpu].chip) != 0) return CUDA_ERROR_INVALID_DEVICE;
        *target = to;
    }
    return CUDA_SUCCESS;
}

/* Called with g_lock held: the device memory taken again (on the target GPU of the request's
 * pairs, which the process runs on from then on), every byte copied back. */
static CUresult ckpt_restore(void) {
    uint64_t saved = g_ckpt->saved_bytes;
    int target;
    CUresult refused = ckpt_target(&target);
    if (refused != CUDA_SUCCESS) return refused;
    if (target != g_gpu) {
        int ledger = gpu_file(target, "memory"), engine = gpu_file(target, "engine");
        if (ledger < 0 || saved > g_gpus[target].total ||
            !ledger_change_on(ledger, g_gpus[target].total, (int64_t)saved)) {
            if (ledger >= 0) close(ledger);
            if (engine >= 0) close(engine);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        char from[48], to[48];
        uuid_format(g_gpus[g_gpu].uuid, from);
        uuid_format(g_gpus[target].uuid, to);
        trace("fake checkpoint moved %s -> %s", from, to);
        close(g_ledger_fd);
        g_ledger_fd = ledger;
        if (g_engine_fd >= 0) close(g_engine_fd);
        g_engine_fd = engine; /* no kernel runs: the process is locked */
        g_gpu = target;
        g_mem_total = g_gpus[target].total;
    } else if (!ledger_change((int64_t)saved)) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    int failed = g_fail_restore;
    for (fk_alloc *a = g_allocs; a && !failed; a = a->next) {
        if (a->kind != ALLOC_POINTER || a->fd < 0 || a->bytes != NULL) continue;
        int host = a->fd;
        a->fd = -1;
        back(a);
        if (a->bytes == NULL) {
            failed = 1;
            close(host);
            break;
        }
        unsigned char page[4096];
        for (uint64_t at = 0; at < a->size; at += 4096) {
            size_t n = a->size - at < 4096 ? (size_t)(a->size - at) : 4096;
            if (pread(host, page, n, (off_t)at) == (ssize_t)n) memcpy((unsigned char *)a->bytes + at, page, n);
        }
        close(host);
    }
    g_mem_used = saved;
    g_checkpointed = 0;
    g_ckpt->saved_bytes = 0;
    return failed ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
}

static CUresult ckpt_serve(uint32_t op, unsigned timeout_ms) {
    uint32_t state = g_ckpt->state;
    CUresult r = CUDA_ERROR_ILLEGAL_STATE;
    switch (op) {
    case CK_LOCK:
        if (state != CU_PROCESS_STATE_RUNNING) break;
        r = ckpt_lock(timeout_ms);
        if (r == CUDA_SUCCESS) g_ckpt->state = CU_PROCESS_STATE_LOCKED;
        break;
    case CK_CHECKPOINT:
        if (state != CU_PROCESS_STATE_LOCKED) break;
        pthread_mutex_lock(&g_lock);
        r = ckpt_checkpoint();
        pthread_mutex_unlock(&g_lock);
        if (r == CUDA_SUCCESS) g_ckpt->state = CU_PROCESS_STATE_CHECKPOINTED;
        break;
    case CK_RESTORE:
        if (state != CU_PROCESS_STATE_CHECKPOINTED) break;
        pthread_mutex_lock(&g_lock);
        r = ckpt_restore();
        pthread_mutex_unlock(&g_lock);
        if (r == CUDA_SUCCESS) g_ckpt->state = CU_PROCESS_STATE_LOCKED;
        else if (r == CUDA_ERROR_UNKNOWN) g_ckpt->state = CU_PROCESS_STATE_FAILED; /* bytes lost */
        break;
    case CK_UNLOCK:
        if (state != CU_PROCESS_STATE_LOCKED) break;
        pthread_mutex_lock(&g_lock);
        __atomic_store_n(&g_ckpt_locked, 0, __ATOMIC_SEQ_CST);
        pthread_cond_broadcast(&g_unlocked);
        pthread_mutex_unlock(&g_lock);
        g_ckpt->state = CU_PROCESS_STATE_RUNNING;
        r = CUDA_SUCCESS;
        break;
    default:
        r = CUDA_ERROR_INVALID_VALUE;
    }
    trace("fake checkpoint op=%u result=%d state=%u", op, (int)r, g_ckpt->state);
    return r;
}

static void *ckpt_thread(void *arg) {
    (void)arg;
    for (;;) {
        uint32_t seq = __atomic_load_n(&g_ckpt->request_seq, __ATOMIC_ACQUIRE);
        if (seq == __atomic_load_n(&g_ckpt->done_seq, __ATOMIC_ACQUIRE)) {
            futex_wait(&g_ckpt->request_seq, seq, 1000);
            continue;
        }
        g_ckpt->result = (int32_t)ckpt_serve(g_ckpt->op, g_ckpt->timeout_ms);
        __atomic_store_n(&g_ckpt->done_seq, seq, __ATOMIC_RELEASE);
        futex_wake(&g_ckpt->done_seq);
    }
    return NULL;
}

static void ckpt_unlink(void) {
    if (g_ckpt_path[0]) unlink(g_ckpt_path);
}

/* At cuInit: the page and the thread that serves it (once). */
static void ckpt_start(void) {
    ckpt_page_path(g_ckpt_path, sizeof g_ckpt_path, (int)getpid());
    int fd = open(g_ckpt_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return;
    void *page = MAP_FAILED;
    if (ftruncate(fd, sizeof(ckpt_page)) == 0)
        page = mmap(NULL, sizeof(ckpt_page), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (page == MAP_FAILED) {
        unlink(g_ckpt_path);
        return;
    }
    g_ckpt = page;
    g_ckpt->state = CU_PROCESS_STATE_RUNNING;
    __atomic_store_n(&g_ckpt->magic, CKPT_MAGIC, __ATOMIC_RELEASE);
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&thread, &attr, ckpt_thread, NULL) != 0) {
        munmap(page, sizeof(ckpt_page));
        g_ckpt = NULL;
        unlink(g_ckpt_path);
    } else {
        atexit(ckpt_unlink);
    }
    pthread_attr_destroy(&attr);
}

/* The controller's side: map the target's page (NULL: not a live CUDA process of this fake). */
static ckpt_page *ckpt_open(int pid) {
    if (pid <= 0 || !pid_alive(pid)) return NULL;
    char path[64];
    ckpt_page_path(path, sizeof path, pid);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return NULL;
    void *page = mmap(NULL, sizeof(ckpt_page), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (page == MAP_FAILED) return NULL;
    ckpt_page *p = page;
    if (__atomic_load_n(&p->magic, __ATOMIC_ACQUIRE) != CKPT_MAGIC) {
        munmap(page, sizeof(ckpt_page));
        return NULL;
    }
    return p;
}

static CUresult ckpt_request(const char *entry, int pid, uint32_t op, unsigned timeout_ms,
                             const fake_restore_args *restore) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    uint32_t pairs = restore ? restore->gpuPairsCount : 0;
    if (pairs > FAKE_GPUS_MAX || (pairs > 0 && restore->gpuPairs == NULL))
        return CUDA_ERROR_INVALID_VALUE;
    if (pid == (int)getpid()) return CUDA_ERROR_INVALID_VALUE; /* a controller is another process */
    ckpt_page *p = ckpt_open(pid);
    if (p == NULL) return CUDA_ERROR_INVALID_VALUE;
    char path[64];
    ckpt_page_path(path, sizeof path, pid);
    int lock = open(path, O_RDONLY | O_CLOEXEC);
    if (lock >= 0) flock(lock, LOCK_EX); /* one controller at a time */
    p->op = op;
    p->timeout_ms = timeout_ms;
    p->pair_count = pairs;
    for (uint32_t i = 0; i < pairs; i++) {
        memcpy(p->pairs[i][0], restore->gpuPairs[i].oldUuid.bytes, 16);
        memcpy(p->pairs[i][1], restore->gpuPairs[i].newUuid.bytes, 16);
    }
    uint32_t seq = __atomic_add_fetch(&p->request_seq, 1, __ATOMIC_ACQ_REL);
    futex_wake(&p->request_seq);
    CUresult r;
    for (;;) {
        uint32_t done = __atomic_load_n(&p->done_seq, __ATOMIC_ACQUIRE);
        if (done == seq) {
            r = (CUresult)p->result;
            break;
        }
        if (!pid_alive(pid)) {
            r = CUDA_ERROR_INVALID_VALUE;
            break;
        }
        futex_wait(&p->done_seq, done, 100);
    }
    if (lock >= 0) close(lock);
    munmap(p, sizeof(ckpt_page));
    trace("fake %s %d %d", entry, pid, (int)r);
    return r;
}

EXPORT CUresult CUDAAPI cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    return ckpt_request("cuCheckpointProcessLock", pid, CK_LOCK, args ? args->timeoutMs : 0, NULL);
}

EXPORT CUresult CUDAAPI cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    (void)args;
    return ckpt_request("cuCheckpointProcessCheckpoint", pid, CK_CHECKPOINT, 0, NULL);
}

EXPORT CUresult CUDAAPI cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    return ckpt_request("cuCheckpointProcessRestore", pid, CK_RESTORE, 0,
                        (const fake_restore_args *)args);
}

EXPORT CUresult CUDAAPI cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    (void)args;
    return ckpt_request("cuCheckpointProcessUnlock", pid, CK_UNLOCK, 0, NULL);
}

EXPORT CUresult CUDAAPI cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (state == NULL) return CUDA_ERROR_INVALID_VALUE;
    ckpt_page *p = ckpt_open(pid);
    if (p == NULL) return CUDA_ERROR_INVALID_VALUE;
    *state = (CUprocessState)__atomic_load_n(&p->state, __ATOMIC_ACQUIRE);
    munmap(p, sizeof(ckpt_page));
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (tid == NULL || !pid_alive(pid)) return CUDA_ERROR_INVALID_VALUE;
    *tid = pid; /* the fake restores on its serving thread; its id is not kept */
    return CUDA_SUCCESS;
}
#endif

/* -- cuGetProcAddress: the fake's own functions by (base) name -- */

typedef struct {
    const char *name;   /* the name cudart asks for */
    int min_version;    /* the driver version that introduced this entry */
    void *legacy;       /* default / legacy-stream variant */
    void *per_thread;   /* per-thread-default-stream variant (NULL: same as legacy) */
} proc_entry;

#define PROC(name, version, legacy, ptsz) {name, version, (void *)(legacy), (void *)(ptsz)}

static const proc_entry g_procs[] = {
    PROC("cuInit", 2000, cuInit, NULL),
    PROC("cuDriverGetVersion", 2020, cuDriverGetVersion, NULL),
    PROC("cuDeviceGet", 2000, cuDeviceGet, NULL),
    PROC("cuDeviceGetCount", 2000, cuDeviceGetCount, NULL),
    PROC("cuDeviceGetName", 2000, cuDeviceGetName, NULL),
    PROC("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2, NULL),
    PROC("cuCtxCreate", 3020, cuCtxCreate_v2, NULL),
    PROC("cuCtxDestroy", 4000, cuCtxDestroy_v2, NULL),
    PROC("cuCtxSynchronize", 2000, cuCtxSynchronize, NULL),
    PROC("cuCtxSetCurrent", 4000, cuCtxSetCurrent, NULL),
    PROC("cuCtxGetCurrent", 4000, cuCtxGetCurrent, NULL),
    PROC("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain, NULL),
    PROC("cuModuleLoadData", 2000, cuModuleLoadData, NULL),
    PROC("cuModuleGetFunction", 2000, cuModuleGetFunction, NULL),
    PROC("cuModuleUnload", 2000, cuModuleUnload, NULL),
    PROC("cuLibraryLoadData", 12000, cuLibraryLoadData, NULL),
    PROC("cuLibraryGetKernel", 12000, cuLibraryGetKernel, NULL),
    PROC("cuLibraryUnload", 12000, cuLibraryUnload, NULL),
    PROC("cuKernelGetFunction", 12000, cuKernelGetFunction, NULL),
#ifndef FAKE_MINIMAL
    PROC("cuFuncGetName", 12030, cuFuncGetName, NULL),
    PROC("cuKernelGetName", 12030, cuKernelGetName, NULL),
    PROC("cuLaunchKernelEx", 11060, cuLaunchKernelEx, cuLaunchKernelEx_ptsz),
#endif
    PROC("cuLaunchKernel", 4000, cuLaunchKernel, cuLaunchKernel_ptsz),
    PROC("cuLaunchCooperativeKernel", 9000, cuLaunchCooperativeKernel,
         cuLaunchCooperativeKernel_ptsz),
    PROC("cuGraphLaunch", 10000, cuGraphLaunch, cuGraphLaunch_ptsz),
    PROC("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags, NULL),
    PROC("cuGraphDestroy", 10000, cuGraphDestroy, NULL),
    PROC("cuGraphExecDestroy", 10000, cuGraphExecDestroy, NULL),
    PROC("cuGraphInstantiate", 12000, cuGraphInstantiateWithFlags, NULL),
    PROC("cuGraphGetNodes", 10000, cuGraphGetNodes, NULL),
    PROC("cuGraphNodeGetType", 10000, cuGraphNodeGetType, NULL),
    PROC("cuGraphKernelNodeGetParams", 12000, cuGraphKernelNodeGetParams_v2, NULL),
    PROC("cuGraphExecKernelNodeSetParams", 12000, cuGraphExecKernelNodeSetParams_v2, NULL),
    PROC("cuGraphExecUpdate", 12000, cuGraphExecUpdate_v2, NULL),
    PROC("cuStreamCreate", 2000, cuStreamCreate, NULL),
    PROC("cuStreamDestroy", 4000, cuStreamDestroy_v2, NULL),
    PROC("cuStreamSynchronize", 2000, cuStreamSynchronize, cuStreamSynchronize_ptsz),
    PROC("cuStreamQuery", 2000, cuStreamQuery, cuStreamQuery_ptsz),
    PROC("cuStreamIsCapturing", 10000, cuStreamIsCapturing, cuStreamIsCapturing_ptsz),
    PROC("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2, cuStreamBeginCapture_v2_ptsz),
    PROC("cuStreamEndCapture", 10000, cuStreamEndCapture, cuStreamEndCapture_ptsz),
    PROC("cuEventCreate", 2000, cuEventCreate, NULL),
    PROC("cuEventDestroy", 4000, cuEventDestroy_v2, NULL),
    PROC("cuEventRecord", 2000, cuEventRecord, cuEventRecord_ptsz),
    PROC("cuEventQuery", 2000, cuEventQuery, NULL),
    PROC("cuEventSynchronize", 2000, cuEventSynchronize, NULL),
    PROC("cuEventElapsedTime", 2000, cuEventElapsedTime, NULL),
    PROC("cuMemAllocManaged", 6000, cuMemAllocManaged, NULL),
    PROC("cuMemAllocAsync", 11020, cuMemAllocAsync, cuMemAllocAsync_ptsz),
    PROC("cuMemFreeAsync", 11020, cuMemFreeAsync, cuMemFreeAsync_ptsz),
    PROC("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync,
         cuMemAllocFromPoolAsync_ptsz),
    PROC("cuMemPoolCreate", 11020, cuMemPoolCreate, NULL),
    PROC("cuMemPoolDestroy", 11020, cuMemPoolDestroy, NULL),
    PROC("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo, NULL),
    PROC("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute, NULL),
    PROC("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute, NULL),
    PROC("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool, NULL),
    PROC("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool, NULL),
    PROC("cuCtxGetDevice", 2000, cuCtxGetDevice, NULL),
    PROC("cuArrayCreate", 3020, cuArrayCreate_v2, NULL),
    PROC("cuArrayCreate", 2000, cuArrayCreate, NULL),
    PROC("cuArray3DCreate", 3020, cuArray3DCreate_v2, NULL),
    PROC("cuArray3DCreate", 2000, cuArray3DCreate, NULL),
    PROC("cuMipmappedArrayCreate", 5000, cuMipmappedArrayCreate, NULL),
    PROC("cuArrayDestroy", 2000, cuArrayDestroy, NULL),
    PROC("cuMipmappedArrayDestroy", 5000, cuMipmappedArrayDestroy, NULL),
    PROC("cuArrayGetMemoryRequirements", 11060, cuArrayGetMemoryRequirements, NULL),
    PROC("cuMipmappedArrayGetMemoryRequirements", 11060, cuMipmappedArrayGetMemoryRequirements,
         NULL),
    PROC("cuGraphCreate", 10000, cuGraphCreate, NULL),
    PROC("cuGraphAddMemAllocNode", 11040, cuGraphAddMemAllocNode, NULL),
    PROC("cuGraphAddMemFreeNode", 11040, cuGraphAddMemFreeNode, NULL),
    PROC("cuGraphAddNode", 12030, cuGraphAddNode_v2, NULL),
    PROC("cuGraphAddNode", 12020, cuGraphAddNode, NULL),
    PROC("cuMemAlloc", 3020, cuMemAlloc_v2, NULL),
    PROC("cuMemAlloc", 2000, cuMemAlloc, NULL),
    PROC("cuMemAllocPitch", 3020, cuMemAllocPitch_v2, NULL),
    PROC("cuMemAllocPitch", 2000, cuMemAllocPitch, NULL),
    PROC("cuMemFree", 3020, cuMemFree_v2, NULL),
    PROC("cuMemFree", 2000, cuMemFree, NULL),
    PROC("cuMemGetInfo", 3020, cuMemGetInfo_v2, NULL),
    PROC("cuMemGetInfo", 2000, cuMemGetInfo, NULL),
    PROC("cuMemCreate", 10020, cuMemCreate, NULL),
    PROC("cuMemRelease", 10020, cuMemRelease, NULL),
    PROC("cuMemAddressReserve", 10020, cuMemAddressReserve, NULL),
    PROC("cuMemAddressFree", 10020, cuMemAddressFree, NULL),
    PROC("cuMemMap", 10020, cuMemMap, NULL),
    PROC("cuMemUnmap", 10020, cuMemUnmap, NULL),
    PROC("cuMemSetAccess", 10020, cuMemSetAccess, NULL),
    PROC("cuIpcGetMemHandle", 4010, cuIpcGetMemHandle, NULL),
    PROC("cuIpcOpenMemHandle", 11000, cuIpcOpenMemHandle_v2, NULL),
    PROC("cuIpcCloseMemHandle", 4010, cuIpcCloseMemHandle, NULL),
    PROC("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds),
    PROC("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2, NULL),
    PROC("cuGetExportTable", 3000, cuGetExportTable, NULL),
#ifndef FAKE_MINIMAL
    PROC("cuCheckpointProcessLock", 12080, cuCheckpointProcessLock, NULL),
    PROC("cuCheckpointProcessCheckpoint", 12080, cuCheckpointProcessCheckpoint, NULL),
    PROC("cuCheckpointProcessRestore", 12080, cuCheckpointProcessRestore, NULL),
    PROC("cuCheckpointProcessUnlock", 12080, cuCheckpointProcessUnlock, NULL),
    PROC("cuCheckpointProcessGetState", 12080, cuCheckpointProcessGetState, NULL),
    PROC("cuCheckpointProcessGetRestoreThreadId", 12080, cuCheckpointProcessGetRestoreThreadId,
         NULL),
#endif
    PROC("cuGetProcAddress", 12000, cuGetProcAddress_v2, NULL),
    PROC("cuGetProcAddress", 11030, cuGetProcAddress, NULL),
};

EXPORT CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                            cuuint64_t flags,
                                            CUdriverProcAddressQueryResult *status) {
    if (symbol == NULL || pfn == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    int too_old = 0;
    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
        const proc_entry *e = &g_procs[i];
        if (strcmp(e->name, symbol) != 0) continue;
        if (version < e->min_version) {
            too_old = 1;
            continue;
        }
        int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
        *pfn = per_thread && e->per_thread ? e->per_thread : e->legacy;
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
        trace("fake cuGetProcAddress %s %s", symbol, per_thread ? "ptds" : "legacy");
        return CUDA_SUCCESS;
    }
    if (status)
        *status = too_old ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                          : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int version,
                                         cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
