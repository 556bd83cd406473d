"""Exceptions wsync raises: one class per wsync status code.

Every class derives from ``wsync.Error`` and from the built-in exception a Python caller
would reach for first (``ValueError`` for bad input, ``TimeoutError`` for a missed
deadline, ``ConnectionError`` for an unreachable server), so ``except TimeoutError``
works as well as ``except wsync.DeadlineExceededError``. The message is the engine's own,
including a server's reply where a server refused.
"""


class Error(Exception):
    """Base of every wsync exception; ``code`` is the wsync status name."""

    code = "UNKNOWN"


class InvalidArgumentError(Error, ValueError):
    code = "INVALID_ARGUMENT"


class UnauthenticatedError(Error, PermissionError):
    code = "UNAUTHENTICATED"


class NotFoundError(Error, LookupError):
    code = "NOT_FOUND"


class FailedPreconditionError(Error, RuntimeError):
    code = "FAILED_PRECONDITION"


class PayloadTooLargeError(Error, ValueError):
    code = "PAYLOAD_TOO_LARGE"


class DeadlineExceededError(Error, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class UnavailableError(Error, ConnectionError):
    code = "UNAVAILABLE"


class DataLossError(Error, RuntimeError):
    code = "DATA_LOSS"


class AbortedError(Error, RuntimeError):
    code = "ABORTED"


class UnimplementedError(Error, NotImplementedError):
    code = "UNIMPLEMENTED"


class InternalError(Error, RuntimeError):
    code = "INTERNAL"


__all__ = ["Error", "InvalidArgumentError", "UnauthenticatedError", "NotFoundError",
           "FailedPreconditionError", "PayloadTooLargeError", "DeadlineExceededError",
           "UnavailableError", "DataLossError", "AbortedError", "UnimplementedError",
           "InternalError"]

# By the C++ StatusCode's name (wsync::StatusCodeName); the extension raises through it.
BY_CODE = {cls.code: cls for cls in (
    InvalidArgumentError, UnauthenticatedError, NotFoundError, FailedPreconditionError,
    PayloadTooLargeError, DeadlineExceededError, UnavailableError, DataLossError,
    AbortedError, UnimplementedError, InternalError)}
