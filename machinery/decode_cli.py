"""machinery/decode_cli.py: the command line of decode.py: its flags, modes, file checks, main().

`python decode.py ...` runs this module's main() through runpy (the last lines of decode.py), and
main() calls the chapter's functions. build_parser() holds the flags (python decode.py --help);
MODES says which flags each mode reads and NEEDS which flag needs another, so that parse_args()
refuses a flag that would do nothing. run() checks every file first (an output can be written,
and it is neither an input nor a file of a run directory), reads every input, then runs one mode:
--compare (decode.py Appendix A), --plot (machinery/plots.py), --svd, --g-table and --attention
(analyse: decode.py Appendix C), a translator (translate_and_score: decode.py sections 5-7) or a
language model (language_model: decode.py section 8). The user's mistakes are DataErrors: one
line, exit status 1; Ctrl-C or SIGTERM exits with 130 or 143.

--benchmark: the speed of greedy and beam search with the BLEU each one buys, timed by
machinery/speed.py's timed after a warm-up (allocator, kernels, thread pools); it prints and
asserts nothing. The references [1]-[3] are decode.py's: TwT, PowerNorm and QKNorm.
"""

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console

import data
import decode
from machinery import arguments, fileio, processes, rundir
from machinery.arguments import alpha_range, count, fraction, positive, positive_int, threads
from machinery.fileio import DataError
from machinery.plots import figure, plot_runs, render_heatmap, save_heatmap_png
from machinery.rundir import checkpoints
from machinery.speed import timed
from model import PAD, has_bf16, precision


