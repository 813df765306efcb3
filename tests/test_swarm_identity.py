"""A swarm's identity and admission with real processes on loopback: `murmur node`, `murmur join`,
`murmur bootstrap`, and hostile processes (tests/support/hostile_dht.py forging configs and flooding
records; the hostile node of tests/support/hostile.py in its wrong-key and stolen-certificate modes, a
real node that claims a membership it lacks).

- an open swarm: forged `<swarm>.config` values (plain, far expiration, oversized, the attacker's own
  signature, one claiming the founder's key) never replace the founder's, for its nodes nor for a
  joiner arriving after them, and the DHT nodes, `murmur bootstrap` included, refuse what their rules
  let them see is forged (counted); a flood of 1000 fake peer records leaves only real-keyed ones
  (valid in an open swarm) for the honest nodes, which keep gossiping; those are more than a view
  holds, and the views stay at their cap with the members in them, the overflow shown on /metrics and
  memory bounded;
- a key swarm and an allowlist swarm: a node without the key (or the certificate) does not start; one
  that tries anyway (a wrong key, a stolen certificate) is in nobody's view, its streams are refused and
  counted, and nothing it sends is mixed: the members' average is exactly their own;
- a restart with another config keeps the old checkpoint, a joiner follows the founder's new version,
  and a restart with the old config again resumes from the kept checkpoints.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from node.net.identity import create_identity
from node.net.view import MAX_VIEW
from node.train.checkpoint import CHECKPOINT_FILE, kept_path, read_checkpoint_file
from support.attacks import fetch_metrics, metric
from support.hostile import Mode, hostile_argv
from support.swarm_harness import MURMUR, Node, Swarm, check_consensus, summary, wait_for

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
HOSTILE_DHT = [sys.executable, str(REPO / "tests" / "support" / "hostile_dht.py")]
_BOOTSTRAP_READY = re.compile(r"murmur: bootstrap peer (\S+) ready; maddrs (\S+)")
# real-keyed fake records in the flood: more than a view holds besides its members (node.net.view.MAX_VIEW)
FLOOD_KEYS = MAX_VIEW + 44
FLOOD_RSS_BOUND = 64 << 20  # generous (18 MB measured): 1000 records of ~1 KB, a view of MAX_VIEW records, their dials


def start_bootstrap(swarm: Swarm) -> tuple[Node, str]:
    node = swarm.launch("bootstrap", [str(MURMUR), "bootstrap", "--data-dir", str(swarm.root / "bootstrap"),
                                      "--log-level", "info"])
    found = wait_for(lambda: _BOOTSTRAP_READY.search(node.stdout()), 120, "the bootstrap node to be ready")
    return node, found[2]


def run_hostile_dht(swarm: Swarm, name: str, modes: list[str], *args: str) -> dict:
    report = swarm.root / f"{name}.json"
    node = swarm.launch(name, [*HOSTILE_DHT, "--mode", *modes, "--identity", str(swarm.root / f"{name}.key"),
                               "--report", str(report), *args])
    assert node.process.wait(180) == 0, node.log_tail()
    return json.loads(report.read_text())


def errors_of(nodes: list[Node]) -> dict[str, int]:
    total: dict[str, int] = {}
    for status in (node.status() for node in nodes):
        for kind, n in status["errors"].items():
            total[kind] = total.get(kind, 0) + n
    return total


def not_members_refused(nodes: list[Node]) -> int:
    """Streams and messages of non-members refused: a peer whose record is not in the view has its
    streams closed unread (limits.streams_refused); one whose message header fails admission, the
    wire error (errors.not_member)."""
    total = 0
    for status in (node.status() for node in nodes):
        total += status["errors"].get("not_member", 0) + status["limits"]["streams_refused"].get("not_member", 0)
    return total


def view_of(node: Node) -> set[str]:
    return {p["peer_id"] for p in node.status()["peers"]}


def test_forged_configs_and_a_record_flood_do_not_take_an_open_swarm(tmp_path):
    with Swarm(tmp_path, round_interval=0.5, swarm="open1") as swarm:
        bootstrap, entry = start_bootstrap(swarm)
        # no proof of work asked: this test is the view's cap under a flood of free identities
        # (test_sybils_swarm.py floods a swarm that asks one)
        founder = swarm.found(peers=entry, identity_work=0)
        member = swarm.spawn("n1", seed=1, join=founder)
        swarm.wait_ready([member])
        before = {n.name: s["rounds_run"] for n, s in zip([founder, member], swarm.statuses([founder, member]),
                                                           strict=True)}
        memory_before = {n.name: psutil.Process(n.pid).memory_info().rss for n in (founder, member)}

        # forged configs (repeated for 2 s), then 1000 fake peer records, from one hostile DHT peer
        hostile = run_hostile_dht(swarm, "hostile", ["forge-config", "flood-records"], "--swarm", "open1", "--peers",
                                  entry, "--founder", founder.peer_id, "--probe", entry, founder.maddrs[0],
                                  "--duration", "2", "--every", "1", "--count", "1000", "--keys", str(FLOOD_KEYS),
                                  "--config-hash", founder.status()["config_hash"])
        assert hostile["found_founder_key"]
        # right after the flood (its records live 60 s): more live records than a view holds; the members'
        # views stay at their cap, keep each other (standing peers keep their place), and count what they left out
        members = {founder.peer_id, member.peer_id}
        real_keyed = set(hostile["real_key_peer_ids"])
        assert len(real_keyed) == FLOOD_KEYS and not real_keyed & members

        def overflow(node: Node) -> float:
            return metric(fetch_metrics(node), "murmur_view_overflow")

        # at one moment, both views: a record lapses now and then on a loaded machine (a late heartbeat
        # while the DHT checks the flood), and a member is out of the other's view until it is read again
        def capped() -> bool:
            seen = {n.name: (view_of(n), overflow(n), n.status()["limits"]["view_overflow"]) for n in (founder, member)}
            # per node: the view's size, members missing from it, others not real-keyed, the overflow on
            # /metrics and in the status (read together: the flood's records expire a minute after it)
            counts = {name: (len(view), len(members - view), len(view - members - real_keyed), left_out, status)
                      for name, (view, left_out, status) in seen.items()}
            assert all(size == MAX_VIEW and missing == stray == 0 and left_out > 0 and status > 0
                       for size, missing, stray, left_out, status in counts.values()), counts
            return True

        wait_for(capped, 30, "the members' views at their cap with both members in them and the rest real-keyed, "
                 "the overflow on /metrics")
        for node in (founder, member):
            view = view_of(node)
            grown = psutil.Process(node.pid).memory_info().rss - memory_before[node.name]
            print(f"{node.name} after the flood: view {len(view)}, overflow {overflow(node):g}, "
                  f"RSS +{grown / 2**20:.1f} MiB")
            assert grown < FLOOD_RSS_BOUND, (node.name, grown)
        tried = hostile["forged"][0]
        # nobody keeps what any DHT node can see is forged: a plain value, a far expiration, an oversized value
        assert not tried["plain"] and not tried["own_key_far_expiration"] and not tried["oversized"], tried
        at_bootstrap, at_founder = hostile["held"]["config"][entry], hostile["held"]["config"][founder.maddrs[0]]
        assert "plain" not in at_bootstrap and "plain" not in at_founder
        assert all(item["expires_in"] < 700 for item in at_bootstrap.values()), at_bootstrap
        # a bootstrap knows no swarm's founder: it keeps the attacker's own signed config; the founder does not
        assert hostile["peer_id"] in at_bootstrap and hostile["peer_id"] not in at_founder
        assert founder.peer_id in at_founder

        # a node joining after the forgery, through the bootstrap that holds a forged config, takes the founder's
        late = swarm.spawn("n2", seed=2, join=founder, extra_args=["--peers", entry])
        swarm.wait_ready([late])
        honest = [founder, member, late]
        statuses = swarm.statuses(honest)
        assert {s["config_hash"] for s in statuses} == {founder.status()["config_hash"]}
        # the member, which watched the DHT all along, did not take the forged version 10^6 for a new one
        assert {(s["invite"], s["config_version"]) for s in statuses} == {(founder.invite, 1)}
        errors = errors_of(honest)
        for refused in ("dht_refused_unsigned", "dht_refused_expiration", "dht_refused_too_large"):
            assert errors.get(refused, 0) >= 1, errors
        assert errors.get("dht_refused_config_not_founder", 0) + errors.get("dht_refused_config_bad_signature", 0) >= 1
        wait_for(lambda: "refused DHT values:" in bootstrap.stderr(), 30, "the bootstrap to report its refusals")
        wait_for(lambda: "weak_key=" in bootstrap.stderr(), 30, "the bootstrap to report the weak keys")
        report = bootstrap.stderr().rsplit("refused DHT values:", 1)[1].splitlines()[0]
        for refused in ("unsigned=", "expiration=", "too_large=", "weak_key="):
            assert refused in report, report

        # of the 1000 fake peer records only those of real keys of their own get in (an open swarm admits anyone)
        flood = hostile["flood"]
        assert sum(v for k, v in flood.items() if k.startswith("tried_")) == 1000
        assert flood["accepted_weak_key"] == 0, flood
        honest_ids = {n.peer_id for n in honest}
        for node in honest:
            view = view_of(node)
            # real-keyed fakes at most: no weak-keyed or misattributed one, and never more than the cap
            assert view - honest_ids <= real_keyed and len(view) <= MAX_VIEW, view - honest_ids - real_keyed
        assert errors.get("dht_refused_weak_key", 0) >= 1 and errors.get("dht_refused_not_owner", 0) >= 1, errors
        # the honest nodes keep gossiping (a fake's dead address costs a skipped exchange, not the round)
        wait_for(lambda: all(s["rounds_run"] >= before[n.name] + 3 for n, s in
                             zip([founder, member], swarm.statuses([founder, member]), strict=True)), 60,
                 "rounds after the flood")
        assert swarm.stop_all(honest) == [0, 0, 0], swarm.logs()


def test_a_key_swarm_admits_holders_of_its_key_only(tmp_path):
    key = tmp_path / "swarm.key"
    with Swarm(tmp_path, swarm="keyed", min_peers=2) as swarm:
        founder = swarm.found(admission="key", swarm_key_file=key)
        assert key.stat().st_mode & 0o777 == 0o600
        member = swarm.spawn("n1", seed=1, join=founder, swarm_key_file=key)
        keyless = swarm.spawn("keyless", seed=5, join=founder)
        swarm.wait_ready([member])
        assert keyless.process.wait(90) == 2
        assert "admits holders of its swarm key only: give --swarm-key-file" in keyless.stderr()
        intruder = swarm.spawn("intruder", seed=6, join=founder, hostile=hostile_argv([Mode.WRONG_KEY]))
        swarm.wait_ready([intruder])
        members = [founder, member]
        # the intruder sees the members and asks them for their parameters; they refuse it (it has no
        # record in their views: before a byte of its streams)
        wait_for(lambda: not_members_refused(members) >= 2, 60, "the intruder's streams refused")
        swarm.wait_rounds(members, 3)
        # waited on: a late heartbeat on a loaded machine can drop a member from a view for a moment
        swarm.wait_views(members, members, timeout_s=30)
        wait_for(lambda: {founder.peer_id, member.peer_id} <= view_of(intruder), 30, "the intruder to see the members")
        # its own record, signed with its own real key, is refused by the members' DHT nodes and their views
        errors = errors_of(members)
        assert errors.get("dht_refused_not_member", 0) + errors.get("peer_record_not_member", 0) >= 1, errors
        report = summary(members, swarm.statuses(members))
        assert swarm.stop_all(members) == [0, 0], swarm.logs()
        # nothing the intruder sent was mixed: the members' average is their own initial average
        check_consensus(members, report, swarm.logs())


def test_an_allowlist_swarm_admits_certificate_holders_only(tmp_path):
    member_key = tmp_path / "n1.key"
    member_id = create_identity(member_key).peer_id
    with Swarm(tmp_path, swarm="listed", min_peers=2) as swarm:
        founder = swarm.found(admission="allowlist")
        certificate = tmp_path / "n1.cert"
        issued = subprocess.run([str(MURMUR), "invite", member_id, "--swarm", "listed", "--data-dir",
                                 str(founder.data_dir), "--out", str(certificate)], capture_output=True, text=True,
                                timeout=60)
        assert issued.returncode == 0, issued.stderr
        assert f"--invite {founder.invite}" in issued.stderr
        member = swarm.spawn("n1", seed=1, join=founder, identity=member_key,
                             extra_args=["--certificate", str(certificate)])
        swarm.wait_ready([member])
        # a copy of the member's certificate (anyone can read it from the member's record) admits no one else
        intruder = swarm.spawn("intruder", seed=6, join=founder,
                               hostile=hostile_argv([Mode.STOLEN_CERTIFICATE], options={"certificate": certificate}))
        swarm.wait_ready([intruder])
        members = [founder, member]
        wait_for(lambda: not_members_refused(members) >= 2, 60, "the intruder's streams refused")
        swarm.wait_rounds(members, 3)
        # waited on: a late heartbeat on a loaded machine can drop a member from a view for a moment
        swarm.wait_views(members, members, timeout_s=30)
        wait_for(lambda: {founder.peer_id, member.peer_id} <= view_of(intruder), 30, "the intruder to see the members")
        # its own record, signed with its own real key but carrying the member's certificate, is refused
        # by the members' DHT nodes and their views, and counted
        errors = errors_of(members)
        assert errors.get("dht_refused_not_member", 0) + errors.get("peer_record_not_member", 0) >= 1, errors
        assert member.status()["admission"] == "allowlist"
        report = summary(members, swarm.statuses(members))
        assert swarm.stop_all(members) == [0, 0], swarm.logs()
        check_consensus(members, report, swarm.logs())


def _checkpoint(path: Path) -> tuple[np.ndarray, int, str]:
    checkpoint = read_checkpoint_file(path)
    return checkpoint.tensors["params"], int(checkpoint.meta["round"]), str(checkpoint.meta["config_hash"])


def test_a_new_config_keeps_the_old_checkpoint_and_joiners_follow_it(tmp_path):
    with Swarm(tmp_path, swarm="versions", round_interval=0.4) as swarm:
        founder = swarm.found()
        joiner = swarm.spawn("n1", seed=1, join=founder)
        swarm.wait_ready([joiner])
        swarm.wait_rounds([founder, joiner], 3)
        hash_a = founder.status()["config_hash"]
        assert founder.stop()[0] == 0
        params_a, round_a, saved = _checkpoint(founder.data_dir / CHECKPOINT_FILE)
        assert saved == hash_a

        # the founder restarts with another recipe: a new version; its checkpoint of A is kept, not rotated away
        founder_b = swarm.spawn("n0", seed=0, join=None, data_dir=founder.data_dir, round_interval=0.5,
                                peers=joiner.maddrs[0])
        swarm.wait_ready([founder_b])
        status_b = founder_b.status()
        assert status_b["config_version"] == 2 and status_b["config_hash"] != hash_a
        kept_a = kept_path(founder.data_dir / CHECKPOINT_FILE, hash_a)
        kept_params, kept_round, _ = _checkpoint(kept_a)
        assert kept_round == round_a and np.array_equal(kept_params, params_a)
        # the joiner follows: a new session under version 2, its own checkpoint of A kept too
        wait_for(joiner.reread_ready_line, 60, "the joiner to follow the founder's version 2")
        wait_for(lambda: joiner.status()["config_version"] == 2, 30, "the joiner under version 2")
        assert joiner.status()["config_hash"] == status_b["config_hash"]
        assert kept_path(joiner.data_dir / CHECKPOINT_FILE, hash_a).exists()

        # the founder's old recipe again: its hash again (version 3), and both resume from their kept checkpoints
        assert founder_b.stop()[0] == 0
        founder_a = swarm.spawn("n0", seed=0, join=None, data_dir=founder.data_dir, peers=joiner.maddrs[0])
        swarm.wait_ready([founder_a])
        status_a = founder_a.status()
        assert (status_a["config_version"], status_a["config_hash"]) == (3, hash_a)
        assert status_a["round"] >= round_a  # resumed, not restarted from round 0
        assert "took back the checkpoint kept for config" in founder_a.stderr()
        wait_for(joiner.reread_ready_line, 60, "the joiner to follow version 3")
        wait_for(lambda: joiner.status()["config_hash"] == hash_a, 30, "the joiner back under config A")
        assert "took back the checkpoint kept for config" in joiner.stderr()
        assert swarm.stop_all([founder_a, joiner]) == [0, 0], swarm.logs()
