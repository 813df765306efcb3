"""`murmur tokenizer train`: a byte-level BPE trained with `tokenizers` on local --data shards (the
readers training uses: text, jsonl, parquet), written as a tokenizer.json for --tokenizer."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator
from pathlib import Path

from node.cli.args import UsageError, number
from node.config import Command


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tokenizer = commands.add_parser(
        Command.TOKENIZER, help="train a byte-level BPE tokenizer on local data",
        description="Tokenizer tools. `murmur tokenizer train --data PATH --vocab N` trains a byte-level BPE with "
        "the tokenizers library on local text, jsonl or parquet shards (no download) and writes a tokenizer.json "
        "for --tokenizer.")
    actions = tokenizer.add_subparsers(dest="action", required=True, metavar="ACTION")
    train = actions.add_parser("train", help="train a byte-level BPE on local files",
                               description="Train a byte-level BPE (EOS <|endoftext|> at id 0, the 256 bytes, then "
                               "merges) on the training units of --data (the validation units are left out) and "
                               "write it as a tokenizer.json.")
    train.add_argument("--data", type=Path, required=True, metavar="PATH",
                       help="a directory, file or glob of .txt, .jsonl or .parquet shards")
    train.add_argument("--vocab", type=number(int, lo=257, hi=1 << 21), required=True, metavar="N",
                       help="vocabulary size, at least 257 (EOS and the 256 bytes)")
    train.add_argument("--text-field", default="text", metavar="FIELD",
                       help="the jsonl field or parquet column with the text (default text)")
    train.add_argument("--out", type=Path, default=Path("tokenizer.json"), metavar="FILE",
                       help="where to write the tokenizer (default ./tokenizer.json)")
    train.set_defaults(run=_run_tokenizer_train)


def _run_tokenizer_train(args: argparse.Namespace) -> int:
    return run_tokenizer_train(args.data, args.vocab, args.out, args.text_field)


def run_tokenizer_train(data: Path, vocab: int, out: Path, text_field: str) -> int:
    from node.train.shards import DataInvalid, SkipCounter, open_dataset, read_records
    from node.train.tokenizer import TokenizerInvalid, train_bpe

    try:
        plan = open_dataset(data)
    except DataInvalid as exc:
        raise UsageError(str(exc)) from None
    skips = SkipCounter()
    count = 0

    def texts() -> Iterator[str]:
        nonlocal count
        for unit in plan.train:  # not the validation units: the tokenizer never sees them
            for text in read_records(plan, unit, text_field, skips):
                count += 1
                yield text

    stream = texts()
    first = next(stream, None)
    if first is None:
        raise UsageError(f"--data {data} holds no text (field {text_field!r})")
    try:
        spec = train_bpe(itertools.chain([first], stream), vocab, out)
    except (TokenizerInvalid, OSError) as exc:
        raise UsageError(str(exc)) from None
    skipped = sum(skips.counts.values())
    print(f"murmur tokenizer: trained a byte-level BPE of {spec.vocab_size} tokens on {count} records"
          + (f" ({skipped} skipped)" if skipped else "") + f"; wrote {out} (sha256 {spec.sha256})")
    return 0
