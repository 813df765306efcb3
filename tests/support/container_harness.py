"""Podman for the container test: installs it when missing, builds a Python base image without a
registry (debootstrap), builds the project image, and removes everything a test created.

Follows ../shared/ENVIRONMENT.md "Containers": runc through a containers.conf, the machine's extra CA
certificates in the base image, the torch CPU wheel in the build context, `--init`, and a pinned
bridge MAC. The two base images and the Dockerfile's dependency stages are cached between runs
(see docs/deploy.md); the project's source is built into every image. Not a test module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "docker"
TORCH_VERSION = "2.13.0"
# The debootstrapped rootfs and the Python base built on it; both are kept between runs.
ROOTFS_IMAGE = "localhost/murmur-ci-debian:bookworm"
PYTHON_BASE_REPO = "localhost/murmur-ci-python"
# Tags that keep the Dockerfile's `deps` and `runtime` stages (every dependency, no project source) in
# podman's layer cache between runs; the tag is a hash of what those stages are built from.
CACHED_STAGES = {"deps": "localhost/murmur-ci-deps", "runtime": "localhost/murmur-ci-runtime"}
# Fixed mtime for everything in the build context: buildah's COPY cache compares file times, and a
# fresh clone's files are all new.
CONTEXT_MTIME = 1_000_000_000
DEFAULT_MIRROR = "http://deb.debian.org/debian"
CA_DIR = Path("/usr/local/share/ca-certificates")
# What the image build copies from the repository (the same list .dockerignore lets through).
CONTEXT_FILES = ("pyproject.toml", "README.md", "node", "gossip", "topology", "docker/entrypoint.py",
                 "docker/Dockerfile")
CONTAINERS_CONF = """\
# crun cannot start containers on this machine; p2pd and torch want more than the default limits.
[engine]
runtime = "runc"

