"""Client side of gpuloom (import package gpuloom.clients): typed gRPC clients and the CLI."""
