/* The FIKIT decision core; see fikit.h and docs/fikit.md ("Decision core"). */
#include "fikit.h"

#include <string.h>

#define GL_FK_MAGIC 0x676c666b636f7231ULL /* "glfkcor1" */

/* ---- small helpers ---------------------------------------------------------------------- */

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

static uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

/* GL_FK_UNKNOWN stays unknown; anything else is clamped to GL_FK_MAX_NS. */
static uint64_t clamp_ns(uint64_t ns) {
    if (ns == GL_FK_UNKNOWN)
        return ns;
    return ns > GL_FK_MAX_NS ? GL_FK_MAX_NS : ns;
}

static int valid(const gl_fk_core *core) { return core != NULL && core->magic == GL_FK_MAGIC; }

/* Time never runs backwards inside the core: an earlier `now` is taken as the latest seen. */
static uint64_t advance(gl_fk_core *core, uint64_t now) {
    if (now > core->now_ns)
        core->now_ns = now;
    return core->now_ns;
}

static gl_fk_task *task_at(gl_fk_core *core, uint32_t task) {
    if (task >= GL_FK_MAX_TASKS || !core->tasks[task].active)
        return NULL;
    return &core->tasks[task];
}

static int32_t best_priority(const gl_fk_core *core) {
    int32_t best = -1;
    for (uint32_t i = 0; i < GL_FK_MAX_TASKS; i++) {
        const gl_fk_task *t = &core->tasks[i];
        if (t->active && (best < 0 || t->priority < best))
            best = t->priority;
    }
    return best;
}

/* The holder set changed (a task came or went): a window of a former holder closes. */
static void refresh_holder(gl_fk_core *core) {
    int32_t best = best_priority(core);
    if (best != core->holder_priority) {
        if (core->holder_priority >= 0 && best >= 0)
            core->counters.holder_switches++;
        core->holder_priority = best;
    }
    if (core->window_open) {
        const gl_fk_task *owner = &core->tasks[core->window_owner];
        if (!owner->active || owner->priority != best)
            core->window_open = 0;
    }
}

/* ---- outstanding work ------------------------------------------------------------------- */

static void push_outstanding(gl_fk_core *core, gl_fk_task *t, uint64_t duration, int fill) {
    int known = duration != GL_FK_UNKNOWN;
    core->out_count++;
    if (t->overflow > 0 || t->out_count >= GL_FK_MAX_OUTSTANDING) {
        /* Beyond the FIFO: remembered as unknown-length, in order after every FIFO entry. */
        t->overflow++;
        core->counters.overflowed++;
        t->known_unknown++;
        core->out_unknown++;
        if (fill) {
            t->overflow_fill++;
            t->fill_count++;
            t->fill_unknown++;
            core->fill_count++;
            core->fill_unknown++;
        }
        return;
    }
    uint32_t slot = (t->out_head + t->out_count) % GL_FK_MAX_OUTSTANDING;
    t->out_dur[slot] = duration;
    if (fill)
        t->out_fill_mask |= 1ULL << slot;
    else
        t->out_fill_mask &= ~(1ULL << slot);
    t->out_count++;
    if (known) {
        t->out_ns += duration;
        core->out_ns += duration;
    } else {
        t->known_unknown++;
        core->out_unknown++;
    }
    if (fill) {
        t->fill_count++;
        core->fill_count++;
        if (known) {
            t->fill_ns += duration;
            core->fill_ns += duration;
        } else {
            t->fill_unknown++;
            core->fill_unknown++;
        }
    }
}

static void pop_outstanding(gl_fk_core *core, gl_fk_task *t) {
    if (t->out_count > 0) {
        uint32_t slot = t->out_head;
        uint64_t duration = t->out_dur[slot];
        int fill = (t->out_fill_mask >> slot) & 1;
        t->out_head = (t->out_head + 1) % GL_FK_MAX_OUTSTANDING;
        t->out_count--;
        core->out_count--;
        if (duration != GL_FK_UNKNOWN) {
            t->out_ns -= duration;
            core->out_ns -= duration;
        } else {
            t->known_unknown--;
            core->out_unknown--;
        }
        if (fill) {
            t->fill_count--;
            core->fill_count--;
            if (duration != GL_FK_UNKNOWN) {
                t->fill_ns -= duration;
                core->fill_ns -= duration;
            } else {
                t->fill_unknown--;
                core->fill_unknown--;
            }
        }
    } else if (t->overflow > 0) {
        /* Which overflow entries were fills is not kept: count fills off first (the
         * conservative choice only delays later idle fills until the rest completes). */
        t->overflow--;
        core->out_count--;
        t->known_unknown--;
        core->out_unknown--;
        if (t->overflow_fill > 0) {
            t->overflow_fill--;
            t->fill_count--;
            t->fill_unknown--;
            core->fill_count--;
            core->fill_unknown--;
        }
    }
}

