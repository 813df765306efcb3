"""How a node comes to its swarm's config and membership, as its founder or as a joiner.

A founder signs and publishes the config (a new version when its recipe changed); a joiner reads the config
its founder signed, pins that founder, and decides whether it can follow a newer version the founder
publishes. Both learn who they admit (node.net.admission)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from node.config import NodeConfig
from node.runtime.errors import StartupError
from node.runtime.founding import same_recipe, swarm_document
from node.swarm.recipe import (
    AdmissionDoc,
    AdmissionMode,
    RecipeInvalid,
    SwarmSettings,
    check_model_allowed,
    parse_document,
)
from node.train.checkpoint import kept_metas

if TYPE_CHECKING:
    from node.net.admission import Admission
    from node.net.discovery import Discovery
    from node.net.founder import SwarmConfig
    from node.net.identity import Identity

logger = logging.getLogger("murmur.node")

JOIN_CONFIG_TIMEOUT_S = 30.0
FOUNDERS_FILE = "founders.json"  # in the data directory: swarm name -> the founder this node trusts


# ---- the founder -----------------------------------------------------------------------------


def _admission_document(config: NodeConfig) -> AdmissionDoc | None:
    from node.net.admission import SwarmKeyError, admission_document, create_swarm_key, load_swarm_key

    mode = AdmissionMode(config.admission)
    key = None
    if mode is AdmissionMode.KEY:
        path = config.swarm_key_file
        if path is None:
            raise StartupError("--admission key needs --swarm-key-file FILE: the swarm key members are given "
                               "(created there if missing)")
        try:
            if path.exists():
                key = load_swarm_key(path)
            else:
                key = create_swarm_key(path)
                logger.warning("created the swarm key %s: give it to the swarm's members out of band "
                               "(murmur join --swarm-key-file)", path)
        except (SwarmKeyError, OSError) as exc:
            raise StartupError(str(exc)) from None
    return admission_document(mode, config.swarm, key)


async def found_swarm(discovery: Discovery, config: NodeConfig, identity: Identity, checkpoint: Path) -> SwarmConfig:
    """Sign and publish the swarm's config. The document this founder published before (in the DHT, or
    in a checkpoint of its own, current or kept for another config) is published again when the recipe
    is the same, so the swarm keeps its epoch and config hash; otherwise a new document is. Either way
    under a version above every earlier one that differs from it."""
    from node.net.founder import sign_config
    from node.net.records import config_hash

    admission = _admission_document(config)
    discovery.pin_founder(identity.peer_id)  # its DHT node keeps no one else's config of this swarm
    read = await discovery.read_config(identity.peer_id)
    # (version, document) of every config this founder published, as far as it knows
    earlier = [(read.config.version, dict(read.config.config))] if read.config is not None else []
    for meta in kept_metas(checkpoint):
        if meta.get("swarm") == config.swarm and meta.get("founder", identity.peer_id) == identity.peer_id \
                and "swarm_config" in meta:
            earlier.append((int(meta.get("config_version", 0)), json.loads(str(meta["swarm_config"]))))
    try:
        document = next((d for _, d in earlier if same_recipe(d, config, admission)), None) \
            or swarm_document(config, time.time(), admission)
    except RecipeInvalid as exc:
        raise StartupError(str(exc)) from None
    hash_now = config_hash(document)
    latest_version, latest = max(earlier, key=lambda vd: vd[0], default=(0, None))
    # the latest version again when it is this very document (a plain restart), else a new version
    version = latest_version if latest is not None and config_hash(latest) == hash_now else latest_version + 1
    signed = sign_config(identity.signing_key, config.swarm, version, document)
    try:
        await discovery.publish_config(signed)
    except Exception as exc:
        raise StartupError(f"could not publish the swarm config: {exc}") from None
    logger.info("published version %d of swarm %r's config (hash %s)", version, config.swarm, hash_now[:12])
    return signed


# ---- a joiner --------------------------------------------------------------------------------


def _founders_path(data_dir: Path) -> Path:
    return data_dir / FOUNDERS_FILE


def pinned_founder(data_dir: Path, swarm: str) -> str | None:
    """The founder of `swarm` this data directory trusted when it last joined it."""
    try:
        pins = json.loads(_founders_path(data_dir).read_text())
    except (OSError, ValueError):
        return None
    founder = pins.get(swarm) if isinstance(pins, dict) else None
    return founder if isinstance(founder, str) else None


def pin_founder(data_dir: Path, swarm: str, founder: str) -> None:
    """Remember `founder` as `swarm`'s (atomically; a failure is logged, the node goes on)."""
    path = _founders_path(data_dir)
    try:
        pins = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(pins, dict):
            pins = {}
    except (OSError, ValueError):
        pins = {}
    if pins.get(swarm) == founder:
        return
    pins[swarm] = founder
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not pin the founder of swarm %r in %s: %s", swarm, path, exc.strerror)
    finally:
        tmp.unlink(missing_ok=True)


