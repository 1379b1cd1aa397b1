"""Tests for decode.py's evaluation tools: the papers' measurements, checked against
independent computations.

The claims, in the order of decode.py:
  - tokenized BLEU (13a-tokenize, then tokenize="none": multi-bleu.perl on tokenized
    text) equals SacreBLEU's 13a BLEU on raw text, equals tokenize="none" on text that is
    already tokenized, and is 100 for perfect output;
  - the scores of --json and results.json are what SacreBLEU's own CLI writes for the same
    files (scores and signatures), and the printed line puts SacreBLEU's BLEU first;
  - paired bootstrap and approximate randomization (SacreBLEU's implementation) on BLEU and
    chrF: a system against itself is not significant, the references against a corrupted
    baseline are, with 95% intervals; every number equals `sacrebleu --paired-bs/--paired-ar`;
  - checkpoint averaging averages the floating-point tensors and copies int/bool buffers;
    load_checkpoint(run_dir, average=N) uses the N last epochs, and too few is an error;
  - perplexity with eps = 0 is exp of the mean cross entropy computed here from
    model.logits(src, tgt_in); with eps > 0 the smoothed loss obeys its lower bound;
  - attention maps are distributions over the keys, shaped by the tokens, and the
    module's keep_weights is restored; the text heatmap carries the labels; the PNG
    is optional (no matplotlib: False, no exception);
  - the g table lists each scalar g of a ScaleNorm + QKNorm model with its value.
Tiny random models, as in tests/test_decode.py: no training.
"""

import builtins
import io
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import WORDS, tiny_model

import decode
from machinery import decode_cli, plots, rundir
from machinery.fileio import DataError as DecodeError  # decode.py raises fileio's DataError.
from model import BOS, EOS, MultiHeadAttention


@pytest.fixture(scope="module")
def toy():
    """A sentencepiece model and 40 sentence pairs."""
    from data import Tokenizer, train_bpe

    g = torch.Generator().manual_seed(0)
    lines = [
        " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(n),), generator=g))
        for n in torch.randint(2, 9, (80,), generator=g)
    ]
    proto = train_bpe(lines[:40], lines[40:], 60)
    return Tokenizer(proto), list(zip(lines[:40], lines[40:], strict=True)), proto


def without_matplotlib(monkeypatch):
    """As if matplotlib (an optional extra) were not installed."""
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)


# -- BLEU two ways ------------------------------------------------------------------------
RAW_HYP = ["The cat, it seems, sat on the mat.", "Don't go there!", "A big (red) house."]
RAW_REF = ["The cat sat on the mat, it seems.", "Do not go there!", "A big red house."]


def test_tokenized_bleu_equals_sacrebleu_13a_on_raw_text():
    from sacrebleu.metrics import BLEU

    ours = decode.tokenized_bleu(RAW_HYP, RAW_REF).score
    theirs = BLEU(tokenize="13a").corpus_score(RAW_HYP, [RAW_REF]).score
    assert 0 < ours < 100
    assert ours == pytest.approx(theirs, abs=1e-9)


def test_tokenized_bleu_on_pretokenized_text_is_tokenize_none():
    from sacrebleu.metrics import BLEU

    hyp = ["the cat sat on the mat &apos;s .", "we don &apos;t know ."]  # Moses-tokenized, as IWSLT
    ref = ["the cat sat on the mat &apos;s mat .", "we do n&apos;t know ."]
    ours = decode.tokenized_bleu(hyp, ref, already_tokenized=True).score
    assert ours == pytest.approx(BLEU(tokenize="none").corpus_score(hyp, [ref]).score, abs=1e-9)
    # 13a would split "&apos;s" again: the numbers differ, which is why --tokenized exists
    assert ours != pytest.approx(decode.tokenized_bleu(hyp, ref).score, abs=1e-6)


