"""Claim-level tests for norms.py: each test states a paper's claim and checks it against
a formula written out here, independently of the code under test.

  [1] Nguyen & Salazar 2019, Transformers without Tears (TwT): ScaleNorm eq. 5, FixNorm,
      section 4.2 (RMSNorm with tied g_i / sqrt(d) is ScaleNorm), Table 7 (fixed g).
  [4] Zhang & Sennrich 2019, RMSNorm.     [5] Ba et al. 2016, LayerNorm.

Run: python -m pytest -q tests/test_norms.py   (CPU, a few seconds)
"""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import norms
from machinery import arguments, toy_corpus, train_cli
from norms import (
    BATCH_NORMS,
    NORMS,
    LayerNorm,
    NoNorm,
    RMSNorm,
    ScaleNorm,
    build_norm,
    fixnorm,
    use_reference,
)

B, T, D = 3, 5, 16


CORE = ["layer", "scale", "scale_fixed", "rms"]  # the norms of [1] and [4]


def rand(*shape, seed=0, dtype=torch.float64, scale=3.0):
    """Random activations with a non-zero mean and a scale far from 1 (so that a norm that
    forgets to centre or to rescale is caught)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + 0.7).to(dtype)


# The papers' equations, written out here independently of norms.py.
def eq5(x, g, eps=1e-5):
    """TwT eq. 5 with the authors' clamp: g x / max(||x||, eps)."""
    return g * x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


def rmsnorm_eq(x, w, eps):
    """[4]: w_i x_i / sqrt(mean_j x_j^2 + eps)."""
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def fixnorm_eq(w, eps=1e-12):
    return w / torch.linalg.vector_norm(w, dim=-1, keepdim=True).clamp_min(eps)


@pytest.fixture
def reference():
    """--reference for one test: every equation as written, no fast path."""
    use_reference(True)
    yield
    use_reference(False)


def pad_mask(b=B, t=T):
    """(B, T) bool, True at padding; every sentence keeps at least one real token."""
    lengths = torch.tensor([t, t - 2, 1][:b] + [t] * max(0, b - 3))
    return torch.arange(t)[None, :] >= lengths[:, None]


# ---------------------------------------------------------------------------------------
# LayerNorm [5]:  y = gamma (x - mu) / sqrt(sigma^2 + eps) + beta
# ---------------------------------------------------------------------------------------
def test_layernorm_equals_f_layer_norm():
    torch.manual_seed(0)
    ln = LayerNorm(D).double()
    with torch.no_grad():  # trained-like parameters, not the ones/zeros init
        ln.weight.copy_(torch.randn(D, dtype=torch.float64))
        ln.bias.copy_(torch.randn(D, dtype=torch.float64))
    x = rand(B, T, D)
    ref = F.layer_norm(x, (D,), ln.weight, ln.bias, eps=1e-5)  # eps 1e-5 as in the TwT code
    torch.testing.assert_close(ln(x, pad_mask()), ref, rtol=1e-12, atol=1e-12)
    # and the textbook equation, written here with the biased variance
    var, mu = torch.var_mean(x, dim=-1, keepdim=True, unbiased=False)
    eq = ln.weight * (x - mu) / torch.sqrt(var + 1e-5) + ln.bias
    torch.testing.assert_close(ln(x), eq, rtol=1e-12, atol=1e-12)


def test_written_out_layernorm_equals_f_layer_norm_with_gradients(reference):
    """Under --reference LayerNorm runs its equation as written; the fast path is F.layer_norm."""
    torch.manual_seed(1)
    ln = LayerNorm(D).double()
    with torch.no_grad():
        ln.weight.copy_(torch.randn(D, dtype=torch.float64))
        ln.bias.copy_(torch.randn(D, dtype=torch.float64))
    x = rand(B, T, D, seed=1).requires_grad_(True)
    dy = torch.randn_like(x)
    for eps in (1e-5, 1e-2):  # a large eps too, so that eps inside the sqrt is checked
        ln.eps = eps
        y, ref = ln(x), F.layer_norm(x, (D,), ln.weight, ln.bias, eps)
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
        for a, b in zip(
            torch.autograd.grad(y, (x, ln.weight, ln.bias), dy),
            torch.autograd.grad(ref, (x, ln.weight, ln.bias), dy),
            strict=True,
        ):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_layernorm_init_is_identity_affine():
    ln = LayerNorm(D)
    assert torch.equal(ln.weight, torch.ones(D)) and torch.equal(ln.bias, torch.zeros(D))
    assert ln.eps == 1e-5


