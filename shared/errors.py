"""Domain errors: what went wrong, in terms a caller can act on (no grpc here).

`shared.grpc_errors` maps each class to a gRPC status code at the service boundary; any other
exception becomes INTERNAL with a generic message while the details go to the log.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base class; the message is shown to the client verbatim, so it must be actionable."""


class InvalidArgument(PdserveError):
    """The request is malformed or out of range (INVALID_ARGUMENT)."""


class NotFound(PdserveError):
    """A named thing (request id, model, ticket) does not exist (NOT_FOUND)."""


class AlreadyExists(PdserveError):
    """A client-chosen id is already in use (ALREADY_EXISTS)."""


class ResourceExhausted(PdserveError):
    """Capacity is full: KV pool, queue, or a size limit (RESOURCE_EXHAUSTED)."""


class Unavailable(PdserveError):
    """No worker can serve the request right now, or the service is draining (UNAVAILABLE)."""


class PermissionDenied(PdserveError):
    """The caller may not make this call on this deployment, e.g. an operation the operator left
    off (PERMISSION_DENIED); the message names the setting that allows it."""


class FailedPrecondition(PdserveError):
    """The system is not in a state that allows the call, e.g. incompatible KV layout."""


class Cancelled(PdserveError):
    """The request was aborted (CANCELLED)."""


class DeadlineExceeded(PdserveError):
    """The request's deadline passed (DEADLINE_EXCEEDED)."""
