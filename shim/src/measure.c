/* Measure mode (Registered.mode == SHIM_MODE_MEASURE): a record per kernel, timed with a
 * bounded pool of event pairs, harvested off the launch path and sent in MeasurementBatch
 * frames by the background thread (or at exit).
 * Owns: the pool (g_slots, g_free), the launched and in-flight pairs, the seen kernel IDs, the
 * reference event and its time, the batches to send, the counters, g_measure_ready,
 * g_measure_broken, g_measure_closed, and their locks (g_measure_lock, g_harvest_lock,
 * g_flush_lock). */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "shim_internal.h"

/* Each measured launch is bracketed by two events from the pool (recorded on the launch's
 * stream). Nothing waits for them: completed pairs are harvested with cuEventQuery at sync
 * points (after a successful real sync) and by the background thread, timed against one
 * reference event, encoded into batches and sent by the background thread (or at exit). */

#define BATCH_RECORDS 1000           /* records per MeasurementBatch frame, at most */
#define BATCH_BYTES (256 * 1024)     /* bytes per frame, at most (the dispatcher allows 1 MiB) */
#define MAX_QUEUED_BATCHES 256       /* beyond this, new records are dropped */
#define FLUSH_AFTER_NS 100000000ull  /* a partial batch waits at most this long */
#define REBASE_MS 1000.0f            /* keep float offsets from the reference below ~1 s */
#define SEEN_MAX (1u << 20)          /* kernel IDs remembered (first-launch dropping) */

struct mslot {
    CUevent start, end;
    CUstream stream;
    uint64_t id;
    const char *name; /* interned (never freed) */
    unsigned dims[6];
    struct mslot *next;
};

typedef struct batch {
    struct batch *next;
    uint8_t *data;
    size_t length, capacity;
    uint32_t count;
} batch;

typedef struct {
    uint64_t id;
    const char *name; /* NULL: empty */
} seen_entry;

/* Guarded by g_measure_lock: the pool's free list, the list of launched pairs, the seen set. */
static pthread_mutex_t g_measure_lock = PTHREAD_MUTEX_INITIALIZER;
static mslot *g_slots, *g_free, *g_new_head, *g_new_tail;
static size_t g_new_count;
static seen_entry *g_seen;
static size_t g_seen_capacity, g_seen_count;
static CUevent g_ref;          /* the reference event (first use); replaced when rebasing */
static int64_t g_base_ns;      /* CLOCK_MONOTONIC when the reference was first recorded, +
                                  the offsets of later references */
static CUcontext g_ctx;        /* current context at first use (for the background thread) */
static int g_measure_ready;    /* atomic: the pool exists */
int g_measure_broken;          /* setup failed: measure nothing */
/* Guarded by g_harvest_lock: pairs being harvested and the batches to send. */
static pthread_mutex_t g_harvest_lock = PTHREAD_MUTEX_INITIALIZER;
static mslot *g_inflight;
static size_t g_inflight_count;
static batch *g_out_head, *g_out_tail;
static size_t g_out_batches, g_out_records;
static uint64_t g_out_since_ns;
static int g_flush_due;        /* atomic: a sync point harvested records */
/* Held while batches are taken and sent: the exit flush waits for one in progress, so that
 * every batch is on the socket before Goodbye. */
static pthread_mutex_t g_flush_lock = PTHREAD_MUTEX_INITIALIZER;
int g_measure_closed;          /* atomic: the exit flush began; nothing more is measured,
                                  harvested or sent but by it */
/* Counters (atomic). */
static uint64_t g_m_skipped, g_m_dropped, g_m_sent, g_m_failed, g_m_untracked;
static int g_drop_logged;

static inline uint64_t add_u64(uint64_t *counter, uint64_t n) {
    return __atomic_add_fetch(counter, n, __ATOMIC_RELAXED);
}

