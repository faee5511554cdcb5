"""Generated protobuf and gRPC stubs for the gpuloom.v1 contract (built from protos/; never edit)."""
