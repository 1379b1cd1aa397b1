"""train.py -- chapter 5: training a translator with the recipes of the three papers.

Reading order: norms.py -> model.py -> data.py -> decode.py -> train.py (this file).

    python train.py --norm scale --prenorm --fixnorm            # quick start, built-in corpus
    python train.py --data DIR --src en --tgt de --out runs/ende  # your corpus: DIR/train.en ...
    python train.py --preset list                                 # the papers' rows, by name
    python train.py --help                                        # every flag, with its paper

A run reads the corpus, trains a joint BPE, builds the model and trains it with Adam and a schedule
of [1] section 2.4; every --epoch-size steps it scores dev BLEU and keeps the best checkpoint, whose
test BLEU it reports at the end. The run directory (--out) holds the run: its flags, its log and its
checkpoints.

Contents
  1. The learning rate: eq. 7 (INVSQRTDECAY), VALDECAY, NOWARMUP [1, section 2.4]
  2. One training step: word dropout, forward + loss, backward, clipping, Adam
  3. The run: what it holds, and setting it up; the model of the flags, QKNorm's g0 [3, eq. 3]
  4. The loop: the batch, the schedule, the step, the evaluation, the checkpoint
  5. End of an epoch: dev BLEU, validation decay, the stop rules [1, appendix A], checkpoints;
     the final test

The machinery a reader of the papers never needs is in the package machinery/: the flags and
presets (`python train.py` runs machinery/train_cli.py), the log, this process and several, the
run directory with its checkpoints and --resume, the corpus into it.

  [1] Nguyen & Salazar 2019, Transformers without Tears.
  [2] Shen et al. 2020, PowerNorm.    [3] Henry et al. 2020, Query-Key Normalization.
"""

import argparse
import json
import math
import runpy
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

import data
import decode
from machinery import fileio, rundir
from machinery.corpora import prepare_data, read_corpus
from machinery.logbook import RunLog, StepLog, append_metrics, open_board
from machinery.processes import across_processes, rank0_first, start_process, wrap_model
from machinery.rundir import (
    budget,
    commit_run_dir,
    open_run_dir,
    restore,
    save_checkpoints,
    stop_signals,
)
from model import (
    FAST_PATHS,
    ModelConfig,
    Transformer,
    autocast,
    count_parameters,
    qk_g0,
)
from norms import BATCH_NORMS


# ---------------------------------------------------------------------------------------
# 1. The learning rate [1, section 2.4].
#   INVSQRTDECAY (eq. 7):  LR(n) = lambda / sqrt(d) * min(1/sqrt(n), n / n_warmup^1.5)
#     a linear warmup to lambda / sqrt(d * n_warmup) at n = n_warmup, then the inverse square root;
#   VALDECAY:  eq. 7's warmup, then flat at its peak, times alpha_decay when dev BLEU falls below
#   the last `patience`; NOWARMUP:  a constant LR (3e-4 in [1]), with the same validation decay.
#   cosine (the tensorized Transformer's PTB script, for [2]'s language models): eq. 7's linear
#     warmup to the peak, then peak * (1 + cos(pi (n - n_warmup) / (N - n_warmup))) / 2, to 0 at
#     the run's last step N (--max-steps, else --max-epochs x --epoch-size).
# Why ([1] 2.4 conjectures it): warmup lets a PostNorm model's LayerNorms on the residual path
#   adjust their scale early without gradients exploding or vanishing; PreNorm keeps a clean
#   residual path, so [1] trained it with no warmup at a constant 3e-4 ([1] Table 4; warmup still
#   helped gl-en). Validation-based decay then trains at that LR while dev BLEU holds up, and cuts
#   it by alpha_decay when a dev BLEU falls below each of the previous `patience` ones (Code; a
#   plateau never decays): the data, not a fixed formula, decides when the LR comes down.
# ---------------------------------------------------------------------------------------
def inverse_sqrt_lr(step, d_model, warmup, lr_scale):
    n = max(step, 1)
    # Exercise invsqrt: begin
    return lr_scale / math.sqrt(d_model) * min(n**-0.5, n * warmup**-1.5)
    # Exercise invsqrt: end


# VALDECAY: eq. 7's warmup, then flat at its peak, times the decays so far
def flat_after_warmup_lr(s, n, decay):
    return inverse_sqrt_lr(min(n, s.warmup), s.d_model, s.warmup, s.lr_scale) * decay


