"""Tests of the batch-statistics norms of PowerNorm [2]: BatchNorm, PN-V, GroupScaling, PN.

PN has an approximate backward, so gradcheck does not apply: it is checked step by step
against ``RefPN`` below, Algorithm 2 written out token by token without norms.py's Function.
"""

import math

import pytest
import torch

import norms
from norms import NORMS, PNV, BatchNorm, GroupScaling, PowerNorm, PowerNormCode, build_norm

VARIANTS = {"paper": PowerNorm, "code": PowerNormCode}
# batch, pnv, power (the registry's)
BATCH = sorted(name for name, entry in NORMS.items() if entry.batch_stats)

F64 = torch.float64


def random_pad_mask(gen, B, T):
    """(B, T) bool, True at padding, padding anywhere (not only at the end), >= 1 real token."""
    pad = torch.rand(B, T, generator=gen) < 0.35
    pad[0, 0] = False
    return pad


# ---------------------------------------------------------------------------------------
# BatchNorm = torch.nn.BatchNorm1d on the real tokens
# ---------------------------------------------------------------------------------------
def test_batchnorm_equals_torch_batchnorm1d_on_real_tokens_train_and_eval():
    gen = torch.Generator().manual_seed(0)
    B, T, D = 3, 5, 6
    ours = BatchNorm(D).to(F64)
    ref = torch.nn.BatchNorm1d(D).to(F64)
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(torch.linspace(0.5, 2.0, D))
            m.bias.copy_(torch.linspace(-1.0, 1.0, D))
    for step in range(4):
        x = torch.randn(B, T, D, generator=gen, dtype=F64) * 3 + 1
        pad = random_pad_mask(gen, B, T)
        dy = torch.randn(B, T, D, generator=gen, dtype=F64)
        xa, xb = x.clone().requires_grad_(), x[~pad].clone().requires_grad_()
        ya, yb = ours(xa, pad), ref(xb)  # (B, T, D) and (N, D)
        torch.testing.assert_close(ya[~pad], yb)
        (ya[~pad] * dy[~pad]).sum().backward()
        (yb * dy[~pad]).sum().backward()
        torch.testing.assert_close(xa.grad[~pad], xb.grad)
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad)
        torch.testing.assert_close(ours.running_mean, ref.running_mean)
        torch.testing.assert_close(ours.running_var, ref.running_var)
        assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
        for m in (ours, ref):
            m.zero_grad()
    ours.eval(), ref.eval()
    x = torch.randn(B, T, D, generator=gen, dtype=F64)
    pad = random_pad_mask(gen, B, T)
    torch.testing.assert_close(ours(x, pad)[~pad], ref(x[~pad]))
    # Same buffer names as torch's: the state dicts are interchangeable.
    ref.load_state_dict(ours.state_dict())


def test_batchnorm_padding_does_not_change_real_outputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 4, generator=gen)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 4:] = True
    x2 = x.clone()
    x2[pad] = 1e4  # huge padding values
    a, b = BatchNorm(4), BatchNorm(4)
    torch.testing.assert_close(a(x, pad)[~pad], b(x2, pad)[~pad])
    torch.testing.assert_close(a.running_var, b.running_var)


# ---------------------------------------------------------------------------------------
# PN-V = Definition 1
# ---------------------------------------------------------------------------------------
def test_pnv_equals_definition_1_and_its_gradient_is_eq_6():
    gen = torch.Generator().manual_seed(2)
    B, T, D, eps = 3, 4, 5, 1e-5
    norm = PNV(D).to(F64)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, D))
        norm.bias.copy_(torch.linspace(-1.0, 1.0, D))
    gamma, beta = norm.weight.detach(), norm.bias.detach()
    phi = torch.ones(D, dtype=F64)
    for _ in range(3):
        x = (torch.randn(B, T, D, generator=gen, dtype=F64) + 0.5).requires_grad_()
        pad = random_pad_mask(gen, B, T)
        xr = x.detach()[~pad]  # (N, D)
        n = xr.shape[0]
        psi2 = sum(xr[i] ** 2 for i in range(n)) / n  # psi_B^2 = 1/B sum_i x_i^2
        psi = torch.sqrt(psi2 + eps)
        y = norm(x, pad)
        torch.testing.assert_close(y, gamma * x.detach() / psi + beta)  # eq. 4-5, padding too
        # eq. 6: dL/dx_i = gamma/psi dy_i - gamma/(B psi) sum_j dy_j x^_j x^_i  (real tokens)
        dy = torch.randn(B, T, D, generator=gen, dtype=F64)
        dy[pad] = 0  # as in a Transformer: nothing downstream reads padding outputs
        (y * dy).sum().backward()
        xhat, dyr = xr / psi, dy[~pad]
        eq6 = gamma / psi * dyr - gamma / (n * psi) * (dyr * xhat).sum(0) * xhat
        torch.testing.assert_close(x.grad[~pad], eq6)
        phi = 0.9 * phi + 0.1 * psi2
        torch.testing.assert_close(norm.running_phi, phi)
        norm.zero_grad()
    norm.eval()
    x = torch.randn(B, T, D, generator=gen, dtype=F64)
    torch.testing.assert_close(norm(x, None), gamma * x / torch.sqrt(phi + eps) + beta)
    torch.testing.assert_close(norm.running_phi, phi)  # eval leaves the buffer alone


