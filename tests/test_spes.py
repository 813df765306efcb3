"""SPES rules without a network (gossip.spes): ownership and takeover, version/hash records, the
merge warm-up's schedule, exactness and bit-identity, and the configuration's validation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from gossip.spes import (
    ExpertRecord,
    Ownership,
    SpesConfig,
    advance_record,
    assign_experts,
    bounded_records,
    capped_capacities,
    codec_image,
    content_hash,
    expert_similarity,
    freshest_holder,
    merge_alpha,
    merge_layer,
    merge_partners,
    needs_refresh,
    records_from_wire,
    records_to_wire,
    reference_sync_bytes,
    refresh_source,
    sync_bytes_sent,
    training_memory,
    version_bound,
)

pytestmark = pytest.mark.unit

IDS = [f"peer{i}" for i in range(4)]
H0, H1, H2 = "0" * 64, "1" * 64, "2" * 64


def owned_counts(ownership: Ownership) -> Counter[str]:
    return Counter(p for owners in ownership.owners.values() for p in owners)


# ---- ownership ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("replication", "capacity"), [(1, 2), (2, 4)])
def test_every_expert_is_owned_and_each_node_trains_its_capacity(replication: int, capacity: int) -> None:
    """The acceptance layout: 4 nodes, 8 experts per layer, each owning 2 (r = 1) or 4 (r = 2)."""
    ownership = assign_experts(IDS, dict.fromkeys(IDS, capacity), experts_per_layer=8, layers=3, replication=replication)
    assert set(ownership.owners) == {(layer, e) for layer in range(3) for e in range(8)}
    assert all(len(set(owners)) == replication for owners in ownership.owners.values())
    for peer in IDS:
        owned = ownership.owned_by(peer)
        assert len(owned) == 3 * capacity
        assert {e for _, e in owned if _ == 0} == {e for _, e in owned if _ == 2}  # same experts in every layer
    if replication == 2:
        # co-owner pairs differ between experts, so expert mixing also connects the swarm
        assert len({ownership.owners[(0, e)] for e in range(8)}) >= 4


def test_the_assignment_depends_on_the_view_and_capacities_not_on_their_order() -> None:
    capacities = {"c": 3, "a": 1, "d": 2, "b": 2}
    one = assign_experts(["c", "a", "d", "b"], capacities, 8, 2, 2)
    other = assign_experts(["b", "d", "a", "c", "a"], dict(sorted(capacities.items())), 8, 2, 2)
    assert dict(one.owners) == dict(other.owners)
    assert one.peer_ids == ("a", "b", "c", "d")
    counts = owned_counts(one)
    assert all(counts[p] <= 2 * capacities[p] for p in capacities)  # 2 layers


def test_coverage_comes_before_capacity_and_replication_shrinks_to_fit() -> None:
    # 3 experts of capacity for 8 experts: every expert still gets an owner (the least loaded peer)
    tight = assign_experts(["a", "b"], {"a": 2, "b": 1}, 8, 1, 2)
    assert all(len(owners) == 1 for owners in tight.owners.values())
    assert sorted(owned_counts(tight).values()) == [4, 4]
    # a peer with no capacity only owns when it must
    assert "z" not in owned_counts(assign_experts(["a", "z"], {"a": 8, "z": 0}, 8, 1, 2))
    # one peer: r = 2 cannot hold, it owns everything once
    alone = assign_experts(["a"], {"a": 8}, 8, 1, 2)
    assert all(owners == ("a",) for owners in alone.owners.values())


def test_bad_assignment_inputs_are_refused_with_the_problem_named() -> None:
    with pytest.raises(ValueError, match="at least one peer"):
        assign_experts([], {}, 8, 1, 1)
    with pytest.raises(ValueError, match="no capacity given"):
        assign_experts(["a", "b"], {"a": 1}, 8, 1, 1)
    with pytest.raises(ValueError, match="integers >= 0"):
        assign_experts(["a"], {"a": -1}, 8, 1, 1)


def test_when_all_owners_of_an_expert_leave_it_moves_to_live_peers() -> None:
    before = assign_experts(IDS, dict.fromkeys(IDS, 4), 8, 2, 2)
    gone = set(before.owners[(0, 0)])
    assert len(gone) == 2
    live = [p for p in IDS if p not in gone]
    after = assign_experts(live, dict.fromkeys(live, 4), 8, 2, 2)
    assert all(owners and set(owners) <= set(live) for owners in after.owners.values())
    assert after.owners[(0, 0)]


# ---- records -----------------------------------------------------------------------------------------


def test_a_capacity_claim_beyond_the_layer_counts_as_the_layers_expert_count() -> None:
    honest = assign_experts(IDS, dict.fromkeys(IDS, 8), 8, 2, 2)
    claimed = capped_capacities({**dict.fromkeys(IDS[:3], 8), IDS[3]: 2**62}, 8)
    assert claimed[IDS[3]] == 8
    assert assign_experts(IDS, claimed, 8, 2, 2) == honest  # the claim wins nothing over an honest full one
    uncapped = owned_counts(assign_experts(IDS, {**dict.fromkeys(IDS[:3], 2), IDS[3]: 2**62}, 8, 2, 2))
    assert uncapped[IDS[3]] == 2 * 8  # what an uncapped claim takes: every expert of both layers


def test_versions_are_bounded_by_the_sync_index_plus_a_slack() -> None:
    assert version_bound(step=100, sync_every=4, slack=64) == 25 + 64
    records = {"honest": {(0, 0): ExpertRecord(20, H0, True), (0, 1): ExpertRecord(89, H1, False)},
               "liar": {(0, 0): ExpertRecord(2**62, H2, True), (0, 1): ExpertRecord(90, H2, True)}}
    kept, dropped = bounded_records(records, 89)
    assert dropped == 2 and kept == {"honest": records["honest"], "liar": {}}


def test_a_version_moves_only_when_the_content_changes() -> None:
    first = advance_record(None, H0, 3, True)
    assert first == ExpertRecord(3, H0, True)
    assert advance_record(first, H0, 7, True).version == 3  # unchanged: never fetched again
    assert advance_record(first, H1, 7, True).version == 7
    assert not needs_refresh(ExpertRecord(3, H0, False), ExpertRecord(5, H0, True))
    assert needs_refresh(ExpertRecord(3, H0, False), ExpertRecord(5, H1, True))
    assert needs_refresh(None, ExpertRecord(0, H0, True))


def test_content_hash_covers_values_and_shapes_in_the_codec_image() -> None:
    x = np.linspace(-1, 1, 300, dtype=np.float32)
    assert content_hash([x]) == content_hash([x.copy()])
    assert content_hash([x]) != content_hash([x.reshape(3, 100)])
    y = x.copy()
    y[7] = np.nextafter(y[7], np.float32(2))
    assert content_hash([x]) != content_hash([y])
    # bf16 keeps 8 bits of mantissa: a change in the low bits vanishes from the image that travels
    assert content_hash(codec_image([x], "bf16")) == content_hash(codec_image([y], "bf16"))
    image = codec_image([x], "int8")
    assert content_hash(codec_image(image, "int8")) == content_hash(image)  # a re-sent image hashes the same


def test_refresh_comes_from_the_freshest_owner_and_takeover_from_the_freshest_holder() -> None:
    ownership = assign_experts(IDS, dict.fromkeys(IDS, 4), 8, 1, 2)
    key = (0, 0)
    a, b = ownership.owners[key]
    others = [p for p in IDS if p not in (a, b)]
    records = {a: {key: ExpertRecord(4, H0, True)}, b: {key: ExpertRecord(5, H1, True)},
               others[0]: {key: ExpertRecord(9, H2, False)}}
    assert refresh_source(key, ownership, records, others[1]) == b  # only owners serve refreshes
    assert refresh_source(key, ownership, {others[0]: records[others[0]]}, others[1]) is None
    assert freshest_holder(key, records, IDS) == (others[0], records[others[0]][key])
    assert freshest_holder(key, records, [a, b]) == (b, records[b][key])
    tie = {a: {key: ExpertRecord(5, H0, False)}, b: {key: ExpertRecord(5, H1, True)}}
    assert freshest_holder(key, tie, IDS)[0] == b  # an owner's copy before a frozen one of equal version
    assert freshest_holder(key, {}, IDS) is None


def test_records_travel_as_plain_values_and_bad_ones_are_refused() -> None:
    records = {(0, 1): ExpertRecord(2, H1, True), (1, 7): ExpertRecord(0, H0, False)}
    wire = records_to_wire(records)
    assert wire == {"0.1": [2, H1, True], "1.7": [0, H0, False]}
    assert records_from_wire(wire) == records
    for bad, match in [([1], "must be a map"), ({"x": [1, H0, True]}, "layer.expert"),
                       ({"0.1": [1, H0]}, "version, hash, owner"), ({"0.1": [-1, H0, True]}, "version"),
                       ({"0.1": [1, "zz", True]}, "hash"), ({"0.1": [1, H0, 1]}, "version, hash, owner")]:
        with pytest.raises(ValueError, match=match):
            records_from_wire(bad)
    with pytest.raises(ValueError, match="exceed"):
        records_from_wire({f"0.{i}": [0, H0, False] for i in range(5)}, max_experts=4)


# ---- merge warm-up -----------------------------------------------------------------------------------


def test_alpha_falls_linearly_from_alpha0_and_is_exactly_zero_from_d_on() -> None:
    config = SpesConfig(sync_every=2, merge_every=4, merge_until=20, alpha0=0.2)
    assert config.alpha_at(0) == 0.2
    assert config.alpha_at(10) == pytest.approx(0.1)
    assert config.alpha_at(19) == pytest.approx(0.01)
    assert config.alpha_at(20) == 0.0 and config.alpha_at(21) == 0.0
    assert [s for s in range(0, 30) if config.merges_after(s)] == [4, 8, 12, 16]
    assert merge_alpha(5, 0.3, 0) == 0.0  # D = 0: warm-up off


def test_spes_config_refuses_inconsistent_knobs() -> None:
    with pytest.raises(ValueError, match="multiple of sync_every"):
        SpesConfig(sync_every=3, merge_every=4)
    with pytest.raises(ValueError, match="refresh_codec"):
        SpesConfig(refresh_codec="topk")
    with pytest.raises(ValueError, match="alpha0"):
        SpesConfig(alpha0=1.5)
    with pytest.raises(ValueError, match="replication"):
        SpesConfig(replication=0)


def layer_of_experts(seed: int, count: int = 8, shape: tuple[int, int] = (16, 24)) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape).astype(np.float32)
    # expert i is the base plus noise growing with i: experts near in index are near in direction
    return [[(base + 0.3 * i * rng.standard_normal(shape)).astype(np.float32),
             rng.standard_normal((shape[1], shape[0])).astype(np.float32)] for i in range(count)]


def test_each_expert_moves_alpha_toward_the_mean_of_its_four_most_similar() -> None:
    experts = layer_of_experts(0)
    similarity = expert_similarity([e[0] for e in experts])
    exact = expert_similarity([e[0] for e in experts], exact=True)
    flat = np.array([e[0].reshape(-1).astype(np.float64) for e in experts])
    unit = flat / np.linalg.norm(flat, axis=1, keepdims=True)
    np.testing.assert_allclose(similarity, unit @ unit.T, rtol=0, atol=1e-12)
    np.testing.assert_allclose(exact, similarity, rtol=0, atol=1e-12)
    partners = merge_partners([e[0] for e in experts])
    assert all(len(p) == 4 and i not in p for i, p in enumerate(partners))
    assert partners[0] == (1, 2, 3, 4)
    merged = merge_layer(experts, alpha=0.25)
    for i, tensors in merged.items():
        for t, x in enumerate(tensors):
            mean = np.mean([experts[j][t].astype(np.float64) for j in partners[i]], axis=0)
            expected = experts[i][t] + 0.25 * (mean - experts[i][t])
            np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-6)
            assert x.dtype == np.float32 and x.shape == experts[i][t].shape
    assert merge_layer(experts, alpha=0.25, only=[3]).keys() == {3}
    unmoved = merge_layer(experts, alpha=0.0)
    assert all(np.array_equal(unmoved[i][t], experts[i][t]) for i in unmoved for t in range(2))


def test_a_near_tie_at_the_partner_boundary_is_decided_by_exact_cosines() -> None:
    """Experts 1..5 are equally similar to expert 0 up to one float32 ulp in a single element: the
    fast cosines cannot be trusted that close, the exact ones (ties by index) decide."""
    rng = np.random.default_rng(3)
    base = rng.standard_normal(64).astype(np.float32)
    first = [base] + [base.copy() for _ in range(5)] + [rng.standard_normal(64).astype(np.float32) for _ in range(2)]
    for k in range(1, 6):
        first[k][k] = np.nextafter(first[k][k], np.float32(np.inf) if k % 2 else np.float32(-np.inf))
    exact = expert_similarity(first, exact=True)
    ranked = sorted(range(1, 8), key=lambda j: (-exact[0, j], j))
    assert merge_partners(first)[0] == tuple(sorted(ranked[:4]))
    assert 0 not in merge_partners(first)[0]


def test_two_nodes_merge_the_same_experts_bit_identically(tmp_path: Path) -> None:
    """The second 'node' is another Python process (its own numpy state, its own import)."""
    experts = layer_of_experts(1)
    np.savez(tmp_path / "in.npz", *[t for e in experts for t in e])
    here = merge_layer([[t.copy() for t in e] for e in experts], alpha=0.07)
    script = textwrap.dedent(f"""
        import numpy as np
        from gossip.spes import merge_layer
        data = np.load({str(tmp_path / 'in.npz')!r})
        flat = [data[f"arr_{{i}}"] for i in range(len(data.files))]
        merged = merge_layer([flat[i:i + 2] for i in range(0, len(flat), 2)], alpha=0.07)
        np.savez({str(tmp_path / 'out.npz')!r}, *[t for i in sorted(merged) for t in merged[i]])
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    there = np.load(tmp_path / "out.npz")
    ours = [t for i in sorted(here) for t in here[i]]
    assert len(there.files) == len(ours)
    for k, t in enumerate(ours):
        assert there[f"arr_{k}"].tobytes() == t.tobytes()
    # and the result does not depend on the order the experts' copies were made in
    again = merge_layer([[np.array(t, order="F") for t in e] for e in experts], alpha=0.07)
    assert all(again[i][t].tobytes() == here[i][t].tobytes() for i in here for t in range(2))


# ---- traffic and memory ------------------------------------------------------------------------------


def test_analytic_traffic_and_memory_add_up() -> None:
    traffic = sync_bytes_sent(1000, 2, 300, [1, 1, 0], 160, 3)
    assert (traffic.shared, traffic.experts, traffic.refresh, traffic.total) == (2000, 600, 480, 3080)
    assert reference_sync_bytes(shared_numel=10, owned_expert_numel=5, total_numel=40) == 4 * 15 + 4 * 40
    memory = training_memory(trainable_numel=100, frozen_numel=50, optimizer_floats_per_param=2, frozen_bytes_per_param=2)
    assert (memory.parameters, memory.gradients, memory.optimizer_state) == (500, 400, 800)