def analyse(args, model, tokenizer):
    """--svd ([2] Figure 6's curve), --g-table and --attention: print, write nothing but the
    optional PNG."""
    if args.svd:
        sv = decode.singular_values(model)
        marks = sorted(
            {0, len(sv) // 10, len(sv) // 4, len(sv) // 2, 3 * len(sv) // 4, len(sv) - 1}
        )
        print(
            "singular values of the embedding matrix over the largest ([2] Figure 6): "
            + ", ".join(f"sigma_{i + 1} {sv[i]:.3f}" for i in marks)
        )
        if args.png:
            fig = figure(args.png, figsize=(5, 3.5))
            ax = fig.add_subplot(
                xlabel="index", ylabel="sigma_i / sigma_1", title="embedding singular values"
            )
            ax.plot(range(1, len(sv) + 1), sv)
            fig.tight_layout()
            fig.savefig(args.png, dpi=120)
            print(f"wrote {args.png}")
    if model.cfg.lm and args.attention is not None:
        raise DataError(
            f"{args.checkpoint}: a language model: --attention draws a translator's maps"
        )
    if args.g_table:
        decode.print_g_table(model, Console())
    if args.attention is not None:
        w, rows, cols = decode.attention_weights(
            model,
            tokenizer,
            src_line=args.attention,
            tgt_line=args.attention_target,
            layer=args.layer,
            head=args.head,
            kind=args.kind,
        )
        teacher = "given target" if args.attention_target is not None else "greedy translation"
        print(
            f"{args.kind} attention, layer {args.layer}, head {args.head} ({teacher}); "
            "rows = queries"
        )
        print(render_heatmap(w, rows, cols))
        if args.png and save_heatmap_png(
            w, rows, cols, args.png, f"{args.kind} layer {args.layer} head {args.head}"
        ):
            print(f"wrote {args.png}", file=sys.stderr)


def benchmark(model, tokenizer, lines, refs, args, search):
    """--benchmark: greedy search, then a beam search (the run's beam, else 4), each timed on the
    lines after a warm-up; prints sentences/s, target tokens/s and, with refs, the BLEU it buys."""
    device = next(model.parameters()).device
    print(
        f"benchmark: {len(lines)} sentences on {device} (torch threads {torch.get_num_threads()}), "
        f"batch_tokens {args.batch_tokens}",
        file=sys.stderr,
    )
    # Greedy and a beam, each in fp32 and under bf16 autocast (the CPU's too: model.precision).
    for beam, bf16 in itertools.product((1, search.beam if search.beam > 1 else 4), (False, True)):
        how = replace(search, beam=beam, bf16=bf16)
        # Its warm-up on the first 32 lines, then its timing on them all.
        decode.translate(model, tokenizer, lines[:32], how, args.batch_tokens, ids=True)
        everything = functools.partial(
            decode.translate,
            model=model,
            tokenizer=tokenizer,
            lines=lines,
            search=how,
            batch_tokens=args.batch_tokens,
            ids=True,
        )
        ids, secs = timed(everything, device)
        n_tok = sum(len(h) + 1 for h in ids)  # output tokens, EOS counted (as in training)
        name = "greedy (beam 1)" if beam == 1 else f"beam {beam}, alpha {args.alpha}"
        name += ", bf16" if bf16 else ", fp32"
        line = (
            f"{name:>28}: {len(lines) / secs:8.1f} sentences/s {n_tok / secs:9.0f} target "
            f"tokens/s ({secs:.2f} s)"
        )
        if refs is not None:
            line += f"  BLEU {decode.bleu([tokenizer.decode(h) for h in ids], refs).score:.2f}"
        print(line, file=sys.stderr)


def build_parser():
    ap = argparse.ArgumentParser(
        description="Translate with a trained checkpoint (beam search or greedy), score it "
        "(tokenized BLEU, SacreBLEU, chrF), test significance, and look inside the model."
    )
    ap.add_argument(
        "checkpoint",
        nargs="?",
        help="a checkpoint .pt file, or a run directory "
        "(its best checkpoint, else its last); not needed with --compare",
    )
    ap.add_argument("--input", help="source text, one sentence a line (default: stdin)")
    ap.add_argument("--output", help="where to write translations, one a line (default: stdout)")
    ap.add_argument(
        "--ref",
        help="reference translations: print SacreBLEU's BLEU and chrF, then the tokenized BLEU "
        "(unsmoothed, as multi-bleu.perl), each with its signature, on stderr",
    )
    ap.add_argument(
        "--json",
        metavar="FILE.json",
        help="with --ref: also the scores, as SacreBLEU's CLI writes them",
    )
    ap.add_argument(
        "--tokenized",
        action="store_true",
        help="the references (and so the outputs) are already tokenized, e.g. the Moses-tokenized "
        "IWSLT'15 en-vi of [1] or the TED pairs as shipped: tokenized BLEU scores them as they "
        "are, which is exactly multi-bleu.perl ([1] appendix A). Without it, raw text is "
        "13a-tokenized first (prepare de-en writes raw text: leave it off there)",
    )
    ap.add_argument(
        "--lowercase",
        action="store_true",
        help="case-insensitive BLEU and chrF (PowerNorm [2] reports case-insensitive BLEU on "
        "IWSLT14)",
    )
    ap.add_argument(
        "--beam",
        type=positive_int,
        help="beam size; 1 = greedy search (default: the run's test beam, as train.py used it; "
        "TwT: 4)",
    )
    ap.add_argument(
        "--alpha",
        type=alpha_range,
        help="length penalty alpha (default: the run's; TwT: 0.6 with gnmt; "
        "PowerNorm: 1.0 with fairseq)",
    )
    ap.add_argument(
        "--length-penalty",
        choices=decode.PENALTIES,
        help="gnmt: score / ((5 + |Y|) / 6)^alpha (Wu et al. 2016; TwT, QKNorm); fairseq: "
        "score / |Y|^alpha (Ott et al. 2019; PowerNorm); default: the run's",
    )
    ap.add_argument(
        "--max-len-b",
        type=count,
        default=50,
        help="maximum output length = source length + this (TwT code: 50)",
    )
    ap.add_argument(
        "--max-len",
        type=positive_int,
        default=1024,
        help="source lines longer than this (BPE tokens) are cut to it, with a count on stderr "
        "(one huge line must not exhaust memory)",
    )
    ap.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available"
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="auto: bf16 autocast on a GPU that computes bf16 natively, else fp32 (on the CPU "
        "too); bf16: bf16 autocast on a GPU or the CPU (emulated, slower than fp32, on a CPU "
        "without AVX512-BF16, AMX or Arm's BF16); fp32: fp32 throughout (train.py's rule, "
        "model.precision)",
    )
    ap.add_argument(
        "--batch-tokens",
        type=positive_int,
        help="source tokens per batch (sentences x longest length), a language model's tokens per "
        "batch (default: the run's, as its own dev and test; else 4096)",
    )
    ap.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
    ap.add_argument(
        "--threads", type=threads, help="CPU threads (torch.set_num_threads; default: torch's)"
    )
    ap.add_argument(
        "--reference",
        action="store_true",
        help="run every equation as written, with no fast path anywhere (norms.py section 1)",
    )
    ap.add_argument(
        "--benchmark",
        action="store_true",
        help="time greedy (beam 1) and beam search on --input (after a warm-up); print "
        "sentences/s, target tokens/s and, with --ref, the BLEU of each",
    )
    ev = ap.add_argument_group("evaluation and analysis")
    ev.add_argument(
        "--average",
        type=count,
        default=0,
        metavar="N",
        help="translate with the average of the run directory's last N epoch checkpoints "
        "(PowerNorm's released script: 5; its paper: 10); floats are averaged, integer/bool "
        "buffers copied",
    )
    ev.add_argument(
        "--ppl",
        action="store_true",
        help="with --ref: also print the label-smoothed and plain perplexity (teacher forced, "
        "[1] Table 8); a language model: the perplexity of the text of --input (or stdin)",
    )
    ev.add_argument(
        "--label-smoothing",
        type=fraction,
        default=None,
        help="epsilon for --ppl (default: the checkpoint's training value, else 0.1)",
    )
    ev.add_argument(
        "--compare",
        nargs="+",
        metavar="FILE",
        help="BASELINE SYSTEM [SYSTEM ...]: a paired test (SacreBLEU's) of each system's output "
        "file against the baseline's, on --ref: BLEU and chrF, 95%% CI, p-value; no checkpoint "
        "needed",
    )
    ev.add_argument(
        "--test",
        choices=["bs", "ar"],
        default="bs",
        help="--compare's test: paired bootstrap resampling (Koehn 2004) or paired approximate "
        "randomization (Riezler and Maxwell 2005)",
    )
    ev.add_argument(
        "--samples",
        type=positive_int,
        help="bs resamples or ar trials of --compare (default 1000, 10000)",
    )
    ev.add_argument(
        "--seed",
        type=int,
        default=12345,
        help="resampling seed for --compare (SacreBLEU's default); --sample's seed",
    )
    ev.add_argument(
        "--attention",
        metavar="SOURCE",
        help="print the attention map of this source sentence (QKNorm [3] Figures 1-2), "
        "teacher-forced on --attention-target or the model's own greedy translation",
    )
    ev.add_argument(
        "--attention-target", metavar="TARGET", help="the target sentence for --attention"
    )
    ev.add_argument("--layer", type=int, default=0, help="layer of --attention (0-based)")
    ev.add_argument("--head", type=int, default=0, help="head of --attention (0-based)")
    ev.add_argument(
        "--kind",
        default="cross",
        choices=["cross", "enc", "dec"],
        help="--attention: decoder-encoder (cross), encoder self (enc) or decoder self (dec)",
    )
    ev.add_argument("--png", help="--attention: also save the map as a PNG (needs matplotlib)")
    ev.add_argument(
        "--g-table",
        action="store_true",
        help="print every learned scalar g (ScaleNorm, QKNorm) by depth ([1] Figures 3-4)",
    )
    ev.add_argument(
        "--plot",
        nargs="+",
        metavar="RUN",
        help="overlay training runs' curves from RUN/metrics.jsonl into --out FILE.png: dev BLEU "
        "([1] Fig. 1), dev perplexity, training loss, gradient norm ([1] Fig. 2), learned g by "
        "depth ([1] Figs. 3-4), QKNorm's g, batch vs running statistics ([2] Figs. 2-4), each "
        "panel the runs have data for; needs matplotlib (" + fileio.EXTRAS + ")",
    )
    ev.add_argument("--out", metavar="FILE.png", help="the picture --plot writes")
    ev.add_argument(
        "--leak",
        action="store_true",
        help="a language model: how much changing the tokens after the middle of a segment moves "
        "the predictions before it when the batch norms use batch statistics, as in training (one "
        "batch of --batch-tokens from --input)",
    )
    ev.add_argument(
        "--leak-mode",
        choices=["train", "eval"],
        default="train",
        help="--leak: the batch norms as in training, or the model as evaluated (eval: 0 for a "
        "causal model, not for an unmasked one)",
    )
    ev.add_argument(
        "--svd",
        action="store_true",
        help="print the singular values of the embedding matrix over the largest ([2] Figure 6); "
        "with --png also draw them",
    )
    lm = ap.add_argument_group("a language model (train.py --task lm)")
    lm.add_argument(
        "--generate", metavar="PREFIX", help="continue this text until EOS or --max-tokens"
    )
    lm.add_argument(
        "--sample",
        action="store_true",
        help="--generate: sample from the softmax instead of the most probable token",
    )
    lm.add_argument(
        "--temperature", type=positive, default=1.0, help="--sample: softmax(logits / T)"
    )
    lm.add_argument(
        "--max-tokens",
        type=positive_int,
        default=50,
        help="--generate: at most this many new tokens",
    )
    lm.add_argument(
        "--context",
        type=count,
        default=0,
        metavar="N",
        help="--ppl: each token predicted with at least N tokens of the text before it, in windows "
        "of --seq-len sliding by --seq-len - N ([2] A.2, Transformer-XL's evaluation); 0: "
        "non-overlapping segments (train.py's number)",
    )
    lm.add_argument(
        "--seq-len",
        type=positive_int,
        help="--ppl and --generate: the segment (context) length (default: the run's; a "
        "multi-linear attention is built for its own and takes no longer one)",
    )
    return ap


