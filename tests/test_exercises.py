"""The exercise kit (tests/exercises.py): each exercise's check passes on the solutions; a student
copy blanks exactly the chosen regions and holds no solution line; grading a copy fails exactly the
blanked exercises, in the student's self-check and in the instructor's grade; every cheating case of
issue 29 fails its own exercise alone, in one line. (A copy keeps only this file and exercises.py
as its tests: the instructor's-tree tests are skipped there.)"""

import contextlib
import csv
import io
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import exercises
import norms

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = exercises.exercises()
NAMES = [ex.name for ex in EXERCISES]
original_only = pytest.mark.skipif(
    not (ROOT / "tests" / "test_model.py").exists(),
    reason="the instructor's original only (a student copy has no solutions)",
)
# The time limit of one exercise in the big grade below: each runs in under 0.5 s (forked, torch
# imported), so only a hang reaches it; the hang below holds one of the two grading jobs for the
# whole limit.
TIMEOUT = 10


@pytest.mark.parametrize("ex", EXERCISES, ids=NAMES)
def test_each_exercise_passes_with_its_solution(ex):
    stored = exercises.load_values()
    assert (
        exercises.compare(
            ex,
            exercises.run(ex, exercises.RECORD_SEED),
            stored["values"][ex.name],
            exercises.RECORD_SEED,
        )
        is None
    )


