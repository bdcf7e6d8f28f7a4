"""ec-client: talk to ec-daemon from vLLM engines and tools.

`transport` and `session` carry the protocol; `scheduler` and `worker` are the
vLLM-free delegates an engine's scheduler side and worker ranks use; `copy`
holds the data-plane backends. Only grpcio and protobuf are needed to import
this package: numpy, torch and cupy are imported where used.
"""
