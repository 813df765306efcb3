"""The tier-marker rule for every test, and fixtures shared by the in-process training tests."""

from collections.abc import Iterator

import pytest
import torch

from node.train.data import Corpus, embedded_corpus

pytest_plugins = ["pytester", "support.tiers"]  # the tier-marker rule; pytester for its test


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    # several trainers share two cores: more intra-op threads than cores only adds waiting
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    """A small embedded corpus: enough text for the tiny models, quick to build."""
    return embedded_corpus(size_bytes=600_000)
