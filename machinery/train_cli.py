"""machinery/train_cli.py: `python train.py`, the program: its main(), and the checks of its flags.

train.py's `if __name__ == "__main__":` hands over to this module through runpy, which runs main():
it resolves the flags (machinery/presets.py's resolve_flags: the defaults, then a --preset's, then
the command line's), takes a resumed run's own flags from its last checkpoint (resume_flags),
refuses in one line what no flag's type= can check alone (check_flags: a flag that would do nothing
here, a value that does not fit the others'), says on the first screen what a flag did to another
(flag_notes), then sets up the run (train.py section 3) and trains it (section 4), or times it
(--benchmark, machinery/speed.py). A full disk, a corpus's error, Ctrl-C or SIGTERM ends it with one
line that says what to do next, and the exit status a shell expects.

Called by `python train.py` and by the tests; a reader of the book never needs to open it.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import train
from machinery import arguments, fileio, rundir
from machinery.arguments import DEFAULTS
from machinery.logbook import RunLog
from machinery.presets import resolve_flags
from machinery.rundir import ACTIONS, RESUME_MAY_CHANGE, flag_changes, what_next
from machinery.speed import benchmark
from norms import NORMS


def main(argv=None):
    log = RunLog()  # the console and train.log (machinery/logbook.py)
    args, given = resolve_flags(argv, log)
    try:
        # --resume (resume_flags below): the run's own flags, from its last checkpoint, and what may
        # change.
        resumed = None
        if args.resume or args.start_or_resume:
            args, resumed = resume_flags(args, given, log)
        check_flags(args, given)
        for note in flag_notes(args):  # the first screen says what a flag did to another
            log(f"note: {note}")
        if given.get("show"):
            show_flags(args, given)
            return None
        with contextlib.ExitStack() as stack:  # holds the run directory's lock until the end
            run = train.setup(args, stack, log, resumed)  # train.py section 3
            if args.benchmark:
                return benchmark(run, train.train_step)  # machinery/speed.py
            return train.train_loop(run)  # train.py section 4
    except fileio.WriteFailed as e:  # a full disk: what was written before is intact
        sys.exit(f"error: {e}: make room, then {what_next(args)}")
    except fileio.DataError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt as e:
        # Ctrl-C, or SIGTERM (rundir.interrupt_on_sigterm): under torchrun, rank 0 alone says what
        # to do next.
        advice = f": {what_next(args)}" if os.environ.get("RANK", "0") == "0" else ""
        print(f"interrupted{advice}", file=sys.stderr)
        sys.exit(rundir.interrupted_status(e))  # 130 (Ctrl-C) or 143 (SIGTERM), as shells expect


def show_flags(args, given):
    """--show: every flag's value in this run, those given marked; no run, no --out."""
    for k in DEFAULTS:
        mark = "given" if k in given else ""
        print(f"--{k.replace('_', '-'):17s} {getattr(args, k)!s:22s} {mark}".rstrip())


def flag_notes(args):
    """What a flag given does to another flag, said on the run's first screen rather than silently
    (resolve_flags says what --lr does to a preset's or --config's --lr-scale)."""
    norms = dict.fromkeys((args.norm, args.encoder_norm, args.decoder_norm))  # in order, once each
    batch_norms = ", ".join(n for n in norms if n and NORMS[n].batch_stats)
    compile_note = (
        "--compile pads lengths to multiples of 8 (a change to --pn-variant code's backward, which "
        "averages over padding too)"
    )
    if batch_norms:
        compile_note += f"; it keeps no batch-norm diagnostics of --norm {batch_norms}"
    notes = (
        (
            f"--schedule {args.schedule} has no warmup: --warmup {args.warmup} only divides "
            f"--lr-scale, a constant LR of {args.lr:.3g}",
            args.lr_scale is not None and not train.SCHEDULES[args.schedule].warms_up,
        ),
        (compile_note, args.compile),
    )
    return [note for note, said in notes if said]


def check_flags(args, given):
    """What no flag's type= can check alone, before any work, refused in one line naming the flag:
    first a flag given that would do nothing in this configuration, a new run's or a resumed one's
    (idle_rules, by arguments.idle_flag: refused, not silently ignored), then the values that do not
    fit the others' (value_rules)."""
    if idle := arguments.idle_flag(idle_rules(args), given):
        sys.exit("error: {} is {}".format(*idle))
    for flag, wrong, why in value_rules(args):
        if wrong:
            sys.exit(
                f"error: --{flag.replace('_', '-')}: {why} (got {getattr(args, flag, None)!r})"
            )