# ---------------------------------------------------------------------------------------
# GroupScaling = its formula
# ---------------------------------------------------------------------------------------
def group_scaling_formula(x, groups, eps=1e-5):
    """Each group of D/G contiguous channels divided by its own root mean square."""
    D = x.shape[-1]
    size = D // groups
    parts = []
    for g in range(groups):
        part = x[..., g * size : (g + 1) * size]
        parts.append(part / torch.sqrt((part**2).sum(-1, keepdim=True) / size + eps))
    return torch.cat(parts, -1)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_group_scaling_equals_formula_and_gives_unit_rms_per_group(groups):
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(3), dtype=F64) * 5
    y = GroupScaling(groups)(x)
    torch.testing.assert_close(y, group_scaling_formula(x, groups))
    rms = y.unflatten(-1, (groups, -1)).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------
# PowerNorm against Algorithm 2 written out
# ---------------------------------------------------------------------------------------
class RefPN:
    """PN Algorithm 2 / eqs. 8-13, token by token, with the warmup of appendix A; the
    "code" variant with the released code's three departures (norms.py Appendix C;
    sIncerass/powernorm, fairseq/modules/norms/mask_powernorm.py)."""

    def __init__(self, D, warmup, alpha_fwd, alpha_bkw, eps, variant):
        self.phi = torch.ones(D, dtype=F64)  # running psi^2
        self.nu = torch.zeros(D, dtype=F64)
        self.t = 0
        self.W, self.af, self.ab = warmup, alpha_fwd, alpha_bkw
        self.eps, self.variant = eps, variant

    def step(self, xs, pad, dy, gamma, beta):
        """One training step on group-scaled xs (B, T, D): returns y, dL/dxs, dgamma, dbeta."""
        B, T, D = xs.shape
        real = [(b, t) for b in range(B) for t in range(T) if not pad[b, t]]
        every = [(b, t) for b in range(B) for t in range(T)]
        self.t += 1
        psi2_batch = sum(xs[p] ** 2 for p in real) / len(real)  # psi_B^2 over real tokens
        fwd = psi2_batch if self.t <= self.W else self.phi  # warmup: batch statistic
        bwd = psi2_batch if self.variant == "code" else fwd
        y = torch.empty_like(xs)
        for p in every:
            y[p] = gamma * xs[p] / torch.sqrt(fwd + self.eps) + beta  # eqs. 8-9
        # backward, eqs. 11-13
        used = every if self.variant == "code" else real
        dxs = torch.zeros_like(xs)
        dgamma, dbeta = torch.zeros(D, dtype=F64), torch.zeros(D, dtype=F64)
        Gamma, Lambda = torch.zeros(D, dtype=F64), torch.zeros(D, dtype=F64)
        for p in used:
            xhat = xs[p] / torch.sqrt(fwd + self.eps)
            g = gamma * dy[p]  # dL/dx^
            dxs[p] = (g - self.nu * xhat) / torch.sqrt(bwd + self.eps)  # eqs. 11-12
            Gamma += xhat * xhat / len(used)
            Lambda += g * xhat / len(used)
            dgamma += dy[p] * xhat
            dbeta += dy[p]
        self.nu = self.nu * (1 - (1 - self.ab) * Gamma) + (1 - self.ab) * Lambda  # eq. 13
        phi = self.phi
        if self.variant == "code" and self.t < self.W:
            phi = phi * (self.t - 1) / self.t + psi2_batch / self.t  # cumulative mean
        self.phi = self.af * phi + (1 - self.af) * psi2_batch  # eq. 10
        return y, dxs, dgamma, dbeta


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_powernorm_matches_algorithm_2_step_by_step_across_warmup(variant):
    gen = torch.Generator().manual_seed(4)
    B, T, D, G, W = 3, 4, 8, 2, 3
    norm = VARIANTS[variant](D, groups=G, warmup=W, alpha_fwd=0.8, alpha_bkw=0.7).to(F64)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=gen, dtype=F64) + 0.5)
        norm.bias.copy_(torch.randn(D, generator=gen, dtype=F64))
    gamma, beta = norm.weight.detach().clone(), norm.bias.detach().clone()
    ref = RefPN(D, W, 0.8, 0.7, 1e-5, variant)
    for step in range(2 * W):
        x = (torch.randn(B, T, D, generator=gen, dtype=F64) * (1 + step) + 0.3).requires_grad_()
        pad = random_pad_mask(gen, B, T)
        dy = torch.randn(B, T, D, generator=gen, dtype=F64)  # nonzero at padding too

        y = norm(x, pad)
        y.backward(dy)

        x_ref = x.detach().clone().requires_grad_()
        xs = group_scaling_formula(x_ref, G)  # plain autograd through GroupScaling
        y_ref, dxs, dgamma, dbeta = ref.step(xs.detach(), pad, dy, gamma, beta)
        (dx_ref,) = torch.autograd.grad(xs, x_ref, dxs)

        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(x.grad, dx_ref)
        torch.testing.assert_close(norm.weight.grad, dgamma)
        torch.testing.assert_close(norm.bias.grad, dbeta)
        torch.testing.assert_close(norm.running_phi, ref.phi)
        torch.testing.assert_close(norm.running_nu, ref.nu)
        assert int(norm.num_batches_tracked) == step + 1
        if variant == "paper":
            assert (x.grad[pad] == 0).all()  # padding gets no gradient
        norm.zero_grad()


