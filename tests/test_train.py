"""Claims of train.py: eq. 7, the label-smoothed loss, validation decay, flags, resume, learning."""

import json
import math
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import SMALL, TINY  # a small (d 64, two layers) and a tiny configuration

import data
import decode
import norms
import train
from machinery import arguments, fileio, logbook, presets, rundir, speed, toy_corpus, train_cli
from model import ModelConfig, Transformer, label_smoothed_loss


# --- eq. 7 --------------------------------------------------------------------------------
@pytest.mark.parametrize("step", [1, 10, 399, 400, 401, 4000, 100000])
def test_invsqrt_schedule_equals_eq7(step):
    d, warmup, lam = 512, 400, 2.0
    expected = lam * d**-0.5 * min(step**-0.5, step * warmup**-1.5)  # eq. 7, written again
    assert train.inverse_sqrt_lr(step, d, warmup, lam) == pytest.approx(expected, rel=1e-12)


def test_invsqrt_peaks_at_warmup_with_the_papers_value():
    # [1] eq. 7 (and the QKNorm configs' peak): d 512, warmup 8000, lambda 1 peaks at about 4.94e-4.
    lrs = [train.inverse_sqrt_lr(n, 512, 8000, 1.0) for n in range(0, 20001, 50)]
    assert max(lrs) == pytest.approx(train.inverse_sqrt_lr(8000, 512, 8000, 1.0))
    assert train.inverse_sqrt_lr(8000, 512, 8000, 1.0) == pytest.approx(4.94e-4, rel=2e-3)
    # --lr is the peak: lambda = lr * sqrt(d * warmup)
    assert train.Schedule(
        "invsqrt", 512, 8000, 1e-3
    ).lr_scale * 512**-0.5 * 8000**-0.5 == pytest.approx(1e-3)


def schedule(*argv):
    return train.Schedule.from_args(presets.resolve_flags(list(argv))[0])


def test_valdecay_is_warmup_then_flat_and_nowarmup_is_constant():
    lr = schedule(
        "--schedule", "valdecay", "--warmup", "100", "--d-model", "256", "--lr-scale", "1"
    )
    peak = train.inverse_sqrt_lr(100, 256, 100, 1.0)
    assert lr(50) == pytest.approx(peak / 2)  # linear warmup
    assert lr(5000) == pytest.approx(peak)  # flat, no inverse sqrt
    assert lr(5000, 0.8**2) == pytest.approx(peak * 0.64)
    lr = schedule("--schedule", "nowarmup", "--lr", "3e-4")
    assert lr(1) == pytest.approx(3e-4)  # [1] 3.3
    assert lr(10**6, 0.8) == pytest.approx(2.4e-4)


def test_validation_decay_when_below_each_of_the_previous_patience():
    assert not train.validation_decay([10, 11, 12], 3)  # too few evaluations
    assert train.validation_decay([10, 11, 12, 9], 3)  # below all three
    assert not train.validation_decay([10, 11, 12, 10.5], 3)  # not below 10
    assert not train.validation_decay([10, 11, 12, 13], 3)


# --- the loss -------------------------------------------------------------------------------
def test_label_smoothed_loss_equals_smoothing_over_the_allowed_words():
    torch.manual_seed(0)
    N, V = 7, 11
    allowed = torch.ones(V, dtype=torch.bool)
    allowed[[0, 2, 5]] = False
    logits = torch.randn(N, V, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    target = torch.tensor([1, 3, 4, 6, 7, 8, 10])
    eps = 0.1
    loss, nll = label_smoothed_loss(logits, target, eps, allowed=allowed)
    # Reference: cross entropy against q = (1-eps) onehot + eps/|A| on the allowed words A,
    # computed on the allowed columns only (where it is plain torch cross entropy).
    cols = allowed.nonzero().squeeze(1)
    sub_target = torch.searchsorted(cols, target)
    ref = F.cross_entropy(logits[:, cols], sub_target, label_smoothing=eps, reduction="sum")
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10)
    assert nll.item() == pytest.approx(
        F.cross_entropy(logits[:, cols], sub_target, reduction="sum").item()
    )