# Which flags each mode reads: decode.py's one table. A mode is chosen by its flag (the first of
# MODES given), else by the checkpoint (a translator, a language model); a flag given that its mode
# does not read is refused (idle_flag).
MODEL = {"checkpoint", "average", "device", "dtype", "reference", "threads"}
SEARCH = {"beam", "alpha", "length_penalty", "max_len_b", "max_len", "batch_tokens"}
# Looking inside reads no search flag: it decodes greedily, if at all (--attention, no target).
LOOK = MODEL | {"g_table", "attention", "attention_target", "layer", "head", "kind", "png"}
TRANSLATE = (
    MODEL
    | SEARCH
    | {
        "input",
        "output",
        "ref",
        "json",
        "tokenized",
        "lowercase",
        "progress",
        "ppl",
        "label_smoothing",
        "benchmark",
    }
)
LM = {
    "batch_tokens",
    "input",
    "ppl",
    "context",
    "leak",
    "leak_mode",
    "generate",
    "sample",
    "temperature",
    "max_tokens",
    "seed",
    "seq_len",
}
MODES = {
    "compare": {"compare", "ref", "test", "samples", "seed", "tokenized", "lowercase"},
    "plot": {"plot", "out"},
    "svd": MODEL | {"svd", "png"},
    "g_table": LOOK,
    "attention": LOOK,
    "benchmark": MODEL | SEARCH | {"benchmark", "input", "ref"},
    "a translator": TRANSLATE,
    "a language model": MODEL - {"average"} | LM,
}
# A flag that only works with another ("--sample is for --generate"), checked whatever the mode.
NEEDS = {
    "out": ("plot",),
    "context": ("ppl",),
    "leak_mode": ("leak",),
    "sample": ("generate",),
    "max_tokens": ("generate",),
    "temperature": ("sample",),
    "samples": ("compare",),
    "test": ("compare",),
    "seed": ("compare", "sample"),
    "tokenized": ("ref",),
    "lowercase": ("ref",),
    "json": ("ref",),
    "label_smoothing": ("ppl",),
    "attention_target": ("attention",),
    "png": ("attention", "svd"),
    "layer": ("attention",),
    "head": ("attention",),
    "kind": ("attention",),
}


