"""Language models ([2] PowerNorm, Table 2): the decoder without cross-attention (--task lm).

Claims: a language model never sees a later token at evaluation, for every norm, both residual
placements and both attentions; in training, the batch statistics of BN and PN-V (and of PN in
its warmup) do let a later token in, and the per-token norms do not; the multi-linear attention
computes its equation; the stream and its segments predict every token once; the reported test
perplexity is decode.py's; a killed language model resumes exactly; bad input is one line.
"""

import hashlib
import json
import signal
from functools import partial

import pytest
import torch

import data
import decode
import norms
import train
from machinery import (
    corpora,
    decode_cli,
    fileio,
    plots,
    presets,
    rundir,
    speed,
    toy_corpus,
    train_cli,
)
from model import EOS, PAD, UNK, ModelConfig, MultiLinearAttention, Transformer

PN_OPTIONS = {"warmup": 2, "variant": "paper", "alpha_fwd": 0.9, "alpha_bkw": 0.9}


def lm(norm="layer", prenorm=True, attention="softmax", **kw):
    cfg = ModelConfig(
        vocab_size=40,
        d_model=16,
        heads=2,
        ff=32,
        dec_layers=2,
        dropout=0.0,
        lm=True,
        norm=norm,
        prenorm=prenorm,
        attention=attention,
        seq_len=8,
        norm_options=dict(PN_OPTIONS),
        **kw,
    )
    torch.manual_seed(0)
    return Transformer(cfg)


# --- causality ------------------------------------------------------------------------------
@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
@pytest.mark.parametrize("attention", ["softmax", "multilinear"])
@pytest.mark.parametrize("prenorm", [True, False], ids=["prenorm", "postnorm"])
@pytest.mark.parametrize("norm", sorted(norms.NORMS))
def test_a_language_model_is_causal_at_evaluation_for_every_norm(
    norm, prenorm, attention, reference
):
    m = lm(norm, prenorm, attention)
    m.train()
    for _ in range(3):  # running statistics away from their start (PN past its warmup of 2)
        m.logits(None, torch.randint(4, 40, (6, 8)))
    m.eval()
    x = torch.randint(4, 40, (3, 8))
    norms.use_reference(reference)  # the written-out attention and norms, or the fast paths
    try:
        _check_causal(m, x)
    finally:
        norms.use_reference(False)


@torch.no_grad()
def _check_causal(m, x):
    base = m.logits(None, x)
    for t in range(7):
        y = x.clone()
        y[:, t + 1 :] = (x[:, t + 1 :] + 7) % 36 + 4  # every later token different
        out = m.logits(None, y)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=1e-5, atol=1e-5)
        # the later positions do see them
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])


@pytest.mark.parametrize(
    "norm, leaks",
    [
        ("batch", True),
        ("pnv", True),
        ("power", True),
        ("layer", False),
        ("scale", False),
        ("rms", False),
    ],
)
def test_in_training_batch_statistics_let_later_tokens_in_and_per_token_norms_do_not(norm, leaks):
    """[2]'s BN and PN-V average over every position of the batch, the future included; PN only
    inside its warmup (a fresh model is in it)."""
    m = lm(norm)
    segs = data.Segments(torch.randint(4, 40, (6, 8)), torch.randint(4, 40, (6, 8)))
    r = decode.future_leak(m, segs, t=3)
    assert (r["mean_abs_change"] > 1e-4) == leaks, r


def test_powernorm_past_its_warmup_leaks_nothing_in_training():
    m = lm("power")
    m.train()
    for _ in range(3):  # past the warmup of 2 forwards: the running statistic divides
        m.logits(None, torch.randint(4, 40, (6, 8)))
    segs = data.Segments(torch.randint(4, 40, (6, 8)), torch.randint(4, 40, (6, 8)))
    assert decode.future_leak(m, segs, t=3)["mean_abs_change"] < 1e-6


