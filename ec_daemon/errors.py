"""Domain errors of the daemon core, each tied to one gRPC status.

The core raises these with a message for the caller; the service maps them to
status codes in one place (`service.grpc_errors`). Raising one means nothing
was changed.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class; `code` names the gRPC status a remote caller sees."""

    code = "INTERNAL"


class InvalidArgument(CacheError):
    """The request itself is malformed: fix the caller."""

    code = "INVALID_ARGUMENT"


class NotFound(CacheError):
    """The named session (or object) does not exist: re-attach."""

    code = "NOT_FOUND"


class FailedPrecondition(CacheError):
    """Well-formed but not allowed in the current state (role, version)."""

    code = "FAILED_PRECONDITION"


class PermissionDenied(CacheError):
    """The object belongs to another session or engine."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(CacheError):
    """No room: everything is pending, quarantined or awaiting acknowledgement.
    The caller should drop this save (the engine just does not cache it)."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(CacheError):
    """The daemon is shutting down: try again (another generation)."""

    code = "UNAVAILABLE"


class InvariantViolated(CacheError):
    """The bookkeeping does not add up (a daemon bug; --check-invariants)."""

    code = "INTERNAL"
