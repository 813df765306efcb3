"""`murmur node|join|bootstrap|status` up to the point where they would start a daemon: flags, their
precedence over the config file and environment, exit status 2 with one line, help, and dispatch."""

import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from node.cli import main as cli
from node.cli import status as status_command
from node.config import SETTINGS, ConfigError, NodeConfig, settings_table

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PEER_A = "/ip4/127.0.0.1/tcp/4001/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEER_B = "/ip4/127.0.0.1/tcp/4002/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working dir of its own (the default data dir lands there) and no MURMUR_* variables."""
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("MURMUR_"):
            monkeypatch.delenv(name)
    return tmp_path


def parse(*argv: str, env: dict | None = None) -> NodeConfig:
    return cli.parse_node_config(list(argv), env or {})


# ---- parsing and precedence ------------------------------------------------------------------------


def test_node_flags_become_the_config(workdir):
    config = parse("node", "--swarm", "s1", "--listen", "/ip4/127.0.0.1/tcp/0", "--listen", "/ip6/::1/tcp/0",
                   "--peers", PEER_A, PEER_B, "--monitor-port", "0", "--transport", "libp2p", "--topology", "torus",
                   "--rows", "2", "--codec", "bf16", "--round-interval", "0.5", "--heartbeat", "1", "--dim", "64",
                   "--upnp", "--mixing", "trimmed_mean", "--trim", "0.1", "--data-dir", "d", "--log-level", "debug",
                   "--data-listen", "/ip4/127.0.0.1/tcp/4005", "--data-announce", "/dns4/node.example/tcp/14005")
    assert config.swarm == "s1"
    assert config.network.data_listen == ("/ip4/127.0.0.1/tcp/4005",)
    assert config.network.data_announce == ("/dns4/node.example/tcp/14005",)
    assert config.network.listen == ("/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0")
    assert config.network.initial_peers == (PEER_A, PEER_B)
    assert config.network.transport == "libp2p" and config.network.nat_port_map is True
    assert config.monitor.port == 0
    assert (config.gossip.topology.name, config.gossip.topology.rows) == ("torus", 2)
    assert config.gossip.codec == "bf16" and config.gossip.round_interval_s == 0.5
    assert config.heartbeat_s == 1.0 and config.dim == 64 and config.log_level == "DEBUG"
    assert (config.gossip.mixing.kind, config.gossip.mixing.trim) == ("trimmed_mean", 0.1)
    assert config.data_dir == workdir / "d" and config.identity_path == workdir / "d" / "identity.key"


def test_flags_beat_environment_beats_config_file(workdir):
    (workdir / "murmur.toml").write_text(
        'swarm = "from-file"\n[monitor]\nport = 0\n[gossip]\ncodec = "fp16"\n[gossip.topology]\nname = "ring"\n'
    )
    env = {"MURMUR_CONFIG": "murmur.toml", "MURMUR_CODEC": "int8", "MURMUR_TOPOLOGY": "complete"}
    config = parse("node", "--topology", "star", env=env)
    assert config.swarm == "from-file"  # only the file sets it
    assert config.gossip.codec == "int8"  # env over file
    assert config.gossip.topology.name == "star"  # flag over env and file


def test_config_flag_beats_murmur_config_variable(workdir):
    (workdir / "a.toml").write_text('swarm = "a"\n[monitor]\nport = 0\n')
    (workdir / "b.toml").write_text('swarm = "b"\n[monitor]\nport = 0\n')
    assert parse("node", "--config", "b.toml", env={"MURMUR_CONFIG": "a.toml"}).swarm == "b"
    assert parse("node", env={"MURMUR_CONFIG": "a.toml"}).swarm == "a"


def test_a_boolean_flag_can_switch_off_what_the_environment_switched_on(workdir):
    env = {"MURMUR_UPNP": "1", "MURMUR_MONITOR_PORT": "0"}
    assert parse("node", env=env).network.nat_port_map is True
    assert parse("node", "--no-upnp", env=env).network.nat_port_map is False


def test_join_founds_nothing_and_needs_a_peer_from_some_source(workdir):
    env = {"MURMUR_MONITOR_PORT": "0"}
    with pytest.raises(ConfigError, match=r"^no peer to join through: give --peers MULTIADDR"):
        parse("join", "--swarm", "s1", env=env)
    assert parse("join", "--peers", PEER_A, env=env).network.initial_peers == (PEER_A,)
    assert parse("join", env={**env, "MURMUR_PEERS": f"{PEER_A},{PEER_B}"}).network.initial_peers == (PEER_A, PEER_B)


def test_bootstrap_ignores_node_only_variables_and_skips_the_monitor(workdir):
    with socket.socket() as busy:  # a bootstrap node serves no monitor, so a busy port is no reason to refuse
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = {"MURMUR_MONITOR_PORT": str(busy.getsockname()[1]), "MURMUR_CODEC": "nonsense"}
        config = parse("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/31337", env=env)
    assert config.network.listen == ("/ip4/127.0.0.1/tcp/31337",)


def test_bootstrap_has_no_gossip_flags(workdir):
    with pytest.raises(ConfigError, match="unrecognized arguments: --topology ring"):
        parse("bootstrap", "--topology", "ring")


# ---- bad values: exit 2 and one line -----------------------------------------------------------------

BAD_COMMAND_LINES = [
    (["node", "--monitor-port", "65536"], "murmur node: error: --monitor-port: port 65536 is out of range 0-65535"),
    (["node", "--topology", "mesh"], "murmur node: error: --topology: unknown topology 'mesh'"),
    (["node", "--listen", "/ip4/127.0.0.1/tcp/0/p2p"], "murmur node: error: --listen: malformed multiaddr"),
    (["join", "--peers", "/ip4/127.0.0.1/tcp/4001"], "murmur join: error: --peers: peer multiaddr"),
    (["join", "--swarm", "s"], "murmur join: error: no peer to join through"),
    (["node", "--config", "missing.toml"], "murmur node: error: --config missing.toml: cannot read the config file"),
    (["node", "--swarm", "no/slash"], "murmur node: error: --swarm: invalid swarm name 'no/slash'"),
    (["node", "--mixing", "clipped"], "murmur node: error: --mixing: mixing rule 'clipped' needs a clipping radius"),
    (["node", "--dim"], "murmur node: error: argument --dim: expected one argument"),
    (["bootstrap", "--identity", "."], "murmur bootstrap: error: --identity: cannot read identity"),
    (["status", "--url", "localhost:7690"], "murmur status: error: --url: 'localhost:7690' is not an http(s) URL"),
    (["status", "--url", "http://h:1", "--monitor-port", "2"], "not allowed with argument --url"),
    (["status", "--url", "http://h:1", "--monitor-host", "h"], "--monitor-host cannot be combined with --url"),
    (["status", "--monitor-port", "0"], "murmur status: error: --monitor-port: port 0 means the node picked"),
    (["node", "--data-announce", "/ip4/127.0.0.1/tcp/4003"],
     "murmur node: error: --data-announce: only the libp2p data plane listens apart from p2pd"),
    (["node", "--transport", "libp2p", "--data-listen", "/ip4/127.0.0.1/tcp/4003/p2p"],
     "murmur node: error: --data-listen: malformed multiaddr"),
]


def exit_status(argv: list[str]) -> int:
    """What `murmur ARGV` exits with: main returns a status, argparse's own errors exit."""
    try:
        return cli.main(argv)
    except SystemExit as exited:
        return exited.code


