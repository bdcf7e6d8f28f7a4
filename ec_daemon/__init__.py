"""ec-daemon: the host-local server that owns the shared encoder cache.

Needs grpcio and protobuf only (no torch, no CUDA). The core modules
(`allocator`, `eviction`, `cache`, `sessions`, `region`) hold no gRPC types and
are tested directly; `dataplane` serves them on plain values, `service` adapts
that to gRPC and `cli` to the shell.
"""

__version__ = "0.1.0"
