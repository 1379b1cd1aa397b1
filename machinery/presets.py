"""machinery/presets.py: the papers' rows as presets, and the flags of a run (resolve_flags).

Each preset is one row of a paper's table as a set of flags, applied after the defaults and before
the flags of the command line (which override it): --preset NAME, and --preset list prints them
all. A row names its language pair (PAIRS); --pair NAME swaps in another pair's corpus and per-pair
flags: machinery/corpora.py's CORPORA "flags" (their one copy, beside the corpus's source and notes)
and --data data/NAME (multi30k: data/multi30k-en-de), where `python data.py prepare NAME` puts it.
--config FILE starts a new run from a run's config.json instead, as a preset of every flag
(config_flags).

resolve_flags turns a command line into a run's flags: DEFAULTS (machinery/arguments.py), then the
pair's and the preset's (or --config's) flags, then the command line's, and fixes the values that
depend on other flags, once. Called by machinery/train_cli.py's main() (`python train.py`) and by
the tests; a reader of the book never needs to open it.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import train
from machinery.arguments import DEFAULTS, build_parser
from machinery.corpora import PAIRS
from machinery.rundir import ACTIONS, RUN_RECORDS


def one_line_error(message):
    """The parser's error, as one line (argparse's own would add its usage): exit status 1."""
    sys.exit(f"error: {message}")


def resolve_flags(argv=None, log=print):
    """The command line -> (args, given): every flag's value, and the flags given explicitly; log:
    its notes."""
    parser = build_parser()
    parser.error = one_line_error
    given = vars(parser.parse_args(argv))
    if given.get("preset") == "list":
        list_presets()
    if given.get("preset", next(iter(PRESETS))) not in PRESETS:
        sys.exit(
            f"error: --preset {given['preset']}: unknown; --preset list shows the "
            f"{len(PRESETS)} presets"
        )
    pair, _, row = PRESETS[given["preset"]] if "preset" in given else (None, "", {})
    if "config" in given:  # a run's every flag; --pair given swaps its corpus
        row = {**config_flags(given["config"], parser), **PAIRS.get(given.get("pair"), {})}
    flags = {**DEFAULTS, **PAIRS.get(given.get("pair", pair), {}), **row}
    # A flag given on the command line wins over the preset, always: --lr sets the peak LR, which a
    # preset's (or --config's) lambda (--lr-scale) would otherwise override. The run's first screen
    # says so.
    if "lr" in given and flags["lr_scale"] is not None:
        log(
            f"note: --lr {given['lr']:g} is the peak LR, which --lr-scale {flags['lr_scale']} "
            f"would set: not used"
        )
        flags["lr_scale"] = None
    flags.update(given)
    check_pair(given, pair, row)
    args = argparse.Namespace(**flags)
    # Values that depend on other flags are fixed here, once, and recorded in config.json.
    if args.bpe_size is None:
        args.bpe_size = 0 if args.task == "lm" else 2000 if args.data is None else 8000
    if args.pn_warmup is None:  # Paper [2] appendix A: the same as the LR schedule's warmup
        args.pn_warmup = train.Schedule.from_args(args).warmup
    if args.lr_scale is not None:  # config.json records the peak that runs
        args.lr = args.lr_scale / math.sqrt(args.d_model * args.warmup)
    return args, given


def list_presets():
    """--preset list: every preset's name, language pair and paper's row, then exit (status 0)."""
    width = max(len(pair) for pair, _, _ in PRESETS.values())
    for name, (pair, row, _) in PRESETS.items():
        print(f"{name:30s} {pair:{width}s} {row}")
    print(
        f"{len(PRESETS)} presets; --pair NAME swaps the language pair ({', '.join(PAIRS)}); any "
        f"flag given with --preset overrides it"
    )
    sys.exit(0)


def check_pair(given, pair, row):
    """--pair given with --task or --preset must name a corpus for that task: a language model's
    corpus for a translator, or a translator's for a language model, is refused in one line. pair,
    row: the preset's language pair and flags."""
    if "pair" not in given or ("task" not in given and "preset" not in given):
        return
    task = given.get("task") or row.get("task") or PAIRS[pair].get("task", "mt")
    if PAIRS[given["pair"]].get("task", "mt") == task:
        return
    if "task" in given:
        what = f"--task {task}"
    else:
        model = "language model" if task == "lm" else "translator"
        what = f"--preset {given['preset']}, a {model}"
    sys.exit(f"error: --pair {given['pair']}: not a corpus for {what}")