def idle_flag(mode, given):
    """Why the first flag given that `mode` does not read (MODES) is refused, or None (the rule of
    machinery/arguments.py's idle_flag)."""
    how = mode if " " in mode else "--" + mode.replace("_", "-")
    if idle := arguments.idle_flag([(sorted(given - MODES[mode]), False, how)], given):
        return f"{'a checkpoint' if idle[0] == '--checkpoint' else idle[0]} does nothing with {how}"


def parse_args(argv=None):
    """The flags, refused (argparse's usage error, exit status 2) where one is missing, out of
    range, or would do nothing."""
    ap = build_parser()
    args = ap.parse_args(argv)
    # The flags given a value of their own.
    args.given = {f for f, v in vars(args).items() if v != ap.get_default(f)}
    # What --compare reads and what --plot writes.
    for mode, flag, what in (("compare", "ref", "--ref"), ("plot", "out", "--out FILE.png")):
        if getattr(args, mode) and not getattr(args, flag):
            ap.error(f"--{mode} needs {what}")
    if not args.compare and not args.plot and not args.checkpoint:
        ap.error("a checkpoint (file or run directory) is needed, except with --compare or --plot")
    # SacreBLEU takes 0 as "no seed": another resampling at every run.
    if args.compare and args.seed < 1:
        ap.error(f"--seed must be at least 1 for --compare (got {args.seed!r})")
    needs = [
        ((f,), args.given & set(n), " or ".join(f"--{x.replace('_', '-')}" for x in n))
        for f, n in NEEDS.items()
    ]
    if idle := arguments.idle_flag(needs, args.given):  # the rule train.py's flags follow too
        output = "; translations go to --output" if idle[0] == "--out" else ""
        ap.error("{} is for {}: give it too".format(*idle) + output)
    # A mode's flag chooses the mode, else the checkpoint's kind does (in run).
    mode = next((m for m in MODES if m in args.given), None)
    if mode and (why := idle_flag(mode, args.given)):
        ap.error(why)
    return args


