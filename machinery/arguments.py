"""machinery/arguments.py: train.py's flags, and the value types that both programs' flags share.

build_parser is train.py's argparse parser: every flag names the paper and equation it comes from,
and `python train.py --help` is their documentation. The parser's own defaults are suppressed, so
that parse_args returns exactly the flags given on the command line; DEFAULTS holds the defaults
(build_parser fills it). A run's flags are DEFAULTS, then the --preset's flags, then the command
line's: machinery/presets.py's resolve_flags builds them, and machinery/train_cli.py checks them
(check_flags) before `python train.py` starts a run.

The range of each number is its type= (ranged: positive_int, count, fraction, ...), the same for
decode.py's flags (machinery/decode_cli.py): a value out of range is argparse's own one-line error
that names the flag. idle_flag is both programs' one rule for a flag given where it does nothing:
it is refused in one line, never silently ignored.

Called by machinery/presets.py, machinery/train_cli.py and machinery/decode_cli.py (and the tests);
a reader of the book never needs to open it.
"""

import argparse
import math

import decode
import train
from machinery import fileio
from machinery.corpora import PAIRS
from machinery.rundir import RESUME_MAY_CHANGE
from norms import NORMS


def idle_flag(rules, given):
    """Both programs' one rule for a flag given where it does nothing: refused in one line, never
    silently ignored. rules: (flags, read, why), the flags read only where `read` holds. Returns the
    first flag given where it is not read, as a command line writes it (--flag-name), with its
    rule's why; None if there is none."""
    for flags, read, why in rules:
        if not read and (idle := [f for f in flags if f in given]):
            return f"--{idle[0].replace('_', '-')}", why


def ranged(kind, ok, why):
    """An argparse type= that checks the range too, for both files' flags: a value out of range is
    argparse's own one-line error naming the flag ("argument --beam: must be at least 1 (got 0)"); a
    non-finite number never passes."""

    def convert(text):
        v = kind(text)
        if not (math.isfinite(v) and ok(v)):
            raise argparse.ArgumentTypeError(
                f"must be {why}{'' if math.isfinite(v) else ', and finite'} (got {text})"
            )
        return v

    # Named as its kind, so that text that is no number reads "invalid int value: 'x'".
    convert.__name__ = kind.__name__
    return convert


positive_int = ranged(int, lambda v: v >= 1, "at least 1")
count = ranged(int, lambda v: v >= 0, "0 or more")
positive = ranged(float, lambda v: v > 0, "positive")
non_negative = ranged(float, lambda v: v >= 0, "0 or more")
fraction = ranged(float, lambda v: 0 <= v < 1, "in [0, 1)")
alpha_range = ranged(
    float, lambda v: 0 <= v <= 10, "in [0, 10] (the papers: 0.6, 1.0; a larger one overflows)"
)
threads = ranged(int, lambda v: 1 <= v <= 1024, "in [1, 1024]")  # torch crashed at 100,000 threads.
in_0_1 = ranged(float, lambda v: 0 < v <= 1, "in (0, 1]")
# A percentile, and the LR's range too: a larger LR overflows at the first step.
percent = ranged(float, lambda v: 0 < v <= 100, "in (0, 100]")
# QKNorm's L ([3] eq. 3).
length_range = ranged(float, lambda v: 2 <= v <= 1e6, "in [2, 1e6] (g0 = log2(L^2 - L) in [1, 40])")
seed_range = ranged(
    int, lambda v: 0 <= v < 2**63 - 64, "in [0, 2^63 - 64) (torch's generators take 64 bits)"
)


DEFAULTS = {}  # every flag's default, filled by build_parser


