"""Claims of the CUDA path (skipped, with the reason, where no GPU is visible):

  - one training step on the GPU in fp32 computes the CPU's loss, gradient norm and gradients
    (every kind of norm, the custom backwards of PowerNorm and the loss included); in bf16
    autocast it stays close to them;
  - the training step never makes the host wait for the GPU (no .item(), no data-dependent
    shape): torch's sync debug mode raises on any synchronising call inside it;
  - greedy and beam search on the GPU (fp32) give the CPU's translations;
  - a run killed on the GPU resumes to the metrics of the run that was not killed;
  - --compile computes the eager step and compiles a handful of graphs, not one per shape.
The CPU side of each claim is tested in the other files.
"""

import copy
import json

import pytest
import torch

import data
import decode
import train
from machinery import fileio, toy_corpus, train_cli
from model import ModelConfig, Transformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY = [
    "--d-model",
    "64",
    "--ff",
    "256",
    "--heads",
    "4",
    "--layers",
    "2",
    "--batch-tokens",
    "1024",
    "--log-interval",
    "10",
    "--bpe-size",
    "1000",
    "--device",
    "cuda",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    toy_corpus.make_toy_corpus(d, seed=1, n_train=3000, n_dev=40, n_test=40)
    return ["--data", str(d), "--src", "src", "--tgt", "tgt"]


def toy_batches(n=2, seed=0, V=60):
    """n batches of random sentence pairs of varied lengths (ids 4..V-1), on the CPU."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        pairs = [
            (
                torch.randint(
                    4, V, (int(torch.randint(2, 15, (1,), generator=g)),), generator=g
                ).tolist(),
                torch.randint(
                    4, V, (int(torch.randint(2, 15, (1,), generator=g)),), generator=g
                ).tolist(),
            )
            for _ in range(12)
        ]
        out.append((pairs, data.collate(pairs, range(len(pairs)))))
    return out


NORM_CASES = {
    "layer-postnorm": dict(norm="layer", prenorm=False, fixnorm=False),
    "scale-fixnorm": dict(norm="scale"),
    "rms": dict(norm="rms"),
    "batch": dict(norm="batch", prenorm=False),
    "pnv": dict(norm="pnv"),
    "power": dict(norm="power", norm_options={"warmup": 1}),  # past its warmup at the second step
    # the cumulative mean
    "power-code": dict(norm="power", norm_options={"warmup": 5, "variant": "code"}),
    "qknorm": dict(norm="layer", qknorm=True, qk_g0=5.0),
}


def rel(a, b):
    return (
        torch.linalg.vector_norm((a - b).double())
        / torch.linalg.vector_norm(b.double()).clamp_min(1e-30)
    ).item()


def two_steps(model, device, bf16):
    """Two train_steps (lr 0 then lr 1e-3: the first leaves the weights, fills Adam's and the norms'
    statistics) on the same batches; (losses, gnorms, gradients of the last step, buffers). Adam's
    update itself is not compared: where a gradient is rounding noise (a bias just before a batch
    norm), its sign, and so Adam's +-lr step, differs between any two devices."""
    fused = device == "cuda"
    opt = torch.optim.Adam(model.parameters(), lr=0.0, fused=True if fused else None)
    options = train.StepOptions(0.0, 0.1, 1.0, bf16=bf16)
    losses, gnorms = [], []
    for lr, (pairs, _) in zip((0.0, 1e-3), toy_batches(), strict=True):
        b = data.collate(pairs, range(len(pairs)), device)
        loss, _, gnorm, n = train.train_step(model, opt, [b], lr, options)
        losses.append(loss.item() / n)
        gnorms.append(gnorm.item())
    grads = {k: p.grad.detach().cpu() for k, p in model.named_parameters() if p.grad is not None}
    buffers = {k: v.detach().cpu() for k, v in model.named_buffers() if "running" in k}
    return losses, gnorms, grads, buffers


@pytest.mark.parametrize("case", list(NORM_CASES))
def test_a_training_step_on_cuda_computes_the_cpu_step(case):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=60,
        d_model=32,
        heads=4,
        ff=64,
        enc_layers=2,
        dec_layers=2,
        dropout=0.0,
        **NORM_CASES[case],
    )
    cpu_model = Transformer(cfg)
    gpu_model = copy.deepcopy(cpu_model).cuda()
    bf16_model = copy.deepcopy(cpu_model).cuda()
    ref = two_steps(cpu_model, "cpu", False)
    fp32 = two_steps(gpu_model, "cuda", False)
    bf16 = two_steps(bf16_model, "cuda", True)
    for got, tol in ((fp32, 1e-4), (bf16, 5e-2)):  # fp32: rounding alone; bf16: 8-bit mantissas
        assert got[0] == pytest.approx(ref[0], rel=tol) and got[1] == pytest.approx(ref[1], rel=tol)
        # Relative to the whole gradient: a bias just before a batch norm has a gradient of exactly
        # 0 (the mean removes it), so its own relative error is rounding over rounding.
        whole = torch.cat([g.flatten() for g in ref[2].values()])
        worst = max(rel(got[2][k], ref[2][k]) * ref[2][k].norm() / whole.norm() for k in ref[2])
        error = rel(torch.cat([got[2][k].flatten() for k in ref[2]]), whole)
        assert error < (1e-4 if tol == 1e-4 else 5e-2) and worst < tol, (
            f"{case}: gradients {error:.2e} {worst:.2e}"
        )
        for k in ref[3]:  # running statistics (BN, PN-V, PowerNorm's phi and nu)
            assert rel(got[3][k], ref[3][k]) < tol * 10, k