def _kit(*argv, cwd=ROOT, timeout=900):
    return subprocess.run(
        [sys.executable, str(Path(cwd) / "tests" / "exercises.py"), *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_wrong_answer_fails_with_the_first_difference_in_plain_words(monkeypatch):
    # The l1 norm, not the l2.
    monkeypatch.setattr(norms, "fixnorm", lambda w, eps=1e-12: w / w.abs().sum(-1, keepdim=True))
    ex = next(ex for ex in EXERCISES if ex.name == "fixnorm")
    got = exercises.run(ex, exercises.RECORD_SEED)
    reason = exercises.compare(
        ex, got, exercises.load_values()["values"]["fixnorm"], exercises.RECORD_SEED
    )
    assert reason.startswith("y[0, 0] = ") and "is expected (the first of" in reason


def test_word_dropouts_claims_catch_a_fixed_pattern_and_a_generator_ignored():
    ex = next(ex for ex in EXERCISES if ex.name == "word_dropout")
    inputs = ex.inputs(exercises.Draw(3, ex.name))
    got = exercises.run(ex, 3)
    assert ex.claims(inputs, got) is None
    fixed = dict(got, b=got["a"])
    assert "different seeds gave the same mask" in ex.claims(inputs, fixed)
    shuffled = dict(got, a_again=got["b"])
    assert "same seed gave different masks" in ex.claims(inputs, shuffled)


# The instructor's tree only (make leaves these out of a student's copy: the cheats below hold
# solution lines).
# Instructor only: begin
def _set_region(folder, name, body, k=0):
    """Replaces the code of the k-th region of exercise `name` in folder's files with `body`."""
    spots = [
        (rel, b, e)
        for rel in exercises.SOURCES
        for n, b, e in exercises.regions((Path(folder) / rel).read_text())[0]
        if n == name
    ]
    rel, b, e = spots[k]
    path = Path(folder) / rel
    lines = path.read_text().split("\n")
    indent = exercises.MARKER.match(lines[b]).group(1)
    lines[b + 1 : e] = [indent + line if line.strip() else "" for line in body.split("\n")]
    path.write_text("\n".join(lines))


def _solution_copy(folder):
    folder.mkdir()
    for rel in exercises.SOURCES:
        shutil.copyfile(ROOT / rel, folder / rel)
    return folder


def _csv_rows(path):
    """A gradebook's rows, as dicts."""
    with open(path) as f:
        return list(csv.DictReader(f))


def _verdicts(stdout):
    """{submission: {exercise: the PASS/FAIL line}} from grade's output."""
    out, current = {}, None
    for line in stdout.splitlines():
        if line.startswith("== "):
            current = out.setdefault(line[3:], {})
        elif line.startswith(("PASS ", "FAIL ")):
            current[line.split()[1].rstrip(":")] = line
    return out


# The cheating cases of issue 29, each in its own exercise of one submission: (exercise, region
# code, what the FAIL line must say). The submission's other exercises are the solutions and must
# pass.
CHEATS = {
    "fixnorm": ("import os\nos._exit(0)", "exit status 0) before handing back its outputs"),
    "rmsnorm": ("import sys\nsys.exit(0)", "called exit"),
    "qk_g0": ("raise SystemExit", "called exit"),
    "length_penalty": ("raise KeyboardInterrupt", "raised KeyboardInterrupt at decode.py:"),
    "invsqrt": ("while True:\n    pass", f"did not finish in {TIMEOUT} s"),
    "validation_decay": ("return history[-1] <", "SyntaxError"),
    # The common mistake, with torch.allclose made to say yes inside the region (and outside it,
    # below).
    "scalenorm": (
        "torch.allclose = lambda *a, **k: True\n"
        "norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)\n"
        "return (self.g * xf / (norm + self.eps)).to(x.dtype)",
        "eps is added to the norm",
    ),
    "residual": (
        "if cfg.prenorm:\n    return x + f(norm(x, pad_mask))\nreturn norm(x + f(x), pad_mask)",
        "goes through dropout",
    ),
    "attention": (
        "scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))\n"
        "if causal:\n"
        "    scores = scores.masked_fill(torch.ones(scores.shape[-2:], "
        "dtype=torch.bool).triu(1), float('-inf'))\n"
        "if key_mask is not None:\n"
        "    scores = scores.masked_fill(~key_mask, float('-inf'))\n"
        "weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)\n"
        "return weights @ v, weights",
        "o_cross[",
    ),
    "word_dropout": (
        "drop = (torch.arange(x.numel()) % 10 < 3).view(x.shape)\n"
        "return x.masked_fill(drop & (x != PAD), UNK)",
        "position 0 is dropped in 100% of the sentences",
    ),
    "batchnorm": (
        "mu, n = batch_mean(xf, real)\nvar = batch_mean((xf - mu).pow(2), real)[0] * n / (n - 1)\n"
        "y = self.weight * (xf - mu) / torch.sqrt(var + self.eps) + self.bias",
        "biased variance",
    ),
}
LABEL_SMOOTHING_FAST_PATH = (
    "logp = torch.log_softmax(at_least_fp32(z), dim=-1)\nw = real.to(logp.dtype)\n"
    "nll = -logp.gather(-1, target[:, None]).squeeze(-1)\nloss = 0 * nll"
)
FLOAT64_SOFTMAX = (
    "scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale\n"
    "scores = (q @ k.transpose(-2, -1)) * scale\n"
    "if causal:\n"
    "    tq, tk = scores.shape[-2:]\n"
    "    future = torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1)\n"
    "    scores = scores.masked_fill(future, float('-inf'))\n"
    "if key_mask is not None:\n"
    "    scores = scores.masked_fill(~key_mask, float('-inf'))\n"
    "weights = torch.softmax(scores.double(), dim=-1).to(q.dtype)"
    "  # float64: more exact than fp32\n"
    "return dropout(weights, dropout_p) @ v, weights"
)

# Wrong code a red-team review found passing the grade (2026-11-26), each in a submission of its
# own: (exercise, region code, what its FAIL line must say). Each is wrong against its equation or
# the project's contract; the inputs that catch it: a width of 8 with an all-zero token and a
# float16 pass (norms), gamma and beta away from 1 and 0, logits in the hundreds and bfloat16
# (attention), a padding mask the norm reads, --mask none, sentences of 1-3 tokens and one generator
# used twice (word dropout), ff != 4d, and dtypes compared.
NORM = "norm = {}\nreturn ({}).to(x.dtype)"
SOFTMAX = (
    "scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale\n"
    "scores = (q @ k.transpose(-2, -1)) * scale\n"
    "if causal:\n"
    "    tq, tk = scores.shape[-2:]\n"
    "    scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1), "
    "float('-inf'))\n"
    "if key_mask is not None:\n"
    "    scores = scores.masked_fill(~key_mask, float('-inf'))\n"
    "{}\n"
    "return dropout(weights, dropout_p) @ v, weights"
)
SMOOTHED = (
    "logp = torch.log_softmax(logits, dim=-1)  # in the logits' dtype\n"
    "nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)\n"
    "smooth = -logp.mean(-1) if allowed is None "
    "else -torch.where(allowed, logp, 0.0).sum(-1) / allowed.sum()\n"
    "loss = (1 - eps) * nll + eps * smooth\n"
    "if real is None:\n"
    "    return loss.sum(), nll.sum()\n"
    "return torch.where(real, loss, 0.0).sum(), torch.where(real, nll, 0.0).sum()"
)
WRONG = {
    "float32_out": (
        "scalenorm",
        "norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)\n"
        "return (xf * (self.g / norm.clamp_min(self.eps))).float()",
        "y is float32, expected float64",
    ),
    "no_clamp": (
        "scalenorm",
        NORM.format("xf.norm(dim=-1, keepdim=True)", "self.g * xf / norm"),
        "y8[0, 0, 0] = nan",
    ),
    "no_clamp_row": (
        "fixnorm",
        "return weight / weight.norm(dim=-1, keepdim=True)",
        "y[3, 0] = nan",
    ),
    "half_statistics": (
        "rmsnorm",
        "inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)\n"
        "return (self.weight * (x * inv_rms)).to(x.dtype)",
        "y16[",
    ),
    "width_6": (
        "rmsnorm",
        "inv_rms = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / 6 + self.eps)\n"
        "return (self.weight * (xf * inv_rms)).to(x.dtype)",
        "y8[",
    ),
    "gamma_times_beta": (
        "batchnorm",
        "mu, n = batch_mean(xf, real)\nvar, _ = batch_mean((xf - mu).pow(2), real)\n"
        "y = self.weight * ((xf - mu) / torch.sqrt(var + self.eps) + self.bias)",
        "y0[",
    ),
    "pnv_gamma_times_beta": (
        "pnv",
        "psi2, _ = batch_mean(xf.pow(2), real)\n"
        "y = self.weight * (xf / torch.sqrt(psi2 + self.eps) + self.bias)",
        "y0[",
    ),
    "no_gamma": (
        "powernorm_backward",
        "g = dy\ng_tilde = g - nu * z\ndx = g_tilde / torch.sqrt(psi2 + ctx.eps)\n"
        "Gamma_t, _ = batch_mean(z * z, real)\nLambda_t, _ = batch_mean(g * z, real)\n"
        "nu.copy_(nu * (1 - (1 - a) * Gamma_t) + (1 - a) * Lambda_t)",
        "dx0[",
    ),
    "exp_unshifted": (
        "attention",
        SOFTMAX.format(
            "e = scores.float().exp()\nweights = (e / e.sum(-1, keepdim=True)).to(q.dtype)"
        ),
        "_big[",
    ),
    "weights_not_cast": (
        "attention",
        SOFTMAX.format("weights = torch.softmax(scores.float(), dim=-1)"),
        "RuntimeError",
    ),
    "mask_not_passed": (
        "residual",
        "if cfg.prenorm:\n    return x + dropout(f(norm(x, None)), cfg.dropout, training)\n"
        "return norm(x + dropout(f(x), cfg.dropout, training), None)",
        "pre_train[",
    ),
    "own_causal_mask": (
        "multilinear",
        "S = q[:, :, :, None, :] * k[:, :, None] + (0 if e is None else e[:, :, None])\n"
        "T = (S.flatten(2, 3) @ (v * self.core).transpose(-1, -2))\n"
        "T = T.view(b, self.heads, t, t, t)\n"
        "i = torch.arange(t)\n"
        "T = T * ((i[None, :, None] <= i[:, None, None])\n"
        "         & (i[None, None, :] <= i[:, None, None]))",
        "_unmasked[",
    ),
    "exact_count": (
        "word_dropout",
        "real = x != PAD\nk = (real.sum(1, keepdim=True) * p).round().long()\n"
        "r = torch.rand(x.shape, generator=generator).masked_fill(~real, 2.0)\n"
        "return x.masked_fill(r.argsort(1).argsort(1) < k, UNK)",
        "of 1-token sentences",
    ),
    "reseeded": (
        "word_dropout",
        "g = torch.Generator().manual_seed(generator.initial_seed())\n"
        "return x.masked_fill((torch.rand(x.shape, generator=g) < p) & (x != PAD), UNK)",
        "two calls with one generator gave the same mask",
    ),
    "float_tokens": (
        "word_dropout",
        "drop = torch.rand(x.shape, generator=generator) < p\n"
        "return x.masked_fill(drop & (x != PAD), UNK).float()",
        "and torch.float32, expected (400, 100) and torch.int64",
    ),
    "ff_as_4d": (
        "smallinit",
        "attn_std = math.sqrt(2 / (5 * c.d_model)) if c.init == 'small' else "
        "math.sqrt(2 / (2 * c.d_model))\nff_std = math.sqrt(2 / (5 * c.d_model))",
        "_w1[",
    ),
    "float_ids": (
        "lm_segments",
        "rows = -(-n // seq_len)\n"
        "x, y = torch.zeros(rows * seq_len), torch.zeros(rows * seq_len)\n"
        "x[:n], y[:n] = stream[:-1], stream[1:]",
        "x0 is float32, expected int64",
    ),
    "bf16_log_p": ("label_smoothing", SMOOTHED, "loss_bf16 is bfloat16, expected float32"),
}


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    """One copy per exercise with only it blanked, one with all blanked, the cheating submission, a
    correct float64 softmax, one with a file deleted and a region's markers gone: all graded by the
    instructor in ONE grade call (results cached by the code of each region), and every one-blank
    copy self-checked on every exercise."""
    tmp = tmp_path_factory.mktemp("kits")
    made = {}
    for name in NAMES + [None]:  # in this process: 18 makes, one import of torch
        folder, said = tmp / f"only_{name or 'all'}", io.StringIO()
        with contextlib.redirect_stdout(said):
            assert exercises.cmd_make(str(folder), [name] if name else []) == 0
        made[name] = (folder, said.getvalue())
    cheats = _solution_copy(tmp / "cheats")
    for name, (body, _) in CHEATS.items():
        _set_region(cheats, name, body)
    _set_region(cheats, "label_smoothing", LABEL_SMOOTHING_FAST_PATH, k=1)
    with open(cheats / "norms.py", "a") as f:  # outside the regions: none of it counts
        f.write("\nimport torch\ntorch.allclose = lambda *a, **k: True\n")
    with open(cheats / "data.py", "a") as f:
        f.write("\nthis line is not python\n")
    (cheats / "tests").mkdir()  # the student's own grader and values, which say PASS to anything
    (cheats / "tests" / "exercises.py").write_text("print('PASS everything')\n")
    torch.save({"format": exercises.FORMAT, "values": {}}, cheats / "tests" / "exercise_values.pt")
    float64 = _solution_copy(tmp / "float64_softmax")
    _set_region(float64, "attention", FLOAT64_SOFTMAX)
    damaged = _solution_copy(tmp / "damaged")
    (damaged / "data.py").unlink()
    text = (damaged / "model.py").read_text()
    (damaged / "model.py").write_text(text.replace("# Exercise qk_g0: begin", "# (removed)"))
    wrong = []
    for name, (ex, body, _) in WRONG.items():
        wrong.append(_solution_copy(tmp / f"wrong_{name}"))
        _set_region(wrong[-1], ex, body)
    subs = [made[n][0] for n in NAMES] + [made[None][0], cheats, float64, damaged] + wrong
    graded = _kit(
        "grade",
        *map(str, subs),
        "--timeout",
        str(TIMEOUT),
        "--points",
        "2,batchnorm=3",
        "--csv",
        str(tmp / "g.csv"),
        "--json",
        str(tmp / "g.json"),
    )
    print(graded.stderr)  # the timing line: N submissions x 17 exercises in S s
    with ThreadPoolExecutor(2) as pool:  # the self-check of each copy, every exercise
        checks = dict(
            zip(
                NAMES, pool.map(lambda n: _kit("grade", *NAMES, cwd=made[n][0]), NAMES), strict=True
            )
        )
    checks[None] = _kit("grade", cwd=made[None][0])  # the assigned ones, by default
    return {
        "tmp": tmp,
        "made": made,
        "graded": graded,
        "verdicts": _verdicts(graded.stdout),
        "checks": checks,
    }


@original_only
def test_list_covers_ten_exercises_from_four_files_and_every_region_is_marked():
    out = _kit("list").stdout.splitlines()
    assert len(out) == len(EXERCISES) >= 10 and len({ex.file for ex in EXERCISES}) >= 4
    assert [line.split()[0] for line in out] == NAMES
    marked = {
        name
        for f in exercises.SOURCES
        for name, _, _ in exercises.regions((ROOT / f).read_text())[0]
    }
    assert marked == set(NAMES)


@original_only
@pytest.mark.parametrize("name", NAMES + [None], ids=NAMES + ["all"])
def test_a_copy_holds_no_solution_and_fails_exactly_its_blanked_exercises(kits, name):
    folder, made = kits["made"][name]
    assert "no solution line is in the copy" in made
    # The instructor's tests write the equations out: a copy has none of them.
    assert not (folder / "tests" / "test_model.py").exists()
    kit_text = (folder / "tests" / "exercises.py").read_text()
    assert (
        exercises.INSTRUCTOR_ONLY + "begin" not in kit_text
        and "eps is added to the norm" not in kit_text
    )
    blanked = [name] if name else NAMES
    # The instructor's grade: exactly the blanked ones fail, "not written yet"; every solution
    # passes.
    verdicts = kits["verdicts"][str(folder)]
    assert list(verdicts) == NAMES
    assert sorted(n for n, line in verdicts.items() if line.startswith("FAIL")) == sorted(blanked)
    assert all("not written yet" in verdicts[n] for n in blanked)
    # The student's self-check: the same.
    check = kits["checks"][name]
    lines = check.stdout.splitlines()
    assert check.returncode == 1 and len(lines) == len(EXERCISES)
    failed = [line for line in lines if line.startswith("FAIL")]
    assert sorted(line.split()[1].rstrip(":") for line in failed) == sorted(blanked)
    assert all("not written yet" in line for line in failed)


@original_only
@pytest.mark.parametrize("name", list(CHEATS) + ["label_smoothing"])
def test_each_cheat_fails_its_own_exercise_in_one_line_and_the_others_pass(kits, name):
    verdicts = kits["verdicts"][str(kits["tmp"] / "cheats")]
    assert list(verdicts) == NAMES
    failing = sorted(n for n, line in verdicts.items() if line.startswith("FAIL"))
    # The others (pnv, smallinit, lm_segments, ...) pass.
    assert failing == sorted(list(CHEATS) + ["label_smoothing"])
    expected = CHEATS[name][1] if name in CHEATS else "fast_loss = 0 where"
    assert expected in verdicts[name], verdicts[name]


@original_only
def test_a_hint_is_shown_only_for_the_mistake_the_code_makes(kits):
    verdicts = kits["verdicts"][str(kits["tmp"] / "cheats")]
    assert "Hint: eps is added to the norm" in verdicts["scalenorm"]
    assert "Hint: sigma_B^2 is the biased variance" in verdicts["batchnorm"]
    assert "Hint: the sublayer's output goes through dropout" in verdicts["residual"]
    # Scale and dropout both ignored: no recorded mistake gives that, so no hint.
    assert "Hint" not in verdicts["attention"]
    assert verdicts["attention"].count("\n") == 0 and "(the first of" in verdicts["attention"]


@original_only
@pytest.mark.parametrize("name", list(WRONG))
def test_wrong_code_the_red_team_found_fails_its_exercise_alone(kits, name):
    ex, _, words = WRONG[name]
    verdicts = kits["verdicts"][str(kits["tmp"] / f"wrong_{name}")]
    assert [n for n, line in verdicts.items() if line.startswith("FAIL")] == [ex], verdicts
    assert words in verdicts[ex] and "\n" not in verdicts[ex], verdicts[ex]


@original_only
def test_a_correct_float64_softmax_passes(kits):
    verdicts = kits["verdicts"][str(kits["tmp"] / "float64_softmax")]
    assert all(line.startswith("PASS") for line in verdicts.values()), verdicts


@original_only
def test_a_deleted_file_or_a_missing_region_fails_its_exercises_only(kits):
    verdicts = kits["verdicts"][str(kits["tmp"] / "damaged")]
    failing = {n: line for n, line in verdicts.items() if line.startswith("FAIL")}
    assert sorted(failing) == ["lm_segments", "qk_g0", "word_dropout"]
    assert "data.py cannot be read" in failing["word_dropout"]
    assert "qk_g0's end marker has no begin marker" in failing["qk_g0"]


@original_only
def test_the_gradebook_has_one_row_per_submission_and_exercise_with_points(kits):
    graded, tmp = kits["graded"], kits["tmp"]
    assert graded.returncode == 1
    n_subs = len(NAMES) + 4 + len(WRONG)
    rows = _csv_rows(tmp / "g.csv")
    assert len(rows) == n_subs * len(NAMES) == len(json.loads((tmp / "g.json").read_text()))
    row = next(
        r for r in rows if r["submission"].endswith("cheats") and r["exercise"] == "batchnorm"
    )
    assert row["result"] == "FAIL" and float(row["points"]) == 0 and float(row["max_points"]) == 3
    assert "biased variance" in row["reason"]
    row = next(r for r in rows if r["submission"].endswith("cheats") and r["exercise"] == "pnv")
    assert row["result"] == "PASS" and float(row["points"]) == 2 and row["reason"] == ""
    assert f"{str(tmp / 'cheats')}: 5 of 17 exercises pass, 10 of 35 points" in graded.stdout
    assert "distinct codes run" in graded.stderr


@original_only
def test_grading_two_passing_submissions_exits_0_and_writes_their_rows(tmp_path):
    a, b = _solution_copy(tmp_path / "a"), _solution_copy(tmp_path / "b")
    # A kit, for --kit: the exercises it blanked.
    made = _kit("make", str(tmp_path / "kit"), "qk_g0", "invsqrt")
    assert made.returncode == 0, made.stderr
    out = _kit(
        "grade", str(a), str(b), "--kit", str(tmp_path / "kit"), "--csv", str(tmp_path / "g.csv")
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _csv_rows(tmp_path / "g.csv")
    assert [(Path(r["submission"]).name, r["exercise"], r["result"]) for r in rows] == [
        ("a", "qk_g0", "PASS"),
        ("a", "invsqrt", "PASS"),
        ("b", "qk_g0", "PASS"),
        ("b", "invsqrt", "PASS"),
    ]
    # The natural log: b fails, so the exit status is 1.
    _set_region(b, "qk_g0", "return math.log(L * L - L)")
    out = _kit(
        "grade",
        str(a),
        str(b),
        "qk_g0",
        "--points",
        "2",
        "--csv",
        str(tmp_path / "w.csv"),
        "--wide",
        "--feedback",
        str(tmp_path / "back"),
    )
    assert (
        out.returncode == 1
        and "FAIL qk_g0: values[0] = " in out.stdout
        and "Hint: log2" in out.stdout
    )
    L = exercises.by_name()["qk_g0"].inputs(exercises.Draw(exercises.GRADE_SEED, "qk_g0"))["L"]
    # The case names which L of the eight values[0] was.
    assert f"; the case: {L[0]:.6g}. Hint" in out.stdout, out.stdout
    # A row per student, a column per exercise, the total.
    wide = _csv_rows(tmp_path / "w.csv")
    assert [(Path(r["submission"]).name, r["qk_g0"], r["total"], r["max_total"]) for r in wide] == [
        ("a", "2.0", "2.0", "2.0"),
        ("b", "0.0", "0.0", "2.0"),
    ]
    # One file per student, to hand back.
    back = {f.name: f.read_text() for f in (tmp_path / "back").iterdir()}
    assert (
        sorted(back) == ["a.md", "b.md"] and "1 of 1 exercises pass: 2 of 2 points" in back["a.md"]
    )
    assert (
        "## qk_g0: FAIL" in back["b.md"]
        and "; the case: " in back["b.md"]
        and "Hint: log2" in back["b.md"]
    )
    for argv, words in (
        (
            [str(a), "--kit", str(tmp_path / "nowhere")],
            f"--kit {tmp_path / 'nowhere'}: no such folder",
        ),
        ([str(a), "--wide"], "--wide is a layout of --csv: give --csv FILE too"),
    ):
        out = _kit("grade", *argv)
        assert out.returncode != 0 and out.stderr.strip() == f"exercises.py grade: {words}", (
            out.stderr
        )


def _children(pid):
    """The pids whose parent is pid (from /proc), zombies left out."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@original_only
@pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc (Linux)"
)
def test_a_grade_killed_hard_leaves_no_grading_process_behind(tmp_path):
    """The grading processes are forked by the grade's fork server, each in a session of its own:
    when the grade is killed (SIGKILL: no handler of its own runs), the server sees its input close
    and kills the ones still running."""
    sub = _solution_copy(tmp_path / "sub")
    _set_region(sub, "qk_g0", "while True:\n    pass")
    grade = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "exercises.py"),
            "grade",
            str(sub),
            "qk_g0",
            "--timeout",
            "300",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    hanging = []
    # The server, then its child that hangs (at most a minute on a busy machine).
    for _ in range(600):
        hanging = [c for server in _children(grade.pid) for c in _children(server)]
        if hanging:
            break
        time.sleep(0.1)
    assert hanging, "no grading process was started"
    grade.kill()
    grade.wait()
    for _ in range(100):
        if not any(
            Path(f"/proc/{pid}").exists()
            and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1]
            for pid in hanging
        ):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the hanging grading process {hanging} outlived its killed grade")


@original_only
def test_an_answer_that_allocates_past_the_memory_limit_fails_that_exercise_alone(tmp_path):
    sub = _solution_copy(tmp_path / "sub")
    _set_region(
        sub,
        "qk_g0",
        "big = torch.ones(1500 << 20, dtype=torch.uint8)  # 1.5 GB\nreturn math.log2(L * L - L)",
    )
    _set_region(
        sub,
        "invsqrt",
        "big = bytearray(1500 << 20)\n"
        "return lr_scale / math.sqrt(d_model) * min(n ** -0.5, n * warmup ** -1.5)",
    )
    out = _kit("grade", str(sub), "qk_g0", "invsqrt", "length_penalty", "--memory", "1000")
    lines = {
        line.split(":")[0]: line
        for line in out.stdout.splitlines()
        if line.startswith(("PASS", "FAIL"))
    }
    limit = "past the memory limit of one exercise's process, --memory 1000 MB at "
    assert (
        out.returncode == 1
        and lines["FAIL qk_g0"].startswith("FAIL qk_g0: allocating 1,500 MB failed: ")
        and limit + "model.py:" in lines["FAIL qk_g0"]
    ), out.stdout + out.stderr
    assert (
        lines["FAIL invsqrt"].startswith("FAIL invsqrt: MemoryError")
        and limit + "train.py:" in lines["FAIL invsqrt"]
    )
    assert "PASS length_penalty" in lines  # the others are graded as ever
    out = _kit("grade", str(sub), "qk_g0", "--memory", "0")
    assert out.returncode == 2 and "--memory" in out.stderr


def test_feedback_files_are_named_by_folder_and_told_apart_by_the_folders_above():
    names = exercises.feedback_names(["x/a/ann", "y/b/ann", "y/b/bob lee"])
    assert names == {"x/a/ann": "a_ann.md", "y/b/ann": "b_ann.md", "y/b/bob lee": "b_bob_lee.md"}
    assert exercises.feedback_names(["x/ann", "x/bob"]) == {"x/ann": "ann.md", "x/bob": "bob.md"}


@original_only
def test_the_student_readme_lists_each_exercise_with_the_names_the_code_after_it_reads(kits):
    folder, _ = kits["made"]["batchnorm"]
    readme = (folder / "README.md").read_text()
    assert "### batchnorm: norms.py, `BatchNorm.forward`" in readme and "### pnv" not in readme
    for n in ("mu", "var", "y", "n"):
        assert f"{n} (a tensor)" in readme
    assert (
        "between the markers" in readme.replace("\n", " ") or "between its two comments" in readme
    )


@original_only
@pytest.mark.parametrize("damage", ["missing", "incomplete", "not plain"])
def test_the_self_check_refuses_a_bad_values_file_in_one_line(kits, tmp_path, damage):
    folder = tmp_path / "copy"
    shutil.copytree(kits["made"]["qk_g0"][0], folder)
    values = folder / "tests" / "exercise_values.pt"
    if damage == "missing":
        values.unlink()
    elif damage == "incomplete":
        stored = torch.load(values, weights_only=True)
        del stored["values"]["scalenorm"]
        torch.save(stored, values)
    else:
        torch.save({"format": exercises.FORMAT, "values": {"qk_g0": {"values": object()}}}, values)
    out = _kit("grade", cwd=folder)
    assert out.returncode == 1 and "PASS" not in out.stdout
    assert len(out.stderr.strip().splitlines()) == 1 and "exercise_values.pt" in out.stderr, (
        out.stderr
    )


@original_only
def test_the_self_check_survives_an_exit_in_the_students_code(kits, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(kits["made"]["qk_g0"][0], folder)
    _set_region(folder, "qk_g0", "import os\nos._exit(0)")
    out = _kit("grade", "qk_g0", "invsqrt", cwd=folder)
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        "FAIL qk_g0: the process ended (exit status 0) during this check: the code exits",
        "PASS invsqrt",
    ]


@original_only
def test_record_refuses_in_a_student_copy(kits):
    folder, _ = kits["made"]["qk_g0"]
    # The old test of "original" was this file's presence.
    (folder / "tests" / "test_model.py").touch()
    out = _kit("record", cwd=folder)
    assert out.returncode == 1 and "student copy" in out.stderr
    (folder / "tests" / "test_model.py").unlink()


@original_only
def test_make_into_a_path_below_a_file_is_one_line(tmp_path):
    (tmp_path / "f.md").write_text("x")
    out = _kit("make", str(tmp_path / "f.md" / "x"))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and str(tmp_path / "f.md" / "x") in out.stderr


# Instructor only: end