static uint32_t outstanding(const gl_fk_task *t) { return t->out_count + t->overflow; }

/* ---- admission -------------------------------------------------------------------------- */

/* Puts one kernel of task `id` on the predicted device queue and updates its idle estimate. */
static void admit(gl_fk_core *core, uint32_t id, uint64_t duration, uint64_t gap, int fill,
                  uint64_t now) {
    gl_fk_task *t = &core->tasks[id];
    uint64_t end = now;
    if (duration != GL_FK_UNKNOWN) {
        core->tail_ns = sat_add(max_u64(now, core->tail_ns), duration);
        end = core->tail_ns;
    }
    push_outstanding(core, t, duration, fill);
    t->last_gap_known = gap != GL_FK_UNKNOWN;
    t->last_gap_ns = t->last_gap_known ? gap : 0;
    /* Its next launch is expected a gap after this kernel's predicted end (or its launch
     * when the duration is unknown). */
    t->idle_at_ns = sat_add(sat_add(end, t->last_gap_ns), core->config.idle_margin_ns);
}

static void admit_holder(gl_fk_core *core, uint32_t id, uint64_t duration, uint64_t gap,
                         uint64_t now) {
    /* Early stop: the holder's launch ends the current gap window at once. */
    if (core->window_open) {
        if (now < core->window_end_ns)
            core->counters.windows_closed_early++;
        core->window_open = 0;
    }
    admit(core, id, duration, gap, 0, now);
    core->counters.admitted_holder++;
    if (duration != GL_FK_UNKNOWN && gap != GL_FK_UNKNOWN &&
        gap >= core->config.gap_threshold_ns && gap > 0) {
        core->window_open = 1;
        core->window_owner = id;
        core->window_end_ns = sat_add(core->tail_ns, gap);
        core->counters.windows_opened++;
    }
}

/* All holders idle: each has nothing outstanding and its expected next launch is overdue. */
static int holders_idle(const gl_fk_core *core, uint64_t now, uint64_t *wake) {
    uint64_t latest = 0;
    int waiting_on_completion = 0;
    for (uint32_t i = 0; i < GL_FK_MAX_TASKS; i++) {
        const gl_fk_task *t = &core->tasks[i];
        if (!t->active || (int32_t)t->priority != core->holder_priority)
            continue;
        if (outstanding(t) > 0)
            waiting_on_completion = 1;
        latest = max_u64(latest, t->idle_at_ns);
    }
    if (waiting_on_completion) {
        *wake = UINT64_MAX; /* gl_fk_completed is the event that changes it */
        return 0;
    }
    if (now >= latest)
        return 1;
    *wake = latest;
    return 0;
}

enum { MODE_NONE, MODE_WINDOW, MODE_IDLE };

/* May this request go now in this mode? */
static int fits(const gl_fk_core *core, const gl_fk_task *t, int mode, uint64_t now) {
    uint64_t d = t->req_duration_ns;
    if (mode == MODE_WINDOW) {
        /* No fill for unknown kernels. */
        return d != GL_FK_UNKNOWN &&
               sat_add(sat_add(max_u64(now, core->tail_ns), d), core->config.fill_guard_ns) <=
                   core->window_end_ns;
    }
    if (core->fill_count == 0)
        return 1; /* one kernel always may go when no fill work is outstanding */
    if (d == GL_FK_UNKNOWN || core->fill_unknown > 0)
        return 0;
    return sat_add(core->fill_ns, d) <= core->config.idle_backlog_ns;
}

/* BestPrioFit: the best priority with a fitting request, and there the longest waiting. */
static int best_prio_fit(const gl_fk_core *core, int mode, uint64_t now) {
    int pick = -1;
    for (uint32_t i = 0; i < GL_FK_MAX_TASKS; i++) {
        const gl_fk_task *t = &core->tasks[i];
        if (!t->active || !t->has_request || (int32_t)t->priority == core->holder_priority)
            continue;
        if (pick >= 0) {
            const gl_fk_task *b = &core->tasks[pick];
            if (t->priority > b->priority ||
                (t->priority == b->priority && t->req_seq > b->req_seq))
                continue;
        }
        if (fits(core, t, mode, now))
            pick = (int)i;
    }
    return pick;
}