# --- the multi-linear attention (model.py Appendix B) ---------------------------------------------
def test_multilinear_attention_computes_its_equation():
    """T[i, j, k] = sum_r c_r Q[i, r] K[j, r] V[k, r], zero unless j, k <= i; out_i = W^O vec T[i] +
    b, written out with loops in float64; a shorter segment is the start of a full one."""
    cfg = ModelConfig(
        vocab_size=10, d_model=6, heads=2, seq_len=4, attention="multilinear", lm=True
    )
    torch.manual_seed(0)
    att = MultiLinearAttention(cfg).double()
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    qkv = x @ att.qkv.weight.T + att.qkv.bias
    R, L = 3, 4
    out = torch.zeros(2, 4, 6, dtype=torch.float64)
    for b in range(2):
        for i in range(L):
            flat = []
            for h in range(2):
                q, k, v = (
                    qkv[b, :, part * 6 + h * R : part * 6 + (h + 1) * R] for part in range(3)
                )
                T = torch.zeros(L, L, dtype=torch.float64)
                for j in range(i + 1):
                    for kk in range(i + 1):
                        T[j, kk] = sum(att.core[r] * q[i, r] * k[j, r] * v[kk, r] for r in range(R))
                flat.append(T.flatten())
            out[b, i] = att.out.weight @ torch.cat(flat) + att.out.bias
    torch.testing.assert_close(att(x), out)
    torch.testing.assert_close(att(x[:, :3]), out[:, :3])
    with pytest.raises(ValueError, match="--seq-len 4"):
        att(torch.randn(1, 5, 6, dtype=torch.float64))


# --- the text: a stream, cut into segments --------------------------------------------------------
def test_every_token_of_the_text_is_predicted_once_from_the_ones_before_it():
    vocab = data.WordVocab.build(["a b c", "b <unk> d", "a"])
    # PTB's <unk> is UNK, and so is a new word
    assert vocab.encode("a <unk> zz") == [vocab.index["a"], UNK, UNK]
    stream = data.lm_stream(vocab, ["a b c", "b d", "a"])
    assert stream.tolist() == [EOS] + vocab.encode("a b c") + [EOS] + vocab.encode("b d") + [
        EOS,
        vocab.index["a"],
        EOS,
    ]
    segs = data.lm_segments(stream, 4)
    real = segs.y.ne(PAD)
    assert (
        segs.y[real].tolist() == stream[1:].tolist()
        and segs.x[real].tolist() == stream[:-1].tolist()
    )
    # 9 targets: 7 words + 3 EOS - 1 + 1
    assert segs.x.shape == (3, 4) and int(real.sum()) == stream.numel() - 1
    batches = data.make_batches(segs, 8, True, seed=1)
    assert sorted(i for b in batches for i in b) == [0, 1, 2] and all(len(b) <= 2 for b in batches)
    # One segment a batch: in training the one-token last segment never makes a batch alone
    # (BatchNorm needs two)
    assert data.make_batches(segs, 4, False) == [[2], [0], [1]]
    assert all(
        len(b) == 1 + (2 in b)
        for seed in range(4)
        for b in data.make_batches(segs, 4, True, seed=seed)
    )
    assert data.collate(segs, [2]).n_tgt == 1


# --- a whole run ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """DIR/{train,dev,test}.txt: the target side of a small built-in corpus."""
    toy = toy_corpus.make_toy_corpus(
        tmp_path_factory.mktemp("toy"), seed=2, n_train=1500, n_dev=40, n_test=40
    )
    d = tmp_path_factory.mktemp("text")
    for split in fileio.SPLITS:
        (d / f"{split}.txt").write_text((toy / f"{split}.tgt").read_text())
    return d


LM = [
    "--task",
    "lm",
    "--d-model",
    "32",
    "--ff",
    "64",
    "--heads",
    "2",
    "--layers",
    "2",
    "--batch-tokens",
    "512",
    "--threads",
    "1",
    "--log-interval",
    "5",
    "--warmup",
    "20",
    "--lr",
    "3e-3",
]