def test_perfect_output_scores_100_everywhere():
    assert decode.tokenized_bleu(RAW_REF, RAW_REF).score == pytest.approx(100.0)
    assert decode.tokenized_bleu(RAW_REF, RAW_REF, already_tokenized=True).score == pytest.approx(
        100.0
    )
    assert decode.chrf(RAW_REF, RAW_REF).score == pytest.approx(100.0)
    report = decode.score_report(decode.scores(RAW_HYP, RAW_REF))
    assert "\n" not in report and "tok:13a|smooth:exp" in report and "tok:13a|smooth:none" in report
    # the headline first: SacreBLEU's BLEU, then chrF, then the tokenized BLEU, named as unsmoothed
    assert (
        report.index("BLEU|nrefs")
        < report.index("chrF2|nrefs")
        < report.index("tokenized BLEU (unsmoothed")
    )


def sacrebleu_cli(*args, seed=None):
    """SacreBLEU's own command line (python -m sacrebleu), its stdout."""
    env = dict(os.environ, **({} if seed is None else {"SACREBLEU_SEED": str(seed)}))
    done = subprocess.run(
        [sys.executable, "-m", "sacrebleu", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return done.stdout


def test_scores_equal_sacrebleu_cli(tmp_path):
    """decode.scores (--json, results.json) is what `sacrebleu REF -i HYP -m bleu chrf` writes,
    field by field."""
    (tmp_path / "ref").write_text("\n".join(RAW_REF) + "\n")
    (tmp_path / "hyp").write_text("\n".join(RAW_HYP) + "\n")
    ours = decode.scores(RAW_HYP, RAW_REF)
    bleu, chrf = json.loads(
        sacrebleu_cli(tmp_path / "ref", "-i", tmp_path / "hyp", "-m", "bleu", "chrf", "-w", "2")
    )
    assert ours["bleu"] == bleu and ours["chrf"] == chrf and 0 < bleu["score"] < 100
    tokenized = json.loads(
        sacrebleu_cli(
            tmp_path / "ref",
            "-i",
            tmp_path / "hyp",
            "-m",
            "bleu",
            "-w",
            "2",
            # multi-bleu.perl: 13a, no smoothing
            "--smooth-method",
            "none",
        )
    )
    assert ours["tokenized_bleu"] == dict(
        tokenized, name="tokenized BLEU (unsmoothed, as multi-bleu.perl)"
    )


# -- paired bootstrap -------------------------------------------------------------------
def corpus(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (8,), generator=g))
        for _ in range(n)
    ]


