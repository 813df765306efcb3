"""How a node comes to its swarm's config, without a network: the founder's version numbering, the
founder a joiner trusts (invite, pin, none), whether a joiner can follow a newer version, and the
checkpoints kept per config. A stand-in for the DHT (`DhtStandIn`) records what the founder publishes;
the real DHT runs in tests/test_swarm_identity.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from node.config import GossipConfig, NodeConfig, TrainingConfig
from node.net.discovery import ConfigRead
from node.net.founder import SwarmConfig, issue_certificate, sign_config
from node.net.identity import Identity, create_identity
from node.runtime.errors import StartupError
from node.runtime.founding import swarm_document
from node.runtime.swarm_config import (
    FOUNDERS_FILE,
    found_swarm,
    founder_to_trust,
    node_admission,
    pin_founder,
    pinned_founder,
    why_not_follow,
)
from node.train.checkpoint import (
    CHECKPOINT_FILE,
    kept_metas,
    kept_path,
    load_checkpoint,
    save_checkpoint,
    switch_checkpoint,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    directory = tmp_path_factory.mktemp("ids")
    return {name: create_identity(directory / f"{name}.key") for name in ("founder", "joiner")}


def vector_config(tmp_path: Path, **changes: object) -> NodeConfig:
    return NodeConfig(swarm="sc", data_dir=tmp_path, training=TrainingConfig(model="vector"), dim=8, **changes)


class DhtStandIn:
    """Stands in for Discovery's config reads and writes: holds what the founder published."""

    def __init__(self, latest: SwarmConfig | None = None) -> None:
        self.latest = latest
        self.published: list[SwarmConfig] = []

    def pin_founder(self, founder: str) -> None:
        self.pinned = founder

    async def read_config(self, founder: str | None) -> ConfigRead:
        return ConfigRead(self.latest)

    async def publish_config(self, config: SwarmConfig) -> SwarmConfig:
        self.published.append(config)
        self.latest = config
        return config


def _save(path: Path, config: SwarmConfig, swarm: str, value: float) -> None:
    save_checkpoint(path, {"params": np.full(8, value, np.float32)},
                    {"round": 3, "swarm": swarm, "config_hash": config.config_hash,
                     "swarm_config": json.dumps(config.config), "config_version": config.version,
                     "founder": config.founder})


def test_a_founder_numbers_its_configs_and_keeps_a_recipes_hash(tmp_path, ids):
    founder = ids["founder"]
    checkpoint = tmp_path / CHECKPOINT_FILE
    dht = DhtStandIn()
    config_a = vector_config(tmp_path)
    first = asyncio.run(found_swarm(dht, config_a, founder, checkpoint))
    assert first.version == 1 and first.founder == founder.peer_id
    # the same recipe again: the same document (epoch included) and version
    assert asyncio.run(found_swarm(dht, config_a, founder, checkpoint)).signed is not None
    assert (dht.latest.version, dht.latest.config_hash) == (1, first.config_hash)
    _save(checkpoint, first, "sc", 1.0)
    # another recipe: version 2, a new hash
    config_b = replace(config_a, gossip=GossipConfig(round_interval_s=0.5))
    second = asyncio.run(found_swarm(dht, config_b, founder, checkpoint))
    assert second.version == 2 and second.config_hash != first.config_hash
    switch_checkpoint(checkpoint, second.config_hash)
    _save(checkpoint, second, "sc", 2.0)
    # the first recipe again, with no DHT to remember it: its kept checkpoint gives back its document
    third = asyncio.run(found_swarm(DhtStandIn(), config_a, founder, checkpoint))
    assert (third.version, third.config_hash, third.config["epoch"]) == (3, first.config_hash, first.config["epoch"])


def test_a_founder_refuses_a_key_swarm_without_a_key_file(tmp_path, ids):
    with pytest.raises(StartupError, match="--admission key needs --swarm-key-file"):
        asyncio.run(found_swarm(DhtStandIn(), vector_config(tmp_path, admission="key"), ids["founder"],
                                tmp_path / CHECKPOINT_FILE))
    created = asyncio.run(found_swarm(DhtStandIn(), vector_config(tmp_path, admission="key",
                                                                  swarm_key_file=tmp_path / "k"),
                                      ids["founder"], tmp_path / CHECKPOINT_FILE))
    assert created.config["admission"]["mode"] == "key" and (tmp_path / "k").exists()


