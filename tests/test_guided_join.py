"""The guided join (node.runtime.guide): `murmur join` prints the swarm's model and algorithm, whether they
fit this machine (and the SPES capacity it chose), the measured link to the first peers, and how peers
reach it, one line each in a fixed order, each failure with what to do; the status serves the same lines."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from gossip.footprint import MemoryInputs, footprint
from node.runtime.guide import (
    PREFIX,
    Check,
    GuideLine,
    Verdict,
    as_json,
    bootstrap_failed_line,
    first_peers,
    format_line,
    link_line,
    memory_line,
    reach_line,
    refusal_line,
)
from node.runtime.preflight import Capacity, CapacityChoice, Fit, Machine, choose_capacity

ROOT = Path(__file__).resolve().parents[1]
PEER = "12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"
MIB = 2**20


def guide_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(PREFIX + " ")]


# ---- unit: the lines -------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_line_has_the_prefix_the_padded_check_the_verdict_and_what_to_do():
    ok = GuideLine(check=Check.LINK, verdict=Verdict.OK, text="...x rtt 1.0 ms")
    assert format_line(ok) == "murmur: preflight link   ok: ...x rtt 1.0 ms"
    failed = GuideLine(check=Check.MEMORY, verdict=Verdict.FAIL, text="does not fit", advice="use dsgd")
    assert format_line(failed) == "murmur: preflight memory fail: does not fit; what to do: use dsgd"


@pytest.mark.unit
def test_the_status_carries_the_lines_in_the_fixed_order():
    lines = [GuideLine(check=c, verdict=Verdict.OK, text=c.value) for c in (Check.REACH, Check.LINK, Check.MODEL,
                                                                           Check.MEMORY)]
    shown = as_json(lines)
    assert [line["check"] for line in shown] == ["model", "memory", "link", "reach"]
    assert set(shown[0]) == {"check", "verdict", "text", "advice", "figures"}


@pytest.mark.unit
def test_the_link_line_names_each_peer_with_its_rtt_and_goodput():
    line = link_line({PEER: {"latency_ms": 12.34, "goodput_mbit_s": 87.6, "error": None},
                      "QmOther1234567890": {"latency_ms": None, "goodput_mbit_s": None, "error": "timeout"}})
    assert line.verdict is Verdict.OK
    assert "...Lr2NASuq rtt 12.3 ms, goodput 87.6 Mbit/s" in line.text and "no answer (timeout)" in line.text
    assert line.figures == {"peers": 2, "answered": 1, "rtt_ms": 12.34, "goodput_mbit_s": 87.6}
    silent = link_line({PEER: {"latency_ms": None, "goodput_mbit_s": None, "error": "stream reset"}})
    assert silent.verdict is Verdict.WARN and "murmur doctor" in silent.advice
    assert link_line({}).verdict is Verdict.WARN and "--peers" in link_line({}).advice


@pytest.mark.unit
def test_an_unreachable_bootstrap_names_the_address_and_what_to_check():
    address = f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}"
    line = bootstrap_failed_line([address], "bootstrap failed")
    assert line.verdict is Verdict.FAIL and address in line.text
    assert "firewall" in line.advice and "--peers" in line.advice
    assert first_peers([address, address, "/ip4/1.2.3.4/tcp/1"]) == [PEER]  # deduplicated, ids only


@pytest.mark.unit
def test_the_reach_line_tells_direct_relayed_and_unreachable_apart_and_says_what_to_do():
    direct = reach_line({"reach": "public", "detail": "dialled back by 1 of 1", "relays": [], "ports": [4001]})
    assert (direct.verdict, direct.figures["kind"]) == (Verdict.OK, "direct") and "dialled back" in direct.text
    relay = {"peer_id": PEER, "held": True}
    relayed = reach_line({"reach": "private", "detail": "", "relays": [relay], "ports": [4001]})
    assert (relayed.verdict, relayed.figures["kind"], relayed.figures["relays_held"]) == (Verdict.OK, "relayed", 1)
    alone = reach_line({"reach": "private", "detail": "1 peer(s) could not dial back", "relays": [], "ports": [4001]})
    assert (alone.verdict, alone.figures["kind"]) == (Verdict.WARN, "unreachable")
    assert "--announce" in alone.advice and "4001" in alone.advice and "--relays" in alone.advice
    unknown = reach_line({"reach": "unknown", "detail": "no peer to ask", "relays": [], "ports": []})
    assert unknown.figures["kind"] == "unknown" and "--reachability" in unknown.advice


def _fit(capacity: Capacity | None, machine: Machine, experts_per_layer: int = 8, largest: int = 0) -> Fit:
    inputs = MemoryInputs(2_000_000, "dadam", "cuda" if machine.vram else "cpu")
    return Fit(machine, inputs, footprint(inputs), 16, 256, experts_per_layer if capacity else 0, capacity, largest)


@pytest.mark.unit
def test_the_memory_line_has_the_numbers_and_the_choice():
    line = memory_line(_fit(None, Machine(4 * 2**30, None)))
    need = footprint(MemoryInputs(2_000_000, "dadam", "cpu")).host_bytes
    assert line.text.startswith(f"fits: ~{need / MIB:.1f} MiB of RAM (") and "of 4.0 GiB available (a CPU node)" in line.text
    assert "batch size 16 (the swarm's" in line.text and "SPES" not in line.text
    assert line.figures["ram_needed"] == need and line.figures["ram_available"] == 4 * 2**30
    chose = memory_line(_fit(Capacity(3, CapacityChoice.LARGEST_FITTING), Machine(2**30, None), largest=3))
    assert "SPES capacity 3 of 8 experts per layer (the most that fit: all 8 would not" in chose.text
    assert chose.figures["spes_experts"] == 3 and chose.figures["spes_capacity_choice"] == "largest_fitting"
    gpu = memory_line(_fit(Capacity(None, CapacityChoice.MEASURED), Machine(2**34, 2**33), largest=5))
    assert "of GPU memory of 8.0 GiB free" in gpu.text and "allows 5 of 8 experts" in gpu.text


@pytest.mark.unit
def test_a_refusal_line_keeps_the_numbers_and_puts_the_suggestions_in_what_to_do():
    line = refusal_line("the swarm's model (2.4M parameters) with dadam needs ~121 MiB of RAM here, this machine "
                        "has 64.0 MiB available: ...; dsgd would need ~70 MiB of RAM")
    assert line.verdict is Verdict.FAIL and "2.4M parameters" in line.text and "64.0 MiB available" in line.text
    assert line.advice == "dsgd would need ~70 MiB of RAM"


@pytest.mark.unit
def test_murmur_status_repeats_the_joins_checks():
    from node.cli.status import format_status

    status = {"peer_id": "QmMe", "swarm": "s", "maddrs": [], "round": 0, "step": 0, "peers": [], "bytes_sent": 0,
              "bytes_received": 0, "errors": {},
              "preflight": as_json([GuideLine(check=Check.LINK, verdict=Verdict.OK, text="...x rtt 2.0 ms")])}
    assert "joined   link   ok: ...x rtt 2.0 ms" in format_status(status).splitlines()
    assert not [line for line in format_status({**status, "preflight": None}).splitlines() if line.startswith("joined")]


class _Writer:
    def __init__(self) -> None:
        self.data = b""
        self.transport = SimpleNamespace(abort=lambda: None)

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        return None


@pytest.mark.unit
def test_the_link_probe_answers_one_asker_a_burst_then_refuses_it_while_others_are_answered():
    from node.net.probe import PROBE_BURST, ProbeServer

    def asker(name: str) -> SimpleNamespace:
        return SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: name))

    async def probe(server: ProbeServer, who: str) -> bool:
        reader = asyncio.StreamReader()
        reader.feed_data((0).to_bytes(8, "big"))  # an empty push: the round-trip probe
        reader.feed_eof()
        writer = _Writer()
        await server._answer(asker(who), reader, writer)
        return writer.data == (0).to_bytes(8, "big")

    async def run() -> tuple[list[bool], bool, int]:
        server = ProbeServer(None)  # only its answers are exercised: no daemon
        stranger = [await probe(server, "QmStranger") for _ in range(PROBE_BURST + 5)]
        return stranger, await probe(server, "QmJoiner"), server.refused

    stranger, joiner, refused = asyncio.run(run())
    assert stranger == [True] * PROBE_BURST + [False] * 5 and refused == 5
    assert joiner  # another asker still gets its answer


# ---- unit: the capacity a SPES node chooses ---------------------------------------------------------


@pytest.mark.unit
def test_the_capacity_is_the_users_else_every_expert_else_the_most_that_fit():
    assert choose_capacity(8, 3, "cpu", 8) == Capacity(3, CapacityChoice.GIVEN)
    assert choose_capacity(8, 99, "cpu", 2) == Capacity(8, CapacityChoice.GIVEN)  # refused by the preflight
    assert choose_capacity(8, None, "cpu", 8) == Capacity(8, CapacityChoice.ALL)
    assert choose_capacity(8, None, "cpu", 5) == Capacity(5, CapacityChoice.LARGEST_FITTING)
    assert choose_capacity(8, None, "cpu", 0) == Capacity(8, CapacityChoice.ALL)  # nothing fits: refused
    assert choose_capacity(8, None, "cuda", 2) == Capacity(None, CapacityChoice.MEASURED)


def _moe_settings(*flags: str):
    from node.cli.main import parse_node_config
    from node.runtime.founding import swarm_document
    from node.swarm.recipe import SwarmSettings

    settings = SwarmSettings.from_doc(swarm_document(parse_node_config(["node", "--model", "moe", *flags], {}), 1.0))
    assert settings.training is not None
    return settings


@pytest.mark.unit
def test_a_spes_node_short_of_ram_trains_the_most_experts_that_fit_or_is_told_which(monkeypatch):
    from node.runtime.preflight import MOCK_ENV, DoesNotFit, check_fit

    settings = _moe_settings("--spes")
    monkeypatch.setenv(MOCK_ENV, "ram=100MiB,vram=0")  # every expert needs ~159 MiB, one ~55 MiB
    fit = check_fit(settings.training, settings, "cpu")
    assert fit is not None and fit.capacity is not None and fit.capacity.choice is CapacityChoice.LARGEST_FITTING
    assert 1 <= fit.capacity.experts == fit.largest_fitting < 8 and fit.footprint.host_bytes <= 100 * MIB
    with pytest.raises(DoesNotFit, match=rf"--experts {fit.largest_fitting} \(of 8 per layer\) fits here"):
        check_fit(settings.training, settings, "cpu", wanted_experts=8)
    monkeypatch.setenv(MOCK_ENV, "ram=1GiB,vram=0")
    every = check_fit(settings.training, settings, "cpu")
    assert every is not None and every.capacity == Capacity(8, CapacityChoice.ALL)
    assert every.as_json()["spes_capacity"] == {"experts": 8, "of": 8, "choice": "all", "largest_fitting": 8}


# ---- multiprocess: a join that reaches no one ---------------------------------------------------------


@pytest.mark.multiprocess
def test_a_join_whose_bootstrap_does_not_answer_names_the_address_and_what_to_check(tmp_path):
    import socket

    from support.swarm_harness import MURMUR, clean_env

    with socket.socket() as probe:  # a loopback port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER}"
    argv = [str(MURMUR), "join", "--peers", address, "--invite", f"s@{PEER}", "--data-dir", str(tmp_path / "d"),
            "--monitor-port", "0", "--threads", "1"]
    proc = subprocess.run(argv, env={**clean_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=180, check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    printed = guide_lines(proc.stdout)
    assert len(printed) == 1 and printed[0].startswith(f"{PREFIX} link   fail: no bootstrap peer answered: {address}")
    assert "firewall" in printed[0] and "--peers" in printed[0], printed


# ---- multiprocess: joining a loopback swarm -----------------------------------------------------------


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> Iterator[object]:
    """A 2-node loopback swarm training the embedded MoE, shared by this module's joins."""
    from support.swarm_harness import Swarm

    with Swarm(tmp_path_factory.mktemp("guided"), model="moe", threads=1, steps=0) as s:
        s.start(2)
        yield s


