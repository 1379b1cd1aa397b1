"""train.py -- chapter 5: training a translator with the recipes of the three papers.

Reading order: norms.py -> model.py -> data.py -> decode.py -> train.py (this file).

    python train.py --norm scale --prenorm --fixnorm            # quick start, built-in corpus
    python train.py --data DIR --src en --tgt de --out runs/ende  # your corpus: DIR/train.en ...
    python train.py --preset list                                 # the papers' rows, by name
    python train.py --help                                        # every flag, with its paper

A run reads the corpus, trains a joint BPE, builds the model and trains it with Adam and a schedule
of [1] section 2.4; every --epoch-size steps it scores dev BLEU and keeps the best checkpoint, whose
test BLEU it reports at the end. The run directory (--out) holds the run: its flags, log,
checkpoints.

Contents
  1. The learning rate: eq. 7 (INVSQRTDECAY), VALDECAY, NOWARMUP [1, section 2.4]
  2. One training step: word dropout, forward + loss, backward, clipping, Adam
  3. The training state and the run: setting it up, one call each
  4. The loop
  5. End of an epoch: dev BLEU, validation decay, stopping, checkpoints; the final test
  Appendix A: main(), the flags (python train.py --help), and the model's configuration from them
  Appendix B: presets, the papers' table rows as named sets of flags (--preset NAME)
  Appendix C: speed and the log: FLOPs, MFU, log lines, divergence, batch-norm diagnostics,
  --benchmark, --profile
  Appendix D: this process (threads, seeds, device), and several (torchrun, DistributedDataParallel)
  Appendix E: the run directory: one run, checked, locked; checkpoints; --resume
  Appendix F: the corpus into the run directory: read, BPE, encode (data.py does each)

  [1] Nguyen & Salazar 2019, Transformers without Tears.
  [2] Shen et al. 2020, PowerNorm.    [3] Henry et al. 2020, Query-Key Normalization.
"""

import argparse
import contextlib
import ctypes
import hashlib
import importlib.util
import io
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.profiler import ProfilerActivity, profile
from torch.utils.benchmark import Timer

import data
import decode
from data import (
    alpha_range,
    count,
    fraction,
    in_0_1,
    length_range,
    non_negative,
    positive,
    positive_int,
    threads,
)
from model import (
    FAST_PATHS,
    ModelConfig,
    Transformer,
    autocast,
    count_parameters,
    has_bf16,
    output_columns,
    qk_g0,
)
from norms import BATCH_NORMS, NORMS, sync, timed


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
    # [1] appendix A: 0.1, tokens -> UNK; Code: on the source and target *inputs*
    word_dropout: float
    smoothing: float  # label smoothing epsilon
    clip: float  # clip the global gradient norm at this (0: off)
    rng: Optional[torch.Generator] = None  # word dropout's own random generator
    bf16: bool = False  # bf16 autocast on CUDA (--dtype bf16)


