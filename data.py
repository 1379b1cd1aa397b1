"""data.py -- chapter 3: corpus, subwords, batches, word dropout.

Reading order: norms.py -> model.py -> data.py -> decode.py -> train.py. ``python data.py`` builds
the built-in corpus (data/toy/) and summarises it (machinery/toy_corpus.py); ``python data.py
prepare NAME`` fetches one of the papers' corpora (machinery/corpora.py). A reader of the papers
never needs those machinery modules, nor machinery/fileio.py, which reads and writes the files.

Contents
  1. Reading a parallel corpus DIR/{train,dev,test}.{SRC,TGT}, with one-line errors that name the
     file and line
  2. Joint BPE with sentencepiece, a small Tokenizer, and ids back to text
  3. Encoding
  4. The target-vocabulary mask of [1]
  5. Token-budget batches with length buckets, collate (the project's one batcher), and the share
     of padding in a set of batches
  6. Word dropout [1, 11]
  7. QKNorm's length statistic L [3] (g0 from it: model.qk_g0, beside the attention)
  8. A language model's text ([2] Table 2): words or BPE, one stream, cut into segments
  Appendix A: a language model's other segments (windows for perplexity in context, [2] A.2; the
              baseline code's rows), its word vocabulary, and a run's tokenizer

Shapes: B sentences in a batch, S source length, T target length (after the BOS/EOS shift).

  [1] Nguyen & Salazar 2019, Transformers without Tears (appendix A: word dropout, vocabulary
      masks, 4k-token batches).
  [3] Henry et al. 2020, Query-Key Normalization for Transformers (eq. 3: g0 = log2(L^2 - L), L:
      97.5th percentile).
  [2] Shen et al. 2020, PowerNorm (Table 2: language models on PTB and WikiText-103).
  [11] Sennrich, Haddow & Birch 2016, Edinburgh Neural Machine Translation Systems for WMT 16.
"""

import io
import itertools
import os
import random
import re
import runpy
import sys
from collections import Counter
from dataclasses import dataclass

import sentencepiece as spm
import torch

from machinery.fileio import DataError, read_lines
from model import BOS, EOS, PAD, UNK
from norms import MIN_REAL_TOKENS


# ---------------------------------------------------------------------------------------
# 1. Reading a parallel corpus.
# ---------------------------------------------------------------------------------------
def read_parallel(src_path, tgt_path, max_len=None, drop_empty=True):
    """Aligned files -> (pairs [(src_line, tgt_line)], stats {"lines", "empty", "long", "kept"}).
    A pair with an empty side is dropped and counted in stats["empty"], on every split: an empty
    source has nothing to translate and an empty reference cannot be scored, so BLEU on dev/test is
    over the kept pairs (the caller prints the count). drop_empty=False keeps them. max_len
    (whitespace words, either side) drops long pairs, counted in stats["long"]. DataError if a file
    is missing, the files disagree, or nothing is left.
    """
    src_lines, tgt_lines = (
        read_lines(
            p,
            "a corpus directory holds {train,dev,test}.LANG, one sentence per line, "
            "e.g. train.en and train.de aligned line by line",
        )
        for p in (src_path, tgt_path)
    )
    if len(src_lines) != len(tgt_lines):
        raise DataError(
            f"{src_path} has {len(src_lines)} lines but {tgt_path} has {len(tgt_lines)}; "
            f"the two sides must be aligned line by line"
        )
    lines = list(zip(src_lines, tgt_lines, strict=True))
    n_empty = sum(not s or not t for s, t in lines)
    kept = [(s, t) for s, t in lines if (s and t) or not drop_empty]
    pairs = [
        (s, t) for s, t in kept if max_len is None or max(len(s.split()), len(t.split())) <= max_len
    ]
    n_long = len(kept) - len(pairs)
    if not pairs:
        raise DataError(
            f"{src_path} / {tgt_path}: no usable sentence pairs ({len(src_lines)} lines, "
            f"{n_empty} with an empty side, {n_long} longer than max_len={max_len})"
        )
    return pairs, {"lines": len(src_lines), "empty": n_empty, "long": n_long, "kept": len(pairs)}


