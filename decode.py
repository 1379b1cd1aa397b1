"""decode.py -- chapter 4: searching, scoring and looking inside a trained model.

Reading order: norms.py -> model.py -> data.py -> decode.py -> train.py.
Shapes: B sentences, S source length, K beam size, V vocabulary, n the rows still decoding.

    python decode.py RUN                                  # stdin -> stdout, best checkpoint
    python decode.py RUN --input test.src --ref test.tgt  # BLEU, chrF (signatures) on stderr;
    --json FILE python decode.py RUN --average 5 --input test.src --ref test.tgt --ppl
    python decode.py --compare baseline.hyp sys1.hyp sys2.hyp --ref test.tgt   # significance
    (--test bs|ar) python decode.py RUN --attention "a source sentence" --layer 0 --head 0 --kind
    cross python decode.py RUN --g-table          python decode.py RUN --input dev.src --benchmark
    python decode.py LM_RUN --ppl --input test.txt        # a language model: perplexity of a text
    python decode.py LM_RUN --generate "the company said" --sample --temperature 0.8

Contents
  1. Incremental decoding: encode once, then one token per step with cached keys/values
  2. The length penalty (GNMT [7])
  3. Greedy search
  4. Beam search (batched over sentences and beams)
  5. Translating many lines
  6. Scores: SacreBLEU's BLEU, chrF, tokenized BLEU [8, 9]
  7. Held-out loss and perplexity ([1] Table 8)
  8. A language model ([2] Table 2): perplexity of a text, and continuing a prefix
  Appendix A: significance: paired bootstrap resampling [10], approximate randomization
  Appendix B: checkpoints: a run directory's model, and averaging them [2]
  Appendix C: looking inside: the learned g's ([1] Figures 3-4), attention maps ([3] Figures 1-2),
              the embedding's singular values ([2] Figure 6)
  Appendix D: --benchmark, the speed and BLEU of greedy and beam search
  Appendix E: pictures (--plot)
  Appendix F: the command line (python decode.py --help)
  Appendix G: plumbing: the output length limit, eval mode for a while, a score's signature

  [1] Nguyen & Salazar 2019, Transformers without Tears (TwT): beam 4, alpha 0.6, maximum
      output length = source length + 50 (the authors' code, tnq177/transformers_without_tears).
  [2] Shen et al. 2020, PowerNorm: translations from an average of the last epoch checkpoints;
      language models (Table 2), the singular values of the embedding (Figure 6).
  [3] Henry et al. 2020, Query-Key Normalization (QKNorm).
  [7] Wu et al. 2016, Google's Neural Machine Translation System (GNMT), eq. 14.
  [8] Post 2018, A Call for Clarity in Reporting BLEU Scores (SacreBLEU).
  [9] Popovic 2015, chrF.   [10] Koehn 2004, Statistical Significance Tests for MT Evaluation.
Comment markers: ``# Paper:``, ``# Note:`` (ours), ``# Code:`` (the authors' released code).
"""

import argparse
import contextlib
import copy
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
from rich.table import Column, Table
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest

import data
from data import (
    DataError,
    alpha_range,
    checkpoints,
    count,
    fraction,
    positive,
    positive_int,
    read_checkpoint,
    threads,
)
from model import (
    BOS,
    EOS,
    PAD,
    UNK,
    ModelConfig,
    MultiHeadAttention,
    Transformer,
    autocast,
    has_bf16,
)
from norms import BATCH_NORMS, timed

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------
# 1. Incremental decoding: encode the source once, then one output token per step. Each decoder
# layer's self-attention keys/values are cached and the new step's appended, so the prefix is never
# recomputed; each layer's cross-attention keys/values are computed once. DecoderCache carries them,
# one row per hypothesis (each layer appends to it in model.py's other_self_attention).
# ---------------------------------------------------------------------------------------
@dataclass
class DecoderCache:
    E: torch.Tensor  # (V, D) the (FixNorm'ed) embedding matrix, computed once
    src_pad: torch.Tensor  # (n, S) bool
    mem_kv: list  # per decoder layer: the cross-attention (k, v), each (n, H, S, Dh)
    self_kv: list  # per decoder layer: {"k", "v"} of the self-attention so far, (n, H, t, Dh)
    step: int = 0

    def select(self, rows):
        """Keep or reorder rows (beams, sentences): rows (n',) long. Returns self."""
        self.src_pad = self.src_pad.index_select(0, rows)
        self.mem_kv = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.mem_kv]
        self.self_kv = [
            {key: x.index_select(0, rows) for key, x in kv.items()} for kv in self.self_kv
        ]
        return self


def start_decoding(model, src):
    """Encode src (B, S) once: the cache for decode_step()."""
    E = model.embedding_matrix()
    memory, src_pad = model.encode(src, E)
    return DecoderCache(E, src_pad, model.memory_kv(memory), [{} for _ in model.decoder])


def decode_step(model, y, cache):
    """y (n,) the last output token of each row -> logits (n, V) of the next one; the cache
    advances."""
    h = model.decode(
        y[:, None], cache.src_pad, cache.E, cache.mem_kv, cache.self_kv, start=cache.step
    )
    cache.step += 1
    return model.output_logits(h[:, -1], cache.E)


# ---------------------------------------------------------------------------------------
# 2. Length penalty:   s(Y) = log P(Y | X) / lp(Y)
#     GNMT [7, eq. 14] (TwT and QKNorm, Code: alpha 0.6):       lp(Y) = ((5 + |Y|) / 6)^alpha
#     fairseq (Ott et al. 2019; PowerNorm, "length penalty 1.0"): lp(Y) = |Y|^alpha
# The two rank hypotheses differently for the same alpha: GNMT's 5 damps the penalty of short
# outputs.
# Note: |Y| counts every scored token, EOS included: a hypothesis that emits EOS at step t (t = 0
# for the first output token) has |Y| = t + 1, the authors' ((5 + t + 1) / 6)^alpha at step t [Code]
# and fairseq's (t + 1)^alpha; one cut at the maximum length has no EOS: |Y| = its number of tokens.
# Without the penalty (alpha = 0) beam search prefers short outputs: every extra token multiplies
# P(Y | X) by a number below 1.
# ---------------------------------------------------------------------------------------
PENALTIES = ("gnmt", "fairseq")


def length_penalty(length, alpha, kind="gnmt"):
    """lp(Y) of GNMT, ((5 + |Y|) / 6)^alpha, or of fairseq, |Y|^alpha; length = |Y| (EOS
    included)."""
    # Exercise length_penalty: begin
    return ((5.0 + length) / 6.0) ** alpha if kind == "gnmt" else float(length) ** alpha
    # Exercise length_penalty: end


# ---------------------------------------------------------------------------------------
# 3. Greedy search:  y_t = argmax_w log P(w | y_<t, x),  until EOS or the maximum length (Code:
#    source length
# + 50; _max_lengths, Appendix G). Batched with decode_step's cache; a sentence leaves the batch
# once done. EOS is forbidden at the first step, as in beam search: greedy_search =
# beam_search(beam=1) up to exact float ties.
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_search(model, src, max_len=None):
    """src (B, S) long, PAD-padded, each row with at least one token -> B token lists (no BOS/EOS).
    max_len: None (source length + 50), an int, or a (B,) tensor."""
    B, dev = src.size(0), src.device
    limit = _max_lengths(src, max_len)  # (B,)
    cache = start_decoding(model, src)
    active = torch.arange(B, device=dev)  # (n,) original index of each row
    y = torch.full((B,), BOS, dtype=torch.long, device=dev)  # (n,) last token
    hist = torch.empty(B, 0, dtype=torch.long, device=dev)  # (n, t) tokens so far
    results = [None] * B
    for t in range(int(limit.max()) + 1):  # at t = the largest limit every row is done
        done = y.eq(EOS) | (limit[active] <= t)  # (n,) emitted EOS, or at the length limit
        if done.any():
            for i in done.nonzero().flatten().tolist():
                results[active[i]] = data.content_ids(hist[i])  # the tokens before EOS
            keep = (~done).nonzero().flatten()  # rows still decoding
            if keep.numel() == 0:
                break
            active, y, hist = active[keep], y[keep], hist[keep]
            cache.select(keep)  # later steps compute less
        logp = decode_step(model, y, cache).float().log_softmax(-1)  # (n, V)  log P(w | y_<t, x)
        if t == 0:
            logp[:, EOS] = NEG_INF  # Code: EOS is never the first token
        y = logp.argmax(-1)  # (n,)  masked words have log P = -inf: never chosen
        hist = torch.cat([hist, y[:, None]], dim=1)
    return results


