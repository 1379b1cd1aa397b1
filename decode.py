"""decode.py -- greedy and beam search, translation of a file, and SacreBLEU scoring.

Reading order: norms.py -> model.py -> data.py -> train.py -> decode.py (this file).
Shapes: B sentences, S source length, T target length, K beam size, V vocabulary,
n the sentences of a batch that are still being decoded (n <= B).

What is here, top-down:
  length penalty (GNMT [2]) -> greedy search -> beam search (batched over sentences and
  beams, cached keys/values, sentences leave the batch when done) -> checkpoint loading
  -> translate() (length-sorted batches, original order restored) -> BLEU / chrF ->
  the command line, with a speed-and-quality benchmark.

How to run:
  python decode.py runs/toy                          # stdin -> stdout, best checkpoint
  python decode.py runs/toy/checkpoint_last.pt --input data/toy/test.src \\
      --output test.hyp --ref data/toy/test.tgt       # BLEU + signature on stderr
  python decode.py runs/toy --input data/toy/dev.src --ref data/toy/dev.tgt --benchmark
  python decode.py --help

Papers (numbers used in comments):
  [1] Nguyen & Salazar 2019, Transformers without Tears (TwT): beam 4, alpha 0.6,
      maximum output length = source length + 50 (the authors' code, REFERENCE.md).
  [2] Wu et al. 2016, Google's Neural Machine Translation System (GNMT), eq. 14:
      the length penalty lp(Y) = ((5 + |Y|) / 6)^alpha.
  [3] Post 2018, A Call for Clarity in Reporting BLEU Scores (SacreBLEU).
  [4] Popovic 2015, chrF: character n-gram F-score.

Comment markers: ``# Paper:`` is what a paper says, ``# Note:`` is ours, and
``# Code:`` is what the authors' released code does (../shared/REFERENCE.md).
"""
import argparse
import contextlib
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
def load_checkpoint(path, device="cpu"):
    """A .pt file or a run directory -> (model in eval mode on device, tokenizer, ckpt dict).

    A run directory gives its checkpoint_best.pt, else its checkpoint_last.pt. The
    tokenizer is rebuilt from the sentencepiece model embedded in the checkpoint
    ("bpe_model_proto"), so a checkpoint file alone can translate.
    Raises DecodeError (one line, naming the path) for a missing file or a non-checkpoint.
    """
    from data import Tokenizer

    p = Path(path)
    if p.is_dir():
        found = [p / n for n in ("checkpoint_best.pt", "checkpoint_last.pt") if (p / n).is_file()]
        if not found:
            raise DecodeError(f"{p}: run directory has no checkpoint_best.pt or checkpoint_last.pt")
        p = found[0]
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

    model = Transformer(ModelConfig(**ckpt["model_config"]))
    # Note: a module saved after torch.compile has "_orig_mod." prefixes; accept both.
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    model.load_state_dict(state)
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
# Scoring [3, 4]
# Note: corpus BLEU on detokenized text with SacreBLEU's default 13a tokenization, so that
# the number comes with a signature anyone can reproduce. Code: the authors report
# multi-bleu.perl on their tokenized text (= SacreBLEU tokenize="none" on that text);
# the two numbers are not comparable.
# ---------------------------------------------------------------------------------------
def bleu(hyps, refs):
    """Corpus BLEU of detokenized hyps against one reference each: a sacrebleu BLEUScore.

    Note: the score also carries .signature, the metric's signature as a string
    ("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"), which sacrebleu keeps
    on the metric, not on the score: report it with the number.
    """
    from sacrebleu.metrics import BLEU

    metric = BLEU()
    score = metric.corpus_score(list(hyps), [list(refs)])
    score.signature = str(metric.get_signature())
    return score


def score_report(hyps, refs):
    """One line: BLEU with its details, the BLEU signature, and chrF."""
    from sacrebleu.metrics import BLEU, CHRF

    b, c = BLEU(), CHRF()
    bs, cs = b.corpus_score(list(hyps), [list(refs)]), c.corpus_score(list(hyps), [list(refs)])
    return f"{bs} | {b.get_signature()} | chrF2 = {cs.score:.2f}"


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
        description="Translate with a trained checkpoint (beam search or greedy) and score with SacreBLEU.")
    ap.add_argument("checkpoint", help="a checkpoint .pt file, or a run directory "
                    "(its checkpoint_best.pt, else checkpoint_last.pt)")
    ap.add_argument("--input", help="source text, one sentence a line (default: stdin)")
    ap.add_argument("--output", help="where to write translations, one a line (default: stdout)")
    ap.add_argument("--ref", help="reference translations: print BLEU, its signature and chrF on stderr")
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
    args = ap.parse_args(argv)
    if args.beam < 1:
        ap.error("--beam must be at least 1")
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


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    try:  # every check before any work; stdin is read last, so errors show at once
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DecodeError("--device cuda: no CUDA device is available")
        lines = read_lines(args.input) if args.input else None
        refs = read_lines(args.ref) if args.ref else None
        model, tokenizer, ckpt = load_checkpoint(args.checkpoint, device)
        if lines is None:
            lines = split_lines(sys.stdin.read())
        if refs is not None and len(refs) != len(lines):
            raise DecodeError(f"{args.ref}: {len(refs)} lines, but {args.input or 'stdin'} has {len(lines)}")
    except DecodeError as e:
        sys.exit(f"decode.py: error: {e}")
    print(f"loaded {args.checkpoint} (step {ckpt.get('step')}, dev BLEU {ckpt.get('dev_bleu')}, "
          f"{ckpt.get('src_lang', '?')}->{ckpt.get('tgt_lang', '?')})", file=sys.stderr)

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
        print(score_report(hyps, refs), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
