"""The cache core: the entry life cycle as a state machine on plain values.

The cache and what it is made of (records, limits, the allocator, the
eviction policy, sessions, quotas, events, the invariants, the stats
snapshot). It does no I/O but through the durable layer and knows no event
loop, gRPC or second tier, so tests and fuzzing drive it directly: it never
imports the data plane, the second tier or serving.
"""
