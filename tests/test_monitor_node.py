"""The monitor of real `murmur node` processes (vector mode, loopback): every JSON endpoint matches its
documented JSON Schema, `/metrics` parses with prometheus_client and carries the documented names and
the node's own figures, bad requests get 404/400 and leave the node serving, and `murmur status`
reads the same API."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.monitor.metrics import METRIC_NAMES
from node.monitor.schemas import JSON_ENDPOINTS, openapi_document, schema
from support.swarm_harness import Swarm, initial_vector, wait_for

pytestmark = pytest.mark.multiprocess

MURMUR = str(Path(sys.executable).with_name("murmur"))
KNOWN_KEYWORDS = {"$schema", "title", "description", "type", "properties", "required", "additionalProperties",
                  "items", "enum", "minimum", "maximum", "exclusiveMinimum"}
JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_errors(value: object, sch: dict, where: str = "$") -> list[str]:
    """The subset of JSON Schema 2020-12 our schemas use (jsonschema is not a dependency); a keyword
    outside that subset is an error, so a schema cannot silently check less than it says."""
    unknown = set(sch) - KNOWN_KEYWORDS
    if unknown:
        return [f"{where}: schema uses unsupported keywords {sorted(unknown)}"]
    errors: list[str] = []
    if "type" in sch:
        kinds = sch["type"] if isinstance(sch["type"], list) else [sch["type"]]
        if not any(_is(value, kind) for kind in kinds):
            return [f"{where}: {value!r:.60} is not of type {kinds}"]
    if "enum" in sch and value not in sch["enum"]:
        errors.append(f"{where}: {value!r} not in {sch['enum']}")
    if _is(value, "number"):
        if "minimum" in sch and value < sch["minimum"]:
            errors.append(f"{where}: {value} < minimum {sch['minimum']}")
        if "maximum" in sch and value > sch["maximum"]:
            errors.append(f"{where}: {value} > maximum {sch['maximum']}")
        if "exclusiveMinimum" in sch and value <= sch["exclusiveMinimum"]:
            errors.append(f"{where}: {value} <= exclusiveMinimum {sch['exclusiveMinimum']}")
    if isinstance(value, dict):
        errors += [f"{where}: missing {key!r}" for key in sch.get("required", []) if key not in value]
        props = sch.get("properties", {})
        extra = sch.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors += schema_errors(item, props[key], f"{where}.{key}")
            elif extra is False:
                errors.append(f"{where}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, f"{where}.{key}")
    if isinstance(value, list) and "items" in sch:
        for i, item in enumerate(value):
            errors += schema_errors(item, sch["items"], f"{where}[{i}]")
    return errors


def _is(value: object, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, JSON_TYPES[kind])


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def get_json(url: str) -> object:
    status, _, body = get(url)
    assert status == 200, (url, status, body)
    return json.loads(body)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two gossiping nodes in vector mode, past their first rounds."""
    with Swarm(tmp_path_factory.mktemp("monitor"), heartbeat=1, min_peers=2) as swarm:
        nodes = swarm.start(2)
        swarm.wait_views(nodes, nodes)
        swarm.wait_rounds(nodes, 3)
        yield swarm, nodes


def test_the_validator_catches_what_it_is_for():
    # the checks below are only as good as this validator: it must fail shapes that are wrong
    status = schema("status")
    assert schema_errors({"peer_id": "x"}, status)  # required keys missing
    peers = schema("peers")
    good = {"self": "a", "now": 1.0, "record_ttl_s": 3.0, "peers": []}
    assert schema_errors(good, peers) == []
    assert schema_errors({**good, "surprise": 1}, peers)  # additionalProperties false
    assert schema_errors({**good, "now": "soon"}, peers)  # wrong type
    assert schema_errors({**good, "record_ttl_s": -1}, peers)  # below minimum
    assert schema_errors({"entries": [{"id": 1, "t": 0, "level": "fatal", "kind": "log", "message": ""}]},
                         schema("log"))  # not in enum
    assert schema_errors(True, {"type": "integer"})  # a bool is not an integer in JSON
    assert schema_errors(1, {"type": "integer", "pattern": "x"})  # an unsupported keyword is refused


