"""The swarm-average evaluation in-process (in-memory transport, the tiny model): the loss is that of an
average computed independently; frozen, dead and misbehaving peers are left out and named while the
rest is averaged; a second request while one runs is refused as busy; the average written on request
is the model evaluated, and periodic writes coalesce; the monitor's POST endpoint answers
200/409/422/400 with JSON, and `murmur eval [--save]` reports what it answered."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_monitor_node import schema_errors  # the JSON Schema subset validator the monitor's tests use

from gossip.codecs import get_codec
from gossip.exchange import ExchangeSettings, GossipPeer
from gossip.memory import InMemoryNetwork
from gossip.optimizers import OptimizerConfig
from node.cli.eval import format_swarm_eval, run_eval
from node.config import NodeConfig
from node.monitor import Counters, EventLog, HistoryRecorder, start_monitor
from node.monitor.schemas import schema
from node.runtime.status import NodeRuntime
from node.swarm.contributors import ContributorTable
from node.swarm.swarm_eval import EvalBusy, EvalUnavailable, SwarmEvaluator
from node.train.checkpoint import load_checkpoint
from node.train.data import Corpus
from node.train.models import build_model
from node.train.trainer import Trainer, TrainerConfig, average_tensors
from support.tiny_model import TINY

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

SETTINGS = ExchangeSettings(swarm="test", config_hash="c0ffee", codec=get_codec("fp32"), exchange_timeout_s=5.0)


@dataclass(frozen=True)
class Record:
    peer_id: str
    maddrs: tuple[str, ...] = ()


def make_trainer(corpus: Corpus, peer_id: str = "me") -> Trainer:
    config = TrainerConfig(optimizer=OptimizerConfig(), batch_size=4, context=TINY.context, device="cpu",
                           precision="fp32", eval_batch_size=16, eval_batches=2)
    return Trainer(build_model(TINY, seed=0), config, peer_id=peer_id, train_tokens=corpus.train, val_tokens=corpus.val)


def model_tensors(seed: int) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy().reshape(-1).copy() for name, p in build_model(TINY, seed=seed).named_parameters()}


async def start_peer(net: InMemoryNetwork, peer_id: str, tensors: dict[str, np.ndarray], step: int) -> GossipPeer:
    peer = GossipPeer(net.transport(peer_id), SETTINGS, tensors, step=step)
    await peer.start()
    peer.park()  # answer pulls with the current tensors at once (a peer that is not waiting for a round)
    return peer


async def swarm(net: InMemoryNetwork, trainer: Trainer, others: dict[str, int]) -> tuple[GossipPeer, dict]:
    """This node's peer (its trainer's parameters, step 7) and one peer per `others` entry (id -> seed),
    each at step 10 + seed; returns our peer and every member's tensors by id."""
    members = {"me": await trainer.tensors()}
    mine = await start_peer(net, "me", members["me"], step=7)
    for peer_id, seed in others.items():
        members[peer_id] = model_tensors(seed)
        await start_peer(net, peer_id, members[peer_id], step=10 + seed)
    return mine, members


