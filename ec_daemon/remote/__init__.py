"""The second tier: a store shared by the daemons of many hosts (Redis now).

`values` is the verified value format, `store` one store behind a small
interface, `breaker` the circuit breakers, `tier` the threads that run it all
beside the daemon's event loop. Nothing here imports the rest of the daemon,
and the daemon imports this package only when --remote is set.
"""
