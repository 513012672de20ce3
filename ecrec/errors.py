"""The project's exceptions: what went wrong, in domain terms, with no transport types.

Code inside the servers, the strategies and the rebuild engine raises these; only the gRPC
service edge (:func:`ecrec.net.transport.grpc_status_of`, used by every servicer) turns them into
status codes.  Each class names the status it maps to, so a reader of domain code knows what
the caller will see without the domain code importing ``grpc``.

    InvalidRequest        INVALID_ARGUMENT    malformed or inconsistent input; nothing changed
    NotFound              NOT_FOUND           unknown table, dense tensor, server
    AlreadyExists         ALREADY_EXISTS      a table or tensor exists with another spec
    FailedPrecondition    FAILED_PRECONDITION the request does not fit this server's state
                                              (wrong owner, standby, stale map, not restored)
    Unavailable           UNAVAILABLE         try again later (rows not rebuildable yet, peer gone)
    DeadlineExceeded      DEADLINE_EXCEEDED   a wait ran out
    ResourceExhausted     RESOURCE_EXHAUSTED  a bound was reached (queue, log, message size)
    PermissionDenied      PERMISSION_DENIED   the caller may not call this
    DataLoss              DATA_LOSS           data cannot be recovered (more than m failures in a
                                              stripe, a corrupt checkpoint)
    Unimplemented         UNIMPLEMENTED       the active strategy does not serve this
    Busy                  ABORTED             this server is busy for a moment (a snapshot's cut holds
                                              pushes): the caller retries the same request here soon
"""

from __future__ import annotations


class EcrecError(Exception):
    """Base of every error this project raises on purpose; ``status`` names the gRPC status code."""

    status = "INTERNAL"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(EcrecError, ValueError):
    status = "INVALID_ARGUMENT"


class NotFound(EcrecError, KeyError):
    status = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class AlreadyExists(EcrecError):
    status = "ALREADY_EXISTS"


class FailedPrecondition(EcrecError):
    status = "FAILED_PRECONDITION"


class Unavailable(EcrecError):
    status = "UNAVAILABLE"


class DeadlineExceeded(EcrecError):
    status = "DEADLINE_EXCEEDED"


class ResourceExhausted(EcrecError):
    status = "RESOURCE_EXHAUSTED"


class PermissionDenied(EcrecError):
    status = "PERMISSION_DENIED"


class DataLoss(EcrecError):
    status = "DATA_LOSS"


class Unimplemented(EcrecError):
    status = "UNIMPLEMENTED"


class Busy(EcrecError):
    """Retry the same request at the same server in a moment (not a failure: nothing to report)."""

    status = "ABORTED"


#: what a server's refusal of a push of a worker incarnation it forgot says (``ecrec.server.applied``); the SDK
#: goes on under a new incarnation when it reads it
FORGOTTEN_INCARNATION = "forgot worker incarnation"