/* Insert `id` (guarded): 1 inserted (its first launch), 0 known (*interned set), -1 full. */
static int seen_insert(uint64_t id, const char *name, const char **interned) {
    if (g_seen_count * 2 >= g_seen_capacity) {
        size_t capacity = g_seen_capacity ? g_seen_capacity * 2 : 1024;
        seen_entry *grown = capacity <= 2 * (size_t)SEEN_MAX ? calloc(capacity, sizeof *grown)
                                                             : NULL;
        if (grown != NULL) {
            for (size_t i = 0; i < g_seen_capacity; i++) {
                if (g_seen[i].name == NULL) continue;
                size_t j = (size_t)(g_seen[i].id * 0x9E3779B97F4A7C15ull) & (capacity - 1);
                while (grown[j].name) j = (j + 1) & (capacity - 1);
                grown[j] = g_seen[i];
            }
            free(g_seen);
            g_seen = grown;
            g_seen_capacity = capacity;
        }
    }
    if (g_seen_capacity == 0) return -1;
    size_t mask = g_seen_capacity - 1, j = (size_t)(id * 0x9E3779B97F4A7C15ull) & mask;
    for (; g_seen[j].name; j = (j + 1) & mask)
        if (g_seen[j].id == id) {
            *interned = g_seen[j].name;
            return 0;
        }
    if (g_seen_count >= SEEN_MAX || g_seen_count + 1 >= g_seen_capacity) return -1; /* full */
    char *copy = strdup(name);
    if (copy == NULL) return -1;
    g_seen[j] = (seen_entry){.id = id, .name = copy};
    g_seen_count++;
    return 1;
}

static void measure_atexit(void);

/* First use (guarded): the pool, the reference event on `key`, the exit handler. */
static int measure_setup(CUstream key) {
    if (!g_aux.event_create || !g_aux.event_record || !g_aux.event_query ||
        !g_aux.event_elapsed) {
        say(LOG_WARN, "measure mode: the driver lacks the event functions; measuring nothing");
        return -1;
    }
    g_slots = calloc((size_t)g_config.event_pool, sizeof *g_slots);
    if (g_slots == NULL || g_aux.event_create(&g_ref, CU_EVENT_DEFAULT) != CUDA_SUCCESS ||
        g_aux.event_record(g_ref, key) != CUDA_SUCCESS) {
        say(LOG_WARN, "measure mode: cannot set up the event pool; measuring nothing");
        return -1;
    }
    g_base_ns = (int64_t)now_ns();
    if (g_aux.ctx_get_current) g_aux.ctx_get_current(&g_ctx);
    for (int i = g_config.event_pool - 1; i >= 0; i--) {
        g_slots[i].next = g_free;
        g_free = &g_slots[i];
    }
    atexit(measure_atexit);
    __atomic_store_n(&g_measure_ready, 1, __ATOMIC_RELEASE);
    trace("measure start pool %d", g_config.event_pool);
    return 0;
}

/* Never record into a capture; when the driver cannot say, do not measure. */
static int measure_capturing(CUstream key) {
    if (g_aux.is_capturing == NULL) return 0; /* a driver without graphs */
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    return g_aux.is_capturing(key, &status) != CUDA_SUCCESS ||
           status != CU_STREAM_CAPTURE_STATUS_NONE;
}

static void slot_release(mslot *slot) {
    pthread_mutex_lock(&g_measure_lock);
    slot->next = g_free;
    g_free = slot;
    pthread_mutex_unlock(&g_measure_lock);
}

/* Before a launch: a slot whose start event is recorded on `key`, or NULL (not measured: a
 * capture, the first launch of its kernel ID, or the pool is exhausted). Never waits. */
mslot *measure_begin(CUstream key, const char *name, const unsigned dims[6], uint64_t id) {
    if (measure_capturing(key)) return NULL;
    const char *interned = NULL;
    pthread_mutex_lock(&g_measure_lock);
    if (!g_measure_ready && (g_measure_broken || measure_setup(key) != 0)) {
        __atomic_store_n(&g_measure_broken, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&g_measure_lock);
        return NULL;
    }
    int fresh = seen_insert(id, name, &interned);
    mslot *slot = NULL;
    if (fresh == 0) {
        slot = g_free;
        if (slot) g_free = slot->next;
    }
    pthread_mutex_unlock(&g_measure_lock);
    if (fresh != 0) { /* the first launch of an ID (warm-up) is not measured */
        if (fresh < 0) add_u64(&g_m_untracked, 1);
        return NULL;
    }
    if (slot == NULL) {
        if (add_u64(&g_m_skipped, 1) == 1)
            say(LOG_INFO, "measure mode: all %d event pairs in flight; skipping launches",
                g_config.event_pool);
        return NULL;
    }
    if ((slot->start == NULL &&
         g_aux.event_create(&slot->start, CU_EVENT_DEFAULT) != CUDA_SUCCESS) ||
        (slot->end == NULL && g_aux.event_create(&slot->end, CU_EVENT_DEFAULT) != CUDA_SUCCESS) ||
        g_aux.event_record(slot->start, key) != CUDA_SUCCESS) {
        add_u64(&g_m_failed, 1);
        slot_release(slot);
        return NULL;
    }
    slot->stream = key;
    slot->id = id;
    slot->name = interned;
    memcpy(slot->dims, dims, sizeof slot->dims);
    return slot;
}

