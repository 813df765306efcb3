"""The memory model (gossip.footprint) against hand counts of what the code keeps, the preflight's
refusal and pass (node.runtime.preflight, with MURMUR_MOCK_MACHINE_MEMORY), and docs/training.md's
table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gossip.footprint import TABLE_CASES, MemoryInputs, Where, footprint, table_markdown

ROOT = Path(__file__).resolve().parent.parent
# a ~1B-parameter Llama (TinyLlama-like shape): config only, nothing allocated
BIG_LLAMA = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
             "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def per(inputs: MemoryInputs, where: Where) -> dict[str, float]:
    return {t.name: t.per_parameter for t in footprint(inputs).terms if t.where is where}


@pytest.mark.unit
def test_dadam_on_cuda_counts_the_trainer_on_the_gpu_and_the_gossip_peer_on_the_host():
    f = footprint(MemoryInputs(10**9, "dadam", "cuda", max_staleness=2, in_neighbours=2))
    # parameters, gradients (fp32), Adam's two moments, and the copy others' values are evaluated on
    assert f.device_per_parameter == 4 + 4 + 8 + 4
    # staging 4; round inputs (S+1)*4 = 12; last mix 4; 2 neighbours' decoded values 8; the mix 4;
    # checkpoint: params 4 + moments 8 (messages stream a chunk at a time: nothing model-sized)
    assert f.host_per_parameter == 4 + 12 + 4 + 8 + 4 + 12
    assert f.host_bytes == 44 * 10**9 and f.device_bytes == 20 * 10**9
    # the default topology (one-peer-exp) receives one neighbour a round: the 28 (+ 12 at a checkpoint)
    one = footprint(MemoryInputs(10**9, "dadam", "cuda", in_neighbours=1))
    assert one.host_per_parameter - 12 == 28


@pytest.mark.unit
def test_contribution_scoring_holds_the_scored_values_and_the_base_where_the_algorithm_scores():
    import gossip.footprint as model
    from node.swarm import contribution

    assert model.MAX_SCORED == contribution.MAX_SCORED
    off, on = (per(MemoryInputs(1, "dadam", "cpu", in_neighbours=2, scoring=s), Where.HOST) for s in (False, True))
    # beyond their round: 2 neighbours' values and the base; one moved copy at a time
    assert on["contribution scoring (4 copies while it measures)"] == 16 and set(on) - set(off) == {
        "contribution scoring (4 copies while it measures)"}
    assert per(MemoryInputs(1, "dadam", "cpu", in_neighbours=9, scoring=True), Where.HOST)[
        "contribution scoring (6 copies while it measures)"] == 24  # at most MAX_SCORED neighbours
    # DiLoCo measures a fragment at a time; CHOCO its estimates of the neighbours; SPES does not score
    diloco = per(MemoryInputs(1, "diloco", "cpu", in_neighbours=2, fragments=4, scoring=True), Where.HOST)
    assert diloco["contribution scoring (4 copies while it measures)"] == 4
    choco = per(MemoryInputs(1, "dadam", "cpu", in_neighbours=2, choco=True, scoring=True), Where.HOST)
    assert choco["contribution scoring (4 copies while it measures)"] == 16
    unscored = MemoryInputs(4, "dadam", "cpu", spes=True, expert_parameters=3, scoring=True)
    assert not [t for t in per(unscored, Where.HOST) if t.startswith("contribution scoring")]


@pytest.mark.unit
def test_on_a_cpu_node_the_trainer_is_host_memory_and_there_is_no_staging():
    f = footprint(MemoryInputs(1000, "dsgd", "cpu", inner="sgd", momentum=0.0))
    assert f.device_bytes == 0
    host = per(MemoryInputs(1000, "dsgd", "cpu", inner="sgd"), Where.HOST)
    assert "pinned staging buffers" not in host and "optimizer moments (sgd)" not in host
    assert host["parameters"] == 4 and host["gradients"] == 4 and host["checkpoint snapshot"] == 4
    assert per(MemoryInputs(1000, "dsgd", "cpu", inner="sgd", momentum=0.9), Where.HOST)["optimizer moments (sgd)"] == 4


@pytest.mark.unit
def test_staleness_and_neighbours_scale_the_round_buffers():
    base = footprint(MemoryInputs(1, "dsgd", "cpu", inner="sgd", max_staleness=2)).host_per_parameter
    assert footprint(MemoryInputs(1, "dsgd", "cpu", inner="sgd", max_staleness=6)).host_per_parameter == base + 16
    # one more neighbour: its decoded values (float32, whatever the codec)
    assert footprint(MemoryInputs(1, "dsgd", "cpu", inner="sgd", in_neighbours=3)).host_per_parameter == base + 4
    # a lossy codec keeps the past round inputs in its size: int8's 1 byte (and its scales) for fp32's 4
    int8 = footprint(MemoryInputs(1, "dsgd", "cpu", inner="sgd", codec="int8")).host_per_parameter
    assert int8 == pytest.approx(base - 2 * (3 - 4 / 256))
    assert footprint(MemoryInputs(1, "dsgd", "cpu", inner="sgd", codec="int8", in_neighbours=3)).host_per_parameter \
        == pytest.approx(int8 + 4)


@pytest.mark.unit
def test_choco_adds_its_anchor_two_estimates_per_edge_and_the_outgoing_differences():
    plain = footprint(MemoryInputs(1, "dadam", "cuda", codec="fp32")).host_per_parameter
    host = per(MemoryInputs(1, "dadam", "cuda", choco=True, choco_edges=2), Where.HOST)
    assert host["CHOCO anchor"] == 4 and host["CHOCO estimates (2 per edge, 2 edges)"] == 16
    assert host["CHOCO outgoing differences (2)"] == 16
    # compressed gossip answers no past round: it keeps this round's input only
    assert host["round inputs (this round's, 0 past in fp32)"] == 4
    assert sum(host.values()) == plain + 36 - 8 == 72


@pytest.mark.unit
def test_diloco_keeps_anchor_momentum_residuals_and_two_peers():
    host = per(MemoryInputs(1, "diloco", "cuda", codec="bf16", anchor_codec="int8", outer_momentum=0.9), Where.HOST)
    for name in ("anchor", "outer momentum", "error-feedback residuals", "anchor error-feedback residuals"):
        assert host[name] == 4, name
    # the peers serving the anchor and the momentum hold those arrays and nothing before them
    assert not any(name.startswith("served") for name in host)
    # this round's input in float32, the two past ones as each peer's codec sends them (int8: its scales too)
    assert host["pseudo-gradients: round inputs (this round's, 2 past in bf16)"] == 4 + 2 * 2
    assert host["anchors: round inputs (this round's, 2 past in int8)"] == pytest.approx(4 + 2 * (1 + 4 / 256))
    assert host["current values and pseudo-gradient (a sync)"] == 8
    assert sum(host.values()) == pytest.approx(96 - 4 - 2 * (3 - 4 / 256))
    # fragments take turns: a round's transient buffers shrink, the kept ones do not
    four = per(MemoryInputs(1, "diloco", "cuda", codec="bf16", fragments=4), Where.HOST)
    assert four["pseudo-gradients: neighbours' values (2, decoded)"] == 2 and four["anchor"] == 4
    # lossless codecs keep no residuals; no momentum, no momentum buffers
    lean = per(MemoryInputs(1, "diloco", "cpu", codec="fp32", anchor_codec="fp32", outer_momentum=0.0), Where.HOST)
    assert not any("residual" in n or "momentum" in n for n in lean)


@pytest.mark.unit
@pytest.mark.parametrize(("frozen_bf16", "frozen_bytes"), [(False, 4), (True, 2)])
def test_spes_trains_its_owned_experts_and_keeps_the_others_frozen_as_the_recipe_says(frozen_bf16, frozen_bytes):
    """The daemon keeps the experts it does not own in float32 (its recipe leaves frozen_bf16 off), so
    the preflight counts 4 bytes for each, not bfloat16's 2."""
    f = footprint(MemoryInputs(100, "dadam", "cuda", codec="int8", spes=True, expert_parameters=80, owned_share=0.25,
                               outer_momentum=0.0, frozen_bf16=frozen_bf16))
    device = {t.name: t.per_parameter for t in f.terms if t.where is Where.DEVICE}
    trained, frozen = 0.4, 0.6  # 20 shared + 20 owned of 100
    assert device["parameters"] == pytest.approx(4 * trained + frozen_bytes * frozen)
    assert device["optimizer moments (adam)"] == pytest.approx(8 * trained)