@pytest.mark.multiprocess
def test_a_joiner_prints_and_serves_the_four_checks_with_measured_figures(swarm):
    founder = swarm.nodes[0]
    joiner = swarm.spawn("guided", seed=7, join=founder)
    swarm.wait_ready([joiner])
    printed = guide_lines(joiner.stdout())
    assert [line.split()[2] for line in printed] == ["model", "memory", "link", "reach"], joiner.stdout()
    model, memory, link, reach = printed
    assert "trains moe (2.4M parameters) with DAdam" in model and " ok: " in model
    assert " ok: fits: ~" in memory and "available (a CPU node)" in memory and "batch size 16" in memory
    assert " ok: " in link and "rtt " in link and "Mbit/s" in link
    shown = joiner.status()["preflight"]
    assert [format_line(GuideLine(check=Check(s["check"]), verdict=Verdict(s["verdict"]), text=s["text"],
                                  advice=s["advice"])) for s in shown] == printed
    figures = {s["check"]: s["figures"] for s in shown}
    assert figures["link"]["rtt_ms"] > 0 and figures["link"]["goodput_mbit_s"] > 0 and figures["link"]["answered"] == 1
    assert figures["memory"]["ram_needed"] > 0 and figures["memory"]["ram_available"] > figures["memory"]["ram_needed"]
    assert figures["reach"]["kind"] in ("direct", "relayed"), reach  # loopback peers dial it back
    assert founder.status()["preflight"] is None  # a founder joins no one


