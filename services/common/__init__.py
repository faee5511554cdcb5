"""Machinery every gpuloom service shares: settings, logging, metrics, gRPC server, errors."""