# ---------------------------------------------------------------------------------------
# 4. Beam search [1; Code: the beam search of tnq177/transformers_without_tears]. Each sentence
# keeps K hypotheses ("beams"), all n*K of them rows of one decoding state: one decode_step advances
#   them all. At step t: candidates  = every alive beam extended by every word w:   c = logP(y) +
#                 logP(w | y, x) every finished beam, kept as it is (it "extends with EOS at no
#                 cost")
#   ranking     = by the length-penalised score: c / lp(t + 1) for an extension,
#                 logP(y) / lp(|y|) (fixed when it finished) for a finished beam
#   new beams   = the K best candidates; an extension by EOS becomes finished.
# All extensions of a step share lp(t + 1), so they rank among themselves by log-probability; the
# penalty matters against finished beams and at the end. A sentence leaves the batch once its K
# beams have all finished (Code too).
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def beam_search(model, src, beam=4, alpha=0.6, max_len=None, return_scores=False, penalty="gnmt"):
    """src and max_len as for greedy_search -> B token lists: each sentence's best finished
    hypothesis without BOS and EOS (with return_scores, (tokens, score) pairs). penalty: "gnmt" or
    "fairseq" (section 2)."""
    B, K, dev, V = src.size(0), beam, src.device, model.cfg.vocab_size
    limit = _max_lengths(src, max_len)  # (B,)
    # B*K rows
    cache = start_decoding(model, src).select(torch.arange(B, device=dev).repeat_interleave(K))
    active = torch.arange(B, device=dev)  # (n,) original index of each sentence
    y = torch.full((B * K,), BOS, dtype=torch.long, device=dev)  # (n*K,) last token of each beam
    cum = torch.full((B, K), NEG_INF, device=dev)  # (n, K) log P(y | x) of each beam
    cum[:, 0] = 0.0  # Note: at step 0 only beam 0 is live, so the K beams are not K copies
    # (n, K) final score of a finished beam (-inf while alive)
    score = torch.full((B, K), NEG_INF, device=dev)
    finished = torch.zeros(B, K, dtype=torch.bool, device=dev)  # (n, K)
    hist = torch.empty(B, K, 0, dtype=torch.long, device=dev)  # (n, K, t) tokens so far
    results = [None] * B
    # every hypothesis has t tokens; at the largest limit all are finished
    for t in range(int(limit.max()) + 1):
        # (n, K) close alive beams at the limit
        at_limit = (limit[active] <= t)[:, None] & ~finished
        # logP / lp(t), no EOS
        score = torch.where(at_limit, cum / length_penalty(max(t, 1), alpha, penalty), score)
        finished = finished | at_limit
        done = finished.all(1)  # (n,) sentences whose K beams have all finished leave the batch
        if done.any():
            for i in done.nonzero().flatten().tolist():
                best = int(score[i].argmax())
                tokens = data.content_ids(hist[i, best])  # before EOS, less the PAD placeholders
                results[active[i]] = (tokens, float(score[i, best])) if return_scores else tokens
            keep = (~done).nonzero().flatten()  # (n',)
            if keep.numel() == 0:
                break
            rows = (keep[:, None] * K + torch.arange(K, device=dev)).flatten()  # (n'*K,)
            active, cum, score, finished, hist = (
                active[keep],
                cum[keep],
                score[keep],
                finished[keep],
                hist[keep],
            )
            y = y[rows]
            cache.select(rows)  # later steps compute less
        n = active.numel()
        logp = decode_step(model, y, cache).float().log_softmax(-1)  # (n*K, V)  log P(w | y, x)
        # Note: masked words have log P = -inf, which meets only finite numbers, -inf, lp > 0 and
        # topk: no NaN.
        if t == 0:
            logp[:, EOS] = NEG_INF  # Code: EOS is forbidden at step 0 (no empty output)
        ext = cum.view(n * K, 1) + logp  # (n*K, V)  log P(y w | x)
        ext.masked_fill_(finished.view(n * K, 1), NEG_INF)  # finished beams do not extend
        # (n, K*V)  c / lp(t+1)
        ext_scores = (ext / length_penalty(t + 1, alpha, penalty)).view(n, K * V)
        # (n, K); finished beams compete as they are
        top, idx = torch.cat([ext_scores, score], dim=1).topk(K, dim=1)
        is_ext = idx < K * V  # (n, K) an extension (else a kept finished beam)
        parent = torch.where(is_ext, idx // V, idx - K * V)  # (n, K) the beam it comes from
        # (n, K) only when fewer than K finite candidates exist; emits PAD, not a masked word
        dead = top.eq(NEG_INF)
        word = torch.where(is_ext & ~dead, idx % V, PAD)  # (n, K) appended token
        # (n, K) log P(y | x), unread once finished
        cum = ext.view(n, K * V).gather(1, idx.clamp(max=K * V - 1))
        finished = ~is_ext | word.eq(EOS) | dead  # (n, K)
        score = top.masked_fill(~finished, NEG_INF)  # EOS: c / lp(t+1); kept: unchanged
        hist = torch.cat(
            [hist.gather(1, parent[:, :, None].expand(-1, -1, t)), word[:, :, None]], dim=2
        )
        # each beam: its parent's cache
        cache.select((torch.arange(n, device=dev)[:, None] * K + parent).flatten())
        y = word.masked_fill(finished, EOS).flatten()  # finished rows are fed EOS, output ignored
    return results


# ---------------------------------------------------------------------------------------
# 5. Translating many lines: BPE-encode, batch by length with data.make_batches (longest batch
# first, so an out-of-memory error shows at once), search, put back in order, detokenize.
# ---------------------------------------------------------------------------------------
@dataclass
class Search:
    """How to search; TwT's defaults (Code: beam 4, alpha 0.6, output length |x| + 50)."""

    beam: int = 4  # 1 = greedy search
    alpha: float = 0.6  # the length penalty's alpha
    max_len_b: int = 50  # at most |x| + max_len_b output tokens
    # a longer source (BPE tokens) is cut to it: one huge line cannot exhaust memory
    max_src_len: int = 1024
    bf16: bool = True  # bf16 autocast on CUDA (model.autocast); False: fp32
    # the length penalty (section 2): gnmt (TwT, QKNorm) or fairseq (PowerNorm)
    penalty: str = "gnmt"


def translate(
    model, tokenizer, lines, search=Search(), batch_tokens=4096, progress=False, ids=False
):
    """Source lines -> detokenized outputs in order (empty -> empty), or with ids=True their output
    token ids (no BOS/EOS); batches of batch_tokens (sentences x longest)."""
    device = next(model.parameters()).device
    # C++ threads
    encoded = [x[: search.max_src_len] for x in tokenizer.encode(list(lines))] if lines else []
    outputs = [[] for _ in encoded]  # an empty (or blank) line translates to an empty line
    todo = [i for i, x in enumerate(encoded) if x]
    sources = [(encoded[i], []) for i in todo]  # no target: batched by source length alone
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        # on stderr, gone when done
        console=Console(stderr=True),
        transient=True,
        disable=not progress,
    )
    # train.py calls us mid-training: its mode comes back
    with bar, evaluating(model), autocast(device, search.bf16):
        task = bar.add_task("translating", total=len(todo))
        for b in reversed(data.make_batches(sources, batch_tokens, shuffle=False)):
            src = data.collate(sources, b, device).src  # (B, S)
            limit = src.ne(PAD).sum(1) + search.max_len_b  # (B,)  |x| + b output tokens at most
            hyps = (
                greedy_search(model, src, limit)
                if search.beam == 1
                else beam_search(
                    model, src, search.beam, search.alpha, limit, penalty=search.penalty
                )
            )
            for j, h in zip(b, hyps):  # back to the original order
                outputs[todo[j]] = h
            bar.update(task, advance=len(b))
    return outputs if ids else [tokenizer.decode(h) for h in outputs]


# ---------------------------------------------------------------------------------------
# 6. Scoring [8, 9]: the same outputs, three numbers.
#   tokenized BLEU  what the papers report. Paper [1] appendix A: "We report tokenized BLEU with
#   multi-bleu.perl";
#                   [2] too; [3] for en-vi only (its 4 TED pairs: multi-bleu-detok.perl).
#                   multi-bleu.perl splits on whitespace, so the number depends on the tokenization
#                   before scoring; SacreBLEU, tokenize="none", on the same text reproduces it
#                   exactly (Code: 32.49, 33.24 on the TwT and QKNorm tst2013 outputs).
#   SacreBLEU       BLEU on detokenized text with SacreBLEU's 13a tokenizer, with its signature.
#   chrF            character n-gram F-score [9] (beta 2): no tokenization at all.
# Note: our corpora are raw text and the model writes raw text: for a multi-bleu.perl-style number
# both sides are 13a-tokenized first, then scored with tokenize="none" (on raw text: SacreBLEU's 13a
# BLEU, unsmoothed). Corpora tokenized beforehand (IWSLT'15 en-vi as the TwT authors ship it):
# already_tokenized=True (--tokenized).
# ---------------------------------------------------------------------------------------
def bleu(hyps, refs, lowercase=False):
    """SacreBLEU (13a, detokenized) with .signature, e.g. "nrefs:1|case:mixed|eff:no|tok:13a|...";
    lowercase: case-insensitive ("case:lc"), as [2] reports on IWSLT14. Note: force=True silences
    SacreBLEU's "you forgot to detokenize" warning (the built-in corpus writes " ." like tokenized
    text); score and signature stay."""
    return _score(BLEU(force=True, lowercase=lowercase), hyps, refs)


def tokenized_bleu(hyps, refs, already_tokenized=False, lowercase=False):
    """multi-bleu.perl-style BLEU (with .signature): 13a-tokenize both sides (tokenize="13a") unless
    already_tokenized (tokenize="none"). Note: smooth_method="none" as in multi-bleu.perl (0 when an
    n-gram order has no match)."""
    tokenize = "none" if already_tokenized else "13a"
    return _score(
        BLEU(tokenize=tokenize, smooth_method="none", lowercase=lowercase, force=True), hyps, refs
    )


def chrf(hyps, refs, lowercase=False):
    """Corpus chrF2 [9]: a sacrebleu CHRFScore (with .signature)."""
    return _score(CHRF(lowercase=lowercase), hyps, refs)


# ---------------------------------------------------------------------------------------
# 7. Held-out loss and perplexity ([1] Table 8), teacher-forced; n = all target tokens y_1..y_m,
#   EOS: NLL      = sum_t -log p(y_t | y_<t, x)                                   ppl = exp(NLL / n)
#   smoothed = sum_t (1 - eps) (-log p(y_t)) + eps mean_{w in A} (-log p(w))    exp(smoothed / n)
# with A the target vocabulary. The smoothed loss is the training objective (model.py), so its
# perplexity is what [1] Table 8 lists; by Jensen, per token smoothed >= (1-eps) NLL + eps log|A|.
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_loss(model, encoded, batch_tokens, smoothing, bf16=True):
    """(label-smoothed loss sum, NLL sum, target tokens) of encoded pairs, teacher-forced, in eval
    mode."""
    device, total, nll_total, n = next(model.parameters()).device, 0.0, 0.0, 0
    with evaluating(model), autocast(device, bf16):
        for idx in data.make_batches(encoded, batch_tokens, shuffle=False):
            b = data.collate(encoded, idx, device)
            loss, nll = model(b.src, b.tgt_in, b.tgt_out, smoothing)
            total, nll_total, n = total + loss.item(), nll_total + nll.item(), n + b.n_tgt
    return total, nll_total, n


