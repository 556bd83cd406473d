"""wsync: move freshly trained weights from RL trainers into running inference servers.

A trainer process builds a ``TrainerEngine`` and calls ``send_weights`` after each step; an
inference worker written in Python builds a ``ReceiverEngine`` and lands each update
through its own ``load_weights``. See the README's "Python" section.
"""

from wsync import errors
from wsync._wsync import trainer_backends
from wsync.errors import *  # noqa: F401,F403  (the exception classes)
from wsync.receiver import ReceiverEngine  # receiver side

__all__ = ["errors", "trainer_backends", "ReceiverEngine"] + errors.__all__
