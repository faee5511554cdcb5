/* The lease part of the admission engine (see leasedesk.h, engine.c and docs/dispatcher.md).
 *
 * One round: for every process whose request sequence number moved, validate its request
 * words, then either renew its lease from its standing terms (write the lease words, bump the
 * epoch, FUTEX_WAKE) or forward the request to Python; journal either. A round costs a
 * microsecond or two per request. */
#define _GNU_SOURCE
#include "leasedesk.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "native.h"
#include "wire.h"

/* A report of more GPU time than this in one lease is garbage, not a measurement (the same
 * bound as the Python channel's). */
#define MAX_REPORTED_NS (3600ull * 1000000000ull)

typedef struct {
    int used;
    uint8_t *region;
    uint32_t seen_seq;
    uint32_t untaken; /* events of this slot in the journal */
    int has_terms;
    gl_desk_terms terms;
    uint64_t budget_ns;      /* what is left of the limit this window */
    uint64_t native_lease;   /* the last lease the desk granted it ... */
    uint64_t native_charge;  /* ... and what that lease took from the budget */
    int64_t untaken_charge;  /* the net charges of its events Python has not taken */
} desk_slot;

struct gl_desk {
    int notify;
    int notified;   /* notify written, events not taken since */
    int throttled;  /* some slot was skipped for too many untaken events */
    uint32_t high;  /* slots at or above this are unused */
    uint64_t next_lease;
    gl_desk_stats stats;
    gl_desk_event journal[GL_DESK_JOURNAL];
    uint32_t head, count;
    desk_slot slots[GL_DESK_MAX_SLOTS];
};

static void notify_python(gl_desk *d) {
    if (d->notified) return;
    d->notified = 1;
    ring_eventfd(d->notify);
}

/* The same stores, in the same order, as AdmissionRegion.publish_lease: the epoch last, so a
 * woken shim sees the new lease. */
static void publish_lease(uint8_t *r, uint64_t lease_id, uint64_t until_ns) {
    store64(r, GL_OFF_LEASE_ID, lease_id);
    store64(r, GL_OFF_ADMIT_UNTIL, until_ns);
    store32(r, GL_OFF_STATE, GL_STATE_LEASED);
    store32(r, GL_OFF_EPOCH, load32(r, GL_OFF_EPOCH) + 1);
    wake_word(r, GL_OFF_EPOCH);
}

static void record(gl_desk *d, uint32_t slot, const gl_desk_event *event) {
    d->journal[(d->head + d->count) % GL_DESK_JOURNAL] = *event;
    d->count++;
    d->slots[slot].untaken++;
    d->slots[slot].untaken_charge += event->charge_ns;
    if (d->count >= GL_DESK_JOURNAL / 4 || d->slots[slot].untaken >= GL_DESK_SLOT_EVENTS / 2)
        notify_python(d);
}

static uint64_t add_capped(uint64_t a, uint64_t b, uint64_t cap) {
    return a >= cap || b >= cap - a ? cap : a + b;
}

/* A window ended: the scheduler lowers what the client used by its limit per window passed,
 * not below 0, so what is left of the limit grows by as much, to at most the limit. */
static void roll(desk_slot *s, uint64_t now) {
    gl_desk_terms *t = &s->terms;
    if (now < t->window_end_ns) return;
    uint64_t passed = (now - t->window_end_ns) / t->window_ns + 1;
    t->window_end_ns += passed * t->window_ns;
    if (s->budget_ns == GL_DESK_FOREVER) return;
    uint64_t grow = passed > GL_DESK_FOREVER / (t->limit_ns | 1) ? GL_DESK_FOREVER
                                                                  : passed * t->limit_ns;
    s->budget_ns = add_capped(s->budget_ns, grow, t->limit_ns);
}

/* The usage report of the lease that ended gives back what that lease took from the budget
 * beyond what it used (or takes what it used beyond it), as the scheduler's charging does.
 * Returns the net change to the budget (positive: given back). */
static int64_t settle(desk_slot *s, const gl_desk_event *e) {
    if (!(e->flags & GL_LR_REPORT) || e->report_lease == 0 ||
        e->report_lease != s->native_lease || s->budget_ns == GL_DESK_FOREVER)
        return 0;
    uint64_t charged = s->native_charge, before = s->budget_ns;
    s->native_lease = 0;
    if (e->gpu_ns < charged) {
        s->budget_ns = add_capped(s->budget_ns, charged - e->gpu_ns, s->terms.limit_ns);
        return (int64_t)(s->budget_ns - before);
    }
    uint64_t more = e->gpu_ns - charged;
    s->budget_ns -= more < s->budget_ns ? more : s->budget_ns;
    return -(int64_t)(before - s->budget_ns);
}