def test_a_multilinear_word_model_learns_and_its_test_perplexity_is_decodes(text, tmp_path, capsys):
    run = tmp_path / "run"
    train_cli.main(
        LM
        + [
            "--data",
            str(text),
            "--bpe-size",
            "0",
            "--seq-len",
            "8",
            "--attention",
            "multilinear",
            "--norm",
            "power",
            "--max-steps",
            "40",
            "--epoch-size",
            "20",
            "--out",
            str(run),
        ]
    )
    result = json.loads((run / "results.json").read_text())
    dev = [
        r["dev_ppl"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "dev_ppl" in r
    ]
    vocab = data.WordVocab((run / "bpe.model").read_bytes()).vocab_size
    # it learned: far below a uniform guess
    assert dev[-1] < dev[0] < vocab and result["test_ppl"] < vocab / 4
    capsys.readouterr()
    decode_cli.main([str(run), "--ppl", "--input", str(text / "test.txt")])
    printed = float(capsys.readouterr().out.split()[1])
    assert printed == pytest.approx(result["test_ppl"], abs=0.006)  # printed with 2 decimals
    lines = [line for line in (text / "test.txt").read_text().splitlines() if line]
    words = sum(len(line.split()) + 1 for line in lines)
    assert result["test_tokens"] == words and "test_word_ppl" not in result
    assert (
        len(result["embedding_singular_values"]) == 32
        and result["embedding_singular_values"][0] == 1.0
    )
    assert plots.plot_series([run])["dev perplexity"][0][2] == dev  # --plot's curve


def test_a_bpe_language_model_reports_perplexity_per_word_too(text, tmp_path, capsys):
    run = tmp_path / "run"
    train_cli.main(
        LM
        + [
            "--data",
            str(text),
            "--bpe-size",
            "300",
            "--max-steps",
            "10",
            "--epoch-size",
            "10",
            "--out",
            str(run),
        ]
    )
    r = json.loads((run / "results.json").read_text())
    assert r["test_tokens"] > r["test_words"]  # more pieces than words
    # The same NLL over fewer units: exp(NLL / words) = ppl^(tokens / words).
    assert r["test_word_ppl"] == pytest.approx(
        r["test_ppl"] ** (r["test_tokens"] / r["test_words"]), rel=1e-9
    )
    decode_cli.main([str(run), "--generate", "a", "--max-tokens", "5"])
    assert capsys.readouterr().out.strip()
    # an empty prefix takes it too
    assert decode_cli.main([str(run), "--generate", "", "--max-tokens", "3"]) == 0
    capsys.readouterr()
    # --leak on whole segments only: the text's padded last segment would score log p(PAD) = -inf
    _, tok, _ = decode.load_checkpoint(run)
    lines = [line for line in (text / "test.txt").read_text().splitlines() if line]
    # the text ends in a padded segment
    assert data.lm_segments(data.lm_stream(tok, lines), 32).y.eq(PAD).any()
    assert decode_cli.main([str(run), "--leak", "--input", str(text / "test.txt")]) == 0
    out = capsys.readouterr().out
    assert "future leak" in out and "nan" not in out and "inf" not in out, out
    (tmp_path / "short.txt").write_text("a b\n")
    for extra, words in (
        (["--input", str(tmp_path / "short.txt")], "shorter than one segment"),
        (["--input", str(text / "test.txt"), "--seq-len", "1"], "--seq-len 1"),
    ):
        assert words in _one_line_error(partial(decode_cli.main, [str(run), "--leak", *extra]))


def test_a_stopped_language_model_resumes_to_the_same_metrics(text, tmp_path, killed_run):
    """Ctrl-C mid-epoch and mid-log-window: the run stops after that step, with a checkpoint of it,
    and resumes."""
    argv = LM + [
        "--data",
        str(text),
        "--norm",
        "pnv",
        "--max-steps",
        "24",
        "--epoch-size",
        "8",
        "--seed",
        "4",
    ]
    train_cli.main(argv + ["--out", str(tmp_path / "whole")])
    killed_run(argv + ["--out", str(tmp_path / "killed")], 19, signal.SIGINT)
    assert (
        rundir.read_checkpoint(tmp_path / "killed" / "checkpoint_last.pt")["train_state"]["step"]
        == 19
    )
    train_cli.main(["--resume", str(tmp_path / "killed")])
    # Every step's, log window's and epoch's record, but their timings and the final record
    # (train_seconds).
    timings = ("tok_per_s", "mfu")

    def rows(d):
        return [
            {k: v for k, v in r.items() if k not in timings}
            for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())
            if "final" not in r
        ]

    assert rows("killed") == rows("whole")
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("whole", "killed"))
    assert a["test_ppl"] == b["test_ppl"] and a["best_dev_ppl"] == b["best_dev_ppl"]


