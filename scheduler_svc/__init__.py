"""Scheduler: a pure batching core (no grpc, no torch) and a thin gRPC service around it."""
