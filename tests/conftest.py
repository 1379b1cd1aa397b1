"""Make the repository root importable (``import norms``, ``import model``) however pytest is run."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
import torch


@pytest.fixture
def killed_run(monkeypatch):
    """killed_run(argv, n): train.main(argv) interrupted (Ctrl-C) at its n-th training step; it
    exits as train.py does on Ctrl-C (its message is returned), and train_step is restored for the resume."""
    import train

    def run(argv, n):
        real_step, calls = train.train_step, {"n": 0}

        def dying_step(*a, **k):
            calls["n"] += 1
            if calls["n"] == n:
                raise KeyboardInterrupt
            return real_step(*a, **k)

        monkeypatch.setattr(train, "train_step", dying_step)
        with pytest.raises(SystemExit) as e:
            train.main(argv)
        monkeypatch.setattr(train, "train_step", real_step)
        return str(e.value.code)

    return run


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The tests' models are tiny: one intra-op thread is faster than two (and much faster on
    a busy 2-core machine). Restored at the end of the session."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
