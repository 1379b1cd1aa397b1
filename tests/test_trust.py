"""Trust: checkpoints that run no code, run directories that never lose or mix work, failures
that say so in one line, before any training, and exit non-zero.

Every test is one claim, on tiny models (a few seconds each): the built-in language pair, 300
sentence pairs, d 32, one layer, 5 steps an epoch.
"""
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import decode
import train

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--d-model", "32", "--ff", "64", "--heads", "2", "--layers", "1", "--bpe-size", "300", "--batch-tokens", "512",
        "--epoch-size", "5", "--threads", "1", "--log-interval", "5", "--dev-beam", "1", "--beam", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = data.make_toy_corpus(tmp_path_factory.mktemp("toy"), n_train=300, n_dev=8, n_test=8)
    return ["--data", str(d), "--src", "src", "--tgt", "tgt"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
    """A finished run of 3 epochs (15 steps): config, metrics, 3 epoch checkpoints, best, last, results."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train.main(TINY + corpus + ["--max-steps", "15", "--out", str(run)])
    return run


def copy_run(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def snapshot(d):
    """{relative path: sha256} of every file under d: any change, deletion or new file shows."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".lock"}


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
    msg = one_line_error(lambda: decode.main([str(tmp_path / "evil.pt"), "--input", str(tmp_path / "in.txt")]),
                         "evil.pt", "refused")
    assert "could run code" in msg and not marker.exists()


def test_an_untrusted_checkpoint_runs_no_code_on_resume(finished, tmp_path, corpus):
    run = copy_run(finished, tmp_path)
    marker = tmp_path / "pwned"
    good = torch.load(run / "checkpoint_last.pt", weights_only=True)
    for f in run.glob("checkpoint_*.pt"):
        torch.save(dict(good, extra=Payload(marker)), f)  # every checkpoint poisoned
    one_line_error(lambda: train.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"]),
                   "nothing to resume")
    assert not marker.exists()


# --- 2. a new run never changes an existing run directory ----------------------------------
def test_a_new_run_never_changes_an_existing_run_directory(finished, tmp_path, corpus):
    run = copy_run(finished, tmp_path)
    before = snapshot(run)
    # a bad corpus: reported before anything in the run directory is touched (metrics.jsonl was deleted)
    one_line_error(lambda: train.main(TINY + ["--data", str(tmp_path / "nowhere"), "--src", "x", "--tgt", "y",
                                              "--out", str(run)]), "nowhere")
    # a new configuration into it: refused, with the two ways out
    one_line_error(lambda: train.main(TINY + corpus + ["--layers", "2", "--out", str(run)]),
                   "already holds a run", "--resume", "--overwrite")
    # --benchmark never writes into a run directory (it wiped the quick start's files)
    result = train.main(TINY + corpus + ["--benchmark", "1", "--out", str(run)])
    assert result["steps"] == 1
    assert snapshot(run) == before


def test_overwrite_replaces_the_run_and_average_stays_within_one_run(finished, tmp_path, corpus):
    run = copy_run(finished, tmp_path)
    old_id = json.loads((run / "config.json").read_text())["run_id"]
    stale = tmp_path / "checkpoint_epoch3.pt"
    shutil.copy(run / "checkpoint_epoch3.pt", stale)
    train.main(TINY + corpus + ["--max-steps", "10", "--seed", "2", "--overwrite", "--out", str(run)])
    config = json.loads((run / "config.json").read_text())
    assert config["run_id"] != old_id and config["seed"] == 2
    assert [p.name for p in decode.epoch_checkpoints(run)] == ["checkpoint_epoch1.pt", "checkpoint_epoch2.pt"]
    assert all(json.loads(l)["step"] <= 10 for l in (run / "metrics.jsonl").read_text().splitlines()
               if "step" in json.loads(l))
    decode.load_checkpoint(run, average=2)  # the new run's two epochs average
    shutil.copy(stale, run / "checkpoint_epoch3.pt")  # an epoch checkpoint of the old run, left behind
    with pytest.raises(data.DataError, match="another run"):
        decode.load_checkpoint(run, average=3)


def test_a_second_process_on_a_directory_in_use_is_refused(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    with open(run / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's lock (flock is per open file)
        before = snapshot(run)
        one_line_error(lambda: train.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"]),
                       "in use by another process")
        assert snapshot(run) == before


def test_temporary_files_have_unique_names_and_a_kill_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "checkpoint_last.pt"
    data.atomic_write(target, {"step": 1})
    names, real_replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (names.append(Path(a).name), real_replace(a, b)))
    data.atomic_write(target, {"step": 2})
    data.atomic_write(target, {"step": 3})
    assert len(set(names)) == 2 and all(n.endswith(".tmp") for n in names)  # no shared .tmp name
    monkeypatch.setattr(os, "replace", real_replace)

    def killed_save(obj, f):  # half a file written, then the process is interrupted
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", killed_save)
    with pytest.raises(KeyboardInterrupt):
        data.atomic_write(target, {"step": 4})
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"step": 3}  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_last.pt"]  # no temporary left


# --- 3. resume is honest --------------------------------------------------------------------
def test_resume_applies_the_flags_that_may_change_and_refuses_the_others(finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path)
    msg = one_line_error(lambda: train.main(["--resume", str(run), "--max-steps", "25", "--d-model", "64",
                                             "--lr", "0.1"]), "--d-model (32 -> 64)", "--lr (0.002 -> 0.1)")
    assert "--max-steps" not in msg
    capsys.readouterr()
    train.main(["--resume", str(run), "--max-steps", "25", "--max-epochs", "10"])
    out = capsys.readouterr().out
    assert "resume: --max-steps 25 (changed on resume)" in out and "step     25" in out
    config = json.loads((run / "config.json").read_text())
    assert config["max_steps"] == 25 and config["changed_on_resume"] == {"max_steps": 25, "max_epochs": 10}


def test_resume_says_what_it_cannot_honour(finished, tmp_path, corpus):
    run = copy_run(finished, tmp_path)
    for f in run.glob("checkpoint_*.pt"):
        f.unlink()  # a config.json but no checkpoint (the run died before its first evaluation)
    one_line_error(lambda: train.main(["--resume", str(run)]), "nothing to resume", "--overwrite")
    one_line_error(lambda: train.main(["--resume", str(tmp_path / "none")]), "no readable config.json")
    # an edited corpus under the same run: refused, naming the split
    run = tmp_path / "edited"
    shutil.copytree(finished, run)
    toy = tmp_path / "toy"
    shutil.copytree(corpus[1], toy)
    config = json.loads((run / "config.json").read_text())
    data.atomic_write(run / "config.json", json.dumps(dict(config, data=str(toy))))
    (toy / "train.tgt").write_text((toy / "train.tgt").read_text().replace(" .", " !", 1))
    one_line_error(lambda: train.main(["--resume", str(run)]), "the corpus changed", "train")


def test_resume_survives_a_half_written_metrics_line_and_a_damaged_newest_checkpoint(finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 16, "loss": 4.2, "gno')  # the kill came mid-line
    last = run / "checkpoint_last.pt"
    last.write_bytes(last.read_bytes()[:1000])  # and mid-checkpoint (no atomic writer, say)
    capsys.readouterr()
    train.main(["--resume", str(run), "--max-steps", "20", "--max-epochs", "10"])
    out = capsys.readouterr().out
    assert "resume: skipped" in out and "checkpoint_epoch3.pt at step 15 (the newest that reads back)" in out
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]  # every line is JSON
    assert [r["step"] for r in rows if "gnorm" in r] == list(range(1, 21))


# --- 4. bad flags fail early, in one line, before any training ------------------------------
@pytest.mark.parametrize("argv, flag", [
    (["--dev-beam", "0"], "--dev-beam"), (["--beam", "0"], "--beam"),
    (["--schedule", "valdecay", "--patience", "0"], "--patience"), (["--heads", "0"], "--heads"),
    (["--log-interval", "0"], "--log-interval"), (["--relu-dropout", "2"], "--relu-dropout"),
    (["--beta2", "1.5"], "--beta2"), (["--attn-dropout", "-0.5"], "--attn-dropout"),
    (["--enc-layers", "-1"], "--enc-layers"), (["--qk-length", "1.5"], "--qk-length"), (["--lr", "0"], "--lr"),
    (["--src", "en", "--tgt", "de"], "--src"), (["--accumulate", "0"], "--accumulate"),
    (["--decay-factor", "1.5"], "--decay-factor"), (["--clip", "-1"], "--clip"),
])
def test_every_bad_flag_fails_at_start_in_one_line(argv, flag, tmp_path):
    one_line_error(lambda: train.main(argv + ["--out", str(tmp_path / "run")]), flag)
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_huge_dev_line_is_cut_with_a_count_not_fatal(tmp_path, capsys):
    corpus = data.make_toy_corpus(tmp_path / "toy", n_train=300, n_dev=8, n_test=8)
    with open(corpus / "dev.src", "a") as f:
        f.write(" ".join(["Thullockmeyth"] * 3000) + "\n")  # thousands of BPE tokens
    with open(corpus / "dev.tgt", "a") as f:
        f.write("na .\n")
    capsys.readouterr()
    result = train.main(TINY + ["--data", str(corpus), "--src", "src", "--tgt", "tgt", "--max-len", "60",
                                "--max-steps", "5", "--out", str(tmp_path / "run")])
    assert "data: dev: 1 source lines longer than --max-len 60 BPE tokens are cut to it" in capsys.readouterr().out
    assert result["best_step"] == 5


# --- 5. failures exit non-zero ---------------------------------------------------------------
def test_a_diverged_run_exits_non_zero_keeps_its_last_good_checkpoint_and_writes_strict_json(
        tmp_path, corpus, monkeypatch):
    real_step = train.train_step
    calls = {"n": 0}

    def diverging_step(*a, **k):  # a real step, whose loss turns NaN at step 12
        calls["n"] += 1
        loss, nll, gnorm, n = real_step(*a, **k)
        return (loss * float("nan"), nll, gnorm * float("inf"), n) if calls["n"] == 12 else (loss, nll, gnorm, n)

    monkeypatch.setattr(train, "train_step", diverging_step)
    run = tmp_path / "run"
    one_line_error(lambda: train.main(TINY + corpus + ["--max-steps", "20", "--out", str(run)]),
                   "diverged", "step 12", "checkpoint_last.pt")
    for line in (run / "metrics.jsonl").read_text().splitlines():  # strict JSON: no NaN / Infinity literals
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    bad = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "nonfinite" in l]
    assert bad == [{"step": 12, "loss": None, "gnorm": None, "lr": bad[0]["lr"], "tokens": bad[0]["tokens"],
                    "nonfinite": ["loss", "gnorm"]}]
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["step"] == 10  # the last good one


