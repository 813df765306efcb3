"""`murmur tokenizer train`: a byte-level BPE trained with `tokenizers` on local --data shards (the
readers training uses: text, jsonl, parquet), written as a tokenizer.json for --tokenizer."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path


class TokenizerUsage(ValueError):
    """Bad data or vocabulary: exit 2 with this line."""


def run_tokenizer_train(data: Path, vocab: int, out: Path, text_field: str) -> int:
    from node.train.shards import DataInvalid, SkipCounter, open_dataset, read_records
    from node.train.tokenizer import TokenizerInvalid, train_bpe

    try:
        plan = open_dataset(data)
    except DataInvalid as exc:
        raise TokenizerUsage(str(exc)) from None
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
        raise TokenizerUsage(f"--data {data} holds no text (field {text_field!r})")
    try:
        spec = train_bpe(itertools.chain([first], stream), vocab, out)
    except (TokenizerInvalid, OSError) as exc:
        raise TokenizerUsage(str(exc)) from None
    skipped = sum(skips.counts.values())
    print(f"murmur tokenizer: trained a byte-level BPE of {spec.vocab_size} tokens on {count} records"
          + (f" ({skipped} skipped)" if skipped else "") + f"; wrote {out} (sha256 {spec.sha256})")
    return 0
