"""Test-wide settings: no hub access, one thread (tiny models on a shared 2-core machine)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
