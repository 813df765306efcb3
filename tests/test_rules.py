"""gossip.rules: each cross-field rule's predicate, the one the config layers, the swarm document and
`murmur plan` all ask (their messages are checked where they are written: test_choco, test_plan, test_config)."""

from __future__ import annotations

import pytest

from gossip.rules import Knobs, Rule, RuleBroken, broken_rules, check_knobs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("knobs", "rules"), [
    (Knobs(), set()),
    (Knobs(codec="topk"), {Rule.TOPK_ON_WHOLE_PARAMETERS}),
    (Knobs(codec="topk", diloco=True), set()),
    (Knobs(codec="topk", choco=True), set()),
    (Knobs(codec="topk", spes=True), {Rule.TOPK_ON_WHOLE_PARAMETERS, Rule.TOPK_WITH_SPES}),
    (Knobs(choco=True, diloco=True), {Rule.CHOCO_WITH_DILOCO}),
    (Knobs(choco=True, spes=True), {Rule.CHOCO_WITH_SPES}),
    (Knobs(spes=True, diloco=True), {Rule.SPES_WITH_DILOCO}),
    (Knobs(fragments=2), {Rule.FRAGMENTS_WITHOUT_DILOCO}),
    (Knobs(fragments=2, diloco=True), set()),  # the phase not known: not judged
    (Knobs(fragments=4, diloco=True, local_steps=4), set()),
    (Knobs(fragments=5, diloco=True, local_steps=4), {Rule.FRAGMENTS_OVER_PHASE}),
])
def test_broken_rules(knobs: Knobs, rules: set[Rule]) -> None:
    assert broken_rules(knobs) == rules


def test_check_knobs_names_the_first_rule() -> None:
    check_knobs(Knobs(codec="topk", diloco=True))
    with pytest.raises(RuleBroken, match="differences only") as refused:
        check_knobs(Knobs(codec="topk", spes=True))
    assert refused.value.rule is Rule.TOPK_ON_WHOLE_PARAMETERS
    check_knobs(Knobs(codec="topk", spes=True), ignore=list(Rule))


def test_compressed_gossip_mixes_by_differences_only() -> None:
    assert broken_rules(Knobs(choco=True, mixing="median")) == {Rule.CHOCO_WITH_WHOLE_VECTOR_MIXING}
    assert broken_rules(Knobs(choco=True, mixing="clipped")) == set()
    assert broken_rules(Knobs(mixing="median")) == set()
