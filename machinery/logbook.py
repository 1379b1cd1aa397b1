"""machinery/logbook.py: what a training run tells, on the console and in its run directory.

RunLog is the run's log: each line on rank 0's console and, timestamped, in the run directory's
train.log, across resumes. StepLog is the training loop's log: a progress bar on a terminal, a
metrics record per step ([1] Figure 2), a log line per --log-interval steps (loss, perplexity, LR,
tokens/s, MFU, gradient norm), the batch norms' diagnostics ([2] Figures 2-4), and a stop when the
loss or the gradient norm is not finite. append_metrics writes a record to metrics.jsonl, strict
JSON, and under --tensorboard the same numbers as TensorBoard scalars (open_board opens the writer).
MFU's numbers (model FLOPs, the machine's own matmul throughput) come from machinery/speed.py.
Figures are logged, never asserted.

Who calls it: train.py (setup, the loop, the end of an epoch, the final test) and
machinery/train_cli.py's main(), which makes the RunLog before the run exists. Imports run one way:
train.py imports this module, never the reverse, so StepLog is handed train.py's diverged (which
stops the run) as on_diverged.
"""

import io
import json
import math
import os
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from machinery import fileio
from machinery.speed import matmul_flops, step_flops
from norms import BATCH_NORMS


def scalars(record, prefix=""):
    """The numbers of a metrics record as (tag, value), a nested key's tag joined by "/"
    (g/encoder.0.norm_ff.g)."""
    for k, v in record.items():
        if isinstance(v, dict):
            yield from scalars(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
            yield prefix + k, v


def append_metrics(run, record):
    """Append one record to metrics.jsonl (rank 0). Strict JSON: a non-finite number is written
    as null and its key listed under "nonfinite" (json.dumps would write the non-standard NaN)."""
    if run.master:
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        # NaN and Infinity become null, nested ones too.
        record = json.loads(json.dumps(record), parse_constant=lambda _: None)
        record.update({"nonfinite": bad} if bad else {})
        fileio.append_file(run.dir / "metrics.jsonl", json.dumps(record, allow_nan=False) + "\n")
        # --tensorboard: the same records, as events.
        for tag, value in scalars(record) if run.board else ():
            run.board.add_scalar(tag, value, record.get("step", run.state.step))


def open_board(run_dir, step, stack):
    """--tensorboard's SummaryWriter into the run directory (rank 0), open until the run ends (it
    is entered in stack). A resume hides what a killed run wrote after its checkpoint's step."""
    # An optional extra, imported only here (machinery/train_cli.py's check_flags checked that it is
    # installed).
    from torch.utils.tensorboard import SummaryWriter

    return stack.enter_context(SummaryWriter(run_dir, purge_step=step + 1))


class RunLog:
    """The run's log: log(line) prints the line on rank 0's console (the other ranks' is quiet) and
    appends it to the run directory's train.log, timestamped, across resumes. The lines before the
    run directory holds the run wait for it (machinery/rundir.py's commit_run_dir sets path)."""

    def __init__(self):
        self.console = Console(
            soft_wrap=True, quiet=os.environ.get("RANK", "0") != "0", highlight=False, markup=False
        )
        self.path, self.waiting = None, []

    def __call__(self, line):  # a string, or what rich prints
        self.console.print(line)
        if not self.console.quiet:  # the file gets the text without styles, unwrapped
            plain = Console(file=io.StringIO(), soft_wrap=True, color_system=None, markup=False)
            plain.print(line)
            self.waiting.append(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {plain.file.getvalue()}")
        if self.path is not None and self.waiting:
            fileio.append_file(self.path, "".join(self.waiting))
            self.waiting = []

    print = __call__  # what decode.print_g_table prints with: its table goes to train.log too


class StepLog:
    """The training loop's log: a progress bar on a terminal, a metrics record per step ([1] Figure
    2), a log line per --log-interval steps (loss, tokens/s, MFU) with the batch norms'
    diagnostics, a stop when the loss or the gradient norm is not finite. The steps' numbers stay
    on the device: reading them (.item()) would wait for the GPU at every step. They are read
    together at each log line and before each evaluation."""

    def __init__(self, run, total, on_diverged):
        # on_diverged(run, what): train.py's diverged, which stops the run.
        self.run, self.total, self.on_diverged, args = run, total, on_diverged, run.args
        self.matmul_peak = matmul_flops(run)
        run.log(
            f"speed: the fastest of the step's matmul shapes (d {args.d_model}, ff {args.ff}, the "
            f"output layer's columns) runs at {self.matmul_peak / 1e9:.1f} GFLOP/s here, in "
            f"{args.precision} (MFU's denominator)"
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
        # The steps since the last host sync, and when it was.
        self.pending, self.t0 = [], time.perf_counter()

    def step(self, batches, lr, loss, nll, gnorm, n_tgt):
        """One step's numbers, kept on the device; at a log step (and the last) they are read with
        the steps before and make the log line, at an evaluation's step they are read, so that a
        step that diverged stops the run before its evaluation."""
        run, s, args = self.run, self.run.state, self.run.args
        flops = step_flops(run, batches)
        # n_tgt is a tensor under DDP (every rank's count, summed on the device).
        numbers = [loss, nll, gnorm] + ([n_tgt] if torch.is_tensor(n_tgt) else [])
        numbers = torch.stack([x.double() for x in numbers])
        if run.world > 1:  # the whole batch's sums, so that every rank logs and stops alike
            # The loss and NLL sums, in place (n_tgt is summed already).
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
        # The one host sync.
        values = torch.stack([p[-1] for p in self.pending]).tolist() if self.pending else []
        dt, self.t0 = time.perf_counter() - self.t0, time.perf_counter()
        s.train_seconds += dt
        win["t"] += dt
        # Each step into the window, and its record ([1] Figure 2).
        for (step, step_lr, n, f, _), (loss, nll, g, *n_read) in zip(
            self.pending, values, strict=True
        ):
            n = n_read[0] if n_read else n
            for k, v in (
                ("loss", loss),
                ("nll", nll),
                ("tok", n),
                ("gnorm", g),
                ("n", 1),
                ("flops", f),
            ):
                win[k] += v
            append_metrics(
                run, {"step": step, "loss": loss / n, "gnorm": g, "lr": step_lr, "tokens": n}
            )
            # A non-finite gradient norm with a finite loss would still make the weights NaN.
            for what, v in (("the training loss", loss), ("the gradient norm", g)):
                if not math.isfinite(v):
                    self.on_diverged(run, f"{what} became {v} at step {step}")
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
            f"step {run.state.step:6d} | loss {tl:6.3f} | ppl {math.exp(min(nll, 50)):8.2f} | "
            f"lr {lr:.2e} | {tps:7.0f} tok/s | MFU {100 * mfu:4.1f}% | "
            f"gnorm {win['gnorm'] / win['n']:6.3f}"
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
        self.warn_if_diverging(tl)
        self.diagnostics()
        run.state.window = dict.fromkeys(win, 0.0)

    def warn_if_diverging(self, loss):
        """A training loss huge but finite, far above the loss of guessing uniformly among the
        target words after the warmup: the log and metrics.jsonl say so, and the run goes on."""
        run = self.run
        uniform = math.log(int(run.model.allowed.sum()))
        if loss > uniform + 3 and run.state.step > run.schedule.warmup:
            warning = (
                f"the training loss {loss:.2f} is far above a uniform guess ({uniform:.2f}): the "
                f"run may be diverging (a smaller --lr, --prenorm or more --warmup may help)"
            )
            run.log("warning: " + warning)
            append_metrics(run, {"step": run.state.step, "warning": warning})

    def diagnostics(self):
        """The batch norms' diagnostics of this log step into metrics.jsonl ([2] Figures 2-4: batch
        vs running statistics, and the batch statistics' gradient terms); train.py's
        keep_diagnostics had them kept at this step."""
        run = self.run
        stats = {
            name: m.stats
            for name, m in run.model.named_modules()
            if isinstance(m, BATCH_NORMS) and m.stats
        }
        if stats:
            append_metrics(run, {"step": run.state.step, "batch_norm_stats": stats})

    def evaluated(self):
        """After an evaluation: MFU's denominator is measured again and the larger of the two is
        kept (a busy moment at the start, or another process on a shared machine, reads it low and
        MFU above 100%); the clock restarts, as evaluation is not training time."""
        self.matmul_peak = max(self.matmul_peak, matmul_flops(self.run, seconds=0.25))
        self.t0 = time.perf_counter()
