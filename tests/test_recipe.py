"""The swarm's recipe: its declared schema and every bound of it, the documents it keeps byte for byte,
and what a node takes from it (a model given by import path is user code, which a joiner imports only
if its own --model names the same builder)."""

import copy
import json
import math
import typing
from collections.abc import Iterator
from dataclasses import replace

import msgspec
import pytest

from gossip.optimizers import ALGORITHMS
from gossip.spes.rules import REFRESH_CODECS
from node.config import NODE_CODECS, GossipConfig, NodeConfig, TrainingConfig
from node.net.records import canonical_config_bytes, membership_shards
from node.runtime import founding
from node.swarm import recipe
from node.swarm.recipe import RecipeInvalid, check_model_allowed
from topology import TOPOLOGY_NAMES, WEIGHT_SCHEMES, TopologySpec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("swarm_model, own_model", [
    ("moe", "moe"), ("moe", "dense"), ("dense", "moe"), ("vector", "moe"),  # embedded: always allowed
    ("tiny_model:build", "tiny_model:build"),  # user code the node named itself
])
def test_embedded_models_and_named_builders_are_allowed(swarm_model, own_model):
    check_model_allowed(swarm_model, own_model)


@pytest.mark.parametrize("swarm_model, own_model", [
    ("os:abort", "moe"),  # a config written by anyone in the DHT must not make a joiner call this
    ("tiny_model:build", "tiny_model:build_failing"),
    ("tiny_model:build", "moe"),
])
def test_a_builder_the_node_did_not_name_is_refused_with_the_flag_to_allow_it(swarm_model, own_model):
    with pytest.raises(RecipeInvalid) as refused:
        check_model_allowed(swarm_model, own_model)
    assert str(refused.value) == (f"the swarm trains the model built by {swarm_model!r}, code this node would "
                                  f"import and run; start it with --model {swarm_model} to allow that")


# ---- the declared schema of `<swarm>.config` ------------------------------------------------------




# Documents as murmur published them before the schema was declared: their bytes, and so their config
# hash, must survive a decode and re-encode (every swarm running today keeps its hash).
MODEL_DOC = {
    "version": 2, "epoch": 1234.5,
    "payload": {"kind": "model", "model": "moe", "seed": 3, "batch_size": 16, "context": 128, "steps": 500,
                "optimizer": {"algorithm": "dadam", "lr": 0.003, "warmup_steps": 10, "local_steps": 1,
                              "micro_batches": 1},
                "spes": {"sync_every": 1, "merge_every": 10, "merge_until": 100, "alpha0": 0.1, "replication": 2,
                         "refresh_codec": "bf16", "expert_codec": "fp32"}},
    "gossip": {"topology": {"name": "custom", "weights": None, "degree": 4, "seed": 0, "rows": None,
                            "edges": [[0, 1], [1, 2]], "directed": True},
               "codec": "fp32", "round_interval_s": 0.4, "max_staleness_rounds": 2,
               "mixing": {"kind": "clipped", "tau": 0.5, "trim": 0.2}},
}
VECTOR_DOC = {
    "version": 2, "epoch": 99.0,
    "payload": {"kind": "vector", "dim": 64},
    "gossip": {"topology": {"name": "torus", "weights": "uniform", "degree": 4, "seed": 0, "rows": 2,
                            "edges": [], "directed": False},
               "codec": "int8", "round_interval_s": 1.0, "max_staleness_rounds": 2,
               "mixing": {"kind": "weighted", "tau": None, "trim": 0.2}},
}
KEY_CHECK = "ab" * 32
ADMISSION_DOC = {**VECTOR_DOC, "admission": {"mode": "key", "key_check": KEY_CHECK}}


@pytest.mark.parametrize("doc", [MODEL_DOC, VECTOR_DOC, ADMISSION_DOC])
def test_a_published_document_keeps_its_bytes_and_hash_through_the_schema(doc):
    document = recipe.parse_document(doc)
    assert canonical_config_bytes(recipe.document_dict(document)) == canonical_config_bytes(doc)
    assert recipe.document_from_json(canonical_config_bytes(doc)) == document


