"""The second tier: a store shared by the daemons of many hosts, on Redis or
on Mooncake Store (the --remote URL's scheme chooses, once, at start-up).

`backend` declares what the tier needs of a store and its two kinds:
`store` is the Redis backend (values in ec-daemon's format, announced on an
index every daemon follows), `mooncake` the Mooncake one (vLLM's format,
asked for each wanted key, bytes moved between the region and the store).
`values` is the verified value format, `breaker` the circuit breakers,
`budget` the promotion budget, `index` what other daemons announced, `core`
what the tier's parts share, `publisher` the write-behind queue and thread,
`follower` the index thread (Redis), `resolver` the cross-host lookups and
claims, and `tier` the one face that composes them beside the daemon's event
loop and fetches. Nothing
here imports the rest of the daemon (but `sizes`, to parse a URL's sizes),
and the daemon imports this package only when --remote is set.
"""
