"""Volunteers behind NAT, in network namespaces the test makes and removes (tests/support/nat.py): two home
LANs behind NAT routers (MASQUERADE; new connections from the wan dropped) and two public hosts, one
running `murmur bootstrap` (a relay) and one the founder with --relay-service (a second relay).

One swarm serves every test, in order: the homes cannot reach each other; the NAT'd pair trains the
embedded model with the public node, exchanging through a relay every round; `murmur doctor` gives the
right verdicts; the bootstrap relay is killed and the pair goes on through the second relay.

Needs root, `ip`, `tc` and `iptables` (installed with apt when missing), as CI has; it never skips.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from support.nat import MURMUR, Host, Internet, NatNode, NatProcesses, internet, tcp_connects, tcp_listener
from support.swarm_harness import wait_for

pytestmark = pytest.mark.multiprocess

MODEL_BYTES = 2_447_616 * 4  # the embedded MoE model in fp32: what each side of an exchange sends
# the swarm's recipe (the founder's flags) and every node's own
RECIPE = ["--model", "moe", "--optimizer", "dsgd", "--lr", "0.3", "--batch-size", "2", "--context", "32",
          "--min-peers", "3", "--topology", "one-peer-exp"]
# --mixing weighted: this test is about relays and reachability. Under the robust default (adaptive_clip)
# this 3-node D-SGD swarm at lr 0.3 has left nodes' validation loss near the untrained model's at step 20,
# with the relays' limits in force (an open question for the robust mixing, noted on issue 14's work).
NODE = ["--mixing", "weighted", "--threads", "1", "--heartbeat", "1", "--exchange-timeout", "30", "--eval-every", "10",
        "--checkpoint-every", "100000", "--log-level", "info", "--monitor-port", "0"]
ROUNDS_WANTED = 6  # relayed exchanges between the NAT'd pair before the relay is killed


@dataclass(frozen=True)
class NatSwarm:
    net: Internet
    procs: NatProcesses
    boot: NatNode
    founder: NatNode
    homes: tuple[NatNode, NatNode]


@pytest.fixture(scope="module")
def net() -> Iterator[Internet]:
    with internet("nat", publics=2, homes=2) as built:
        yield built


@pytest.fixture(scope="module")
def swarm(net: Internet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatSwarm]:
    root = tmp_path_factory.mktemp("nat")
    procs = NatProcesses(root)
    try:
        pub0, pub1 = net.publics
        # one after the other: a node whose --peers do not answer yet exits (the bootstrap answers once
        # its relay service's check is done)
        boot = procs.wait_ready(procs.start("boot", pub0, ["bootstrap", "--listen", pub0.tcp_maddr(4001),
                                                           "--data-dir", str(root / "boot"), "--log-level", "info"]))
        founder = procs.wait_ready(procs.start("founder", pub1, [
            "node", "--listen", pub1.tcp_maddr(4001), "--peers", boot.maddr(), "--relay-service", "--reachability", "public",
            "--data-dir", str(root / "founder"), *RECIPE, *NODE]))
        homes = tuple(procs.start(f"home{i}", home.host, [
            "join", "--invite", founder.invite, "--listen", "/ip4/0.0.0.0/tcp/0", "--peers", boot.maddr(),
            "--relays", boot.maddr(),
            founder.maddr(), "--data-dir", str(root / f"home{i}"), *NODE]) for i, home in enumerate(net.homes))
        for node in homes:
            procs.wait_ready(node)
        yield NatSwarm(net, procs, boot, founder, homes)  # type: ignore[arg-type]
    finally:
        procs.close()


def doctor(host: Host, *args: str) -> dict:
    """`murmur doctor --json ARGS` run on `host`."""
    out = subprocess.run(host.command([MURMUR, "doctor", "--json", *args]), capture_output=True, text=True,
                         timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def data_dir(swarm: NatSwarm, node: NatNode) -> str:
    return str(swarm.procs.root / node.name)  # as the swarm fixture names them


# The training loop's pacing, as on loopback, not a failed exchange: `stale`, the partner was more than
# the staleness bound ahead in steps and said so in its answer; `stalled`, its record showed it that far
# behind and unchanged, so the round left it out. The pair meets again in a later round.
PACING = ("stale", "stalled")
# Counted with the skips but no exchange was skipped: a round did not wait for a partner far behind whose
# waiting budget was spent (node/swarm/progress.py); the exchange still ran.
NOT_SKIPS = ("laggard_wait_spent",)


def failed_exchanges(status: dict) -> dict:
    """Skips of neighbours whose exchange failed (unreachable, timeout, truncated, rejected...)."""
    return {reason: n for reason, n in status["skipped"].items() if reason not in PACING + NOT_SKIPS}


def paced(status: dict) -> int:
    return sum(status["skipped"].get(reason, 0) for reason in PACING)


def exchange_errors(status: dict) -> dict:
    """Errors of the exchanges themselves (a DHT store that found no replica is not one)."""
    return {kind: n for kind, n in status["errors"].items() if not kind.startswith("dht_")}


def failures(status: dict) -> tuple[dict, dict]:
    return failed_exchanges(status), exchange_errors(status)


def clean_run(pair: tuple[NatNode, NatNode], rounds: int, timeout_s: float, restarts: int) -> tuple[list[dict], list[dict]]:
    """The NAT'd pair's statuses at the start and the end of a run of `rounds` rounds on each in which no
    exchange failed and no exchange error appeared, and the pair's link to each other is relayed.

    Rounds are coupled: a view that differs between two peers for a moment (a record not yet read, a
    neighbour left out as stalled, a relay that just died) has one of them wait a whole exchange
    deadline for the other, and the peers waiting on its next round with it; such a failure restarts
    the run, at most `restarts` times, each run with `timeout_s` of its own."""
    a, c = pair
    base = [n.status() for n in pair]
    restarted = 0
    deadline = time.monotonic() + timeout_s
    while True:
        now = [n.status() for n in pair]
        failed = [(failures(b), failures(s)) for b, s in zip(base, now) if failures(s) != failures(b)]
        if failed:
            restarted += 1
            assert restarted <= restarts, f"exchanges failed in {restarted} runs (before, after): {failed}"
            base = now
            deadline = time.monotonic() + timeout_s  # a failed run cost its own exchange deadlines
        elif all(s["rounds_run"] >= b["rounds_run"] + rounds for b, s in zip(base, now)) and \
                connection(now[0], c.peer_id) == "relayed" == connection(now[1], a.peer_id):
            return base, now
        assert time.monotonic() < deadline, f"no run of {rounds} clean relayed rounds in {timeout_s} s: {now}"
        time.sleep(1.0)


def link(status: dict, peer_id: str) -> dict:
    return next(p for p in status["peers"] if p["peer_id"] == peer_id)


def connection(status: dict, peer_id: str) -> str | None:
    """How this node is connected to `peer_id`; None while the peer is not in its status's peers (for a
    moment after a relay dies, as the view and connections settle)."""
    return next((p["connection"] for p in status["peers"] if p["peer_id"] == peer_id), None)


def test_the_two_homes_cannot_open_tcp_connections_to_each_other(net: Internet) -> None:
    home0, home1 = (home.host for home in net.homes)
    public = net.publics[0]
    for here, there in ((home0, home1), (home1, home0)):
        with tcp_listener(there) as port:
            assert there.call_inside(tcp_connects, there.address, port), "the listener itself does not answer"
            assert not here.call_inside(tcp_connects, there.address, port), f"{here.name} reached {there.name}'s LAN"
            wan = net.homes[[h.host for h in net.homes].index(there)].router.address
            assert not here.call_inside(tcp_connects, wan, port), f"{here.name} reached {there.name}'s router"
            assert not public.call_inside(tcp_connects, there.address, port), "the internet reached a home"
    with tcp_listener(public) as port:  # out of the homes, connections do open: the checks above can fail
        assert home0.call_inside(tcp_connects, public.address, port)
        assert home1.call_inside(tcp_connects, public.address, port)


def test_the_nat_pair_trains_with_the_swarm_through_a_relay(swarm: NatSwarm) -> None:
    a, c = swarm.homes
    everyone = [swarm.founder, a, c]
    ids = {n.peer_id for n in everyone}

    def formed() -> list[dict] | None:
        statuses = [n.status() for n in everyone]
        if not all({p["peer_id"] for p in s["peers"]} >= ids for s in statuses):
            return None
        _, sa, sc = statuses
        circuits = [m for s, other in ((sa, c), (sc, a)) for m in link(s, other.peer_id)["maddrs"] if "/p2p-circuit/" in m]
        return statuses if {a.peer_id, c.peer_id} <= {m.rsplit("/p2p/", 1)[-1] for m in circuits} else None

    # The run is counted from the moment every node has every other's record in its view, and each home
    # sees the other's circuits in it: before, a joiner's first exchanges can be refused by a partner
    # that has not read its record yet (a stream from a peer not in the view is closed unread:
    # gossip.limits.IncomingGate), on loopback as here, and a NAT'd joiner's first record lists no
    # circuit yet (its relays are still being probed), so the other home cannot dial it. A round already
    # under way then ends first (it may have begun before): the run starts with each node's next round.
    formed_at = wait_for(formed, 120, "the three nodes in each other's views, the homes' circuits in their records",
                         interval_s=0.5)

    def next_round() -> list[dict] | None:
        statuses = [n.status() for n in everyone]
        return statuses if all(s["rounds_run"] > f["rounds_run"] for s, f in zip(statuses, formed_at)) else None

    wait_for(next_round, 60, "a round on each node", interval_s=0.5)
    # a start-up transient may restart the run once (see clean_run); after it, every exchange goes through
    (was_a, was_c), (sa, sc) = clean_run((a, c), ROUNDS_WANTED, 240, restarts=1)
    founder = swarm.founder.status()
    for node, s, was in ((a, sa, was_a), (c, sc, was_c)):
        reach = s["reachability"]
        assert reach["reach"] == "private" and reach["relays_held"] == 2, reach
        assert all(r["circuit"] == "carries" for r in reach["relays"]), reach["relays"]
        assert any("/p2p-circuit/" in m for m in link(founder, node.peer_id)["maddrs"]), "no circuit in its record"
        assert link(s, swarm.founder.peer_id)["connection"] == "direct"  # out of the NAT, dials are direct
        # every round of the run that was not paced (PACING) moved a whole model in
        rounds = s["rounds_run"] - was["rounds_run"] - (paced(s) - paced(was))
        assert s["bytes_received"] - was["bytes_received"] >= (rounds - 1) * MODEL_BYTES, \
            (rounds, s["bytes_received"] - was["bytes_received"], s["skipped"], was["skipped"])
    assert link(sa, c.peer_id)["goodput_mbit_s"] or link(sc, a.peer_id)["goodput_mbit_s"], "no goodput measured"
    # /metrics says the same: one neighbour direct (the founder), one relayed (the other home), relays held
    for node in (a, c):
        text = node.metrics()
        for line in ('murmur_peer_connections{kind="direct"} 1.0', 'murmur_peer_connections{kind="relayed"} 1.0',
                     'murmur_peer_connections{kind="holepunched"} 0.0', 'murmur_relays_held 2.0',
                     'murmur_reachability_info{mode="auto",reach="private"} 1.0'):
            assert line in text.splitlines(), f"{node.name}: no {line!r} in\n{text}"
    assert any(f'murmur_peer_goodput_mbit_per_second{{kind="relayed",peer_id="{other.peer_id}"}}' in node.metrics()
               for node, other in ((a, c), (c, a))), "no relayed goodput in /metrics"
    assert founder["reachability"]["reach"] == "public"
    assert founder["reachability"]["relay_service"]["limits_in_force"] is True

    # each node's validation losses by the step they were taken at: the nodes do not step in lockstep, so
    # their models are compared at steps all three evaluated (at 20 or after), not at whatever each is at.
    # Each node's mean over three such steps: an evaluation reads a model a noisy step or two (lr 0.3, a
    # batch of 2) from its last mix, which alone put the three losses 0.43 apart once at one step (3.46-3.89
    # at step 20, in a fresh-clone run). That every round moved a whole model is asserted above.
    seen: list[dict[int, float]] = [{} for _ in everyone]

    def trained() -> list[float] | None:
        for node, losses in zip(everyone, seen):
            t = node.status()["training"]
            if t["val_step"] is not None and t["val_step"] >= 20:
                losses[t["val_step"]] = t["val_loss"]
        common = sorted(set.intersection(*(set(losses) for losses in seen)))[:3]
        return [sum(losses[step] for step in common) / 3 for losses in seen] if len(common) == 3 else None

    losses = wait_for(trained, 240, "evaluations at three steps (20 or after) on every node", 0.5)
    # as on loopback (tests/test_demo.py): every node learnt (one process alone gets from 5.54 to 3.55 in
    # 20 such steps), and gossip kept the three models together
    untrained = math.log(256)  # a byte-level model that knows nothing (measured: 5.54)
    assert all(loss < untrained - 1.0 for loss in losses), losses
    assert max(losses) - min(losses) < 0.3, losses


def test_doctor_says_public_for_the_public_node_and_relayed_for_the_nat_d_one(swarm: NatSwarm) -> None:
    # a running node's check is a POST: it carries the node's monitor token, read from its data dir
    public = doctor(swarm.founder.host, "--url", swarm.founder.monitor_url, "--data-dir", data_dir(swarm, swarm.founder))
    assert public["verdict"] == "public" and public["advice"] == [], public
    assert public["redetected"]["reach"] == "public"
    assert public["relay_service"]["limits_in_force"] is True
    a = swarm.homes[0]
    nat = doctor(a.host, "--url", a.monitor_url, "--data-dir", data_dir(swarm, a))
    assert nat["verdict"] == "relayed", nat
    assert nat["redetected"]["reach"] == "private"
    router = swarm.net.homes[0].router.address
    assert all(o.startswith(f"/ip4/{router}/tcp/") for o in nat["observed"]), nat["observed"]  # its public address
    assert {r["peer_id"] for r in nat["relays"] if r["held"] and r["circuit"] == "carries"} == \
        {swarm.boot.peer_id, swarm.founder.peer_id}
    by_peer = {n["peer_id"]: n for n in nat["neighbours"]}
    assert by_peer[swarm.homes[1].peer_id]["connection"] == "relayed"
    assert all(n["latency_ms"] is not None and n["goodput_mbit_s"] for n in nat["neighbours"]), nat["neighbours"]
    # the guided join said so at start (docs/cli.md): reached through relays, its link to the bootstraps measured
    joined = {line["check"]: line for line in a.status()["preflight"]}
    assert joined["reach"]["figures"]["kind"] == "relayed", joined["reach"]
    assert (joined["link"]["figures"]["rtt_ms"] or 0) > 0, joined["link"]


def test_killing_a_relay_is_noticed_and_the_pair_goes_on_through_the_other(swarm: NatSwarm) -> None:
    a, c = swarm.homes
    swarm.procs.kill(swarm.boot)

    def noticed() -> list[dict] | None:
        now = [n.status() for n in (a, c)]
        lost = all(any(r["peer_id"] == swarm.boot.peer_id and r["lost_at"] is not None and not r["held"]
                       for r in s["reachability"]["relays"]) for s in now)
        return now if lost else None

    statuses = wait_for(noticed, 30, "both NAT'd nodes to report the bootstrap relay lost", interval_s=0.5)
    for s in statuses:
        assert s["reachability"]["relays_held"] == 1
        assert [m for m in s["reachability"]["circuits"] if swarm.boot.peer_id in m] == []
    # the pair goes on through the founder's relay: an exchange in flight over the dead relay, and the
    # waits it causes while each node's view and address book let go of it, may fail a few runs (see
    # clean_run; three on a loaded machine); then 4 rounds in a row go through
    _, after = clean_run((a, c), 4, 150, restarts=4)
    for s in after:
        assert [r["peer_id"] for r in s["reachability"]["relays"] if r["held"]] == [swarm.founder.peer_id]

    # before joining, a node in a home that knows only the dead relay: not reachable, and told why
    lonely = doctor(c.host, "--peers", swarm.founder.maddr(), "--relays", swarm.boot.maddr(),
                    "--listen", "/ip4/0.0.0.0/tcp/0")
    assert lonely["verdict"] == "unreachable", lonely
    assert any(swarm.boot.peer_id in line and "holds no slot" in line for line in lonely["advice"]), lonely["advice"]
    assert any("forward TCP port" in line for line in lonely["advice"]), lonely["advice"]