def test_one_training_step_under_reference_equals_the_fast_step():
    """--reference runs every equation as written (no fast path): one train_step from the same
    state gives the same loss and the same parameters as the fast step. Dropout and word dropout
    are off here: the fast dropout draws other random numbers (its distribution is tested in
    test_model.py); SDPA is off: its CPU kernel is not float64-exact (see test_model.py)."""
    batches = [
        data.collate(
            [([5, 6, 7, 3], [8, 9]), ([10, 11], [12, 13, 14, 3]), ([4, 9, 9], [5])], [0, 1, 2]
        )
    ]
    mask = torch.zeros(40, dtype=torch.bool)
    mask[[1, 3, 5, 8, 9, 12, 13, 14]] = True
    results = []
    for reference in (False, True):
        torch.manual_seed(0)
        cfg = ModelConfig(
            vocab_size=40,
            d_model=16,
            heads=2,
            ff=32,
            enc_layers=2,
            dec_layers=1,
            dropout=0.0,
            norm="layer",
            sdpa=False,
        )
        m = Transformer(cfg, mask).double()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        norms.use_reference(reference)
        try:
            out = train.train_step(m, opt, batches, 1e-2, train.StepOptions(0.0, 0.1, 1.0))
        finally:
            norms.use_reference(False)
        results.append((out, m.state_dict()))
    (fast, fast_state), (ref, ref_state) = results
    torch.testing.assert_close(fast[:3], ref[:3], rtol=1e-10, atol=1e-12)
    assert fast[3] == ref[3] == 10
    for k in fast_state:
        torch.testing.assert_close(fast_state[k], ref_state[k], rtol=1e-9, atol=1e-12)


def test_batch_flops_counts_the_matmuls():
    from model import ModelConfig

    cfg = ModelConfig(vocab_size=100, d_model=8, heads=2, ff=32, enc_layers=1, dec_layers=1)
    B, S, T = 2, 3, 4
    D, FF, V = 8, 32, 100
    # its shapes are what counts
    batch = data.Batch(torch.zeros(B, S), torch.zeros(B, T), torch.zeros(B, T), B * T)
    enc = S * (4 * D * D + 2 * D * FF) + 2 * S * S * D
    dec = T * (6 * D * D + 2 * D * FF) + S * 2 * D * D + 2 * T * T * D + 2 * T * S * D
    assert speed.batch_flops(cfg, batch) == 6 * B * (enc + dec + T * D * V)
    assert speed.batch_flops(cfg, batch, out_vocab=30) == 6 * B * (enc + dec + T * D * 30)


# --- bad flags ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--d-model", "30", "--heads", "4"], "--d-model"),
        (["--batch-tokens", "0"], "--batch-tokens"),
        (["--dropout", "1.5"], "--dropout"),
        (["--data", "somewhere"], "--data"),
        (["--src", "en"], "--src"),
        (["--qk-length", "1"], "--qk-length"),
    ],
)
def test_bad_flags_give_a_one_line_error_naming_the_flag(argv, flag, tmp_path):
    with pytest.raises(SystemExit) as e:
        train_cli.main(argv + ["--out", str(tmp_path / "run")])
    msg = str(e.value.code)
    assert flag in msg and "\n" not in msg


def test_missing_corpus_file_is_a_one_line_error(tmp_path):
    (tmp_path / "train.en").write_text("a b\n")
    with pytest.raises(SystemExit) as e:
        train_cli.main(
            ["--data", str(tmp_path), "--src", "en", "--tgt", "de", "--out", str(tmp_path / "run")]
        )
    msg = str(e.value.code)
    assert "train.de" in msg and "\n" not in msg


