"""`murmur eval`: ask a running node for the validation loss of the swarm-average model
(`POST /api/eval/average` on its monitor) and report it next to the node's own latest loss."""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from node.cli.args import PRECEDENCE, number
from node.cli.status import add_monitor_target, monitor_token, no_node, post_monitor, print_answer, status_url
from node.config import Command

# The node pulls every peer at once, each answer begun within 30 s (node.swarm.swarm_eval.FETCH_TIMEOUT_S) and
# its transfer paced by its size (gossip.pace: a large model over a slow link can take longer), then evaluates.
DEFAULT_TIMEOUT_S = 300.0


class EvalRefused(Exception):
    """The node answered with an error (busy, not training...): its message."""


def request_swarm_eval(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, save: bool = False,
                       token: str | None = None) -> dict[str, Any]:
    """The node's answer; raises EvalRefused for an error answer, URLError/OSError/ValueError otherwise.
    `token` is the node's monitor token (its POST endpoints need it)."""
    query = "?save=true" if save else ""
    return post_monitor(f"{url.rstrip('/')}/api/eval/average{query}", timeout_s, token, EvalRefused)


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def format_swarm_eval(result: dict[str, Any]) -> str:
    """The human-readable report: the two losses, then who was in and who was out."""
    peers, failed, local = result["peers"], result["failed"], result["local"]
    steps = (f"step {result['min_step']}" if result["min_step"] == result["max_step"]
             else f"steps {result['min_step']}-{result['max_step']}")
    lines = [f"swarm average  val loss {_loss(result['loss'])}   {len(peers)} peer{'s' * (len(peers) != 1)}, {steps}, "
             f"{result['elapsed_s']:.1f} s",
             f"this node      val loss {_loss(local['val_loss'])}"
             + (f" at step {local['val_step']}" if local["val_step"] is not None else " (not evaluated yet)")
             + f"   train loss {_loss(local['loss'])} at step {local['step']}"]
    lines += [f"  in   {p['peer_id']}  step {p['step']}{'  (this node)' if p['self'] else ''}" for p in peers]
    lines += [f"  out  {peer}  {reason}" for peer, reason in sorted(failed.items())]
    if result.get("saved"):
        lines.append(f"written to {result['saved']}")
    if result.get("save_error"):
        lines.append(f"NOT written: {result['save_error']} (the previous file is kept)")
    return "\n".join(lines)


def run_eval(url: str, as_json: bool, timeout_s: float = DEFAULT_TIMEOUT_S, save: bool = False,
             token: str | None = None) -> int:
    """Exit 0 with the report; 1 when the node refused, did not answer, or could not write the average."""
    try:
        result = request_swarm_eval(url, timeout_s, save, token)
    except EvalRefused as exc:
        hint = "" if token else " (no monitor token found: run in the node's directory, or give --data-dir or --token)"
        print(f"murmur eval: error: the node at {url} refused: {exc}{hint}", file=sys.stderr)
        return 1
    except TimeoutError:
        print(f"murmur eval: error: no answer from {url} within {timeout_s:g} s (--timeout)", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return no_node("eval", url, exc)
    status = print_answer("eval", url, result, as_json, format_swarm_eval)
    return 1 if status == 0 and result.get("save_error") else status


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    evaluate = commands.add_parser(
        Command.EVAL, help="validation loss of the swarm-average model, asked of a running node", epilog=PRECEDENCE,
        description="Ask a running node to pull every live peer's current parameters, average them uniformly "
        "with its own and evaluate the average on its validation split (POST /api/eval/average); print that "
        "loss next to the node's own latest validation loss, and which peers were in and out. Takes seconds "
        "(a peer that does not answer costs up to 30 s). Without --url it asks the monitor at "
        "http://MONITOR-HOST:MONITOR-PORT.",
    )
    add_monitor_target(evaluate)
    evaluate.add_argument("--timeout", type=number(float, lo=1.0), default=300.0, metavar="SECONDS",
                          help="how long to wait for the node's answer (default 300)")
    evaluate.add_argument("--save", action="store_true",
                          help="the node also writes the average model to swarm-average.safetensors in its data "
                          "directory (atomically; the previous one is kept as swarm-average.safetensors.prev)")
    evaluate.add_argument("--json", action="store_true",
                          help="print the node's JSON answer: loss, self, peers (peer_id, step, self), failed "
                          "(peer id -> reason), min_step, max_step, elapsed_s, saved, save_error, "
                          "local (val_loss, val_step, loss, step)")
    evaluate.set_defaults(run=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    url = status_url(args, os.environ)
    return run_eval(url, args.json, args.timeout, save=args.save, token=monitor_token(args, os.environ, url))
