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
from machinery.logbook import RunLog, StepLog, append_metrics
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
    log: RunLog  # log(line): rank 0's console and train.log (Appendix C)
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
        run_dir, ckpt, stage = open_run_dir(
            args, pairs, log, stack, rank == 0, resumed, stop_reason
        )
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
            raise fileio.DataError(
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
    step_log = StepLog(run, total, diverged)
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
        "stopped": run.state.stopped[1],
        # [2] Figure 6: the embedding matrix's singular values, over the largest (decode.py
        # --svd)
        "embedding_singular_values": decode.singular_values(run.model),
    }
    # [1] Figures 3-4: learned g versus depth (train.log too)
    decode.print_g_table(run.model, run.log)
    # before test
    fileio.atomic_write(
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
        fileio.atomic_write(run.dir / "test.hyp", "".join(h + "\n" for h in hyps))
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
    fileio.atomic_write(run.dir / "results.json", json.dumps(result, indent=2) + "\n")
    return result


# =======================================================================================
# Appendix A: main(), and the flags. Every flag names the paper and equation it comes from; --help
# is their documentation. The parser's own defaults are suppressed, so that parse_args returns
# exactly the flags given on the command line; DEFAULTS holds the defaults. A run's flags are
# DEFAULTS, then the --preset's flags (Appendix B), then the command line's (resolve_flags).
# =======================================================================================


# The range of each number is its type= (data.py Appendix D): a value out of range is argparse's own
# error line.


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


# =======================================================================================
# Appendix C: speed and the log. Model FLOPs, the machine's own matmul throughput (MFU), the log
# line (StepLog), a diverged run, the batch norms' diagnostics, --benchmark, --profile, keeping
# freed memory. Figures are never asserted.
# =======================================================================================


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
    last = rundir.checkpoint_file(run.dir, "last")
    run.state.stopped = stopping(
        run.args,
        "diverged",
        what=what,
        last=f"the last good checkpoint is {last}"
        if last.exists()
        else "no checkpoint was written",
    )
    run.log("error: " + run.state.stopped[1])


# =======================================================================================
# Appendix D: this process (threads, seeds, device), and several processes. torchrun sets
# WORLD_SIZE/RANK/LOCAL_RANK: PyTorch's DistributedDataParallel, gloo on the CPU and NCCL on CUDA.
# Each step's batches are sharded by rank (Run.next_batches); the batch norms sum their statistics
# over the ranks (norms.py Appendix A); rank 0 alone evaluates, logs and writes, and shares its dev
# score.
# =======================================================================================


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
# A run directory's files and what --overwrite removes: data.py's Appendix D (RESULT_FILES,
# CACHE_FILES, checkpoints); the BPE model and the encoded caches are keyed by their content and are
# reused or replaced, never trusted.


# =======================================================================================
# Appendix F: the corpus into the run directory. Read every split (data.py), train the joint BPE
# into the run directory (reused by a later run only for the same training text and size),
# encode (cached there too); a language model's text is cut into segments (data.py section 8).
# =======================================================================================


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
    # The command line (its flags, modes and checks) is machinery, not the book:
    # machinery/train_cli.py runs as the program and reads this chapter.
    runpy.run_module("machinery.train_cli", run_name="__main__")