def train_step(net, optimizer, batches, lr, opts: StepOptions):
    """Forward, label-smoothed loss, backward for every micro-batch, then clip and Adam. Returns
    this rank's (loss sum, NLL sum), the gradient norm before clipping, and the step's target
    tokens, which the loss is divided by."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    # Code: word dropout on source and target inputs, never on the targets ([1] appendix A: p 0.1,
    # UNK).
    drop = lambda x: (
        data.word_dropout(x, opts.word_dropout, opts.rng)
        if opts.word_dropout and x is not None
        else x
    )
    loss_sum = nll_sum = 0.0
    # Appendix D: one process, or several (torchrun)
    with across_processes(net, batches) as (n_tgt, grad_sync):
        for i, b in enumerate(batches):
            with grad_sync(i):
                with autocast(b.tgt_in.device, opts.bf16):  # b.src is None for a language model
                    # sums over the targets
                    loss, nll = net(drop(b.src), drop(b.tgt_in), b.tgt_out, opts.smoothing)
                # Code: summed over non-pad targets, divided by their count
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
# 3. The training state and the run: what a run holds, and setting it up (the model: model.py).
# ---------------------------------------------------------------------------------------
@dataclass
class TrainState:
    """Everything resume needs besides the model, the optimizer and the random generators."""

    step: int = 0  # optimizer updates so far
    epoch: int = 0  # evaluations so far (an epoch is --epoch-size steps, as in [1]'s code)
    data_pass: int = 0  # passes over the training data so far (an epoch here is not one)
    batch_pos: int = 0  # position in this pass's shuffled batch order
    best_step: int = 0  # the step of the best dev score (the best checkpoint's)
    # the dev score of every evaluation (TASKS: BLEU or perplexity)
    history: list = field(default_factory=list)
    lr_decay: float = 1.0  # the product of the validation decays so far
    stopped: Optional[tuple] = None  # why training stopped: (code, message) of STOPS
    # training time so far, over every start of the run (evaluation not counted)
    train_seconds: float = 0.0
    # the sums of the steps since the last log line (StepLog)
    window: dict = field(default_factory=dict)


@dataclass
class Run:
    """One training run, built once by setup(); what the loop and its helpers read."""

    args: argparse.Namespace
    dir: Path
    device: torch.device
    rank: int  # this process's rank and the number of processes (Appendix D)
    world: int
    log: "RunLog"  # log(line): rank 0's console and train.log (Appendix C)
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
    # --tensorboard: the SummaryWriter that append_metrics also writes to
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
    # lengths are padded to a multiple of this: 8 under --compile (see wrap_model), else 1
    def pad_multiple(self):
        return 8 if self.args.compile else 1


def setup(args, stack, log, resumed=None):
    """Everything before the first step, in order: this process, the corpus, the run directory, the
    data, the model and its optimizer, the checkpoint a resumed run starts from. Every input (flags,
    corpus, the run directory and what it holds) is read and checked before anything is written; the
    run directory's lock is held in ``stack`` until training ends (Appendix E). resumed: --resume's
    (checkpoint, flags that differ), from resume_flags."""
    # Appendix D: threads, seeds, torchrun's ranks
    rank, world, device, bf16 = start_process(args, log, stack)
    pairs, langs = read_corpus(args, log)  # Appendix F
    # Appendix D: the other ranks read what rank 0 checks, prepares and commits
    with rank0_first(rank, world):
        # Appendix E: checked
        run_dir, ckpt, stage = open_run_dir(args, pairs, log, stack, rank == 0, resumed)
        # Appendix F
        tokenizer, train, dev, unfiltered = prepare_data(args, pairs, run_dir, stage, log, ckpt)
        model, optimizer = build_model(args, tokenizer, train, unfiltered, device, bf16, log)
        # Word dropout draws from its own generator, on the device the batches live on.
        options = StepOptions(
            args.word_dropout,
            args.label_smoothing,
            args.clip,
            torch.Generator(device=device).manual_seed(args.seed + rank),
            bf16,
        )
        run = Run(
            args,
            run_dir,
            device,
            rank,
            world,
            log,
            tokenizer,
            langs,
            pairs,
            train,
            dev,
            model,
            model,
            optimizer,
            Schedule.from_args(args),
            options,
        )
        if ckpt is not None:
            restore(run, ckpt)  # Appendix E
        run.order = data.make_batches(
            train, args.batch_tokens, True, args.seed, run.state.data_pass
        )
        # a step takes a batch for each process and micro-batch
        if len(run.order) < world * args.accumulate:
            raise data.DataError(
                f"the training data makes {len(run.order)} batches of --batch-tokens "
                f"{args.batch_tokens}, fewer than the {world * args.accumulate} of a step ({world} "
                f"processes x --accumulate {args.accumulate}): give a smaller --batch-tokens"
            )
        if run.master and not args.benchmark:
            # Appendix E: every input checked, the first change
            commit_run_dir(args, run_dir, stage, ckpt, log)
        # an optional extra (check_flags checked it is installed)
        if args.tensorboard and run.master:
            # a resume hides what a killed run wrote after it
            from torch.utils.tensorboard import SummaryWriter

            run.board = stack.enter_context(SummaryWriter(run_dir, purge_step=run.state.step + 1))
    run.net = wrap_model(model, args, world, device)  # Appendix D: DDP; Appendix C: --compile
    return run


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
        f"model: {count_parameters(model) / 1e6:.2f}M parameters, {'PreNorm' if cfg.prenorm else 'PostNorm'}, "
        f"norm={cfg.encoder_norm or cfg.norm}/{cfg.decoder_norm or cfg.norm}, fixnorm={cfg.fixnorm}, "
        f"init={cfg.init}, qknorm={cfg.qknorm}, device={device}{' bf16' if bf16 else ''}, "
        f"threads={torch.get_num_threads()}"
        + (f", {dist.get_world_size()} ranks" if dist.is_initialized() else "")
        + (", --reference" if args.reference else "")
    )
    # an edit to one of these main-text functions shows only with --reference
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


# ---------------------------------------------------------------------------------------
# 4. The loop: one log line per --log-interval steps, dev BLEU every --epoch-size steps.
# ---------------------------------------------------------------------------------------
# main() (Appendix A) calls it with the run that setup() built from the checked flags
def train_loop(run):
    args, s = run.args, run.state
    total, limit = budget(args)
    # Appendix C: the progress bar (step_log.bar), log lines, metrics.jsonl, MFU
    step_log = StepLog(run, total)
    # Appendix E: Ctrl-C or SIGTERM stops after the step, saved
    with step_log.bar, stop_signals(run) as signalled:
        while s.step < total and not s.stopped:
            batches = run.next_batches()
            s.step += 1
            lr = run.schedule(s.step, s.lr_decay)
            # the batch norms keep [2] Figures 2-4's diagnostics at log steps only:
            for m in run.model.modules():
                if isinstance(m, BATCH_NORMS):  # they cost time (Appendix C; none under --compile)
                    m.track, m.stats = s.step % args.log_interval == 0 and not args.compile, {}
            loss, nll, gnorm, n_tgt = train_step(
                run.net, run.optimizer, batches, lr, run.step_options
            )
            # may stop the run: a non-finite loss or gradient norm
            step_log.step(batches, lr, loss, nll, gnorm, n_tgt)
            end = not s.stopped and (s.step % args.epoch_size == 0 or s.step == total)
            if end:
                end_of_epoch(run)  # which writes its checkpoints
                step_log.evaluated()
            stop = not s.stopped and signalled(end or s.step % args.log_interval == 0)
            if (
                not end
                and not s.stopped
                and (stop or args.save_interval and s.step % args.save_interval == 0)
            ):
                # its records first; no checkpoint if a step diverged (the last good one stays)
                if step_log.flush():
                    # Appendix E: a checkpoint of this step
                    save_checkpoints(run, improved=False, epoch_end=False)
            if stop:
                raise KeyboardInterrupt(stop)  # main() says how to continue
    s.stopped = s.stopped or stopping(args, limit)  # else the budget, recorded in results.json
    if s.stopped[0] != "diverged":
        run.log(f"stopping: {s.stopped[1]}")
    result = finish(run)
    if s.stopped[0] == "diverged":  # a failed run exits non-zero (its last good checkpoint stays)
        sys.exit(f"error: {s.stopped[1]}")
    return result


# ---------------------------------------------------------------------------------------
# 5. End of an epoch: dev perplexity and BLEU, validation decay, stopping, checkpoints (rank 0). A
# diverged run (diverged, Appendix C) stops with its last good checkpoint.
# ---------------------------------------------------------------------------------------
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
    search = decode.Search(
        args.dev_beam,
        args.alpha,
        max_src_len=args.max_len,
        bf16=run.step_options.bf16,
        penalty=args.length_penalty,
    )
    hyps = decode.translate(
        run.model, run.tokenizer, [x for x, _ in run.pairs["dev"]], search, args.batch_tokens
    )
    return decode.bleu(hyps, [y for _, y in run.pairs["dev"]]).score, dev_loss, dev_ppl


def end_of_epoch(run):
    """Dev BLEU of a translator, dev perplexity of a language model (TASKS); the same decisions on
    either."""
    args, s, task = run.args, run.state, TASKS[run.args.task]
    s.epoch += 1
    t0, score = time.time(), None
    if run.master:
        score, dev_loss, dev_ppl = dev_score(run)
    # every rank takes the same decisions: rank 0's dev score and stop (Appendix D)
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
    # [1] appendix A: the LR too small, or no progress
    s.stopped = stop_reason(args, s.step, s.lr_decay, s.history)
    if not run.master:
        # the other ranks' part of rank 0's checkpoint: their random generators
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
    # Appendix E; before the epoch's line: no log reports an epoch a resume lacks
    save_checkpoints(run, improved)
    run.log(
        f"epoch {s.epoch:3d} | step {s.step:6d} | {task.scores(score, dev_ppl, s.history)} (step {s.best_step}) "
        f"| eval {time.time() - t0:.1f}s"
        + (
            f" | LR x {args.decay_factor} ({task.name} worse than each of the "
            f"previous {args.patience})"
            if decayed
            else ""
        )
    )


def finish(run):
    """Test BLEU (beam search) or perplexity of the best checkpoint (by the dev score); the learned
    g's."""
    args = run.args
    if not run.master:
        return None
    if not (best := data.checkpoints(run.dir, "test")):
        run.log("no checkpoint was written (the run ended before its first epoch)")
        return None
    ckpt = data.read_checkpoint(best[0], run.device)
    run.model.load_state_dict(ckpt["model"])
    best = ckpt["train_state"]
    result = {
        "run_id": args.run_id,
        "steps": run.state.step,
        "best_step": best["step"],
        f"best_dev_{TASKS[args.task].key}": best["history"][-1],
        "train_seconds": run.state.train_seconds,
        "stopped": run.state.stopped[1],
        # [2] Figure 6: the embedding matrix's singular values, over the largest (decode.py
        # --svd)
        "embedding_singular_values": decode.singular_values(run.model),
    }
    # [1] Figures 3-4: learned g versus depth (train.log too)
    decode.print_g_table(run.model, run.log)
    # before test
    data.atomic_write(
        run.dir / "g_values.json", json.dumps(decode.g_values(run.model), indent=2) + "\n"
    )
    # the field's test perplexity: every target token, EOS included, no smoothing
    if args.task == "lm":
        both = {
            s: decode.lm_perplexity(
                run.model,
                run.tokenizer,
                run.pairs[s],
                args.seq_len,
                args.batch_tokens,
                # dev: for its <unk> count
                run.step_options.bf16,
            )
            for s in ("dev", "test")
        }
        ppl = both["test"]
        result.update(test_ppl=ppl["ppl"], test_tokens=ppl["n_tokens"])
        if args.bpe_size:  # BPE: per word too (the same NLL over the text's words and EOS)
            result.update(test_word_ppl=ppl["word_ppl"], test_words=ppl["n_words"])
        per_word = (
            f" ({ppl['word_ppl']:.2f} per word, {ppl['n_words']} words and EOS)"
            if args.bpe_size
            else ""
        )
        # OOV rate
        result.update(
            {f"{s}_{k}": p[k] for s, p in both.items() for k in ("unk_tokens", "unk_share")}
        )
        unknown = ", ".join(
            f"{s} {p['unk_tokens']} ({p['unk_share']:.2%})" for s, p in both.items()
        )
        run.log(
            f"test perplexity (best checkpoint, step {best['step']}): {ppl['ppl']:.2f} over {ppl['n_tokens']} "
            f"tokens{per_word}; unknown (<unk>) tokens: {unknown}"
        )
    elif run.pairs["test"]:
        search = decode.Search(
            args.beam,
            args.alpha,
            max_src_len=args.max_len,
            bf16=run.step_options.bf16,
            penalty=args.length_penalty,
        )
        hyps = decode.translate(
            run.model, run.tokenizer, [x for x, _ in run.pairs["test"]], search, args.batch_tokens
        )
        # decode.py --json's: BLEU, chrF, tokenized BLEU
        s = decode.scores(hyps, [y for _, y in run.pairs["test"]])
        data.atomic_write(run.dir / "test.hyp", "".join(h + "\n" for h in hyps))
        result.update(
            test_bleu=s["bleu"]["score"],
            test_signature=s["bleu"]["signature"],
            test_chrf=s["chrf"]["score"],
            test_chrf_signature=s["chrf"]["signature"],
        )
        run.log(
            f"test (best checkpoint, step {best['step']}, beam {args.beam}, {args.length_penalty} length penalty "
            f"alpha {args.alpha}): {decode.score_report(s)}"
        )
    append_metrics(run, {"final": result})  # metrics.jsonl's last record
    # Appendix E: a finished run
    data.atomic_write(run.dir / "results.json", json.dumps(result, indent=2) + "\n")
    return result


# =======================================================================================
# Appendix A: main(), and the flags. Every flag names the paper and equation it comes from; --help
# is their documentation. The parser's own defaults are suppressed, so that parse_args returns
# exactly the flags given on the command line; DEFAULTS holds the defaults. A run's flags are
# DEFAULTS, then the --preset's flags (Appendix B), then the command line's (resolve_flags).
# =======================================================================================
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
            run = setup(args, stack, log, resumed)  # section 3
            return benchmark(run) if args.benchmark else train_loop(run)  # Appendix C; section 4
    except data.WriteFailed as e:  # a full disk: what was written before is intact
        sys.exit(f"error: {e}: make room, then {what_next(args)}")
    except data.DataError as e:
        sys.exit(f"error: {e}")
    # Ctrl-C, SIGTERM (data.interrupt_on_sigterm); under torchrun rank 0 advises
    except KeyboardInterrupt as e:
        print(
            "interrupted" + (f": {what_next(args)}" if os.environ.get("RANK", "0") == "0" else ""),
            file=sys.stderr,
        )
        sys.exit(data.interrupted_status(e))  # 130 (Ctrl-C) or 143 (SIGTERM), as shells expect


