"""The rules that tie a swarm's knobs to each other (which codec may carry what, which algorithms combine),
each predicate written once. The node's config layers, the swarm document a joiner reads and `murmur
plan` all ask `broken_rules`; each says what is wrong in its own words (a flag, a document field, a plan
input), since a user sees the same rule from a different place. Plain values in, no torch, no network.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from gossip.codecs.registry import SPARSE_CODECS
from gossip.mixing import MixingKind

# mixing rules CHOCO can apply to an edge's difference (theirs - mine); the others need whole vectors (a node
# whose own rule is one of those clips each edge at its adaptive radius instead: gossip.robust.Mixer.edge_scales)
CHOCO_RULES = (MixingKind.WEIGHTED, MixingKind.CLIPPED, MixingKind.ADAPTIVE_CLIP)


class Rule(enum.StrEnum):
    """A combination of knobs murmur refuses, and why (the value is the reason in a few words)."""

    # top-k (and SparseLoCo's chunked top-k) sends a few entries of each tensor and drops the rest: sound on differences carried on by error
    # feedback or estimates (DiLoCo's pseudo-gradients, compressed gossip's), never on whole parameters
    TOPK_ON_WHOLE_PARAMETERS = "top-k is sound on differences only, and this swarm gossips whole parameters"
    TOPK_WITH_SPES = "SPES mixes its shared weights as whole parameters: top-k is not sound there"
    # compressed gossip is a per-step scheme; DiLoCo compresses its pseudo-gradients with the codec itself
    CHOCO_WITH_DILOCO = "compressed gossip is for the per-step optimizers dsgd and dadam, not diloco"
    CHOCO_WITH_SPES = "compressed gossip does not cover SPES's expert syncs"
    CHOCO_WITH_WHOLE_VECTOR_MIXING = "compressed gossip moves along per-edge differences; this mixing rule needs " \
        "whole vectors"
    # SPES's outer step has knobs of its own (spes_outer_lr, ...); one node does not run both outer loops
    SPES_WITH_DILOCO = "SPES takes its outer step knobs from its own fields, not from diloco's"
    FRAGMENTS_WITHOUT_DILOCO = "streaming fragments are diloco's outer sync"
    # each fragment syncs at its own inner step of a phase
    FRAGMENTS_OVER_PHASE = "more fragments than inner steps in a phase"


class RuleBroken(ValueError):
    """A combination a `Rule` refuses; `rule` says which."""

    def __init__(self, rule: Rule) -> None:
        super().__init__(rule.value)
        self.rule = rule


@dataclass(frozen=True)
class Knobs:
    """The values the rules read: the codec's name, which schemes are on, the mixing rule, DiLoCo's
    fragments and phase."""

    codec: str = "fp32"
    diloco: bool = False
    choco: bool = False
    spes: bool = False
    mixing: str = MixingKind.WEIGHTED
    fragments: int = 1
    local_steps: int | None = None  # H; None: not known here, so FRAGMENTS_OVER_PHASE is not judged


def broken_rules(knobs: Knobs) -> frozenset[Rule]:
    """Every rule `knobs` break (empty: a sound combination). Callers test the rules in the order they
    report them; `check_knobs` raises for the first in declaration order."""
    topk = knobs.codec in SPARSE_CODECS  # top-k, and SparseLoCo's chunked top-k
    return frozenset(rule for rule, broken in (
        (Rule.TOPK_ON_WHOLE_PARAMETERS, topk and not (knobs.diloco or knobs.choco)),
        (Rule.TOPK_WITH_SPES, topk and knobs.spes),
        (Rule.CHOCO_WITH_DILOCO, knobs.choco and knobs.diloco),
        (Rule.CHOCO_WITH_SPES, knobs.choco and knobs.spes),
        (Rule.CHOCO_WITH_WHOLE_VECTOR_MIXING, knobs.choco and knobs.mixing not in CHOCO_RULES),
        (Rule.SPES_WITH_DILOCO, knobs.spes and knobs.diloco),
        (Rule.FRAGMENTS_WITHOUT_DILOCO, knobs.fragments > 1 and not knobs.diloco),
        (Rule.FRAGMENTS_OVER_PHASE, knobs.diloco and knobs.local_steps is not None
         and knobs.fragments > knobs.local_steps),
    ) if broken)


def check_knobs(knobs: Knobs, ignore: Sequence[Rule] = ()) -> None:
    """Raise RuleBroken for the first rule (in declaration order) `knobs` break, apart from `ignore`."""
    broken = broken_rules(knobs)
    for rule in Rule:
        if rule in broken and rule not in ignore:
            raise RuleBroken(rule)
