"""`murmur topology` and `murmur sim` as a user runs them: the real console script, JSON shapes, exit codes."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

MURMUR = [str(Path(sys.executable).with_name("murmur"))]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(MURMUR + list(args), capture_output=True, text=True, timeout=120, env={**os.environ})


def test_topology_json_shape_and_values():
    out = run("topology", "static-exp", "--peers", "8", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert {"name", "n", "degree", "rho", "spectral_gap"} <= info.keys()
    assert info["name"] == "static-exp" and info["n"] == 8 and info["degree"] == 3
    assert info["rho"] == pytest.approx(0.5) and info["spectral_gap"] == pytest.approx(0.5)


def test_topology_text_names_the_figures():
    out = run("topology", "ring", "--peers", "8")
    assert out.returncode == 0, out.stderr
    assert "rho           0.804738" in out.stdout and "degree        2" in out.stdout


def test_sim_json_reports_contracting_rounds():
    out = run("sim", "--peers", "64", "--topology", "one-peer-exp", "--rounds", "6", "--json")
    assert out.returncode == 0, out.stderr
    rounds = json.loads(out.stdout)["rounds"]
    assert [r["round"] for r in rounds] == list(range(7))
    assert all({"round", "consensus_error", "bytes"} <= r.keys() for r in rounds)
    # one-peer exponential over 64 = 2^6 peers averages exactly after 6 rounds
    assert rounds[-1]["consensus_error"] < 1e-6 * rounds[0]["consensus_error"]
    assert rounds[0]["bytes"] == 0 and all(r["bytes"] > 64 * 1000 * 4 for r in rounds[1:])


def test_sim_table_is_printed_per_round():
    out = run("sim", "--peers", "16", "--topology", "ring", "--rounds", "3")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines()[2:] if line.strip()]
    assert [int(line.split()[0]) for line in lines] == [0, 1, 2, 3]
    errors = [float(line.split()[2]) for line in lines]
    assert errors == sorted(errors, reverse=True) and not any(math.isnan(e) for e in errors)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["topology", "mesh", "--peers", "8"], "invalid choice: 'mesh'"),
        (["topology", "ring", "--peers", "0"], "--peers"),
        (["topology", "ring", "--peers", "eight"], "not a valid int"),
        (["topology", "torus", "--peers", "12", "--rows", "5"], "does not divide"),
        (["topology", "custom", "--peers", "4"], "needs --edges"),
        (["topology", "custom", "--peers", "4", "--edges", "0-1,2-3"], "does not connect"),
        (["topology", "static-exp", "--peers", "8", "--weights", "metropolis-hastings"], "undirected"),
        (["sim", "--peers", "8", "--drop", "1.5"], "--drop"),
        (["sim", "--peers", "8", "--mixing", "clipped"], "tau"),
        (["sim", "--peers", "8", "--frobnicate"], "unrecognized arguments"),
        (["config"], "invalid choice: 'config' (choose from 'topology', 'sim', 'node', 'join'"),
    ],
)
def test_bad_values_exit_2_with_one_line(args, needle):
    out = run(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert needle in out.stderr