# ---------------------------------------------------------------------------------------
# 2. Joint BPE (sentencepiece), and ids back to text.
# ---------------------------------------------------------------------------------------
def train_bpe(src_lines, tgt_lines, vocab_size):
    """Trains one BPE model on source + target training text, in memory; returns the model's bytes.
    Paper: [1] uses joint BPE (fastBPE, 8000 merges); one vocabulary lets the source embedding,
    target embedding and output layer be one matrix. Note: we use sentencepiece BPE with vocab_size
    pieces instead of a number of merges, and the "identity" normalization, so that
    decode(encode(s)) == s (bar runs of spaces, unseen characters) and BLEU compares the output with
    the untouched reference text. A too-small corpus gets the largest size, said on stderr.
    """
    lines, model = [line for line in list(src_lines) + list(tgt_lines) if line], io.BytesIO()

    def train(v):
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=v,
            model_type="bpe",
            character_coverage=1.0,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            normalization_rule_name="identity",
            # Deterministic: all sentences (0), in order.
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=1 << 16,
            num_threads=min(4, os.cpu_count() or 1),
            minloglevel=2,  # quiet
        )

    # Note: below 5, sentencepiece fails on a special piece's id before saying what it needs; 5
    # never fits (every corpus has its word boundary and one character), so its message follows.
    try:
        train(max(vocab_size, 5))
    except RuntimeError as e:
        if m := re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", str(e)):
            raise DataError(
                f"--bpe-size {vocab_size}: too small for this corpus, whose {int(m.group(1)) - 4} "
                f"distinct characters and 4 special pieces need at least {m.group(1)}"
            ) from None
        if not (m := re.search(r"Vocabulary size too high \((\d+)\).*<= (\d+)", str(e))):
            raise
        print(
            f"note: vocab_size {vocab_size} is too large for this corpus; using {m.group(2)}",
            file=sys.stderr,
        )
        train(int(m.group(2)))
    return model.getvalue()


class Tokenizer:
    """A thin wrapper around a sentencepiece model (its bytes, as train_bpe returns them) with our
    special ids."""

    def __init__(self, proto, name="vocabulary"):
        self.sp = spm.SentencePieceProcessor(model_proto=bytes(proto))
        # The model's bytes: what caches and checkpoints key on.
        self.proto = self.sp.serialized_model_proto()
        self.vocab_size = self.sp.get_piece_size()
        special_ids = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if special_ids != (PAD, UNK, BOS, EOS):
            raise DataError(
                f"{name}: a sentencepiece model not made by data.train_bpe (other special ids)"
            )

    def encode(self, text):
        """str -> [ids], without BOS/EOS. A list of str gives a list of lists (C++ threads)."""
        return self.sp.encode(text, out_type=int, num_threads=os.cpu_count() or 1)

    def decode(self, ids):
        """[ids] -> str: stops at the first EOS, skips PAD and BOS (content_ids, below)."""
        return self.sp.decode(content_ids(ids))

    def piece(self, i):
        return self.sp.id_to_piece(int(i))


def content_ids(ids):
    """The ids up to the first EOS, without PAD and BOS: what a tokenizer turns back into text."""
    ids = ids.tolist() if torch.is_tensor(ids) else ids
    return [int(i) for i in itertools.takewhile(lambda i: i != EOS, ids) if i not in (PAD, BOS)]


# ---------------------------------------------------------------------------------------
# 3. Encoding.
# A run encodes its text once: machinery/corpora.py's load_or_encode keeps the ids in the run
# directory, keyed by the BPE model and the text.
# ---------------------------------------------------------------------------------------
def encode_pairs(tok, pairs):
    """[(src, tgt)] -> [([src ids], [tgt ids])], no BOS/EOS (collate adds them)."""
    src, tgt = tok.encode([p[0] for p in pairs]), tok.encode([p[1] for p in pairs])
    return list(zip(src, tgt, strict=True))