def config_flags(path, parser):
    """--config FILE: the flags a run's config.json holds, for a new run (not the run's records, its
    --out or an action). A file that is not a JSON object, a key that is no flag, a value its flag's
    type= or choices refuse: one line that names it."""
    try:
        saved = json.loads(Path(path).read_text())
        # A JSON list or value has no .items(): AttributeError.
        flags = {k: v for k, v in saved.items() if k not in RUN_RECORDS + ACTIONS + ("out",)}
    except (OSError, ValueError, AttributeError) as e:
        sys.exit(f"error: --config {path}: not a JSON object of flags ({e})")
    actions = {a.dest: a for a in parser._actions if a.dest in DEFAULTS}
    for k, v in flags.items():
        try:
            ok = is_value_of(actions[k], DEFAULTS[k], v)
        except (KeyError, TypeError, ValueError, argparse.ArgumentTypeError):
            ok = False
        if ok:
            continue
        if k in actions:
            sys.exit(
                f"error: --config {path}: {k!r}: {v!r} is not a value of --{k.replace('_', '-')}"
            )
        sys.exit(f"error: --config {path}: {k!r}: not a flag of train.py")
    return flags


def is_value_of(action, default, v):
    """Whether a flag (its argparse action, its default) takes the value v, as argparse takes a
    value from a command line: through the flag's type= and choices. A switch takes a bool; None is
    a value only where it is the default."""
    if v is None and default is None:
        return True
    if action.nargs == 0:  # a switch: --qknorm, --fixnorm / --no-fixnorm
        return isinstance(v, bool)
    return (
        not isinstance(v, bool)
        and (action.type or str)(str(v)) == v
        and v in (action.choices or [v])
    )


# The shared recipes. TwT appendix A: d 512, FFN 2048, word dropout and label smoothing 0.1,
# 4096-token batches, beam 4 with alpha 0.6 (dev BLEU with beam 4 too, as the authors' code).
TWT = dict(
    d_model=512,
    ff=2048,
    word_dropout=0.1,
    label_smoothing=0.1,
    batch_tokens=4096,
    beam=4,
    alpha=0.6,
    dev_beam=4,
    init="small",
)


TWT_LN = dict(TWT, norm="layer", fixnorm=False)  # [1] 3.1 and Table 5: before FixNorm and ScaleNorm


TWT_FINAL = dict(TWT, prenorm=True, norm="scale", fixnorm=True)  # PreNorm + FixNorm + ScaleNorm


INVSQRT = dict(schedule="invsqrt", lr_scale=1.0, warmup=8000)  # [1] 3.2-3.3: 8k warmup, lambda 1


NOWARMUP = dict(schedule="nowarmup", lr=3e-4)  # [1] 3.3: a constant 3e-4, x0.8 decay


# QKNorm's released configs: LayerNorm, PreNorm, FixNorm; linear warmup to ~4.94e-4 then flat,
# x0.8 validation decay; stop when the LR falls below 1e-5, no early stop.
QK = dict(
    TWT,
    norm="layer",
    prenorm=True,
    fixnorm=True,
    qknorm=True,
    schedule="warmupflat",
    lr_scale=1.0,
    warmup=8000,
    stop_lr=1e-5,
    early_stop=0,
)


