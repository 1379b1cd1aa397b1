"""The exercise kit: the papers' equations as exercises an instructor hands out and grades.

    python tests/exercises.py list                  # one line per exercise: name, file:function, equation, what to write
    python tests/exercises.py make OUT [NAME ...]   # a student copy of the project in OUT, those exercises blanked
    python tests/exercises.py grade [NAME ...]      # PASS/FAIL per exercise (exit status 0 only if all pass)
    python tests/exercises.py record                # (instructor) store the expected values from the solutions

Each exercise is a region of the source between two visible comments,
    # Exercise NAME: begin
    ...the lines that compute the equation...
    # Exercise NAME: end
`make` replaces the code of each chosen region with `raise NotImplementedError(...)` naming the
exercise and its equation; the comments in the region (the equation, written out) stay, and so do
the docstrings. The copy holds no solution: its tests are this file and tests/test_exercises.py,
which compare the student's code with expected values stored in tests/exercise_values.pt (made from
the solutions by `record`) or with a claim that needs no solution (word dropout's rate). Every
check calls one exercise's code on fixed inputs and runs the project's own code around it, so a
blank in one exercise fails that exercise alone; grading runs with every fast path off
(norms.use_reference), so the code the student writes is the code that runs.
"""
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import data  # noqa: E402
import decode  # noqa: E402
import model  # noqa: E402
import norms  # noqa: E402
import train  # noqa: E402

VALUES = Path(__file__).resolve().parent / "exercise_values.pt"
SOURCES = ["norms.py", "model.py", "data.py", "decode.py", "train.py"]
COPIED = SOURCES + ["requirements.txt", "tests/conftest.py", "tests/exercises.py", "tests/test_exercises.py",
                    "tests/exercise_values.pt"]


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _pad_mask():  # (2, 5) True at padding: the second sentence has 3 real tokens
    return torch.tensor([[False] * 5, [False] * 3 + [True] * 2])


def _forward_backward(module, x, pad_mask=None, seed=1):
    """y = module(x), and dL/dx, dL/dparameters for L = sum(y * r), r fixed."""
    x = x.clone().requires_grad_(True)
    y = module(x, pad_mask) if pad_mask is not None else module(x)
    r = _x(*y.shape, seed=seed)
    (y * r).sum().backward()
    out = {"y": y.detach(), "dx": x.grad}
    out.update({f"d{n}": p.grad for n, p in module.named_parameters() if p.grad is not None})
    return out


# --- each exercise: its inputs, and what the project's code gives on them -----------------------
def _scalenorm(i):
    m = norms.ScaleNorm(6).double()
    with torch.no_grad():
        m.g.fill_(1.7)
    return _forward_backward(m, i["x"])


def _rmsnorm(i):
    m = norms.RMSNorm(6).double()
    with torch.no_grad():
        m.weight.copy_(i["gain"])
    return _forward_backward(m, i["x"])


def _fixnorm(i):
    w = i["w"].clone().requires_grad_(True)
    y = norms.fixnorm(w)
    (y * _x(*y.shape, seed=1)).sum().backward()
    return {"y": y.detach(), "dw": w.grad}


def _batch_norm(cls, i):
    m = cls(6).double().train()
    out = _forward_backward(m, i["x"], _pad_mask())
    real = ~_pad_mask()  # padding positions: whatever the student's code gives there is fine
    out["y"], out["dx"] = out["y"][real], out["dx"][real]
    out.update({k: v.clone() for k, v in m.named_buffers()})
    return out


def _powernorm_backward(i):
    m = norms.PowerNorm(6, groups=2, warmup=1, alpha_fwd=0.9, alpha_bkw=0.9).double().train()
    out = {}
    for step in range(3):  # the first inside the warmup, then the running statistic
        got = _forward_backward(m, i["x"][step], _pad_mask(), seed=10 + step)
        out.update({f"{k}{step}": v for k, v in got.items()})
        out[f"nu{step}"] = m.running_nu.clone()
    return out


