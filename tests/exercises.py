"""The exercise kit: the papers' equations as exercises an instructor hands out and grades.

    python tests/exercises.py list
        one line per exercise: name, file:function, equation, what it writes
    python tests/exercises.py make OUT [NAME ...]
        a student copy of the project in OUT, those exercises blanked
    python tests/exercises.py grade [NAME ...]
        the self-check of this copy: PASS/FAIL per exercise
    python tests/exercises.py grade DIR [DIR ...] [NAME ...] [--kit KIT] [--csv FILE]
            [--json FILE] [--points SPEC]
        (instructor) grade students' copies from this tree
    python tests/exercises.py record
        (instructor) store the self-check's expected values
docs/course.md shows an instructor's workflow end to end.

Each exercise is a region of the source between two visible comments,
    # Exercise NAME: begin
    ...the lines that compute the equation...
    # Exercise NAME: end
`make` replaces the code of each chosen region with `raise NotImplementedError(...)` naming the
exercise and its equation; the comments in the region (the equation, written out) stay, and so do
the docstrings. It records which exercises it blanked (the self-check and the copy's README.md
default to those). The copy holds no solution: no code line of a blanked region, and none of the
mistakes below (they are instructor-only and left out of the copy).

Two graders, one check. Each exercise draws its inputs from a seed, runs the project's code on
them with every fast path off (norms.use_reference), and hands back tensors; those are compared in
the dtype the equation is written for with the expected ones (or, for word dropout, with claims that
need no solution), and a failure names the first element that differs.
- The self-check (`grade` with no folder) runs in the student's copy, against the values `record`
  stored from the solutions (tests/exercise_values.pt), in a child process that reports each
  verdict on a pipe (an exit or a hang in one exercise fails it, and a new process checks the rest).
  It is the student's tool: a missing, incomplete or not-plain values file is refused, never PASS.
- The instructor's grade (`grade DIR ...`, run in the instructor's tree) trusts nothing in a
  submission but the code between its markers: for each exercise, that code is put into a copy of
  the instructor's own five files (and machinery/) and run in a fresh Python process with a time
  limit, which hands back only tensors (read with weights_only=True). The expected values come
  from the instructor's own code on inputs drawn at grading time (--seed); the verdict is decided
  here. Any way the student's code ends (an exception, a syntax error, an exit, a signal, a
  time-out, a missing region) is that exercise's FAIL, in one line; the others are still graded. A
  student's code still runs with the grader's user rights: grade in an account or container that
  holds nothing else.
"""

import argparse
import ast
import contextlib
import csv
import hashlib
import importlib
import itertools
import json
import os
import re
import resource
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

# The project's files import from the repository's root (this file runs from tests/).
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
VALUES = Path(__file__).resolve().parent / "exercise_values.pt"
SOURCES = ["norms.py", "model.py", "data.py", "decode.py", "train.py"]
# The machinery the chapters import (flags, run folders, corpora: no exercise is in it).
MACHINERY = sorted(f"machinery/{p.name}" for p in (ROOT / "machinery").glob("*.py"))
COPIED = (
    SOURCES
    + MACHINERY
    + [
        "requirements.txt",
        "tests/conftest.py",
        "tests/exercises.py",
        "tests/test_exercises.py",
    ]
)
RECORD_SEED = 0  # the self-check's inputs (the values file holds their expected outputs)
GRADE_SEED = 29  # the instructor's grade, by default: other inputs than the self-check's
FORMAT = 2  # of the values file
MARKER = re.compile(r"^(\s*)# Exercise (\S+): (begin|end)\s*$")
# With "begin" and "end": the lines that make leaves out of a student's copy.
INSTRUCTOR_ONLY = "# Instructor only: "
norms = model = data = decode = train = None  # The project's five files: load_project().


def load_project():
    """Imports the five files (in a grading process, inside its try: a syntax error is that
    exercise's FAIL)."""
    global norms, model, data, decode, train
    data, decode, model, norms, train = (
        importlib.import_module(name) for name in ("data", "decode", "model", "norms", "train")
    )


# --- inputs, drawn from a seed -----------------------------------------------------------------
class Draw:
    def __init__(self, seed, name):
        self.g = torch.Generator().manual_seed(seed * 1000003 + sum(map(ord, name)))

    def randn(self, *shape, dtype=torch.float64):
        return torch.randn(*shape, generator=self.g, dtype=torch.float64).to(dtype)

    def uniform(self, lo, hi):
        return lo + (hi - lo) * torch.rand((), generator=self.g, dtype=torch.float64).item()

    def integer(self, lo, hi):  # lo <= n < hi
        return int(torch.randint(lo, hi, (), generator=self.g))

    def seed(self):
        return self.integer(0, 2**31)


def _tokens(d):
    """x (2, 5, 6): some tokens of tiny norm (where eps placement shows), channel 0 of tiny spread
    (where eps shows in a variance), padding (pad_mask below) far from the real tokens."""
    x = d.randn(2, 5, 6)
    x[0, 1] *= 1e-3
    x[1, 0] *= 1e-4
    x[..., 0] = x[..., 0] * 1e-3 + 0.5
    x[1, 3:] += 4.0
    return x


def _wide_tokens(d):
    """x (2, 3, 8): another width than _tokens' 6 (where a hard-coded D shows), one token all zero
    (only the eps keeps its output finite) and one channel at 300, whose square (90,000) is past
    float16's largest number (65,504): in float16 the statistics must be taken in float32
    (at_least_fp32), as the project's norms do."""
    x = d.randn(2, 3, 8)
    x[0, 0] = 0.0
    x[1, 1, 2] = 300.0
    return x


def _affine(d, n=6):
    """A norm's gamma and beta away from their initial 1 and 0 (where a misplaced gamma or beta
    shows)."""
    return {"gamma": 0.5 + d.randn(n).abs(), "beta": d.randn(n)}


def _pad_mask():  # (2, 5) True at padding: the second sentence has 3 real tokens
    return torch.tensor([[False] * 5, [False] * 3 + [True] * 2])


def _forward_backward(module, x, pad_mask=None, r_seed=1):
    """y = module(x), and dL/dx, dL/dparameters for L = sum(y * r), r fixed."""
    x = x.clone().requires_grad_(True)
    y = module(x, pad_mask) if pad_mask is not None else module(x)
    r = torch.randn(
        y.shape, generator=torch.Generator().manual_seed(r_seed), dtype=torch.float64
    ).to(y.dtype)
    (y * r).sum().backward()
    out = {"y": y.detach(), "dx": x.grad}
    out.update({f"d{n}": p.grad for n, p in module.named_parameters() if p.grad is not None})
    return out


# --- each exercise: what the project's code gives on the inputs ---------------------------------
def _wide_and_half(module, x):
    """A norm of width 8 on _wide_tokens: in float64 (y8, dx8, d<parameter>8), and in float16 with
    float32 parameters (y16: the output's dtype is the input's, the statistics are not)."""
    out = {f"{k}8": v for k, v in _forward_backward(module.double(), x).items()}
    out["y16"] = module.float()(x.half()).detach()
    return out


def _scalenorm(i):
    m = norms.ScaleNorm(6).double()
    with torch.no_grad():
        m.g.fill_(i["g"])
    return {**_forward_backward(m, i["x"]), **_wide_and_half(norms.ScaleNorm(8), i["x8"])}


def _rmsnorm(i):
    m = norms.RMSNorm(6).double()
    with torch.no_grad():
        m.weight.copy_(i["gain"])
    return {**_forward_backward(m, i["x"]), **_wide_and_half(norms.RMSNorm(8), i["x8"])}


def _fixnorm(i):
    w = i["w"].clone().requires_grad_(True)
    y = norms.fixnorm(w)
    (y * i["r"]).sum().backward()
    return {"y": y.detach(), "dw": w.grad}


def _set_affine(m, i):
    with torch.no_grad():
        m.weight.copy_(i["gamma"])
        m.bias.copy_(i["beta"])
    return m


def _batch_norm(cls, i):
    m = _set_affine(cls(6).double().train(), i)
    out = {}
    for step in range(2):  # twice: the running statistics after each
        got = _forward_backward(m, i["x"] * (1 + step), _pad_mask(), r_seed=1 + step)
        real = ~_pad_mask()  # padding positions: whatever the student's code gives there is fine
        got["y"], got["dx"] = got["y"][real], got["dx"][real]
        got.update({k: v.clone() for k, v in m.named_buffers()})
        out.update({f"{k}{step}": v for k, v in got.items()})
    return out


def _powernorm_backward(i):
    m = _set_affine(
        norms.PowerNorm(6, groups=2, warmup=1, alpha_fwd=0.9, alpha_bkw=0.9).double().train(), i
    )
    out = {}
    for step in range(3):  # the first inside the warmup, then the running statistic
        got = _forward_backward(m, i["x"][step], _pad_mask(), r_seed=10 + step)
        out.update({f"{k}{step}": v for k, v in got.items()})
        out[f"nu{step}"] = m.running_nu.clone()
    return out


def _attention(i):
    out = {}
    cases = {
        # Self-attention, scale None, no dropout.
        "causal": dict(key_mask=i["key_mask"], causal=True),
        # Tq != Tk, with dropout.
        "cross": dict(key_mask=i["cross_mask"], scale=i["scale"], dropout_p=0.25),
        # Logits in the hundreds: exp() alone overflows float32 (max 3.4e38 = e^88.7).
        "big": dict(causal=True),
        # Bfloat16 q, k, v: the weights come back in q's dtype.
        "bf16": dict(key_mask=i["key_mask"], causal=True),
    }
    for case, kw in cases.items():
        q, k, v = (i[f"{n}_{case}"].clone().requires_grad_(True) for n in "qkv")
        torch.manual_seed(i["seed"])  # Dropout's mask.
        o, w = model.attention_math(q, k, v, **kw)
        out.update({f"o_{case}": o.detach(), f"w_{case}": w.detach()})
        if case != "bf16":  # (bfloat16's gradients: rounding, not the equation)
            (o * i[f"r_{case}"]).sum().backward()
            out.update({f"dq_{case}": q.grad, f"dk_{case}": k.grad, f"dv_{case}": v.grad})
    return out


