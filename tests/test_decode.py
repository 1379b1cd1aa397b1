"""Tests for decode.py: the searches against slow references, and the command line.

The claims, in the order of decode.py:
  - greedy search with the key/value cache equals a slow greedy that re-runs the whole
    model on the prefix at every step;
  - beam size 1 equals greedy, token for token;
  - beam search finds a hypothesis whose length-penalised score, recomputed by teacher
    forcing, is at least the greedy output's, and the score it reports is that score;
  - a batch gives the same outputs as each sentence alone (sentences that finish and
    leave the batch do not disturb the others);
  - EOS is never the first token; PAD, BOS and masked words never appear, even when the
    beam is wider than the allowed vocabulary (-inf scores, no NaN);
  - checkpoints load from a file or a run directory, translate() keeps the input order,
    the command line prints BLEU with its signature, and bad inputs give one-line errors.
A tiny random model is enough for all of these (no training): its weights are scaled up
so that its outputs depend on the source and the prefix, and they end at varied lengths.
"""

import io
import json
import math
import subprocess
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

import conftest
import pytest
import torch
from conftest import WORDS

import decode
from decode import Search, beam_search, greedy_search, length_penalty, load_checkpoint, translate
from machinery import decode_cli, rundir, train_cli
from model import BOS, EOS, PAD

V = 40


tiny_model = partial(conftest.tiny_model, g=8.0)  # the final g sets peakiness: 8, peaky


def random_src(B=6, S=7, seed=1, vocab_size=V):
    """(B, S) sources of different lengths, PAD-padded on the right."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab_size, (B, S), generator=g)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    lengths[0] = S
    src[torch.arange(S)[None, :] >= lengths[:, None]] = PAD
    return src


@torch.no_grad()
def slow_greedy(model, src_row, max_len):
    """Test-only greedy: the full teacher-forced model on the whole prefix, every step."""
    out = []
    for t in range(max_len):
        tgt_in = torch.tensor([[BOS] + out], device=src_row.device)
        logp = model.logits(src_row[None], tgt_in)[0, -1].float().log_softmax(-1)
        if t == 0:
            logp[EOS] = -math.inf
        w = int(logp.argmax())
        if w == EOS:
            break
        out.append(w)
    return out


@torch.no_grad()
def teacher_forced_score(model, src_row, tokens, ended, alpha, penalty="gnmt"):
    """log P(tokens [+ EOS] | src) / lp(|Y|), |Y| counting EOS when it ended: GNMT's ((5 + |Y|) /
    6)^alpha or fairseq's |Y|^alpha, written out here."""
    y = tokens + [EOS] if ended else tokens
    tgt_in = torch.tensor([[BOS] + y[:-1]], device=src_row.device)
    logp = model.logits(src_row[None], tgt_in)[0].float().log_softmax(-1)  # (T, V)
    logp[0, EOS] = -math.inf  # EOS forbidden at step 0, as in the searches
    total = logp.gather(1, torch.tensor(y, device=logp.device)[:, None]).sum().item()
    return total / (((5 + len(y)) / 6) ** alpha if penalty == "gnmt" else len(y) ** alpha)


def unpad(src_row):
    return src_row[src_row.ne(PAD)]


# -- the searches -----------------------------------------------------------------------
def test_length_penalty_convention():
    # Code (TwT): ((5 + t + 1) / 6)^alpha at step t; a hypothesis ending at step t has t+1 tokens.
    assert length_penalty(1, 0.6) == 1.0
    assert length_penalty(7, 0.6) == pytest.approx(2.0**0.6)
    assert length_penalty(30, 0.0) == 1.0
    assert length_penalty(7, 1.0, "fairseq") == 7.0  # fairseq: (step + 1)^alpha, step 6 is the EOS
    assert length_penalty(4, 0.6, "fairseq") == pytest.approx(4**0.6)


