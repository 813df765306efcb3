"""SPES's rules as pure numpy: the knobs, who owns which expert, and the per-expert version/hash
records peers publish (and their declared wire schema). docs/spes.md explains the scheme.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from gossip.codecs import CODEC_TYPES, SPARSE_CODECS, get_codec
from gossip.errors import WireError
from gossip.knobs import MAX_OUTER_LR, MAX_STEPS

ExpertKey = tuple[int, int]  # (MoE layer, expert index within the layer)
# peer id -> the records it published (or holds), one per expert
RecordsByPeer = Mapping[str, Mapping[ExpertKey, "ExpertRecord"]]

REFRESH_CODECS = ("fp32", "fp16", "bf16", "int8")  # codecs a frozen copy may travel in (not top-k: whole values)


class ExpertHashMismatch(WireError):
    """An expert copy whose content does not hash to the value its sender declared."""

    kind = "hash_mismatch"


def expert_label(key: ExpertKey) -> str:
    """"layer.expert": the expert's name in records, protocol names and logs."""
    return f"{key[0]}.{key[1]}"


def parse_expert_label(label: str) -> ExpertKey:
    layer, dot, expert = label.partition(".")
    if not dot or not layer.isdigit() or not expert.isdigit():
        raise ValueError(f"expert label {label!r} is not of the form layer.expert")
    return int(layer), int(expert)


# ---- configuration ----------------------------------------------------------------------------------


MAX_SYNC_ANCHOR_EVERY = 10**6  # the swarm document's cap on anchor_every (a node's own setting has none)
# The swarm document's caps on S, M and r (a node's own settings have none)
MAX_SPES_EVERY = 10**6
MAX_REPLICATION = 64
NODE_REFRESH_CODECS = ("fp16", "bf16", "int8")  # what a node's --spes-refresh-codec offers (a document: fp32 too)
_NO_CAP = {"le": None}


class SpesSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """SPES's swarm-wide knobs, each declared once (gossip.knobs, as gossip.diloco.DilocoSettings): type,
    bounds (the swarm document's), help. The document's part (node.swarm.recipe.SpesDoc, written with every
    field) subclasses it and the settings table's rows `training.spes_<field>` (`--spes-<field>`,
    `MURMUR_SPES_<FIELD>`) derive from it.

    Only expert_codec has a default, the one documents written before it existed mean; a node's defaults
    are SpesConfig's and node.config's. SpesConfig keeps its own checks and messages (S | M, ...). A node's
    own settings are not capped (`setting_bounds`), and it offers the refresh codecs NODE_REFRESH_CODECS
    (`setting_choices`: fp32 copies are a document's, not a flag's)."""

    sync_every: Annotated[int, msgspec.Meta(
        ge=1, le=MAX_SPES_EVERY, extra={"noun": "steps", "setting_bounds": _NO_CAP},
        description="S: steps between SPES syncs (the swarm's)",
    )]
    merge_every: Annotated[int, msgspec.Meta(
        ge=1, le=MAX_SPES_EVERY, extra={"noun": "steps", "setting_bounds": _NO_CAP},
        description="M: steps between expert-merging warm-up merges, a multiple of S (the swarm's)",
    )]
    merge_until: Annotated[int, msgspec.Meta(
        ge=0, le=MAX_STEPS, extra={"setting_bounds": _NO_CAP},
        description="D: no warm-up merge from this step on; 0 turns the warm-up off (the swarm's)",
    )]
    alpha0: Annotated[float, msgspec.Meta(
        ge=0.0, le=1.0, extra={"metavar": "ALPHA"},
        description="warm-up merge strength at step 0, falling linearly to 0 at D (the swarm's)",
    )]
    replication: Annotated[int, msgspec.Meta(
        ge=1, le=MAX_REPLICATION, extra={"noun": "replication", "setting_bounds": _NO_CAP},
        description="r: owners per expert where peers and capacities allow (the swarm's)",
    )]
    refresh_codec: Annotated[Literal["fp32", "fp16", "bf16", "int8"], msgspec.Meta(
        extra={"metavar": "CODEC", "noun": "refresh codec", "setting_choices": NODE_REFRESH_CODECS},
        description="codec of the deltas frozen expert copies are refreshed with (without delta refresh: of the "
        "copies, which are hashed in it) (the swarm's)",
    )]
    expert_codec: Annotated[Literal["fp32", "fp16", "bf16", "int8"], msgspec.Meta(
        extra={"metavar": "CODEC", "noun": "expert codec"},
        description="codec co-owners mix their experts in, with error feedback (the swarm's)",
    )] = "fp32"


class SpesSyncSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """SPES's sync knobs (issue 15), each declared once (gossip.knobs, as gossip.diloco.DilocoSettings):
    type, bounds (the swarm document's), help, and the default a swarm document that leaves the field
    out means. The document's part (node.swarm.recipe.SpesSyncDoc) subclasses it and the settings table's
    rows `training.spes_<field>` (`--spes-<field>`, `MURMUR_SPES_<FIELD>`) derive from it.

    `shared_codec` and `delta_refresh` default otherwise for a node (SpesConfig's int8 and on): these
    defaults are what SPES documents written before the fields existed mean, which keeps their hash."""

    shared_codec: Annotated[Literal["fp32", "fp16", "bf16", "int8"], msgspec.Meta(
        extra={"metavar": "CODEC", "noun": "shared codec"},
        description="codec topology neighbours mix the shared weights in, with error feedback (the swarm's; SPES "
        "ignores --codec)",
    )] = "fp32"
    delta_refresh: Annotated[bool, msgspec.Meta(
        description="refresh frozen copies with the owner's compressed delta (in --spes-refresh-codec) since the "
        "copy held; off: whole copies in --spes-refresh-codec (the swarm's)",
    )] = False
    outer_lr: Annotated[float, msgspec.Meta(
        gt=0.0, le=MAX_OUTER_LR, extra={"metavar": "LR"},
        description="outer learning rate of each sync's step on the mixed pseudo-gradients; 1 with no momentum "
        "is plain mixing (the swarm's)",
    )] = 1.0
    outer_momentum: Annotated[float, msgspec.Meta(
        ge=0.0, lt=1.0, extra={"metavar": "MU"},
        description="Nesterov momentum of each sync's outer step (the swarm's)",
    )] = 0.0
    # the document caps the period (MAX_SYNC_ANCHOR_EVERY); a node's own setting does not
    anchor_every: Annotated[int, msgspec.Meta(
        ge=0, le=MAX_SYNC_ANCHOR_EVERY, extra={"setting_bounds": {"le": None}},
        description="mix the anchors at every this-many-th sync (0: never) (the swarm's)",
    )] = 1


_SYNC = SpesSyncSettings()


