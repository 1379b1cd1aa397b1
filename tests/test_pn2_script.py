"""The baseline's PTB script as flags (issue 40): --preset pn2-script runs the tensorized
Transformer's run_ptb.sh (szhangtju/The-compression-of-Transformer, BTD-Transformer) as closely as
our flags go. Each setting the script has and our other rows lack is a flag; each is checked here
against what the script's code does, written out in the test.
"""

import json
import signal

import pytest
import torch

import data
import train
from machinery import decode_cli, fileio, presets, rundir, toy_corpus, train_cli
from model import ModelConfig, MultiLinearAttention, Transformer

# The script: 3 layers, d 256, 1 head of d_head 40, FFN 2100, segments of 32; its vocabulary is
# PTB's 10,000 words.
SCRIPT = dict(
    d_model=256,
    heads=1,
    ff=2100,
    dec_layers=3,
    lm=True,
    norm="layer",
    prenorm=False,
    fixnorm=False,
    attention="multilinear",
    seq_len=32,
    mask="none",
    positions="relative",
    head_dim=40,
    attn_bias=False,
    init="normal",
    final_dropout=0.3,
    dropout=0.3,
    attn_dropout=0.0,
)


def baseline_batches(stream, rows, bptt):
    """The baseline's LMOrderedIterator (its data_utils.py), written out: the text cut into `rows`
    columns of n_step = len // rows tokens, the rest dropped; batch i holds positions [i, i + bptt)
    of every column as inputs and [i + 1, i + bptt + 1) as targets, for i in range(0, n_step - bptt,
    bptt)."""
    n_step = stream.numel() // rows
    cols = stream[: n_step * rows].view(rows, n_step)
    return [
        (cols[:, i : i + bptt], cols[:, i + 1 : i + 1 + bptt])
        for i in range(0, n_step - bptt, bptt)
    ]


@pytest.mark.parametrize("tokens, rows, bptt", [(1000, 4, 8), (929589 // 40, 3, 32), (97, 5, 3)])
def test_lm_streams_batches_the_text_as_the_baseline_code_and_keeps_the_order_every_pass(
    tokens, rows, bptt
):
    text = torch.arange(4, 4 + tokens)  # the baseline's corpus: words and EOS, no EOS in front
    stream = torch.cat([torch.tensor([data.EOS]), text])  # ours: data.lm_stream puts one EOS first
    segs = data.lm_streams(stream, bptt, rows)
    expected = baseline_batches(text, rows, bptt)
    for epoch in (0, 1, 7):  # the same order every pass, whatever the seed and the pass
        batches = data.make_batches(segs, rows * bptt, True, seed=3, epoch=epoch)
        assert len(batches) == len(expected)
        for idx, (x, y) in zip(batches, expected, strict=True):
            b = data.collate(segs, idx)
            assert torch.equal(b.tgt_in, x) and torch.equal(b.tgt_out, y) and b.n_tgt == x.numel()
    shuffled = data.make_batches(data.lm_segments(stream, bptt), rows * bptt, True, seed=3, epoch=0)
    assert shuffled != sorted(shuffled)  # the default, --lm-batches shuffled, still shuffles


def test_a_text_too_short_for_one_window_a_row_is_one_line():
    with pytest.raises(
        fileio.DataError, match="rows of 4 tokens, too short for one window of --seq-len 8"
    ):
        data.lm_streams(torch.arange(13), 8, 3)


def test_the_scripts_model_has_the_baselines_parameters():
    """The baseline's log at these settings: '#params = 6715252' and '#non emb params = 4145172'
    (its layers only; its r_w_bias and r_r_bias, 2 x 40, sit outside them). --head-dim 40 and
    --no-attn-bias give the same count."""
    m = Transformer(ModelConfig(vocab_size=10000, **SCRIPT))
    assert sum(p.numel() for p in m.parameters()) == 6715252
    layers = sum(p.numel() for n, p in m.named_parameters() if n.startswith("decoder"))
    assert layers == 4145172 + 2 * 40
    att = m.decoder[0].self_attn
    assert (att.qkv.weight.shape, att.qkv.bias, att.out.bias, att.core.shape) == (
        (120, 256),
        None,
        None,
        (40,),
    )
    assert att.r_net.weight.shape == (40, 256) and att.r_w_bias.shape == (1, 1, 40)
    default = MultiLinearAttention(
        ModelConfig(vocab_size=10, d_model=8, heads=2, seq_len=4, attention="multilinear")
    )
    assert default.core.shape == (4,) and default.qkv.bias.shape == (24,)  # R = D / H, with biases


def test_init_normal_is_the_baseline_codes():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=10000, **SCRIPT))
    params = {n: p.detach() for n, p in m.named_parameters()}
    # E and every Linear's weight
    weights = torch.cat([p.flatten() for p in params.values() if p.dim() == 2])
    assert abs(weights.mean()) < 1e-4 and weights.std() == pytest.approx(0.02, rel=0.01)
    gains = torch.cat([p for n, p in params.items() if "norm" in n and n.endswith("weight")])
    assert gains.mean() == pytest.approx(1.0, abs=0.005) and gains.std() == pytest.approx(
        0.02, rel=0.1
    )
    biases = [p for n, p in params.items() if n.endswith("bias") and "r_" not in n.split(".")[-1]]
    assert biases and all(not p.any() for p in biases)  # FFN, norm and output biases start at 0
    # softmax of zeroed memory
    assert torch.equal(params["decoder.0.self_attn.core"], torch.full((40,), 1 / 40))
    # N(0, 0.02), 40 numbers
    assert params["decoder.0.self_attn.r_w_bias"].std() == pytest.approx(0.02, rel=0.3)


def test_final_dropout_drops_the_decoders_output_in_training_only():
    cfg = dict(SCRIPT, d_model=32, ff=64, head_dim=8, seq_len=8, dropout=0.0, final_dropout=0.5)
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=30, **cfg))
    x = torch.randint(4, 30, (4, 8))
    E = m.embedding_matrix()
    h = m.hidden(None, x, E)
    zeros = h.eq(0).float().mean()
    assert 0.4 < zeros < 0.6  # about half of the outputs dropped: the only dropout in this model
    m.eval()
    plain = Transformer(ModelConfig(vocab_size=30, **dict(cfg, final_dropout=0.0)))
    plain.load_state_dict(m.state_dict())
    plain.eval()
    assert torch.equal(m.hidden(None, x, E), plain.hidden(None, x, E))  # at evaluation, no dropout


