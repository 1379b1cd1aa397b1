"""decode.py -- chapter 4: searching, scoring and looking inside a trained model.

Reading order: norms.py -> model.py -> data.py -> decode.py -> train.py.
Shapes: B sentences, S source length, K beam size, V vocabulary, n the rows still decoding.

    python decode.py RUN                                  # stdin -> stdout, best checkpoint
    python decode.py RUN --input test.src --ref test.tgt  # BLEU, chrF (signatures) on stderr
    python decode.py RUN --input test.src --ref test.tgt --json scores.json
    python decode.py RUN --average 5 --input test.src --ref test.tgt --ppl
    python decode.py --compare base.hyp sys1.hyp sys2.hyp --ref test.tgt  # significance (--test)
    python decode.py RUN --attention "a source sentence" --layer 0 --head 0 --kind cross
    python decode.py RUN --g-table          python decode.py RUN --input dev.src --benchmark
    python decode.py LM_RUN --ppl --input test.txt        # a language model: perplexity of a text
    python decode.py LM_RUN --generate "the company said" --sample --temperature 0.8

Contents
  1. Incremental decoding: encode once, then one token per step with cached keys/values
  2. The length penalty (GNMT [7])
  3. Greedy search
  4. Beam search (batched over sentences and beams)
  5. Translating many lines
  6. Scores: SacreBLEU's BLEU, chrF, tokenized BLEU [8, 9], as SacreBLEU's CLI writes them
  7. Held-out loss and perplexity ([1] Table 8)
  8. A language model ([2] Table 2): perplexity of a text, and continuing a prefix
  Appendix A: significance: paired bootstrap resampling [10], approximate randomization
  Appendix B: checkpoints: a run directory's model, and averaging them [2]
  Appendix C: looking inside: the learned g's ([1] Figures 3-4), the embedding's singular values
              ([2] Figure 6), the future leak of batch statistics, attention maps ([3] Figures 1-2)
  Appendix D: plumbing: the output length limit, eval mode for a while, a score's signature,
              the checks behind the command line's notes
  The command line (python decode.py --help: its modes, file checks, --benchmark) is
  machinery/decode_cli.py, its pictures (--plot, --png) machinery/plots.py.

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

import contextlib
import copy
import json
import math
import os
import runpy
from dataclasses import dataclass
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
from rich.table import Column, Table
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest

import data
from machinery import fileio
from machinery.fileio import DataError
from machinery.rundir import checkpoints, read_checkpoint
from model import BOS, EOS, PAD, UNK, ModelConfig, MultiHeadAttention, Transformer, autocast
from norms import BATCH_NORMS

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------
# 1. Incremental decoding: encode the source once, then one output token per step.
# Each decoder layer's self-attention keys/values are cached and the new step's appended, so the
# prefix is never recomputed; each layer's cross-attention keys/values are computed once.
# DecoderCache carries them, one row per hypothesis (each layer appends to it in model.py's
# other_self_attention).
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
    """y (n,), each row's last output token -> the logits (n, V) of its next; the cache advances."""
    h = model.decode(
        y[:, None], cache.src_pad, cache.E, cache.mem_kv, cache.self_kv, start=cache.step
    )
    cache.step += 1
    return model.output_logits(h[:, -1], cache.E)


# ---------------------------------------------------------------------------------------
# 2. The length penalty: a hypothesis Y scores s(Y) = log P(Y | X) / lp(Y).
#     GNMT [7, eq. 14] (TwT and QKNorm, Code: alpha 0.6):       lp(Y) = ((5 + |Y|) / 6)^alpha
#     fairseq (Ott et al. 2019; PowerNorm, "length penalty 1.0"): lp(Y) = |Y|^alpha
# For one alpha the two rank hypotheses differently: GNMT's 5 damps the penalty of short outputs.
# Note: |Y| counts every scored token, EOS included: a hypothesis that emits EOS at step t (t = 0
# for the first output token) has |Y| = t + 1, the authors' ((5 + t + 1) / 6)^alpha at step t [Code]
# and fairseq's (t + 1)^alpha; one cut at the maximum length has no EOS: |Y| = its number of tokens.
# Without the penalty (alpha = 0) beam search prefers short outputs: every extra token multiplies
# P(Y | X) by a number below 1.
# ---------------------------------------------------------------------------------------
PENALTIES = ("gnmt", "fairseq")


