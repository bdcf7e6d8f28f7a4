"""ec-client: talk to ec-daemon from vLLM engines and tools.

The folders are layers, each importing only those below it: `common` (the
session link, the step contract, settings, trust: what an engine's scheduler
and worker processes share), then `scheduler_side` and `worker_side` (the
vLLM-free delegates; neither imports the other), with `copy` (the region
mapping and the data-plane backends) under the worker side. The vLLM shell
(`vllm_connector` and its helpers) sits at the root, where vLLM is told to
find it, and nothing here imports it. Only grpcio and protobuf are needed
to import this package: numpy, torch and cupy are imported where used.
"""