def _residual(i):
    out = {}

    def f(h):  # A sublayer.
        return torch.tanh(h @ i["w"])

    # A norm that reads the padding mask, as BatchNorm and PowerNorm do: padding halved.
    def norm(h, pad_mask):
        pad = torch.zeros(h.shape[:-1], dtype=torch.bool) if pad_mask is None else pad_mask
        return h / (1 + h.pow(2).sum(-1, keepdim=True)) * (1 - 0.5 * pad[..., None])

    pad_mask = torch.tensor([[False] * 3, [False, True, True]])
    for prenorm in (True, False):
        cfg = model.ModelConfig(vocab_size=8, dropout=0.3, prenorm=prenorm)
        for training in (True, False):
            torch.manual_seed(i["seed"])  # Dropout's mask.
            y = model.residual(i["x"], f, norm, pad_mask, cfg, training=training)
            out[f"{'pre' if prenorm else 'post'}_{'train' if training else 'eval'}"] = y
    return out


def _smallinit(i):
    out = {}
    for init in ("small", "xavier"):
        torch.manual_seed(i["seed"])
        m = model.Transformer(
            model.ModelConfig(
                vocab_size=16,
                d_model=16,
                ff=int(i["ff"]),
                heads=2,
                enc_layers=1,
                dec_layers=1,
                init=init,
            )
        )
        a, ff = m.encoder[0].self_attn, m.encoder[0].ff
        out.update(
            {
                f"{init}_q": a.q.weight.detach(),
                f"{init}_out": a.out.weight.detach(),
                f"{init}_w1": ff.w1.weight.detach(),
                f"{init}_w2": ff.w2.weight.detach(),
            }
        )
    return out


def _label_smoothing(i):
    """Both regions: label_smoothed_loss (with and without its masks), and the fast path's forward
    (SmoothedCrossEntropy; its written-out backward reads the log p the region computes)."""
    out = {}
    logits = i["logits"].clone().requires_grad_(True)
    loss, nll = model.label_smoothed_loss(
        logits.masked_fill(~i["allowed"], float("-inf")),
        i["target"],
        i["eps"],
        i["real"],
        i["allowed"],
    )
    loss.backward()
    out.update(loss=loss.detach(), nll=nll.detach(), dlogits=logits.grad)
    logits = i["logits"].clone().requires_grad_(True)
    loss, nll = model.label_smoothed_loss(logits, i["target"], i["eps"])
    (loss + 0.5 * nll).backward()
    out.update(loss_all=loss.detach(), nll_all=nll.detach(), dlogits_all=logits.grad)
    z = i["logits"].flatten(0, 1).clone().requires_grad_(True)
    loss, nll = model.SmoothedCrossEntropy.apply(
        z, i["target"].flatten(), i["real"].flatten(), i["eps"]
    )
    (loss + 0.5 * nll).backward()
    out.update(fast_loss=loss.detach(), fast_nll=nll.detach(), fast_dz=z.grad)
    # Bfloat16 logits: log p is taken in float32.
    loss, nll = model.label_smoothed_loss(i["logits_bf16"], i["target"], i["eps"], i["real"])
    out.update(loss_bf16=loss.detach(), nll_bf16=nll.detach())
    return out


def _multilinear(i):
    out = {}
    for name, kw in (
        ("", {}),
        ("_unmasked", dict(mask="none")),
        ("_relative", dict(positions="relative")),
    ):
        cfg = model.ModelConfig(
            vocab_size=8, d_model=6, heads=2, seq_len=4, attention="multilinear", lm=True, **kw
        )
        torch.manual_seed(i["seed"])
        att = model.MultiLinearAttention(cfg).double()
        out.update({f"{k}{name}": v for k, v in _forward_backward(att, i["x"]).items()})
        # A segment shorter than the L it is built for.
        out[f"y_short{name}"] = att(i["x"][:, :3]).detach()
    return out


def _word_dropout(i):
    """The outputs the claims below are checked on (any random draw is right)."""
    x = i["x"]
    before = x.clone()
    out = {"before": before}
    for name, p, seed in (("a", 0.3, 1), ("a_again", 0.3, 1), ("b", 0.3, 2), ("c", 0.1, 3)):
        out[name] = data.word_dropout(x, p, torch.Generator().manual_seed(i["seed"] + seed))
    out["after"] = x
    out["short"] = data.word_dropout(i["short"], 0.3, torch.Generator().manual_seed(i["seed"] + 4))
    g = torch.Generator().manual_seed(i["seed"] + 5)
    # One generator, drawn from twice.
    out["first"], out["second"] = data.word_dropout(x, 0.3, g), data.word_dropout(x, 0.3, g)
    return out


def _word_dropout_claims(i, got):
    """None if word dropout's claims hold on the handed-back outputs, else what fails: a non-PAD
    token becomes UNK with probability p, independently of the other positions, drawn from the
    generator given; PAD never changes; the input is not written into. Each check runs only if the
    ones before it hold (the first reads the outputs' types and shapes before any claim does: a list
    or a wrong shape would stop the grader)."""
    problem = _outputs_problem(i, got)
    if problem is None and not torch.equal(got["after"], i["x"]):
        problem = "word_dropout wrote into its input (it must return a new tensor)"
    for name, p in (("a", 0.3), ("b", 0.3), ("c", 0.1)):
        problem = problem or _mask_problem(i, got[name], p)
    return problem or _generator_problem(got) or _short_sentences_problem(i, got)


def _outputs_problem(i, got):
    """None if every output is a tensor of its input's shape and dtype, else which is not."""
    for name, y in got.items():
        x = i["short"] if name == "short" else i["x"]
        if not isinstance(y, torch.Tensor):
            return f"the output is a {type(y).__name__}, not a tensor"
        if y.shape != x.shape or y.dtype != x.dtype:
            return (
                f"the output has shape {tuple(y.shape)} and {y.dtype}, "
                f"expected {tuple(x.shape)} and {x.dtype}"
            )
    return None


def _mask_problem(i, y, p):
    """None if y is i["x"] with each non-PAD token turned UNK with probability p, independently of
    its position and of its neighbours, else what is not."""
    before = i["x"]
    real = before != i["pad"]
    if not torch.equal(y[~real], before[~real]):
        return "a PAD token was changed"
    changed = (y != before) & real
    if not (y[changed] == i["unk"]).all():
        return "a dropped token is not UNK"
    rate = changed.sum().item() / real.sum().item()
    if abs(rate - p) > 0.015:
        return f"{100 * rate:.1f}% of the tokens were dropped, not {100 * p:.0f}%"
    per_position = changed[:, :80].double().mean(0)  # Each position's rate, over 400 sentences.
    worst = int((per_position - p).abs().argmax())
    if abs(per_position[worst] - p) > 0.13:
        return (
            f"position {worst} is dropped in {100 * per_position[worst]:.0f}% of the sentences, "
            f"not {100 * p:.0f}%"
        )
    both = (changed[:, :79] & changed[:, 1:80]).double().mean().item()
    if abs(both - p * p) > 0.015:
        return (
            f"neighbours are dropped together {100 * both:.1f}% of the time, "
            f"not {100 * p * p:.1f}% (independent)"
        )
    return None


def _generator_problem(got):
    """None if the masks come from the generator given (the same seed, the same mask; another
    seed or a second draw, another mask), else what does not."""
    if not torch.equal(got["a"], got["a_again"]):
        return (
            "two generators with the same seed gave different masks: draw from the generator given"
        )
    if torch.equal(got["a"], got["b"]):
        return "two generators with different seeds gave the same mask: it must be random"
    if torch.equal(got["first"], got["second"]):
        return (
            "two calls with one generator gave the same mask: draw from it "
            "(each batch its own mask)"
        )
    return None


def _short_sentences_problem(i, got):
    """None if the tokens of sentences of 1, 2 and 3 tokens (1,000 each) are each dropped alike,
    at 30%, else the length where they are not."""
    short = i["short"] != i["pad"]
    for n in (1, 2, 3):
        rows = short.sum(1) == n
        rate = ((got["short"] != i["short"]) & short)[rows].sum().item() / (n * rows.sum().item())
        if abs(rate - 0.3) > 0.07:  # 4.8 standard deviations at n = 1.
            return (
                f"{100 * rate:.1f}% of the tokens of {n}-token sentences were dropped, "
                "not 30% (independently)"
            )
    return None


def _lm_segments(i):
    out = {}
    for n, (stream, seq_len) in enumerate(i["cases"]):
        s = data.lm_segments(stream, seq_len)
        out.update({f"x{n}": s.x, f"y{n}": s.y})
    return out


def _scalars(fn, cases):
    return {"values": torch.tensor([float(fn(*c)) for c in cases], dtype=torch.float64)}


def _histories(d):
    cases = [
        ([1.0, 2.0, 3.0], 3),
        ([5.0, 4.0, 4.5, 3.0], 3),
        ([5.0, 4.0, 4.5, 4.2], 3),
        ([2.0, 1.0], 1),
        ([2.0, 2.0], 1),
        ([3.0, 2.0, 1.0], 3),
        ([3.0, 3.0, 2.0, 3.0], 2),
    ]
    for _ in range(40):
        cases.append(([round(d.uniform(0, 4), 1) for _ in range(d.integer(1, 9))], d.integer(1, 5)))
    return cases


@dataclass
class Exercise:
    name: str
    file: str
    function: str
    equation: str
    writes: str
    hint: str  # shown in the student's README
    inputs: object  # Draw -> {name: value}
    run: object  # inputs -> {name: tensor}, the project's outputs
    dtype: torch.dtype = torch.float64  # the dtype the equation is written for (its tolerance)
    # (inputs, outputs) -> None or what fails (no stored values: any random draw is right).
    claims: object = None


def exercises():
    """Every exercise, in the order `list` shows them: the chapters' reading order, mostly."""
    return norm_exercises() + model_exercises() + data_exercises() + decode_and_train_exercises()