def length_penalty(length, alpha, kind="gnmt"):
    """lp(Y) of GNMT, ((5 + |Y|) / 6)^alpha, or of fairseq, |Y|^alpha; length: |Y|, EOS counted."""
    # Exercise length_penalty: begin
    return ((5.0 + length) / 6.0) ** alpha if kind == "gnmt" else float(length) ** alpha
    # Exercise length_penalty: end


# ---------------------------------------------------------------------------------------
# 3. Greedy search: y_t = argmax_w log P(w | y_<t, x), until EOS or the maximum length.
# The maximum length is the source length + 50 (Code; _max_lengths, Appendix D). The search is
# batched with decode_step's cache, and a sentence leaves the batch once done. EOS is forbidden at
# the first step, as in beam search: greedy_search = beam_search(beam=1) up to exact float ties.
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_search(model, src, max_len=None):
    """src (B, S) long, PAD-padded, each row with at least one token -> B token lists (no BOS/EOS).
    max_len: None (the source length + 50), an int, or a (B,) tensor."""
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
# 4. Beam search [1], batched over sentences and beams.
# Code: the beam search of tnq177/transformers_without_tears. Each sentence keeps K hypotheses
# ("beams"), all n*K of them rows of one decoding state: one decode_step advances them all.
# At step t:
#   candidates  = every alive beam extended by every word w:   c = logP(y) + logP(w | y, x)
#                 every finished beam, kept as it is (it "extends with EOS at no cost")
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
    # B*K rows: each sentence's encoding, once for each of its beams.
    cache = start_decoding(model, src).select(torch.arange(B, device=dev).repeat_interleave(K))
    active = torch.arange(B, device=dev)  # (n,) original index of each sentence
    y = torch.full((B * K,), BOS, dtype=torch.long, device=dev)  # (n*K,) last token of each beam
    cum = torch.full((B, K), NEG_INF, device=dev)  # (n, K) log P(y | x) of each beam
    cum[:, 0] = 0.0  # Note: at step 0 only beam 0 is live, so the K beams are not K copies
    # (n, K) the final score of a finished beam (-inf while it is alive)
    score = torch.full((B, K), NEG_INF, device=dev)
    finished = torch.zeros(B, K, dtype=torch.bool, device=dev)  # (n, K)
    hist = torch.empty(B, K, 0, dtype=torch.long, device=dev)  # (n, K, t) tokens so far
    results = [None] * B
    # At step t every hypothesis has t tokens; at the largest limit all are finished.
    for t in range(int(limit.max()) + 1):
        at_limit = (limit[active] <= t)[:, None] & ~finished  # (n, K) alive beams at the limit
        # They close there, scored logP / lp(t) (no EOS).
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
                x[keep] for x in (active, cum, score, finished, hist)
            )
            y = y[rows]
            cache.select(rows)  # later steps compute less
        n = active.numel()
        logp = decode_step(model, y, cache).float().log_softmax(-1)  # (n*K, V)  log P(w | y, x)
        # Note: a masked word's log P = -inf meets only finite numbers, -inf, lp > 0, topk: no NaN.
        if t == 0:
            logp[:, EOS] = NEG_INF  # Code: EOS is forbidden at step 0 (no empty output)
        ext = cum.view(n * K, 1) + logp  # (n*K, V)  log P(y w | x)
        ext.masked_fill_(finished.view(n * K, 1), NEG_INF)  # finished beams do not extend
        # (n, K*V) the extensions' scores c / lp(t + 1)
        ext_scores = (ext / length_penalty(t + 1, alpha, penalty)).view(n, K * V)
        # (n, K) the K best candidates; finished beams compete as they are
        top, idx = torch.cat([ext_scores, score], dim=1).topk(K, dim=1)
        is_ext = idx < K * V  # (n, K) an extension (else a kept finished beam)
        parent = torch.where(is_ext, idx // V, idx - K * V)  # (n, K) the beam it comes from
        # dead: -inf, only when fewer than K finite candidates exist; it appends PAD, no masked word
        dead = top.eq(NEG_INF)  # (n, K)
        word = torch.where(is_ext & ~dead, idx % V, PAD)  # (n, K) appended token
        # (n, K) the new beams' log P(y | x), unread once a beam has finished
        cum = ext.view(n, K * V).gather(1, idx.clamp(max=K * V - 1))
        finished = ~is_ext | word.eq(EOS) | dead  # (n, K)
        score = top.masked_fill(~finished, NEG_INF)  # EOS: c / lp(t+1); kept: unchanged
        hist = torch.cat(
            [hist.gather(1, parent[:, :, None].expand(-1, -1, t)), word[:, :, None]], dim=2
        )
        # Each new beam takes its parent's cache.
        cache.select((torch.arange(n, device=dev)[:, None] * K + parent).flatten())
        y = word.masked_fill(finished, EOS).flatten()  # finished rows are fed EOS, output ignored
    return results


# ---------------------------------------------------------------------------------------
# 5. Translating many lines.
# BPE-encode, batch by length with data.make_batches (the longest batch first, so that an
# out-of-memory error shows at once), search, put back in order, detokenize.
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Search:
    """How to search; TwT's defaults (Code: beam 4, alpha 0.6, output length |x| + 50)."""

    beam: int = 4  # 1 = greedy search
    alpha: float = 0.6  # the length penalty's alpha
    max_len_b: int = 50  # at most |x| + max_len_b output tokens
    # A longer source (in BPE tokens) is cut to it: one huge line cannot exhaust memory.
    max_src_len: int = 1024
    bf16: bool = False  # bf16 autocast (model.autocast), where model.precision chose it
    penalty: str = "gnmt"  # section 2's length penalty: gnmt (TwT, QKNorm) or fairseq (PowerNorm)


def translate(
    model, tokenizer, lines, search=Search(), batch_tokens=4096, progress=False, ids=False
):
    """Source lines -> detokenized outputs in order (empty -> empty), or with ids=True their output
    token ids (no BOS/EOS); batches of batch_tokens (sentences x longest)."""
    device = next(model.parameters()).device
    # One call for all lines: sentencepiece encodes them in C++ threads.
    encoded = [x[: search.max_src_len] for x in tokenizer.encode(list(lines))] if lines else []
    outputs = [[] for _ in encoded]  # an empty (or blank) line translates to an empty line
    todo = [i for i, x in enumerate(encoded) if x]
    sources = [(encoded[i], []) for i in todo]  # no target: batched by source length alone
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),  # on stderr
        transient=True,  # gone when done
        disable=not progress,
    )
    # train.py calls us mid-training: evaluating() gives its model the mode it had back.
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
            for j, h in zip(b, hyps, strict=True):  # back to the original order
                outputs[todo[j]] = h
            bar.update(task, advance=len(b))
    return outputs if ids else [tokenizer.decode(h) for h in outputs]