def idle_rules(args):
    """train.py's one table of which flags each task and mode reads: (flags, read, why), the flags
    read only where `read` holds; a flag given where it is not is refused as "--flag is why"."""
    norms = {args.norm, args.encoder_norm, args.decoder_norm}
    schedule = train.SCHEDULES[args.schedule]
    decaying = ", ".join(k for k, e in train.SCHEDULES.items() if e.decays)
    translator = (
        "src",
        "tgt",
        "enc_layers",
        "encoder_norm",
        "max_len",
        "beam",
        "dev_beam",
        "alpha",
        "length_penalty",
        "qk_percentile",
    )
    return (
        (
            ("qk_length", "qk_percentile", "qk_no_g", "qk_norm_v"),
            args.qknorm,
            "QKNorm's, so it needs --qknorm",
        ),
        (
            ("pn_variant", "pn_alpha_fwd", "pn_alpha_bkw", "pn_warmup"),
            "power" in norms,
            "PowerNorm's, so it needs --norm, --encoder-norm or --decoder-norm power",
        ),
        (
            ("warmup",),
            schedule.warms_up or args.lr_scale is not None,
            f"the length of a warmup, which --schedule {args.schedule} does not have (with "
            "--lr-scale it sets the LR)",
        ),
        (
            ("seq_len", "attention", "lm_batches"),
            args.task == "lm",
            "a language model's, so it needs --task lm",
        ),
        (
            translator,
            args.task == "mt",
            "a translator's; a language model (--task lm) has no source, is scored by perplexity, "
            "and its QKNorm L is --seq-len",
        ),
        (
            ("mask", "positions", "head_dim", "attn_bias"),
            args.attention == "multilinear",
            "the multi-linear attention's: give --attention multilinear",
        ),
        (
            ("sdpa", "attn_dropout"),
            args.attention == "softmax",
            "the softmax attention's; the multi-linear attention has neither",
        ),
        (
            ("src", "tgt"),
            args.data is not None,
            "the name of a corpus's files in --data DIR; without --data the built-in corpus is "
            "used",
        ),
        (("profile",), args.benchmark, "for the steps of --benchmark N: give --benchmark too"),
        (
            ("tensorboard",),
            not args.benchmark,
            "for a run's records; --benchmark writes no run directory",
        ),
        (
            ("patience", "decay_factor"),
            schedule.decays,
            f"for validation-based decay (--schedule {decaying}), not --schedule {args.schedule}",
        ),
    )


def value_rules(args):
    """The values that do not fit the others': (flag, wrong, why), refused as "--flag: why (got
    its value)" where wrong holds."""
    # The multi-linear attention holds H L^2 x D weights in W^O and H L^2 x (B L) numbers in its
    # tensor T, a layer: at most 2^31 in all (8.6 GB in fp32), as training keeps T several times
    # over (PTB's preset at --seq-len 512: 23 GB).
    wo, t = (
        args.heads * args.seq_len**2 * n * (args.dec_layers or args.layers)
        for n in (args.d_model, max(args.batch_tokens, args.seq_len))
    )
    return (
        (
            "seq_len",
            args.attention == "multilinear" and wo + t > 2**31,
            f"the multi-linear attention would need {wo:,} weights in W^O and {t:,} numbers in T "
            f"({4 * (wo + t) / 1e9:,.1f} GB in fp32), at most 2^31 = {2**31:,} in all: give a "
            "smaller --seq-len (or --batch-tokens)",
        ),
        (
            "seq_len",
            args.task == "lm" and args.qknorm and args.qk_length is None and args.seq_len < 2,
            "is the language model's QKNorm L (give --qk-length), and g0 = log2(L^2 - L) needs "
            "L >= 2",
        ),
        (
            "bpe_size",
            args.bpe_size < 1 and args.task == "mt",
            "must be at least 1 (0, whitespace words, is for --task lm)",
        ),
        (
            "qknorm",
            args.attention == "multilinear" and args.qknorm,
            "normalises the queries and keys of a softmax; the multi-linear attention has none",
        ),
        ("d_model", args.d_model % args.heads, f"must be divisible by --heads {args.heads}"),
        (
            "tensorboard",
            args.tensorboard and not importlib.util.find_spec("tensorboard"),
            f"needs the package tensorboard, which is not installed: {fileio.EXTRAS}",
        ),
        (
            "src",
            (args.src is None) != (args.tgt is None),
            "give both language suffixes, --src and --tgt, or neither",
        ),
        (
            "data",
            args.data is not None and args.src is None and args.task == "mt",
            "also give --src and --tgt, e.g. --src en --tgt de for DIR/train.en and DIR/train.de",
        ),
    )