@pytest.mark.unit
def test_docs_table_is_the_functions():
    doc = (ROOT / "docs" / "training.md").read_text()
    assert table_markdown() in doc, "regenerate: python -c 'from gossip.footprint import table_markdown; print(table_markdown())'"
    assert len(TABLE_CASES) >= 5


@pytest.mark.unit
def test_mock_machine_memory_parses():
    from node.runtime.preflight import Machine, parse_mock

    assert parse_mock("ram=2GiB,vram=0") == Machine(2 * 2**30, None)
    assert parse_mock("ram=64GiB, vram=24GB") == Machine(64 * 2**30, 24 * 10**9)
    with pytest.raises(ValueError):
        parse_mock("vram=1GiB")


def settings_for(*flags: str):
    from node.cli.main import parse_node_config
    from node.runtime.founding import swarm_document
    from node.swarm.recipe import SwarmSettings

    return SwarmSettings.from_doc(swarm_document(parse_node_config(["node", *flags], {}), 1.0))


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    directory = tmp_path_factory.mktemp("big-llama")
    LlamaConfig(**BIG_LLAMA).save_pretrained(str(directory))
    return directory


@pytest.mark.unit
def test_preflight_refuses_a_1b_model_on_a_small_machine_and_names_the_numbers(big_llama, monkeypatch):
    from node.runtime.errors import StartupError
    from node.runtime.preflight import MOCK_ENV, preflight

    settings = settings_for("--model", f"hf:{big_llama}", "--optimizer", "diloco")
    assert settings.training is not None
    monkeypatch.setenv(MOCK_ENV, "ram=31GiB,vram=0")
    with pytest.raises(StartupError) as refused:
        preflight(settings.training, settings, "cpu")
    line = str(refused.value)
    assert "\n" not in line and "1.10B parameters" in line and "gossip DiLoCo" in line
    assert "31.0 GiB available" in line and "fits up to ~" in line and "dsgd would need ~" in line