/* The oldest queued request matching: holder requests (want_holder) or starved ones. */
static int oldest_request(const gl_fk_core *core, int want_holder, uint64_t now) {
    int pick = -1;
    for (uint32_t i = 0; i < GL_FK_MAX_TASKS; i++) {
        const gl_fk_task *t = &core->tasks[i];
        if (!t->active || !t->has_request)
            continue;
        int holder = (int32_t)t->priority == core->holder_priority;
        if (want_holder ? !holder
                        : (holder || core->config.max_wait_ns == 0 ||
                           now - t->req_time_ns < core->config.max_wait_ns))
            continue;
        if (pick < 0 || t->req_seq < core->tasks[pick].req_seq)
            pick = (int)i;
    }
    return pick;
}

static void grant_fill(gl_fk_core *core, uint32_t id, uint64_t now) {
    gl_fk_task *t = &core->tasks[id];
    t->has_request = 0;
    admit(core, id, t->req_duration_ns, t->req_gap_ns, 1, now);
}

/* ---- API -------------------------------------------------------------------------------- */

void gl_fk_default_config(gl_fk_config *out) {
    if (out == NULL)
        return;
    out->gap_threshold_ns = 100000;
    out->idle_margin_ns = 200000;
    out->idle_backlog_ns = 0;
    out->max_wait_ns = 0;
    out->fill_guard_ns = 0;
}

size_t gl_fk_core_size(void) { return sizeof(gl_fk_core); }

int gl_fk_init(gl_fk_core *core, const gl_fk_config *config) {
    if (core == NULL || config == NULL)
        return -1;
    if (config->gap_threshold_ns > GL_FK_MAX_CONFIG_NS ||
        config->idle_margin_ns > GL_FK_MAX_CONFIG_NS ||
        config->idle_backlog_ns > GL_FK_MAX_CONFIG_NS ||
        config->max_wait_ns > GL_FK_MAX_CONFIG_NS || config->fill_guard_ns > GL_FK_MAX_CONFIG_NS)
        return -1;
    memset(core, 0, sizeof(*core));
    core->config = *config;
    core->holder_priority = -1;
    core->magic = GL_FK_MAGIC;
    return 0;
}

int gl_fk_add_task(gl_fk_core *core, uint32_t task, uint32_t priority, uint64_t now_ns) {
    if (!valid(core))
        return -1;
    if (task >= GL_FK_MAX_TASKS || priority >= GL_FK_PRIORITIES || core->tasks[task].active) {
        core->counters.rejected_calls++;
        return -1;
    }
    uint64_t now = advance(core, now_ns);
    gl_fk_task *t = &core->tasks[task];
    memset(t, 0, sizeof(*t));
    t->active = 1;
    t->priority = (uint8_t)priority;
    /* Not launched yet: idle unless it launches within the margin. */
    t->idle_at_ns = sat_add(now, core->config.idle_margin_ns);
    refresh_holder(core);
    return 0;
}

void gl_fk_remove_task(gl_fk_core *core, uint32_t task, uint64_t now_ns) {
    if (!valid(core))
        return;
    gl_fk_task *t = task_at(core, task);
    if (t == NULL) {
        core->counters.rejected_calls++;
        return;
    }
    advance(core, now_ns);
    while (outstanding(t) > 0)
        pop_outstanding(core, t);
    t->active = 0;
    t->has_request = 0;
    refresh_holder(core);
}

/* What gl_fk_request and gl_fk_launched share: checks, the clock, clamping, and a holder's
 * kernel admitted at once. -1: refused; 1: the holder's, admitted; 0: the caller decides. */
static int launch_common(gl_fk_core *core, uint32_t task, uint64_t *duration, uint64_t *gap,
                         uint64_t *now) {
    if (!valid(core))
        return -1;
    gl_fk_task *t = task_at(core, task);
    if (t == NULL || t->has_request) {
        core->counters.rejected_calls++;
        return -1;
    }
    *now = advance(core, *now);
    *duration = clamp_ns(*duration);
    *gap = clamp_ns(*gap);
    if (*duration == GL_FK_UNKNOWN)
        core->counters.unknown_requests++;
    if ((int32_t)t->priority == core->holder_priority) {
        admit_holder(core, task, *duration, *gap, *now);
        return 1;
    }
    return 0;
}

