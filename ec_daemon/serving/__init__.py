"""Serving: the daemon as a process, the top of the import graph.

The thin gRPC servicer and its converters (`service`, `wire`), access
(`auth`), settings (`config`), Prometheus (`metrics`), start-up and warm
restart (`startup`, `adoption`, `server`) and the command line (`cli`).
Everything below is usable without these; only `ec_daemon.__main__` imports
them.
"""
