"""The settings layer: defaults < TOML file < MURMUR_* environment < flags, and one clear error per bad value."""

import socket
from pathlib import Path

import pytest

from node.config import (
    SETTINGS,
    SETTINGS_BY_KEY,
    ConfigError,
    MonitorConfig,
    NetworkConfig,
    NodeConfig,
    check_environment,
    merge_layers,
    read_config_file,
    read_environment,
    read_flags,
    setting_value,
)
from topology import TopologySpec

pytestmark = pytest.mark.unit

PEER_A = "/ip4/127.0.0.1/tcp/4001/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEER_B = "/ip4/127.0.0.1/tcp/4002/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


def write_toml(tmp_path: Path, text: str, name: str = "murmur.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def flags(**given: object) -> dict:
    """read_flags input from setting keys spelled with '__' for '.'."""
    return read_flags({SETTINGS_BY_KEY[key.replace("__", ".")]: value for key, value in given.items()})


def resolve(tmp_path: Path, toml: str | None = None, env: dict | None = None, given: dict | None = None) -> NodeConfig:
    layers = []
    if toml is not None:
        layers.append(read_config_file(write_toml(tmp_path, toml)))
    layers.append(read_environment(env or {}, SETTINGS))
    layers.append(flags(**(given or {})))
    return merge_layers(*layers).config


# ---- precedence ----------------------------------------------------------------------------------

# (key, TOML line in its table, env value, flag value as argparse leaves it, expected from file, env, flag)
PRECEDENCE_CASES = [
    ("monitor.port", "[monitor]\nport = 7001", "7002", "7003", 7001, 7002, 7003),
    ("gossip.topology.name", '[gossip.topology]\nname = "ring"', "torus", "hypercube", "ring", "torus", "hypercube"),
    ("gossip.round_interval_s", "[gossip]\nround_interval_s = 0.5", "0.25", "2", 0.5, 0.25, 2.0),
    ("network.initial_peers", f'[network]\ninitial_peers = ["{PEER_A}"]', f"{PEER_A}, {PEER_B}", [PEER_B],
     (PEER_A,), (PEER_A, PEER_B), (PEER_B,)),
    ("network.nat_port_map", "[network]\nnat_port_map = true", "off", True, True, False, True),
    ("log_level", 'log_level = "debug"', "warning", "error", "DEBUG", "WARNING", "ERROR"),
    ("gossip.topology.edges", '[gossip.topology]\nedges = [[0, 1], [1, 2]]', "0-2", "2-1,1-0",
     ((0, 1), (1, 2)), ((0, 2),), ((2, 1), (1, 0))),
]


@pytest.mark.parametrize("key,toml,env_value,flag_value,from_file,from_env,from_flag", PRECEDENCE_CASES,
                         ids=[case[0] for case in PRECEDENCE_CASES])
def test_file_then_env_then_flag_each_win(tmp_path, key, toml, env_value, flag_value, from_file, from_env, from_flag):
    setting = SETTINGS_BY_KEY[key]
    default = setting_value(NodeConfig(), key)
    # each layer changes the value, otherwise the case proves nothing
    assert default != from_file and from_file != from_env and from_env != from_flag and from_flag != default
    env = {setting.env: env_value}
    given = {key.replace(".", "__"): flag_value}
    assert setting_value(resolve(tmp_path), key) == default
    assert setting_value(resolve(tmp_path, toml), key) == from_file
    assert setting_value(resolve(tmp_path, toml, env), key) == from_env
    assert setting_value(resolve(tmp_path, toml, env, given), key) == from_flag
    assert setting_value(resolve(tmp_path, None, None, given), key) == from_flag


def test_layers_override_setting_by_setting_not_whole_sections(tmp_path):
    config = resolve(tmp_path, "[monitor]\nhost = '127.0.0.2'\nport = 7001\n", {"MURMUR_MONITOR_PORT": "7002"})
    assert config.monitor == MonitorConfig(host="127.0.0.2", port=7002)


def test_sources_name_where_each_value_came_from(tmp_path):
    path = write_toml(tmp_path, "[monitor]\nport = 7001\n")
    resolved = merge_layers(read_config_file(path), read_environment({"MURMUR_SWARM": "s1"}, SETTINGS),
                            flags(gossip__codec="int8"))
    assert resolved.source("monitor.port") == f"{path}:monitor.port"
    assert resolved.source("swarm") == "MURMUR_SWARM"
    assert resolved.source("gossip.codec") == "--codec"
    assert resolved.source("dim") == "default --dim"


def test_empty_environment_variable_counts_as_unset(tmp_path):
    config = resolve(tmp_path, "[monitor]\nport = 7001\n", {"MURMUR_MONITOR_PORT": "", "MURMUR_PEERS": "  "})
    assert config.monitor.port == 7001 and config.network.initial_peers == ()


def test_environment_variables_of_other_commands_are_not_read():
    status_settings = [s for s in SETTINGS if "status" in s.commands]
    layer = read_environment({"MURMUR_CODEC": "nonsense", "MURMUR_MONITOR_PORT": "7005"}, status_settings)
    assert set(layer) == {"monitor.port"}


def test_relative_paths_in_the_file_are_relative_to_the_file(tmp_path, monkeypatch):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    path = write_toml(conf_dir, 'data_dir = "state"\nidentity_file = "keys/id.key"\n')
    config = merge_layers(read_config_file(path), read_environment({"MURMUR_DATA_DIR": ""}, SETTINGS)).config
    assert config.data_dir == conf_dir / "state"
    assert config.identity_path == conf_dir / "keys" / "id.key"
    from_env = merge_layers(read_environment({"MURMUR_DATA_DIR": "other"}, SETTINGS)).config
    assert from_env.data_dir == tmp_path / "other"  # env and flags: relative to the working dir
    assert from_env.identity_path == tmp_path / "other" / "identity.key"


def test_nested_topology_and_mixing_become_the_gossip_layer_objects(tmp_path):
    config = resolve(tmp_path, "[gossip.topology]\nname = 'random-regular'\ndegree = 3\nseed = 9\n"
                     "[gossip.mixing]\nkind = 'clipped'\ntau = 0.5\n")
    assert config.gossip.topology == TopologySpec("random-regular", degree=3, seed=9)
    assert config.gossip.mixing.kind == "clipped" and config.gossip.mixing.tau == 0.5


# ---- defaults ------------------------------------------------------------------------------------


def test_defaults_follow_the_network_rules():
    config = NodeConfig()
    assert config.network.listen == ("/ip4/127.0.0.1/tcp/0",)
    assert config.network.nat_port_map is False
    assert config.monitor.host == "127.0.0.1"
    assert config.network.transport == "p2pd"
    assert config.identity_path == Path("murmur-data") / "identity.key"


def test_merged_paths_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = merge_layers().config
    assert config.data_dir == tmp_path / "murmur-data"
    assert config.identity_path == tmp_path / "murmur-data" / "identity.key"


@pytest.mark.parametrize("host,url", [("127.0.0.1", "http://127.0.0.1:7690"), ("0.0.0.0", "http://127.0.0.1:7690"),
                                      ("::1", "http://[::1]:7690"), ("::", "http://[::1]:7690")])
def test_monitor_url_is_one_a_local_client_can_reach(host, url):
    assert MonitorConfig(host=host, port=7690).url == url


def test_a_directly_built_config_is_checked_too():
    with pytest.raises(ConfigError, match="network.listen: malformed multiaddr 'tcp/1'"):
        NodeConfig(network=NetworkConfig(listen=("tcp/1",)))
    with pytest.raises(ConfigError, match="monitor.port: port 65536 is out of range 0-65535"):
        NodeConfig(monitor=MonitorConfig(port=65536))


# ---- bad values: one line naming the source -------------------------------------------------------

BAD_ENV = [
    ("MURMUR_MONITOR_PORT", "65536", "MURMUR_MONITOR_PORT: port 65536 is out of range 0-65535"),
    ("MURMUR_MONITOR_PORT", "http", "MURMUR_MONITOR_PORT: 'http' is not an integer"),
    ("MURMUR_TOPOLOGY", "mesh", "MURMUR_TOPOLOGY: unknown topology 'mesh'; choose one of ring"),
    ("MURMUR_CODEC", "fp8", "MURMUR_CODEC: unknown codec 'fp8'"),
    ("MURMUR_TRANSPORT", "quic", "MURMUR_TRANSPORT: unknown transport 'quic'"),
    ("MURMUR_UPNP", "maybe", "MURMUR_UPNP: 'maybe' is not a boolean"),
    ("MURMUR_HEARTBEAT", "0", "MURMUR_HEARTBEAT: 0 is out of range: must be a number > 0"),
    ("MURMUR_HEARTBEAT", "nan", "MURMUR_HEARTBEAT: must be a finite number"),
    ("MURMUR_TRIM", "0.5", "MURMUR_TRIM: 0.5 is out of range: must be a number >= 0 and < 0.5"),
    ("MURMUR_DIM", "0", "MURMUR_DIM: dim 0 is below the minimum 1"),
    ("MURMUR_EDGES", "0-1-2", "MURMUR_EDGES: '0-1-2' is not an edge list"),
    ("MURMUR_LISTEN", "/ip4/127.0.0.1/tcp/0 /ip4/300.0.0.1/tcp/0",
     "MURMUR_LISTEN: malformed multiaddr '/ip4/300.0.0.1/tcp/0': base address '300.0.0.1' is not IPv4"),
    ("MURMUR_LISTEN", "/ip4/127.0.0.1", "MURMUR_LISTEN: multiaddr '/ip4/127.0.0.1' has no /tcp/<port> or /udp/<port>"),
    ("MURMUR_LISTEN", PEER_A, "MURMUR_LISTEN: multiaddr '" + PEER_A + "' must not name a peer"),
    ("MURMUR_ANNOUNCE", "/unix/tmp/x", "MURMUR_ANNOUNCE: multiaddr '/unix/tmp/x' must start with an address"),
    ("MURMUR_PEERS", "/ip4/127.0.0.1/tcp/4001", "MURMUR_PEERS: peer multiaddr '/ip4/127.0.0.1/tcp/4001' must end "
     "with /p2p/<peer id>"),
    ("MURMUR_PEERS", "/ip4/127.0.0.1/tcp/4001/p2p/nonsense", "MURMUR_PEERS: malformed multiaddr"),
]


@pytest.mark.parametrize("name,value,message", BAD_ENV, ids=[f"{n}={v}" for n, v, _ in BAD_ENV])
def test_bad_environment_values_name_the_variable(name, value, message):
    with pytest.raises(ConfigError) as caught:
        read_environment({name: value}, SETTINGS)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


BAD_FLAGS = [
    ({"monitor__port": "-1"}, "--monitor-port: port -1 is out of range 0-65535"),
    ({"gossip__topology__name": "mesh"}, "--topology: unknown topology 'mesh'"),
    ({"network__listen": ["/ip4/127.0.0.1/tcp/0", "ip4/127.0.0.1/tcp/1"]},
     "--listen: malformed multiaddr 'ip4/127.0.0.1/tcp/1'"),
    ({"network__initial_peers": ["/ip4/127.0.0.1/tcp/1"]},
     "--peers: peer multiaddr '/ip4/127.0.0.1/tcp/1' must end with"),
    ({"gossip__mixing__tau": "-1"}, "--tau: -1 is out of range: must be a number > 0"),
    ({"swarm": "two words"}, "--swarm: 'two words' must be a non-empty string without spaces"),
    ({"log_level": "loud"}, "--log-level: unknown log level 'LOUD'"),
]


@pytest.mark.parametrize("given,message", BAD_FLAGS, ids=[next(iter(g)) for g, _ in BAD_FLAGS])
def test_bad_flag_values_name_the_flag(given, message):
    with pytest.raises(ConfigError) as caught:
        flags(**given)
    assert str(caught.value).startswith(message)


BAD_FILES = [
    ("[monitor]\nprot = 7690\n", "unknown key 'monitor.prot' (did you mean 'monitor.port'?)"),
    ("training_steps = 3\n", "unknown key 'training_steps'"),
    ("[monitro]\nport = 1\n", "unknown key 'monitro' (did you mean 'monitor'?)"),
    ("[monitor]\nport = '7690'\n", ":monitor.port: must be an integer, got a string ('7690')"),
    ("[monitor]\nport = 7690.0\n", ":monitor.port: must be an integer, got a float (7690.0)"),
    ("[monitor]\nport = 70000\n", ":monitor.port: port 70000 is out of range 0-65535"),
    ("[network]\nnat_port_map = 'yes'\n", ":network.nat_port_map: must be true or false, got a string"),
    ("[network]\nlisten = '/ip4/127.0.0.1/tcp/0'\n", ":network.listen: must be an array of strings, got a string"),
    ("[network]\ninitial_peers = ['/ip4/1.2.3.4/tcp/1']\n", ":network.initial_peers: peer multiaddr"),
    ("[gossip]\nround_interval_s = true\n", ":gossip.round_interval_s: must be a number, got a boolean"),
    ("[gossip.topology]\nname = 'mesh'\n", ":gossip.topology.name: unknown topology 'mesh'"),
    ("[gossip.topology]\nedges = [[0, 1, 2]]\n", ":gossip.topology.edges: must be an array of [from, to] rank pairs"),
    ("gossip = 3\n", ":gossip: must be a table ([gossip]), got an integer"),
    ("swarm = ['a']\n", ":swarm: must be a string, got an array"),
    ("[monitor\nport = 1\n", ": not valid TOML: "),
]


@pytest.mark.parametrize("text,message", BAD_FILES, ids=[t.splitlines()[-1] for t, _ in BAD_FILES])
def test_bad_config_files_name_the_file_and_key(tmp_path, text, message):
    path = write_toml(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        read_config_file(path)
    assert str(caught.value).startswith(str(path))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_missing_config_file_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"^--config .*nope.toml: cannot read the config file: No such file"):
        read_config_file(tmp_path / "nope.toml")


def test_clipped_mixing_without_tau_names_where_clipped_came_from():
    with pytest.raises(ConfigError, match=r"^MURMUR_MIXING: mixing rule 'clipped' needs a clipping radius"):
        merge_layers(read_environment({"MURMUR_MIXING": "clipped"}, SETTINGS))
    config = merge_layers(read_environment({"MURMUR_MIXING": "clipped"}, SETTINGS), flags(gossip__mixing__tau="2"))
    assert config.config.gossip.mixing.tau == 2.0


def test_custom_topology_without_edges_is_refused():
    with pytest.raises(ConfigError, match=r"^--topology: the custom topology needs an edge list"):
        merge_layers(flags(gossip__topology__name="custom"))


# ---- checks against the machine -----------------------------------------------------------------


def checked(tmp_path: Path, **given: object) -> NodeConfig:
    resolved = merge_layers(flags(**{"data_dir": str(tmp_path / "data"), "monitor__port": "0", **given}))
    check_environment(resolved)
    return resolved.config


def test_a_sound_config_passes_the_machine_checks(tmp_path):
    config = checked(tmp_path, swarm="my-swarm.v2")
    assert config.swarm == "my-swarm.v2" and config.data_dir == tmp_path / "data"


def test_a_monitor_port_in_use_is_refused(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^--monitor-port: port {port} on 127.0.0.1 is already in use"):
            checked(tmp_path, monitor__port=str(port))
    checked(tmp_path, monitor__port=str(port))  # free again once the other socket is gone


def test_a_monitor_host_that_is_not_this_machine_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^--monitor-host: 192.0.2.1 is not an address of this machine"):
        checked(tmp_path, monitor__host="192.0.2.1")  # TEST-NET-1: never assigned to a host


def test_swarm_name_follows_the_dht_key_rules(tmp_path):
    with pytest.raises(ConfigError, match=r"^--swarm: invalid swarm name 'a/b'"):
        checked(tmp_path, swarm="a/b")


def test_an_identity_file_that_is_not_a_key_is_refused(tmp_path):
    garbage = tmp_path / "id.key"
    garbage.write_bytes(b"\xff\x00 not a key")
    with pytest.raises(ConfigError, match=rf"^--identity: identity {garbage} is not a libp2p private key file"):
        checked(tmp_path, identity_file=str(garbage))


def test_an_identity_path_that_cannot_be_read_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^--identity: cannot read identity .*: Is a directory"):
        checked(tmp_path, identity_file=str(tmp_path))


def test_a_bad_default_identity_names_the_data_dir(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "identity.key").write_text("junk")
    with pytest.raises(ConfigError, match=r"^identity file <data-dir>/identity.key \(data dir from --data-dir\)"):
        checked(tmp_path)


def test_an_existing_identity_is_accepted_and_a_missing_one_left_to_create(tmp_path):
    from node.net.identity import create_identity

    key = tmp_path / "node.key"
    create_identity(key)
    assert checked(tmp_path, identity_file=str(key)).identity_path == key
    assert not checked(tmp_path).identity_path.exists()


def test_a_data_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "data").write_text("")
    with pytest.raises(ConfigError, match=r"^--data-dir: data dir .*data exists and is not a directory"):
        checked(tmp_path)
    with pytest.raises(ConfigError, match=r"^--data-dir: cannot create data dir .*data/sub"):
        check_environment(merge_layers(flags(data_dir=str(tmp_path / "data" / "sub"), monitor__port="0")))


def test_robust_mixing_is_the_default_and_a_nodes_own_rule_wins_over_the_swarms():
    from gossip.mixing import MixingKind
    from node.runtime.founding import swarm_document
    from node.runtime.serve import exchange_settings
    from node.swarm.recipe import SwarmSettings

    founder = NodeConfig()
    assert founder.gossip.mixing.kind is MixingKind.ADAPTIVE_CLIP
    weighted_swarm = merge_layers(flags(gossip__mixing__kind="weighted")).config
    swarm = SwarmSettings.from_doc(swarm_document(weighted_swarm, epoch=0.0))
    assert swarm.mixing.kind is MixingKind.WEIGHTED  # the founder's own rule, published for information
    joiner = NodeConfig()
    assert exchange_settings(joiner, "hash", swarm).rule.kind is MixingKind.ADAPTIVE_CLIP
    median_joiner = merge_layers(flags(gossip__mixing__kind="median")).config
    assert exchange_settings(median_joiner, "hash", swarm).rule.kind is MixingKind.MEDIAN