def test_the_two_length_penalties_are_searched_for_and_rank_differently():
    """PowerNorm decodes with fairseq's |Y|^alpha, TwT with GNMT's ((5 + |Y|) / 6)^alpha: the
    reported score is the written-out one under each, and with alpha 1 they pick different outputs.
    """
    differ = 0
    for seed in range(3):
        model, src = tiny_model(seed=seed), random_src(B=8, seed=3 + seed)
        outputs = {}
        for penalty in ("gnmt", "fairseq"):
            beams = beam_search(
                model, src, beam=4, alpha=1.0, max_len=15, return_scores=True, penalty=penalty
            )
            for s, (b, b_score) in zip(src, beams, strict=True):
                assert b_score == pytest.approx(
                    teacher_forced_score(model, unpad(s), b, len(b) < 15, 1.0, penalty), abs=1e-4
                )
            outputs[penalty] = [b for b, _ in beams]
        differ += sum(g != f for g, f in zip(outputs["gnmt"], outputs["fairseq"], strict=True))
    assert differ >= 1


def test_greedy_with_cache_equals_slow_greedy():
    model, src = tiny_model(), random_src()
    fast = greedy_search(model, src, max_len=12)
    slow = [slow_greedy(model, unpad(s), 12) for s in src]
    assert fast == slow
    assert len({len(h) for h in fast}) > 1  # the test covers rows that finish early


def test_beam_size_1_equals_greedy():
    mask = torch.ones(V, dtype=torch.bool)
    mask[20:26] = False
    for seed in range(3):
        model, src = tiny_model(seed=seed, mask=mask), random_src(B=8, seed=seed + 10)
        limit = src.ne(PAD).sum(1) + 5  # a per-sentence max length (B,)
        assert beam_search(model, src, beam=1, max_len=limit) == greedy_search(
            model, src, max_len=limit
        )
        if seed == 0:
            assert beam_search(model, src, beam=1) == greedy_search(model, src)  # default |x| + 50


def test_beam_score_at_least_greedy_and_reported_score_is_true():
    # Note: beam search is not guaranteed to beat greedy (greedy's prefix can fall out of
    # the beam), but with K = 4 on these seeded models it does; that the reported score
    # equals the teacher-forced one checks the bookkeeping (cumulative log-probs, lp, EOS).
    alpha, max_len, better = 0.6, 15, 0
    for seed in range(3):
        model, src = tiny_model(seed=seed), random_src(B=8, seed=3 + seed)
        greedy = greedy_search(model, src, max_len=max_len)
        beams = beam_search(model, src, beam=4, alpha=alpha, max_len=max_len, return_scores=True)
        for s, g, (b, b_score) in zip(src, greedy, beams, strict=True):
            s = unpad(s)
            g_score = teacher_forced_score(model, s, g, len(g) < max_len, alpha)
            tf_score = teacher_forced_score(model, s, b, len(b) < max_len, alpha)
            assert b_score == pytest.approx(tf_score, abs=1e-4)
            assert tf_score >= g_score - 1e-5
            better += tf_score > g_score + 1e-4
    assert better >= 10  # the test models give beam search something to find


def test_batched_beam_equals_each_sentence_alone():
    model, src = tiny_model(seed=4), random_src(B=7, seed=5)
    batched = beam_search(model, src, beam=4, max_len=14, return_scores=True)
    alone = [
        beam_search(model, unpad(s)[None], beam=4, max_len=14, return_scores=True)[0] for s in src
    ]
    assert [h for h, _ in batched] == [h for h, _ in alone]
    assert [sc for _, sc in batched] == pytest.approx([sc for _, sc in alone], abs=1e-5)
    assert len({len(h) for h, _ in batched}) > 1  # sentences left the batch at different steps
    assert greedy_search(model, src, max_len=14) == [
        greedy_search(model, unpad(s)[None], max_len=14)[0] for s in src
    ]


