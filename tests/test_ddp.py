"""Multi-process training (torch.distributed, gloo on CPU): 2 ranks = 1 process with the whole
batch.

train.py under torchrun wraps the model in DistributedDataParallel and gives each rank a shard
of the step's batch; norms.py sums the batch statistics of BatchNorm, PN-V and PowerNorm over
the ranks (the authors' code never did). The claim tested here: one or more optimizer steps on
2 ranks, each with half of a batch (split by sentences), give the same parameters, norm buffers,
losses and gradient norms as the same steps on 1 process with the whole batch.

How: this file is also the worker script. The test runs ``python tests/test_ddp.py --worker OUT``
twice (RANK 0 and 1, MASTER_ADDR 127.0.0.1, a free port), each worker runs every configuration
through ``train.train_step`` on a DDP-wrapped float64 model and saves its state; the test process
(never distributed) runs the same steps on the whole batches and compares. A last test runs
train.py itself under torchrun with 2 processes.

What this caught: train_step used to multiply each rank's loss by the world size (so that DDP's
gradient *average* became the sum). That scales every dL/dY by 2, which PowerNorm's backward is
not linear in (eq. 11 subtracts nu X^, which does not scale): running_nu came out twice the
whole-batch value and later gradients differed. train_step now sums the ranks' gradients instead.
"""

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import gloo_unusable_reason

import data
import model
import norms
import train
from machinery import toy_corpus, train_cli

# The repository's root: conftest.py puts it on the import path of the tests, and dist_env's
# PYTHONPATH on the worker's (it runs as a script, without conftest.py).
ROOT = Path(__file__).resolve().parent.parent

TIMEOUT_S = 90  # a hung collective must fail the test, not hang it

# name -> (norm, norm options, even padding, --clip). Three steps: for PowerNorm with warmup 2, step
# 1 is the code variant's cumulative-mean warmup step, step 2 divides by psi_B, step 3 by the
# running psi; running_nu is updated by every backward. "code" counts padding positions in its
# backward means, so its two halves must have the whole batch's padded lengths ("even"); the others
# get halves of different padded lengths, where only real tokens may count. No clipping (clipping,
# like Adam's first step ~ lr * sign(g), would hide a gradient off by a constant factor; so the
# optimizer is plain SGD), except in "batch-clip": clip_grad_norm_ runs after DDP's all-reduce, so
# every rank clips with the whole batch's norm.
CONFIGS = {
    "scale": ("scale", {}, False, 0.0),  # the default: ScaleNorm, PreNorm, FixNorm
    "layer": ("layer", {}, False, 0.0),
    "batch": ("batch", {}, False, 0.0),
    "pnv": ("pnv", {}, False, 0.0),
    "power-paper": ("power", {"warmup": 2, "variant": "paper"}, False, 0.0),
    "power-code": ("power", {"warmup": 2, "variant": "code"}, True, 0.0),
    "batch-clip": ("batch", {}, False, 0.1),
}


# Negative controls, BatchNorm with norms.sum_over_ranks replaced: they must *not* match, or the
# comparison could not see anything. "unsynced": per-rank statistics (the authors' code).
# "not differentiable": the right sums in the forward, but through plain dist.all_reduce, which
# autograd does not see: the backward misses the other ranks' share of the gradient.
def _unsynced(*tensors):
    return tensors


def _not_differentiable(*tensors):
    out = []
    for t in tensors:
        total = t.detach().clone()
        torch.distributed.all_reduce(total)
        out.append(t + (total - t.detach()))  # the value of the sum, the gradient of t alone
    return tuple(out)


CONTROLS = {"batch-unsynced": _unsynced, "batch-not-differentiable": _not_differentiable}
STEPS, SENTENCES, VOCAB, LR = 3, 8, 50, 0.5