def test_a_founders_settings_give_the_document_murmur_always_published():
    config = NodeConfig(seed=3, identity_work=0, gossip=GossipConfig(
        topology=TopologySpec("custom", edges=((0, 1), (1, 2)), directed=True), round_interval_s=0.4,
        mixing=recipe.MixingRule(kind="clipped", tau=0.5, trim=0.2), codec="fp32", max_staleness_rounds=2),
        training=TrainingConfig(model="moe", optimizer="dadam", lr=0.003, warmup_steps=10, steps=500, local_steps=1,
                                micro_batches=1, batch_size=16, context=128, spes=True, spes_sync_every=1,
                                spes_merge_every=10, spes_merge_until=100, spes_alpha0=0.1, spes_replication=2,
                                spes_refresh_codec="bf16", spes_expert_codec="fp32", spes_shared_codec="fp32",
                                spes_delta_refresh=False))
    assert founding.swarm_document(config, 1234.5) == MODEL_DOC
    # SPES's sync knobs of issue 15 go beside `spes`, so the document above (SPES as before) keeps its bytes
    compressed = replace(config, training=replace(config.training, spes_shared_codec="int8", spes_delta_refresh=True))
    assert founding.swarm_document(compressed, 1234.5)["payload"] == {
        **MODEL_DOC["payload"], "spes_sync": {"shared_codec": "int8", "delta_refresh": True}}
    # open admission leaves the document (and its hash) as it was; key admission adds its part
    assert founding.swarm_document(config, 1234.5, recipe.AdmissionDoc(mode=recipe.AdmissionMode.OPEN)) == MODEL_DOC
    with_key = founding.swarm_document(config, 1234.5, recipe.AdmissionDoc(mode=recipe.AdmissionMode.KEY, key_check=KEY_CHECK))
    assert with_key == {**MODEL_DOC, "admission": {"mode": "key", "key_check": KEY_CHECK}}
    # an open swarm's proof of work per identity is written only when asked for (0 keeps the bytes above),
    # and never in a key swarm, whose identities cost the founder's key instead
    worked = replace(config, identity_work=20)
    assert founding.swarm_document(worked, 1234.5) == {**MODEL_DOC, "identity_work": 20}
    assert "identity_work" not in founding.swarm_document(
        worked, 1234.5, recipe.AdmissionDoc(mode=recipe.AdmissionMode.KEY, key_check=KEY_CHECK))
    # membership shards are written only above one (one is the unsharded key, the bytes above), and are
    # held to 1..MAX_MEMBERSHIP_SHARDS when read back
    sharded = founding.swarm_document(replace(config, membership_shards=8), 1234.5)
    assert sharded == {**MODEL_DOC, "membership_shards": 8}
    assert founding.swarm_document(replace(config, membership_shards=1), 1234.5) == MODEL_DOC
    assert membership_shards(sharded) == 8 and membership_shards(MODEL_DOC) == 1
    for bad in (0, recipe.MAX_MEMBERSHIP_SHARDS + 1):
        with pytest.raises(recipe.RecipeInvalid, match="membership_shards"):
            recipe.parse_document({**MODEL_DOC, "membership_shards": bad})
        assert membership_shards({"membership_shards": bad}) == 1
    assert membership_shards({"membership_shards": True}) == 1


def test_the_schemas_names_are_the_projects():
    assert typing.get_args(recipe.TopologyName) == TOPOLOGY_NAMES
    assert typing.get_args(recipe.WeightScheme) == WEIGHT_SCHEMES
    assert typing.get_args(recipe.CodecName) == NODE_CODECS
    assert typing.get_args(recipe.RefreshCodecName) == REFRESH_CODECS
    assert typing.get_args(typing.get_type_hints(recipe.OptimizerDoc)["algorithm"]) == ALGORITHMS
    assert typing.get_type_hints(recipe.AdmissionDoc)["mode"] is recipe.AdmissionMode


Path = tuple[str | int, ...]


def _value_at(doc: dict, path: Path) -> object:
    for part in path:
        doc = doc[part]
    return doc


def _with(doc: dict, path: Path, value: object) -> dict:
    out = copy.deepcopy(doc)
    target = out
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return out


