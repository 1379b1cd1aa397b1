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
        xf = x.float()
        inv = self.g / torch.linalg.vector_norm(xf, dim=-1, keepdim=True).clamp_min(self.eps)  # (B, T, 1)
        return (xf * inv).to(x.dtype)


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
        xf = x.float()
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, 1)  1/RMS(x)
        return (self.weight * (xf * inv)).to(x.dtype)


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
def fixnorm(weight, eps=1e-12):
    """l2-normalise each row of an embedding matrix (V, D): ||fixnorm(w)_v|| = 1."""
    return weight / torch.linalg.vector_norm(weight, dim=-1, keepdim=True).clamp_min(eps)


# ---------------------------------------------------------------------------------------
# The registry: the value of --norm (and --encoder-norm / --decoder-norm) -> the class.
# ---------------------------------------------------------------------------------------
NORMS = {
    "layer": LayerNorm,
    "scale": ScaleNorm,
    "scale_fixed": ScaleNorm,  # TwT Table 7: g fixed at sqrt(D), only the output g learned
    "rms": RMSNorm,
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
