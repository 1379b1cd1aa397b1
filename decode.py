"""decode.py -- greedy and beam search, translation, scoring and the papers' evaluation tools.

Reading order: norms.py -> model.py -> data.py -> train.py -> decode.py (this file).
Shapes: B sentences, S source length, T target length, K beam size, V vocabulary,
n the sentences of a batch that are still being decoded (n <= B).

What is here, top-down:
  length penalty (GNMT [2]) -> greedy search -> beam search (batched over sentences and
  beams, cached keys/values, sentences leave the batch when done) -> checkpoint loading
  (one file, or the average of the last N epochs [7]) -> translate() (length-sorted
  batches, original order restored) -> tokenized BLEU, SacreBLEU, chrF -> paired
  bootstrap significance [6] -> analysis: label-smoothed perplexity ([1] Table 8),
  attention heatmaps ([5] Figures 1-2), the learned g's ([1] Figures 3-4) -> the command
  line, with a speed-and-quality benchmark.

How to run:
  python decode.py runs/toy                          # stdin -> stdout, best checkpoint
  python decode.py runs/toy/checkpoint_last.pt --input data/toy/test.src \\
      --output test.hyp --ref data/toy/test.tgt       # BLEU + signature on stderr
  python decode.py runs/toy --input data/toy/dev.src --ref data/toy/dev.tgt --benchmark
  python decode.py runs/toy --average 5 --input test.src --ref test.tgt --ppl
  python decode.py --compare baseline.hyp system.hyp --ref test.tgt   # significance
  python decode.py runs/toy --attention "a source sentence" --layer 0 --head 0 --kind cross
  python decode.py runs/toy --g-table
  python decode.py --help

Papers (numbers used in comments):
  [1] Nguyen & Salazar 2019, Transformers without Tears (TwT): beam 4, alpha 0.6,
      maximum output length = source length + 50 (the authors' code, REFERENCE.md).
  [2] Wu et al. 2016, Google's Neural Machine Translation System (GNMT), eq. 14:
      the length penalty lp(Y) = ((5 + |Y|) / 6)^alpha.
  [3] Post 2018, A Call for Clarity in Reporting BLEU Scores (SacreBLEU).
  [4] Popovic 2015, chrF: character n-gram F-score.
  [5] Henry et al. 2020, Query-Key Normalization for Transformers (QKNorm): Figures 1-2
      show attention weights; like [1], significance by paired bootstrap.
  [6] Koehn 2004, Statistical Significance Tests for Machine Translation Evaluation.
  [7] Shen et al. 2020, PowerNorm: translations come from the average of the last 5
      epoch checkpoints (the authors' fairseq recipe, REFERENCE.md).

Comment markers: ``# Paper:`` is what a paper says, ``# Note:`` is ours, and
``# Code:`` is what the authors' released code does (../shared/REFERENCE.md).
"""
import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from model import BOS, EOS, PAD, ModelConfig, Transformer

NEG_INF = float("-inf")


class DecodeError(ValueError):
    """A user-facing problem (missing file, not a checkpoint, line-count mismatch).

    The message is one line and names the file; the command line prints it as is.
    """


# ---------------------------------------------------------------------------------------
# Length penalty [2, eq. 14]:   s(Y) = log P(Y | X) / lp(Y),   lp(Y) = ((5 + |Y|) / 6)^alpha
#
# Note: |Y| counts every scored token of the hypothesis, EOS included. A hypothesis that
# emits EOS at step t (t = 0 for the first output token) has |Y| = t + 1, which is the
# authors' ((5 + t + 1) / 6)^alpha at step t [Code, REFERENCE.md]. A hypothesis cut at
# the maximum length has no EOS: |Y| = its number of tokens, and log P has no EOS term.
# Without the penalty (alpha = 0) beam search prefers short outputs, since every extra
# token multiplies P(Y | X) by a number below 1.
# ---------------------------------------------------------------------------------------
def length_penalty(length, alpha):
    """lp = ((5 + length) / 6)^alpha; length counts the scored tokens (EOS included)."""
    return ((5.0 + length) / 6.0) ** alpha


def _max_lengths(src, max_len, max_len_b):
    """Maximum number of output tokens (EOS not counted) per sentence: (B,) long.

    None: source length + max_len_b (Code: + 50 in the authors' code [1]); an int: the
    same for all; a tensor: one value per sentence. A hypothesis that reaches the limit
    is closed as it is, without EOS. Note: the authors' loop lets such a hypothesis take
    one more step, in which it may still emit EOS; the two differ only at the limit.
    """
    if max_len is None:
        return src.ne(PAD).sum(1) + max_len_b  # (B,)  |x| + b
    if torch.is_tensor(max_len):
        return max_len.to(device=src.device, dtype=torch.long).reshape(src.size(0))
    return torch.full((src.size(0),), int(max_len), dtype=torch.long, device=src.device)


def _strip(tokens):
    """Hypothesis tokens up to (not including) the first EOS or PAD placeholder."""
    out = []
    for w in tokens:
        if w == EOS or w == PAD:
            break
        out.append(w)
    return out


# ---------------------------------------------------------------------------------------
# Greedy search:  y_t = argmax_w log P(w | y_<t, x),  until EOS or the maximum length.
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_search(model, src, max_len=None, max_len_b=50):
    """src (B, S) long, PAD-padded, each row with at least one token -> B token lists.

    Each list is the output without BOS and EOS. Batched, with the cached keys/values
    of model.decode_step (the prefix is never recomputed); a sentence leaves the batch
    (reorder_state) as soon as it emits EOS or reaches max_len, and decoding stops when
    none is left. EOS is forbidden at the first step, as in beam search, so that
    greedy_search equals beam_search(beam=1).
    """
    B = src.size(0)
    limit = _max_lengths(src, max_len, max_len_b)  # (B,)
    state = model.start_decoding(src)
    active = torch.arange(B, device=src.device)  # (n,) original index of each row
    y = torch.full((B,), BOS, dtype=torch.long, device=src.device)  # (n,) last token
    hist = torch.empty(B, 0, dtype=torch.long, device=src.device)  # (n, t) tokens so far
    ended = torch.zeros(B, dtype=torch.bool, device=src.device)  # (n,) emitted EOS
    results = [None] * B
    t = 0
    while True:
        done = ended | (limit[active] <= t)  # (n,) finished or at the length limit
        if done.any():
            for i in done.nonzero().flatten().tolist():
                results[active[i]] = _strip(hist[i].tolist())
            keep = (~done).nonzero().flatten()  # rows still decoding
            if keep.numel() == 0:
                break
            active, y, hist, ended = active[keep], y[keep], hist[keep], ended[keep]
            state = model.reorder_state(state, keep)  # later steps compute less
        logp = model.decode_step(y, state).float().log_softmax(-1)  # (n, V)  log P(w | y_<t, x)
        if t == 0:
            logp[:, EOS] = NEG_INF  # Code: EOS is never the first token
        y = logp.argmax(-1)  # (n,)  masked words have log P = -inf: never chosen
        hist = torch.cat([hist, y[:, None]], dim=1)
        ended = y.eq(EOS)
        t += 1
    return results