# eq. 7's warmup, then peak * (1 + cos(pi (n - n_warmup) / (N - n_warmup))) / 2
def cosine_lr(s, n, decay):
    if n <= s.warmup:
        return flat_after_warmup_lr(s, n, 1.0)
    return (
        s.peak * (1 + math.cos(math.pi * min(1.0, (n - s.warmup) / max(s.total - s.warmup, 1)))) / 2
    )


class ScheduleEntry(NamedTuple):  # a schedule of the registry, as norms.py's Norm
    # lr(schedule, n, decay): the LR of step n; decay: the product of the validation decays so far
    lr: Callable
    warms_up: bool  # reads --warmup (n_warmup)
    decays: bool  # validation-based decay ([1] 2.4): reads --patience and --decay-factor
    help: str  # what --help says of it


# The registry, as norms.py's NORMS: --schedule NAME -> its entry, which --help, check_flags and
# Schedule read.
SCHEDULES = {
    "invsqrt": ScheduleEntry(
        lambda s, n, decay: inverse_sqrt_lr(n, s.d_model, s.warmup, s.lr_scale),
        True,
        False,
        "eq. 7 of [1] (INVSQRTDECAY)",
    ),
    "valdecay": ScheduleEntry(
        flat_after_warmup_lr,
        True,
        True,
        "eq. 7's linear warmup, then flat at its peak, times "
        "--decay-factor when dev BLEU stalls ([1] 2.4, VALDECAY)",
    ),
    "nowarmup": ScheduleEntry(
        lambda s, n, decay: s.peak * decay,
        False,
        True,
        "constant --lr (3e-4 in [1] 3.3) with the same validation decay",
    ),
    "warmupflat": ScheduleEntry(
        flat_after_warmup_lr,
        True,
        True,
        "valdecay under the name of QKNorm's released configs (Code [3])",
    ),
    "cosine": ScheduleEntry(
        cosine_lr,
        True,
        False,
        "the warmup, then a cosine to 0 at the run's last step (the "
        "tensorized Transformer's PTB script, [2]'s language models)",
    ),
}


@dataclass
class Schedule:
    kind: str  # a name in SCHEDULES
    d_model: int
    warmup: int  # n_warmup; 0 for a schedule that does not warm up (nowarmup)
    peak: float  # the peak LR, lambda / sqrt(d * n_warmup); the constant LR under nowarmup
    total: int = 0  # cosine: the run's last step N

    @classmethod
    def from_args(cls, args):
        return cls(
            args.schedule,
            args.d_model,
            args.warmup if SCHEDULES[args.schedule].warms_up else 0,
            # resolve_flags made lr lambda / sqrt(d * n_warmup) under --lr-scale
            args.lr,
            budget(args)[0],
        )

    @property
    def lr_scale(self):  # lambda of eq. 7
        return self.peak * math.sqrt(self.d_model * max(self.warmup, 1))

    @property
    def decays(self):  # [1] 2.4: validation-based decay
        return SCHEDULES[self.kind].decays

    # the LR of step n, as ScheduleEntry.lr says (decay: the decays so far)
    def __call__(self, step, decay=1.0):
        return SCHEDULES[self.kind].lr(self, step, decay)


def validation_decay(history, patience):
    """[1] 2.4 VALDECAY. Code: decay when the newest dev BLEU is strictly below each of the previous
    `patience` ones (no cooldown); returns True when the LR should be multiplied."""
    # Exercise validation_decay: begin
    if len(history) <= patience:
        return False
    return history[-1] < min(history[-1 - patience : -1])
    # Exercise validation_decay: end


# ---------------------------------------------------------------------------------------
# 2. One training step: an update from one or more micro-batches (--accumulate) of this rank.
# ---------------------------------------------------------------------------------------
@dataclass
class StepOptions:
    # Word dropout: [1] appendix A's 0.1, tokens -> UNK; Code: on the source and target *inputs*.
    word_dropout: float
    smoothing: float  # label smoothing epsilon
    clip: float  # clip the global gradient norm at this (0: off)
    rng: Optional[torch.Generator] = None  # word dropout's own random generator
    bf16: bool = False  # bf16 autocast, where --dtype's precision is bf16 (model.precision)

    @classmethod
    def from_args(cls, args, device, rank, bf16):
        # Word dropout draws from its own generator, on the device the batches live on.
        rng = torch.Generator(device=device).manual_seed(args.seed + rank)
        return cls(args.word_dropout, args.label_smoothing, args.clip, rng, bf16)