# ---------------------------------------------------------------------------------------
# 6. Scoring [8, 9]: the same outputs, three numbers.
#   tokenized BLEU  what the papers report. Paper [1] appendix A: "We report tokenized BLEU
#                   with multi-bleu.perl"; [2] too; [3] for en-vi only (its 4 TED pairs:
#                   multi-bleu-detok.perl). multi-bleu.perl splits on whitespace, so the number
#                   depends on the tokenization before scoring; SacreBLEU, tokenize="none", on the
#                   same text reproduces it exactly (Code: 32.49, 33.24 on the TwT and QKNorm
#                   tst2013 outputs).
#   SacreBLEU       BLEU on detokenized text with SacreBLEU's 13a tokenizer, with its signature.
#   chrF            character n-gram F-score [9] (beta 2): no tokenization at all.
# Note: our corpora are raw text and the model writes raw text: for a multi-bleu.perl-style number
# both sides are 13a-tokenized first, then scored with tokenize="none" (on raw text: SacreBLEU's 13a
# BLEU, unsmoothed). Corpora tokenized beforehand (IWSLT'15 en-vi as the TwT authors ship it):
# already_tokenized=True (--tokenized). scores() gives the three as SacreBLEU's CLI writes them.
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


def scores(hyps, refs, already_tokenized=False, lowercase=False):
    """The three scores, for --json and train.py's results.json: {"bleu", "chrf",
    "tokenized_bleu"}, each the dict SacreBLEU's CLI writes (--format json): name, score (2
    decimals), signature and its fields, BLEU's verbose_score."""
    tb = tokenized_bleu(hyps, refs, already_tokenized, lowercase)
    # Its name says why it is not the headline: it is 0 when an n-gram order has no match.
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


