"""--dtype on the CPU as on a GPU: bf16 autocast where asked (native or emulated), fp32 by default
on the CPU and under --reference; one rule (model.precision), said on the first screen and
recorded; the CPU fast paths equal their fp32 selves within bf16's rounding; MFU under 100%."""

import json
from functools import partial
from types import SimpleNamespace

import pytest
import torch

import data
import decode
import model
from conftest import TINY, WORDS, tiny_model
from machinery import speed, train_cli
from model import ModelConfig, Transformer, fast_dropout, precision
from norms import use_reference

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "flags, native",
    [("flags : fpu avx2 avx512_bf16 amx_tile", True), ("Features : fp asimd bf16", True)]
    + [("flags : fpu sse avx2 avx512f", False)],
)
def test_a_cpu_computes_bf16_natively_where_its_flags_say_so(monkeypatch, tmp_path, flags, native):
    """Torch's own checks first (AVX512-BF16, AMX), else /proc/cpuinfo's flags: avx512_bf16,
    amx_bf16, or Arm's bf16."""
    for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, check, lambda: False, raising=False)
    (tmp_path / "cpuinfo").write_text(f"processor : 0\n{flags}\n")
    real_open = open

    def cpuinfo(path, *a, **k):
        return real_open(tmp_path / "cpuinfo" if path == "/proc/cpuinfo" else path, *a, **k)

    monkeypatch.setattr(model, "open", cpuinfo, raising=False)
    assert model.has_bf16(CPU) is native
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert model.has_bf16(CPU)  # torch's own check is enough


@pytest.mark.parametrize("native", [True, False])
def test_the_precision_rule_on_a_cpu(monkeypatch, native):
    """auto: fp32 on a CPU (until measured); bf16: bf16, said to be slower where emulated; fp32:
    fp32; --reference: fp32 whatever --dtype says. The words say whether this CPU is native."""
    monkeypatch.setattr(model, "cpu_has_bf16", lambda: native)
    said = "computes bf16 natively" if native else "has no native bf16"
    bf16, why = precision(CPU, "auto")
    assert not bf16 and said in why and "--dtype bf16" in why
    bf16, why = precision(CPU, "bf16")
    assert bf16 and said in why and ("slower than fp32" in why) is (not native)
    assert precision(CPU, "fp32")[0] is False
    use_reference(True)
    try:
        bf16, why = precision(CPU, "bf16")
        assert not bf16 and "--reference" in why
    finally:
        use_reference(False)


def test_fast_dropout_in_bf16_draws_the_same_mask_as_in_fp32():
    """The same random numbers give the same mask in either dtype; forward and backward agree to
    bf16's rounding (its scale 1 / (1 - p') is a bf16 number)."""
    x = torch.randn(64, 50)
    x32, x16 = x.clone().requires_grad_(True), x.bfloat16().requires_grad_(True)
    dy = torch.randn(64, 50)
    torch.manual_seed(3)
    y32 = fast_dropout(x32, 0.3, relu=True)
    torch.manual_seed(3)
    y16 = fast_dropout(x16, 0.3, relu=True)
    assert torch.equal(y32 == 0, y16 == 0)
    torch.testing.assert_close(y16.float(), y32, rtol=1e-2, atol=1e-2)
    y32.backward(dy)
    y16.backward(dy.bfloat16())
    torch.testing.assert_close(x16.grad.float(), x32.grad, rtol=1e-2, atol=1e-2)


