/* Spatial harvesting (Orion's rule, across processes under MPS): may a lower-priority kernel
 * run now, beside the kernel the holder has on the GPU, rather than wait for its gaps?
 *
 * The C twin of gpuloom/policies/harvest/spatial.py (docs/harvest.md, "The rule: spatial
 * harvesting"): the same conditions, knobs and arithmetic (doubles, in the same order), so the
 * two give the same verdicts (tests/dispatcher/test_spatial_parity.py). Pure: no I/O, no
 * clock, no allocation; the engine's FIKIT half asks it on its own thread for a filler's
 * request queued behind a running holder kernel, only when the GPU runs MPS. */
#ifndef GL_SPATIAL_H
#define GL_SPATIAL_H

#include <stdint.h>

#include "fikit.h"

/* A kernel's bound class, as the profile store's KernelBound enum numbers it. */
enum { GL_SP_UNKNOWN = 0, GL_SP_COMPUTE = 1, GL_SP_MEMORY = 2 };

typedef struct {
    double sm_limit;            /* share of the SMs running kernels and candidate may ask for */
    double stretch;             /* predicted slowdown of a harvested kernel beside the holder */
    double max_holder_slowdown; /* of the holder's running kernel, predicted */
    double other_factor;        /* estimated interference, compute beside memory */
    double unknown_factor;      /* estimated interference, a class unknown */
    uint32_t allow_unknown;     /* 1: an unknown class may run beside the holder */
    uint32_t sms;               /* the GPU's SMs */
} gl_sp_config;

/* A kernel on the GPU now. */
typedef struct {
    uint32_t priority;
    uint32_t demand; /* SMs it asked for */
    uint32_t bound;  /* GL_SP_* */
} gl_sp_running;

/* The lower-priority kernel that asks to run. GL_FK_UNKNOWN: duration never measured (it
 * waits), or no quota limit. */
typedef struct {
    uint32_t priority;
    uint32_t demand;
    uint32_t bound;
    uint32_t pad;
    uint64_t duration_ns;   /* predicted alone */
    uint64_t queued_ns;     /* predicted work ahead of it on its own stream */
    uint64_t quota_left_ns; /* GL_FK_UNKNOWN: no quota limit */
} gl_sp_candidate;

/* The defaults of spatial.py's HarvestConfig (sms 0: set it). */
GL_FK_API void gl_sp_default_config(gl_sp_config *out);
/* 0, or -1 when a knob is out of spatial.py's range, sms is 0 or above GL_SP_MAX_SMS. */
GL_FK_API int gl_sp_check_config(const gl_sp_config *config);
/* 1: admit the candidate beside `running` (n kernels) now; 0: it waits. `holder_next_launch_ns`
 * GL_FK_UNKNOWN: the holder's next launch cannot be predicted (it waits). Times and durations
 * should stay below 2^53 ns (exact as doubles, as in Python). */
GL_FK_API int gl_sp_admit(const gl_sp_config *config, uint64_t now_ns,
                          const gl_sp_candidate *candidate, const gl_sp_running *running,
                          uint32_t n, uint64_t holder_next_launch_ns);

#define GL_SP_MAX_SMS 4096

#endif