def filter_long(encoded_pairs, max_len):
    """Drops pairs with more than max_len BPE tokens on either side: (kept, n_dropped).
    Note: for training data only; dropping dev or test sentences would change what BLEU is on."""
    kept = [
        (x, y)
        for x, y in encoded_pairs
        if max_len is None or (len(x) <= max_len and len(y) <= max_len)
    ]
    return kept, len(encoded_pairs) - len(kept)


# ---------------------------------------------------------------------------------------
# 4. The target vocabulary mask.
# ---------------------------------------------------------------------------------------
def target_vocab_mask(encoded_tgt_seqs, vocab_size):
    """(V,) bool, True where the decoder may output that id.
    Paper: [1] appendix A: the embeddings are shared, "but we mask out words that are not in the
    target's vocabulary at the final output layer before softmax, by setting their logits to -inf".
    Note: as in the authors' code, the target vocabulary is UNK, EOS and every id seen in the BPE'd
    target training data; PAD and BOS are never outputs.
    """
    mask = torch.zeros(vocab_size, dtype=torch.bool)  # (V,)
    mask[torch.tensor([i for seq in encoded_tgt_seqs for i in seq], dtype=torch.long)] = True
    # UNK and EOS may be output; PAD and BOS are never in a target, and the model masks them
    # (model.Transformer).
    mask[UNK] = mask[EOS] = True
    return mask


# ---------------------------------------------------------------------------------------
# 5. Batches by tokens, collate, and the share of padding.
# ---------------------------------------------------------------------------------------
def make_batches(encoded_pairs, batch_tokens, shuffle, seed=0, epoch=0):
    """Groups example indices into batches of at most batch_tokens; a list of lists.
    Cost of a batch = B * max(S, T), "sentences x the longer side's padded length" as in the
    authors' code (tnq177/transformers_without_tears); a pair longer than batch_tokens gets a batch
    of its own. Examples are sorted by (longer side, source length, target length), so that a batch
    holds similar lengths and little padding, then cut greedily. Note: sorting by the longer side
    first, the quantity the budget counts, packs tighter than by (source, target): padding falls
    from 6.0% to 3.9% at 4096 tokens on the built-in corpus. With shuffle, equal lengths are
    tie-broken at random and the batch order is shuffled, both from (seed, epoch) only, so an epoch
    can be replayed exactly; without, the sorted order (for evaluation and translation: pairs with
    an empty target batch by source length alone). A language model's segments (section 8), all L
    long, make batches of batch_tokens // L (or one). A training batch holds 2 or more real tokens a
    side, as BatchNorm needs (norms.refuse_one_token): one of fewer (a one-token source alone, a
    text's one-token last segment) takes the next example in; the last, the one before.
    """
    # lm_streams' segments (Appendix A): batch j is every row's j-th window, in order, every pass.
    if rows := getattr(encoded_pairs, "rows", 0):
        return [list(range(i, i + rows)) for i in range(0, len(encoded_pairs), rows)]
    lens = _lengths(encoded_pairs)
    rng = random.Random(seed * 1000003 + epoch)
    tie = [rng.random() for _ in lens] if shuffle else list(range(len(lens)))
    order = sorted(range(len(lens)), key=lambda i: (max(lens[i]), *lens[i], tie[i]))

    def lone(batch):  # a training batch with fewer than MIN_REAL_TOKENS real tokens on a side
        if not shuffle:
            return False
        return min(map(sum, zip(*(lens[i] for i in batch), strict=True))) < MIN_REAL_TOKENS

    batches = []
    # The longer sides ascending: a batch's cost is its size x its newest pair's longer side.
    for i in order:
        if batches and ((len(batches[-1]) + 1) * max(lens[i]) <= batch_tokens or lone(batches[-1])):
            batches[-1].append(i)
        else:
            batches.append([i])
    if len(batches) > 1 and lone(batches[-1]):
        batches[-2:] = [batches[-2] + batches[-1]]
    if shuffle:
        rng.shuffle(batches)
    return batches


def _lengths(encoded_pairs):
    """[(S, T)] of each pair, T = len(y) + 1 (the decoder reads BOS + y); a language model's
    segments: [(L,)], each one's real tokens."""
    if isinstance(encoded_pairs, Segments):
        return [(n,) for n in encoded_pairs.x.ne(PAD).sum(1).tolist()]
    return [(len(x), len(y) + 1) for x, y in encoded_pairs]


