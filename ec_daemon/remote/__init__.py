"""The second tier: a store shared by the daemons of many hosts, on Redis or
on Mooncake Store (the --remote URL's scheme chooses, once, at start-up).

`tier` is the one face the daemon calls (the contract the data plane
declares, `plane.second_tier`); around one `backend` it composes the
`publisher` (the write-behind queue and thread) and the `resolver` (lookups
and claims across hosts), which share `common` (breakers, budget, counters,
errors). `backend` declares what the tier asks of a store, and each store's
folder does all of it its own way: `redis` (values in ec-daemon's format,
announced on an index every daemon follows) and `mooncake` (vLLM's format,
asked for each wanted key, bytes moved between the region and the store).
`values` is ec-daemon's verified value format (Redis's values, the checksum
beside Mooncake's), `breaker` the circuit breakers, `budget` the promotion
budget. Nothing here imports the daemon above the core (`core.events` and
`core.limits`, and `ec_protocol.sizes` to parse a URL's sizes), and the daemon imports
this package only when --remote is set.
"""