[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
"""
APT_PACKAGES = ("podman", "buildah", "debootstrap")
INSTALL_TIMEOUT_S = 600.0
BUILD_TIMEOUT_S = 1200.0
COMMAND_TIMEOUT_S = 120.0


class PodmanUnavailable(RuntimeError):
    """Podman (or runc, debootstrap) is missing and could not be installed."""


def _run(argv: Sequence[str], *, timeout_s: float,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=env, check=False)


def _missing_tools() -> list[str]:
    return [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]


def ensure_podman() -> None:
    """Install podman, buildah, debootstrap and runc with apt when any is missing; PodmanUnavailable
    (with apt's last lines) when that fails."""
    if not _missing_tools():
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise PodmanUnavailable(f"{', '.join(_missing_tools())} missing, and installing needs apt-get as root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (["apt-get", "update", "-q"],
             ["apt-get", "install", "-y", "-q", *APT_PACKAGES],
             # Debian's podman recommends crun, which cannot start containers here: runc instead.
             ["apt-get", "install", "-y", "-q", "--no-install-recommends", "runc"])
    for step in steps:
        try:
            done = _run(step, timeout_s=INSTALL_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            raise PodmanUnavailable(f"`{' '.join(step)}` took over {INSTALL_TIMEOUT_S:g} s") from None
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise PodmanUnavailable(f"`{' '.join(step)}` failed (exit {done.returncode}):\n{tail}")
    if _missing_tools():
        raise PodmanUnavailable(f"apt-get installed the packages but {', '.join(_missing_tools())} is still missing")


class PodmanFailed(AssertionError):
    """A podman command that had to succeed did not; the message holds its output."""


@dataclass(frozen=True)
class Podman:
    """Runs `podman` with the test's containers.conf."""

    conf_path: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(self.conf_path)}

    def run(self, *args: str, timeout_s: float = COMMAND_TIMEOUT_S,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        done = _run(["podman", *args], timeout_s=timeout_s, env=self.env())
        if check and done.returncode != 0:
            raise PodmanFailed(f"`podman {' '.join(args)}` exited {done.returncode}:\n"
                               + "\n".join((done.stdout + done.stderr).splitlines()[-40:]))
        return done

    def image_exists(self, ref: str) -> bool:
        return self.run("image", "exists", ref, check=False).returncode == 0


def write_containers_conf(directory: Path) -> Podman:
    path = directory / "containers.conf"
    path.write_text(CONTAINERS_CONF)
    return Podman(path)


def debian_mirror() -> str:
    """The Debian mirror apt uses on this machine (deb822 `URIs:` or one-line `deb URL suite`)."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                match = re.match(r"\s*(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+)", line)
                if match and match.group(1).rstrip("/").endswith("/debian"):
                    return match.group(1).rstrip("/")
    return DEFAULT_MIRROR


def ensure_rootfs_image(podman: Podman, workdir: Path) -> None:
    """A minimal Debian bookworm image from debootstrap (slow), unless an earlier run left one."""
    if podman.image_exists(ROOTFS_IMAGE):
        return
    rootfs = workdir / "rootfs"
    try:
        done = _run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), debian_mirror()], timeout_s=600)
        if done.returncode != 0:
            raise PodmanFailed("debootstrap failed:\n" + "\n".join((done.stdout + done.stderr).splitlines()[-20:]))
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(["podman", "import", "-", ROOTFS_IMAGE], stdin=tar.stdout, capture_output=True,
                                      text=True, timeout=300, env=podman.env(), check=False)
        finally:
            tar.stdout.close()  # type: ignore[union-attr]
            tar.wait(60)
        if imported.returncode != 0 or tar.returncode != 0:
            raise PodmanFailed(f"podman import failed (tar {tar.returncode}):\n{imported.stderr[-2000:]}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


def _ca_files() -> list[Path]:
    return sorted(p for p in CA_DIR.glob("*.crt") if p.is_file())


def python_base_tag() -> str:
    """The Python base's tag: a hash of what it is built from, so a changed CA file or recipe rebuilds it."""
    digest = hashlib.sha256((DOCKER_DIR / "ci-base.Containerfile").read_bytes())
    for path in _ca_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{PYTHON_BASE_REPO}:{digest.hexdigest()[:12]}"


def ensure_python_base(podman: Podman, workdir: Path) -> str:
    """The CI's stand-in for python:3.11-slim: Debian's python3 and venv plus this machine's CA
    certificates. Built once and kept; older tags of it are removed."""
    ensure_rootfs_image(podman, workdir)
    tag = python_base_tag()
    if podman.image_exists(tag):
        return tag
    context = workdir / "ci-base"
    (context / "ca").mkdir(parents=True)
    for path in _ca_files():
        shutil.copy(path, context / "ca" / path.name)
    shutil.copy(DOCKER_DIR / "ci-base.Containerfile", context / "Containerfile")
    podman.run("build", "--layers=false", "--build-arg", f"BASE_ROOTFS={ROOTFS_IMAGE}", "-t", tag, str(context),
               timeout_s=600)
    listed = podman.run("images", "--format", "{{.Repository}}:{{.Tag}}", PYTHON_BASE_REPO).stdout.split()
    for old in (ref for ref in listed if ref != tag):
        podman.run("rmi", old, check=False)
    return tag


def download_torch_wheel(dest: Path) -> Path:
    """The torch CPU wheel, through this machine's pip configuration (a local wheel, no CUDA build)."""
    dest.mkdir(parents=True, exist_ok=True)
    done = _run([sys.executable, "-m", "pip", "download", "-q", f"torch=={TORCH_VERSION}", "--no-deps",
                 "--only-binary", ":all:", "-d", str(dest)], timeout_s=600)
    wheels = sorted(dest.glob(f"torch-{TORCH_VERSION}*.whl"))
    if done.returncode != 0 or not wheels:
        raise PodmanFailed(f"pip download torch=={TORCH_VERSION} failed:\n{done.stderr[-2000:]}")
    if "+cpu" not in wheels[0].name:
        raise PodmanFailed(f"pip found {wheels[0].name}, not the CPU build: the image would carry CUDA")
    return wheels[0]


def build_context(dest: Path, torch_wheel: Path) -> Path:
    """The files the Dockerfile copies, and the torch wheel in docker/wheels/ (a hard link when possible)."""
    for name in CONTEXT_FILES:
        source, target = REPO / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(source, target)
    wheels = dest / "docker" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    try:
        os.link(torch_wheel, wheels / torch_wheel.name)
    except OSError:
        shutil.copy(torch_wheel, wheels / torch_wheel.name)
    for path in (dest, *dest.rglob("*")):
        os.utime(path, (CONTEXT_MTIME, CONTEXT_MTIME), follow_symlinks=False)
    return dest


def stages_tag_suffix(context: Path, base: str) -> str:
    """What the cached stages are built from: the Dockerfile, pyproject.toml's dependency list (what the
    Dockerfile's requirements stage reads), the torch wheel's name and size, and the base. Only names
    the cache entry (buildah's layer cache decides what is rebuilt)."""
    digest = hashlib.sha256(base.encode())
    digest.update(b"\0" + (context / "docker" / "Dockerfile").read_bytes())
    dependencies = tomllib.loads((context / "pyproject.toml").read_text())["project"]["dependencies"]
    digest.update(b"\0" + "\n".join(dependencies).encode())
    for wheel in sorted((context / "docker" / "wheels").glob("*.whl")):
        digest.update(f"\0{wheel.name}:{wheel.stat().st_size}".encode())
    return digest.hexdigest()[:12]


def build_image(podman: Podman, context: Path, base: str, tag: str, log_path: Path) -> float:
    """`docker build` as CI runs it, with docker's layer cache (`--layers`): the `deps` and `runtime`
    stages, which hold no project source, are tagged and kept, so a run rebuilds them only when their
    inputs changed, while the project's source is built and installed in every run; older tags of
    them are removed. --format docker keeps the HEALTHCHECK (OCI images drop it). The builds' output
    goes to `log_path`, each line prefixed with the seconds since the start. Returns the CPU seconds
    the builds used (their RUN steps are podman's descendants), a load-independent measure of their cost."""
    cpu_before = _children_cpu_s()
    common = ["--format", "docker", "--layers", "--build-arg", f"BASE={base}",
              "-f", str(context / "docker" / "Dockerfile")]
    suffix = stages_tag_suffix(context, base)
    # The build stage (the project's wheel) is tagged only so that its layers go with the test's image.
    build_stage = f"{tag}-build-stage"
    started = time.monotonic()
    with open(log_path, "w") as log:
        for stage, repo in CACHED_STAGES.items():
            if not podman.image_exists(f"{repo}:{suffix}"):  # else the final build finds its layers cached
                _build(podman, [*common, "--target", stage, "-t", f"{repo}:{suffix}", str(context)], log, started)
        try:
            _build(podman, [*common, "--target", "build", "-t", build_stage, str(context)], log, started)
            _build(podman, [*common, "-t", tag, str(context)], log, started)
        finally:
            podman.run("rmi", build_stage, check=False)
    for repo in CACHED_STAGES.values():
        listed = podman.run("images", "--format", "{{.Repository}}:{{.Tag}}", repo).stdout.split()
        for old in (ref for ref in listed if ref != f"{repo}:{suffix}"):
            podman.run("rmi", old, check=False)
    return _children_cpu_s() - cpu_before


def _build(podman: Podman, args: list[str], log, started: float) -> None:
    argv = ["podman", "build", *args]
    log.write(f"{time.monotonic() - started:7.1f} $ {' '.join(argv)}\n")
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=podman.env()) as build:
        try:
            for line in build.stdout:  # type: ignore[union-attr]
                log.write(f"{time.monotonic() - started:7.1f} {line}")
            build.wait(timeout=BUILD_TIMEOUT_S)
        finally:
            if build.poll() is None:
                build.kill()
    if build.returncode != 0:
        log.flush()
        tail = "".join(Path(log.name).read_text().splitlines(keepends=True)[-40:])
        raise PodmanFailed(f"podman build exited {build.returncode} (log: {log.name}):\n{tail}")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def image_size_bytes(podman: Podman, ref: str) -> int:
    return int(podman.run("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())


def status_of(podman: Podman, container: str) -> dict:
    """The node's /api/status, asked from inside its container as a user would (`murmur status`)."""
    done = podman.run("exec", container, "murmur", "status", "--json", timeout_s=60)
    return json.loads(done.stdout)


def pin_bridge_mac(podman: Podman, network: str) -> None:
    """Debian's netavark 1.4 changes the bridge's MAC as containers join, which breaks container DNS
    now and then: fix the bridge to its current address once the first container is up."""
    info = json.loads(podman.run("network", "inspect", network).stdout)
    bridge = info[0]["network_interface"]
    mac = Path(f"/sys/class/net/{bridge}/address").read_text().strip()
    done = _run(["ip", "link", "set", "dev", bridge, "address", mac], timeout_s=10)
    if done.returncode != 0:
        raise PodmanFailed(f"could not pin {bridge}'s MAC {mac}: {done.stderr.strip()}")


@dataclass
class Cleanup:
    """Everything a test created, removed in reverse order on exit, whatever happened in between.
    Container logs are printed first (pytest shows them when the test fails)."""

    podman: Podman
    containers: list[str]
    volumes: list[str]
    networks: list[str]
    images: list[str]

    def close(self) -> None:
        for name in self.containers:
            logs = self.podman.run("logs", "--tail", "40", name, check=False)
            print(f"--- podman logs {name} ---\n{logs.stdout}{logs.stderr}")
        for name in reversed(self.containers):
            self.podman.run("rm", "-f", "--ignore", "-t", "5", name, check=False)
        for name in self.volumes:
            self.podman.run("volume", "rm", "-f", name, check=False)
        for name in self.networks:
            self.podman.run("network", "rm", "-f", name, check=False)
        for ref in self.images:
            self.podman.run("rmi", "-f", ref, check=False)


@contextlib.contextmanager
def cleanup(podman: Podman) -> Iterator[Cleanup]:
    registry = Cleanup(podman, [], [], [], [])
    try:
        yield registry
    finally:
        registry.close()


def unique_suffix() -> str:
    return f"{os.getpid()}-{int(time.time()) % 100000}"