def norm_exercises():
    """The exercises of norms.py: ScaleNorm, FixNorm, RMSNorm and the batch-statistics norms."""
    return [
        Exercise(
            name="scalenorm",
            file="norms.py",
            function="ScaleNorm.forward",
            equation="TwT eq. 5: g x / ||x||",
            writes="the norm of each token and the scaled output",
            hint="eps clamps the norm from below (max(||x||, eps)), not added to it; xf (at "
            "least float32) for the norm, the output in x's dtype",
            inputs=lambda d: {"x": _tokens(d), "g": d.uniform(0.5, 3), "x8": _wide_tokens(d)},
            run=_scalenorm,
        ),
        Exercise(
            name="fixnorm",
            file="norms.py",
            function="fixnorm",
            equation="TwT section 2.3 (eq. 6): w / ||w|| per embedding row",
            writes="each row divided by its l2 norm",
            hint="one norm per row (dim=-1), eps clamps it from below",
            # Row 3 is all zero.
            inputs=lambda d: {
                "w": d.randn(7, 5) * (torch.arange(7) != 3)[:, None],
                "r": d.randn(7, 5),
            },
            run=_fixnorm,
        ),
        Exercise(
            name="rmsnorm",
            file="norms.py",
            function="RMSNorm.forward",
            equation="Zhang & Sennrich 2019: g_i x_i / RMS(x)",
            writes="1 / RMS(x) and the output",
            hint="RMS(x) = sqrt(mean_i x_i^2 + eps): eps inside the root; xf (at least float32) "
            "for the statistics, the output in x's dtype",
            inputs=lambda d: {"x": _tokens(d), "gain": d.randn(6), "x8": _wide_tokens(d)},
            run=_rmsnorm,
        ),
        Exercise(
            name="batchnorm",
            file="norms.py",
            function="BatchNorm.forward",
            equation="PowerNorm Alg. 1: mu_B, sigma_B^2 over the real tokens",
            writes="the batch mean and variance over real tokens and the normalized output",
            hint="batch_mean(v, real) averages over the real tokens only; sigma_B^2 is the "
            "biased variance (1/N)",
            inputs=lambda d: {"x": _tokens(d), **_affine(d)},
            run=lambda i: _batch_norm(norms.BatchNorm, i),
        ),
        Exercise(
            name="pnv",
            file="norms.py",
            function="PNV.forward",
            equation="PowerNorm Def. 1: psi_B^2 = mean x^2, y = gamma x / psi_B + beta",
            writes="the quadratic mean over real tokens and the output",
            hint="batch_mean(v, real) averages over the real tokens only; no centring; eps "
            "inside the root",
            inputs=lambda d: {"x": _tokens(d), **_affine(d)},
            run=lambda i: _batch_norm(norms.PNV, i),
        ),
        Exercise(
            name="powernorm_backward",
            file="norms.py",
            function="_PowerNormFunction.backward",
            equation="PowerNorm Alg. 2 / eqs. 11-13: X^' = dL/dX^ - nu X^, dL/dX = X^' / psi, "
            "the update of nu",
            writes="the approximate backward and the running nu",
            hint="nu is updated in place (nu.copy_) from nu_{t-1}; Gamma and Lambda are means "
            "over the real tokens",
            inputs=lambda d: {"x": d.randn(3, 2, 5, 6), **_affine(d)},
            run=_powernorm_backward,
        ),
    ]


def model_exercises():
    """The exercises of model.py: attention, the residual, SmallInit, label smoothing and the
    multi-linear attention."""
    return [
        Exercise(
            name="attention",
            file="model.py",
            function="attention_math",
            equation="Vaswani eq. 1: softmax(Q K^T / sqrt(Dh) + mask) V",
            writes="the scores, the causal and key masks, the softmax, the output",
            hint="scale is 1/sqrt(Dh) only when the caller gives None; dropout(weights, "
            "dropout_p) (weights in q's dtype) before @ V; the weights handed back are "
            "before dropout",
            inputs=lambda d: _attention_inputs(d),
            run=_attention,
            dtype=torch.float32,
        ),
        Exercise(
            name="residual",
            file="model.py",
            function="residual",
            equation="TwT eqs. 2-3: PostNorm norm(x + F(x)), PreNorm x + F(norm(x))",
            writes="both residual placements",
            hint="dropout(F(...), cfg.dropout, training) on the sublayer's output; the norm gets "
            "pad_mask",
            inputs=lambda d: {"x": d.randn(2, 3, 4), "w": d.randn(4, 4), "seed": d.seed()},
            run=_residual,
        ),
        Exercise(
            name="smallinit",
            file="model.py",
            function="Transformer.reset_parameters",
            equation="TwT eq. 4 and section 2.2: Xavier std sqrt(2/(d_in + d_out)), SmallInit "
            "sqrt(2/5d)",
            writes="the attention and feed-forward standard deviations",
            hint="the std, not the variance; the feed-forward's fans are d_model and ff",
            # ff is not 4d.
            inputs=lambda d: {"seed": d.seed(), "ff": 16 * (2, 3, 5, 6)[d.integer(0, 4)]},
            run=_smallinit,
        ),
        Exercise(
            name="label_smoothing",
            file="model.py",
            function="label_smoothed_loss",
            equation="TwT appendix A: (1 - eps) NLL + eps mean over the allowed words of -log p",
            writes="log p, the NLL, the smoothed loss over real positions (in both regions: the "
            "fast path too)",
            hint="two regions: label_smoothed_loss and SmoothedCrossEntropy.forward (its "
            "backward reads logp and w); log p in at least float32 (at_least_fp32)",
            inputs=lambda d: _label_smoothing_inputs(d),
            run=_label_smoothing,
        ),
        Exercise(
            name="multilinear",
            file="model.py",
            function="MultiLinearAttention.forward",
            equation="Ma et al. 2019 core-1: T[i,j,k] = sum_r c_r Q[i,r] K[j,r] V[k,r], zero "
            "unless j, k <= i",
            writes="the causal tensor T",
            hint="self.mask[:t, :t, :t] is the mask: [j <= i and k <= i]; None under --mask none "
            "(nothing masked); e (relative positions; else None) adds e[j, r] to every i's "
            "Q[i, r] K[j, r]",
            inputs=lambda d: {"x": d.randn(2, 4, 6), "seed": d.seed()},
            run=_multilinear,
        ),
    ]


def data_exercises():
    """Word dropout and LM segments (data.py), and QKNorm's g0 (model.py) from L, the length
    statistic data.py computes."""
    return [
        Exercise(
            name="word_dropout",
            file="data.py",
            function="word_dropout",
            equation="TwT appendix A: a token becomes UNK with probability p",
            writes="the random replacement, PAD untouched",
            hint="draw from the generator given, one draw per position, each token "
            "independently; return a new tensor",
            inputs=lambda d: _word_dropout_inputs(d),
            run=_word_dropout,
            claims=_word_dropout_claims,
        ),
        Exercise(
            name="qk_g0",
            file="model.py",
            function="qk_g0",
            equation="QKNorm eq. 3: g0 = log2(L^2 - L)",
            writes="g0 from L",
            hint="log2, not the natural log",
            inputs=lambda d: {"L": [2, 30, 72, 97.5] + [d.uniform(2, 500) for _ in range(4)]},
            run=lambda i: _scalars(model.qk_g0, [(L,) for L in i["L"]]),
        ),
        Exercise(
            name="lm_segments",
            file="data.py",
            function="lm_segments",
            equation="a stream cut into inputs w_t and targets w_{t+1}",
            writes="the input and target segments, PAD-padded",
            hint="rows = ceil(n / seq_len): the last, shorter segment is PAD-padded, not dropped",
            inputs=lambda d: {
                "cases": [(torch.arange(11) + 3, 4)]
                + [
                    (torch.randint(4, 60, (d.integer(2, 30),), generator=d.g), d.integer(1, 7))
                    for _ in range(3)
                ]
            },
            run=_lm_segments,
        ),
    ]


def decode_and_train_exercises():
    """The exercises of decode.py and train.py: the length penalty and the learning rate's
    schedules."""
    return [
        Exercise(
            name="length_penalty",
            file="decode.py",
            function="length_penalty",
            equation="GNMT eq. 14: ((5 + |Y|) / 6)^alpha; fairseq: |Y|^alpha",
            writes="both penalties",
            hint="the whole (5 + |Y|) / 6 is raised to alpha",
            inputs=lambda d: {
                "cases": [
                    (1, 0.6, "gnmt"),
                    (7, 0.6, "gnmt"),
                    (7, 1.0, "fairseq"),
                    (12, 0.5, "fairseq"),
                    (3, 0.0, "gnmt"),
                ]
                + [
                    (d.integer(1, 80), d.uniform(0, 2), kind)
                    for kind in ("gnmt", "fairseq")
                    for _ in range(3)
                ]
            },
            run=lambda i: _scalars(decode.length_penalty, i["cases"]),
        ),
        Exercise(
            name="invsqrt",
            file="train.py",
            function="inverse_sqrt_lr",
            equation="TwT eq. 7: lambda / sqrt(d) min(n^-0.5, n warmup^-1.5)",
            writes="the learning rate of step n",
            hint="n warmup^-1.5 during the warmup, n^-0.5 after it",
            inputs=lambda d: {
                "cases": [
                    (1, 512, 4000, 1.0),
                    (4000, 512, 4000, 1.0),
                    (20000, 512, 4000, 2.0),
                    (10, 128, 200, 1.0),
                ]
                + [
                    (
                        d.integer(1, 9000),
                        64 * d.integer(1, 9),
                        d.integer(1, 4000),
                        d.uniform(0.1, 3),
                    )
                    for _ in range(6)
                ]
            },
            run=lambda i: _scalars(train.inverse_sqrt_lr, i["cases"]),
        ),
        Exercise(
            name="validation_decay",
            file="train.py",
            function="validation_decay",
            equation="TwT section 2.4: decay when dev BLEU is below each of the previous "
            "`patience`",
            writes="the decision from the history",
            hint="the newest score against the `patience` scores before it (not counting "
            "itself); strictly below",
            inputs=lambda d: {"cases": _histories(d)},
            run=lambda i: _scalars(train.validation_decay, i["cases"]),
        ),
    ]


