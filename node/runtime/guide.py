"""The guided join: what `murmur join` checks and prints before it trains, one line each under a common
prefix, in a fixed order (the swarm's model and algorithm; whether they fit this machine; the measured link
to the first peers; how peers reach this node), each with what to do when it fails; the status serves them
as `preflight`. This module measures the link, waits for the relays, and words the lines;
node.runtime.serve calls it as the join goes."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from node.algorithms.registry import ALGORITHMS, algorithm_name
from node.runtime.preflight import CapacityChoice, Fit, bytes_text, count_text
from node.swarm.recipe import SwarmSettings

if TYPE_CHECKING:
    from node.net.relays import NodeReachability

PREFIX = "murmur: preflight"
MAX_LINK_PEERS = 3  # bootstrap peers measured: the link to the swarm, not a survey
RELAY_WAIT_S = 30.0  # a node behind NAT waits this long at most for a relay's slot before it says how it is reached
_RELAY_POLL_S = 0.5
RELAY_ADVICE = "a `murmur bootstrap` or a public `murmur node --relay-service`"


class Check(enum.StrEnum):
    """The checks, in the order they are printed."""

    MODEL = "model"
    MEMORY = "memory"
    LINK = "link"
    REACH = "reach"


class Verdict(enum.StrEnum):
    OK = "ok"
    WARN = "warn"  # the node goes on, but something should be fixed
    FAIL = "fail"  # the node does not start


class ReachKind(enum.StrEnum):
    """How peers reach this node (the reach line's `kind`)."""

    DIRECT = "direct"
    RELAYED = "relayed"
    UNREACHABLE = "unreachable"
    UNKNOWN = "unknown"


Figure = float | int | str | None


class GuideLine(msgspec.Struct, frozen=True, kw_only=True):
    """One check's line: what it found (`text`, with the numbers), what to do about it (`advice`, empty
    when nothing), and the numbers themselves (`figures`) for scripts and the monitor."""

    check: Check
    verdict: Verdict
    text: str
    advice: str = ""
    figures: dict[str, Figure] = msgspec.field(default_factory=dict)


def format_line(line: GuideLine) -> str:
    """`murmur: preflight memory ok: ...; what to do: ...` (the check's name padded, so the lines align)."""
    advice = f"; what to do: {line.advice}" if line.advice else ""
    return f"{PREFIX} {line.check.value:<6} {line.verdict.value}: {line.text}{advice}"


def in_order(lines: Sequence[GuideLine]) -> list[GuideLine]:
    """The lines in the fixed order of Check."""
    rank = {check: i for i, check in enumerate(Check)}
    return sorted(lines, key=lambda line: rank[line.check])


def as_json(lines: Sequence[GuideLine]) -> list[dict[str, Any]]:
    built: list[dict[str, Any]] = msgspec.to_builtins(list(in_order(lines)))
    return built


# ---- what the lines say ---------------------------------------------------------------------------


def first_peers(initial_peers: Sequence[str]) -> list[str]:
    """The peer ids of the first MAX_LINK_PEERS bootstrap peers (full multiaddrs), in order."""
    from node.net.hivemind_adapter import is_circuit, peer_of

    ids = [peer_of(m) for m in initial_peers if not is_circuit(m)]
    return list(dict.fromkeys(p for p in ids if p is not None))[:MAX_LINK_PEERS]


async def measure_first_peers(reach: NodeReachability, initial_peers: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Round-trip time and goodput to the first bootstrap peers, all at once (each probe bounded in bytes
    and time: node.net.probe)."""
    async def one(peer: str) -> dict[str, Any]:
        try:
            return await reach.measure(peer)
        except Exception as exc:  # p2pd busy or restarting: the line says so, the join goes on
            return {"latency_ms": None, "goodput_mbit_s": None, "error": str(exc) or type(exc).__name__}

    peers = first_peers(initial_peers)
    measured = await asyncio.gather(*(one(peer) for peer in peers))
    return dict(zip(peers, measured, strict=True))


async def settled_reach(reach: NodeReachability, timeout_s: float = RELAY_WAIT_S) -> dict[str, Any]:
    """The reachability report once a node behind NAT holds a relay's slot, at most `timeout_s` (its watch
    loop checks each relay's circuit a second or two after the connection)."""
    for _ in range(round(timeout_s / _RELAY_POLL_S)):
        if not reach.private or not reach.relays or any(r.held for r in reach.relays):
            break
        await asyncio.sleep(_RELAY_POLL_S)
    return reach.status()


# ---- the lines ---------------------------------------------------------------------------------


def model_line(swarm: str, founder: str, settings: SwarmSettings, parameters: int | None) -> GuideLine:
    """The swarm's model and algorithm, as its founder's config says."""
    topology, codec = settings.topology.name, settings.codec.name
    recipe = settings.training
    if recipe is None:
        return GuideLine(check=Check.MODEL, verdict=Verdict.OK,
                         text=f"swarm '{swarm}' (founder {founder}) gossips a vector of {settings.dim} floats, "
                              f"topology {topology}, codec {codec}",
                         figures={"model": "vector", "algorithm": "gossip", "dim": settings.dim})
    algorithm = algorithm_name(recipe)
    size = f" ({count_text(parameters)} parameters)" if parameters is not None else ""
    inner = f" (inner {recipe.inner_optimizer.algorithm})" if algorithm in ("diloco", "spes") else ""
    return GuideLine(check=Check.MODEL, verdict=Verdict.OK,
                     text=f"swarm '{swarm}' (founder {founder}) trains {recipe.model}{size} with "
                          f"{ALGORITHMS[algorithm].label}{inner}, topology {topology}, codec {codec}, "
                          f"batch {recipe.batch_size} x {recipe.context} tokens",
                     figures={"model": recipe.model, "algorithm": algorithm, "parameters": parameters,
                              "batch_size": recipe.batch_size, "context": recipe.context})


def _capacity_text(fit: Fit) -> str:
    capacity, of = fit.capacity, fit.experts_per_layer
    if capacity is None:
        return ""
    if capacity.choice is CapacityChoice.MEASURED:
        return (f"; SPES capacity: sized to the free GPU memory at start (the estimate allows {fit.largest_fitting} "
                f"of {of} experts per layer; --experts sets it)")
    why = {CapacityChoice.GIVEN: "--experts", CapacityChoice.ALL: "every expert fits",
           CapacityChoice.LARGEST_FITTING: f"the most that fit: all {of} would not; --experts sets it"}[capacity.choice]
    return f"; SPES capacity {capacity.experts} of {of} experts per layer ({why})"


def memory_line(fit: Fit) -> GuideLine:
    """The model fits: what it needs of RAM (and GPU memory), what this machine has, what this node chose."""
    f, machine = fit.footprint, fit.machine
    gpu = (f", ~{bytes_text(f.device_bytes)} of GPU memory of {bytes_text(machine.vram)} free"
           if machine.vram is not None else " (a CPU node)")
    capacity = fit.capacity
    return GuideLine(check=Check.MEMORY, verdict=Verdict.OK,
                     text=f"fits: ~{bytes_text(f.host_bytes)} of RAM ({f.host_per_parameter:.0f} B/param) of "
                          f"{bytes_text(machine.ram)} available{gpu}; batch size {fit.batch_size} (the swarm's, the "
                          f"same on every node){_capacity_text(fit)}",
                     figures={"ram_needed": f.host_bytes, "ram_available": machine.ram,
                              "vram_needed": f.device_bytes if machine.vram is not None else None,
                              "vram_available": machine.vram, "batch_size": fit.batch_size,
                              "spes_experts": capacity.experts if capacity else None,
                              "spes_capacity_choice": capacity.choice.value if capacity else None})


def memory_unknown_line(model: str) -> GuideLine:
    return GuideLine(check=Check.MEMORY, verdict=Verdict.WARN,
                     text=f"the size of {model} is not known before it is built: it is checked as it is built")


def memory_vector_line(dim: int) -> GuideLine:
    return GuideLine(check=Check.MEMORY, verdict=Verdict.OK, text=f"fits: a vector of {dim} floats",
                     figures={"ram_needed": 4 * dim})


def refusal_line(refusal: str) -> GuideLine:
    """The model does not fit: the preflight's refusal names the numbers and what would fit."""
    found, _, would = refusal.partition("; ")
    return GuideLine(check=Check.MEMORY, verdict=Verdict.FAIL, text=f"does not fit: {found}",
                     advice=would or "use a machine with more memory")


def link_line(measured: Mapping[str, Mapping[str, Any]]) -> GuideLine:
    """The link to the first peers (peer id -> node.net.relays.NodeReachability.measure's answer)."""
    if not measured:
        return GuideLine(check=Check.LINK, verdict=Verdict.WARN, text="no peer to measure (no --peers)",
                         advice="give --peers MULTIADDR of a node or bootstrap of the swarm")
    good = {p: m for p, m in measured.items() if m.get("error") is None and m.get("latency_ms") is not None}
    parts = [f"{_short(p)} rtt {m['latency_ms']:.1f} ms, goodput {m['goodput_mbit_s']:.3g} Mbit/s"
             if p in good else f"{_short(p)} no answer ({m.get('error')})" for p, m in measured.items()]
    rtts = [float(m["latency_ms"]) for m in good.values()]
    goodputs = [float(m["goodput_mbit_s"]) for m in good.values() if m.get("goodput_mbit_s") is not None]
    figures: dict[str, Figure] = {"peers": len(measured), "answered": len(good),
                                  "rtt_ms": min(rtts) if rtts else None,
                                  "goodput_mbit_s": max(goodputs) if goodputs else None}
    if not good:
        return GuideLine(check=Check.LINK, verdict=Verdict.WARN, text="; ".join(parts), figures=figures,
                         advice="the bootstrap peers answered the DHT but not a link probe (an older murmur, or a "
                                "busy peer): the link is measured again by `murmur doctor`")
    return GuideLine(check=Check.LINK, verdict=Verdict.OK, text="; ".join(parts), figures=figures)


def bootstrap_failed_line(peers: Sequence[str], why: str) -> GuideLine:
    """No bootstrap peer answered: which addresses, and what to check."""
    return GuideLine(check=Check.LINK, verdict=Verdict.FAIL,
                     text=f"no bootstrap peer answered: {', '.join(peers) or 'none given'} ({why})",
                     advice="check each address (ip, port and /p2p/ id, as the node printed it), that the firewall "
                            "lets this machine reach that TCP port, and that the node runs; or give other --peers",
                     figures={"peers": len(peers), "answered": 0})


def reach_line(report: Mapping[str, Any]) -> GuideLine:
    """How peers reach this node, from node.net.relays.NodeReachability.status()."""
    reach, relays = report.get("reach"), report.get("relays") or []
    held = [r for r in relays if r.get("held")]
    ports = ", ".join(map(str, report.get("ports") or [])) or "its TCP port"
    detail = report.get("detail") or ""
    if reach == "public":
        kind, verdict, text, advice = ReachKind.DIRECT, Verdict.OK, f"reachable directly ({detail})", ""
    elif reach == "private" and held:
        kind, verdict, advice = ReachKind.RELAYED, Verdict.OK, ""
        text = (f"reachable through {len(held)} relay(s) ({', '.join(_short(r['peer_id']) for r in held)}); "
                f"behind NAT ({detail})")
    elif reach == "private":
        kind, verdict = ReachKind.UNREACHABLE, Verdict.WARN
        text = (f"NOT reachable: behind NAT ({detail}) and " +
                (f"no relay holds a slot yet ({', '.join(_short(r['peer_id']) for r in relays)})" if relays
                 else "no relay"))
        advice = (f"forward TCP port {ports} on the router and restart with --announce /ip4/PUBLIC_IP/tcp/PORT "
                  f"--reachability public, or give --relays MULTIADDR ({RELAY_ADVICE})")
    else:
        kind, verdict = ReachKind.UNKNOWN, Verdict.WARN
        text = f"unknown: no peer could check ({detail})"
        advice = ("give --peers of a bootstrap node (bootstraps dial back), or say it outright: --reachability "
                  "public (a public address or forwarded port) or private (behind NAT, through --relays)")
    return GuideLine(check=Check.REACH, verdict=verdict, text=text, advice=advice,
                     figures={"kind": kind.value, "relays_held": len(held)})


def _short(peer_id: str) -> str:
    """A peer id as people read it in a line: its last 8 characters after an ellipsis."""
    return f"...{peer_id[-8:]}" if len(peer_id) > 12 else peer_id


__all__ = [
    "MAX_LINK_PEERS",
    "PREFIX",
    "Check",
    "GuideLine",
    "ReachKind",
    "Verdict",
    "as_json",
    "bootstrap_failed_line",
    "first_peers",
    "format_line",
    "in_order",
    "link_line",
    "measure_first_peers",
    "memory_line",
    "memory_unknown_line",
    "memory_vector_line",
    "model_line",
    "reach_line",
    "refusal_line",
    "settled_reach",
]