def losses_and_grads(cfg, src, tgt_in, tgt_out, bf16):
    """One training forward and backward of a fresh model (seed 0, dropout from seed 1) on the
    CPU, fast paths on: the loss and every parameter's gradient, fp32 or under bf16 autocast."""
    torch.manual_seed(0)
    net = Transformer(cfg, tgt_vocab_mask=None if cfg.lm else torch.arange(cfg.vocab_size) < 30)
    net.train()
    torch.manual_seed(1)
    with model.autocast(CPU, bf16):
        loss, _ = net(src, tgt_in, tgt_out, 0.1)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("translator (fused dropout, SDPA, target-word loss)", {}),
        ("multi-linear attention", dict(lm=True, attention="multilinear", seq_len=8)),
        (
            "multi-linear, relative positions",
            dict(lm=True, attention="multilinear", seq_len=8, positions="relative"),
        ),
    ],
)
def test_each_cpu_fast_path_under_bf16_equals_its_fp32_self(kind, extra):
    """The whole training step's fast paths (model.py Appendix A and B) under CPU bf16 autocast,
    against the same fast paths in fp32, which the tests of model.py hold equal to the main text:
    the loss to 1%, all the gradients together to 6% of their norm and each weight matrix's to 15%
    (bf16 keeps 8 bits of mantissa; measured: 0.1%, 4% and 9% at most). A scalar's gradient, a sum
    that nearly cancels, is held by the total only."""
    cfg = ModelConfig(
        vocab_size=40, d_model=32, heads=4, ff=64, enc_layers=1, dec_layers=2, dropout=0.1, **extra
    )
    g = torch.Generator().manual_seed(2)
    B, T = 4, 8
    tgt = torch.randint(4, 40, (B, T + 1), generator=g)
    src = None if cfg.lm else torch.randint(4, 40, (B, 7), generator=g)
    loss32, grads32 = losses_and_grads(cfg, src, tgt[:, :-1], tgt[:, 1:], bf16=False)
    loss16, grads16 = losses_and_grads(cfg, src, tgt[:, :-1], tgt[:, 1:], bf16=True)
    assert loss16.dtype == torch.float32  # the loss itself is computed in fp32
    torch.testing.assert_close(loss16, loss32, rtol=1e-2, atol=0)
    assert grads16.keys() == grads32.keys()
    # The weights and their gradients stay fp32.
    assert all(g.dtype == torch.float32 for g in grads16.values())
    all32, all16 = (torch.cat([g[k].flatten() for k in grads32]) for g in (grads32, grads16))
    assert (all16 - all32).norm() <= 0.06 * all32.norm(), kind
    for name, g32 in grads32.items():
        if g32.dim() >= 2:
            assert (grads16[name] - g32).norm() <= 0.15 * g32.norm(), (kind, name)


def dtypes_seen(net, fn):
    """The dtypes of every Linear layer's output while fn() runs."""
    seen = set()

    def hook(module, inputs, output):
        seen.add(output.dtype)

    hooks = [m.register_forward_hook(hook) for m in net.modules() if isinstance(m, torch.nn.Linear)]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.fixture(scope="module")
def words():
    """A BPE tokenizer of WORDS (data.py's), and lines of them."""
    g = torch.Generator().manual_seed(0)
    lines = [
        " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(n),), generator=g))
        for n in torch.randint(2, 9, (60,), generator=g)
    ]
    return data.Tokenizer(data.train_bpe(lines[:30], lines[30:], 60)), lines[:6]


def test_decoding_computes_in_the_precision_it_is_given(words):
    """Greedy and beam search, a language model's perplexity and continuations run their matmuls
    in bf16 under bf16=True and in fp32 otherwise (the default), on the CPU too."""
    tok, lines = words
    mt = tiny_model(vocab_size=tok.vocab_size)
    lm = tiny_model(vocab_size=tok.vocab_size, lm=True)
    for bf16, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        for beam in (1, 3):
            search = decode.Search(beam, bf16=bf16)
            seen = dtypes_seen(mt, partial(decode.translate, mt, tok, lines, search))
            assert seen == {dtype}, (beam, bf16, seen)
        ppl = partial(decode.lm_perplexity, lm, tok, lines, 4, bf16=bf16)
        assert dtypes_seen(lm, ppl) == {dtype}, ("ppl", bf16)
        more = partial(decode.generate, lm, tok, lines[0], 4, max_tokens=3, bf16=bf16)
        assert dtypes_seen(lm, more) == {dtype}, ("generate", bf16)