# ---------------------------------------------------------------------------------------
# ScaleNorm [1, eq. 5]:  ScaleNorm(x; g) = g x / ||x||
# ---------------------------------------------------------------------------------------
def test_scalenorm_output_has_norm_g():
    """Eq. 5 projects every token onto the sphere of radius g."""
    sn = ScaleNorm(D)
    with torch.no_grad():
        sn.g.fill_(2.37)  # a trained-like g, not the init sqrt(d)
    y = sn(rand(B, T, D, dtype=torch.float32), pad_mask())
    norms = torch.linalg.vector_norm(y.double(), dim=-1)  # (B, T)
    torch.testing.assert_close(
        norms, torch.full((B, T), 2.37, dtype=torch.float64), rtol=1e-6, atol=0
    )


def test_scalenorm_equals_eq5():
    sn = ScaleNorm(D)
    with torch.no_grad():
        sn.g.fill_(1.7)
    x = rand(B, T, D, seed=2, dtype=torch.float32)
    eq5 = 1.7 * x / x.pow(2).sum(-1, keepdim=True).sqrt()  # g x / ||x||
    torch.testing.assert_close(sn(x, pad_mask()), eq5, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("d", [16, 512])
def test_scalenorm_init_g_is_sqrt_d(d):
    """[1] 3.2: "All g's in ScaleNorm are initialized to sqrt(d)"; g is one learned scalar."""
    sn = ScaleNorm(d)
    params = dict(sn.named_parameters())
    assert list(params) == ["g"] and params["g"].dim() == 0 and params["g"].requires_grad
    assert sn.g.item() == pytest.approx(math.sqrt(d), rel=1e-7)


def test_scalenorm_eps_clamps_the_norm():
    """Code: y = g x / max(||x||, eps): a zero vector gives zeros (not NaN), and a vector with
    ||x|| < eps is divided by eps itself (eps is clamped, not added)."""
    sn = ScaleNorm(D)
    x = torch.zeros(1, 2, D)
    tiny = torch.full((D,), 1.0) / math.sqrt(D) * 1e-7  # ||tiny|| = 1e-7 < eps = 1e-5
    x[0, 1] = tiny
    y = sn(x)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0, 0], torch.zeros(D))
    torch.testing.assert_close(y[0, 1], sn.g.detach() * tiny / 1e-5, rtol=1e-5, atol=0)
    # gradients are finite at zero too
    x0 = torch.zeros(1, 1, D, requires_grad=True)
    sn(x0).sum().backward()
    assert torch.isfinite(x0.grad).all()


def test_scale_fixed_g_is_buffer_sqrt_d():
    """TwT Table 7, "ScaleNorm (g = sqrt d)": g is fixed (a buffer, saved, never trained)."""
    d = 64
    sn = build_norm("scale_fixed", d)
    assert isinstance(sn, ScaleNorm)
    assert len(list(sn.parameters())) == 0
    assert "g" in dict(sn.named_buffers()) and "g" in sn.state_dict()
    assert sn.g.item() == pytest.approx(math.sqrt(d), rel=1e-7)
    x = rand(B, T, d, dtype=torch.float32)
    torch.testing.assert_close(
        torch.linalg.vector_norm(sn(x), dim=-1), torch.full((B, T), math.sqrt(d)), rtol=1e-5, atol=0
    )


