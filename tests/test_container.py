"""The node image, built and run with podman as users run it with docker: the CLI's help and errors,
then three containers on a user-defined network that form one swarm, gossip, survive losing one
node, stop on SIGTERM with a final checkpoint in their volumes, and keep their identity.

Installs podman when it is missing and fails (never skips) when it cannot; see docs/deploy.md.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from node.train.checkpoint import load_checkpoint
from support.container_harness import (
    Cleanup,
    Podman,
    PodmanUnavailable,
    build_context,
    build_image,
    cleanup,
    download_torch_wheel,
    ensure_podman,
    ensure_python_base,
    image_size_bytes,
    pin_bridge_mac,
    status_of,
    unique_suffix,
    write_containers_conf,
)
from support.swarm_harness import wait_for
from support.tiny_model import TINY

# Building the image from a cold cache takes minutes on 2 cores; the per-test default is 600 s.
pytestmark = [pytest.mark.container, pytest.mark.timeout(1500)]

P2P_PORT = 31337
MONITOR_PORT = 7690
# Light training for three nodes sharing two busy cores: the tests' tiny model (tests/support/tiny_model.py,
# mounted into every container and named by import path, as a user brings their own model), one torch
# thread, small batches. Set through the environment, which a node that lacks a setting ignores.
# Rounds and heartbeats keep their defaults: on a loaded machine a 1 s heartbeat lets peer records lapse.
MODEL_DIR = "/opt/murmur-models"
NODE_ENV = {"PYTHONPATH": MODEL_DIR, "MURMUR_MODEL": "tiny_model:build", "MURMUR_CONTEXT": str(TINY.context),
            "MURMUR_BATCH_SIZE": "4", "MURMUR_THREADS": "1", "MURMUR_DIM": "4096"}
STOP_WAIT_S = 90.0  # podman stop waits the service's stop_grace_period, then SIGKILLs (exit 137)
READY_TIMEOUT_S = 180.0
PROGRESS_TIMEOUT_S = 240.0
MORE_ROUNDS = 3
# Only for iterating on this test: run against this already built image instead of building one.
REUSE_IMAGE_ENV = "MURMUR_TEST_IMAGE"
COMPOSE_FILE = Path(__file__).resolve().parent.parent / "docker" / "compose.yaml"
TINY_MODEL_FILE = Path(__file__).resolve().parent / "support" / "tiny_model.py"


@dataclass(frozen=True)
class Built:
    podman: Podman
    image: str
    registry: Cleanup


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    try:
        ensure_podman()
    except PodmanUnavailable as exc:
        pytest.fail(f"the container test needs podman and could not install it: {exc}", pytrace=False)
    work = tmp_path_factory.mktemp("container")
    podman = write_containers_conf(work)
    with cleanup(podman) as registry:
        given = os.environ.get(REUSE_IMAGE_ENV, "").strip()
        if given:  # iterating on this test: an image built earlier, left in place
            assert podman.image_exists(given), f"{REUSE_IMAGE_ENV}={given}: no such image"
            yield Built(podman, given, registry)
            return
        started = time.monotonic()
        base = ensure_python_base(podman, work)
        print(f"base image {base}: ready in {time.monotonic() - started:.0f} s")
        context = build_context(work / "context", download_torch_wheel(work / "wheels"))
        image = f"localhost/murmur-test:{unique_suffix()}"
        registry.images.append(image)
        started = time.monotonic()
        cpu_s = build_image(podman, context, base, image, work / "build.log")
        print(f"image {image}: built in {time.monotonic() - started:.0f} s ({cpu_s:.0f} CPU s; log "
              f"{work / 'build.log'}), {image_size_bytes(podman, image) / 1e6:.0f} MB")
        yield Built(podman, image, registry)


def run_once(built: Built, *args: str):
    # --no-healthcheck: podman reports on stderr that it cannot schedule one without systemd
    return built.podman.run("run", "--rm", "--init", "--no-healthcheck", built.image, *args, check=False,
                            timeout_s=120)


def test_help_and_bad_flag(built: Built) -> None:
    shown = run_once(built, "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: murmur"), shown.stdout[:300]
    for command in ("node", "join", "bootstrap", "status"):
        assert command in shown.stdout

    bad = run_once(built, "join", "--no-such-flag")
    assert bad.returncode == 2, (bad.stdout, bad.stderr)
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and re.match(r"murmur( join)?: error: ", lines[0]) and "--no-such-flag" in lines[0], lines

    no_peer = run_once(built, "join")
    assert no_peer.returncode == 2, (no_peer.stdout, no_peer.stderr)
    assert "no peer to join through" in no_peer.stderr


def test_image_runs_as_a_user_with_a_healthcheck(built: Built) -> None:
    inspected = json.loads(built.podman.run("image", "inspect", built.image).stdout)[0]
    config = inspected["Config"]
    assert config["User"] == "murmur"
    assert config["StopSignal"] == "SIGTERM"
    # podman shows a docker-format image's healthcheck beside Config
    assert inspected["Healthcheck"]["Test"] == ["CMD", "murmur", "status"], inspected.get("Healthcheck")
    assert "/data" in config["Volumes"]
    assert {f"{P2P_PORT}/tcp", f"{MONITOR_PORT}/tcp"} <= set(config["ExposedPorts"])


@dataclass(frozen=True)
class Service:
    """One service of docker/compose.yaml, in the terms `podman run` needs."""

    name: str
    command: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    publishes_monitor: bool
    init: bool
    stop_grace_s: int


def compose_services() -> dict[str, Service]:
    """The services of the compose file (docker compose is not installed here, so the test runs them
    with podman; the parts it does not translate are checked to be what it assumes)."""
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    services = {}
    for name, spec in document["services"].items():
        if spec.get("profiles"):
            continue  # an optional profile's (observability): a plain `compose up` does not start it
        assert spec["volumes"] == [f"{name}:/data"], f"{name}: its volume must be {name}:/data"
        ports = spec.get("ports", [])
        assert ports in ([], [f"127.0.0.1:{MONITOR_PORT}:{MONITOR_PORT}"]), f"{name}: only the monitor, on loopback"
        grace = spec["stop_grace_period"]
        assert grace.endswith("s"), grace
        services[name] = Service(name, tuple(spec["command"]), tuple(spec["environment"].items()), bool(ports),
                                 bool(spec["init"]), int(grace[:-1]))
    return services


def start_service(built: Built, service: Service, container: str, network: str, volume: str,
                  command: tuple[str, ...] | None = None, drop_env: tuple[str, ...] = ()) -> None:
    """`podman run` what compose would run for `service`; other containers reach it by the service's name.
    Its monitor goes to a free loopback port (7690 may be taken on a test machine)."""
    built.registry.containers.append(container)
    env = {**dict(service.environment), **NODE_ENV}
    env_args = [arg for key, value in env.items() if key not in drop_env for arg in ("-e", f"{key}={value}")]
    publish = ["-p", f"127.0.0.1::{MONITOR_PORT}"] if service.publishes_monitor else []
    init = ["--init"] if service.init else []
    model = ["-v", f"{TINY_MODEL_FILE}:{MODEL_DIR}/tiny_model.py:ro"]
    built.podman.run("run", "-d", *init, "--name", container, "--network", network, "--network-alias", service.name,
                     "-v", f"{volume}:/data", *model, "--stop-timeout", str(service.stop_grace_s), *publish, *env_args,
                     built.image, *(command or service.command))


def wait_status(built: Built, name: str, what: str, check, timeout_s: float = PROGRESS_TIMEOUT_S) -> dict:
    """Poll the node's status until `check(status)` holds; the last status read is in the failure."""
    last: dict = {}

    def poll() -> bool:
        nonlocal last
        last = status_of(built.podman, name)
        return check(last)

    try:
        # each poll starts `podman exec` and a `murmur status` process, on the cores the nodes train on
        wait_for(poll, timeout_s, f"{name}: {what}", interval_s=2.0)
    except AssertionError as exc:
        brief = {key: last.get(key) for key in ("round", "rounds_run", "step", "bytes_received", "errors", "skipped")}
        raise AssertionError(f"{exc}; last status: {len(last.get('peers', []))} peers, {brief}") from None
    return last


