"""A user model named by import path (`--model tiny_model:build`, with tests/ on PYTHONPATH): the
multi-process training tests use it to train in seconds, and it exercises the import-path route."""

import os

from node.train.models import ModelConfig, build_model

TINY = ModelConfig(context=32, layers=2, width=64, heads=4, experts=0, expert_hidden=128)


def build():
    return build_model(TINY)


class _FailsAfter(type(build_model(TINY))):
    """The tiny model, whose forward pass raises from its 20th call on: a user model with a bug."""

    calls = 0

    def forward(self, idx, targets=None):
        self.calls += 1
        if self.calls >= 20:
            raise RuntimeError("user model bug: shapes went wrong")
        return super().forward(idx, targets)


def build_failing():
    model = build()
    model.__class__ = _FailsAfter
    return model


class _Paced(type(build_model(TINY))):
    """The tiny model taking at least PACE_S per forward pass (the compute time of a bigger model), so
    that a multi-process run lasts long enough for a process started mid-run to join it, however fast
    or loaded the machine is. TINY_PACE_S in the environment sets the pace (a slower volunteer)."""

    PACE_S = float(os.environ.get("TINY_PACE_S", "0.1"))
    last = 0.0

    def forward(self, idx, targets=None):
        import time

        wait = self.last + self.PACE_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.last = time.monotonic()
        return super().forward(idx, targets)


def build_paced():
    model = build()
    model.__class__ = _Paced
    return model