def test_json_endpoints_match_their_documented_schemas(pair):
    _, nodes = pair
    url = nodes[0].monitor_url
    for path, (name, _, _) in JSON_ENDPOINTS.items():
        body = get_json(url + path)
        assert schema_errors(body, schema(name)) == [], path
    # and with the data a running swarm has by now, not only empty lists
    # a record that lapsed for a heartbeat on a loaded machine comes back: wait for both, then check them
    everyone = sorted(n.peer_id for n in nodes)
    def both_peers() -> list | None:
        listed = get_json(url + "/api/peers")["peers"]
        return listed if sorted(p["peer_id"] for p in listed) == everyone else None

    peers = wait_for(both_peers, 30, "both peers on /api/peers")
    assert [p["self"] for p in peers].count(True) == 1
    # the graph is the one the monitor's last tick cached: a lapse then leaves one node, so it is waited on
    topology = wait_for(lambda: (t := get_json(url + "/api/topology"))["nodes"] and
                        {n["peer_id"] for n in t["nodes"]} == set(everyone) and t, 30, "both peers in the topology")
    assert topology["topology"] == "one-peer-exp" and topology["rho"] == 0.0  # n = 2 averages in one round
    assert topology["edges"] and all(e["weight"] == 0.5 for e in topology["edges"])
    def sampled_traffic() -> dict | None:  # samples come at the history's own pace, not the rounds'
        history = get_json(url + "/api/history")
        last = history["samples"][-1] if history["samples"] else {}
        return history if last.get("bytes_sent", 0) > 0 and last.get("peers_alive") == 2 else None

    history = wait_for(sampled_traffic, 30, "a history sample with the rounds' bytes and both peers")
    assert len(history["samples"]) >= 2
    assert any(s["consensus_distance"] is not None for s in history["samples"])
    log = get_json(url + "/api/log")
    assert any(e["kind"] == "gossip_started" for e in log["entries"])
    doc = get_json(url + "/api/openapi.json")
    assert doc == json.loads(json.dumps(openapi_document()))


def test_status_keeps_its_keys_and_adds_the_monitor_figures(pair):
    _, nodes = pair
    status = nodes[0].status()
    for key in ("peer_id", "swarm", "maddrs", "peers", "step", "round", "bytes_sent", "bytes_received", "errors",
                "rounds_run", "skipped", "uptime_s", "loss", "tokens_per_s", "experts", "version"):
        assert key in status, key
    assert status["peer_id"] == nodes[0].peer_id
    assert status["loss"] is None and status["tokens_per_s"] is None  # vector mode trains nothing
    # the two nodes start a gap apart; pairwise averaging (rho = 0) closes it in one round, after which
    # a mixing round moves the vector no more, so the estimate falls to (float32 rounding of) zero
    gap = float(np.linalg.norm(initial_vector(nodes[0].seed, nodes[0].dim) - initial_vector(nodes[1].seed, nodes[1].dim)))

    def settled() -> bool:
        distance = nodes[0].status()["consensus_distance"]
        return distance is not None and 0 <= distance < 1e-3 * gap

    wait_for(settled, timeout_s=60, what="the consensus-distance estimate to fall to zero")


