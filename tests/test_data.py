"""The byte tokenizer, the embedded corpus (identical everywhere, learnable), user corpora, per-peer
shards and reproducible batches."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.train import data
from node.train.data import (
    corpus_from_text,
    decode,
    decode_bytes,
    directory_corpus,
    embedded_corpus,
    encode,
    load_corpus,
    peer_shard,
    shard,
    shard_index,
    split_train_val,
    synthetic_text,
    training_batch,
    unigram_loss,
    validation_batches,
)

pytestmark = pytest.mark.unit

SMALL = 300_000  # bytes: enough stories for statistics, fast to generate


@pytest.fixture(scope="module")
def small_corpus() -> data.Corpus:
    return embedded_corpus(size_bytes=SMALL)


@settings(deadline=None)  # the machine is shared: a slow example is not a failure
@given(st.binary())
def test_any_bytes_round_trip_through_the_tokenizer(raw: bytes) -> None:
    tokens = encode(raw)
    assert tokens.dtype == torch.long and tokens.shape == (len(raw),)
    assert decode_bytes(tokens) == raw


@settings(deadline=None)
@given(st.text())
def test_any_unicode_text_round_trips_through_the_tokenizer(text: str) -> None:
    tokens = encode(text)
    assert len(tokens) == len(text.encode("utf-8"))
    assert all(0 <= t < data.VOCAB_SIZE for t in tokens.tolist())
    assert decode(tokens) == text


def test_decoding_a_model_sample_never_fails() -> None:
    assert decode([0x68, 0x69, 0xFF]) == "hi\ufffd"  # invalid UTF-8 from a model's sample
    with pytest.raises(ValueError, match="0..255"):
        decode([256])
    with pytest.raises(ValueError, match="0..255"):
        decode([-1])


def test_the_embedded_corpus_is_the_same_on_every_build_and_machine() -> None:
    first = synthetic_text(seed=0, size_bytes=100_000)
    assert synthetic_text(seed=0, size_bytes=100_000) == first
    assert synthetic_text(seed=1, size_bytes=100_000) != first
    # A golden digest: the corpus depends only on PCG64's specified bit stream and IEEE arithmetic, so
    # this holds on every machine and Python/numpy version. If the generator is changed on purpose,
    # bump CORPUS_VERSION and update the digest.
    assert hashlib.sha256(first).hexdigest() == GOLDEN_CORPUS_SHA256


GOLDEN_CORPUS_SHA256 = "93fbd653a24fb661c676d5a3fe6d1eed0fcedb9a2936cec69119d020b2e651be"


def test_the_embedded_corpus_is_english_like_text_with_structure_beyond_byte_frequencies() -> None:
    text = synthetic_text(seed=0, size_bytes=SMALL)
    assert SMALL <= len(text) < SMALL + 2_000  # whole stories, stopping just past the requested size
    decoded = text.decode("ascii")
    words = decoded.split()
    assert len(words) > SMALL / 8
    assert sum(w.strip('.,:"').isalpha() for w in words) / len(words) > 0.9
    assert decoded.count("\n\n") > 100  # many stories
    # The next byte is far more predictable from the previous one than from frequencies alone: there is
    # something for a model to learn beyond the unigram loss.
    values = np.frombuffer(text, dtype=np.uint8)
    pairs = np.bincount(values[:-1].astype(np.int64) * 256 + values[1:], minlength=256 * 256).reshape(256, 256)
    joint = pairs[pairs > 0] / pairs.sum()
    previous = pairs.sum(axis=1)
    previous = previous[previous > 0] / pairs.sum()
    conditional_entropy = float(-(joint * np.log(joint)).sum() + (previous * np.log(previous)).sum())
    assert conditional_entropy < unigram_loss(text) - 0.8


def test_the_embedded_corpus_is_cached_under_the_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = embedded_corpus(tmp_path, size_bytes=50_000)
    cached = list(tmp_path.iterdir())
    assert len(cached) == 1 and cached[0].read_bytes() == synthetic_text(0, 50_000)

    def no_generation(*_: object) -> bytes:
        raise AssertionError("the corpus was generated again instead of read from the cache")

    monkeypatch.setattr(data, "synthetic_text", no_generation)
    second = embedded_corpus(tmp_path, size_bytes=50_000)
    assert second.digest == first.digest
    assert torch.equal(second.train, first.train) and torch.equal(second.val, first.val)


def test_training_and_validation_parts_are_disjoint_whole_stories(small_corpus: data.Corpus) -> None:
    text = synthetic_text(0, SMALL)
    train, val = bytes(small_corpus.train.tolist()), bytes(small_corpus.val.tolist())
    assert train + val == text
    assert 0.03 < len(val) / len(text) < 0.07
    assert train.endswith(b"\n\n") and val.startswith(b"Story ")
    val_stories = [story for story in val.split(b"\n\n") if story]
    assert len(val_stories) > 10
    assert not any(story in train for story in val_stories)


def test_a_split_cuts_at_a_paragraph_then_a_line_then_anywhere() -> None:
    assert split_train_val(b"aaaa\n\nbb\ncc", 0.5) == (b"aaaa\n\n", b"bb\ncc")
    assert split_train_val(b"aaaa\nbbbb\ncc", 0.5) == (b"aaaa\nbbbb\n", b"cc")
    assert split_train_val(b"abcdefghij", 0.3) == (b"abcdefg", b"hij")
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(b"abc", 1.0)
    with pytest.raises(ValueError, match="too small"):
        corpus_from_text(b"a", "tiny")


def test_a_user_corpus_is_every_txt_file_of_the_directory_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"second file\n" * 50)
    (tmp_path / "a.txt").write_bytes(b"first file\n" * 50)
    (tmp_path / "notes.md").write_bytes(b"not part of the corpus\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"nested, not part of the corpus\n")
    corpus = load_corpus(data=tmp_path)
    text = b"first file\n" * 50 + b"\n" + b"second file\n" * 50
    assert bytes(corpus.train.tolist()) + bytes(corpus.val.tolist()) == text
    assert corpus.digest == hashlib.sha256(text).hexdigest()
    assert corpus.source == f"dir:{tmp_path}"


def test_a_bad_user_corpus_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        directory_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"no \*\.txt files"):
        directory_corpus(tmp_path)


def test_a_peer_always_reads_the_same_shard_and_peers_spread_over_shards(small_corpus: data.Corpus) -> None:
    assert shard_index("QmPeerA", 16) == shard_index("QmPeerA", 16)
    assert torch.equal(peer_shard(small_corpus, "QmPeerA"), peer_shard(small_corpus, "QmPeerA"))
    indices = {shard_index(f"QmPeer{n}", 16) for n in range(200)}
    assert indices == set(range(16))
    # Peers on different shards read different data.
    other = next(f"QmPeer{n}" for n in range(1, 200) if shard_index(f"QmPeer{n}", 16) != shard_index("QmPeer0", 16))
    assert not torch.equal(peer_shard(small_corpus, "QmPeer0")[:1000], peer_shard(small_corpus, other)[:1000])


def test_shards_partition_the_training_part(small_corpus: data.Corpus) -> None:
    parts = [shard(small_corpus.train, index, 7) for index in range(7)]
    assert torch.equal(torch.cat(parts), small_corpus.train)
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
    with pytest.raises(ValueError):
        shard(small_corpus.train, 7, 7)


def test_training_batches_are_next_byte_windows_of_the_shard_and_reproducible(small_corpus: data.Corpus) -> None:
    tokens = peer_shard(small_corpus, "QmPeerA")
    x, y = training_batch(tokens, "QmPeerA", step=5, batch_size=16, context=64)
    assert x.shape == y.shape == (16, 64) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    haystack = bytes(tokens.tolist())
    for row_x, row_y in zip(x, y):
        assert bytes(row_x.tolist()) + bytes(row_y[-1:].tolist()) in haystack
    again = training_batch(tokens, "QmPeerA", step=5, batch_size=16, context=64)
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    assert not torch.equal(training_batch(tokens, "QmPeerA", 6, 16, 64)[0], x)
    assert not torch.equal(training_batch(tokens, "QmPeerB", 5, 16, 64)[0], x)
    with pytest.raises(ValueError, match="too few"):
        training_batch(tokens[:64], "QmPeerA", 0, 16, 64)


def test_validation_batches_are_fixed_consecutive_windows(small_corpus: data.Corpus) -> None:
    batches = list(validation_batches(small_corpus.val, batch_size=8, context=32, max_batches=3))
    assert len(batches) == 3
    assert all(x.shape == (8, 32) and y.shape == (8, 32) for x, y in batches)
    xs = torch.cat([x for x, _ in batches])
    assert torch.equal(xs.reshape(-1), small_corpus.val[: 24 * 32].long())
    assert torch.equal(batches[0][1][0], small_corpus.val[1:33].long())
    everything = list(validation_batches(small_corpus.val, batch_size=8, context=32))
    assert sum(len(x) for x, _ in everything) == (len(small_corpus.val) - 1) // 32


def test_unigram_loss_is_the_entropy_of_the_byte_distribution(small_corpus: data.Corpus) -> None:
    assert unigram_loss(bytes(range(256)) * 3) == pytest.approx(math.log(256))
    assert unigram_loss(b"aaaa") == pytest.approx(0.0)
    assert unigram_loss(b"abab") == pytest.approx(math.log(2))
    assert unigram_loss(torch.tensor([1, 2, 1, 2], dtype=torch.uint8)) == pytest.approx(math.log(2))
    # What a trained model is compared with: English-like text, about 3 nats per byte.
    assert 2.7 < unigram_loss(small_corpus.val) < 3.3