def resume_flags(args, given, log):
    """--resume RUN (or --start-or-resume when --out holds a checkpoint): (the flags of RUN's last
    checkpoint, with the given ones that may change, (that checkpoint, {a flag given that differs
    from its: (its value, the one given)})); DataError if it is missing, does not read back, or an
    older train.py wrote it. may_resume refuses the other flags that differ, before any change.
    --start-or-resume without a checkpoint: (args, None), a new run, replacing (--overwrite) a
    folder that holds only a run with the same flags killed before its first checkpoint."""
    run_dir = Path(args.resume or args.out)
    # The resume point (rundir.save_checkpoints writes it), and the run's flags as a file.
    path, config = rundir.checkpoint_file(run_dir, "last"), run_dir / "config.json"
    if args.start_or_resume and not path.exists():
        if rundir.run_id_of(config):
            if diff := differing_flags(json.loads(config.read_text()), args, {}, run_dir):
                raise fileio.DataError(
                    f"--start-or-resume: {run_dir} holds a run with other flags: "
                    f"{flag_changes(diff)}; choose another --out"
                )
            args.overwrite = True  # it never wrote a checkpoint: started again
        return args, None
    if not path.exists():
        raise fileio.DataError(
            f"--resume {run_dir}: nothing to resume from, no {path.name} (the run may have stopped "
            f"before its first checkpoint); start it again with --overwrite"
        )
    try:
        ckpt = rundir.read_checkpoint(path)  # which also refuses an older train.py's checkpoint
    except fileio.DataError as e:
        # Damaged, or another run's: never replaced (its best checkpoint still decodes).
        raise fileio.DataError(
            f"--resume {run_dir}: {e}; move it out of the folder (and start again)"
        ) from None
    log(f"resume: {path} at step {ckpt['train_state']['step']}")
    saved = ckpt["args"]
    note_edited_config(config, saved, log)
    if "precision" not in saved and saved.get("dtype") == "bf16":
        # Written before --dtype auto, when bf16 meant bf16 on a GPU and fp32 on the CPU.
        saved = {**saved, "dtype": "auto"}
    diff = differing_flags(saved, args, given, run_dir)
    changed = {k: v for k, (_, v) in diff.items() if k in RESUME_MAY_CHANGE}
    flags = {
        **DEFAULTS,
        **saved,
        **changed,
        "resume": str(run_dir),
        "out": str(run_dir),
        "overwrite": False,  # an action of the run's first start, not one of its flags
        "changed_on_resume": {**saved.get("changed_on_resume", {}), **changed},
    }
    return argparse.Namespace(**flags), (ckpt, diff)


def note_edited_config(config, saved, log):
    """A run's config.json edited by hand is said, never replaced unannounced: the checkpoint's
    flags (saved) hold, and the file is written again from them."""
    with contextlib.suppress(OSError, ValueError):
        if (edited := json.loads(config.read_text())) != json.loads(json.dumps(saved)):
            keys = []
            if isinstance(edited, dict):
                keys = [k for k in {**saved, **edited} if edited.get(k) != saved.get(k)]
            which = ", ".join(keys) or "not an object"
            log(
                f"resume: {config} differs from the checkpoint ({which}): the checkpoint's flags "
                "hold, and the file is written again from them"
            )


def differing_flags(saved, args, given, run_dir):
    """{flag: (the run's value, the command's)}: the one comparison of a command with a run's saved
    flags (its checkpoint's, or its config.json alone): the flags given, or under --start-or-resume
    every flag, given or not."""
    flags = {k: getattr(args, k) for k in DEFAULTS} if args.start_or_resume else given
    return {
        k: (saved.get(k, DEFAULTS.get(k)), v)
        for k, v in flags.items()
        if k not in ACTIONS
        and not (k == "out" and Path(v) == Path(run_dir))
        and v != saved.get(k, DEFAULTS.get(k))
    }


if __name__ == "__main__":
    # SIGTERM (SLURM's, before its kill) stops a run as Ctrl-C does, and main() says how to go on.
    rundir.interrupt_on_sigterm()
    main()
