"""What a node takes from the swarm's recipe: a model given by import path is user code, which a
joiner imports only if its own --model names the same builder."""

import pytest

from node.training.recipe import RecipeInvalid, check_model_allowed

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
