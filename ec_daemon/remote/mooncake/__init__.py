"""The second tier on Mooncake Store, in vLLM's key scheme and value format,
shared with vLLM's own Mooncake connector. `backend` is how the tier uses
it; `store` the client's values (read into and written from the region),
`connection` its life (connected in the background), `buffers` the
registered transfer buffers and their budget, `codec` vLLM's keys and
header, `claims` claims across hosts, `url` the --remote URL.
"""