def _constrained(info: msgspec.inspect.Type, value: object, path: Path) -> Iterator[tuple[Path, msgspec.inspect.Type]]:
    """Every constrained leaf of the schema along the document `value` (unions follow the member present)."""
    if isinstance(info, msgspec.inspect.Metadata):  # a knob declared with its help (gossip.knobs)
        info = info.type
    if isinstance(info, msgspec.inspect.UnionType):
        for member in info.types:
            if isinstance(member, msgspec.inspect.StructType) and isinstance(value, dict):
                tag = getattr(member, "tag", None)
                if tag is None or value.get(member.tag_field) == tag:
                    yield from _constrained(member, value, path)
                    return
            elif not isinstance(member, msgspec.inspect.NoneType) and value is not None:
                yield from _constrained(member, value, path)
                return
        return
    if isinstance(info, msgspec.inspect.StructType):
        for field in info.fields:
            if field.encode_name in value:
                yield from _constrained(field.type, value[field.encode_name], (*path, field.encode_name))
        return
    if isinstance(info, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
        yield path, info
        if value:
            yield from _constrained(info.item_type, value[0], (*path, 0))
        return
    if isinstance(info, msgspec.inspect.TupleType):
        for i, item in enumerate(info.item_types):
            yield from _constrained(item, value[i], (*path, i))
        return
    yield path, info


def _cases() -> Iterator[tuple[str, dict, Path, object, bool]]:
    """(what, base document, path, value, accepted) for each side of every declared bound."""
    for doc in (MODEL_DOC, VECTOR_DOC, ADMISSION_DOC):
        for path, info in _constrained(msgspec.inspect.type_info(recipe.SwarmDocument), doc, ()):
            name = ".".join(map(str, path))
            if path == ("version",):
                continue  # the format, checked before the schema (test_a_document_breaking_a_rule...)
            if isinstance(info, msgspec.inspect.IntType):
                for bound, inside, outside in (("ge", 0, -1), ("gt", 1, 0), ("le", 0, 1), ("lt", -1, 0)):
                    limit = getattr(info, bound)
                    if limit is not None:
                        yield f"{name} {bound} {limit}", doc, path, limit + inside, True
                        yield f"{name} {bound} {limit}", doc, path, limit + outside, False
                yield f"{name} a bool", doc, path, True, False
            elif isinstance(info, msgspec.inspect.FloatType):
                for bound, into in (("ge", math.inf), ("gt", math.inf), ("le", -math.inf), ("lt", -math.inf)):
                    limit = getattr(info, bound)
                    if limit is not None:  # the closest floats on either side of the bound
                        inside = limit if bound in ("ge", "le") else math.nextafter(limit, into)
                        outside = math.nextafter(limit, -into) if bound in ("ge", "le") else limit
                        yield f"{name} {bound} {limit}", doc, path, inside, True
                        yield f"{name} {bound} {limit}", doc, path, outside, False
                yield f"{name} NaN", doc, path, math.nan, False
                yield f"{name} inf", doc, path, math.inf, False
            elif isinstance(info, msgspec.inspect.StrType):
                if info.max_length is not None:
                    yield f"{name} max_length", doc, path, "a" * (info.max_length + 1), False
                if info.pattern is not None:
                    yield f"{name} pattern", doc, path, "not a valid one!", False
            elif isinstance(info, msgspec.inspect.LiteralType | msgspec.inspect.EnumType):
                yield f"{name} unknown", doc, path, "no-such-choice", False
            elif isinstance(info, msgspec.inspect.VarTupleType) and info.max_length is not None:
                items = _value_at(doc, path)
                item = items[0] if items else [0, 1]  # type: ignore[index]
                yield f"{name} max_length", doc, path, [item] * (info.max_length + 1), False


CASES = list(_cases())


def test_every_declared_bound_is_checked():
    """The walk above sees the bounds this module promises (a new bounded field is checked automatically)."""
    names = {what for what, *_ in CASES}
    for promised in ("gossip.max_staleness_rounds le 16", "gossip.round_interval_s ge 0.001",
                     "payload.optimizer.lr gt 0.0", "payload.batch_size le 4096", "payload.context le 131072",
                     "payload.steps le 1000000000", "gossip.topology.edges max_length", "gossip.topology.degree le 256",
                     "gossip.topology.rows le 65536", "payload.dim le 134217728", "gossip.codec unknown",
                     "gossip.mixing.kind unknown", "gossip.mixing.tau NaN", "payload.spes.replication le 64",
                     "payload.spes.refresh_codec unknown", "payload.model pattern", "admission.key_check pattern",
                     "epoch inf", "gossip.topology.edges.0.1 lt 65536"):
        assert promised in names, promised
    assert len(CASES) > 100


@pytest.mark.parametrize("what, doc, path, value, accepted", CASES, ids=[f"{c[0]} {'ok' if c[4] else 'refused'}"
                                                                        for c in CASES])
def test_a_recipe_field_is_refused_exactly_beyond_its_bound(what, doc, path, value, accepted):
    changed = _with(doc, path, value)
    if accepted:  # the schema takes the bound itself (rules across fields may still refuse the document)
        msgspec.convert(changed, recipe.SwarmDocument)
        return
    with pytest.raises(recipe.RecipeInvalid) as refused:
        recipe.parse_document(changed)
    where = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in path).replace(".[", "[")
    assert str(refused.value).startswith(f"the swarm's config is invalid: {where}: "), str(refused.value)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(version=3), "the swarm's config has version 3; this murmur reads 2"),
    (lambda d: d.update(version=True), "the swarm's config has version True; this murmur reads 2"),
    (lambda d: d.update(extra=1), "the swarm's config is invalid: object contains unknown field `extra`"),
    (lambda d: d["gossip"].update(extra=1), "the swarm's config is invalid: gossip: object contains unknown field"),
    (lambda d: d["payload"].update(kind="weights"), "the swarm's config is invalid: payload.kind: invalid value 'weights'"),
    (lambda d: d["gossip"].pop("codec"), "the swarm's config is invalid: gossip: object missing required field `codec`"),
    (lambda d: d["gossip"]["topology"].update(edges=[]), "the swarm's config is invalid: the custom topology needs an"),
    (lambda d: d["payload"]["spes"].update(merge_every=3, sync_every=2), "the swarm's config is invalid: spes config: merge_every (3) must be a multiple"),
    (lambda d: d["gossip"]["mixing"].update(tau=None), "the swarm's config is invalid: mixing kind 'clipped' needs a clipping radius tau"),
])
def test_a_document_breaking_a_rule_is_refused_in_one_line(change, message):
    doc = copy.deepcopy(MODEL_DOC)
    change(doc)
    with pytest.raises(recipe.RecipeInvalid) as refused:
        recipe.parse_document(doc)
    assert str(refused.value).startswith(message), str(refused.value)
    assert "\n" not in str(refused.value)
    with pytest.raises(recipe.RecipeInvalid):  # the DHT validators' path (JSON bytes) refuses it the same way
        recipe.document_from_json(json.dumps(doc).encode())