def test_eos_never_first_and_no_special_or_masked_words():
    mask = torch.zeros(V, dtype=torch.bool)
    mask[[1, EOS, 5, 9, 17]] = True  # the target vocabulary: UNK (1), EOS and 3 words
    model = tiny_model(mask=mask, eos_bias=50.0)  # EOS would win every step if allowed
    with torch.no_grad():
        model.out_bias[~model.allowed] = 100.0  # masked words would win if the mask leaked
    src = random_src(B=5, seed=6)
    allowed = set(torch.nonzero(model.allowed).flatten().tolist()) - {EOS}
    for beam in (1, 2, 8):  # 8 > the 4 words allowed at step 0: some beams are -inf
        for hyp in beam_search(model, src, beam=beam, max_len=6):
            assert len(hyp) >= 1, "EOS at step 0"
            assert set(hyp) <= allowed and PAD not in hyp and BOS not in hyp and EOS not in hyp
    for hyp in greedy_search(model, src, max_len=6):
        assert len(hyp) == 1 and hyp[0] in allowed  # one word, then EOS


def test_beam_search_with_all_scores_minus_inf_paths_has_no_nan():
    mask = torch.zeros(V, dtype=torch.bool)
    mask[[EOS, 7]] = True  # a single word: K = 4 beams, only one finite path
    model, src = tiny_model(mask=mask, eos_bias=-2.0), random_src(B=3, seed=7)
    out = beam_search(model, src, beam=4, max_len=5, return_scores=True)
    for hyp, score in out:
        assert set(hyp) == {7} and math.isfinite(score)


