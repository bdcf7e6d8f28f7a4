"""The data plane: what the handlers ask of the core, on the event loop.

`dataplane` runs the cache and its listeners (convergence and promotions,
watchers, a worker's saves) and waits (`wakeups`) on plain values; serving
converts to and from gRPC around it. It never imports serving, and never
the second tier: the server hands the tier in, so the plane runs (and is
tested) without one.
"""