def train_step(net, optimizer, batches, lr, opts: StepOptions):
    """Forward, label-smoothed loss, backward for every micro-batch, then clip and Adam. Returns
    this rank's (loss sum, NLL sum), the gradient norm before clipping, and the step's target
    tokens, which the loss is divided by."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)

    # Code: word dropout on source and target inputs, never on the targets ([1] appendix A: p 0.1,
    # UNK). b.src is None for a language model.
    def drop(x):
        if opts.word_dropout and x is not None:
            return data.word_dropout(x, opts.word_dropout, opts.rng)
        return x

    loss_sum = nll_sum = 0.0
    # One process, or several under torchrun (machinery/processes.py).
    with across_processes(net, batches) as (n_tgt, grad_sync):
        for i, b in enumerate(batches):
            with grad_sync(i):
                with autocast(b.tgt_in.device, opts.bf16):
                    # Sums over the targets.
                    loss, nll = net(drop(b.src), drop(b.tgt_in), b.tgt_out, opts.smoothing)
                # Code: summed over non-pad targets, divided by their count.
                (loss / n_tgt).backward()
            loss_sum, nll_sum = loss_sum + loss.detach(), nll_sum + nll.detach()
    # Paper (appendix A): "Gradients are clipped when global norm exceeds 1.0"; the norm before
    # clipping is what [1] Figure 2 plots.
    gnorm = torch.nn.utils.clip_grad_norm_(
        net.parameters(), opts.clip if opts.clip > 0 else float("inf")
    )
    optimizer.step()
    return loss_sum, nll_sum, gnorm.detach(), n_tgt


# ---------------------------------------------------------------------------------------
# 3. The training state and the run: what a run holds, and setting it up.
# setup() builds the run in a few named calls: this process, the corpus, the run directory, the
# data, the model of the flags (model.py; QKNorm's g0 [3, eq. 3] from the training data) and its
# optimizer, and the step a resumed run starts from.
# ---------------------------------------------------------------------------------------
@dataclass
class TrainState:
    """Everything resume needs besides the model, the optimizer and the random generators."""

    step: int = 0  # optimizer updates so far
    epoch: int = 0  # evaluations so far (an epoch is --epoch-size steps, as in [1]'s code)
    data_pass: int = 0  # passes over the training data so far (an epoch here is not one)
    batch_pos: int = 0  # position in this pass's shuffled batch order
    best_step: int = 0  # the step of the best dev score (the best checkpoint's)
    # The dev score of every evaluation (TASKS: BLEU or perplexity).
    history: list = field(default_factory=list)
    lr_decay: float = 1.0  # the product of the validation decays so far
    stopped: Optional[tuple] = None  # why training stopped: (code, message) of STOPS
    # Training time so far, over every start of the run (evaluation not counted).
    train_seconds: float = 0.0
    # The sums of the steps since the last log line (machinery/logbook.py's StepLog).
    window: dict = field(default_factory=dict)


@dataclass
class Run:
    """One training run, built once by setup(); what the loop and its helpers read."""

    args: argparse.Namespace
    dir: Path
    device: torch.device
    rank: int  # this process's rank and the number of processes (machinery/processes.py)
    world: int
    log: RunLog  # log(line): rank 0's console and train.log (machinery/logbook.py)
    tokenizer: data.Tokenizer
    langs: tuple  # the source and target language suffixes
    pairs: dict  # raw text pairs per split: dev and test BLEU
    train: list  # encoded training pairs
    dev: list  # encoded dev pairs: dev perplexity
    model: Transformer
    net: torch.nn.Module  # what a step calls: the model, or its DDP or compiled wrapper
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    step_options: StepOptions
    state: TrainState = field(default_factory=TrainState)
    order: list = field(default_factory=list)  # this pass's shuffled batches
    # --tensorboard: the SummaryWriter that append_metrics also writes to.
    board: Optional[object] = None

    @property
    def master(self):  # rank 0 alone logs and writes files
        return self.rank == 0

    def next_batches(self):
        """This rank's micro-batches of the next step: each step takes world x accumulate
        consecutive batches of the shuffled order; rank r trains on every world-th from the r-th."""
        n, s = self.world * self.args.accumulate, self.state
        if s.batch_pos + n > len(self.order):  # the data ran out: the next shuffled pass
            s.data_pass, s.batch_pos = s.data_pass + 1, 0
            self.order = data.make_batches(
                self.train, self.args.batch_tokens, True, self.args.seed, s.data_pass
            )
        idx = self.order[s.batch_pos + self.rank : s.batch_pos + n : self.world]
        s.batch_pos += n
        return [data.collate(self.train, i, self.device, self.pad_multiple) for i in idx]

    @property
    def pad_multiple(self):
        """Lengths are padded to a multiple of this: 8 under --compile (see wrap_model), else 1."""
        return 8 if self.args.compile else 1


def setup(args, stack, log, resumed=None):
    """Everything before the first step, in order: this process, the corpus, the run directory, the
    data, the model and its optimizer, the checkpoint a resumed run starts from. Every input (flags,
    corpus, the run directory and what it holds) is read and checked before anything is written; the
    run directory's lock is held in ``stack`` until training ends (machinery/rundir.py). resumed:
    --resume's (checkpoint, flags that differ), from machinery/train_cli.py's resume_flags."""
    # Threads, seeds, torchrun's ranks (machinery/processes.py).
    rank, world, device, bf16 = start_process(args, log, stack)
    pairs, langs = read_corpus(args, log)  # machinery/corpora.py
    # Under torchrun the other ranks read what rank 0 checks, prepares and commits.
    with rank0_first(rank, world):
        # The run directory, checked; the rules of its stops are this chapter's (stop_reason).
        run_dir, ckpt, stage = open_run_dir(
            args, pairs, log, stack, master=rank == 0, resumed=resumed, stop_reason=stop_reason
        )
        # The BPE model and the encoded corpus (machinery/corpora.py).
        tokenizer, train, dev, unfiltered = prepare_data(args, pairs, run_dir, stage, log, ckpt)
        model, optimizer = build_model(
            args, tokenizer, train, unfiltered, device=device, bf16=bf16, log=log
        )
        run = Run(
            args=args,
            dir=run_dir,
            device=device,
            rank=rank,
            world=world,
            log=log,
            tokenizer=tokenizer,
            langs=langs,
            pairs=pairs,
            train=train,
            dev=dev,
            model=model,
            net=model,
            optimizer=optimizer,
            schedule=Schedule.from_args(args),
            step_options=StepOptions.from_args(args, device, rank, bf16),
        )
        start_from(run, ckpt)
        if run.master and not args.benchmark:
            # Every input checked: the run directory's first change (machinery/rundir.py).
            commit_run_dir(args, run_dir, stage, ckpt, log)
        if args.tensorboard and run.master:
            run.board = open_board(run_dir, run.state.step, stack)  # machinery/logbook.py
    # DDP and --compile (machinery/processes.py).
    run.net = wrap_model(model, args, world, device)
    return run


def start_from(run, ckpt):
    """The step the run starts from: a resumed run's checkpoint (machinery/rundir.py's restore), and
    the shuffled batch order of the pass over the data that step is in."""
    args = run.args
    if ckpt is not None:
        restore(run, ckpt)
    run.order = data.make_batches(
        run.train, args.batch_tokens, True, args.seed, run.state.data_pass
    )
    # A step takes a batch for each process and micro-batch.
    if len(run.order) < run.world * args.accumulate:
        raise fileio.DataError(
            f"the training data makes {len(run.order)} batches of --batch-tokens "
            f"{args.batch_tokens}, fewer than the {run.world * args.accumulate} of a step "
            f"({run.world} processes x --accumulate {args.accumulate}): give a smaller "
            f"--batch-tokens"
        )


def build_model(args, tokenizer, train, unfiltered, device, bf16, log):
    """The model of the flags (model.py) and its optimizer: Adam ([1] appendix A), AdamW under
    --weight-decay. A language model may predict every word; a translator only the target side's
    ([1] appendix A: the tied output layer masks the other words)."""
    allowed = (
        None
        if args.task == "lm"
        else data.target_vocab_mask([t for _, t in train], tokenizer.vocab_size)
    )
    cfg = model_config_from_args(
        args, tokenizer.vocab_size, qknorm_g0(args, unfiltered, log) if args.qknorm else 1.0
    )
    model = Transformer(cfg, allowed).to(device)
    log(
        f"model: {count_parameters(model) / 1e6:.2f}M parameters, "
        f"{'PreNorm' if cfg.prenorm else 'PostNorm'}, "
        f"norm={cfg.encoder_norm or cfg.norm}/{cfg.decoder_norm or cfg.norm}, "
        f"fixnorm={cfg.fixnorm}, "
        f"init={cfg.init}, qknorm={cfg.qknorm}, device={device}{' bf16' if bf16 else ''}, "
        f"threads={torch.get_num_threads()}"
        + (f", {dist.get_world_size()} ranks" if dist.is_initialized() else "")
        + (", --reference" if args.reference else "")
    )
    # An edit to one of these main-text functions shows only with --reference.
    if not args.reference:
        log(
            "fast paths, where they apply: "
            + ", ".join(f"{k} -> {v}" for k, v in FAST_PATHS.items())
            + "; an edit to one of these functions runs only with --reference"
        )
    adam = torch.optim.AdamW if args.weight_decay > 0 else torch.optim.Adam
    return model, adam(
        model.parameters(),
        lr=0.0,
        betas=(args.beta1, args.beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
        fused=True if device.type == "cuda" else None,
    )


def model_config_from_args(args, vocab_size, qk_g0=1.0):
    """The ModelConfig of the flags: a field named as a flag takes its value (d_model: --d-model);
    the others here."""
    named = {f.name: getattr(args, f.name) for f in fields(ModelConfig) if hasattr(args, f.name)}
    # --pn-K: PowerNorm's option K.
    power = {k: getattr(args, f"pn_{k}") for k in ("warmup", "variant", "alpha_fwd", "alpha_bkw")}
    # The module counts forwards; --pn-warmup counts updates (--accumulate forwards each).
    power["warmup"] *= args.accumulate
    return ModelConfig(
        **dict(
            named,
            vocab_size=vocab_size,
            enc_layers=args.enc_layers or args.layers,
            norm_options=power,
            qk_g0=qk_g0,
            dec_layers=args.dec_layers or args.layers,
            qk_learn_g=not args.qk_no_g,
            lm=args.task == "lm",
            seq_len=args.seq_len if args.attention == "multilinear" else 0,
        )
    )


def qknorm_g0(args, train, log):
    """QKNorm's g0 = log2(L^2 - L) [3, eq. 3], L from --qk-length or the training data. Paper [3]
    section 3: "L is the 97.5th percentile sequence length across all training data sequences for
    source and target"; its Table 5 says "word count". Note: we count BPE tokens, the sequence the
    attention sees (g0 is there because of the number of elements in QK^T), over every training pair
    before the --max-len filter (which would cap a high percentile); whitespace words give a smaller
    L (Multi30k en-de: 30 BPE tokens, 20 words). Code [3]: L hard-coded per pair."""
    if args.qk_length is not None:
        L, how = args.qk_length, "--qk-length"
    elif args.task == "lm":
        L, how = args.seq_len, "--seq-len: a language model's segments are that long"
    else:
        L = data.length_percentile(train, q=args.qk_percentile)
        how = (
            f"{args.qk_percentile}th percentile of BPE training lengths, source and target pooled, "
            f"no BOS/EOS, before the --max-len filter"
        )
    g0 = qk_g0(L)
    log(f"qknorm: L = {L:.2f} ({how}); g0 = log2(L^2 - L) = {g0:.3f}")
    return g0


# ---------------------------------------------------------------------------------------
# 4. The loop: the batch, the schedule, the step, the evaluation and the checkpoint.
# One log line per --log-interval steps, dev BLEU every --epoch-size steps; a stop request (Ctrl-C,
# SIGTERM) or --save-interval saves the step it comes at, which a resumed run starts after.
# ---------------------------------------------------------------------------------------
def train_loop(run):
    """The training loop; machinery/train_cli.py's main() calls it with the run that setup() built
    from the checked flags."""
    args, s = run.args, run.state
    total, limit = budget(args)
    # The progress bar (step_log.bar), log lines, metrics.jsonl, MFU (machinery/logbook.py).
    step_log = StepLog(run, total, diverged)
    # Ctrl-C or SIGTERM stops the run after the step in progress (machinery/rundir.py).
    with step_log.bar, stop_signals(run) as signalled:
        while s.step < total and not s.stopped:
            batches = run.next_batches()
            s.step += 1
            lr = run.schedule(s.step, s.lr_decay)
            keep_diagnostics(run)
            loss, nll, gnorm, n_tgt = train_step(
                run.net, run.optimizer, batches, lr, run.step_options
            )
            # The step's record and, every --log-interval steps, the log line. It stops the run at
            # a non-finite loss or gradient norm.
            step_log.step(batches, lr, loss, nll, gnorm, n_tgt)
            if s.stopped:
                break
            evaluated = s.step % args.epoch_size == 0 or s.step == total
            if evaluated:
                end_of_epoch(run)  # which writes its checkpoints
                step_log.evaluated()
            stop = stop_requested(run, signalled, evaluated)
            if not evaluated and (stop or save_due(run)):
                save_step(run, step_log)
            if stop:
                raise KeyboardInterrupt(stop)  # main() says how to continue
    # Else the budget stopped the run, recorded in results.json.
    s.stopped = s.stopped or stopping(args, limit)
    if s.stopped[0] != "diverged":
        run.log(f"stopping: {s.stopped[1]}")
    result = finish(run)
    if s.stopped[0] == "diverged":  # a failed run exits non-zero (its last good checkpoint stays)
        sys.exit(f"error: {s.stopped[1]}")
    return result


def keep_diagnostics(run):
    """The batch norms keep [2] Figures 2-4's diagnostics at log steps only, as they cost time (none
    under --compile); StepLog's log line writes them to metrics.jsonl."""
    track = run.state.step % run.args.log_interval == 0 and not run.args.compile
    for m in run.model.modules():
        if isinstance(m, BATCH_NORMS):
            m.track, m.stats = track, {}