def _attention_inputs(d):
    f32 = dict(dtype=torch.float32)
    i = {f"{n}_causal": d.randn(2, 2, 4, 3, **f32) for n in "qkv"}
    i.update(
        {
            "q_cross": d.randn(2, 2, 3, 5, **f32),
            "k_cross": d.randn(2, 2, 6, 5, **f32),
            "v_cross": d.randn(2, 2, 6, 5, **f32),
            "r_causal": d.randn(2, 2, 4, 3, **f32),
            "r_cross": d.randn(2, 2, 3, 5, **f32),
            "scale": d.uniform(0.2, 0.9),
            "seed": d.seed(),
        }
    )
    i["key_mask"] = torch.tensor([[True] * 4, [True, True, True, False]])[:, None, None, :]
    i["cross_mask"] = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]
    # Logits of 144 x N(0, 3): in the hundreds.
    i.update({f"{n}_big": 12 * d.randn(1, 2, 4, 3, **f32) for n in "qkvr"})
    i.update({f"{n}_bf16": d.randn(2, 2, 4, 3, dtype=torch.bfloat16) for n in "qkv"})
    return i


def _label_smoothing_inputs(d):
    return {
        "logits": d.randn(2, 3, 6),
        "target": torch.tensor([[1, 2, 0], [4, 1, 2]]),
        "real": torch.tensor([[True, True, False], [True, True, True]]),
        "eps": d.uniform(0.05, 0.3),
        "allowed": torch.tensor([True, True, True, False, True, True]),
        "logits_bf16": d.randn(2, 3, 6).bfloat16(),
    }


def _word_dropout_inputs(d):
    x = torch.randint(4, 50, (400, 100), generator=d.g)
    x[:, 80:] = data.PAD
    # Sentences of 1, 2 and 3 tokens, 1,000 each.
    short = torch.randint(4, 50, (3000, 3), generator=d.g)
    short[torch.arange(3) >= (torch.arange(3000) % 3 + 1)[:, None]] = data.PAD
    return {"x": x, "seed": d.seed(), "pad": data.PAD, "unk": data.UNK, "short": short}


def by_name():
    return {ex.name: ex for ex in exercises()}


# --- running and checking one exercise ----------------------------------------------------------
def run(ex, seed):
    """The exercise's outputs on the inputs of `seed`, every fast path off: {name: tensor}
    (detached)."""
    inputs = ex.inputs(Draw(seed, ex.name))
    norms.use_reference(True)
    try:
        got = ex.run(inputs)
    finally:
        norms.use_reference(False)
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in got.items()}


# An output in these dtypes is compared at its own precision.
LOW_PRECISION = (torch.float16, torch.bfloat16)


def tolerance(dtype):
    """(rtol, atol) of a comparison in dtype; float16 and bfloat16 (about 2.5 units of bfloat16's
    last place, 20 of float16's): an output the equation computes in float32 and rounds to them,
    where one rounding step more or less is no mistake."""
    return (
        (1e-6, 1e-8)
        if dtype == torch.float64
        else (2e-2, 2e-2)
        if dtype in LOW_PRECISION
        else (1e-5, 1e-6)
    )


def compare(ex, got, want, seed):
    """None if the outputs `got` are right, else the first difference, in words (one line)."""
    if ex.claims is not None:
        inputs = ex.inputs(Draw(seed, ex.name))
        reason = ex.claims(inputs, got)
        return reason and f"{reason}; {case_of(inputs, '', ())}"
    for key, expected in want.items():
        value = got.get(key)
        if value is None:
            return f"{key} was not computed (or no gradient reached it)"
        if not isinstance(value, torch.Tensor):
            return f"{key} is a {type(value).__name__}, not a tensor"
        if value.shape != expected.shape:
            return f"{key} has shape {tuple(value.shape)}, expected {tuple(expected.shape)}"
        # A dtype that differs: e.g. float32 out of a float64 input, token ids as floats.
        if value.dtype != expected.dtype:
            return f"{key} is {str(value.dtype)[6:]}, expected {str(expected.dtype)[6:]}"
        if not expected.is_floating_point():
            bad = value != expected
        else:
            rtol, atol = tolerance(expected.dtype if expected.dtype in LOW_PRECISION else ex.dtype)
            value, expected = value.to(ex.dtype), expected.to(ex.dtype)
            bad = ~torch.isclose(value, expected, rtol=rtol, atol=atol)
        if bad.any():
            first_bad = bad.flatten().nonzero()[0, 0]
            at = (
                tuple(int(j) for j in torch.unravel_index(first_bad, bad.shape))
                if bad.dim()
                else ()
            )
            index = f"[{', '.join(map(str, at))}]" if at else ""
            allowed = (
                f"; allowed {atol:g} + {rtol:g} x |expected|"
                if expected.is_floating_point()
                else ""
            )
            first = f"the first of {int(bad.sum())} elements that differ, " if bad.sum() > 1 else ""
            return (
                f"{key}{index} = {value[at].item():.10g} "
                f"where {expected[at].item():.10g} is expected "
                f"({first}in {str(ex.dtype)[6:]}{allowed}); "
                f"{case_of(ex.inputs(Draw(seed, ex.name)), key, at)}"
            )
    return None


def case_of(inputs, key, at):
    """The inputs of an output that differs, in words: for an exercise of cases (its outputs
    values[i], or x{i} and y{i}), that case's arguments; else the inputs named with the output's
    suffix (o_causal: q_causal, k_causal...; y8: x8), and every scalar; else every input. Tensors by
    shape and dtype."""

    def words(v):
        if isinstance(v, torch.Tensor):
            return f"{tuple(v.shape)} {str(v.dtype)[6:]}" if v.dim() else f"{v.item():.6g}"
        if isinstance(v, (tuple, list)):
            return "(" + ", ".join(words(x) for x in v) + ")"
        return f"{v:.6g}" if isinstance(v, float) else repr(v)

    cases = next((v for v in inputs.values() if isinstance(v, list)), None)
    digits = re.search(r"(\d+)$", key)
    n = at[0] if key == "values" and at else int(digits.group(1)) if digits else None
    if cases is not None and n is not None and n < len(cases):
        return f"the case: {words(cases[n])}"
    suffix = re.search(r"(_[a-z0-9]+|\d+)$", key)
    named = {k: v for k, v in inputs.items() if suffix and k.endswith(suffix.group(1)) and k != key}
    chosen = (
        {**named, **{k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}}
        if named
        else inputs
    )
    return "the inputs: " + ", ".join(f"{k} {words(v)}" for k, v in chosen.items())


def hint_for(ex, got, mistakes, seed):
    """The hint of the recorded mistake whose outputs `got` equal, if any."""
    for hint, outputs in mistakes:
        if (
            outputs is not None
            and set(outputs) <= set(got)
            and compare(ex, got, outputs, seed) is None
        ):
            return hint
    return None


def how_it_ended(exc):
    """An exception raised by a student's code, in words (one line), and where: (file, line) or
    None."""
    if isinstance(exc, NotImplementedError) and str(exc).startswith("exercise "):
        how = "not written yet (raises NotImplementedError)"
    else:
        # A SyntaxError's str has its line too: its msg alone.
        text = exc.msg if isinstance(exc, SyntaxError) else str(exc).strip()
        text = text.splitlines()[0][:200] if text else ""
        kind = {SystemExit: "called exit", KeyboardInterrupt: "raised KeyboardInterrupt"}.get(
            type(exc)
        )
        how = (
            f"{kind} ({text})"
            if kind and text
            else kind or f"{type(exc).__name__}{': ' + text if text else ''}"
        )
    if isinstance(exc, SyntaxError) and exc.filename and Path(exc.filename).name in SOURCES:
        return how, (Path(exc.filename).name, int(exc.lineno or 0))
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).name in SOURCES
    ]
    return how, (Path(frames[-1].filename).name, int(frames[-1].lineno or 0)) if frames else None


# --- the self-check (in a student's copy) --------------------------------------------------------
def load_values(path=VALUES):
    """The values file, checked: plain tensors only, every exercise present. A clear one-line
    refusal otherwise."""
    what = f"exercises.py: {path}"
    if not Path(path).is_file():
        sys.exit(
            f"{what} is missing: ask your instructor for the kit's tests/exercise_values.pt "
            "(nothing was graded)"
        )
    try:
        stored = torch.load(path, weights_only=True)
    except Exception as e:  # Anything but plain tensors is refused.
        sys.exit(f"{what} does not load as plain tensors ({type(e).__name__}); nothing was graded")
    names = [ex.name for ex in exercises()]
    ok = (
        isinstance(stored, dict)
        and stored.get("format") == FORMAT
        and isinstance(stored.get("values"), dict)
        and isinstance(stored.get("mistakes", {}), dict)
    )
    if not ok:
        sys.exit(f"{what} is not a values file of this kit (format {FORMAT}); nothing was graded")
    missing = [
        n
        for n in names
        if not isinstance(stored["values"].get(n), dict)
        or not all(isinstance(v, torch.Tensor) for v in stored["values"][n].values())
        or (not stored["values"][n] and by_name()[n].claims is None)
    ]
    if missing:
        sys.exit(
            f"{what} is incomplete: no expected values for {', '.join(missing)}; nothing was graded"
        )
    return stored


def self_check(names, timeout):
    """The checks run in a child process that reports one verdict line per exercise on a pipe of
    its own; however the student's code ends that process (an exit, a signal, a hang), the exercise
    it was checking FAILs with how, and a new process checks the rest."""
    stored = load_values()
    assigned = stored.get("assigned") or [ex.name for ex in exercises()]
    if not isinstance(assigned, list) or any(n not in by_name() for n in assigned):
        sys.exit(
            f"exercises.py: {VALUES} records an assignment of unknown exercises; nothing was graded"
        )
    todo, failed, total = list(names or assigned), 0, len(names or assigned)
    while todo:
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        # This process has imported torch and none of the project's files: the child starts fresh.
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            os.setsid()
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            cmd_check(write_fd, todo)  # never returns
        os.close(write_fd)
        done, how, buf = 0, None, b""
        while done < len(todo):
            if b"\n" not in buf:
                if not select.select([read_fd], [], [], timeout)[0]:
                    how = f"did not finish in {timeout:g} s, the time limit (an endless loop?)"
                    break
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                buf += chunk
                continue
            line, buf = buf.split(b"\n", 1)
            line = line.decode(errors="replace")
            if line.startswith(("PASS ", "FAIL ")) and line.split()[1].rstrip(":") == todo[done]:
                print(line, flush=True)
                failed += line.startswith("FAIL")
                done += 1
        os.close(read_fd)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # A hang, and anything the student's code started.
        rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        todo = todo[done:]
        if todo:
            how = how or (
                f"killed by {signal.Signals(-rc).name}"
                if rc < 0
                else f"the process ended (exit status {rc}) during this check: the code exits"
            )
            print(f"FAIL {todo[0]}: {how}", flush=True)
            failed += 1
            todo = todo[1:]
    print(f"{total - failed} of {total} exercises pass", file=sys.stderr)
    return 1 if failed else 0


