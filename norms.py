"""norms.py -- every normalization of the three papers, one class per equation.

Read this file first (reading order: norms.py -> model.py -> data.py -> train.py -> decode.py).

Shapes, declared once for the whole project:
    B  batch size (sentences)         S  source length     T  target length
    D  model width (d_model)          H  attention heads   Dh = D / H
    V  vocabulary size
Every norm here is called as ``norm(x, pad_mask)`` with x of shape (B, T, D) and
pad_mask (B, T) bool, True at padding (or None). The per-token norms ignore the mask;
the batch-statistics norms (BatchNorm, PN-V, PowerNorm) need it so that padding never
enters their statistics.

Papers (numbers used in comments):
  [1] Nguyen & Salazar 2019, Transformers without Tears (TwT): ScaleNorm eq. 5, FixNorm eq. 6.
  [2] Shen et al. 2020, PowerNorm: Rethinking Batch Normalization in Transformers.
  [3] Henry et al. 2020, Query-Key Normalization for Transformers (QKNorm; in model.py).
  [4] Zhang & Sennrich 2019, Root Mean Square Layer Normalization (RMSNorm).
  [5] Ba et al. 2016, Layer Normalization.

Comment markers: ``# Paper:`` is what a paper says, ``# Note:`` is ours, and
``# Code:`` is what the authors' released code does (../shared/REFERENCE.md).

Run ``python norms.py --benchmark`` to time every norm's forward+backward against LayerNorm.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------
# LayerNorm [5]:  y = gamma * (x - mu) / sqrt(sigma^2 + eps) + beta
#   mu = mean_i x_i,  sigma^2 = mean_i (x_i - mu)^2   (over the D features of one token)
# ---------------------------------------------------------------------------------------
class LayerNorm(nn.Module):
    """LayerNorm [5] with 2D parameters (gamma, beta); eps 1e-5 as in the TwT code."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))  # gamma
        self.bias = nn.Parameter(torch.zeros(d))  # beta

    @staticmethod
    def formula(x, weight, bias, eps):
        """The equation written out, for reading and for the tests."""
        mu = x.mean(-1, keepdim=True)  # (B, T, 1)  mu
        var = (x - mu).pow(2).mean(-1, keepdim=True)  # (B, T, 1)  sigma^2 (biased)
        return weight * (x - mu) / torch.sqrt(var + eps) + bias  # (B, T, D)

    def forward(self, x, pad_mask=None):
        # Note: the fast path is PyTorch's fused kernel; tests check it equals formula().
        # Under autocast layer_norm runs in fp32 (it is on autocast's fp32 list).
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


# ---------------------------------------------------------------------------------------
# ScaleNorm [1, eq. 5]:  ScaleNorm(x; g) = g * x / ||x||,   one scalar g, init sqrt(D)
# ---------------------------------------------------------------------------------------
class ScaleNorm(nn.Module):
    """Scaled l2 normalization [1, eq. 5]: projects each token onto the sphere of radius g.

    Code: eps *clamps* the norm (g * x / max(||x||, eps)), it is not added; eps 1e-5.
    ``learn_g=False`` keeps g fixed at sqrt(D) (TwT Table 7, "ScaleNorm (g = sqrt d)";
    not in the authors' code).
    """

    def __init__(self, d, eps=1e-5, learn_g=True):
        super().__init__()
        self.eps = eps
        g = torch.tensor(math.sqrt(d))  # Paper: "All g's in ScaleNorm are initialized to sqrt(d)"
        if learn_g:
            self.g = nn.Parameter(g)
        else:
            self.register_buffer("g", g)

    @staticmethod
    def formula(x, g, eps):
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (B, T, 1)  ||x||
        return g * x / norm.clamp_min(eps)  # (B, T, D)  g x / ||x||

    def forward(self, x, pad_mask=None):
        # Note: statistics in fp32 even under autocast (an fp16 ||x||^2 overflows at |x|~256).
        # Three implementations of one equation, tested equal (tests/test_norms.py):
        #   formula()                 the equation, differentiated by autograd (~6 passes over x)
        #   _ScaleNormFunction        the same with the gradient written out (one dot product)
        #   _FusedScaleNormFunction   PyTorch's fused weight-norm kernel: one C++ pass forward,
        #                             one backward, faster than F.layer_norm (the CPU path)
        return _scale_norm(_at_least_fp32(x), self.g, self.eps).to(x.dtype)


class _ScaleNormFunction(torch.autograd.Function):
    """y = g x / n, n = max(||x||, eps), with its exact gradient (tests: gradcheck, = formula()):

        dL/dx = (g / n) * (dy - x * <dy, x> / n^2)     (the projection term only where ||x|| > eps)
        dL/dg = sum over tokens of <dy, x> / n
    One dot product <dy, x> per token serves both.
    """

    @staticmethod
    def forward(ctx, x, g, eps):
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (B, T, 1)  ||x||
        clamped = n < eps
        n = n.clamp_min(eps)
        ctx.save_for_backward(x, n, clamped, g)
        return x * (g / n)  # (B, T, D)

    @staticmethod
    def backward(ctx, dy):
        x, n, clamped, g = ctx.saved_tensors
        dot = torch.linalg.vecdot(dy, x).unsqueeze(-1)  # (B, T, 1)  <dy, x>
        proj = (dot / (n * n)).masked_fill(clamped, 0.0)  # (B, T, 1)
        dx = (dy - x * proj) * (g / n)
        dg = (dot / n).sum().to(g.dtype) if ctx.needs_input_grad[1] else None
        return dx, dg, None


