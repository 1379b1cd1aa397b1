"""machinery/speed.py: how fast the code runs, measured and printed, never asserted.

What it holds:
  - The timing harness: sync (waits for the work queued on a CUDA device) and timed (a call's
    result and its wall seconds, the device synchronised before and after). decode.py --benchmark
    (machinery/decode_cli.py), the built-in corpus (machinery/toy_corpus.py), train.py's
    --benchmark and python norms.py --benchmark time with it.
  - FLOPs and MFU: batch_flops (the matmul FLOPs of one training step on a batch), step_flops (a
    step's, over its micro-batches and the ranks) and matmul_flops (this machine's own GEMM
    throughput, MFU's denominator). machinery/logbook.py's StepLog reads them for the log line.
  - train.py's --benchmark N and --profile: benchmark times N training steps after a warm-up, with
    one device sync at the end as training has, and prints tokens/s, FLOPs, MFU, padding and peak
    memory; profile_steps runs 5 more steps under torch.profiler. machinery/train_cli.py calls
    benchmark in place of the training loop.
  - python norms.py --benchmark: every norm's forward+backward timed against LayerNorm
    (benchmark_norms), and its command line (main). norms.py's ``if __name__ == "__main__":`` runs
    this module as the program.

The figures are printed, never asserted (no test checks a speed): these machines are shared and
noisy, so compare ratios measured in one run, with the candidates interleaved (round robin) so that
noise hits them alike. A reader of the book never needs this module: no chapter imports it.
"""

import argparse
import resource
import time
from dataclasses import asdict
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.benchmark import Timer

import data
from model import output_columns
from norms import NORMS, build_norm, use_reference


def sync(device):
    """Waits for the work queued on a CUDA device (the CPU's is done when it returns)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device=None):
    """(the result of fn(), its wall seconds), the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def benchmark_norms(
    batch=64, length=64, d=512, heads=8, repeats=30, rounds=5, device="cpu", bf16=False
):
    """Best (over rounds) seconds of one forward+backward of every norm on (batch, length, d);
    bf16: a bf16 input under CUDA autocast, as in training on a GPU. The norms take turns in every
    round (round robin), each after one untimed warm-up."""
    x0 = torch.randn(
        batch, length, d, device=device, dtype=torch.bfloat16 if bf16 else torch.float32
    )
    pad = torch.zeros(batch, length, dtype=torch.bool, device=device)
    pad[: batch // 2, length - length // 8 :] = True  # some padding, as in a real batch
    dy = torch.randn_like(x0)
    # Every norm, PowerNorm past its warmup.
    norms = {name: build_norm(name, d, heads, {"warmup": 1}).to(device) for name in NORMS}

    def run(norm, x):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            for _ in range(repeats):
                norm(x, pad).backward(dy)

    times = {name: [] for name in norms}
    for _ in range(rounds):
        for name, norm in norms.items():
            x = x0.clone().requires_grad_(True)
            run(norm, x)  # warm-up
            times[name].append(timed(partial(run, norm, x), device)[1] / repeats)
    return {name: min(t) for name, t in times.items()}  # min over rounds: the least disturbed


def batch_flops(cfg, b, out_vocab=None):
    """Training FLOPs of one step on a data.Batch b: its (B, S) source and (B, T) target, padding
    included.

    Counts the matmuls (2 FLOPs per multiply-add) of the forward pass, times 3 (backward ~ two
    forwards). Per token, per layer:
      encoder:  Q, K, V, O projections 4 D^2 + FFN 2 D FF          + scores Q K^T, A V: 2 S D
      decoder:  self 4 D^2 + cross Q, O 2 D^2 + FFN 2 D FF          + scores 2 T D + 2 S D
                (+ cross K, V 2 D^2 per *source* token)
      output:   D Vt per target token (training computes only the Vt = out_vocab target words'
                logits; by default all V)
    A language model (S = 0) has no cross-attention. The multi-linear attention (model.py
    Appendix B) costs W^QKV 3 D HR, the tensor T^2 HR (T^2 R per head; twice under --positions
    relative) and W^O H L^2 D per token, where HR = H x --head-dim (D by default).
    """
    # A language model's batch has no source (S = 0).
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


def step_flops(run, batches):
    """A step's FLOPs, for the log line and --benchmark: this rank's micro-batches x the ranks."""
    return (
        sum(batch_flops(run.model.cfg, b, output_columns(run.model)) for b in batches) * run.world
    )


def gemm_shapes(run, tokens=4096):
    """The step's own matmul shapes (m, k, n), (m x k) @ (k x n) over `tokens` rows: the
    attention's projections (D -> D), the feed-forward's two (D -> FF, FF -> D) and the output
    layer (D -> the columns a step computes, output_columns)."""
    d, ff = run.args.d_model, run.args.ff
    return [
        (tokens, d, d),
        (tokens, d, ff),
        (tokens, ff, d),
        (tokens, d, output_columns(run.model)),
    ]


def matmul_flops(run, tokens=4096, seconds=1.0):
    """FLOP/s of the fastest of the step's own GEMM shapes (gemm_shapes), in the step's precision
    (bf16 under autocast, else fp32), in this process: MFU's denominator. A step's matmuls run at
    most this fast, so its MFU stays under 100% (one fixed shape, the feed-forward's, ran slower
    here than a 10k-word output layer, and pn2-script's MFU read 98-110%). torch's Timer runs each
    shape in blocks of products for its share of `seconds` (after a warm-up; on a GPU, one sync per
    block) and the best block counts: a busy moment on a shared machine would otherwise understate
    the peak (and inflate MFU)."""
    device, shapes = run.device, gemm_shapes(run, tokens)
    gen = torch.Generator(device=device).manual_seed(0)  # its own RNG: training's stays untouched
    dtype = torch.bfloat16 if run.step_options.bf16 else torch.float32
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, generator=gen).to(dtype)
        b = torch.randn(k, n, device=device, generator=gen).to(dtype)
        # Timer's default is 1 thread; the GEMM gets as many as training has.
        timer = Timer("a @ b", globals={"a": a, "b": b}, num_threads=torch.get_num_threads())
        secs = min(timer.blocked_autorange(min_run_time=seconds / len(shapes)).times)
        best = max(best, 2 * m * k * n / secs)
    return best