/* After the launch: record the end event and hand the pair to the harvester. */
void measure_end(mslot *slot, CUresult launched) {
    if (launched != CUDA_SUCCESS || g_aux.event_record(slot->end, slot->stream) != CUDA_SUCCESS) {
        slot_release(slot);
        return;
    }
    slot->next = NULL;
    pthread_mutex_lock(&g_measure_lock);
    if (g_new_tail)
        g_new_tail->next = slot;
    else
        g_new_head = slot;
    g_new_tail = slot;
    g_new_count++;
    pthread_mutex_unlock(&g_measure_lock);
}

/* Append one record to the batches to send (g_harvest_lock held). */
static void emit(const gl_kernel_record *record) {
    batch *b = g_out_tail;
    if (b == NULL || b->count >= BATCH_RECORDS ||
        b->length + GL_KERNEL_RECORD_MAX > BATCH_BYTES) {
        if (g_out_batches >= MAX_QUEUED_BATCHES || (b = calloc(1, sizeof *b)) == NULL) {
            add_u64(&g_m_dropped, 1);
            return;
        }
        if (g_out_tail)
            g_out_tail->next = b;
        else
            g_out_head = b;
        g_out_tail = b;
        g_out_batches++;
    }
    if (b->capacity - b->length < GL_KERNEL_RECORD_MAX) {
        size_t capacity = b->capacity ? b->capacity * 2 : 16384;
        if (capacity > BATCH_BYTES) capacity = BATCH_BYTES;
        uint8_t *grown = realloc(b->data, capacity);
        if (grown == NULL) {
            add_u64(&g_m_dropped, 1);
            return;
        }
        b->data = grown;
        b->capacity = capacity;
    }
    if (g_out_records == 0) g_out_since_ns = now_ns();
    b->length += gl_encode_kernel_record(b->data + b->length, record);
    b->count++;
    g_out_records++;
}

static inline int64_t ms_to_ns(float ms) {
    double ns = (double)ms * 1e6;
    return (int64_t)(ns < 0 ? ns - 0.5 : ns + 0.5);
}

/* Collect every completed pair (g_harvest_lock held); never waits. Streams run in order, so
 * after a pair that is not done, later pairs of the same stream are not asked about. */
