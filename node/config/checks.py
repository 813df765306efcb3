"""What a config can only be checked against on this machine: the swarm name (by hivemind's rules),
the data dir and identity file, and whether the monitor's address can be bound."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from node.config.layers import ResolvedConfig
from node.config.settings import IDENTITY_FILE_NAME, ConfigError, MonitorConfig


def check_environment(
    resolved: ResolvedConfig, *, swarm: bool = True, files: bool = True, monitor: bool = True
) -> None:
    """What a config can only be checked against on this machine (or with hivemind's rules, which
    cost hivemind's import): the swarm name, the data dir and identity file, the monitor address."""
    config = resolved.config
    if swarm:
        from node.net.records import validate_swarm_name  # imports hivemind

        try:
            validate_swarm_name(config.swarm)
        except ValueError as exc:
            raise ConfigError(f"{resolved.source('swarm')}: {exc}") from None
    if files:
        _check_data_dir(config.data_dir, resolved.source("data_dir"))
        _check_identity(config.identity_path, _identity_source(resolved))
    if monitor:
        _check_monitor_address(config.monitor, resolved.source("monitor.host"), resolved.source("monitor.port"))


def _identity_source(resolved: ResolvedConfig) -> str:
    if resolved.config.identity_file is not None:
        return resolved.source("identity_file")
    return f"identity file <data-dir>/{IDENTITY_FILE_NAME} (data dir from {resolved.source('data_dir')})"


def _check_data_dir(path: Path, source: str) -> None:
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{source}: data dir {path} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{source}: data dir {path} is not writable")
        return
    ancestor = next(parent for parent in path.parents if parent.exists())
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{source}: cannot create data dir {path}: {ancestor} is not a writable directory")


def _check_identity(path: Path, source: str) -> None:
    """An existing identity file must be a key murmur can use; a missing one is created at start."""
    if not path.exists() and not path.is_symlink():
        return
    from node.net.identity import InvalidIdentity, load_identity  # imports hivemind

    try:
        load_identity(path)
    except InvalidIdentity as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _check_monitor_address(monitor: MonitorConfig, host_source: str, port_source: str) -> None:
    """Bind the monitor's address once, so a port in use fails now with exit 2, not after p2pd started.

    SO_REUSEADDR as the monitor's server sets it: a port only in TIME_WAIT after a restart is free.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            monitor.host, monitor.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(f"{host_source}: cannot resolve monitor host {monitor.host!r}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{port_source}: port {monitor.port} on {monitor.host} is already in use; "
                                  "choose another, or 0 for any free port") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"{host_source}: {monitor.host} is not an address of this machine") from None
            if exc.errno == errno.EACCES:
                raise ConfigError(f"{port_source}: port {monitor.port} needs privileges; use one above 1023") from None
            problem = f"cannot listen on {monitor.host}:{monitor.port}: {exc.strerror}"
            raise ConfigError(f"{port_source}: {problem}") from None
