"""The per-GPU dispatcher: reservations, the shim channel and token sharing."""