def perplexity(model, tokenizer, pairs, label_smoothing=0.1, batch_tokens=4096, bf16=True):
    """pairs [(src, tgt)] of raw text -> dict(smoothed_ppl, ppl, smoothed_loss, nll, n_tokens),
    the losses per target token (EOS included). Pairs with an empty source are skipped."""
    if not (encoded := [e for e in data.encode_pairs(tokenizer, list(pairs)) if e[0]]):
        raise DataError("perplexity: no pair with a non-empty source")
    total, nll_total, n = evaluate_loss(model, encoded, batch_tokens, label_smoothing, bf16)
    return {
        "smoothed_ppl": math.exp(total / n),
        "ppl": math.exp(nll_total / n),
        "smoothed_loss": total / n,
        "nll": nll_total / n,
        "n_tokens": n,
    }


# ---------------------------------------------------------------------------------------
# 8. A language model ([2] Table 2). Perplexity is the field's: the text as one stream cut into
# segments (data.py section 8), every token predicted once from the ones before it in its segment:
#   ppl = exp(NLL / n),  n = the text's tokens + one EOS a sentence;  per word: exp(NLL / (words +
#   EOS))
# (the same NLL; under BPE n counts pieces, so per-word perplexity is the one comparable across
# vocabularies).
# ---------------------------------------------------------------------------------------
def lm_perplexity(model, tokenizer, lines, seq_len, batch_tokens=4096, bf16=True, context=0):
    """dict(ppl, nll, n_tokens, word_ppl, n_words, unk_tokens, unk_share) of text lines (empty lines
    skipped, as training does). context N > 0: each token with at least N tokens before it ([2] A.2,
    as Transformer-XL evaluates), in windows of seq_len tokens that slide by seq_len - N
    (data.lm_windows). Note: the window stays seq_len, the positions the model trained on (a softmax
    model scored with longer windows got worse: its positions past seq_len were never trained)."""
    lines = [line for line in lines if line]  # none: DataError (data.lm_windows)
    segments = data.lm_windows(data.lm_stream(tokenizer, lines), seq_len, context)
    _, nll, n = evaluate_loss(model, segments, batch_tokens, 0.0, bf16)
    words = sum(len(line.split()) + 1 for line in lines)  # + EOS each
    # papers' OOV rate: scored targets that are UNK (PTB's <unk>, new words)
    unknown = int(segments.y.eq(UNK).sum())
    return {
        "ppl": math.exp(nll / n),
        "nll": nll / n,
        "n_tokens": n,
        "word_ppl": math.exp(nll / words),
        "n_words": words,
        "unk_tokens": unknown,
        "unk_share": unknown / n,
    }


@torch.no_grad()
def generate(model, tokenizer, prefix, seq_len, max_tokens=50, temperature=0.0, seed=0):
    """The prefix continued until EOS or max_tokens, each token predicted from the last seq_len: the
    most probable one (temperature 0, greedy) or drawn from softmax(logits / temperature)
    (--sample)."""
    ids, rng = [EOS] + tokenizer.encode(prefix), torch.Generator().manual_seed(seed)
    start = len(ids)
    with evaluating(model):
        for _ in range(max_tokens):
            # the context the model was trained with
            x = torch.tensor([ids[-seq_len:]], device=model.embed.device)
            logits = model.logits(None, x)[0, -1].float().cpu()  # (V,) -inf at PAD and BOS
            nxt = (
                int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=rng))
                if temperature > 0
                else int(logits.argmax())
            )
            if nxt == EOS:
                break
            ids.append(nxt)
    return tokenizer.decode(ids[1:start]), tokenizer.decode(ids[start:])


# =======================================================================================
# Appendix A: significance [10] as SacreBLEU tests it: corpus BLEU and chrF, each system against one
# baseline. Paired bootstrap resampling (Koehn 2004, the test of [1] and [3]; --test bs): draw
# n_samples test sets of the same size from the real one, with replacement, the same sentence
# indices for both systems, and score both on each. The spread of a system's score over the draws
# gives its 95% confidence interval; how often the difference is as large as the real one, once the
#   draws are centred on "no difference", gives the p-value: p = (#{s : |d_s| - mean_s |d_s| >
#   |score_sys - score_base|} + 1) / (n_samples + 1)
# Paired approximate randomization (Riezler and Maxwell 2005; --test ar) swaps each sentence's two
# outputs with probability 1/2, n_samples times:   p = (#{s : |d_s| > |score_sys - score_base|} + 1)
# / (n_samples + 1).
# Note: we call SacreBLEU's own implementation (sacrebleu.significance.PairedTest; "bs" ports Moses'
# bootstrap-hypothesis-difference-significance.pl); the CI is mean +- half the 2.5%..97.5%
# percentile range.
# =======================================================================================
def paired_test(
    hyps,
    refs,
    test="bs",
    n_samples=0,
    seed=12345,
    already_tokenized=False,
    lowercase=False,
    names=None,
):
    """The systems hyps[1:] against the baseline hyps[0] -> dict: "test", "n_samples" (0:
    SacreBLEU's default, 1000 for bs, 10000 for ar), "signatures" ({metric: signature}), "rows" (the
    baseline's, then each system's: {metric: {"score", "mean", "ci" (resampled mean, 95% half-width;
    None under ar, as SacreBLEU's CLI), "delta" (system - baseline), "p_value" (None for the
    baseline), "undecidable" (why p is 1, see below; else "")}}). names: the outputs' and the
    references' names, for the error when line counts differ. Note: SacreBLEU takes seed 0 as
    none."""
    hyps, refs = [list(h) for h in hyps], list(refs)
    names = names or [*(f"system {i}" for i in range(len(hyps))), "references"]
    if len({len(x) for x in (*hyps, refs)}) > 1:
        raise DataError(
            "line counts differ: "
            + ", ".join(f"{n} {len(x)}" for n, x in zip(names, (*hyps, refs)))
        )
    if len(hyps) < 2 or not refs:
        raise DataError(
            "a paired test needs the baseline's output and at least one system's, of one line or more"
        )
    # BLEU: SacreBLEU's, or under --tokenized the report's tokenized BLEU (as multi-bleu.perl, no
    # smoothing).
    metrics = {
        "BLEU": BLEU(tokenize="none", smooth_method="none", lowercase=lowercase, force=True)
        if already_tokenized
        else BLEU(lowercase=lowercase, force=True),
        "chrF": CHRF(lowercase=lowercase),
    }
    caller_seed = os.environ.get("SACREBLEU_SEED")
    # where SacreBLEU reads its seed
    os.environ["SACREBLEU_SEED"] = "None" if seed is None else str(int(seed))
    try:
        # reads it
        paired = PairedTest(
            list(zip(names, hyps)), metrics, [refs], test_type=test, n_samples=n_samples
        )
        signatures, scores = paired()
    finally:  # the environment as the caller had it
        os.environ.pop("SACREBLEU_SEED") if caller_seed is None else os.environ.update(
            SACREBLEU_SEED=caller_seed
        )
    out = {
        "test": test,
        "n_samples": paired.n_samples,
        "signatures": {m: str(s) for m, s in signatures.items()},
        "rows": [{} for _ in hyps],
    }
    # sacrebleu Result objects
    for metric, (b, *others) in ((m, r) for m, r in scores.items() if m != "System"):
        for i, (row, h, r) in enumerate(zip(out["rows"], hyps, (b, *others))):  # b: the baseline's
            # Note: when the two scores are equal (identical outputs, outputs that differ only in
            # spacing, both at BLEU 0) the real difference is 0; bootstrap finds no strictly larger
            # centred difference and returns its smallest p-value, 1 / (n_samples + 1),
            # "significant". There is no difference to test: we report p = 1.
            undecidable = (
                "the two outputs are identical"
                if h == hyps[0]
                else f"both outputs score {metric} 0"
                if b.score == r.score == 0
                else f"the two outputs score the same {metric}"
                if b.score == r.score
                else ""
            )
            row[metric] = {
                k: None if getattr(r, k) is None else float(getattr(r, k))
                for k in ("score", "mean", "ci")
            }
            row[metric].update(
                delta=float(r.score - b.score),
                undecidable=undecidable,
                p_value=None if i == 0 else 1.0 if undecidable else float(r.p_value),
            )
    return out


def compare(args):
    """--compare BASELINE SYSTEM [SYSTEM ...] --ref REF: the table of paired_test (a rich Table),
    its signatures and each system's verdict on stdout."""
    names = (*args.compare, args.ref)  # BASELINE, SYSTEMs, REF
    r = paired_test(
        [data.read_lines(path) for path in args.compare],
        data.read_lines(args.ref),
        args.test,
        args.samples or 0,
        args.seed,
        args.tokenized,
        args.lowercase,
        names=names,
    )
    how = {"bs": "paired bootstrap resampling", "ar": "paired approximate randomization"}[r["test"]]
    table = Table(
        Column("system", overflow="fold"),
        "metric",
        *(
            Column(col, justify="right")
            for col in (
                # the numbers right-aligned
                "score",
                "mean +- 95% CI",
                "p-value",
            )
        ),
        title=f"{how}, {r['n_samples']} samples",
    )
    # a row per system and metric; "-": none (AR gives no interval)
    for name, row in zip(names, r["rows"]):
        for metric, x in row.items():
            table.add_row(
                str(name),
                metric,
                f"{x['score']:.2f}",
                "-" if x["mean"] is None else f"{x['mean']:.2f} +- {x['ci']:.2f}",
                "-" if x["p_value"] is None else f"{x['p_value']:.4f}",
            )
    Console().print(table)
    print("\n".join(f"{metric}: {signature}" for metric, signature in r["signatures"].items()))
    for name, row in zip(names[1:], r["rows"][1:]):
        print(
            f"{name}: "
            + "; ".join(
                f"{metric} delta {x['delta']:+.2f}, p = {x['p_value']:.4f} ("
                + (
                    f"not significant: {x['undecidable']}, so there is no difference to test"
                    if x["undecidable"]
                    else f"{'' if x['p_value'] < 0.05 else 'not '}significant at 0.05"
                )
                + ")"
                for metric, x in row.items()
            )
        )


