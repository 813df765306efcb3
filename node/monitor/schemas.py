"""The JSON API's documented shapes: the JSON Schema files shipped in `schemas/`, and the OpenAPI
document assembled from them (served at `/api/openapi.json`)."""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

SCHEMA_NAMES = ("status", "peers", "topology", "history", "log", "swarm", "swarm_eval", "doctor", "error")

# path -> (schema name, summary, query parameters: name -> (JSON type, description))
JSON_ENDPOINTS: dict[str, tuple[str, str, dict[str, tuple[str, str]]]] = {
    "/api/status": ("status", "this node", {}),
    "/api/peers": ("peers", "the membership view with each peer's last record", {}),
    "/api/topology": ("topology", "the current round's graph, weights and rho", {}),
    "/api/history": ("history", "time series for the charts", {
        "since": ("number", "only samples taken after this unix time"),
        "limit": ("integer", "only the last N samples (N >= 1)"),
    }),
    "/api/swarm": ("swarm", "the swarm page: every peer's step, loss, tokens, uptime, reach and contribution, "
                   "and the swarm's loss and throughput over time", {
        "limit": ("integer", "only the last N points of the history (N >= 1)"),
    }),
    "/api/log": ("log", "recent events and errors", {
        "after": ("integer", "only entries with a larger id"),
        "limit": ("integer", "only the last N entries (N >= 1)"),
    }),
}


@functools.cache
def schema(name: str) -> dict[str, Any]:
    """One documented schema, e.g. schema("status")."""
    if name not in SCHEMA_NAMES:
        raise KeyError(f"no schema named {name!r}; known: {', '.join(SCHEMA_NAMES)}")
    text = resources.files(__package__).joinpath("schemas", f"{name}.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 (whose schema dialect is JSON Schema 2020-12) for every endpoint of the monitor."""
    error = {"description": "bad query (400) or unknown path (404)",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}}}
    paths: dict[str, Any] = {}
    for path, (name, summary, query) in JSON_ENDPOINTS.items():
        paths[path] = {"get": {
            "summary": summary,
            "parameters": [{"name": q, "in": "query", "required": False, "description": desc,
                            "schema": {"type": kind}} for q, (kind, desc) in query.items()],
            "responses": {"200": {"description": summary,
                                  "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}},
                          "400": error, "404": error},
        }}
    paths["/api/events"] = {"get": {
        "summary": "server-sent events: an `update` event each sampling interval with "
                   "{status, peers, topology, sample, log, swarm} (swarm's history: the newest point)",
        "responses": {"200": {"description": "an event stream", "content": {"text/event-stream": {}}},
                      "403": {"description": "asked for by a page of another origin (a browser's cross-site request)",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}}},
                      "503": {"description": "the most event streams are open already (Retry-After says when to retry)",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}}}}}}
    paths["/api/eval/average"] = {"post": {
        "summary": "evaluate the swarm-average model: pull every live peer's parameters, average them with "
                   "this node's, and return the validation loss (takes seconds; one at a time)",
        "parameters": [{"name": "save", "in": "query", "required": False, "schema": {"type": "boolean"},
                        "description": "also write the average model to swarm-average.safetensors in the node's data "
                                       "directory (true/false, 1/0, yes/no, on/off)"}],
        "responses": {"200": {"description": "the swarm-average loss and who was in and out",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/swarm_eval"}}}},
                      "400": error,
                      "403": {"description": "sent by a page of another origin (a browser's cross-site request)",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}}},
                      "409": {"description": "another evaluation is running on this node",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}}},
                      "422": {"description": "this node trains no model (vector mode)",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}}}},
    }}
    paths["/api/doctor"] = {"post": {
        "summary": "reachability checks (`murmur doctor`): dial-back, a probe through each relay's circuit, the "
                   "relay service's check, latency and goodput to each neighbour (takes seconds; one at a time)",
        "responses": {"200": {"description": "the checks' findings",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/doctor"}}}},
                      "400": error,
                      "403": {"description": "sent by a page of another origin (a browser's cross-site request)",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}}},
                      "409": {"description": "a check is already running, or the node has no host yet",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}}}},
    }}
    paths["/metrics"] = {"get": {
        "summary": "Prometheus text format", "responses": {"200": {"description": "metrics",
                                                                 "content": {"text/plain": {}}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "murmur node monitor", "version": "1"},
        "paths": paths,
        "components": {"schemas": {name: schema(name) for name in SCHEMA_NAMES}},
    }