def test_metrics_parse_and_carry_the_documented_names_and_the_nodes_figures(pair):
    _, nodes = pair
    url = nodes[0].monitor_url
    def scraped() -> tuple[dict, dict] | None:  # once both records are in view (one may lapse a heartbeat)
        status, content_type, body = get(url + "/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        samples = {s.name: s for f in families.values() for s in f.samples}
        return (families, samples) if samples["murmur_peers_alive"].value == 2 else None

    families, samples = wait_for(scraped, 30, "a scrape with both peers alive")
    for name in METRIC_NAMES:
        # the parser strips `_total` and `_info` from family names; samples keep them
        assert name in samples or name.removesuffix("_total") in families or name.removesuffix("_info") in families, name
    info = samples["murmur_node_info"]
    assert info.labels["peer_id"] == nodes[0].peer_id and info.labels["swarm"] == "murmur"
    after = nodes[0].status()
    assert 0 < samples["murmur_bytes_sent_total"].value <= after["bytes_sent"]
    assert samples["murmur_peers_alive"].value == 2
    assert samples["murmur_topology_rho"].value == 0.0
    assert "murmur_loss" not in samples  # unknown in vector mode: absent, not NaN


def test_unknown_paths_get_404_bad_queries_400_and_the_node_serves_on(pair):
    _, nodes = pair
    url = nodes[0].monitor_url
    for path in ("/nope", "/api/nope", "/api/status/extra", "/static/../daemon.py", "/%2e%2e/etc/passwd"):
        status, content_type, body = get(url + path)
        assert status == 404, path
        if path.startswith("/api"):
            assert content_type.startswith("application/json") and json.loads(body)["status"] == 404
    bad = ["/api/history?limit=abc", "/api/history?limit=0", "/api/history?since=nan", "/api/history?since=x",
           "/api/history?limit=1&limit=2", "/api/status?verbose=1", "/api/log?after=-1", "/metrics?x=1",
           "/api/events?x=1", "/?q=1"]
    for path in bad:
        status, _, body = get(url + path)
        assert status == 400, path
        answer = json.loads(body)
        assert answer["status"] == 400 and answer["error"], path
    # a POST is refused too, and a malformed request line does not bring anything down
    request = urllib.request.Request(url + "/api/status", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405
    # bytes that are not HTTP at all get aiohttp's own 400, and the connection is closed
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"\x00\xffGARBAGE / HTTP/9.9\r\n\r\n")
        assert raw.recv(1024).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    assert len(get_json(url + "/api/history?limit=1")["samples"]) == 1
    families = {f.name: f for f in text_string_to_metric_families(get(url + "/metrics")[2].decode())}
    assert families["murmur_monitor_bad_requests"].samples[0].value >= len(bad)
    assert nodes[0].alive() and nodes[0].status()["peer_id"] == nodes[0].peer_id


def test_murmur_status_reads_the_same_api(pair):
    _, nodes = pair
    done = subprocess.run([MURMUR, "status", "--url", nodes[1].monitor_url, "--json"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["peer_id"] == nodes[1].peer_id
    text = subprocess.run([MURMUR, "status", "--url", nodes[1].monitor_url], capture_output=True, text=True,
                          timeout=60)
    assert text.returncode == 0, text.stderr
    assert nodes[1].peer_id in text.stdout and "uptime" in text.stdout and "loss" in text.stdout


def test_the_page_and_its_files_are_served_from_the_package(pair):
    _, nodes = pair
    url = nodes[0].monitor_url
    status, content_type, body = get(url + "/")
    assert status == 200 and content_type.startswith("text/html")
    page = body.decode()
    assert '<script src="/monitor.js"' in page and "http" not in page.replace('"http://www.w3.org', "")
    for path in ("/monitor.js", "/monitor.css"):
        status, _, body = get(url + path)
        assert status == 200 and body
        assert b"https://" not in body  # nothing from a CDN: the page works offline

    def the_history_grows() -> bool:
        before = get_json(url + "/api/history")["samples"][-1]["t"]
        return wait_for(lambda: get_json(url + "/api/history")["samples"][-1]["t"] > before, 5, "a new sample")

    assert the_history_grows()


def test_a_node_that_trains_no_model_refuses_the_swarm_average_in_one_line(pair):
    _, nodes = pair  # vector mode: gossip only, no model and no validation split
    token = (nodes[0].data_dir / "monitor.token").read_text().strip()
    request = urllib.request.Request(nodes[0].monitor_url + "/api/eval/average", data=b"", method="POST",
                                     headers={"Authorization": f"Bearer {token}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 422
    assert "trains no model" in json.loads(refused.value.read())["error"]
    done = subprocess.run([MURMUR, "eval", "--url", nodes[0].monitor_url, "--data-dir", str(nodes[0].data_dir)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "trains no model" in done.stderr


def request(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> int:
    data = b"" if method == "POST" else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers or {}),
                                    timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_monitor_refuses_a_foreign_host_and_a_post_without_the_token(pair):
    """DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1 sends its own name as
    Host; every endpoint refuses it, GET included. A POST needs this run's token, which the node wrote
    to its data directory for its user alone."""
    _, nodes = pair
    node = nodes[0]
    url, port = node.monitor_url, node.monitor_url.rsplit(":", 1)[1]
    evil = {"Host": f"evil.example:{port}"}
    for path in ("/", "/monitor.js", "/api/status", "/api/peers", "/api/topology", "/api/events", "/metrics"):
        assert request(url + path, headers=evil) == 403, path
    assert request(url + "/api/eval/average", "POST", headers=evil) == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert request(url + "/api/status", headers={"Host": host}) == 200, host

    token_file = node.data_dir / "monitor.token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    assert request(url + "/api/eval/average", "POST") == 401
    assert request(url + "/api/eval/average", "POST", {"Authorization": "Bearer not-the-token"}) == 401
    assert request(url + "/api/eval/average", "POST", {"Authorization": f"Bearer {token}"}) == 422  # vector mode
    # the token is this node's alone: the other node's does not open this one
    other = (nodes[1].data_dir / "monitor.token").read_text().strip()
    assert other != token
    assert request(url + "/api/eval/average", "POST", {"Authorization": f"Bearer {other}"}) == 401

    families = {f.name: f for f in text_string_to_metric_families(get(url + "/metrics")[2].decode())}
    refused = {s.labels["reason"]: s.value for s in families["murmur_monitor_refused"].samples}
    assert refused["host"] >= 8 and refused["token"] >= 3, refused
    assert node.alive()