# PowerNorm's released IWSLT'14 recipe: pre-norm, 6+6 layers, d 512, FFN 1024, 4 heads, the batch
# norms in the encoder only, Adam (0.9, 0.98), decoupled weight decay 1e-4, inverse-sqrt LR peaking
# at 0.0015 after 8000 steps, no clipping, dropout 0.3 (attention, ReLU 0.1), no word dropout,
# average of the last 5 epoch checkpoints, beam 5, length penalty 1.0 (fairseq's score / |Y|^1.0,
# not GNMT's).
PN = dict(
    layers=6,
    d_model=512,
    heads=4,
    ff=1024,
    dropout=0.3,
    attn_dropout=0.1,
    relu_dropout=0.1,
    word_dropout=0.0,
    label_smoothing=0.1,
    batch_tokens=4096,
    prenorm=True,
    fixnorm=False,
    init="xavier",
    schedule="invsqrt",
    lr=0.0015,
    warmup=8000,
    beta2=0.98,
    weight_decay=1e-4,
    clip=0.0,
    stop_lr=1e-9,
    epoch_size=1000,
    max_epochs=100,
    early_stop=5,
    keep_checkpoints=5,
    beam=5,
    alpha=1.0,
    length_penalty="fairseq",
    norm="layer",
)


# PowerNorm's language models ([2] appendix A.2, Table 2): the tensorized Transformer core-1 of Ma
# et al. 2019 with every LN replaced; its PTB script (szhangtju/The-compression-of-Transformer): 3
# layers, d 256, 1 head, FFN 2100, dropout 0.3, no attention dropout, post-norm, tied embeddings,
# segments of 32 tokens without memory, 120 segments (3,840 tokens) a batch, clip 0.25, Adam at
# 2.5e-4 with a cosine decay ([2] A.2: "we follow the learning rate setting in (Ma et al., 2019)").
# [2] A.2: 30 epochs, warmup 4000 steps, label smoothing 0.1, PN's warmup as for MT, its alphas
# tuned over 0.9/0.95/0.99. Guessed or changed (neither says): alpha 0.9 both ways, Xavier init
# instead of N(0, 0.02), the head dimension D / H = 256 instead of the script's 40, the cosine
# reaching 0 at the last of the 30 epochs. One epoch is one pass over PTB's 929,589 training tokens
# (243 batches).
PN2 = dict(
    task="lm",
    layers=3,
    d_model=256,
    heads=1,
    ff=2100,
    dropout=0.3,
    attn_dropout=0.0,
    relu_dropout=0.3,
    word_dropout=0.0,
    label_smoothing=0.1,
    attention="multilinear",
    seq_len=32,
    batch_tokens=3840,
    prenorm=False,
    fixnorm=False,
    init="xavier",
    schedule="cosine",
    lr=2.5e-4,
    warmup=4000,
    clip=0.25,
    epoch_size=243,
    max_epochs=30,
    early_stop=0,
    stop_lr=0.0,
    keep_checkpoints=0,
    norm="layer",
    # A CPU's epoch is 5-10 minutes: a hard kill loses at most 2-4 minutes of it (docs/runs.md).
    save_interval=100,
)


# Its Table 2's norms: (the preset's name, the table's name, --norm).
PN2_NORMS = (
    ("layernorm", "LN", "layer"),
    ("batchnorm", "BN", "batch"),
    ("pnv", "PN-V", "pnv"),
    ("powernorm", "PN", "power"),
)


def row(*parts, **flags):
    """The flags of a row: the parts merged left to right, then flags (later ones win)."""
    return {k: v for part in parts + (flags,) for k, v in part.items()}


# The study (docs/reproduced.md): the papers' comparisons at laptop scale, on Multi30k
# en-de (`python data.py prepare multi30k`). One recipe for every row of a comparison, so budgets
# are equal: d 128, 3+3 layers, 400 updates of 4096-token batches (~13 min on one CPU thread),
# eq. 7 to a 2e-3 peak at step 200, greedy dev BLEU every 50 steps, beam-4 test BLEU of the best.
M30K = dict(
    layers=3,
    d_model=128,
    heads=4,
    ff=512,
    dropout=0.1,
    word_dropout=0.1,
    label_smoothing=0.1,
    batch_tokens=4096,
    init="small",
    schedule="invsqrt",
    lr=2e-3,
    warmup=200,
    max_steps=400,
    epoch_size=50,
    max_epochs=1000,
    early_stop=0,
    stop_lr=0.0,
    dev_beam=1,
    beam=4,
    alpha=0.6,
    log_interval=10,
    keep_checkpoints=0,
)