/* The lease length the terms give now, or 0: leave it to Python. */
static uint64_t renewal_length(const desk_slot *s) {
    if (!s->has_terms) return 0;
    uint64_t length = s->terms.lease_ns;
    if (length == GL_DESK_FOREVER) return length;
    if (s->budget_ns != GL_DESK_FOREVER && length > s->budget_ns) length = s->budget_ns;
    return length >= s->terms.min_lease_ns && length > 0 ? length : 0;
}

static void take_request(gl_desk *d, uint32_t slot, uint64_t now) {
    desk_slot *s = &d->slots[slot];
    uint8_t *r = s->region;
    uint32_t seq = load32(r, GL_OFF_LR_SEQ);
    if (seq == s->seen_seq) return;
    if (d->count == GL_DESK_JOURNAL || s->untaken >= GL_DESK_SLOT_EVENTS) {
        /* Read again once Python has taken events: a flood costs only its sender. */
        d->stats.throttled++;
        d->throttled = 1;
        notify_python(d);
        return;
    }
    s->seen_seq = seq;
    d->stats.requests++;
    gl_desk_event e = {.slot = slot, .seq = seq, .at_ns = now};
    uint32_t flags = load32(r, GL_OFF_LR_FLAGS);
    e.posted_ns = load64(r, GL_OFF_LR_POST_NS);
    if (e.posted_ns > now || now - e.posted_ns > 1000000000ull) e.posted_ns = now;
    if (flags & ~(uint32_t)(GL_LR_REPORT | GL_LR_RELEASE)) {
        d->stats.invalid_writes++;
        e.flags = GL_DESK_INVALID;
    } else if (flags & GL_LR_REPORT) {
        e.report_lease = load64(r, GL_OFF_LR_LEASE);
        e.gpu_ns = load64(r, GL_OFF_LR_GPU_NS);
        e.burst_ns = load64(r, GL_OFF_LR_BURST_NS);
        e.allocated_bytes = load64(r, GL_OFF_LR_ALLOCATED);
        e.flags = flags;
        if (e.gpu_ns > MAX_REPORTED_NS || e.burst_ns > MAX_REPORTED_NS) {
            d->stats.invalid_writes++;
            e.flags = GL_DESK_INVALID;
        }
    }
    uint64_t length = 0;
    int64_t given_back = 0;
    if (!(e.flags & GL_DESK_INVALID) && s->has_terms) {
        roll(s, now);
        given_back = settle(s, &e);
        length = renewal_length(s);
    }
    e.charge_ns = -given_back;
    if (length == 0) {
        e.kind = GL_DESK_FORWARDED;
        d->stats.forwarded++;
        record(d, slot, &e);
        notify_python(d);
        return;
    }
    e.kind = GL_DESK_RENEWED;
    e.lease_id = GL_DESK_LEASE_BASE | d->next_lease++;
    e.until_ns = length == GL_DESK_FOREVER ? GL_DESK_FOREVER : now + length;
    if (length != GL_DESK_FOREVER && s->budget_ns != GL_DESK_FOREVER) {
        s->budget_ns -= length;
        e.charge_ns += (int64_t)length;
    }
    s->native_lease = e.lease_id;
    s->native_charge = length == GL_DESK_FOREVER ? 0 : length;
    publish_lease(r, e.lease_id, e.until_ns);
    d->stats.renewed++;
    record(d, slot, &e);
}

void gl_desk_round(gl_desk *d, uint64_t now) {
    d->stats.rounds++;
    for (uint32_t t = 0; t < d->high; t++)
        if (d->slots[t].used) take_request(d, t, now);
}

gl_desk *gl_desk_new(int notify_fd) {
    if (notify_fd < 0) {
        errno = EINVAL;
        return NULL;
    }
    gl_desk *d = calloc(1, sizeof *d);
    if (d == NULL) return NULL;
    d->notify = notify_fd;
    d->next_lease = 1;
    return d;
}

static void release_slot(gl_desk *d, uint32_t slot) {
    desk_slot *s = &d->slots[slot];
    if (s->region != NULL) munmap(s->region, GL_REGION_BYTES);
    memset(s, 0, sizeof *s);
}