def founder_to_trust(config: NodeConfig) -> str | None:
    """The founder a joiner trusts: its --founder/--invite, else the one pinned by an earlier join; None
    only with --trust-first-founder. StartupError when it knows none and may not guess."""
    pinned = pinned_founder(config.data_dir, config.swarm)
    if config.founder is not None:
        if pinned is not None and pinned != config.founder:
            logger.warning("swarm %r: trusting founder %s as given, instead of %s pinned by an earlier join",
                           config.swarm, config.founder, pinned)
        return config.founder
    if pinned is not None:
        logger.info("swarm %r: trusting founder %s, pinned by an earlier join (%s)", config.swarm, pinned,
                    _founders_path(config.data_dir))
        return pinned
    if config.trust_first_founder:
        return None
    raise StartupError(f"no founder to trust for swarm {config.swarm!r}: give the invite the founder's node printed "
                       "(--invite NAME@FOUNDER_PEER_ID) or --founder PEER_ID; --trust-first-founder takes whichever "
                       "founder's config is found, which anyone on the network can be")


async def join_swarm(discovery: Discovery, config: NodeConfig) -> SwarmConfig:
    """The config of the swarm's founder, read from the DHT (retried for JOIN_CONFIG_TIMEOUT_S: a failed
    read and an empty one are told apart), and the founder pinned in the data directory."""
    founder = founder_to_trust(config)
    if founder is not None:
        discovery.pin_founder(founder)
    peers = ", ".join(config.network.initial_peers)
    deadline = time.monotonic() + JOIN_CONFIG_TIMEOUT_S
    problem, said = "", ""
    while True:
        read = await discovery.read_config(founder)
        if read.config is not None:
            break
        if read.failed is not None:
            problem = f"reading the swarm config from the DHT failed ({read.failed})"
        elif founder is None and len(read.founders) > 1:
            raise StartupError(f"swarm {config.swarm!r} has configs signed by {len(read.founders)} founders "
                               f"({', '.join(sorted(read.founders))}): give the founder's --invite or --founder")
        else:
            ignored = sum(read.refused.values())
            problem = (f"no config for swarm {config.swarm!r} signed by "
                       f"{'its founder ' + founder if founder else 'any founder'} found through {peers}"
                       + (f" ({ignored} config(s) signed otherwise or invalid were ignored)" if ignored else ""))
        if problem != said:
            logger.warning("%s; retrying", problem)
            said = problem
        if time.monotonic() > deadline:
            raise StartupError(f"{problem} within {JOIN_CONFIG_TIMEOUT_S:g} s: is the invite right, "
                               "and does a node of the swarm run?")
        await asyncio.sleep(0.5)
    found = read.config
    if founder is None:
        logger.warning("swarm %r: trusting founder %s, whose signed config was the one found (--trust-first-founder); "
                       "pinned in %s", config.swarm, found.founder, _founders_path(config.data_dir))
        discovery.pin_founder(found.founder)
    pin_founder(config.data_dir, config.swarm, found.founder)
    return found


# ---- membership ------------------------------------------------------------------------------


def node_admission(config: NodeConfig, swarm: SwarmConfig, identity: Identity) -> Admission:
    """Who this node admits, and its own proof, as the swarm's config says; StartupError when this node
    lacks what the swarm asks of its members (the swarm key, a certificate)."""
    from node.net.admission import Admission, SwarmKeyError, load_swarm_key, read_certificate
    from node.net.founder import NotAdmitted

    document = parse_document(swarm.config)
    mode = document.admission_mode
    if mode is AdmissionMode.OPEN:
        return Admission.open(config.swarm)
    if mode is AdmissionMode.KEY:
        if config.swarm_key_file is None:
            raise StartupError(f"swarm {config.swarm!r} admits holders of its swarm key only: give --swarm-key-file "
                               "FILE (the founder hands the key out)")
        try:
            return Admission.with_key(config.swarm, load_swarm_key(config.swarm_key_file),
                                      document.admission.key_check if document.admission else None)
        except SwarmKeyError as exc:
            raise StartupError(str(exc)) from None
    certificate = None
    if identity.peer_id != swarm.founder:
        if config.certificate_file is None:
            raise StartupError(f"swarm {config.swarm!r} admits peers with its founder's certificate only: ask the "
                               f"founder to run `murmur invite {identity.peer_id}` and give the file to --certificate")
        try:
            certificate = read_certificate(config.certificate_file)
        except ValueError as exc:
            raise StartupError(f"--certificate {config.certificate_file}: {exc}") from None
    try:
        return Admission.with_allowlist(config.swarm, swarm.founder, swarm.founder_key, identity.peer_id, certificate)
    except NotAdmitted as exc:
        raise StartupError(f"--certificate {config.certificate_file}: {exc}") from None


def why_not_follow(newer: SwarmConfig, config: NodeConfig, identity: Identity) -> str | None:
    """Why this node cannot run the founder's newer config (None: it can): a recipe it refuses, a model
    it may not build, or a membership it lacks."""
    try:
        settings = SwarmSettings.from_doc(newer.config)
        if settings.training is not None:
            check_model_allowed(settings.training.model, config.training.model)
        node_admission(config, newer, identity)
    except (RecipeInvalid, StartupError) as exc:
        return str(exc)
    return None
