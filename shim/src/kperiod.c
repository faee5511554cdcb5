/* Iteration boundaries from the kernel stream: a training loop launches the same sequence of
 * kernels every mini-batch, whatever its allocator does (PyTorch's caching allocator allocates
 * once and reuses: its memory samples show no cycle, its launches do). Every launch's kernel
 * (its function and dimensions) and time go into a ring; every KP_EVERY launches the smallest
 * period p (1..KP_MAX_PERIOD launches) for which the recent launches repeat with that period
 * (kp_period: at most 5% of the positions differ) is taken as the loop's; the
 * iteration's boundary is the launch that follows the longest host gap within the last period
 * (data loading, the step's end), and the period's duration the mean time between boundaries
 * seen in the ring. Published in the admission region (GL_OFF_KP_*, wire.h) and the trace;
 * each later launch at the boundary's phase refreshes the boundary's time there.
 * Runs only while the dispatcher samples memory for training introspection (the region's
 * sample period set): otherwise a launch pays nothing but that check.
 * The dispatcher, asked to suspend a process whose memory samples show no cycle, waits for
 * the host gap before the next boundary, so that the shim parks at the boundary's launch
 * (services/dispatcher/core.py). Owns: g_kp_ids, g_kp_ns, g_kp_count, g_kp_lock and the detection buffers. */
#define _GNU_SOURCE
#include "shim_internal.h"

#define KP_RING 4096u /* launches kept (a power of two) */
#define KP_MAX_PERIOD 1024u
#define KP_EVERY 256u /* launches between two detections */

static uint64_t g_kp_ids[KP_RING];
static uint64_t g_kp_ns[KP_RING];
static uint64_t g_kp_count; /* atomic: launches recorded */
static pthread_mutex_t g_kp_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_kp_snap_ids[KP_RING], g_kp_snap_ns[KP_RING]; /* under g_kp_lock */
static uint32_t g_kp_published;                                /* under g_kp_lock */
/* The period found (atomic; 0: none) and the launch index of a boundary: every launch at that
 * phase refreshes the region's boundary time, so it stays current between detections (and
 * after a suspension, which shifts the loop's phase in time, not in launches). */
static uint32_t g_kp_period;
static uint64_t g_kp_boundary_index;

/* The period of the last `have` launches (oldest first), 0 when they do not repeat: the
 * smallest p for which each of the last max(2p, KP_WINDOW) launches (at least three periods of
 * history) equals the one p before it, at most 5% excepted. The window keeps a short run of
 * one kernel (a layer's forward kernel launched four times) from passing for the loop. */
#define KP_WINDOW 512u
static uint32_t kp_period(const uint64_t *ids, uint64_t have) {
    for (uint32_t p = 1; p <= KP_MAX_PERIOD && 3u * p <= have; p++) {
        uint64_t window = 2u * p > KP_WINDOW ? 2u * p : KP_WINDOW;
        if (window > have - p) window = have - p;
        uint64_t allowed = window / 20u, bad = 0, k = have;
        while (k-- > have - window)
            if (ids[k] != ids[k - p] && ++bad > allowed) break;
        if (bad <= allowed) return p;
    }
    return 0;
}

static void kp_detect(uint64_t count, uint8_t *r) {
    if (pthread_mutex_trylock(&g_kp_lock) != 0) return; /* another thread is at it */
    uint64_t have = count < KP_RING ? count : KP_RING, first = count - have;
    for (uint64_t k = 0; k < have; k++) {
        g_kp_snap_ids[k] = g_kp_ids[(first + k) & (KP_RING - 1)];
        g_kp_snap_ns[k] = g_kp_ns[(first + k) & (KP_RING - 1)];
    }
    uint32_t p = kp_period(g_kp_snap_ids, have);
    uint64_t period_ns = 0, boundary_ns = 0, gap_us = 0;
    if (p > 0) {
        uint64_t j = have - p, widest = 0;
        for (uint64_t k = have - p; k < have; k++) {
            uint64_t gap = g_kp_snap_ns[k] - g_kp_snap_ns[k - 1];
            if (gap >= widest) widest = gap, j = k;
        }
        uint64_t periods = j / p; /* boundaries j, j - p, ... back to the ring's start */
        period_ns = (g_kp_snap_ns[j] - g_kp_snap_ns[j - periods * p]) / periods;
        boundary_ns = g_kp_snap_ns[j];
        gap_us = widest / 1000u < UINT32_MAX ? widest / 1000u : UINT32_MAX;
        __atomic_store_n(&g_kp_boundary_index, first + j, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&g_kp_period, p, __ATOMIC_RELEASE);
    w_u32(r, GL_OFF_KP_PERIOD, p);
    w_u32(r, GL_OFF_KP_GAP_US, (uint32_t)gap_us);
    w_u64(r, GL_OFF_KP_PERIOD_NS, period_ns);
    w_u64(r, GL_OFF_KP_BOUNDARY_NS, boundary_ns);
    if (p != g_kp_published || p > 0)
        trace("kperiod kernels=%u period_ns=%llu boundary_ns=%llu", p,
              (unsigned long long)period_ns, (unsigned long long)boundary_ns);
    g_kp_published = p;
    pthread_mutex_unlock(&g_kp_lock);
}

void kp_note_launch(CUfunction f, const unsigned dims[6]) {
    uint8_t *r = region();
    if (r == NULL || r_u32(r, GL_OFF_SAMPLE_PERIOD) == 0) return;
    uint64_t id = (uint64_t)(uintptr_t)f * 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < 6; i++) id = (id ^ dims[i]) * 0x100000001b3ull;
    uint64_t n = __atomic_fetch_add(&g_kp_count, 1, __ATOMIC_RELAXED), t = now_ns();
    g_kp_ids[n & (KP_RING - 1)] = id;
    g_kp_ns[n & (KP_RING - 1)] = t;
    uint32_t p = __atomic_load_n(&g_kp_period, __ATOMIC_ACQUIRE);
    uint64_t at = __atomic_load_n(&g_kp_boundary_index, __ATOMIC_RELAXED);
    if (p != 0 && n > at && (n - at) % p == 0) w_u64(r, GL_OFF_KP_BOUNDARY_NS, t);
    if (UNLIKELY((n + 1) % KP_EVERY == 0)) kp_detect(n + 1, r);
}