def cmd_check(fd, names):
    """(the self-check's forked child) one verdict line per exercise, written to the pipe `fd`.
    Never returns."""
    out = os.fdopen(int(fd), "w")
    stored = load_values()
    try:
        load_project()
    except BaseException as e:  # A file that does not import fails every check.
        how, where = how_it_ended(e)
        for n in names:
            out.write(f"FAIL {n}: {how}{f' at {where[0]}:{where[1]}' if where else ''}\n")
        out.flush()
        os._exit(0)
    for ex in (by_name()[n] for n in names):
        try:
            got = run(ex, RECORD_SEED)
            reason = compare(ex, got, stored["values"][ex.name], RECORD_SEED)
            if reason:
                hint = hint_for(ex, got, stored.get("mistakes", {}).get(ex.name, []), RECORD_SEED)
                reason += f". Hint: {hint}" if hint else ""
        except BaseException as e:  # A student's code ends this one check only, however it ends.
            how, where = how_it_ended(e)
            reason = how + (f" at {where[0]}:{where[1]}" if where else "")
        out.write(f"FAIL {ex.name}: {reason}\n" if reason else f"PASS {ex.name}\n")
        out.flush()
    os._exit(0)


# --- the instructor's grade: each exercise of a submission in a fresh process ---------------------
def regions(text):
    """[(name, begin line index, end line index)] of the '# Exercise NAME: begin/end' comments, and
    the problems found (an end without its begin, a begin without its end, one inside another)."""
    found, problems, open_ = [], [], None
    for n, line in enumerate(text.split("\n")):
        m = MARKER.match(line)
        if not m:
            continue
        name, kind = m.group(2), m.group(3)
        if kind == "begin":
            if open_ is not None:
                problems.append(f"{open_[0]}'s region is not closed before {name}'s begins")
            open_ = (name, n)
        elif open_ is None or open_[0] != name:
            problems.append(f"{name}'s end marker has no begin marker before it")
            open_ = None
        else:
            found.append((name, open_[1], n))
            open_ = None
    if open_ is not None:
        problems.append(f"{open_[0]}'s region has no end marker")
    return found, problems


def region_texts(folder, ex_name, files):
    """The code between the markers of one exercise, per region, its indentation removed; or
    (None, why) when a file or a region is missing."""
    texts, where = [], []
    for rel, count in files:
        path = Path(folder) / rel
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            return (
                None,
                f"{rel} cannot be read ({getattr(e, 'strerror', None) or type(e).__name__})",
            )
        found, problems = regions(text)
        mine = [(b, e) for name, b, e in found if name == ex_name]
        broken = [p for p in problems if p.startswith(ex_name + "'")]
        if broken:
            return None, f"{rel}: {broken[0]}"
        if len(mine) != count:
            return None, (
                f"{rel} has {len(mine)} region{'s' if len(mine) != 1 else ''} "
                f"'# Exercise {ex_name}: "
                f"begin/end', the exercise has {count}"
            )
        lines = text.split("\n")
        for b, e in mine:
            indent = MARKER.match(lines[b]).group(1)
            texts.append(
                "\n".join(
                    line[len(indent) :] if line.startswith(indent) else line
                    for line in lines[b + 1 : e]
                )
            )
            where.append((rel, b + 2))  # the region's first line, 1-based
    return (texts, where), None


def solution_files(ex_name):
    """[(file, number of regions of the exercise in it)] in the instructor's tree."""
    out = []
    for rel in SOURCES:
        n = sum(1 for name, _, _ in regions((ROOT / rel).read_text())[0] if name == ex_name)
        if n:
            out.append((rel, n))
    return out


def student_copy_text(text):
    """A kit file without its instructor-only lines (the mistakes, the cheats of the tests:
    near-solutions)."""
    lines, out, skipping = text.split("\n"), [], False
    for line in lines:
        if line == INSTRUCTOR_ONLY + "begin":
            skipping = True
            out.append("# (the instructor-only lines are left out of a student's copy)")
        elif line == INSTRUCTOR_ONLY + "end":
            skipping = False
        elif not skipping:
            out.append(line)
    return "\n".join(out)


def build_sandbox(folder, ex_name, texts):
    """A copy of the instructor's five files and machinery/ (and this kit, without its
    instructor-only lines) in `folder`, the exercise's regions replaced by `texts` (in file order,
    then line order). Returns, for each replaced region, (file, its first line, its last line)
    there."""
    (folder / "tests").mkdir(parents=True)
    (folder / "tests" / "exercises.py").write_text(student_copy_text(Path(__file__).read_text()))
    (folder / "machinery").mkdir()
    for rel in MACHINERY:  # the instructor's own machinery, as it is
        shutil.copyfile(ROOT / rel, folder / rel)
    spans, texts = [], list(texts)
    for rel in SOURCES:
        lines = (ROOT / rel).read_text().split("\n")
        mine = [(b, e) for name, b, e in regions("\n".join(lines))[0] if name == ex_name]
        bodies, texts = texts[: len(mine)], texts[len(mine) :]
        # One body per region: a region left without one would keep the instructor's solution.
        for (b, e), body in reversed(list(zip(mine, bodies, strict=True))):
            indent = MARKER.match(lines[b]).group(1)
            lines[b + 1 : e] = [indent + line if line.strip() else "" for line in body.split("\n")]
        (folder / rel).write_text("\n".join(lines))
        spans += [(rel, b + 2, e) for name, b, e in regions("\n".join(lines))[0] if name == ex_name]
    return spans