@pytest.mark.unit
def test_preflight_passes_when_it_fits_and_reports_the_terms(big_llama, monkeypatch, caplog):
    from node.runtime.preflight import MOCK_ENV, preflight

    settings = settings_for("--model", f"hf:{big_llama}")
    assert settings.training is not None
    monkeypatch.setenv(MOCK_ENV, "ram=1TiB,vram=0")
    with caplog.at_level("INFO", logger="murmur.node"):
        memory = preflight(settings.training, settings, "cpu")
    assert memory is not None and memory["parameters"] > 10**9 and memory["device"] == "cpu"
    assert memory["host_bytes"] > 20 * memory["parameters"] and memory["terms"]
    assert "preflight:" in caplog.text
    # the embedded default model is counted on the meta device and fits any machine the tests run on
    monkeypatch.delenv(MOCK_ENV)
    default = settings_for()
    assert default.training is not None
    small = preflight(default.training, default, "cpu")
    assert small is not None and small["parameters"] < 10**8


@pytest.mark.multiprocess
def test_murmur_node_exits_2_with_one_line_when_the_model_does_not_fit(big_llama, tmp_path):
    env = {**os.environ, "MURMUR_MOCK_MACHINE_MEMORY": "ram=8GiB,vram=0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(Path(sys.executable).with_name("murmur")), "node", "--swarm", "pf", "--model", f"hf:{big_llama}",
                           "--data-dir", str(tmp_path), "--listen", "/ip4/127.0.0.1/tcp/0", "--monitor-port", "0"],
                          env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("murmur: error:")]
    assert len(errors) == 1 and "1.10B parameters" in errors[0] and "8.0 GiB available" in errors[0], proc.stderr[-2000:]