def test_the_preset_is_the_scripts_settings():
    args, given = presets.resolve_flags(["--preset", "pn2-script"])
    train_cli.check_flags(args, given)
    script = dict(
        layers=3,
        d_model=256,
        heads=1,
        head_dim=40,
        ff=2100,
        dropout=0.3,
        attn_dropout=0.0,
        seq_len=32,
        batch_tokens=120 * 32,
        lr=2.5e-4,
        clip=0.25,
        schedule="cosine",
        max_steps=20000,
        attn_bias=False,
        init="normal",
        final_dropout=0.3,
        lm_batches="streams",
        label_smoothing=0.0,
        mask="none",
        positions="relative",
        prenorm=False,
        fixnorm=False,
        norm="layer",
        epoch_size=242,
        beta1=0.9,
        beta2=0.999,
        adam_eps=1e-8,
        weight_decay=0.0,
        word_dropout=0.0,
    )
    assert {k: getattr(args, k) for k in script} == script
    # the cosine reaches 0 at the script's max_step
    assert rundir.budget(args) == (20000, "max_steps")
    s = train.Schedule.from_args(args)
    # The script's CosineAnnealingLR(T_max = 20000), stepped after each update: update n uses
    # 2.5e-4 (1 + cos(pi (n - 1) / 20000)) / 2. Ours, with a warmup of 1 step, divides by 19999:
    # within 1e-4 of the peak.
    for n in (1, 2, 5000, 10000, 19999):
        script_lr = (
            2.5e-4
            * (1 + torch.cos(torch.tensor(torch.pi * (n - 1) / 20000, dtype=torch.float64)))
            / 2
        )
        assert s(n) == pytest.approx(float(script_lr), rel=0, abs=1e-4 * 2.5e-4)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--head-dim", "8"], "--head-dim"),
        (["--task", "lm", "--no-attn-bias"], "--attn-bias"),
        (["--lm-batches", "streams"], "--lm-batches"),
    ],
)
def test_the_new_flags_are_refused_where_they_would_do_nothing(argv, flag, tmp_path):
    with pytest.raises(SystemExit) as e:
        train_cli.main(argv + ["--out", str(tmp_path / "r")])
    assert flag in str(e.value.code) and "\n" not in str(e.value.code)
    assert not (tmp_path / "r").exists()


def test_a_streams_run_learns_and_one_stopped_mid_pass_resumes_exactly(
    tmp_path, killed_run, capsys
):
    """A small run with every setting of the script: it learns, one stopped mid-pass (SIGTERM at
    step 11 of batches that come 10 to a pass) resumes to the same records, the batches of the same
    order every pass, and decode.py rebuilds the model (R 8, no attention biases) to score the test
    text as train.py did."""
    toy = toy_corpus.make_toy_corpus(tmp_path / "toy", seed=2, n_train=130, n_dev=30, n_test=30)
    text = tmp_path / "text"
    text.mkdir()
    for split in fileio.SPLITS:
        (text / f"{split}.txt").write_text((toy / f"{split}.tgt").read_text())
    argv = [
        "--preset",
        "pn2-script",
        "--data",
        str(text),
        "--d-model",
        "32",
        "--ff",
        "64",
        "--head-dim",
        "8",
        "--seq-len",
        "8",
        "--batch-tokens",
        "128",
        "--max-steps",
        "24",
        "--epoch-size",
        "8",
        "--lr",
        "3e-3",
        "--save-interval",
        "4",
        "--threads",
        "1",
        "--log-interval",
        "4",
    ]
    train_cli.main(argv + ["--out", str(tmp_path / "whole")])
    killed_run(argv + ["--out", str(tmp_path / "killed")], 11, signal.SIGTERM)
    train_cli.main(["--resume", str(tmp_path / "killed")])

    def rows(d):
        return [
            {k: v for k, v in r.items() if k not in ("tok_per_s", "mfu")}
            for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())
            if "final" not in r
        ]

    assert rows("killed") == rows("whole")
    dev = [r["dev_ppl"] for r in rows("whole") if "dev_ppl" in r]
    assert len(dev) == 3 and dev[-1] < dev[0]
    capsys.readouterr()
    decode_cli.main([str(tmp_path / "whole"), "--ppl", "--input", str(text / "test.txt")])
    result = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert float(capsys.readouterr().out.split()[1]) == pytest.approx(result["test_ppl"], abs=0.006)