class _FusedScaleNormFunction(torch.autograd.Function):
    """y = g x / max(||x||, eps) through PyTorch's fused weight-normalization kernel.

    Why the plain code is slower than LayerNorm: F.layer_norm is one C++ kernel that reads a
    token's D features once for its statistics and once to normalise, and one more kernel for
    the whole backward; formula() and _ScaleNormFunction run each step (norm, divide, dot
    product, subtract, scale) as its own pass over the (B*T, D) activations.
    The fix: weight normalization (Salimans & Kingma 2016) w = g v / ||v|| with one norm per row
    of v is ScaleNorm's equation with one g per row, and PyTorch ships it fused for CPU and CUDA:
        torch._weight_norm_interface(v, g_rows, 0)              -> (w, ||v|| per row)
        aten._weight_norm_interface_backward(dw, v, g, n, 0)    -> (dL/dv, dL/dg_rows)
    whose gradient is _ScaleNormFunction's: (g/n)(dy - x <dy, x>/n^2) and <dy, x>/n.
    The kernel has no eps (a zero row gives 0/0): rows with ||x|| < eps are recomputed with the
    clamp, y = x g/eps, a linear map (dL/dx = dy g/eps, dL/dg = <dy, x>/eps).
    Note: the kernel needs contiguous v and g (a strided v gives wrong values, an expanded g
    corrupts memory), hence the .contiguous() calls. Finding the clamped rows is a host sync,
    free on the CPU; on CUDA ScaleNorm keeps _ScaleNormFunction (no sync, see _scale_norm).
    """

    @staticmethod
    def forward(ctx, x, g, eps):
        x2 = x.reshape(-1, x.size(-1)).contiguous()  # (N, D), N = B*T tokens
        g_rows = g.detach().to(x2.dtype).reshape(1, 1).expand(x2.size(0), 1).contiguous()  # (N, 1)
        y, n = torch._weight_norm_interface(x2, g_rows, 0)  # (N, D) g x/||x||,  (N, 1) ||x||
        small = (n < eps).squeeze(1)  # (N,)  rows where the clamp max(||x||, eps) applies
        ctx.any_small = bool(small.any())
        if ctx.any_small:
            y[small] = x2[small] * (g_rows[small] / eps)
        ctx.eps, ctx.g_dtype = eps, g.dtype
        ctx.save_for_backward(x2, g_rows, n, small)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, g_rows, n, small = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).contiguous()
        dx, dg_rows = torch.ops.aten._weight_norm_interface_backward(dy2, x2, g_rows, n, 0)
        if ctx.any_small:
            dx[small] = dy2[small] * (g_rows[small] / ctx.eps)
            dg_rows[small] = torch.linalg.vecdot(dy2[small], x2[small]).unsqueeze(-1) / ctx.eps
        dg = dg_rows.sum().to(ctx.g_dtype) if ctx.needs_input_grad[1] else None  # g is one scalar
        return dx.view(dy.shape), dg, None


def _scale_norm(x, g, eps):
    """g x / max(||x||, eps) over the last dim: the fused kernel on the CPU (measured there:
    `python norms.py --benchmark`), the hand-written Function elsewhere."""
    if x.device.type == "cpu":
        return _FusedScaleNormFunction.apply(x, g, eps)
    return _ScaleNormFunction.apply(x, g, eps)


