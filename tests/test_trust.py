"""Trust: checkpoints that run no code, run directories that never lose or mix work, failures
that say so in one line, before any training, and exit non-zero.

Every test is one claim, on tiny models (a few seconds each): the built-in language pair, 300
sentence pairs, d 32, one layer, 5 steps an epoch.
"""

import argparse
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import TINY

import data
import decode
import train
from machinery import arguments, decode_cli, fileio, logbook, presets, rundir, toy_corpus, train_cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
    """A finished run of 3 epochs (15 steps): config, metrics, 3 epoch checkpoints, best, last,
    results."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train_cli.main(TINY + corpus + ["--max-steps", "15", "--out", str(run)])
    return run


def copy_run(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def snapshot(d):
    """{relative path: sha256} of every file under d: any change, deletion or new file shows."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def one_line_error(call, *names):
    """call() must exit non-zero with one line naming each of names; returns the line."""
    with pytest.raises(SystemExit) as e:
        call()
    msg = str(e.value.code)
    assert e.value.code not in (0, None) and "\n" not in msg, msg
    for name in names:
        assert str(name) in msg, msg
    return msg


class Payload:
    """Unpickled, this would create a file: what a malicious checkpoint carries."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# --- 1. an untrusted checkpoint runs no code ----------------------------------------------
def test_an_untrusted_checkpoint_runs_no_code_in_decode(finished, tmp_path):
    ckpt = torch.load(finished / "checkpoint_best.pt", weights_only=True)
    marker = tmp_path / "pwned"
    torch.save(dict(ckpt, extra=Payload(marker)), tmp_path / "evil.pt")
    (tmp_path / "in.txt").write_text("the dog sees a cat .\n")
    msg = one_line_error(
        lambda: decode_cli.main([str(tmp_path / "evil.pt"), "--input", str(tmp_path / "in.txt")]),
        "evil.pt",
        "refused",
    )
    assert "could run code" in msg and not marker.exists()


def test_an_untrusted_checkpoint_runs_no_code_on_resume(finished, tmp_path, corpus):
    run = copy_run(finished, tmp_path)
    marker = tmp_path / "pwned"
    good = torch.load(run / "checkpoint_last.pt", weights_only=True)
    for f in run.glob("checkpoint_*.pt"):
        torch.save(dict(good, extra=Payload(marker)), f)  # every checkpoint poisoned
    one_line_error(
        lambda: train_cli.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"]),
        "checkpoint_last.pt: refused",
        "could run code",
    )
    assert not marker.exists()


# --- 2. a new run never changes an existing run directory ----------------------------------
def test_a_new_run_never_changes_an_existing_run_directory(finished, tmp_path, corpus):
    run = copy_run(finished, tmp_path)
    before = snapshot(run)
    # a bad corpus: reported before anything in the run directory is touched (metrics.jsonl was
    # deleted)
    one_line_error(
        lambda: train_cli.main(
            TINY
            + ["--data", str(tmp_path / "nowhere"), "--src", "x", "--tgt", "y", "--out", str(run)]
        ),
        "nowhere",
    )
    # a new configuration into it: refused, with the two ways out
    one_line_error(
        lambda: train_cli.main(TINY + corpus + ["--layers", "2", "--out", str(run)]),
        "already holds a run",
        "--resume",
        "--overwrite",
    )
    # --benchmark never writes into a run directory (it wiped the quick start's files)
    result = train_cli.main(TINY + corpus + ["--benchmark", "1", "--out", str(run)])
    assert result["steps"] == 1
    assert snapshot(run) == before


def test_overwrite_replaces_the_run_and_average_stays_within_one_run(finished, tmp_path, corpus):
    run = copy_run(finished, tmp_path)
    old_id = json.loads((run / "config.json").read_text())["run_id"]
    stale = tmp_path / "checkpoint_epoch3.pt"
    shutil.copy(run / "checkpoint_epoch3.pt", stale)
    train_cli.main(
        TINY + corpus + ["--max-steps", "10", "--seed", "2", "--overwrite", "--out", str(run)]
    )
    config = json.loads((run / "config.json").read_text())
    assert config["run_id"] != old_id and config["seed"] == 2
    assert [p.name for p in rundir.checkpoints(run, "average")] == [
        "checkpoint_epoch1.pt",
        "checkpoint_epoch2.pt",
    ]
    assert all(
        json.loads(line)["step"] <= 10
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if "step" in json.loads(line)
    )
    decode.load_checkpoint(run, average=2)  # the new run's two epochs average
    # an epoch checkpoint of the old run, left behind
    shutil.copy(stale, run / "checkpoint_epoch3.pt")
    with pytest.raises(fileio.DataError, match="another run"):
        decode.load_checkpoint(run, average=3)


def test_a_second_process_on_a_directory_in_use_is_refused(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    with open(run / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's lock (flock is per open file)
        before = snapshot(run)
        one_line_error(
            lambda: train_cli.main(
                ["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"]
            ),
            "in use by another process",
        )
        assert snapshot(run) == before


def test_temporary_files_have_unique_names_and_a_kill_mid_write_keeps_the_old_file(
    tmp_path, monkeypatch
):
    target = tmp_path / "checkpoint_last.pt"
    fileio.atomic_write(target, {"step": 1})
    names, real_replace = [], os.replace
    monkeypatch.setattr(
        os, "replace", lambda a, b: (names.append(Path(a).name), real_replace(a, b))
    )
    fileio.atomic_write(target, {"step": 2})
    fileio.atomic_write(target, {"step": 3})
    assert len(set(names)) == 2 and all(n.endswith(".tmp") for n in names)  # no shared .tmp name
    monkeypatch.setattr(os, "replace", real_replace)

    def killed_save(obj, f):  # half a file written, then the process is interrupted
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_save)
    with pytest.raises(KeyboardInterrupt):
        fileio.atomic_write(target, {"step": 4})
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"step": 3}  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_last.pt"]  # no temporary left


# --- 3. resume is honest --------------------------------------------------------------------
def test_resume_applies_the_flags_that_may_change_and_refuses_the_others(
    finished, tmp_path, capsys
):
    run = copy_run(finished, tmp_path)
    msg = one_line_error(
        lambda: train_cli.main(
            ["--resume", str(run), "--max-steps", "25", "--d-model", "64", "--lr", "0.1"]
        ),
        "--d-model (32 -> 64)",
        "--lr (0.002 -> 0.1)",
    )
    assert "--max-steps" not in msg
    capsys.readouterr()
    train_cli.main(["--resume", str(run), "--max-steps", "25", "--max-epochs", "10"])
    out = capsys.readouterr().out
    assert "resume: --max-steps 25 (changed on resume)" in out and "step     25" in out
    config = json.loads((run / "config.json").read_text())
    assert config["max_steps"] == 25 and config["changed_on_resume"] == {
        "max_steps": 25,
        "max_epochs": 10,
    }


def test_resume_says_what_it_cannot_honour(finished, tmp_path, corpus):
    run = copy_run(finished, tmp_path)
    for f in run.glob("checkpoint_*.pt"):
        f.unlink()  # a config.json but no checkpoint (the run died before its first evaluation)
    one_line_error(
        lambda: train_cli.main(["--resume", str(run)]), "nothing to resume", "--overwrite"
    )
    one_line_error(
        lambda: train_cli.main(["--resume", str(tmp_path / "none")]), "nothing to resume"
    )
    # an edited corpus under the same run (its new place given with --data): refused, naming the
    # split
    run = copy_run(finished, tmp_path / "e")
    toy = tmp_path / "toy"
    shutil.copytree(corpus[1], toy)
    (toy / "train.tgt").write_text((toy / "train.tgt").read_text().replace(" .", " !", 1))
    one_line_error(
        lambda: train_cli.main(["--resume", str(run), "--data", str(toy)]),
        "the corpus changed",
        "train",
    )
    # A run of a train.py from before the checkpoint was the resume record: refused in one line,
    # nothing changed
    for f in run.glob("checkpoint_*.pt"):
        torch.save({k: v for k, v in torch.load(f, weights_only=True).items() if k != "format"}, f)
    before = snapshot(run)
    one_line_error(
        lambda: train_cli.main(["--resume", str(run)]),
        "written by an older train.py",
        "start a new run",
    )
    # decode.py too
    one_line_error(lambda: decode_cli.main([str(run), "--g-table"]), "written by an older train.py")
    assert snapshot(run) == before


def test_resume_survives_a_half_written_metrics_line_and_refuses_a_damaged_last_checkpoint(
    finished, tmp_path, capsys
):
    """The last checkpoint is the one resume point (the best and epoch files hold the weights alone,
    a third of its size): a damaged one is refused in one line that names it, and nothing changes;
    the best still decodes."""
    run = copy_run(finished, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 16, "loss": 4.2, "gno')  # the kill came mid-line
    capsys.readouterr()
    train_cli.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"])
    # every line is JSON
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "gnorm" in r] == list(range(1, 21))
    last, best = run / "checkpoint_last.pt", run / "checkpoint_best.pt"
    assert (
        "optimizer" not in torch.load(best, weights_only=True)
        and best.stat().st_size < last.stat().st_size / 2
    )
    last.write_bytes(last.read_bytes()[:1000])  # a damaged last checkpoint (no atomic writer, say)
    before = snapshot(run)
    one_line_error(
        lambda: train_cli.main(["--resume", str(run), "--max-steps", "25"]),
        "checkpoint_last.pt",
        "not a readable checkpoint",
        "move it out",
    )
    assert snapshot(run) == before
    decode.load_checkpoint(run)  # the best checkpoint still gives the model


# --- 4. bad flags fail early, in one line, before any training ------------------------------
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--dev-beam", "0"], "--dev-beam"),
        (["--beam", "0"], "--beam"),
        (["--schedule", "valdecay", "--patience", "0"], "--patience"),
        (["--heads", "0"], "--heads"),
        (["--log-interval", "0"], "--log-interval"),
        (["--relu-dropout", "2"], "--relu-dropout"),
        (["--beta2", "1.5"], "--beta2"),
        (["--attn-dropout", "-0.5"], "--attn-dropout"),
        (["--enc-layers", "-1"], "--enc-layers"),
        (["--qk-length", "1.5"], "--qk-length"),
        (["--lr", "0"], "--lr"),
        (["--src", "en", "--tgt", "de"], "--src"),
        (["--accumulate", "0"], "--accumulate"),
        (["--schedule", "valdecay", "--decay-factor", "1.5"], "--decay-factor"),
        (["--clip", "-1"], "--clip"),
        # Issue 30: each was a traceback or a crash after the run directory was made (g0 infinite,
        # Adam's first step overflowing, torch segfaulting on 100,000 threads).
        (["--lr", "1e300"], "--lr"),
        (["--lr-scale", "1e300"], "--lr-scale"),
        (["--qknorm", "--qk-length", "1e200"], "--qk-length"),
        (["--threads", "100000"], "--threads"),
    ],
)
def test_every_bad_flag_fails_at_start_in_one_line(argv, flag, tmp_path):
    one_line_error(lambda: train_cli.main(argv + ["--out", str(tmp_path / "run")]), flag)
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_huge_dev_line_is_cut_with_a_count_not_fatal(tmp_path, capsys):
    corpus = toy_corpus.make_toy_corpus(tmp_path / "toy", n_train=300, n_dev=8, n_test=8)
    with open(corpus / "dev.src", "a") as f:
        f.write(" ".join(["Thullockmeyth"] * 3000) + "\n")  # thousands of BPE tokens
    with open(corpus / "dev.tgt", "a") as f:
        f.write("na .\n")
    capsys.readouterr()
    result = train_cli.main(
        TINY
        + [
            "--data",
            str(corpus),
            "--src",
            "src",
            "--tgt",
            "tgt",
            "--max-len",
            "60",
            "--max-steps",
            "5",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert (
        "data: dev: 1 source lines longer than --max-len 60 BPE tokens are cut to it"
        in capsys.readouterr().out
    )
    assert result["best_step"] == 5


# --- 5. failures exit non-zero ---------------------------------------------------------------
def test_a_diverged_run_exits_non_zero_keeps_its_last_good_checkpoint_and_writes_strict_json(
    tmp_path, corpus, monkeypatch
):
    real_step = train.train_step
    calls = {"n": 0}

    def diverging_step(*a, **k):  # a real step, whose loss turns NaN at step 12
        calls["n"] += 1
        loss, nll, gnorm, n = real_step(*a, **k)
        return (
            (loss * float("nan"), nll, gnorm * float("inf"), n)
            if calls["n"] == 12
            else (loss, nll, gnorm, n)
        )

    monkeypatch.setattr(train, "train_step", diverging_step)
    run = tmp_path / "run"
    one_line_error(
        lambda: train_cli.main(TINY + corpus + ["--max-steps", "20", "--out", str(run)]),
        "diverged",
        "step 12",
        "checkpoint_last.pt",
    )
    # strict JSON: no NaN / Infinity literals
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    bad = [
        json.loads(line)
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if "nonfinite" in line
    ]
    assert bad == [
        {
            "step": 12,
            "loss": None,
            "gnorm": None,
            "lr": bad[0]["lr"],
            "tokens": bad[0]["tokens"],
            "nonfinite": ["loss", "gnorm"],
        }
    ]
    # the last good one
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["train_state"]["step"] == 10


def test_a_non_finite_gradient_norm_with_a_finite_loss_is_a_divergence_too(
    tmp_path, corpus, monkeypatch
):
    """Clipping by an infinite norm multiplies the gradients by 0 * inf = NaN: the weights are lost
    even though the loss was finite, so the run must stop before writing a checkpoint."""
    real_step = train.train_step
    calls = {"n": 0}

    def step_with_inf_gradient(*a, **k):
        calls["n"] += 1
        loss, nll, gnorm, n = real_step(*a, **k)
        return (loss, nll, gnorm * float("inf"), n) if calls["n"] == 7 else (loss, nll, gnorm, n)

    monkeypatch.setattr(train, "train_step", step_with_inf_gradient)
    run = tmp_path / "run"
    one_line_error(
        lambda: train_cli.main(TINY + corpus + ["--max-steps", "20", "--out", str(run)]),
        "diverged",
        "the gradient norm became inf",
        "step 7",
    )
    # the last good one
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["train_state"]["step"] == 5


def test_a_huge_but_finite_loss_is_a_warning_and_the_run_goes_on(
    tmp_path, corpus, monkeypatch, capsys
):
    real_step = train.train_step

    def exploding_step(*a, **k):  # a per-token loss of 40 nats: far worse than guessing uniformly
        loss, nll, gnorm, n = real_step(*a, **k)
        return loss * 0 + 40.0 * n, nll, gnorm, n

    monkeypatch.setattr(train, "train_step", exploding_step)
    capsys.readouterr()
    result = train_cli.main(
        TINY + corpus + ["--max-steps", "10", "--warmup", "2", "--out", str(tmp_path / "run")]
    )
    assert (
        "warning: the training loss 40.00 is far above a uniform guess" in capsys.readouterr().out
    )
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "gnorm" in r][-1] == 10 and any("warning" in r for r in rows)
    assert result is not None  # it ended normally, with its test BLEU


# --- 6. decode.py ----------------------------------------------------------------------------
def test_decode_checks_its_output_folder_before_translating(finished, tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text("the dog sees a cat .\n")
    monkeypatch.setattr(
        decode, "translate", lambda *a, **k: pytest.fail("translated before checking --output")
    )
    one_line_error(
        lambda: decode_cli.main(
            [
                str(finished),
                "--input",
                str(tmp_path / "in.txt"),
                "--output",
                str(tmp_path / "missing" / "out.txt"),
            ]
        ),
        "missing",
        "--output",
    )


def test_decode_stdin_closed_or_undecodable_is_one_line(finished, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    sys.stdin.close()
    one_line_error(lambda: decode_cli.main([str(finished)]), "stdin is closed", "--input")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the dog .\nthe \xff cat .\n")))
    one_line_error(lambda: decode_cli.main([str(finished)]), "stdin", "line 2", "0xff")


def test_decode_names_the_line_of_undecodable_input_and_refuses_a_negative_length(
    finished, tmp_path
):
    (tmp_path / "in.txt").write_bytes(b"the dog .\nthe cat .\nthe \xe9 bird .\n")
    one_line_error(
        lambda: decode_cli.main([str(finished), "--input", str(tmp_path / "in.txt")]),
        "in.txt",
        "line 3",
    )
    p = subprocess.run(
        [sys.executable, "decode.py", str(finished), "--max-len-b", "-100"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        input="the dog .\n",
    )
    assert p.returncode != 0 and "argument --max-len-b: must be 0 or more" in p.stderr


# --- 7. --overwrite and --resume never lose what they were not told to --------------------------
def test_overwrite_checks_every_input_before_removing_anything(finished, tmp_path, corpus):
    run = copy_run(finished, tmp_path)
    before = snapshot(run)
    one_line_error(
        lambda: train_cli.main(
            TINY + corpus + ["--max-len", "1", "--overwrite", "--out", str(run)]
        ),
        "no training pair left",
    )
    one_line_error(
        lambda: train_cli.main(
            TINY + corpus + ["--bpe-size", "5", "--overwrite", "--out", str(run)]
        ),
        "--bpe-size 5",
        "too small",
    )
    assert snapshot(run) == before and not [
        p for p in run.iterdir() if p.name.startswith(".staging")
    ]


def test_overwrite_refuses_a_folder_that_is_not_a_run_and_removes_only_the_runs_own_files(
    finished, tmp_path, corpus
):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"lr": 0.1, "notes": "my own experiment"}\n')
    (theirs / "results.json").write_text('{"bleu": 30.1}\n')
    (theirs / "notes.txt").write_text("do not delete\n")
    before = snapshot(theirs)
    one_line_error(
        lambda: train_cli.main(TINY + corpus + ["--overwrite", "--out", str(theirs)]),
        "not a run directory of train.py",
        str(theirs),
    )
    assert snapshot(theirs) == before
    run = copy_run(finished, tmp_path)
    # the user's own copies
    shutil.copy(run / "checkpoint_best.pt", run / "checkpoint_best_backup.pt")
    (run / "notes.txt").write_text("seed 1 looked good\n")
    other = torch.load(run / "checkpoint_epoch1.pt", weights_only=True)
    other["args"]["run_id"] = "another run"
    # a checkpoint of another run, under a run's name
    torch.save(other, run / "checkpoint_epoch9.pt")
    kept = {
        n: h
        for n, h in snapshot(run).items()
        if n in ("checkpoint_best_backup.pt", "notes.txt", "checkpoint_epoch9.pt")
    }
    train_cli.main(TINY + corpus + ["--max-steps", "5", "--overwrite", "--out", str(run)])
    assert {n: h for n, h in snapshot(run).items() if n in kept} == kept
    assert not (run / "checkpoint_epoch3.pt").exists()  # the old run's own files went


def test_a_refused_resume_changes_nothing_and_a_deleted_bpe_model_comes_from_the_checkpoint(
    finished, tmp_path
):
    run = copy_run(finished, tmp_path)
    proto = (run / "bpe.model").read_bytes()
    # another file under its name
    (run / "bpe.model").write_bytes((run / "bpe.model").read_bytes()[::-1])
    before = snapshot(run)
    one_line_error(
        lambda: train_cli.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"]),
        "bpe.model",
        "not the BPE model",
    )
    assert snapshot(run) == before
    (run / "bpe.model").unlink()  # deleted: the checkpoint holds the model
    train_cli.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"])
    assert (run / "bpe.model").read_bytes() == proto
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["train_state"]["step"] == 20
    # and resumes again
    train_cli.main(["--resume", str(run), "--max-steps", "25", "--max-epochs", "10"])


def test_the_next_start_removes_what_a_kill_mid_write_left(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    (run / ".checkpoint_last.pt.k1ll3d.tmp").write_bytes(b"PK half a checkpoint")
    (run / ".metrics.jsonl.x7y8z9.tmp").write_text('{"step": 3')
    (run / ".staging-abc123").mkdir()
    (run / ".staging-abc123" / "bpe.model").write_bytes(b"half")
    (run / ".my-editor.tmp").write_text("not train.py's")
    train_cli.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"])
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [
        ".lock",
        ".my-editor.tmp",
    ]


# --- 8. what was asked is what runs -----------------------------------------------------------
def test_a_flag_given_on_the_command_line_wins_over_the_preset():
    args, _ = presets.resolve_flags(["--preset", "twt3-scalenorm", "--lr", "1e-3"])
    assert args.lr == 1e-3 and train.Schedule.from_args(args).peak == 1e-3
    # the preset's lambda 1, recorded as its peak
    args, _ = presets.resolve_flags(["--preset", "twt3-scalenorm"])
    assert args.lr == pytest.approx(1 / (512 * 8000) ** 0.5) == train.Schedule.from_args(args).peak
    one_line_error(
        lambda: presets.resolve_flags(["--lr", "1e-3", "--lr-scale", "2"]), "--lr", "--lr-scale"
    )


def test_dev_and_test_lines_with_an_empty_side_are_translated_and_scored(tmp_path, capsys):
    d = toy_corpus.make_toy_corpus(tmp_path / "toy", n_train=300, n_dev=8, n_test=8)
    for split, side in (("dev", "src"), ("test", "src"), ("test", "tgt")):
        lines = (d / f"{split}.{side}").read_text().splitlines()
        lines[2 if side == "src" else 5] = ""
        (d / f"{split}.{side}").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    run = tmp_path / "run"
    train_cli.main(
        TINY
        + ["--data", str(d), "--src", "src", "--tgt", "tgt", "--max-steps", "5", "--out", str(run)]
    )
    assert "test: 2 pairs with an empty side kept" in capsys.readouterr().out
    hyps = (run / "test.hyp").read_text().split("\n")[:-1]
    assert len(hyps) == 8 and hyps[2] == ""
    assert (
        decode_cli.main(
            [
                "--compare",
                str(run / "test.hyp"),
                str(run / "test.hyp"),
                "--ref",
                str(d / "test.tgt"),
                "--samples",
                "20",
            ]
        )
        == 0
    )


def test_compare_never_calls_equal_scores_significant(tmp_path, capsys):
    ref = ["the dog sees a cat .", "a bird sings in the tree .", "the man reads a book ."] * 10
    spaced = [s.replace(" .", ".") for s in ref]  # differs only in spacing: the same 13a BLEU
    zero_a, zero_b = ["x y z"] * 30, ["q r s t"] * 30  # different, both BLEU 0
    files = {}
    for name, lines in (("ref", ref), ("a", ref), ("b", spaced), ("za", zero_a), ("zb", zero_b)):
        files[name] = tmp_path / name
        files[name].write_text("\n".join(lines) + "\n")
    for test in ("bs", "ar"):  # chrF ignores spaces too: the same chrF2 for "a" and "b"
        for a, b, whys in (
            ("a", "b", ("the same BLEU", "the same chrF2")),
            ("za", "zb", ("outputs score BLEU 0",)),
        ):
            capsys.readouterr()
            decode_cli.main(
                [
                    "--compare",
                    str(files[a]),
                    str(files[b]),
                    "--ref",
                    str(files["ref"]),
                    "--samples",
                    "200",
                    "--test",
                    test,
                ]
            )
            # the system's verdict, BLEU's then chrF2's
            last = capsys.readouterr().out.strip().splitlines()[-1]
            assert last.startswith(
                f"{files[b]}: BLEU delta +0.00, p = 1.0000 (not significant: "
            ), last
            assert all(why in last for why in whys), last


def test_a_checkpoint_is_written_only_with_finite_weights_and_a_finite_dev_loss(
    tmp_path, corpus, monkeypatch
):
    real_step = train.train_step
    calls = {"n": 0}

    def blowing_up_step(net, *a, **k):  # a finite loss, then weights of 1e30 (finite, but useless)
        calls["n"] += 1
        out = real_step(net, *a, **k)
        if calls["n"] == 10:
            with torch.no_grad():
                for p in net.parameters():
                    p.mul_(1e30)
        return out

    monkeypatch.setattr(train, "train_step", blowing_up_step)
    run = tmp_path / "run"
    one_line_error(
        lambda: train_cli.main(TINY + corpus + ["--max-steps", "20", "--out", str(run)]),
        "diverged",
        "step 10",
        "no checkpoint of it is written",
        "checkpoint_last.pt",
    )
    # the last good one
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["train_state"]["step"] == 5
    assert not (run / "checkpoint_epoch2.pt").exists()


def test_train_seconds_count_every_part_of_a_resumed_run(tmp_path, corpus, monkeypatch):
    """A fake clock that advances one second per training step: the run trains 15 steps, so 15 s,
    however many times it was killed and resumed (the steps after the last checkpoint are
    redone)."""
    clock, real_step, calls = {"t": 0.0}, train.train_step, {"n": 0}

    def step(*a, **k):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt  # killed after the checkpoint of step 5
        clock["t"] += 1.0
        return real_step(*a, **k)

    monkeypatch.setattr(train.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(logbook, "matmul_flops", lambda *a, **k: 1e9)
    monkeypatch.setattr(train, "train_step", step)
    run = tmp_path / "run"
    with pytest.raises(SystemExit):
        train_cli.main(TINY + corpus + ["--max-steps", "15", "--out", str(run)])
    assert train_cli.main(["--resume", str(run)])["train_seconds"] == 15.0
    # finished: refused, unchanged
    one_line_error(lambda: train_cli.main(["--resume", str(run)]), "nothing to train")
    assert json.loads((run / "results.json").read_text())["train_seconds"] == 15.0


def test_a_moved_but_identical_corpus_resumes(finished, tmp_path, corpus):
    run = copy_run(finished, tmp_path)
    moved = tmp_path / "moved"
    shutil.copytree(corpus[1], moved)
    for f in run.glob("checkpoint_*.pt"):  # the corpus it was trained on has moved
        ckpt = torch.load(f, weights_only=True)
        torch.save(dict(ckpt, args=dict(ckpt["args"], data=str(tmp_path / "gone"))), f)
    one_line_error(lambda: train_cli.main(["--resume", str(run)]), "gone", "--data")
    train_cli.main(
        ["--resume", str(run), "--data", str(moved), "--max-steps", "20", "--max-epochs", "10"]
    )
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["train_state"]["step"] == 20


# --- 9. nothing asked for is silently skipped --------------------------------------------------
def test_what_cannot_be_done_is_said_not_skipped(finished, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    one_line_error(
        lambda: decode_cli.main(
            [str(finished), "--attention", "the dog .", "--png", str(tmp_path / "a.png")]
        ),
        "--png",
        "pip install matplotlib",
    )
    (tmp_path / "empty.txt").write_text("")
    one_line_error(
        lambda: decode_cli.main(
            [str(finished), "--benchmark", "--input", str(tmp_path / "empty.txt")]
        ),
        "--benchmark",
        "empty.txt",
    )
    one_line_error(
        lambda: train_cli.main(TINY + ["--profile", "--out", str(tmp_path / "run")]),
        "--profile",
        "--benchmark",
    )
    p = subprocess.run(
        [sys.executable, "data.py", "--bogus"], cwd=ROOT, capture_output=True, text=True
    )
    assert p.returncode != 0 and "--bogus" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_a_byte_order_mark_is_not_text(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfthe dog .\nthe cat .\n")
    assert fileio.read_lines(tmp_path / "a.txt") == ["the dog .", "the cat ."]
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbfthe dog .\nthe \xff cat .\n")
    with pytest.raises(fileio.DataError, match="line 2: invalid UTF-8 byte 0xff at byte offset 17"):
        fileio.read_lines(tmp_path / "b.txt")  # offsets still count from the file's first byte
    (tmp_path / "c.txt").write_bytes("the dog .\n".encode("utf-16"))  # a Windows "Unicode" file
    with pytest.raises(fileio.DataError, match="UTF-16 text, not UTF-8 .*iconv -f utf-16"):
        fileio.read_lines(tmp_path / "c.txt")


# --- 10. one line naming the flag or file, never a traceback -----------------------------------
def _link(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "no" / "such" / "folder")
    return tmp_path / "dangling"


@pytest.mark.parametrize(
    "make_argv, names",
    [
        (lambda t: ["--preset", "twt3-scalenorm", "--pair", "nosuch"], ["--pair", "nosuch"]),
        (
            lambda t: ["--out", str((t / "a-file").write_text("x") and t / "a-file")],
            ["--out", "a file"],
        ),
        (lambda t: ["--out", str(_link(t))], ["--out", "symbolic link"]),
        (lambda t: ["--out", "/proc/nmt-run"], ["--out /proc/nmt-run"]),
        (lambda t: ["--bpe-size", "5", "--out", str(t / "fresh")], ["--bpe-size 5", "too small"]),
        (lambda t: ["--seed", "12345678901234567890123", "--out", str(t / "run")], ["--seed"]),
    ],
)
def test_bad_outs_and_values_are_one_line(make_argv, names, tmp_path, corpus):
    one_line_error(lambda: train_cli.main(TINY + corpus + make_argv(tmp_path)), *names)
    assert not (tmp_path / "fresh").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda c: [c], "(not an object)"),
        (lambda c: dict(c, d_model="abc"), "(d_model)"),
        (lambda c: dict(c, norm="batchy", d_modle=64), "(norm, d_modle)"),
    ],
)
def test_a_resume_reads_its_checkpoint_and_names_what_an_edited_config_json_changed(
    edit, said, finished, tmp_path, capsys
):
    """config.json is for people: the checkpoint is the resume record, so an edited config.json
    changes nothing; the resume names the keys that differ and says the checkpoint's hold (the file
    is then written from them: no edit is replaced unannounced)."""
    run = copy_run(finished, tmp_path)
    (run / "config.json").write_text(
        json.dumps(edit(json.loads((run / "config.json").read_text())))
    )
    capsys.readouterr()
    train_cli.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"])
    assert (
        f"config.json differs from the checkpoint {said}: the checkpoint's flags hold"
        in capsys.readouterr().out
    )
    ckpt = torch.load(run / "checkpoint_last.pt", weights_only=True)
    assert (
        ckpt["train_state"]["step"] == 20
        and ckpt["args"]["d_model"] == 32
        and ckpt["args"]["norm"] == "scale"
    )
    # written again, from the run's flags
    assert json.loads((run / "config.json").read_text())["d_model"] == 32
    # an unedited one: nothing to say
    train_cli.main(["--resume", str(run), "--max-steps", "25", "--max-epochs", "10"])
    assert "differs from the checkpoint" not in capsys.readouterr().out


def test_config_starts_a_new_run_with_a_runs_flags_and_refuses_a_bad_key_in_one_line(
    finished, tmp_path, capsys
):
    """--config RUN/config.json: that run's flags, the command line's winning; --show shows them; a
    key that is no flag, a value of the wrong type or range, a file that is no JSON object: one line
    naming it."""
    config = finished / "config.json"
    saved = json.loads(config.read_text())
    args, given = presets.resolve_flags(
        ["--config", str(config), "--out", str(tmp_path / "b"), "--lr", "0.01"]
    )
    assert (
        given == {"config": str(config), "out": str(tmp_path / "b"), "lr": 0.01} and args.lr == 0.01
    )
    differ = [k for k, v in saved.items() if getattr(args, k, None) != v]
    assert set(differ) <= set(
        rundir.RUN_RECORDS + rundir.ACTIONS + ("out", "config", "lr", "lr_scale")
    ), differ
    # --lr given: the run's --lr-scale is not used
    assert args.lr_scale is None and args.out == str(tmp_path / "b")
    capsys.readouterr()
    # shows, trains nothing
    assert train_cli.main(["--config", str(config), "--d-model", "48", "--show"]) is None
    shown = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert shown["--d-model"] == ["48", "given"] and shown["--bpe-size"] == [str(saved["bpe_size"])]
    # the run, again
    train_cli.main(["--config", str(config), "--out", str(tmp_path / "again"), "--max-steps", "5"])
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    differ = {k for k in {**saved, **again} if again.get(k) != saved.get(k)}
    # the corpus's hashes too: the same corpus
    assert differ == {"out", "config", "max_steps", "run_id"}, differ
    for edit, names in (
        (dict(saved, d_modle=64), ["'d_modle'", "not a flag"]),
        (dict(saved, d_model="big"), ["'d_model'", "'big' is not a value of --d-model"]),
        (dict(saved, d_model=0), ["'d_model'", "0 is not a value of --d-model"]),
        (dict(saved, prenorm="yes"), ["'prenorm'", "--prenorm"]),
        (dict(saved, norm="batchy"), ["'norm'", "--norm"]),
        ([saved], ["not a JSON object of flags"]),
    ):
        (tmp_path / "edited.json").write_text(json.dumps(edit))
        one_line_error(
            lambda: train_cli.main(
                ["--config", str(tmp_path / "edited.json"), "--out", str(tmp_path / "c")]
            ),
            "--config",
            *names,
        )
    (tmp_path / "broken.json").write_text("{")
    one_line_error(
        lambda: train_cli.main(["--config", str(tmp_path / "broken.json")]),
        "--config",
        "not a JSON object",
    )
    one_line_error(
        lambda: train_cli.main(["--config", str(tmp_path / "none.json")]), "--config", "none.json"
    )
    assert not (tmp_path / "c").exists()


def test_a_full_disk_while_checkpointing_is_one_line_and_the_old_checkpoints_survive(
    tmp_path, corpus, monkeypatch
):
    real_save = torch.save

    def full_disk(obj, f):  # the disk fills while atomic_write writes step 10's checkpoint
        if isinstance(obj, dict) and obj.get("train_state", {}).get("step") == 10:
            raise OSError(28, "No space left on device")
        return real_save(obj, f)

    monkeypatch.setattr(fileio.torch, "save", full_disk)
    run = tmp_path / "run"
    one_line_error(
        lambda: train_cli.main(TINY + corpus + ["--max-steps", "20", "--out", str(run)]),
        "No space left on device",
        "intact",
        f"make room, then continue with python train.py --resume {run}",
    )
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["train_state"]["step"] == 5


@pytest.mark.parametrize("full", ["metrics.jsonl", "bpe.model", "config.json"])
def test_a_full_disk_before_the_first_checkpoint_never_advises_resume(
    full, tmp_path, corpus, monkeypatch
):
    """The advice follows what the run directory holds: no checkpoint yet, nothing to resume."""
    real_mkstemp, real_open = tempfile.mkstemp, open

    def full_disk(*a, prefix, **k):  # atomic_write's temporary file beside the file it replaces
        if prefix == f".{full}.":
            raise OSError(28, "No space left on device")
        return real_mkstemp(*a, prefix=prefix, **k)

    def full_append(path, *a, **k):
        if Path(path).name == full:
            raise OSError(28, "No space left on device", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(fileio.tempfile, "mkstemp", full_disk)
    # metrics.jsonl is appended to, not replaced
    monkeypatch.setattr(fileio, "open", full_append, raising=False)
    run = tmp_path / "run"
    msg = one_line_error(
        lambda: train_cli.main(TINY + corpus + ["--max-steps", "20", "--out", str(run)]),
        "No space left on device",
        full,
        "make room, then",
    )
    assert "--resume" not in msg, msg
    # committed: the run's config.json is there
    assert ("--overwrite" in msg) == (full == "metrics.jsonl"), msg


def test_decode_and_plot_outputs_are_checked_before_any_work(finished, tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text("the dog sees a cat .\n")
    monkeypatch.setattr(
        decode, "translate", lambda *a, **k: pytest.fail("translated before checking --output")
    )
    src = ["--input", str(tmp_path / "in.txt")]
    one_line_error(
        lambda: decode_cli.main([str(finished), *src, "--output", str(tmp_path)]),
        "--output",
        "a folder",
    )
    one_line_error(
        lambda: decode_cli.main([str(finished), *src, "--output", "/proc/out.txt"]),
        "--output",
        "cannot write",
    )
    for out, why in (
        (tmp_path / "missing" / "p.png", "does not exist"),
        (tmp_path / "p.jpg", "must end in .png"),
    ):
        one_line_error(
            partial(decode_cli.main, ["--plot", str(finished), "--out", str(out)]), "--out", why
        )


# --- 11. the second probe's findings ----------------------------------------------------------
def test_decode_never_overwrites_what_it_reads_or_what_train_wrote(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    (tmp_path / "x.en").write_text("the dog sees a cat .\n")
    before = snapshot(tmp_path)
    ckpt = run / "checkpoint_best.pt"
    for model, output, why in (
        (run, tmp_path / "x.en", "is --input"),
        (ckpt, ckpt, "is the checkpoint"),
        (run, ckpt, "a file of the run directory"),
        (run, run / "config.json", "a file of the run"),
    ):
        one_line_error(
            partial(
                decode_cli.main,
                [str(model), "--input", str(tmp_path / "x.en"), "--output", str(output)],
            ),
            "--output",
            why,
        )
    assert snapshot(tmp_path) == before
    assert (
        decode_cli.main(
            [str(run), "--input", str(tmp_path / "x.en"), "--output", str(run / "x.hyp")]
        )
        == 0
    )


def test_ctrl_c_says_what_can_be_done(tmp_path, corpus, killed_run, finished, monkeypatch, capsys):
    run = tmp_path / "run"
    # before the first checkpoint
    msg = killed_run(TINY + corpus + ["--max-steps", "20", "--out", str(run)], 3)
    assert "nothing to resume" in msg and "--overwrite" in msg and "--resume" not in msg, msg
    # after step 5's
    msg = killed_run(TINY + corpus + ["--max-steps", "20", "--overwrite", "--out", str(run)], 8)
    assert f"--resume {run}" in msg, msg
    # another run's, which --overwrite keeps
    foreign = torch.load(run / "checkpoint_last.pt", weights_only=True)
    foreign["args"]["run_id"] = "another run"
    torch.save(foreign, run / "checkpoint_epoch99.pt")
    msg = killed_run(TINY + corpus + ["--max-steps", "20", "--overwrite", "--out", str(run)], 3)
    assert "nothing to resume" in msg and (run / "checkpoint_epoch99.pt").exists(), msg
    # Before the run directory changes (here: while the model is built), an --overwrite start leaves
    # the old run as it was: start again, never "--resume" (that would continue the old run).
    old = copy_run(finished, tmp_path / "o")
    before = snapshot(old)

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "build_model", killed)
    for argv in (["--overwrite", "--out", str(old)], ["--out", str(tmp_path / "never")]):
        with pytest.raises(SystemExit) as e:
            train_cli.main(TINY + corpus + ["--max-steps", "20", *argv])
        msg = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 130 and "the same command" in msg, msg
        assert "had not started" in msg and "--resume" not in msg, msg
    assert snapshot(old) == before and not (tmp_path / "never").exists()


def test_a_resume_that_would_train_nothing_is_refused_and_a_budget_stop_is_recorded(
    finished, tmp_path
):
    run = copy_run(finished, tmp_path)
    assert json.loads((run / "results.json").read_text())["stopped"] == "--max-steps 15 reached"
    before = snapshot(run)
    one_line_error(
        lambda: train_cli.main(["--resume", str(run), "--max-steps", "10"]),
        "past that --max-steps 10",
    )
    # finished: the same budget, or a larger one that another budget (--max-epochs 1000 x 5 steps)
    # still binds
    one_line_error(
        lambda: train_cli.main(["--resume", str(run)]),
        "trained 15 steps, all that --max-steps 15 allows",
    )
    one_line_error(
        lambda: train_cli.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "3"]),
        "all that --max-epochs 3 allows",
        "give a larger --max-epochs",
    )
    assert snapshot(run) == before
    # a larger budget continues
    train_cli.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"])
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["train_state"]["step"] == 20


def test_too_few_batches_for_a_step_and_the_advice_under_torchrun(
    finished, tmp_path, corpus, monkeypatch
):
    one_line_error(
        lambda: train_cli.main(
            TINY + corpus + ["--accumulate", "1000", "--out", str(tmp_path / "r")]
        ),
        "batches of --batch-tokens 512, fewer than the 1000 of a step",
        "--accumulate 1000",
    )
    assert not (tmp_path / "r").exists()
    config = json.loads((finished / "config.json").read_text())
    args = argparse.Namespace(
        out=str(finished), benchmark=False, run_id=config["run_id"], epoch_size=5
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (
        f"torchrun (as many processes as before, 2) train.py --resume {finished}"
        in rundir.what_next(args)
    )


def test_an_empty_out_is_refused_not_this_folder(tmp_path, corpus, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_error(
        lambda: train_cli.main(TINY + corpus + ["--max-steps", "5", "--out", ""]), "--out is empty"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags, steps", [([], 10), (["--warmup", "2", "--stop-lr", "10"], 5)])
def test_a_run_killed_in_its_final_test_resumes_to_finish_it(
    flags, steps, tmp_path, corpus, monkeypatch
):
    """Stopped by its budget or by --stop-lr, then killed before results.json: the resume runs the
    test alone."""
    run, real = tmp_path / "run", fileio.atomic_write

    def killed(path, content):
        if Path(path).name == "results.json":
            raise KeyboardInterrupt
        return real(path, content)

    monkeypatch.setattr(fileio, "atomic_write", killed)  # Ctrl-C just before results.json
    with pytest.raises(SystemExit):
        train_cli.main(TINY + corpus + ["--max-steps", "10", *flags, "--out", str(run)])
    assert not (run / "results.json").exists()
    monkeypatch.setattr(fileio, "atomic_write", real)
    result = train_cli.main(["--resume", str(run)])  # every step trained: only the test is left
    assert result["steps"] == steps and "test_bleu" in result and (run / "results.json").exists()
    # now it is finished
    one_line_error(lambda: train_cli.main(["--resume", str(run)]), "nothing to train")


def test_a_run_stopped_by_stop_lr_or_early_stop_resumes_when_the_flag_changes(tmp_path, corpus):
    """A run stopped by --stop-lr (or --early-stop) and resumed with that flag unchanged would stop
    at once: refused in one line, nothing changed. With the flag changed it trains on."""
    run = tmp_path / "run"
    train_cli.main(
        TINY + corpus + ["--warmup", "2", "--stop-lr", "10", "--max-steps", "10", "--out", str(run)]
    )
    stopped = json.loads((run / "results.json").read_text())["stopped"]
    assert (
        "--stop-lr" in stopped
        and torch.load(run / "checkpoint_last.pt", weights_only=True)["train_state"]["step"] == 5
    )
    before = snapshot(run)
    one_line_error(
        lambda: train_cli.main(["--resume", str(run)]), "would stop again at once", "--stop-lr"
    )
    assert snapshot(run) == before
    train_cli.main(["--resume", str(run), "--stop-lr", "0"])
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["train_state"]["step"] == 10
    assert json.loads((run / "results.json").read_text())["stopped"] == "--max-steps 10 reached"
    args = presets.resolve_flags(["--early-stop", "3"])[0]
    stopped, history = (
        ("early_stop", "dev BLEU has not improved for 3 evaluations"),
        [5.0, 4.0, 5.0, 3.0],
    )
    # 3 evaluations since the best (the first 5.0)
    assert train.stop_reason(args, 20, 1.0, history) == stopped
    for flags in (["--early-stop", "4"], ["--early-stop", "0"]):
        assert train.stop_reason(presets.resolve_flags(flags)[0], 20, 1.0, history) is None


def test_a_damaged_bpe_model_with_a_valid_key_is_made_again(finished, tmp_path, corpus, capsys):
    run = copy_run(finished, tmp_path)
    # bpe.key still matches the text
    (run / "bpe.model").write_bytes((run / "bpe.model").read_bytes()[:100])
    train_cli.main(TINY + corpus + ["--max-steps", "5", "--out", str(run), "--overwrite"])
    assert "trained joint BPE" in capsys.readouterr().out
    assert data.load_tokenizer((run / "bpe.model").read_bytes()).vocab_size > 4


def test_a_read_only_run_directory_is_one_line(finished, tmp_path, monkeypatch):
    run = copy_run(finished, tmp_path)
    real_open = open

    def read_only(path, *a, **k):
        if str(path).endswith(".lock"):
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", read_only)
    one_line_error(
        lambda: train_cli.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"]),
        str(run),
        "Read-only file system",
    )


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--qk-no-g"], ["--qk-no-g", "--qknorm"]),
        (["--qk-length", "30"], ["--qk-length", "--qknorm"]),
        (["--pn-variant", "code"], ["--pn-variant", "power"]),
        (["--pn-alpha-fwd", "0.5"], ["--pn-alpha-fwd", "power"]),
        (["--schedule", "nowarmup", "--warmup", "50"], ["--warmup", "nowarmup"]),
        # read by decay alone
        (["--patience", "5"], ["--patience", "validation-based decay", "not --schedule invsqrt"]),
        (
            ["--schedule", "cosine", "--decay-factor", "0.5"],
            ["--decay-factor", "not --schedule cosine"],
        ),
    ],
)
def test_a_flag_that_would_do_nothing_is_refused(argv, names, tmp_path):
    one_line_error(lambda: train_cli.main(TINY + argv + ["--out", str(tmp_path / "run")]), *names)
    assert not (tmp_path / "run").exists()


def test_a_file_as_data_is_one_line(tmp_path, corpus):
    one_line_error(
        lambda: train_cli.main(
            TINY
            + [
                "--data",
                str(Path(corpus[1]) / "train.src"),
                "--src",
                "src",
                "--tgt",
                "tgt",
                "--out",
                str(tmp_path / "r"),
            ]
        ),
        "--data",
        "a file, not a folder",
    )


def test_decode_empty_input_with_ref_odd_metrics_and_idle_flags_are_one_line(finished, tmp_path):
    (tmp_path / "e").write_text("")
    one_line_error(
        lambda: decode_cli.main(
            [str(finished), "--input", str(tmp_path / "e"), "--ref", str(tmp_path / "e")]
        ),
        "--ref",
        "nothing to score",
    )
    run = copy_run(finished, tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:2] + ["[1, 2]"] + lines[3:]) + "\n")
    with pytest.raises(fileio.DataError, match="line 3 is not a record of train.py"):
        rundir.read_metrics(run)  # what --plot reads
    with pytest.raises(SystemExit) as e:
        decode_cli.parse_args([str(finished), "--layer", "3"])
    assert e.value.code == 2
    p = subprocess.run(
        [sys.executable, "data.py", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert p.returncode == 0 and "prepare NAME" in p.stdout


def test_both_programs_refuse_an_idle_flag_through_one_rule(monkeypatch, capsys):
    """machinery/arguments.py's idle_flag owns "a flag given where it does nothing is refused in
    one line": the first idle flag, as a command line writes it, with its rule's why. train.py's
    table (machinery/train_cli.py), decode.py's needs and its modes go through it."""
    assert arguments.idle_flag(
        [(("a", "b_c"), True, "x"), (("d", "b_c"), False, "why")], {"b_c"}
    ) == (
        "--b-c",
        "why",
    )
    assert arguments.idle_flag([(("a",), False, "x")], {"b"}) is None
    seen, rule = [], arguments.idle_flag
    monkeypatch.setattr(
        arguments, "idle_flag", lambda rules, given: seen.append(rule(rules, given)) or seen[-1]
    )
    for main, argv, said in (
        (train_cli.main, ["--qk-length", "5"], "--qk-length is QKNorm's, so it needs --qknorm"),
        (decode_cli.main, ["x", "--sample"], "--sample is for --generate: give it too"),
        (
            decode_cli.main,
            ["--compare", "a", "b", "--ref", "c", "--beam", "3"],
            "--beam does nothing with --compare",
        ),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert said in (
            e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err
        ), argv
        assert seen[-1][0] == said.split()[0], argv  # the line came from the one rule
    assert len(seen) >= 3


def test_a_failed_start_removes_only_empty_folders_it_made_and_decode_sees_through_dotdot(
    finished, tmp_path, corpus
):
    # made by this start, which then fails; another run's folder appears in it
    sweep = tmp_path / "sweep"
    real_mkdir, made = Path.mkdir, []

    def mkdir_then_a_sibling(self, *a, **k):  # the sibling run is made right after our folders
        real_mkdir(self, *a, **k)
        if self.name == "b" and not made:
            made.append(real_mkdir(self.parent / "a"))
            (self.parent / "a" / "config.json").write_text("{}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "mkdir", mkdir_then_a_sibling)
        one_line_error(
            lambda: train_cli.main(TINY + corpus + ["--max-len", "1", "--out", str(sweep / "b")]),
            "no training pair left",
        )
    assert (sweep / "a" / "config.json").exists() and not (sweep / "b").exists()
    run = copy_run(finished, tmp_path)
    (tmp_path / "x.en").write_text("the dog .\n")
    for output in (run / ".." / "run" / "config.json", run / "test.hyp"):
        one_line_error(
            partial(
                decode_cli.main,
                [str(run), "--input", str(tmp_path / "x.en"), "--output", str(output)],
            ),
            "a file of the run directory",
        )


def test_decode_ctrl_c_says_whether_the_output_was_written(finished, tmp_path, monkeypatch, capsys):
    (tmp_path / "in.txt").write_text("the dog sees a cat .\n")
    (tmp_path / "ref.txt").write_text("the dog sees a cat .\n")
    argv = [str(finished), "--input", str(tmp_path / "in.txt"), "--ref", str(tmp_path / "ref.txt")]

    def killed(*a, **k):
        raise KeyboardInterrupt

    # Ctrl-C while scoring: the translations are written
    monkeypatch.setattr(decode, "score_report", killed)
    assert decode_cli.main(argv + ["--output", str(tmp_path / "a.hyp")]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "not written" not in err and (tmp_path / "a.hyp").exists(), err
    monkeypatch.setattr(decode, "translate", killed)  # Ctrl-C while translating: nothing is written
    assert decode_cli.main(argv + ["--output", str(tmp_path / "b.hyp")]) == 130
    assert "b.hyp was not written" in capsys.readouterr().err and not (tmp_path / "b.hyp").exists()


def test_decode_writes_through_a_link_and_into_a_pipe(finished, tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text("the dog sees a cat .\nthe cat sees a dog .\n")
    target, link = tmp_path / "target.hyp", tmp_path / "link.hyp"
    target.write_text("old\n")
    link.symlink_to(target)
    assert (
        decode_cli.main([str(finished), "--input", str(tmp_path / "in.txt"), "--output", str(link)])
        == 0
    )
    # the link's file, not the link
    assert link.is_symlink() and len(target.read_text().splitlines()) == 2
    fifo, got = tmp_path / "pipe", []
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    assert (
        decode_cli.main([str(finished), "--input", str(tmp_path / "in.txt"), "--output", str(fifo)])
        == 0
    )
    reader.join(timeout=60)
    # a pipe stays a pipe, and gets the translations
    assert fifo.is_fifo() and got == [target.read_text()]
    # /dev/stdout when the shell sent it to a file (> log.txt 2>&1): appended to, not replaced
    log = tmp_path / "log.txt"
    with open(log, "a") as f:
        f.write("earlier\n")
        f.flush()
        assert (
            decode_cli.main(
                [
                    str(finished),
                    "--input",
                    str(tmp_path / "in.txt"),
                    "--output",
                    f"/proc/self/fd/{f.fileno()}",
                ]
            )
            == 0
        )
    assert log.read_text() == "earlier\n" + target.read_text()

    # an unreadable checkpoint: one line, not a traceback (a resume skips it)
    def denied(path, *a, **k):
        if str(path).endswith(".pt"):
            raise PermissionError(13, "Permission denied")
        return open(path, *a, **k)

    monkeypatch.setattr(rundir, "open", denied, raising=False)  # read_checkpoint's
    with pytest.raises(fileio.DataError, match="cannot read it"):
        rundir.read_checkpoint(finished / "checkpoint_last.pt")


def test_a_full_disk_inside_torch_save_is_the_os_error(tmp_path, monkeypatch):
    """torch's zip writer reports a failed write as a RuntimeError; atomic_write says the OSError's
    words (ENOSPC)."""
    real_fdopen = os.fdopen

    class Full(io.RawIOBase):
        def __init__(self, fd):
            self.fd, self.n = fd, 0

        def writable(self):
            return True

        def write(self, b):
            self.n += len(b)
            if self.n > 5000:
                raise OSError(28, "No space left on device")
            return len(b)

        def close(self):
            real_fdopen(self.fd, "wb").close()
            super().close()

    monkeypatch.setattr(fileio.os, "fdopen", lambda fd, mode: io.BufferedWriter(Full(fd)))
    with pytest.raises(
        fileio.WriteFailed,
        match=f"{tmp_path / 'c.pt'}: cannot write it .No space left on device.; ",
    ):
        fileio.atomic_write(tmp_path / "c.pt", {"x": torch.zeros(100000)})
    assert list(tmp_path.iterdir()) == []


def test_decode_refuses_what_would_silently_do_nothing_or_mislead(
    finished, tmp_path, caplog, capsys
):
    src, ref = tmp_path / "in.txt", tmp_path / "ref.txt"
    src.write_text("the dog sees a cat .\n")
    ref.write_text("the dog sees a cat .\n")
    run = [str(finished), "--input", str(src)]
    for argv, words in (
        (run + ["--out", str(tmp_path / "o.hyp")], "--out is for --plot"),
        ([str(finished), "--g-table", "--input", str(src)], "--input does nothing with --g-table"),
        (run + ["--benchmark", "--output", str(tmp_path / "o.hyp")], "--output does nothing"),
        (run + ["--svd"], "--input does nothing with --svd"),
        (
            [str(finished), "--plot", str(finished), "--out", str(tmp_path / "p.png")],
            "a checkpoint does nothing with --plot",
        ),
        (run + ["--alpha", "inf"], "argument --alpha: must be in [0, 10]"),
        (run + ["--alpha", "11"], "argument --alpha: must be in [0, 10]"),
        (
            ["--compare", str(src), str(src), "--ref", str(ref), "--seed", "0"],
            "--seed must be at least 1",
        ),
        ([str(finished / "config.json")], "not a file torch.save writes"),
        (run + ["--samples", "50"], "--samples is for --compare"),
        (run + ["--seed", "3"], "--seed is for --compare"),
        (run + ["--tokenized"], "--tokenized is for --ref"),
        (run + ["--ref", str(ref), "--label-smoothing", "0.2"], "--label-smoothing is for --ppl"),
        (run + ["--ref", str(ref), "--benchmark", "--lowercase"], "--lowercase does nothing with"),
    ):
        with pytest.raises(SystemExit) as e:
            decode_cli.main(argv)
        assert e.value.code != 0
        err = capsys.readouterr().err + str(e.value.code)
        assert words in err, (argv, err)
    assert not (tmp_path / "o.hyp").exists()
    one_line_error(lambda: train_cli.main(TINY + ["--lr", "inf"]), "--lr", "finite")
    # --ppl with nothing to score is refused before anything is translated or written
    (tmp_path / "empty.txt").write_text("\n")
    one_line_error(
        lambda: decode_cli.main(
            [
                str(finished),
                "--input",
                str(tmp_path / "empty.txt"),
                "--ref",
                str(tmp_path / "empty.txt"),
                "--ppl",
                "--output",
                str(tmp_path / "p.hyp"),
            ]
        ),
        "--ppl",
        "no non-empty source line",
    )
    assert not (tmp_path / "p.hyp").exists()
    # --compare honours --lowercase (case:lc): outputs that differ only in case score the same
    upper = tmp_path / "upper.txt"
    upper.write_text("THE DOG SEES A CAT .\n")
    assert (
        decode_cli.main(
            ["--compare", str(src), str(upper), "--ref", str(ref), "--lowercase", "--samples", "50"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "case:lc" in out and "score the same BLEU" in out, out
    # tokenized BLEU scores tokenized text on purpose: no "did you forget to detokenize" warning
    with caplog.at_level("WARNING"):
        decode.score_report(decode.scores(["a b ."] * 120, ["a b ."] * 120))
    assert (
        "detokenize" not in caplog.text.lower() and "tokenized period" not in caplog.text.lower()
    ), caplog.text


# --- 12. issue 30, round 3: a user's files, stops, signals, --show -----------------------------
def test_a_folder_with_files_a_run_writes_but_no_run_is_refused_and_other_files_stay_usable(
    tmp_path, corpus
):
    """train.py never replaces a file it did not write: a folder holding files a run would write (a
    user's test.hyp, results.json, g_values.json, bpe.model) and no run of train.py (no config.json
    with a run id) is refused in one line, with --overwrite too, and nothing in it changes; a folder
    with unrelated files stays usable."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name in ("test.hyp", "results.json", "g_values.json", "bpe.model"):
        (theirs / name).write_text(f"the user's own {name}\n")
    before = snapshot(theirs)
    for extra in ([], ["--overwrite"]):
        one_line_error(
            partial(
                train_cli.main, TINY + corpus + ["--max-steps", "5", *extra, "--out", str(theirs)]
            ),
            f"--out {theirs}",
            "not a run directory of train.py",
            "bpe.model",
            "test.hyp",
        )
        assert snapshot(theirs) == before and sorted(p.name for p in theirs.iterdir()) == sorted(
            before
        )
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("seed 1 looked good\n")
    (mine / "model.pt").write_bytes(b"not a checkpoint of train.py")
    train_cli.main(TINY + corpus + ["--max-steps", "5", "--out", str(mine)])
    assert (mine / "notes.txt").read_text() == "seed 1 looked good\n" and (
        mine / "results.json"
    ).exists()
    assert (mine / "model.pt").read_bytes() == b"not a checkpoint of train.py"


def test_every_budget_stop_says_stopping_and_one_rule_owner_decides_a_resume(
    tmp_path, corpus, monkeypatch, capsys
):
    """--max-steps and --max-epochs each print their `stopping:` line. The stop rules have one owner
    (stop_reason): a run stopped by --stop-lr at an evaluation where --early-stop holds too is
    resumed with --stop-lr 0 only to stop again at once, so that resume is refused naming
    --early-stop (it trained another epoch before)."""
    for flags, line in (
        (["--max-steps", "7"], "stopping: --max-steps 7 reached"),
        (["--max-epochs", "1"], "stopping: --max-epochs 1 reached"),
    ):
        train_cli.main(TINY + corpus + [*flags, "--out", str(tmp_path / flags[0])])
        assert line in capsys.readouterr().out
    scores = iter([5.0, 4.0, 4.0, 4.0])  # dev BLEU: the second evaluation is worse than the first
    monkeypatch.setattr(train, "dev_score", lambda run: (next(scores), 1.0, 2.7))
    run = tmp_path / "both"
    train_cli.main(
        TINY
        + corpus
        + [
            "--warmup",
            "6",
            "--stop-lr",
            "10",
            "--early-stop",
            "1",
            "--max-steps",
            "20",
            "--out",
            str(run),
        ]
    )
    stopped = json.loads((run / "results.json").read_text())["stopped"]
    assert "--stop-lr" in stopped
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["train_state"]["step"] == 10
    before = snapshot(run)
    one_line_error(
        lambda: train_cli.main(["--resume", str(run), "--stop-lr", "0"]),
        "would stop again at once",
        "has not improved for 1 evaluations",
        "--early-stop",
    )
    assert snapshot(run) == before
    args = presets.resolve_flags(["--warmup", "2", "--stop-lr", "10", "--early-stop", "1"])[0]
    # both hold: the first rule names it
    assert train.stop_reason(args, 10, 1.0, [5.0, 4.0])[0] == "stop_lr"
    args.stop_lr = 0.0
    assert train.stop_reason(args, 10, 1.0, [5.0, 4.0])[0] == "early_stop"
    assert train.stop_reason(args, 10, 1.0, [4.0, 5.0]) is None


def test_decode_prints_a_checkpoints_dev_bleu_as_a_score(finished, tmp_path, capsys):
    """The dev BLEU decode.py reports of a checkpoint prints with two decimals (it printed
    100.00000000000004)."""
    ckpt = torch.load(finished / "checkpoint_best.pt", weights_only=True)
    ckpt["train_state"]["history"][-1] = 100.00000000000004
    torch.save(ckpt, tmp_path / "perfect.pt")
    (tmp_path / "in.txt").write_text("the dog sees a cat .\n")
    assert decode_cli.main([str(tmp_path / "perfect.pt"), "--input", str(tmp_path / "in.txt")]) == 0
    err = capsys.readouterr().err
    assert "dev BLEU 100.00," in err and "100.0000" not in err, err


def test_sigterm_stops_a_run_as_ctrl_c_does_and_it_resumes_from_its_last_checkpoint(
    tmp_path, corpus
):
    """SIGTERM (what SLURM sends) mid-run, to a real process: exit status 143 (Ctrl-C's is 130,
    killed_run checks it), Ctrl-C's advice in one line, every checkpoint written reads back, no
    temporary left, and the run resumes."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *TINY,
            *corpus,
            "--max-epochs",
            "1000",
            "--out",
            str(run),
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while (
        not (run / "checkpoint_last.pt").exists() and proc.poll() is None and time.time() < deadline
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, err
    assert (
        err.strip().splitlines()[-1] == f"interrupted: continue with python train.py --resume {run}"
    ), err
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]
    step = max(rundir.read_checkpoint(p)["train_state"]["step"] for p in rundir.checkpoints(run))
    assert rundir.read_checkpoint(run / "checkpoint_last.pt")["train_state"]["step"] == step >= 5
    result = train_cli.main(["--resume", str(run), "--max-steps", str(step + 5)])
    assert result["steps"] == step + 5


def test_show_prints_every_resolved_flag_for_any_preset_and_touches_nothing(
    finished, tmp_path, capsys
):
    def shown():  # {flag: [value, "given"?]} of what --show printed
        return {
            line.split()[0]: line.split()[1:]
            for line in capsys.readouterr().out.splitlines()
            if line[:2] == "--"
        }

    out = tmp_path / "never"
    assert (
        train_cli.main(
            ["--preset", "twt3-scalenorm", "--d-model", "64", "--show", "--out", str(out)]
        )
        is None
    )
    flags = shown()
    assert set(flags) == {"--" + k.replace("_", "-") for k in arguments.DEFAULTS}  # every flag
    # preset
    assert (
        flags["--d-model"] == ["64", "given"]
        and flags["--ff"] == ["2048"]
        and flags["--layers"] == ["6"]
    )
    assert (
        flags["--lr-scale"] == ["1.0"]
        and flags["--warmup"] == ["8000"]
        and flags["--beta1"] == ["0.9"]
    )
    assert not out.exists()
    # every preset, a language model's too: the idle-flag rules let --show through
    for name in presets.PRESETS:
        train_cli.main(["--preset", name, "--show", "--out", str(out)])
        assert shown()["--preset"] == [name, "given"] and not out.exists()
    # a flag given over a preset's
    train_cli.main(["--preset", "pn2-powernorm", "--show", "--seq-len", "64"])
    assert shown()["--seq-len"] == ["64", "given"]
    before = snapshot(finished)
    train_cli.main(["--resume", str(finished), "--show"])  # a resumed run's flags: its checkpoint's
    assert shown()["--d-model"] == ["32"] and snapshot(finished) == before


def test_the_checkpoint_is_written_before_the_line_that_reports_its_epoch(
    tmp_path, corpus, monkeypatch, capsys
):
    """Killed between an epoch's checkpoint and its report: the log never says an epoch was reached
    that a resume does not start from."""
    run, real = tmp_path / "run", rundir.save_checkpoints

    def killed(r, improved):
        if r.state.epoch == 2:
            raise KeyboardInterrupt
        return real(r, improved)

    monkeypatch.setattr(train, "save_checkpoints", killed)
    with pytest.raises(SystemExit) as e:
        train_cli.main(TINY + corpus + ["--max-steps", "15", "--out", str(run)])
    out = capsys.readouterr().out
    assert e.value.code == 130 and "epoch   1 | step      5" in out and "epoch   2" not in out, out
    monkeypatch.setattr(train, "save_checkpoints", real)
    train_cli.main(["--resume", str(run)])
    assert "at step 5" in capsys.readouterr().out


def test_a_flag_given_on_resume_is_compared_with_the_checkpoints_once(finished, tmp_path, capsys):
    """What a resume applies and what it refuses come from one comparison with the checkpoint's
    flags (a flag the checkpoint lacks counts as its default): the default given again is no change,
    another value of a flag that may change is applied, any other is refused with both values."""
    run = copy_run(finished, tmp_path)
    ckpt = torch.load(run / "checkpoint_last.pt", weights_only=True)
    del ckpt["args"]["log_interval"]  # as a checkpoint of a train.py without the flag would be
    torch.save(ckpt, run / "checkpoint_last.pt")
    before = snapshot(run)
    one_line_error(
        lambda: train_cli.main(
            [
                "--resume",
                str(run),
                "--max-steps",
                "20",
                "--max-epochs",
                "10",
                "--seed",
                "2",
                "--log-interval",
                "50",
            ]
        ),
        "a continued run keeps its flags",
        "--seed (1 -> 2)",
    )
    assert snapshot(run) == before
    train_cli.main(
        ["--resume", str(run), "--max-steps", "20", "--max-epochs", "10", "--log-interval", "50"]
    )
    out = capsys.readouterr().out
    assert (
        "--max-steps 20 (changed on resume)" in out and "--log-interval 50 (changed" not in out
    ), out


def test_a_checkpoint_copied_alone_into_a_folder_is_not_resumed(finished, tmp_path):
    """Issue 30's probe: --resume on a folder holding only a checkpoint copied from another run (no
    config.json) trained on from it, wrote a new run around it and ended "no checkpoint was
    written". config.json is a run's first file, so a folder without one holds no run: one line,
    nothing written."""
    folder = tmp_path / "copied"
    folder.mkdir()
    shutil.copy(finished / "checkpoint_last.pt", folder / "checkpoint_last.pt")
    before = snapshot(folder)
    one_line_error(
        lambda: train_cli.main(["--resume", str(folder), "--max-steps", "30"]),
        folder,
        "not a run directory",
        "config.json",
    )
    assert snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == [
        "checkpoint_last.pt"
    ]


def test_sigterm_stops_decode_as_ctrl_c_does(finished, tmp_path):
    """SIGTERM to decode.py while it translates to --output: exit 143, Ctrl-C's line, the output not
    written."""
    (tmp_path / "in.txt").write_text("the dog sees a cat .\n" * 20000)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "decode.py"),
            str(finished),
            "--input",
            str(tmp_path / "in.txt"),
            "--output",
            str(tmp_path / "out.hyp"),
            "--beam",
            "4",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert "loaded" in proc.stderr.readline()  # the model is loaded: it translates now
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, err
    assert (
        err.strip().splitlines()[-1]
        == f"decode.py: interrupted ({tmp_path / 'out.hyp'} was not written)"
    ), err
    assert not (tmp_path / "out.hyp").exists()


def test_a_checkpoint_of_another_run_under_a_runs_own_name_stops_the_resume_and_is_kept(
    finished, tmp_path
):
    """Issue 30's probe: another run's checkpoint copied over a run's checkpoint_last.pt was skipped
    by --resume, which went on from the run's best and then wrote its own checkpoint_last.pt over
    the copied file. Refused now, in one line; nothing changes. A folder with someone else's
    config.json (no run id) is no run's: --output may write there."""
    run = copy_run(finished, tmp_path)
    other = torch.load(run / "checkpoint_last.pt", weights_only=True)
    other["args"]["run_id"] = "another run"
    torch.save(other, run / "checkpoint_last.pt")
    before = snapshot(run)
    one_line_error(
        lambda: train_cli.main(["--resume", str(run), "--max-steps", "30"]),
        "checkpoint_last.pt",
        "another run",
        "move it out",
    )
    assert snapshot(run) == before
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"model_type": "bert"}\n')
    (tmp_path / "in.txt").write_text("the dog sees a cat .\n")
    assert (
        decode_cli.main(
            [
                str(finished),
                "--input",
                str(tmp_path / "in.txt"),
                "--output",
                str(theirs / "test.hyp"),
            ]
        )
        == 0
    )
    assert (theirs / "test.hyp").read_text().count("\n") == 1