# ---------------------------------------------------------------------------------------
# 7. Held-out loss and perplexity ([1] Table 8), teacher-forced.
# Over the n target tokens (every y_1..y_m and EOS):
#   NLL      = sum_t -log p(y_t | y_<t, x)                                   ppl = exp(NLL / n)
#   smoothed = sum_t (1 - eps) (-log p(y_t)) + eps mean_{w in A} (-log p(w))    exp(smoothed / n)
# with A the target vocabulary. The smoothed loss is the training objective (model.py), so its
# perplexity is what [1] Table 8 lists; by Jensen, per token smoothed >= (1-eps) NLL + eps log|A|.
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_loss(model, encoded, batch_tokens, smoothing, bf16=False):
    """Encoded pairs, teacher-forced in eval mode -> (the label-smoothed loss summed, the NLL
    summed, the number of target tokens)."""
    device, total, nll_total, n = next(model.parameters()).device, 0.0, 0.0, 0
    with evaluating(model), autocast(device, bf16):
        for idx in data.make_batches(encoded, batch_tokens, shuffle=False):
            b = data.collate(encoded, idx, device)
            loss, nll = model(b.src, b.tgt_in, b.tgt_out, smoothing)
            total, nll_total, n = total + loss.item(), nll_total + nll.item(), n + b.n_tgt
    return total, nll_total, n