def stop_requested(run, signalled, evaluated):
    """The signal (Ctrl-C, SIGTERM) that stops the run after this step, 0 if none. Under torchrun
    the ranks agree on it, on a GPU only at host syncs: evaluations and log lines
    (machinery/rundir.py's stop_signals). A run that stops anyway (its stop rules, at an evaluation)
    is not asked."""
    if run.state.stopped:
        return 0
    return signalled(evaluated or run.state.step % run.args.log_interval == 0)


def save_due(run):
    """Whether --save-interval saves this step (an evaluation's step saves its own checkpoints)."""
    return bool(run.args.save_interval) and run.state.step % run.args.save_interval == 0


def save_step(run, step_log):
    """A checkpoint of this step, which a resumed run starts after. The step's records go first; no
    checkpoint if a step diverged (the last good one stays)."""
    if step_log.flush():
        save_checkpoints(run, improved=False, epoch_end=False)  # machinery/rundir.py


# ---------------------------------------------------------------------------------------
# 5. End of an epoch: dev perplexity and BLEU, validation decay, the stop rules, checkpoints.
# Rank 0 evaluates and writes; every rank takes its decisions. The stop rules are [1] appendix A's
# (the LR too small, or no progress), beside the budget (--max-steps, --max-epochs); a diverged run
# (diverged) stops with its last good checkpoint. After the loop, the final test.
# ---------------------------------------------------------------------------------------
class Task(NamedTuple):  # a task of the registry TASKS, as ScheduleEntry is a schedule of SCHEDULES
    """What a task's dev score is, which way is better, and how the log prints it."""

    name: str  # as the log says it
    key: str  # its key in metrics.jsonl (dev_KEY) and results.json (best_dev_KEY)
    # +1: higher is better (BLEU), -1: lower is better (perplexity); sign * score: higher is better.
    sign: int
    width: str  # its format in the epoch line

    def since_best(self, history):  # evaluations since the best (the first of equals)
        up = [self.sign * x for x in history]
        return len(up) - 1 - up.index(max(up))

    def scores(self, score, dev_ppl, history):  # the epoch line's scores
        bleu = f"dev BLEU {score:6.2f} | " if self.key == "bleu" else ""
        best = history[-1 - self.since_best(history)]
        return f"{bleu}dev ppl {dev_ppl:7.2f} | best {best:{self.width}}"


