"""The second tier on Redis or Redis Cluster: values in ec-daemon's format,
announced on an index every daemon follows. `backend` is how the tier uses
it; `store` the client (values, claims), `shards` the index in the store,
`announcements` what this host follows of them and `follower` the thread
that reads them; `url` the --remote URL and token file, `resp` the protocol
where redis-py's costs a copy.
"""