void gl_desk_free(gl_desk *d) {
    if (d == NULL) return;
    for (uint32_t t = 0; t < GL_DESK_MAX_SLOTS; t++) release_slot(d, t);
    free(d);
}

int gl_desk_add(gl_desk *d, int region_fd) {
    struct stat st;
    if (d == NULL || fstat(region_fd, &st) != 0 || st.st_size < (off_t)GL_REGION_BYTES) {
        errno = EINVAL;
        return -1;
    }
    void *mapped =
        mmap(NULL, GL_REGION_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, region_fd, 0);
    if (mapped == MAP_FAILED) return -1;
    int slot = -1;
    for (uint32_t t = 0; t < GL_DESK_MAX_SLOTS && slot < 0; t++)
        if (!d->slots[t].used) slot = (int)t;
    if (slot < 0) {
        munmap(mapped, GL_REGION_BYTES);
        errno = ENOSPC;
        return -1;
    }
    desk_slot *s = &d->slots[slot];
    *s = (desk_slot){.used = 1, .region = mapped};
    s->seen_seq = load32(s->region, GL_OFF_LR_SEQ);
    if ((uint32_t)slot >= d->high) d->high = (uint32_t)slot + 1;
    d->stats.slots++;
    return slot;
}

void gl_desk_remove(gl_desk *d, int slot) {
    if (d == NULL || slot < 0 || slot >= (int)GL_DESK_MAX_SLOTS) return;
    if (d->slots[slot].used) {
        /* Its events go: compact the journal without them. */
        uint32_t kept = 0;
        for (uint32_t i = 0; i < d->count; i++) {
            gl_desk_event *e = &d->journal[(d->head + i) % GL_DESK_JOURNAL];
            if (e->slot != (uint32_t)slot)
                d->journal[(d->head + kept++) % GL_DESK_JOURNAL] = *e;
        }
        d->count = kept;
        release_slot(d, (uint32_t)slot);
        d->stats.slots--;
        while (d->high > 0 && !d->slots[d->high - 1].used) d->high--;
    }
}

int gl_desk_set_terms(gl_desk *d, int slot, const gl_desk_terms *terms) {
    if (d == NULL || slot < 0 || slot >= (int)GL_DESK_MAX_SLOTS ||
        (terms != NULL && (terms->lease_ns == 0 || terms->window_ns == 0 ||
                           (terms->budget_ns != GL_DESK_FOREVER &&
                            terms->budget_ns > terms->limit_ns)))) {
        errno = EINVAL;
        return -1;
    }
    desk_slot *s = &d->slots[slot];
    if (!s->used) {
        errno = ENOENT;
        return -1;
    }
    s->has_terms = terms != NULL;
    if (terms != NULL) {
        s->terms = *terms;
        s->budget_ns = terms->budget_ns;
        if (s->budget_ns != GL_DESK_FOREVER) {
            /* Python's books hold the events it took; the others' charges come off here. */
            int64_t pending = s->untaken_charge;
            if (pending > 0)
                s->budget_ns -= (uint64_t)pending < s->budget_ns ? (uint64_t)pending : s->budget_ns;
            else
                s->budget_ns = add_capped(s->budget_ns, (uint64_t)(-pending), terms->limit_ns);
        }
    }
    /* A request that came while it had no terms was forwarded already; none is lost. */
    return 0;
}

void gl_desk_revoke_all(gl_desk *d) {
    for (uint32_t t = 0; t < d->high; t++) d->slots[t].has_terms = 0;
}

uint32_t gl_desk_take(gl_desk *d, gl_desk_event *out, uint32_t max, int *rescan) {
    uint32_t n = d->count < max ? d->count : max;
    for (uint32_t i = 0; i < n; i++) {
        out[i] = d->journal[d->head];
        d->head = (d->head + 1) % GL_DESK_JOURNAL;
        desk_slot *s = &d->slots[out[i].slot];
        if (s->untaken > 0) s->untaken--;
        s->untaken_charge -= out[i].charge_ns;
    }
    d->count -= n;
    d->notified = 0;
    *rescan = d->throttled;
    d->throttled = 0;
    return n;
}

void gl_desk_get_stats(const gl_desk *d, gl_desk_stats *out) {
    *out = d->stats;
    out->pending = d->count;
}
