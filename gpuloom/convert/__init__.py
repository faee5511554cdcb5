"""Where the wire meets the domain, for services and clients alike: domain types to and from
gpuloom.v1 protobuf, and domain errors to and from gRPC status codes. Only what more than one
service or a client needs lives here; a service's own messages convert in its convert.py."""