TASKS = {"mt": Task("dev BLEU", "bleu", 1, "6.2f"), "lm": Task("dev perplexity", "ppl", -1, "7.2f")}


def dev_score(run):
    """Rank 0: (score, dev loss per token, dev perplexity). The score is a translator's dev BLEU, a
    language model's dev perplexity (TASKS); None when the model diverged: a checkpoint is written
    only if it is good, finite weights and a finite dev loss (weights of 1e30 are finite, but their
    dev loss is not)."""
    args = run.args
    dev_loss, dev_nll, n = decode.evaluate_loss(
        run.model, run.dev, args.batch_tokens, args.label_smoothing, run.step_options.bf16
    )
    bad = next(
        (name for name, p in run.model.named_parameters() if not torch.isfinite(p).all()), None
    )
    if bad or not math.isfinite(dev_loss):
        diverged(
            run,
            (f"the weights became non-finite ({bad})" if bad else f"the dev loss became {dev_loss}")
            + f" at step {run.state.step}, so no checkpoint of it is written",
        )
        return None, None, None
    dev_ppl, dev_loss = math.exp(min(dev_nll / max(n, 1), 50)), dev_loss / max(n, 1)
    if args.task == "lm":
        return dev_ppl, dev_loss, dev_ppl
    hyps = translate_split(run, "dev", args.dev_beam)
    return decode.bleu(hyps, [y for _, y in run.pairs["dev"]]).score, dev_loss, dev_ppl