@pytest.mark.parametrize("argv,line", BAD_COMMAND_LINES, ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_bad_values_exit_2_with_one_line(workdir, capsys, argv, line):
    assert exit_status(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert len(out.err.strip().splitlines()) == 1, out.err
    assert line in out.err


def test_bad_environment_value_exits_2_naming_the_variable(workdir, capsys, monkeypatch):
    monkeypatch.setenv("MURMUR_MONITOR_PORT", "sixty")
    assert cli.main(["node"]) == 2
    assert capsys.readouterr().err == "murmur node: error: MURMUR_MONITOR_PORT: 'sixty' is not an integer\n"


def test_a_monitor_port_in_use_exits_2(workdir, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["node", "--monitor-port", str(port)]) == 2
    assert f"--monitor-port: port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_unknown_key_in_the_config_file_exits_2(workdir, capsys):
    (workdir / "m.toml").write_text("[gossip]\ntopolgy = 'ring'\n")
    assert cli.main(["node", "--config", "m.toml"]) == 2
    assert "m.toml: unknown key 'gossip.topolgy' (did you mean 'gossip.topology'?)" in capsys.readouterr().err


def test_the_console_script_exits_2_with_one_line(workdir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MURMUR_")}
    murmur = str(Path(sys.executable).with_name("murmur"))
    out = subprocess.run([murmur, "node", "--monitor-port", "99999"], capture_output=True, text=True, timeout=120,
                         env=env, cwd=workdir)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "murmur node: error: --monitor-port: port 99999 is out of range 0-65535\n"


# ---- help ---------------------------------------------------------------------------------------------

# The flags DESIGN.md's CLI contract names, and those the node brief adds; all must be documented.
CONTRACT_FLAGS = {
    "node": ["--swarm", "--listen", "--announce", "--identity", "--data-dir", "--monitor-port", "--monitor-host",
             "--config", "--transport", "--topology", "--weights", "--degree", "--topology-seed", "--rows",
             "--edges", "--codec", "--round-interval", "--heartbeat", "--dim", "--upnp", "--peers"],
    "join": ["--peers", "--swarm", "--listen", "--identity", "--data-dir", "--monitor-port", "--config",
             "--transport", "--topology", "--codec", "--round-interval", "--heartbeat", "--dim", "--upnp"],
    "bootstrap": ["--listen", "--identity", "--data-dir"],
    "status": ["--monitor-port", "--url", "--json"],
}


@pytest.mark.parametrize("command", sorted(CONTRACT_FLAGS))
def test_help_documents_every_flag_with_env_var_and_default(command, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for flag in CONTRACT_FLAGS[command]:
        assert f"{flag} " in text, flag
    for setting in SETTINGS:
        if command in setting.commands:
            assert setting.flag in text and setting.env in text, setting.key
    if command in ("node", "join"):
        assert "default: 7690; env MURMUR_MONITOR_PORT; config key monitor.port" in text
        assert "one of: ring, torus" in text
        assert "in increasing precedence" in text


def test_docs_table_is_current():
    doc = (ROOT / "docs" / "cli.md").read_text()
    assert settings_table() in doc, "docs/cli.md is stale: paste the output of `python -m node.config` into it"
    for setting in SETTINGS:
        assert setting.env in doc and f"`{setting.flag}`" in doc


# ---- dispatch to the daemon ------------------------------------------------------------------------------


@pytest.fixture
def fake_daemon(monkeypatch):
    """node.runtime.serve and node.cli.status as recording stand-ins, so dispatch is tested without a network."""
    calls = []
    daemon = types.ModuleType("node.runtime.serve")
    daemon.run_node = lambda config, founding: calls.append(("run_node", config, founding)) or 0
    daemon.run_bootstrap = lambda config: calls.append(("run_bootstrap", config)) or 0
    monkeypatch.setattr(status_command, "run_status",
                        lambda url, as_json, token=None: calls.append(("run_status", url, as_json)) or 3)
    monkeypatch.setitem(sys.modules, "node.runtime.serve", daemon)
    return calls


def test_node_founds_and_join_does_not(workdir, fake_daemon):
    assert cli.main(["node", "--swarm", "s1", "--monitor-port", "0"]) == 0
    assert cli.main(["join", "--swarm", "s1", "--peers", PEER_A, "--monitor-port", "0"]) == 0
    (_, founder, founding), (_, joiner, joining) = fake_daemon
    assert founding is True and joining is False
    assert founder.swarm == joiner.swarm == "s1" and joiner.network.initial_peers == (PEER_A,)


def test_bootstrap_runs_the_bootstrap_entry_point(workdir, fake_daemon):
    assert cli.main(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/4555"]) == 0
    [(name, config)] = fake_daemon
    assert name == "run_bootstrap" and config.network.listen == ("/ip4/127.0.0.1/tcp/4555",)


def test_a_bad_value_never_reaches_the_daemon(workdir, fake_daemon):
    assert cli.main(["node", "--monitor-port", "0", "--codec", "fp64"]) == 2
    assert fake_daemon == []


@pytest.mark.parametrize(
    "argv,env,url",
    [
        (["status"], {}, "http://127.0.0.1:7690"),
        (["status", "--monitor-port", "7701"], {"MURMUR_MONITOR_PORT": "7700"}, "http://127.0.0.1:7701"),
        (["status"], {"MURMUR_MONITOR_PORT": "7700", "MURMUR_MONITOR_HOST": "::1"}, "http://[::1]:7700"),
        (["status", "--url", "http://10.1.2.3:8000/"], {"MURMUR_MONITOR_PORT": "7700"}, "http://10.1.2.3:8000"),
    ],
)
def test_status_asks_the_monitor_the_node_would_serve(workdir, fake_daemon, monkeypatch, argv, env, url):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main([*argv, "--json"]) == 3  # run_status's own exit status is passed on
    assert fake_daemon == [("run_status", url, True)]


@pytest.mark.parametrize(
    "argv,token",
    [
        (["status"], "from-the-data-dir"),  # ./murmur-data/monitor.token, to the loopback default
        (["status", "--url", "http://localhost:7700"], "from-the-data-dir"),
        (["status", "--token", "given"], "given"),
        # a node elsewhere does not learn this machine's token, unless the data dir is named
        (["status", "--url", "http://10.1.2.3:8000"], None),
        (["status", "--url", "http://10.1.2.3:8000", "--data-dir", "murmur-data"], "from-the-data-dir"),
        (["status", "--data-dir", "elsewhere"], None),  # no token there
    ],
)
def test_status_and_eval_send_the_monitor_token_of_the_data_dir(workdir, argv, token):
    (workdir / "murmur-data").mkdir()
    (workdir / "murmur-data" / "monitor.token").write_text("from-the-data-dir\n")
    args = cli.build_parser().parse_args(argv)
    url = status_command.status_url(args, {})
    assert status_command.monitor_token(args, {}, url) == token


def test_topology_and_sim_still_parse_as_before():
    args = cli.build_parser().parse_args(["sim", "--peers", "8", "--topology", "ring", "--degree", "3"])
    assert (args.peers, args.topology, args.degree, args.rounds, args.topology_seed) == (8, "ring", 3, 20, 0)
    args = cli.build_parser().parse_args(["topology", "ring", "--peers", "4"])
    assert (args.name, args.peers, args.json) == ("ring", 4, False)
