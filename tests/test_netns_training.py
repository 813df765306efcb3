"""Issue 24's setup at a size the suite can afford: a 21M-parameter Hugging Face Llama config trained with
the README's internet setup (gossip DiLoCo, int8, overlap) by a founder and a volunteer on three hosts of
a network the test makes (network namespaces on a switch, every host's link shaped to 100 Mbit/s each way
with tc tbf, tests/support/nat.py), and a third node that joins late: its catch-up downloads the model
across the shaped links, and from then on every outer sync of every node completes with its neighbour
(no timeout, no cut transfer), with the node's default exchange timeout of 5 s although a sync moves
about 43 MB each way. Longer runs at 85M and 129M parameters are in bench/bench_wan.py
(docs/benchmarks.md, "Real model sizes over 50 Mbit/s links").

Needs root, `ip`, `tc` and `iptables`, as CI has; it never skips.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.nat import Internet, NatNode, NatProcesses, internet
from support.swarm_harness import wait_for

# Three CPU-bound nodes for ~3 minutes: beside another node-process file they skew its timing (a CI run
# failed test_nat's loss-spread bound beside it), so it runs after them, beside in-process files.
pytestmark = [pytest.mark.multiprocess, pytest.mark.run_last]

MODEL = Path(__file__).parent / "data" / "llama-21m"  # 21,439,872 parameters in 111 tensors
PARAMETERS = 21_439_872
RATE_MBIT = 100
H = 5  # inner steps per outer sync: a sync every few seconds of compute, so the run sees several
# A node more than max_staleness x H steps behind its neighbours finds their rounds stale and catches up
# again (DiLoCo's laggard rule). A catch-up here (the download, the checks' evaluations of the own model
# and the copy, the momentum) takes tens of seconds on loaded cores, over which the pair trains 20-40
# steps: with the default bound of 2 x 5 steps a joiner on a loaded machine caught up again and again and
# never synced (a CI run). The README's H=100 gives 200 steps; 6 x 5 = 30 gives the joiner that room here.
# The same bound is how far ahead the swarm must be for a starting node to catch up at all.
STALENESS = 6
RECIPE = ["--model", f"hf:{MODEL}", "--optimizer", "diloco", "--local-steps", str(H), "--codec", "int8", "--overlap",
          "--max-staleness", str(STALENESS), "--batch-size", "1", "--context", "32", "--min-peers", "2",
          "--topology", "one-peer-exp"]
NODE = ["--threads", "1", "--heartbeat", "1", "--eval-every", "100000", "--checkpoint-every", "100000",
        "--monitor-port", "0", "--log-level", "info"]
SYNCS_AFTER_JOIN = 2
# Pacing, not a failed sync: the neighbour was more than the staleness bound ahead and said so (`stale`),
# or its record showed it that far behind and unchanged, so the round left it out (`stalled`), or it
# answered that it does not run that round (`rejected`: a node that is catching up, as the joiner, three
# CPU-bound nodes sharing the machine's cores, does more than once). A sync that failed moving its bytes
# is a timeout, a cut or stalled transfer, or an unreachable neighbour: none may happen.
PACING = ("stale", "stalled", "rejected")


def diloco(node: NatNode) -> dict:
    return node.status()["training"]["diloco"]


def failed_syncs(node: NatNode) -> dict[str, int]:
    """The node's outer exchanges that failed: skips other than pacing, and exchanges counted failed."""
    d = diloco(node)
    failed = {reason: n for reason, n in d["skipped"].items() if reason not in PACING and n}
    if d["exchanges_failed"]:
        failed["exchanges_failed"] = d["exchanges_failed"]
    return failed


@pytest.fixture
def net() -> Iterator[Internet]:
    with internet("train", publics=3, homes=0, rate_mbit=RATE_MBIT) as built:
        yield built


@pytest.fixture
def procs(net: Internet, tmp_path: Path) -> Iterator[NatProcesses]:
    """The test's murmur processes, ended before their namespaces go."""
    processes = NatProcesses(tmp_path)
    try:
        yield processes
    finally:
        processes.close()


def test_a_21m_model_trains_over_shaped_links_and_a_late_joiner_catches_up_and_syncs(net: Internet,
                                                                                     procs: NatProcesses) -> None:
    hosts, root = net.publics, procs.root
    founder = procs.wait_ready(procs.start("founder", hosts[0], [
        "node", "--swarm", "netns-train", "--listen", hosts[0].tcp_maddr(4001), "--data-dir", str(root / "founder"),
        *RECIPE, *NODE]))
    volunteer = procs.wait_ready(procs.start("volunteer", hosts[1], [
        "join", "--invite", founder.invite, "--peers", founder.maddr(), "--listen", hosts[1].tcp_maddr(4001),
        "--data-dir", str(root / "volunteer"), *NODE]))
    pair = [founder, volunteer]
    try:
        # the pair's syncs, model-sized, across the shaped link; the joiner comes once the pair is further
        # ahead than a node catches up from (max_staleness x H steps): else it trains from its own start
        wait_for(lambda: all(n.status()["training"]["step"] >= (STALENESS + 2) * H for n in pair), 300,
                 f"the pair at step {(STALENESS + 2) * H}")
        joiner = procs.wait_ready(procs.start("joiner", hosts[2], [
            "join", "--invite", founder.invite, "--peers", founder.maddr(), "--listen", hosts[2].tcp_maddr(4001),
            "--data-dir", str(root / "joiner"), *NODE]))
        joined = wait_for(lambda: joiner.status()["training"]["joined"], 240, "the joiner's catch-up")
        everyone = [*pair, joiner]
        start = {n.name: diloco(n) for n in everyone}

        def received(node: NatNode) -> int:
            return diloco(node)["outer_bytes_received"] - start[node.name]["outer_bytes_received"]

        # syncs that received their neighbour's payloads, its int8 pseudo-gradient and anchor (~1 byte a
        # parameter each): an outer step counts a sync whose neighbours were all left out too (a joiner
        # still behind finds their rounds stale and steps alone)
        wait_for(lambda: all(received(n) >= SYNCS_AFTER_JOIN * 2 * PARAMETERS for n in everyone), 300,
                 f"{SYNCS_AFTER_JOIN} outer syncs' payloads received by every node after the join")
        end = {n.name: diloco(n) for n in everyone}
        failed = {n.name: failed_syncs(n) for n in everyone}
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{procs.logs()}") from None

    # the catch-up took the swarm's model across the shaped links and adopted it, checked. The hosts share
    # one /24, so the joiner counts them as one network and takes one source (docs/threat-model.md,
    # "Sybils"); the other may also be `unreachable`: a donor that has not read the joiner's record yet
    # closes its streams unread (in a CI run the record's store timed out on the saturated link)
    assert joined["sources"] and joined["loss"] is not None, joined
    # every outer sync completed: none failed over the whole run (each node received its neighbour's int8
    # pseudo-gradients and anchors, ~21 MB each, in at least two syncs after the join: the wait above)
    assert not any(failed.values()), (failed, end, procs.logs())