def translate_split(run, split, beam):
    """The run's translations of a split's sources ("dev" or "test") with this beam, the run's
    length penalty and its output length limit (decode.py section 5)."""
    args = run.args
    search = decode.Search(
        beam,
        args.alpha,
        max_src_len=args.max_len,
        bf16=run.step_options.bf16,
        penalty=args.length_penalty,
    )
    sources = [x for x, _ in run.pairs[split]]
    return decode.translate(run.model, run.tokenizer, sources, search, args.batch_tokens)


def end_of_epoch(run):
    """Dev BLEU of a translator, dev perplexity of a language model (TASKS); the same decisions on
    either."""
    args, s, task = run.args, run.state, TASKS[run.args.task]
    s.epoch += 1
    t0, score = time.time(), None
    if run.master:
        score, dev_loss, dev_ppl = dev_score(run)
    # Every rank takes the same decisions: rank 0's dev score and stop (machinery/processes.py).
    if run.world > 1:
        dist.broadcast_object_list(shared := [score, s.stopped], src=0)
        score, s.stopped = shared
    if score is None:  # diverged
        return
    s.history.append(score)
    improved = task.since_best(s.history) == 0  # the first evaluation is the best so far
    if improved:
        s.best_step = s.step
    # Validation decay ([1] 2.4), for the schedules that have it: "we still perform a linear warmup
    # but then multiply by a scale alpha_decay < 1"; Code: no decay while still in the warmup.
    up = [task.sign * x for x in s.history]  # higher is better, as validation_decay reads them
    decayed = (
        run.schedule.decays
        and s.step >= run.schedule.warmup
        and validation_decay(up, args.patience)
    )
    if decayed:
        s.lr_decay *= args.decay_factor
    # [1] appendix A: the LR too small, or no progress.
    s.stopped = stop_reason(args, s.step, s.lr_decay, s.history)
    if not run.master:
        # The other ranks' part of rank 0's checkpoint: their random generators.
        save_checkpoints(run, improved)
        return
    # [1] Figure 1 (dev BLEU per epoch) and Figures 3-4 (learned g's) come from these records.
    append_metrics(
        run,
        {
            "step": s.step,
            "epoch": s.epoch,
            f"dev_{task.key}": score,
            "dev_loss": dev_loss,
            "dev_ppl": dev_ppl,
            "lr": run.schedule(s.step + 1, s.lr_decay),
            "g": run.model.learned_scales(),
        },
    )
    # The checkpoints come before the epoch's line: no log reports an epoch a resume lacks.
    save_checkpoints(run, improved)
    line = (
        f"epoch {s.epoch:3d} | step {s.step:6d} | {task.scores(score, dev_ppl, s.history)} "
        f"(step {s.best_step}) | eval {time.time() - t0:.1f}s"
    )
    if decayed:
        line += (
            f" | LR x {args.decay_factor} ({task.name} worse than each of the previous "
            f"{args.patience})"
        )
    run.log(line)