# ---------------------------------------------------------------------------------------
# RMSNorm [4]:  y_i = g_i * x_i / RMS(x),  RMS(x) = sqrt(mean_i x_i^2 + eps),  g init 1
# TwT section 4.2: tying the g_i of RMSNorm and dividing by sqrt(D) gives ScaleNorm.
# ---------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Root mean square layer normalization [4]: per-feature gain, no centring, no bias."""

    def __init__(self, d, eps=1e-8):  # Note: eps 1e-8 as in [4]'s released code
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))  # g_i

    @staticmethod
    def formula(x, weight, eps):
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (B, T, 1)  RMS(x)
        return weight * x / rms  # (B, T, D)

    def forward(self, x, pad_mask=None):
        # formula() with a hand-written backward (tests: gradcheck, = formula()): on the CPU
        # through the fused weight-norm kernel (_FusedRMSNormFunction), elsewhere written out.
        fn = _FusedRMSNormFunction if x.device.type == "cpu" else _RMSNormFunction
        return fn.apply(_at_least_fp32(x), self.weight, self.eps).to(x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """y = w * x * r, r = 1 / sqrt(mean(x^2) + eps), with its exact gradient; u = dy * w:

        dL/dx = r * (u - x r^2 * <u, x> / D),      dL/dw = sum over tokens of dy * x * r
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (B, T, 1)  1/RMS(x)
        ctx.save_for_backward(x, weight, r)
        return weight * (x * r)  # (B, T, D)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        xr = x * r  # (B, T, D)  x / RMS(x)
        u = dy * weight.to(dy.dtype)
        m = torch.linalg.vecdot(u, xr).unsqueeze(-1) / x.size(-1)  # (B, T, 1)  <u, x r> / D
        dx = (u - xr * m) * r
        dw = (dy * xr).reshape(-1, x.size(-1)).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class _FusedRMSNormFunction(torch.autograd.Function):
    """RMSNorm's backward through two fused C++ kernels that PyTorch ships, with exact math.

    dL/dx: with r = 1/RMS(x) and u = w * dy, RMSNorm's input gradient is  r u - (r^3/D) <u, x> x,
    and the weight-norm kernel's backward (see _FusedScaleNormFunction) for g v/n computes
    (g/n) u - (g/n^3) <u, v> v.  The two agree for
        n = sqrt(||x||^2 + D eps) = sqrt(D) / r,     g = sqrt(D),
    so that kernel, handed this n instead of ||x||, computes dL/dx in one pass (eps included;
    a zero row gives r u).
    dL/dw = sum over tokens of dy * x r: LayerNorm's backward computes dL/dgamma = sum of
    dy * (x - mean) rstd from the mean and rstd it is handed; with mean 0 and rstd r it is
    RMSNorm's dL/dw (its dL/dx is not: it has LayerNorm's centring term, so it is not asked for).
    The forward is a norm and two multiplies, as in _RMSNormFunction.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        d = x.size(-1)
        x2 = x.reshape(-1, d).contiguous()  # (N, D)
        n = torch.sqrt(torch.linalg.vector_norm(x2, dim=-1, keepdim=True).square_() + d * eps)  # (N, 1)
        ctx.save_for_backward(x2, weight, n)
        return (x2 * (math.sqrt(d) / n)).mul_(weight.to(x2.dtype)).view(x.shape)  # w * x / RMS(x)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, n = ctx.saved_tensors
        d = x2.size(-1)
        dy2 = dy.reshape(x2.shape).contiguous()
        w = weight.to(dy2.dtype)
        g = torch.full_like(n, math.sqrt(d))  # (N, 1)
        dx, _ = torch.ops.aten._weight_norm_interface_backward(dy2 * w, x2, g, n, 0)
        dw = None
        if ctx.needs_input_grad[1]:
            r = g / n  # (N, 1)  1/RMS(x)
            _, dw, _ = torch.ops.aten.native_layer_norm_backward(dy2, x2, [d], torch.zeros_like(r), r, w, None,
                                                                 [False, True, False])
            dw = dw.to(weight.dtype)
        return dx.view(dy.shape), dw, None


# ---------------------------------------------------------------------------------------
# FixNorm [1, section 2.3; Nguyen & Chiang 2018]:  FixNorm(w) = w / ||w||  per embedding row
#
# Paper (eq. 6): with ScaleNorm + FixNorm the final linear layer computes
#     g * (w . x) / (||w|| ||x||)      (cosine normalization with a learned scale g).
# Code: there is no separate FixNorm g. The embedding rows are l2-normalised on every
# forward, the decoder's final PreNorm ScaleNorm makes ||x|| = g, so
#     logit_w = x . w/||w|| + b_w = g * cos(x, w) + b_w:
# the final ScaleNorm's g *is* eq. 6's learned g (a softmax temperature). model.py does
# exactly that; this function is the row normalization.
# ---------------------------------------------------------------------------------------
def fixnorm_formula(weight, eps=1e-12):
    """l2-normalise each row of an embedding matrix (V, D): ||fixnorm(w)_v|| = 1."""
    return weight / torch.linalg.vector_norm(weight, dim=-1, keepdim=True).clamp_min(eps)


def fixnorm(weight, eps=1e-12):
    """fixnorm_formula(), computed as ScaleNorm with g = 1 (the fused kernel on the CPU)."""
    return _scale_norm(_at_least_fp32(weight), weight.new_ones(()), eps).to(weight.dtype)