class ForkServer:
    """Where the grading processes start: a process that has imported torch once forks each of them
    (started on first use, one per grade). A fresh interpreter's start is 1.5-2 s of importing
    torch, 70 of them in a class's grade; a fork is milliseconds, and the child is as fresh for the
    student's code: its own process group, folder, log, import path and limits, none of the
    project's files imported yet (cmd_serve, serve_one)."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), "_serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            start_new_session=True,
        )
        self.news, self.jobs, self.gone = threading.Condition(), itertools.count(), False
        # Job number -> pid; pid -> exit status (-N: killed by signal N).
        self.started, self.ended = {}, {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            what, key, value = line.split()
            with self.news:
                (self.started if what == "started" else self.ended)[int(key)] = int(value)
                self.news.notify_all()
        with self.news:
            self.gone = True
            self.news.notify_all()

    def start(self, *argv, cwd, log):
        """Forks `exercises.py *argv` run in folder cwd (its own copy of this file), output to the
        file log: its pid."""
        with self.news:
            job = next(self.jobs)
            self.proc.stdin.write(
                json.dumps(
                    {"job": job, "argv": [str(a) for a in argv], "cwd": str(cwd), "log": str(log)}
                )
                + "\n"
            )
            self.proc.stdin.flush()
            self.news.wait_for(lambda: job in self.started or self.gone)
            if self.gone:
                raise RuntimeError("exercises.py: the grader's fork server ended")
            return self.started.pop(job)

    def wait(self, pid, timeout=None):
        """The exit status of process pid (as Popen's returncode), or None if it still runs after
        timeout s."""
        with self.news:
            if not self.news.wait_for(lambda: pid in self.ended or self.gone, timeout):
                return None
            if pid not in self.ended:
                raise RuntimeError("exercises.py: the grader's fork server ended")
            return self.ended.pop(pid)


SERVER_LOCK, SERVER = threading.Lock(), []


def fork_server():
    with SERVER_LOCK:
        if not SERVER:
            SERVER.append(ForkServer())
        return SERVER[0]


def cmd_serve():
    """(the fork server) one JSON job a line on stdin: fork serve_one; "started JOB PID", then
    "ended PID STATUS". When the grader ends (stdin closes), however it ends (a kill too), the
    children still running are killed."""
    buf, alive = b"", set()
    while True:
        while True:  # the children that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            alive.discard(pid)
            print(f"ended {pid} {os.waitstatus_to_exitcode(status)}", flush=True)
        if not select.select([0], [], [], 0.02)[0]:
            continue
        chunk = os.read(0, 65536)  # not sys.stdin: its buffer would hide a second line from select
        if not chunk:  # the grader ended
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # a hang, and anything it started
                os.waitpid(pid, 0)
            os._exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            job = json.loads(line)
            pid = os.fork()
            if pid == 0:
                serve_one(job)
            alive.add(pid)
            print(f"started {job['job']} {pid}", flush=True)


def serve_one(job):
    """(a forked grading process) run the copy's exercises.py with job's argv in its folder, as a
    fresh process would: a session of its own (killed as a group), stdin empty, stdout and stderr to
    the log, the copy's folder alone on the import path of the project's files. Never returns."""
    try:
        os.setsid()
        for fd, path, mode in (
            (0, os.devnull, os.O_RDONLY),
            (1, job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            os.dup2(os.open(path, mode, 0o600), fd)
        os.dup2(1, 2)
        os.chdir(job["cwd"])
        script = str(Path(job["cwd"]) / "tests" / "exercises.py")
        sys.path[:] = [str(Path(script).parent)] + [
            p for p in sys.path if p not in (str(ROOT), str(ROOT / "tests"))
        ]
        sys.argv = [script] + job["argv"]
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        os._exit(0 if e.code is None else e.code if isinstance(e.code, int) else 1)
    except BaseException:  # The copy's harness itself failed: its traceback is in the log.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


LIVE = set()  # the pids of the grading processes running now (killed on Ctrl-C)


def run_isolated(ex_name, texts, seed, timeout, memory=2048):
    """One exercise with `texts` as its regions, in a fresh process with a time limit and a memory
    limit (`memory` MB of data: what the process allocates, beyond Python's and torch's code;
    cmd_run sets it). Returns (outputs, None, spans), or (None, how it ended, spans): a line, or
    (how, file, line) to be mapped to the submission's lines through spans (build_sandbox)."""
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        box, result = Path(tmp) / "box", Path(tmp) / "box" / "result.pt"
        spans = build_sandbox(box, ex_name, texts)
        server = fork_server()
        pid = server.start("_run", ex_name, seed, result, memory, cwd=box, log=Path(tmp) / "log")
        LIVE.add(pid)
        try:
            returncode = server.wait(pid, timeout)
            timed_out = returncode is None
        finally:
            LIVE.discard(pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # A hang, and anything it started.
        if timed_out:
            returncode = server.wait(pid)
        with open(Path(tmp) / "log", errors="replace") as log:
            last = ([line for line in log.read().splitlines() if line.strip()][-1:] or [""])[0][
                :160
            ]
        try:
            got = (
                torch.load(result, weights_only=True)
                if result.is_file() and not timed_out
                else None
            )
        except Exception as e:  # Anything but plain tensors: what it was, in one line.
            return (
                None,
                f"it handed back something other than plain tensors ({type(e).__name__})",
                spans,
            )
    if timed_out:
        return None, f"did not finish in {timeout:g} s, the time limit (an endless loop?)", spans
    if got is None:
        if returncode < 0:
            return None, f"the process was killed by {signal.Signals(-returncode).name}", spans
        return (
            None,
            (
                f"the process ended (exit status {returncode}) before handing back its outputs: "
                "the code "
                f"exits or kills it{' (its last words: ' + last + ')' if last else ''}"
            ),
            spans,
        )
    if (
        isinstance(got, dict)
        and set(got) == {"error"}
        and isinstance(got["error"], tuple)
        and len(got["error"]) == 3
    ):
        how, rel, line = got["error"]
        if isinstance(how, str) and (
            "can't allocate memory" in how or how.startswith("MemoryError")
        ):
            # Torch's allocator says how much.
            tried = re.search(r"you tried to allocate (\d+) bytes", how)
            what = (
                f"allocating {int(tried.group(1)) / 2**20:,.0f} MB failed"
                if tried
                else how.split(":")[0]
            )
            how = f"{what}: past the memory limit of one exercise's process, --memory {memory} MB"
        return None, (how, rel, line), spans
    if not (
        isinstance(got, dict)
        and set(got) == {"outputs"}
        and isinstance(got["outputs"], dict)
        and all(
            isinstance(k, str) and (v is None or isinstance(v, torch.Tensor))
            for k, v in got["outputs"].items()
        )
    ):
        return None, "it handed back something other than named tensors", spans
    return got["outputs"], None, spans


def cmd_run(name, seed, out, memory):
    """(in a grading process) one exercise's outputs, or how its code failed, written to `out`;
    allocations past `memory` MB of data fail (RLIMIT_DATA, soft and hard: a process without root's
    rights cannot lift it)."""
    resource.setrlimit(resource.RLIMIT_DATA, (int(memory) << 20, int(memory) << 20))
    try:
        load_project()
        result = {"outputs": run(by_name()[name], int(seed))}
    except BaseException as e:  # However the code ends, the grader hears how.
        how, where = how_it_ended(e)
        result = {"error": (how,) + (where or ("", 0))}
    torch.save(result, out)
    os._exit(0)  # nothing the student's code left behind (threads, atexit) runs after this


class Grader:
    """The instructor's grade: results cached by (exercise, the code of its regions), the reference
    run once."""

    def __init__(self, seed, timeout, jobs, memory):
        self.seed, self.timeout, self.memory = seed, timeout, memory
        self.pool = ThreadPoolExecutor(max(1, jobs))
        self.cache, self.expected, self.mistake_runs = {}, {}, {}

    def submit(self, ex_name, texts):
        key = (ex_name, hashlib.sha256("\0".join(texts).encode()).hexdigest())
        if key not in self.cache:
            self.cache[key] = self.pool.submit(
                run_isolated, ex_name, texts, self.seed, self.timeout, self.memory
            )
        return self.cache[key]

    def reference(self, ex):
        if ex.name not in self.expected:
            self.expected[ex.name] = run(ex, self.seed)
        return self.expected[ex.name]

    def mistakes(self, ex):
        """The instructor's mistakes of this exercise, run like a submission on this grade's
        inputs."""
        if ex.name not in self.mistake_runs:
            runs = [
                (hint, self.submit(ex.name, bodies)) for hint, bodies in MISTAKES.get(ex.name, [])
            ]
            self.mistake_runs[ex.name] = [(hint, f.result()[0]) for hint, f in runs]
        return self.mistake_runs[ex.name]

    def verdict(self, ex, future, where):
        outputs, error, spans = future.result()
        if error is not None:
            if isinstance(error, str):
                return error
            text, rel, line = error
            # One span and one place per region alike; a mismatch could only misplace a line
            # number in the message, so it never stops a grade.
            for (srel, first, last), (wrel, wline) in zip(spans, where, strict=False):
                if rel == srel and first <= line <= last:
                    return f"{text} at {wrel}:{wline + line - first}"
            return text + (
                f" (in the instructor's {rel}:{line}, called with your code's results)"
                if rel
                else ""
            )
        reason = compare(ex, outputs, self.reference(ex), self.seed)
        if reason:
            hint = hint_for(ex, outputs, self.mistakes(ex), self.seed)
            reason += f". Hint: {hint}" if hint else ""
        return reason


def parse_points(spec, names):
    points = {n: 1.0 for n in names}
    for item in filter(None, (spec or "").split(",")):
        name, _, value = item.rpartition("=")
        try:
            p = float(value)
        except ValueError:
            sys.exit(f"exercises.py grade: --points {spec}: {item!r} is not NAME=POINTS or POINTS")
        if name and name not in names:
            sys.exit(
                f"exercises.py grade: --points {spec}: {name!r} is not among the exercises graded"
            )
        for n in [name] if name else names:
            points[n] = p
    return points


def grade_submissions(folders, names, a):
    every = by_name()
    chosen = names or (assigned_of(a.kit) if a.kit else list(every))
    points = parse_points(a.points, chosen)
    for flag, path in (("--csv", a.csv), ("--json", a.json), ("--feedback", a.feedback)):
        if path and not Path(path).resolve().parent.is_dir():
            sys.exit(f"exercises.py grade: {flag} {path}: its folder does not exist")
    if a.wide and not a.csv:
        sys.exit("exercises.py grade: --wide is a layout of --csv: give --csv FILE too")
    if a.feedback and Path(a.feedback).exists() and not Path(a.feedback).is_dir():
        sys.exit(f"exercises.py grade: --feedback {a.feedback}: a file, not a folder")
    started = time.time()
    grader = Grader(a.seed, a.timeout, a.jobs, a.memory)
    files = {n: solution_files(n) for n in chosen}
    plans = []
    for folder in folders:  # every job first, so that the pool is kept busy
        plan = []
        for n in chosen:
            found, why = region_texts(folder, n, files[n])
            plan.append(
                (
                    every[n],
                    why,
                    grader.submit(n, found[0]) if found else None,
                    found[1] if found else None,
                )
            )
        plans.append((folder, plan))
    try:
        rows = report(plans, grader, points)
    except KeyboardInterrupt:
        grader.pool.shutdown(wait=False, cancel_futures=True)
        for pid in list(LIVE):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        print("exercises.py grade: interrupted; no gradebook written", file=sys.stderr)
        return 130
    grader.pool.shutdown()
    print(
        f"graded {len(folders)} submission{'s' if len(folders) != 1 else ''} "
        f"x {len(chosen)} exercises in "
        f"{time.time() - started:.1f} s ({len(grader.cache)} distinct codes run, seed {a.seed})",
        file=sys.stderr,
    )
    if a.csv:
        table = wide_rows(rows, chosen, points) if a.wide else rows
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    if a.feedback:
        write_feedback(rows, Path(a.feedback), points)
    return 0 if all(r["result"] == "PASS" for r in rows) else 1


def report(plans, grader, points):
    """Each submission's lines, in order, as its results come in; the gradebook's rows."""
    rows = []
    for folder, plan in plans:
        print(f"== {folder}", flush=True)
        got = 0.0
        for ex, why, future, where in plan:
            reason = why or grader.verdict(ex, future, where)
            if why:
                reason = f"missing: {why}"
            earned = 0.0 if reason else points[ex.name]
            got += earned
            print(f"FAIL {ex.name}: {reason}" if reason else f"PASS {ex.name}", flush=True)
            rows.append(
                {
                    "submission": str(folder),
                    "exercise": ex.name,
                    "result": "FAIL" if reason else "PASS",
                    "points": earned,
                    "max_points": points[ex.name],
                    "reason": reason or "",
                }
            )
        passed = sum(r["result"] == "PASS" for r in rows if r["submission"] == str(folder))
        print(
            f"{folder}: {passed} of {len(plan)} exercises pass, "
            f"{got:g} of {sum(points.values()):g} points",
            flush=True,
        )
    return rows


def wide_rows(rows, names, points):
    """The gradebook with a row per submission: each exercise's points (0 for a FAIL), the total,
    the maximum."""
    table = {}
    for r in rows:
        table.setdefault(r["submission"], {"submission": r["submission"]})[r["exercise"]] = r[
            "points"
        ]
    for row in table.values():
        row.update(total=sum(row[n] for n in names), max_total=sum(points[n] for n in names))
    return list(table.values())


def feedback_names(submissions):
    """A file name per submission: its folder's name, with the folders above it where two would be
    alike."""
    parts = {s: Path(s).resolve().parts for s in submissions}
    depth = 1
    while depth < max(map(len, parts.values())) and len(
        {"_".join(p[-depth:]) for p in parts.values()}
    ) < len(parts):
        depth += 1
    return {s: re.sub(r"[^\w.-]", "_", "_".join(p[-depth:])) + ".md" for s, p in parts.items()}


def write_feedback(rows, folder, points):
    """--feedback DIR: one Markdown file per submission, to hand back: its score, then each
    exercise's verdict."""
    folder.mkdir(exist_ok=True)
    subs = list(dict.fromkeys(r["submission"] for r in rows))
    for sub, name in feedback_names(subs).items():
        mine = [r for r in rows if r["submission"] == sub]
        got, most = sum(r["points"] for r in mine), sum(r["max_points"] for r in mine)
        lines = [
            f"# Feedback: {Path(sub).name}",
            "",
            f"{sum(r['result'] == 'PASS' for r in mine)} of {len(mine)} exercises pass: "
            f"{got:g} of {most:g} "
            f"points.",
            "",
            "| exercise | result | points |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r['exercise']} | {r['result']} | {r['points']:g} of {r['max_points']:g} |"
            for r in mine
        ]
        for r in (r for r in mine if r["result"] == "FAIL"):
            lines += ["", f"## {r['exercise']}: FAIL", "", r["reason"]]
        (folder / name).write_text("\n".join(lines) + "\n")
    print(f"feedback: {len(subs)} files in {folder}", file=sys.stderr)


def assigned_of(kit):
    """The exercises a kit made by `make` (kept by the instructor) blanked."""
    path = Path(kit) / "tests" / "exercise_values.pt"
    if not Path(kit).is_dir():
        sys.exit(f"exercises.py grade: --kit {kit}: no such folder")
    try:
        stored = torch.load(path, weights_only=True)
        return list(stored["assigned"])
    except Exception:  # No values file, or one without an assignment.
        sys.exit(
            f"exercises.py grade: --kit {kit}: {path} records no assignment "
            "(give the exercises' names)"
        )


def positive(flag, kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a positive {'number' if kind is float else 'integer'}"
            )
        return value

    return parse


def grade_parser():
    """`grade`'s flags: the self-check's --timeout, and the instructor's grade's."""
    p = argparse.ArgumentParser(
        prog="exercises.py grade",
        description="Without a folder: the self-check of this copy. "
        "With folders: the instructor's grade of those students' copies.",
    )
    p.add_argument(
        "items", nargs="*", metavar="DIR|NAME", help="students' copies, and the exercises to grade"
    )
    p.add_argument(
        "--seed", type=int, default=GRADE_SEED, help="the inputs drawn (instructor's grade)"
    )
    p.add_argument(
        "--timeout",
        type=positive("--timeout", float),
        default=120.0,
        help="seconds one exercise may run (default 120)",
    )
    p.add_argument(
        "--memory",
        type=positive("--memory", int),
        default=2048,
        metavar="MB",
        help="megabytes of data one exercise's process may allocate; past it that exercise "
        "FAILs, saying so (default 2048: with --jobs 4, 8 GB at most)",
    )
    p.add_argument(
        "--jobs",
        type=positive("--jobs", int),
        default=min(4, os.cpu_count() or 1),
        help="exercises graded at once (default: the CPU count, at most 4)",
    )
    p.add_argument("--points", help="points per exercise: 2, or batchnorm=3,pnv=2 (default 1 each)")
    p.add_argument("--csv", help="write the gradebook: one row per submission and exercise")
    p.add_argument("--json", help="the gradebook as JSON")
    p.add_argument(
        "--wide",
        action="store_true",
        help="with --csv: one row per submission, a column per exercise "
        "(its points, 0 for a FAIL) and the total, instead of a row per submission and exercise",
    )
    p.add_argument(
        "--feedback",
        metavar="DIR",
        help="write one Markdown file per submission into DIR, to hand back: "
        "each exercise's verdict, with its hint and, for a FAIL, the failing case",
    )
    p.add_argument("--kit", help="the copy `make` wrote: grade the exercises it blanked")
    return p


def cmd_grade(argv):
    a = grade_parser().parse_args(argv)
    names = [x for x in a.items if x in by_name()]
    folders = [Path(x) for x in a.items if x not in by_name()]
    for f in folders:
        if not f.is_dir():
            sys.exit(
                f"exercises.py grade: {f} is neither an exercise "
                "(python tests/exercises.py list) nor a folder"
            )
    if not folders:
        given = [
            f
            for f in (
                "--seed",
                "--jobs",
                "--points",
                "--csv",
                "--json",
                "--kit",
                "--wide",
                "--feedback",
                "--memory",
            )
            if any(x == f or x.startswith(f + "=") for x in argv)
        ]
        if given:
            sys.exit(
                f"exercises.py grade: {given[0]} is for grading students' copies: "
                "give their folders"
            )
        return self_check(names, a.timeout)
    if STUDENT_COPY:
        sys.exit(
            "exercises.py grade: grading students' copies needs the solutions: run it in the "
            "instructor's tree"
        )
    load_project()
    return grade_submissions(folders, names, a)


# --- make, record, list ---------------------------------------------------------------------------
def blank(text, names, equations):
    """text with the code of each named region replaced by a raise; the region's comments kept."""
    lines = text.split("\n")
    for name, b, e in sorted(regions(text)[0], key=lambda r: -r[1]):
        if name not in names:
            continue
        indent = lines[b][: len(lines[b]) - len(lines[b].lstrip())]
        # Comments kept: whole-line ones, and a line's trailing one where it states an equation.
        kept = [
            indent + "# " + line.split("# ", 1)[1]
            for line in lines[b + 1 : e]
            if "# " in line
            and (line.strip().startswith("#") or re.search(r"Paper|eq\.|=", line.split("# ", 1)[1]))
        ]
        raise_ = f'{indent}raise NotImplementedError("exercise {name}: {equations[name]}")'
        lines[b + 1 : e] = kept + [raise_]
    return "\n".join(lines)


def code_of(line):
    return line.split("#", 1)[0].strip()


def defined_names(ex):
    """The names each region of the exercise assigns that the code after it (in its function) reads,
    with their kind from a run of the solution: 'mu (a tensor)'; or 'returns' if the region
    returns."""
    spans = [span for rel, _ in solution_files(ex.name) for span in region_spans(ex.name, rel)]
    kinds = kinds_after(ex, spans)
    parts = []
    for _, _, _, names, returns in spans:
        if names:
            parts.append(
                "defines: " + ", ".join(f"{n} ({kinds[n]})" if n in kinds else n for n in names)
            )
        if returns:
            parts.append("returns the function's result")
    return "; ".join(parts) or "changes nothing the code after it reads"


def region_spans(ex_name, rel):
    """For each region of the exercise in the file rel: (its path, the first line of its function,
    the line after the region, the names it assigns that the code after it reads, whether it
    returns)."""
    text = (ROOT / rel).read_text()
    tree = ast.parse(text)
    spans = []
    for name, b, e in regions(text)[0]:
        if name != ex_name:
            continue
        fn = min(
            (
                f
                for f in ast.walk(tree)
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                and f.lineno <= b + 1
                and f.end_lineno >= e
            ),
            key=lambda f: f.end_lineno - f.lineno,
        )
        # The nodes between the region's markers.
        inside = [n for n in ast.walk(fn) if hasattr(n, "lineno") and b + 1 < n.lineno < e + 1]
        stored = [
            n.id
            for n in sorted(
                (n for n in inside if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)),
                key=lambda n: (n.lineno, n.col_offset),
            )
        ]
        read = {
            n.id
            for n in ast.walk(fn)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.lineno > e + 1
        }
        returns = any(isinstance(n, ast.Return) for n in inside)
        names = list(dict.fromkeys(n for n in stored if n in read))
        spans.append((str(ROOT / rel), fn.lineno, e + 2, names, returns))
    return spans


def kinds_after(ex, spans):
    """{name: 'a tensor'}: each name's kind, from the solution's locals just after its region (a
    run of the exercise, traced)."""
    kinds = {}

    def tracer(frame, event, arg):
        for path, first, after, names, _ in spans:
            if (
                frame.f_code.co_filename == path
                and frame.f_code.co_firstlineno <= first <= frame.f_lineno
                and event == "line"
                and frame.f_lineno >= after
            ):
                for n in names:
                    if n in frame.f_locals and n not in kinds:
                        v = frame.f_locals[n]
                        kind = "tensor" if isinstance(v, torch.Tensor) else type(v).__name__
                        kinds[n] = f"a{'n' * (kind[0] in 'aeiou')} {kind}"
        return tracer

    sys.settrace(tracer)
    try:
        run(ex, RECORD_SEED)
    except Exception:  # The kinds are a courtesy: without them, the names are listed bare.
        pass
    finally:
        sys.settrace(None)
    return kinds


def student_readme(chosen):
    out = [
        "# Exercises",
        "",
        "Write each exercise's code between its two comments, `# Exercise NAME: begin` and "
        "`# Exercise NAME: end`,",
        "in place of the `raise NotImplementedError(...)`. Only the code between the markers "
        "is graded: your",
        "instructor puts it into their own copy of the files, so what you change elsewhere "
        "does not count (and the",
        "code after a region reads the names listed below: define them).",
        "",
        "    python tests/exercises.py list",
        "    python tests/exercises.py grade            # yours: PASS name, or FAIL name: "
        "what differs, where",
        "    python tests/exercises.py grade NAME ...   # those only",
        "",
        "## Your exercises",
        "",
    ]
    for ex in chosen:
        out += [
            f"### {ex.name}: {ex.file}, `{ex.function}`",
            "",
            f"- equation: {ex.equation}",
            f"- write: {ex.writes}",
            f"- the code after the region: {defined_names(ex)}",
            f"- hint: {ex.hint}",
            "",
        ]
    return "\n".join(out)


def cmd_make(out, names):
    chosen = {ex.name: ex for ex in chosen_exercises(names)}
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        sys.exit(f"exercises.py make: {out} exists and is not an empty folder; give a new one")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        sys.exit(f"exercises.py make: cannot make the folder {out}: {e.strerror or e}")
    if not VALUES.is_file():
        sys.exit("exercises.py make: run `record` first (no values file)")
    stored = load_values()
    solutions, outside = [], []  # the blanked regions' code lines, and every other code line
    for rel in COPIED:
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / rel).read_text()
        if rel in SOURCES:
            lines, inside = text.split("\n"), set()
            for name, b, e in regions(text)[0]:
                if name in chosen:
                    solutions += [
                        code_of(line) for line in lines[b + 1 : e] if len(code_of(line)) >= 12
                    ]
                    inside.update(range(b + 1, e))
            outside += [code_of(line) for n, line in enumerate(lines) if n not in inside]
            text = blank(
                text, chosen, {n: ex.equation.replace('"', "'") for n, ex in chosen.items()}
            )
        elif rel in ("tests/exercises.py", "tests/test_exercises.py"):
            text = student_copy_text(text)
        elif rel in MACHINERY:  # no region there: every line is outside the regions
            outside += [code_of(line) for line in text.split("\n")]
        dest.write_text(text)
    torch.save(dict(stored, assigned=list(chosen)), out / "tests" / "exercise_values.pt")
    (out / "README.md").write_text(student_readme(list(chosen.values())))
    # The copy holds no solution line: no code line of a blanked region (one not also found outside
    # the regions, like `return y`) appears anywhere in it.
    copy_text = "\n".join(
        code_of(line) for p in out.rglob("*.py") for line in p.read_text().split("\n")
    )
    outside = set(outside)
    leaked = [s for s in solutions if s not in outside and s in copy_text]
    if leaked:
        shutil.rmtree(out)
        sys.exit(
            "exercises.py make: a solution line is still in the copy (so none was written): "
            f"{leaked[0]!r}"
        )
    print(
        f"wrote {out}: {len(chosen)} exercise{'' if len(chosen) == 1 else 's'} blanked "
        f"({', '.join(chosen)}); "
        f"no solution line is in the copy"
    )
    return 0