def benchmark(run, train_step):
    """--benchmark N: time N training steps after 3 warm-up steps (and --compile's compilations);
    print figures, assert nothing. As in training, the host reads nothing back from the device in
    the N steps: one sync at the end."""
    args, warm, dev = run.args, 3, run.device
    matmul_peak = matmul_flops(run)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    # torch.compile's own counter of the graphs it made, imported only with --compile.
    if args.compile:
        from torch._dynamo.utils import counters
    graphs = int(counters["stats"]["unique_graphs"]) if args.compile else 0

    def step(i):
        """Step i's mean loss and target tokens, left on the device, and its FLOPs."""
        batches = run.next_batches()
        loss, _, _, n_tgt = train_step(
            run.net, run.optimizer, batches, run.schedule(i + 1), run.step_options
        )
        return loss / n_tgt, n_tgt, step_flops(run, batches)

    def steps(first, last):
        return [step(i) for i in range(first, last)]

    warmed, warm_secs = timed(partial(steps, 0, warm), dev)
    compiling = " (and compilation)" if args.compile else ""
    run.log(f"benchmark: {warm} warm-up steps{compiling} took {warm_secs:.1f}s")
    measured, secs = timed(partial(steps, warm, warm + args.benchmark), dev)
    losses = torch.stack([loss for loss, _, _ in warmed + measured]).tolist()
    # n is a device tensor under DDP.
    n_tok, flops = float(sum(n for _, n, _ in measured)), sum(f for _, _, f in measured)
    result = profile_steps(run, step, secs, n_tok) if args.profile else {}
    # The graphs torch.compile made in these steps (a recompilation storm shows here).
    if args.compile:
        result["compiled_graphs"] = int(counters["stats"]["unique_graphs"]) - graphs
    # The peak measured again after the steps; the larger of the two is kept.
    matmul_peak = max(matmul_peak, matmul_flops(run))
    result.update(benchmark_figures(run, n_tok, flops, secs, matmul_peak, losses))
    run.log(benchmark_line(result))
    return result