# =======================================================================================
# The batch-statistics norms of PowerNorm [2]. Unlike the per-token norms above, their
# statistics run over the batch: over every *real* token of the batch, per channel.
# Paper [2, footnote 1]: "the batch size actually corresponds to all non-padded words".
# So a batch of B sentences of T positions is, for these norms, a set of N <= B*T tokens.
# =======================================================================================
def _at_least_fp32(x):
    """x in fp32, or in fp64 if it already is (the tests run in fp64). Statistics of
    half-precision activations overflow: x^2 > 65504 in fp16 once |x| > 256."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _real_tokens(x, pad_mask):
    """The (B, T) bool mask of real (non-padding) tokens; a clear error for an all-padding batch."""
    if pad_mask is None:
        return torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
    # Note: .bool() first; ~ on a uint8 mask gives 254/255, not False/True (a pitfall of the code).
    real = ~pad_mask.bool()  # (B, T)
    if not real.any():
        # Code: the authors' module divides 0 by 0 here and returns NaN; we refuse instead.
        raise ValueError("batch statistics need at least one non-padding token; the batch is all padding")
    return real


class _AllReduceSum(torch.autograd.Function):
    """y = sum over ranks of x (torch.distributed, op SUM), with its gradient: every rank's
    y is the same sum, so dL/dx on a rank is the sum over ranks of their dL/dy.
    (dist.all_reduce alone is in place and invisible to autograd: the other ranks' share of
    the gradient would be lost. torch.distributed.nn.functional.all_reduce did this too; it is
    deprecated in torch 2.13.)"""

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        torch.distributed.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx = dy.clone()
        torch.distributed.all_reduce(dx)
        return dx


def _all_reduce_sum(*tensors):
    """Each tensor summed over all ranks of torch.distributed (one collective), differentiably;
    the tensors themselves on one process. Returns a tuple, one entry per argument.

    Used for the batch statistics in training: the ranks of DistributedDataParallel each hold
    a shard of the batch, and summing the per-rank sums (and token counts) gives exactly the
    statistics of the whole batch. Code: the authors' BN/PN never synchronise statistics
    across GPUs (each GPU normalises with its own shard's); we do, like nn.SyncBatchNorm.
    Note: counts travel as floats of the statistics' dtype: exact up to 2^24 tokens per
    batch in fp32.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensors
    flat = _AllReduceSum.apply(torch.cat([t.reshape(-1) for t in tensors]))  # one message, not one per tensor
    return tuple(f.view_as(t) for f, t in zip(flat.split([t.numel() for t in tensors]), tensors))


# ---------------------------------------------------------------------------------------
# BatchNorm for Transformers [2, Algorithm 1]:
#   mu_B = 1/N sum_i x_i,  sigma_B^2 = 1/N sum_i (x_i - mu_B)^2     (per channel, N real tokens)
#   y = gamma * (x - mu_B) / sqrt(sigma_B^2 + eps) + beta
# ---------------------------------------------------------------------------------------
class BatchNorm(nn.Module):
    """Batch normalization over the real tokens of a batch [2, Algorithm 1] ("Transformer_BN").

    Equals ``torch.nn.BatchNorm1d`` applied to ``x[~pad_mask]`` (N, D): the same buffers
    (running_mean, running_var updated with the *unbiased* variance, num_batches_tracked)
    and the same defaults (eps 1e-5, momentum 0.1, i.e. the paper's alpha = 0.9). Padding
    positions are normalized with the real tokens' statistics and never enter them.
    Plain autograd, which gives the paper's eq. 3 (both batch statistics get gradient).
    Note: a nonzero upstream gradient at padding would reach the real tokens through
    mu_B and sigma_B; in the Transformer it is zero (loss and attention mask padding).
    Under torch.distributed the statistics run over the real tokens of every rank
    (_all_reduce_sum), so B ranks with shards of a batch normalise as one process with all of it.

    Differs from the authors' code: their BN first RMS-scales each token over all D channels,
    overwrites padding rows with the real rows' mean, then runs ordinary BN (momentum 0.05)
    over all B*T rows, which shrinks the variance by N / (B*T). We follow Algorithm 1.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))  # gamma
        self.bias = nn.Parameter(torch.zeros(num_features))  # beta
        self.register_buffer("running_mean", torch.zeros(num_features))  # mu
        self.register_buffer("running_var", torch.ones(num_features))  # sigma^2
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))  # as torch's

    def forward(self, x, pad_mask=None):
        xf = _at_least_fp32(x)  # statistics in fp32 under autocast
        if self.training:
            xr = xf[_real_tokens(xf, pad_mask)]  # (N_r, D)  the real tokens of this rank
            # Note: under torch.distributed the sums and N run over every rank's real tokens
            # (_all_reduce_sum); on one process they are this batch's. Two passes (mean, then
            # centred squares) rather than E[x^2] - mu^2, which cancels catastrophically.
            # Code: the authors' BN uses each GPU's own shard only (never synchronised).
            x_sum, n = _all_reduce_sum(xr.sum(0), xr.new_tensor(float(xr.shape[0])))  # (D,), ()
            n = int(n)  # N, real tokens of the whole batch
            if n < 2:  # Note: the unbiased running variance needs two tokens (torch raises too)
                raise ValueError(f"BatchNorm in training needs more than 1 real token, got {n}")
            # Paper (Alg. 1): mu_B = 1/N sum_i x_i
            mu = x_sum / n  # (D,)  mu_B
            # Paper (Alg. 1): sigma_B^2 = 1/N sum_i (x_i - mu_B)^2   (biased)
            (sq_sum,) = _all_reduce_sum((xr - mu).pow(2).sum(0))  # (D,)
            var = sq_sum / n  # (D,)  sigma_B^2
            with torch.no_grad():
                m = self.momentum  # Paper's alpha = 1 - momentum
                # Paper (Alg. 1): mu = alpha mu + (1 - alpha) mu_B
                self.running_mean.copy_((1 - m) * self.running_mean + m * mu)
                # Note: like torch.nn.BatchNorm1d, the running variance takes the unbiased
                # N/(N-1) sigma_B^2; Algorithm 1 writes the biased sigma_B^2.
                self.running_var.copy_((1 - m) * self.running_var + m * var * n / (n - 1))
                self.num_batches_tracked += 1
        else:
            # Paper (inference): y = gamma * (x - mu) / sigma + beta, running statistics only
            mu, var = self.running_mean, self.running_var
        # Paper (Alg. 1, eqs. 1-2): y = gamma * (x - mu_B) / sigma_B + beta
        y = self.weight * (xf - mu) / torch.sqrt(var + self.eps) + self.bias  # (B, T, D)
        return y.to(x.dtype)


# ---------------------------------------------------------------------------------------
# PN-V [2, Definition 1]:  psi_B^2 = 1/N sum_i x_i^2   (quadratic mean, no centring)
#   y = gamma * x / sqrt(psi_B^2 + eps) + beta
# ---------------------------------------------------------------------------------------
class PNV(nn.Module):
    """Power normalization with batch statistics, PN-V [2, Definition 1, eqs. 4-5].

    BN without the mean: divide by the per-channel quadratic mean of the real tokens.
    Plain autograd, which gives the paper's eq. 6 (gradient through psi_B^2). Padding is
    normalized too and kept out of psi_B^2 (same gradient note as BatchNorm). Under
    torch.distributed psi_B^2 runs over every rank's real tokens, as in BatchNorm.
    Eval uses the running quadratic mean phi (starts at 1), updated in training like
    torch's running variance: phi = (1 - momentum) phi + momentum psi_B^2, momentum 0.1
    (alpha = 0.9). No N/(N-1) factor: a mean of squares is already unbiased for E[x^2].

    Note: the paper gives no inference rule for PN-V; the running phi is ours (the same
    EMA as eq. 10). Appendix A puts a "layer-scale layer" before every BN/PN in its
    experiments; we keep PN-V exactly Definition 1 (PowerNorm below has GroupScaling).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))  # gamma
        self.bias = nn.Parameter(torch.zeros(num_features))  # beta
        self.register_buffer("running_phi", torch.ones(num_features))  # running psi^2

    def forward(self, x, pad_mask=None):
        xf = _at_least_fp32(x)
        if self.training:
            xr = xf[_real_tokens(xf, pad_mask)]  # (N_r, D)  the real tokens of this rank
            # Note: sum and N over every rank's real tokens under torch.distributed
            # (Code: the authors' statistics are per GPU).
            sq_sum, n = _all_reduce_sum(xr.pow(2).sum(0), xr.new_tensor(float(xr.shape[0])))
            # Paper (Def. 1): psi_B^2 = 1/N sum_i x_i^2
            psi2 = sq_sum / n  # (D,)  psi_B^2
            with torch.no_grad():
                m = self.momentum  # alpha = 1 - momentum
                # Note: phi = (1 - momentum) phi + momentum psi_B^2   (eq. 10's EMA)
                self.running_phi.copy_((1 - m) * self.running_phi + m * psi2)
        else:
            psi2 = self.running_phi
        # Paper (eqs. 4-5): y = gamma * x / psi_B + beta
        y = self.weight * xf / torch.sqrt(psi2 + self.eps) + self.bias  # (B, T, D)
        return y.to(x.dtype)