def test_a_batchnorm_language_model_whose_text_ends_in_a_one_token_segment_trains_and_resumes(
    tmp_path,
):
    """Issue 30: --norm batch --seq-len 8 --batch-tokens 8 on a text of 8k + 1 targets made a batch
    of the last segment alone, one real token: a traceback when it came, and again at each
    --resume."""
    d = tmp_path / "text"
    d.mkdir()
    # 4 x 4 + 9 = 25 targets: 3 x 8 + 1
    (d / "train.txt").write_text("a b c\n" * 4 + "d e f g h i j k\n")
    for split in ("dev", "test"):
        (d / f"{split}.txt").write_text("a b c d e f g h\n")
    segs = data.lm_segments(
        data.lm_stream(data.WordVocab.build(["a"]), ["a b c"] * 4 + ["d e f g h i j k"]), 8
    )
    assert segs.x.ne(PAD).sum(1).tolist() == [8, 8, 8, 1]
    for epoch in range(20):  # in training, never a batch of fewer than 2 real tokens
        assert all(
            segs.x[b].ne(PAD).sum() >= 2
            for b in data.make_batches(segs, 8, True, seed=0, epoch=epoch)
        )
    argv = [
        "--task",
        "lm",
        "--data",
        str(d),
        "--bpe-size",
        "0",
        "--norm",
        "batch",
        "--seq-len",
        "8",
        "--batch-tokens",
        "8",
        "--d-model",
        "16",
        "--ff",
        "32",
        "--heads",
        "2",
        "--layers",
        "1",
        "--threads",
        "1",
        "--epoch-size",
        "6",
    ]
    # 4 passes over the text
    train_cli.main(argv + ["--max-steps", "12", "--out", str(tmp_path / "run")])
    train_cli.main(["--resume", str(tmp_path / "run"), "--max-steps", "18"])
    assert json.loads((tmp_path / "run" / "results.json").read_text())["steps"] == 18


