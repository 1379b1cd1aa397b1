"""norms.py -- chapter 1: every normalization of the three papers, one class per equation.

Reading order: norms.py -> model.py -> data.py -> decode.py -> train.py (each file imports only
the ones before it). Run ``python norms.py --benchmark`` to time every norm against LayerNorm
(machinery/speed.py holds the timing harness; a reader of the papers never needs it).

Contents
  1. Conventions: shapes, the padding mask, fp32 statistics, --reference
  2. LayerNorm [5]
  3. ScaleNorm [1, eq. 5] and FixNorm [1, section 2.3; with ScaleNorm, eq. 6]
  4. RMSNorm [4]
  5. The batch-statistics norms of PowerNorm [2]: BatchNorm (Algorithm 1), PN-V (Definition 1),
     GroupScaling, PowerNorm (Definition 3, Algorithm 2, the approximate backward)
  6. No norm ([3] Table 6, "Without LayerNorm")
  7. The registry: --norm NAME -> its class, equation and paper (a new norm: its class, one entry,
     its test)
  Appendix A: batch statistics in practice: over several processes (torchrun), too few tokens
  Appendix B: diagnostics of the batch statistics ([2] Figures 2-4)
  Appendix C: PowerNorm as the authors' released code computes it (--pn-variant code)

Papers (one numbering for the whole project):
  [1] Nguyen & Salazar 2019, Transformers without Tears (TwT).
  [2] Shen et al. 2020, PowerNorm: Rethinking Batch Normalization in Transformers.
  [3] Henry et al. 2020, Query-Key Normalization for Transformers (QKNorm; in model.py).
  [4] Zhang & Sennrich 2019, Root Mean Square Layer Normalization (RMSNorm).
  [5] Ba et al. 2016, Layer Normalization.
Comment markers: ``# Paper:`` is what a paper says, ``# Note:`` is ours, ``# Code:`` is what the
authors' released code does: tnq177/transformers_without_tears (TwT), sIncerass/powernorm
(PowerNorm, a fairseq fork: fairseq/modules/norms/mask_powernorm.py), CyndxAI/QKNorm.
"""

import math
import runpy
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------
# 1. Conventions: shapes, the padding mask, fp32 statistics and --reference.
# Shapes, declared once for the whole project:
#     B  batch size (sentences)    S  source length    T  target length
#     D  model width (d_model)     H  attention heads  Dh = D / H      V  vocabulary size
# Every norm is called as norm(x, pad_mask): x (B, T, D), pad_mask (B, T) bool, True at padding
# (or None). Only the batch-statistics norms use the mask: padding never enters their statistics.
# Statistics are computed in fp32 even under bf16/fp16 autocast: x^2 overflows fp16 at |x| > 256.
# --reference (train.py, decode.py): use_reference() turns off the few fast paths (each one line
# from the equation it speeds up, kept because a whole training step measured faster with it), so
# that every equation runs exactly as written: a student who edits an equation and trains with
# --reference sees the effect.
# ---------------------------------------------------------------------------------------
_fast_paths = True


def fast_paths():
    """True unless --reference turned the fast paths off."""
    return _fast_paths


def use_reference(on=True):
    """--reference: every equation as written, no fast path anywhere (on=False: back to normal)."""
    global _fast_paths
    _fast_paths = not on