M30K_LN = row(M30K, norm="layer", fixnorm=False)  # [1] Table 3 rows (1)-(2)


M30K_FINAL = row(M30K, prenorm=True, norm="scale", fixnorm=True)  # [1] Table 3 (4)


# [1] Tables 2 and 5: deeper, with no warmup.
M30K_DEEP = row(M30K_LN, layers=6, schedule="nowarmup", lr=1e-3, max_steps=250)


# PowerNorm's recipe at this scale, as PN's above: pre-norm, no FixNorm, Xavier, its Adam, weight
# decay and peak LR.
M30K_PN = row(
    M30K,
    prenorm=True,
    norm="layer",
    fixnorm=False,
    init="xavier",
    beta2=0.98,
    weight_decay=1e-4,
    lr=1.5e-3,
    clip=0.0,
    word_dropout=0.0,
)


# [3]: QKNorm + LayerNorm.
M30K_QK = row(M30K, prenorm=True, norm="layer", fixnorm=True, qknorm=True)


# PowerNorm's Table 2 at laptop scale, on PTB (`python data.py prepare ptb`): [2]'s recipe (PN2
# above) at d 128, FFN 512, dropout 0.1, eq. 7 to a 1e-3 peak at step 200, 3 passes over PTB (729
# updates), dev perplexity every pass. Multi-linear attention; --attention softmax gives the other
# half of the study.
PTB = row(
    PN2,
    d_model=128,
    ff=512,
    dropout=0.1,
    relu_dropout=0.1,
    schedule="invsqrt",
    lr=1e-3,
    warmup=200,
    epoch_size=243,
    max_epochs=3,
    log_interval=27,
)


