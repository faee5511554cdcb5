"""A training job for the migration tests: counts steps (one every STEP_S), writes each step it
completes to a log with the dispatcher it ran on, and answers SIGUSR1 by saving the steps done
to its state file and exiting 0. Started again, it goes on from the saved state, so a log in
which every step appears exactly once shows that no work was lost or done twice.

    python training_worker.py STATE LOG STEPS
"""

from __future__ import annotations

import os
import signal
import sys
import time

STEP_S = 0.01


def main() -> int:
    state, log, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    done = int(open(state).read()) if os.path.exists(state) else 0  # noqa: SIM115
    asked = []
    signal.signal(signal.SIGUSR1, lambda *_: asked.append(True))
    where = os.environ.get("GPULOOM_DISPATCHER", "?")
    with open(log, "a") as out:
        out.write(f"start {done} {where}\n")
        out.flush()
        while done < steps:
            if asked:
                with open(state + ".tmp", "w") as saved:
                    saved.write(str(done))
                os.replace(state + ".tmp", state)
                out.write(f"checkpoint {done}\n")
                return 0
            time.sleep(STEP_S)
            done += 1
            out.write(f"step {done} {where}\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