@pytest.mark.multiprocess
def test_a_joiner_whose_machine_cannot_hold_the_model_is_refused_with_the_numbers_and_a_suggestion(swarm, tmp_path):
    from support.swarm_harness import MURMUR, clean_env

    founder = swarm.nodes[0]
    env = {**clean_env(), "MURMUR_MOCK_MACHINE_MEMORY": "ram=64MiB,vram=0", "PYTHONPATH": str(ROOT)}
    argv = [str(MURMUR), "join", "--peers", founder.maddrs[0], "--invite", founder.invite, "--data-dir",
            str(tmp_path / "small"), "--monitor-port", "0", "--threads", "1", "--heartbeat", "1"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    printed = guide_lines(proc.stdout)
    assert [line.split()[2] for line in printed] == ["model", "memory", "link", "reach"], proc.stdout
    model, memory = printed[0], printed[1]
    assert " ok: " in model and "trains moe (2.4M parameters) with DAdam" in model
    assert memory.startswith(f"{PREFIX} memory fail: does not fit: the swarm's model (2.4M parameters) with dadam "
                             "needs ~"), memory
    assert "64.0 MiB available" in memory and "; what to do: " in memory and "would need ~" in memory
    errors = [line for line in proc.stderr.splitlines() if line.startswith("murmur: error:")]
    assert len(errors) == 1 and "64.0 MiB available" in errors[0]
    assert "ready;" not in proc.stdout  # it never entered the swarm


