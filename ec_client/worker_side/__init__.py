"""A worker process's side: `WorkerDelegate`, its saver and its regions.

Saves (queued, bounded in bytes, sent as stream messages or unary calls) and
loads (no RPC) through region mappings held by generation, copying with a
backend of `ec_client.copy`. It never imports the scheduler side (what a
step says arrives as `common.contract` values) nor the vLLM shell.
"""
