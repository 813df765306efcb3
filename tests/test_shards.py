"""--data as streamed shards (node.train.shards): the shard plan gives peers disjoint parts of every
epoch that together cover the training units; records come out of text, jsonl and parquet files; a
malformed jsonl line or a record without the text field is skipped with one counted log line while
reading goes on; batches are consecutive windows of the peer's part, and the validation set is the
same on every peer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from node.train.shards import (
    DataInvalid,
    ShardPlan,
    ShardStream,
    SkipCounter,
    SkipKind,
    StreamPosition,
    open_dataset,
    read_records,
    resolve_files,
)
from node.train.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit

PEERS = ["QmPeerA", "QmPeerB", "QmPeerC"]


def write_jsonl(path: Path, count: int, field: str = "text", start: int = 0) -> list[str]:
    texts = [f"record {i:06d} " + "lorem ipsum dolor sit amet " * (1 + i % 7) for i in range(start, start + count)]
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"id": text[:13], field: text}) + "\n")
    return texts


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    texts = write_jsonl(root / "part-0.jsonl", 3000)
    texts += write_jsonl(root / "sub" / "part-1.jsonl", 2500, start=3000)
    (root / "notes.bin").write_bytes(b"\x00ignored: not a shard kind")
    return root, texts


def read_part(plan: ShardPlan, units, skips: SkipCounter | None = None) -> list[str]:
    return [text for unit in units for text in read_records(plan, unit, "text", skips or SkipCounter())]


def test_peers_read_disjoint_parts_of_every_epoch_that_cover_the_training_units(dataset) -> None:
    root, texts = dataset
    plan = open_dataset(root)
    assert [f.name for f in plan.files] == ["part-0.jsonl", "sub/part-1.jsonl"]
    assert len(plan.train) > 3 * len(PEERS) and plan.val
    validation = set(read_part(plan, plan.val))
    training = read_part(plan, plan.train)
    # every record is in exactly one unit: units cut at line starts
    assert sorted(training + list(validation)) == sorted(texts)
    for epoch in (0, 1):
        parts = {peer: read_part(plan, plan.units_for(peer, PEERS, epoch)) for peer in PEERS}
        for a in PEERS:
            for b in PEERS:
                if a < b:
                    assert not set(parts[a]) & set(parts[b]), f"{a} and {b} read the same record in epoch {epoch}"
        assert sorted(t for part in parts.values() for t in part) == sorted(training)
        assert not validation & {t for part in parts.values() for t in part}
    # deterministic, and a new epoch deals the units differently
    assert plan.units_for(PEERS[0], PEERS, 0) == open_dataset(root).units_for(PEERS[0], list(reversed(PEERS)), 0)
    assert plan.units_for(PEERS[0], PEERS, 0) != plan.units_for(PEERS[0], PEERS, 1)
    # alone, a peer reads everything
    assert sorted(plan.units_for(PEERS[0], [PEERS[0]], 0)) == sorted(plan.train)


def test_a_malformed_line_and_a_missing_field_are_skipped_counted_and_logged_once_each(tmp_path, caplog) -> None:
    path = tmp_path / "d.jsonl"
    good = write_jsonl(path, 4)
    with open(path, "a") as f:
        f.write('{"text": "unterminated\n')
        f.write("[1, 2, 3]\n")
        f.write(json.dumps({"title": "no text field"}) + "\n")
        f.write(json.dumps({"text": 42}) + "\n")
        f.write("\n")
        f.write(json.dumps({"text": "after the bad ones"}) + "\n")
    plan = ShardPlan(tuple(resolve_files(path)), tuple(), tuple())
    from node.train.shards import cut_units

    counted: list[str] = []
    skips = SkipCounter(counted.append)
    with caplog.at_level(logging.WARNING, logger="murmur.data"):
        texts = [t for unit in cut_units(plan.files) for t in read_records(plan, unit, "text", skips)]
    assert texts == [*good, "after the bad ones"]
    assert counted == [SkipKind.BAD_RECORD, SkipKind.BAD_RECORD, SkipKind.MISSING_FIELD, SkipKind.MISSING_FIELD]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all("d.jsonl byte" in line for line in lines)
    assert "not JSON" in lines[0] and "not an object" in lines[1] and "no string field 'text'" in lines[2]


def test_text_and_parquet_shards_and_the_text_field(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    table = pa.table({"body": [f"row {i}" for i in range(10)] + [None], "n": list(range(11))})
    pq.write_table(table, tmp_path / "b.parquet", row_group_size=4)
    plan = ShardPlan(tuple(resolve_files(tmp_path)), (), ())
    from node.train.shards import cut_units

    units = cut_units(plan.files)
    assert [(plan.files[u.file].name, u.start) for u in units] == [("a.txt", 0), ("b.parquet", 0), ("b.parquet", 1),
                                                                  ("b.parquet", 2)]
    counted: list[str] = []
    texts = [t for u in units for t in read_records(plan, u, "body", SkipCounter(counted.append))]
    assert texts == ["first line\nsecond line\n", *[f"row {i}" for i in range(10)]]
    assert counted == [SkipKind.MISSING_FIELD]  # the null
    assert list(read_records(plan, units[1], "text", SkipCounter(counted.append))) == []
    assert counted[-1] == SkipKind.MISSING_FIELD  # no such column: one skip for the row group


def test_a_glob_names_shards_and_nothing_usable_is_refused(dataset, tmp_path) -> None:
    root, _ = dataset
    assert [f.name for f in resolve_files(Path(f"{root}/**/*.jsonl"))] == ["part-0.jsonl", "sub/part-1.jsonl"]
    with pytest.raises(DataInvalid, match="no such file"):
        resolve_files(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataInvalid, match="no .txt"):
        resolve_files(tmp_path / "empty")


def test_a_stream_packs_its_part_into_consecutive_windows_and_the_validation_set_is_shared(dataset) -> None:
    root, _ = dataset
    plan = open_dataset(root)
    streams = [ShardStream(plan, ByteTokenizer(), peer) for peer in PEERS]
    try:
        for stream in streams:
            stream.set_members(PEERS)
        x, y = streams[0].train_batch(4, 32)
        assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
        x2, _ = streams[0].train_batch(4, 32)
        assert not torch.equal(x, x2)  # the next windows, not the same ones
        first_unit = streams[0].epoch_units[0][0]
        expected = "".join(t + "\n" for t in read_records(plan, first_unit, "text", SkipCounter())).encode()
        assert bytes(torch.cat([x.reshape(4, 32), y[:, -1:]], 1)[0].tolist()) == expected[:33]
        assert streams[0].position == StreamPosition(0, 0)
        vals = [s.val_tokens() for s in streams]
        assert all(torch.equal(vals[0], v) for v in vals) and vals[0].numel() > 1000
    finally:
        for stream in streams:
            stream.close()


def test_a_stream_resumes_at_its_position_and_a_closed_stream_ends_a_waiting_step(dataset) -> None:
    root, _ = dataset
    plan = open_dataset(root)
    stream = ShardStream(plan, ByteTokenizer(), PEERS[1], start=StreamPosition(1, 2))
    try:
        stream.set_members(PEERS)
        x, _ = stream.train_batch(2, 16)
        third_unit = plan.units_for(PEERS[1], PEERS, 1)[2]
        first = next(read_records(plan, third_unit, "text", SkipCounter()))
        assert bytes(x[0].tolist()) == first.encode()[:16]
    finally:
        stream.close()
    with pytest.raises(DataInvalid, match="closed"):
        stream.train_batch(1000, 1000)
