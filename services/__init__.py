"""gpuloom's gRPC services (import package gpuloom.services)."""