@pytest.mark.parametrize("case", ["scale-fixnorm", "batch", "power", "qknorm"])
def test_the_training_step_never_waits_for_the_gpu(case):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=60, d_model=32, heads=4, ff=64, enc_layers=2, dec_layers=2, **NORM_CASES[case]
    )
    model = Transformer(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4, fused=True)
    options = train.StepOptions(
        0.1, 0.1, 1.0, torch.Generator(device="cuda").manual_seed(0), bf16=True
    )
    (p1, _), (p2, _) = toy_batches()
    # warm-up: Adam's state
    train.train_step(model, opt, [data.collate(p1, range(12), "cuda")], 1e-3, options)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
    try:
        for pairs in (p1, p2):
            out = train.train_step(
                model, opt, [data.collate(pairs, range(12), "cuda")], 1e-3, options
            )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out[0]).item()


@pytest.fixture(scope="module")
def cuda_run(corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("cuda") / "run"
    train_cli.main(
        TINY
        + corpus
        + [
            "--max-steps",
            "300",
            "--epoch-size",
            "100",
            "--warmup",
            "100",
            "--lr",
            "3e-3",
            "--out",
            str(run),
        ]
    )
    return run


def test_decoding_on_cuda_gives_the_cpu_translations(cuda_run, corpus):
    lines = fileio.read_lines(f"{corpus[1]}/dev.src")
    refs = fileio.read_lines(f"{corpus[1]}/dev.tgt")
    outputs = {}
    for device in ("cpu", "cuda"):
        model, tok, _ = decode.load_checkpoint(str(cuda_run), torch.device(device))
        for beam in (1, 4):
            outputs[device, beam] = decode.translate(
                model, tok, lines, decode.Search(beam, bf16=False)
            )
        outputs[device, "bf16"] = decode.translate(model, tok, lines, decode.Search(4, bf16=True))
    for beam in (1, 4):
        same = sum(a == b for a, b in zip(outputs["cpu", beam], outputs["cuda", beam], strict=True))
        assert same == len(lines), f"beam {beam}: {len(lines) - same} of {len(lines)} lines differ"
    fp32, bf16 = (decode.bleu(outputs["cuda", k], refs).score for k in (4, "bf16"))
    assert fp32 > 10 and abs(bf16 - fp32) < 3, (fp32, bf16)


def _records(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (
        [(r["step"], r["loss"], r["gnorm"]) for r in rows if "gnorm" in r],
        [(r["step"], r["dev_bleu"]) for r in rows if "dev_bleu" in r],
    )


def test_a_run_killed_on_cuda_resumes_to_the_same_metrics(tmp_path, killed_run, corpus):
    argv = (
        TINY
        + corpus
        + [
            "--max-steps",
            "24",
            "--epoch-size",
            "8",
            "--warmup",
            "10",
            "--seed",
            "3",
            "--pn-warmup",
            "5",
            "--norm",
            "layer",
            "--encoder-norm",
            "power",
        ]
    )
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train_cli.main(argv + ["--out", str(whole)])
    killed_run(argv + ["--out", str(killed)], 20)  # killed in its third epoch
    train_cli.main(["--resume", str(killed)])
    (steps_a, bleu_a), (steps_b, bleu_b) = _records(whole), _records(killed)
    # The GPU's atomic adds (the embedding's backward) make two runs differ in the last bits.
    assert [s[0] for s in steps_a] == [s[0] for s in steps_b] == list(range(1, 25))
    for a, b in zip(steps_a, steps_b, strict=True):
        assert a[1] == pytest.approx(b[1], rel=1e-4) and a[2] == pytest.approx(b[2], rel=1e-3)
    assert [s for s, _ in bleu_a] == [s for s, _ in bleu_b] == [8, 16, 24]
    assert all(abs(a - b) < 1.0 for (_, a), (_, b) in zip(bleu_a, bleu_b, strict=True))


def test_compile_computes_the_eager_step_and_compiles_a_handful_of_graphs(corpus, tmp_path):
    argv = (
        TINY
        + corpus
        + ["--dtype", "fp32", "--dropout", "0", "--word-dropout", "0", "--benchmark", "20"]
    )
    eager = train_cli.main(argv + ["--out", str(tmp_path / "a")])
    compiled = train_cli.main(argv + ["--compile", "--out", str(tmp_path / "b")])
    # 23 steps (and the warm-up's) of varied batch shapes: compiled once for symbolic shapes.
    assert 1 <= compiled["compiled_graphs"] <= 4, compiled["compiled_graphs"]
    # the same first step
    assert compiled["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-4)
    # and still close at 23
    assert compiled["losses"][-1] == pytest.approx(eager["losses"][-1], rel=2e-2)
