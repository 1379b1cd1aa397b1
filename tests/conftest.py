"""Make the repository root importable (``import norms``, ``import model``) however pytest is run."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The tests' models are tiny: one intra-op thread is faster than two (and much faster on
    a busy 2-core machine). Restored at the end of the session."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
