"""ec-daemon: the host-local server that owns the shared encoder cache.

Needs grpcio and protobuf only (no torch, no CUDA). The folders are layers,
each importing only those below it: `durable` (region, index, journal),
`core` (the cache and its state, no gRPC types, tested directly), `plane`
(the data plane serving the core on plain values) beside `remote` (the
second tier), and `serving` (gRPC, the command line) on top. `errors`, the
vocabulary every layer speaks, imports nothing of the daemon (sizes are
the protocol's, `ec_protocol.sizes`: the client's settings speak them too).
"""

__version__ = "0.1.0"