def corrupt(lines, seed=1):
    """Every sentence keeps its first half and gets random words after it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for line in lines:
        w = line.split()
        out.append(
            " ".join(w[:4] + [WORDS[i] for i in torch.randint(0, len(WORDS), (4,), generator=g)])
        )
    return out


def test_paired_test_identical_systems_not_significant():
    refs = corpus()
    hyps = corrupt(refs)
    for test in ("bs", "ar"):
        r = decode.paired_test([hyps, list(hyps)], refs, test, n_samples=200)
        for metric in ("BLEU", "chrF2"):  # no difference: p = 1, and why
            x = r["rows"][1][metric]
            assert (
                x["delta"] == 0.0
                and x["p_value"] == 1.0
                and x["undecidable"] == "the two outputs are identical"
            )
            assert (
                r["rows"][0][metric]["score"] == x["score"]
                and r["rows"][0][metric]["p_value"] is None
            )


def test_paired_test_references_beat_corrupted_baseline():
    refs = corpus()
    r = decode.paired_test([corrupt(refs), refs], refs, n_samples=200)
    base, system = r["rows"]
    assert system["BLEU"]["score"] == pytest.approx(100.0) and system["BLEU"]["delta"] > 10
    assert system["chrF2"]["score"] == pytest.approx(100.0) and system["chrF2"]["delta"] > 10
    assert system["BLEU"]["p_value"] < 0.05 and system["chrF2"]["p_value"] < 0.05
    for x in (*base.values(), *system.values()):
        assert x["ci"] >= 0 and x["mean"] - x["ci"] <= x["mean"] <= x["mean"] + x["ci"]
    # a corrupted system's scores vary over resamples
    assert base["BLEU"]["ci"] > 0 and base["chrF2"]["ci"] > 0
    again = decode.paired_test([corrupt(refs), refs], refs, n_samples=200)
    assert again == r  # seeded: reproducible
    other = decode.paired_test([corrupt(refs), refs], refs, n_samples=200, seed=7)
    assert (
        other["rows"][0]["BLEU"]["ci"] != base["BLEU"]["ci"]
        and "seed:7" in other["signatures"]["BLEU"]
    )
    # SacreBLEU's seed is taken from the environment; ours is put back
    assert os.environ.get("SACREBLEU_SEED") is None
    ar = decode.paired_test([corrupt(refs), refs], refs, "ar", n_samples=200)
    # AR: no interval
    assert ar["rows"][1]["BLEU"]["p_value"] < 0.05 and ar["rows"][1]["BLEU"]["mean"] is None
    with pytest.raises(DecodeError, match="line counts differ"):
        decode.paired_test([refs[:-1], refs], refs)


def cli_table(text):
    """The rows of SacreBLEU's --paired-bs/--paired-ar table (-f text): {system: [the cells of each
    metric]}."""
    rows, name = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("\u2502")[1:-1]]  # the box drawing's vertical bar
        if len(cells) > 1 and cells[0] != "System":
            name = (cells[0] or name).removeprefix("Baseline: ")
            rows.setdefault(name, [""] * (len(cells) - 1))
            rows[name] = [a + " " + b for a, b in zip(rows[name], cells[1:], strict=True)]
    return rows


@pytest.mark.parametrize("test", ["bs", "ar"])
def test_paired_test_equals_sacrebleu_cli(tmp_path, test):
    """Every score, interval and p-value of decode.paired_test (and so of --compare) is what
    `sacrebleu REF -i BASE SYS1 SYS2 -m bleu chrf --paired-bs` (or --paired-ar) prints for the same
    files and seed."""
    refs = corpus()
    files = {
        "ref": refs,
        "base": corrupt(refs, 1),
        "sys1": corrupt(refs, 2),
        "sys2": refs[:30] + corrupt(refs, 3)[30:],
    }
    for name, lines in files.items():
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    out = sacrebleu_cli(
        tmp_path / "ref",
        "-i",
        *(tmp_path / n for n in ("base", "sys1", "sys2")),
        "-m",
        "bleu",
        "chrf",
        f"--paired-{test}",
        f"--paired-{test}-n",
        200,
        "-w",
        4,
        "-f",
        "text",
        "--no-color",
        seed=7,
    )
    ours = decode.paired_test([files[n] for n in ("base", "sys1", "sys2")], refs, test, 200, seed=7)
    theirs = cli_table(out)
    assert list(theirs) == [str(tmp_path / n) for n in ("base", "sys1", "sys2")]
    for row, cells in zip(ours["rows"], theirs.values(), strict=True):
        for x, cell in zip(row.values(), cells, strict=True):  # BLEU, chrF2
            want = [f"{x[k]:.4f}" for k in ("score", "mean", "ci", "p_value") if x[k] is not None]
            assert re.findall(r"\d+\.\d+", cell) == want, (cell, x)
    # a table with a significant difference
    assert any(row["BLEU"]["p_value"] < 0.05 for row in ours["rows"][1:])
    for metric, signature in ours["signatures"].items():
        assert re.search(rf"^ - {metric} +{re.escape(signature)}$", out, re.M), (
            metric,
            signature,
            out,
        )


def test_cli_compare_prints_table_and_names_bad_files(tmp_path, capsys):
    refs = corpus()
    (tmp_path / "ref").write_text("\n".join(refs) + "\n")
    (tmp_path / "base").write_text("\n".join(corrupt(refs)) + "\n")
    (tmp_path / "sys").write_text("\n".join(refs) + "\n")
    (tmp_path / "sys2").write_text("\n".join(corrupt(refs, 5)) + "\n")
    (tmp_path / "short").write_text("one line\n")
    for test in ("bs", "ar"):
        argv = [
            "--compare",
            str(tmp_path / "base"),
            str(tmp_path / "sys"),
            str(tmp_path / "sys2"),
            "--ref",
            str(tmp_path / "ref"),
            "--samples",
            "100",
            "--test",
            test,
        ]
        assert decode_cli.main(argv) == 0
        out = capsys.readouterr().out
        assert (
            "p-value" in out
            and "95% CI" in out
            and "100 samples" in out
            and out.count("\u2502 chrF2") == 3
        )
        assert (
            f"BLEU: nrefs:1|{test}:100|seed:12345" in out
            and f"chrF2: nrefs:1|{test}:100|seed:12345" in out
        )
        verdicts = out.strip().splitlines()[-2:]  # one line per system, both metrics
        assert (
            verdicts[0].startswith(f"{tmp_path / 'sys'}: BLEU delta +")
            and "; chrF2 delta +" in verdicts[0]
        )
        assert verdicts[1].startswith(f"{tmp_path / 'sys2'}: BLEU delta ")
    for bad in ("short", "missing"):
        with pytest.raises(SystemExit) as e:
            decode_cli.main(
                [
                    "--compare",
                    str(tmp_path / bad),
                    str(tmp_path / "sys"),
                    "--ref",
                    str(tmp_path / "ref"),
                ]
            )
        msg = str(e.value.code)
        assert (
            str(tmp_path / bad) in msg and "\n" not in msg and msg.startswith("decode.py: error:")
        )
    with pytest.raises(SystemExit) as e:  # a baseline alone: nothing to compare
        decode_cli.main(["--compare", str(tmp_path / "base"), "--ref", str(tmp_path / "ref")])
    assert "at least one system's" in str(e.value.code)


# -- checkpoint averaging -----------------------------------------------------------------
def fake_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b16": torch.randn(5, generator=g).bfloat16(),
        "num_batches_tracked": torch.tensor(10 * (seed + 1)),
        "allowed": torch.rand(6, generator=g) > 0.5,
    }


def test_average_checkpoints_averages_floats_and_copies_int_and_bool(tmp_path):
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"checkpoint_epoch{i + 1}.pt")
        torch.save(
            {
                "format": rundir.CHECKPOINT_FORMAT,
                "model_config": {"vocab_size": 6},
                "model": fake_state(i),
                "step": i,
                "optimizer": {"x": 1},
            },
            paths[-1],
        )
    avg = decode.average_checkpoints(paths)
    a, b = fake_state(0), fake_state(1)
    assert torch.allclose(avg["model"]["w"], (a["w"] + b["w"]) / 2, atol=1e-6)
    assert avg["model"]["b16"].dtype == torch.bfloat16
    assert torch.equal(
        avg["model"]["b16"], ((a["b16"].double() + b["b16"].double()) / 2).bfloat16()
    )
    assert avg["model"]["num_batches_tracked"].dtype == torch.long
    assert int(avg["model"]["num_batches_tracked"]) == 20  # the last one's, not 15
    assert torch.equal(avg["model"]["allowed"], b["allowed"])
    assert avg["step"] == 1 and "optimizer" not in avg and len(avg["averaged_from"]) == 2


def test_load_checkpoint_average_of_run_dir(tmp_path, toy):
    tok, _, proto = toy
    models = [
        tiny_model(tok.vocab_size, seed=s, norm="power", encoder_norm="power") for s in range(3)
    ]
    for epoch, m in enumerate(models, start=1):
        m.encoder[0].norm_attn.num_batches_tracked.fill_(100 * epoch)
        ckpt = {
            "format": rundir.CHECKPOINT_FORMAT,
            "model_config": asdict(m.cfg),
            "model": m.state_dict(),
            "step": epoch,
            "bpe_model_proto": proto,
        }
        torch.save(ckpt, tmp_path / f"checkpoint_epoch{epoch}.pt")
    (tmp_path / "checkpoint_epoch3.pt.tmp").write_text("an interrupted save")  # ignored
    loaded, ltok, ckpt = decode.load_checkpoint(tmp_path, average=2)  # epochs 2 and 3
    assert [Path(p).name for p in ckpt["averaged_from"]] == [
        "checkpoint_epoch2.pt",
        "checkpoint_epoch3.pt",
    ]
    s1, s2, got = models[1].state_dict(), models[2].state_dict(), loaded.state_dict()
    for k, v in got.items():
        if torch.is_floating_point(v):  # logit_mask's -inf stay -inf ((-inf + -inf) / 2)
            assert torch.allclose(v, (s1[k] + s2[k]) / 2, atol=1e-6), k
        else:
            assert torch.equal(v, s2[k]), k
    assert int(got["encoder.0.norm_attn.num_batches_tracked"]) == 300
    assert torch.equal(got["logit_mask"], s2["logit_mask"])
    assert (
        decode.translate(loaded, ltok, ["the cat sat"], decode.Search(max_len_b=5))[0] is not None
    )
    with pytest.raises(DecodeError) as e:
        decode.load_checkpoint(tmp_path, average=5)
    assert str(tmp_path) in str(e.value) and "has 3" in str(e.value) and "\n" not in str(e.value)


# -- perplexity -------------------------------------------------------------------------
def test_perplexity_is_exp_mean_cross_entropy(toy):
    tok, pairs, _ = toy
    model = tiny_model(tok.vocab_size)
    out = decode.perplexity(model, tok, pairs, label_smoothing=0.0, batch_tokens=100)
    total, n = 0.0, 0
    with torch.no_grad():
        for src_text, tgt_text in pairs:  # one pair at a time: no padding at all
            x, y = tok.encode(src_text), tok.encode(tgt_text)
            logits = model.logits(torch.tensor([x]), torch.tensor([[BOS] + y]))[0]  # (T, V)
            total += F.cross_entropy(logits, torch.tensor(y + [EOS]), reduction="sum").item()
            n += len(y) + 1
    assert out["n_tokens"] == n
    assert out["ppl"] == pytest.approx(math.exp(total / n), rel=1e-4)
    assert out["smoothed_ppl"] == pytest.approx(out["ppl"], rel=1e-6)  # eps = 0: the same loss


def test_smoothed_loss_lower_bound(toy):
    # smoothed = (1-eps) NLL + eps mean_{w in A} -log p_w >= (1-eps) NLL + eps log|A| (Jensen)
    tok, pairs, _ = toy
    model = tiny_model(tok.vocab_size)
    model.train()
    eps = 0.1
    out = decode.perplexity(model, tok, pairs, label_smoothing=eps)
    assert model.training  # the mode is restored
    n_allowed = int(model.allowed.sum())
    assert out["smoothed_loss"] >= (1 - eps) * out["nll"] + eps * math.log(n_allowed) - 1e-6
    assert out["ppl"] == pytest.approx(decode.perplexity(model, tok, pairs, 0.0)["ppl"], rel=1e-6)
    # The value itself, one pair at a time, by torch's label-smoothed cross-entropy over the target
    # words A (the bound above is slack for an untrained model: a smoothed loss equal to the NLL
    # passed it).
    total, n = 0.0, 0
    with torch.no_grad():
        model.eval()
        for src_text, tgt_text in pairs:
            x, y = tok.encode(src_text), tok.encode(tgt_text)
            # (T, |A|)
            logits = model.logits(torch.tensor([x]), torch.tensor([[BOS] + y]))[0][:, model.allowed]
            column = model.allowed.cumsum(0) - 1  # a target word's column among A
            total += F.cross_entropy(
                logits, column[torch.tensor(y + [EOS])], label_smoothing=eps, reduction="sum"
            ).item()
            n += len(y) + 1
    assert out["smoothed_loss"] == pytest.approx(total / n, rel=1e-4)


# -- attention maps -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cross", "enc", "dec"])
def test_attention_weights_rows_sum_to_one_and_shapes(toy, kind):
    tok, pairs, _ = toy
    model = tiny_model(tok.vocab_size, qknorm=True, qk_g0=5.0)
    src, tgt = pairs[0]
    w, rows, cols = decode.attention_weights(model, tok, src, tgt, layer=1, head=2, kind=kind)
    S, T = len(tok.encode(src)), len(tok.encode(tgt)) + 1
    assert (
        w.shape == {"cross": (T, S), "enc": (S, S), "dec": (T, T)}[kind] == (len(rows), len(cols))
    )
    assert torch.allclose(w.sum(-1), torch.ones(len(rows)), atol=1e-5)
    if kind == "dec":
        assert torch.equal(w, w.tril()) and rows[0] == "<s>"  # causal
    if kind == "cross":
        assert rows[-1] == "</s>" and cols == [tok.piece(i) for i in tok.encode(src)]
    attn = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert len(attn) == 2 + 2 * 2 and all(
        m.keep_weights is False and m.last_weights is None for m in attn
    )


def test_attention_on_own_translation_and_heatmap(toy, tmp_path, monkeypatch, capsys):
    tok, pairs, _ = toy
    model = tiny_model(tok.vocab_size)
    src = pairs[1][0]
    w, rows, cols = decode.attention_weights(model, tok, src, None, kind="cross")
    greedy = decode.greedy_search(model, torch.tensor([tok.encode(src)]))[0]
    assert rows == [tok.piece(i) for i in greedy] + ["</s>"]
    assert not model.decoder[0].cross_attn.keep_weights
    text = plots.render_heatmap(w, rows, cols)
    for label in rows + cols:
        # cut to max_label 8 with "~"
        assert (label if len(label) <= 8 else label[:7] + "~") in text
    assert len(text.splitlines()) == len(rows) + 2
    # Without matplotlib: False and one note, never ImportError.
    without_matplotlib(monkeypatch)
    assert plots.save_heatmap_png(w, rows, cols, tmp_path / "a.png") is False
    assert not (tmp_path / "a.png").exists()
    assert "matplotlib" in capsys.readouterr().err
    with pytest.raises(DecodeError, match="layer 7"):
        decode.attention_weights(model, tok, src, None, layer=7)


# -- the learned g's ----------------------------------------------------------------------
def test_g_values_json_and_table_for_scalenorm_qknorm(tmp_path):
    model = tiny_model(40, norm="scale", qknorm=True, qk_g0=3.5)
    with torch.no_grad():
        model.decoder[1].cross_attn.g.fill_(7.25)
        model.encoder[0].norm_ff.g.fill_(2.5)
    saved = decode.g_values(model)
    # 2 encoder layers x (2 ScaleNorm + 1 QKNorm) + 2 decoder layers x (3 + 2) + 2 final norms
    assert len(saved) == 2 * 3 + 2 * 5 + 2
    by_name = {r["name"]: r for r in saved}
    assert by_name.keys() == model.learned_scales().keys()
    assert by_name["decoder.1.cross_attn.g"]["value"] == 7.25
    assert (
        by_name["decoder.1.cross_attn.g"]["kind"] == "QKNorm"
        and by_name["decoder.1.cross_attn.g"]["layer"] == 1
    )
    assert by_name["encoder.0.norm_ff.g"] == {
        "name": "encoder.0.norm_ff.g",
        "stack": "encoder",
        "layer": 0,
        "sublayer": "ffn",
        "kind": "ScaleNorm",
        "value": 2.5,
    }
    assert by_name["encoder.1.self_attn.g"]["value"] == 3.5
    assert by_name["dec_final_norm.g"]["layer"] == 2 and by_name["dec_final_norm.g"][
        "value"
    ] == pytest.approx(32**0.5)
    from rich.console import Console

    console = Console(file=io.StringIO(), width=160)
    decode.print_g_table(model, console)
    text = console.file.getvalue()
    assert "decoder.1.cross_attn.g" in text and "7.250" in text and "#" * 12 in text


def test_g_table_for_layernorm_model_is_one_line(tmp_path):
    from rich.console import Console

    model = tiny_model(40, norm="layer")
    console = Console(file=io.StringIO(), width=120)
    decode.print_g_table(model, console)
    assert len(console.file.getvalue().strip().splitlines()) == 1
    assert decode.g_values(model) == []


def test_cli_g_table_and_attention(tmp_path, toy, capsys):
    tok, pairs, proto = toy
    model = tiny_model(tok.vocab_size, qknorm=True, qk_g0=4.0)
    torch.save(
        {
            "format": rundir.CHECKPOINT_FORMAT,
            "model_config": asdict(model.cfg),
            "model": model.state_dict(),
            "bpe_model_proto": proto,
        },
        tmp_path / "checkpoint_best.pt",
    )
    assert decode_cli.main([str(tmp_path), "--g-table"]) == 0
    assert "decoder.0.cross_attn.g" in capsys.readouterr().out
    src, tgt = pairs[2]
    assert (
        decode_cli.main(
            [
                str(tmp_path),
                "--attention",
                src,
                "--attention-target",
                tgt,
                "--kind",
                "enc",
                "--layer",
                "1",
                "--head",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "enc attention, layer 1, head 3" in out and "shades:" in out
    (tmp_path / "dev.src").write_text("\n".join(s for s, _ in pairs[:6]) + "\n")
    (tmp_path / "dev.tgt").write_text("\n".join(t for _, t in pairs[:6]) + "\n")
    assert (
        decode_cli.main(
            [
                str(tmp_path),
                "--input",
                str(tmp_path / "dev.src"),
                "--ref",
                str(tmp_path / "dev.tgt"),
                "--output",
                str(tmp_path / "hyp"),
                "--ppl",
                "--beam",
                "1",
                "--max-len-b",
                "5",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "tokenized BLEU (unsmoothed, as multi-bleu.perl)|" in err
    assert "test perplexity: label-smoothed (eps 0.1)" in err


# -- case-insensitive BLEU and pictures (issue: PowerNorm reports case-insensitive BLEU) ------
def test_lowercase_bleu_ignores_case_and_says_so_in_its_signature():
    hyps, refs = ["The Cat sat ON the mat ."], ["the cat sat on the mat ."]
    assert decode.bleu(hyps, refs).score < 60
    lc = decode.bleu(hyps, refs, lowercase=True)
    assert lc.score == pytest.approx(100.0) and "case:lc" in lc.signature
    assert decode.tokenized_bleu(hyps, refs, lowercase=True).score == pytest.approx(100.0)
    report = decode.score_report(decode.scores(hyps, refs, lowercase=True))
    assert "case:lc" in report and "chrF2|nrefs:1|case:lc" in report and "= 100.00" in report


def _fake_run(root, name, scale_g, qk_g, bn_key=None):
    """A metrics.jsonl as train.py writes it: steps, log windows, evaluations, batch-norm records,
    and a half-written last line (a killed run)."""
    run = root / name
    run.mkdir()
    rows = []
    for step in range(1, 21):
        rows.append(
            {"step": step, "loss": 5.0 - step / 10, "gnorm": 2.0 / step, "lr": 1e-3, "tokens": 100}
        )
        if step % 10 == 0:
            rows.append(
                {
                    "step": step,
                    "train_loss": 5.0 - step / 10,
                    "train_ppl": 9.0,
                    "tok_per_s": 1.0,
                    "mfu": 0.5,
                }
            )
            rows.append(
                {
                    "step": step,
                    "epoch": step // 10,
                    "dev_bleu": float(step),
                    "dev_loss": 1.0,
                    "dev_ppl": 2.7,
                    "lr": 1e-3,
                    "g": {
                        "encoder.0.norm_attn.g": scale_g,
                        "encoder.0.self_attn.g": qk_g,
                        "dec_final_norm.g": scale_g + 1,
                        "encoder.1.norm_ff.g": scale_g + 0.5,
                    },
                }
            )
            if bn_key:
                rows.append(
                    {
                        "step": step,
                        "batch_norm_stats": {"encoder.0.norm_attn": {bn_key: 0.1 * step}},
                    }
                )
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 21, "lo'
    )
    return run


def test_plot_series_picks_each_panel_from_metrics(tmp_path):
    a = _fake_run(tmp_path, "bn", 3.0, 7.0, "dist_sigma2")
    b = _fake_run(tmp_path, "pn", 4.0, 9.0, "dist_psi2")
    panels = plots.plot_series([a, b])
    assert [c[0] for c in panels["dev BLEU"]] == ["bn", "pn"] and panels["dev BLEU"][0][1:] == (
        [10, 20],
        [10.0, 20.0],
    )
    assert panels["dev perplexity"][0][1:] == ([10, 20], [2.7, 2.7])
    # every step; the torn line skipped
    assert panels["gradient norm (before clipping)"][1][1] == list(range(1, 21))
    depth = panels["learned g by depth (last evaluation)"][0]
    # ScaleNorm g's only, encoder by layer, then the decoder's final
    assert depth[2] == [3.0, 3.5, 4.0]
    assert panels["QKNorm g (mean over modules)"][1][2] == [9.0, 9.0]
    stats = panels["batch vs running statistic, first norm"]
    assert [c[0] for c in stats] == ["bn (dist_sigma2)", "pn (dist_psi2)"] and stats[0][2] == [
        1.0,
        2.0,
    ]


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    run = _fake_run(tmp_path, "r", 3.0, 7.0)
    without_matplotlib(monkeypatch)
    with pytest.raises(SystemExit) as e:  # one line, a non-zero exit, nothing written
        decode_cli.main(["--plot", str(run), "--out", str(tmp_path / "p.png")])
    msg = str(e.value.code)
    assert "pip install matplotlib" in msg and "\n" not in msg and not (tmp_path / "p.png").exists()


def test_plot_writes_a_png_when_matplotlib_is_there(tmp_path):
    pytest.importorskip(
        "matplotlib", reason="matplotlib is an optional extra (pip install matplotlib)"
    )
    runs = [str(_fake_run(tmp_path, n, 3.0, 7.0, "dist_psi2")) for n in ("a", "b")]
    assert decode_cli.main(["--plot", *runs, "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_a_run_with_one_evaluation_as_a_point(tmp_path, monkeypatch):
    """A curve of one point has no line to draw: it gets a marker (it was in the legend and
    invisible)."""
    pytest.importorskip(
        "matplotlib", reason="matplotlib is an optional extra (pip install matplotlib tensorboard)"
    )
    from matplotlib.axes import Axes

    run, drawn, real_plot = _fake_run(tmp_path, "one", 3.0, 7.0), [], Axes.plot
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    # one epoch
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 10)
    )
    monkeypatch.setattr(
        Axes,
        "plot",
        lambda ax, xs, ys, **k: (
            drawn.append((ax, len(xs), k.get("marker"))) or real_plot(ax, xs, ys, **k)
        ),
    )
    decode_cli.main(["--plot", str(run), "--out", str(tmp_path / "p.png")])
    # each panel's title is set after its curves
    drawn = [(ax.get_title(), n, marker) for ax, n, marker in drawn]
    assert ("dev BLEU", 1, "o") in drawn and ("training loss", 1, "o") in drawn, drawn
    assert (
        all(marker for _, n, marker in drawn if n == 1)
        and ("gradient norm (before clipping)", 10, None) in drawn
    )


def test_tokenized_bleu_on_raw_text_is_noticed():
    """--tokenized scores the text as it is: right for Moses-tokenized references (en-vi as the TwT
    authors ship it), wrong for raw text such as prepare de-en writes, where "dog." is one word."""
    raw = ["The dog sees a cat.", "Yes, it runs home!", "A man, a plan, a canal: Panama."]
    moses = ["The dog sees a cat .", "Yes , it runs home !", "A man , a plan , a canal : Panama ."]
    assert decode.attached_punctuation(raw) > 0.2 and decode.attached_punctuation(moses) == 0.0
    # abbreviations and numbers
    assert decode.attached_punctuation(["the U.S. army", "3.5 km"]) == 0.0
