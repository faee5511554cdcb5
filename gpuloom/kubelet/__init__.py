"""Generated protobuf and gRPC stubs of the kubelet's device plugin API v1beta1 (built from
protos/gpuloom/kubelet/deviceplugin.proto at install time; never edit, never commit)."""