def at_least_fp32(x):
    """x in fp32, or in fp64 if it already is (the tests run in fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ---------------------------------------------------------------------------------------
# 2. LayerNorm [5]: y = gamma * (x - mu) / sqrt(sigma^2 + eps) + beta.
#      mu = mean_i x_i,  sigma^2 = mean_i (x_i - mu)^2       (over the D features of one token)
# Why: each token is centred and scaled by its own statistics, so its output never depends on the
# other sentences of the batch (BatchNorm's does): the Transformer's norm, the baseline of [1] and
# [2], and kept by [3].
# ---------------------------------------------------------------------------------------
# The parameters are torch's: weight gamma (ones), bias beta (zeros); eps 1e-5 (Code: as in TwT).
class LayerNorm(nn.LayerNorm):
    def forward(self, x, pad_mask=None):
        # The fast path is PyTorch's fused kernel, the same equation (tests); the written-out one
        # below costs 5-8% of a step.
        if fast_paths():
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        xf = at_least_fp32(x)
        mu = xf.mean(-1, keepdim=True)  # (B, T, 1)  mu
        var = (xf - mu).pow(2).mean(-1, keepdim=True)  # (B, T, 1)  sigma^2 (biased)
        return (self.weight * (xf - mu) / torch.sqrt(var + self.eps) + self.bias).to(x.dtype)


# ---------------------------------------------------------------------------------------
# 3. ScaleNorm [1, eq. 5]: ScaleNorm(x; g) = g * x / ||x||, each token onto a sphere of radius g.
# Why: [1] section 2.3: a norm need not fix a mean and a variance (what helps is a smoother loss
# landscape, after Santurkar et al. 2018). ScaleNorm keeps only each token's direction, on a sphere
# of learned radius g: the one "global scale" a sublayer's activations should have (in a run g tends
# to grow with depth: decode.py --g-table). One scalar in place of LayerNorm's 2D gains and biases,
# and fewer operations ([1]: 3d, not 7d; ~5% faster). One scalar g, initialised to sqrt(D);
# learn_g=False keeps it there ([1] Table 7, "ScaleNorm (g = sqrt d)"; not in the authors' code).
# Code: eps *clamps* the norm, g x / max(||x||, eps), it is not added; eps 1e-5.
# ---------------------------------------------------------------------------------------
class ScaleNorm(nn.Module):
    def __init__(self, d, eps=1e-5, learn_g=True):
        super().__init__()
        self.eps = eps
        g = torch.tensor(math.sqrt(d))  # Paper: "All g's in ScaleNorm are initialized to sqrt(d)"
        if learn_g:
            self.g = nn.Parameter(g)
        else:
            self.register_buffer("g", g)

    def forward(self, x, pad_mask=None):
        xf = at_least_fp32(x)
        # Exercise scalenorm: begin
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)  # (B, T, 1)  ||x||
        # Note: x * (g / ||x||) rather than g * x / ||x||: one pass over (B, T, D), not two.
        return (xf * (self.g / norm.clamp_min(self.eps))).to(x.dtype)  # (B, T, D)  g x / ||x||
        # Exercise scalenorm: end


# FixNorm [1, section 2.3; Nguyen & Chiang 2018]:  FixNorm(w) = g * w / ||w||, g fixed
# Why: at the output layer large inner products sharpen the softmax, and frequent words (long
# embeddings) crowd out rare ones. With unit rows and ||x|| = g a logit is g times a cosine: words
# compete by direction alone, which [1] and Nguyen & Chiang 2018 find helps rare words (and faster
# learning early in training, [1] Figure 1).
# Paper (eq. 6): with ScaleNorm + FixNorm the final linear layer computes
#     g * (w . x) / (||w|| ||x||)     (cosine normalization with a learned scale g).
# Code: FixNorm has no g of its own: each row of the embedding matrix (V, D) is l2-normalised on
# every forward (w / ||w||, below: ||fixnorm(w)_v|| = 1), and the decoder's final PreNorm ScaleNorm
# makes ||x|| = g, so logit_w = g cos(x, w) + b_w: the final ScaleNorm's g *is* eq. 6's g (an
# inverse softmax temperature).
def fixnorm(weight, eps=1e-12):
    # Exercise fixnorm: begin
    return weight / torch.linalg.vector_norm(weight, dim=-1, keepdim=True).clamp_min(eps)
    # Exercise fixnorm: end


# ---------------------------------------------------------------------------------------
# 4. RMSNorm [4]: y_i = g_i * x_i / RMS(x), RMS(x) = sqrt(mean_i x_i^2 + eps).
# The gains g_i start at 1; there is no centring and no bias. TwT section 4.2: tying the g_i of
# RMSNorm and dividing by sqrt(D) gives ScaleNorm.
# Why: [4]: LayerNorm's re-centring is not what makes it work; its re-scaling is, so RMSNorm keeps
# only that (the output does not change when x is scaled) and saves the mean and the bias.
# ---------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-8):  # Note: eps 1e-8 as in [4]'s released code
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))  # g_i

    def forward(self, x, pad_mask=None):
        xf = at_least_fp32(x)
        # Exercise rmsnorm: begin
        inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, 1)  1 / RMS(x)
        return (self.weight * (xf * inv_rms)).to(x.dtype)  # (B, T, D)
        # Exercise rmsnorm: end


# =======================================================================================
# 5. The batch-statistics norms of PowerNorm [2], over the real tokens of a batch.
# Their statistics are per channel, over the N <= B*T *real* tokens of a batch (real_tokens: not
# padding). Paper [2, footnote 1]: "the batch size actually corresponds to all non-padded words".
# In Appendix A: real_tokens, these statistics under torchrun, and too few tokens; in Appendix B:
# [2] Figures 2-4's diagnostics.
# =======================================================================================
def batch_mean(v, real):
    """The per-channel mean of v (B, T, D) over the real tokens (real (B, T) True), and their number
    N (0-dim)."""
    masked = torch.where(real.unsqueeze(-1), v, 0.0)  # (B, T, D)  padding contributes 0
    # The sums (D,) and the count (): summed over the ranks under torchrun (Appendix A), and left as
    # they are in one process.
    total, n = sum_over_ranks(masked.flatten(0, -2).sum(0), real.sum().to(v.dtype))
    return total / n, n


# ---------------------------------------------------------------------------------------
# BatchNorm for Transformers [2, Algorithm 1] ("Transformer_BN"), over the real tokens.
#   mu_B = 1/N sum_i x_i,  sigma_B^2 = 1/N sum_i (x_i - mu_B)^2     (per channel, N real tokens)
#   y = gamma * (x - mu_B) / sqrt(sigma_B^2 + eps) + beta
# Why: [2] section 3 asks why BatchNorm, the norm of vision, costs a Transformer 1.1-1.4 BLEU. Its
# answer: the batch statistics of text fluctuate far more than those of images. mu_B, sigma_B^2
# stray from the running statistics that inference uses, with outliers that persist through
# training, and so do their gradient terms g_mu, g_sigma^2 (eq. 3). See it in a run: train.py logs
# dist_mu, dist_sigma2, g_mu, g_sigma2 (Appendix B; decode.py --plot draws them). Equals
# torch.nn.BatchNorm1d on x[~pad_mask] (N, D): the same buffers and defaults (eps 1e-5, momentum
# 0.1, i.e. the paper's alpha = 0.9). Padding is normalized with the real tokens' statistics and
# never enters them. Plain autograd gives eq. 3 (both statistics get gradient). Note: a nonzero
# dL/dy at padding would reach the real tokens through mu_B and sigma_B; in the Transformer it is
# zero (loss and attention mask padding).
# Code: the authors' BN first RMS-scales each token over all D channels, overwrites padding rows
# with the real rows' mean, then runs ordinary BN (momentum 0.05) over all B*T rows, shrinking the
# variance by N / (B*T).
# ---------------------------------------------------------------------------------------
# The parameters and buffers are torch's, as the banner says: the same names, init and defaults.
class BatchNorm(nn.BatchNorm1d):
    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        # torch's weight is gamma and its bias beta; running_mean is mu, running_var sigma^2.
        super().__init__(num_features, eps, momentum)
        self.track, self.stats = False, {}

    def forward(self, x, pad_mask=None):
        xf = at_least_fp32(x)  # statistics in fp32 under autocast
        # Paper (inference): y = gamma * (x - mu) / sigma + beta, running statistics only
        if not self.training:
            y = (
                self.weight * (xf - self.running_mean) / torch.sqrt(self.running_var + self.eps)
                + self.bias
            )
            return y.to(x.dtype)
        real = real_tokens(xf, pad_mask)
        # Exercise batchnorm: begin
        mu, n = batch_mean(xf, real)  # (D,)  Paper (Alg. 1): mu_B = 1/N sum_i x_i
        # Note: two passes (mean, then centred squares) rather than E[x^2] - mu^2, which cancels
        # badly. Paper (Alg. 1): sigma_B^2 = 1/N sum_i (x_i - mu_B)^2, (D,).
        var, _ = batch_mean((xf - mu).pow(2), real)
        # Paper (eqs. 1-2): y = gamma (x - mu_B) / sqrt(sigma_B^2 + eps) + beta, (B, T, D).
        y = self.weight * (xf - mu) / torch.sqrt(var + self.eps) + self.bias
        # Exercise batchnorm: end
        refuse_one_token(n)  # Appendix A: the running variance's N/(N-1) below needs N >= 2
        # Appendix B's diagnostics, on the steps that train.py tracks (self.track).
        self.stats = batch_diagnostics(self, y, xf, real, var, mu) if self.track else self.stats
        with torch.no_grad():
            # Paper (Alg. 1): mu = alpha mu + (1 - alpha) mu_B, alpha = 1 - momentum
            m = self.momentum
            self.running_mean.copy_((1 - m) * self.running_mean + m * mu)
            # Note: the unbiased N/(N-1) sigma_B^2, as torch.nn.BatchNorm1d takes it; Algorithm 1
            # writes the biased one.
            self.running_var.copy_((1 - m) * self.running_var + m * var * n / (n - 1).clamp_min(1))
            self.num_batches_tracked += 1
        return y.to(x.dtype)


# ---------------------------------------------------------------------------------------
# PN-V [2, Definition 1, eqs. 4-5]: BatchNorm without the mean, divided by the quadratic mean.
#   psi_B^2 = 1/N sum_i x_i^2   (per channel, over the real tokens, no centring)
#   y = gamma * x / sqrt(psi_B^2 + eps) + beta
# Why: [2] section 4.1: the mean is the statistic that fluctuates most, so PN-V stops centring and
# divides by the quadratic mean, which fluctuates orders of magnitude less than sigma_B^2 ([2]
# Figure 4); the backward keeps one batch term, g_psi^2 (eq. 6), in place of g_mu and g_sigma^2. It
# beats BatchNorm, not yet LayerNorm ([2] Table 1). Plain autograd gives eq. 6 (gradient through
# psi_B^2); padding as in BatchNorm. Eval divides by the running quadratic mean phi (starts at 1;
# momentum 0.1, alpha = 0.9; no N/(N-1): a mean of squares is already unbiased for E[x^2]). Note:
# the paper gives no inference rule for PN-V; the running phi is ours (PN's EMA, eq. 10).
# [2] appendix A puts a "layer-scale layer" before every BN/PN; PN-V here is exactly Definition 1.
# ---------------------------------------------------------------------------------------
class PNV(nn.Module):
    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.eps, self.momentum, self.track, self.stats = eps, momentum, False, {}
        self.weight = nn.Parameter(torch.ones(num_features))  # gamma
        self.bias = nn.Parameter(torch.zeros(num_features))  # beta
        self.register_buffer("running_phi", torch.ones(num_features))  # running psi^2

    def forward(self, x, pad_mask=None):
        xf = at_least_fp32(x)
        if not self.training:
            y = self.weight * xf / torch.sqrt(self.running_phi + self.eps) + self.bias
            return y.to(x.dtype)
        real = real_tokens(xf, pad_mask)
        # Exercise pnv: begin
        psi2, _ = batch_mean(xf.pow(2), real)  # (D,)  Paper (Def. 1): psi_B^2 = 1/N sum_i x_i^2
        # Paper (eqs. 4-5): y = gamma x / sqrt(psi_B^2 + eps) + beta, (B, T, D).
        y = self.weight * xf / torch.sqrt(psi2 + self.eps) + self.bias
        # Exercise pnv: end
        # Appendix B's diagnostics, on the steps that train.py tracks (self.track).
        self.stats = batch_diagnostics(self, y, xf, real, psi2) if self.track else self.stats
        with torch.no_grad():  # Note: phi = (1 - momentum) phi + momentum psi_B^2   (eq. 10's EMA)
            self.running_phi.copy_((1 - self.momentum) * self.running_phi + self.momentum * psi2)
        return y.to(x.dtype)


# ---------------------------------------------------------------------------------------
# GroupScaling [2, appendix A "layer-scale layer"; code]: RMSNorm [4] without gain, per group.
# It runs in front of PowerNorm (no parameters, eps 1e-5, not in the registry). In each of G
# contiguous groups of D/G channels:
#   x_i <- x_i / sqrt(mean_group x_j^2 + eps)
# Why: PN's divisor is per channel and over many batches, so it does not bound the size of one
# token: a token far larger than the rest would pass through large. GroupScaling first brings each
# group of each token to unit RMS ([2]: "to control the scale of the activation"), so what reaches
# PN has a known scale.
# Paper: one sentence ("a layer-scale layer (Zhang & Sennrich, 2019) ... before the normalization
# layer"). Code: G = number of attention heads; the authors say it is what keeps PN from NaNs.
# ---------------------------------------------------------------------------------------
class GroupScaling(nn.Module):
    def __init__(self, groups=1, eps=1e-5):
        super().__init__()
        self.groups, self.eps = groups, eps

    def forward(self, x):
        xg = x.unflatten(-1, (self.groups, -1))  # (B, T, G, D/G)
        ms = xg.pow(2).mean(-1, keepdim=True)  # (B, T, G, 1)  mean of x^2 over each group
        return (xg / torch.sqrt(ms + self.eps)).flatten(-2)  # (B, T, D)


# ---------------------------------------------------------------------------------------
# PowerNorm (PN) [2, Definition 3, Algorithm 2], with GroupScaling in front.
# At training step t, per channel:
#   forward:   X^ = X / psi_{t-1}                                          (eq. 8)
#              Y  = gamma X^ + beta                                         (eq. 9)
#              psi_t^2 = alpha_fwd psi_{t-1}^2 + (1 - alpha_fwd) psi_B^2    (eq. 10, Alg. 2's form)
#   backward:  the statistics get no gradient; instead ("approximate backpropagation")
#              X^' = dL/dX^ - nu_{t-1} X^                                   (eq. 11)
#              dL/dX = X^' / psi_{t-1}                                      (eq. 12)
#              nu_t = nu_{t-1} (1 - (1 - alpha_bkw) Gamma) + (1 - alpha_bkw) Lambda   (eq. 13)
#              Gamma = mean_i x^_i x^_i,  Lambda = mean_i dL/dx^_i x^_i
#   inference: Y = gamma X / psi + beta   (the running statistic only: a sentence's output is
#              independent of the batch)
# Why: [2] section 4.2: psi_B still jumps from batch to batch, so PN divides by a running average
# psi^2 of the past batches' quadratic means (eq. 10): a slowly moving statistic, the same kind in
# training and at inference. The exact gradient through a running average reaches back to the first
# step; the approximate backward takes PN-V's (eq. 6: dL/dX = (dL/dX^ - Lambda X^) / psi_B) and
# replaces its batch term Lambda by nu, a running estimate of it (eq. 13's fixed point:
# nu = Lambda / Gamma, Gamma ~ 1), and the gradient stays bounded ([2] Theorem 4). Here psi^2 is
# stored as running_phi (phi = psi^2) and psi = sqrt(phi + eps); statistics in fp32.
# Code: the released module differs in three places (PowerNormCode, Appendix C, --pn-variant code).
# It also stores nu/(1-alpha_bkw) (we store nu); its psi_B^2, Gamma, Lambda are per GPU.
# ---------------------------------------------------------------------------------------
class _PowerNormFunction(torch.autograd.Function):
    """Eqs. 8-9 forward and 11-13 backward of PN for one training step; pn is the PowerNorm whose
    running_nu (nu, updated in place), alpha_bkw and eps the step takes."""

    @staticmethod
    def forward(ctx, x, weight, bias, psi2, real, pn):
        z = x / torch.sqrt(psi2 + pn.eps)  # (B, T, D)  Paper (eq. 8): X^ = X / psi_{t-1}
        ctx.save_for_backward(z, weight, psi2, real)
        # Note: nu is a plain attribute, not saved_for_backward: every backward changes it in place,
        # which autograd's version check would refuse when a module runs twice in one graph.
        ctx.nu, ctx.alpha, ctx.eps = pn.running_nu, pn.alpha_bkw, pn.eps
        return weight * z + bias  # (B, T, D)  Paper (eq. 9): Y = gamma X^ + beta

    @staticmethod
    def backward(ctx, dy):
        z, weight, psi2, real = ctx.saved_tensors  # psi2: psi_{t-1}^2 (or psi_B^2 in the warmup)
        nu, a = ctx.nu, ctx.alpha  # nu_{t-1}: (D,)
        # Note: padding is not in the paper's batch: no gradient to x, gamma, beta, Gamma or Lambda.
        dy = torch.where(real.unsqueeze(-1), dy, 0.0)  # (B, T, D)
        # Exercise powernorm_backward: begin
        g = weight * dy  # (B, T, D)  Paper (Alg. 2): dL/dX^ = gamma dL/dY
        g_tilde = g - nu * z  # (B, T, D)  Paper (eq. 11): X^' = dL/dX^ - nu_{t-1} X^
        # Paper (eq. 12): dL/dX = X^' / psi_{t-1}, (B, T, D).
        dx = g_tilde / torch.sqrt(psi2 + ctx.eps)
        # Gamma = mean_i x^_i x^_i over the real tokens (footnote 1), (D,).
        Gamma_t, _ = batch_mean(z * z, real)
        Lambda_t, _ = batch_mean(g * z, real)  # (D,)  Lambda = mean_i dL/dx^_i x^_i
        # Paper (eq. 13): nu_t = nu_{t-1} (1 - (1 - alpha) Gamma) + (1 - alpha) Lambda
        nu.copy_(nu * (1 - (1 - a) * Gamma_t) + (1 - a) * Lambda_t)
        # Exercise powernorm_backward: end
        dx = torch.where(real.unsqueeze(-1), dx, 0.0)  # padding gets zero gradient
        # dL/dx, dL/dgamma, dL/dbeta; the other inputs get no gradient.
        return dx, (dy * z).sum((0, 1)), dy.sum((0, 1)), None, None, None


class PowerNorm(nn.Module):
    def __init__(self, num_features, groups=1, warmup=4000, alpha_fwd=0.9, alpha_bkw=0.9, eps=1e-5):
        super().__init__()  # Paper: warmup = the LR warmup (train.py passes it)
        if num_features % groups:
            raise ValueError(f"num_features {num_features} is not divisible by groups {groups}")
        self.warmup, self.alpha_fwd, self.alpha_bkw, self.eps = warmup, alpha_fwd, alpha_bkw, eps
        self.track, self.stats = False, {}
        # Code: G is the number of heads, and eps 1e-5 sits inside the sqrt.
        self.group_scaling = GroupScaling(groups, eps=1e-5)
        # Code: weight and bias are always there (whatever ``affine`` says), ones and zeros.
        self.weight = nn.Parameter(torch.ones(num_features))  # gamma
        self.bias = nn.Parameter(torch.zeros(num_features))  # beta
        self.register_buffer("running_phi", torch.ones(num_features))  # phi = psi^2, starts at 1
        self.register_buffer("running_nu", torch.zeros(num_features))  # nu (not nu/(1-alpha_bkw))
        # Note: it counts training *forwards* (as the code does), so train.py passes --pn-warmup x
        # --accumulate to make the warmup W updates.
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def extra_repr(self):
        return (
            f"{self.weight.shape[0]}, groups={self.group_scaling.groups}, warmup={self.warmup}, "
            f"alpha_fwd={self.alpha_fwd}, alpha_bkw={self.alpha_bkw}"
        )

    def forward(self, x, pad_mask=None):
        xs = self.group_scaling(at_least_fp32(x))  # (B, T, D)  GroupScaling, plain autograd
        # Paper (inference): Y = gamma X / psi + beta   (the running statistic only)
        if not self.training:
            y = self.weight * xs / torch.sqrt(self.running_phi + self.eps) + self.bias
            return y.to(x.dtype)
        real = real_tokens(xs, pad_mask)  # (B, T)
        self.num_batches_tracked += 1
        # t is this step, counted from 1 (a tensor, read on its device: Appendix A).
        t = self.num_batches_tracked
        with torch.no_grad():  # the statistics get no gradient (approximate backpropagation)
            psi2, _ = batch_mean(xs.pow(2), real)  # (D,)  Paper (Alg. 2): psi_B^2 = 1/N sum_i x_i^2
            phi = self.running_phi.clone()  # (D,)  psi_{t-1}^2
        # Paper: appendix A names a warmup "for accumulating psi", W = the LR warmup; Algorithm 2
        # has none. Code: the batch psi_B divides while t <= W (as in PN-V), then eq. 8's psi_{t-1}.
        # Note: eqs. 11-13 (with nu) run in the warmup too.
        fwd_psi2 = torch.where(t <= self.warmup, psi2, phi)
        # Appendix B's diagnostics, on the steps that train.py tracks (self.track).
        self.stats = (
            powernorm_diagnostics(self, xs, real, psi2, phi, fwd_psi2) if self.track else self.stats
        )
        # PowerNormCode's step (Appendix C) makes its departures first, then takes this one.
        return self.step(xs, real, psi2, phi, fwd_psi2).to(x.dtype)

    def step(self, xs, real, psi2, phi, fwd_psi2):
        """Y (eqs. 8-9; backward: 11-13), then psi_t^2 (eq. 10)."""
        y = _PowerNormFunction.apply(xs, self.weight, self.bias, fwd_psi2, real, self)
        # Paper (eq. 10, as Alg. 2 writes it): psi_t^2 = alpha psi_{t-1}^2 + (1 - alpha) psi_B^2
        with torch.no_grad():
            self.running_phi.copy_(self.alpha_fwd * phi + (1 - self.alpha_fwd) * psi2)
        return y


# ---------------------------------------------------------------------------------------
# 6. No norm: y = x.
# [3] Table 6, "Without LayerNorm", taken literally (--norm none).
# ---------------------------------------------------------------------------------------
class NoNorm(nn.Identity):  # nn.Identity takes the width d and ignores it
    def forward(self, x, pad_mask=None):
        return x


# ---------------------------------------------------------------------------------------
# 7. The registry: --norm NAME (and --encoder-norm/--decoder-norm) -> its entry.
# The rest reads it: the --norm choices and help (machinery/arguments.py), build_norm, the tests
# that loop over norms and check README.md's table, and --benchmark (machinery/speed.py).
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Norm:
    cls: type  # the module's class (BATCH_NORMS below: isinstance checks)
    equation: str  # one line, as --help prints it
    paper: str  # where it comes from
    # Statistics over the batch: train.py logs Appendix B's diagnostics, decode.py --leak measures
    # how far they let a causal model see the future.
    batch_stats: bool = False
    # The keys of ModelConfig.norm_options it takes (train.py's --pn-*); "groups" is the heads.
    options: tuple = ()
    make: Optional[Callable] = None  # make(d, **options) -> the module; None: cls(d, **options)


NORMS = {
    "layer": Norm(LayerNorm, "y = gamma (x - mu) / sqrt(sigma^2 + eps) + beta", "Ba et al. 2016"),
    "scale": Norm(ScaleNorm, "y = g x / ||x||, one scalar g, init sqrt(D)", "TwT eq. 5"),
    "scale_fixed": Norm(
        ScaleNorm, "y = sqrt(D) x / ||x||", "TwT Table 7", make=partial(ScaleNorm, learn_g=False)
    ),
    "rms": Norm(RMSNorm, "y = g x / sqrt(mean(x^2) + eps)", "Zhang & Sennrich 2019"),
    "batch": Norm(
        BatchNorm, "y = gamma (x - mu_B) / sqrt(sigma_B^2 + eps) + beta", "PowerNorm Alg. 1", True
    ),
    "pnv": Norm(
        PNV,
        "y = gamma x / sqrt(psi_B^2 + eps) + beta, psi_B^2 = mean x^2",
        "PowerNorm Def. 1",
        True,
    ),
    "power": Norm(
        PowerNorm,
        "y = gamma x / psi + beta, running psi^2, approximate backward with nu",
        "PowerNorm Def. 3, Alg. 2",
        True,
        options=("groups", "warmup", "alpha_fwd", "alpha_bkw", "variant"),
        # --pn-variant paper or code: PowerNorm, or PowerNormCode (Appendix C).
        make=lambda d, **options: power_norm(d, **options),
    ),
    "none": Norm(NoNorm, "y = x", "QKNorm Table 6"),
}
# Each class with batch statistics once, for isinstance checks (a PowerNormCode is a PowerNorm).
BATCH_NORMS = tuple(dict.fromkeys(e.cls for e in NORMS.values() if e.batch_stats))


def build_norm(name, d, heads=1, norm_options=None):
    """One norm of kind ``name`` for width d, with the options its entry names, from
    ``norm_options`` (ModelConfig.norm_options) and groups = heads (PowerNorm's GroupScaling:
    Code)."""
    if name not in NORMS:
        raise ValueError(f"unknown norm {name!r}; choose one of {sorted(NORMS)}")
    entry, given = NORMS[name], {"groups": heads, **(norm_options or {})}
    return (entry.make or entry.cls)(d, **{k: v for k, v in given.items() if k in entry.options})


# =======================================================================================
# Appendix A: batch statistics in practice: over several processes, and batches too small for them.
#
# Under DistributedDataParallel (torchrun) every rank holds a shard of the batch. batch_mean's sums
# and token count go through sum_over_ranks: on one process the identity (the main text's plain
# masked mean); under torchrun the sum over the ranks, which gives exactly the whole batch's
# statistics, so the ranks normalise as one process with all of it would (as nn.SyncBatchNorm does).
# batch_mean takes masked sums, not v[real], whose data-dependent shape would make the host wait and
# break torch.compile. Code: the authors' BN/PN never synchronise statistics across GPUs. A
# collective inside PowerNorm's backward (batch_mean of Gamma, Lambda) is safe: every rank runs the
# same backward graph, so they meet in the same order. Eqs. 11-13 are not linear in dL/dY (nu X^
# does not scale with it), so every rank's dL/dY must be the whole batch's, not world x it: see
# train_step in train.py. Also in practice: average only PowerNorm's float buffers when averaging
# checkpoints; phi and its counter change in forward and nu in backward: do not wrap PN in
# activation checkpointing (forward would run twice).
# =======================================================================================
class _AllReduceSum(torch.autograd.Function):
    """y = sum over ranks of x, with its gradient: every rank's y is the same sum, so dL/dx on a
    rank is the sum over ranks of their dL/dy. (dist.all_reduce alone is in place and invisible
    to autograd: the other ranks' share of the gradient would be lost.)"""

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        torch.distributed.all_reduce(y)
        return y

    backward = forward  # dL/dx = the sum over ranks of dL/dy: the same collective


def sum_over_ranks(*tensors):
    """What batch_mean sums with (the banner above; the multi-process tests replace it),
    differentiably, in one collective; a tuple. Note: counts travel as floats of the statistics'
    dtype: exact up to 2^24 tokens in fp32."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensors
    # One message for all the tensors, not one each.
    flat = _AllReduceSum.apply(torch.cat([t.reshape(-1) for t in tensors]))
    parts = flat.split([t.numel() for t in tensors])
    return tuple(f.view_as(t) for f, t in zip(parts, tensors, strict=True))


# Too few tokens: a clear error, not NaN (Code: the authors' module divides 0 by 0). Checked on the
# CPU only: on a GPU, reading the mask or the count would make the host wait at every norm of every
# step (and the batcher never makes a batch of padding only).
def real_tokens(x, pad_mask):
    """The (B, T) bool mask of real (non-padding) tokens of x (B, T, D); a clear error for an
    all-padding batch."""
    if pad_mask is None:
        return torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
    # Note: .bool() first, since ~ on a uint8 mask gives 254/255 (a pitfall of the code). (B, T)
    real = ~pad_mask.bool()
    if real.device.type == "cpu" and not real.any():
        raise ValueError(
            "batch statistics need at least one non-padding token; the batch is all padding"
        )
    return real


# The fewest real tokens BatchNorm takes in training; data.make_batches never forms a training
# batch with fewer.
MIN_REAL_TOKENS = 2


def refuse_one_token(n):
    """BatchNorm in training: the unbiased running variance N/(N-1) needs N >= 2 real tokens (torch
    raises too)."""
    if n.device.type == "cpu" and n < MIN_REAL_TOKENS:
        raise ValueError(f"BatchNorm in training needs more than 1 real token, got {int(n)}")


# =======================================================================================
# Appendix B: diagnostics of the batch statistics ([2] Figures 2-4).
# They are kept in ``norm.stats`` on the steps where train.py sets ``norm.track`` (its log lines;
# they cost host syncs):
#   forward:  the distance between a batch statistic and the running one before it is updated,
#             dist(a, b) = ||a - b|| / D  ([2] section 3.1): dist_mu, dist_sigma2 (BN), dist_psi2
#   backward: the norm of the part of dL/dx_i that each batch statistic contributes, averaged over
#             the real tokens: g_mu, g_sigma2 (BN, eq. 3), g_psi2 (PN-V, eq. 6); for PN, whose
#             statistics get no gradient, the nu X^ term of eqs. 11-12 (g_nu, computed in the
#             forward: nu_{t-1} is known there)
# =======================================================================================
def dist(a, b):
    """||a - b|| / D, a batch statistic's distance from the running one."""
    return (torch.linalg.vector_norm(a.detach() - b) / a.numel()).item()


def batch_diagnostics(norm, y, x, real, var, mu=None):
    """BatchNorm's (mu = mu_B, var = sigma_B^2) or, with mu None, PN-V's (var = psi_B^2: no
    centring, no mu terms)."""
    sigma = torch.sqrt(var.detach() + norm.eps)  # sigma_B (PN-V: psi_B)
    # x~ (PN-V: x^) at the real tokens, (N_r, D).
    x_tilde = ((x.detach() if mu is None else x.detach() - mu.detach()) / sigma)[real]
    scale = norm.weight.detach() / sigma  # (D,)
    # Paper (eq. 3): dL/dx_i = gamma/sigma_B dL/dy_i
    #                          - gamma/(sigma_B N) sum_j (dL/dy_j + dL/dy_j x~_j x~_i)
    # Paper (eq. 6): dL/dx_i = gamma/psi_B dL/dy_i - gamma/(N psi_B) sum_j dL/dy_j x^_j x^_i

    def mean_term(dy):
        """The sum_j dL/dy_j term of eq. 3, mu_B's share."""
        return (scale * dy[real].mean(0)).expand_as(x_tilde)

    def var_term(dy):
        """The x~_j x~_i term of eq. 3 (PN-V: the x^_j x^_i term of eq. 6)."""
        return scale * (dy[real] * x_tilde).mean(0) * x_tilde

    if mu is None:
        stats, terms = {"dist_psi2": dist(var, norm.running_phi)}, [("g_psi2", var_term)]
    else:
        stats = {"dist_mu": dist(mu, norm.running_mean), "dist_sigma2": dist(var, norm.running_var)}
        terms = [("g_mu", mean_term), ("g_sigma2", var_term)]
    # When dL/dy arrives, the hook sets stats[name] to the mean over tokens of ||term(dL/dy)|| for
    # each (name, term); a y without a gradient has none.
    if y.requires_grad:

        def hook(dy):
            with torch.no_grad():
                for name, term in terms:
                    stats[name] = torch.linalg.vector_norm(term(dy), dim=-1).mean().item()

        y.register_hook(hook)
    return stats


def powernorm_diagnostics(norm, xs, real, psi2, phi, fwd_psi2):
    """PowerNorm's: dist_psi2, and g_nu, the nu X^ term of eqs. 11-12."""
    z = xs.detach() / torch.sqrt(fwd_psi2 + norm.eps)  # X^
    # What the backward divides by: psi_B in PowerNormCode's (Appendix C), else the forward's.
    bwd_psi2 = psi2 if isinstance(norm, PowerNormCode) else fwd_psi2
    g_nu = norm.running_nu * z[real] / torch.sqrt(bwd_psi2 + norm.eps)  # (N_r, D)
    return {
        "dist_psi2": dist(psi2, phi),
        "g_nu": torch.linalg.vector_norm(g_nu, dim=-1).mean().item(),
    }


# =======================================================================================
# Appendix C: PowerNorm as the authors' released module computes it (--pn-variant code).
# The module is sIncerass/powernorm's fairseq/modules/norms/mask_powernorm.py. It differs from
# Algorithm 2 in three places; both normalize padding with the same statistic (finite outputs) and
# never let padding into psi_B^2:
#   - the backward divides by the batch psi_B even after warmup (paper: psi_{t-1}, eq. 12);
#   - Gamma and Lambda average over all B*T positions, padding included, and padding positions
#     get gradient (paper: the real tokens only; padding gets zero gradient);
#   - during warmup (t < W) phi first becomes the cumulative mean of the psi_B^2 so far, then
#     takes the EMA step (paper: the EMA of eq. 10 at every step).
# =======================================================================================
class PowerNormCode(PowerNorm):
    """PowerNorm with the released module's three departures; its forward (psi_B^2 over the real
    tokens) and its inference are PowerNorm's."""

    def step(self, xs, real, psi2, phi, fwd_psi2):
        # Code: dL/dX = X^' / psi_B at every step: eq. 12's X^' / psi_{t-1} times psi_{t-1} / psi_B,
        # so the paper's function runs on xs with its gradient scaled by that ratio (1 in the
        # warmup; the value stays xs exactly).
        ratio = torch.sqrt((fwd_psi2 + self.eps) / (psi2 + self.eps))
        xs = xs.detach() + (xs - xs.detach()) * ratio
        t = self.num_batches_tracked  # this step, counted from 1
        # Code: phi <- (t-1)/t phi + 1/t psi_B^2 (a cumulative mean) for t < W, then eq. 10
        with torch.no_grad():
            phi = torch.where(t < self.warmup, phi * (t - 1) / t + psi2 / t, phi)
        # Code: the backward counts padding as real.
        return super().step(xs, torch.ones_like(real), psi2, phi, fwd_psi2)


def power_norm(d, variant="paper", **options):
    """--norm power, --pn-variant paper (PowerNorm, Algorithm 2) or code (PowerNormCode)."""
    if variant not in ("paper", "code"):
        raise ValueError(f"PowerNorm's variant must be 'paper' or 'code', got {variant!r}")
    return (PowerNormCode if variant == "code" else PowerNorm)(d, **options)


if __name__ == "__main__":
    # python norms.py --benchmark (every norm's speed against LayerNorm) is machinery, not the
    # book: machinery/speed.py runs as the program and reads this chapter.
    runpy.run_module("machinery.speed", run_name="__main__")
