"""machinery/rundir.py: the run directory, checkpoints, --resume and signals.

A run directory (--out) holds one run. Training into one that already holds a run is refused unless
--resume (continue it) or --overwrite (replace it). Nothing is deleted or written before every input
is checked (open_run_dir checks, commit_run_dir makes the first change), and a lock keeps a second
process out (staging). A resumed run keeps its flags (those in RESUME_MAY_CHANGE may be given
again), its corpus and its BPE model, and starts from its last checkpoint, read with
torch.load(weights_only=True) (read_checkpoint). Checkpoints hold only tensors and plain Python
values. The last checkpoint is the resume record (the run's flags, state and random generators);
config.json is for people: a resume reads only its run_id. A run directory's files and what
--overwrite removes: RESULT_FILES, CACHE_FILES and the checkpoints; the BPE model and the encoded
caches are keyed by their content and are reused or replaced, never trusted. Ctrl-C and SIGTERM
stop a run after the step in progress, with a checkpoint of it (stop_signals); what_next says how
to go on after a run ended early.

Who calls it: train.py (setup, the loop, the final test), machinery/train_cli.py (--resume's
flags, what_next), decode.py and machinery/decode_cli.py (checkpoints, read_checkpoint),
machinery/corpora.py and machinery/presets.py. The stop rules are train.py's (stop_reason): imports
run one way, so open_run_dir and may_resume are handed them as an argument.
"""

import contextlib
import json
import os
import random
import re
import shutil
import signal
import tempfile
import uuid
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from machinery import fileio
from machinery.fileio import DataError

from machinery.fileio import read_lines

try:
    import fcntl  # a run directory's lock; POSIX only
except ImportError:  # Windows: no lock
    fcntl = None


def interrupt_on_sigterm():
    """SIGTERM (SLURM's, before its kill) raises KeyboardInterrupt(15): each command stops as Ctrl-C
    stops it."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signum)

    signal.signal(signal.SIGTERM, interrupt)


def interrupted_status(e):
    """The exit status after a KeyboardInterrupt: 128 + its signal, 130 (Ctrl-C) or 143
    (SIGTERM)."""
    return 128 + (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT)


@contextlib.contextmanager
def staging(run_dir):
    """A hidden folder inside run_dir (made, with its parents, if missing, and locked) where a run
    prepares its files. If the run fails before commit_run_dir, the run directory is as it was: the
    staging folder goes, and so do the folders made here. The lock is held until the run ends."""
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # the deepest first
    try:
        # Closing the lock's file releases the lock; the staging folder goes first.
        with contextlib.ExitStack() as held:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                # Held while training (flock): a second process is refused.
                lock = held.enter_context(open(run_dir / ".lock", "a"))
            except OSError as e:
                raise DataError(
                    f"--out {run_dir}: cannot make it or write in it ({e.strerror})"
                ) from None
            if fcntl is not None:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise DataError(
                        f"{run_dir} is in use by another process (it holds {run_dir}/.lock)"
                    ) from None
            stage = held.enter_context(
                tempfile.TemporaryDirectory(
                    prefix=".staging-", dir=run_dir, ignore_cleanup_errors=True
                )
            )
            yield Path(stage)
    except BaseException:
        # Not committed: the folders made here go, each only if empty (another run may be in a
        # parent).
        if not (run_dir / "config.json").exists() and made:
            (run_dir / ".lock").unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the first folder not empty ends it
                for p in made:
                    p.rmdir()
        raise


# A run directory's files: their names (train.py writes each by its own literal), its run id, its
# checkpoints. CHECKPOINT_FORMAT: the format of train.py's checkpoints since the checkpoint became
# the resume record (older ones are refused).
CHECKPOINT_FORMAT = 2


# checkpoint_best.pt (the best dev score), checkpoint_last.pt (the resume point),
# checkpoint_epochN.pt (epoch N).
CHECKPOINT = re.compile(r"checkpoint_(best|last|epoch(\d+))\.pt")


RESULT_FILES = (
    "config.json",
    "metrics.jsonl",
    "results.json",
    "test.hyp",
    "g_values.json",
    "train.log",
)


EVENTS = re.compile(r"events\.out\.tfevents\..+")  # train.py --tensorboard's event files


# The BPE model and the encoded caches, kept by their content's key (machinery/corpora.py).
CACHE_FILES = ("bpe.model", "bpe.key", "train.enc.pt", "dev.enc.pt")


def checkpoint_file(run_dir, which):
    """The path of a checkpoint: which is "best", "last" or an epoch's number."""
    return Path(run_dir) / f"checkpoint_{which if isinstance(which, str) else f'epoch{which}'}.pt"


