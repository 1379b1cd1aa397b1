"""machinery/train_cli.py: TODO."""

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
    log = RunLog()  # Appendix C: the console and train.log
    args, given = resolve_flags(argv, log)
    # --resume (Appendix E): the run's own flags, from its last checkpoint, and what may change
    try:
        args, resumed = (
            resume_flags(args, given, log) if args.resume or args.start_or_resume else (args, None)
        )
        check_flags(args, given)
        for note in flag_notes(args):  # the first screen says what a flag did to another
            log(f"note: {note}")
        # --show: every flag's value in this run (those given marked); no run, no --out
        if given.get("show"):
            for k in DEFAULTS:
                print(
                    f"--{k.replace('_', '-'):17s} {getattr(args, k)!s:22s} {'given' if k in given else ''}".rstrip()
                )
            return None
        with contextlib.ExitStack() as stack:  # holds the run directory's lock until the end
            run = train.setup(args, stack, log, resumed)  # section 3
            return (
                benchmark(run, train.train_step) if args.benchmark else train.train_loop(run)
            )  # Appendix C; section 4
    except fileio.WriteFailed as e:  # a full disk: what was written before is intact
        sys.exit(f"error: {e}: make room, then {what_next(args)}")
    except fileio.DataError as e:
        sys.exit(f"error: {e}")
    # Ctrl-C, SIGTERM (data.interrupt_on_sigterm); under torchrun rank 0 advises
    except KeyboardInterrupt as e:
        print(
            "interrupted" + (f": {what_next(args)}" if os.environ.get("RANK", "0") == "0" else ""),
            file=sys.stderr,
        )
        sys.exit(rundir.interrupted_status(e))  # 130 (Ctrl-C) or 143 (SIGTERM), as shells expect


def flag_notes(args):
    """What a flag given does to another flag, said on the run's first screen rather than silently
    (resolve_flags says what --lr does to a preset's or --config's --lr-scale)."""
    norms = dict.fromkeys((args.norm, args.encoder_norm, args.decoder_norm))  # in order, once each
    batch_norms = ", ".join(n for n in norms if n and NORMS[n].batch_stats)
    return [
        note
        for note, said in (
            (
                f"--schedule {args.schedule} has no warmup: --warmup {args.warmup} only divides --lr-scale, "
                f"a constant LR of {args.lr:.3g}",
                args.lr_scale is not None and not train.SCHEDULES[args.schedule].warms_up,
            ),
            (
                "--compile pads lengths to multiples of 8 (a change to --pn-variant code's backward, which averages over "
                "padding too)"
                + (
                    f"; it keeps no batch-norm diagnostics of --norm {batch_norms}"
                    if batch_norms
                    else ""
                ),
                args.compile,
            ),
        )
        if said
    ]