# ---------------------------------------------------------------------------------------
# GroupScaling [2, appendix A "layer-scale layer"; code]: RMSNorm [4] without gain, per group
#   split the D channels of a token into G contiguous groups of D/G; in each group
#   x_i <- x_i / sqrt(mean_group x_j^2 + eps)
# ---------------------------------------------------------------------------------------
class GroupScaling(nn.Module):
    """Per-token, per-group RMS scaling in front of PowerNorm (no parameters, eps 1e-5).

    Paper: one sentence in appendix A ("a layer-scale layer (Zhang & Sennrich, 2019) ...
    before the normalization layer"). Code: G = number of attention heads; the authors say
    it is what keeps PN from NaNs. Not in the registry: PowerNorm owns one.
    """

    def __init__(self, groups=1, eps=1e-5):
        super().__init__()
        self.groups, self.eps = groups, eps

    def forward(self, x):
        xg = x.unflatten(-1, (self.groups, -1))  # (B, T, G, D/G)
        ms = xg.pow(2).mean(-1, keepdim=True)  # (B, T, G, 1)  mean of x^2 over each group
        return (xg / torch.sqrt(ms + self.eps)).flatten(-2)  # (B, T, D)


# ---------------------------------------------------------------------------------------
# PowerNorm (PN) [2, Definition 3, Algorithm 2]. At training step t, per channel:
#   forward:   X^ = X / psi_{t-1}                                     (eq. 8)
#              Y  = gamma X^ + beta                                    (eq. 9)
#              psi_t^2 = alpha_fwd psi_{t-1}^2 + (1 - alpha_fwd) psi_B^2  (eq. 10)
#   backward:  the statistics get no gradient; instead ("approximate backpropagation")
#              X^' = dL/dX^ - nu_{t-1} X^                              (eq. 11)
#              dL/dX = X^' / psi_{t-1}                                 (eq. 12)
#              nu_t = nu_{t-1} (1 - (1 - alpha_bkw) Gamma) + (1 - alpha_bkw) Lambda  (eq. 13)
#              Gamma = mean_i x^_i x^_i,  Lambda = mean_i dL/dx^_i x^_i
#   inference: Y = gamma X / psi + beta
# Here psi^2 is stored as running_phi (phi = psi^2) and psi = sqrt(phi + eps).
# ---------------------------------------------------------------------------------------
class _PowerNormFunction(torch.autograd.Function):
    """Eqs. 8-9 forward and eqs. 11-13 backward of PN, for one training step.

    The module decides which statistic divides in the forward (fwd_stat) and in the
    backward (bwd_stat); this function owns the backward statistic nu and updates it in place.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, fwd_stat, bwd_stat, running_nu, real, alpha_bkw, eps, code):
        # Paper (eq. 8): X^ = X / psi_{t-1}   (during warmup: X / psi_B)
        z = x / torch.sqrt(fwd_stat + eps)  # (B, T, D)  X^
        ctx.save_for_backward(z, weight, bwd_stat, real)
        # Note: nu is kept as a plain attribute, not saved_for_backward: it is changed in place
        # by every backward, which autograd's version check would refuse when a module runs
        # twice in one graph.
        ctx.running_nu, ctx.alpha_bkw, ctx.eps, ctx.code = running_nu, alpha_bkw, eps, code
        # Paper (eq. 9): Y = gamma X^ + beta
        return weight * z + bias  # (B, T, D)

    @staticmethod
    def backward(ctx, dy):
        z, weight, bwd_stat, real = ctx.saved_tensors
        nu, a = ctx.running_nu, ctx.alpha_bkw  # nu_{t-1}: (D,)
        if not ctx.code:
            # Note: padding is not part of the paper's batch: it sends no gradient anywhere
            # (not to x, gamma, beta, nor into Gamma and Lambda).
            dy = torch.where(real.unsqueeze(-1), dy, 0.0)  # (B, T, D)
        # Paper (Alg. 2): dL/dX^ = gamma dL/dY
        g = weight * dy  # (B, T, D)  dL/dX^
        # Paper (eq. 11): X^' = dL/dX^ - nu_{t-1} X^
        g_tilde = g - nu * z  # (B, T, D)  X^'
        # Paper (eq. 12): dL/dX = X^' / psi_{t-1}
        # Code: divides by the batch psi_B even after warmup (the module passes bwd_stat).
        dx = g_tilde / torch.sqrt(bwd_stat + ctx.eps)  # (B, T, D)
        # Note: the sums and counts of the two means run over every rank under torch.distributed
        # (Code: per GPU in the authors' code). A collective inside backward is safe: every rank
        # runs the same backward graph, so they meet in the same order (as nn.SyncBatchNorm does).
        # Note: eqs. 11-13 are not linear in dL/dY (nu X^ does not scale with it), so every rank's
        # dL/dY must be the whole batch's, not world x it: see train_step in train.py.
        if ctx.code:
            # Code: Gamma and Lambda are means over all B*T positions, padding included.
            zz, gz, n = _all_reduce_sum((z * z).sum((0, 1)), (g * z).sum((0, 1)),
                                        z.new_tensor(float(real.numel())))
        else:
            # Paper: means over the N real tokens (footnote 1); padding gets zero gradient.
            zz, gz, n = _all_reduce_sum((z * z)[real].sum(0), (g * z)[real].sum(0),
                                        z.new_tensor(float(real.sum())))
            dx = torch.where(real.unsqueeze(-1), dx, 0.0)
        gamma_t = zz / n  # (D,)  Gamma = mean_i x^_i x^_i
        lambda_t = gz / n  # (D,)  Lambda = mean_i dL/dx^_i x^_i
        # Paper (eq. 13): nu_t = nu_{t-1} (1 - (1 - alpha) Gamma) + (1 - alpha) Lambda
        nu.copy_(nu * (1 - (1 - a) * gamma_t) + (1 - a) * lambda_t)
        # dgamma = sum_i dL/dy_i x^_i,  dbeta = sum_i dL/dy_i
        dweight = (dy * z).sum((0, 1))  # (D,)
        dbias = dy.sum((0, 1))  # (D,)
        return dx, dweight, dbias, None, None, None, None, None, None, None


class PowerNorm(nn.Module):
    """Power normalization, PN [2, Definition 3, Algorithm 2], with GroupScaling in front.

    y = gamma * GroupScaling(x) / psi + beta, psi^2 a running quadratic mean of the real
    tokens, with the approximate backward of eqs. 11-13 (a custom autograd.Function).
    Warmup (appendix A names it; Algorithm 2 has none; details from the code): for the first
    ``warmup`` training forwards the batch psi_B divides instead, while phi accumulates. Eval: running
    statistic only, so each sentence's output is independent of the rest of the batch.
    Buffers: running_phi (= psi^2, starts at 1), running_nu (the paper's nu itself, starts
    at 0), num_batches_tracked (int64, training forwards). All in fp32 under autocast.

    ``variant="paper"`` follows the equations; ``variant="code"`` reproduces the authors'
    released module (../shared/REFERENCE.md), which differs in three places:
      - backward divides by the batch psi_B even after warmup (paper: psi_{t-1}, eq. 12);
      - Gamma and Lambda average over all B*T positions, padding included, and padding
        positions get gradient (paper: real tokens only; here padding gets zero gradient);
      - during warmup phi first becomes the cumulative mean of the psi_B^2 so far and then
        takes the EMA step (paper: the EMA of eq. 10 at every step).
    Both variants normalize padding positions with the same statistic (finite outputs) and
    never let padding into psi_B^2. Other differences from the code: it stores nu/(1-alpha_bkw)
    where we store nu; an all-padding batch gives NaN there and a ValueError here; its
    psi_B^2, Gamma and Lambda are per GPU, ours run over every rank under torch.distributed.
    ``groups`` defaults to ``heads`` (what build_norm passes), as in the code.
    """

    def __init__(self, num_features, groups=None, warmup=4000, alpha_fwd=0.9, alpha_bkw=0.9,
                 eps=1e-5, variant="paper", heads=1):
        super().__init__()
        groups = heads if groups is None else groups
        if num_features % groups:
            raise ValueError(f"num_features {num_features} is not divisible by groups {groups}")
        if variant not in ("paper", "code"):
            raise ValueError(f"variant must be 'paper' or 'code', got {variant!r}")
        self.groups, self.warmup, self.eps, self.variant = groups, warmup, eps, variant
        self.alpha_fwd, self.alpha_bkw = alpha_fwd, alpha_bkw
        self.group_scaling = GroupScaling(groups, eps=1e-5)  # Code: eps 1e-5 inside the sqrt
        # Code: weight and bias are always there (whatever ``affine`` says), ones and zeros.
        self.weight = nn.Parameter(torch.ones(num_features))  # gamma
        self.bias = nn.Parameter(torch.zeros(num_features))  # beta
        self.register_buffer("running_phi", torch.ones(num_features))  # phi = psi^2, starts at 1
        self.register_buffer("running_nu", torch.zeros(num_features))  # nu (not nu/(1-alpha_bkw))
        # Note: counts training *forwards*, not optimizer updates (as the code does): with
        # gradient accumulation over k batches, warmup W lasts W/k updates. Average only the
        # float buffers when averaging checkpoints. phi and the counter change in forward and
        # nu in backward: do not wrap PN in activation checkpointing (forward would run twice).
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def extra_repr(self):
        return (f"{self.weight.shape[0]}, groups={self.groups}, warmup={self.warmup}, "
                f"alpha_fwd={self.alpha_fwd}, alpha_bkw={self.alpha_bkw}, variant={self.variant!r}")

    def forward(self, x, pad_mask=None):
        xs = self.group_scaling(_at_least_fp32(x))  # (B, T, D)  GroupScaling, plain autograd
        if not self.training:
            # Paper (inference): Y = gamma X / psi + beta   (running statistic only)
            y = self.weight * xs / torch.sqrt(self.running_phi + self.eps) + self.bias  # (B, T, D)
            return y.to(x.dtype)

        real = _real_tokens(xs, pad_mask)  # (B, T)
        self.num_batches_tracked += 1
        t = int(self.num_batches_tracked)  # this step, counted from 1
        with torch.no_grad():  # the statistics get no gradient (approximate backpropagation)
            # Note: sum and N over every rank's real tokens under torch.distributed.
            # Code: the authors' psi_B^2 is per GPU ("never synchronised across GPUs").
            xr = xs[real]  # (N_r, D)
            sq_sum, n = _all_reduce_sum(xr.pow(2).sum(0), xr.new_tensor(float(xr.shape[0])))
            # Paper (Alg. 2): psi_B^2 = 1/N sum_i x_i^2   over the N real tokens
            psi2 = sq_sum / n  # (D,)  psi_B^2
            phi = self.running_phi.clone()  # (D,)  psi_{t-1}^2
        # Paper (appendix A) says only that a warmup "for accumulating psi" is used, W = the LR
        # warmup. Code: the batch psi_B divides while t <= W (as in PN-V), then eq. 8's psi_{t-1}.
        fwd_stat = psi2 if t <= self.warmup else phi
        # Paper (eq. 12): backward divides by psi_{t-1}; Note: we divide by what the forward
        # divided by, so psi_B during warmup. The approximate backward (with nu) runs during
        # warmup too, as in the code. Code: always by the batch psi_B.
        bwd_stat = psi2 if self.variant == "code" else fwd_stat
        y = _PowerNormFunction.apply(xs, self.weight, self.bias, fwd_stat, bwd_stat,
                                     self.running_nu, real, self.alpha_bkw, self.eps,
                                     self.variant == "code")  # (B, T, D)
        with torch.no_grad():
            if self.variant == "code" and t < self.warmup:
                # Code: phi <- (t-1)/t phi + 1/t psi_B^2 (cumulative mean) before the EMA step,
                # for t < W. Not in the paper: Algorithm 2 has only the EMA below.
                phi = phi * (t - 1) / t + psi2 / t
            # Paper (eq. 10): psi_t^2 = alpha psi_{t-1}^2 + (1 - alpha) psi_B^2
            self.running_phi.copy_(self.alpha_fwd * phi + (1 - self.alpha_fwd) * psi2)
        return y.to(x.dtype)


# ---------------------------------------------------------------------------------------
# The registry: the value of --norm (and --encoder-norm / --decoder-norm) -> the class.
# ---------------------------------------------------------------------------------------
NORMS = {
    "layer": LayerNorm,
    "scale": ScaleNorm,
    "scale_fixed": ScaleNorm,  # TwT Table 7: g fixed at sqrt(D), only the output g learned
    "rms": RMSNorm,
    "batch": BatchNorm,  # PowerNorm [2] Algorithm 1, over the real tokens
    "pnv": PNV,  # PowerNorm [2] Definition 1
    "power": PowerNorm,  # PowerNorm [2] Definition 3 / Algorithm 2, GroupScaling in front
}


def build_norm(name, d, heads=1, **options):
    """Make one norm of kind ``name`` for width d. ``heads`` feeds PowerNorm's GroupScaling.

    Unknown keyword options are ignored by the norms that do not use them, so the model can
    pass one option dict to every norm.
    """
    if name not in NORMS:
        raise ValueError(f"unknown norm {name!r}; choose one of {sorted(NORMS)}")
    if name == "scale_fixed":
        return ScaleNorm(d, learn_g=False)
    cls = NORMS[name]
    accepted = cls.__init__.__code__.co_varnames[: cls.__init__.__code__.co_argcount]
    kwargs = {k: v for k, v in dict(heads=heads, **options).items() if k in accepted}
    return cls(d, **kwargs)


# ---------------------------------------------------------------------------------------
# python norms.py --benchmark: forward + backward time of every norm on a base model's
# activations (B, T, D), each as a ratio to LayerNorm measured in the same process, with
# the measurements interleaved (round robin) so that machine noise hits every norm alike.
# Printed figures only; nothing is asserted about time anywhere.
# ---------------------------------------------------------------------------------------
def benchmark(batch=64, length=64, d=512, heads=8, repeats=30, rounds=5):
    import time

    x0 = torch.randn(batch, length, d)
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[: batch // 2, length - length // 8:] = True  # some padding, as in a real batch
    dy = torch.randn_like(x0)
    norms = {name: build_norm(name, d, heads=heads, warmup=1) for name in NORMS}
    # the slower forms of the same equations, for comparison (the modules use the fused form on the CPU)
    sn, rms = norms["scale"], norms["rms"]
    norms["scale:formula"] = lambda x, pad: ScaleNorm.formula(x, sn.g, sn.eps)
    norms["scale:written"] = lambda x, pad: _ScaleNormFunction.apply(x, sn.g, sn.eps)
    norms["rms:formula"] = lambda x, pad: RMSNorm.formula(x, rms.weight, rms.eps)
    norms["rms:written"] = lambda x, pad: _RMSNormFunction.apply(x, rms.weight, rms.eps)
    times = {name: [] for name in norms}
    for _ in range(rounds):
        for name, norm in norms.items():
            x = x0.clone().requires_grad_(True)
            for _ in range(2):  # warm-up
                norm(x, pad).backward(dy)
            t0 = time.perf_counter()
            for _ in range(repeats):
                norm(x, pad).backward(dy)
            times[name].append((time.perf_counter() - t0) / repeats)
    best = {name: min(t) for name, t in times.items()}  # min over rounds: the least disturbed
    return best


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Time every norm's forward+backward against LayerNorm.")
    p.add_argument("--benchmark", action="store_true", help="run the benchmark (the only action)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--d-model", type=int, default=512, help="D of the activations (base model: 512)")
    p.add_argument("--heads", type=int, default=8, help="PowerNorm's GroupScaling groups")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if not a.benchmark:
        p.print_help()
        raise SystemExit(0)
    if a.threads:
        torch.set_num_threads(a.threads)
    best = benchmark(a.batch, a.length, a.d_model, a.heads)
    print(f"forward+backward on ({a.batch}, {a.length}, {a.d_model}) fp32, {torch.get_num_threads()} threads, "
          f"best of 5 rounds x 30:")
    for name, t in best.items():
        print(f"  {name:14s} {t * 1e3:8.3f} ms   {t / best['layer']:5.2f} x LayerNorm")
