"""Who a protocol talks to: the hook through which a node admits the senders of a key or allowlist swarm and
proves its own membership in every message it sends.

node.net.admission builds it; the protocols here only call it. An open swarm uses `OPEN`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gossip.wire import Header, HeaderFields, MetaValue


class StreamAdmission(Protocol):
    """What the gossip and SPES protocols need to know about membership."""

    def credentials(self, fields: HeaderFields) -> Mapping[str, MetaValue]:
        """The meta entries that prove this node's membership in a message with these header fields."""
        ...

    def admit(self, header: Header) -> None:
        """Raise gossip.errors.NotMember unless `header.sender` (already checked to be the stream's
        authenticated peer) proves its membership in this header."""
        ...


class _Open:
    """Anyone takes part: no proof is sent, every sender is admitted."""

    def credentials(self, fields: HeaderFields) -> Mapping[str, MetaValue]:
        return {}

    def admit(self, header: Header) -> None:
        return None


OPEN: StreamAdmission = _Open()