def test_json_that_is_not_a_document_is_refused():
    for raw in (b"", b"[]", b"{", b'{"version": 2}', b"\xff"):
        with pytest.raises(recipe.RecipeInvalid):
            recipe.document_from_json(raw)


def test_a_founder_whose_flags_break_a_bound_gets_the_field_named():
    config = NodeConfig(gossip=GossipConfig(max_staleness_rounds=17))
    with pytest.raises(recipe.RecipeInvalid, match=r"gossip\.max_staleness_rounds: expected `int` <= 16"):
        founding.swarm_document(config, 0.0)


def test_settings_read_back_from_a_document():
    settings = recipe.SwarmSettings.from_doc(ADMISSION_DOC)
    assert settings.admission is recipe.AdmissionMode.KEY and settings.dim == 64 and settings.max_staleness == 2
    assert recipe.SwarmSettings.from_doc(MODEL_DOC).admission is recipe.AdmissionMode.OPEN
    trained = recipe.SwarmSettings.from_doc(MODEL_DOC).training
    assert trained is not None and trained.spes is not None and trained.optimizer.lr == 0.003
    assert founding.same_recipe({**MODEL_DOC, "epoch": 5.0}, NodeConfig(seed=3)) is False

@pytest.mark.parametrize("argv, env, message", [
    (["node", "--max-staleness", "17"], {}, "--max-staleness: expected `int` <= 16"),
    (["node", "--round-interval", "0.0001"], {}, "--round-interval: expected `float` >= 0.001"),
    (["node"], {"MURMUR_LR": "11"}, "MURMUR_LR: expected `float` <= 10.0"),
    (["node", "--batch-size", "5000"], {}, "--batch-size: expected `int` <= 4096"),
])
def test_a_founder_is_refused_a_recipe_its_swarm_would_refuse(argv, env, message, tmp_path):
    from node.cli.main import parse_node_config
    from node.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        parse_node_config([*argv, "--data-dir", str(tmp_path)], env)
    assert str(refused.value) == message


def test_every_document_field_names_a_setting():
    from node.config import SETTINGS_BY_KEY

    assert all(key is None or key in SETTINGS_BY_KEY for key in founding.SETTING_OF_FIELD.values())