def numpy_mean(members: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The members' mean as numpy computes it, of the stacked members in float64: the reference."""
    return {name: np.mean(np.stack([m[name].astype(np.float64) for m in members]), axis=0) for name in members[0]}


async def independent_loss(corpus: Corpus, members: Sequence[dict[str, np.ndarray]]) -> float:
    """The loss of the members' mean (numpy's) evaluated by another trainer."""
    mean = {name: values.astype(np.float32) for name, values in numpy_mean(members).items()}
    async with make_trainer(corpus, "checker") as checker:
        return await checker.evaluate(mean)


def view_of(*ids: str):
    return lambda: [Record(peer_id) for peer_id in ids]


def test_the_swarm_average_is_the_float64_mean():
    rng = np.random.default_rng(0)
    members = [{"w": rng.standard_normal(100_000).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
               for _ in range(3)]
    average, reference = average_tensors(members), numpy_mean(members)
    for name in ("w", "b"):
        np.testing.assert_allclose(average[name], reference[name].astype(np.float32), rtol=0, atol=1e-6)
        assert average[name].dtype == np.float32
    with pytest.raises(ValueError, match="nothing to average"):
        average_tensors([])


def test_the_averaged_loss_is_that_of_an_independently_computed_average(corpus: Corpus):
    async def main() -> None:
        net = InMemoryNetwork()
        async with make_trainer(corpus) as trainer:
            mine, members = await swarm(net, trainer, {"peer-a": 1, "peer-b": 2})
            evaluator = SwarmEvaluator(trainer, mine, view_of("me", "peer-a", "peer-b"))
            result = await evaluator.evaluate()
            own_loss = await trainer.evaluate()
        expected = await independent_loss(corpus, list(members.values()))
        assert result.loss == pytest.approx(expected, rel=1e-5)
        assert abs(result.loss - own_loss) > 1e-3  # the peers really are in it
        assert [(p.peer_id, p.step) for p in result.included] == [("me", 7), ("peer-a", 11), ("peer-b", 12)]
        assert dict(result.failed) == {}
        assert (result.min_step, result.max_step) == (7, 12)
        answer = result.as_dict()
        assert answer["self"] == "me" and [p["self"] for p in answer["peers"]] == [True, False, False]
        json.dumps(answer, allow_nan=False)
        # what the endpoint answers (NodeRuntime adds `local`) is the documented shape
        local = {"val_loss": own_loss, "val_step": 5, "loss": None, "step": 7}
        assert schema_errors({**answer, "local": local}, schema("swarm_eval")) == []
        assert schema_errors(answer, schema("swarm_eval")) == ["$: missing 'local'"]

    asyncio.run(main())


def test_frozen_dead_and_misbehaving_peers_are_left_out_and_the_rest_averaged(corpus: Corpus):
    async def main() -> None:
        net = InMemoryNetwork()
        counted: list[str] = []
        async with make_trainer(corpus) as trainer:
            mine, members = await swarm(net, trainer, {"good": 1, "frozen": 2, "dead": 3})
            # a peer whose parameters have the wrong shape: its answer is refused, counted and logged
            wrong = {name: t[:-1] if i == 0 else t for i, (name, t) in enumerate(model_tensors(4).items())}
            await start_peer(net, "wrong", wrong, step=3)
            net.freeze("frozen")
            await net.kill("dead")
            evaluator = SwarmEvaluator(trainer, mine, view_of("me", "good", "frozen", "dead", "wrong", "ghost"),
                                       fetch_timeout_s=1.0, count=counted.append)
            async with asyncio.timeout(30):
                result = await evaluator.evaluate()
            net.thaw("frozen")
        assert dict(result.failed) == {"frozen": "timeout", "dead": "unreachable", "wrong": "manifest_mismatch",
                                       "ghost": "unreachable"}
        assert [p.peer_id for p in result.included] == ["me", "good"]
        assert counted == ["swarm_eval_manifest_mismatch"]
        assert result.loss == pytest.approx(await independent_loss(corpus, [members["me"], members["good"]]), rel=1e-5)
        assert result.elapsed_s >= 1.0  # it waited out the frozen peer's timeout, and no longer than that
        assert result.elapsed_s < 20

    asyncio.run(main())


def test_alone_the_average_is_the_own_model(corpus: Corpus):
    async def main() -> None:
        async with make_trainer(corpus) as trainer:
            mine, _ = await swarm(InMemoryNetwork(), trainer, {})
            result = await SwarmEvaluator(trainer, mine, view_of("me")).evaluate()
            assert result.loss == pytest.approx(await trainer.evaluate(), rel=1e-6)
            assert [p.peer_id for p in result.included] == ["me"]

    asyncio.run(main())


def test_a_second_request_while_one_runs_is_refused_as_busy(corpus: Corpus):
    async def main() -> None:
        net = InMemoryNetwork()
        async with make_trainer(corpus) as trainer:
            mine, _ = await swarm(net, trainer, {"slow": 1})
            net.freeze("slow")
            fetches = []
            real_fetch = mine.fetch

            async def counting_fetch(peer: str, **kwargs):
                fetches.append(peer)
                return await real_fetch(peer, **kwargs)

            mine.fetch = counting_fetch
            evaluator = SwarmEvaluator(trainer, mine, view_of("me", "slow"), fetch_timeout_s=1.0)
            first = asyncio.create_task(evaluator.evaluate())
            await asyncio.sleep(0.1)
            assert evaluator.busy
            with pytest.raises(EvalBusy, match="already running"):
                await evaluator.evaluate()
            assert fetches == ["slow"]  # the refused request pulled nobody
            done = await first
            assert dict(done.failed) == {"slow": "timeout"}
            assert not evaluator.busy
            net.thaw("slow")
            again = await evaluator.evaluate()  # free again once the first is over
            assert [p.peer_id for p in again.included] == ["me", "slow"] and fetches == ["slow", "slow"]

    asyncio.run(main())


def test_a_saved_average_is_the_model_evaluated_and_a_failed_write_is_reported(corpus: Corpus, tmp_path):
    from node.runtime.saving import save_swarm_average as _save_swarm_average

    async def main() -> None:
        net = InMemoryNetwork()
        counted: list[str] = []
        runtime = NodeRuntime(NodeConfig(data_dir=tmp_path, swarm="test"), founding=True)
        runtime.config_hash, runtime.swarm_doc = "c0ffee", {"version": 1}
        # the contributors the training loop saw (node.swarm.contributors), for the export's card
        seen = ContributorTable(initial={"peer-a": 800, "me": 1600})
        runtime.training = SimpleNamespace(contributors=seen, observe_contributors=lambda: None)
        async with make_trainer(corpus) as trainer:
            mine, members = await swarm(net, trainer, {"peer-a": 1, "peer-b": 2})
            evaluator = SwarmEvaluator(trainer, mine, view_of("me", "peer-a", "peer-b"), count=counted.append,
                                       save=functools.partial(_save_swarm_average, runtime))
            result = await evaluator.evaluate(save=True)
            assert result.saved == str(tmp_path / "swarm-average.safetensors") and result.save_error is None
            written = load_checkpoint(tmp_path / "swarm-average.safetensors")
            assert await trainer.evaluate(written.tensors) == pytest.approx(result.loss, rel=1e-6)

            # a data directory that cannot hold the file: the answer says so, the failure is counted
            blocked = tmp_path / "a-file"
            blocked.write_text("not a directory")
            runtime.config = NodeConfig(data_dir=blocked, swarm="test")
            failed = await evaluator.evaluate(save=True)
        mean = numpy_mean(list(members.values()))
        assert sorted(written.tensors) == sorted(mean)
        for name, expected in mean.items():
            np.testing.assert_allclose(written.tensors[name], expected, rtol=0, atol=1e-6)
        assert written.meta["kind"] == "swarm-average" and written.meta["swarm"] == "test"
        assert (written.meta["min_step"], written.meta["max_step"]) == (7, 12)
        assert json.loads(written.meta["peers"]) == ["me", "peer-a", "peer-b"]
        steps = json.loads(written.meta["peer_steps"])  # each peer's step as pulled (the export's model card)
        assert list(steps) == ["me", "peer-a", "peer-b"] and (min(steps.values()), max(steps.values())) == (7, 12)
        assert json.loads(written.meta["contributors"]) == {"me": 1600, "peer-a": 800}
        assert failed.saved is None and "a-file" in failed.save_error  # mkdir: it exists, as a file
        assert failed.loss == pytest.approx(result.loss, rel=1e-6)  # the evaluation itself still answered
        assert counted == ["swarm_average_save_failed"]
        assert failed.as_dict()["save_error"] == failed.save_error
        assert load_checkpoint(tmp_path / "swarm-average.safetensors").meta == written.meta  # the earlier file is intact

    asyncio.run(main())


def test_periodic_writes_are_coalesced_wait_behind_a_request_and_stop_on_close(corpus: Corpus):
    async def main() -> None:
        net = InMemoryNetwork()
        writes: list[int] = []

        async def save(average, result) -> str:
            writes.append(len(result.included))
            return "written"

        async with make_trainer(corpus) as trainer:
            mine, _ = await swarm(net, trainer, {"slow": 1})
            net.freeze("slow")
            evaluator = SwarmEvaluator(trainer, mine, view_of("me", "slow"), fetch_timeout_s=0.5, save=save)
            evaluator.save_in_background()
            await asyncio.sleep(0.1)
            assert evaluator.busy
            with pytest.raises(EvalBusy):
                await evaluator.evaluate()  # a request meanwhile is refused, as for any running evaluation
            evaluator.save_in_background()  # due twice more while the first runs: one more write, not two
            evaluator.save_in_background()
            async with asyncio.timeout(20):
                while len(writes) < 2 or evaluator.busy:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.7)
            assert writes == [1, 1]  # the frozen peer was left out both times

            # due while a request runs: it waits for the request, then writes
            request = asyncio.create_task(evaluator.evaluate())
            await asyncio.sleep(0.1)
            evaluator.save_in_background()
            await request
            async with asyncio.timeout(20):
                while len(writes) < 3:
                    await asyncio.sleep(0.05)

            # closing the node cancels a write in flight: it never lands
            evaluator.save_in_background()
            await asyncio.sleep(0.1)
            await evaluator.close()
            assert not evaluator.busy and writes == [1, 1, 1]
            net.thaw("slow")

        with pytest.raises(EvalUnavailable, match="nowhere to write"):
            SwarmEvaluator(trainer, mine, view_of("me")).save_in_background()

    asyncio.run(main())


# ---- the monitor endpoint and `murmur eval` -------------------------------------------------------

ANSWER = {"loss": 2.5, "self": "me", "peers": [{"peer_id": "me", "step": 7, "self": True},
                                                {"peer_id": "peer-a", "step": 9, "self": False}],
          "failed": {"peer-b": "timeout"}, "min_step": 7, "max_step": 9, "elapsed_s": 1.25, "saved": None,
          "save_error": None,
          "local": {"val_loss": 2.75, "val_step": 5, "loss": 2.6, "step": 7}}


class FakeNode:
    """Stands in for NodeRuntime (which needs p2pd and a DHT); the server is the real one."""

    def __init__(self) -> None:
        self.history = HistoryRecorder()
        self.events = EventLog()
        self.record_ttl_s = 6.0
        self.refusal: Exception | None = None
        self.calls = 0
        self.saves: list[bool] = []
        self.save_error: str | None = None

    def status(self) -> dict[str, Any]:
        return {"peer_id": "me", "peers": [], "errors": {}, "skipped": {}, "gossip_from": 0}

    def peers(self) -> list[dict[str, Any]]:
        return []

    def topology(self) -> dict[str, Any]:
        return {"rho": None, "nodes": [], "edges": []}

    async def refresh_topology(self) -> None:
        pass

    def counters(self) -> Counters:
        return Counters(step=0, round=0, bytes_sent=0, bytes_received=0, peers_alive=1)

    async def evaluate_swarm_average(self, save: bool = False) -> dict[str, Any]:
        self.calls += 1
        self.saves.append(save)
        if self.refusal is not None:
            raise self.refusal
        if save and self.save_error:
            return {**ANSWER, "save_error": self.save_error}
        return {**ANSWER, "saved": "/data/swarm-average.safetensors"} if save else ANSWER


def test_the_endpoint_answers_the_result_busy_not_training_and_bad_queries(capsys):
    async def main() -> None:
        import aiohttp

        node = FakeNode()
        server = await start_monitor(node, "127.0.0.1", 0, interval_s=60)
        url = f"{server.url}/api/eval/average"
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {server.token}"}) as session:
                async with session.post(url) as ok:
                    assert ok.status == 200 and await ok.json() == ANSWER
                    assert schema_errors(ANSWER, schema("swarm_eval")) == []
                async with session.get(url) as wrong_method:
                    assert wrong_method.status == 405
                async with session.post(url + "?peers=3") as bad:
                    assert bad.status == 400 and "unknown query parameter 'peers'" in (await bad.json())["error"]
                async with session.post(url + "?save=maybe") as bad_save:
                    assert bad_save.status == 400 and "'maybe' is not a boolean" in (await bad_save.json())["error"]
                for query, wanted in (("?save=true", True), ("?save=1", True), ("?save=false", False)):
                    async with session.post(url + query) as answered:
                        assert answered.status == 200 and node.saves[-1] is wanted
                        assert (await answered.json())["saved"] == ("/data/swarm-average.safetensors" if wanted else None)
                node.refusal = EvalBusy("an evaluation of the swarm average is already running")
                async with session.post(url) as busy:
                    assert busy.status == 409
                    assert await busy.json() == {"error": "an evaluation of the swarm average is already running",
                                                 "status": 409}
                node.refusal = EvalUnavailable("this node trains no model")
                async with session.post(url) as vector:
                    assert vector.status == 422 and (await vector.json())["error"] == "this node trains no model"
                async with session.post(url, headers={"Origin": "http://evil.example"}) as cross_site:
                    assert cross_site.status == 403 and "http://evil.example" in (await cross_site.json())["error"]
                async with session.post(url, headers={"Origin": server.url}) as same_site:
                    assert same_site.status == 422  # the monitor page's own origin may ask
            assert node.calls == 7  # the bad queries, the GET and the cross-site request evaluated nothing

            # `murmur eval` on the same server: a refusal is one line and exit 1, an answer is a report
            assert await asyncio.to_thread(functools.partial(run_eval, server.url, False, token=server.token)) == 1
            err = capsys.readouterr().err.strip().splitlines()
            assert err == [f"murmur eval: error: the node at {server.url} refused: this node trains no model"]
            node.refusal = None
            assert await asyncio.to_thread(functools.partial(run_eval, server.url, True, token=server.token)) == 0
            assert json.loads(capsys.readouterr().out) == ANSWER and node.saves[-1] is False
            # `murmur eval --save`: the report ends with where the node wrote the average
            assert await asyncio.to_thread(functools.partial(run_eval, server.url, False, save=True,
                                                             token=server.token)) == 0
            assert capsys.readouterr().out.splitlines()[-1] == "written to /data/swarm-average.safetensors"
            assert node.saves[-1] is True
            # a node that could not write it: the report says so and the exit status is 1, for scripts
            node.save_error = "[Errno 28] No space left on device"
            assert await asyncio.to_thread(functools.partial(run_eval, server.url, False, save=True,
                                                             token=server.token)) == 1
            assert capsys.readouterr().out.splitlines()[-1] == (
                "NOT written: [Errno 28] No space left on device (the previous file is kept)")
        finally:
            await server.close()

    asyncio.run(main())


def test_the_report_names_both_losses_and_who_was_in_and_out():
    report = format_swarm_eval(ANSWER).splitlines()
    assert report[0].startswith("swarm average  val loss 2.5000   2 peers, steps 7-9")
    assert report[1].startswith("this node      val loss 2.7500 at step 5")
    assert "  in   me  step 7  (this node)" in report and "  in   peer-a  step 9" in report
    assert "  out  peer-b  timeout" in report


def test_a_node_that_trains_no_model_refuses_with_a_clear_error():
    runtime = NodeRuntime(NodeConfig(), founding=True)

    with pytest.raises(EvalUnavailable, match="trains no model"):
        asyncio.run(runtime.evaluate_swarm_average())


@pytest.mark.parametrize("args, message", [
    (["--timeout", "0"], "argument --timeout: 0 is below the minimum 1.0"),
    (["--url", "ftp://x"], "--url: 'ftp://x' is not an http(s) URL"),
    (["--url", "http://127.0.0.1:1", "--monitor-port", "7690"], "not allowed with argument"),
    (["--monitor-port", "0"], "port 0 means the node picked a free port"),
    (["--peers", "x"], "unrecognized arguments: --peers"),
])
def test_bad_eval_flags_exit_2_with_one_line(args, message, capsys):
    from node.cli.main import main

    try:
        status = main(["eval", *args])
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # argparse names the top-level program for arguments no command takes, as for every command
    assert len(lines) == 1 and lines[0].startswith(("murmur eval: error: ", "murmur: error: ")), lines
    assert message in lines[0]


def test_eval_without_a_node_exits_1_naming_the_url(capsys):
    assert run_eval("http://127.0.0.1:1", as_json=False, timeout_s=5) == 1
    assert capsys.readouterr().err.strip() == ("murmur eval: error: no node answers at http://127.0.0.1:1 "
                                               "([Errno 111] Connection refused)")


def test_a_diverged_average_is_answered_with_a_null_loss():
    from node.swarm.swarm_eval import IncludedPeer, SwarmEvalResult

    result = SwarmEvalResult(float("nan"), "me", (IncludedPeer("me", 3),), {}, 0.5)
    answer = {**result.as_dict(), "local": {"val_loss": None, "val_step": None, "loss": None, "step": 3}}
    assert answer["loss"] is None and schema_errors(answer, schema("swarm_eval")) == []
    json.dumps(answer, allow_nan=False)
    assert format_swarm_eval(answer).startswith("swarm average  val loss n/a   1 peer, step 3")


def test_a_given_average_rule_decides_how_the_members_combine(corpus: Corpus):
    """SPES passes its own rule (each expert over its owners only): the evaluator must use it, with
    every member keyed by peer id."""
    async def main() -> None:
        net = InMemoryNetwork()
        seen: list[list[str]] = []

        def only_peer_a(members):
            seen.append(list(members))
            return {name: np.array(x, copy=True) for name, x in members["peer-a"].items()}

        async with make_trainer(corpus) as trainer:
            mine, members = await swarm(net, trainer, {"peer-a": 1, "peer-b": 2})
            result = await SwarmEvaluator(trainer, mine, view_of("me", "peer-a", "peer-b"), average=only_peer_a).evaluate()
        assert seen == [["me", "peer-a", "peer-b"]]
        assert result.loss == pytest.approx(await independent_loss(corpus, [members["peer-a"]]), rel=1e-5)

    asyncio.run(main())