def test_the_founder_a_joiner_trusts(tmp_path, ids, caplog):
    founder, other = ids["founder"].peer_id, ids["joiner"].peer_id
    with pytest.raises(StartupError, match="no founder to trust for swarm 'sc': give the invite"):
        founder_to_trust(vector_config(tmp_path))
    assert founder_to_trust(vector_config(tmp_path, trust_first_founder=True)) is None
    assert founder_to_trust(vector_config(tmp_path, founder=founder)) == founder
    pin_founder(tmp_path, "sc", founder)
    pin_founder(tmp_path, "elsewhere", other)
    assert json.loads((tmp_path / FOUNDERS_FILE).read_text()) == {"sc": founder, "elsewhere": other}
    assert pinned_founder(tmp_path, "sc") == founder and pinned_founder(tmp_path, "nope") is None
    assert founder_to_trust(vector_config(tmp_path)) == founder  # a restart needs no invite
    assert founder_to_trust(vector_config(tmp_path, founder=other)) == other  # a given one wins, loudly
    assert "instead of" in caplog.text
    (tmp_path / FOUNDERS_FILE).write_text("not json")
    assert pinned_founder(tmp_path, "sc") is None


def test_a_joiner_lacking_what_the_swarm_asks_is_told_at_start(tmp_path, ids):
    founder, joiner = ids["founder"], ids["joiner"]
    allowlist = sign_config(founder.signing_key, "sc", 1, swarm_document(
        vector_config(tmp_path), 1.0, _admission("allowlist")))
    with pytest.raises(StartupError, match=f"murmur invite {joiner.peer_id}"):
        node_admission(vector_config(tmp_path), allowlist, joiner)
    certificate = tmp_path / "c"
    certificate.write_text(issue_certificate(founder.signing_key, "sc", founder.peer_id, 2**35).text)  # not its own
    with pytest.raises(StartupError, match="--certificate .*: the certificate is for peer"):
        node_admission(vector_config(tmp_path, certificate_file=certificate), allowlist, joiner)
    certificate.write_text(issue_certificate(founder.signing_key, "sc", joiner.peer_id, 2**35).text)
    assert node_admission(vector_config(tmp_path, certificate_file=certificate), allowlist, joiner).mode == "allowlist"
    assert node_admission(vector_config(tmp_path), allowlist, founder).mode == "allowlist"  # the founder needs none


def _admission(mode: str):  # type: ignore[no-untyped-def]
    from node.swarm.recipe import AdmissionDoc, AdmissionMode

    return AdmissionDoc(mode=AdmissionMode(mode))


def test_a_joiner_follows_a_newer_version_it_can_run_and_says_why_not_otherwise(tmp_path, ids):
    founder, joiner = ids["founder"], ids["joiner"]
    config = vector_config(tmp_path)
    runnable = sign_config(founder.signing_key, "sc", 2, swarm_document(config, 2.0))
    assert why_not_follow(runnable, config, joiner) is None
    user_code = swarm_document(NodeConfig(training=TrainingConfig(model="os:abort")), 2.0)
    assert "code this node would import and run" in why_not_follow(
        sign_config(founder.signing_key, "sc", 3, user_code), config, joiner)
    keyed = sign_config(founder.signing_key, "sc", 4, swarm_document(config, 2.0, _admission("allowlist")))
    assert "admits peers with its founder's certificate only" in why_not_follow(keyed, config, joiner)
    too_stale = {**swarm_document(config, 2.0)}
    too_stale["gossip"] = {**too_stale["gossip"], "max_staleness_rounds": 100}
    assert "max_staleness_rounds" in why_not_follow(sign_config(founder.signing_key, "sc", 5, too_stale), config,
                                                    joiner)


def test_a_checkpoint_of_another_config_is_kept_and_taken_back(tmp_path, ids):
    path = tmp_path / CHECKPOINT_FILE
    founder = ids["founder"]
    a = sign_config(founder.signing_key, "sc", 1, swarm_document(vector_config(tmp_path), 1.0))
    b = sign_config(founder.signing_key, "sc", 2, swarm_document(vector_config(tmp_path), 2.0))
    assert switch_checkpoint(path, a.config_hash) is None  # nothing there
    _save(path, a, "sc", 1.0)
    _save(path, a, "sc", 1.5)  # a .prev of config a too
    assert switch_checkpoint(path, a.config_hash) is None  # the right one: left alone
    said = switch_checkpoint(path, b.config_hash)
    assert said == f"kept the checkpoint of config {a.config_hash[:12]} as {kept_path(path, a.config_hash).name}"
    assert not path.exists() and kept_path(path, a.config_hash).exists()
    assert kept_path(path, a.config_hash).with_name(kept_path(path, a.config_hash).name + ".prev").exists()
    _save(path, b, "sc", 2.0)
    assert {m["config_hash"] for m in kept_metas(path)} == {a.config_hash, b.config_hash}
    said = switch_checkpoint(path, a.config_hash)
    assert "took back the checkpoint kept for config" in said and "kept the checkpoint of config" in said
    restored = load_checkpoint(path)
    assert restored is not None and restored.meta["config_hash"] == a.config_hash
    assert float(restored.tensors["params"][0]) == 1.5
    assert kept_path(path, b.config_hash).exists()


