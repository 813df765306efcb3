"""`murmur export`: a swarm's model as a directory other tools load (node.swarm.export), from a
node's data directory or from a running node, which first writes its swarm average."""

from __future__ import annotations

import argparse
import sys
import urllib.error
from pathlib import Path

from node.cli.args import UsageError, number
from node.cli.eval import DEFAULT_TIMEOUT_S, EvalRefused, request_swarm_eval
from node.cli.status import loopback_token, no_node
from node.config import Command, NodeConfig


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = commands.add_parser(
        Command.EXPORT, help="write the swarm's model as a directory transformers (or safetensors) loads",
        description="Write a swarm's model to --to DIR: for a Hugging Face model a save_pretrained directory "
        "(config, model.safetensors, the tokenizer) that AutoModelForCausalLM and AutoTokenizer load; for "
        "the embedded models model.safetensors with one tensor per parameter and config.json; every export with a "
        "tokenizer AutoTokenizer loads (the byte vocabulary if the swarm has no tokenizer file), murmur.json and "
        "README.md, a model card (docs/training.md, \"Export\"). From a node's --data-dir (its swarm average if written, else its checkpoint; --from picks), or "
        "from a running node's monitor (--url), which first pulls and writes the swarm average.")
    export.add_argument("--to", type=Path, required=True, metavar="DIR", help="the directory to write (must not exist, "
                        "or be empty, unless --force)")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-dir", type=Path, metavar="DIR", help="a node's data directory")
    source.add_argument("--url", help="monitor URL of a running node on this machine, e.g. http://127.0.0.1:7690")
    export.add_argument("--from", dest="source", choices=("average", "checkpoint"),
                        help="with --data-dir: the swarm average (swarm-average.safetensors) or this node's own "
                        "checkpoint (default: the average if there is one)")
    export.add_argument("--force", action="store_true", help="replace --to if it exists (only once the new "
                        "export is complete: a failure leaves the old one)")
    export.add_argument("--timeout", type=number(float, lo=1.0), default=300.0, metavar="SECONDS",
                        help="with --url: how long to wait for the node's swarm average (default 300)")
    export.add_argument("--token", help="with --url: the node's monitor token (default: read from "
                        "./murmur-data/monitor.token for a loopback URL; its POST endpoints need it)")
    export.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    if args.source is not None and args.url is not None:
        raise UsageError("--from applies to --data-dir; with --url the node writes and exports its swarm average")
    if args.token is not None and args.url is None:
        raise UsageError("--token applies to --url")
    token = None
    if args.url is not None:
        token = args.token.strip() if args.token is not None else loopback_token(args.url, NodeConfig().data_dir)
    return run_export(args.to, args.data_dir, args.url, args.source, args.force, args.timeout, token=token)


def run_export(to: Path, data_dir: Path | None, url: str | None, source: str | None, force: bool,
               timeout_s: float = DEFAULT_TIMEOUT_S, token: str | None = None) -> int:
    """`token`: with `url`, the node's monitor token (its POST endpoints need it)."""
    from node.swarm.export import ExportFailed, ExportSource, export_data_dir
    from node.train.checkpoint import CheckpointUnreadable
    from node.train.durable import recover_directory
    from node.train.models.hf import HfModelInvalid

    recover_directory(to)  # an export killed while replacing `to` put the old one aside: it comes back
    if to.exists() and not force and (not to.is_dir() or any(to.iterdir())):
        raise UsageError(f"--to {to} exists and is not empty (add --force to replace it)")
    if to.is_dir() and not any(to.iterdir()):
        to.rmdir()
    chosen = ExportSource(source) if source is not None else None
    if url is not None:
        try:
            answer = request_swarm_eval(url, timeout_s, save=True, token=token)
        except EvalRefused as exc:
            print(f"murmur export: error: the node at {url} refused: {exc}", file=sys.stderr)
            return 1
        except TimeoutError:
            print(f"murmur export: error: no answer from {url} within {timeout_s:g} s", file=sys.stderr)
            return 1
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return no_node("export", url, exc)
        if not answer.get("saved"):
            print(f"murmur export: error: the node could not write its swarm average: {answer.get('save_error')}",
                  file=sys.stderr)
            return 1
        data_dir, chosen = Path(answer["saved"]).parent, ExportSource.AVERAGE
    assert data_dir is not None
    if not data_dir.is_dir():
        raise UsageError(f"--data-dir {data_dir} is not a directory")
    try:
        kind, manifest = export_data_dir(data_dir, to, chosen, force=force)
    except (ExportFailed, HfModelInvalid, CheckpointUnreadable, ValueError) as exc:
        raise UsageError(str(exc)) from None
    what = ("the swarm average" if kind is ExportSource.AVERAGE else "this node's checkpoint")
    steps = manifest.get("step") if kind is ExportSource.CHECKPOINT else f"{manifest.get('min_step')}-{manifest.get('max_step')}"
    print(f"murmur export: wrote {what} of swarm {manifest.get('swarm')!r} ({manifest['model']}, step {steps}) to {to}")
    return 0
