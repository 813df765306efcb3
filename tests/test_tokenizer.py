"""Tokenizers (node.train.tokenizer) and the blob protocol joiners fetch a swarm's tokenizer with
(gossip.blob, over the in-memory transport): a trained byte-level BPE round-trips text, its config
entry is bounded, a fetched blob must have the size and hash the swarm config names, and a node that
cannot get the tokenizer stops with a clear line."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from gossip.blob import BLOB_PROTOCOL, BlobFailed, fetch_blob, serve_blobs
from gossip.memory import InMemoryNetwork
from gossip.transport import Stream
from node.runtime.errors import StartupError
from node.runtime.tokenizer import obtain_tokenizer
from node.train.data import synthetic_text
from node.train.tokenizer import (
    EOS,
    BpeTokenizer,
    TokenizerInvalid,
    TokenizerSpec,
    cache_path,
    spec_of,
    train_bpe,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, TokenizerSpec]:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return out, train_bpe(synthetic_text(0, 200_000).decode().split("\n\n"), 400, out)


def test_a_trained_bpe_round_trips_text_with_eos_first_and_its_entry_names_it(trained) -> None:
    path, spec = trained
    data = path.read_bytes()
    assert spec == spec_of(data) and spec.sha256 == hashlib.sha256(data).hexdigest() and spec.vocab_size == 400
    tokenizer = BpeTokenizer(data)
    assert tokenizer.eos_id == 0 and tokenizer.tokenizer.id_to_token(0) == EOS
    text = "Mira walked to the garden. Ünïcode 🙂 too\n"
    ids = tokenizer.encode_batch([text])[0]
    assert tokenizer.decode(ids) == text and len(ids) < len(text.encode())  # merges shorten English
    assert TokenizerSpec.from_doc(spec.to_doc()) == spec


@pytest.mark.parametrize(("doc", "message"), [
    ({"sha256": "AB" * 32, "vocab_size": 10, "bytes": 10}, "sha256"),
    ({"sha256": "ab" * 32, "vocab_size": 0, "bytes": 10}, "vocab_size"),
    ({"sha256": "ab" * 32, "vocab_size": 10, "bytes": 1 << 40}, "bytes"),
    ({"sha256": "ab" * 32, "vocab_size": 10, "bytes": 10, "url": "http://x"}, "unknown field"),
])
def test_the_swarm_configs_tokenizer_entry_is_bounded(doc, message) -> None:
    with pytest.raises(TokenizerInvalid, match=message):
        TokenizerSpec.from_doc(doc)


def test_a_bad_vocabulary_or_file_is_refused(tmp_path) -> None:
    with pytest.raises(TokenizerInvalid, match="at least 257"):
        train_bpe(["text"], 100, tmp_path / "t.json")
    with pytest.raises(TokenizerInvalid, match="not a tokenizer.json"):
        spec_of(b'{"model": 1}')


def test_a_blob_is_fetched_by_hash_and_checked_for_size_and_hash(trained) -> None:
    path, spec = trained
    data = path.read_bytes()

    async def main() -> None:
        net = InMemoryNetwork()
        server, client = net.transport("server"), net.transport("client")
        served: list[str] = []

        async def source(sha256: str) -> bytes | None:
            served.append(sha256)
            return data if sha256 == spec.sha256 else None

        await serve_blobs(server, source)
        assert await fetch_blob(client, "server", spec.sha256, spec.bytes) == data
        with pytest.raises(BlobFailed, match="refused: unknown blob"):
            await fetch_blob(client, "server", "0" * 64, 10)
        with pytest.raises(BlobFailed, match="more than the 10 expected"):  # refused before reading it
            await fetch_blob(client, "server", spec.sha256, 10)

        # a peer that answers with other bytes of the right size is caught by the hash
        async def liar(sha256: str) -> bytes | None:
            return b"x" * spec.bytes

        await serve_blobs(net.transport("liar"), liar)
        with pytest.raises(BlobFailed, match="do not hash to"):
            await fetch_blob(client, "liar", spec.sha256, spec.bytes)

        # garbage instead of a request is answered with a refusal, and the server goes on
        stream: Stream = await client.open_stream("server", BLOB_PROTOCOL)
        await stream.write(b"\x00\x00\x00\x00\x00\x00\x00\x03abc")
        prefix = await stream.read_exactly(8)
        assert b"malformed request" in await stream.read_exactly(int.from_bytes(prefix, "big"))
        await stream.close()
        assert await fetch_blob(client, "server", spec.sha256, spec.bytes) == data

    asyncio.run(main())


def test_a_joiner_takes_the_tokenizer_from_a_peer_caches_it_and_serves_it_or_stops_with_a_clear_line(trained, tmp_path,
                                                                                                   monkeypatch) -> None:
    path, spec = trained
    import node.runtime.tokenizer as module

    monkeypatch.setattr(module, "FIND_PEERS_S", 0.5)

    class Record:
        def __init__(self, peer_id: str) -> None:
            self.peer_id, self.maddrs = peer_id, ()

    async def main() -> None:
        net = InMemoryNetwork()
        founder, joiner, late = net.transport("founder"), net.transport("joiner"), net.transport("late")
        dialled: list[str] = []

        async def connect(record) -> None:
            dialled.append(record.peer_id)

        await obtain_tokenizer(spec, tmp_path / "founder", path, founder, lambda: [], connect)
        got = await obtain_tokenizer(spec, tmp_path / "joiner", None, joiner,
                                     lambda: [Record("joiner"), Record("founder")], connect)
        assert got.data == path.read_bytes() and dialled == ["founder"]
        assert cache_path(tmp_path / "joiner", spec.sha256).read_bytes() == got.data
        # the joiner now serves it too
        assert await fetch_blob(late, "joiner", spec.sha256, spec.bytes) == got.data
        with pytest.raises(StartupError, match=r"does not have the swarm's tokenizer .* no peer served it .*"
                                               r"pass --tokenizer FILE"):
            await obtain_tokenizer(spec, tmp_path / "alone", None, net.transport("alone"), lambda: [], connect)

    asyncio.run(main())


def test_a_joiner_without_the_tokenizer_that_no_peer_serves_exits_2_with_one_line(trained, tmp_path, monkeypatch,
                                                                                  capsys) -> None:
    """The node's runner (node.runtime.serve._run, as `murmur join` runs the node) turns the StartupError
    of obtain_tokenizer into exit 2 and one `murmur: error:` line naming the fix."""
    _, spec = trained
    import node.runtime.tokenizer as module
    from node.runtime.serve import _run

    monkeypatch.setattr(module, "FIND_PEERS_S", 0.5)
    looked: list[str] = []

    async def node() -> int:
        transport = InMemoryNetwork().transport("joiner")

        def view() -> list:
            looked.append("view")
            return []

        await obtain_tokenizer(spec, tmp_path, None, transport, view, lambda record: None)
        return 0

    assert _run(node) == 2
    assert looked, "the joiner looked for peers before giving up"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"murmur: error: this node does not have the swarm's tokenizer (sha256 {spec.sha256[:16]}")
    assert lines[0].endswith(f"{spec.bytes} bytes) and no peer served it (no peer in view); pass --tokenizer FILE "
                             "with that file")
    assert not cache_path(tmp_path, spec.sha256).exists()
