"""machinery/logbook.py: TODO."""
import io
import json
import math
import os
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from norms import timed
import resource
import time
from dataclasses import asdict
import torch.distributed as dist
from rich.progress import TimeElapsedColumn, TimeRemainingColumn
from torch.profiler import ProfilerActivity, profile
from torch.utils.benchmark import Timer
import data

from model import (
    output_columns,
)
from norms import BATCH_NORMS, sync
from machinery import fileio


def scalars(record, prefix=""):
    """The numbers of a metrics record as (tag, value), a nested key's tag joined by "/"
    (g/encoder.0.norm_ff.g)."""
    for k, v in record.items():
        if isinstance(v, dict):
            yield from scalars(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
            yield prefix + k, v


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


def benchmark(run, train_step):
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


def append_metrics(run, record):
    """Append one record to metrics.jsonl (rank 0). Strict JSON: a non-finite number is written
    as null and its key listed under "nonfinite" (json.dumps would write the non-standard NaN)."""
    if run.master:
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        # NaN, Infinity: null, nested too
        record = json.loads(json.dumps(record), parse_constant=lambda _: None)
        record.update({"nonfinite": bad} if bad else {})
        fileio.append_file(run.dir / "metrics.jsonl", json.dumps(record, allow_nan=False) + "\n")
        # --tensorboard: the same records, as events
        for tag, value in scalars(record) if run.board else ():
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
            fileio.append_file(self.path, "".join(self.waiting))
            self.waiting = []

    print = __call__  # what decode.print_g_table prints with: its table goes to train.log too


class StepLog:
    """The training loop's log: a progress bar on a terminal, a metrics record per step ([1] Figure
    2), a log line per --log-interval steps (loss, tokens/s, MFU), a stop when the loss or the
    gradient norm is not finite. The steps' numbers stay on the device: reading them (.item()) would
    wait for the GPU at every step. They are read together at each log line and before each
    evaluation."""

    def __init__(self, run, total, on_diverged):
        # on_diverged(run, what): train.py's diverged, which stops the run
        self.run, self.total, self.on_diverged, args = run, total, on_diverged, run.args
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