def cmd_record():
    """The self-check's expected values, from the solutions, and each mistake's outputs (each must
    fail its check on the self-check's inputs and on the grade's default ones, or its hint would
    mislead)."""
    if STUDENT_COPY:
        sys.exit(
            "exercises.py record: this is a student copy; record the expected values in the "
            "instructor's tree"
        )
    values, mistakes = {}, {}
    for ex in exercises():
        values[ex.name] = {} if ex.claims else run(ex, RECORD_SEED)
        mistakes[ex.name] = []
        for hint, bodies in MISTAKES.get(ex.name, []):
            for seed in (GRADE_SEED, RECORD_SEED):
                outputs, error, _ = run_isolated(ex.name, bodies, seed, 300)
                want = values[ex.name] if seed == RECORD_SEED else run(ex, seed)
                if error is not None or compare(ex, outputs, want, seed) is None:
                    sys.exit(
                        f"exercises.py record: the mistake of {ex.name} hinted {hint!r} "
                        f"{'fails to run: ' + str(error) if error else 'passes its check'} "
                        f"(seed {seed})"
                    )
            mistakes[ex.name].append((hint, outputs))
    torch.save({"format": FORMAT, "values": values, "mistakes": mistakes}, VALUES)
    print(
        f"wrote {VALUES.relative_to(ROOT)}: {len(values)} exercises, "
        f"{sum(map(len, mistakes.values()))} mistakes with hints (each fails its check)"
    )
    return 0