def make_batches(seed, even):
    """STEPS lists of SENTENCES encoded pairs (token ids 4..VOCAB-1). Uneven: the first half
    short, the second long (each half has its own padded lengths). Even: each half holds a
    pair with the longest source and one with the longest target."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        pairs = []
        for i in range(SENTENCES):
            lo, hi = (2, 6) if (i < SENTENCES // 2 and not even) else (4, 10)
            ls, lt = (int(v) for v in torch.randint(lo, hi + 1, (2,), generator=g))
            if even and i in (0, SENTENCES // 2):
                ls = hi  # the longest source in each half
            if even and i in (1, SENTENCES // 2 + 1):
                lt = hi  # the longest target in each half
            pairs.append(
                tuple(torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (ls, lt))
            )
        steps.append(pairs)
    return steps


class SGD:
    """p <- p - lr * dL/dp, the optimizer interface train_step uses. (torch.optim.SGD does the
    same, but importing torch.optim's step machinery costs each process seconds of
    torch._dynamo.)"""

    def __init__(self, params, lr):
        self.params = list(params)
        self.param_groups = [{"lr": lr, "params": self.params}]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is not None:
                p.sub_(self.param_groups[0]["lr"] * p.grad)


def build(norm, options):
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    cfg = model.ModelConfig(
        vocab_size=VOCAB,
        d_model=16,
        heads=2,
        ff=32,
        enc_layers=1,
        dec_layers=1,
        norm=norm,
        dropout=0.0,
        norm_options=dict(options),
    )
    m = model.Transformer(cfg).double()
    return m, SGD(m.parameters(), lr=LR)


def run_config(name, rank=0, world=1):
    """STEPS train_steps of configuration `name`; rank r of `world` trains on its half of each
    batch. Returns the final state_dict and the per-step (local loss sum, global target tokens, grad
    norm)."""
    norm, options, even, clip = CONFIGS["batch" if name in CONTROLS else name]
    step_options = train.StepOptions(word_dropout=0.0, smoothing=0.1, clip=clip)
    m, opt = build(norm, options)
    step_model = m
    if world > 1:
        step_model = torch.nn.parallel.DistributedDataParallel(m)
    m.train()
    losses, gnorms, totals = [], [], []
    for pairs in make_batches(seed=1, even=even):
        half = len(pairs) // world
        b = data.collate(pairs, list(range(rank * half, (rank + 1) * half)))  # rank r: its half
        # n: all ranks' target tokens
        loss, _, gnorm, n = train.train_step(step_model, opt, [b], LR, step_options)
        losses.append(loss.item())
        gnorms.append(gnorm.item())
        totals.append(float(n))  # a device tensor under DDP
    return {
        "state": {k: v.clone() for k, v in m.state_dict().items()},
        "loss": losses,
        "gnorm": gnorms,
        "tokens": totals,
    }


def worker(out_dir):
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment)."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {name: run_config(name, rank, world) for name in CONFIGS}
    synced = norms.sum_over_ranks
    for name, replacement in CONTROLS.items():
        norms.sum_over_ranks = replacement
        try:
            results[name] = run_config(name, rank, world)
        finally:
            norms.sum_over_ranks = synced
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_env(**extra):
    env = dict(
        os.environ, MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra
    )
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no dependence on the host's network
    return env


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Runs the 2 workers once for every configuration; returns [rank 0 results, rank 1 results]."""
    reason = gloo_unusable_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("ddp")
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(out)],
            cwd=ROOT,
            env=dist_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs, deadline = [], time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-4000:]}"
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def max_difference(a, b):
    """(largest |a - b| over the float entries of two state_dicts, its key); integer entries must be
    equal."""
    assert a.keys() == b.keys()
    worst = (0.0, None)
    for k in a:
        if a[k].is_floating_point():
            worst = max(worst, ((a[k] - b[k]).abs().max().item(), k))
        else:
            assert torch.equal(a[k], b[k]), k
    return worst


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_with_half_batches_equal_one_process_with_the_whole_batch(ranks, name):
    whole = run_config(name)  # this process is not distributed: the whole batch
    norm = CONFIGS[name][0]
    buffers = [
        k
        for k in whole["state"]
        if k.endswith(("running_mean", "running_var", "running_phi", "running_nu"))
    ]
    assert bool(buffers) == (norm in ("batch", "pnv", "power"))
    start = dict(build(*CONFIGS[name][:2])[0].named_parameters())
    moved = max((whole["state"][k] - v).abs().max().item() for k, v in start.items())
    assert moved > 1e-3  # the steps did change the model (so equality below says something)
    for r, res in enumerate(ranks):
        # Parameters and every buffer (running statistics, running_nu, counters), on each rank.
        diff, key = max_difference(res[name]["state"], whole["state"])
        assert diff < 1e-12, f"rank {r}: {key} differs by {diff:.3g}"
        assert res[name]["tokens"] == whole["tokens"]  # the global target count of each step
        # The gradient norm (clip_grad_norm_ runs after DDP's all-reduce): the whole batch's, on
        # each rank.
        assert res[name]["gnorm"] == pytest.approx(whole["gnorm"], rel=1e-12, abs=0)
    if CONFIGS[name][3]:
        assert min(whole["gnorm"]) > CONFIGS[name][3]  # clipping did act
    # Each rank's loss sum is its half's; the two add up to the whole batch's.
    halves = [a + b for a, b in zip(ranks[0][name]["loss"], ranks[1][name]["loss"], strict=True)]
    assert halves == pytest.approx(whole["loss"], rel=1e-12, abs=0)
    if buffers:  # the statistics differ between the halves, so synchronisation was needed
        assert ranks[0][name]["loss"] != pytest.approx(ranks[1][name]["loss"], rel=1e-3)


@pytest.mark.parametrize("control", list(CONTROLS))
def test_batchnorm_without_differentiable_cross_rank_sums_does_not_match(ranks, control):
    """The negative controls: per-rank statistics (the authors' code), or the right statistics
    whose sum autograd cannot see, give another model."""
    whole = run_config("batch")
    for res in ranks:
        assert max_difference(res[control]["state"], whole["state"])[0] > 1e-6
    if control == "batch-not-differentiable":  # the first forward was right; its backward was not
        assert ranks[0][control]["loss"][0] == pytest.approx(
            ranks[0]["batch"]["loss"][0], rel=1e-12
        )