def checkpoints(run_dir, use="any"):
    """The checkpoints in run_dir that `use` reads, in the order it tries them: "decode" (a run
    directory given to decode.py) the best, else the last; "test" (train.py's final test) the best;
    "average" the epochs, oldest first; "any" every one (a resume reads the last alone:
    checkpoint_file(run_dir, "last"))."""
    run_dir = Path(run_dir)
    found = sorted(
        (int(m[2] or -1), m[1], p)
        for p in (run_dir.iterdir() if run_dir.is_dir() else [])
        if (m := CHECKPOINT.fullmatch(p.name))
    )
    named, epochs = {k: p for _, k, p in found}, [p for n, _, p in found if n >= 0]
    order = {
        "decode": [named.get("best"), named.get("last")],
        "test": [named.get("best")],
        "average": epochs,
        "any": [p for *_, p in found],
    }[use]
    return [p for p in order if p is not None and p.is_file()]


def is_run_file(name):
    """Whether train.py writes a file of this name into a run directory (its lock too)."""
    return name in RESULT_FILES + CACHE_FILES + (".lock",) or bool(
        CHECKPOINT.fullmatch(name) or EVENTS.fullmatch(name)
    )


def run_id_of(path):
    """The run id a config.json, results.json or checkpoint holds (None if it holds none or is
    unreadable)."""
    try:
        # A checkpoint's flags hold its id; memory-mapped, only the few bytes of the id are read.
        if path.suffix == ".pt":
            blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("args")
        else:
            blob = json.loads(path.read_text())
    except Exception:  # unreadable, not JSON, not a checkpoint: not known to be this run's
        return None
    return (
        blob.get("run_id")
        if isinstance(blob, dict) and isinstance(blob.get("run_id"), str)
        else None
    )