# --- resume: a killed run continues exactly ------------------------------------------------
def _records(run_dir, windows=False):
    """Every step's (loss, gnorm) and every evaluation's dev BLEU in metrics.jsonl; windows: the log
    lines' training loss too (a window cut by a kill mid-step averages fewer steps; one cut by a
    saved stop does not)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], round(r["loss"], 6), round(r["gnorm"], 5)) for r in rows if "gnorm" in r]
    bleus = [(r["step"], r["dev_bleu"]) for r in rows if "dev_bleu" in r]
    return (
        steps,
        bleus,
        [(r["step"], round(r["train_loss"], 6)) for r in rows if "train_loss" in r and windows],
    )


def test_a_run_killed_mid_epoch_resumes_to_the_same_metrics(tmp_path, killed_run, small_corpus):
    argv = (
        SMALL
        + small_corpus
        + [
            "--max-steps",
            "24",
            "--epoch-size",
            "8",
            "--warmup",
            "10",
            "--seed",
            "3",
            "--pn-warmup",
            "5",
            "--norm",
            "layer",
            "--encoder-norm",
            "power",
        ]
    )
    whole = tmp_path / "whole"
    train_cli.main(argv + ["--out", str(whole)])

    # The same run, killed (Ctrl-C) in the middle of its third epoch, then resumed.
    killed = tmp_path / "killed"
    killed_run(argv + ["--out", str(killed)], 20)
    assert json.loads((killed / "config.json").read_text())["max_steps"] == 24
    train_cli.main(["--resume", str(killed)])

    assert _records(killed) == _records(whole)
    a = json.loads((whole / "results.json").read_text())
    b = json.loads((killed / "results.json").read_text())
    assert a["best_dev_bleu"] == b["best_dev_bleu"] and a["test_bleu"] == b["test_bleu"]


def test_an_edit_to_a_main_text_function_a_fast_path_replaces_is_named_and_runs_under_reference(
    tmp_path, corpus
):
    """A student edits model.attention_math in a copy: the run's first screen names it among the
    fast paths (which run instead, so the run is unchanged), and with --reference the edited
    function is what runs."""
    root = Path(__file__).resolve().parent.parent
    for name in ("norms.py", "model.py", "data.py", "decode.py", "train.py"):
        shutil.copyfile(root / name, tmp_path / name)
    shutil.copytree(root / "machinery", tmp_path / "machinery")  # the programs' command lines
    text = (tmp_path / "model.py").read_text()
    head = "def attention_math(q, k, v, key_mask=None, causal=False, scale=None, dropout_p=0.0):\n"
    assert head in text
    (tmp_path / "model.py").write_text(
        text.replace(head, head + '    raise RuntimeError("the edited attention")\n')
    )
    argv = [
        sys.executable,
        "train.py",
        *TINY,
        *corpus,
        "--benchmark",
        "1",
        "--out",
        str(tmp_path / "run"),
    ]
    fast = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (
        fast.returncode == 0
        and "model.attention_math -> F.scaled_dot_product_attention" in fast.stdout
    ), fast.stderr
    assert "an edit to one of these functions runs only with --reference" in fast.stdout
    written = subprocess.run(
        argv + ["--reference"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert written.returncode != 0 and "the edited attention" in written.stderr
    assert "fast paths" not in written.stdout


def test_sigterm_at_any_step_saves_that_step_and_the_resume_reaches_the_same_metrics(
    tmp_path, killed_run, corpus, capsys
):
    """SIGTERM mid-epoch and mid-log-window, with --accumulate 2: the run stops after the step in
    progress with a checkpoint of it (not of the epoch before), and the resumed run's every record
    equals the run never stopped. train.log holds every line both starts printed, each
    timestamped."""
    argv = (
        TINY
        + corpus
        + [
            "--max-steps",
            "14",
            "--log-interval",
            "3",
            "--accumulate",
            "2",
            "--seed",
            "5",
            # evaluations at 5, 10, 14; log lines every 3
            "--norm",
            "power",
            "--pn-warmup",
            "4",
        ]
    )
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    train_cli.main(argv + ["--out", str(whole)])
    msg = killed_run(argv + ["--out", str(stopped)], 8, signal.SIGTERM)
    assert msg == f"interrupted: continue with python train.py --resume {stopped}", msg
    assert rundir.read_checkpoint(stopped / "checkpoint_last.pt")["train_state"]["step"] == 8
    train_cli.main(["--resume", str(stopped)])
    assert _records(stopped, windows=True) == _records(whole, windows=True)
    a, b = (json.loads((d / "results.json").read_text()) for d in (whole, stopped))
    assert a["best_dev_bleu"] == b["best_dev_bleu"] and a["test_bleu"] == b["test_bleu"]
    printed, log = capsys.readouterr().out.splitlines(), (stopped / "train.log").read_text()
    stamped = [
        line[20:] for line in log.splitlines() if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", line)
    ]
    assert [line[:6] for line in stamped].count(
        "model:"
    ) == 2 and "SIGTERM: stopping after this step" in log
    # the g table too
    assert stamped[-1].startswith("test (best checkpoint") and all(
        line in log for line in printed
    ), log


def test_a_hard_kill_loses_at_most_save_interval_steps(tmp_path, killed_run, corpus):
    """A kill inside a step (a second Ctrl-C; SIGKILL writes nothing at all) resumes from the last
    checkpoint, which --save-interval 3 wrote at step 6, between evaluations; the resumed run equals
    the run never killed."""
    argv = (
        TINY
        + corpus
        + ["--max-steps", "12", "--epoch-size", "12", "--save-interval", "3", "--seed", "6"]
    )
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train_cli.main(argv + ["--out", str(whole)])
    killed_run(argv + ["--out", str(killed)], 8)
    assert rundir.read_checkpoint(killed / "checkpoint_last.pt")["train_state"]["step"] == 6
    # no evaluation yet: the interval writes the last alone
    assert not (killed / "checkpoint_best.pt").exists()
    train_cli.main(["--resume", str(killed)])
    assert _records(killed) == _records(whole)


def test_one_command_starts_continues_and_finishes_a_run(tmp_path, killed_run, corpus, capsys):
    """--start-or-resume: the same command run three times, stopped in between, reaches the same
    metrics as one run; it refuses a flag that differs from the run's (given or not) and a folder
    that holds another run."""
    argv = TINY + corpus + ["--max-steps", "12", "--seed", "7", "--start-or-resume"]
    whole, run = tmp_path / "whole", tmp_path / "run"
    train_cli.main(argv + ["--out", str(whole)])
    # the first start, stopped after step 4
    killed_run(argv + ["--out", str(run)], 4, signal.SIGTERM)
    # continued from 4, stopped after step 8
    killed_run(argv + ["--out", str(run)], 4, signal.SIGINT)
    assert rundir.read_checkpoint(run / "checkpoint_last.pt")["train_state"]["step"] == 8
    train_cli.main(argv + ["--out", str(run)])  # continued to the end
    assert _records(run, windows=True) == _records(whole, windows=True)
    assert "resume: " in capsys.readouterr().out
    for flags, words in (
        (argv[:-1] + ["--seed", "8", "--start-or-resume"], "--seed (7 -> 8)"),
        # not given: its default
        ([a for a in argv if a not in ("--seed", "7")], "--seed (7 -> 1)"),
        (argv + ["--overwrite"], "--overwrite: not allowed with argument --start-or-resume"),
    ):
        with pytest.raises(SystemExit) as e:
            train_cli.main(flags + ["--out", str(run)])
        assert words in str(e.value.code), e.value.code
    # another run's folder, killed before its first checkpoint: never replaced
    other = tmp_path / "other"
    killed_run(TINY + corpus + ["--max-steps", "12", "--seed", "9", "--out", str(other)], 2)
    with pytest.raises(SystemExit) as e:
        train_cli.main(argv + ["--out", str(other)])
    assert "holds a run with other flags: --seed (9 -> 7)" in str(e.value.code), e.value.code
    # now a run of these flags, killed likewise:
    killed_run(argv[:-1] + ["--out", str(other), "--overwrite"], 2)
    assert not rundir.checkpoints(other)  # --start-or-resume starts it again, from nothing
    train_cli.main(argv + ["--out", str(other)])
    assert _records(other) == _records(whole)


def test_tensorboard_events_hold_the_records_of_metrics_jsonl(tmp_path, corpus, monkeypatch):
    """--tensorboard: the run directory's event files, read back with tensorboard's own reader, hold
    the numbers of metrics.jsonl under the same names (the steps' loss, LR and gradient norm, the
    log lines', dev BLEU, the learned g's); without the package the flag is refused in one line that
    names the install command, before any file."""
    argv = (
        TINY
        + corpus
        + ["--max-steps", "6", "--epoch-size", "3", "--log-interval", "2", "--tensorboard"]
    )
    # as if not installed
    monkeypatch.setattr(train_cli.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(SystemExit) as e:
        train_cli.main(argv + ["--out", str(tmp_path / "none")])
    assert (
        "pip install matplotlib tensorboard" in str(e.value.code)
        and not (tmp_path / "none").exists()
    )
    monkeypatch.undo()
    pytest.importorskip(
        "tensorboard", reason="an optional extra (pip install matplotlib tensorboard); CI has it"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_cli.main(argv + ["--out", str(tmp_path / "run")])
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    for tag in (
        "loss",
        "lr",
        "gnorm",
        "train_loss",
        "tok_per_s",
        "dev_bleu",
        "dev_ppl",
        "g/enc_final_norm.g",
    ):
        key, *inner = tag.split("/")
        want = [
            (r["step"], r[key][inner[0]] if inner else r[key])
            for r in rows
            if key in r and "step" in r
        ]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert len(want) > 1 and [s for s, _ in got] == [s for s, _ in want], tag
        assert all(
            math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(got, want, strict=True)
        ), tag


# --- every norm, placement and QKNorm trains a few steps on the built-in corpus -------------
@pytest.mark.parametrize(
    "extra",
    [
        ["--norm", "layer", "--postnorm", "--no-fixnorm", "--init", "xavier"],
        ["--norm", "scale"],
        ["--norm", "scale_fixed"],
        ["--norm", "rms"],
        ["--norm", "batch"],
        ["--norm", "pnv"],
        ["--norm", "power", "--pn-variant", "code"],
        ["--norm", "layer", "--encoder-norm", "power"],
        ["--norm", "scale", "--decoder-norm", "rms"],
        ["--norm", "layer", "--qknorm"],
        ["--norm", "scale", "--qknorm", "--qk-no-g"],
        ["--norm", "power", "--qknorm", "--qk-norm-v"],
        ["--norm", "batch", "--qknorm", "--postnorm"],
        ["--norm", "rms", "--qknorm", "--qk-length", "72"],
    ],
)
def test_every_norm_and_placement_trains_with_finite_loss(extra, tmp_path, small_corpus):
    run = tmp_path / "run"
    # 3 + 2 steps
    result = train_cli.main(SMALL + small_corpus + extra + ["--benchmark", "2", "--out", str(run)])
    # --benchmark trains real steps (and writes no run directory); the model took the flags.
    assert result["model_config"]["norm"] == extra[1] and all(
        math.isfinite(loss) for loss in result["losses"]
    )
    assert not run.exists()


def test_a_stale_bpe_model_of_another_size_is_not_reused(tmp_path, small_corpus):
    """A run directory keeps its bpe.model and caches (keyed by their content); a new run with
    another --bpe-size there (--overwrite) trains a new BPE instead of reusing the stale one."""
    import sentencepiece as spm

    run = tmp_path / "run"
    base = (
        SMALL[: SMALL.index("--bpe-size")] + small_corpus + ["--max-steps", "1", "--out", str(run)]
    )
    train_cli.main(base + ["--bpe-size", "300"])
    assert spm.SentencePieceProcessor(model_file=str(run / "bpe.model")).get_piece_size() == 300
    for f in run.iterdir():
        if not f.name.startswith(("bpe.", "train.enc", "dev.enc", "config.json")):
            # the run's own config.json (a folder with run files and none is refused), BPE and
            # caches
            f.unlink()
    train_cli.main(base + ["--bpe-size", "400", "--overwrite"])
    assert spm.SentencePieceProcessor(model_file=str(run / "bpe.model")).get_piece_size() == 400


def test_short_runs_log_finite_losses_and_decreasing_loss(tmp_path, small_corpus):
    run = tmp_path / "run"
    train_cli.main(
        SMALL
        + small_corpus
        + [
            "--max-steps",
            "30",
            "--epoch-size",
            "30",
            "--warmup",
            "10",
            "--norm",
            "power",
            "--qknorm",
            "--pn-warmup",
            "10",
            "--out",
            str(run),
        ]
    )
    steps, bleus, _ = _records(run)
    losses = [loss for _, loss, _ in steps]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) < sum(losses[:5])
    g = json.loads((run / "g_values.json").read_text())
    assert any(r["kind"] == "QKNorm" for r in g)


# --- a short run on the built-in language pair learns ---------------------------------------
def test_a_short_training_run_raises_dev_bleu_well_above_its_start(tmp_path):
    d = tmp_path / "toy"
    toy_corpus.make_toy_corpus(d, seed=1, n_train=5000, n_dev=100, n_test=50)
    run = tmp_path / "run"
    result = train_cli.main(
        [
            "--data",
            str(d),
            "--src",
            "src",
            "--tgt",
            "tgt",
            "--d-model",
            "64",
            "--ff",
            "256",
            "--layers",
            "2",
            "--heads",
            "4",
            "--batch-tokens",
            "1024",
            "--threads",
            "1",
            "--bpe-size",
            "1000",
            "--max-steps",
            "240",
            "--epoch-size",
            "60",
            "--warmup",
            "60",
            "--lr",
            "3e-3",
            "--out",
            str(run),
            "--log-interval",
            "60",
        ]
    )
    _, bleus, _ = _records(run)
    first, last = bleus[0][1], bleus[-1][1]
    assert last > 10 and last > first + 8, bleus  # measured: 0.4 -> 23 at 240 steps
    assert result["test_bleu"] > 8
    assert (run / "checkpoint_best.pt").exists() and (run / "test.hyp").exists()


# --- faithfulness: the schedules and PowerNorm's warmup as the papers define them ----------
def _lr_by_step(run_dir):
    return {
        r["step"]: r["lr"]
        for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
        if "gnorm" in r
    }


def test_validation_decay_never_fires_inside_the_warmup(tmp_path, monkeypatch, small_corpus):
    """[1] 2.4: VALDECAY is a linear warmup, *then* x alpha_decay when dev BLEU falls (Code:
    eval_and_decay skips annealing during warmup). Dev BLEU is driven down at every evaluation,
    inside the warmup too: the LR stays on eq. 7's warmup line until n_warmup, and only then
    decays."""
    bleus = iter(range(100, 0, -1))  # strictly falling: every evaluation after the first is worse
    real_bleu = train.decode.bleu

    def falling(hyps, refs, lowercase=False):  # SacreBLEU's score object, its score replaced
        score = real_bleu(hyps, refs, lowercase)
        score.score = float(next(bleus))
        return score

    monkeypatch.setattr(train.decode, "bleu", falling)
    run = tmp_path / "run"
    warmup, epoch = 30, 5
    train_cli.main(
        SMALL
        + small_corpus
        + [
            "--schedule",
            "valdecay",
            "--warmup",
            str(warmup),
            "--lr",
            "1e-3",
            "--epoch-size",
            str(epoch),
            "--max-steps",
            "50",
            "--patience",
            "1",
            "--early-stop",
            "0",
            "--max-epochs",
            "100",
            "--out",
            str(run),
        ]
    )
    lr = _lr_by_step(run)
    peak = 1e-3
    # eq. 7's linear warmup, undecayed, although BLEU fell 5 times
    for step in range(1, warmup + 1):
        assert lr[step] == pytest.approx(peak * step / warmup, rel=1e-9), step
    # the evaluation at step n_warmup (the peak: the warmup is over) decays, and each one after it
    assert lr[warmup + 1] == pytest.approx(peak * 0.8, rel=1e-9)
    assert lr[warmup + epoch + 1] == pytest.approx(peak * 0.8**2, rel=1e-9)
    assert lr[50] == pytest.approx(peak * 0.8**4, rel=1e-9)


def test_results_json_holds_the_test_scores_decode_json_writes(tmp_path, small_corpus):
    """results.json keeps test_bleu and test_signature, and adds test_chrf with its signature:
    decode.scores' numbers (decode.py --json's) for test.hyp, which are SacreBLEU's CLI's
    (tests/test_evaluation.py)."""
    run = tmp_path / "run"
    train_cli.main(SMALL + small_corpus + ["--max-steps", "4", "--out", str(run)])
    result = json.loads((run / "results.json").read_text())
    hyps = (run / "test.hyp").read_text().split("\n")[:-1]
    s = decode.scores(hyps, (Path(small_corpus[1]) / "test.tgt").read_text().split("\n")[:-1])
    assert (
        result["test_bleu"],
        result["test_signature"],
        result["test_chrf"],
        result["test_chrf_signature"],
    ) == (s["bleu"]["score"], s["bleu"]["signature"], s["chrf"]["score"], s["chrf"]["signature"])
    assert "tok:13a|smooth:exp" in result["test_signature"] and result[
        "test_chrf_signature"
    ].startswith("nrefs:1|")
    log = (run / "train.log").read_text()
    assert "test (best checkpoint, step " in log and decode.score_report(s) in log


def test_powernorm_warmup_follows_the_lr_warmup_unless_given():
    """[2] appendix A: "we set it identical to the warmup steps for the learning rate schedule"."""
    args, _ = presets.resolve_flags(["--norm", "power", "--warmup", "200"])
    assert args.pn_warmup == 200
    args, _ = presets.resolve_flags(["--norm", "power", "--warmup", "200", "--pn-warmup", "50"])
    assert args.pn_warmup == 50
    cfg = train.model_config_from_args(
        presets.resolve_flags(["--norm", "power", "--warmup", "300"])[0], 40
    )
    assert Transformer(cfg).encoder[0].norm_attn.warmup == 300
    # The warmup is the LR's, in updates: with --accumulate 4 an update is 4 forwards, which the
    # module counts
    cfg = train.model_config_from_args(
        presets.resolve_flags(["--norm", "power", "--warmup", "300", "--accumulate", "4"])[0], 40
    )
    assert Transformer(cfg).encoder[0].norm_attn.warmup == 1200


def test_a_new_schedule_is_a_function_and_one_entry_of_schedules(monkeypatch):
    """As a norm is one NORMS entry: --schedule takes the new name, --help says it, the LR is its
    function's, and the flags it does not read (its entry: no warmup, no validation decay) are
    refused in one line."""
    halving = train.ScheduleEntry(
        lambda s, n, decay: s.peak / 2 ** (n // 100), False, False, "halves every 100 steps"
    )
    monkeypatch.setitem(train.SCHEDULES, "halving", halving)
    args, _ = presets.resolve_flags(["--schedule", "halving", "--lr", "0.01"])
    lr = train.Schedule.from_args(args)
    assert (lr.warmup, lr.decays, lr(1), lr(250), args.pn_warmup) == (0, False, 0.01, 0.0025, 0)
    assert "halving: halves every 100 steps" in " ".join(
        arguments.build_parser().format_help().split()
    )
    for flag, words in (
        (["--warmup", "10"], "--schedule halving does not have"),
        (["--patience", "3"], "not --schedule halving"),
    ):
        with pytest.raises(SystemExit, match=words):
            train_cli.check_flags(*presets.resolve_flags(["--schedule", "halving", *flag]))
    assert "halving" not in str(
        pytest.raises(
            SystemExit,
            train_cli.check_flags,
            *presets.resolve_flags(["--schedule", "invsqrt", "--patience", "3"]),
        ).value
    )


def test_lr_scale_sets_the_constant_lr_of_nowarmup():
    """--lr-scale (lambda of eq. 7) overrides --lr under every schedule: under NOWARMUP the constant
    LR is eq. 7's peak lambda / sqrt(d * n_warmup), so 2xLR doubles it (it was silently ignored)."""
    lr1 = schedule(
        "--schedule", "nowarmup", "--lr-scale", "1", "--d-model", "512", "--warmup", "8000"
    )
    lr2 = schedule(
        "--schedule", "nowarmup", "--lr-scale", "2", "--d-model", "512", "--warmup", "8000"
    )
    assert lr1(1) == lr1(10**5) == pytest.approx(1 / math.sqrt(512 * 8000))
    assert lr2(1) == pytest.approx(2 * lr1(1))