def check_flags(args, given):
    """What no flag's type= can check alone, before any work, refused in one line naming the flag:
    train.py's one table of which flags each task and mode reads (data.idle_flag: a flag given that
    would do nothing in this configuration, a new run's or a resumed one's, is refused, not silently
    ignored), then the values that do not fit the others'."""
    norms = {args.norm, args.encoder_norm, args.decoder_norm}
    if idle := arguments.idle_flag(
        (
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
                train.SCHEDULES[args.schedule].warms_up or args.lr_scale is not None,
                "the length of a warmup, "
                f"which --schedule {args.schedule} does not have (with --lr-scale it sets the LR)",
            ),
            (
                ("seq_len", "attention", "lm_batches"),
                args.task == "lm",
                "a language model's, so it needs --task lm",
            ),
            (
                (
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
                ),
                args.task == "mt",
                "a translator's; a language model (--task lm) has no source, "
                "is scored by perplexity, and its QKNorm L is --seq-len",
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
                "the name of a corpus's files in --data DIR; without --data the "
                "built-in corpus is used",
            ),
            (("profile",), args.benchmark, "for the steps of --benchmark N: give --benchmark too"),
            (
                ("tensorboard",),
                not args.benchmark,
                "for a run's records; --benchmark writes no run directory",
            ),
            (
                ("patience", "decay_factor"),
                train.SCHEDULES[args.schedule].decays,
                "for validation-based decay (--schedule "
                f"{', '.join(k for k, e in train.SCHEDULES.items() if e.decays)}), not --schedule {args.schedule}",
            ),
        ),
        given,
    ):
        sys.exit("error: {} is {}".format(*idle))
    # The multi-linear attention holds H L^2 x D weights in W^O and H L^2 x (B L) numbers in its
    # tensor T, a layer: at most 2^31 in all (8.6 GB in fp32), as training keeps T several times
    # over (PTB's preset at --seq-len 512: 23 GB).
    wo, t = (
        args.heads * args.seq_len**2 * n * (args.dec_layers or args.layers)
        for n in (args.d_model, max(args.batch_tokens, args.seq_len))
    )
    for flag, wrong, why in (
        (
            "seq_len",
            args.attention == "multilinear" and wo + t > 2**31,
            f"the multi-linear attention would "
            f"need {wo:,} weights in W^O and {t:,} numbers in T ({4 * (wo + t) / 1e9:,.1f} GB in fp32), at most "
            f"2^31 = {2**31:,} in all: give a smaller --seq-len (or --batch-tokens)",
        ),
        (
            "seq_len",
            args.task == "lm" and args.qknorm and args.qk_length is None and args.seq_len < 2,
            "is the "
            "language model's QKNorm L (give --qk-length), and g0 = log2(L^2 - L) needs L >= 2",
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
    ):
        if wrong:
            sys.exit(
                f"error: --{flag.replace('_', '-')}: {why} (got {getattr(args, flag, None)!r})"
            )


def resume_flags(args, given, log):
    """--resume RUN (or --start-or-resume when --out holds a checkpoint): (the flags of RUN's last
    checkpoint, with the given ones that may change, (that checkpoint, {a flag given that differs
    from its: (its value, the one given)})); DataError if it is missing, does not read back, or an
    older train.py wrote it. may_resume refuses the other flags that differ, before any change.
    --start-or-resume without a checkpoint: (args, None), a new run, replacing (--overwrite) a
    folder that holds only a run with the same flags killed before its first checkpoint."""
    run_dir = Path(args.resume or args.out)
    # the resume point (save_checkpoints)
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
    # damaged, or another run's: never replaced (its best checkpoint still decodes)
    except fileio.DataError as e:
        raise fileio.DataError(
            f"--resume {run_dir}: {e}; move it out of the folder (and start again)"
        ) from None
    log(f"resume: {path} at step {ckpt['train_state']['step']}")
    saved = ckpt["args"]
    # config.json edited by hand: said, never replaced unannounced
    with contextlib.suppress(OSError, ValueError):
        if (edited := json.loads(config.read_text())) != json.loads(json.dumps(saved)):
            keys = (
                [k for k in {**saved, **edited} if edited.get(k) != saved.get(k)]
                if isinstance(edited, dict)
                else []
            )
            log(
                f"resume: {config} differs from the checkpoint ({', '.join(keys) or 'not an object'}"
                f"): the checkpoint's flags hold, and the file is written again from them"
            )
    diff = differing_flags(saved, args, given, run_dir)
    changed = {k: v for k, (_, v) in diff.items() if k in RESUME_MAY_CHANGE}
    return argparse.Namespace(
        **{
            **DEFAULTS,
            **saved,
            **changed,
            "resume": str(run_dir),
            "out": str(run_dir),
            # an action of the run's first start, not one of its flags
            "overwrite": False,
            "changed_on_resume": {**saved.get("changed_on_resume", {}), **changed},
        }
    ), (ckpt, diff)


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
    # SIGTERM (SLURM's, before its kill) stops a run as Ctrl-C does: main() says how
    rundir.interrupt_on_sigterm()
    main()