@dataclass
class Batch:
    """One padded batch, batch-first; made by collate."""

    src: torch.Tensor | None  # (B, S) source ids, PAD-padded, no BOS/EOS; None for a language model
    tgt_in: torch.Tensor  # (B, T) [BOS] + y, the decoder's input
    tgt_out: torch.Tensor  # (B, T) y + [EOS], what it must predict
    n_tgt: int  # non-pad target tokens (= tokens in the loss)


def collate(encoded_pairs, idx, device=None, multiple=1):
    """Pads the examples idx into a Batch (on device, if given), the lengths rounded up to a
    multiple of ``multiple`` (train.py --compile: 8, so that every batch has the shapes' alignment
    the compiled kernels were specialised for). A language model's segments (section 8) are padded
    already: their Batch has no source."""
    if isinstance(encoded_pairs, Segments):
        # No source; the inputs and the targets, (B, L) each.
        tensors = [None, encoded_pairs.x[list(idx)], encoded_pairs.y[list(idx)]]
    else:
        xs, ys = [encoded_pairs[i][0] for i in idx], [encoded_pairs[i][1] for i in idx]
        S = round_up(max(len(x) for x in xs), multiple)
        T = round_up(max(len(y) for y in ys) + 1, multiple)
        # Decoder input and output are the same target, shifted by one position:
        #   tgt_in  = BOS y1 ... yn        tgt_out = y1 ... yn EOS
        tensors = [
            torch.tensor([x + [PAD] * (S - len(x)) for x in xs]),  # (B, S)
            torch.tensor([[BOS] + y + [PAD] * (T - 1 - len(y)) for y in ys]),  # (B, T)
            torch.tensor([y + [EOS] + [PAD] * (T - 1 - len(y)) for y in ys]),  # (B, T)
        ]
    # tgt_out's real tokens, counted on the host, before the copy.
    n_tgt = int(tensors[-1].ne(PAD).sum())
    if device is not None:  # on CUDA from pinned host memory: the copy overlaps the last step
        cuda = torch.device(device).type == "cuda"
        tensors = [
            t if t is None else (t.pin_memory() if cuda else t).to(device, non_blocking=cuda)
            for t in tensors
        ]
    return Batch(*tensors, n_tgt=n_tgt)