# ---------------------------------------------------------------------------------------
# RMSNorm [4]:  y_i = g_i x_i / sqrt(mean_j x_j^2 + eps)
# ---------------------------------------------------------------------------------------
def test_rmsnorm_equals_formula():
    torch.manual_seed(3)
    rn = RMSNorm(D)
    with torch.no_grad():
        rn.weight.copy_(torch.randn(D))
    x = rand(B, T, D, seed=3, dtype=torch.float32)
    ref = rn.weight * x / torch.sqrt((x * x).sum(-1, keepdim=True) / D + 1e-8)
    torch.testing.assert_close(rn(x, pad_mask()), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("a", [1e-2, 0.5, 7.0, 1e3])
def test_rmsnorm_is_scale_invariant(a):
    """RMSNorm(a x) = RMSNorm(x) for a > 0 (re-scaling invariance, [4] section 4); the same
    holds for ScaleNorm. Up to eps: checked where ||a x|| >> eps."""
    torch.manual_seed(4)
    rn = RMSNorm(D)
    with torch.no_grad():
        rn.weight.copy_(torch.randn(D))
    sn = ScaleNorm(D)
    x = rand(B, T, D, seed=4, dtype=torch.float32)
    torch.testing.assert_close(rn(a * x), rn(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sn(a * x), sn(x), rtol=1e-5, atol=1e-5)


def test_rmsnorm_weight_init_ones():
    rn = RMSNorm(D)
    assert torch.equal(rn.weight, torch.ones(D)) and rn.weight.requires_grad
    assert [n for n, _ in rn.named_parameters()] == ["weight"]  # no bias, no centring


def test_scalenorm_is_rmsnorm_with_tied_g_over_sqrt_d():
    """TwT 4.2: "tying the g_i of RMSNorm and dividing by sqrt(d) retrieves ScaleNorm":
    RMSNorm with every g_i = g / sqrt(d) equals ScaleNorm with g."""
    g = 3.1
    sn, rn = ScaleNorm(D), RMSNorm(D)
    with torch.no_grad():
        sn.g.fill_(g)
        rn.weight.fill_(g / math.sqrt(D))
    x = rand(B, T, D, seed=5, dtype=torch.float32)
    torch.testing.assert_close(rn(x), sn(x), rtol=1e-5, atol=1e-6)
    # not a coincidence of the default init: untied g_i break the equality
    with torch.no_grad():
        rn.weight[0] *= 2
    assert not torch.allclose(rn(x), sn(x), rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------
# FixNorm [1, 2.3]:  w / ||w|| per embedding row
# ---------------------------------------------------------------------------------------
def test_fixnorm_rows_have_unit_norm():
    torch.manual_seed(6)
    w = torch.randn(50, D, dtype=torch.float64) * torch.rand(50, 1, dtype=torch.float64) * 10
    fw = fixnorm(w)
    torch.testing.assert_close(
        torch.linalg.vector_norm(fw, dim=-1), torch.ones(50, dtype=torch.float64)
    )
    # the direction is kept: fw * ||w|| = w
    torch.testing.assert_close(fw * torch.linalg.vector_norm(w, dim=-1, keepdim=True), w)
    # a zero row stays finite
    assert torch.isfinite(fixnorm(torch.zeros(2, D))).all()


# ---------------------------------------------------------------------------------------
# The common interface: norm(x, pad_mask), any registered norm.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize("training", [True, False])
def test_every_norm_accepts_pad_mask_and_keeps_shape(name, training):
    torch.manual_seed(7)
    norm = build_norm(name, D, heads=4)
    norm.train(training)
    x = rand(B, T, D, dtype=torch.float32)
    for mask in (pad_mask(), None):
        y = norm(x, mask)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", sorted(NORMS))
def test_every_norm_is_finite_under_bf16_autocast(name):
    """Under bf16 autocast, bf16 activations of size ~300 give finite outputs that agree with the
    fp32 computation to bf16 precision (whether the statistics are fp32: the fp16 test below)."""
    torch.manual_seed(8)
    norm = build_norm(name, D, heads=4).eval()  # eval: batch norms use fixed statistics
    x = rand(B, T, D, scale=300.0, dtype=torch.float32).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x, pad_mask())
    assert y.shape == x.shape and torch.isfinite(y).all()
    ref = norm(x.float(), pad_mask())
    torch.testing.assert_close(y.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", sorted(NORMS))
def test_every_norm_keeps_fp32_statistics_on_fp16_activations(name, training):
    """fp16 activations of size ~300 (x^2 overflows fp16 past 256): each norm's output, in fp16,
    agrees with the same norm on the fp32 copy, in training (batch statistics) and evaluation. A
    norm computing its statistics in fp16 (at_least_fp32 forgotten) returns zeros or NaN here; bf16,
    with fp32's range, would not show it."""
    a, b = (build_norm(name, D, heads=4).train(training) for _ in range(2))
    x = rand(B, T, D, seed=5, scale=300.0, dtype=torch.float16)
    y16, y32 = a(x, pad_mask()), b(x.float(), pad_mask())
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.float(), y32, rtol=1e-2, atol=1e-2 * y32.abs().max().item())


def test_build_norm_unknown_name_raises_value_error_naming_choices():
    with pytest.raises(ValueError) as err:
        build_norm("groupnorm", D)
    msg = str(err.value)
    assert "groupnorm" in msg
    for name in CORE:
        assert repr(name) in msg or name in msg


@pytest.mark.parametrize(
    "name,cls",
    [("layer", LayerNorm), ("scale", ScaleNorm), ("scale_fixed", ScaleNorm), ("rms", RMSNorm)],
)
def test_registry_builds_the_named_class(name, cls):
    n = build_norm(name, D, 4)
    assert type(n) is cls
    assert (name == "scale_fixed") == (
        isinstance(n, ScaleNorm) and not isinstance(n.g, nn.Parameter)
    )


# ---------------------------------------------------------------------------------------
# The registry: a norm is its class and one entry, which the flags, the tests, the README check
# read.
# ---------------------------------------------------------------------------------------
README = Path(__file__).resolve().parent.parent / "README.md"


def readme_norms():
    """The --norm values of README.md's "## The normalizations" table (its first column, in
    backticks)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert "## The normalizations" in lines, "README.md has no '## The normalizations' section"
    names = set()
    for line in lines[lines.index("## The normalizations") + 1 :]:
        if line.startswith("## "):
            break
        cell = re.match(r"\|\s*`([^`]+)`\s*\|", line)
        if cell:
            names.add(cell.group(1))
    return names


def missing_from_readme(names):
    return sorted(set(names) - readme_norms())


def test_readme_table_has_a_row_for_every_registered_norm():
    missing = missing_from_readme(NORMS)
    assert not missing, (
        f"README.md's '## The normalizations' table has no row for --norm {', '.join(missing)}"
    )


@pytest.mark.parametrize("name", sorted(NORMS))
def test_every_entry_builds_its_class_and_says_what_it_computes(name):
    entry = NORMS[name]
    # each takes only the options it names
    norm = build_norm(name, D, 4, {"warmup": 1, "no such option": 0})
    assert isinstance(norm, entry.cls) and isinstance(norm, nn.Module)
    assert "=" in entry.equation and "\n" not in entry.equation and entry.paper
    assert isinstance(norm, BATCH_NORMS) == entry.batch_stats


@pytest.mark.parametrize("name", sorted(NORMS))
def test_batch_stats_says_whether_a_sentence_depends_on_the_rest_of_its_batch(name):
    """In training a norm without batch statistics gives a sentence the output it has alone; one
    with them (BatchNorm, PN-V, PowerNorm in its warmup) does not."""
    x = rand(B, T, D, seed=14)
    together, alone = (
        build_norm(name, D, 4).double().train(),
        build_norm(name, D, 4).double().train(),
    )
    same = torch.allclose(together(x, None)[:1], alone(x[:1], None), rtol=1e-9, atol=1e-9)
    assert same != NORMS[name].batch_stats


class MeanAbsNorm(nn.Module):
    """A norm made up for the test below: y = g x / mean_i |x_i|, one learned scalar g."""

    calls = 0

    def __init__(self, d):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(1.0))

    def forward(self, x, pad_mask=None):
        MeanAbsNorm.calls += 1
        return self.g * x / x.abs().mean(-1, keepdim=True).clamp_min(1e-6)


def test_a_norm_added_as_a_class_and_one_entry_is_offered_trained_tested_and_missed_by_the_readme(
    monkeypatch, tmp_path
):

    monkeypatch.setitem(NORMS, "meanabs", norms.Norm(MeanAbsNorm, "y = g x / mean|x|", "a test"))
    # --norm, --encoder-norm, --decoder-norm offer it, --help explains it
    parser = arguments.build_parser()
    args = parser.parse_args(
        ["--norm", "meanabs", "--encoder-norm", "meanabs", "--decoder-norm", "meanabs"]
    )
    assert (args.norm, args.encoder_norm, args.decoder_norm) == ("meanabs",) * 3
    assert "meanabs: y = g x / mean|x| (a test)" in " ".join(parser.format_help().split())
    # train.py trains with it: two steps, finite losses, through its forward
    monkeypatch.setattr(MeanAbsNorm, "calls", 0)
    corpus = toy_corpus.make_toy_corpus(tmp_path / "corpus", n_train=300, n_dev=10, n_test=10)
    run = tmp_path / "run"
    train_cli.main(
        [
            "--norm",
            "meanabs",
            "--d-model",
            "32",
            "--ff",
            "64",
            "--layers",
            "1",
            "--heads",
            "2",
            "--batch-tokens",
            "512",
            "--max-steps",
            "2",
            "--epoch-size",
            "2",
            "--threads",
            "1",
            "--bpe-size",
            "300",
            "--beam",
            "1",
            "--device",
            "cpu",
            "--data",
            str(corpus),
            "--src",
            "src",
            "--tgt",
            "tgt",
            "--out",
            str(run),
        ]
    )
    losses = [
        r["loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert MeanAbsNorm.calls > 0
    # the tests that loop over the registry take it
    test_every_norm_accepts_pad_mask_and_keeps_shape("meanabs", True)
    test_every_norm_is_finite_under_bf16_autocast("meanabs")
    test_every_entry_builds_its_class_and_says_what_it_computes("meanabs")
    test_batch_stats_says_whether_a_sentence_depends_on_the_rest_of_its_batch("meanabs")
    # and the README check names it until the table has a row for it
    assert missing_from_readme(NORMS) == ["meanabs"]
    monkeypatch.undo()
    arguments.build_parser()  # train.py's table of flags as it was


# ---------------------------------------------------------------------------------------
# Gradients: the norms are their equations under autograd, so gradcheck in float64 must pass,
# with respect to the input and the learned scale, including where eps matters.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ScaleNorm, RMSNorm])
def test_gradcheck_float64_input_and_parameter(cls):
    torch.manual_seed(9)
    norm = cls(6).double()
    name = "g" if cls is ScaleNorm else "weight"
    p = (
        torch.tensor(1.3, dtype=torch.float64)
        if cls is ScaleNorm
        else torch.randn(6, dtype=torch.float64)
    )
    x = rand(2, 3, 6, seed=9).requires_grad_(True)

    def f(x, p):
        return torch.func.functional_call(norm, {name: p}, (x,))

    assert torch.autograd.gradcheck(f, (x, p.requires_grad_(True)))
    assert norm(x).dtype == torch.float64
    # the float64 forward is float64-accurate
    ref = eq5(x, norm.g, norm.eps) if cls is ScaleNorm else rmsnorm_eq(x, norm.weight, norm.eps)
    torch.testing.assert_close(norm(x), ref, rtol=1e-12, atol=1e-12)


def test_scalenorm_backward_is_exact_in_the_clamped_region_too():
    """Finite differences, with one token whose norm is below eps (there y = g x / eps, so the
    projection term must vanish)."""
    torch.manual_seed(3)
    norm = ScaleNorm(5).double()
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    x[0, 1] *= 1e-7 / x[0, 1].norm()  # ||x|| = 1e-7 < eps = 1e-5
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: norm(x), (x,))
    y = norm(x)
    y.sum().backward()
    assert torch.allclose(x.grad[0, 1], torch.full((5,), norm.g.item() / 1e-5, dtype=torch.float64))


def hard_rows(shape=(2, 4, 6), seed=11, transpose=False):
    """float64 activations with one zero token, one token of norm 1e-7 (< eps = 1e-5) and, if
    transpose, a strided (non-contiguous) layout."""
    torch.manual_seed(seed)
    b, t, d = shape
    x = (
        torch.randn(b, d, t, dtype=torch.float64).transpose(1, 2)
        if transpose
        else torch.randn(b, t, d, dtype=torch.float64)
    )
    with torch.no_grad():
        x[0, 1] = 0.0
        x[1, 2] *= 1e-7 / x[1, 2].norm()
    return x.requires_grad_(True)


@pytest.mark.parametrize("cls", [ScaleNorm, RMSNorm])
@pytest.mark.parametrize("transpose", [False, True], ids=["contiguous", "strided"])
def test_norms_equal_their_equations_with_gradients_on_hard_rows(cls, transpose):
    """Values and gradients (input and parameter) equal the equations written above, with a zero
    row, a row below eps and a strided input; gradcheck too."""
    x = hard_rows(transpose=transpose)
    norm = cls(6).double()
    with torch.no_grad():
        if cls is ScaleNorm:
            norm.g.fill_(2.7)
        else:
            norm.weight.copy_(torch.randn(6, dtype=torch.float64))
            norm.eps = 1e-3  # large enough that its place (inside the sqrt) shows in the values
    p = norm.g if cls is ScaleNorm else norm.weight
    dy = torch.randn_like(x)
    y = norm(x)
    yf = eq5(x, p, norm.eps) if cls is ScaleNorm else rmsnorm_eq(x, p, norm.eps)
    for a, b in zip(
        (y,) + torch.autograd.grad(y, (x, p), dy),
        (yf,) + torch.autograd.grad(yf, (x, p), dy),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: norm(x), (x,))
    if cls is ScaleNorm:
        assert torch.equal(y[0, 1], torch.zeros(6, dtype=torch.float64))  # zero row: 0, not 0/0


def test_fixnorm_equals_its_equation_with_gradient():
    torch.manual_seed(12)
    w = torch.randn(7, 6, dtype=torch.float64)
    with torch.no_grad():
        w[3] = 0.0  # a zero row: stays 0 (eps clamp), not NaN
    w.requires_grad_(True)
    dy = torch.randn(7, 6, dtype=torch.float64)
    y, yf = fixnorm(w), fixnorm_eq(w)
    torch.testing.assert_close(y, yf, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        torch.autograd.grad(y, w, dy)[0], torch.autograd.grad(yf, w, dy)[0], rtol=1e-12, atol=1e-12
    )
    # finite differences of step 1e-6 leave the clamp region of eps = 1e-12: check off zero
    assert torch.autograd.gradcheck(fixnorm, (w.detach()[:3].clone().requires_grad_(True),))


def test_float32_norms_match_the_float64_equations():
    """In the training dtype: fp32 results within fp32 rounding of the float64 equation
    (ScaleNorm and RMSNorm, forward and input gradient)."""
    x64 = hard_rows((8, 16, 64), seed=13)
    dy = torch.randn_like(x64)
    w = torch.randn(64, dtype=torch.float64)
    sn, rn = ScaleNorm(64), RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        sn.g.fill_(8.0)
        rn.weight.copy_(w.float())
    for norm, eq in [(sn, lambda x: eq5(x, 8.0, 1e-5)), (rn, lambda x: rmsnorm_eq(x, w, 1e-5))]:
        x32 = x64.detach().float().requires_grad_(True)
        y32 = norm(x32)
        (dx32,) = torch.autograd.grad(y32, x32, dy.float())
        y = eq(x64)
        (dx,) = torch.autograd.grad(y, x64, dy)
        torch.testing.assert_close(y32.double(), y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx32.double(), dx, rtol=1e-4, atol=1e-3)


def test_no_norm_is_the_identity():
    """--norm none (QKNorm Table 6 "without LayerNorm", literally): y = x, no parameters."""
    n = build_norm("none", D)
    x = rand(B, T, D)
    assert isinstance(n, NoNorm) and n(x, pad_mask()) is x and not list(n.parameters())