# =======================================================================================
# Appendix B: checkpoints (written by train.py, read safely by data.read_checkpoint): a run
# directory's model (load_checkpoint), and their average [2]:   theta_avg = (1/N) sum_{i=1..N}
# theta_i   over the last N epochs.
# Paper [2] (section 5.1) averages the last 10 checkpoints; Code [2]: its script averages the last 5
# epoch checkpoints (fairseq's average_checkpoints.py). Nearby points of one run averaged act like
# an ensemble at the cost of one model. Only floating-point tensors are averaged; integer and bool
# buffers come from the last checkpoint: PowerNorm's num_batches_tracked (a long) decides whether
# the layer still uses batch statistics, and a mean of counters is not a count (Code: fairseq's
# averaging crashes on it); the target-vocabulary mask `allowed` is a bool.
# =======================================================================================
def average_checkpoints(paths):
    """Checkpoint files (oldest first) -> one checkpoint dict whose "model" is their average; the
    rest is the last file's, less "optimizer" and "rng" (they belong to its weights: do not resume
    from it); "averaged_from" lists the files. Sums in float64, the first file kept beside the one
    added. DataError if models or runs (run_id) differ."""
    paths = [Path(x) for x in paths]
    if not paths:
        raise DataError("average_checkpoints: no checkpoint files given")
    ckpt = first = read_checkpoint(paths[0], "cpu")
    total = {k: v.double() for k, v in first["model"].items() if torch.is_floating_point(v)}
    for p in paths[1:]:
        ckpt = read_checkpoint(p, "cpu")
        if (
            ckpt["model"].keys() != first["model"].keys()
            or ckpt["model_config"] != first["model_config"]
            or any(v.shape != first["model"][k].shape for k, v in ckpt["model"].items())
        ):
            raise DataError(
                f"{p}: not the same model as {paths[0]} (names, shapes or model_config differ)"
            )
        # train.py's flags
        if (ckpt.get("args") or {}).get("run_id") != (first.get("args") or {}).get("run_id"):
            raise DataError(
                f"{p}: from another run than {paths[0]} (run_id differs); average one run's checkpoints"
            )
        for k in total:
            total[k] += ckpt["model"][k].double()  # sum_i theta_i
    averaged = {
        k: (total[k] / len(paths)).to(v.dtype) if k in total else v.clone()
        for k, v in ckpt["model"].items()
    }
    kept = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer", "rng")}
    return dict(kept, model=averaged, averaged_from=[str(p) for p in paths])