def test_a_flag_that_changes_another_is_said_on_the_first_screen(capsys):
    """--lr over a preset's --lr-scale, --warmup as the divisor of nowarmup's constant LR,
    --compile's padding and lost diagnostics: each is a note before anything runs (here --show), and
    a plain preset has none."""
    for argv, said in (
        (
            ["--preset", "twt4-invsqrt", "--lr", "1e-3"],
            "the peak LR, which --lr-scale 1.0 would set: not used",
        ),
        (
            ["--schedule", "nowarmup", "--lr-scale", "1", "--warmup", "100"],
            "--warmup 100 only divides --lr-scale, a constant LR of 0.00884",
        ),
        (["--compile", "--norm", "power"], "multiples of 8 (a change to --pn-variant code's"),
        (["--compile", "--encoder-norm", "batch"], "no batch-norm diagnostics of --norm batch"),
    ):
        train_cli.main(argv + ["--show"])
        assert said in capsys.readouterr().out, argv
    train_cli.main(["--preset", "twt4-invsqrt", "--show"])
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize("norm", ["scale", "layer", "batch"])
def test_accumulated_micro_batches_equal_one_big_batch_for_per_token_norms(norm):
    """--accumulate N: N micro-batches per update, the loss divided by all their target tokens. With
    a per-token norm the update equals one batch holding them all (float64); a batch norm computes
    its statistics per micro-batch ([2] Figure 5's setting), so there the update differs."""
    pairs = [
        ([5, 6, 7, 3], [8, 9]),
        ([10, 11], [12, 13, 14, 3]),
        ([4, 9, 9, 30], [5, 3, 7]),
        ([20, 21, 22], [23]),
        ([24, 25], [26, 27, 28, 29, 31]),
        ([32, 33, 34, 35, 36], [37, 38]),
    ]
    results = []
    for split in ([[0, 1, 2, 3, 4, 5]], [[0, 1], [2, 3, 4], [5]]):  # one batch, or 3 micro-batches
        torch.manual_seed(0)
        cfg = ModelConfig(
            vocab_size=40,
            d_model=16,
            heads=2,
            ff=32,
            enc_layers=2,
            dec_layers=2,
            dropout=0.0,
            norm=norm,
            sdpa=False,
        )
        m = Transformer(cfg).double()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        batches = [data.collate(pairs, idx) for idx in split]
        out = train.train_step(m, opt, batches, 1e-2, train.StepOptions(0.0, 0.1, 0.5))
        results.append((out, m.state_dict()))
    (big, big_state), (micro, micro_state) = results
    assert big[3] == micro[3] == 23  # target tokens of the whole update, EOS included
    same = all(
        torch.allclose(big_state[k], micro_state[k], rtol=1e-9, atol=1e-12)
        for k in big_state
        if big_state[k].is_floating_point()
    )
    if norm == "batch":
        assert not same  # the statistics came from each micro-batch
    else:
        # loss, NLL, gradient norm
        torch.testing.assert_close(big[:3], micro[:3], rtol=1e-10, atol=1e-12)
        assert same


