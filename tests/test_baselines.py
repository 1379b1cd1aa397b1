"""Ours against the baselines' own code, matched by weights (issue 40, item 2), from two small
fixtures.

Users of the project have no copy of the baselines' code, so these tests read what it computed,
saved once by tests/fixtures/make_baseline_fixtures.py (committed; run it with the two baselines'
folders to remake the fixtures):

  tests/fixtures/baseline_attention.pt: BlockTensorAttn of szhangtju/The-compression-of-Transformer
    (BTD-Transformer/transformer_upload.py, commit c614f39), the multi-linear attention of
    PowerNorm's language models, at its PTB script's rank R = d_head = 40, one head, no mask (the
    code never applies one), its relative position term on, in float64: the inputs, the weights, its
    outputs and the gradients.
  tests/fixtures/authors_powernorm.pt: MaskPowerNorm of sIncerass/powernorm
  (fairseq/modules/norms/mask_powernorm.py,
    commit 9ea6226), in float64, over five training steps across its warmup and one eval step.

Each fixture's `provenance` says which commit, which file (and its sha256), what was patched to
import it, the seed. The tests load the baselines' weights into ours (model.py Appendix B's mapping;
norms.py Appendix C's PowerNormCode) and compare in float64 to 1e-6 (absolute); the values measured
are far below (about 1e-15).
"""

from pathlib import Path

import pytest
import torch

from model import ModelConfig, MultiLinearAttention, sinusoidal_positions
from norms import LayerNorm, PowerNorm, power_norm

FIXTURES = Path(__file__).resolve().parent / "fixtures"
F64 = torch.float64
TOL = 1e-6


def load(name):
    return torch.load(FIXTURES / name, weights_only=True)  # plain data only: no code runs on load


def max_diff(a, b):
    return (a.to(F64) - b.to(F64)).abs().max().item()