# ---------------------------------------------------------------------------------------
# Beam search [1, Code: REFERENCE.md "Beam search"].
#
# Each sentence keeps K hypotheses ("beams"); all n*K of them are rows of one decoding
# state, so one decode_step advances every beam of every sentence. At step t:
#   candidates  = every alive beam extended by every word w:   c = logP(y) + logP(w | y, x)
#                 every finished beam, kept as it is (it "extends with EOS at no cost")
#   ranking     = by the length-penalised score: c / lp(t + 1) for an extension,
#                 logP(y) / lp(|y|) (fixed when it finished) for a finished beam
#   new beams   = the K best candidates; an extension by EOS becomes finished.
# Within one step all extensions share lp(t + 1), so among themselves they rank by plain
# log-probability (as in ordinary beam search); the penalty only matters when they are
# compared with finished beams, and at the end, when the best finished beam is returned.
# A sentence leaves the batch when all its K beams have finished (Code: the same rule):
# its rows are dropped from the state with reorder_state so later steps compute less.
# Note: we chose this rule over "stop once the best finished score cannot be beaten":
# it is the authors' and needs no bound on future scores.
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def beam_search(model, src, beam=4, alpha=0.6, max_len=None, max_len_b=50, return_scores=False):
    """src (B, S) long, PAD-padded, each row with at least one token -> B token lists.

    Each list is the best finished hypothesis without BOS and EOS. max_len: None (source
    length + max_len_b), an int, or a (B,) tensor. return_scores: also return each
    output's length-penalised score, as a list of (tokens, score) pairs.
    With beam=1 the result is the greedy one (up to exact floating-point ties).
    """
    B, K, dev = src.size(0), beam, src.device
    V = model.cfg.vocab_size
    limit = _max_lengths(src, max_len, max_len_b)  # (B,)
    state = model.start_decoding(src)  # encoder and cross-attention keys/values once per sentence
    state = model.reorder_state(state, torch.arange(B, device=dev).repeat_interleave(K))  # B*K rows
    active = torch.arange(B, device=dev)  # (n,) original index of each sentence
    y = torch.full((B * K,), BOS, dtype=torch.long, device=dev)  # (n*K,) last token of each beam
    cum = torch.full((B, K), NEG_INF, device=dev)  # (n, K) log P(y | x) of each beam
    cum[:, 0] = 0.0  # Note: at step 0 only beam 0 is live, so the K beams are not K copies
    score = torch.full((B, K), NEG_INF, device=dev)  # (n, K) final score of a finished beam
    finished = torch.zeros(B, K, dtype=torch.bool, device=dev)  # (n, K)
    hist = torch.empty(B, K, 0, dtype=torch.long, device=dev)  # (n, K, t) tokens so far
    results = [None] * B
    t = 0  # every hypothesis has t tokens
    while True:
        # Sentences at their length limit: close the alive beams as they are (no EOS).
        at_limit = (limit[active] <= t)[:, None] & ~finished  # (n, K)
        score = torch.where(at_limit, cum / length_penalty(t, alpha), score)  # logP / lp(t)
        finished = finished | at_limit
        # Sentences whose K beams have all finished leave the batch.
        done = finished.all(1)  # (n,)
        if done.any():
            for i in done.nonzero().flatten().tolist():
                best = int(score[i].argmax())
                tokens = _strip(hist[i, best].tolist())
                results[active[i]] = (tokens, float(score[i, best])) if return_scores else tokens
            keep = (~done).nonzero().flatten()  # (n',)
            if keep.numel() == 0:
                break
            rows = (keep[:, None] * K + torch.arange(K, device=dev)).flatten()  # (n'*K,)
            active, cum, score = active[keep], cum[keep], score[keep]
            finished, hist, y = finished[keep], hist[keep], y[rows]
            state = model.reorder_state(state, rows)  # later steps compute less
        n = active.numel()

        logp = model.decode_step(y, state).float().log_softmax(-1)  # (n*K, V)  log P(w | y, x)
        # Note: masked words have logit -inf, so log P = -inf; -inf only ever meets finite
        # numbers or other -inf in sums, divisions by lp > 0 and topk, so no NaN appears.
        if t == 0:
            logp[:, EOS] = NEG_INF  # Code: EOS is forbidden at step 0 (no empty output)
        ext = cum.view(n * K, 1) + logp  # (n*K, V)  log P(y w | x)
        ext.masked_fill_(finished.view(n * K, 1), NEG_INF)  # finished beams do not extend
        ext_scores = (ext / length_penalty(t + 1, alpha)).view(n, K * V)  # (n, K*V)  c / lp(t+1)
        keep_scores = score.masked_fill(~finished, NEG_INF)  # (n, K)  finished beams compete as they are
        top, idx = torch.cat([ext_scores, keep_scores], dim=1).topk(K, dim=1)  # (n, K)

        is_ext = idx < K * V  # (n, K) an extension (else a kept finished beam)
        parent = torch.where(is_ext, idx // V, idx - K * V)  # (n, K) beam it comes from
        word = torch.where(is_ext, idx % V, torch.full_like(idx, PAD))  # (n, K) appended token
        dead = top.eq(NEG_INF)  # (n, K) only when fewer than K finite candidates exist
        word = word.masked_fill(dead, PAD)  # never emit a masked word, even on a dead beam
        ext_cum = ext.view(n, K * V).gather(1, idx.clamp(max=K * V - 1))  # (n, K)
        cum = torch.where(is_ext, ext_cum, cum.gather(1, parent))  # (n, K)
        finished = ~is_ext | word.eq(EOS) | dead  # (n, K)
        score = top.masked_fill(~finished, NEG_INF)  # EOS: c / lp(t+1); kept: unchanged
        hist = torch.cat([hist.gather(1, parent[:, :, None].expand(-1, -1, t)), word[:, :, None]], dim=2)

        rows = (torch.arange(n, device=dev)[:, None] * K + parent).flatten()  # (n*K,) parent rows
        state = model.reorder_state(state, rows)  # each new beam takes its parent's cache
        y = word.masked_fill(finished, EOS).flatten()  # finished rows are fed EOS, output ignored
        t += 1
    return results


# ---------------------------------------------------------------------------------------
# Checkpoints (written by train.py)
# ---------------------------------------------------------------------------------------
def _read_checkpoint(p, device="cpu"):
    """torch.load of one checkpoint file, with the checks; DecodeError naming the file."""
    if not p.is_file():
        raise DecodeError(f"{p}: no such checkpoint file")
    try:
        ckpt = torch.load(p, map_location=device, weights_only=True)
    except Exception:
        # Note: weights_only=True (no code runs while loading) reads everything train.py
        # writes as plain types; other objects need the full unpickler. Only load your own.
        try:
            ckpt = torch.load(p, map_location=device, weights_only=False)
        except Exception as e:
            raise DecodeError(f"{p}: not a checkpoint ({type(e).__name__}: {e})".splitlines()[0]) from None
    if not isinstance(ckpt, dict) or "model_config" not in ckpt or "model" not in ckpt:
        raise DecodeError(f"{p}: not a checkpoint (no 'model_config' and 'model' entries)")
    # Note: a module saved after torch.compile has "_orig_mod." prefixes; accept both.
    ckpt["model"] = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    return ckpt


# ---------------------------------------------------------------------------------------
# Checkpoint averaging [7]:  theta_avg = (1/N) sum_{i=1..N} theta_i  over the last N epochs.
#
# Paper/Code [7]: PowerNorm's translations come from the average of the last 5 epoch
# checkpoints (fairseq's average_checkpoints.py). Averaging the weights of nearby points of
# one training run acts like an ensemble at the cost of one model.
# Only floating-point tensors are averaged. Integer and bool buffers are copied from the
# last checkpoint: PowerNorm's num_batches_tracked counter (a long) decides whether the
# layer still uses batch statistics, and the mean of counters is not a count (Code:
# fairseq's averaging crashes on that int buffer, REFERENCE.md); the target-vocabulary
# mask `allowed` is a bool. Float buffers (PowerNorm's running phi and nu) are averaged
# like the weights, as fairseq does.
# ---------------------------------------------------------------------------------------
def average_checkpoints(paths):
    """Checkpoint files (oldest first) -> one checkpoint dict whose "model" is their average.

    Everything but "model" comes from the last file (model_config, bpe_model_proto, step,
    ...), its "optimizer" and "rng" entries are dropped (they belong to the last file's
    weights, not to the average: do not resume training from it), and "averaged_from"
    lists the files. Sums are taken in float64, one file in memory at a time, and cast
    back to each tensor's dtype. DecodeError if the files do not hold the same model.
    """
    paths = [Path(x) for x in paths]
    if not paths:
        raise DecodeError("average_checkpoints: no checkpoint files given")
    total, last = None, None
    for p in paths:
        ckpt = _read_checkpoint(p, "cpu")
        state = ckpt["model"]
        if total is None:
            first, total = p, {k: v.double() for k, v in state.items() if torch.is_floating_point(v)}
            keys, shapes = set(state), {k: v.shape for k, v in state.items()}
            config = ckpt["model_config"]
        else:
            if set(state) != keys or any(v.shape != shapes[k] for k, v in state.items()):
                raise DecodeError(f"{p}: not the same model (parameter names or shapes) as {first}")
            if ckpt["model_config"] != config:
                raise DecodeError(f"{p}: model_config differs from {first}'s")
            for k in total:
                total[k] += state[k].double()  # sum_i theta_i
        last = ckpt
    averaged = {}
    for k, v in last["model"].items():
        if k in total:
            averaged[k] = (total[k] / len(paths)).to(v.dtype)  # (1/N) sum_i theta_i
        else:
            averaged[k] = v.clone()  # int / bool buffers: the last checkpoint's
    out = {k: v for k, v in last.items() if k not in ("model", "optimizer", "rng")}
    out["model"] = averaged
    out["averaged_from"] = [str(p) for p in paths]
    return out


def epoch_checkpoints(run_dir):
    """A run directory's checkpoint_epoch{N}.pt files, sorted by N (1-based epoch number)."""
    found = []
    for f in Path(run_dir).glob("checkpoint_epoch*.pt"):
        m = re.fullmatch(r"checkpoint_epoch(\d+)\.pt", f.name)
        if m:
            found.append((int(m.group(1)), f))
    return [f for _, f in sorted(found)]


def load_checkpoint(path, device="cpu", average=0):
    """A .pt file or a run directory -> (model in eval mode on device, tokenizer, ckpt dict).

    A run directory gives its checkpoint_best.pt, else its checkpoint_last.pt; with
    average=N > 0 (a run directory only) the average of its N highest-numbered
    checkpoint_epoch{N}.pt files instead (average_checkpoints). The tokenizer is rebuilt
    from the sentencepiece model embedded in the checkpoint ("bpe_model_proto"), so a
    checkpoint file alone can translate.
    Raises DecodeError (one line, naming the path) for a missing file or a non-checkpoint.
    """
    from data import Tokenizer

    p = Path(path)
    if average and average > 0:
        if not p.is_dir():
            raise DecodeError(f"{p}: --average {average} needs a run directory (with checkpoint_epoch*.pt files)")
        epochs = epoch_checkpoints(p)
        if len(epochs) < average:
            raise DecodeError(f"{p}: --average {average} needs {average} checkpoint_epoch*.pt files, "
                              f"the run directory has {len(epochs)}")
        ckpt = average_checkpoints(epochs[-average:])
        p = epochs[-1]  # for messages and the bpe.model fallback
    else:
        if p.is_dir():
            found = [p / n for n in ("checkpoint_best.pt", "checkpoint_last.pt") if (p / n).is_file()]
            if not found:
                raise DecodeError(f"{p}: run directory has no checkpoint_best.pt or checkpoint_last.pt")
            p = found[0]
        ckpt = _read_checkpoint(p, device)

    model = Transformer(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    model.to(device).eval()

    proto = ckpt.get("bpe_model_proto")
    if proto is None:  # fall back to the run directory's bpe.model
        if not (p.parent / "bpe.model").is_file():
            raise DecodeError(f"{p}: has no bpe_model_proto and there is no {p.parent / 'bpe.model'}")
        tokenizer = Tokenizer(p.parent / "bpe.model")
    else:
        # data.Tokenizer reads a file; sentencepiece keeps the model in memory once loaded.
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "bpe.model").write_bytes(bytes(proto))
            tokenizer = Tokenizer(Path(tmp) / "bpe.model")
        tokenizer.model_path = f"{p}:bpe_model_proto"
    if tokenizer.vocab_size != model.cfg.vocab_size:
        raise DecodeError(f"{p}: tokenizer has {tokenizer.vocab_size} pieces, model {model.cfg.vocab_size}")
    return model, tokenizer, ckpt


# ---------------------------------------------------------------------------------------
# Translating many lines
# ---------------------------------------------------------------------------------------
def _length_batches(lengths, batch_tokens):
    """Indices sorted by length (longest first), cut so that B * max S <= batch_tokens.

    Sorting cuts padding (and the steps a short sentence waits for a long one); longest
    first makes an out-of-memory error show at once. A sentence longer than batch_tokens
    gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + ([cur] if cur else [])


def _progress_bar(enabled, total):
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    return Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=True)


def translate_ids(model, tokenizer, lines, beam=4, alpha=0.6, batch_tokens=4096, device=None,
                  progress=False, max_len_b=50, amp=True):
    """Like translate(), but returns the output token ids (no BOS/EOS) of each line."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    encoded = tokenizer.encode(list(lines)) if lines else []  # sentencepiece encodes a list in C++
    outputs = [[] for _ in encoded]  # an empty (or blank) line translates to an empty line
    todo = [i for i, x in enumerate(encoded) if x]
    batches = [[todo[j] for j in b] for b in _length_batches([len(encoded[i]) for i in todo], batch_tokens)]
    # Paper/Code: bf16 autocast on CUDA (as in training); fp32 on CPU.
    use_amp = amp and device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_amp else contextlib.nullcontext()
    was_training = model.training
    model.eval()  # no dropout; train.py may call us mid-training: the mode is restored below
    try:
        with _progress_bar(progress, len(todo)) as bar, autocast:
            task = bar.add_task("translating", total=len(todo)) if bar is not None else None
            for b in batches:
                S = len(encoded[b[0]])  # longest first
                src = torch.full((len(b), S), PAD, dtype=torch.long)  # (B, S)
                for r, i in enumerate(b):
                    src[r, :len(encoded[i])] = torch.tensor(encoded[i])
                src = src.to(device)
                if beam == 1:
                    hyps = greedy_search(model, src, max_len_b=max_len_b)
                else:
                    hyps = beam_search(model, src, beam=beam, alpha=alpha, max_len_b=max_len_b)
                for i, h in zip(b, hyps):  # back to the original order
                    outputs[i] = h
                if bar is not None:
                    bar.update(task, advance=len(b))
    finally:
        model.train(was_training)
    return outputs


def translate(model, tokenizer, lines, beam=4, alpha=0.6, batch_tokens=4096, device=None,
              progress=False, max_len_b=50, amp=True):
    """Translates a list of source lines; returns the detokenized outputs in the same order.

    Lines are BPE-encoded (no BOS/EOS, as in training), sorted by length into batches of
    at most batch_tokens source tokens (sentences x longest length), decoded with beam
    search (beam=1: greedy search), put back in the input order and detokenized with
    tokenizer.decode. An empty line gives an empty output. device: where the source
    tensors go (None: the model's device). amp: bf16 autocast when on CUDA.
    """
    ids = translate_ids(model, tokenizer, lines, beam, alpha, batch_tokens, device, progress, max_len_b, amp)
    return [tokenizer.decode(h) for h in ids]


# ---------------------------------------------------------------------------------------
# Scoring [3, 4]: the same outputs, three numbers.
#
#   tokenized BLEU  what the papers report. Paper [1] appendix A: "We report tokenized BLEU
#                   with multi-bleu.perl"; [5] and [7] do the same. multi-bleu.perl splits
#                   on whitespace and nothing else, so the number depends on how the text
#                   was tokenized before scoring; SacreBLEU with tokenize="none" on the same
#                   text reproduces it exactly (Code: 32.49 and 33.24 on the authors' shipped
#                   tst2013 outputs, REFERENCE.md).
#   SacreBLEU       BLEU on detokenized text with SacreBLEU's own 13a tokenizer, printed
#                   with its signature so that anyone can reproduce it [3].
#   chrF            character n-gram F-score [4] (beta 2): no tokenization at all.
#
# Note: our corpora are raw (untokenized) text, and the model writes raw text. To get a
# multi-bleu.perl-style number we tokenize both sides with the 13a tokenizer first and
# then score with tokenize="none". On raw text that equals SacreBLEU's 13a BLEU (13a then
# whitespace split is exactly what tokenize="13a" does), so the two numbers differ only
# on corpora that were tokenized beforehand (IWSLT'15 en-vi as the TwT authors ship it,
# with Moses escapes such as "&apos;"): there, pass already_tokenized=True (CLI
# --tokenized) and the text is scored as it is, as multi-bleu.perl would. Tokenized BLEU
# from different tokenizers is not comparable across papers; SacreBLEU's signature is.
# ---------------------------------------------------------------------------------------
def bleu(hyps, refs):
    """Corpus BLEU of detokenized hyps against one reference each: a sacrebleu BLEUScore.

    Note: the score also carries .signature, the metric's signature as a string
    ("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"), which sacrebleu keeps
    on the metric, not on the score: report it with the number.
    """
    from sacrebleu.metrics import BLEU

    # Note: force=True silences SacreBLEU's "you forgot to detokenize" warning: the built-in
    # corpus writes " ." like tokenized text; the score and signature are unchanged by it.
    metric = BLEU(force=True)
    score = metric.corpus_score(list(hyps), [list(refs)])
    score.signature = str(metric.get_signature())
    return score


def tokenize_13a(lines):
    """SacreBLEU's 13a tokenizer (mteval-v13a.pl): punctuation split off, '&quot;' etc. unescaped."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tok = Tokenizer13a()
    return [tok(line.rstrip()) for line in lines]


def tokenized_bleu(hyps, refs, already_tokenized=False):
    """multi-bleu.perl-style corpus BLEU: a sacrebleu BLEUScore (with .signature).

    already_tokenized=False (raw text, our corpora): both sides go through the 13a
    tokenizer first. True: the text is scored as it is (e.g. Moses-tokenized IWSLT).
    Either way BLEU is then computed with tokenize="none" (whitespace split only).
    Note: smooth_method="none" as in multi-bleu.perl, which gives 0 when some n-gram order
    has no match; SacreBLEU's default "exp" smoothing differs from it only in that case.
    """
    from sacrebleu.metrics import BLEU

    hyps, refs = list(hyps), list(refs)
    if not already_tokenized:
        hyps, refs = tokenize_13a(hyps), tokenize_13a(refs)
    metric = BLEU(tokenize="none", smooth_method="none")
    score = metric.corpus_score(hyps, [refs])
    score.signature = str(metric.get_signature())
    return score


def chrf(hyps, refs):
    """Corpus chrF2 [4]: a sacrebleu CHRFScore (with .signature)."""
    from sacrebleu.metrics import CHRF

    metric = CHRF()
    score = metric.corpus_score(list(hyps), [list(refs)])
    score.signature = str(metric.get_signature())
    return score


def score_report(hyps, refs, already_tokenized=False):
    """One line: tokenized BLEU (multi-bleu.perl style), SacreBLEU with its signature, chrF."""
    tb, sb, cs = tokenized_bleu(hyps, refs, already_tokenized), bleu(hyps, refs), chrf(hyps, refs)
    how = "as given" if already_tokenized else "13a-tokenized"
    return (f"tokenized BLEU = {tb.score:.2f} ({how}, tok:none, as multi-bleu.perl) | "
            f"SacreBLEU {sb} | {sb.signature} | chrF2 = {cs.score:.2f}")


# ---------------------------------------------------------------------------------------
# Paired bootstrap resampling [6] (Koehn 2004), the significance test of [1] and [5].
#
# Draw n_samples test sets of the same size from the real one, with replacement, the
# same sentence indices for both systems; on each draw compute both corpus BLEUs. The
# spread of a system's BLEU over the draws gives its 95% confidence interval; how often
# the difference between the systems is as large as the real one, once the draws are
# centred on "no difference", gives the p-value:
#   p = (#{s : |d_s| - mean_s |d_s| > |BLEU_sys - BLEU_base|} + 1) / (n_samples + 1)
# Note: we call SacreBLEU's own implementation (sacrebleu.significance.PairedTest,
# test_type="bs", the Moses bootstrap-hypothesis-difference-significance.pl port), not a
# rewrite; the CI is mean +- half the width of the 2.5%..97.5% percentile range.
# ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def _sacrebleu_seed(seed):
    """SacreBLEU reads its resampling seed from $SACREBLEU_SEED; set it for one call."""
    old = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = "None" if seed is None else str(int(seed))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SACREBLEU_SEED", None)
        else:
            os.environ["SACREBLEU_SEED"] = old


def paired_bootstrap(baseline_hyps, system_hyps, refs, n_samples=1000, seed=12345, already_tokenized=False):
    """Paired bootstrap test of system vs baseline on corpus BLEU -> dict.

    Keys: "baseline" and "system", each {"bleu", "mean", "ci"} (BLEU on the real test set,
    the bootstrap mean, and the 95% interval half-width: mean +- ci), plus "ci_low" and
    "ci_high"; "p_value" (of the system's difference from the baseline; < 0.05 is the
    usual "significant"), "delta" (system - baseline BLEU), "n_samples", "signature",
    "identical" (the two outputs are the same, line for line: p = 1, see below).
    BLEU is SacreBLEU's 13a BLEU, or tokenize="none" when already_tokenized (see above).
    Note: SacreBLEU treats seed 0 as "no seed"; None draws from the OS (not reproducible).
    """
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    base, sys_, refs = list(baseline_hyps), list(system_hyps), list(refs)
    if not (len(base) == len(sys_) == len(refs)):
        raise DecodeError(f"line counts differ: baseline {len(base)}, system {len(sys_)}, references {len(refs)}")
    if not refs:
        raise DecodeError("paired bootstrap needs at least one sentence")
    metric = BLEU(tokenize="none") if already_tokenized else BLEU()
    with _sacrebleu_seed(seed):
        test = PairedTest([("baseline", base), ("system", sys_)], {"BLEU": metric}, [refs],
                          test_type="bs", n_samples=n_samples)
        signatures, scores = test()
    b, s = scores["BLEU"]  # sacrebleu Result objects: score, p_value, mean, ci
    p_value = float(s.p_value)
    if base == sys_:
        # Note: for two identical outputs every resampled difference is 0 and so is the real
        # one; SacreBLEU counts strictly larger centred differences, finds none, and returns
        # its smallest p-value, 1 / (n_samples + 1), i.e. "significant". There is no
        # difference to test: we report p = 1.
        p_value = 1.0
    out = {"n_samples": n_samples, "signature": str(signatures["BLEU"]),
           "p_value": p_value, "delta": float(s.score - b.score), "identical": base == sys_}
    for name, r in (("baseline", b), ("system", s)):
        out[name] = {"bleu": float(r.score), "mean": float(r.mean), "ci": float(r.ci),
                     "ci_low": float(r.mean - r.ci), "ci_high": float(r.mean + r.ci)}
    return out


def bootstrap_table(result, names=("baseline", "system")):
    """A small rich Table of paired_bootstrap's result (print result["signature"] with it)."""
    from rich.table import Table

    table = Table(title=f"paired bootstrap resampling, {result['n_samples']} samples")
    for col in ("system", "BLEU", "mean +- 95% CI", "p-value"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for key, name in zip(("baseline", "system"), names):
        r = result[key]
        p = "-" if key == "baseline" else f"{result['p_value']:.4f}"
        table.add_row(str(name), f"{r['bleu']:.2f}", f"{r['mean']:.2f} +- {r['ci']:.2f}", p)
    return table


# ---------------------------------------------------------------------------------------
# Label-smoothed perplexity ([1] Table 8).
#
# Teacher forcing over held-out pairs (src, y), n = all target tokens y_1..y_m, EOS:
#   NLL        = sum_t -log p(y_t | y_<t, x)                        ppl          = exp(NLL / n)
#   smoothed   = sum_t (1 - eps) * -log p(y_t) + eps * mean_{w in A} -log p(w)
#                                                                   smoothed ppl = exp(smoothed / n)
# A is the target vocabulary (the words the output layer does not mask). The smoothed loss
# is the training objective, so its perplexity is what [1] Table 8 lists for train and
# test; ppl is the ordinary one. Since -log p(w) >= 0 and, by Jensen, the mean over A of
# -log p(w) >= log |A|, per token: smoothed >= (1 - eps) * NLL + eps * log |A|.
# Note: the loss is train.label_smoothed_loss, the one training minimises, so the numbers
# agree with the training log.
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def perplexity(model, tokenizer, pairs, label_smoothing=0.1, batch_tokens=4096, device=None):
    """pairs [(src, tgt)] of raw text -> dict(smoothed_ppl, ppl, smoothed_loss, nll, n_tokens).

    smoothed_loss and nll are per target token (EOS included); the ppl's are their exp.
    Pairs with an empty source are skipped (the encoder would attend to nothing).
    """
    import data
    import train  # Note: imported here, not at the top: train.py imports decode too

    device = torch.device(device) if device is not None else next(model.parameters()).device
    encoded = [e for e in data.encode_pairs(tokenizer, list(pairs)) if e[0]]
    if not encoded:
        raise DecodeError("perplexity: no pair with a non-empty source")
    total, nll_total, n = train.evaluate_loss(model, encoded, batch_tokens, device, label_smoothing)

    return {"smoothed_ppl": math.exp(total / n), "ppl": math.exp(nll_total / n),
            "smoothed_loss": total / n, "nll": nll_total / n, "n_tokens": n}


# ---------------------------------------------------------------------------------------
# Attention heatmaps ([5] Figures 1-2: attention weights with and without QKNorm).
#
# One teacher-forced forward of (x, BOS y) with keep_weights on the chosen module: its
# written-out path stores softmax(scores) (B, H, Tq, Tk) as last_weights; we take head h.
#   kind "enc":   encoder self-attention    rows = cols = source pieces x_1..x_S
#   kind "dec":   decoder self-attention    rows = cols = decoder inputs BOS, y_1..y_m
#                 (causal: row t has zeros right of the diagonal)
#   kind "cross": decoder-encoder attention rows = the piece each position predicts,
#                 y_1..y_m, EOS; cols = source pieces
# Note: decoder row t reads input y_{t-1} (BOS at t = 1) and predicts y_t. For "cross" we
# label rows with the predicted piece, so that a row shows where the model looked to
# write that piece (an alignment); for "dec" both axes are the same input positions.
# ---------------------------------------------------------------------------------------
def _attention_module(model, kind, layer):
    stacks = {"enc": (model.encoder, "self_attn"), "dec": (model.decoder, "self_attn"),
              "cross": (model.decoder, "cross_attn")}
    if kind not in stacks:
        raise DecodeError(f"--kind must be one of {', '.join(stacks)}, not {kind!r}")
    layers, attr = stacks[kind]
    if not 0 <= layer < len(layers):
        raise DecodeError(f"--layer {layer}: the {'encoder' if kind == 'enc' else 'decoder'} has "
                          f"layers 0..{len(layers) - 1}")
    return getattr(layers[layer], attr)


@torch.no_grad()
def attention_weights(model, tokenizer, src_line, tgt_line=None, layer=0, head=0, kind="cross"):
    """One attention map -> (weights (Tq, Tk) float tensor on CPU, query_tokens, key_tokens).

    Teacher-forced on tgt_line, or on the model's own greedy translation when it is None.
    Tokens are BPE pieces (strings), the labels of the rows and columns (see above).
    keep_weights and last_weights of the module, and the model's train/eval mode, are
    restored afterwards. Rows sum to 1.
    """
    module = _attention_module(model, kind, layer)
    if not 0 <= head < model.cfg.heads:
        raise DecodeError(f"--head {head}: the model has heads 0..{model.cfg.heads - 1}")
    device = next(model.parameters()).device
    x = tokenizer.encode(src_line)
    if not x:
        raise DecodeError("--attention: the source sentence is empty")
    src = torch.tensor([x], device=device)  # (1, S)
    was_training = model.training
    model.eval()
    old = (module.keep_weights, module.last_weights)
    try:
        y = greedy_search(model, src) if tgt_line is None else [tokenizer.encode(tgt_line)]
        y = y[0]
        tgt_in = torch.tensor([[BOS] + y], device=device)  # (1, T)  BOS y_1..y_m
        module.keep_weights = True  # the written-out attention path, which returns the weights
        model(src, tgt_in)
        w = module.last_weights[0, head].float().cpu()  # (Tq, Tk)
    finally:
        module.keep_weights, module.last_weights = old
        model.train(was_training)
    src_pieces = [tokenizer.piece(i) for i in x]
    if kind == "enc":
        return w, src_pieces, src_pieces
    if kind == "dec":
        inputs = ["<s>"] + [tokenizer.piece(i) for i in y]
        return w, inputs, inputs
    return w, [tokenizer.piece(i) for i in y] + ["</s>"], src_pieces


SHADES = " .:-=+*#%@"  # weight 0 -> " ", weight 1 -> "@"


def _label(text, width):
    return text if len(text) <= width else text[:width - 1] + "~"


def render_heatmap(weights, rows, cols, max_label=8):
    """A text heatmap of weights (R, C) in [0, 1]: one character per cell, by weight.

    The shade is SHADES[round(w * 9)] on an absolute scale (not per row), so that maps of
    different heads and models compare. Labels longer than max_label are cut ("~").
    Column labels are written across the top; each column is as wide as its label.
    """
    w = torch.as_tensor(weights, dtype=torch.float32)
    if w.dim() != 2 or w.shape != (len(rows), len(cols)):
        raise ValueError(f"weights {tuple(w.shape)} do not match {len(rows)} rows x {len(cols)} columns")
    rlab = [_label(r, max_label) for r in rows]
    clab = [_label(c, max_label) for c in cols]
    rw = max([len(r) for r in rlab] + [1])
    lines = [" " * rw + " | " + " ".join(clab)]
    for r, row in zip(rlab, w.tolist()):
        cells = []
        for c, v in zip(clab, row):
            ch = SHADES[min(len(SHADES) - 1, max(0, round(v * (len(SHADES) - 1))))]
            cells.append(ch * len(c))  # the shade, as wide as its column's label
        lines.append(r.rjust(rw) + " | " + " ".join(cells))
    lines.append(f"shades: {SHADES!r} for weights 0 .. 1 (absolute scale)")
    return "\n".join(lines)


def save_heatmap_png(weights, rows, cols, path, title=None):
    """Saves the map as a PNG with matplotlib; True if written.

    matplotlib is optional: without it this prints one line on stderr and returns False
    (it never raises ImportError).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; {path} was not written (pip install matplotlib)",
              file=sys.stderr)
        return False
    w = torch.as_tensor(weights, dtype=torch.float32).numpy()
    fig, ax = plt.subplots(figsize=(max(4, 0.4 * len(cols) + 2), max(3, 0.4 * len(rows) + 1.5)))
    im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=90)
    ax.set_yticks(range(len(rows)), rows)
    if title:
        ax.set_title(title)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------
# The learned g's ([1] Figures 3-4: the g of every ScaleNorm, by depth; [5]: QKNorm's g).
#
# Every scalar g of the model, from model.learned_scales(), in depth order:
#   ScaleNorm:  y = g * x / ||x||       one g per norm (per sublayer, plus a final one per stack)
#   QKNorm:     softmax(g * Q^ K^T) V   one g per attention module
# Paper [1] section 2.3 / eq. 6: with PreNorm + ScaleNorm + FixNorm the decoder's final
# g multiplies every logit, logit_w = g cos(h, e_w) + b_w: it is the softmax temperature
# (Code: there is no separate FixNorm g). LayerNorm and RMSNorm have vector gains and
# are left out; a LayerNorm model without QKNorm has no scalar g at all.
# ---------------------------------------------------------------------------------------
_SUBLAYER = {"norm_attn": "self-attn", "norm_self": "self-attn", "norm_cross": "cross-attn",
             "norm_ff": "ffn", "self_attn": "self-attn", "cross_attn": "cross-attn"}


def g_values(model):
    """[{name, stack, layer, sublayer, kind, value}] for every scalar g, in depth order.

    stack "encoder"/"decoder"; layer the 0-based layer index (the final norm gets
    layer = number of layers); sublayer "self-attn", "cross-attn", "ffn", "final" (or
    "final (temp.)": the decoder's final g under FixNorm); kind "ScaleNorm", "QKNorm", ...
    """
    out = []
    for name, value in model.learned_scales().items():
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        parts = name.split(".")
        if parts[0] in ("encoder", "decoder"):
            stack, layer, sub = parts[0], int(parts[1]), _SUBLAYER.get(parts[2], parts[2])
        elif parts[0] in ("enc_final_norm", "dec_final_norm"):
            stack = "encoder" if parts[0].startswith("enc") else "decoder"
            layer = len(model.encoder if stack == "encoder" else model.decoder)
            sub = "final"
            if stack == "decoder" and model.cfg.fixnorm:
                sub = "final (temp.)"  # FixNorm: logit = g cos(h, e_w) + b_w
        else:
            stack, layer, sub = "-", -1, parts[0]
        kind = "QKNorm" if type(owner).__name__ == "MultiHeadAttention" else type(owner).__name__
        out.append({"name": name, "stack": stack, "layer": layer, "sublayer": sub, "kind": kind,
                    "value": value})
    return out


def g_table(model, bar_width=12):
    """The g's as a rich Table (None when the model has no scalar g); bar length ~ |g|."""
    from rich import box
    from rich.table import Table

    rows = g_values(model)
    if not rows:
        return None
    top = max(abs(r["value"]) for r in rows) or 1.0
    table = Table(title="learned g (ScaleNorm / QKNorm), by depth", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    for col in ("name", "layer", "sublayer", "kind", "g", "|g|"):
        table.add_column(col, justify="right" if col in ("layer", "g") else "left", no_wrap=True,
                         min_width=bar_width if col == "|g|" else None)
    for r in rows:
        bar = "#" * round(bar_width * abs(r["value"]) / top)  # length proportional to |g|
        table.add_row(r["name"], str(r["layer"]), r["sublayer"], r["kind"], f"{r['value']:.3f}", bar)
    return table


def print_g_table(model, console=None):
    """Prints the g table on console (a rich Console; None: a new one on stdout).

    A model without scalar g's (LayerNorm without QKNorm) gets one line saying so.
    """
    from rich.console import Console

    console = console or Console()
    table = g_table(model)
    if table is None:
        console.print("no scalar g in this model (no ScaleNorm and no QKNorm)")
    else:
        console.print(table)


def save_g_values(model, path):
    """Writes g_values(model) as a JSON list to path (atomically); returns the list."""
    rows = g_values(model)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return rows


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------
def split_lines(text):
    """Text -> lines without their newlines (CRLF too); a final newline ends the last line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [l.rstrip("\r") for l in lines]


def read_lines(path):
    """A text file's lines; DecodeError (naming the file) if it is missing or unreadable."""
    try:
        return split_lines(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DecodeError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DecodeError(f"{path}: cannot read ({type(e).__name__})") from None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Translate with a trained checkpoint (beam search or greedy), score it (tokenized "
                    "BLEU, SacreBLEU, chrF), test significance, and look inside the model.")
    ap.add_argument("checkpoint", nargs="?", help="a checkpoint .pt file, or a run directory "
                    "(its checkpoint_best.pt, else checkpoint_last.pt); not needed with --compare")
    ap.add_argument("--input", help="source text, one sentence a line (default: stdin)")
    ap.add_argument("--output", help="where to write translations, one a line (default: stdout)")
    ap.add_argument("--ref", help="reference translations: print tokenized BLEU, SacreBLEU with its "
                    "signature, and chrF on stderr")
    ap.add_argument("--tokenized", action="store_true",
                    help="the references (and so the outputs) are already tokenized, e.g. the Moses-"
                         "tokenized IWSLT'15 en-vi of [1]: tokenized BLEU scores them as they are, "
                         "with tokenize=none, which is exactly multi-bleu.perl ([1] appendix A reports "
                         "tokenized BLEU). Without it, raw text is 13a-tokenized first (then the "
                         "tokenized BLEU equals SacreBLEU's). Also used by --compare")
    ap.add_argument("--beam", type=int, default=4, help="beam size; 1 = greedy search (TwT: 4)")
    ap.add_argument("--alpha", type=float, default=0.6,
                    help="GNMT length penalty ((5 + |Y|) / 6)^alpha (TwT: 0.6)")
    ap.add_argument("--max-len-b", type=int, default=50,
                    help="maximum output length = source length + this (TwT code: 50)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: cuda if available, else cpu (bf16 autocast on cuda)")
    ap.add_argument("--batch-tokens", type=int, default=4096,
                    help="source tokens per batch, counted as sentences x longest length")
    ap.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
    ap.add_argument("--benchmark", action="store_true",
                    help="time greedy (beam 1) and beam search on --input (after a warm-up); "
                         "print sentences/s, target tokens/s and, with --ref, the BLEU of each")
    ev = ap.add_argument_group("evaluation and analysis")
    ev.add_argument("--average", type=int, default=0, metavar="N",
                    help="translate with the average of the run directory's last N checkpoint_epoch*.pt "
                         "(PowerNorm [7]: 5); floats are averaged, integer/bool buffers copied")
    ev.add_argument("--ppl", action="store_true",
                    help="with --ref: also print the label-smoothed and plain test perplexity "
                         "(teacher forced, [1] Table 8)")
    ev.add_argument("--label-smoothing", type=float, default=None,
                    help="epsilon for --ppl (default: the checkpoint's training value, else 0.1)")
    ev.add_argument("--compare", nargs=2, metavar=("BASELINE", "SYSTEM"),
                    help="paired bootstrap resampling (Koehn 2004, SacreBLEU's implementation) of two "
                         "output files against --ref: BLEU, 95%% CI, p-value; no checkpoint needed")
    ev.add_argument("--samples", type=int, default=1000, help="bootstrap resamples for --compare")
    ev.add_argument("--seed", type=int, default=12345, help="resampling seed for --compare (SacreBLEU's default)")
    ev.add_argument("--attention", metavar="SOURCE",
                    help="print the attention map of this source sentence (QKNorm [5] Figures 1-2), "
                         "teacher-forced on --attention-target or the model's own greedy translation")
    ev.add_argument("--attention-target", metavar="TARGET", help="the target sentence for --attention")
    ev.add_argument("--layer", type=int, default=0, help="layer of --attention (0-based)")
    ev.add_argument("--head", type=int, default=0, help="head of --attention (0-based)")
    ev.add_argument("--kind", default="cross", choices=["cross", "enc", "dec"],
                    help="--attention: decoder-encoder (cross), encoder self (enc) or decoder self (dec)")
    ev.add_argument("--png", help="--attention: also save the map as a PNG (needs matplotlib)")
    ev.add_argument("--g-table", action="store_true",
                    help="print every learned scalar g (ScaleNorm, QKNorm) by depth ([1] Figures 3-4)")
    args = ap.parse_args(argv)
    if args.beam < 1:
        ap.error("--beam must be at least 1")
    if args.average < 0:
        ap.error("--average must be 0 (off) or a number of checkpoints")
    if args.compare:
        if not args.ref:
            ap.error("--compare needs --ref")
    elif not args.checkpoint:
        ap.error("a checkpoint (file or run directory) is needed, except with --compare")
    if args.ppl and not args.ref:
        ap.error("--ppl needs --ref (and the sources in --input or on stdin)")
    if args.attention_target is not None and args.attention is None:
        ap.error("--attention-target needs --attention")
    return args


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def benchmark(model, tokenizer, lines, refs, args, device):
    """Speed of greedy and beam search with the BLEU each one buys; prints, asserts nothing."""
    beams = [1, args.beam if args.beam > 1 else 4]
    warm = lines[:32]
    for k in beams:  # warm-up: allocator, kernels, thread pools
        translate_ids(model, tokenizer, warm, k, args.alpha, args.batch_tokens, device, False, args.max_len_b)
    print(f"benchmark: {len(lines)} sentences on {device} (torch threads {torch.get_num_threads()}), "
          f"batch_tokens {args.batch_tokens}", file=sys.stderr)
    for k in beams:
        _sync(device)
        t0 = time.perf_counter()
        ids = translate_ids(model, tokenizer, lines, k, args.alpha, args.batch_tokens, device, False, args.max_len_b)
        _sync(device)
        secs = time.perf_counter() - t0
        n_tok = sum(len(h) + 1 for h in ids)  # output tokens, EOS counted (as in training)
        name = "greedy (beam 1)" if k == 1 else f"beam {k}, alpha {args.alpha}"
        line = f"{name:>22}: {len(lines) / secs:8.1f} sentences/s {n_tok / secs:9.0f} target tokens/s ({secs:.2f} s)"
        if refs is not None:
            line += f"  BLEU {bleu([tokenizer.decode(h) for h in ids], refs).score:.2f}"
        print(line, file=sys.stderr)


def compare(args):
    """--compare BASELINE SYSTEM --ref REF: the paired bootstrap table on stdout."""
    from rich.console import Console

    base_path, sys_path = args.compare
    base, system, refs = read_lines(base_path), read_lines(sys_path), read_lines(args.ref)
    for path, lines in ((base_path, base), (sys_path, system)):
        if len(lines) != len(refs):
            raise DecodeError(f"{path}: {len(lines)} lines, but {args.ref} has {len(refs)}")
    result = paired_bootstrap(base, system, refs, args.samples, args.seed, args.tokenized)
    Console().print(bootstrap_table(result, names=(base_path, sys_path)))
    verdict = "significant" if result["p_value"] < 0.05 else "not significant"
    print(result["signature"])
    print(f"delta {result['delta']:+.2f} BLEU, p = {result['p_value']:.4f} ({verdict} at 0.05)")


def analyse(args, model, tokenizer):
    """--g-table and --attention: print, write nothing but the optional PNG."""
    from rich.console import Console

    if args.g_table:
        print_g_table(model, Console())
    if args.attention is not None:
        w, rows, cols = attention_weights(model, tokenizer, args.attention, args.attention_target,
                                          args.layer, args.head, args.kind)
        teacher = "given target" if args.attention_target is not None else "greedy translation"
        print(f"{args.kind} attention, layer {args.layer}, head {args.head} ({teacher}); rows = queries")
        print(render_heatmap(w, rows, cols))
        if args.png and save_heatmap_png(w, rows, cols, args.png,
                                         title=f"{args.kind} layer {args.layer} head {args.head}"):
            print(f"wrote {args.png}", file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        try:
            compare(args)
        except DecodeError as e:
            sys.exit(f"decode.py: error: {e}")
        return 0
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    analysis = args.g_table or args.attention is not None
    try:  # every check before any work; stdin is read last, so errors show at once
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DecodeError("--device cuda: no CUDA device is available")
        lines = read_lines(args.input) if args.input else None
        refs = read_lines(args.ref) if args.ref else None
        model, tokenizer, ckpt = load_checkpoint(args.checkpoint, device, average=args.average)
        if analysis:
            analyse(args, model, tokenizer)
            return 0
        if lines is None:
            lines = split_lines(sys.stdin.read())
        if refs is not None and len(refs) != len(lines):
            raise DecodeError(f"{args.ref}: {len(refs)} lines, but {args.input or 'stdin'} has {len(lines)}")
    except DecodeError as e:
        sys.exit(f"decode.py: error: {e}")
    avg = f", average of {len(ckpt['averaged_from'])} epochs" if "averaged_from" in ckpt else ""
    print(f"loaded {args.checkpoint} (step {ckpt.get('step')}, dev BLEU {ckpt.get('dev_bleu')}, "
          f"{ckpt.get('src_lang', '?')}->{ckpt.get('tgt_lang', '?')}{avg})", file=sys.stderr)

    with torch.inference_mode():
        if args.benchmark:
            benchmark(model, tokenizer, lines, refs, args, device)
            return 0
        hyps = translate(model, tokenizer, lines, args.beam, args.alpha, args.batch_tokens, device,
                         args.progress, args.max_len_b)
    text = "".join(h + "\n" for h in hyps)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    if refs is not None:
        print(score_report(hyps, refs, args.tokenized), file=sys.stderr)
        if args.ppl:
            eps = args.label_smoothing
            if eps is None:
                eps = (ckpt.get("args") or {}).get("label_smoothing", 0.1)
            ppl = perplexity(model, tokenizer, list(zip(lines, refs)), eps, args.batch_tokens, device)
            print(f"test perplexity: label-smoothed (eps {eps}) {ppl['smoothed_ppl']:.2f}, "
                  f"plain {ppl['ppl']:.2f} over {ppl['n_tokens']} target tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
