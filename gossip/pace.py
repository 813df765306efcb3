"""How long a transfer of tensors (a round's exchange, a whole model) may take: a deadline on progress (a
piece that stalls cuts it) and a bound on the whole, from its size over the goodput measured for the peer
(docs/training.md, "Transfers").

A slow but moving link is not cut as if it were dead; a peer that stops, or trickles bytes below the
floor, is: nothing holds a transfer open for longer than its size allows at the floor."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

# How much slower than its measured goodput a peer may be before the whole-transfer bound cuts it: links
# share their capacity with other streams and the measurement is a moving average.
GOODPUT_SLACK = 4.0
# A paced transfer reads the stream in pieces of at most this many bytes: the stall timeout applies to each,
# and progress moves with each (a payload frame is up to 4 MiB, which a slow link takes long to deliver).
PIECE_BYTES = 64 << 10


class TransferStalled(TimeoutError):
    """No piece of a transfer arrived (or could be written) within the stall timeout."""


class TransferPace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The deadlines of transfers of tensors once their size is known (a round's exchanges, a joiner's
    download, the pulls of the swarm-average evaluation and the final merge, the answers to them),
    declared once (gossip.knobs): each field is a node's own setting (`gossip.stall_timeout`,
    `--stall-timeout`; `gossip.goodput_floor`, `--goodput-floor`: node.config.table), hence docs/cli.md's table."""

    stall_timeout_s: Annotated[float, msgspec.Meta(
        gt=0.0, le=600.0, extra={"metavar": "S", "setting": "stall_timeout"},
        description="seconds a transfer of tensors (a round's exchange, a join's download, the pulls of the swarm "
                    "average and the final merge) may go without a piece (64 KiB) arriving before it is cut as stalled",
    )] = 20.0
    goodput_floor_mbit_s: Annotated[float, msgspec.Meta(
        gt=0.0, le=100_000.0, extra={"metavar": "MBIT_S", "setting": "goodput_floor"},
        description="the slowest goodput (Mbit/s) a transfer of tensors is given time for: it is cut after the "
                    f"stall timeout plus its size at the larger of this floor and 1/{GOODPUT_SLACK:g} of the "
                    "goodput measured for that peer",
    )] = 2.0

    def rate_bytes_s(self, measured_mbit_s: float | None) -> float:
        """The slowest rate a transfer from a peer measured at `measured_mbit_s` (None: not yet) is given."""
        mbit_s = self.goodput_floor_mbit_s
        if measured_mbit_s is not None and math.isfinite(measured_mbit_s):
            mbit_s = max(mbit_s, measured_mbit_s / GOODPUT_SLACK)
        return mbit_s * 1e6 / 8

    def whole_s(self, nbytes: int, measured_mbit_s: float | None = None) -> float:
        """The most seconds a transfer of `nbytes` may take once its size is known."""
        return self.stall_timeout_s + nbytes / self.rate_bytes_s(measured_mbit_s)


DEFAULT_PACE = TransferPace()


def measured_goodput(transport: object, peer: str) -> float | None:
    """The goodput (Mbit/s) `transport` measured from `peer` lately; None where it measures none (the
    in-memory transport, a peer not measured yet)."""
    measured = getattr(transport, "goodput_mbit_s", None)
    value = measured(peer) if callable(measured) else None
    return value if isinstance(value, float) else None


@dataclass
class TransferProgress:
    """One download as it runs (read by the status page and the command line while it lasts)."""

    peer: str = ""
    bytes_total: int = 0  # the payload's, known once the header is read
    bytes_done: int = 0
    started: float = field(default_factory=time.monotonic)

    def begin(self, peer: str, bytes_total: int) -> None:
        self.peer, self.bytes_total, self.bytes_done, self.started = peer, bytes_total, 0, time.monotonic()

    def add(self, nbytes: int) -> None:
        """`nbytes` more arrived; before `begin` (the header, whose size is not the payload's) none count."""
        self.bytes_done = min(self.bytes_total, self.bytes_done + nbytes)

    @property
    def rate_bps(self) -> float:
        """Bytes per second since the payload began."""
        elapsed = time.monotonic() - self.started
        return self.bytes_done / elapsed if elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        rate = self.rate_bps
        return (self.bytes_total - self.bytes_done) / rate if rate > 0 else None