def check_files(args):
    """The files decode.py would write, checked before any work: never what it reads (--input,
    --ref, the checkpoint), and each one writable (check_output_file)."""
    if args.output:
        out = Path(args.output).resolve()
        for flag, path in (
            ("--input", args.input),
            ("--ref", args.ref),
            ("the checkpoint", args.checkpoint),
        ):
            if path and out.exists() and Path(path).exists() and out.samefile(path):
                raise DataError(
                    f"--output {args.output}: is {flag} {path}; write the translations elsewhere"
                )
    # --json's .json: no text decode.py reads; a run's results.json is refused.
    for flag, suffix in (("output", None), ("json", ".json"), ("png", ".png"), ("out", ".png")):
        if path := getattr(args, flag):
            check_output_file(path, f"--{flag}", suffix)


def check_output_file(path, flag, suffix=None):
    """DataError naming the flag unless `path` can be written: not a folder, in a folder that exists
    and takes a new file (tried, not guessed from permissions), with `suffix` if given, and not a
    file of any run of train.py."""
    p = Path(path)
    if suffix and p.suffix.lower() != suffix:
        raise DataError(f"{flag} {path}: the file name must end in {suffix}")
    if p.is_dir():
        raise DataError(f"{flag} {path}: a folder, not a file")
    if is_stream(p):  # a device or a pipe (/dev/stdout, a FIFO): written as a stream
        if not os.access(p, os.W_OK):
            raise DataError(f"{flag} {path}: cannot write to it")
        return
    folder = p.resolve().parent  # a symbolic link: its file is replaced, not the link
    if not folder.is_dir():
        raise DataError(f"{flag} {path}: its folder {folder} does not exist")
    if rundir.is_run_file(p.resolve().name) and (
        rundir.run_id_of(folder / "config.json") or checkpoints(folder)
    ):
        raise DataError(
            f"{flag} {path}: a file of the run directory {folder} (train.py writes it); "
            "write elsewhere"
        )
    try:
        tempfile.TemporaryFile(dir=folder).close()  # a file made there and removed
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot write into {folder} ({e.strerror})") from None