static void harvest(void) {
    if (__atomic_load_n(&g_measure_closed, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&g_measure_lock);
    mslot *fresh = g_new_head;
    size_t fresh_count = g_new_count;
    g_new_head = g_new_tail = NULL;
    g_new_count = 0;
    pthread_mutex_unlock(&g_measure_lock);
    if (fresh) { /* append, keeping launch order */
        mslot **tail = &g_inflight;
        while (*tail) tail = &(*tail)->next;
        *tail = fresh;
        g_inflight_count += fresh_count;
    }
    if (g_inflight == NULL || g_aux.event_query(g_ref) != CUDA_SUCCESS) return;
    CUstream blocked[16];
    int nblocked = 0;
    mslot *done = NULL, **link = &g_inflight;
    while (*link) {
        mslot *slot = *link;
        int skip = 0;
        for (int i = 0; i < nblocked && !skip; i++) skip = blocked[i] == slot->stream;
        CUresult ready = skip ? CUDA_ERROR_NOT_READY : g_aux.event_query(slot->end);
        /* Both ends from the reference: events that share a GPU timestamp (one kernel's end,
         * the next one's start) get the same ns, so gaps are never negative. Far from the
         * reference (after a long pause) float ms are coarse: then the duration is measured
         * on its own. */
        float start_ms = 0, end_ms = 0, duration_ms = 0;
        if (ready == CUDA_SUCCESS) {
            CUresult a = g_aux.event_elapsed(&start_ms, g_ref, slot->start);
            CUresult b = g_aux.event_elapsed(&end_ms, g_ref, slot->end);
            if (a == CUDA_SUCCESS && b == CUDA_SUCCESS && end_ms > 2 * REBASE_MS)
                b = g_aux.event_elapsed(&duration_ms, slot->start, slot->end);
            if (a == CUDA_ERROR_NOT_READY || b == CUDA_ERROR_NOT_READY)
                ready = CUDA_ERROR_NOT_READY;
            else if (a != CUDA_SUCCESS || b != CUDA_SUCCESS)
                ready = a != CUDA_SUCCESS ? a : b;
        }
        if (ready == CUDA_ERROR_NOT_READY) {
            if (!skip && nblocked < (int)(sizeof blocked / sizeof blocked[0]))
                blocked[nblocked++] = slot->stream;
            link = &slot->next;
            continue;
        }
        *link = slot->next;
        g_inflight_count--;
        if (ready == CUDA_SUCCESS) {
            int64_t start = g_base_ns + ms_to_ns(start_ms);
            int64_t end = end_ms > 2 * REBASE_MS ? start + ms_to_ns(duration_ms)
                                                 : g_base_ns + ms_to_ns(end_ms);
            if (start < 1) start = 1;
            if (end < start) end = start;
            gl_kernel_record record = {.kernel_id = slot->id,
                                       .name = slot->name,
                                       .start_ns = (uint64_t)start,
                                       .end_ns = (uint64_t)end};
            for (int i = 0; i < 6; i++) record.dims[i] = slot->dims[i];
            emit(&record);
            /* Float ms lose precision far from the reference (61 ns at 1 s): move the
             * reference to this end event; its time is, by definition, the record's end. */
            if (end_ms > REBASE_MS) {
                CUevent old = g_ref;
                g_ref = slot->end;
                slot->end = old;
                g_base_ns = end;
            }
        } else {
            add_u64(&g_m_failed, 1);
        }
        slot->next = done;
        done = slot;
    }
    if (done) {
        mslot *last = done;
        while (last->next) last = last->next;
        pthread_mutex_lock(&g_measure_lock);
        last->next = g_free;
        g_free = done;
        pthread_mutex_unlock(&g_measure_lock);
    }
}

static void note_dropped(uint64_t count, const char *why) {
    if (count == 0) return;
    add_u64(&g_m_dropped, count);
    if (!__atomic_exchange_n(&g_drop_logged, 1, __ATOMIC_ACQ_REL))
        say(LOG_WARN, "measure mode: %s; dropping kernel measurements", why);
}

/* Send the queued batches when due (or `force`); drop them when the dispatcher is gone.
 * Sends are bounded by the socket's send timeout (GPULOOM_SHIM_WAIT_MS). */
static void measure_flush(int force) {
    pthread_mutex_lock(&g_flush_lock);
    if (!force && __atomic_load_n(&g_measure_closed, __ATOMIC_ACQUIRE)) {
        pthread_mutex_unlock(&g_flush_lock);
        return;
    }
    pthread_mutex_lock(&g_harvest_lock);
    int due = force || g_out_records >= BATCH_RECORDS ||
              __atomic_exchange_n(&g_flush_due, 0, __ATOMIC_ACQ_REL) ||
              (g_out_records && now_ns() - g_out_since_ns >= FLUSH_AFTER_NS);
    batch *list = due ? g_out_head : NULL;
    if (list) {
        g_out_head = g_out_tail = NULL;
        g_out_batches = g_out_records = 0;
    }
    pthread_mutex_unlock(&g_harvest_lock);
    while (list) {
        batch *b = list;
        list = b->next;
        if (conn_state() != CONN_CONNECTED) {
            note_dropped(b->count, "no dispatcher");
        } else if (send_batch(b->data, b->length) == 0) {
            add_u64(&g_m_sent, b->count);
            trace("measure sent %u", b->count);
        } else {
            note_dropped(b->count, "cannot send to the dispatcher");
        }
        free(b->data);
        free(b);
    }
    pthread_mutex_unlock(&g_flush_lock);
}

/* At a sync point, after the real call succeeded (so no capture forbids querying). */
void measure_sync_point(void) {
    if (!__atomic_load_n(&g_measure_ready, __ATOMIC_ACQUIRE) ||
        __atomic_load_n(&g_measure_closed, __ATOMIC_RELAXED))
        return;
    /* Waits for a harvest the background thread is in the middle of (it never waits itself):
     * that one may have asked about the pairs before this sync completed them, and skipped,
     * this sync would leave them taken until the background's next round, and the launches
     * right after the sync would find the pool exhausted. */
    pthread_mutex_lock(&g_harvest_lock);
    harvest();
    int have = g_out_records > 0;
    pthread_mutex_unlock(&g_harvest_lock);
    if (have) {
        __atomic_store_n(&g_flush_due, 1, __ATOMIC_RELEASE);
        background_wake();
    }
}

/* The background thread's share: harvest, send what is due. */
void measure_background(void) {
    static __thread int prepared;
    if (!__atomic_load_n(&g_measure_ready, __ATOMIC_ACQUIRE) ||
        __atomic_load_n(&g_measure_closed, __ATOMIC_ACQUIRE))
        return;
    if (!prepared) {
        prepared = 1;
        /* Another thread's global-mode capture must not forbid (or be broken by) our queries. */
        if (g_aux.exchange_capture_mode) {
            CUstreamCaptureMode relaxed = CU_STREAM_CAPTURE_MODE_RELAXED;
            g_aux.exchange_capture_mode(&relaxed);
        }
        if (g_ctx && g_aux.ctx_set_current) g_aux.ctx_set_current(g_ctx);
    }
    pthread_mutex_lock(&g_harvest_lock);
    harvest();
    pthread_mutex_unlock(&g_harvest_lock);
    measure_flush(0);
}

/* At exit (before the driver's own exit handlers, registered earlier): wait a little for the
 * pairs in flight, send everything, report what was not measured. */
static void measure_atexit(void) {
    uint64_t wait_ns = (uint64_t)(g_config.wait_ms < 1000 ? g_config.wait_ms : 1000) * 1000000u;
    uint64_t deadline = now_ns() + wait_ns;
    size_t left;
    for (;;) {
        pthread_mutex_lock(&g_harvest_lock);
        harvest();
        left = g_inflight_count;
        pthread_mutex_unlock(&g_harvest_lock);
        if (left == 0 || conn_state() != CONN_CONNECTED || now_ns() >= deadline) break;
        struct timespec pause = {.tv_sec = 0, .tv_nsec = 1000000};
        nanosleep(&pause, NULL);
    }
    /* From here on nothing is harvested or sent but by this flush (which first waits for one
     * that the background thread may be in the middle of). */
    __atomic_store_n(&g_measure_closed, 1, __ATOMIC_RELEASE);
    measure_flush(1);
    pthread_mutex_lock(&g_harvest_lock);
    left = g_inflight_count;
    pthread_mutex_unlock(&g_harvest_lock);
    pthread_mutex_lock(&g_measure_lock);
    left += g_new_count;
    pthread_mutex_unlock(&g_measure_lock);
    uint64_t skipped = __atomic_load_n(&g_m_skipped, __ATOMIC_RELAXED);
    uint64_t dropped = __atomic_load_n(&g_m_dropped, __ATOMIC_RELAXED) + left;
    uint64_t failed = __atomic_load_n(&g_m_failed, __ATOMIC_RELAXED);
    uint64_t untracked = __atomic_load_n(&g_m_untracked, __ATOMIC_RELAXED);
    if (skipped)
        say(LOG_WARN,
            "measure mode: launches not measured: %llu (all %d event pairs were in flight; "
            "GPULOOM_SHIM_EVENT_POOL)",
            (unsigned long long)skipped, g_config.event_pool);
    if (dropped)
        say(LOG_WARN,
            "measure mode: kernel records dropped: %llu (no dispatcher, or not finished at "
            "exit)",
            (unsigned long long)dropped);
    if (failed || untracked)
        say(LOG_INFO, "measure mode: %llu event errors, %llu launches of untracked kernel IDs",
            (unsigned long long)failed, (unsigned long long)untracked);
    trace("measure exit sent %llu skipped %llu dropped %llu",
          (unsigned long long)__atomic_load_n(&g_m_sent, __ATOMIC_RELAXED),
          (unsigned long long)skipped, (unsigned long long)dropped);
}

int measure_ready(void) { return __atomic_load_n(&g_measure_ready, __ATOMIC_ACQUIRE); }