@pytest.mark.unit
def test_murmur_status_shows_the_estimate_in_one_line():
    from node.cli.status import format_status

    memory = footprint(MemoryInputs(10**9, "dadam", "cuda")).as_json()
    status = {"peer_id": "QmMe", "swarm": "s", "maddrs": [], "round": 0, "step": 0, "peers": [], "bytes_sent": 0,
              "bytes_received": 0, "errors": {}, "memory": memory}
    lines = [line for line in format_status(status).splitlines() if line.startswith("memory")]
    assert lines == ["memory   ~41.0 GiB RAM (44 B/param), ~18.6 GiB GPU (20 B/param) for 1,000,000,000 parameters"]
    assert not [line for line in format_status({**status, "memory": None}).splitlines() if line.startswith("memory")]


@pytest.mark.multiprocess
def test_a_fitting_node_starts_and_its_status_carries_the_estimate(tmp_path):
    from support.swarm_harness import Swarm

    with Swarm(tmp_path) as swarm:
        node = swarm.found(model="moe", threads=1, steps=20)
        memory = node.status()["memory"]
        assert memory is not None and 0 < memory["parameters"] < 10**8 and memory["algorithm"] == "dadam"
        assert memory["host_bytes"] > 0 and {t["name"] for t in memory["terms"]} >= {"parameters", "gradients"}
        assert "preflight:" in node.stderr()
        swarm.stop_all([node])


@pytest.mark.unit
def test_spes_owned_share_follows_experts_or_the_least_on_a_gpu():
    from node.runtime.preflight import ModelSize, owned_share

    size = ModelSize(100, 80, 8)
    assert owned_share(size, "cpu", None) == 1.0  # a CPU node trains every expert
    assert owned_share(size, "cuda", None) == 1 / 8  # sized to the GPU at start: the least must fit
    assert owned_share(size, "cuda", 2) == 2 / 8 and owned_share(size, "cpu", 99) == 1.0
    assert owned_share(ModelSize(100), "cuda", None) == 1.0


@pytest.mark.unit
def test_the_refusal_names_an_algorithm_that_fits():
    from node.runtime.preflight import Machine, judge

    inputs = MemoryInputs(10**9, "diloco", "cpu", codec="bf16")
    dsgd = footprint(MemoryInputs(10**9, "dsgd", "cpu", inner="sgd", codec="bf16"))
    fits, line = judge(inputs, Machine(dsgd.host_bytes + 1, None))
    assert line is not None and "dsgd fits with ~" in line and "diloco" not in line.split("; ", 1)[1]
    # the largest model this machine takes with diloco: its RAM over diloco's bytes per parameter
    largest = (dsgd.host_bytes + 1) / footprint(inputs).host_per_parameter
    assert f"fits up to ~{largest / 1e9:.2f}B parameters with this algorithm" in line
    assert judge(inputs, Machine(fits.host_bytes, None))[1] is None  # exactly enough: it fits


@pytest.mark.unit
def test_a_malformed_mock_is_a_startup_error_naming_the_variable(monkeypatch):
    from node.runtime.errors import StartupError
    from node.runtime.preflight import MOCK_ENV, preflight

    settings = settings_for()
    assert settings.training is not None
    monkeypatch.setenv(MOCK_ENV, "ram=lots")
    with pytest.raises(StartupError, match=f"^{MOCK_ENV}: expected ram=SIZE"):
        preflight(settings.training, settings, "cpu")


@pytest.mark.unit
def test_experts_are_counted_in_the_embedded_and_the_fused_transformers_layout():
    from node.runtime.preflight import parameter_split

    for model in ("moe", "hf-tiny-mixtral"):
        settings = settings_for("--model", model)
        assert settings.training is not None
        size = parameter_split(settings.training)
        assert size is not None and 0 < size.expert_parameters < size.parameters and size.experts_per_layer > 1, model


@pytest.mark.unit
def test_a_node_that_fits_only_without_scoring_is_told_so():
    from node.runtime.preflight import Machine, judge

    inputs = MemoryInputs(10**9, "dadam", "cpu", in_neighbours=1, scoring=True)
    on, off = footprint(inputs).host_bytes, footprint(MemoryInputs(10**9, "dadam", "cpu", in_neighbours=1)).host_bytes
    _, refusal = judge(inputs, Machine(ram=(on + off) // 2, vram=None))
    assert refusal is not None and "--score-every 0 (no contribution scoring) fits" in refusal
    _, roomy = judge(inputs, Machine(ram=on, vram=None))
    assert roomy is None