def round_up(n, multiple):
    """n rounded up to a multiple of ``multiple`` (the padded lengths of collate)."""
    return -(-n // multiple) * multiple


def padding_share(encoded_pairs, batches, multiple=1):
    """Fraction of padded positions in src + tgt over all batches, with the lengths rounded up to
    a multiple of ``multiple`` as collate does."""
    # A language model's segments: only the end of the text is padding.
    if isinstance(encoded_pairs, Segments):
        return float(encoded_pairs.y.eq(PAD).float().mean())
    lens = _lengths(encoded_pairs)
    real = sum(sum(lens[i]) for b in batches for i in b)  # S + T of each pair
    padded = sum(
        len(b) * round_up(max(lens[i][side] for i in b), multiple)
        for b in batches
        for side in (0, 1)
    )
    return 1.0 - real / padded if padded else 0.0


# ---------------------------------------------------------------------------------------
# 6. Word dropout.
# ---------------------------------------------------------------------------------------
def word_dropout(x, p, generator=None):
    """A copy of x where each non-PAD token is replaced by UNK with probability p.
    Paper: [1] appendix A: "we also do word dropout (Sennrich et al., 2016a) with probability 0.1.
    However, instead of zeroing the word embeddings, we randomly replace tokens with UNK." Training
    only, on src and tgt_in, never on tgt_out (the labels). Note: like the authors' code, BOS in
    tgt_in can be dropped too. Unlike it, we never write into x: on the CPU their in-place version
    corrupts the cached batches (the UNK rate grows every epoch).
    """
    if p <= 0:
        return x.clone()
    # Exercise word_dropout: begin
    drop = torch.rand(x.shape, generator=generator, device=x.device) < p  # same shape as x
    return x.masked_fill(drop & (x != PAD), UNK)
    # Exercise word_dropout: end


# ---------------------------------------------------------------------------------------
# 7. QKNorm's length statistic.
# ---------------------------------------------------------------------------------------
def length_percentile(encoded_pairs, q=97.5, count_bos_eos=False):
    """The q-th percentile of training lengths in BPE tokens (QKNorm's L).
    Paper: [3] eq. 3, "L is the 97.5th percentile sequence length across all training data sequences
    for source and target". Note: we pool source and target lengths into one list (the paper does
    not say how; the authors hard-coded L per language pair) and interpolate linearly like
    numpy.percentile. BOS/EOS are not counted unless count_bos_eos (then the +1 the decoder sees,
    T = len(y) + 1).
    """
    src_lens = [len(x) for x, _ in encoded_pairs]
    lens = src_lens + [len(y) + int(count_bos_eos) for _, y in encoded_pairs]
    if not lens:
        raise ValueError("length_percentile: no sequences")
    return torch.quantile(torch.tensor(lens, dtype=torch.float64), q / 100.0).item()


# ---------------------------------------------------------------------------------------
# 8. A language model's text ([2] Table 2, PTB): one stream, cut into segments.
# DIR/{train,dev,test}.txt holds one sentence a line. Tokens are whitespace words (--bpe-size 0:
# WordVocab in Appendix A, the training text's words; PTB's own <unk> is UNK, and so is any word
# the training text lacks) or the BPE of section 2. The sentences are joined into one stream, each
# followed by EOS, and cut into non-overlapping segments of L tokens; a segment predicts each next
# token from the ones before it in the segment only (no memory across segments: the baseline's
# mem_len 0):
#   stream  = EOS s_1 EOS s_2 EOS ... s_n EOS      (the first EOS: the first word is predicted too)
#   input_i = stream[iL : (i+1)L],   target_i = stream[iL + 1 : (i+1)L + 1]   (last one PAD-padded)
# Perplexity is exp(mean NLL) over every target, EOS included: n = words + sentences.
# ---------------------------------------------------------------------------------------
def lm_stream(tok, lines):
    """The stream above as a 1-D LongTensor: EOS, then each line's tokens followed by EOS."""
    return torch.tensor(
        [EOS] + [i for seq in tok.encode(list(lines)) for i in seq + [EOS]], dtype=torch.long
    )


@dataclass
class Segments:
    """A stream cut into segments: inputs x (N, L) and targets y (N, L), PAD-padded at the end."""

    x: torch.Tensor
    y: torch.Tensor
    # lm_streams' segments (Appendix A): a batch is `rows` segments, in this order every pass, never
    # shuffled. 0: segments that make_batches groups by length, like sentence pairs.
    rows: int = 0

    def __len__(self):
        return self.x.size(0)


def lm_segments(stream, seq_len):
    """Segments of seq_len tokens: every token of the stream but the first is a target once."""
    n = stream.numel() - 1  # the targets
    if n < 1:
        raise DataError("no text to predict")
    # Exercise lm_segments: begin
    rows = -(-n // seq_len)
    x, y = torch.full((rows * seq_len,), PAD), torch.full((rows * seq_len,), PAD)
    x[:n], y[:n] = stream[:-1], stream[1:]
    # Exercise lm_segments: end
    return Segments(x.view(rows, seq_len), y.view(rows, seq_len))


# =======================================================================================
# Appendix A: A language model's other segments, its word vocabulary, and a run's tokenizer.
# Section 8 cuts the text once, for training and for perplexity without context. Here: windows
# that score each token with the text before it (decode.py --ppl --context N, as [2] A.2 evaluates,
# after Transformer-XL); the baseline code's rows (train.py --lm-batches streams); whitespace words
# as the vocabulary (--bpe-size 0, PTB's own); and the tokenizer of a run's vocabulary bytes.
# =======================================================================================
def lm_windows(stream, length, context):
    """Segments for perplexity with context (decode.py --ppl --context N; [2] A.2 evaluates as
    Transformer-XL does, each token with the text before it): windows of `length` inputs, each one
    `length - context` tokens after the last, scoring only its targets not scored before (the first
    window all of its own; the other targets are PAD). Every target is scored once, predicted from
    its input and at least `context` tokens before that (fewer at the very start of the text), at
    most length - 1. context 0: lm_segments' segments exactly."""
    n, stride = stream.numel() - 1, length - context
    if not 0 <= context < length:
        raise DataError(
            f"--context {context}: at most {length - 1}, less than the window (--seq-len {length})"
        )
    # The first window scores `length` targets, the others `stride` each.
    size = length + stride * len(range(length, n, stride))
    # The text as one segment of `size`, PAD-padded: the last window may be short.
    flat = lm_segments(stream, size)
    # Window k starts at k * stride.
    x, y = (t[0].unfold(0, length, stride).contiguous() for t in (flat.x, flat.y))
    # In every window but the first, the first `context` targets were scored by the one before: PAD.
    y[1:, :context] = PAD
    return Segments(x, y)


def lm_streams(stream, seq_len, rows):
    """train.py --lm-batches streams, the baseline code's batches (its data_utils.py,
    LMOrderedIterator): the text (without the stream's first EOS, which its corpus lacks) cut into
    `rows` equal rows, the rest dropped; each row into windows of seq_len inputs, each with its next
    tokens as targets (a row's last one or two tokens are never predicted). Segment j * rows + r is
    row r's j-th window, so that batches of `rows` segments, in order, hold every row's j-th window
    in batch j, and row r's text goes on in batch j + 1 (no memory carries it over: mem_len 0)."""
    n = (stream.numel() - 1) // rows  # tokens a row
    windows = (n - 1) // seq_len
    if windows < 1:
        raise DataError(
            f"the text makes rows of {n} tokens, too short for one window of --seq-len {seq_len}"
        )
    text = stream[1 : 1 + n * rows].view(rows, n)
    x, y = (
        text[:, k : k + windows * seq_len].reshape(rows, windows, seq_len).transpose(0, 1)
        for k in (0, 1)
    )
    return Segments(x.reshape(-1, seq_len), y.reshape(-1, seq_len), rows=rows)


class WordVocab:
    """--bpe-size 0: whitespace words, most frequent first, after our four special ids. Its bytes
    (`proto`, like the sentencepiece model's) are a header and one word a line."""

    HEADER, SPECIALS = b"words v1\n", ("<pad>", "<unk>", "<s>", "</s>")

    def __init__(self, proto):
        if not bytes(proto).startswith(self.HEADER):
            raise DataError("not a word vocabulary written by data.WordVocab")
        self.proto = bytes(proto)
        words = self.proto[len(self.HEADER) :].decode("utf-8").split("\n")
        self.words = list(self.SPECIALS) + words
        # A word that looks like a special token ("<s>" in the text) is an unknown word, not its id.
        self.index = {w: i for i, w in enumerate(self.words) if i > EOS} | {"<unk>": UNK}
        self.vocab_size = len(self.words)

    @classmethod
    def build(cls, lines):
        counts = Counter(w for line in lines for w in line.split() if w not in cls.SPECIALS)
        words = sorted(counts, key=lambda w: (-counts[w], w))  # most frequent first
        return cls(cls.HEADER + "\n".join(words).encode("utf-8"))

    def encode(self, text):
        """str -> [ids] (an unknown word is UNK); a list of str gives a list of lists."""
        if not isinstance(text, str):
            return [self.encode(t) for t in text]
        return [self.index.get(w, UNK) for w in text.split()]

    def decode(self, ids):
        return " ".join(self.words[i] for i in content_ids(ids))

    def piece(self, i):
        return self.words[int(i)]


def load_tokenizer(proto, name="vocabulary"):
    """The tokenizer of a run's vocabulary bytes: a WordVocab, or a sentencepiece Tokenizer."""
    return WordVocab(proto) if bytes(proto).startswith(WordVocab.HEADER) else Tokenizer(proto, name)


if __name__ == "__main__":
    # The command line (python data.py, python data.py prepare NAME) is machinery, not the book:
    # machinery/corpora.py runs as the program and reads this chapter.
    runpy.run_module("machinery.corpora", run_name="__main__")
