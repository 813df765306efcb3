"""What a node's training run takes of the node's own settings: the swarm's recipe says what is
trained, these say where the data is, how this machine computes and how often it evaluates and saves."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from node.train.trainer import Precision


@dataclass(frozen=True)
class TrainingSettings:
    """Built from the node's config by the runtime (node.runtime.training.training_settings)."""

    data_dir: Path  # the node's data directory: the embedded corpus is cached there
    data: Path | None  # text/jsonl/parquet shards (node.train.shards); None: the embedded corpus
    device: str  # auto, cpu, cuda or cuda:N
    precision: Precision
    threads: int  # torch CPU threads; 0: torch's default
    eval_every: int  # steps between validation-loss evaluations of the local model
    checkpoint_every: int  # steps between checkpoints (and one when training stops)
    average_every: int  # steps between writes of the swarm-average model (and one at the end); 0: never
    min_peers: int  # a fresh swarm starts training once this many peers are in the view
    model: str = "moe"  # this node's own --model: where a joiner finds pretrained weights the swarm starts from
    text_field: str = "text"  # the jsonl field / parquet column of `data` that holds the text
    tokenizer: Path | None = None  # this node's own --tokenizer file (used when its hash is the swarm's)
    join_check: str = "auto"  # how a catch-up's download is checked (node.swarm.joining.JoinCheck)