def build_parser():
    p = argparse.ArgumentParser(
        argument_default=argparse.SUPPRESS,
        description=(
            "Train a Transformer translator with the normalizations of TwT [1], PowerNorm [2] and "
            "QKNorm [3]. [1] Nguyen & Salazar 2019, Transformers without Tears; [2] Shen et al. "
            "2020, PowerNorm; [3] Henry et al. 2020, Query-Key Normalization for Transformers. The "
            "defaults are the quick start: a small model that learns the built-in corpus in about "
            "4 minutes on 2 CPU cores. The papers' rows are presets: --preset list."
        ),
    )

    def add(group, *names, default=None, help="", **kw):
        if default is not None and not isinstance(default, bool):
            help += f" (default: {default})"
        action = group.add_argument(*names, help=help, **kw)
        DEFAULTS[action.dest] = default

    g = p.add_argument_group("presets")
    row = g.add_mutually_exclusive_group()  # a run's flags start from one of them
    add(
        row,
        "--preset",
        metavar="NAME",
        help="apply one row of a paper's table (machinery/presets.py); flags given "
        "with it override it; 'list' prints them all",
    )
    add(
        row,
        "--config",
        metavar="FILE",
        help="start a new run with the flags of a run's config.json (RUN/config.json, "
        "as edited or not), as a preset of every flag: flags given with it override it (--out too)",
    )
    add(
        g,
        "--pair",
        metavar="NAME",
        choices=list(PAIRS),
        help="use this language pair's corpus and per-pair flags "
        "instead of the preset's (" + ", ".join(PAIRS) + ")",
    )
    add(
        g,
        "--show",
        action="store_true",
        default=False,
        help="print each flag's value in this run, then exit",
    )
    g = p.add_argument_group("data")
    add(
        g,
        "--task",
        choices=["mt", "lm"],
        default="mt",
        help="mt: a translator; lm: a language model, the decoder "
        "alone ([2] Table 2), on DIR/{train,dev,test}.txt",
    )
    add(
        g,
        "--seq-len",
        type=positive_int,
        default=32,
        help="--task lm: the text is cut into segments of this many "
        "tokens (the tensorized Transformer's PTB script: 32)",
    )
    add(
        g,
        "--lm-batches",
        choices=["shuffled", "streams"],
        default="shuffled",
        help=(
            "--task lm: shuffled segments, or streams: the baseline code's rows of the text, batch "
            "j every row's j-th segment (data.lm_streams)"
        ),
    )
    add(
        g,
        "--data",
        help=(
            "corpus directory holding {train,dev,test}.{SRC,TGT}; default: the built-in synthetic "
            "corpus (machinery/toy_corpus.py), generated on first use"
        ),
    )
    add(g, "--src", help="source language suffix, e.g. en (DIR/train.en)")
    add(g, "--tgt", help="target language suffix, e.g. de (DIR/train.de)")
    add(
        g,
        "--bpe-size",
        type=count,
        help=(
            "joint sentencepiece BPE vocabulary size ([1] Table 1: 8k; 3k for gl-en); default "
            "8000, or 2000 on the built-in corpus; --task lm: 0 (the default there) is whitespace "
            "words"
        ),
    )
    add(
        g,
        "--max-len",
        type=positive_int,
        default=250,
        help="training pairs longer than this (BPE tokens, either side) are dropped, with a count",
    )
    add(
        g,
        "--batch-tokens",
        type=positive_int,
        default=4096,
        help="tokens per batch, counted as sentences x the "
        "longer side's padded length ([1] appendix A: 4096)",
    )
    add(
        g,
        "--accumulate",
        type=positive_int,
        default=1,
        metavar="N",
        help="micro-batches of --batch-tokens per update "
        "(gradient accumulation); batch statistics are per micro-batch ([2] Figure 5)",
    )
    add(
        g,
        "--word-dropout",
        type=fraction,
        default=0.1,
        help="probability that an input token becomes UNK ([1] appendix A, training only)",
    )
    g = p.add_argument_group("model")
    add(
        g,
        "--layers",
        type=positive_int,
        default=2,
        help="encoder and decoder layers ([1]: 6; 4 for gl-en)",
    )
    add(g, "--enc-layers", type=positive_int, help="override --layers for the encoder")
    add(g, "--dec-layers", type=positive_int, help="override --layers for the decoder")
    add(g, "--d-model", type=positive_int, default=128, help="model width d ([1]: 512)")
    add(
        g,
        "--heads",
        type=positive_int,
        default=4,
        help="attention heads ([1]: 8; [3] Table 4 varies it)",
    )
    add(g, "--ff", type=positive_int, default=512, help="feed-forward width ([1]: 2048)")
    add(
        g,
        "--dropout",
        type=fraction,
        default=0.1,
        help="dropout on embeddings, sublayer outputs, ReLU and "
        "attention weights ([1] Table 1: 0.3; 0.4 for gl-en)",
    )
    add(g, "--attn-dropout", type=fraction, help="attention-weight dropout (default: --dropout)")
    add(g, "--relu-dropout", type=fraction, help="ReLU dropout (default: --dropout)")
    add(
        g,
        "--norm",
        default="scale",
        choices=sorted(NORMS),
        help="norm of every sublayer (norms.NORMS): "
        + "; ".join(f"{name}: {e.equation} ({e.paper})" for name, e in NORMS.items()),
    )
    add(
        g,
        "--encoder-norm",
        choices=sorted(NORMS),
        help="override --norm in the encoder ([2]: PN in the encoder only)",
    )
    add(g, "--decoder-norm", choices=sorted(NORMS), help="override --norm in the decoder")
    place = g.add_mutually_exclusive_group()
    add(
        place,
        "--prenorm",
        dest="prenorm",
        action="store_true",
        default=True,
        help="PreNorm residual "
        "x + F(norm(x)) ([1] eq. 3), plus a final norm per stack (the default)",
    )
    add(
        place,
        "--postnorm",
        dest="prenorm",
        action="store_false",
        default=True,
        help="PostNorm residual norm(x + F(x)) ([1] eq. 2, the original Transformer)",
    )
    add(
        g,
        "--fixnorm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="l2-normalise the tied "
        "embedding rows ([1] section 2.3, eq. 6 with ScaleNorm; default on)",
    )
    add(
        g,
        "--init",
        choices=["small", "xavier", "normal"],
        default="small",
        help=(
            "SmallInit (attention std sqrt(2/5d), [1] section 2.2), Xavier normal ([1] eq. 4), or "
            "the baseline LM code's (model.normal_init)"
        ),
    )
    add(
        g,
        "--qknorm",
        action="store_true",
        default=False,
        help="QKNorm attention: softmax(g * q^.k^) with l2-normalised q, k ([3] eqs. 2-5)",
    )
    add(
        g,
        "--qk-length",
        type=length_range,
        help="L of g0 = log2(L^2 - L) ([3] eq. 3); default: from --qk-percentile",
    )
    add(
        g,
        "--qk-percentile",
        type=percent,
        default=97.5,
        help="percentile of training lengths used as L ([3] section 3; Table 5 varies it)",
    )
    add(
        g,
        "--qk-no-g",
        action="store_true",
        default=False,
        help="QKNorm ablation: g fixed at 1 ([3] Table 6)",
    )
    add(
        g,
        "--qk-norm-v",
        action="store_true",
        default=False,
        help="QKNorm ablation: l2-normalise V too ([3] Table 6)",
    )
    add(
        g,
        "--pn-warmup",
        type=count,
        help="PowerNorm: training updates that use batch statistics while the "
        "running one accumulates ([2] appendix A: the LR warmup); default: the LR warmup",
    )
    add(
        g,
        "--pn-variant",
        choices=["paper", "code"],
        default="paper",
        help=(
            "PowerNorm: 'paper' follows [2] Algorithm 2 / eq. 12; 'code' the released code "
            "(backward divides by the batch psi_B after warmup; padding enters the backward means)"
        ),
    )
    add(
        g,
        "--pn-alpha-fwd",
        type=fraction,
        default=0.9,
        help="PowerNorm forward running-average alpha ([2] eq. 10)",
    )
    add(
        g,
        "--pn-alpha-bkw",
        type=fraction,
        default=0.9,
        help="PowerNorm backward running-average alpha ([2] eq. 13)",
    )
    add(
        g,
        "--attention",
        choices=["softmax", "multilinear"],
        default="softmax",
        help=(
            "--task lm: softmax attention, or the tensorized Transformer's multi-linear attention, "
            "core-1, causal ([2] appendix A.2)"
        ),
    )
    add(
        g,
        "--mask",
        choices=["causal", "none"],
        default="causal",
        help=(
            "--attention multilinear: causal ([2]: 'with masking'), or none: the baseline code's "
            "mask, built and never applied (model.py Appendix B)"
        ),
    )
    add(
        g,
        "--positions",
        choices=["sinusoidal", "relative"],
        default="sinusoidal",
        help=(
            "--attention multilinear: sinusoids added to the input, or relative: the baseline "
            "code's term inside the attention instead"
        ),
    )
    add(
        g,
        "--head-dim",
        type=positive_int,
        help="--attention multilinear: each head's rank R (the baseline's PTB "
        "script: 40); default D / H",
    )
    add(
        g,
        "--attn-bias",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--attention multilinear: "
        "biases in W^QKV and W^O (the baseline code has none; default on)",
    )
    add(
        g,
        "--final-dropout",
        type=fraction,
        default=0.0,
        help="dropout on the decoder's output, before the output "
        "layer (the baseline LM code's: 0.3, its --dropout)",
    )
    add(
        g,
        "--sdpa",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch's scaled_dot_product_attention (off: the written-out attention; default on)",
    )
    g = p.add_argument_group("optimisation and schedule")
    add(
        g,
        "--schedule",
        choices=list(train.SCHEDULES),
        default="invsqrt",
        help="; ".join(f"{name}: {entry.help}" for name, entry in train.SCHEDULES.items()),
    )
    # Both set the peak LR (lr = lr_scale / sqrt(d * warmup)): at most one of them is given.
    peak = g.add_mutually_exclusive_group()
    add(
        peak,
        "--lr-scale",
        type=percent,
        help="lambda of eq. 7: LR(n) = lambda / sqrt(d) * min(n^-0.5, n * "
        "warmup^-1.5) ([1] 3.3: 1, and 2 for 2xLR); when given it overrides --lr",
    )
    add(
        peak,
        "--lr",
        type=percent,
        default=2e-3,
        help="peak LR (reached at n_warmup), i.e. lambda = lr * "
        "sqrt(d * warmup) in eq. 7; the constant LR of --schedule nowarmup ([1] 3.3: 3e-4)",
    )
    add(g, "--warmup", type=positive_int, default=200, help="n_warmup of eq. 7 ([1]: 8000)")
    add(
        g,
        "--decay-factor",
        type=in_0_1,
        default=0.8,
        help="alpha_decay of validation decay ([1] 2.4; 0.8 in 3.3)",
    )
    add(
        g,
        "--patience",
        type=positive_int,
        default=3,
        help=(
            "validation decay when the dev score (BLEU; perplexity with --task lm) is worse than "
            "each of the previous PATIENCE evaluations ([1] 2.4; 3 in 3.3)"
        ),
    )
    add(
        g,
        "--stop-lr",
        type=non_negative,
        default=1e-6,
        help="stop when the LR falls below this ([1] appendix A: 1e-6; TwT code 5e-5; [3]: 1e-5)",
    )
    add(
        g,
        "--early-stop",
        type=count,
        default=20,
        help="stop when the dev score (BLEU, or perplexity) has not "
        "improved for this many evaluations ([1]: 20, 50 for gl-en; 0: off)",
    )
    add(g, "--beta1", type=fraction, default=0.9, help="Adam beta1 ([1] appendix A)")
    add(g, "--beta2", type=fraction, default=0.999, help="Adam beta2 ([1] appendix A)")
    add(g, "--adam-eps", type=positive, default=1e-8, help="Adam epsilon ([1] appendix A)")
    add(
        g,
        "--weight-decay",
        type=non_negative,
        default=0.0,
        help="decoupled weight decay (AdamW; [2] used 1e-4)",
    )
    add(
        g,
        "--clip",
        type=non_negative,
        default=1.0,
        help="clip the global gradient norm at this value (0: off)",
    )
    add(
        g,
        "--label-smoothing",
        type=fraction,
        default=0.1,
        help="epsilon of label smoothing, spread over the target vocabulary ([1] appendix A)",
    )
    g = p.add_argument_group("run")
    add(g, "--out", default="runs/quickstart", help="run directory")
    add(g, "--seed", type=seed_range, default=1, help="fixes every random choice")
    add(
        g,
        "--epoch-size",
        type=positive_int,
        default=100,
        help="steps per epoch; dev BLEU after each ([1]: 1000-2000 by pair)",
    )
    add(
        g,
        "--max-epochs",
        type=positive_int,
        default=4,
        help="stop after this many epochs ([1] Table 1: 200)",
    )
    add(
        g,
        "--keep-checkpoints",
        type=count,
        default=5,
        help="keep the last N per-epoch checkpoints, for "
        "checkpoint averaging (Code [2]: the last 5; its paper: 10)",
    )
    add(
        g,
        "--save-interval",
        type=count,
        default=0,
        metavar="N",
        help=(
            "also write the last checkpoint every N steps between evaluations: a hard kill "
            "(SIGKILL, a lost node) then loses at most N steps (0: at evaluations only; Ctrl-C and "
            "SIGTERM always save the step they stop at)"
        ),
    )
    add(g, "--max-steps", type=positive_int, help="stop after this many steps (quick checks)")
    add(
        g,
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda if available",
    )
    add(
        g,
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="auto: bf16 autocast on a GPU that computes bf16 natively, else fp32 (the CPU's "
        "default is fp32 until measured: docs/speed.md); bf16: bf16 autocast on a GPU or the CPU "
        "(a CPU without AVX512-BF16, AMX or Arm's BF16 emulates it, slower than fp32); fp32: "
        "fp32 throughout. The first screen says which, and config.json and results.json record "
        "it as precision",
    )
    add(g, "--threads", type=threads, help="CPU threads (torch.set_num_threads)")
    add(
        g,
        "--compile",
        action="store_true",
        default=False,
        help=(
            "torch.compile the model, once, for symbolic shapes, lengths padded to multiples of 8 "
            "(a minute or more to compile; for a GPU)"
        ),
    )
    add(
        g,
        "--reference",
        action="store_true",
        default=False,
        help="run every equation as written, with no "
        "fast path anywhere (norms.py section 1): slower, for checking an edited equation",
    )
    add(g, "--log-interval", type=positive_int, default=50, help="steps between log lines")
    add(
        g,
        "--tensorboard",
        action="store_true",
        default=False,
        help="also write metrics.jsonl's records as "
        "TensorBoard events into the run directory (tensorboard --logdir runs); an optional extra: "
        + fileio.EXTRAS,
    )
    add(g, "--beam", type=positive_int, default=4, help="beam size for test BLEU (Code: 4)")
    add(
        g,
        "--alpha",
        type=alpha_range,
        default=0.6,
        help="length penalty alpha (TwT Code: 0.6; PowerNorm: 1.0)",
    )
    add(
        g,
        "--length-penalty",
        choices=list(decode.PENALTIES),
        default="gnmt",
        help=(
            "gnmt: score / ((5 + |Y|) / 6)^alpha (Wu et al. 2016; TwT, QKNorm); fairseq: score / "
            "|Y|^alpha (Ott et al. 2019, as PowerNorm decodes)"
        ),
    )
    add(
        g,
        "--dev-beam",
        type=positive_int,
        default=1,
        help="beam size for the per-epoch dev BLEU (1 = greedy)",
    )
    action = g.add_mutually_exclusive_group()  # what the command does: at most one of these four
    add(
        action,
        "--benchmark",
        type=count,
        default=0,
        metavar="N",
        help=(
            "time N training steps after a warm-up and print tokens/s, FLOPs/token, MFU, padding "
            "and peak memory, then exit (writes no run directory)"
        ),
    )
    add(
        g,
        "--profile",
        action="store_true",
        default=False,
        help="with --benchmark: also print where the time "
        "of a step goes (torch.profiler, by operator)",
    )
    add(
        action,
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint, with "
        "its saved flags (only "
        + ", ".join("--" + f.replace("_", "-") for f in sorted(RESUME_MAY_CHANGE))
        + " may be given again to change them)",
    )
    add(
        action,
        "--overwrite",
        action="store_true",
        default=False,
        help="train into --out even if it holds a run: "
        "that run's files are removed first (without it such a directory is refused)",
    )
    add(
        action,
        "--start-or-resume",
        action="store_true",
        default=False,
        help=(
            "start the run in --out, or continue it when --out already holds it: one command for a "
            "scheduler's requeue. Every flag of the command is compared with the run's; a folder "
            "of another run, or a flag that differs, is refused as --resume refuses it"
        ),
    )
    return p
