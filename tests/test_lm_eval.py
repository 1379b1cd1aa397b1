"""A language model evaluated as PowerNorm's Table 2 was ([2] A.2: Transformer-XL's scheme, each
token with the text before it), and the baseline's unmasked model seen at evaluation: decode.py
--ppl --context N, --leak --leak-mode eval."""

import json
import random

import pytest
import torch

import data
import decode
from machinery import decode_cli, fileio, presets, train_cli

LM = [
    "--task",
    "lm",
    "--bpe-size",
    "0",
    "--d-model",
    "32",
    "--ff",
    "64",
    "--heads",
    "2",
    "--layers",
    "2",
    "--batch-tokens",
    "256",
    "--threads",
    "1",
    "--warmup",
    "20",
    "--lr",
    "3e-3",
    "--attention",
    "multilinear",
    "--norm",
    "layer",
]


@pytest.mark.parametrize("length, context", [(4, 0), (4, 1), (4, 3), (6, 2), (5, 4), (7, 3)])
def test_every_token_is_scored_once_with_at_least_context_tokens_before_it(length, context):
    stream = torch.arange(4, 4 + 23)
    w = data.lm_windows(stream, length, context)
    scored = w.y.ne(data.PAD)
    assert w.y[scored].tolist() == stream[1:].tolist()  # each target once, in order
    for row, col in scored.nonzero().tolist():
        p = int(w.y[row, col]) - 4  # the target's index in the stream
        assert int(w.x[row, col]) == int(w.y[row, col]) - 1  # its input: the token before it
        # and at least `context` tokens before that input, in its window
        assert col >= min(context, p - 1)
    if context == 0:  # the segments train.py scores, exactly
        segs = data.lm_segments(stream, length)
        assert torch.equal(w.x, segs.x) and torch.equal(w.y, segs.y)
    with pytest.raises(fileio.DataError, match=f"--context {length}: at most {length - 1}"):
        data.lm_windows(stream, length, length)


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A multi-linear model trained on lines 'k_i m m v_i': v_i is known from k_i three tokens back,
    and a segment of 6 that starts between them cannot see it."""
    d = tmp_path_factory.mktemp("kv")
    r = random.Random(0)
    for split, n in (("train", 2000), ("dev", 100), ("test", 200)):
        (d / f"{split}.txt").write_text(
            "".join(f"k{i} m m v{i}\n" for i in (r.randrange(10) for _ in range(n)))
        )
    run = tmp_path_factory.mktemp("runs") / "kv"
    train_cli.main(
        LM
        + [
            "--data",
            str(d),
            "--seq-len",
            "6",
            "--max-steps",
            "200",
            "--epoch-size",
            "50",
            "--out",
            str(run),
        ]
    )
    return d, run


def test_with_context_a_model_that_learned_the_text_scores_lower(learned, capsys):
    d, run = learned
    model, tok, _ = decode.load_checkpoint(run)
    lines = (d / "test.txt").read_text().splitlines()
    seg = decode.lm_perplexity(model, tok, lines, 6, bf16=False)
    ctx = decode.lm_perplexity(model, tok, lines, 6, bf16=False, context=5)
    assert ctx["n_tokens"] == seg["n_tokens"] == 1000  # every token scored once either way
    assert ctx["ppl"] < 0.97 * seg["ppl"], (ctx, seg)  # v_i sees its k_i in every window
    assert decode.lm_perplexity(model, tok, lines, 6, bf16=False, context=0) == seg
    capsys.readouterr()
    decode_cli.main([str(run), "--ppl", "--input", str(d / "test.txt"), "--context", "5"])
    out = capsys.readouterr().out
    assert out.startswith(
        f"perplexity {ctx['ppl']:.2f} over 1000 tokens (at least 5 tokens of context)"
    ), out
    with pytest.raises(SystemExit, match="--context 6: at most 5, less than the window"):
        decode_cli.main([str(run), "--ppl", "--input", str(d / "test.txt"), "--context", "6"])
    with pytest.raises(SystemExit):
        decode_cli.main([str(run), "--generate", "k1", "--context", "2"])
    assert "--context is for --ppl" in capsys.readouterr().err


def test_at_evaluation_a_causal_model_leaks_nothing_and_an_unmasked_one_does(
    learned, tmp_path, capsys
):
    d, causal = learned
    unmasked = tmp_path / "unmasked"
    train_cli.main(
        LM
        + [
            "--data",
            str(d),
            "--seq-len",
            "6",
            "--mask",
            "none",
            "--positions",
            "relative",
            "--max-steps",
            "4",
            "--epoch-size",
            "4",
            "--out",
            str(unmasked),
        ]
    )
    moved = {}
    for name, run in (("causal", causal), ("unmasked", unmasked)):
        capsys.readouterr()
        decode_cli.main([str(run), "--leak", "--leak-mode", "eval", "--input", str(d / "dev.txt")])
        out = capsys.readouterr().out
        assert out.startswith("future leak (the model as evaluated)"), out
        moved[name] = float(out.split(" by ")[1].split()[0])
    assert moved["causal"] == 0.0 and moved["unmasked"] > 1e-3, moved


def test_the_baselines_flags_need_the_multilinear_attention_and_its_presets_set_them():
    with pytest.raises(SystemExit, match="--mask is the multi-linear attention's"):
        train_cli.main(["--task", "lm", "--mask", "none"])
    for norm in ("layernorm", "powernorm"):
        pair, _, flags = presets.PRESETS[f"pn2-released-{norm}"]
        causal = presets.PRESETS[f"pn2-{norm}"][2]
        assert pair == "ptb" and flags == dict(causal, mask="none", positions="relative")


@pytest.mark.parametrize("n", ["0", "-3"])
def test_generate_with_no_tokens_to_make_is_refused(learned, n, capsys):
    """Issue 30: --max-tokens 0 (and -3) printed nothing and exited 0."""
    with pytest.raises(SystemExit):
        decode_cli.main([str(learned[1]), "--generate", "k1", "--max-tokens", n])
    assert f"argument --max-tokens: must be at least 1 (got {n})" in capsys.readouterr().err


@pytest.fixture(scope="module")
def unknown_words(tmp_path_factory):
    """A word model whose dev and test hold words its training text lacks: dev 'a x b' (1 of 4
    tokens with EOS unknown), test PTB's own '<unk>' and unseen words (3 of 4), its blank lines
    skipped."""
    d = tmp_path_factory.mktemp("unk")
    for split, text in (
        ("train", "a b c\n" * 40),
        ("dev", "a x b\n" * 10),
        ("test", "<unk> y z\n\n" * 5),
    ):
        (d / f"{split}.txt").write_text(text)
    run = tmp_path_factory.mktemp("runs") / "unk"
    train_cli.main(
        LM
        + [
            "--data",
            str(d),
            "--seq-len",
            "4",
            "--max-steps",
            "2",
            "--epoch-size",
            "2",
            "--out",
            str(run),
        ]
    )
    return d, run


def test_a_language_model_reports_its_unknown_tokens(unknown_words, capsys):
    """Issue 30: results.json, the log and --ppl gave a perplexity over a text whose every word may
    be <unk>; they give the count and share of unknown tokens (of the tokens perplexity is over),
    dev and test, as papers do."""
    d, run = unknown_words
    r = json.loads((run / "results.json").read_text())
    assert (r["dev_unk_tokens"], r["dev_unk_share"], r["test_unk_tokens"], r["test_unk_share"]) == (
        10,
        0.25,
        15,
        0.75,
    )
    assert r["test_tokens"] == 20  # the share is of these
    model, tok, _ = decode.load_checkpoint(run)
    # a b EOS q EOS: q unknown
    small = decode.lm_perplexity(model, tok, ["a b", "", "q"], 4, bf16=False)
    assert (small["unk_tokens"], small["unk_share"], small["n_tokens"]) == (1, 0.2, 5)
    lines = (d / "test.txt").read_text().splitlines()
    # each scored once
    assert decode.lm_perplexity(model, tok, lines, 4, bf16=False, context=2)["unk_tokens"] == 15
    capsys.readouterr()
    assert decode_cli.main([str(run), "--ppl", "--input", str(d / "test.txt")]) == 0
    assert capsys.readouterr().out.rstrip().endswith("unknown (<unk>) tokens: 15 (75.00%)")


def test_the_log_says_how_many_tokens_were_unknown(tmp_path, capsys):
    d = tmp_path / "text"
    d.mkdir()
    for split, text in (
        ("train", "a b c\n" * 40),
        ("dev", "a x b\n" * 10),
        ("test", "a b c\n" * 5),
    ):
        (d / f"{split}.txt").write_text(text)
    train_cli.main(
        LM
        + [
            "--data",
            str(d),
            "--seq-len",
            "4",
            "--max-steps",
            "2",
            "--epoch-size",
            "2",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert "unknown (<unk>) tokens: dev 10 (25.00%), test 0 (0.00%)" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--ppl", "--leak"])
@pytest.mark.parametrize("text", ["", "\n\n"])
def test_no_text_to_score_names_the_file(unknown_words, tmp_path, flag, text):
    """Issue 30: --leak --input empty.txt and --ppl on an empty file said 'no text to predict'
    without the file."""
    empty = tmp_path / "empty.txt"
    empty.write_text(text)
    with pytest.raises(SystemExit) as e:
        decode_cli.main([str(unknown_words[1]), flag, "--input", str(empty)])
    msg = str(e.value.code)
    assert (
        e.value.code != 0
        and "\n" not in msg
        and msg.startswith(f"decode.py: error: {empty}: no text")
    ), msg
    assert empty.read_text() == text