int gl_fk_request(gl_fk_core *core, uint32_t task, uint64_t duration_ns, uint64_t gap_after_ns,
                  uint64_t now_ns) {
    int result = launch_common(core, task, &duration_ns, &gap_after_ns, &now_ns);
    if (result != 0)
        return result;
    gl_fk_task *t = &core->tasks[task];
    t->has_request = 1;
    t->req_duration_ns = duration_ns;
    t->req_gap_ns = gap_after_ns;
    t->req_time_ns = now_ns;
    t->req_seq = core->next_seq++;
    core->counters.queued++;
    return 0;
}

int gl_fk_launched(gl_fk_core *core, uint32_t task, uint64_t duration_ns, uint64_t gap_after_ns,
                   uint64_t now_ns) {
    int result = launch_common(core, task, &duration_ns, &gap_after_ns, &now_ns);
    if (result != 0)
        return result;
    /* It ran as a holder's kernel while the holder changed: fill work, outstanding. */
    core->counters.launched_unadmitted++;
    admit(core, task, duration_ns, gap_after_ns, 1, now_ns);
    return 0;
}

void gl_fk_completed(gl_fk_core *core, uint32_t task, uint32_t count, uint64_t now_ns) {
    if (!valid(core))
        return;
    gl_fk_task *t = task_at(core, task);
    if (t == NULL) {
        core->counters.rejected_calls++;
        return;
    }
    uint64_t now = advance(core, now_ns);
    uint32_t n = count < outstanding(t) ? count : outstanding(t);
    for (uint32_t i = 0; i < n; i++)
        pop_outstanding(core, t);
    if (n == 0)
        return;
    /* Feedback: what is still outstanding cannot take longer than its predicted sum. */
    if (core->out_unknown == 0)
        core->tail_ns = min_u64(core->tail_ns, sat_add(now, core->out_ns));
    if (outstanding(t) == 0) {
        /* Its next launch is now expected a gap after this real end, not the predicted one. */
        t->idle_at_ns = sat_add(sat_add(now, t->last_gap_ns), core->config.idle_margin_ns);
        if (core->window_open && core->window_owner == task && t->last_gap_known)
            core->window_end_ns = sat_add(now, t->last_gap_ns);
    }
}

int gl_fk_decide(gl_fk_core *core, uint64_t now_ns, uint32_t *out, int max, uint64_t *wake_at_ns) {
    uint64_t wake = UINT64_MAX;
    int n = 0;
    if (!valid(core) || (out == NULL && max > 0)) {
        if (wake_at_ns != NULL)
            *wake_at_ns = wake;
        return 0;
    }
    uint64_t now = advance(core, now_ns);
    /* Holder requests queued before their task became the holder (a better one left). */
    while (n < max) {
        int id = oldest_request(core, 1, now);
        if (id < 0)
            break;
        gl_fk_task *t = &core->tasks[id];
        t->has_request = 0;
        admit_holder(core, (uint32_t)id, t->req_duration_ns, t->req_gap_ns, now);
        out[n++] = (uint32_t)id;
    }
    /* Anti-starvation before the fill rules: these have waited longest of all. */
    while (n < max) {
        int id = oldest_request(core, 0, now);
        if (id < 0)
            break;
        grant_fill(core, (uint32_t)id, now);
        core->counters.granted_starved++;
        out[n++] = (uint32_t)id;
    }
    while (n < max) {
        int mode = MODE_NONE;
        uint64_t idle_wake = UINT64_MAX;
        if (core->window_open && now < core->window_end_ns)
            mode = MODE_WINDOW;
        else if (holders_idle(core, now, &idle_wake))
            mode = MODE_IDLE;
        int id = mode == MODE_NONE ? -1 : best_prio_fit(core, mode, now);
        if (id < 0) {
            /* A window's fits only shrink as time passes; idleness can begin by itself. */
            if (mode == MODE_WINDOW)
                holders_idle(core, now, &idle_wake);
            if (mode != MODE_IDLE)
                wake = min_u64(wake, idle_wake);
            break;
        }
        grant_fill(core, (uint32_t)id, now);
        if (mode == MODE_WINDOW)
            core->counters.granted_window++;
        else
            core->counters.granted_idle++;
        out[n++] = (uint32_t)id;
    }
    int any_waiting = 0;
    for (uint32_t i = 0; i < GL_FK_MAX_TASKS; i++) {
        const gl_fk_task *t = &core->tasks[i];
        if (!t->active || !t->has_request)
            continue;
        any_waiting = 1;
        if (core->config.max_wait_ns > 0)
            wake = min_u64(wake, sat_add(t->req_time_ns, core->config.max_wait_ns));
    }
    if (!any_waiting)
        wake = UINT64_MAX;
    else if (n == max)
        wake = now; /* `out` was full: there may be more to grant at once */
    if (wake_at_ns != NULL)
        *wake_at_ns = wake;
    return n;
}