DEFAULTS = {}  # every flag's default
# The range of each number is its type= (data.py Appendix D): a value out of range is argparse's own
# error line.


def build_parser():
    p = argparse.ArgumentParser(
        argument_default=argparse.SUPPRESS,
        description="Train a Transformer translator with the normalizations of TwT [1], PowerNorm [2] and QKNorm "
        "[3]. [1] Nguyen & Salazar 2019, Transformers without Tears; [2] Shen et al. 2020, PowerNorm; "
        "[3] Henry et al. 2020, Query-Key Normalization for Transformers. The defaults are the quick "
        "start: a small model that learns the built-in corpus in about 4 minutes on 2 CPU cores. "
        "The papers' rows are presets: --preset list.",
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
        help="apply one row of a paper's table (train.py Appendix B); flags given "
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
        help="--task lm: shuffled segments, "
        "or streams: the baseline code's rows of the text, batch j every row's j-th segment (data.lm_streams)",
    )
    add(
        g,
        "--data",
        help="corpus directory holding {train,dev,test}.{SRC,TGT}; default: the built-in synthetic "
        "corpus (data.py), generated on first use",
    )
    add(g, "--src", help="source language suffix, e.g. en (DIR/train.en)")
    add(g, "--tgt", help="target language suffix, e.g. de (DIR/train.de)")
    add(
        g,
        "--bpe-size",
        type=count,
        help="joint sentencepiece BPE vocabulary size ([1] Table 1: 8k; 3k for "
        "gl-en); default 8000, or 2000 on the built-in corpus; --task lm: 0 (the default there) is whitespace words",
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
        help="SmallInit (attention std "
        "sqrt(2/5d), [1] section 2.2), Xavier normal ([1] eq. 4), or the baseline LM code's (model.normal_init)",
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
        type=data.percent,
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
        help="PowerNorm: 'paper' follows [2] "
        "Algorithm 2 / eq. 12; 'code' the released code (backward divides by the batch psi_B after warmup; "
        "padding enters the backward means)",
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
        help="--task lm: softmax "
        "attention, or the tensorized Transformer's multi-linear attention, core-1, causal ([2] appendix A.2)",
    )
    add(
        g,
        "--mask",
        choices=["causal", "none"],
        default="causal",
        help="--attention multilinear: causal ([2]: "
        "'with masking'), or none: the baseline code's mask, built and never applied (model.py Appendix B)",
    )
    add(
        g,
        "--positions",
        choices=["sinusoidal", "relative"],
        default="sinusoidal",
        help="--attention multilinear: "
        "sinusoids added to the input, or relative: the baseline code's term inside the attention instead",
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
        choices=list(SCHEDULES),
        default="invsqrt",
        help="; ".join(f"{name}: {entry.help}" for name, entry in SCHEDULES.items()),
    )
    # both set the peak LR (lr = lr_scale / sqrt(d * warmup)): one of them
    peak = g.add_mutually_exclusive_group()
    add(
        peak,
        "--lr-scale",
        type=data.percent,
        help="lambda of eq. 7: LR(n) = lambda / sqrt(d) * min(n^-0.5, n * "
        "warmup^-1.5) ([1] 3.3: 1, and 2 for 2xLR); when given it overrides --lr",
    )
    add(
        peak,
        "--lr",
        type=data.percent,
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
        help="validation decay when the dev score (BLEU; perplexity "
        "with --task lm) is worse than each of the previous PATIENCE evaluations ([1] 2.4; 3 in 3.3)",
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
    add(g, "--seed", type=data.seed_range, default=1, help="fixes every random choice")
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
        help="also write the last checkpoint every N "
        "steps between evaluations: a hard kill (SIGKILL, a lost node) then loses at most N steps (0: at evaluations "
        "only; Ctrl-C and SIGTERM always save the step they stop at)",
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
        default="bf16",
        choices=["bf16", "fp32"],
        help="on CUDA: bf16 autocast (default; fp32 where "
        "the GPU has no bf16) or fp32 throughout; the CPU always trains in fp32",
    )
    add(g, "--threads", type=threads, help="CPU threads (torch.set_num_threads)")
    add(
        g,
        "--compile",
        action="store_true",
        default=False,
        help="torch.compile the model, once, for "
        "symbolic shapes, lengths padded to multiples of 8 (a minute or more to compile; for a GPU)",
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
        + data.EXTRAS,
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
        help="gnmt: score / ((5 + |Y|) / 6)"
        "^alpha (Wu et al. 2016; TwT, QKNorm); fairseq: score / |Y|^alpha (Ott et al. 2019, as PowerNorm decodes)",
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
        help="time N training steps after a warm-up and "
        "print tokens/s, FLOPs/token, MFU, padding and peak memory, then exit (writes no run directory)",
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
        help="start the run in --out, or continue it "
        "when --out already holds it: one command for a scheduler's requeue. Every flag of the command is compared "
        "with the run's; a folder of another run, or a flag that differs, is refused as --resume refuses it",
    )
    return p


def resolve_flags(argv=None, log=print):
    """The command line -> (args, given): every flag's value, and the flags given explicitly; log:
    its notes."""
    parser = build_parser()
    # one line (argparse adds its usage)
    parser.error = lambda message: sys.exit(f"error: {message}")
    given = vars(parser.parse_args(argv))
    if given.get("preset") == "list":
        width = max(len(pair) for pair, _, _ in PRESETS.values())
        for name, (pair, row, _) in PRESETS.items():
            print(f"{name:30s} {pair:{width}s} {row}")
        print(
            f"{len(PRESETS)} presets; --pair NAME swaps the language pair ({', '.join(PAIRS)}); any flag given "
            f"with --preset overrides it"
        )
        sys.exit(0)
    if given.get("preset", next(iter(PRESETS))) not in PRESETS:
        sys.exit(
            f"error: --preset {given['preset']}: unknown; --preset list shows the {len(PRESETS)} presets"
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
            f"note: --lr {given['lr']:g} is the peak LR, which --lr-scale {flags['lr_scale']} would set: not used"
        )
        flags["lr_scale"] = None
    flags.update(given)
    # a language model's corpus for a translator...
    if "pair" in given and ("task" in given or "preset" in given):
        task = given.get("task") or row.get("task") or PAIRS[pair].get("task", "mt")
        if PAIRS[given["pair"]].get("task", "mt") != task:
            what = (
                f"--task {task}"
                if "task" in given
                else f"--preset {given['preset']}, a {'language model' if task == 'lm' else 'translator'}"
            )
            sys.exit(f"error: --pair {given['pair']}: not a corpus for {what}")
    args = argparse.Namespace(**flags)
    # Values that depend on other flags are fixed here, once, and recorded in config.json.
    if args.bpe_size is None:
        args.bpe_size = 0 if args.task == "lm" else 2000 if args.data is None else 8000
    if args.pn_warmup is None:  # Paper [2] appendix A: the same as the LR schedule's warmup
        args.pn_warmup = Schedule.from_args(args).warmup
    if args.lr_scale is not None:  # config.json records the peak that runs
        args.lr = args.lr_scale / math.sqrt(args.d_model * args.warmup)
    return args, given


