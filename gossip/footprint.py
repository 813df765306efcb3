"""Memory a training node needs, per algorithm: host (RAM) and device (GPU) bytes, itemised.

Pure arithmetic (no torch): the preflight (node/runtime/preflight.py) compares it with this machine's
memory at start, the status shows it, docs/training.md ("Memory per parameter") prints its table.

Each term is a reading of what the code keeps, in model-sized float32 copies (4 bytes a parameter)
unless it says otherwise; the peak of a round is counted, not the average:

- Trainer (node/train/trainer.py), on the device (host memory on a CPU node): parameters and
  gradients in float32; the local optimizer (gossip/optimizers.py LocalOptimizer): Adam's two moments,
  or one SGD momentum buffer when momentum > 0, none for plain SGD. On CUDA, `HostStaging` keeps one
  pinned float32 host buffer per parameter (node/train/staging.py).
- A gossip peer (gossip/exchange.py GossipPeer) keeps its tensors as each round began for the last
  max_staleness + 1 rounds (`_round_inputs`: the current round's in float32, the past ones, which only
  pulls ask for, as its codec puts them on the wire; none past under CHOCO), the last mix until the
  next round (`_base`, the adaptive radius's reference); during a round the neighbours' decoded
  values (float32 whatever the codec, one per in-neighbour) and the mix it installs. Messages are
  encoded and decoded a chunk at a time (gossip/wire: `iter_message`, `decode_into`), so the wire's
  own buffers are bounded, not model-sized. DAdam's update (x_{t+1} = mix - lr d) runs after the
  round, on the device: no host copy beside the round's.
- CHOCO (gossip/choco.py): the anchor, two estimates (`mine`, `theirs`) per neighbour edge, and per
  exchange the difference and its decoded image (`Outgoing.wire`, `.sent`).
- Gossip DiLoCo (node/algorithms/diloco/trainer.py, node/algorithms/outer_group.py): the anchor; the
  trainer's current values and the pseudo-gradient anchor - now during a sync; per fragment one peer
  for the pseudo-gradients and one for the anchors (each a gossip peer as above, over the fragment's
  share; fragments sync one after the other, so a round's transient buffers are 1/fragments of the
  model); the outer Nesterov momentum (when momentum > 0); the peers serving the anchor and the
  momentum hold those same arrays and keep no previous values (they run no rounds); error-feedback residuals for
  a lossy codec (pseudo-gradients) and a lossy anchor codec; with overlap, the phase start (the fast
  weights) beside the anchor.
- SPES: the terms of DiLoCo's outer groups over the trained part (the shared weights and the owned
  experts), and the first trained values its main peer keeps as the base of its moves; the other
  experts stay frozen on the device in float32, or in bfloat16 where `SpesConfig.frozen_bf16` asks
  (node/algorithms/spes/node.py; the daemon's recipe leaves it off).
- A checkpoint (node/runtime/saving.py, Trainer.state) is written from a host snapshot of the
  parameters (every one in float32) and the optimizer state; DiLoCo's outer state in it shares the arrays it already holds.
- The trainer evaluates values other than its own (a joiner's downloads, the swarm average, contribution
  scoring) on a copy of the model it keeps once made (Trainer._eval_model), beside the parameters.
- Contribution scoring (node/swarm/contribution.py), where the node scores (dense gossip, CHOCO's
  estimates of its neighbours, gossip DiLoCo's fragments): while it measures, into the next round, it
  holds the values of up to MAX_SCORED neighbours (CHOCO: the estimates the next commit replaces) and the
  node's base beyond their round (the own value is a round input), and one moved copy at a time; DiLoCo's are the fragment's models, A - m, its own among them, measured from the
  anchor (node/algorithms/diloco/scoring.py).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gossip.codecs import get_codec

F32 = 4  # bytes of one float32 copy, per parameter
BF16 = 2  # bytes of one bfloat16 copy, per parameter
LOSSLESS_CODECS = ("fp32",)


class Where(enum.StrEnum):
    HOST = "host"
    DEVICE = "device"


@dataclass(frozen=True)
class MemoryInputs:
    """What the footprint depends on. `parameters` counts the whole model; with SPES, `expert_parameters`
    of them are routed experts, of which this node trains `owned_share` (0..1)."""

    parameters: int
    algorithm: str = "dadam"  # dsgd, dadam, diloco
    device: str = "cpu"  # cpu or cuda
    codec: str = "fp32"  # of whole tensors (dsgd/dadam), of the pseudo-gradients (diloco)
    inner: str = "adam"  # the trainer's optimizer: adam, or sgd
    momentum: float = 0.0  # sgd's
    max_staleness: int = 2
    in_neighbours: int = 2  # values a round receives (a ring: 2)
    choco: bool = False
    choco_edges: int = 2  # neighbours whose estimates are kept (a ring: 2)
    fragments: int = 1
    overlap: bool = False
    outer_momentum: float = 0.9
    anchor_codec: str = "int8"
    anchor_every: int = 1
    spes: bool = False
    expert_parameters: int = 0
    owned_share: float = 1.0
    frozen_bf16: bool = False  # SPES keeps the experts it does not own in bfloat16 (SpesConfig.frozen_bf16)
    scoring: bool = False  # contribution scoring (--score-every > 0) where the algorithm scores

    def __post_init__(self) -> None:
        if self.parameters < 0 or self.expert_parameters < 0 or self.expert_parameters > self.parameters:
            raise ValueError("parameter counts must be >= 0, experts at most the whole model")
        if self.algorithm not in ("dsgd", "dadam", "diloco"):
            raise ValueError(f"unknown algorithm {self.algorithm!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device kind {self.device!r}")
        if not 0.0 <= self.owned_share <= 1.0:
            raise ValueError(f"owned_share must be in [0, 1], got {self.owned_share!r}")

    @property
    def outer(self) -> bool:
        """Whether outer groups (anchors, pseudo-gradients) do the syncing: DiLoCo and SPES."""
        return self.algorithm == "diloco" or self.spes

    @property
    def trained(self) -> float:
        """Parameters this node trains (SPES: the shared ones and its owned experts)."""
        if not self.spes:
            return float(self.parameters)
        return self.parameters - self.expert_parameters + self.owned_share * self.expert_parameters


@dataclass(frozen=True)
class Term:
    name: str
    where: Where
    per_parameter: float  # bytes per parameter of the whole model
    note: str = ""


@dataclass(frozen=True)
class Footprint:
    parameters: int
    terms: tuple[Term, ...] = field(default_factory=tuple)

    def _sum(self, where: Where) -> float:
        return sum(t.per_parameter for t in self.terms if t.where is where)

    @property
    def host_per_parameter(self) -> float:
        return self._sum(Where.HOST)

    @property
    def device_per_parameter(self) -> float:
        return self._sum(Where.DEVICE)

    @property
    def host_bytes(self) -> int:
        return round(self.host_per_parameter * self.parameters)

    @property
    def device_bytes(self) -> int:
        return round(self.device_per_parameter * self.parameters)

    def largest(self, where: Where, n: int = 3) -> list[str]:
        """The names of the `n` largest terms in `where`."""
        chosen = sorted((t for t in self.terms if t.where is where), key=lambda t: -t.per_parameter)
        return [t.name for t in chosen[:n] if t.per_parameter > 0]

    def as_json(self) -> dict[str, Any]:
        return {"parameters": self.parameters,
                "host_bytes": self.host_bytes, "device_bytes": self.device_bytes,
                "host_bytes_per_parameter": round(self.host_per_parameter, 3),
                "device_bytes_per_parameter": round(self.device_per_parameter, 3),
                "terms": [{"name": t.name, "where": str(t.where), "bytes_per_parameter": round(t.per_parameter, 3),
                           "bytes": round(t.per_parameter * self.parameters)} for t in self.terms]}


# node.swarm.contribution.MAX_SCORED: the neighbours one scored round measures at most (gossip does not
# import node; tests/test_footprint.py checks the two agree)
MAX_SCORED = 4


def _optimizer_floats(m: MemoryInputs) -> int:
    if m.inner == "adam":
        return 2
    return 1 if m.momentum > 0 else 0


def _wire_bytes(codec: str) -> float:
    """Bytes per element of `codec` on the wire (float32's for a codec that needs options to size it)."""
    try:
        return min(F32, get_codec(codec).encoded_nbytes(1 << 20) / (1 << 20))
    except ValueError:
        return F32


def _peer_terms(prefix: str, share: float, m: MemoryInputs, transient: float, codec: str) -> list[Term]:
    """A gossip peer over `share` of the model (in model fractions) whose rounds send `codec`; `transient`
    scales the buffers that exist only while its round runs (fragments take turns)."""
    d = m.in_neighbours
    past = 0 if m.choco else m.max_staleness  # compressed gossip answers no past round: it keeps none
    return [
        Term(f"{prefix}round inputs (this round's, {past} past in {codec})", Where.HOST,
             (F32 + past * _wire_bytes(codec)) * share),
        Term(f"{prefix}last mix", Where.HOST, F32 * share),
        Term(f"{prefix}neighbours' values ({d}, decoded)", Where.HOST, d * F32 * share * transient),
        Term(f"{prefix}mix result", Where.HOST, F32 * share * transient),
    ]


def footprint(m: MemoryInputs) -> Footprint:
    """Host and device bytes of a training node (see the module docstring for where each term comes from)."""
    trained = m.trained / m.parameters if m.parameters else 1.0  # share of the model trained here
    frozen = 1.0 - trained
    trainer = Where.DEVICE if m.device == "cuda" else Where.HOST
    opt = _optimizer_floats(m)
    terms = [
        Term("parameters", trainer, F32 * trained + (BF16 if m.frozen_bf16 else F32) * frozen),
        Term("gradients", trainer, F32 * trained),
        Term(f"optimizer moments ({m.inner})", trainer, opt * F32 * trained),
    ]
    # the parameters' own dtype, as the trainer's copy is made (frozen SPES experts as they are kept)
    terms.append(Term("evaluation model (others' values)", trainer, F32 * trained + (BF16 if m.frozen_bf16 else F32) * frozen))
    if m.device == "cuda":
        terms.append(Term("pinned staging buffers", Where.HOST, F32 * trained))
    scored = m.scoring and not m.spes
    if scored:  # beyond their round: the scored neighbours' values and the base (DiLoCo: the own model), and
        held = min(m.in_neighbours, MAX_SCORED) + 2  # one moved copy at a time; a fragment's in DiLoCo
        share = 1.0 / max(1, m.fragments) if m.outer else 1.0
        terms.append(Term(f"contribution scoring ({held} copies while it measures)", Where.HOST, held * F32 * share))
    if not m.outer:
        terms += _peer_terms("", 1.0, m, 1.0, m.codec)
        if m.choco:
            d = m.in_neighbours
            terms += [Term("CHOCO anchor", Where.HOST, F32),
                      Term(f"CHOCO estimates (2 per edge, {m.choco_edges} edges)", Where.HOST, 2 * m.choco_edges * F32),
                      Term(f"CHOCO outgoing differences ({d})", Where.HOST, 2 * d * F32)]
    else:
        t, turn = trained, 1.0 / max(1, m.fragments)
        mixes_anchors = m.anchor_every > 0
        fused = m.outer_momentum == 0 and m.anchor_codec == m.codec  # (outer lr 1 too; counted as not fused)
        terms.append(Term("anchor", Where.HOST, F32 * t))
        if m.spes:  # SPES's main peer serves the trained values as moves: it keeps the first ones as its base
            terms.append(Term("served anchor's previous values", Where.HOST, F32 * t))
        terms.append(Term("current values and pseudo-gradient (a sync)", Where.HOST, 2 * F32 * t * turn))
        if m.overlap:
            terms.append(Term("phase start (overlap)", Where.HOST, F32 * t))
        if not (fused and mixes_anchors):
            terms += _peer_terms("pseudo-gradients: ", t, m, turn, m.codec)
        if mixes_anchors:
            terms += _peer_terms("anchors: ", t, m, turn, m.anchor_codec)
        if m.outer_momentum > 0:
            terms.append(Term("outer momentum", Where.HOST, F32 * t))
        if m.codec not in LOSSLESS_CODECS and not (fused and mixes_anchors):
            terms.append(Term("error-feedback residuals", Where.HOST, F32 * t))
        if mixes_anchors and m.anchor_codec not in LOSSLESS_CODECS:
            terms.append(Term("anchor error-feedback residuals", Where.HOST, F32 * t))
    # Trainer.state copies every parameter as float32 (frozen experts too) and the optimizer state
    terms.append(Term("checkpoint snapshot", Where.HOST, F32 + opt * F32 * trained))
    return Footprint(m.parameters, tuple(term for term in terms if term.per_parameter > 0))


# The table of docs/training.md ("Memory per parameter"): CUDA, max_staleness 2, a ring (2 neighbours a
# round) unless it says one-peer-exp (the default topology: 1 neighbour a round).
TABLE_CASES: Mapping[str, MemoryInputs] = {
    "dadam (one-peer-exp, the defaults)": MemoryInputs(1, "dadam", "cuda", in_neighbours=1, scoring=True),
    "dadam (one-peer-exp, --score-every 0)": MemoryInputs(1, "dadam", "cuda", in_neighbours=1),
    "dsgd (momentum 0.9, fp32)": MemoryInputs(1, "dsgd", "cuda", inner="sgd", momentum=0.9, scoring=True),
    "dadam (fp32)": MemoryInputs(1, "dadam", "cuda", scoring=True),
    "dadam + CHOCO": MemoryInputs(1, "dadam", "cuda", choco=True, scoring=True),
    "diloco (bf16, anchors int8)": MemoryInputs(1, "diloco", "cuda", codec="bf16", scoring=True),
    "diloco (bf16, 4 fragments, overlap)": MemoryInputs(1, "diloco", "cuda", codec="bf16", fragments=4, overlap=True,
                                                        scoring=True),
    "SPES (int8, 1/4 of 3/4 experts owned)": MemoryInputs(4, "dadam", "cuda", codec="int8", spes=True,
                                                          expert_parameters=3, owned_share=0.25, outer_momentum=0.0),
}


def table_markdown() -> str:
    """The markdown table docs/training.md carries (tests/test_footprint.py checks it is current)."""
    lines = ["| algorithm | host B/param | GPU B/param | host terms (B/param) |", "|---|---|---|---|"]
    for label, inputs in TABLE_CASES.items():
        f = footprint(inputs)
        host = ", ".join(f"{t.name} {t.per_parameter:g}" for t in f.terms if t.where is Where.HOST)
        lines.append(f"| {label} | {f.host_per_parameter:g} | {f.device_per_parameter:g} | {host} |")
    return "\n".join(lines)


__all__ = [
    "TABLE_CASES",
    "Footprint",
    "MemoryInputs",
    "Term",
    "Where",
    "footprint",
    "table_markdown",
]