def test_the_two_variants_differ_only_where_the_released_code_departs():
    """Same batches: outputs agree during warmup; the gradients part once nu or phi do."""
    gen = torch.Generator().manual_seed(5)
    B, T, D, W = 2, 5, 4, 2
    paper, code = (VARIANTS[v](D, warmup=W).to(F64) for v in ("paper", "code"))
    for step in range(4):
        x = torch.randn(B, T, D, generator=gen, dtype=F64)
        pad = random_pad_mask(gen, B, T)
        pad[1, -1] = True
        dy = torch.randn(B, T, D, generator=gen, dtype=F64)
        xp, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        yp, yc = paper(xp, pad), code(xc, pad)
        yp.backward(dy), yc.backward(dy)
        if step < W:
            torch.testing.assert_close(yp, yc)  # forward: batch psi_B in both
        assert not torch.allclose(xp.grad, xc.grad)  # padding in Gamma/Lambda and gradient
        assert (xp.grad[pad] == 0).all() and (xc.grad[pad] != 0).any()


def test_powernorm_eval_uses_only_the_running_statistic():
    gen = torch.Generator().manual_seed(6)
    D = 8
    norm = PowerNorm(D, groups=2, warmup=2)
    for _ in range(3):
        norm(torch.randn(3, 4, D, generator=gen), None).sum().backward()
    norm.eval()
    buffers = {k: v.clone() for k, v in norm.named_buffers()}
    x = torch.randn(3, 4, D, generator=gen)
    y = norm(x, None)
    psi = torch.sqrt(norm.running_phi + 1e-5)
    expected = norm.weight * group_scaling_formula(x, 2) / psi + norm.bias
    torch.testing.assert_close(y, expected)
    x2 = x.clone()
    x2[1:] = torch.randn(2, 4, D, generator=gen) * 100  # other sentences change
    torch.testing.assert_close(norm(x2, None)[0], y[0])  # sentence 0 does not
    torch.testing.assert_close(norm(x[:1], None), y[:1])  # nor does it alone in its batch
    for k, v in norm.named_buffers():  # eval updates nothing, the counter included
        assert torch.equal(v, buffers[k]), k


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_powernorm_padding_never_changes_real_tokens(variant):
    """Real tokens' outputs (and, in the paper variant, their gradients) do not see padding:
    neither its values, nor its amount, nor its upstream gradient."""
    gen = torch.Generator().manual_seed(7)
    B, T, D, W = 2, 4, 8, 2
    a = VARIANTS[variant](D, groups=2, warmup=W).to(F64)
    b = VARIANTS[variant](D, groups=2, warmup=W).to(F64)
    for _ in range(2 * W):
        x = torch.randn(B, T, D, generator=gen, dtype=F64)
        pad = random_pad_mask(gen, B, T)
        dy = torch.randn(B, T, D, generator=gen, dtype=F64)
        # b sees two more padded positions per sentence and other padding values/gradients
        xb = torch.cat([x, torch.zeros(B, 2, D, dtype=F64)], 1)
        padb = torch.cat([pad, torch.ones(B, 2, dtype=torch.bool)], 1)
        xb[padb] = torch.randn(int(padb.sum()), D, generator=gen, dtype=F64) * 50
        dyb = torch.cat([dy, torch.zeros(B, 2, D, dtype=F64)], 1)
        dyb[padb] = torch.randn(int(padb.sum()), D, generator=gen, dtype=F64)
        xa, xb = x.clone().requires_grad_(), xb.requires_grad_()
        ya, yb = a(xa, pad), b(xb, padb)
        torch.testing.assert_close(ya[~pad], yb[:, :T][~pad])
        ya.backward(dy), yb.backward(dyb)
        torch.testing.assert_close(a.running_phi, b.running_phi)
        if variant == "paper":
            torch.testing.assert_close(xa.grad[~pad], xb.grad[:, :T][~pad])
            torch.testing.assert_close(a.running_nu, b.running_nu)
            torch.testing.assert_close(a.weight.grad, b.weight.grad)
            assert (xb.grad[padb] == 0).all()
        a.zero_grad(), b.zero_grad()