def test_murmur_status_names_the_invite_the_config_version_and_why_it_is_not_followed():
    from node.cli.status import format_status

    status = {"peer_id": "p", "swarm": "s", "maddrs": [], "round": 1, "step": 2, "peers": [], "bytes_sent": 0,
              "bytes_received": 0, "errors": {}, "invite": "s@QmFounder", "config_version": 2, "admission": "key",
              "config_not_followed": None}
    assert "invite   s@QmFounder   (config version 2, admission key)" in format_status(status).splitlines()
    behind = format_status({**status, "config_not_followed": "version 3: a reason"})
    assert "invite   s@QmFounder   (config version 2, admission key; not following version 3: a reason)" in behind


@pytest.mark.parametrize("read, message", [
    (ConfigRead(None, failed="timed out after 5 s"), "reading the swarm config from the DHT failed (timed out after 5 s)"),
    (ConfigRead(None, refused={"not_founder": 2}), "no config for swarm 'sc' signed by its founder"),
])
def test_a_joiner_tells_a_failed_dht_read_from_a_missing_config(tmp_path, ids, monkeypatch, read, message):
    import node.runtime.swarm_config as swarm_config

    monkeypatch.setattr(swarm_config, "JOIN_CONFIG_TIMEOUT_S", 0.0)
    dht = DhtStandIn()
    dht.read_config = lambda founder: asyncio.sleep(0, read)  # type: ignore[method-assign]
    config = vector_config(tmp_path, founder=ids["founder"].peer_id, network=replace(NodeConfig().network))
    with pytest.raises(StartupError) as refused:
        asyncio.run(swarm_config.join_swarm(dht, config))
    assert str(refused.value).startswith(message), str(refused.value)
    if read.refused:
        assert "(2 config(s) signed otherwise or invalid were ignored)" in str(refused.value)


def test_trusting_the_first_founder_needs_exactly_one(tmp_path, ids, caplog):
    import node.runtime.swarm_config as swarm_config

    founder = ids["founder"]
    found = sign_config(founder.signing_key, "sc", 1, swarm_document(vector_config(tmp_path), 1.0))
    dht = DhtStandIn(found)
    config = vector_config(tmp_path, trust_first_founder=True)
    assert asyncio.run(swarm_config.join_swarm(dht, config)).founder == founder.peer_id
    assert dht.pinned == founder.peer_id and pinned_founder(tmp_path, "sc") == founder.peer_id
    assert "trusting founder" in caplog.text
    dht.read_config = lambda f: asyncio.sleep(0, ConfigRead(None, founders=frozenset({"QmA", "QmB"})))  # type: ignore
    (tmp_path / FOUNDERS_FILE).unlink()
    with pytest.raises(StartupError, match="has configs signed by 2 founders"):
        asyncio.run(swarm_config.join_swarm(dht, config))


def test_each_newer_config_version_wakes_the_follower_once(tmp_path, ids):
    """A version this node cannot run is said once (a log line, a count), and the node goes on: the wait
    for the next version sleeps until one is seen, it does not return the same version again."""
    from node.net.discovery import Discovery, DiscoverySettings
    from node.runtime.serve import _follow_newer_config

    founder, joiner = ids["founder"], ids["joiner"]
    config = vector_config(tmp_path)
    version = {v: sign_config(founder.signing_key, "sc", v, swarm_document(config, 2.0, _admission("allowlist")))
               for v in (1, 2, 3)}
    discovery = Discovery(None, joiner, DiscoverySettings(swarm="sc"),  # type: ignore[arg-type]  # never started
                          data_maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{joiner.peer_id}",))
    discovery.latest_config = version[1]  # as enter() leaves it

    class Runtime:
        swarm_config, config_not_followed, counts = version[1], "", list[str]()

        def count(self, kind: str) -> None:
            self.counts.append(kind)

    async def run() -> Runtime:
        runtime, session, followed = Runtime(), asyncio.Event(), list[SwarmConfig]()
        follower = asyncio.create_task(_follow_newer_config(discovery, config, joiner, runtime, followed,  # type: ignore[arg-type]
                                                            session))
        ticks = 0
        for seen in (2, 2, 1, 3):
            discovery.saw_config(version[seen])
            for _ in range(20):  # the event loop still runs other tasks
                await asyncio.sleep(0.005)
                ticks += 1
        follower.cancel()
        assert ticks == 80 and not session.is_set() and not followed
        return runtime

    runtime = asyncio.run(asyncio.wait_for(run(), 10))
    assert runtime.counts == ["config_not_followed"] * 2  # versions 2 and 3, once each
    assert runtime.config_not_followed.startswith("version 3: ")
