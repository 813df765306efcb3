"""Paced whole-model transfers over real p2pd streams (two daemons on loopback), the sender throttled by
the test: a download slower than the whole deadline it used to have completes, one whose donor sends the
header and then nothing is cut within the stall timeout (the in-memory cases: tests/test_transfer_pace.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from test_transfer_pace import EXCHANGE_TIMEOUT_S, PAYLOAD, TENSORS, hostile_answer, settings
from test_transport_contract import p2pd_transport

from gossip.exchange import GossipPeer
from gossip.pace import TransferPace, TransferProgress, TransferStalled
from gossip.transport import GOSSIP_PROTOCOL

pytestmark = pytest.mark.multiprocess

RATE = 2_000_000  # bytes/s the throttled donor writes: the 4 MB model takes about 2 s
STALL_S = 1.5


def test_over_p2pd_a_throttled_download_completes_and_a_stalled_one_is_cut(tmp_path: Path) -> None:
    async def main() -> None:
        async with (p2pd_transport(tmp_path / "slow.key") as slow, p2pd_transport(tmp_path / "stuck.key") as stuck,
                    p2pd_transport(tmp_path / "joiner.key") as mine):
            await slow.serve(GOSSIP_PROTOCOL, hostile_answer(slow.peer_id, RATE, piece=64 << 10))
            await stuck.serve(GOSSIP_PROTOCOL, hostile_answer(stuck.peer_id, None))
            for donor in (slow, stuck):
                await mine.connect(donor.peer_id, await donor.maddrs())
            me = GossipPeer(mine, settings(TransferPace(stall_timeout_s=STALL_S, goodput_floor_mbit_s=2.0)),
                            {n: np.zeros_like(t) for n, t in TENSORS.items()})

            progress = TransferProgress()
            started = time.monotonic()
            tensors, _, step = await me.fetch(slow.peer_id, progress)
            took = time.monotonic() - started
            assert took > 4 * EXCHANGE_TIMEOUT_S  # the old whole deadline would have cut it
            assert step == 9 and all(np.array_equal(tensors[n], t) for n, t in TENSORS.items())
            assert progress.bytes_done == progress.bytes_total == PAYLOAD

            started = time.monotonic()
            with pytest.raises(TransferStalled):
                await me.fetch(stuck.peer_id)
            assert STALL_S <= time.monotonic() - started < STALL_S + 3.0

    asyncio.run(main())