def benchmark_figures(run, n_tok, flops, secs, matmul_peak, losses):
    """--benchmark's figures: the timed steps took secs for n_tok target tokens and flops FLOPs;
    matmul_peak is this process's GEMM FLOP/s and losses every step's mean loss."""
    dev = run.device
    if dev.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(dev) / 2**20
        device = f"{dev} ({torch.cuda.get_device_name(dev)})"
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB
        device = str(dev)
    return {
        "steps": run.args.benchmark,
        "tgt_tok_per_s": n_tok / secs,
        "flops_per_tgt_token": flops / n_tok,
        "achieved_flops": flops / secs,
        "matmul_peak_flops": matmul_peak,
        "mfu": flops / secs / (matmul_peak * run.world),
        "padding_share": data.padding_share(run.train, run.order, run.pad_multiple),
        "peak_memory_mb": peak_mb,
        "threads": torch.get_num_threads(),
        "device": device,
        "bf16": run.step_options.bf16,
        "losses": losses,
        "model_config": asdict(run.model.cfg),
    }


def benchmark_line(r):
    """--benchmark's log line of its figures r."""
    graphs = f" | {r['compiled_graphs']} compiled graphs" if "compiled_graphs" in r else ""
    return (
        f"benchmark: {r['steps']} steps | {r['tgt_tok_per_s']:.0f} target tok/s | "
        f"{r['flops_per_tgt_token'] / 1e6:.1f} MFLOP/target token | achieved "
        f"{r['achieved_flops'] / 1e9:.1f} GFLOP/s | matmul peak "
        f"{r['matmul_peak_flops'] / 1e9:.1f} GFLOP/s | MFU {100 * r['mfu']:.1f}% | padding "
        f"{100 * r['padding_share']:.1f}% | peak memory {r['peak_memory_mb']:.0f} MiB "
        f"| {r['threads']} threads{graphs}"
    )


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
        # The GPU's busy seconds per target token.
        busy = sum(e.self_device_time_total for e in kernels) / 1e6 / prof_tok
        result["host_gap_share"] = max(0.0, 1 - busy / (secs / n_tok))
        steps = run.args.benchmark  # the timed steps' secs and n_tok
        run.log(
            f"profile: the GPU is busy {1e6 * busy * n_tok / steps:.0f} us of each "
            f"{1e6 * secs / steps:.0f} us step: {100 * result['host_gap_share']:.1f}% of the step "
            "is host gaps"
        )
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    run.log(events.table(sort_by=key, row_limit=25))
    return result


def build_parser():
    """python norms.py --benchmark's flags."""
    p = argparse.ArgumentParser(description="Time every norm's forward+backward against LayerNorm.")
    p.add_argument("--benchmark", action="store_true", help="run the benchmark (the only action)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--length", type=int, default=64)
    p.add_argument(
        "--d-model", type=int, default=512, help="D of the activations (base model: 512)"
    )
    p.add_argument("--heads", type=int, default=8, help="PowerNorm's GroupScaling groups")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--reference",
        action="store_true",
        help="time the written-out LayerNorm in place of F.layer_norm",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--bf16", action="store_true", help="on CUDA: a bf16 input under autocast, as training runs"
    )
    return p


def main():
    """python norms.py --benchmark: every norm's forward+backward, timed against LayerNorm."""
    p = build_parser()
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if not a.benchmark:
        p.print_help()
        raise SystemExit(0)
    if a.threads:
        torch.set_num_threads(a.threads)
    use_reference(a.reference)
    bf16 = a.bf16 and a.device == "cuda"  # --bf16 is CUDA's: the CPU is timed in fp32
    best = benchmark_norms(a.batch, a.length, a.d_model, a.heads, device=a.device, bf16=bf16)
    where = (
        torch.cuda.get_device_name() if a.device == "cuda" else f"{torch.get_num_threads()} threads"
    )
    reference = ", --reference" if a.reference else ""
    print(
        f"forward+backward on ({a.batch}, {a.length}, {a.d_model}) {'bf16' if bf16 else 'fp32'}, "
        f"{where}, best of 5 rounds x 30{reference}:"
    )
    for name, t in best.items():
        print(f"  {name:12s} {t * 1e3:8.3f} ms   {t / best['layer']:5.2f} x LayerNorm")


if __name__ == "__main__":
    main()