def progress(status: dict) -> tuple[int, int, int]:
    return status["rounds_run"], status["step"], status["bytes_received"]


def assert_advancing(built: Built, names: list[str], peers: int) -> None:
    """Each node comes to see exactly `peers` peers, then runs MORE_ROUNDS more gossip rounds, takes
    more steps and receives more bytes. (The view is not required to stay at `peers` meanwhile: on a
    loaded machine a heartbeat can be late and a record lapse for a moment.)"""
    before = {}
    for name in names:
        before[name] = progress(wait_status(built, name, f"{peers} peers in view", lambda s: len(s["peers"]) == peers))
    for name in names:
        rounds0, step0, bytes0 = before[name]
        wait_status(built, name, f"{MORE_ROUNDS} more rounds, more steps and more bytes than {before[name]}",
                    lambda s, r=rounds0, t=step0, b=bytes0: s["rounds_run"] >= r + MORE_ROUNDS and s["step"] > t
                    and s["bytes_received"] > b)


def volume_path(built: Built, volume: str) -> Path:
    return Path(built.podman.run("volume", "inspect", "--format", "{{.Mountpoint}}", volume).stdout.strip())


def exit_code(built: Built, name: str) -> int:
    return int(built.podman.run("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip())


def published_status(built: Built, name: str) -> dict:
    """The status through the monitor port published on 127.0.0.1, as compose publishes the first node's."""
    host_port = built.podman.run("port", name, f"{MONITOR_PORT}/tcp").stdout.split()[0]
    with urllib.request.urlopen(f"http://{host_port}/api/status", timeout=5) as response:
        return json.load(response)


def test_compose_swarm_forms_survives_a_loss_and_stops_cleanly(built: Built) -> None:
    started = time.monotonic()
    services = compose_services()
    assert list(services) == ["murmur-a", "murmur-b", "murmur-c"]
    founder_service = services["murmur-a"]
    assert founder_service.command[0] == "node" and founder_service.publishes_monitor
    suffix = unique_suffix()
    podman, registry = built.podman, built.registry
    network = f"murmur-ct-{suffix}"
    containers = {name: f"{network}-{name}" for name in services}
    volumes = {name: f"{network}-{name}-data" for name in services}
    registry.networks.append(network)
    podman.run("network", "create", network)
    for volume in volumes.values():
        registry.volumes.append(volume)
        podman.run("volume", "create", volume)
    a, b, c = containers.values()

    start_service(built, founder_service, a, network, volumes["murmur-a"])
    pin_bridge_mac(podman, network)
    founder = wait_status(built, a, "its API", lambda s: bool(s["peer_id"]), timeout_s=READY_TIMEOUT_S)
    founder_maddr = f"/dns4/murmur-a/tcp/{P2P_PORT}/p2p/{founder['peer_id']}"
    assert founder_maddr in founder["maddrs"]
    # c joins as compose has it (MURMUR_PEERS_FROM); b as a user types it, with a's full multiaddr
    start_service(built, services["murmur-b"], b, network, volumes["murmur-b"],
                  command=(*services["murmur-b"].command, "--peers", founder_maddr, "--invite", founder["invite"]),
                  drop_env=("MURMUR_PEERS_FROM",))
    start_service(built, services["murmur-c"], c, network, volumes["murmur-c"])

    assert_advancing(built, [a, b, c], peers=3)
    ids = {name: status_of(podman, name)["peer_id"] for name in (a, b, c)}
    assert len(set(ids.values())) == 3
    # the guided join (docs/cli.md): each joiner checked the four things in order and measured its link
    for joiner in (b, c):
        checks = status_of(podman, joiner)["preflight"]
        assert [line["check"] for line in checks] == ["model", "memory", "link", "reach"], checks
        assert (checks[2]["figures"]["rtt_ms"] or 0) > 0, checks
    assert published_status(built, a)["peer_id"] == ids[a]
    assert podman.run("healthcheck", "run", a, check=False).returncode == 0, "the HEALTHCHECK fails on a live node"

    # losing a node: the other two notice and carry on
    podman.run("kill", c)
    assert_advancing(built, [a, b], peers=2)

    # SIGTERM (podman stop): a clean exit and a final checkpoint at least as new as the last round seen
    last_seen = {name: status_of(podman, name) for name in (a, b)}
    stop_sent = time.time()
    podman.run("stop", a, b, timeout_s=STOP_WAIT_S)
    stop_s = time.time() - stop_sent
    for name, volume in ((a, volumes["murmur-a"]), (b, volumes["murmur-b"])):
        assert exit_code(built, name) == 0, f"{name} did not stop cleanly on SIGTERM"
        path = volume_path(built, volume) / "checkpoint.safetensors"
        assert path.stat().st_mtime >= stop_sent - 1, f"{name}'s checkpoint predates the stop"
        checkpoint = load_checkpoint(path)
        assert checkpoint is not None, f"{name} wrote no checkpoint"
        assert int(checkpoint.meta["round"]) >= last_seen[name]["round"], (checkpoint.meta, last_seen[name]["round"])
        assert int(checkpoint.meta["step"]) >= last_seen[name]["step"], (checkpoint.meta, last_seen[name]["step"])
        assert (path.parent / "identity.key").is_file()

    # the identity lives in the volume: a new container on a's volume is the same peer
    again = f"{a}-again"
    start_service(built, founder_service, again, network, volumes["murmur-a"])
    restarted = wait_status(built, again, "its API", lambda s: bool(s["peer_id"]), timeout_s=READY_TIMEOUT_S)
    assert restarted["peer_id"] == ids[a]
    podman.run("stop", again, timeout_s=STOP_WAIT_S)
    assert exit_code(built, again) == 0
    print(f"swarm scenario: {time.monotonic() - started:.0f} s, SIGTERM to exit of two nodes {stop_s:.1f} s")