def _one_line_error(fn):
    with pytest.raises(SystemExit) as e:
        fn()
    msg = str(e.value.code)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_bad_language_model_input_is_one_line(text, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for split in fileio.SPLITS:
        (empty / f"{split}.txt").write_text("a b\n" if split != "dev" else "\n\n")
    msg = _one_line_error(
        lambda: train_cli.main(LM + ["--data", str(empty), "--out", str(tmp_path / "r1")])
    )
    assert "dev.txt" in msg and "no text" in msg
    (empty / "dev.txt").write_text("a b\n")
    msg = _one_line_error(
        lambda: train_cli.main(LM + ["--data", str(empty), "--out", str(tmp_path / "r2")])
    )
    assert "dev.txt" in msg and "shorter than one segment of --seq-len 32" in msg
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()  # nothing written
    for argv, flag in (
        (["--seq-len", "8"], "--seq-len"),
        (["--attention", "multilinear"], "--attention"),
        (["--task", "lm", "--src", "en", "--tgt", "de"], "--src"),
        (["--task", "lm", "--beam", "2"], "--beam"),
        (["--task", "lm", "--attention", "multilinear", "--qknorm"], "--qknorm"),
        (["--bpe-size", "0"], "--bpe-size"),
    ):
        assert flag in _one_line_error(
            partial(train_cli.main, argv + ["--out", str(tmp_path / "r3")])
        )


def test_qknorm_on_segments_of_one_token_is_one_line(tmp_path):
    """Issue 30: a language model's QKNorm L is --seq-len, and g0 = log2(L^2 - L) needs L >= 2 (a
    traceback)."""
    argv = ["--task", "lm", "--qknorm", "--seq-len", "1"]
    msg = _one_line_error(lambda: train_cli.main(argv + ["--out", str(tmp_path / "r")]))
    assert "--seq-len" in msg and "L >= 2" in msg and not (tmp_path / "r").exists()
    train_cli.check_flags(*presets.resolve_flags(argv + ["--qk-length", "8"]))  # L given: fine


def test_decoding_a_multilinear_model_with_a_longer_segment_is_one_line(text, tmp_path, capsys):
    run = tmp_path / "run"
    train_cli.main(
        LM
        + [
            "--data",
            str(text),
            "--seq-len",
            "8",
            "--attention",
            "multilinear",
            "--max-steps",
            "4",
            "--epoch-size",
            "4",
            "--out",
            str(run),
        ]
    )
    msg = _one_line_error(
        lambda: decode_cli.main(
            [str(run), "--ppl", "--input", str(text / "test.txt"), "--seq-len", "16"]
        )
    )
    assert "--seq-len 16" in msg and "8" in msg
    # shorter: fine
    decode_cli.main([str(run), "--ppl", "--input", str(text / "test.txt"), "--seq-len", "4"])
    assert "segments of 4" in capsys.readouterr().out
    msg = _one_line_error(lambda: decode_cli.main([str(run), "--input", str(text / "test.txt")]))
    assert "a language model" in msg


# --- the data and the presets -------------------------------------------------------------------
def test_prepare_ptb_checks_each_files_md5_offline(tmp_path, monkeypatch, capsys):
    src = tmp_path / "copy"
    src.mkdir()
    files = {"train": "ptb.train.txt", "dev": "ptb.valid.txt", "test": "ptb.test.txt"}
    for split, name in files.items():
        (src / name).write_text(f" {split} one <unk> N \n {split} two \n")
    md5 = {s: hashlib.md5((src / n).read_bytes()).hexdigest() for s, n in files.items()}
    monkeypatch.setitem(corpora.CORPORA["ptb"], "md5", md5)
    out = corpora.prepare("ptb", tmp_path / "ptb", str(src))
    assert (out / "dev.txt").read_text() == "dev one <unk> N\ndev two\n"
    assert "python train.py --data" in capsys.readouterr().out
    monkeypatch.setitem(corpora.CORPORA["ptb"], "md5", dict(md5, test="0" * 32))
    # a folder of the user's own text: a damaged test file found last changes none of it
    mine = tmp_path / "mine"
    mine.mkdir()
    for split in files:
        (mine / f"{split}.txt").write_text(f"the user's {split}\n")
    with pytest.raises(fileio.DataError, match="ptb.test.txt: md5"):
        corpora.prepare("ptb", mine, str(src))
    assert [(mine / f"{s}.txt").read_text() for s in files] == [f"the user's {s}\n" for s in files]


def test_the_table_2_presets_are_the_papers_language_models():
    for name, norm in (
        ("pn2-layernorm", "layer"),
        ("pn2-batchnorm", "batch"),
        ("pn2-pnv", "pnv"),
        ("pn2-powernorm", "power"),
    ):
        args, _ = presets.resolve_flags(["--preset", name])
        assert (args.task, args.norm, args.attention, args.seq_len, args.layers, args.d_model) == (
            "lm",
            norm,
            "multilinear",
            32,
            3,
            256,
        )
        assert (args.dropout, args.max_epochs, args.warmup, args.label_smoothing, args.prenorm) == (
            0.3,
            30,
            4000,
            0.1,
            False,
        )
        assert (args.schedule, args.lr, args.clip, args.batch_tokens, args.heads, args.ff) == (
            "cosine",
            2.5e-4,
            0.25,
            3840,
            1,
            2100,
        )


def test_batch_flops_of_a_language_model_and_the_multilinear_attention():
    D, FF, V, B, T = 8, 32, 100, 2, 4
    # a language model's: no source
    batch = data.Batch(None, torch.zeros(B, T), torch.zeros(B, T), B * T)
    cfg = ModelConfig(vocab_size=V, d_model=D, heads=2, ff=FF, dec_layers=1, lm=True)
    assert speed.batch_flops(cfg, batch) == 6 * B * (
        T * (4 * D * D + 2 * D * FF) + 2 * T * T * D + T * D * V
    )
    cfg = ModelConfig(
        vocab_size=V,
        d_model=D,
        heads=2,
        ff=FF,
        dec_layers=1,
        lm=True,
        attention="multilinear",
        seq_len=5,
    )
    assert speed.batch_flops(cfg, batch) == 6 * B * (
        T * (3 * D * D + T * T * D + 2 * 25 * D + 2 * D * FF) + T * D * V
    )


def test_review_fixes_special_words_idle_flags_and_the_cosine_schedule(text, tmp_path, capsys):
    vocab = data.WordVocab.build(["a <s> b </s> <pad>"])
    # words, never special ids
    assert vocab.encode("a <s> </s> <pad> <unk>") == [vocab.index["a"], UNK, UNK, UNK, UNK]
    for argv, flag in (
        (["--task", "lm", "--qknorm", "--qk-percentile", "50"], "--qk-percentile"),
        (["--task", "lm", "--attention", "multilinear", "--no-sdpa"], "--sdpa"),
        (["--task", "lm", "--attention", "multilinear", "--attn-dropout", "0.2"], "--attn-dropout"),
        (["--preset", "pn1-layernorm", "--pair", "ptb"], "--pair ptb"),
        (["--preset", "pn2-layernorm", "--pair", "de-en"], "--pair de-en"),
    ):
        assert flag in _one_line_error(
            partial(train_cli.main, argv + ["--out", str(tmp_path / "r")])
        )
    run = tmp_path / "run"
    train_cli.main(
        LM + ["--data", str(text), "--max-steps", "4", "--epoch-size", "4", "--out", str(run)]
    )
    assert "--beam" in _one_line_error(
        lambda: train_cli.main(["--resume", str(run), "--max-steps", "8", "--beam", "7"])
    )
    assert "--task mt" in _one_line_error(lambda: train_cli.main(["--pair", "ptb", "--task", "mt"]))
    # A resume that repeats the run's own language-model flag is checked against the run, not the
    # defaults
    train_cli.main(["--resume", str(run), "--max-steps", "8", "--seq-len", "32"])
    for argv, words in (
        ([str(run), "--attention", "a b"], "--attention"),
        ([str(run), "--ppl", "--input", str(text / "test.txt"), "--beam", "7"], "--beam"),
        ([str(run), "--generate", "a", "--output", str(tmp_path / "o.txt")], "--output"),
    ):
        assert words in _one_line_error(partial(decode_cli.main, argv))
    with pytest.raises(SystemExit):
        decode_cli.main([str(run), "--svd", "--ppl", "--input", str(text / "test.txt")])
    assert "--input does nothing with --svd" in capsys.readouterr().err
    assert "--input" in _one_line_error(
        lambda: decode_cli.main([str(run), "--generate", "a", "--input", str(text / "test.txt")])
    )
    # cosine: eq. 7's linear warmup to the peak, then (1 + cos(pi progress)) / 2 down to 0 at the
    # last step
    s = train.Schedule("cosine", 256, 100, 1e-3, total=1100)
    assert (
        s(50) == pytest.approx(0.5e-3)
        and s(100) == pytest.approx(1e-3)
        and s(600) == pytest.approx(0.5e-3)
    )
    assert s(1100) == pytest.approx(0.0, abs=1e-15) and not s.decays
    args, _ = presets.resolve_flags(["--preset", "pn2-powernorm", "--max-epochs", "2"])
    assert train.Schedule.from_args(args).total == 2 * 243