def perplexity(model, tokenizer, pairs, label_smoothing=0.1, batch_tokens=4096, bf16=False):
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
# 8. A language model ([2] Table 2): the perplexity of a text, and continuing a prefix.
# Perplexity is the field's: the text as one stream cut into segments (data.py section 8), every
# token predicted once from the ones before it in its segment:
#   ppl = exp(NLL / n),   n = the text's tokens + one EOS a sentence
#   per word: exp(NLL / (words + EOS)), the same NLL
# Under BPE n counts pieces, so the per-word perplexity is the one comparable across vocabularies.
# ---------------------------------------------------------------------------------------
def lm_perplexity(model, tokenizer, lines, seq_len, batch_tokens=4096, bf16=False, context=0):
    """dict(ppl, nll, n_tokens, word_ppl, n_words, unk_tokens, unk_share) of text lines (empty lines
    skipped, as training does). context N > 0: each token with at least N tokens before it ([2] A.2,
    as Transformer-XL evaluates), in windows of seq_len tokens that slide by seq_len - N
    (data.lm_windows). Note: the window stays seq_len, the positions the model trained on (a softmax
    model scored with longer windows got worse: its positions past seq_len were never trained)."""
    lines = [line for line in lines if line]  # none: DataError (data.lm_windows)
    segments = data.lm_windows(data.lm_stream(tokenizer, lines), seq_len, context)
    _, nll, n = evaluate_loss(model, segments, batch_tokens, 0.0, bf16)
    words = sum(len(line.split()) + 1 for line in lines)  # + EOS each
    # The papers' OOV rate: the scored targets that are UNK (PTB's <unk>, new words).
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
def generate(model, tokenizer, prefix, seq_len, max_tokens=50, temperature=0.0, seed=0, bf16=False):
    """The prefix continued until EOS or max_tokens, each token predicted from the last seq_len
    tokens: at temperature 0 the most probable one (greedy), else one drawn from
    softmax(logits / temperature) (--sample). Returns the prefix and the continuation, as text."""
    ids, rng = [EOS] + tokenizer.encode(prefix), torch.Generator().manual_seed(seed)
    start = len(ids)
    with evaluating(model), autocast(model.embed.device, bf16):
        for _ in range(max_tokens):
            # The last seq_len tokens: the context the model was trained with.
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
# Appendix A: significance [10], as SacreBLEU tests it.
# Corpus BLEU and chrF, each system against one baseline. Paired bootstrap resampling (Koehn 2004,
# the test of [1] and [3]; --test bs): draw n_samples test sets of the same size from the real one,
# with replacement, the same sentence indices for both systems, and score both on each. The spread
# of a system's score over the draws gives its 95% confidence interval; how often the difference is
# as large as the real one, once the draws are centred on "no difference", gives the p-value:
#   p = (#{s : |d_s| - mean_s |d_s| > |score_sys - score_base|} + 1) / (n_samples + 1)
# Paired approximate randomization (Riezler and Maxwell 2005; --test ar) swaps each sentence's two
# outputs with probability 1/2, n_samples times:
#   p = (#{s : |d_s| > |score_sys - score_base|} + 1) / (n_samples + 1)
# Note: we call SacreBLEU's own implementation (sacrebleu.significance.PairedTest; "bs" ports
# Moses' bootstrap-hypothesis-difference-significance.pl); the CI is mean +- half the
# 2.5%..97.5% percentile range.
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
    baseline), "undecidable" (why p is 1, see _undecidable; else "")}}). names: the outputs' and
    the references' names, for the error when line counts differ. Note: SacreBLEU takes seed 0 as
    none."""
    hyps, refs = [list(h) for h in hyps], list(refs)
    names = names or [*(f"system {i}" for i in range(len(hyps))), "references"]
    if len({len(x) for x in (*hyps, refs)}) > 1:
        counts = zip(names, (*hyps, refs), strict=True)
        raise DataError("line counts differ: " + ", ".join(f"{n} {len(x)}" for n, x in counts))
    if len(hyps) < 2 or not refs:
        raise DataError(
            "a paired test needs the baseline's output and at least one system's, "
            "of one line or more"
        )
    # BLEU is SacreBLEU's, or under --tokenized the report's tokenized BLEU (unsmoothed, as
    # multi-bleu.perl).
    metrics = {
        "BLEU": BLEU(tokenize="none", smooth_method="none", lowercase=lowercase, force=True)
        if already_tokenized
        else BLEU(lowercase=lowercase, force=True),
        "chrF": CHRF(lowercase=lowercase),
    }
    # names ends with the references' name, which names no system.
    systems = list(zip(names, hyps, strict=False))
    with _sacrebleu_seed(seed):  # PairedTest and its resampling read it
        paired = PairedTest(systems, metrics, [refs], test_type=test, n_samples=n_samples)
        signatures, scores = paired()
    out = {
        "test": test,
        "n_samples": paired.n_samples,
        "signatures": {m: str(s) for m, s in signatures.items()},
        "rows": [{} for _ in hyps],
    }
    # sacrebleu's Result objects, the baseline's (b) first
    for metric, (b, *others) in ((m, r) for m, r in scores.items() if m != "System"):
        for i, (row, h, r) in enumerate(zip(out["rows"], hyps, (b, *others), strict=True)):
            undecidable = _undecidable(metric, h == hyps[0], b.score, r.score)
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


def _undecidable(metric, identical, baseline, system):
    """Why a system's p-value is 1, or "": its output and the baseline's are identical, or they
    score the same. Note: when the two scores are equal (identical outputs, outputs that differ only
    in spacing, both at BLEU 0) the real difference is 0; bootstrap finds no strictly larger centred
    difference and returns its smallest p-value, 1 / (n_samples + 1), "significant". There is no
    difference to test: we report p = 1."""
    if identical:
        return "the two outputs are identical"
    if baseline == system == 0:
        return f"both outputs score {metric} 0"
    if baseline == system:
        return f"the two outputs score the same {metric}"
    return ""


@contextlib.contextmanager
def _sacrebleu_seed(seed):
    """SacreBLEU reads its seed from the environment, SACREBLEU_SEED ("None": no seed): set it for
    a while, then the environment as the caller had it."""
    caller_seed = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = "None" if seed is None else str(int(seed))
    try:
        yield
    finally:
        if caller_seed is None:
            os.environ.pop("SACREBLEU_SEED")
        else:
            os.environ["SACREBLEU_SEED"] = caller_seed


def compare(args):
    """--compare BASELINE SYSTEM [SYSTEM ...] --ref REF: the table of paired_test (a rich Table),
    its signatures and each system's verdict on stdout."""
    names = (*args.compare, args.ref)  # BASELINE, SYSTEMs, REF
    r = paired_test(
        hyps=[fileio.read_lines(path) for path in args.compare],
        refs=fileio.read_lines(args.ref),
        test=args.test,
        n_samples=args.samples or 0,
        seed=args.seed,
        already_tokenized=args.tokenized,
        lowercase=args.lowercase,
        names=names,
    )
    how = {"bs": "paired bootstrap resampling", "ar": "paired approximate randomization"}[r["test"]]
    numbers = (Column(c, justify="right") for c in ("score", "mean +- 95% CI", "p-value"))
    title = f"{how}, {r['n_samples']} samples"
    table = Table(Column("system", overflow="fold"), "metric", *numbers, title=title)
    # A row per system and metric; "-" where AR gives no interval. REF, names' last, has no row.
    for name, row in zip(names, r["rows"], strict=False):
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
    for name, row in zip(names[1:], r["rows"][1:], strict=False):
        print(f"{name}: " + "; ".join(_verdict(metric, x) for metric, x in row.items()))


