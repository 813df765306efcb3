"""Why a message from a peer was refused: one exception type per failure, each with the label it is counted under.

A node catches `WireError`, logs it, and increments the counter named by the exception's `kind`;
the monitor shows those counts. `WIRE_ERROR_KINDS` lists every label so counters can start at zero.
"""

from __future__ import annotations

from typing import ClassVar


class WireError(Exception):
    """A frame or message was refused. `kind` is a short, stable label for counters and logs."""

    kind: ClassVar[str] = "wire_error"


class FrameTooLarge(WireError):
    """A length, count or size exceeds a `WireLimits` bound (checked before anything is allocated)."""

    kind = "too_large"


class BadSchema(WireError):
    """The bytes are not a well-formed message: bad msgpack, missing/unknown keys, wrong types or values."""

    kind = "bad_schema"


class UnknownCodec(WireError):
    """The header names a codec this node does not know, or one the receiver does not accept."""

    kind = "unknown_codec"


class ManifestMismatch(WireError):
    """The tensor manifest disagrees with the codec's sizes, the payload, or the receiver's model."""

    kind = "manifest_mismatch"


class NonFiniteValues(WireError):
    """A tensor holds NaN or infinity, or a value the codec cannot represent without overflowing."""

    kind = "non_finite"


class OutOfRange(WireError):
    """A tensor holds finite values beyond the receiver's magnitude bound (`gossip.robust.ValueBound`)."""

    kind = "out_of_range"


class Truncated(WireError):
    """The stream or buffer ended before the message was complete."""

    kind = "truncated"


class WrongSwarm(WireError):
    """The message belongs to another swarm, or to this swarm under a different training config."""

    kind = "wrong_swarm"


class VersionMismatch(WireError):
    """The sender speaks another version of the wire protocol."""

    kind = "bad_version"


class NotMember(WireError):
    """The sender is not admitted to the swarm: it proves no membership (swarm key or founder's certificate)."""

    kind = "not_member"


WIRE_ERROR_KINDS: tuple[str, ...] = tuple(
    cls.kind
    for cls in (
        FrameTooLarge,
        BadSchema,
        UnknownCodec,
        ManifestMismatch,
        NonFiniteValues,
        OutOfRange,
        Truncated,
        WrongSwarm,
        VersionMismatch,
        NotMember,
    )
)