def test_sum_over_ranks_is_the_identity_on_one_process():
    a, b = torch.randn(3, requires_grad=True), torch.tensor(2.0)
    out = norms.sum_over_ranks(a, b)
    assert out[0] is a and out[1] is b


def test_train_py_under_torchrun_with_two_processes(tmp_path):
    """train.py with 2 ranks: exits 0, rank 0 alone writes the run files, checkpoints exist."""
    reason = gloo_unusable_reason()
    if reason:
        pytest.skip(reason)
    corpus = toy_corpus.make_toy_corpus(tmp_path / "corpus", n_train=300, n_dev=10, n_test=10)
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(ROOT / "train.py"),
        "--d-model",
        "32",
        "--ff",
        "64",
        "--layers",
        "1",
        "--heads",
        "2",
        "--batch-tokens",
        "512",
        "--max-steps",
        "6",
        "--epoch-size",
        "3",
        "--threads",
        "1",
        "--bpe-size",
        "300",
        "--device",
        "cpu",
        "--data",
        str(corpus),
        "--src",
        "src",
        "--tgt",
        "tgt",
        "--out",
        str(run),
    ]
    t0 = time.time()
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, env=dist_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S}s:\n{(e.stdout or b'')[-3000:]}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, (
        f"torchrun exited with {p.returncode} after {time.time() - t0:.0f}s:\n{out[-4000:]}"
    )
    assert out.count("model:") == 1 and "2 ranks" in out  # rank 0 alone logs
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 7))  # each step once: rank 1 wrote nothing
    for r in records:  # both ranks' target tokens, read back from the device with the loss
        if "loss" in r:
            assert r["tokens"] > 0 and float(r["tokens"]).is_integer() and 0 < r["loss"] < 20, r
    assert [r["epoch"] for r in records if "epoch" in r] == [1, 2]
    assert sum("final" in r for r in records) == 1
    for f in (
        "config.json",
        "bpe.model",
        "checkpoint_last.pt",
        "checkpoint_best.pt",
        "results.json",
    ):
        assert (run / f).exists(), f
    assert not list(run.glob("*.tmp"))
    ckpt = torch.load(run / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert ckpt["train_state"]["step"] == 6
    # The same command again: rank 0 refuses (the directory holds a run), and rank 1 stops with it,
    # not waiting for rank 0 for ever; nothing changes.
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    cmd[cmd.index("--master_port") + 1] = str(free_port())
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, env=dist_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"a refused start under torchrun did not end in {TIMEOUT_S}s "
            "(a rank waiting for rank 0)"
        )
    assert p.returncode != 0 and (p.stdout + p.stderr).count("already holds a run") == 1, (
        p.stdout + p.stderr
    )
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before


def test_a_torchrun_run_stopped_by_sigterm_resumes_exactly_and_only_with_as_many_processes(
    tmp_path,
):
    """SIGTERM to torchrun (which passes it to its workers) mid-run: the two ranks agree on the step
    to stop after, rank 0 saves it with each rank's random generators (dropout, word dropout), and
    the resumed 2-rank run logs the same steps as one run never stopped; a resume with 1 process is
    refused."""
    reason = gloo_unusable_reason()
    if reason:
        pytest.skip(reason)
    corpus = toy_corpus.make_toy_corpus(tmp_path / "corpus", n_train=300, n_dev=10, n_test=10)

    def torchrun(*argv, wait=True):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(ROOT / "train.py"),
            *argv,
        ]
        if not wait:
            return subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=dist_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        p = subprocess.run(
            cmd, cwd=ROOT, env=dist_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]

    flags = [
        "--d-model",
        "32",
        "--ff",
        "64",
        "--layers",
        "1",
        "--heads",
        "2",
        "--batch-tokens",
        "512",
        "--epoch-size",
        "7",
        "--log-interval",
        "2",
        "--threads",
        "1",
        "--bpe-size",
        "300",
        "--device",
        "cpu",
        "--data",
        str(corpus),
        "--src",
        "src",
        "--tgt",
        "tgt",
        "--max-steps",
        "60",
        "--max-epochs",
        "99",
    ]
    torchrun(*flags, "--out", str(tmp_path / "whole"))
    part = tmp_path / "part"
    proc, deadline = torchrun(*flags, "--out", str(part), wait=False), time.time() + TIMEOUT_S

    def steps(d):
        return [
            (r["step"], r["loss"], r["gnorm"])
            for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())
            if "loss" in r
        ]

    while (
        proc.poll() is None
        and time.time() < deadline
        and len(steps("part") if (part / "metrics.jsonl").exists() else []) < 4
    ):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=TIMEOUT_S)[0]
    stopped = torch.load(part / "checkpoint_last.pt", map_location="cpu", weights_only=True)[
        "train_state"
    ]["step"]
    assert 4 <= stopped < 60 and "interrupted: continue with torchrun" in out, out[-4000:]
    torchrun("--resume", str(part))
    assert steps("part") == steps("whole") and len(steps("whole")) == 60
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--resume", str(part), "--max-steps", "70"])
    assert "trained on 2 processes and this is 1" in str(e.value.code)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2])