def assert_within(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    d = max_diff(got, want)
    assert d <= TOL, f"{what}: max |ours - baseline| = {d:.3g} > {TOL}"


# ---------------------------------------------------------------------------------------
# The multi-linear attention (model.py Appendix B) against BlockTensorAttn
# ---------------------------------------------------------------------------------------
def halves_to_interleaved(d):
    """perm with ours[:, m] = baseline[:, perm[m]]: the baseline's sinusoids are [sin
    f_0..f_{D/2-1}; cos f_0..], ours interleaved (sin f_i at 2i, cos f_i at 2i+1): perm = [0, D/2,
    1, D/2 + 1, ...]."""
    return torch.arange(d).view(2, d // 2).t().flatten()


def ours_from_baseline(
    fx, permute_wr=True, core=None, swap_jk=False, swap_biases=False, own_sinusoids=False
):
    """Our MultiLinearAttention in float64 holding the fixture's weights (model.py Appendix B's
    mapping): qkv_net -> qkv ([W^Q; W^K; W^V], the same rows), core_value[0] -> core, o_net -> out
    (its L^2 inputs in the same (j, k) order), r_net -> r_net with its input columns permuted
    (halves -> interleaved sinusoids), r_w_bias and r_r_bias (n_head, R) -> (H, 1, R), and the
    baseline's float64 sinusoids, permuted, into pe_reversed. The keywords break one piece of the
    mapping each (the tests below show each breaks the match)."""
    c, w = fx["config"], fx["weights"]
    d, R, L = c["d_model"], c["d_head"], c["tgt_len"]
    cfg = ModelConfig(
        vocab_size=10,
        d_model=d,
        heads=c["n_head"],
        seq_len=L,
        attention="multilinear",
        lm=True,
        mask="none",
        positions="relative",
        head_dim=R,
        attn_bias=False,
        dropout=0.0,
    )
    m = MultiLinearAttention(cfg).to(F64).eval()
    perm = halves_to_interleaved(d)
    u, v = fx["inputs"]["r_w_bias"], fx["inputs"]["r_r_bias"]
    with torch.no_grad():
        m.qkv.weight.copy_(w["qkv_net.weight"])
        m.core.copy_(w["core_value"][0] if core is None else core)
        o = w["o_net.weight"]
        m.out.weight.copy_(o.view(d, L, L).transpose(1, 2).reshape(d, L * L) if swap_jk else o)
        m.r_net.weight.copy_(w["r_net.weight"][:, perm] if permute_wr else w["r_net.weight"])
        m.r_w_bias.copy_((v if swap_biases else u).view(m.r_w_bias.shape))
        m.r_r_bias.copy_((u if swap_biases else v).view(m.r_r_bias.shape))
        # ours are computed in float32 (sinusoidal_positions); the baseline's in float64
        if not own_sinusoids:
            m.pe_reversed.copy_(fx["inputs"]["r"][:, 0, perm])
    return m


def run_ours(m, fx):
    """Our forward and backward on the fixture's input: x = w (L, B, D) made batch-first, the loss
    sum(grad_attn_out * attention output); returns the output sequence-first and the gradients by
    baseline name."""
    x = fx["inputs"]["w"].to(F64).transpose(0, 1).clone().requires_grad_()  # (B, L, D)
    y = m(x).transpose(0, 1)  # (L, B, D), the baseline's layout
    (y * fx["inputs"]["grad_attn_out"].to(F64)).sum().backward()
    perm = halves_to_interleaved(m.r_net.weight.shape[1])
    inverse = torch.argsort(perm)  # ours[:, inverse] back in the baseline's column order
    grads = {
        "w": x.grad.transpose(0, 1),
        "qkv_net.weight": m.qkv.weight.grad,
        "core_value": m.core.grad[None],
        "o_net.weight": m.out.weight.grad,
        "r_net.weight": m.r_net.weight.grad[:, inverse],
        "r_w_bias": m.r_w_bias.grad.view(1, -1),
        "r_r_bias": m.r_r_bias.grad.view(1, -1),
    }
    return y, grads


def test_the_attention_fixture_is_the_baselines_ptb_attention():
    fx = load("baseline_attention.pt")
    p, c = fx["provenance"], fx["config"]
    assert (
        p["commit"].startswith("c614f39") and p["file"] == "BTD-Transformer/transformer_upload.py"
    )
    assert (c["d_head"], c["n_head"], c["mem_len"], c["core_nums"], c["dropout"]) == (
        40,
        1,
        0,
        1,
        0.0,
    )
    assert fx["outputs"]["attn_out"].dtype == F64 and set(fx["grads"]) == {
        "w",
        "qkv_net.weight",
        "core_value",
        "o_net.weight",
        "r_net.weight",
        "r_w_bias",
        "r_r_bias",
    }


def test_multilinear_attention_matches_the_baselines_outputs_and_gradients():
    """--mask none --positions relative at R = 40, the baseline's weights in ours: the attention's
    output (the baseline's o_net output, recorded by a forward hook: before its dropout, residual
    and LayerNorm, which ours leaves to the layer) and the gradients of sum(grad_attn_out * output)
    w.r.t. the input and every weight (u and v included) agree to 1e-6 in float64."""
    fx = load("baseline_attention.pt")
    y, grads = run_ours(ours_from_baseline(fx), fx)
    assert_within(y, fx["outputs"]["attn_out"], "attention output")
    for name, want in fx["grads"].items():
        assert_within(grads[name], want, f"gradient of {name}")


def test_post_norm_layer_around_it_matches_the_baselines_whole_forward():
    """The baseline's forward returns layer_norm(w + attn_out) (residual and LayerNorm inside its
    attention): our LayerNorm with its weights, on w + our attention's output, gives that output too
    (model.py residual(), PostNorm)."""
    fx = load("baseline_attention.pt")
    y, _ = run_ours(ours_from_baseline(fx), fx)
    d = fx["config"]["d_model"]
    norm = LayerNorm(d, eps=fx["config"]["layer_norm_eps"]).to(F64)
    with torch.no_grad():
        norm.weight.copy_(fx["weights"]["layer_norm.weight"])
        norm.bias.copy_(fx["weights"]["layer_norm.bias"])
        assert_within(
            norm(fx["inputs"]["w"].to(F64) + y),
            fx["outputs"]["output"],
            "layer_norm(w + attention)",
        )


def test_our_sinusoids_are_the_baselines_permuted():
    """Ours (computed in float32, interleaved) are the baseline's float64 [sin; cos] halves with the
    columns permuted, rows reversed as its pos_seq = L-1, ..., 0 (to 1e-6; measured 4e-8, float32
    rounding). Our attention with its own float32 sinusoids (not the fixture's) then gives the
    baseline's output to 1e-6 (measured 1.5e-8) and every gradient to 1e-6 of that gradient's
    largest entry: float32 positions carry a relative error of about 1e-8 into every gradient, so
    the core's (entries up to about 59) moves by about 9e-7 in absolute terms. The exact, absolute
    1e-6 comparison of the gradients is the test above, with the baseline's float64 sinusoids
    loaded."""
    fx = load("baseline_attention.pt")
    L, d = fx["config"]["tgt_len"], fx["config"]["d_model"]
    assert fx["inputs"]["pos_seq"].tolist() == list(range(L - 1, -1, -1))
    assert_within(
        sinusoidal_positions(L, d).flip(0),
        fx["inputs"]["r"][:, 0, halves_to_interleaved(d)],
        "sinusoids",
    )
    y, grads = run_ours(ours_from_baseline(fx, own_sinusoids=True), fx)
    assert_within(y, fx["outputs"]["attn_out"], "attention output with our float32 sinusoids")
    for name, want in fx["grads"].items():
        d = max_diff(grads[name], want)
        assert d <= TOL * want.abs().max().item(), (
            f"gradient of {name}, our sinusoids: {d:.3g} (relative to its size)"
        )


@pytest.mark.parametrize(
    "broken", ["unpermuted W^R", "another core", "o_net's (j, k) swapped", "u and v swapped"]
)
def test_a_wrong_mapping_does_not_match(broken):
    """The comparison can fail: each piece of the mapping, broken alone, moves the output far beyond
    1e-6."""
    fx = load("baseline_attention.pt")
    core = fx["weights"]["core_value"][0]
    m = ours_from_baseline(
        fx,
        permute_wr=broken != "unpermuted W^R",
        core=core.flip(0) if broken == "another core" else None,
        swap_jk=broken == "o_net's (j, k) swapped",
        swap_biases=broken == "u and v swapped",
    )
    y, _ = run_ours(m, fx)
    assert max_diff(y, fx["outputs"]["attn_out"]) > 1e-3


# ---------------------------------------------------------------------------------------
# PowerNorm (norms.py PowerNormCode, --pn-variant code) against MaskPowerNorm
# ---------------------------------------------------------------------------------------
def run_powernorm(fx, variant):
    """Ours (built as --norm power --pn-variant VARIANT builds it, groups = the authors' group_num)
    in float64 on the fixture's steps: x (T, B, C) -> (B, T, C), the same pad mask (B, T),
    y.backward(grad_y). Returns per step a dict of outputs, gradients and buffers in the authors'
    layout and names (ema_gz = nu / (1 - alpha_bkw))."""
    c, s = fx["config"], fx["steps"]
    norm = power_norm(
        c["num_features"],
        variant=variant,
        groups=c["group_num"],
        warmup=c["warmup_iters"],
        alpha_fwd=c["alpha_fwd"],
        alpha_bkw=c["alpha_bkw"],
        eps=c["eps"],
    ).to(F64)
    assert norm.group_scaling.eps == c["group_eps"]
    with torch.no_grad():
        norm.weight.copy_(fx["weights"]["weight"])
        norm.bias.copy_(fx["weights"]["bias"])
    got = []
    for i, training in enumerate(s["training"]):
        norm.train(training)
        norm.zero_grad()
        x = s["x"][i].to(F64).transpose(0, 1).clone().requires_grad_()  # (B, T, C)
        y = norm(x, s["pad_mask"][i])
        y.backward(s["grad_y"][i].to(F64).transpose(0, 1))
        got.append(
            {
                "y": y.detach().transpose(0, 1),
                "grad_x": x.grad.transpose(0, 1),
                "grad_weight": norm.weight.grad,
                "grad_bias": norm.bias.grad,
                "running_phi": norm.running_phi.clone(),
                "ema_gz": norm.running_nu / (1 - c["alpha_bkw"]),
                "iters": int(norm.num_batches_tracked),
            }
        )
    return got


def test_the_powernorm_fixture_crosses_the_warmup_with_padding():
    fx = load("authors_powernorm.pt")
    s, W = fx["steps"], fx["config"]["warmup_iters"]
    assert fx["provenance"]["file"] == "fairseq/modules/norms/mask_powernorm.py"
    iters = [t for t, training in zip(s["iters"], s["training"], strict=True) if training]
    # before, at, after; eval
    assert min(iters) < W and W in iters and max(iters) > W and not s["training"][-1]
    assert s["pad_mask"].any() and s["y"].dtype == F64


def test_powernorm_code_matches_the_authors_module_step_by_step():
    """PowerNormCode (norms.py Appendix C, with GroupScaling in front) against MaskPowerNorm (with
    GroupScaling1D), the same weights, inputs, pad masks and output gradients: at every step (two
    with running_phi's cumulative mean, the last warmup step, two after the warmup, one in eval
    mode) the output, the input gradient, the weight and bias gradients and the running buffers
    (running_phi; ema_gz = our nu / (1 - alpha_bkw); the step count) agree to 1e-6 in float64."""
    fx = load("authors_powernorm.pt")
    s = fx["steps"]
    for i, ours in enumerate(run_powernorm(fx, "code")):
        assert ours["iters"] == s["iters"][i], f"step {i + 1}: step count"
        for name in ["y", "grad_x", "grad_weight", "grad_bias", "running_phi", "ema_gz"]:
            assert_within(
                ours[name],
                s[name][i],
                f"step {i + 1} ({'train' if s['training'][i] else 'eval'}): {name}",
            )


def test_powernorm_as_the_paper_writes_it_is_not_the_authors_module():
    """The comparison can fail: PowerNorm (Algorithm 2, --pn-variant paper) differs from the
    authors' module, where Appendix C says: running_phi in the warmup (no cumulative mean), the
    gradient at padding (zero)."""
    fx = load("authors_powernorm.pt")
    s = fx["steps"]
    ours = run_powernorm(fx, "paper")
    # step 1: the cumulative mean
    assert max_diff(ours[0]["running_phi"], s["running_phi"][0]) > 1e-3
    padded = next(i for i in range(len(ours)) if s["pad_mask"][i].any() and s["training"][i])
    at_pad = s["pad_mask"][padded].t()  # (T, B)
    assert (
        ours[padded]["grad_x"][at_pad].abs().max() == 0
        and s["grad_x"][padded][at_pad].abs().max() > 1e-3
    )
    assert isinstance(power_norm(4, variant="paper"), PowerNorm)
