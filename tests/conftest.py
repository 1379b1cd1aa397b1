"""The tests' shared material; and the repository root made importable (``import norms``) however
pytest is run."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import signal
import socket

import pytest
import torch

import train
from machinery import toy_corpus, train_cli
from model import EOS, ModelConfig, Transformer
from norms import use_reference

# The tests' shared material, in one place: a tiny translator run's flags (d 32, one layer, 5 steps
# an epoch) and a small one's (d 64, two layers), the built-in corpus at two sizes, the words of the
# decoding tests, a tiny model.
TINY = [
    "--d-model",
    "32",
    "--ff",
    "64",
    "--heads",
    "2",
    "--layers",
    "1",
    "--bpe-size",
    "300",
    "--batch-tokens",
    "512",
    "--epoch-size",
    "5",
    "--threads",
    "1",
    "--log-interval",
    "5",
    "--dev-beam",
    "1",
    "--beam",
    "1",
]
SMALL = [
    "--d-model",
    "64",
    "--ff",
    "256",
    "--heads",
    "4",
    "--layers",
    "2",
    "--batch-tokens",
    "1024",
    "--threads",
    "1",
    "--log-interval",
    "10",
    "--dropout",
    "0.1",
    "--bpe-size",
    "1000",
]
# The decoding tests' words.
WORDS = [
    "the",
    "cat",
    "dog",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "ran",
    "to",
    "house",
    "big",
    "small",
    "red",
    "blue",
]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The built-in language pair (300 training pairs, 8 dev, 8 test) as train.py's flags."""
    d = toy_corpus.make_toy_corpus(tmp_path_factory.mktemp("toy"), n_train=300, n_dev=8, n_test=8)
    return ["--data", str(d), "--src", "src", "--tgt", "tgt"]


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A small copy of the built-in language pair (3000 pairs, for a fast evaluation) as train.py's
    flags."""
    d = tmp_path_factory.mktemp("toy")
    toy_corpus.make_toy_corpus(d, seed=1, n_train=3000, n_dev=40, n_test=40)
    return ["--data", str(d), "--src", "src", "--tgt", "tgt"]


def tiny_model(vocab_size=40, seed=0, mask=None, eos_bias=2.0, scale=4.0, g=None, **cfg):
    """A random 2+2-layer model (d 32) in eval mode; weights x scale so that the layers matter, the
    final g (if given) sets peakiness (logit = g cos(h, e_w) + b_w), the EOS bias makes outputs end,
    at varied lengths."""
    torch.manual_seed(seed)
    c = dict(vocab_size=vocab_size, d_model=32, heads=4, ff=64, enc_layers=2, dec_layers=2, **cfg)
    model = Transformer(ModelConfig(**c), tgt_vocab_mask=mask)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name != "embed":
                p.mul_(scale)
        if g is not None:
            model.dec_final_norm.g.fill_(g)
        model.out_bias[EOS] = eos_bias
    return model.eval()


@pytest.fixture
def reference():
    """--reference for one test: every equation as written, no fast path."""
    use_reference(True)
    yield
    use_reference(False)


def gloo_unusable_reason():
    """None, or why 2 local gloo processes cannot run here (then the tests skip, saying so)."""
    if not torch.distributed.is_available():
        return "this torch build has no torch.distributed"
    if not torch.distributed.is_gloo_available():
        return "this torch build has no gloo backend"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        return f"cannot bind a TCP port on 127.0.0.1 for the rendezvous: {e}"
    return None


@pytest.fixture
def killed_run(monkeypatch, capsys):
    """killed_run(argv, n, sig=None): train.py's main (machinery/train_cli.py) on argv, interrupted
    at its n-th training step. With sig None the interrupt comes inside the step, as a second
    Ctrl-C does (the run resumes from its last checkpoint before). With a signal (SIGINT, SIGTERM),
    it is sent to this process as the step starts, which stops the run after that step, with its
    checkpoint. It exits as train.py does, status 128 + the signal (its message is returned);
    train_step is restored for the resume."""

    def run(argv, n, sig=None):
        real_step, calls = train.train_step, {"n": 0}

        def dying_step(*a, **k):
            calls["n"] += 1
            if calls["n"] == n and sig is None:
                raise KeyboardInterrupt
            if calls["n"] == n:
                signal.raise_signal(sig)  # the handler runs here, in the main thread
            return real_step(*a, **k)

        monkeypatch.setattr(train, "train_step", dying_step)
        with pytest.raises(SystemExit) as e:
            train_cli.main(argv)
        monkeypatch.setattr(train, "train_step", real_step)
        assert e.value.code == 128 + (sig or signal.SIGINT)
        return capsys.readouterr().err.strip().splitlines()[-1]

    return run


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The tests' models are tiny: one intra-op thread is faster than two (and much faster on
    a busy 2-core machine). Restored at the end of the session."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
