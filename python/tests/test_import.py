"""The package imports from the build tree and lists the backends it was built with."""

import wsync


def test_lists_every_cpu_backend():
    assert {"nccl", "ipc", "delta"} <= set(wsync.trainer_backends())


def test_exceptions_are_also_the_builtin_ones():
    assert issubclass(wsync.DeadlineExceededError, TimeoutError)
    assert issubclass(wsync.InvalidArgumentError, ValueError)
    assert issubclass(wsync.UnavailableError, ConnectionError)
    assert all(issubclass(c, wsync.Error) for c in wsync.errors.BY_CODE.values())