int gl_fk_next_fill(const gl_fk_core *core, uint32_t *task, uint64_t *min_gap_ns) {
    if (!valid(core) || task == NULL || min_gap_ns == NULL || core->holder_priority < 0)
        return 0;
    int holders = 0, pick = -1;
    for (uint32_t i = 0; i < GL_FK_MAX_TASKS; i++) {
        const gl_fk_task *t = &core->tasks[i];
        if (!t->active)
            continue;
        if ((int32_t)t->priority == core->holder_priority) {
            if (t->has_request || ++holders > 1)
                return 0; /* decide grants holder requests first; co-holders interleave */
            continue;
        }
        if (!t->has_request || t->req_duration_ns == GL_FK_UNKNOWN)
            continue; /* unknown lengths never fill a window */
        const gl_fk_task *b = pick >= 0 ? &core->tasks[pick] : NULL;
        if (b == NULL || t->priority < b->priority ||
            (t->priority == b->priority && t->req_seq < b->req_seq))
            pick = (int)i;
    }
    if (pick < 0)
        return 0;
    uint64_t gap = max_u64(sat_add(core->tasks[pick].req_duration_ns, core->config.fill_guard_ns),
                           core->config.gap_threshold_ns);
    *task = (uint32_t)pick;
    *min_gap_ns = gap > 0 ? gap : 1; /* a window needs a gap > 0 */
    return 1;
}

int gl_fk_next_asker(const gl_fk_core *core, uint32_t *task) {
    if (!valid(core) || task == NULL || core->holder_priority < 0)
        return 0;
    int holders = 0, pick = -1, tied = 0;
    for (uint32_t i = 0; i < GL_FK_MAX_TASKS; i++) {
        const gl_fk_task *t = &core->tasks[i];
        if (!t->active)
            continue;
        if ((int32_t)t->priority == core->holder_priority) {
            if (t->has_request || ++holders > 1)
                return 0;
            continue;
        }
        if (pick < 0 || t->priority < core->tasks[pick].priority) {
            pick = (int)i;
            tied = 0;
        } else if (t->priority == core->tasks[pick].priority) {
            tied = 1;
        }
    }
    if (pick < 0 || tied || core->tasks[pick].has_request)
        return 0;
    *task = (uint32_t)pick;
    return 1;
}

int gl_fk_release(gl_fk_core *core, uint32_t task, uint64_t now_ns) {
    if (!valid(core))
        return -1;
    gl_fk_task *t = task_at(core, task);
    if (t == NULL || !t->has_request || (int32_t)t->priority == core->holder_priority) {
        core->counters.rejected_calls++;
        return -1;
    }
    grant_fill(core, task, advance(core, now_ns));
    core->counters.granted_released++;
    return 0;
}

void gl_fk_get_counters(const gl_fk_core *core, gl_fk_counters *out) {
    if (out == NULL)
        return;
    if (!valid(core)) {
        memset(out, 0, sizeof(*out));
        return;
    }
    *out = core->counters;
}

int gl_fk_holder_priority(const gl_fk_core *core) { return valid(core) ? core->holder_priority : -1; }

uint64_t gl_fk_window_end(const gl_fk_core *core) {
    return valid(core) && core->window_open ? core->window_end_ns : 0;
}

uint64_t gl_fk_tail(const gl_fk_core *core) { return valid(core) ? core->tail_ns : 0; }

int gl_fk_has_request(const gl_fk_core *core, uint32_t task) {
    if (!valid(core) || task >= GL_FK_MAX_TASKS || !core->tasks[task].active)
        return -1;
    return core->tasks[task].has_request;
}

uint32_t gl_fk_outstanding(const gl_fk_core *core, uint32_t task) {
    if (!valid(core) || task >= GL_FK_MAX_TASKS || !core->tasks[task].active)
        return 0;
    return outstanding(&core->tasks[task]);
}