@pytest.mark.parametrize("name", BATCH)
def test_all_padding_batch_raises_instead_of_nan(name):
    norm = build_norm(name, 8, 2)
    with pytest.raises(ValueError, match="padding"):
        norm(torch.randn(2, 3, 8), torch.ones(2, 3, dtype=torch.bool))
    if name == "power":
        assert int(norm.num_batches_tracked) == 0  # a refused batch is not counted


def test_uint8_pad_mask_is_read_as_boolean():
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(8))
    pad = torch.tensor([[0, 0, 1], [0, 1, 1]])
    for name in BATCH:
        a, b = build_norm(name, 8, 2), build_norm(name, 8, 2)
        torch.testing.assert_close(a(x, pad.to(torch.uint8)), b(x, pad.bool()))


def test_powernorm_under_bf16_autocast_keeps_fp32_statistics():
    gen = torch.Generator().manual_seed(9)
    norm = PowerNorm(8, groups=2, warmup=1)
    pad = torch.zeros(2, 3, dtype=torch.bool)
    pad[1, 2] = True
    for _ in range(3):  # across the warmup boundary
        x = (torch.randn(2, 3, 8, generator=gen) * 300).to(torch.bfloat16).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(x, pad)
        assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
        y.float().sum().backward()
        assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()
        for name, buf in norm.named_buffers():
            if name != "num_batches_tracked":
                assert buf.dtype == torch.float32 and torch.isfinite(buf).all(), name
    assert norm.num_batches_tracked.dtype == torch.int64
    # fp16 activations with |x| > 256, where x^2 overflows fp16: test_norms.py's
    # test_every_norm_keeps_fp32_statistics_on_fp16_activations compares every norm with its fp32
    # result.


def test_powernorm_counter_counts_training_forwards_only():
    norm = PowerNorm(4, warmup=10)
    x = torch.randn(2, 3, 4)
    for _ in range(3):
        norm(x, None)  # forwards, no backward, no optimizer step: still counted (as the code)
    norm.eval()
    norm(x, None)
    assert norm.num_batches_tracked.item() == 3


def test_build_norm_passes_heads_and_options():
    assert {"batch", "pnv", "power"} <= set(BATCH)
    opts = {"warmup": 7, "variant": "code", "alpha_fwd": 0.95}
    pn = build_norm("power", 16, 4, opts)  # GroupScaling's groups = heads (Code)
    got = (pn.group_scaling.groups, pn.warmup, type(pn), pn.alpha_fwd, pn.alpha_bkw)
    assert got == (4, 7, PowerNormCode, 0.95, 0.9)
    assert type(build_norm("power", 16, 4, {"warmup": 7})) is PowerNorm
    assert isinstance(build_norm("batch", 16, 4, opts), BatchNorm)
    assert isinstance(build_norm("pnv", 16, 4, opts), PNV)
    with pytest.raises(ValueError):
        PowerNorm(10, groups=4)
    with pytest.raises(ValueError):
        build_norm("power", 8, 1, {"variant": "fairseq"})
    assert math.isclose(pn.eps, 1e-5)


def test_batch_mean_is_the_plain_masked_mean_on_one_process():
    """norms.batch_mean: the per-channel mean over the real tokens and their number (no sum over
    ranks here)."""
    gen = torch.Generator().manual_seed(10)
    v = torch.randn(3, 4, 5, generator=gen, dtype=F64)
    real = ~random_pad_mask(gen, 3, 4)
    mean, n = norms.batch_mean(v, real)
    torch.testing.assert_close(mean, v[real].mean(0), rtol=1e-12, atol=1e-12)
    assert n.item() == real.sum().item()


def test_batchnorm_refuses_one_real_token_in_training_and_changes_nothing():
    """The unbiased running variance N/(N-1) needs N >= 2: one real token is a clear error, not
    inf."""
    norm = BatchNorm(4)
    pad = torch.ones(2, 3, dtype=torch.bool)
    pad[1, 2] = False
    with pytest.raises(ValueError, match="more than 1 real token, got 1"):
        norm(torch.randn(2, 3, 4), pad)
    assert int(norm.num_batches_tracked) == 0 and torch.equal(norm.running_var, torch.ones(4))
    pad[0, 0] = False
    assert torch.isfinite(norm(torch.randn(2, 3, 4), pad)).all()  # two are enough