def _verdict(metric, x):
    """A system's verdict on one metric, as compare() prints it: the difference, its p-value and
    whether it is significant at 0.05."""
    if x["undecidable"]:
        why = f"not significant: {x['undecidable']}, so there is no difference to test"
    else:
        why = f"{'' if x['p_value'] < 0.05 else 'not '}significant at 0.05"
    return f"{metric} delta {x['delta']:+.2f}, p = {x['p_value']:.4f} ({why})"


# =======================================================================================
# Appendix B: checkpoints: a run directory's model, and averaging them [2].
# train.py writes them, machinery/rundir.py's read_checkpoint reads them safely. load_checkpoint
# gives a run directory's model; average_checkpoints the average of its last N epoch checkpoints:
#   theta_avg = (1/N) sum_{i=1..N} theta_i
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
        # "args": the flags train.py ran with, run_id among them
        if (ckpt.get("args") or {}).get("run_id") != (first.get("args") or {}).get("run_id"):
            raise DataError(
                f"{p}: from another run than {paths[0]} (run_id differs); average one run's "
                "checkpoints"
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
    directory gives its best checkpoint, else its last (checkpoints(dir, "decode")); with
    average=N > 0 (a run directory only), the average of its last N epoch checkpoints. The
    tokenizer is rebuilt from the sentencepiece model inside the checkpoint ("bpe_model_proto"), so
    a checkpoint file alone can translate. Otherwise DataError naming the path."""
    p = Path(path)
    if average > 0:
        if len(epochs := checkpoints(p, "average")) < average:  # a file: none
            raise DataError(
                f"{p}: --average {average} needs a run directory with {average} epoch "
                f"checkpoints; it has {len(epochs)}"
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
# Appendix C: the papers' diagnostics: learned g's, singular values, future leak, attention maps.
# First the learned g's ([1] Figures 3-4: the g of every ScaleNorm, by depth; [3]: QKNorm's g):
# every scalar g of the model, from model.learned_scales(), in depth order:
#   ScaleNorm:  y = g * x / ||x||       one g per norm (per sublayer, plus a final one per stack)
#   QKNorm:     softmax(g * Q^ K^T) V   one g per attention module
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
        # Every g is a norm's or an attention module's.
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
        out.append(dict(name=name, stack=stack, layer=layer, sublayer=sub, kind=kind, value=value))
    # The encoder first, then by depth (a stable sort).
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
# The embedding's singular values ([2] Figure 6, after Gao et al. 2019).
# sigma_1 >= sigma_2 >= ... of the learned embedding matrix E (V, D), divided by sigma_1. A slow
# decay: the embeddings use more directions of the space. Note: E as trained; with --fixnorm the
# model reads its rows normalised to unit length (their lengths are left free).
# ---------------------------------------------------------------------------------------
def singular_values(model):
    sigma = torch.linalg.svdvals(model.embed.detach().double().cpu())
    return [round(x, 5) for x in (sigma / sigma[0]).tolist()]


# ---------------------------------------------------------------------------------------
# The future leak (--leak) of a training forward's batch statistics.
# How far the batch statistics of a training forward let a causal model see the future ([2]'s BN
# and PN-V in a language model): zero for the per-token norms. --leak-mode eval: the model as
# evaluated, zero for any causal model, positive for one that sees later tokens itself (the
# baseline's unmasked multi-linear attention, model.py Appendix B).
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

    # log p(next token) of a fresh copy each time: a running statistic updated by the first call
    # is not a leak.
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
# Attention heatmaps ([3] Figures 1-2: attention weights with and without QKNorm).
# One teacher-forced forward of (x, BOS y) with keep_weights on the chosen module: its written-out
# path stores softmax(scores) (B, H, Tq, Tk) as last_weights; we take head h.
#   kind "enc":   encoder self-attention    rows = cols = source pieces x_1..x_S
#   kind "dec":   decoder self-attention    rows = cols = decoder inputs BOS, y_1..y_m
#                                           (causal: 0 right of the diagonal)
#   kind "cross": decoder-encoder attention rows = the piece each position predicts,
#                                           y_1..y_m, EOS; cols = source
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


# =======================================================================================
# Appendix D: plumbing a first reading can skip.
# The output length limit (sections 3-4), eval mode for a while (section 5), a corpus score with its
# signature (section 6), and two counts behind the notes the programs print: the share of words
# with punctuation attached (text that --tokenized would score as it is), and the number of source
# lines that translate() cuts (machinery/decode_cli.py; machinery/corpora.py for data.py prepare).
# =======================================================================================
def _max_lengths(src, max_len):
    """Maximum output tokens (EOS not counted) per sentence, (B,) long. None: source length + 50
    (Code); an int: the same for all; a tensor: one per sentence. A hypothesis reaching it is closed
    as is, without EOS. Note: the authors' loop lets it take one more step, in which it may still
    emit EOS."""
    max_len = src.ne(PAD).sum(1) + 50 if max_len is None else max_len  # (B,)  |x| + 50
    # An int becomes B copies; a (B,) tensor stays as it is.
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


def attached_punctuation(lines):
    """The share of whitespace tokens that are a word with punctuation attached ("dog." "cat,"):
    about 5-15% in raw English or German, ~0 in Moses-tokenized text; --tokenized on raw text scores
    them as words (no paper's BLEU)."""
    tokens = [w for line in lines for w in line.split()]
    glued = sum(len(w) > 1 and w[-1] in ".,!?;:" and w[:-1].isalpha() for w in tokens)
    return glued / max(len(tokens), 1)


def count_long(tokenizer, lines, max_src_len):
    """How many of the lines translate() cuts to max_src_len BPE tokens, for the caller's note."""
    return sum(len(x) > max_src_len for x in tokenizer.encode(list(lines))) if lines else 0


if __name__ == "__main__":
    # The command line (its flags, modes and checks) is machinery, not the book:
    # machinery/decode_cli.py runs as the program and reads this chapter.
    runpy.run_module("machinery.decode_cli", run_name="__main__")
