"""Who trained a swarm's model, and how much: the tokens each peer says it processed (clipped to what its
step allows), and the bounded table of them a node keeps for its checkpoint and the export's model card."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from node.swarm.recipe import TrainingRecipe

MAX_CONTRIBUTORS = 256  # peers a table remembers; a newcomer beyond that evicts the smallest
MAX_PEER_ID_CHARS = 128  # as node.net.records: a longer id in a file is no peer's
# Tokens any one record or file may claim: 10^15 is ~50 years of a 1M tokens/s node; JSON carries it exactly.
MAX_TOKENS = 10**15


def tokens_per_step(recipe: TrainingRecipe | None) -> int:
    """The tokens one optimizer step of the recipe consumes on one node (0 without a model: vector mode)."""
    if recipe is None:
        return 0
    return recipe.batch_size * recipe.context * recipe.optimizer.micro_batches


def plausible_tokens(claimed: int, step: int, per_step: int) -> int:
    """`claimed` tokens, at most what `step` steps of `per_step` tokens make (a peer cannot have processed
    more than every step it ran) and at most MAX_TOKENS."""
    return max(0, min(claimed, step * per_step, MAX_TOKENS))


def tokens_from_meta(raw: object, step: int, per_step: int) -> int:
    """A checkpoint's `tokens` (this node's own, as written by node.swarm.loop), held to its step; 0 when absent
    or unreadable."""
    try:
        claimed = int(str(raw)) if raw is not None else 0
    except ValueError:
        return 0
    return plausible_tokens(claimed, step, per_step)


class TokensRecord(Protocol):
    """What the table reads of a peer record (node.net.records.PeerRecord)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def tokens(self) -> int: ...


@dataclass(frozen=True)
class Contributor:
    peer_id: str
    tokens: int
    share: float  # of the table's total tokens, 0..1


class ContributorTable:
    """Peer id -> the highest tokens seen of it, for at most `cap` peers: when full, a newcomer with more
    tokens than the smallest entry takes its place (ties: the larger peer id goes), so a flood of
    short-lived ids cannot push out the peers that did the work."""

    def __init__(self, cap: int = MAX_CONTRIBUTORS, initial: Mapping[str, int] | None = None) -> None:
        if cap < 1:
            raise ValueError("a contributor table holds at least one peer")
        self.cap = cap
        self._tokens: dict[str, int] = {}
        self.evicted = 0  # entries dropped (or newcomers refused) because the table was full
        for peer_id, tokens in sorted((initial or {}).items()):
            self.observe(peer_id, tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def observe(self, peer_id: str, tokens: int) -> None:
        """`peer_id` has processed `tokens` (already judged plausible); keeps the highest seen."""
        if not peer_id or len(peer_id) > MAX_PEER_ID_CHARS or tokens <= 0:
            return
        tokens = min(int(tokens), MAX_TOKENS)
        known = self._tokens.get(peer_id)
        if known is not None:
            self._tokens[peer_id] = max(known, tokens)
            return
        if len(self._tokens) >= self.cap:
            smallest = min(self._tokens.items(), key=lambda item: (item[1], _descending(item[0])))
            if (tokens, _descending(peer_id)) <= (smallest[1], _descending(smallest[0])):
                self.evicted += 1
                return
            del self._tokens[smallest[0]]
            self.evicted += 1
        self._tokens[peer_id] = tokens

    def observe_view(self, records: Iterable[TokensRecord]) -> None:
        for record in records:
            self.observe(record.peer_id, record.tokens)

    def as_dict(self) -> dict[str, int]:
        """Peer id -> tokens, in peer id order."""
        return dict(sorted(self._tokens.items()))

    def ranked(self) -> list[Contributor]:
        return ranked(self._tokens)

    def to_meta(self) -> str:
        """The table as a file's metadata value (compact JSON, peer id order)."""
        return json.dumps(self.as_dict(), separators=(",", ":"))

    @classmethod
    def from_meta(cls, raw: object, cap: int = MAX_CONTRIBUTORS) -> ContributorTable:
        """A table read back from a file's metadata; entries that are no peer id and token count are
        skipped, and at most `cap` are kept (the largest)."""
        return cls(cap, parse_contributors(raw))


def parse_contributors(raw: object) -> dict[str, int]:
    """Peer id -> tokens from a file's `contributors` value (a JSON object as text, or a mapping);
    anything else gives {} and bad entries are left out, as a file may be of another murmur."""
    value: object = raw
    if isinstance(raw, (str, bytes)):
        try:
            value = json.loads(raw)
        except ValueError:
            return {}
    if not isinstance(value, Mapping):
        return {}
    return {str(k): min(v, MAX_TOKENS) for k, v in value.items()
            if isinstance(k, str) and 0 < len(k) <= MAX_PEER_ID_CHARS and isinstance(v, int)
            and not isinstance(v, bool) and v > 0}


def ranked(tokens: Mapping[str, int]) -> list[Contributor]:
    """Contributors by tokens, most first (ties by peer id), each with its share of the total."""
    total = sum(tokens.values())
    order = sorted(tokens.items(), key=lambda item: (-item[1], item[0]))
    return [Contributor(peer, n, n / total if total else 0.0) for peer, n in order]


def _descending(peer_id: str) -> tuple[int, ...]:
    # eviction order among equal token counts: the larger id goes first, the same on every node
    return tuple(-ord(c) for c in peer_id)


__all__ = ["MAX_CONTRIBUTORS", "MAX_TOKENS", "Contributor", "ContributorTable", "parse_contributors",
           "plausible_tokens", "ranked", "tokens_from_meta", "tokens_per_step"]