# Why a run stops: the code TrainState.stopped keeps, and its message (the log, results.json).
STOPS = {
    "max_steps": "--max-steps {args.max_steps} reached",
    "max_epochs": "--max-epochs {args.max_epochs} reached",
    "stop_lr": "the LR {lr:.2e} fell below --stop-lr {args.stop_lr:g}",
    "early_stop": "{task.name} has not improved for {args.early_stop} evaluations",
    "diverged": "diverged: {what} (try a smaller --lr, --prenorm, --init small or more --warmup); "
    "{last}",
}


def stopping(args, code, **values):
    """(code, message) of a stop in STOPS, as TrainState.stopped keeps it."""
    return code, STOPS[code].format(args=args, task=TASKS[args.task], **values)


def stop_reason(args, step, lr_decay, history):
    """The stop rules of [1] appendix A, one owner (end_of_epoch, and machinery/rundir.py's
    may_resume): why a run stops after its evaluation at `step`, or None: the LR of its next step
    below --stop-lr after the warmup, else no dev gain for --early-stop."""
    schedule = Schedule.from_args(args)
    if (lr := schedule(step + 1, lr_decay)) < args.stop_lr and step >= schedule.warmup:
        return stopping(args, "stop_lr", lr=lr)
    if 0 < args.early_stop <= TASKS[args.task].since_best(history):
        return stopping(args, "early_stop")
    return None