def test_a_non_finite_gradient_norm_with_a_finite_loss_is_a_divergence_too(tmp_path, corpus, monkeypatch):
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
    one_line_error(lambda: train.main(TINY + corpus + ["--max-steps", "20", "--out", str(run)]),
                   "diverged", "the gradient norm became inf", "step 7")
    assert torch.load(run / "checkpoint_last.pt", weights_only=True)["step"] == 5  # the last good one


def test_a_huge_but_finite_loss_is_a_warning_and_the_run_goes_on(tmp_path, corpus, monkeypatch, capsys):
    real_step = train.train_step

    def exploding_step(*a, **k):  # a per-token loss of 40 nats: far worse than guessing uniformly
        loss, nll, gnorm, n = real_step(*a, **k)
        return loss * 0 + 40.0 * n, nll, gnorm, n

    monkeypatch.setattr(train, "train_step", exploding_step)
    capsys.readouterr()
    result = train.main(TINY + corpus + ["--max-steps", "10", "--warmup", "2", "--out", str(tmp_path / "run")])
    assert "warning: the training loss 40.00 is far above a uniform guess" in capsys.readouterr().out
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "gnorm" in r][-1] == 10 and any("warning" in r for r in rows)
    assert result is not None  # it ended normally, with its test BLEU


# --- 6. decode.py ----------------------------------------------------------------------------
def test_decode_checks_its_output_folder_before_translating(finished, tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text("the dog sees a cat .\n")
    monkeypatch.setattr(decode, "translate", lambda *a, **k: pytest.fail("translated before checking --output"))
    one_line_error(lambda: decode.main([str(finished), "--input", str(tmp_path / "in.txt"),
                                        "--output", str(tmp_path / "missing" / "out.txt")]), "missing", "--output")


def test_decode_stdin_closed_or_undecodable_is_one_line(finished, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    sys.stdin.close()
    one_line_error(lambda: decode.main([str(finished)]), "stdin is closed", "--input")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the dog .\nthe \xff cat .\n")))
    one_line_error(lambda: decode.main([str(finished)]), "stdin", "line 2", "0xff")


def test_decode_names_the_line_of_undecodable_input_and_refuses_a_negative_length(finished, tmp_path):
    (tmp_path / "in.txt").write_bytes(b"the dog .\nthe cat .\nthe \xe9 bird .\n")
    one_line_error(lambda: decode.main([str(finished), "--input", str(tmp_path / "in.txt")]), "in.txt", "line 3")
    p = subprocess.run([sys.executable, "decode.py", str(finished), "--max-len-b", "-100"], cwd=ROOT,
                       capture_output=True, text=True, input="the dog .\n")
    assert p.returncode != 0 and "--max-len-b must be 0 or more" in p.stderr