def train_run(tmp_path, corpus, *flags):
    out = tmp_path / "run"
    result = train_cli.main(TINY + corpus + ["--out", str(out), *flags])
    return out, result


def test_a_toy_run_learns_in_bf16_on_the_cpu_and_records_its_precision(tmp_path, corpus, capsys):
    out, result = train_run(tmp_path, corpus, "--dtype", "bf16", "--max-epochs", "8")
    assert "precision: bf16 autocast (this CPU" in capsys.readouterr().out
    assert result["precision"] == "bf16"
    assert json.loads((out / "config.json").read_text())["precision"] == "bf16"
    assert json.loads((out / "results.json").read_text())["precision"] == "bf16"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 40
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses  # it learns


@pytest.mark.parametrize("flags", [["--dtype", "bf16", "--reference"], []])
def test_reference_and_the_cpus_default_compute_in_fp32(tmp_path, corpus, flags):
    """--reference runs every equation as written, in fp32, whatever --dtype asks; --dtype auto
    (the default) is fp32 on the CPU."""
    out, result = train_run(tmp_path, corpus, "--max-steps", "5", *flags)
    assert result["precision"] == "fp32"
    assert json.loads((out / "config.json").read_text())["precision"] == "fp32"


def test_mfus_denominator_is_the_fastest_of_the_steps_own_matmuls(monkeypatch):
    """pn2-script's MFU read 98-110%: its 10,000-word output layer multiplied faster than the one
    shape the denominator timed, the feed-forward's. With a timer under which the output layer's
    shape is the fastest (100 GFLOP/s, the others 10), the denominator is that one's rate, in the
    step's precision."""
    net = Transformer(ModelConfig(vocab_size=500, d_model=32, heads=2, ff=64))
    cols, seen = net.target_ids.numel(), []  # the output layer's columns a step computes

    class Timer:  # torch.utils.benchmark.Timer, answering from the shapes' made-up rates
        def __init__(self, stmt, globals, num_threads):
            a, b = globals["a"], globals["b"]
            seen.append(a.dtype)
            rate = 100e9 if b.shape[1] == cols else 10e9
            self.seconds = 2 * a.shape[0] * a.shape[1] * b.shape[1] / rate

        def blocked_autorange(self, min_run_time):
            return SimpleNamespace(times=[self.seconds])

    monkeypatch.setattr(speed, "Timer", Timer)
    for bf16, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        run = SimpleNamespace(
            args=SimpleNamespace(d_model=32, ff=64),
            model=net,
            device=CPU,
            step_options=SimpleNamespace(bf16=bf16),
        )
        assert speed.matmul_flops(run, tokens=64) == pytest.approx(100e9)
        assert set(seen[-4:]) == {dtype}


def test_a_steps_mfu_stays_under_100_percent(corpus):
    """A whole --benchmark: the step's FLOP/s stay under the denominator's. (The 98-110% of
    pn2-script needs its full size to show; the test above holds the rule that prevents it.)"""
    small = ["--d-model", "16", "--ff", "32", "--heads", "2", "--layers", "1", "--threads", "1"]
    result = train_cli.main(
        small + corpus + ["--bpe-size", "2000", "--batch-tokens", "2048", "--benchmark", "3"]
    )
    assert 0 < result["mfu"] < 1, result["mfu"]
    assert result["matmul_peak_flops"] >= result["achieved_flops"]


def test_the_mfu_denominator_times_the_steps_own_shapes():
    """gemm_shapes: the projections (D -> D), the feed-forward's two and the output layer's (the
    target words a step computes)."""
    net = Transformer(ModelConfig(vocab_size=300, d_model=32, heads=2, ff=64))
    run = SimpleNamespace(args=SimpleNamespace(d_model=32, ff=64), model=net)
    d, ff, cols = 32, 64, net.target_ids.numel()
    assert speed.gemm_shapes(run, 10) == [(10, d, d), (10, d, ff), (10, ff, d), (10, d, cols)]