def diverged(run, what):
    """Stop the run as diverged: one line saying what and where the last good checkpoint is
    (machinery/logbook.py's StepLog calls it at a non-finite loss or gradient norm)."""
    last = rundir.checkpoint_file(run.dir, "last")
    where = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was written"
    run.state.stopped = stopping(run.args, "diverged", what=what, last=where)
    run.log("error: " + run.state.stopped[1])


def finish(run):
    """Test BLEU (beam search) or perplexity of the best checkpoint (by the dev score); the learned
    g's. Rank 0 alone; results.json records the run's outcome."""
    args = run.args
    if not run.master:
        return None
    if not (best := rundir.checkpoints(run.dir, "test")):
        run.log("no checkpoint was written (the run ended before its first epoch)")
        return None
    ckpt = rundir.read_checkpoint(best[0], run.device)
    run.model.load_state_dict(ckpt["model"])
    best = ckpt["train_state"]
    result = {
        "run_id": args.run_id,
        "steps": run.state.step,
        "best_step": best["step"],
        f"best_dev_{TASKS[args.task].key}": best["history"][-1],
        "train_seconds": run.state.train_seconds,
        "precision": run.args.precision,  # what the run computed in (--dtype)
        "stopped": run.state.stopped[1],
        # [2] Figure 6: the embedding matrix's singular values, over the largest (decode.py --svd).
        "embedding_singular_values": decode.singular_values(run.model),
    }
    # [1] Figures 3-4: learned g versus depth (in train.log too).
    decode.print_g_table(run.model, run.log)
    # The learned g's are written before the test.
    fileio.atomic_write(
        run.dir / "g_values.json", json.dumps(decode.g_values(run.model), indent=2) + "\n"
    )
    if args.task == "lm":
        result.update(final_perplexity(run, best["step"]))
    elif run.pairs["test"]:
        result.update(final_bleu(run, best["step"]))
    append_metrics(run, {"final": result})  # metrics.jsonl's last record
    # A finished run (machinery/rundir.py's may_resume reads it).
    fileio.atomic_write(run.dir / "results.json", json.dumps(result, indent=2) + "\n")
    return result


def final_perplexity(run, best_step):
    """The field's test perplexity: every target token, EOS included, no smoothing; the dev set's
    too, for its count of unknown words (the OOV rate)."""
    args = run.args
    both = {
        s: decode.lm_perplexity(
            run.model,
            run.tokenizer,
            run.pairs[s],
            args.seq_len,
            args.batch_tokens,
            run.step_options.bf16,
        )
        for s in ("dev", "test")
    }
    ppl = both["test"]
    result = {"test_ppl": ppl["ppl"], "test_tokens": ppl["n_tokens"]}
    per_word = ""
    if args.bpe_size:  # BPE: per word too (the same NLL over the text's words and EOS)
        result.update(test_word_ppl=ppl["word_ppl"], test_words=ppl["n_words"])
        per_word = f" ({ppl['word_ppl']:.2f} per word, {ppl['n_words']} words and EOS)"
    result.update({f"{s}_{k}": p[k] for s, p in both.items() for k in ("unk_tokens", "unk_share")})
    unknown = ", ".join(f"{s} {p['unk_tokens']} ({p['unk_share']:.2%})" for s, p in both.items())
    run.log(
        f"test perplexity (best checkpoint, step {best_step}): {ppl['ppl']:.2f} over "
        f"{ppl['n_tokens']} tokens{per_word}; unknown (<unk>) tokens: {unknown}"
    )
    return result


def final_bleu(run, best_step):
    """Test BLEU, chrF and tokenized BLEU (decode.py --json's) of beam search; test.hyp holds the
    translations."""
    args = run.args
    hyps = translate_split(run, "test", args.beam)
    s = decode.scores(hyps, [y for _, y in run.pairs["test"]])
    fileio.atomic_write(run.dir / "test.hyp", "".join(h + "\n" for h in hyps))
    run.log(
        f"test (best checkpoint, step {best_step}, beam {args.beam}, {args.length_penalty} length "
        f"penalty alpha {args.alpha}): {decode.score_report(s)}"
    )
    return {
        "test_bleu": s["bleu"]["score"],
        "test_signature": s["bleu"]["signature"],
        "test_chrf": s["chrf"]["score"],
        "test_chrf_signature": s["chrf"]["signature"],
    }


if __name__ == "__main__":
    # The command line (its flags, modes and checks) is machinery, not the book:
    # machinery/train_cli.py runs as the program and reads this chapter.
    runpy.run_module("machinery.train_cli", run_name="__main__")