# -- files, translate(), the command line -------------------------------------------------
B_ = 5  # outputs of at most |x| + 5 tokens keep these tests fast


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as train.py writes it: bpe.model + checkpoint_best.pt (+ the data)."""
    from data import Tokenizer, train_bpe

    root = tmp_path_factory.mktemp("run")
    g = torch.Generator().manual_seed(0)
    lines = [
        " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(n),), generator=g))
        for n in torch.randint(2, 9, (60,), generator=g)
    ]
    proto = train_bpe(lines[:30], lines[30:], 60)
    tok = Tokenizer(proto)
    model = tiny_model(vocab_size=tok.vocab_size)
    ckpt = {
        "format": rundir.CHECKPOINT_FORMAT,
        "model_config": asdict(model.cfg),
        "model": model.state_dict(),
        "bpe_model_proto": proto,
        "src_lang": "src",
        "tgt_lang": "tgt",
        "step": 7,
        "dev_bleu": 0.0,
    }
    torch.save(ckpt, root / "checkpoint_best.pt")
    (root / "dev.src").write_text("\n".join(lines[:12]) + "\n")
    (root / "dev.tgt").write_text("\n".join(lines[30:42]) + "\n")
    return root, model, tok, lines


def test_load_checkpoint_round_trip_from_file_and_run_dir(run_dir):
    root, model, tok, lines = run_dir
    for path in (root / "checkpoint_best.pt", root):
        loaded, ltok, ckpt = load_checkpoint(path)
        assert not loaded.training and ckpt["step"] == 7
        for k, v in model.state_dict().items():
            assert torch.equal(v, loaded.state_dict()[k]), k
        assert ltok.vocab_size == tok.vocab_size and ltok.encode(lines[0]) == tok.encode(lines[0])
        assert translate(loaded, ltok, lines[:5], Search(max_len_b=B_)) == translate(
            model, tok, lines[:5], Search(max_len_b=B_)
        )


def test_translate_restores_order_and_handles_empty_lines(run_dir):
    _, model, tok, lines = run_dir
    inputs = lines[:9] + [""] + lines[9:12]
    model.train()  # translate() must switch to eval itself, and switch back
    # several batches
    both = translate(model, tok, inputs, Search(3, max_len_b=B_), batch_tokens=20)
    assert model.training
    model.eval()
    assert both == [translate(model, tok, [line], Search(3, max_len_b=B_))[0] for line in inputs]
    assert both[9] == "" and translate(model, tok, []) == []
    assert len(set(both)) > 3  # the outputs differ, so a wrong order would show
    assert translate(model, tok, inputs, Search(1, max_len_b=B_), batch_tokens=20) == [
        tok.decode(
            greedy_search(model, torch.tensor([tok.encode(line)]), len(tok.encode(line)) + B_)[0]
        )
        if line
        else ""
        for line in inputs
    ]


def test_cli_translates_a_file_and_prints_bleu(run_dir, tmp_path, capsys):
    root, model, tok, lines = run_dir
    out = tmp_path / "hyp.txt"
    common = [
        str(root),
        "--input",
        str(root / "dev.src"),
        "--ref",
        str(root / "dev.tgt"),
        "--max-len-b",
        str(B_),
        "--device",
        "cpu",
    ]
    assert (
        decode_cli.main(
            common + ["--output", str(out), "--beam", "2", "--json", str(tmp_path / "scores.json")]
        )
        == 0
    )
    hyps = out.read_text().split("\n")[:-1]
    assert hyps == translate(model, tok, lines[:12], Search(2, max_len_b=B_))
    err = capsys.readouterr().err
    assert (
        "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp" in err
        and "chrF2|nrefs:1|case:mixed|eff:yes" in err
    )
    # --json: the scores as SacreBLEU's own CLI writes them for the same files, and as the line on
    # stderr says
    scores = json.loads((tmp_path / "scores.json").read_text())
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "sacrebleu",
            str(root / "dev.tgt"),
            "-i",
            str(out),
            "-m",
            "bleu",
            "chrf",
            "-w",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert [scores["bleu"], scores["chrf"]] == json.loads(cli.stdout)
    assert decode.score_report(scores) in err and scores["tokenized_bleu"]["name"].startswith(
        "tokenized BLEU"
    )
    # checked before any work, as --output: a name that is not .json, a run's own file, a flag it
    # needs or idles with
    for flags, words in (
        (["--json", str(tmp_path / "scores.txt")], "must end in .json"),
        (["--json", str(root / "results.json")], "a file of the run directory"),
        (["--json", str(tmp_path / "nope" / "s.json")], "does not exist"),
    ):
        with pytest.raises(SystemExit) as e:
            decode_cli.main(common + flags)
        assert words in str(e.value.code), (flags, e.value.code)
    for flags, words in (
        (
            ["--json", str(tmp_path / "s.json"), "--benchmark"],
            "--json does nothing with --benchmark",
        ),
        ([str(root), "--json", str(tmp_path / "s.json")], "--json is for --ref"),
    ):
        with pytest.raises(SystemExit):
            decode_cli.main(common + flags if "--benchmark" in flags else flags)
        assert words in capsys.readouterr().err
    assert decode_cli.main(common + ["--benchmark"]) == 0
    err = capsys.readouterr().err
    assert "greedy (beam 1)" in err and "beam 4" in err and "sentences/s" in err


def test_cli_reads_stdin_writes_stdout(run_dir, monkeypatch, capsys):
    root, model, tok, lines = run_dir
    monkeypatch.setattr(
        sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(lines[:3]) + "\n").encode()))
    )
    assert (
        decode_cli.main([str(root), "--beam", "1", "--max-len-b", str(B_), "--device", "cpu"]) == 0
    )
    out = capsys.readouterr().out
    assert out.split("\n")[:-1] == translate(model, tok, lines[:3], Search(1, max_len_b=B_))


def test_cli_searches_as_the_run_did_unless_told(run_dir, tmp_path, capsys):
    """Without --beam/--alpha/--length-penalty, decode.py uses the search the run's checkpoint was
    trained to be tested with (PowerNorm's rows: beam 5, fairseq's penalty with alpha 1.0), not
    TwT's defaults; a flag given wins; a saved value decode.py does not take is refused by name."""
    root, model, tok, lines = run_dir
    ckpt = torch.load(root / "checkpoint_best.pt", weights_only=True)
    run = tmp_path / "run"
    run.mkdir()
    common = [str(run), "--input", str(root / "dev.src"), "--max-len-b", str(B_), "--device", "cpu"]
    for saved, flags, want in [
        ({"beam": 3, "alpha": 1.0, "length_penalty": "fairseq"}, [], (3, 1.0, "fairseq")),
        (
            {"beam": 3, "alpha": 1.0, "length_penalty": "fairseq"},
            ["--beam", "2"],
            (2, 1.0, "fairseq"),
        ),
        ({}, [], (4, 0.6, "gnmt")),
    ]:
        torch.save(dict(ckpt, args=saved), run / "checkpoint_best.pt")
        out = tmp_path / "hyp.txt"
        assert decode_cli.main(common + flags + ["--output", str(out)]) == 0
        beam, alpha, penalty = want
        assert out.read_text().split("\n")[:-1] == translate(
            model, tok, lines[:12], Search(beam, alpha, B_, penalty=penalty)
        )
        assert f"beam {beam}, {penalty} length penalty alpha {alpha}" in capsys.readouterr().err
    torch.save(dict(ckpt, args={"beam": "4; rm -rf /"}), run / "checkpoint_best.pt")
    with pytest.raises(SystemExit) as e:
        decode_cli.main(common)
    assert "its saved --beam '4; rm -rf /' is not one decode.py takes" in str(e.value)