PRESETS = {  # name: (language pair, the paper's row, flags)
    **{
        f"twt2-{init}-{place}-w{w // 1000}k": (
            "en-vi",
            f"TwT Table 2: {init} init, {place}, {w // 1000}k warmup",
            row(TWT_LN, INVSQRT, init=init, prenorm=place == "prenorm", warmup=w),
        )
        for init in ("xavier", "small")
        for place in ("postnorm", "prenorm")
        for w in (4000, 8000, 16000)
    },
    "twt3-postnorm": (
        "en-vi",
        "TwT Table 3 (1): PostNorm + LayerNorm",
        row(TWT_LN, INVSQRT, prenorm=False),
    ),
    "twt3-prenorm": (
        "en-vi",
        "TwT Table 3 (2): PreNorm + LayerNorm",
        row(TWT_LN, INVSQRT, prenorm=True),
    ),
    "twt3-prenorm-fixnorm": (
        "en-vi",
        "TwT Table 3 (3): PreNorm + FixNorm + LayerNorm",
        row(TWT, INVSQRT, prenorm=True, norm="layer", fixnorm=True),
    ),
    "twt3-scalenorm": (
        "en-vi",
        "TwT Table 3 (4): PreNorm + FixNorm + ScaleNorm",
        row(TWT_FINAL, INVSQRT),
    ),
    "twt4-nowarmup": ("en-vi", "TwT Table 4: NOWARMUP", row(TWT_FINAL, NOWARMUP)),
    "twt4-invsqrt": ("en-vi", "TwT Table 4: INVSQRTDECAY", row(TWT_FINAL, INVSQRT)),
    "twt4-valdecay": (
        "en-vi",
        "TwT Table 4: VALDECAY",
        row(TWT_FINAL, INVSQRT, schedule="valdecay"),
    ),
    "twt4-invsqrt-2xlr": (
        "en-vi",
        "TwT Table 4: INVSQRTDECAY + 2xLR",
        row(TWT_FINAL, INVSQRT, lr_scale=2.0),
    ),
    "twt4-valdecay-2xlr": (
        "en-vi",
        "TwT Table 4: VALDECAY + 2xLR",
        row(TWT_FINAL, INVSQRT, schedule="valdecay", lr_scale=2.0),
    ),
    **{
        f"twt5-{place}-{n}l": (
            "en-vi",
            f"TwT Table 5: {place}, {n} layers, NOWARMUP",
            row(TWT_LN, NOWARMUP, prenorm=place == "prenorm", layers=n),
        )
        for place in ("postnorm", "prenorm")
        for n in (4, 5, 6)
    },
    "twt7-rmsnorm": (
        "en-vi",
        "TwT Table 7: RMSNorm + FixNorm",
        row(TWT_FINAL, INVSQRT, norm="rms"),
    ),
    "twt7-scalenorm": (
        "en-vi",
        "TwT Table 7: ScaleNorm + FixNorm (= Table 3 (4))",
        row(TWT_FINAL, INVSQRT),
    ),
    "twt7-fixed-g": (
        "en-vi",
        "TwT Table 7: ScaleNorm (g = sqrt d) + FixNorm (learned)",
        row(TWT_FINAL, INVSQRT, norm="scale_fixed"),
    ),
    "twt7-fixed-g-valdecay": (
        "en-vi",
        "TwT Table 7: ScaleNorm (g = sqrt d) + FixNorm + VALDECAY",
        row(TWT_FINAL, INVSQRT, norm="scale_fixed", schedule="valdecay"),
    ),
    "twt7-fixed-g-valdecay-2xlr": (
        "en-vi",
        "TwT Table 7: ScaleNorm (g = sqrt d) + FixNorm + VALDECAY + 2xLR",
        row(TWT_FINAL, INVSQRT, norm="scale_fixed", schedule="valdecay", lr_scale=2.0),
    ),
    **{
        f"pn2-{key}": (
            "ptb",
            f"PowerNorm Table 2: PTB, tensorized Transformer {name}",
            row(PN2, norm=norm),
        )
        for key, name, norm in PN2_NORMS
    },
    # The baseline as its code ran (model.py Appendix B): the mask never applied, positions only
    # inside the attention.
    **{
        f"pn2-released-{key}": (
            "ptb",
            f"PowerNorm Table 2: PTB, {name}, the baseline's code as it ran (unmasked, "
            f"relative positions)",
            row(PN2, norm=norm, mask="none", positions="relative"),
        )
        for key, name, norm in PN2_NORMS
        if key in ("layernorm", "powernorm")
    },
    "pn2-script": (
        "ptb",
        "PowerNorm Table 2: PTB, LN, the baseline's PTB script (run_ptb.sh) as closely as our "
        "flags go (docs/departures.md)",
        row(
            PN2,
            mask="none",
            positions="relative",
            head_dim=40,
            attn_bias=False,
            init="normal",
            final_dropout=0.3,
            lm_batches="streams",
            label_smoothing=0.0,
            warmup=1,
            epoch_size=242,
            max_steps=20000,
            max_epochs=83,
        ),
    ),
    # [2] A.2: WikiText-103, 6 layers, the rest as PTB's; an epoch is 101,425,671 words + 1,165,029
    # EOS, 26,717 batches.
    **{
        f"pn2-wt103-{key}": (
            "wikitext-103",
            f"PowerNorm Table 2: WikiText-103, 6-layer tensorized Transformer {name}",
            row(PN2, layers=6, epoch_size=26717, norm=norm, save_interval=5000),
        )
        for key, name, norm in PN2_NORMS
    },
    "pn1-layernorm": ("de-en", "PowerNorm Table 1: Pre-Norm Transformer LN", PN),
    "pn1-batchnorm": (
        "de-en",
        "PowerNorm Table 1: Pre-Norm Transformer BN",
        row(PN, encoder_norm="batch"),
    ),
    "pn1-pnv": (
        "de-en",
        "PowerNorm Table 1: Pre-Norm Transformer PN-V",
        row(PN, encoder_norm="pnv"),
    ),
    "pn1-powernorm": (
        "de-en",
        "PowerNorm Table 1: Pre-Norm Transformer PN (the released backward)",
        row(PN, encoder_norm="power", pn_variant="code"),
    ),
    "qk2-twt": (
        "en-vi",
        "QKNorm Table 2: Nguyen and Salazar (2019) as the QKNorm authors reran it, the TwT code's "
        "defaults (its en-vi 32.79 is TwT's own twt3-scalenorm; their rerun: 32.48)",
        row(TWT_FINAL, NOWARMUP, stop_lr=5e-5, early_stop=0),
    ),
    "qk2-qknorm": ("en-vi", "QKNorm Table 2: QKNorm + LayerNorm", QK),
    **{
        f"qk4-heads{h}": ("en-vi", f"QKNorm Table 4: {h} heads", row(QK, heads=h))
        for h in (2, 4, 8, 16, 32)
    },
    **{
        f"qk5-p{p:g}": (
            "en-vi",
            f"QKNorm Table 5: L at the {p:g}th percentile",
            row(QK, qk_percentile=p),
        )
        for p in (75, 90, 92.5, 95, 97.5, 99, 100)
    },
    **{
        f"qk6-{key}": ("en-vi", f"QKNorm Table 6: {what}", row(QK, flags))
        for key, what, flags in (
            ("no-g", "without g (fixed at 1)", dict(qk_no_g=True)),
            (
                "scalenorm",
                "without LayerNorm, read as QKNorm + ScaleNorm (the code's other norm)",
                dict(norm="scale"),
            ),
            ("no-norm", "without LayerNorm, literally (no norm at all)", dict(norm="none")),
            ("no-fixnorm", "without FixNorm", dict(fixnorm=False)),
            (
                "no-fixnorm-postnorm",
                "without FixNorm or PreNorm",
                dict(fixnorm=False, prenorm=False),
            ),
            ("norm-v", "l2-normalizing V along with Q and K", dict(qk_norm_v=True)),
        )
    },
    **{
        f"ptb-{key}": ("ptb", f"study, PowerNorm Table 2: {name}", row(PTB, norm=norm))
        for key, name, norm in PN2_NORMS
    },
    **{
        f"m30k-{key}": ("multi30k", f"study, {what}", flags)
        for key, what, flags in (
            ("postnorm", "TwT Table 3 (1): PostNorm + LayerNorm", row(M30K_LN, prenorm=False)),
            ("prenorm", "TwT Table 3 (2): PreNorm + LayerNorm", row(M30K_LN, prenorm=True)),
            (
                "prenorm-fixnorm",
                "TwT Table 3 (3): PreNorm + FixNorm + LayerNorm (QKNorm's model without QKNorm)",
                row(M30K_LN, prenorm=True, fixnorm=True),
            ),
            ("scalenorm", "TwT Table 3 (4): PreNorm + FixNorm + ScaleNorm", M30K_FINAL),
            (
                "postnorm-xavier",
                "TwT Table 2: PostNorm + LayerNorm, Xavier normal",
                row(M30K_LN, prenorm=False, init="xavier"),
            ),
            (
                "deep-postnorm",
                "TwT Table 5: 6+6 layers, PostNorm, no warmup (constant 1e-3)",
                row(M30K_DEEP, prenorm=False),
            ),
            (
                "deep-prenorm",
                "TwT Table 5: 6+6 layers, PreNorm, no warmup (constant 1e-3)",
                row(M30K_DEEP, prenorm=True),
            ),
            ("rmsnorm", "TwT Table 7: RMSNorm + FixNorm", row(M30K_FINAL, norm="rms")),
            (
                "fixed-g",
                "TwT Table 7: ScaleNorm (g = sqrt d) + FixNorm (learned)",
                row(M30K_FINAL, norm="scale_fixed"),
            ),
            ("pn-layernorm", "PowerNorm Table 1: LN", M30K_PN),
            (
                "pn-batchnorm",
                "PowerNorm Table 1: BN in the encoder",
                row(M30K_PN, encoder_norm="batch"),
            ),
            ("pn-pnv", "PowerNorm Table 1: PN-V in the encoder", row(M30K_PN, encoder_norm="pnv")),
            (
                "pn-powernorm",
                "PowerNorm Table 1: PN in the encoder (Algorithm 2)",
                row(M30K_PN, encoder_norm="power"),
            ),
            ("qknorm", "QKNorm Table 2: QKNorm + LayerNorm", M30K_QK),
            ("qknorm-no-g", "QKNorm Table 6: without g", row(M30K_QK, qk_no_g=True)),
        )
    },
}
