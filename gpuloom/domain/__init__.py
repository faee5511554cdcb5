"""The domain: the types and rules more than one service or client speaks (profiles and name
checks, the GPU model catalogue and MIG geometry, MIG task runs, shares and quotas, the domain
errors). Plain dataclasses and functions: nothing here imports a service, a client, a policy,
gRPC or generated protobuf (tests/test_layers.py checks it)."""