def read_checkpoint(path, device="cpu"):
    """torch.load(weights_only=True) of one checkpoint file, with its checks; DataError naming it. A
    checkpoint holds only tensors and plain Python values: unpickling anything else could run code,
    so such a file is refused, never retried with the full unpickler."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such checkpoint file")
    try:
        with open(p, "rb") as f:
            head = f.read(2)
    except OSError as e:
        raise DataError(f"{p}: cannot read it ({e.strerror})") from None
    if not head.startswith(b"PK"):  # torch.save writes a zip
        raise DataError(f"{p}: refused, not a checkpoint (not a file torch.save writes)")
    try:
        ckpt = torch.load(p, map_location=device, weights_only=True)
    except Exception as e:  # any failure is the file's: say which, in one line
        why = (
            "it holds objects other than tensors and plain values, and loading those could run code"
            if "Weights only load failed" in str(e)
            else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        )
        raise DataError(f"{p}: refused, not a readable checkpoint ({why})") from None
    if not isinstance(ckpt, dict) or not all(
        isinstance(ckpt.get(k), dict) for k in ("model_config", "model")
    ):
        raise DataError(
            f"{p}: not a checkpoint of this project (no 'model_config' and 'model' entries)"
        )
    # The one check of a checkpoint's format, for decode and resume alike.
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise DataError(
            f"{p}: written by an older train.py (format {ckpt.get('format')}); start a new run"
        )
    # A checkpoint copied in from another run (decode and resume alike): its model is not this
    # run's.
    theirs, ours = (ckpt.get("args") or {}).get("run_id"), run_id_of(p.parent / "config.json")
    if ours is not None and theirs != ours:
        raise DataError(
            f"{p}: refused, a checkpoint of another run (run_id {theirs}) in the folder of run "
            f"{ours}"
        )
    return ckpt


def read_metrics(run_dir):
    """The records of RUN/metrics.jsonl; a half-written last line (a killed run) is skipped."""
    lines, rows = read_lines(Path(run_dir) / "metrics.jsonl"), []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise DataError(f"{run_dir}/metrics.jsonl: line {i + 1} is not JSON") from None
            continue
        if not isinstance(rows[-1], dict) or not isinstance(rows[-1].get("step", 0), (int, float)):
            raise DataError(
                f"{run_dir}/metrics.jsonl: line {i + 1} is not a record of train.py (a JSON object "
                f"with a numeric step)"
            )
    return rows


def budget(args):
    """The run's last step, and the flag that sets it (its code in train.py's STOPS):
    --max-steps, or --max-epochs x --epoch-size, whichever is first."""
    epochs = args.max_epochs * args.epoch_size
    return (
        (args.max_steps, "max_steps")
        if args.max_steps and args.max_steps <= epochs
        else (epochs, "max_epochs")
    )


RESUME_MAY_CHANGE = {
    "max_steps",
    "max_epochs",
    "early_stop",
    "stop_lr",
    "patience",
    "log_interval",
    "device",
    "dtype",
    "threads",
    "compile",
    "dev_beam",
    "beam",
    "alpha",
    "length_penalty",
    "keep_checkpoints",
    "save_interval",
    "data",  # a moved corpus: its hashes are checked
}


# What a command does, not a flag of its run: never compared.
ACTIONS = ("resume", "overwrite", "start_or_resume")


# What config.json records of a run beside its flags.
RUN_RECORDS = ("run_id", "corpus_sha256", "changed_on_resume", "precision")


def save_checkpoints(run, improved, epoch_end=True):
    """At an epoch's end, the best checkpoint when dev improved, epoch N's under --keep-checkpoints
    (for averaging; Code [2]: the last 5); at every save, the last, written last: the resume point,
    the one file with the optimizer's state and the random generators (twice the model's size): the
    best and epoch files hold what decoding reads. Under torchrun every rank calls it, and rank 0's
    checkpoint keeps every rank's generators: each resumes its own."""
    # This process's random generators: what a resumed run restores (restore) to continue exactly.
    rng = dict(
        torch=torch.get_rng_state(),
        python=random.getstate(),
        word_dropout=run.step_options.rng.get_state(),
        cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    )
    ranks = [None] * run.world
    if run.world > 1:
        dist.all_gather_object(ranks, rng)
    if not run.master:
        return
    s, keep, name = run.state, run.args.keep_checkpoints, partial(checkpoint_file, run.dir)
    # Only tensors and plain Python values: read back with torch.load(weights_only=True). The run's
    # flags (args: its run id and corpus hashes too) and its state (the step, the dev scores) are
    # what a resume reads.
    ckpt = {
        "format": CHECKPOINT_FORMAT,
        "model_config": asdict(run.model.cfg),
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "bpe_model_proto": (run.dir / "bpe.model").read_bytes(),
        "src_lang": run.langs[0],
        "tgt_lang": run.langs[1],
        "train_state": asdict(run.state),
        "args": vars(run.args),
        "world": run.world,
        "rng": dict(rng, **({"ranks": ranks} if run.world > 1 else {})),
    }
    weights = {k: v for k, v in ckpt.items() if k not in ("optimizer", "rng")}
    if improved:
        fileio.atomic_write(name("best"), weights)
    if keep > 0 and epoch_end:
        fileio.atomic_write(name(s.epoch), weights)
        name(s.epoch - keep).unlink(missing_ok=True)
    fileio.atomic_write(name("last"), ckpt)


