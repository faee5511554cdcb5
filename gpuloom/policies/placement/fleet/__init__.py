"""The placement state of a fleet: every GPU's allocations and free rectangles, kept
incrementally, and the indexes that make a decision cheap with thousands of GPUs.

Per model (a job's gpu_model constraint picks models, "" all of them) the fleet keeps, over
its schedulable GPUs only:

- `rects`: every free box of every GPU as (area, gpu_id, box), sorted: MRA's global best match
  (the least area that still fits) is the first fitting entry at or after the job's area;
- `by_free`: (free area, gpu_id), sorted, one list per memory class (free memory rounded
  down to a power of two): bin-packing walks them up, spreading down, and skips the classes
  with too little memory, which is what turns most GPUs away once a fleet is busy;
- `by_id`: GPU ids, sorted, for first-fit walks.

A decision touches one GPU, so it updates a handful of entries (bisect, not a rebuild). A GPU
marked unschedulable keeps its allocations and leaves the indexes.

**Shared models** (FaST-GShare's model sharing). A GPU's model store may hold models
(`set_models`): their bytes are used memory of the GPU, once. A job that is a replica of one
(`JobRequest.shared_model`) is placed first among the GPUs where its model is resident, charged
its memory less the weights there (`replica_memory`); only if none of them has room does the
policy look at the whole fleet, where the job is charged its whole footprint. The policy decides
in both rounds: in the first it sees a view of the fleet holding only those GPUs.

Nodes: every GPU belongs to a node, and the fleet keeps each node's CPU (milli) and host memory,
as its GPUs were registered with them, and what jobs hold of them. For a job asking for CPU or
host memory (or naming its nodes), every policy passes over the GPUs of the nodes that do not
take it (`Fleet.offers`, checked as it meets each GPU it would choose, so a decision costs no
more than the GPUs it looks at; nothing in the indexes changes); the commit checks them again.
A job on several GPUs (`JobRequest.gpus > 1`) takes whole GPUs of one node,
all or none: a policy may choose them (`GangPolicy.place_gang`); otherwise the fleet packs it on
the node left with the fewest whole free GPUs (ties by node name).

Both together: a replica asking for CPU or host memory is offered, in its first round, only the
GPUs holding its model whose nodes have them free (the view carries those nodes' records), and
in its second round the whole fleet, whose nodes short of them its policy passes over. A job on
several GPUs takes them whole and cannot be a replica (`JobRequest.validate` refuses the pair).

**Time-slice groups** (Gandiva's over-subscription). `slice_into` puts a job on a GPU that may be
full, as a member of the group of an allocation already there: the member takes turns with the
group's jobs in their rectangle (the driver suspends and resumes them one at a time), so it
takes no area, only its memory (memory stays resident while a job is suspended) and its node's
CPU and host memory. The group's key is its first allocation's id (`Allocation.slice_group`);
the group, and its rectangle, live while any of its allocations does, the first included or
not. A GPU's boxes are therefore one per group, keyed by the group key. `slice_gang_into` does
the same for a job on several whole GPUs, all or none: on each GPU it joins the group named for
that GPU (a running gang's groups are `host` on its first GPU, `host#1`... on the others), its
allocations' ids and `gang` as `place` gives a gang, its CPU and host memory on the first only.

The package, by responsibility: `records` (a GPU's and a node's records, errors), `indexes`
(the per-model indexes), `policy` (the policy Protocols), `core` (`Fleet`: building, placing,
releasing, reading), and the parts mixed into `Fleet`: `indexing`, `nodes`, `gangs`,
`shared_models`, `time_slices`, `verification`.
"""

from __future__ import annotations

from gpuloom.policies.placement.fleet.core import Fleet
from gpuloom.policies.placement.fleet.indexes import (
    ModelIndex,
    memory_class,
    memory_classes,
)
from gpuloom.policies.placement.fleet.policy import GangPolicy, PlacementPolicy
from gpuloom.policies.placement.fleet.records import (
    JOURNAL_KEEP,
    REBUILD_FACTOR,
    REBUILD_SLACK,
    GpuSlot,
    HolderGroup,
    InvalidPlacementError,
    InvalidStateError,
    NodeSlot,
)

__all__ = [
    "JOURNAL_KEEP",
    "REBUILD_FACTOR",
    "REBUILD_SLACK",
    "Fleet",
    "GangPolicy",
    "GpuSlot",
    "HolderGroup",
    "InvalidPlacementError",
    "InvalidStateError",
    "ModelIndex",
    "NodeSlot",
    "PlacementPolicy",
    "memory_class",
    "memory_classes",
]