def run(args):
    """Everything main() does, raising DataError for the user's mistakes."""
    check_files(args)
    if args.compare:
        return decode.compare(args)
    if args.plot:
        return plot_runs(args.plot, args.out)
    device = processes.start_device(args)
    # --dtype's precision on this device (model.precision, train.py's rule too): bf16 or fp32.
    bf16, why = precision(device, args.dtype)
    args.dtype = "bf16" if bf16 else "fp32"
    if bf16 and not has_bf16(device):
        print(f"note: {why}", file=sys.stderr)
    # Every input is read and checked before any work; stdin is read last.
    if args.png:  # it needs matplotlib
        figure(args.png, "--png")
    lines, refs = (fileio.read_lines(path) if path else None for path in (args.input, args.ref))
    model, tokenizer, ckpt = decode.load_checkpoint(args.checkpoint, device, average=args.average)
    if args.svd or args.g_table or args.attention is not None:
        return analyse(args, model, tokenizer)
    if why := idle_flag("a language model" if model.cfg.lm else "a translator", args.given):
        raise DataError(f"{args.checkpoint}: {why}")
    run_defaults(args, ckpt, model.cfg.lm)
    if model.cfg.lm:
        return language_model(args, model, tokenizer, lines)
    if args.ppl and not args.ref:
        raise DataError(
            "--ppl of a translator needs --ref (and the sources in --input or on stdin)"
        )
    return translate_and_score(
        args, model, tokenizer, ckpt, read_stdin() if lines is None else lines, refs
    )


def run_defaults(args, ckpt, lm):
    """The flags not given that default to the run's own: its checkpoint's value, checked by the
    flag's own type (not trusted), else TwT's beam 4, alpha 0.6, gnmt and label smoothing 0.1; a
    language model's segment length, else 32; the batches of the run's dev and test, else 4096 (a
    language model's NLL in the same order: results.json's ppl)."""
    saved = ckpt.get("args") if isinstance(ckpt.get("args"), dict) else {}
    parser = build_parser()
    parser.exit_on_error = False  # a value the flag refuses raises argparse.ArgumentError
    fallback = (
        {"seq_len": 32}
        if lm
        else {"beam": 4, "alpha": 0.6, "label_smoothing": 0.1, "length_penalty": "gnmt"}
    )
    for flag, default in dict(fallback, batch_tokens=4096).items():
        if getattr(args, flag) is None:
            option, v = "--" + flag.replace("_", "-"), saved.get(flag, default)
            # The flag's own type and choices (build_parser), on the value as the command line
            # would give it.
            try:
                setattr(args, flag, getattr(parser.parse_args([f"{option}={v}"]), flag))
            except argparse.ArgumentError:
                raise DataError(
                    f"{args.checkpoint}: its saved {option} {v!r} is not one decode.py takes; "
                    f"give {option}"
                ) from None


def translate_and_score(args, model, tokenizer, ckpt, lines, refs):
    """A translator: translate the lines (to --output or stdout), and score them against refs."""
    if refs is not None and len(refs) != len(lines):
        raise DataError(
            f"{args.ref}: {len(refs)} lines, but {args.input or 'stdin'} has {len(lines)}"
        )
    # Nothing to score or time.
    if (refs is not None or args.benchmark) and not any(line.strip() for line in lines):
        what = "--ppl" if args.ppl else f"--ref {args.ref}" if refs is not None else "--benchmark"
        raise DataError(
            f"{what}: nothing to score, {args.input or 'stdin'} has no non-empty source line"
        )
    if n_long := decode.count_long(tokenizer, lines, args.max_len):
        print(
            f"note: {n_long} source lines longer than --max-len {args.max_len} BPE tokens are "
            "cut to it",
            file=sys.stderr,
        )
    avg = f", average of {len(ckpt['averaged_from'])} epochs" if "averaged_from" in ckpt else ""
    state = ckpt.get("train_state") or {}
    dev_bleu = (state.get("history") or [math.nan])[-1]
    print(
        f"loaded {args.checkpoint} (step {state.get('step')}, dev BLEU {dev_bleu:.2f}, "
        f"{ckpt.get('src_lang', '?')}->{ckpt.get('tgt_lang', '?')}{avg}); beam {args.beam}, "
        f"{args.length_penalty} length penalty alpha {args.alpha}",
        file=sys.stderr,
    )
    search = decode.Search(
        beam=args.beam,
        alpha=args.alpha,
        max_len_b=args.max_len_b,
        max_src_len=args.max_len,
        bf16=args.dtype == "bf16",
        penalty=args.length_penalty,
    )
    if args.benchmark:
        return benchmark(model, tokenizer, lines, refs, args, search)
    hyps = decode.translate(model, tokenizer, lines, search, args.batch_tokens, args.progress)
    write_translations(args.output, "".join(h + "\n" for h in hyps))
    args.output_written = True  # for the message of a Ctrl-C while scoring
    if refs is not None:
        report_scores(args, model, tokenizer, lines, refs, hyps)