def load_checkpoint(path, device="cpu", average=0):
    """A .pt file or a run directory -> (model in eval mode on device, tokenizer, ckpt dict). A run
    directory gives its best checkpoint, else its last (checkpoints(dir, "decode")); with average=N
    > 0 (a run directory only) the average of its last N epoch checkpoints. The tokenizer is rebuilt
    from the sentencepiece model inside the checkpoint ("bpe_model_proto"), so a checkpoint file
    alone can translate. Otherwise DataError naming the path."""
    p = Path(path)
    if average > 0:
        if len(epochs := checkpoints(p, "average")) < average:  # a file: none
            raise DataError(
                f"{p}: --average {average} needs a run directory with {average} epoch checkpoints; it "
                f"has {len(epochs)}"
            )
        ckpt, p = average_checkpoints(epochs[-average:]), epochs[-1]
    else:
        if not (found := checkpoints(p, "decode") if p.is_dir() else [p]):  # a file: itself
            raise DataError(f"{p}: run directory has no best or last checkpoint")
        p = found[0]
        ckpt = read_checkpoint(p, device)
    try:
        model = Transformer(ModelConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        raise DataError(
            f"{p}: its model_config and weights do not make a model of this code "
            f"({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from None
    model = model.to(device).eval()
    if not isinstance(proto := ckpt.get("bpe_model_proto"), (bytes, bytearray)):
        raise DataError(
            f"{p}: has no bpe_model_proto (the sentencepiece model), so it cannot translate"
        )
    try:
        tokenizer = data.load_tokenizer(proto, f"{p}:bpe_model_proto")
    except (RuntimeError, DataError) as e:
        raise DataError(
            f"{p}: its bpe_model_proto is not a usable sentencepiece model ({e})"
        ) from None
    if tokenizer.vocab_size != model.cfg.vocab_size:
        raise DataError(
            f"{p}: tokenizer has {tokenizer.vocab_size} pieces, model {model.cfg.vocab_size}"
        )
    return model, tokenizer, ckpt


# =======================================================================================
# Appendix C: looking inside the model. First the learned g's ([1] Figures 3-4: the g of every
# ScaleNorm, by depth; [3]: QKNorm's g): every scalar g of the model, from model.learned_scales(),
#   in depth order: ScaleNorm:  y = g * x / ||x||       one g per norm (per sublayer, plus a final
#   one per stack) QKNorm:     softmax(g * Q^ K^T) V   one g per attention module
# Paper [1] section 2.3 / eq. 6: with PreNorm + ScaleNorm + FixNorm the decoder's final g multiplies
# every logit, logit_w = g cos(h, e_w) + b_w: it is the softmax temperature (Code: there is no
# separate FixNorm g). LayerNorm and RMSNorm have vector gains and are left out; a LayerNorm model
# without QKNorm has no scalar g at all.
# ---------------------------------------------------------------------------------------
_SUBLAYER = {
    "norm_attn": "self-attn",
    "norm_self": "self-attn",
    "norm_cross": "cross-attn",
    "norm_ff": "ffn",
    "self_attn": "self-attn",
    "cross_attn": "cross-attn",
}


def g_values(model):
    """[{name, stack, layer, sublayer, kind, value}] for every scalar g, in depth order: stack
    "encoder"/"decoder"; layer the 0-based layer index (the final norm: the number of layers);
    sublayer "self-attn", "cross-attn", "ffn", "final" (or "final (temp.)": the decoder's final g
    under FixNorm); kind "ScaleNorm", "QKNorm", ..."""
    out = []
    for name, value in model.learned_scales().items():
        # every g is a norm's or an attention module's
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        parts = name.split(".")
        if parts[0] in ("encoder", "decoder"):
            stack, layer, sub = parts[0], int(parts[1]), _SUBLAYER[parts[2]]
        else:  # a stack's final norm
            stack = {"enc_final_norm": "encoder", "dec_final_norm": "decoder"}[parts[0]]
            # FixNorm: logit = g cos(h, e_w) + b_w
            fixnorm = stack == "decoder" and model.cfg.fixnorm
            layer, sub = len(getattr(model, stack)), "final (temp.)" if fixnorm else "final"
        kind = "QKNorm" if isinstance(owner, MultiHeadAttention) else type(owner).__name__
        out.append(
            {
                "name": name,
                "stack": stack,
                "layer": layer,
                "sublayer": sub,
                "kind": kind,
                "value": value,
            }
        )
    # encoder first, by depth (stable)
    return sorted(out, key=lambda r: (r["stack"] != "encoder", r["layer"]))


def print_g_table(model, console=None, bar_width=12):
    """Prints the g's as a rich Table, bar length ~ |g|, on console (a rich Console; None: a new one
    on stdout), or a line saying there is none."""
    console, rows = console or Console(), g_values(model)
    if not rows:
        return console.print("no scalar g in this model (no norm with one, no QKNorm)")
    top = max(abs(r["value"]) for r in rows) or 1.0
    # the modules with a scalar g, e.g. ScaleNorm / QKNorm
    kinds = " / ".join(dict.fromkeys(r["kind"] for r in rows))
    table = Table(
        title=f"learned g ({kinds}), by depth",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for col in ("name", "layer", "sublayer", "kind", "g", "|g|"):
        table.add_column(
            col,
            justify="right" if col in ("layer", "g") else "left",
            no_wrap=True,
            min_width=bar_width if col == "|g|" else None,
        )
    for r in rows:
        bar = "#" * round(bar_width * abs(r["value"]) / top)  # length proportional to |g|
        table.add_row(
            r["name"], str(r["layer"]), r["sublayer"], r["kind"], f"{r['value']:.3f}", bar
        )
    console.print(table)


# ---------------------------------------------------------------------------------------
# The embedding's singular values ([2] Figure 6, after Gao et al. 2019): sigma_1 >= ... of the
# learned embedding matrix E (V, D), divided by sigma_1. Slow decay: the embeddings use more
# directions of the space. Note: E as trained; with --fixnorm the model reads its rows normalised to
# unit length (their lengths are left free).
# ---------------------------------------------------------------------------------------
def singular_values(model):
    sigma = torch.linalg.svdvals(model.embed.detach().double().cpu())
    return [round(x, 5) for x in (sigma / sigma[0]).tolist()]


# ---------------------------------------------------------------------------------------
# --leak: how far the batch statistics of a training forward let a causal model see the future
# ([2]'s BN and PN-V in a language model). Zero for the per-token norms. --leak-mode eval: the model
# as evaluated, zero for any causal model, positive for one that sees later tokens itself (the
# baseline's unmasked multi-linear attention, model.py B).
# ---------------------------------------------------------------------------------------
def future_leak(model, segments, t=None, seed=0, training=True):
    """One batch of segments, then the same with every token after position t replaced at random;
    the batch norms as in training (batch statistics, running ones updated on a copy;
    training=False: the model as evaluated, which shows a model that sees later tokens itself: [2]'s
    baseline with its mask unapplied), dropout off. Returns the mean |change| of log p(next token)
    at positions <= t, and those positions' perplexity before and after."""
    t = segments.x.size(1) // 2 - 1 if t is None else t
    x, y = segments.x, segments.y
    noise = torch.randint(
        4, model.cfg.vocab_size, x[:, t + 1 :].shape, generator=torch.Generator().manual_seed(seed)
    )
    changed = torch.cat([x[:, : t + 1], noise], 1)  # positions 0..t as they were, the rest random

    # a fresh copy each time: a running statistic updated by the first call is not a leak
    def logp(inp):
        m = copy.deepcopy(model).eval()
        for mod in m.modules() if training else ():
            if isinstance(mod, BATCH_NORMS):
                mod.train()
        with torch.no_grad():
            out = torch.log_softmax(m.logits(None, inp.to(m.embed.device)).float(), -1).cpu()
        return out.gather(-1, y[..., None]).squeeze(-1)[:, : t + 1]  # (N, t + 1)

    before, after = logp(x), logp(changed)
    return {
        "mean_abs_change": float((before - after).abs().mean()),
        "ppl_before": math.exp(-float(before.mean())),
        "ppl_after": math.exp(-float(after.mean())),
        "positions": t + 1,
        "segments": x.size(0),
    }


# ---------------------------------------------------------------------------------------
# Attention heatmaps ([3] Figures 1-2: attention weights with and without QKNorm). One
# teacher-forced forward of (x, BOS y) with keep_weights on the chosen module: its written-out path
# stores softmax(scores) (B, H, Tq, Tk) as last_weights; we take head h.
#   kind "enc":   encoder self-attention    rows = cols = source pieces x_1..x_S
#   kind "dec":   decoder self-attention    rows = cols = decoder inputs BOS, y_1..y_m (causal: 0
#   right of diagonal) kind "cross": decoder-encoder attention rows = the piece each position
#   predicts, y_1..y_m, EOS; cols = source
# Note: decoder row t reads input y_{t-1} (BOS at t = 1) and predicts y_t. For "cross" rows are
# labelled with the predicted piece, so a row shows where the model looked to write it (an
# alignment); for "dec" both axes are inputs.
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def attention_weights(model, tokenizer, src_line, tgt_line=None, layer=0, head=0, kind="cross"):
    """One attention map -> (weights (Tq, Tk) float CPU tensor, rows summing to 1, query_tokens,
    key_tokens), teacher-forced on tgt_line, else on the model's greedy translation. Tokens: BPE
    pieces labelling rows and columns (see above). The module's keep_weights and last_weights and
    the model's train/eval mode are restored after."""
    stack, attr = {
        "enc": ("encoder", "self_attn"),
        "dec": ("decoder", "self_attn"),
        "cross": ("decoder", "cross_attn"),
    }[kind]  # --kind's choices
    if not 0 <= layer < len(layers := getattr(model, stack)):
        raise DataError(f"--layer {layer}: the {stack} has layers 0..{len(layers) - 1}")
    module = getattr(layers[layer], attr)
    if not 0 <= head < model.cfg.heads:
        raise DataError(f"--head {head}: the model has heads 0..{model.cfg.heads - 1}")
    if not (x := tokenizer.encode(src_line)):
        raise DataError("--attention: the source sentence is empty")
    src = torch.tensor([x], device=model.embed.device)  # (1, S)
    old = (module.keep_weights, module.last_weights)  # both restored after
    try:
        with evaluating(model):
            y = greedy_search(model, src)[0] if tgt_line is None else tokenizer.encode(tgt_line)
            tgt_in = torch.tensor([[BOS] + y], device=src.device)  # (1, T)  BOS y_1..y_m
            module.keep_weights = True  # the written-out attention path, which returns the weights
            model.logits(src, tgt_in)
            w = module.last_weights[0, head].float().cpu()  # (Tq, Tk)
    finally:
        module.keep_weights, module.last_weights = old
    source, target = ([tokenizer.piece(i) for i in ids] for ids in (x, y))
    return {
        "enc": (w, source, source),
        "dec": (w, ["<s>"] + target, ["<s>"] + target),
        "cross": (w, target + ["</s>"], source),
    }[kind]


SHADES = " .:-=+*#%@"  # weight 0 -> " ", weight 1 -> "@"


def render_heatmap(weights, rows, cols, max_label=8):
    """A text heatmap of weights (R, C) in [0, 1]: each cell the shade SHADES[round(w * 9)], on an
    absolute scale (not per row) so that maps of different heads and models compare, as wide as its
    column's label (labels across the top, cut to max_label with "~")."""
    w = torch.as_tensor(weights, dtype=torch.float32)
    if w.dim() != 2 or w.shape != (len(rows), len(cols)):
        raise ValueError(
            f"weights {tuple(w.shape)} do not match {len(rows)} rows x {len(cols)} columns"
        )
    rlab, clab = (
        [t if len(t) <= max_label else t[: max_label - 1] + "~" for t in ts] for ts in (rows, cols)
    )
    rw = max([len(r) for r in rlab] + [1])
    lines = [" " * rw + " | " + " ".join(clab)]
    for r, row in zip(rlab, w.tolist()):
        cells = [
            SHADES[min(len(SHADES) - 1, max(0, round(v * (len(SHADES) - 1))))] * len(c)
            for c, v in zip(clab, row)
        ]
        lines.append(r.rjust(rw) + " | " + " ".join(cells))
    lines.append(f"shades: {SHADES!r} for weights 0 .. 1 (absolute scale)")
    return "\n".join(lines)


def figure(path, flag=None, **size):
    """A matplotlib Figure (an optional extra, not in requirements.txt, imported only here) to draw
    the PNG `path`; without it None and a line on stderr saying how to install it, or with `flag`
    DataError naming it."""
    try:
        # no pyplot: no display needed, no open figure to close
        from matplotlib import figure as matplotlib_figure

        return matplotlib_figure.Figure(**size)
    except ImportError:
        why = f"{path} needs matplotlib, which is not installed: {data.EXTRAS}"
        if flag:
            raise DataError(f"{flag} {why}") from None
        print(f"note: {why}", file=sys.stderr)


def save_heatmap_png(weights, rows, cols, path, title=None):
    """Saves the map as a PNG with matplotlib; True if written, False (and a note) without it."""
    if (
        fig := figure(path, figsize=(max(4, 0.4 * len(cols) + 2), max(3, 0.4 * len(rows) + 1.5)))
    ) is None:
        return False  # no matplotlib: figure's note said so
    # as the --svd picture
    ax = fig.add_subplot(title=title or "", yticks=range(len(rows)), yticklabels=rows)
    im = ax.imshow(
        torch.as_tensor(weights).float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto"
    )
    ax.set_xticks(range(len(cols)), cols, rotation=90)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    return True


def analyse(args, model, tokenizer):
    """--svd ([2] Figure 6's curve), --g-table and --attention: print, write nothing but the
    optional PNG."""
    if args.svd:
        sv = singular_values(model)
        marks = sorted(
            {0, len(sv) // 10, len(sv) // 4, len(sv) // 2, 3 * len(sv) // 4, len(sv) - 1}
        )
        print(
            "singular values of the embedding matrix over the largest ([2] Figure 6): "
            + ", ".join(f"sigma_{i + 1} {sv[i]:.3f}" for i in marks)
        )
        if args.png:
            fig = figure(args.png, figsize=(5, 3.5))
            ax = fig.add_subplot(
                xlabel="index", ylabel="sigma_i / sigma_1", title="embedding singular values"
            )
            ax.plot(range(1, len(sv) + 1), sv)
            fig.tight_layout()
            fig.savefig(args.png, dpi=120)
            print(f"wrote {args.png}")
    if model.cfg.lm and args.attention is not None:
        raise DataError(
            f"{args.checkpoint}: a language model: --attention draws a translator's maps"
        )
    if args.g_table:
        print_g_table(model, Console())
    if args.attention is not None:
        w, rows, cols = attention_weights(
            model,
            tokenizer,
            args.attention,
            args.attention_target,
            args.layer,
            args.head,
            args.kind,
        )
        teacher = "given target" if args.attention_target is not None else "greedy translation"
        print(
            f"{args.kind} attention, layer {args.layer}, head {args.head} ({teacher}); rows = queries"
        )
        print(render_heatmap(w, rows, cols))
        if args.png and save_heatmap_png(
            w, rows, cols, args.png, f"{args.kind} layer {args.layer} head {args.head}"
        ):
            print(f"wrote {args.png}", file=sys.stderr)


# =======================================================================================
# Appendix D: --benchmark. Speed of greedy and beam search with the BLEU each one buys, timed by
# norms.timed after a warm-up (allocator, kernels, thread pools); prints, asserts nothing.
# =======================================================================================
def benchmark(model, tokenizer, lines, refs, args, search):
    device = next(model.parameters()).device
    print(
        f"benchmark: {len(lines)} sentences on {device} (torch threads {torch.get_num_threads()}), "
        f"batch_tokens {args.batch_tokens}",
        file=sys.stderr,
    )
    # greedy, and a beam
    for search in [replace(search, beam=k) for k in (1, search.beam if search.beam > 1 else 4)]:
        # its warm-up, then its timing
        translate(model, tokenizer, lines[:32], search, args.batch_tokens, ids=True)
        ids, secs = timed(
            lambda: translate(model, tokenizer, lines, search, args.batch_tokens, ids=True), device
        )
        n_tok = sum(len(h) + 1 for h in ids)  # output tokens, EOS counted (as in training)
        name = "greedy (beam 1)" if search.beam == 1 else f"beam {search.beam}, alpha {args.alpha}"
        line = f"{name:>22}: {len(lines) / secs:8.1f} sentences/s {n_tok / secs:9.0f} target tokens/s ({secs:.2f} s)"
        if refs is not None:
            line += f"  BLEU {bleu([tokenizer.decode(h) for h in ids], refs).score:.2f}"
        print(line, file=sys.stderr)


# =======================================================================================
# Appendix E: pictures. --plot RUN [RUN ...] --out FILE.png overlays runs' metrics.jsonl (from
# train.py), as in [1] Figs. 1-4, [2] Figs. 2-4. plot_series() picks the curves (tested);
# plot_runs() draws them (matplotlib, if installed).
# =======================================================================================
def plot_series(run_dirs):
    """{panel title: [(run name, xs, ys)]}: the curves of each panel of --plot, one per run."""
    # perplexity: steadier than a short run's BLEU
    keys = {
        "dev BLEU": "dev_bleu",
        "dev perplexity": "dev_ppl",
        # the panels of one key each
        "training loss": "train_loss",
        "gradient norm (before clipping)": "gnorm",
    }
    panels = {
        t: []
        for t in (
            *keys,
            "learned g by depth (last evaluation)",
            "QKNorm g (mean over modules)",
            "batch vs running statistic, first norm",
            "embedding singular values / the largest ([2] Fig. 6)",
        )
    }
    # an attention module's g (QKNorm), not a norm's
    qknorm = lambda k: k.endswith(("self_attn.g", "cross_attn.g"))
    # [(x, y)] -> a curve
    add = lambda t, label, xy: panels[t].append((label, [x for x, _ in xy], [y for _, y in xy]))
    for run in run_dirs:
        rows, name = data.read_metrics(run), Path(run).name
        for title, key in keys.items():
            add(title, name, [(r["step"], r[key]) for r in rows if r.get(key) is not None])
        if evals := [r for r in rows if r.get("g")]:
            depth = lambda k: (
                not k.startswith("enc"),
                int(k.split(".")[1]) if k.split(".")[1].isdigit() else 1 << 30,
            )
            g = evals[-1]["g"]
            scale = sorted((k for k in g if not qknorm(k)), key=depth)  # ScaleNorm g's by depth
            add("learned g by depth (last evaluation)", name, [*enumerate(g[k] for k in scale)])
            # (step, its QKNorm g's)
            qk = [(r["step"], [v for k, v in r["g"].items() if qknorm(k)]) for r in evals]
            add(
                "QKNorm g (mean over modules)", name, [(x, sum(gs) / len(gs)) for x, gs in qk if gs]
            )
        first = (
            "encoder.0.norm_attn"
            if any("encoder.0.norm_attn" in r.get("batch_norm_stats", {}) for r in rows)
            else "decoder.0.norm_self"
        )  # a language model has no encoder
        stats = [
            (r["step"], s)
            for r in rows
            for n, s in r.get("batch_norm_stats", {}).items()
            if n == first
        ]
        if key := next(
            (k for k in ("dist_sigma2", "dist_psi2") if stats and k in stats[0][1]), None
        ):
            add(
                "batch vs running statistic, first norm",
                f"{name} ({key})",
                [(x, s[key]) for x, s in stats],
            )
        # the finished run's embedding ([2] Figure 6), from results.json; none while not finished
        # (no results.json yet)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            sv = json.loads((Path(run) / "results.json").read_text())["embedding_singular_values"]
            add("embedding singular values / the largest ([2] Fig. 6)", name, [*enumerate(sv, 1)])
    return panels


def plot_runs(run_dirs, out):
    """--plot: draw plot_series() into out (PNG, checked by run); DataError (one line) without
    matplotlib."""
    fig = figure(out, "--out")
    # only panels with data
    panels = {t: c for t, c in plot_series(run_dirs).items() if any(xs for _, xs, _ in c)}
    rows = -(-max(len(panels), 1) // 3)
    fig.set_size_inches(15, 4 * rows)
    for i, (title, curves) in enumerate(panels.items()):
        xlabel = (
            "layer (encoder, then decoder)"
            if "depth" in title
            else "index"
            if "singular" in title
            else "step"
        )
        log = any(w in title for w in ("gradient", "statistic", "perplexity"))
        # as the --svd picture
        ax = fig.add_subplot(rows, 3, i + 1, xlabel=xlabel, yscale="log" if log else "linear")
        for name, xs, ys in curves:
            if xs:
                # a point
                ax.plot(
                    xs,
                    ys,
                    label=name,
                    marker="o" if "depth" in title or len(xs) == 1 else None,
                    lw=1,
                )
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}", file=sys.stderr)


# =======================================================================================
# Appendix F: the command line: its flags (python decode.py --help) and what main() does.
# =======================================================================================
def attached_punctuation(lines):
    """The share of whitespace tokens that are a word with punctuation attached ("dog." "cat,"):
    about 5-15% in raw English or German, ~0 in Moses-tokenized text; --tokenized on raw text scores
    them as words (no paper's BLEU)."""
    tokens = [w for line in lines for w in line.split()]
    glued = sum(len(w) > 1 and w[-1] in ".,!?;:" and w[:-1].isalpha() for w in tokens)
    return glued / max(len(tokens), 1)


def count_long(tokenizer, lines, max_src_len):
    """How many lines translate() cuts (longer than max_src_len BPE tokens), for the caller to say
    so."""
    return sum(len(x) > max_src_len for x in tokenizer.encode(list(lines))) if lines else 0


def scores(hyps, refs, already_tokenized=False, lowercase=False):
    """Section 6's scores for --json and train.py's results.json: {"bleu", "chrf",
    "tokenized_bleu"}, each the dict SacreBLEU's CLI writes (--format json): name, score (2
    decimals), signature and its fields, BLEU's verbose_score."""
    tb = tokenized_bleu(hyps, refs, already_tokenized, lowercase)
    # not the headline: 0 when an n-gram order has no match
    tb.name = "tokenized BLEU (unsmoothed, as multi-bleu.perl)"
    return {
        key: json.loads(s.format(signature=s.signature, is_json=True))
        for key, s in (
            ("bleu", bleu(hyps, refs, lowercase)),
            ("chrf", chrf(hyps, refs, lowercase)),
            ("tokenized_bleu", tb),
        )
    }


def score_report(scored):
    """One line from scores()'s dict, the headline first, each as SacreBLEU prints it
    ("BLEU|nrefs:1|... = 3.40")."""
    return " | ".join(
        f"{s['name']}|{s['signature']} = {s['score']:.2f} {s.get('verbose_score', '')}".rstrip()
        for s in scored.values()
    )


def build_parser():
    ap = argparse.ArgumentParser(
        description="Translate with a trained checkpoint (beam search or greedy), score it "
        "(tokenized BLEU, SacreBLEU, chrF), test significance, and look inside the model."
    )
    ap.add_argument(
        "checkpoint",
        nargs="?",
        help="a checkpoint .pt file, or a run directory "
        "(its best checkpoint, else its last); not needed with --compare",
    )
    ap.add_argument("--input", help="source text, one sentence a line (default: stdin)")
    ap.add_argument("--output", help="where to write translations, one a line (default: stdout)")
    ap.add_argument(
        "--ref",
        help="reference translations: print SacreBLEU's BLEU and chrF, then the tokenized BLEU "
        "(unsmoothed, as multi-bleu.perl), each with its signature, on stderr",
    )
    ap.add_argument(
        "--json",
        metavar="FILE.json",
        help="with --ref: also the scores, as SacreBLEU's CLI writes them",
    )
    ap.add_argument(
        "--tokenized",
        action="store_true",
        help="the references (and so the outputs) are already "
        "tokenized, e.g. the Moses-tokenized IWSLT'15 en-vi of [1] or the TED pairs as shipped: tokenized "
        "BLEU scores them as they are, which is exactly multi-bleu.perl ([1] appendix A). Without it, raw "
        "text is 13a-tokenized first (prepare de-en writes raw text: leave it off there)",
    )
    ap.add_argument(
        "--lowercase",
        action="store_true",
        help="case-insensitive BLEU and chrF (PowerNorm [2] reports case-insensitive BLEU on IWSLT14)",
    )
    ap.add_argument(
        "--beam",
        type=positive_int,
        help="beam size; 1 = greedy search (default: the run's test beam, as "
        "train.py used it; TwT: 4)",
    )
    ap.add_argument(
        "--alpha",
        type=alpha_range,
        help="length penalty alpha (default: the run's; TwT: 0.6 with gnmt; "
        "PowerNorm: 1.0 with fairseq)",
    )
    ap.add_argument(
        "--length-penalty",
        choices=PENALTIES,
        help="gnmt: score / ((5 + |Y|) / 6)^alpha (Wu et al. 2016; "
        "TwT, QKNorm); fairseq: score / |Y|^alpha (Ott et al. 2019; PowerNorm); default: the run's",
    )
    ap.add_argument(
        "--max-len-b",
        type=count,
        default=50,
        help="maximum output length = source length + this (TwT code: 50)",
    )
    ap.add_argument(
        "--max-len",
        type=positive_int,
        default=1024,
        help="source lines longer than this (BPE tokens) are "
        "cut to it, with a count on stderr (one huge line must not exhaust memory)",
    )
    ap.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available"
    )
    ap.add_argument(
        "--dtype",
        default="bf16",
        choices=["bf16", "fp32"],
        help="on CUDA: bf16 autocast (default) or fp32 throughout; the CPU always computes in fp32",
    )
    ap.add_argument(
        "--batch-tokens",
        type=positive_int,
        help="source tokens per batch (sentences x longest length), "
        "a language model's tokens per batch (default: the run's, as its own dev and test; else 4096)",
    )
    ap.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
    ap.add_argument(
        "--threads", type=threads, help="CPU threads (torch.set_num_threads; default: torch's)"
    )
    ap.add_argument(
        "--reference",
        action="store_true",
        help="run every equation as written, with no fast path anywhere (norms.py section 1)",
    )
    ap.add_argument(
        "--benchmark",
        action="store_true",
        help="time greedy (beam 1) and beam search on --input "
        "(after a warm-up); print sentences/s, target tokens/s and, with --ref, the BLEU of each",
    )
    ev = ap.add_argument_group("evaluation and analysis")
    ev.add_argument(
        "--average",
        type=count,
        default=0,
        metavar="N",
        help="translate with the average of the run "
        "directory's last N epoch checkpoints (PowerNorm's released script: 5; its paper: 10); floats "
        "are averaged, integer/bool buffers copied",
    )
    ev.add_argument(
        "--ppl",
        action="store_true",
        help="with --ref: also print the label-smoothed and plain perplexity (teacher forced, "
        "[1] Table 8); a language model: the perplexity of the text of --input (or stdin)",
    )
    ev.add_argument(
        "--label-smoothing",
        type=fraction,
        default=None,
        help="epsilon for --ppl (default: the checkpoint's training value, else 0.1)",
    )
    ev.add_argument(
        "--compare",
        nargs="+",
        metavar="FILE",
        help="BASELINE SYSTEM [SYSTEM ...]: a paired test "
        "(SacreBLEU's) of each system's output file against the baseline's, on --ref: BLEU and chrF, 95%% "
        "CI, p-value; no checkpoint needed",
    )
    ev.add_argument(
        "--test",
        choices=["bs", "ar"],
        default="bs",
        help="--compare's test: paired bootstrap resampling "
        "(Koehn 2004) or paired approximate randomization (Riezler and Maxwell 2005)",
    )
    ev.add_argument(
        "--samples",
        type=positive_int,
        help="bs resamples or ar trials of --compare (default 1000, 10000)",
    )
    ev.add_argument(
        "--seed",
        type=int,
        default=12345,
        help="resampling seed for --compare (SacreBLEU's default); --sample's seed",
    )
    ev.add_argument(
        "--attention",
        metavar="SOURCE",
        help="print the attention map of this source sentence (QKNorm "
        "[3] Figures 1-2), teacher-forced on --attention-target or the model's own greedy translation",
    )
    ev.add_argument(
        "--attention-target", metavar="TARGET", help="the target sentence for --attention"
    )
    ev.add_argument("--layer", type=int, default=0, help="layer of --attention (0-based)")
    ev.add_argument("--head", type=int, default=0, help="head of --attention (0-based)")
    ev.add_argument(
        "--kind",
        default="cross",
        choices=["cross", "enc", "dec"],
        help="--attention: decoder-encoder (cross), encoder self (enc) or decoder self (dec)",
    )
    ev.add_argument("--png", help="--attention: also save the map as a PNG (needs matplotlib)")
    ev.add_argument(
        "--g-table",
        action="store_true",
        help="print every learned scalar g (ScaleNorm, QKNorm) by depth ([1] Figures 3-4)",
    )
    ev.add_argument(
        "--plot",
        nargs="+",
        metavar="RUN",
        help="overlay training runs' curves from RUN/metrics.jsonl "
        "into --out FILE.png: dev BLEU ([1] Fig. 1), dev perplexity, training loss, gradient norm ([1] "
        "Fig. 2), learned g by depth ([1] Figs. 3-4), QKNorm's g, batch vs running statistics ([2] Figs. "
        "2-4), each panel the runs have data for; needs matplotlib (" + data.EXTRAS + ")",
    )
    ev.add_argument("--out", metavar="FILE.png", help="the picture --plot writes")
    ev.add_argument(
        "--leak",
        action="store_true",
        help="a language model: how much changing the tokens after the "
        "middle of a segment moves the predictions before it when the batch norms use batch statistics, "
        "as in training (one batch of --batch-tokens from --input)",
    )
    ev.add_argument(
        "--leak-mode",
        choices=["train", "eval"],
        default="train",
        help="--leak: the batch norms as "
        "in training, or the model as evaluated (eval: 0 for a causal model, not for an unmasked one)",
    )
    ev.add_argument(
        "--svd",
        action="store_true",
        help="print the singular values of the embedding matrix over the "
        "largest ([2] Figure 6); with --png also draw them",
    )
    lm = ap.add_argument_group("a language model (train.py --task lm)")
    lm.add_argument(
        "--generate", metavar="PREFIX", help="continue this text until EOS or --max-tokens"
    )
    lm.add_argument(
        "--sample",
        action="store_true",
        help="--generate: sample from the softmax instead of the most probable token",
    )
    lm.add_argument(
        "--temperature", type=positive, default=1.0, help="--sample: softmax(logits / T)"
    )
    lm.add_argument(
        "--max-tokens",
        type=positive_int,
        default=50,
        help="--generate: at most this many new tokens",
    )
    lm.add_argument(
        "--context",
        type=count,
        default=0,
        metavar="N",
        help="--ppl: each token predicted with at least N "
        "tokens of the text before it, in windows of --seq-len sliding by --seq-len - N ([2] A.2, "
        "Transformer-XL's evaluation); 0: non-overlapping segments (train.py's number)",
    )
    lm.add_argument(
        "--seq-len",
        type=positive_int,
        help="--ppl and --generate: the segment (context) length (default: "
        "the run's; a multi-linear attention is built for its own and takes no longer one)",
    )
    return ap


# Which flags each mode reads: decode.py's one table. A mode is chosen by its flag (the first of
# MODES given), else by the checkpoint (a translator, a language model); a flag given that its mode
# does not read is refused (idle_flag).
MODEL = {"checkpoint", "average", "device", "dtype", "reference", "threads"}
SEARCH = {"beam", "alpha", "length_penalty", "max_len_b", "max_len", "batch_tokens"}
# greedy, if at all
LOOK = MODEL | {"g_table", "attention", "attention_target", "layer", "head", "kind", "png"}
TRANSLATE = (
    MODEL
    | SEARCH
    | {
        "input",
        "output",
        "ref",
        "json",
        "tokenized",
        "lowercase",
        "progress",
        "ppl",
        "label_smoothing",
        "benchmark",
    }
)
LM = {
    "batch_tokens",
    "input",
    "ppl",
    "context",
    "leak",
    "leak_mode",
    "generate",
    "sample",
    "temperature",
    "max_tokens",
    "seed",
    "seq_len",
}
MODES = {
    "compare": {"compare", "ref", "test", "samples", "seed", "tokenized", "lowercase"},
    "plot": {"plot", "out"},
    "svd": MODEL | {"svd", "png"},
    "g_table": LOOK,
    "attention": LOOK,
    "benchmark": MODEL | SEARCH | {"benchmark", "input", "ref"},
    "a translator": TRANSLATE,
    "a language model": MODEL - {"average"} | LM,
}
# A flag that only works with another ("--sample is for --generate"), checked whatever the mode.
NEEDS = {
    "out": ("plot",),
    "context": ("ppl",),
    "leak_mode": ("leak",),
    "sample": ("generate",),
    "max_tokens": ("generate",),
    "temperature": ("sample",),
    "samples": ("compare",),
    "test": ("compare",),
    "seed": ("compare", "sample"),
    "tokenized": ("ref",),
    "lowercase": ("ref",),
    "json": ("ref",),
    "label_smoothing": ("ppl",),
    "attention_target": ("attention",),
    "png": ("attention", "svd"),
    "layer": ("attention",),
    "head": ("attention",),
    "kind": ("attention",),
}


def idle_flag(mode, given):
    """Why the first flag given that `mode` does not read (MODES) is refused, or None
    (data.idle_flag's rule)."""
    how = mode if " " in mode else "--" + mode.replace("_", "-")
    if idle := data.idle_flag([(sorted(given - MODES[mode]), False, how)], given):
        return f"{'a checkpoint' if idle[0] == '--checkpoint' else idle[0]} does nothing with {how}"


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    # the flags given a value of their own
    args.given = {f for f, v in vars(args).items() if v != ap.get_default(f)}
    # what each reads, writes
    for mode, flag, what in (("compare", "ref", "--ref"), ("plot", "out", "--out FILE.png")):
        if getattr(args, mode) and not getattr(args, flag):
            ap.error(f"--{mode} needs {what}")
    if not args.compare and not args.plot and not args.checkpoint:
        ap.error("a checkpoint (file or run directory) is needed, except with --compare or --plot")
    # SacreBLEU takes 0 as "no seed": another resampling at every run
    if args.compare and args.seed < 1:
        ap.error(f"--seed must be at least 1 for --compare (got {args.seed!r})")
    needs = [
        ((f,), args.given & set(n), " or ".join(f"--{x.replace('_', '-')}" for x in n))
        for f, n in NEEDS.items()
    ]
    if idle := data.idle_flag(needs, args.given):  # data.idle_flag's rule, as train.py's
        output = "; translations go to --output" if idle[0] == "--out" else ""
        ap.error("{} is for {}: give it too".format(*idle) + output)
    # else the checkpoint's kind chooses (run)
    mode = next((m for m in MODES if m in args.given), None)
    if mode and (why := idle_flag(mode, args.given)):
        ap.error(why)
    return args


def check_output_file(path, flag, suffix=None):
    """DataError naming the flag unless `path` can be written: not a folder, in a folder that exists
    and takes a new file (tried, not guessed from permissions), with `suffix` if given, and not a
    file of any run of train.py."""
    p = Path(path)
    if suffix and p.suffix.lower() != suffix:
        raise DataError(f"{flag} {path}: the file name must end in {suffix}")
    if p.is_dir():
        raise DataError(f"{flag} {path}: a folder, not a file")
    if is_stream(p):  # a device or a pipe (/dev/stdout, a FIFO): written as a stream
        if not os.access(p, os.W_OK):
            raise DataError(f"{flag} {path}: cannot write to it")
        return
    folder = p.resolve().parent  # a symbolic link: its file is replaced, not the link
    if not folder.is_dir():
        raise DataError(f"{flag} {path}: its folder {folder} does not exist")
    if data.is_run_file(p.resolve().name) and (
        data.run_id_of(folder / "config.json") or checkpoints(folder)
    ):
        raise DataError(
            f"{flag} {path}: a file of the run directory {folder} (train.py writes it); write elsewhere"
        )
    try:
        tempfile.TemporaryFile(dir=folder).close()  # a file made there and removed
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot write into {folder} ({e.strerror})") from None


def run(args):
    """Everything main() does, raising DataError for the user's mistakes."""
    # never what decode.py reads (--input, --ref, the checkpoint), nor a file train.py wrote
    if args.output:
        out = Path(args.output).resolve()
        for flag, path in (
            ("--input", args.input),
            ("--ref", args.ref),
            ("the checkpoint", args.checkpoint),
        ):
            if path and out.exists() and Path(path).exists() and out.samefile(path):
                raise DataError(
                    f"--output {args.output}: is {flag} {path}; write the translations elsewhere"
                )
    for flag, suffix in (("output", None), ("json", ".json"), ("png", ".png"), ("out", ".png")):
        # --json's .json: no text decode.py reads; a run's results.json is refused
        if path := getattr(args, flag):
            check_output_file(path, f"--{flag}", suffix)
    if args.compare:
        return compare(args)
    if args.plot:
        return plot_runs(args.plot, args.out)
    device = data.start_device(args)
    if device.type == "cuda" and not has_bf16(device):
        args.dtype = "fp32"  # this GPU only emulates bf16, slowly (model.has_bf16)
    # Every input is read and checked before any work; stdin is read last.
    if args.png:  # it needs matplotlib
        figure(args.png, "--png")
    lines, refs = (data.read_lines(path) if path else None for path in (args.input, args.ref))
    model, tokenizer, ckpt = load_checkpoint(args.checkpoint, device, average=args.average)
    if args.svd or args.g_table or args.attention is not None:
        return analyse(args, model, tokenizer)
    if why := idle_flag("a language model" if model.cfg.lm else "a translator", args.given):
        raise DataError(f"{args.checkpoint}: {why}")
    run_defaults(args, ckpt, model.cfg.lm)
    if model.cfg.lm:
        return language_model(args, model, tokenizer, lines)
    if args.ppl and not args.ref:
        raise DataError(
            "--ppl of a translator needs --ref (and the sources in --input or on stdin)"
        )
    return translate_and_score(
        args, model, tokenizer, ckpt, read_stdin() if lines is None else lines, refs
    )


def run_defaults(args, ckpt, lm):
    """The flags not given that default to the run's own: its checkpoint's value, checked by the
    flag's own type (not trusted), else TwT's beam 4, alpha 0.6, gnmt and label smoothing 0.1; a
    language model's segment length, else 32; the batches of the run's dev and test, else 4096 (a
    language model's NLL in the same order: results.json's ppl)."""
    saved = ckpt.get("args") if isinstance(ckpt.get("args"), dict) else {}
    parser = build_parser()
    parser.exit_on_error = False  # a value the flag refuses raises argparse.ArgumentError
    fallback = (
        {"seq_len": 32}
        if lm
        else {"beam": 4, "alpha": 0.6, "label_smoothing": 0.1, "length_penalty": "gnmt"}
    )
    for flag, default in dict(fallback, batch_tokens=4096).items():
        if getattr(args, flag) is None:
            option, v = "--" + flag.replace("_", "-"), saved.get(flag, default)
            # the flag's own type and choices (build_parser), on the value as the command line would
            # give it
            try:
                setattr(args, flag, getattr(parser.parse_args([f"{option}={v}"]), flag))
            except argparse.ArgumentError:
                raise DataError(
                    f"{args.checkpoint}: its saved {option} {v!r} is not one decode.py takes; "
                    f"give {option}"
                ) from None


def translate_and_score(args, model, tokenizer, ckpt, lines, refs):
    """A translator: translate the lines (to --output or stdout), and score them against refs."""
    if refs is not None and len(refs) != len(lines):
        raise DataError(
            f"{args.ref}: {len(refs)} lines, but {args.input or 'stdin'} has {len(lines)}"
        )
    # nothing to score or time
    if (refs is not None or args.benchmark) and not any(line.strip() for line in lines):
        what = "--ppl" if args.ppl else f"--ref {args.ref}" if refs is not None else "--benchmark"
        raise DataError(
            f"{what}: nothing to score, {args.input or 'stdin'} has no non-empty source line"
        )
    if n_long := count_long(tokenizer, lines, args.max_len):
        print(
            f"note: {n_long} source lines longer than --max-len {args.max_len} BPE tokens are cut to it",
            file=sys.stderr,
        )
    avg = f", average of {len(ckpt['averaged_from'])} epochs" if "averaged_from" in ckpt else ""
    state = ckpt.get("train_state") or {}
    print(
        f"loaded {args.checkpoint} (step {state.get('step')}, dev BLEU {(state.get('history') or [math.nan])[-1]:.2f}"
        f", {ckpt.get('src_lang', '?')}->{ckpt.get('tgt_lang', '?')}{avg}); beam {args.beam}, "
        f"{args.length_penalty} length penalty alpha {args.alpha}",
        file=sys.stderr,
    )
    search = Search(
        args.beam,
        args.alpha,
        args.max_len_b,
        args.max_len,
        args.dtype == "bf16",
        args.length_penalty,
    )
    if args.benchmark:
        return benchmark(model, tokenizer, lines, refs, args, search)
    hyps = translate(model, tokenizer, lines, search, args.batch_tokens, args.progress)
    text = "".join(h + "\n" for h in hyps)
    # atomically (a kill leaves the old file or the new one), through a
    if args.output and not is_stream(args.output):
        data.atomic_write(Path(args.output).resolve(), text)  # symbolic link to its file
    # a stream (is_stream) is appended to, not cut: /dev/stdout may be a file the shell opened (>
    # out.txt 2>&1)
    else:
        with (
            open(args.output, "a", encoding="utf-8")
            if args.output
            else contextlib.nullcontext(sys.stdout) as f
        ):
            print(text, end="", file=f, flush=True)
    args.output_written = True  # for the message of a Ctrl-C while scoring
    if refs is not None:
        if args.tokenized and (share := attached_punctuation(refs)) > 0.03:
            print(
                f"note: --tokenized, but {100 * share:.0f}% of the words of {args.ref} have punctuation attached: "
                f"it is not tokenized, so 'tokenized BLEU' scores those as words (drop --tokenized to 13a-tokenize "
                f"both sides first)",
                file=sys.stderr,
            )
        # section 6; the --json file's content
        s = scores(hyps, refs, args.tokenized, args.lowercase)
        print(score_report(s), file=sys.stderr)
        if args.json:  # atomically, as --output
            data.atomic_write(Path(args.json).resolve(), json.dumps(s, indent=2) + "\n")
        if args.ppl:
            ppl = perplexity(
                model,
                tokenizer,
                zip(lines, refs),
                args.label_smoothing,
                args.batch_tokens,
                search.bf16,
            )
            print(
                f"test perplexity: label-smoothed (eps {args.label_smoothing}) {ppl['smoothed_ppl']:.2f}, "
                f"plain {ppl['ppl']:.2f} over {ppl['n_tokens']} target tokens",
                file=sys.stderr,
            )


def is_stream(path):
    """A device, a pipe, or an open file's path (/dev/stdout, /dev/fd/N, /proc/self/fd/N: maybe a
    file the shell opened): written to, never replaced."""
    p = Path(path).absolute()
    descriptor = re.fullmatch(r"/dev/(stdout|stderr|fd/\d+)|/proc/[^/]+/fd/\d+", str(p))
    return bool(descriptor) or p.exists() and not p.is_file()


def read_stdin():
    try:
        raw = sys.stdin.buffer.read()
    except (AttributeError, ValueError, OSError):  # None, closed or unreadable
        raise DataError("stdin is closed or unreadable: give the text with --input FILE") from None
    return data.split_lines(raw, "stdin")  # undecodable bytes: DataError naming the line


def language_model(args, model, tokenizer, lines):
    """--ppl, --leak and --generate of a language model (section 8; data.py section 8)."""
    # the run's own unless given (run_defaults)
    seq_len, batch_tokens = args.seq_len, args.batch_tokens
    if model.cfg.attention == "multilinear" and seq_len > model.cfg.seq_len:
        raise DataError(
            f"--seq-len {seq_len}: {args.checkpoint} has a multi-linear attention built for segments of "
            f"{model.cfg.seq_len} tokens; give --seq-len {model.cfg.seq_len} or less"
        )
    # their text (--input or stdin), read once; its empty lines skipped, as training does
    if args.ppl or args.leak:
        if not (text := [line for line in (read_stdin() if lines is None else lines) if line]):
            raise DataError(f"{args.input or 'stdin'}: no text to score (every line is empty)")
    elif args.generate is None:
        raise DataError(
            f"{args.checkpoint}: a language model: give --ppl, --leak (with --input) or --generate PREFIX"
        )
    elif args.input:
        raise DataError("--input does nothing with --generate (its text is for --ppl and --leak)")
    if args.leak:
        if seq_len < 2:
            raise DataError(
                f"--leak: --seq-len {seq_len}: a segment needs a token after its middle to change"
            )
        segs = data.lm_segments(data.lm_stream(tokenizer, text), seq_len)
        full = segs.y.ne(PAD).all(1)  # whole segments: a padded one would score log p(PAD) = -inf
        n = max(1, batch_tokens // seq_len)
        if not full.any():
            raise DataError(
                f"--leak: {args.input or 'stdin'} is shorter than one segment of {seq_len} tokens"
            )
        r = future_leak(
            model,
            data.Segments(segs.x[full][:n], segs.y[full][:n]),
            training=args.leak_mode == "train",
        )
        print(
            f"future leak ({'batch norms as in training' if args.leak_mode == 'train' else 'the model as evaluated'})"
            f": changing tokens {r['positions'] + 1}..{seq_len} of {r['segments']} segments moves "
            f"log p(next token) at positions 1..{r['positions']} by {r['mean_abs_change']:.4f} nats on average; "
            f"their perplexity {r['ppl_before']:.2f} -> {r['ppl_after']:.2f}"
        )
    if args.ppl:
        ppl = lm_perplexity(
            model, tokenizer, text, seq_len, batch_tokens, args.dtype == "bf16", args.context
        )
        how = (
            f"at least {args.context} tokens of context"
            if args.context
            else f"segments of {seq_len}"
        )
        print(
            f"perplexity {ppl['ppl']:.2f} over {ppl['n_tokens']} tokens ({how}); per word {ppl['word_ppl']:.2f} over "
            f"{ppl['n_words']} words and EOS; unknown (<unk>) tokens: {ppl['unk_tokens']} ({ppl['unk_share']:.2%})"
        )
    if args.generate is not None:
        prefix, more = generate(
            model,
            tokenizer,
            args.generate,
            seq_len,
            args.max_tokens,
            args.temperature if args.sample else 0.0,
            args.seed,
        )
        print(f"{prefix} [{more}]" if prefix else more)


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except DataError as e:
        sys.exit(f"decode.py: error: {e}")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (data.interrupt_on_sigterm)
        unwritten = args.output and not getattr(args, "output_written", False)
        print(
            "decode.py: interrupted" + (f" ({args.output} was not written)" if unwritten else ""),
            file=sys.stderr,
        )
        return data.interrupted_status(e)
    return 0  # the exit status of every mode that ends without an error


# =======================================================================================
# Appendix G: plumbing a first reading can skip: the output length limit (sections 3-4),
# eval mode for a while (section 5), a corpus score with its signature (section 6).
# =======================================================================================
def _max_lengths(src, max_len):
    """Maximum output tokens (EOS not counted) per sentence, (B,) long. None: source length + 50
    (Code); an int: the same for all; a tensor: one per sentence. A hypothesis reaching it is closed
    as is, without EOS. Note: the authors' loop lets it take one more step, in which it may still
    emit EOS."""
    max_len = src.ne(PAD).sum(1) + 50 if max_len is None else max_len  # (B,)  |x| + 50
    # an int: B copies
    return torch.as_tensor(max_len, dtype=torch.long, device=src.device).expand(src.size(0))


@contextlib.contextmanager
def evaluating(model):
    """model.eval() for a while (no dropout, running statistics), then the mode it had."""
    was_training = model.training
    try:
        yield model.eval()
    finally:
        model.train(was_training)


def _score(metric, hyps, refs):
    score = metric.corpus_score(list(hyps), [list(refs)])
    score.signature = str(metric.get_signature())
    return score


if __name__ == "__main__":
    data.interrupt_on_sigterm()  # SIGTERM stops decoding as Ctrl-C does (exit status 143)
    sys.exit(main())