def config_flags(path, parser):
    """--config FILE: the flags a run's config.json holds, for a new run (not the run's records, its
    --out or an action). A file that is not a JSON object, a key that is no flag, a value its flag's
    type= or choices refuse: one line that names it."""
    try:
        saved = json.loads(Path(path).read_text())
        flags = {k: v for k, v in saved.items() if k not in RUN_RECORDS + ACTIONS + ("out",)}
    # AttributeError: a JSON list or value has no .items()
    except (OSError, ValueError, AttributeError) as e:
        sys.exit(f"error: --config {path}: not a JSON object of flags ({e})")
    actions = {a.dest: a for a in parser._actions if a.dest in DEFAULTS}
    for k, v in flags.items():
        # as argparse takes the value from a command line: through its flag's type= and choices
        try:
            a = actions[k]
            ok = (
                v is None
                and DEFAULTS[k] is None
                or (
                    isinstance(v, bool)
                    if a.nargs == 0
                    else not isinstance(v, bool)
                    and (a.type or str)(str(v)) == v
                    and v in (a.choices or [v])
                )
            )
        except (KeyError, TypeError, ValueError, argparse.ArgumentTypeError):
            ok = False
        if not ok:
            sys.exit(
                f"error: --config {path}: {k!r}: "
                + (
                    f"{v!r} is not a value of --{k.replace('_', '-')}"
                    if k in actions
                    else "not a flag of train.py"
                )
            )
    return flags


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
                args.lr_scale is not None and not SCHEDULES[args.schedule].warms_up,
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
    if idle := data.idle_flag(
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
                SCHEDULES[args.schedule].warms_up or args.lr_scale is not None,
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
                SCHEDULES[args.schedule].decays,
                "for validation-based decay (--schedule "
                f"{', '.join(k for k, e in SCHEDULES.items() if e.decays)}), not --schedule {args.schedule}",
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
            f"needs the package tensorboard, which is not installed: {data.EXTRAS}",
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


def budget(args):
    """The run's last step, and the flag that sets it (its code in STOPS): --max-steps, or
    --max-epochs x --epoch-size, whichever is first."""
    epochs = args.max_epochs * args.epoch_size
    return (
        (args.max_steps, "max_steps")
        if args.max_steps and args.max_steps <= epochs
        else (epochs, "max_epochs")
    )


def model_config_from_args(args, vocab_size, qk_g0=1.0):
    """The ModelConfig of the flags: a field named as a flag takes its value (d_model: --d-model);
    the others here."""
    named = {f.name: getattr(args, f.name) for f in fields(ModelConfig) if hasattr(args, f.name)}
    # --pn-K: option K
    power = {k: getattr(args, f"pn_{k}") for k in ("warmup", "variant", "alpha_fwd", "alpha_bkw")}
    # the module counts forwards; --pn-warmup counts updates (--accumulate each)
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


# =======================================================================================
# Appendix B: presets. Each is one row of a paper's table as a set of flags, applied after the
# defaults and before the flags of the command line (which override it): --preset NAME. A row names
# its language pair (PAIRS); --pair NAME swaps in another pair's corpus and per-pair flags:
# data.CORPORA's "flags" (their one copy, beside the corpus's source and notes) and --data data/NAME
# (multi30k: data/multi30k-en-de), where `python data.py prepare NAME` puts it.
# =======================================================================================
PAIRS = {
    name: dict(data=f"data/{c.get('dir', name)}", **c["flags"]) for name, c in data.CORPORA.items()
}
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
    # a CPU's epoch is 5-10 minutes: a hard kill loses at most 2-4 (docs/runs.md)
    save_interval=100,
)
PN2_NORMS = (
    ("layernorm", "LN", "layer"),
    ("batchnorm", "BN", "batch"),
    ("pnv", "PN-V", "pnv"),
    # its Table 2's norms: (the preset's name, the table's, --norm)
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
# [1] Tables 2, 5: no warmup
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
# [3]: QKNorm + LayerNorm
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
        "PowerNorm Table 2: PTB, LN, the baseline's PTB script (run_ptb.sh) as closely as our flags "
        "go (docs/departures.md)",
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
    # [2] A.2: WikiText-103, 6 layers, the rest as PTB's; an epoch: 101,425,671 words + 1,165,029
    # EOS, 26,717 batches
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


# =======================================================================================
# Appendix C: speed and the log. Model FLOPs, the machine's own matmul throughput (MFU), the log
# line (StepLog), a diverged run, the batch norms' diagnostics, --benchmark, --profile, keeping
# freed memory. Figures are never asserted.
# =======================================================================================
def batch_flops(cfg, b, out_vocab=None):
    """Training FLOPs of one step on a data.Batch b, its (B, S) source / (B, T) target, padding
    included.

    Counts the matmuls (2 FLOPs per multiply-add) of the forward pass, times 3 (backward ~ two
    forwards). Per token, per layer:
      encoder:  Q, K, V, O projections 4 D^2 + FFN 2 D FF          + scores Q K^T, A V: 2 S D
      decoder:  self 4 D^2 + cross Q, O 2 D^2 + FFN 2 D FF          + scores 2 T D + 2 S D
                (+ cross K, V 2 D^2 per *source* token)
      output:   D Vt per target token (training computes only the Vt = out_vocab target words'
      logits, default all V)
    A language model (S = 0) has no cross-attention; the multi-linear attention (model.py Appendix
    B) costs W^QKV 3 D HR, the tensor T^2 HR (T^2 R per head; twice under --positions relative) and
    W^O H L^2 D per token, where HR = H x --head-dim (D by default).
    """
    # a language model's batch has no source
    (B, T), S = b.tgt_in.shape, 0 if b.src is None else b.src.size(1)
    D, FF, V = cfg.d_model, cfg.ff, out_vocab or cfg.vocab_size
    enc = cfg.enc_layers * (S * (4 * D * D + 2 * D * FF) + 2 * S * S * D)
    HR, tensors = cfg.heads * (cfg.head_dim or D // cfg.heads), 1 + (cfg.positions == "relative")
    attn = (
        T * (3 * D * HR + tensors * T * T * HR + cfg.heads * cfg.seq_len**2 * D)
        if cfg.attention == "multilinear"
        else T * 4 * D * D + 2 * T * T * D
    )
    cross = 0 if cfg.lm else T * 2 * D * D + S * 2 * D * D + 2 * T * S * D
    dec = cfg.dec_layers * (attn + cross + T * 2 * D * FF)
    return 3 * 2 * B * (enc + dec + T * D * V)


# a step's, for the log line and --benchmark: this rank's micro-batches x the ranks
def step_flops(run, batches):
    return (
        sum(batch_flops(run.model.cfg, b, output_columns(run.model)) for b in batches) * run.world
    )


def matmul_flops(run, tokens=4096, seconds=1.0):
    """FLOP/s of a dense (tokens x d) @ (d x ff) GEMM, the FFN's first matmul, in the step's matmul
    dtype (bf16 under CUDA autocast, else fp32), in this process: MFU's denominator. torch's Timer
    runs it in blocks of products for `seconds` (after a warm-up; on a GPU, one sync per block) and
    the best block counts: a busy moment on a shared machine would otherwise understate the peak
    (and inflate MFU)."""
    device, d, ff = run.device, run.args.d_model, run.args.ff
    gen = torch.Generator(device=device).manual_seed(0)  # its own RNG: training's stays untouched
    dtype = torch.bfloat16 if run.step_options.bf16 else torch.float32
    a, b = (
        torch.randn(*shape, device=device, generator=gen).to(dtype)
        for shape in ((tokens, d), (d, ff))
    )
    # its default is 1 thread
    timer = Timer("a @ b", globals={"a": a, "b": b}, num_threads=torch.get_num_threads())
    return 2 * tokens * d * ff / min(timer.blocked_autorange(min_run_time=seconds).times)


def benchmark(run):
    """--benchmark N: time N training steps after 3 warm-up steps (and --compile's compilations);
    print figures, assert nothing. As in training, the host reads nothing back from the device in
    the N steps: one sync at the end."""
    args, cfg, warm, dev = run.args, run.model.cfg, 3, run.device
    matmul_peak = matmul_flops(run)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    # torch.compile's own counter of the graphs it made, imported only with --compile
    if args.compile:
        from torch._dynamo.utils import counters
    graphs = int(counters["stats"]["unique_graphs"]) if args.compile else 0

    def step(i):  # step i's mean loss and target tokens, left on the device, and its FLOPs
        batches = run.next_batches()
        loss, _, _, n_tgt = train_step(
            run.net, run.optimizer, batches, run.schedule(i + 1), run.step_options
        )
        return loss / n_tgt, n_tgt, step_flops(run, batches)

    warmed, warm_secs = timed(lambda: [step(i) for i in range(warm)], dev)  # norms.py Appendix C
    run.log(
        f"benchmark: {warm} warm-up steps{' (and compilation)' if args.compile else ''} took {warm_secs:.1f}s"
    )
    steps, secs = timed(lambda: [step(i) for i in range(warm, warm + args.benchmark)], dev)
    losses = torch.stack([loss for loss, _, _ in warmed + steps]).tolist()
    # n: a device tensor under DDP
    n_tok, flops = float(sum(n for _, n, _ in steps)), sum(f for _, _, f in steps)
    result = profile_steps(run, step, secs, n_tok) if args.profile else {}
    # the graphs torch.compile made in these steps (a recompilation storm shows here)
    if args.compile:
        result["compiled_graphs"] = int(counters["stats"]["unique_graphs"]) - graphs
    matmul_peak = max(matmul_peak, matmul_flops(run))  # the larger kept
    pad = data.padding_share(run.train, run.order, run.pad_multiple)
    peak_mb = (
        torch.cuda.max_memory_allocated(dev) / 2**20
        if dev.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )  # Linux: KiB -> MiB
    result.update(
        {
            "steps": args.benchmark,
            "tgt_tok_per_s": n_tok / secs,
            "flops_per_tgt_token": flops / n_tok,
            "achieved_flops": flops / secs,
            "matmul_peak_flops": matmul_peak,
            "mfu": flops / secs / (matmul_peak * run.world),
            "padding_share": pad,
            "peak_memory_mb": peak_mb,
            "threads": torch.get_num_threads(),
            "device": str(dev)
            + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
            "bf16": run.step_options.bf16,
            "losses": losses,
            "model_config": asdict(cfg),
        }
    )
    run.log(
        f"benchmark: {args.benchmark} steps | {result['tgt_tok_per_s']:.0f} target tok/s | "
        f"{result['flops_per_tgt_token'] / 1e6:.1f} MFLOP/target token | achieved "
        f"{result['achieved_flops'] / 1e9:.1f} GFLOP/s | matmul peak {matmul_peak / 1e9:.1f} GFLOP/s | MFU "
        f"{100 * result['mfu']:.1f}% | padding {100 * pad:.1f}% | peak memory {result['peak_memory_mb']:.0f} MiB "
        f"| {result['threads']} threads"
        + (f" | {result['compiled_graphs']} compiled graphs" if args.compile else "")
    )
    return result


def profile_steps(run, step, secs, n_tok):
    """--profile: 5 more steps under torch.profiler (not in --benchmark's figures: it slows them):
    where the time goes and, on a GPU, the share of a step (the timed steps: secs for n_tok target
    tokens) its kernels do not cover."""
    dev, result = run.device, {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        prof_tok = sum(float(step(i)[1]) for i in range(5))
        sync(dev)
    events = prof.key_averages()
    if dev.type == "cuda":  # the GPU's busy time (its kernels' rows) against the step's wall time
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        # seconds per target token
        busy = sum(e.self_device_time_total for e in kernels) / 1e6 / prof_tok
        result["host_gap_share"] = max(0.0, 1 - busy / (secs / n_tok))
        steps = run.args.benchmark  # the timed steps' secs and n_tok
        run.log(
            f"profile: the GPU is busy {1e6 * busy * n_tok / steps:.0f} us of each {1e6 * secs / steps:.0f} us "
            f"step: {100 * result['host_gap_share']:.1f}% of the step is host gaps"
        )
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    run.log(events.table(sort_by=key, row_limit=25))
    return result


class Task(NamedTuple):  # a task of the registry TASKS, as ScheduleEntry is a schedule of SCHEDULES
    """What a task's dev score is, which way is better, and how the log prints it."""

    name: str  # as the log says it
    key: str  # its key in metrics.jsonl (dev_KEY) and results.json (best_dev_KEY)
    # +1: higher is better (BLEU), -1: lower is better (perplexity); sign * score: higher is better
    sign: int
    width: str  # its format in the epoch line

    def since_best(self, history):  # evaluations since the best (the first of equals)
        up = [self.sign * x for x in history]
        return len(up) - 1 - up.index(max(up))

    def scores(self, score, dev_ppl, history):  # the epoch line's scores
        bleu = f"dev BLEU {score:6.2f} | " if self.key == "bleu" else ""
        return f"{bleu}dev ppl {dev_ppl:7.2f} | best {history[-1 - self.since_best(history)]:{self.width}}"


TASKS = {"mt": Task("dev BLEU", "bleu", 1, "6.2f"), "lm": Task("dev perplexity", "ppl", -1, "7.2f")}
# why a run stops: the code TrainState.stopped keeps, and its message (the log, results.json)
STOPS = {
    "max_steps": "--max-steps {args.max_steps} reached",
    "max_epochs": "--max-epochs {args.max_epochs} reached",
    "stop_lr": "the LR {lr:.2e} fell below --stop-lr {args.stop_lr:g}",
    "early_stop": "{task.name} has not improved for {args.early_stop} evaluations",
    "diverged": "diverged: {what} (try a smaller --lr, --prenorm, --init small or more --warmup); {last}",
}


# (code, message) of a stop in STOPS, as TrainState.stopped keeps it
def stopping(args, code, **values):
    return code, STOPS[code].format(args=args, task=TASKS[args.task], **values)


def stop_reason(args, step, lr_decay, history):
    """The stop rules of [1] appendix A, one owner (end_of_epoch, may_resume): why a run stops after
    its evaluation at `step`, or None: the LR of its next step below --stop-lr after the warmup,
    else no dev gain for --early-stop."""
    schedule = Schedule.from_args(args)
    if (lr := schedule(step + 1, lr_decay)) < args.stop_lr and step >= schedule.warmup:
        return stopping(args, "stop_lr", lr=lr)
    return (
        stopping(args, "early_stop")
        if 0 < args.early_stop <= TASKS[args.task].since_best(history)
        else None
    )


def diverged(run, what):
    """Stop the run as diverged: one line saying what and where the last good checkpoint is."""
    last = data.checkpoint_file(run.dir, "last")
    run.state.stopped = stopping(
        run.args,
        "diverged",
        what=what,
        last=f"the last good checkpoint is {last}"
        if last.exists()
        else "no checkpoint was written",
    )
    run.log("error: " + run.state.stopped[1])


def append_metrics(run, record):
    """Append one record to metrics.jsonl (rank 0). Strict JSON: a non-finite number is written
    as null and its key listed under "nonfinite" (json.dumps would write the non-standard NaN)."""
    if run.master:
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        # NaN, Infinity: null, nested too
        record = json.loads(json.dumps(record), parse_constant=lambda _: None)
        record.update({"nonfinite": bad} if bad else {})
        data.append_file(run.dir / "metrics.jsonl", json.dumps(record, allow_nan=False) + "\n")
        # --tensorboard: the same records, as events
        for tag, value in data.scalars(record) if run.board else ():
            run.board.add_scalar(tag, value, record.get("step", run.state.step))


class RunLog:
    """The run's log: log(line) prints the line on rank 0's console (the other ranks' is quiet) and
    appends it to the run directory's train.log, timestamped, across resumes. The lines before the
    run directory holds the run wait for it (commit_run_dir sets path)."""

    def __init__(self):
        self.console = Console(
            soft_wrap=True, quiet=os.environ.get("RANK", "0") != "0", highlight=False, markup=False
        )
        self.path, self.waiting = None, []

    def __call__(self, line):  # a string, or what rich prints
        self.console.print(line)
        if not self.console.quiet:  # the file gets the text without styles, unwrapped
            (
                plain := Console(
                    file=io.StringIO(), soft_wrap=True, color_system=None, markup=False
                )
            ).print(line)
            self.waiting.append(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {plain.file.getvalue()}")
        if self.path is not None and self.waiting:
            data.append_file(self.path, "".join(self.waiting))
            self.waiting = []

    print = __call__  # what decode.print_g_table prints with: its table goes to train.log too


class StepLog:
    """The training loop's log: a progress bar on a terminal, a metrics record per step ([1] Figure
    2), a log line per --log-interval steps (loss, tokens/s, MFU), a stop when the loss or the
    gradient norm is not finite. The steps' numbers stay on the device: reading them (.item()) would
    wait for the GPU at every step. They are read together at each log line and before each
    evaluation."""

    def __init__(self, run, total):
        self.run, self.total, args = run, total, run.args
        self.matmul_peak = matmul_flops(run)
        run.log(
            f"speed: dense {args.d_model}x{args.ff} matmul runs at {self.matmul_peak / 1e9:.1f} GFLOP/s here "
            f"(MFU's denominator)"
        )
        self.bar = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} steps"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=run.log.console,
            disable=not run.log.console.is_terminal,
        )
        self.task = self.bar.add_task("train", total=total, completed=run.state.step, info="")
        run.state.window = run.state.window or dict.fromkeys(
            ("loss", "nll", "tok", "flops", "t", "gnorm", "n"), 0.0
        )
        # the steps since the last host sync, and when it was
        self.pending, self.t0 = [], time.perf_counter()

    def step(self, batches, lr, loss, nll, gnorm, n_tgt):
        run, s, args = self.run, self.run.state, self.run.args
        flops = step_flops(run, batches)
        # n_tgt: under DDP
        numbers = [loss, nll, gnorm] + ([n_tgt] if torch.is_tensor(n_tgt) else [])
        numbers = torch.stack([x.double() for x in numbers])
        if run.world > 1:  # the whole batch's sums, so that every rank logs and stops alike
            # the loss and NLL sums, in place (n_tgt is summed already)
            dist.all_reduce(numbers[:2])
        self.pending.append((s.step, lr, n_tgt, flops, numbers))
        log_now = s.step % args.log_interval == 0 or s.step == self.total
        if (log_now or s.step % args.epoch_size == 0) and self.flush() and log_now:
            self.log_window(lr)
        self.bar.update(self.task, completed=s.step)

    def flush(self):
        """The steps since the last host sync into the window and metrics.jsonl: at log lines,
        evaluations and checkpoints. False when one of them diverged (the run stops)."""
        run, s, win = self.run, self.run.state, self.run.state.window
        # the one host sync
        values = torch.stack([p[-1] for p in self.pending]).tolist() if self.pending else []
        dt, self.t0 = time.perf_counter() - self.t0, time.perf_counter()
        s.train_seconds += dt
        win["t"] += dt
        # into the window
        for (step, step_lr, n, f, _), (l, ll, g, *n_read) in zip(self.pending, values):
            n = n_read[0] if n_read else n
            for k, v in (
                ("loss", l),
                ("nll", ll),
                ("tok", n),
                ("gnorm", g),
                ("n", 1),
                ("flops", f),
            ):
                win[k] += v
            # [1] Fig. 2
            append_metrics(
                run, {"step": step, "loss": l / n, "gnorm": g, "lr": step_lr, "tokens": n}
            )
            # A non-finite gradient norm with a finite loss would still make the weights NaN.
            for what, v in (("the training loss", l), ("the gradient norm", g)):
                if not math.isfinite(v):
                    diverged(run, f"{what} became {v} at step {step}")
                    return False
        self.pending = []
        if values:
            self.bar.update(self.task, info=f"loss {values[-1][0] / n:.3f}")
        return True

    def log_window(self, lr):
        """One log line (and metrics record) for the steps since the last one; the window starts
        again."""
        run, win = self.run, self.run.state.window
        tl, nll = win["loss"] / max(win["tok"], 1), win["nll"] / max(win["tok"], 1)
        tps, mfu = win["tok"] / win["t"], win["flops"] / win["t"] / (self.matmul_peak * run.world)
        run.log(
            f"step {run.state.step:6d} | loss {tl:6.3f} | ppl {math.exp(min(nll, 50)):8.2f} | lr {lr:.2e} | "
            f"{tps:7.0f} tok/s | MFU {100 * mfu:4.1f}% | gnorm {win['gnorm'] / win['n']:6.3f}"
        )
        append_metrics(
            run,
            {
                "step": run.state.step,
                "train_loss": tl,
                "train_ppl": math.exp(min(nll, 50)),
                "tok_per_s": tps,
                "mfu": mfu,
            },
        )
        # the loss of guessing uniformly among the target words
        uniform = math.log(int(run.model.allowed.sum()))
        # huge but finite: say so, go on
        if tl > uniform + 3 and run.state.step > run.schedule.warmup:
            warning = (
                f"the training loss {tl:.2f} is far above a uniform guess ({uniform:.2f}): the run may be "
                f"diverging (a smaller --lr, --prenorm or more --warmup may help)"
            )
            run.log("warning: " + warning)
            append_metrics(run, {"step": run.state.step, "warning": warning})
        stats = {
            name: m.stats
            for name, m in run.model.named_modules()
            if isinstance(m, BATCH_NORMS) and m.stats
        }
        # [2] Figures 2-4: batch vs running statistics, and the batch statistics' gradient terms
        if stats:
            append_metrics(run, {"step": run.state.step, "batch_norm_stats": stats})
        run.state.window = dict.fromkeys(win, 0.0)

    def evaluated(self):
        """After an evaluation: MFU's denominator again, the larger kept (a busy moment at the
        start, another process on a shared machine, reads it low and MFU above 100%); the clock
        restarts: evaluation is not training time."""
        self.matmul_peak = max(self.matmul_peak, matmul_flops(self.run, seconds=0.25))
        self.t0 = time.perf_counter()


# =======================================================================================
# Appendix D: this process (threads, seeds, device), and several processes. torchrun sets
# WORLD_SIZE/RANK/LOCAL_RANK: PyTorch's DistributedDataParallel, gloo on the CPU and NCCL on CUDA.
# Each step's batches are sharded by rank (Run.next_batches); the batch norms sum their statistics
# over the ranks (norms.py Appendix A); rank 0 alone evaluates, logs and writes, and shares its dev
# score.
# =======================================================================================
def start_process(args, log, stack):
    """(rank, world size, device, bf16) of this process: --threads, --reference, the seeds,
    torchrun's ranks (one GPU each), bf16 where the GPU has it."""
    # torchrun's
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = data.start_device(args)  # --device cuda without a GPU: DataError, main()'s one line
    if world > 1 and device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():  # one GPU per process
            sys.exit(
                f"error: {world} processes on this machine need {local + 1}+ GPUs, but it has "
                f"{torch.cuda.device_count()} (use --nproc_per_node {torch.cuda.device_count()}, or --device cpu)"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        # Closed after a run that ended well, every rank at once: a rank that closed its gloo group
        # while rank 0 was still testing aborted (SIGABRT, "terminate called without an active
        # exception"), 2 runs in about 20.
        stack.push(
            lambda failed, *_: failed is None and (dist.barrier(), dist.destroy_process_group())
        )
    # glibc's malloc keeps freed memory for reuse: +10-15% tokens/s
    if device.type == "cpu" and not args.reference:
        # By default a block over 32 MiB (a batch's logits, an FFN activation) is mmap'ed fresh at
        # every allocation and unmapped when freed, so each training step faults every page of it in
        # again, zero-filled by the kernel (system time was a sixth of a Multi30k step). With these
        # limits the freed blocks stay in malloc's heap, with the same peak memory. Linux/glibc
        # only; elsewhere a no-op. (The usual alternative is preloading jemalloc.)
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6")
            m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # <malloc.h>
            libc.mallopt(m_mmap_threshold, 1 << 30)  # blocks up to 1 GiB come from the heap
            libc.mallopt(m_trim_threshold, 1 << 30)  # and freed heap memory is not trimmed back
            libc.mallopt(m_top_pad, 64 << 20)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    bf16 = device.type == "cuda" and args.dtype == "bf16"
    if bf16 and not has_bf16(device):
        log(
            f"note: {torch.cuda.get_device_name(device)} has no bf16: training in fp32 (--dtype fp32)"
        )
        bf16 = False
    return rank, world, device, bf16


@contextlib.contextmanager
def rank0_first(rank, world):
    """Under torchrun, what runs inside runs on rank 0 first: it checks the run directory, prepares
    the BPE model and the caches and commits the run directory; the other ranks then read them. When
    rank 0 refuses (one line, from it), the other ranks stop too, instead of waiting for it for
    ever."""
    refused = [True]  # rank 0's verdict: refused, unless the block ends without an exception
    if world > 1 and rank != 0:
        dist.broadcast_object_list(refused, src=0)  # waits for rank 0's verdict
        if refused[0]:
            raise SystemExit(1)
    try:
        yield
        refused = [False]
    finally:
        if world > 1 and rank == 0:
            dist.broadcast_object_list(refused, src=0)


@contextlib.contextmanager
def across_processes(net, batches):
    """A step's micro-batches: yields the step's target tokens, which the loss is divided by, and
    grad_sync(i), the context of micro-batch i's forward and backward. Under DDP the count is every
    rank's, counted and summed on the device (a 0-dim tensor: the host waits for nothing), and DDP
    all-reduces the gradients after the last micro-batch only. It averages them; times the world
    size they are the sum, the gradient of one process with the whole batch (scaling each rank's
    loss instead would scale every dL/dY, which PowerNorm's backward is not linear in)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        yield float(sum(b.n_tgt for b in batches)), lambda i: contextlib.nullcontext()
        return
    n_tgt = sum((b.tgt_out != data.PAD).sum() for b in batches).double()
    dist.all_reduce(n_tgt)
    yield n_tgt, lambda i: contextlib.nullcontext() if i == len(batches) - 1 else net.no_sync()
    for p in net.parameters():
        if p.grad is not None:
            p.grad.mul_(world)


def wrap_model(model, args, world, device):
    """What a step calls: PyTorch's DDP (gradients all-reduced, averaged, across ranks in backward)
    and/or torch.compile around the model; checkpoints save `model` itself."""
    ids = [device.index] if device.type == "cuda" else None
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids) if world > 1 else model
    if args.compile:
        # --compile: torch.compile for batches whose shapes change at every step (sentence lengths,
        # sentences per batch): compiled once for symbolic shapes (dynamic=True), rather than for
        # the first batch's shapes, then again, or once per shape. Two more specialisations each
        # recompiled the whole base model (60-90 s each, H100, 2026-11-24), so both are off: "duck
        # sizing" (two lengths equal in the first batch were assumed equal for ever) and inductor's
        # matmul padding, which asks whether each matmul is compute-bound (with lengths padded to
        # multiples of 8 it has nothing to pad). Note: the padding to multiples of 8 changes no
        # result except PowerNorm's code variant, whose backward statistics average over padding
        # too. torch's compiler modules are imported only here, with --compile.
        import torch._inductor.config as inductor_config
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False
        inductor_config.shape_padding = False
        net = torch.compile(net, dynamic=True)
    return net


# =======================================================================================
# Appendix E: the run directory, checkpoints and --resume. A run directory holds one run. Training
# into one that already holds a run is refused unless --resume (continue it) or --overwrite (replace
# it). Nothing is deleted or written before every input is checked, and a lock keeps a second
# process out. A resumed run keeps its flags (those in RESUME_MAY_CHANGE may be given again), its
# corpus and its BPE model, and starts from its last checkpoint, read with
# torch.load(weights_only=True). Checkpoints hold only tensors and plain Python values. The last
# checkpoint is the resume record (the run's flags, state and generators); config.json is for
# people: a resume reads only its run_id.
# =======================================================================================
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
    "data",
}  # a moved corpus: its hashes are checked
# what a command does, not a flag of its run: never compared
ACTIONS = ("resume", "overwrite", "start_or_resume")
# what config.json records of a run beside its flags
RUN_RECORDS = ("run_id", "corpus_sha256", "changed_on_resume")
# A run directory's files and what --overwrite removes: data.py's Appendix D (RESULT_FILES,
# CACHE_FILES, checkpoints); the BPE model and the encoded caches are keyed by their content and are
# reused or replaced, never trusted.


def save_checkpoints(run, improved, epoch_end=True):
    """At an epoch's end, the best checkpoint when dev improved, epoch N's under --keep-checkpoints
    (for averaging;
    Code [2]: the last 5); at every save, the last, written last: the resume point, the one file
    with the optimizer's state and the random generators (twice the model's size): the best and
    epoch files hold what decoding reads. Under torchrun every rank calls it, and rank 0's
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
    s, keep, name = run.state, run.args.keep_checkpoints, partial(data.checkpoint_file, run.dir)
    # Only tensors and plain Python values: read back with torch.load(weights_only=True). The run's
    # flags (args: its run id and corpus hashes too) and its state (the step, the dev scores) are
    # what a resume reads.
    ckpt = {
        "format": data.CHECKPOINT_FORMAT,
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
        data.atomic_write(name("best"), weights)
    if keep > 0 and epoch_end:
        data.atomic_write(name(s.epoch), weights)
        name(s.epoch - keep).unlink(missing_ok=True)
    data.atomic_write(name("last"), ckpt)


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
            f"{signal.Signals(signum).name}: stopping after this step, with a checkpoint of it (again: at once)"
        )

    def requested(synced):
        if run.world > 1 and (run.device.type == "cpu" or synced):
            agreed = torch.tensor([box[0]], device=run.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            return int(agreed)
        return box[0] if run.world == 1 else 0

    # at the end, each signal gets back the handler it had before
    with contextlib.ExitStack() as previous:
        for sig in (signal.SIGINT, signal.SIGTERM):  # signal.signal returns the handler it replaces
            previous.callback(signal.signal, sig, signal.signal(sig, handler))
        yield requested


def restore(run, ckpt):
    """The model, optimizer, training state and random generators of a checkpoint (Appendix E found
    it)."""
    try:
        run.model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise data.DataError(
            f"{run.dir}: its checkpoint does not fit the model of its flags "
            f"({str(e).splitlines()[0]})"
        ) from None
    if ckpt["world"] != run.world:
        raise data.DataError(
            f"{run.dir}: the run trained on {ckpt['world']} processes and this is {run.world}; "
            f"resume it with as many (a step's batches and batch statistics depend on them)"
        )
    run.state = TrainState(**ckpt["train_state"])  # its stop as may_resume decided
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


def resume_flags(args, given, log):
    """--resume RUN (or --start-or-resume when --out holds a checkpoint): (the flags of RUN's last
    checkpoint, with the given ones that may change, (that checkpoint, {a flag given that differs
    from its: (its value, the one given)})); DataError if it is missing, does not read back, or an
    older train.py wrote it. may_resume refuses the other flags that differ, before any change.
    --start-or-resume without a checkpoint: (args, None), a new run, replacing (--overwrite) a
    folder that holds only a run with the same flags killed before its first checkpoint."""
    run_dir = Path(args.resume or args.out)
    # the resume point (save_checkpoints)
    path, config = data.checkpoint_file(run_dir, "last"), run_dir / "config.json"
    if args.start_or_resume and not path.exists():
        if data.run_id_of(config):
            if diff := differing_flags(json.loads(config.read_text()), args, {}, run_dir):
                raise data.DataError(
                    f"--start-or-resume: {run_dir} holds a run with other flags: "
                    f"{flag_changes(diff)}; choose another --out"
                )
            args.overwrite = True  # it never wrote a checkpoint: started again
        return args, None
    if not path.exists():
        raise data.DataError(
            f"--resume {run_dir}: nothing to resume from, no {path.name} (the run may have stopped "
            f"before its first checkpoint); start it again with --overwrite"
        )
    try:
        ckpt = data.read_checkpoint(path)  # which also refuses an older train.py's checkpoint
    # damaged, or another run's: never replaced (its best checkpoint still decodes)
    except data.DataError as e:
        raise data.DataError(
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


def flag_changes(diff):  # "--flag (old -> new), ..." of differing_flags' answer
    return ", ".join(f"--{k.replace('_', '-')} ({old!r} -> {v!r})" for k, (old, v) in diff.items())


def may_resume(run_dir, args, ckpt, diff, hashes):
    """Whether the run in run_dir may go on from ckpt: DataError naming what stops it, a flag given
    that a continued run keeps, its corpus changed, its budget spent (--max-steps, --max-epochs), or
    a stop that would come again at once (--stop-lr, --early-stop); each says which flag would let
    it go on."""
    # config.json is a run's first file (on resume, read for its run_id alone): a checkpoint copied
    # in alone is no run
    if not (run_dir / "config.json").exists():
        raise data.DataError(
            f"--resume {run_dir}: not a run directory of train.py (no config.json); start a new run "
            f"with --out"
        )
    if refused := {k: d for k, d in diff.items() if k not in RESUME_MAY_CHANGE}:
        raise data.DataError(
            f"--resume {run_dir}: a continued run keeps its flags, and these differ from its "
            f"checkpoint's: {flag_changes(refused)} (start a new run with another --out)"
        )
    if changed := [s for s, h in hashes.items() if h != args.corpus_sha256.get(s)]:
        raise data.DataError(
            f"--resume {run_dir}: the corpus changed since the run started "
            f"({', '.join(changed)} differ{'s' if len(changed) == 1 else ''})"
        )
    last, code = budget(args)  # train_loop's last step
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
        raise data.DataError(
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
        raise data.DataError(
            f"--resume {run_dir}: the run stopped ({state['stopped'][1]}) and would stop again at "
            f"once: nothing to train; give {fix} to continue"
        )


def open_run_dir(args, pairs, log, stack, master, resumed=None):
    """(the run directory, the checkpoint to resume from or None, the staging folder) after every
    check of the run directory, unchanged here: commit_run_dir changes it once every other input is
    checked too. Rank 0 holds its lock (in stack); the other ranks write nothing (staging None).
    --benchmark trains in a temporary directory, removed."""
    if args.benchmark:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="benchmark-")))
        return tmp, None, tmp
    if not str(args.out).strip():  # Path("") would be this folder
        raise data.DataError("--out is empty: give the run directory, e.g. --out runs/NAME")
    # the checkpoint resume_flags read, if any
    run_dir, ckpt = Path(args.out), resumed[0] if resumed else None
    if run_dir.is_symlink() and not run_dir.exists():
        raise data.DataError(
            f"--out {run_dir}: a symbolic link to {os.readlink(run_dir)}, which does not exist"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise data.DataError(f"--out {run_dir}: a file, not a folder")
    # the files a run writes in run_dir, but a lock; rank 0 checks (the other ranks come after its
    # commit)
    held = ""
    if run_dir.is_dir() and master and not args.resume:  # --resume: its checkpoint is the run
        held = ", ".join(
            sorted(
                p.name for p in run_dir.iterdir() if data.is_run_file(p.name) and p.name != ".lock"
            )
        )
    # train.py never replaces a file it did not write
    if held and data.run_id_of(run_dir / "config.json") is None:
        raise data.DataError(
            f"--out {run_dir}: not a run directory of train.py (no config.json with a run_id), yet it "
            f"holds files a run writes ({held}), so none is replaced; choose another --out"
        )
    if held and not args.overwrite:  # commit_run_dir removes that run id's files
        raise data.DataError(
            f"{run_dir} already holds a run ({held}): continue it with --resume {run_dir}, "
            f"or replace it with --overwrite"
        )
    # the corpus's
    hashes = {split: data.pairs_sha256(split_pairs) for split, split_pairs in pairs.items()}
    if args.resume:
        may_resume(run_dir, args, *resumed, hashes)
        for k, v in args.changed_on_resume.items():
            log(f"resume: --{k.replace('_', '-')} {v} (changed on resume)")
    else:
        # recorded in config.json, the checkpoints
        args.run_id, args.corpus_sha256 = uuid.uuid4().hex, hashes
    return run_dir, ckpt, stack.enter_context(data.staging(run_dir)) if master else None


def commit_run_dir(args, run_dir, stage, ckpt, log):
    """The run directory's first change, once every input has been checked: the leftovers of killed
    runs go, an overwritten run's files go, config.json is written, then the staged files move
    in."""
    # atomic_write's temporaries (.NAME.xxxx.tmp) and staging folders of killed runs
    for p in run_dir.iterdir():
        written = p.name[1:].rsplit(".", 2)[0]  # .NAME.xxxx.tmp: a temporary of NAME
        temporary = p.name.startswith(".") and p.name.endswith(".tmp") and data.is_run_file(written)
        if temporary or (p.name.startswith(".staging-") and p != stage):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    # the run --overwrite replaces
    replaces = data.run_id_of(run_dir / "config.json") if args.overwrite else None
    # the old run's results but its config.json (replaced next), and its checkpoints (by their run
    # id)
    if replaces:
        gone = [
            p
            for p in run_dir.iterdir()
            if p.name in data.RESULT_FILES[1:] or data.EVENTS.fullmatch(p.name)
        ]
        gone += [p for p in data.checkpoints(run_dir) if data.run_id_of(p) == replaces]
        for f in gone:
            f.unlink()
        log(f"overwrite: removed the {len(gone)} files of the run that was in {run_dir}")
    # config.json before the staged files: a kill at any point leaves a folder that holds a run
    # (Ctrl-C's advice holds)
    data.atomic_write(run_dir / "config.json", json.dumps(vars(args), indent=2) + "\n")
    log.path = run_dir / "train.log"  # the lines logged so far, and every line after
    for f in stage.iterdir():
        os.replace(f, run_dir / f.name)
    # what a killed run logged after its checkpoint goes
    if ckpt is not None and (run_dir / "metrics.jsonl").exists():
        rows = data.read_metrics(run_dir)  # (and a half-written last line)
        data.atomic_write(
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
    if (
        getattr(args, "run_id", None) is None
        or data.run_id_of(run_dir / "config.json") != args.run_id
    ):
        return f"the run had not started in {run_dir}: start it again with the same command"
    # the resume point (save_checkpoints)
    if data.run_id_of(data.checkpoint_file(run_dir, "last")) == args.run_id:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        how = (
            "python train.py"
            if world == 1
            else f"torchrun (as many processes as before, {world}) train.py"
        )
        return f"continue with {how} --resume {run_dir}"
    # an evaluation's, or --save-interval's
    first = min(args.epoch_size, args.save_interval or args.epoch_size)
    return (
        f"nothing to resume (the first checkpoint comes at step {first}): start it again with the same command "
        f"and --overwrite"
    )


# =======================================================================================
# Appendix F: the corpus into the run directory. Read every split (data.py), train the joint BPE
# into the run directory (reused by a later run only for the same training text and size),
# encode (cached there too); a language model's text is cut into segments (data.py section 8).
# =======================================================================================
def read_corpus(args, log):
    """{split: [(src, tgt)]} of raw text, and the language suffixes; a language model's: {split:
    [line]}."""
    if args.data is None:
        data_dir, langs = data.make_toy_corpus(), ("src", "tgt")
        log(f"data: built-in synthetic corpus in {data_dir}")
    else:
        data_dir, langs = Path(args.data), (args.src, args.tgt)
        if data_dir.is_file():
            raise data.DataError(
                f"--data {data_dir}: a file, not a folder (a corpus folder holds train.{args.src}, "
                f"train.{args.tgt}, dev.* and test.*)"
            )
        pair = next((name for name, p in PAIRS.items() if Path(p["data"]) == data_dir), None)
        if pair and not data_dir.is_dir():
            raise data.DataError(
                f"--data {data_dir}: not there (relative to this folder): prepare it with "
                f"python data.py prepare {pair}, or give --data DIR"
            )
    # DIR/{train,dev,test}.txt, one sentence a line (the built-in corpus: its target side)
    if args.task == "lm":
        if args.data is None:
            log(
                "data: the target side of the built-in synthetic corpus, as a language model's text"
            )
        text = {split: data.lm_text_file(args.data, split) for split in data.SPLITS}
        for split, path in text.items():  # empty lines skipped
            text[split] = [
                line
                for line in data.read_lines(
                    path,
                    "a language model's corpus folder holds train.txt, "
                    "dev.txt and test.txt, one sentence a line",
                )
                if line
            ]
            if not text[split]:
                raise data.DataError(f"{path}: no text (every line is empty)")
        return text, (None, None)
    paths, pairs = data.corpus_paths(data_dir, *langs), {}
    for split in data.SPLITS:
        # A training pair with an empty side teaches nothing and is dropped. Dev and test lines
        # never are: every line is translated and scored, so that test.hyp lines up with the
        # reference file.
        try:
            pairs[split], stats = data.read_parallel(*paths[split], drop_empty=split == "train")
        except data.DataError as e:
            raise data.DataError(
                f"{e} (if the run's corpus moved, give its new place with --data DIR)"
                if args.resume
                else str(e)
            ) from None
        if stats["empty"]:
            log(
                f"data: {split}: {stats['empty']} pairs with an empty side "
                + (
                    "dropped"
                    if split == "train"
                    else "kept (translated and scored like every other line)"
                )
            )
    return pairs, langs


def prepare_data(args, pairs, run_dir, stage, log, ckpt=None):
    """(tokenizer, encoded training pairs, encoded dev pairs, every encoded training pair before the
    --max-len filter, for QKNorm's L). Reads run_dir; writes only into `stage`, whose files the run
    directory takes once every input is checked (Appendix E; None: write nothing). ckpt: a resumed
    run's checkpoint, whose BPE model it keeps."""
    proto = ckpt and ckpt["bpe_model_proto"]
    # bpe.key holds the hash of the training text and --bpe-size, and the model's own: never a stale
    # or damaged one.
    key = data.pairs_sha256(pairs["train"], f"{args.bpe_size}\n".encode())
    # bpe.key's text for the model's bytes
    stamp = lambda proto: f"{key}\n{hashlib.sha256(proto).hexdigest()}"
    old, old_key = run_dir / "bpe.model", run_dir / "bpe.key"
    if proto is not None:  # a resumed run goes on with its checkpoint's own BPE model
        if old.exists() and old.read_bytes() != proto:
            raise data.DataError(f"{old}: not the BPE model its checkpoint was trained with")
    elif old.exists() and old_key.exists() and old_key.read_text() == stamp(old.read_bytes()):
        proto = old.read_bytes()
    else:
        t0 = time.time()
        # whitespace words (PTB's own vocabulary): --task lm alone (check_flags)
        if args.bpe_size == 0:
            proto, made = data.WordVocab.build(pairs["train"]).proto, "word vocabulary made"
        else:
            sides = (pairs["train"], []) if args.task == "lm" else zip(*pairs["train"])
            proto = data.train_bpe(*sides, args.bpe_size)
            made = f"trained {'' if args.task == 'lm' else 'joint '}BPE ({args.bpe_size} requested)"
        log(f"data: {made} in {time.time() - t0:.1f}s")
    # bpe.model: the vocabulary, sentencepiece's model or the word list; both or neither
    if stage is not None:
        data.atomic_write_all({stage / "bpe.model": proto, stage / "bpe.key": stamp(proto)})
    tok = data.load_tokenizer(proto, old)
    # a language model's training and dev segments (data.py section 8); none is filtered
    if args.task == "lm":
        streams = {split: data.lm_stream(tok, pairs[split]) for split in data.SPLITS}
        if streams["dev"].numel() - 1 < args.seq_len:
            raise data.DataError(
                f"{data.lm_text_file(args.data, 'dev')}: {streams['dev'].numel() - 1} "
                f"tokens, shorter than one segment of --seq-len {args.seq_len}"
            )
        train, dev = (
            data.lm_segments(streams["train"], args.seq_len),
            data.lm_segments(streams["dev"], args.seq_len),
        )
        # the baseline code's order (data.lm_streams): one row a batch's segment
        if args.lm_batches == "streams":
            train = data.lm_streams(
                streams["train"], args.seq_len, max(1, args.batch_tokens // args.seq_len)
            )
        log(
            "data: "
            + " / ".join(f"{streams[s].numel() - 1} {s}" for s in data.SPLITS)
            + f" tokens to predict, "
            f"vocabulary {tok.vocab_size}, {len(train)} training segments of --seq-len {args.seq_len}"
        )
        return tok, train, dev, train

    # from the run directory's cache, or encoded and cached in the staging folder
    def encode(split):
        return data.load_or_encode(
            tok,
            pairs[split],
            run_dir / f"{split}.enc.pt",
            stage / f"{split}.enc.pt" if stage is not None else False,
        )

    everything = encode("train")
    train, dropped = data.filter_long(everything, args.max_len)
    if dropped:
        log(f"data: dropped {dropped} training pairs longer than --max-len {args.max_len}")
    if not train:
        raise data.DataError(f"no training pair left after --max-len {args.max_len}")
    # Dev and test are never dropped (BLEU would be over other sentences); a line longer than
    # --max-len BPE tokens is cut to it for translation and the dev loss, with a count, so one huge
    # line cannot exhaust memory at epoch end.
    for split in ("dev", "test"):
        if n := decode.count_long(tok, [x for x, _ in pairs[split]], args.max_len):
            log(
                f"data: {split}: {n} source lines longer than --max-len {args.max_len} BPE tokens are cut to it"
            )
    # dev perplexity: pairs with a source
    dev = [(x[: args.max_len], y[: args.max_len]) for x, y in encode("dev") if x]
    log(
        f"data: {len(train)} train / {len(pairs['dev'])} dev / {len(pairs['test'])} test pairs, "
        f"vocabulary {tok.vocab_size}"
    )
    return tok, train, dev, everything


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
            f"{args.qk_percentile}th percentile of BPE training lengths, source and target pooled, no BOS/EOS, "
            f"before the --max-len filter"
        )
    g0 = qk_g0(L)
    log(f"qknorm: L = {L:.2f} ({how}); g0 = log2(L^2 - L) = {g0:.3f}")
    return g0


if __name__ == "__main__":
    # SIGTERM (SLURM's, before its kill) stops a run as Ctrl-C does: main() says how
    data.interrupt_on_sigterm()
    main()
