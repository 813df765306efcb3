"""`murmur export`: a swarm's model as a directory other tools load (node.train.export), from a
node's data directory or from a running node, which first writes its swarm average."""

from __future__ import annotations

import sys
import urllib.error
from pathlib import Path

from node.cli.eval import DEFAULT_TIMEOUT_S, EvalRefused, request_swarm_eval
from node.cli.status import no_node


class ExportUsage(ValueError):
    """What to export from, or where to, is wrong: exit 2 with this line."""


def run_export(to: Path, data_dir: Path | None, url: str | None, source: str | None, force: bool,
               timeout_s: float = DEFAULT_TIMEOUT_S, token: str | None = None) -> int:
    """`token`: with `url`, the node's monitor token (its POST endpoints need it)."""
    from node.train.checkpoint import CheckpointUnreadable
    from node.train.export import ExportFailed, ExportSource, export_data_dir
    from node.train.models.hf import HfModelInvalid

    if to.exists() and not force and (not to.is_dir() or any(to.iterdir())):
        raise ExportUsage(f"--to {to} exists and is not empty (add --force to replace it)")
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
        raise ExportUsage(f"--data-dir {data_dir} is not a directory")
    try:
        kind, manifest = export_data_dir(data_dir, to, chosen, force=force)
    except (ExportFailed, HfModelInvalid, CheckpointUnreadable, ValueError) as exc:
        raise ExportUsage(str(exc)) from None
    what = ("the swarm average" if kind is ExportSource.AVERAGE else "this node's checkpoint")
    steps = manifest.get("step") if kind is ExportSource.CHECKPOINT else f"{manifest.get('min_step')}-{manifest.get('max_step')}"
    print(f"murmur export: wrote {what} of swarm {manifest.get('swarm')!r} ({manifest['model']}, step {steps}) to {to}")
    return 0