def cmd_list():
    for ex in exercises():
        print(f"{ex.name:<19} {ex.file}:{ex.function} | {ex.equation} | write: {ex.writes}")
    return 0


def chosen_exercises(names):
    every = exercises()
    unknown = [n for n in names if n not in {ex.name for ex in every}]
    if unknown:
        sys.exit(
            f"exercises.py: unknown exercise {unknown[0]!r}; "
            "python tests/exercises.py list shows them"
        )
    return [ex for ex in every if not names or ex.name in names]


def main(argv):
    if argv == ["_serve"]:
        return cmd_serve()
    if argv[:1] == ["_run"] and len(argv) == 5:
        return cmd_run(*argv[1:])
    if not argv or argv[0] not in ("list", "make", "grade", "record"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if argv[0] != "grade":  # the self-check imports a student's files in its child process only
        load_project()
    if argv[0] == "make":
        if len(argv) < 2:
            sys.exit("exercises.py make: give the folder to write the copy into")
        return cmd_make(argv[1], argv[2:])
    if argv[0] == "grade":
        return cmd_grade(argv[1:])
    return {"list": cmd_list, "record": cmd_record}[argv[0]]()


# --- the instructor's mistakes: each a region's code with one mistake students make, and its hint.
# `record` checks that each fails its exercise's check; a FAIL shows the hint of the mistake whose
# outputs the student's code gives. A student's copy gets their outputs (in the values file), not
# this code.
MISTAKES, STUDENT_COPY = {}, True
# Instructor only: begin
STUDENT_COPY = False
MISTAKES = {
    "scalenorm": [
        (
            "eps is added to the norm, g x / (||x|| + eps); here it clamps it: g x / "
            "max(||x||, eps)",
            [
                "n = xf.norm(dim=-1, keepdim=True)\n"
                "return (self.g * xf / (n + self.eps)).to(x.dtype)"
            ],
        )
    ],
    "rmsnorm": [
        (
            "eps goes inside the root: sqrt(mean x^2 + eps), not sqrt(mean x^2) + eps",
            [
                "r = xf.pow(2).mean(-1, keepdim=True).sqrt() + self.eps\n"
                "return (self.weight * xf / r).to(x.dtype)"
            ],
        ),
        (
            "the mean of x^2 over the D channels, not the sum",
            [
                "r = torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + self.eps)\n"
                "return (self.weight * xf / r).to(x.dtype)"
            ],
        ),
    ],
    "batchnorm": [
        (
            "sigma_B^2 is the biased variance, 1/N sum (x - mu)^2, not 1/(N - 1)",
            [
                "mu, n = batch_mean(xf, real)\n"
                "var = torch.where(real.unsqueeze(-1), (xf - mu) ** 2, 0.0).sum((0, "
                "1)) / (n - 1)\n"
                "y = self.weight * (xf - mu) / (var + self.eps).sqrt() + self.bias"
            ],
        ),
        (
            "eps goes inside the root: sqrt(sigma_B^2 + eps)",
            [
                "mu, n = batch_mean(xf, real)\n"
                "var = batch_mean((xf - mu) ** 2, real)[0]\n"
                "y = self.weight * (xf - mu) / (var.sqrt() + self.eps) + self.bias"
            ],
        ),
        (
            "padding is in the statistics: average over the real tokens only (batch_mean(v, real))",
            [
                "mu = xf.mean((0, 1))\n"
                "n = real.sum().to(xf.dtype)\n"
                "var = ((xf - mu) ** 2).mean((0, 1))\n"
                "y = self.weight * (xf - mu) / (var + self.eps).sqrt() + self.bias"
            ],
        ),
    ],
    "pnv": [
        (
            "padding is in the statistics: average over the real tokens only (batch_mean(v, real))",
            [
                "psi2 = (xf * xf).mean((0, 1))\n"
                "y = self.weight * xf / (psi2 + self.eps).sqrt() + self.bias"
            ],
        ),
        (
            "eps goes inside the root: sqrt(psi_B^2 + eps)",
            [
                "psi2 = batch_mean(xf * xf, real)[0]\n"
                "y = self.weight * xf / (psi2.sqrt() + self.eps) + self.bias"
            ],
        ),
    ],
    "attention": [
        (
            "the scale the caller gives is not used (QKNorm passes 1.0)",
            [
                "s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))\n"
                "if causal:\n"
                "    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), "
                "float('-inf'))\n"
                "if key_mask is not None:\n"
                "    s = s.masked_fill(~key_mask, float('-inf'))\n"
                "a = s.float().softmax(-1).to(q.dtype)\n"
                "return dropout(a, dropout_p) @ v, a"
            ],
        ),
        (
            "dropout_p is not used: dropout(weights, dropout_p) before multiplying by V",
            [
                "s = q @ k.transpose(-2, -1) * (q.size(-1) ** -0.5 if scale is None else scale)\n"
                "if causal:\n"
                "    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), "
                "float('-inf'))\n"
                "if key_mask is not None:\n"
                "    s = s.masked_fill(~key_mask, float('-inf'))\n"
                "a = s.float().softmax(-1).to(q.dtype)\n"
                "return a @ v, a"
            ],
        ),
    ],
    "residual": [
        (
            "the sublayer's output goes through dropout(..., cfg.dropout, training) before "
            "it is added",
            [
                "if cfg.prenorm:\n"
                "    return x + f(norm(x, pad_mask))\n"
                "return norm(x + f(x), pad_mask)"
            ],
        )
    ],
    "qk_g0": [("log2, not the natural log", ["return math.log(L ** 2 - L)"])],
    "validation_decay": [
        (
            "the window is off by one: the `patience` scores before the newest, "
            "history[-1 - patience:-1]",
            [
                "if len(history) <= patience:\n"
                "    return False\n"
                "return history[-1] < min(history[-patience:-1] or [1e9])"
            ],
        ),
        (
            "the window is off by one: the `patience` scores before the newest, "
            "history[-1 - patience:-1]",
            [
                "if len(history) <= patience + 1:\n"
                "    return False\n"
                "return history[-1] < min(history[-2 - patience:-1])"
            ],
        ),
        (
            "strictly below: a score equal to the worst of the window does not decay",
            [
                "if len(history) <= patience:\n"
                "    return False\n"
                "return history[-1] <= min(history[-1 - patience:-1])"
            ],
        ),
    ],
    "lm_segments": [
        (
            "rows = ceil(n / seq_len): the last, shorter segment is PAD-padded, not dropped",
            [
                "rows = max(n // seq_len, 1)\n"
                "x, y = torch.full((rows * seq_len,), PAD), torch.full((rows * seq_len,), PAD)\n"
                "m = min(n, rows * seq_len)\n"
                "x[:m], y[:m] = stream[:m], stream[1:m + 1]"
            ],
        )
    ],
    "length_penalty": [
        (
            "the whole (5 + |Y|) / 6 is raised to alpha",
            ["return 5.0 + length / 6.0 ** alpha if kind == 'gnmt' else float(length) ** alpha"],
        )
    ],
}
# Instructor only: end

if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main(sys.argv[1:]))
else:
    load_project()
