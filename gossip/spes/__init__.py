"""SPES (sparse expert synchronisation for mixture-of-experts models) as pure numpy: who owns which
expert, per-expert version/hash records, the expert-merging warm-up, and the analytic traffic and memory.

No torch, no networking: `node/spes/node.py` runs these rules over a trainer and the gossip transport,
and the daemon publishes the records under `<swarm>.experts`. docs/spes.md explains the scheme.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from gossip.codecs import CODEC_TYPES, get_codec
from gossip.errors import WireError

ExpertKey = tuple[int, int]  # (MoE layer, expert index within the layer)
# peer id -> the records it published (or holds), one per expert
RecordsByPeer = Mapping[str, Mapping[ExpertKey, "ExpertRecord"]]

MERGE_NEIGHBOURS = 4  # an expert moves toward the mean of this many most similar experts of its layer
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


@dataclass(frozen=True)
class SpesConfig:
    """The SPES knobs. Steps count completed optimizer steps (the trainer's `step` after a step)."""

    sync_every: int = 1  # S: a sync after every S-th step
    merge_every: int = 10  # M: merge warm-up after every M-th step (a multiple of S: merges follow a sync)
    merge_until: int = 0  # D: no merging from step D on; 0 turns the warm-up off
    alpha0: float = 0.1  # merge strength at step 0
    replication: int = 2  # r: owners per expert where peers and capacities allow
    expert_codec: str = "fp32"  # co-owners mix their expert in this codec
    refresh_codec: str = "bf16"  # frozen copies travel (and are hashed) in this codec
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
        if self.expert_codec not in CODEC_TYPES or self.expert_codec == "topk":
            raise ValueError(f"spes config: expert_codec must be one of {REFRESH_CODECS}, got {self.expert_codec!r}")
        if self.refresh_codec not in REFRESH_CODECS:
            raise ValueError(f"spes config: refresh_codec must be one of {REFRESH_CODECS}, got {self.refresh_codec!r}")

    def syncs_after(self, step: int) -> bool:
        """Whether the step that brought the trainer to `step` completed steps ends with a sync."""
        return step > 0 and step % self.sync_every == 0

    def refreshes_at(self, sync_index: int) -> bool:
        return sync_index % self.refresh_every == 0

    def merges_after(self, step: int) -> bool:
        return step > 0 and step % self.merge_every == 0 and step < self.merge_until

    def alpha_at(self, step: int) -> float:
        return merge_alpha(step, self.alpha0, self.merge_until)


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
        if not (isinstance(entry, list | tuple) and len(entry) == 3 and isinstance(entry[2], bool)):
            raise ValueError(f"expert records: entry for {label} must be [version, hash, owner], got {entry!r}")
        out[key] = ExpertRecord(entry[0], entry[1], entry[2])
    return out


# ---- expert-merging warm-up -------------------------------------------------------------------------


def merge_alpha(step: int, alpha0: float, until: int) -> float:
    """alpha(step) = alpha0 * (1 - step / D) for step < D, and exactly 0 from D on (or when D = 0)."""
    if until <= 0 or step >= until:
        return 0.0
    return alpha0 * (1.0 - step / until)


def _exact_dot(a: np.ndarray, b: np.ndarray) -> float:
    # float32 * float32 is exact in float64, and fsum rounds the sum once, correctly: the same
    # inputs give the same bits on every IEEE machine, whatever BLAS or SIMD width numpy uses.
    return math.fsum(np.multiply(a, b, dtype=np.float64).tolist())


def _flat_first(first_matrices: Sequence[np.ndarray]) -> list[np.ndarray]:
    flat = [np.ascontiguousarray(m, dtype=np.float32).reshape(-1) for m in first_matrices]
    if len({f.size for f in flat}) > 1:
        raise ValueError("experts of one layer must have first matrices of one size")
    return flat


def _cosine(dot: float, norm_a: float, norm_b: float) -> float:
    denominator = norm_a * norm_b
    return dot / denominator if denominator > 0 else 0.0


def expert_similarity(first_matrices: Sequence[np.ndarray], exact: bool = False) -> np.ndarray:
    """Cosine similarity between the flattened first matrices of a layer's experts (E x E, float64;
    0 for a zero matrix). With `exact`, every dot product is correctly rounded (bit-identical on
    every machine, ~100x slower); otherwise one float64 matrix product, whose summation error is
    at most about size * 2^-53 in cosine (Cauchy-Schwarz bounds the sum of |products|)."""
    flat = _flat_first(first_matrices)
    count = len(flat)
    if exact:
        norms = [math.sqrt(_exact_dot(f, f)) for f in flat]
        sim = np.eye(count, dtype=np.float64)
        for i in range(count):
            for j in range(i + 1, count):
                sim[i, j] = sim[j, i] = _cosine(_exact_dot(flat[i], flat[j]), norms[i], norms[j])
        return sim
    stacked = np.array(flat, dtype=np.float64)
    gram = stacked @ stacked.T
    norms = np.sqrt(np.diag(gram))
    outer = np.outer(norms, norms)
    sim = np.divide(gram, outer, out=np.zeros_like(gram), where=outer > 0)
    np.fill_diagonal(sim, 1.0)
    return sim


def _ranked(row: Sequence[float], i: int) -> list[int]:
    """The other experts, most similar first, ties by index."""
    return sorted((j for j in range(len(row)) if j != i), key=lambda j: (-row[j], j))


def merge_partners(first_matrices: Sequence[np.ndarray], neighbours: int = MERGE_NEIGHBOURS) -> list[tuple[int, ...]]:
    """For each expert, the `neighbours` other experts of its layer most similar to it (ties: lower
    index first), sorted by index; fewer when the layer has fewer other experts.

    The choice is the same on every machine: the fast cosines decide wherever the gap at the
    top-k boundary is wider than their error bound (with a wide margin); a row with a closer call
    is recomputed with correctly rounded dot products. The merged values depend on nothing else.
    """
    flat = _flat_first(first_matrices)
    count = len(flat)
    margin = 1e-8 + 8 * (flat[0].size if flat else 0) * 2.0**-53
    fast = expert_similarity(flat)
    exact_norms: list[float] | None = None
    out = []
    for i in range(count):
        order = _ranked(fast[i], i)
        if len(order) > neighbours and fast[i, order[neighbours - 1]] - fast[i, order[neighbours]] <= margin:
            if exact_norms is None:
                exact_norms = [math.sqrt(_exact_dot(f, f)) for f in flat]
            row = [1.0 if j == i else _cosine(_exact_dot(flat[i], flat[j]), exact_norms[i], exact_norms[j])
                   for j in range(count)]
            order = _ranked(row, i)
        out.append(tuple(sorted(order[:neighbours])))
    return out


def merge_layer(experts: Sequence[Sequence[np.ndarray]], alpha: float, neighbours: int = MERGE_NEIGHBOURS,
                only: Iterable[int] | None = None) -> dict[int, list[np.ndarray]]:
    """One warm-up merge of a layer: expert i becomes x_i + alpha * (mean of its partners - x_i),
    tensor by tensor, from the values before the merge (all experts move at once).

    `experts[i]` lists expert i's tensors, its first matrix first (similarity is measured on it).
    `only` limits which experts are computed (a node computes the ones it owns); the result maps
    expert index -> new float32 tensors. Element-wise float64 arithmetic in a fixed order and a
    machine-independent choice of partners make the result bit-identical wherever the inputs are.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"merge alpha must be in [0, 1], got {alpha!r}")
    partners = merge_partners([tensors[0] for tensors in experts], neighbours)
    chosen = range(len(experts)) if only is None else sorted(set(only))
    merged = {}
    for i in chosen:
        new = []
        for t, x in enumerate(experts[i]):
            own = np.asarray(x, dtype=np.float64)
            if not partners[i] or alpha == 0.0:
                new.append(np.array(x, dtype=np.float32, copy=True))
                continue
            total = np.zeros_like(own)
            for j in partners[i]:
                total += np.asarray(experts[j][t], dtype=np.float64)
            mean = total / len(partners[i])
            new.append((own + alpha * (mean - own)).astype(np.float32))
        merged[i] = new
    return merged


# ---- traffic and memory -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncTraffic:
    """Bytes one node sends in one sync, by what they carry."""

    shared: int
    experts: int
    refresh: int

    @property
    def total(self) -> int:
        return self.shared + self.experts + self.refresh


def sync_bytes_sent(shared_message_bytes: int, shared_out_degree: int, expert_message_bytes: int,
                    co_owner_counts: Iterable[int], refresh_message_bytes: int, refreshes_served: int) -> SyncTraffic:
    """The analytic bytes a node sends in a sync: its shared weights to each topology neighbour
    that mixes them, each owned expert to each of its co-owners, and one refresh message per
    changed frozen copy it serves. Message sizes are whole wire messages (gossip.wire.message_nbytes);
    header-only requests (pulls, fetch requests) are left out: they are a few hundred bytes."""
    return SyncTraffic(
        shared=shared_message_bytes * shared_out_degree,
        experts=expert_message_bytes * sum(co_owner_counts),
        refresh=refresh_message_bytes * refreshes_served,
    )


def reference_sync_bytes(shared_numel: int, owned_expert_numel: int, total_numel: int) -> int:
    """Bytes one node moves per sync in the reference SPES implementation (central server, barrier):
    it uploads its shared weights and owned experts in fp32 and downloads the whole model in fp32."""
    return 4 * (shared_numel + owned_expert_numel) + 4 * total_numel


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of parameters, gradients and optimizer state on one node at the peak of a step."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def training_memory(trainable_numel: int, frozen_numel: int, optimizer_floats_per_param: int,
                    frozen_bytes_per_param: int = 4) -> TrainingMemory:
    """Analytic memory: fp32 trainable parameters with fp32 gradients and `optimizer_floats_per_param`
    fp32 state values each (Adam 2, SGD with momentum 1, plain SGD 0), frozen parameters at
    `frozen_bytes_per_param` (4 fp32, 2 bf16) with neither."""
    return TrainingMemory(
        parameters=4 * trainable_numel + frozen_bytes_per_param * frozen_numel,
        gradients=4 * trainable_numel,
        optimizer_state=4 * optimizer_floats_per_param * trainable_numel,
    )