def write_translations(output, text):
    """The translations to --output, else to stdout."""
    # A file is replaced atomically (a kill leaves the old file or the new one); through a symbolic
    # link, the file it points to is replaced, not the link (resolve).
    if output and not is_stream(output):
        fileio.atomic_write(Path(output).resolve(), text)
        return
    # A stream (is_stream) is appended to, not cut: /dev/stdout may be a file the shell opened
    # (> out.txt 2>&1).
    with open(output, "a", encoding="utf-8") if output else contextlib.nullcontext(sys.stdout) as f:
        print(text, end="", file=f, flush=True)


def report_scores(args, model, tokenizer, lines, refs, hyps):
    """The scores of hyps against refs on stderr (decode.py section 6), into --json if given, and
    with --ppl the test perplexity (section 7)."""
    if args.tokenized and (share := decode.attached_punctuation(refs)) > 0.03:
        print(
            f"note: --tokenized, but {100 * share:.0f}% of the words of {args.ref} have "
            "punctuation attached: it is not tokenized, so 'tokenized BLEU' scores those as words "
            "(drop --tokenized to 13a-tokenize both sides first)",
            file=sys.stderr,
        )
    s = decode.scores(hyps, refs, args.tokenized, args.lowercase)  # the --json file's content
    print(decode.score_report(s), file=sys.stderr)
    if args.json:  # atomically, as --output
        fileio.atomic_write(Path(args.json).resolve(), json.dumps(s, indent=2) + "\n")
    if args.ppl:
        ppl = decode.perplexity(
            model,
            tokenizer,
            zip(lines, refs, strict=True),
            label_smoothing=args.label_smoothing,
            batch_tokens=args.batch_tokens,
            bf16=args.dtype == "bf16",
        )
        print(
            f"test perplexity: label-smoothed (eps {args.label_smoothing}) "
            f"{ppl['smoothed_ppl']:.2f}, plain {ppl['ppl']:.2f} over {ppl['n_tokens']} target "
            "tokens",
            file=sys.stderr,
        )


def is_stream(path):
    """A device, a pipe, or an open file's path (/dev/stdout, /dev/fd/N, /proc/self/fd/N: maybe a
    file the shell opened): written to, never replaced."""
    p = Path(path).absolute()
    descriptor = re.fullmatch(r"/dev/(stdout|stderr|fd/\d+)|/proc/[^/]+/fd/\d+", str(p))
    return bool(descriptor) or p.exists() and not p.is_file()


def read_stdin():
    """The lines of stdin, read once, exactly (machinery/fileio.py's split_lines)."""
    try:
        raw = sys.stdin.buffer.read()
    except (AttributeError, ValueError, OSError):  # None, closed or unreadable
        raise DataError("stdin is closed or unreadable: give the text with --input FILE") from None
    return fileio.split_lines(raw, "stdin")  # undecodable bytes: DataError naming the line


