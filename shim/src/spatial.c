/* Spatial harvesting: see spatial.h and gpuloom/policies/harvest/spatial.py, whose order of
 * checks and arithmetic this follows step for step. */
#include "spatial.h"

#include <stddef.h>

void gl_sp_default_config(gl_sp_config *out) {
    *out = (gl_sp_config){.sm_limit = 1.0,
                          .stretch = 1.3,
                          .max_holder_slowdown = 1.03,
                          .other_factor = 1.5,
                          .unknown_factor = 2.0,
                          .allow_unknown = 1,
                          .sms = 0};
}

static int factor_ok(double value) { return value >= 1.0 && value <= 100.0; }

int gl_sp_check_config(const gl_sp_config *c) {
    if (c == NULL || !(c->sm_limit > 0.0 && c->sm_limit <= 1.0) || !factor_ok(c->stretch) ||
        !factor_ok(c->max_holder_slowdown) || !factor_ok(c->other_factor) ||
        !factor_ok(c->unknown_factor) || c->allow_unknown > 1 || c->sms == 0 ||
        c->sms > GL_SP_MAX_SMS)
        return -1;
    return 0;
}

int gl_sp_admit(const gl_sp_config *c, uint64_t now_ns, const gl_sp_candidate *candidate,
                const gl_sp_running *running, uint32_t n, uint64_t holder_next_launch_ns) {
    if (c == NULL || candidate == NULL || (n > 0 && running == NULL) || c->sms == 0) return 0;
    uint32_t holders = 0;
    uint64_t asked = candidate->demand, beside = candidate->demand;
    for (uint32_t i = 0; i < n; i++) {
        asked += running[i].demand;
        if (running[i].priority < candidate->priority)
            holders++;
        else
            beside += running[i].demand; /* other harvested kernels: they slow the holder too */
    }
    if (holders == 0 || holder_next_launch_ns == GL_FK_UNKNOWN ||
        candidate->duration_ns == GL_FK_UNKNOWN)
        return 0;
    /* The holder keeps every SM it asked for. */
    if ((double)asked > c->sm_limit * (double)c->sms) return 0;
    double factor = 1.0;
    for (uint32_t i = 0; i < n; i++) {
        if (running[i].priority >= candidate->priority) continue;
        uint32_t mine = running[i].bound, theirs = candidate->bound;
        if (mine == GL_SP_UNKNOWN || theirs == GL_SP_UNKNOWN) {
            if (!c->allow_unknown) return 0;
            if (c->unknown_factor > factor) factor = c->unknown_factor;
        } else if (mine == theirs) {
            return 0; /* two of one class clash */
        } else if (c->other_factor > factor) {
            factor = c->other_factor;
        }
    }
    if (1.0 + (factor - 1.0) * (double)beside / (double)c->sms > c->max_holder_slowdown) return 0;
    /* Off the SMs before the holder's next kernel wants them. */
    double end = (double)(now_ns + candidate->queued_ns) +
                 (double)candidate->duration_ns * c->stretch;
    if (end > (double)holder_next_launch_ns) return 0;
    return candidate->quota_left_ns == GL_FK_UNKNOWN ||
           candidate->duration_ns <= candidate->quota_left_ns;
}