def test_bleu_helpers():
    hyps, refs = ["the cat sat on the mat ."], ["the cat sat on the mat ."]
    score = decode.bleu(hyps, refs)
    assert score.score == pytest.approx(100.0) and "tok:13a" in score.signature
    assert "\n" not in decode.score_report(decode.scores(hyps, refs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_search_and_bf16_translate(run_dir):
    _, model, tok, lines = run_dir
    gpu, src = tiny_model().cuda(), random_src().cuda()
    assert beam_search(gpu, src, beam=1, max_len=12) == greedy_search(gpu, src, max_len=12)  # fp32
    assert greedy_search(gpu, src, max_len=12) == [slow_greedy(gpu, unpad(s), 12) for s in src]
    model_gpu = tiny_model(vocab_size=tok.vocab_size).cuda()
    out = translate(
        model_gpu, tok, lines[:8] + [""], Search(4, max_len_b=B_, bf16=True)
    )  # bf16 autocast
    assert len(out) == 9 and out[-1] == "" and all(out[:8])


@pytest.mark.parametrize(
    "case", ["missing_ckpt", "empty_dir", "not_a_ckpt", "ref_mismatch", "missing_input"]
)
def test_bad_inputs_give_one_line_errors_naming_the_file(run_dir, tmp_path, case):
    root = run_dir[0]
    src = str(root / "dev.src")
    if case == "missing_ckpt":
        named, argv = str(tmp_path / "nope.pt"), [str(tmp_path / "nope.pt"), "--input", src]
    elif case == "empty_dir":
        named, argv = str(tmp_path), [str(tmp_path), "--input", src]
    elif case == "not_a_ckpt":
        (tmp_path / "junk.pt").write_text("hello")
        named, argv = str(tmp_path / "junk.pt"), [str(tmp_path / "junk.pt"), "--input", src]
    elif case == "ref_mismatch":
        short = tmp_path / "short.tgt"
        short.write_text("one line\n")
        named, argv = str(short), [str(root), "--input", src, "--ref", str(short)]
    else:
        named, argv = str(tmp_path / "none.src"), [str(root), "--input", str(tmp_path / "none.src")]
    with pytest.raises(SystemExit) as e:
        decode_cli.main(argv)
    msg = str(e.value.code)
    assert named in msg and "\n" not in msg and msg.startswith("decode.py: error:")


# -- issue 30: a run's files, a run's checkpoints, --threads, the batch default -----------------
def _one_line_exit(argv, *words):
    """decode_cli.main(argv) stops with one line (non-zero) holding every one of words."""
    with pytest.raises(SystemExit) as e:
        decode_cli.main(argv)
    msg = str(e.value.code)
    assert e.value.code != 0 and "\n" not in msg and all(w in msg for w in words), msg
    return msg


def _files(folder):
    return {p: p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def test_output_never_replaces_a_file_any_run_wrote(run_dir, tmp_path):
    """Issue 30: --output RUN_B/checkpoint_best.pt replaced run B's checkpoint (only the decoded
    run's files were protected). A run's folder (config.json or a checkpoint) keeps every name a run
    writes; other names, and a folder with no run in it, take the translations."""
    root = run_dir[0]
    b, c, mine = tmp_path / "b", tmp_path / "c", tmp_path / "mine"
    for d in (b, c, mine):
        d.mkdir()
    # a run: its checkpoint
    (b / "checkpoint_best.pt").write_bytes((root / "checkpoint_best.pt").read_bytes())
    (b / "results.json").write_text("{}\n")
    (c / "config.json").write_text('{"run_id": "c"}\n')  # a run: its config.json
    # written through: its file would be replaced
    (tmp_path / "link.hyp").symlink_to(b / "checkpoint_best.pt")
    before = _files(tmp_path)
    src = [str(root), "--input", str(root / "dev.src"), "--max-len-b", str(B_), "--output"]
    for out in (
        b / "checkpoint_best.pt",
        b / "results.json",
        b / "test.hyp",
        b / "checkpoint_epoch3.pt",
        c / "bpe.model",
        c / ".lock",
        tmp_path / "link.hyp",
    ):
        _one_line_exit(src + [str(out)], f"--output {out}", "a file of the run directory")
    assert _files(tmp_path) == before  # nothing written, nothing replaced
    for out in (b / "b.hyp", mine / "results.json"):
        assert decode_cli.main(src + [str(out)]) == 0 and out.read_text().count("\n") == 12


def test_a_checkpoint_of_another_run_is_refused_by_decode_and_resume(run_dir, tmp_path):
    """Issue 30: a language model's checkpoint copied into a translation run's folder made decode.py
    take the whole run for a language model. A checkpoint whose run_id is not its folder's run's
    (config.json) is refused."""

    ckpt = torch.load(run_dir[0] / "checkpoint_best.pt", weights_only=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"run_id": "ours"}\n')
    for name in ("best", "last"):  # decode.py reads the best, a resume the last
        torch.save(dict(ckpt, args={"run_id": "theirs"}), run / f"checkpoint_{name}.pt")
    before = _files(tmp_path)
    for model in (run, run / "checkpoint_best.pt"):
        _one_line_exit(
            [str(model), "--input", str(run_dir[0] / "dev.src")],
            str(run / "checkpoint_best.pt"),
            "another run (run_id theirs)",
            "run ours",
        )
    # a resume refuses it (a file train.py did not write, never replaced)
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--resume", str(run)])
    assert "another run" in str(e.value.code) and "move it out" in str(e.value.code), e.value.code
    assert _files(tmp_path) == before
    # its own run's: read
    torch.save(dict(ckpt, args={"run_id": "ours"}), run / "checkpoint_best.pt")
    assert decode.load_checkpoint(run)[2]["args"]["run_id"] == "ours"


def test_threads_is_range_checked_and_set(run_dir, monkeypatch, capsys):
    """Issue 30: decode.py had no --threads (train.py's: [1, 1024]; torch crashed at 100,000)."""
    root = run_dir[0]
    argv = [str(root), "--input", str(root / "dev.src"), "--max-len-b", str(B_)]
    for n in ("0", "100000"):
        with pytest.raises(SystemExit):
            decode_cli.main(argv + ["--threads", n])
        assert f"argument --threads: must be in [1, 1024] (got {n})" in capsys.readouterr().err
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    assert decode_cli.main(argv + ["--threads", "3"]) == 0 and set_to == [3]


def test_a_translators_batches_are_the_runs_else_4096(run_dir, tmp_path, monkeypatch):
    """One owner of the default (run_defaults): the batches the run's own dev and test used, else
    4096; given wins."""
    root, model, tok, lines = run_dir
    ckpt = torch.load(root / "checkpoint_best.pt", weights_only=True)
    used = []
    monkeypatch.setattr(
        decode,
        "translate",
        lambda m, t, src, search, batch_tokens, *a: used.append(batch_tokens) or [""] * len(src),
    )
    for saved, given, want in (
        ({"batch_tokens": 123}, [], 123),
        ({}, [], 4096),
        ({"batch_tokens": 123}, ["50"], 50),
    ):
        torch.save(dict(ckpt, args=saved), tmp_path / "c.pt")
        flags = ["--batch-tokens", *given] if given else []
        assert (
            decode_cli.main([str(tmp_path / "c.pt"), "--input", str(root / "dev.src"), *flags]) == 0
        )
        assert used.pop() == want
