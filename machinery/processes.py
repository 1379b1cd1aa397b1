"""machinery/processes.py: this process (threads, seeds, device), and several processes.

One process: start_device sets --threads and --reference and picks the device (both programs);
start_process also seeds the random generators, keeps freed memory for reuse on the CPU and decides
bf16. Several: torchrun sets WORLD_SIZE, RANK and LOCAL_RANK, and the run uses PyTorch's
DistributedDataParallel, gloo on the CPU and NCCL on CUDA (one GPU per process). Each step's batches
are sharded by rank (train.py's Run.next_batches); the batch norms sum their statistics over the
ranks (norms.py Appendix A); rank 0 alone checks and commits the run directory (rank0_first),
evaluates, logs and writes, and shares its dev score. across_processes counts a step's target tokens
over the ranks and syncs the gradients once per step; wrap_model puts DDP and --compile around the
model.

Who calls it: train.py (setup, train_step) and machinery/decode_cli.py (start_device).
"""

import contextlib
import ctypes
import os
import random
import sys

import torch
import torch.distributed as dist

import data
from machinery.fileio import DataError
from model import pick_device, precision
from norms import use_reference


def start_device(args):
    """Both files' --threads, --reference and --device, set once: the device to run on (DataError if
    it is not here)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    use_reference(args.reference)
    try:
        return pick_device(args.device)
    except ValueError as e:
        raise DataError(str(e)) from None


def start_process(args, log, stack):
    """(rank, world size, device, bf16) of this process: --threads, --reference, the seeds,
    torchrun's ranks (one GPU each), and the precision --dtype asks for on this device."""
    # torchrun's ranks.
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = start_device(args)  # --device cuda without a GPU: DataError, main()'s one line
    if world > 1 and device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():  # one GPU per process
            sys.exit(
                f"error: {world} processes on this machine need {local + 1}+ GPUs, but it has "
                f"{torch.cuda.device_count()} (use --nproc_per_node {torch.cuda.device_count()}, "
                f"or --device cpu)"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        stack.push(close_process_group)
    if device.type == "cpu" and not args.reference:
        keep_freed_memory()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    # --dtype's precision on this device (model.precision, the one rule), said on the first screen
    # and recorded in config.json and results.json.
    bf16, why = precision(device, args.dtype)
    args.precision = "bf16" if bf16 else "fp32"
    log(f"precision: {why}")
    return rank, world, device, bf16


def close_process_group(failed, *_):
    """Under torchrun, the process group is closed after a run that ended well (failed: its
    exception type, None), every rank at once: a rank that closed its gloo group while rank 0 was
    still testing aborted (SIGABRT, "terminate called without an active exception"), 2 runs in
    about 20."""
    if failed is None:
        dist.barrier()
        dist.destroy_process_group()


def keep_freed_memory():
    """glibc's malloc keeps freed memory for reuse: +10-15% tokens/s on the CPU. By default a block
    over 32 MiB (a batch's logits, an FFN activation) is mmap'ed fresh at every allocation and
    unmapped when freed, so each training step faults every page of it in again, zero-filled by the
    kernel (system time was a sixth of a Multi30k step). With these limits the freed blocks stay in
    malloc's heap, with the same peak memory. Linux/glibc only; elsewhere a no-op. (The usual
    alternative is preloading jemalloc.)"""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # <malloc.h>
        libc.mallopt(m_mmap_threshold, 1 << 30)  # blocks up to 1 GiB come from the heap
        libc.mallopt(m_trim_threshold, 1 << 30)  # and freed heap memory is not trimmed back
        libc.mallopt(m_top_pad, 64 << 20)


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
