"""Durable state: the files that outlive the daemon's process.

The region in the tmpfs (`region`), the index of its ready entries beside it
(`index`) and that index's record format (`journal`). They sit at the bottom
because a warm restart reads them before anything else exists: they never
import the cache core, the data plane, the second tier or serving.
"""
