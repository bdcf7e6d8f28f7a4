"""The scheduler process's side: `SchedulerDelegate` and its `ReadyView`.

vLLM's per-step scheduler calls on plain values: the local view of what is
ready, hits, loads in flight and withheld acknowledgements. It never
imports the worker side or the copy backends (a scheduler maps no region and
copies nothing) nor the vLLM shell; what workers need from it travels as
`common.contract` values.
"""