def test_qknorm_L_is_measured_before_the_max_len_filter(tmp_path, small_corpus, capsys):
    """[3] section 3: L over "all training data sequences": the 100th percentile is the longest
    training sequence, not the longest one --max-len kept."""
    run = tmp_path / "run"
    capsys.readouterr()
    train_cli.main(
        SMALL
        + small_corpus
        + [
            "--qknorm",
            "--qk-percentile",
            "100",
            "--max-len",
            "6",
            "--max-steps",
            "1",
            "--out",
            str(run),
        ]
    )
    out = capsys.readouterr().out
    tok = data.Tokenizer((run / "bpe.model").read_bytes())
    pairs, _ = data.read_parallel(*fileio.corpus_paths(small_corpus[1], "src", "tgt")["train"])
    longest = max(len(ids) for s, t in pairs for ids in tok.encode([s, t]))
    assert longest > 6 and f"qknorm: L = {longest:.2f} (100.0th percentile" in out
    assert "before the --max-len filter" in out


def test_mfu_takes_the_larger_matmul_probe_after_each_evaluation(
    tmp_path, small_corpus, monkeypatch
):
    """A probe taken while another process was busy reads the machine's matmul speed low, and MFU
    above 100%: it is taken again after each evaluation and the larger kept."""
    probes = iter([1e6, 1e12, 1e9, 1e9])  # the start, then after each evaluation
    monkeypatch.setattr(logbook, "matmul_flops", lambda *a, **k: next(probes))
    run = tmp_path / "run"
    train_cli.main(
        SMALL
        + small_corpus
        + ["--max-steps", "20", "--epoch-size", "10", "--log-interval", "10", "--out", str(run)]
    )
    mfu = [
        r["mfu"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "mfu" in r
    ]
    assert len(mfu) == 2 and mfu[0] > 1000 * mfu[1]  # 1e6 before the first evaluation, then 1e12