def language_model(args, model, tokenizer, lines):
    """--ppl, --leak and --generate of a language model (decode.py section 8; data.py section 8)."""
    seq_len = args.seq_len  # the run's own unless given (run_defaults)
    if model.cfg.attention == "multilinear" and seq_len > model.cfg.seq_len:
        raise DataError(
            f"--seq-len {seq_len}: {args.checkpoint} has a multi-linear attention built for "
            f"segments of {model.cfg.seq_len} tokens; give --seq-len {model.cfg.seq_len} or less"
        )
    # --ppl and --leak read their text (--input or stdin) once; its empty lines are skipped, as
    # training does.
    if args.ppl or args.leak:
        if not (text := [line for line in (read_stdin() if lines is None else lines) if line]):
            raise DataError(f"{args.input or 'stdin'}: no text to score (every line is empty)")
    elif args.generate is None:
        raise DataError(
            f"{args.checkpoint}: a language model: give --ppl, --leak (with --input) or "
            "--generate PREFIX"
        )
    elif args.input:
        raise DataError("--input does nothing with --generate (its text is for --ppl and --leak)")
    if args.leak:
        print_leak(args, model, tokenizer, text)
    if args.ppl:
        ppl = decode.lm_perplexity(
            model,
            tokenizer,
            lines=text,
            seq_len=seq_len,
            batch_tokens=args.batch_tokens,
            bf16=args.dtype == "bf16",
            context=args.context,
        )
        how = (
            f"at least {args.context} tokens of context"
            if args.context
            else f"segments of {seq_len}"
        )
        print(
            f"perplexity {ppl['ppl']:.2f} over {ppl['n_tokens']} tokens ({how}); per word "
            f"{ppl['word_ppl']:.2f} over {ppl['n_words']} words and EOS; unknown (<unk>) tokens: "
            f"{ppl['unk_tokens']} ({ppl['unk_share']:.2%})"
        )
    if args.generate is not None:
        prefix, more = decode.generate(
            model,
            tokenizer,
            prefix=args.generate,
            seq_len=seq_len,
            max_tokens=args.max_tokens,
            temperature=args.temperature if args.sample else 0.0,
            seed=args.seed,
            bf16=args.dtype == "bf16",
        )
        print(f"{prefix} [{more}]" if prefix else more)


def print_leak(args, model, tokenizer, text):
    """--leak: decode.future_leak on one batch of whole segments of the text, printed."""
    seq_len = args.seq_len
    if seq_len < 2:
        raise DataError(
            f"--leak: --seq-len {seq_len}: a segment needs a token after its middle to change"
        )
    segs = data.lm_segments(data.lm_stream(tokenizer, text), seq_len)
    full = segs.y.ne(PAD).all(1)  # whole segments: a padded one would score log p(PAD) = -inf
    n = max(1, args.batch_tokens // seq_len)
    if not full.any():
        raise DataError(
            f"--leak: {args.input or 'stdin'} is shorter than one segment of {seq_len} tokens"
        )
    r = decode.future_leak(
        model,
        data.Segments(segs.x[full][:n], segs.y[full][:n]),
        training=args.leak_mode == "train",
    )
    how = "batch norms as in training" if args.leak_mode == "train" else "the model as evaluated"
    print(
        f"future leak ({how}): changing tokens {r['positions'] + 1}..{seq_len} of "
        f"{r['segments']} segments moves log p(next token) at positions 1..{r['positions']} by "
        f"{r['mean_abs_change']:.4f} nats on average; their perplexity {r['ppl_before']:.2f} -> "
        f"{r['ppl_after']:.2f}"
    )


def main(argv=None):
    """python decode.py: 0 when a mode ends without an error, else the message and its status."""
    args = parse_args(argv)
    try:
        run(args)
    except DataError as e:
        sys.exit(f"decode.py: error: {e}")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (rundir.interrupt_on_sigterm)
        unwritten = args.output and not getattr(args, "output_written", False)
        print(
            "decode.py: interrupted" + (f" ({args.output} was not written)" if unwritten else ""),
            file=sys.stderr,
        )
        return rundir.interrupted_status(e)
    return 0  # the exit status of every mode that ends without an error


if __name__ == "__main__":
    rundir.interrupt_on_sigterm()  # SIGTERM stops decoding as Ctrl-C does (exit status 143)
    sys.exit(main())
