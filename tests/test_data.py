"""Tests for data.py: the toy corpus, reading errors, BPE, batching, word dropout, L."""

import collections
import math

import pytest
import torch
from conftest import tiny_model

import data
import model
from data import BOS, EOS, PAD, UNK
from machinery import corpora, fileio, toy_corpus
from machinery.fileio import DataError


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A small toy corpus, its BPE model and the encoded training set."""
    d = toy_corpus.make_toy_corpus(
        tmp_path_factory.mktemp("toy"), seed=1, n_train=6000, n_dev=200, n_test=200
    )
    paths = fileio.corpus_paths(d, "src", "tgt")
    train, _ = data.read_parallel(*paths["train"])
    model = data.train_bpe([s for s, _ in train], [t for _, t in train], 2000)
    tok = data.Tokenizer(model)
    return d, train, tok, data.encode_pairs(tok, train)


# --- toy corpus -------------------------------------------------------------


def test_toy_corpus_is_deterministic_and_has_the_advertised_sizes(tmp_path, toy):
    a = toy_corpus.make_toy_corpus(tmp_path / "a", seed=1, n_train=6000, n_dev=200, n_test=200)
    b = toy_corpus.make_toy_corpus(tmp_path / "b", seed=2, n_train=6000, n_dev=200, n_test=200)
    for name in ("train.src", "train.tgt", "dev.src", "test.tgt"):
        assert (a / name).read_bytes() == (toy[0] / name).read_bytes()
        assert (a / name).read_bytes() != (b / name).read_bytes()
    for split, n in (("train", 6000), ("dev", 200), ("test", 200)):
        for lang in ("src", "tgt"):
            assert len((a / f"{split}.{lang}").read_text().splitlines()) == n
    # Dev and test hold no training sentence.
    train_src = set((a / "train.src").read_text().splitlines())
    assert not train_src & set((a / "dev.src").read_text().splitlines())


def test_toy_corpus_is_idempotent(tmp_path):
    d = toy_corpus.make_toy_corpus(tmp_path, seed=3, n_train=50, n_dev=5, n_test=5)
    mtime = (d / "train.src").stat().st_mtime_ns
    toy_corpus.make_toy_corpus(tmp_path, seed=3, n_train=50, n_dev=5, n_test=5)
    assert (d / "train.src").stat().st_mtime_ns == mtime  # not rewritten
    toy_corpus.make_toy_corpus(tmp_path, seed=4, n_train=50, n_dev=5, n_test=5)
    assert (d / "train.src").stat().st_mtime_ns != mtime  # other seed: rebuilt


def test_toy_sentences_have_the_advertised_lengths(toy):
    lens = [len(s.split()) for s, _ in toy[1]]
    assert min(lens) >= 4 and max(lens) <= 25
    assert 8 <= sum(lens) / len(lens) <= 12


def test_toy_translation_reorders_and_inflects(toy):
    """SVO -> SOV: the target ends with a verb, the source does not put it last.

    "X sees the cat ." translates to "... <cat>k <see> .": the accusative
    object comes before the verb, so the target is no monotone word-for-word copy.
    """
    train = toy[1]
    pairs = dict(train)
    # Find the translations of "the cat" (object) and "sees" from minimal pairs.
    hits = [(s, t) for s, t in train if s.split()[-4:-1] == ["sees", "the", "cat"]]
    assert hits, "expected some '... sees the cat .' sentences"
    for s, t in hits:
        w = t.split()
        # Object (noun + accusative -k, determiner "na") before the verb.
        assert w[-4].endswith("k") and w[-3] == "na", (s, t)
    # Agreement: the verb differs between "he sees ..." and "they see ...".
    verbs = collections.defaultdict(set)
    for s, t in pairs.items():
        first, second = s.split()[:2]
        if first in ("he", "they") and second in ("sees", "see"):
            verbs[first].add(t.split()[-2])
    assert verbs["he"] and verbs["they"] and not verbs["he"] & verbs["they"]


def test_toy_target_is_a_function_of_the_source():
    """One reference per source: a repeated source always gets the same target."""
    import random

    grammar = toy_corpus._ToyGrammar(random.Random(5))
    seen, repeats = {}, 0
    for _ in range(20000):
        s, t = grammar.sentence()
        repeats += s in seen
        assert seen.setdefault(s, t) == t, s
    assert repeats > 100  # the check did see repeated sources


def test_toy_vocabulary_has_a_long_tail(toy):
    counts = collections.Counter(w for s, _ in toy[1] for w in s.split())
    rare = [w for w, c in counts.items() if c <= 2]
    assert len(rare) > 0.3 * len(counts)  # many types seen once or twice
    assert counts.most_common(1)[0][1] > 1000  # and a few very frequent ones


def test_names_are_transliterated():
    """A proper name is rewritten letter by letter in the target (c,q->k w->v y->i j->y x->ks)."""
    import random

    grammar = toy_corpus._ToyGrammar(random.Random(5))
    grammar.lists["name"] = (["Wyxcoj"], [1.0])  # the only name
    pairs = [grammar.sentence() for _ in range(300)]
    assert any("Wyxcoj" in s for s, _ in pairs)
    # in the target, with its case ending if any
    assert all(("Wyxcoj" in s) == ("Vikskoy" in t) for s, t in pairs)


# --- reading a corpus: every error names the file ---------------------------


def _write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_missing_file_names_the_file_and_the_convention(tmp_path):
    paths = fileio.corpus_paths(tmp_path, "en", "de")
    assert paths["dev"] == (tmp_path / "dev.en", tmp_path / "dev.de")
    _write(paths["train"][0], "a\n")
    with pytest.raises(DataError, match=r"train\.de.*not found.*train\.en") as e:
        data.read_parallel(*paths["train"])
    assert "\n" not in str(e.value)


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    s = _write(tmp_path / "train.en", "a\nb\nc\n")
    t = _write(tmp_path / "train.de", "x\ny\n")
    with pytest.raises(DataError, match=r"train\.en has 3 lines but .*train\.de has 2"):
        data.read_parallel(s, t)


def test_undecodable_bytes_name_file_line_and_offset(tmp_path):
    s = _write(tmp_path / "train.en", "hello\nw\xf6rld\n")  # valid UTF-8
    t = _write(tmp_path / "train.de", b"hallo\nab\xff\xfe\n")  # line 2, offset 8
    with pytest.raises(DataError, match=r"train\.de: line 2: .*0xff at byte offset 8"):
        data.read_parallel(s, t)


def test_empty_lines_are_dropped_and_counted(tmp_path):
    s = _write(tmp_path / "a.en", "one\n\nthree\n  four  \n")
    t = _write(tmp_path / "a.de", "eins\nzwei\n \r\nvier\n")
    pairs, stats = data.read_parallel(s, t)
    assert pairs == [("one", "eins"), ("four", "vier")]
    assert stats["empty"] == 2 and stats["lines"] == 4
    kept, _ = data.read_parallel(s, t, drop_empty=False)
    assert len(kept) == 4


def test_max_len_drops_long_pairs(tmp_path):
    s = _write(tmp_path / "a.en", "a b c\nd\n")
    t = _write(tmp_path / "a.de", "x\ny\n")
    pairs, stats = data.read_parallel(s, t, max_len=2)
    assert pairs == [("d", "y")] and stats["long"] == 1


def test_empty_training_set_is_an_error(tmp_path):
    s = _write(tmp_path / "train.en", "\n\n")
    t = _write(tmp_path / "train.de", "x\n\n")
    with pytest.raises(DataError, match=r"train\.en.*no usable sentence pairs"):
        data.read_parallel(s, t)


def test_lines_split_on_newline_only(tmp_path):
    # U+2028 would make str.splitlines() see two lines and break the alignment.
    s = _write(tmp_path / "a.en", "one\u2028two\n")
    t = _write(tmp_path / "a.de", "eins\n")
    assert data.read_parallel(s, t)[0] == [("one\u2028two", "eins")]


# --- BPE -------------------------------------------------------------------


def test_bpe_round_trip_and_special_ids(toy):
    _, train, tok, _ = toy
    assert (
        (tok.sp.pad_id(), tok.sp.unk_id(), tok.sp.bos_id(), tok.sp.eos_id())
        == (0, 1, 2, 3)
        == (PAD, UNK, BOS, EOS)
    )
    assert [tok.piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    for s, t in train[:200]:
        assert tok.decode(tok.encode(s)) == s
        assert tok.decode(tok.encode(t)) == t
    ids = tok.encode("the dog")
    assert tok.decode([BOS] + ids + [EOS, 5, 6, PAD]) == "the dog"  # stops at EOS


def test_bpe_training_is_deterministic(toy):
    src = [s for s, _ in toy[1][:1000]]
    tgt = [t for _, t in toy[1][:1000]]
    a = data.train_bpe(src, tgt, 500)
    b = data.train_bpe(src, tgt, 500)

    def pieces(m):
        return [data.Tokenizer(m).piece(i) for i in range(500)]

    # Same pieces in the same order, and the same bytes (trained in memory: no file name in the
    # model).
    assert pieces(a) == pieces(b) and a == b


def test_bpe_vocab_too_large_is_lowered(capsys):
    model = data.train_bpe(["ab ab", "ba"], ["abc"], 5000)
    assert data.Tokenizer(model).vocab_size < 5000
    assert "too large" in capsys.readouterr().err


def test_encode_cache_round_trip(tmp_path, toy):
    _, train, tok, enc = toy
    cache = tmp_path / "enc.pt"
    first = corpora.load_or_encode(tok, train[:300], cache)
    assert first == enc[:300] and cache.exists()
    assert corpora.load_or_encode(tok, train[:300], cache) == enc[:300]  # from the cache
    assert corpora.load_or_encode(tok, train[:10], cache) == enc[:10]  # other corpus: re-encoded


def test_filter_long_counts_what_it_drops():
    enc = [([4] * 3, [4] * 3), ([4] * 6, [4]), ([4], [4] * 7)]
    assert data.filter_long(enc, 5) == ([([4] * 3, [4] * 3)], 2)
    assert data.filter_long(enc, None) == (enc, 0)


# --- vocabulary mask --------------------------------------------------------


def test_target_vocab_mask():
    mask = data.target_vocab_mask([[5, 6], [6, 7]], vocab_size=10)
    assert mask.dtype == torch.bool and mask.shape == (10,)
    assert not mask[PAD] and not mask[BOS] and mask[UNK] and mask[EOS]
    assert mask[5] and mask[7] and not mask[8]  # 8: seen only on the source side


# --- batching ---------------------------------------------------------------


def test_batches_cover_every_example_once_within_budget(toy):
    enc = toy[3]
    for shuffle in (False, True):
        batches = data.make_batches(enc, 1000, shuffle=shuffle, seed=1)
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(len(enc)))
        for b in batches:
            cost = len(b) * max(max(len(enc[i][0]), len(enc[i][1]) + 1) for i in b)
            assert cost <= 1000 or len(b) == 1


def test_an_overlong_pair_gets_its_own_batch():
    enc = [([4] * 3, [4] * 3), ([4] * 50, [4] * 2), ([4] * 3, [4] * 4)]
    batches = data.make_batches(enc, 20, shuffle=False)
    assert [1] in batches and sorted(i for b in batches for i in b) == [0, 1, 2]


def test_a_training_batch_never_holds_one_real_token_on_a_side():
    """Issue 30: a one-token source sentence alone in its batch (--batch-tokens 4) crashed
    BatchNorm, whose statistics need two tokens. In training it joins a neighbour; evaluation's
    batches are as cut."""
    # (S, T): (1, 3) (2, 3) (3, 2)...
    enc = [([4], [5, 6]), ([4, 5], [6, 7]), ([4, 5, 6], [7]), ([4, 5], [6, 7, 8])]
    assert data.make_batches(enc, 4, shuffle=False) == [[0], [1], [2], [3]]
    m = tiny_model(norm="batch").train()
    for seed in range(5):
        batches = data.make_batches(enc, 4, shuffle=True, seed=seed)
        assert sorted(i for b in batches for i in b) == [0, 1, 2, 3] and [0] not in batches
        for b in batches:
            x = data.collate(enc, b)
            assert (
                min(int(x.src.ne(PAD).sum()), x.n_tgt) >= 2
                and m(x.src, x.tgt_in, x.tgt_out)[0].isfinite()
            )


def test_batches_are_reproducible_from_seed_and_epoch(toy):
    enc = toy[3]
    a = data.make_batches(enc, 2000, shuffle=True, seed=7, epoch=3)
    assert a == data.make_batches(enc, 2000, shuffle=True, seed=7, epoch=3)
    assert a != data.make_batches(enc, 2000, shuffle=True, seed=7, epoch=4)
    assert a != data.make_batches(enc, 2000, shuffle=True, seed=8, epoch=3)


def test_padding_share_is_low(toy):
    enc = toy[3]
    share = data.padding_share(enc, data.make_batches(enc, 4096, shuffle=True, seed=1))
    assert share <= 0.10
    assert data.padding_share(enc, [[i] for i in range(len(enc))]) < 0.5 + 1e-9


@pytest.mark.parametrize("multiple", [1, 8])
def test_padding_share_counts_what_collate_pads(toy, multiple):
    enc = toy[3]
    batches = data.make_batches(enc, 1024, shuffle=True, seed=2)[:20]
    real = padded = 0
    for b in batches:
        x = data.collate(enc, b, multiple=multiple)
        real, padded = (
            real + int(x.src.ne(PAD).sum()) + x.n_tgt,
            padded + x.src.numel() + x.tgt_out.numel(),
        )
    assert data.padding_share(enc, batches, multiple) == pytest.approx(1 - real / padded)


def test_collate_shifts_the_target():
    enc = [([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])]
    b = data.collate(enc, [0, 1])
    assert b.src.tolist() == [[5, 6, 7], [5, PAD, PAD]]  # (B, S)
    assert b.tgt_in.tolist() == [[BOS, 8, 9, PAD, PAD], [BOS, 8, 9, 10, 11]]  # (B, T)
    assert b.tgt_out.tolist() == [[8, 9, EOS, PAD, PAD], [8, 9, 10, 11, EOS]]
    assert b.src.dtype == b.tgt_in.dtype == torch.long
    assert b.n_tgt == 8


# --- word dropout -----------------------------------------------------------


def test_word_dropout():
    x = torch.tensor([[5, 6, 7, PAD], [BOS, 9, PAD, PAD]])
    before = x.clone()
    y = data.word_dropout(x, 0.0)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()  # identity, a copy
    y = data.word_dropout(x, 1.0)
    assert torch.equal(x, before)  # input untouched
    assert y.tolist() == [[UNK, UNK, UNK, PAD], [UNK, UNK, PAD, PAD]]
    g = torch.Generator().manual_seed(0)
    big = torch.randint(4, 1000, (200, 500))
    big[:, 400:] = PAD
    out = data.word_dropout(big, 0.1, generator=g)
    assert (out[:, 400:] == PAD).all()  # PAD never changes
    rate = (out[:, :400] == UNK).float().mean().item()
    assert abs(rate - 0.1) < 0.005


# --- QKNorm length statistic ------------------------------------------------


def test_length_percentile_matches_a_hand_computed_value():
    # Source lengths 1, 2, 3, 4 and target lengths 5, 6, 7, 8, pooled: 1..8.
    enc = [([4] * n, [4] * (n + 4)) for n in (1, 2, 3, 4)]
    # Linear interpolation at rank 0.975 * (8 - 1) = 6.825: 7 + 0.825 * (8 - 7).
    assert math.isclose(data.length_percentile(enc), 7.825)
    assert math.isclose(data.length_percentile(enc, q=50), 4.5)
    # With the decoder's +1 the targets are 6..9: pooled 1,2,3,4,6,7,8,9.
    assert math.isclose(data.length_percentile(enc, q=50, count_bos_eos=True), 5.0)


def test_qk_g0():
    assert math.isclose(model.qk_g0(72), math.log2(72 * 72 - 72))
    assert round(model.qk_g0(72), 2) == 12.32
    with pytest.raises(ValueError):
        model.qk_g0(1)