def _attention(i):
    q, k, v = (i[n].clone().requires_grad_(True) for n in "qkv")
    o, w = model.attention_math(q, k, v, i["key_mask"], causal=bool(i["causal"]))
    (o * _x(*o.shape, seed=1)).sum().backward()
    return {"o": o.detach(), "w": w, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _residual(i):
    out = {}
    for prenorm in (True, False):
        cfg = model.ModelConfig(vocab_size=8, dropout=0.0, prenorm=prenorm)
        f = lambda h: torch.tanh(h @ i["w"])  # a sublayer
        norm = lambda h, pad_mask: h / (1 + h.pow(2).sum(-1, keepdim=True))  # a norm
        out["pre" if prenorm else "post"] = model.residual(i["x"], f, norm, None, cfg, training=False)
    return out


def _smallinit(i):
    out = {}
    for init in ("small", "xavier"):
        torch.manual_seed(0)
        m = model.Transformer(model.ModelConfig(vocab_size=16, d_model=32, ff=96, heads=2, enc_layers=1, dec_layers=1,
                                                init=init))
        out[f"{init}_q"], out[f"{init}_w1"] = m.encoder[0].self_attn.q.weight.detach(), m.encoder[0].ff.w1.weight.detach()
    return out


def _label_smoothing(i):
    logits = i["logits"].clone().requires_grad_(True)
    loss, nll = model.label_smoothed_loss(logits.masked_fill(~i["allowed"], float("-inf")), i["target"], 0.1,
                                          i["real"], i["allowed"])
    loss.backward()
    return {"loss": loss.detach(), "nll": nll.detach(), "dlogits": logits.grad}


def _multilinear(i):
    cfg = model.ModelConfig(vocab_size=8, d_model=6, heads=2, seq_len=4, attention="multilinear", lm=True)
    torch.manual_seed(0)
    att = model.MultiLinearAttention(cfg).double()
    return _forward_backward(att, i["x"])


def _word_dropout(i):
    """A claim, not stored values (any random draw is right): a non-PAD token becomes UNK with
    probability p, PAD never does, the rest are unchanged, the input is not written into."""
    x = torch.randint(4, 50, (200, 100), generator=torch.Generator().manual_seed(0))
    x[:, 80:] = data.PAD
    before = x.clone()
    y = data.word_dropout(x, 0.3, torch.Generator().manual_seed(1))
    real = before != data.PAD
    assert torch.equal(x, before), "word_dropout wrote into its input (it must return a new tensor)"
    assert torch.equal(y[~real], before[~real]), "a PAD token was changed"
    changed = (y != before) & real
    assert torch.equal(y[changed], torch.full_like(y[changed], data.UNK)), "a dropped token is not UNK"
    rate = changed.sum().item() / real.sum().item()
    assert abs(rate - 0.3) < 0.015, f"{100 * rate:.1f}% of the tokens were dropped, not 30%"
    assert torch.equal(data.word_dropout(x, 0.0), x), "p = 0 must change nothing"
    return {}


def _lm_segments(i):
    s = data.lm_segments(i["stream"], 4)
    return {"x": s.x, "y": s.y}


def _scalars(fn, cases):
    return {"values": torch.tensor([float(fn(*c)) for c in cases], dtype=torch.float64)}


@dataclass
class Exercise:
    name: str
    file: str
    function: str
    equation: str
    writes: str
    inputs: dict
    run: object  # inputs -> {name: tensor}, the project's outputs (or an assertion of a claim)


def exercises():
    xb = _x(2, 5, 6)
    return [
        Exercise("scalenorm", "norms.py", "ScaleNorm.forward", "TwT eq. 5: g x / ||x||",
                 "the norm of each token and the scaled output", {"x": xb}, _scalenorm),
        Exercise("fixnorm", "norms.py", "fixnorm", "TwT section 2.3 (eq. 6): w / ||w|| per embedding row",
                 "each row divided by its l2 norm", {"w": _x(7, 5)}, _fixnorm),
        Exercise("rmsnorm", "norms.py", "RMSNorm.forward", "Zhang & Sennrich 2019: g_i x_i / RMS(x)",
                 "1 / RMS(x) and the output", {"x": xb, "gain": _x(6, seed=3)}, _rmsnorm),
        Exercise("batchnorm", "norms.py", "BatchNorm.forward", "PowerNorm Alg. 1: mu_B, sigma_B^2 over the real tokens",
                 "the batch mean and variance over real tokens and the normalized output", {"x": xb},
                 lambda i: _batch_norm(norms.BatchNorm, i)),
        Exercise("pnv", "norms.py", "PNV.forward", "PowerNorm Def. 1: psi_B^2 = mean x^2, y = gamma x / psi_B + beta",
                 "the quadratic mean over real tokens and the output", {"x": xb}, lambda i: _batch_norm(norms.PNV, i)),
        Exercise("powernorm_backward", "norms.py", "_PowerNormFunction.backward",
                 "PowerNorm Alg. 2 / eqs. 11-13: X^' = dL/dX^ - nu X^, dL/dX = X^' / psi, the update of nu",
                 "the approximate backward and the running nu", {"x": _x(3, 2, 5, 6, seed=4)}, _powernorm_backward),
        Exercise("attention", "model.py", "attention_math", "Vaswani eq. 1: softmax(Q K^T / sqrt(Dh) + mask) V",
                 "the scores, the causal and key masks, the softmax, the output",
                 {"q": _x(2, 2, 4, 3), "k": _x(2, 2, 4, 3, seed=1), "v": _x(2, 2, 4, 3, seed=2), "causal": True,
                  "key_mask": torch.tensor([[True] * 4, [True, True, True, False]])[:, None, None, :]}, _attention),
        Exercise("residual", "model.py", "residual", "TwT eqs. 2-3: PostNorm norm(x + F(x)), PreNorm x + F(norm(x))",
                 "both residual placements", {"x": _x(2, 3, 4), "w": _x(4, 4, seed=1)}, _residual),
        Exercise("smallinit", "model.py", "Transformer.reset_parameters",
                 "TwT eq. 4 and section 2.2: Xavier std sqrt(2/(d_in + d_out)), SmallInit sqrt(2/5d)",
                 "the attention and feed-forward standard deviations", {}, _smallinit),
        Exercise("label_smoothing", "model.py", "label_smoothed_loss",
                 "TwT appendix A: (1 - eps) NLL + eps mean over the allowed words of -log p",
                 "log p, the NLL, the smoothed loss over real positions",
                 {"logits": _x(2, 3, 6), "target": torch.tensor([[1, 2, 0], [4, 1, 2]]),
                  "real": torch.tensor([[True, True, False], [True, True, True]]),
                  "allowed": torch.tensor([True, True, True, False, True, True])}, _label_smoothing),
        Exercise("multilinear", "model.py", "MultiLinearAttention.forward",
                 "Ma et al. 2019 core-1: T[i,j,k] = sum_r c_r Q[i,r] K[j,r] V[k,r], zero unless j, k <= i",
                 "the causal tensor T", {"x": _x(2, 4, 6)}, _multilinear),
        Exercise("word_dropout", "data.py", "word_dropout", "TwT appendix A: a token becomes UNK with probability p",
                 "the random replacement, PAD untouched", {}, _word_dropout),
        Exercise("qk_g0", "model.py", "qk_g0", "QKNorm eq. 3: g0 = log2(L^2 - L)", "g0 from L", {},
                 lambda i: _scalars(model.qk_g0, [(2,), (30,), (72,), (97.5,)])),
        Exercise("lm_segments", "data.py", "lm_segments", "a stream cut into inputs w_t and targets w_{t+1}",
                 "the input and target segments, PAD-padded", {"stream": torch.arange(11) + 3}, _lm_segments),
        Exercise("length_penalty", "decode.py", "length_penalty",
                 "GNMT eq. 14: ((5 + |Y|) / 6)^alpha; fairseq: |Y|^alpha", "both penalties", {},
                 lambda i: _scalars(decode.length_penalty, [(1, 0.6, "gnmt"), (7, 0.6, "gnmt"), (7, 1.0, "fairseq"),
                                                            (12, 0.5, "fairseq"), (3, 0.0, "gnmt")])),
        Exercise("invsqrt", "train.py", "inverse_sqrt_lr",
                 "TwT eq. 7: lambda / sqrt(d) min(n^-0.5, n warmup^-1.5)", "the learning rate of step n", {},
                 lambda i: _scalars(train.inverse_sqrt_lr, [(1, 512, 4000, 1.0), (4000, 512, 4000, 1.0),
                                                            (20000, 512, 4000, 2.0), (10, 128, 200, 1.0)])),
        Exercise("validation_decay", "train.py", "validation_decay",
                 "TwT section 2.4: decay when dev BLEU is below each of the previous `patience`",
                 "the decision from the history", {},
                 lambda i: _scalars(train.validation_decay, [([1.0, 2.0, 3.0], 3), ([5.0, 4.0, 4.5, 3.0], 3),
                                                             ([5.0, 4.0, 4.5, 4.2], 3), ([2.0, 1.0], 1),
                                                             ([2.0, 2.0], 1)])),
    ]


# --- checking one exercise --------------------------------------------------------------------
def check(ex, stored):
    """Runs one exercise with every fast path off; AssertionError (in plain words) if it is wrong."""
    norms.use_reference(True)
    try:
        got = ex.run(ex.inputs)
    finally:
        norms.use_reference(False)
    want = stored.get(ex.name, {})
    for key, expected in want.items():
        assert key in got, f"{key} was not computed"
        value = got[key]
        assert value is not None, f"{key}: no gradient reached it"
        assert value.shape == expected.shape, f"{key} has shape {tuple(value.shape)}, expected {tuple(expected.shape)}"
        value, expected = value.double(), expected.double()
        same_inf = torch.isinf(value) == torch.isinf(expected)
        if not (same_inf.all() and torch.allclose(value[~torch.isinf(expected)], expected[~torch.isinf(expected)],
                                                  rtol=1e-6, atol=1e-8)):
            diff = torch.where(torch.isinf(expected), 0.0, (value - expected).abs()).nan_to_num(float("inf"))
            at = tuple(int(j) for j in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
            raise AssertionError(f"{key} differs from the expected value: {value[at].item():.10g} where "
                                 f"{expected[at].item():.10g} is expected (at index {at}; difference "
                                 f"{diff[at].item():.3g}, allowed 1e-8 + 1e-6 x |expected|)")


def load_values():
    return torch.load(VALUES, weights_only=True) if VALUES.exists() else {}


# --- the command line ---------------------------------------------------------------------------
def cmd_list():
    for ex in exercises():
        print(f"{ex.name:<19} {ex.file}:{ex.function} | {ex.equation} | write: {ex.writes}")
    return 0


def cmd_record():
    """The expected values, from the solutions (run it in the original, never in a copy)."""
    if not (ROOT / "tests" / "test_model.py").exists():
        sys.exit("exercises.py record: this is a student copy; record the expected values in the original")
    values = {}
    for ex in exercises():
        norms.use_reference(True)
        try:
            values[ex.name] = {k: v.detach().clone() for k, v in ex.run(ex.inputs).items()}
        finally:
            norms.use_reference(False)
    torch.save(values, VALUES)
    print(f"wrote {VALUES.relative_to(ROOT)}: {len(values)} exercises")
    return 0


def cmd_grade(names):
    chosen = select(names)
    stored, failed = load_values(), 0
    for ex in chosen:
        try:
            check(ex, stored)
            print(f"PASS {ex.name}")
        except NotImplementedError:
            failed += 1
            print(f"FAIL {ex.name}: not written yet ({ex.file}:{ex.function} raises NotImplementedError)")
        except AssertionError as e:
            failed += 1
            print(f"FAIL {ex.name}: {e}")
        except Exception as e:  # noqa: BLE001 -- a student's error: say what and where, in one line
            failed += 1
            print(f"FAIL {ex.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    print(f"{len(chosen) - failed} of {len(chosen)} exercises pass", file=sys.stderr)
    return 1 if failed else 0


def regions(text):
    """[(name, begin line index, end line index)] of the '# Exercise NAME: begin/end' comments (an
    exercise may have several: a fast path that computes the same equation is blanked with it)."""
    found, open_ = [], {}
    for n, line in enumerate(text.split("\n")):
        s = line.strip()
        if s.startswith("# Exercise ") and s.endswith(": begin"):
            open_[s[len("# Exercise "):-len(": begin")]] = n
        elif s.startswith("# Exercise ") and s.endswith(": end"):
            name = s[len("# Exercise "):-len(": end")]
            found.append((name, open_.pop(name), n))
    return found


def blank(text, names, equations):
    """text with the code of each named region replaced by a raise; the region's comments kept."""
    lines = text.split("\n")
    for name, b, e in sorted(regions(text), key=lambda r: -r[1]):
        if name not in names:
            continue
        indent = lines[b][: len(lines[b]) - len(lines[b].lstrip())]
        # Comments kept: whole-line ones, and a line's trailing one where it states an equation.
        kept = [indent + "# " + line.split("# ", 1)[1] for line in lines[b + 1:e] if "# " in line
                and (line.strip().startswith("#") or re.search(r"Paper|eq\.|=", line.split("# ", 1)[1]))]
        raise_ = f'{indent}raise NotImplementedError("exercise {name}: {equations[name]}")'
        lines[b + 1:e] = kept + [raise_]
    return "\n".join(lines)


def code_of(line):
    return line.split("#", 1)[0].strip()


def cmd_make(out, names):
    chosen = {ex.name: ex for ex in select(names)}
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        sys.exit(f"exercises.py make: {out} exists and is not an empty folder; give a new one")
    solutions, outside = [], []  # the blanked regions' code lines, and every other code line
    for rel in COPIED:
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if rel in SOURCES:
            text = (ROOT / rel).read_text()
            lines, inside = text.split("\n"), set()
            for name, b, e in regions(text):
                if name in chosen:
                    solutions += [code_of(line) for line in lines[b + 1:e] if len(code_of(line)) >= 12]
                    inside.update(range(b + 1, e))
            outside += [code_of(line) for n, line in enumerate(lines) if n not in inside]
            dest.write_text(blank(text, chosen, {n: ex.equation.replace('"', "'") for n, ex in chosen.items()}))
        else:
            shutil.copyfile(ROOT / rel, dest)
    (out / "README.md").write_text(
        "# Exercises\n\nFill in each `raise NotImplementedError` between `# Exercise NAME: begin` and `# Exercise NAME: "
        "end`: the comments there give the equation.\n\n    python tests/exercises.py list\n"
        "    python tests/exercises.py grade            # all, or: grade NAME ...\n")
    # The copy holds no solution line: no code line of a blanked region (one not also found outside
    # the regions, like `return y`) appears anywhere in it.
    copy_text = "\n".join(code_of(line) for p in out.rglob("*.py") for line in p.read_text().split("\n"))
    outside = set(outside)
    leaked = [s for s in solutions if s not in outside and s in copy_text]
    if leaked:
        shutil.rmtree(out)
        sys.exit(f"exercises.py make: a solution line is still in the copy (so none was written): {leaked[0]!r}")
    print(f"wrote {out}: {len(chosen)} exercise{'' if len(chosen) == 1 else 's'} blanked ({', '.join(chosen)}); "
          f"no solution line is in the copy")
    return 0


def select(names):
    every = exercises()
    unknown = [n for n in names if n not in {ex.name for ex in every}]
    if unknown:
        sys.exit(f"exercises.py: unknown exercise {unknown[0]!r}; python tests/exercises.py list shows them")
    return [ex for ex in every if not names or ex.name in names]


def main(argv):
    if not argv or argv[0] not in ("list", "make", "grade", "record"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if argv[0] == "make":
        if len(argv) < 2:
            sys.exit("exercises.py make: give the folder to write the copy into")
        return cmd_make(argv[1], argv[2:])
    return {"list": cmd_list, "record": cmd_record}[argv[0]]() if argv[0] in ("list", "record") else cmd_grade(argv[1:])


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main(sys.argv[1:]))
