"""Every bound of the client and every default of its settings, declared
once (the client's counterpart of the daemon's `core.limits`): how much it
remembers, how long it waits, how often it logs, how large its buffers are.
A module that needs one imports it from here; the settings table
(`common.settings`) takes each number among its defaults from here, and
tests/unit/test_import_graph.py fails when a client module declares a
number of its own. A leaf: it imports nothing.
"""

from __future__ import annotations

# ------------------------------------------------------------------ settings' defaults

# The worker's queue of encoder outputs waiting to be saved (outside vLLM's
# encoder budget); a full queue skips the save.
DEFAULT_SAVE_QUEUE_BYTES = 256 << 20
# Loads staged a step before their use, per worker rank (on its device,
# outside vLLM's encoder budget): docs/architecture.md, "Staged loads".
DEFAULT_STAGING_BYTES = 256 << 20
# Each load checked against its entry's checksum: off, since it costs more
# than 5% of a load (docs/performance.md, 2b: the cpu backend's load of 1-64
# MiB takes 1.3-1.5x as long with it; a CUDA worker reads the pages on the
# host after its copy: benchmarks/gpu.py's `verify_cost`). Turn it on where
# other processes that map the region (any engine's workers, a --group) are
# not trusted.
DEFAULT_VERIFY_CHECKSUM = False
# How long a request is deferred at most for another engine's encode or a
# promotion.
DEFAULT_MAX_DEFER_SECONDS = 10.0
# How long `ensure` may wait in all, per step, for the answers to the items it
# just wanted: an answer takes a fraction of a millisecond; an unanswered want
# defers its request a step.
DEFAULT_ANSWER_WAIT_SECONDS = 0.005
# `ec_daemon_weights_id`, at most (the daemon takes a layout variant of 256).
MAX_WEIGHTS_ID_CHARS = 128

# ------------------------------------------------------------------ the session (both processes)

# Attach attempts back off from this.
BACKOFF_START_SECONDS = 0.05
# Attach attempts while the daemon is down: a refused connection costs
# nothing, and a restarted daemon (warm: its cache adopted) is worth hitting
# again at once.
RECONNECT_MAX_SECONDS = 0.25
# After an attachment this client could not use (a callback failed).
BACKOFF_MAX_SECONDS = 2.0
# A view answers hits until this fraction of the lease after the send time
# of the newest heartbeat the daemon echoed; the rest of the lease is the
# margin for a dispatched load to land.
FRESH_FRACTION = 0.5
# A stream silent this many leases (heartbeats sent, nothing heard) is given up.
SILENT_LEASES = 2.0
# Heartbeats remembered until echoed: at one per EARLY_BEAT_SECONDS, 1,024
# cover 100 s, past any useful echo of a lease up to 200 s (an echo counts
# only until its send time + lease * FRESH_FRACTION; one forgotten makes
# freshness conservative, never longer).
MAX_BEATS_IN_FLIGHT = 1024
# A heartbeat goes out this soon (not a whole interval later) when the owner
# has something for it (`LinkListener.beat_due`: loads to touch), so the
# daemon's LRU hears of hits within this: with a heartbeat only every
# lease/10, entries hit every step were evicted from a cache turning over
# faster than that (docs/performance.md 6).
EARLY_BEAT_SECONDS = 0.1
MIN_BEAT_SECONDS = 0.01  # whatever interval a daemon asks for (ours: 50 ms at least)
# How long `SessionLink.stop` waits for its thread to detach.
STOP_SECONDS = 2.0

# While detached, the warning comes back this often (one line a minute: an
# operator tailing the log sees it, a long outage does not flood it).
DETACHED_WARNING_SECONDS = 60.0

# ------------------------------------------------------------------ the scheduler's side

# Ranks still not all mapped this long after an attach or a rank's loss is
# worth a warning (engines start their scheduler before their workers, and
# stop their workers first).
UNMAPPED_WARNING_SECONDS = 30.0
# A want unanswered this long (a daemon that dropped it) is encoded.
ANSWER_SECONDS = 1.0
# Items wanted and remembered at once; beyond, items are encoded without asking.
MAX_WANTS = 1 << 14
# Distinct entries whose loads wait for a heartbeat; beyond, recency and load
# counts of further entries are dropped until the next one.
MAX_PENDING_TOUCHES = 1 << 16
# Events of one daemon message applied per hold of the view's lock (a few
# microseconds each); between slices the engine's thread may take the lock.
APPLY_SLICE = 256
# A staged load whose ranks never all reported is given up after this (a
# backstop: vLLM returns every step's worker output, and a copy takes
# milliseconds). Its eviction is then acknowledged, logged.
INFLIGHT_TTL_SECONDS = 120.0
# An entry a rank could not use for a reason other than its bytes is not
# staged again by this engine for this long (its requests encode it).
UNUSABLE_SECONDS = 10.0
# Entries remembered as not to be staged again, at most.
MAX_REFUSED = 4096
# A staged output no step adopted this many worker steps after the step that
# staged it is dropped by the worker. The scheduler drops its own record of it
# earlier (`ADOPT_STEPS`), so it never names one a worker dropped.
STAGED_STEPS = 64
ADOPT_STEPS = STAGED_STEPS // 2

# ------------------------------------------------------------------ the workers' side

# How often the idle saver thread unmaps retired regions.
PRUNE_SECONDS = 1.0
# Saves given up for a cut region are logged at most this often (counted each).
CUT_LOG_SECONDS = 10.0
# Dropped saves remembered until taken (`take_dropped`: every engine step).
MAX_DROPPED_SAVES = 4096
# The most saves asked for in one stream message: their copies are reported
# together, so the first one's entry is ready only after the last one's copy.
SAVE_BATCH = 16
# A retired mapping stays at least this long after it was retired (and
# while any copy uses it), for loads dispatched before the scheduler saw the
# daemon change.
RETIRE_SECONDS = 5.0
# Where `empty_host` puts an output: the kernel copies a pread into a buffer
# less aligned than this several times slower on some CPUs (x86 "rep movsb":
# 2 GB/s into an address 8 or 16 bytes past a 32-byte boundary, 14 GB/s at
# one; malloc's large blocks, numpy's among them, start 16 bytes past one).
HOST_ALIGN = 64
# Page-locked memory per copy stream for the copies of chunks that are not
# registered: pinned memory is scarce (two buffers per worker process), and
# a larger copy only waits for its stream once per this many bytes.
BOUNCE_BYTES = 16 << 20
# What `chunks` reads at a time (a buffer of the caller's thread, reused).
READ_CHUNK_BYTES = 1 << 20
# Host memory registered with CUDA per call (a large region is registered in chunks).
REGISTER_CHUNK_BYTES = 1 << 30

# ------------------------------------------------------------------ the vLLM shell

# How often get_ec_connector_stats hands vLLM a summary (it asks every step).
STATS_INTERVAL_SECONDS = 1.0
# The daemon takes a layout variant of up to 256 characters: versions longer
# than this (local build tags) are named by their digest.
MAX_RUNTIME_CHARS = 64
# Items whose save was reported dropped, remembered (the most recent ones)
# so a producer announces no metadata for them.
MAX_DROPPED_ITEMS = 4096