@contextlib.contextmanager
def stop_signals(run):
    """While training: Ctrl-C (SIGINT) or SIGTERM (a scheduler's, before its kill) stops the run
    after the step in progress, with a checkpoint of that step; a second one stops it at once, from
    the last checkpoint. Yields requested(synced), asked after each step: the signal that stops the
    run after it (0: none). Under torchrun every rank must stop at the same step: the ranks agree
    (the largest of their signals), at every step on the CPU, at host syncs (synced) on a GPU, where
    reading the answer would otherwise wait for the GPU at every step."""
    box = [0]

    def handler(signum, frame):
        if box[0]:
            raise KeyboardInterrupt(signum)
        box[0] = signum
        run.log(
            f"{signal.Signals(signum).name}: stopping after this step, with a checkpoint of it "
            f"(again: at once)"
        )

    def requested(synced):
        if run.world > 1 and (run.device.type == "cpu" or synced):
            agreed = torch.tensor([box[0]], device=run.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            return int(agreed)
        return box[0] if run.world == 1 else 0

    # At the end, each signal gets back the handler it had before (signal.signal returns the handler
    # it replaces).
    with contextlib.ExitStack() as previous:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous.callback(signal.signal, sig, signal.signal(sig, handler))
        yield requested


def restore(run, ckpt):
    """The model, optimizer, training state and random generators of the checkpoint a resumed run
    starts from (machinery/train_cli.py's resume_flags read it, may_resume let it go on)."""
    try:
        run.model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise fileio.DataError(
            f"{run.dir}: its checkpoint does not fit the model of its flags "
            f"({str(e).splitlines()[0]})"
        ) from None
    if ckpt["world"] != run.world:
        raise fileio.DataError(
            f"{run.dir}: the run trained on {ckpt['world']} processes and this is {run.world}; "
            f"resume it with as many (a step's batches and batch statistics depend on them)"
        )
    run.state = replace(run.state, **ckpt["train_state"])  # its stop as may_resume decided
    rng = (
        ckpt["rng"]["ranks"][run.rank]
        if len(ckpt["rng"].get("ranks", [])) == run.world
        else ckpt["rng"]
    )
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    run.step_options.rng.set_state(rng["word_dropout"])


def flag_changes(diff):  # "--flag (old -> new), ..." of differing_flags' answer
    return ", ".join(f"--{k.replace('_', '-')} ({old!r} -> {v!r})" for k, (old, v) in diff.items())


def may_resume(run_dir, args, ckpt, diff, hashes, stop_reason):
    """Whether the run in run_dir may go on from ckpt: DataError naming what stops it, a flag given
    that a continued run keeps, its corpus changed, its budget spent (--max-steps, --max-epochs), or
    a stop that would come again at once (--stop-lr, --early-stop); each says which flag would let
    it go on."""
    # config.json is a run's first file (on resume, read for its run_id alone): a checkpoint copied
    # in alone is no run.
    if not (run_dir / "config.json").exists():
        raise fileio.DataError(
            f"--resume {run_dir}: not a run directory of train.py (no config.json); start a new "
            f"run with --out"
        )
    if refused := {k: d for k, d in diff.items() if k not in RESUME_MAY_CHANGE}:
        raise fileio.DataError(
            f"--resume {run_dir}: a continued run keeps its flags, and these differ from its "
            f"checkpoint's: {flag_changes(refused)} (start a new run with another --out)"
        )
    if changed := [s for s, h in hashes.items() if h != args.corpus_sha256.get(s)]:
        raise fileio.DataError(
            f"--resume {run_dir}: the corpus changed since the run started "
            f"({', '.join(changed)} differ{'s' if len(changed) == 1 else ''})"
        )
    last, code = budget(args)  # train.py's train_loop's last step
    flag = f"--{code.replace('_', '-')} {getattr(args, code)}"
    done, results = ckpt["train_state"]["step"], {}
    with contextlib.suppress(OSError, ValueError):
        results = json.loads((run_dir / "results.json").read_text())
    # Finished: its results.json, of this run, at this step; else killed before its test, which is
    # left to do.
    finished = (
        isinstance(results, dict)
        and results.get("run_id") == args.run_id
        and results.get("steps") == done
    )
    if done > last or done == last and finished:
        raise fileio.DataError(
            f"--resume {run_dir}: the run has trained {done} steps, "
            f"{'past' if done > last else 'all'} that {flag} allows: nothing to train; give a "
            f"larger {flag.split()[0]} to continue"
        )
    state = ckpt["train_state"]
    # A checkpoint's stop is --stop-lr's or --early-stop's (a budget's comes after the last
    # checkpoint): the stop rules under the resumed run's flags decide whether it holds (one killed
    # in its final test goes straight to the test).
    state["stopped"] = state["stopped"] and stop_reason(
        args, state["step"], state["lr_decay"], state["history"]
    )
    if state["stopped"] and finished:
        fix = (
            "a smaller --stop-lr"
            if state["stopped"][0] == "stop_lr"
            else "a larger --early-stop (0: off)"
        )
        raise fileio.DataError(
            f"--resume {run_dir}: the run stopped ({state['stopped'][1]}) and would stop again at "
            f"once: nothing to train; give {fix} to continue"
        )


def open_run_dir(args, pairs, log, stack, master, resumed, stop_reason):
    """(the run directory, the checkpoint to resume from or None, the staging folder) after every
    check of the run directory, unchanged here: commit_run_dir changes it once every other input is
    checked too. Rank 0 holds its lock (in stack); the other ranks write nothing (staging None).
    --benchmark trains in a temporary directory, removed."""
    if args.benchmark:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="benchmark-")))
        return tmp, None, tmp
    if not str(args.out).strip():  # Path("") would be this folder
        raise fileio.DataError("--out is empty: give the run directory, e.g. --out runs/NAME")
    # The checkpoint that machinery/train_cli.py's resume_flags read, if any.
    run_dir, ckpt = Path(args.out), resumed[0] if resumed else None
    if run_dir.is_symlink() and not run_dir.exists():
        raise fileio.DataError(
            f"--out {run_dir}: a symbolic link to {os.readlink(run_dir)}, which does not exist"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise fileio.DataError(f"--out {run_dir}: a file, not a folder")
    # The files a run writes in run_dir, but a lock; rank 0 checks (the other ranks come after its
    # commit).
    held = ""
    if run_dir.is_dir() and master and not args.resume:  # --resume: its checkpoint is the run
        held = ", ".join(
            sorted(p.name for p in run_dir.iterdir() if is_run_file(p.name) and p.name != ".lock")
        )
    # train.py never replaces a file it did not write.
    if held and run_id_of(run_dir / "config.json") is None:
        raise fileio.DataError(
            f"--out {run_dir}: not a run directory of train.py (no config.json with a run_id), "
            f"yet it holds files a run writes ({held}), so none is replaced; choose another --out"
        )
    if held and not args.overwrite:  # commit_run_dir removes that run id's files
        raise fileio.DataError(
            f"{run_dir} already holds a run ({held}): continue it with --resume {run_dir}, "
            f"or replace it with --overwrite"
        )
    # The corpus's hashes, split by split.
    hashes = {split: fileio.pairs_sha256(split_pairs) for split, split_pairs in pairs.items()}
    if args.resume:
        may_resume(run_dir, args, *resumed, hashes, stop_reason)
        for k, v in args.changed_on_resume.items():
            log(f"resume: --{k.replace('_', '-')} {v} (changed on resume)")
    else:
        # Recorded in config.json and the checkpoints.
        args.run_id, args.corpus_sha256 = uuid.uuid4().hex, hashes
    return run_dir, ckpt, stack.enter_context(staging(run_dir)) if master else None


def commit_run_dir(args, run_dir, stage, ckpt, log):
    """The run directory's first change, once every input has been checked: the leftovers of killed
    runs go, an overwritten run's files go, config.json is written, then the staged files move
    in."""
    # The leftovers of killed runs: atomic_write's temporaries (.NAME.xxxx.tmp) and staging folders.
    for p in run_dir.iterdir():
        written = p.name[1:].rsplit(".", 2)[0]  # .NAME.xxxx.tmp: a temporary of NAME
        temporary = p.name.startswith(".") and p.name.endswith(".tmp") and is_run_file(written)
        if not temporary and not (p.name.startswith(".staging-") and p != stage):
            continue
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    # The run --overwrite replaces: its results but its config.json (replaced next), and its
    # checkpoints (known by their run id).
    replaces = run_id_of(run_dir / "config.json") if args.overwrite else None
    if replaces:
        gone = [
            p for p in run_dir.iterdir() if p.name in RESULT_FILES[1:] or EVENTS.fullmatch(p.name)
        ]
        gone += [p for p in checkpoints(run_dir) if run_id_of(p) == replaces]
        for f in gone:
            f.unlink()
        log(f"overwrite: removed the {len(gone)} files of the run that was in {run_dir}")
    # config.json before the staged files: a kill at any point leaves a folder that holds a run
    # (Ctrl-C's advice holds).
    fileio.atomic_write(run_dir / "config.json", json.dumps(vars(args), indent=2) + "\n")
    log.path = run_dir / "train.log"  # the lines logged so far, and every line after
    for f in stage.iterdir():
        os.replace(f, run_dir / f.name)
    # What a killed run logged after its checkpoint goes (and a half-written last line).
    if ckpt is not None and (run_dir / "metrics.jsonl").exists():
        rows = read_metrics(run_dir)
        fileio.atomic_write(
            run_dir / "metrics.jsonl",
            "".join(
                json.dumps(r) + "\n"
                for r in rows
                if r.get("step", 1 << 62) <= ckpt["train_state"]["step"]
            ),
        )


def what_next(args):
    """What to do after a run ended early (Ctrl-C, a full disk), from what its run directory holds
    now: resume from its checkpoint, or start it again (with --overwrite once the run is in the
    directory: its config.json)."""
    run_dir = Path(args.out)
    if args.benchmark:
        return "run the benchmark again (it writes no run directory)"
    if getattr(args, "run_id", None) is None or run_id_of(run_dir / "config.json") != args.run_id:
        return f"the run had not started in {run_dir}: start it again with the same command"
    # The resume point (save_checkpoints) is this run's.
    if run_id_of(checkpoint_file(run_dir, "last")) == args.run_id:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        how = (
            "python train.py"
            if world == 1
            else f"torchrun (as many processes as before, {world}) train.py"
        )
        return f"continue with {how} --resume {run_dir}"
    # The first checkpoint: an evaluation's, or --save-interval's.
    first = min(args.epoch_size, args.save_interval or args.epoch_size)
    return (
        f"nothing to resume (the first checkpoint comes at step {first}): start it again with "
        f"the same command and --overwrite"
    )