@dataclass(frozen=True)
class SpesConfig:
    """The SPES knobs. Steps count completed optimizer steps (the trainer's `step` after a step)."""

    # S: a sync after every S-th step. 50, the low end of the reference's 50-100: each sync moves about the
    # shared weights and owned experts once, so S = 1 would need a link of the model's size per step, and
    # the loss grows with S (docs/benchmarks.md, SPES part 4).
    sync_every: int = 50
    merge_every: int = 50  # M: merge warm-up after every M-th step (a multiple of S: merges follow a sync)
    merge_until: int = 0  # D: no merging from step D on; 0 turns the warm-up off
    alpha0: float = 0.1  # merge strength at step 0
    replication: int = 2  # r: owners per expert where peers and capacities allow
    # Each sync is an outer step per group (shared weights; each owned expert) over gossip, compressed
    # with error feedback (node.algorithms.outer_group): the pseudo-gradients mixed in the group's codec,
    # the anchors every `anchor_every`-th sync; at outer lr 1 without momentum (the defaults) one
    # message per group per sync, the weights themselves, as plain SPES mixes them.
    shared_codec: str = "int8"  # the shared weights travel in this codec
    expert_codec: str = "int8"  # co-owners mix their expert in this codec
    outer_lr: float = _SYNC.outer_lr
    outer_momentum: float = _SYNC.outer_momentum
    anchor_every: int = _SYNC.anchor_every
    # delta_refresh: frozen copies are refreshed with the owner's delta in refresh_codec since the copy
    # the asker holds (the owner's published copy is the sum of its deltas, so the asker's sum hashes the
    # same); a whole copy travels in fp32. Off: whole copies travel (and are hashed) in refresh_codec.
    refresh_codec: str = "int8"
    delta_refresh: bool = True
    refresh_every: int = 1  # frozen copies are refreshed (when changed) at every this-many-th sync
    frozen_bf16: bool = False  # store frozen experts in bfloat16 on the node

    def __post_init__(self) -> None:
        for name in ("sync_every", "merge_every", "replication", "refresh_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"spes config: {name} must be >= 1, got {getattr(self, name)!r}")
        if self.merge_until < 0:
            raise ValueError(f"spes config: merge_until must be >= 0, got {self.merge_until!r}")
        if self.merge_every % self.sync_every:
            raise ValueError(f"spes config: merge_every ({self.merge_every}) must be a multiple of sync_every "
                             f"({self.sync_every}), so that every merge follows a sync")
        if not (math.isfinite(self.alpha0) and 0.0 <= self.alpha0 <= 1.0):
            raise ValueError(f"spes config: alpha0 must be in [0, 1], got {self.alpha0!r}")
        for name in ("shared_codec", "expert_codec"):
            if getattr(self, name) not in CODEC_TYPES or getattr(self, name) in SPARSE_CODECS:
                raise ValueError(f"spes config: {name} must be one of {REFRESH_CODECS}, got {getattr(self, name)!r}")
        if not (math.isfinite(self.outer_lr) and 0.0 < self.outer_lr <= MAX_OUTER_LR):
            raise ValueError(f"spes config: outer_lr must be in (0, 10], got {self.outer_lr!r}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"spes config: outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if self.anchor_every < 0:
            raise ValueError(f"spes config: anchor_every must be >= 0, got {self.anchor_every!r}")
        if self.refresh_codec not in REFRESH_CODECS:
            raise ValueError(f"spes config: refresh_codec must be one of {REFRESH_CODECS}, got {self.refresh_codec!r}")

    def syncs_after(self, step: int) -> bool:
        """Whether the step that brought the trainer to `step` completed steps ends with a sync."""
        return step > 0 and step % self.sync_every == 0

    @property
    def image_codec(self) -> str:
        """The codec a whole copy travels and is hashed in: exact with delta refreshes."""
        return "fp32" if self.delta_refresh else self.refresh_codec

    def refreshes_at(self, sync_index: int) -> bool:
        return sync_index % self.refresh_every == 0

    def merges_after(self, step: int) -> bool:
        return step > 0 and step % self.merge_every == 0 and step < self.merge_until

    def alpha_at(self, step: int) -> float:
        return merge_alpha(step, self.alpha0, self.merge_until)


def merge_alpha(step: int, alpha0: float, until: int) -> float:
    """alpha(step) = alpha0 * (1 - step / D) for step < D, and exactly 0 from D on (or when D = 0)."""
    if until <= 0 or step >= until:
        return 0.0
    return alpha0 * (1.0 - step / until)


# ---- ownership --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ownership:
    """Which peers own (train) each expert: every (layer, expert) has at least one owner."""

    peer_ids: tuple[str, ...]  # the membership view it was computed from, sorted
    experts_per_layer: int
    layers: int
    owners: Mapping[ExpertKey, tuple[str, ...]]  # sorted owner ids

    def owned_by(self, peer_id: str) -> frozenset[ExpertKey]:
        return frozenset(key for key, owners in self.owners.items() if peer_id in owners)

    def co_owners(self, key: ExpertKey, peer_id: str) -> tuple[str, ...]:
        """The other owners of `key` (empty when `peer_id` owns it alone or not at all)."""
        owners = self.owners[key]
        return tuple(p for p in owners if p != peer_id) if peer_id in owners else ()

    @property
    def keys(self) -> tuple[ExpertKey, ...]:
        return tuple(sorted(self.owners))


def assign_experts(peer_ids: Iterable[str], capacities: Mapping[str, int], experts_per_layer: int, layers: int,
                   replication: int) -> Ownership:
    """The ownership every peer with the same view and capacities computes.

    `capacities[p]` is how many experts per MoE layer peer p trains. Replica passes k = 0..r-1 walk
    the experts in order; each gives the expert to the peer (not already an owner) with the most
    capacity left, ties going to the peer whose rank follows the expert index by k, so equal
    capacities spread experts round-robin and co-owner pairs differ between experts. The first pass
    always gives every expert an owner, beyond capacity if it must (the least loaded peer): coverage
    comes before capacity. Later passes stop at capacity, so r shrinks where the swarm cannot hold
    it (e.g. r = min(r, peers)). Every layer gets the same assignment.
    """
    peers = sorted(set(peer_ids))
    if not peers:
        raise ValueError("assign_experts needs at least one peer")
    if experts_per_layer < 1 or layers < 1 or replication < 1:
        raise ValueError(f"experts_per_layer, layers and replication must be >= 1, got "
                         f"{experts_per_layer}, {layers}, {replication}")
    missing = [p for p in peers if p not in capacities]
    if missing:
        raise ValueError(f"no capacity given for peers {missing[:3]}")
    bad = {p: capacities[p] for p in peers if not isinstance(capacities[p], int) or capacities[p] < 0}
    if bad:
        raise ValueError(f"capacities must be integers >= 0, got {bad}")
    n = len(peers)
    remaining = {p: capacities[p] for p in peers}
    load = dict.fromkeys(peers, 0)
    owners: list[list[str]] = [[] for _ in range(experts_per_layer)]
    for k in range(min(replication, n)):
        for e in range(experts_per_layer):
            candidates = [(rank, p) for rank, p in enumerate(peers) if p not in owners[e]]
            with_room = [(rank, p) for rank, p in candidates if remaining[p] > 0]
            if with_room:
                _, chosen = min(with_room, key=lambda rp: (-remaining[rp[1]], (rp[0] - e - k) % n))
            elif k == 0:
                _, chosen = min(candidates, key=lambda rp: (load[rp[1]], (rp[0] - e) % n))
            else:
                continue
            owners[e].append(chosen)
            remaining[chosen] -= 1
            load[chosen] += 1
    per_layer = [tuple(sorted(o)) for o in owners]
    table = {(layer, e): per_layer[e] for layer in range(layers) for e in range(experts_per_layer)}
    return Ownership(tuple(peers), experts_per_layer, layers, MappingProxyType(table))


# ---- versions and hashes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertRecord:
    """What a peer says about its copy of one expert: the sync index at which its content last
    changed (versions of one expert are comparable across peers: higher is fresher), the sha256 of
    its content in the refresh codec's image, and whether the peer owns (trains) it."""

    version: int
    hash: str
    owner: bool

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"expert record: version must be an integer >= 0, got {self.version!r}")
        if not (isinstance(self.hash, str) and len(self.hash) == 64 and all(c in "0123456789abcdef" for c in self.hash)):
            raise ValueError(f"expert record: hash must be 64 lowercase hex digits, got {self.hash!r}")


def content_hash(tensors: Sequence[np.ndarray]) -> str:
    """sha256 over the tensors' float32 bytes (C order) and shapes, in the given order."""
    digest = hashlib.sha256()
    for t in tensors:
        a = np.ascontiguousarray(t, dtype=np.float32)
        digest.update(repr(a.shape).encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


def codec_image(tensors: Sequence[np.ndarray], codec_name: str) -> list[np.ndarray]:
    """What a receiver decodes after the tensors travel in `codec_name` (the values a hash covers)."""
    codec = get_codec(codec_name)
    return [codec.decode(codec.encode(np.ascontiguousarray(t, dtype=np.float32).reshape(-1)), t.size).reshape(t.shape)
            for t in tensors]


def advance_record(previous: ExpertRecord | None, new_hash: str, sync_index: int, owner: bool) -> ExpertRecord:
    """The record after a sync: the version moves only if the content changed (so an unchanged expert
    keeps its version and is never fetched again), to `sync_index` or, where that is not above the
    previous version, to one above it: versions never go back, even where the node that took an
    expert over is a few syncs behind the owner it continues from."""
    if previous is not None and previous.hash == new_hash:
        return ExpertRecord(previous.version, new_hash, owner)
    return ExpertRecord(sync_index if previous is None else max(sync_index, previous.version + 1), new_hash, owner)


def version_bound(step: int, sync_every: int, slack: int) -> int:
    """The highest expert version a node at `step` believes. Versions are sync indices (step // S; a
    takeover continues one above the copy it took), and honest peers run within a lag window of each
    other, so a version more than `slack` syncs beyond this node's own sync index is a claim no honest
    peer makes: believing it would make the claimant every refresh's source and, adopted, push every
    version in the swarm out of reach."""
    return max(0, step) // sync_every + slack


def bounded_records(records: RecordsByPeer, bound: int) -> tuple[dict[str, dict[ExpertKey, ExpertRecord]], int]:
    """`records` without the entries whose version exceeds `bound`, and how many were dropped."""
    kept: dict[str, dict[ExpertKey, ExpertRecord]] = {}
    dropped = 0
    for peer, entries in records.items():
        kept[peer] = {key: r for key, r in entries.items() if r.version <= bound}
        dropped += len(entries) - len(kept[peer])
    return kept, dropped


def capped_capacities(capacities: Mapping[str, int], experts_per_layer: int) -> dict[str, int]:
    """Capacities as ownership may use them: a peer claiming more experts per layer than a layer has
    (say 2^62) is taken at the layer's count, so it cannot claim every expert ahead of everyone."""
    return {peer: max(0, min(int(c), experts_per_layer)) for peer, c in capacities.items()}


def overclaiming_peers(capacities: Mapping[str, int], records: RecordsByPeer, experts_per_layer: int,
                       bound: int) -> frozenset[str]:
    """The peers whose claims no honest peer makes: a capacity above the layer's expert count
    (`capacities`, from their peer records; ownership caps it, see `capped_capacities`), or an expert
    record whose version is beyond `bound` (`version_bound`; the directory drops such records, see
    `bounded_records`). A node joining the swarm takes no parameters from them."""
    over = {peer for peer, c in capacities.items() if c > experts_per_layer}
    over |= {peer for peer, entries in records.items() if any(r.version > bound for r in entries.values())}
    return frozenset(over)


def needs_refresh(held: ExpertRecord | None, published: ExpertRecord) -> bool:
    """Whether a frozen copy must be fetched: its content differs from what an owner published, and
    is not already newer (a directory read can lag behind a copy fetched since)."""
    return held is None or (held.hash != published.hash and held.version <= published.version)


def refresh_source(key: ExpertKey, ownership: Ownership, records: RecordsByPeer, requester: str) -> str | None:
    """The owner a frozen copy of `key` is fetched from: among its owners that published a record,
    one with the highest version; ties are spread over requesters (by a hash of the requester's id).
    None when no owner published one."""
    published = [(records[p][key].version, p) for p in ownership.owners[key] if p != requester
                 and key in records.get(p, {})]
    if not published:
        return None
    best = max(v for v, _ in published)
    freshest = sorted(p for v, p in published if v == best)
    pick = int(hashlib.sha256(f"{requester}/{expert_label(key)}".encode()).hexdigest(), 16) % len(freshest)
    return freshest[pick]


def freshest_holder(key: ExpertKey, records: RecordsByPeer, live: Iterable[str]) -> tuple[str, ExpertRecord] | None:
    """The live peer holding the freshest copy of `key` (owner or not): highest version, an owner's
    copy before a frozen one, then the smallest id. What a new owner continues from on takeover."""
    candidates = [(p, records[p][key]) for p in sorted(set(live)) if key in records.get(p, {})]
    if not candidates:
        return None
    return min(candidates, key=lambda pr: (-pr[1].version, not pr[1].owner, pr[0]))


class WireRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """One expert record as it travels: [version, hash, owner] (the value under its label)."""

    version: Annotated[int, msgspec.Meta(ge=0)]
    hash: Annotated[str, msgspec.Meta(min_length=64, max_length=64, pattern="^[0-9a-f]+$")]
    owner: bool


WireRecords = dict[str, WireRecord]  # "layer.expert" -> its record


def records_to_wire(records: Mapping[ExpertKey, ExpertRecord]) -> dict[str, list[Any]]:
    """A peer's records as the msgpack-able value of its `<swarm>.experts` subkey."""
    return {expert_label(key): [r.version, r.hash, r.owner] for key, r in sorted(records.items())}


def records_from_wire(value: object, max_experts: int = 1 << 16) -> dict[ExpertKey, ExpertRecord]:
    """Parse (and validate) what `records_to_wire` wrote; ValueError naming the first bad entry."""
    if not isinstance(value, Mapping):
        raise ValueError(f"expert records must be a map, got {type(value).__name__}")
    if len(value) > max_experts:
        raise ValueError(f"expert records: {len(value)} entries exceed the limit {max_experts}")
    out = {}
    for label, entry in value.items():
        if not isinstance(label, str):
            raise ValueError(f"expert records: key {label!r} is not a string")
        key = parse_expert_label(label)
        try:
            record = msgspec.convert(entry, WireRecord)
        except msgspec.ValidationError:
            raise ValueError(_entry_error(label, entry)) from None
        out[key] = ExpertRecord(record.version, record.hash, record.owner)
    return out


# what each checked field of a WireRecord must be, in the words a refusal names it with
_FIELD_RULES = {"version": "version must be an integer >= 0", "hash": "hash must be 64 lowercase hex digits"}


def _entry_error(label: str, entry: object) -> str:
    """What is wrong with one refused entry: the first field (in wire order, as msgspec checks them)
    that fails its declared type on its own, else the entry's shape."""
    fields = msgspec.structs.fields(WireRecord)
    if isinstance(entry, list | tuple) and len(entry) == len(fields):
        for field, value in zip(fields, entry, strict=True):
            if field.name not in _FIELD_RULES:
                continue
            try:
                msgspec.convert(value, field.type)
            except msgspec.ValidationError:
                return f"expert record: {_FIELD_RULES[field.name]}, got {value!r}"
    return f"expert records: entry for {label} must be [version, hash, owner], got {entry!r}"
