"""gpuloom: a GPU-sharing control plane.

The import package spans three folders of the repository: `gpuloom/` (this file and the
generated protobuf stubs in `gpuloom/v1/`), `services/` (gpuloom.services) and `clients/`
(gpuloom.clients).
"""

__version__ = "0.1.0"
