"""train.py -- train a translator with the recipes of Transformers without Tears [1].

Reading order: norms.py -> model.py -> data.py -> train.py -> decode.py.

    python train.py --norm scale --prenorm --fixnorm            # quick start, built-in corpus
    python train.py --data DIR --src en --tgt de --out runs/ende  # your corpus: DIR/train.en ...
    python train.py --help                                        # every flag, with its paper

The defaults are the quick start (d 128, 2+2 layers, peak LR 2e-3 after 200 warmup steps,
4 epochs of 100 steps): about 5 minutes on a 2-core CPU. The papers' base model is
``--layers 6 --d-model 512 --heads 8 --ff 2048 --dropout 0.3 --lr-scale 1 --warmup 8000``.

What one run does: reads (or generates) the corpus, trains a joint BPE, encodes and caches
the data, builds the model, and trains with Adam and the inverse square root schedule
(eq. 7 of [1]); every --epoch-size steps it computes dev BLEU and keeps the best
checkpoint; at the end it reports test BLEU of the best checkpoint. The run directory
(--out) holds config.json, metrics.jsonl, bpe.model and the checkpoints, each written
atomically; ``--resume RUN_DIR`` continues a killed run from its last checkpoint.

  [1] Nguyen & Salazar 2019, Transformers without Tears.
  [2] Shen et al. 2020, PowerNorm.    [3] Henry et al. 2020, Query-Key Normalization.
"""
import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import data
from model import ModelConfig, Transformer, count_parameters
from norms import NORMS


# ---------------------------------------------------------------------------------------
# Flags. Every flag names the paper and equation it comes from; --help is the documentation.
# ---------------------------------------------------------------------------------------
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where there is a default worth showing."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action, (argparse._StoreFalseAction, argparse._StoreTrueAction)):
            return action.help
        return super()._get_help_string(action)


def build_parser():
    p = argparse.ArgumentParser(
        description="Train a Transformer translator with the normalizations of TwT [1], "
                    "PowerNorm [2] and QKNorm [3]. [1] Nguyen & Salazar 2019, Transformers without "
                    "Tears; [2] Shen et al. 2020, PowerNorm; [3] Henry et al. 2020, Query-Key "
                    "Normalization for Transformers. The defaults are the quick start: a small model that "
                    "learns the built-in corpus in about 5 minutes on 2 CPU cores. The papers' base model is "
                    "--layers 6 --d-model 512 --heads 8 --ff 2048 --dropout 0.3 --lr-scale 1 --warmup 8000 "
                    "--epoch-size 1000 --max-epochs 200.",
        formatter_class=_HelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None,
                   help="corpus directory holding {train,dev,test}.{SRC,TGT}; default: the "
                        "built-in synthetic corpus (data.py), generated on first use")
    g.add_argument("--src", default=None, help="source language suffix, e.g. en (DIR/train.en)")
    g.add_argument("--tgt", default=None, help="target language suffix, e.g. de (DIR/train.de)")
    g.add_argument("--bpe-size", type=int, default=None,
                   help="joint sentencepiece BPE vocabulary size ([1] appendix A: 8k; 3k for gl-en); "
                        "default 8000, or 2000 on the built-in corpus")
    g.add_argument("--max-len", type=int, default=250,
                   help="training pairs longer than this (BPE tokens, either side) are dropped, with a count")
    g.add_argument("--batch-tokens", type=int, default=4096,
                   help="tokens per batch, counted as sentences x the longer side's padded length ([1] appendix A: 4096)")
    g.add_argument("--word-dropout", type=float, default=0.1,
                   help="probability that an input token becomes UNK ([1] appendix A, training only)")

    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=2, help="encoder and decoder layers ([1]: 6; 4 for gl-en)")
    g.add_argument("--enc-layers", type=int, default=None, help="override --layers for the encoder")
    g.add_argument("--dec-layers", type=int, default=None, help="override --layers for the decoder")
    g.add_argument("--d-model", type=int, default=128, help="model width d ([1]: 512)")
    g.add_argument("--heads", type=int, default=4, help="attention heads ([1]: 8; [3] Table 4 varies it)")
    g.add_argument("--ff", type=int, default=512, help="feed-forward width ([1]: 2048)")
    g.add_argument("--dropout", type=float, default=0.1,
                   help="dropout on embeddings, sublayer outputs, ReLU and attention weights ([1] appendix A: 0.3)")
    g.add_argument("--attn-dropout", type=float, default=None, help="attention-weight dropout (default: --dropout)")
    g.add_argument("--relu-dropout", type=float, default=None, help="ReLU dropout (default: --dropout)")
    g.add_argument("--norm", default="scale", choices=sorted(NORMS),
                   help="norm of every sublayer: layer (LayerNorm), scale (ScaleNorm, [1] eq. 5), "
                        "scale_fixed (g = sqrt d, [1] Table 7), rms (RMSNorm), and the batch norms of [2]")
    g.add_argument("--encoder-norm", default=None, choices=sorted(NORMS),
                   help="override --norm in the encoder ([2] used PowerNorm in the encoder only)")
    g.add_argument("--decoder-norm", default=None, choices=sorted(NORMS), help="override --norm in the decoder")
    place = g.add_mutually_exclusive_group()
    place.add_argument("--prenorm", dest="prenorm", action="store_true", default=True,
                       help="PreNorm residual x + F(norm(x)) ([1] eq. 3), plus a final norm per stack (the default)")
    place.add_argument("--postnorm", dest="prenorm", action="store_false",
                       help="PostNorm residual norm(x + F(x)) ([1] eq. 2, the original Transformer)")
    g.add_argument("--fixnorm", action=argparse.BooleanOptionalAction, default=True,
                   help="l2-normalise the tied embedding rows ([1] section 2.3, eq. 6 with ScaleNorm)")
    g.add_argument("--init", choices=["small", "xavier"], default="small",
                   help="SmallInit (attention std sqrt(2/5d), [1] section 2.2) or Xavier normal ([1] eq. 4)")
    g.add_argument("--qknorm", action="store_true",
                   help="QKNorm attention: softmax(g * q^.k^) with l2-normalised q, k ([3] eq. 2-5)")
    g.add_argument("--qk-length", type=float, default=None,
                   help="L of g0 = log2(L^2 - L) ([3] eq. 3); default: computed from the training data")
    g.add_argument("--qk-percentile", type=float, default=97.5,
                   help="percentile of training lengths used as L ([3] section 3; Table 5 varies it)")
    g.add_argument("--qk-no-g", action="store_true", help="QKNorm ablation: g fixed at 1 ([3] Table 6)")
    g.add_argument("--qk-norm-v", action="store_true", help="QKNorm ablation: l2-normalise V too ([3] Table 6)")
    g.add_argument("--pn-warmup", type=int, default=4000,
                   help="PowerNorm: forwards that use batch statistics while the running one accumulates "
                        "([2] appendix A: the LR warmup, 8000 for IWSLT14)")
    g.add_argument("--pn-variant", choices=["paper", "code"], default="paper",
                   help="PowerNorm: 'paper' follows [2] Algorithm 2 / eq. 12; 'code' reproduces the released "
                        "code (backward divides by the batch psi_B after warmup; padding enters the backward means)")
    g.add_argument("--pn-alpha-fwd", type=float, default=0.9, help="PowerNorm forward running-average alpha ([2] eq. 10)")
    g.add_argument("--pn-alpha-bkw", type=float, default=0.9, help="PowerNorm backward running-average alpha ([2] eq. 12)")
    g.add_argument("--sdpa", action=argparse.BooleanOptionalAction, default=True,
                   help="use torch's scaled_dot_product_attention (off: the written-out attention)")

    g = p.add_argument_group("optimisation and schedule")
    g.add_argument("--schedule", choices=["invsqrt", "valdecay", "nowarmup", "warmupflat"], default="invsqrt",
                   help="invsqrt: eq. 7 of [1] (INVSQRTDECAY); valdecay: eq. 7's linear warmup, then flat at its "
                        "peak, times --decay-factor when dev BLEU stalls ([1] 2.4, VALDECAY); nowarmup: constant "
                        "--lr (3e-4 in [1]) with the same validation decay; warmupflat: [3]'s name for valdecay "
                        "(linear warmup then flat, x0.8 validation decay)")
    g.add_argument("--lr-scale", type=float, default=None,
                   help="lambda of eq. 7: LR(n) = lambda / sqrt(d) * min(n^-0.5, n * warmup^-1.5) ([1] 3.3: 1, "
                        "and 2 for 2xLR); when given it overrides --lr")
    g.add_argument("--lr", type=float, default=2e-3,
                   help="peak LR (reached at n_warmup), i.e. lambda = lr * sqrt(d * warmup) in eq. 7; the constant "
                        "LR of --schedule nowarmup ([1] 3.3: 3e-4)")
    g.add_argument("--warmup", type=int, default=200, help="n_warmup of eq. 7 ([1]: 8000)")
    g.add_argument("--decay-factor", type=float, default=0.8, help="alpha_decay of validation decay ([1] 3.3)")
    g.add_argument("--patience", type=int, default=3,
                   help="validation decay when dev BLEU is below each of the previous PATIENCE evaluations ([1] 3.3)")
    g.add_argument("--stop-lr", type=float, default=1e-6,
                   help="stop when the LR falls below this ([1] appendix A: 1e-6; TwT code 5e-5; [3]: 1e-5)")
    g.add_argument("--early-stop", type=int, default=20,
                   help="stop when dev BLEU has not improved for this many evaluations ([1]: 20, 50 for gl-en; 0: off)")
    g.add_argument("--beta1", type=float, default=0.9, help="Adam beta1 ([1] appendix A)")
    g.add_argument("--beta2", type=float, default=0.999, help="Adam beta2 ([1] appendix A)")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon ([1] appendix A)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay (AdamW; [2] used 1e-4)")
    g.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm at this value (0: off)")
    g.add_argument("--label-smoothing", type=float, default=0.1,
                   help="epsilon of label smoothing, spread over the target vocabulary ([1] appendix A)")

    g = p.add_argument_group("run")
    g.add_argument("--out", default="runs/quickstart", help="run directory")
    g.add_argument("--seed", type=int, default=1, help="fixes every random choice")
    g.add_argument("--epoch-size", type=int, default=100,
                   help="steps per epoch; dev BLEU after each ([1]: 1000-2000 by pair)")
    g.add_argument("--max-epochs", type=int, default=4, help="stop after this many epochs ([1] Table 1: 200)")
    g.add_argument("--keep-checkpoints", type=int, default=5,
                   help="keep the last N per-epoch checkpoints, for checkpoint averaging ([2]: average of the last 5)")
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (quick checks)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (CUDA)")
    g.add_argument("--log-interval", type=int, default=50, help="steps between log lines")
    g.add_argument("--beam", type=int, default=4, help="beam size for test BLEU (Code: 4)")
    g.add_argument("--alpha", type=float, default=0.6, help="GNMT length penalty alpha (Code: 0.6)")
    g.add_argument("--dev-beam", type=int, default=1, help="beam size for the per-epoch dev BLEU (1 = greedy)")
    g.add_argument("--benchmark", type=int, default=0, metavar="N",
                   help="time N training steps after a warm-up and print tokens/s, FLOPs/token, MFU, padding "
                        "and peak memory, then exit (no evaluation, no files but config.json)")
    g.add_argument("--profile", action="store_true",
                   help="with --benchmark: also print where the time of a step goes (torch.profiler, by operator)")
    g.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last checkpoint (its saved flags are used)")
    return p


# ---------------------------------------------------------------------------------------
# The learning rate: eq. 7 of [1]
#   LR(n) = lambda / sqrt(d) * min(1/sqrt(n), n / n_warmup^1.5)
# (linear warmup to lambda / sqrt(d * n_warmup) at n = n_warmup, then inverse square root).
# ---------------------------------------------------------------------------------------
def inverse_sqrt_lr(step, d_model, warmup, lr_scale):
    n = max(step, 1)
    return lr_scale / math.sqrt(d_model) * min(n ** -0.5, n * warmup ** -1.5)


def lr_scale_for_peak(peak_lr, d_model, warmup):
    """The lambda that makes eq. 7 peak at peak_lr (at n = warmup)."""
    return peak_lr * math.sqrt(d_model) * math.sqrt(warmup)


def scheduled_lr(step, args, lr_scale, decay):
    """The LR of step n under --schedule; ``decay`` is the product of validation decays so far.

      invsqrt:              eq. 7
      valdecay, warmupflat: eq. 7's warmup branch up to n_warmup, then flat at the peak, x decay
      nowarmup:             constant --lr (3e-4), x decay
    """
    if args.schedule == "invsqrt":
        return inverse_sqrt_lr(step, args.d_model, args.warmup, lr_scale)
    if args.schedule == "nowarmup":
        return args.lr * decay
    return inverse_sqrt_lr(min(step, args.warmup), args.d_model, args.warmup, lr_scale) * decay


def validation_decay(history, patience):
    """[1] 3.3 VALDECAY. Code: decay when the newest dev BLEU is strictly below each of the
    previous `patience` ones (no cooldown); returns True when the LR should be multiplied."""
    if len(history) <= patience:
        return False
    return history[-1] < min(history[-1 - patience:-1])


# ---------------------------------------------------------------------------------------
# The loss: label-smoothed cross entropy [1 appendix A; Szegedy et al. 2016]
#   q = (1 - eps) * onehot(y) + eps * uniform over the allowed target types
#   loss = -sum_w q_w log p_w = (1 - eps) * NLL + eps * mean_{w allowed} (-log p_w)
# Code: smoothing is spread over the target vocabulary only (masked words have p = 0).
# With log p_w = z_w - logsumexp(z):  mean_{allowed}(-log p_w) = logsumexp(z) - mean_{allowed} z_w.
# ---------------------------------------------------------------------------------------
def label_smoothed_loss(logits, target, allowed, eps, weight=None):
    """logits (N, V) with -inf outside `allowed` (V,); target (N,); weight (N,) or None, e.g. 0 at
    padding. Returns the (weighted) summed loss and NLL.

    Note: weighting the padded rows by 0 is cheaper than selecting the real rows with
    logits[keep], which copies (N, V) forward and scatters it back in the backward.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (or fp64) softmax
    if weight is not None:  # a 0-weight row's target may be PAD, whose logit is -inf: score EOS there
        target = target.masked_fill(weight == 0, data.EOS)
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    nll = lse - logits.gather(-1, target[:, None]).squeeze(-1)  # (N,)  -log p_y
    if eps > 0:
        mean_allowed = torch.where(allowed, logits, 0.0).sum(-1) / allowed.sum()  # (N,)
        smooth = lse - mean_allowed  # (N,)  mean over allowed w of -log p_w
        loss = (1 - eps) * nll + eps * smooth
    else:
        loss = nll
    if weight is not None:
        loss, nll = loss * weight, nll * weight
    return loss.sum(), nll.sum()


class SmoothedCrossEntropy(torch.autograd.Function):
    """The loss above on logits z (N, C) over the C target words only (model(..., target_only=True)),
    in one fused pass each way. With logp = log_softmax(z) and q = (1 - eps) onehot(y) + eps / C:

        loss = sum_n w_n * (-sum_c q_c logp_c) = sum_n w_n ((1 - eps) NLL_n + eps * mean_c(-logp_c))
        dloss/dz = w_n * (softmax(z) - q)              (dNLL/dz = w_n * (softmax(z) - onehot(y)))

    Note (speed): autograd of label_smoothed_loss() runs logsumexp, where, gather and their
    backward kernels over (N, V), ~10 passes; this saves log p once and reads it twice.
    Tests: gradcheck in float64 and equality with label_smoothed_loss() on the masked logits.
    Returns (loss sum, NLL sum), both weighted.
    """

    @staticmethod
    def forward(ctx, z, target, weight, eps):
        logp = torch.log_softmax(z.to(torch.promote_types(z.dtype, torch.float32)), dim=-1)  # (N, C)
        weight = weight.to(logp.dtype)
        nll = -logp.gather(-1, target[:, None]).squeeze(-1)  # (N,)
        loss = (1 - eps) * nll - eps * logp.mean(-1)  # (N,)
        ctx.save_for_backward(logp, target, weight)
        ctx.eps, ctx.z_dtype = eps, z.dtype
        return (loss * weight).sum(), (nll * weight).sum()

    @staticmethod
    def backward(ctx, d_loss, d_nll):
        logp, target, weight = ctx.saved_tensors
        eps, C = ctx.eps, logp.size(-1)
        grad = logp.exp()  # softmax(z)
        grad.mul_((weight * (d_loss + d_nll))[:, None])  # w (dL + dNLL) softmax
        grad.sub_((weight * d_loss * eps / C)[:, None])  # - w dL eps / C
        grad.scatter_add_(-1, target[:, None], -(weight * (d_loss * (1 - eps) + d_nll))[:, None])  # - onehot
        return grad.to(ctx.z_dtype), None, None, None


# ---------------------------------------------------------------------------------------
# Small utilities: atomic writes, the run directory, devices.
# ---------------------------------------------------------------------------------------
def atomic_save(obj, path):
    """torch.save to a temporary file, then rename: a kill never leaves a broken file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_text(text, path):
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def append_jsonl(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def pick_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: no CUDA device is available (use --device cpu or auto)")
    return torch.device(name)


def model_config_from_args(args, vocab_size, qk_g0=1.0):
    return ModelConfig(
        vocab_size=vocab_size, d_model=args.d_model, heads=args.heads, ff=args.ff,
        enc_layers=args.enc_layers or args.layers, dec_layers=args.dec_layers or args.layers,
        dropout=args.dropout, attn_dropout=args.attn_dropout, relu_dropout=args.relu_dropout,
        norm=args.norm, encoder_norm=args.encoder_norm, decoder_norm=args.decoder_norm,
        norm_options=norm_options_from_args(args), prenorm=args.prenorm, fixnorm=args.fixnorm,
        init=args.init, qknorm=args.qknorm, qk_g0=qk_g0, qk_learn_g=not args.qk_no_g,
        qk_norm_v=args.qk_norm_v, sdpa=args.sdpa)


def norm_options_from_args(args):
    """Options handed to every norm (each norm takes the ones its constructor names)."""
    return {k: getattr(args, a) for k, a in
            [("warmup", "pn_warmup"), ("variant", "pn_variant"),
             ("alpha_fwd", "pn_alpha_fwd"), ("alpha_bkw", "pn_alpha_bkw")]}


def validate_args(args):
    def bad(flag, why):
        sys.exit(f"error: {flag}: {why}")
    if args.d_model % args.heads:
        bad("--d-model", f"{args.d_model} is not divisible by --heads {args.heads}")
    for flag in ("batch_tokens", "epoch_size", "d_model", "heads", "ff", "layers", "warmup", "bpe_size", "max_len"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            bad("--" + flag.replace("_", "-"), "must be positive")
    for flag in ("dropout", "word_dropout", "label_smoothing"):
        if not 0 <= getattr(args, flag) < 1:
            bad("--" + flag.replace("_", "-"), "must be in [0, 1)")
    if (args.src is None) != (args.tgt is None):
        bad("--src/--tgt", "give both language suffixes or neither")
    if args.data is not None and args.src is None:
        bad("--data", "also give --src and --tgt, e.g. --src en --tgt de for DIR/train.en and DIR/train.de")
    if not 0 < args.qk_percentile <= 100:
        bad("--qk-percentile", "must be in (0, 100]")
    if args.qk_length is not None and args.qk_length <= 1:
        bad("--qk-length", "must be > 1 (g0 = log2(L^2 - L))")


# ---------------------------------------------------------------------------------------
# Data: read, BPE, encode (cached in the run directory).
# ---------------------------------------------------------------------------------------
def prepare_data(args, run_dir, log):
    if args.data is None:
        data_dir, src, tgt = data.ensure_toy_corpus(), "src", "tgt"
        log(f"data: built-in synthetic corpus in {data_dir}")
    else:
        data_dir, src, tgt = Path(args.data), args.src, args.tgt
    paths = data.corpus_paths(data_dir, src, tgt)
    splits = {}
    for split in ("train", "dev", "test"):
        pairs, stats = data.read_parallel(*paths[split], drop_empty=True)
        if stats.get("empty"):
            log(f"data: {split}: dropped {stats['empty']} pairs with an empty side")
        splits[split] = pairs
    if args.bpe_size is None:
        args.bpe_size = 2000 if args.data is None else 8000
    bpe_path, bpe_key_path = run_dir / "bpe.model", run_dir / "bpe.key"
    # The BPE model is reused only for the same training text and size (a run directory reused for
    # another corpus or --bpe-size trains a new one): the key is a hash of both.
    h = hashlib.sha256(f"{args.bpe_size}\n".encode())
    for s, t in splits["train"]:
        h.update(f"{s}\t{t}\n".encode())
    bpe_key = h.hexdigest()
    if not bpe_path.exists() or not bpe_key_path.exists() or bpe_key_path.read_text() != bpe_key:
        t0 = time.time()
        trained = data.train_bpe([s for s, _ in splits["train"]], [t for _, t in splits["train"]],
                                 args.bpe_size, str(run_dir / "bpe"))
        if Path(trained) != bpe_path:
            os.replace(trained, bpe_path)
        atomic_write_text(bpe_key, bpe_key_path)
        log(f"data: trained joint BPE ({args.bpe_size} requested) in {time.time() - t0:.1f}s")
    tok = data.Tokenizer(str(bpe_path))
    enc = {}
    for split in ("train", "dev"):
        enc[split] = data.load_or_encode(tok, splits[split], run_dir / f"{split}.enc.pt")
    train, dropped = data.filter_long(enc["train"], args.max_len)
    if dropped:
        log(f"data: dropped {dropped} training pairs longer than --max-len {args.max_len}")
    if not train:
        raise data.DataError(f"{paths['train'][0]}: no training pair left after --max-len {args.max_len}")
    log(f"data: {len(train)} train / {len(splits['dev'])} dev / {len(splits['test'])} test pairs, "
        f"vocabulary {tok.vocab_size}")
    return tok, splits, train, enc["dev"], (src, tgt)


# ---------------------------------------------------------------------------------------
# Evaluation.
# ---------------------------------------------------------------------------------------
def evaluate_bleu(model, tok, pairs, beam, alpha, device, batch_tokens):
    import decode  # imported here: decode.py imports train inside its functions too
    hyps = decode.translate(model, tok, [s for s, _ in pairs], beam=beam, alpha=alpha,
                            batch_tokens=batch_tokens, device=device)
    return decode.bleu(hyps, [t for _, t in pairs]), hyps


@torch.no_grad()
def evaluate_loss(model, encoded, batch_tokens, device, eps, amp=None):
    """Teacher-forced held-out loss: (label-smoothed loss sum, NLL sum, target tokens).

    exp(sum / tokens) is the (label-smoothed) perplexity of [1] Table 8.
    Note: a reference token outside the target vocabulary (a BPE piece seen only on the
    source side of the training data) can never be produced (its logit is -inf); it is
    scored as UNK, so the perplexity stays finite.
    """
    was_training = model.training
    model.eval()
    total = nll_total = 0.0
    n = 0
    try:
        for idx in data.make_batches(encoded, batch_tokens, shuffle=False, seed=0):
            b = data.collate(encoded, idx, device)
            with (amp() if amp is not None else torch.autocast("cpu", enabled=False)):
                logits = model(b.src, b.tgt_in)  # (B, T, V)
            keep = b.tgt_out.ne(data.PAD).flatten()  # (B*T,)
            target = b.tgt_out.flatten()
            target = torch.where(model.allowed[target] | ~keep, target, data.UNK)
            loss, nll = label_smoothed_loss(logits.flatten(0, 1), target, model.allowed, eps, keep.to(logits.dtype))
            total, nll_total, n = total + loss.item(), nll_total + nll.item(), n + int(keep.sum())
    finally:
        model.train(was_training)
    return total, nll_total, n


# ---------------------------------------------------------------------------------------
# Checkpoints: everything needed to resume exactly, and to decode with nothing else.
# ---------------------------------------------------------------------------------------
def make_checkpoint(model, optimizer, tok_proto, state, args, langs):
    return {
        "model_config": model.cfg.to_dict(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "bpe_model_proto": tok_proto,
        "src_lang": langs[0], "tgt_lang": langs[1],
        "step": state["step"], "dev_bleu": state.get("dev_bleu"),
        "train_state": state,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        "args": vars(args),
    }


# ---------------------------------------------------------------------------------------
# Speed: model FLOPs and the machine's own matmul throughput (for MFU).
# ---------------------------------------------------------------------------------------
def step_flops(cfg, B, S, T, out_vocab=None):
    """Training FLOPs of one step on a (B, S) source / (B, T) target batch, padding included.

    Counts the matmuls (2 FLOPs per multiply-add) of the forward pass and multiplies by 3
    (the backward costs about two forwards). Per token, per layer:
      encoder:  Q, K, V, O projections 4 D^2 + FFN 2 D FF            + scores Q K^T, A V: 2 S D
      decoder:  self 4 D^2 + cross Q, O 2 D^2 + FFN 2 D FF            + scores 2 T D + 2 S D
                (+ cross K, V 2 D^2 per *source* token)
      output:   D Vt per target token (the tied embedding as the output layer; training computes
                only the Vt = out_vocab target words' logits, default all V)
    """
    D, FF, V = cfg.d_model, cfg.ff, out_vocab or cfg.vocab_size
    enc = cfg.enc_layers * (S * (4 * D * D + 2 * D * FF) + 2 * S * S * D)
    dec = cfg.dec_layers * (T * (6 * D * D + 2 * D * FF) + S * 2 * D * D + 2 * T * T * D + 2 * T * S * D)
    return 3 * 2 * B * (enc + dec + T * D * V)


def measure_matmul_flops(device, d, ff, tokens=4096, dtype=torch.float32, seconds=1.0):
    """FLOP/s of a dense (tokens x d) @ (d x ff) GEMM, the model's largest matmul shape, measured
    in this process: the denominator of MFU (model FLOPs utilisation)."""
    gen = torch.Generator(device=device).manual_seed(0)  # its own RNG: training's stays untouched
    a = torch.randn(tokens, d, device=device, dtype=dtype, generator=gen)
    b = torch.randn(d, ff, device=device, dtype=dtype, generator=gen)
    for _ in range(3):  # warm-up
        a @ b
    best = 0.0
    for _ in range(5):  # the best of 5 short windows: a busy moment on a shared machine
        n, t0 = 0, time.perf_counter()  # would otherwise understate the peak (and inflate MFU)
        while time.perf_counter() - t0 < seconds / 5:
            a @ b
            n += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
        best = max(best, 2 * tokens * d * ff * n / (time.perf_counter() - t0))
    return best


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB


# ---------------------------------------------------------------------------------------
# One training step, shared by training and --benchmark.
# ---------------------------------------------------------------------------------------
def train_step(step_model, model, optimizer, b, lr, args, wd_gen, amp, n_tgt_global):
    """Forward, label-smoothed loss, backward, clip, Adam. Returns (loss sum, NLL sum, grad norm).

    n_tgt_global: target tokens of this step over all ranks (= b.n_tgt on one process); the
    loss is divided by it, and DDP's average of the ranks' gradients is multiplied by the world
    size: their sum is the gradient of one process with the whole batch. (Scaling the loss by the
    world size instead would scale every dL/dY too, which PowerNorm's backward is not linear in.)
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    # Paper (appendix A): word dropout on source and target *inputs*, never on the targets.
    src = data.word_dropout(b.src, args.word_dropout, wd_gen) if args.word_dropout else b.src
    tgt_in = data.word_dropout(b.tgt_in, args.word_dropout, wd_gen) if args.word_dropout else b.tgt_in
    with amp():
        logits = step_model(src, tgt_in, target_only=True)  # (B, T, Vt): target words only
    keep = b.tgt_out.ne(data.PAD).flatten()  # (B*T,) 0 weight at padding
    # Word id -> its column in the logits (PAD -> 0, weight 0). Every training target is a target
    # word: data.target_vocab_mask is built from the training targets.
    column = (model.allowed.cumsum(0) - 1).clamp_min(0)
    loss_sum, nll_sum = SmoothedCrossEntropy.apply(logits.flatten(0, 1), column[b.tgt_out.flatten()],
                                                   keep, args.label_smoothing)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    loss = loss_sum / n_tgt_global  # Code: summed over non-pad targets, divided by their count
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if world > 1:  # DDP averaged the gradients over the ranks; the whole batch's is their sum
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(world)
    # Paper (appendix A): "Gradients are clipped when global norm exceeds 1.0".
    # The norm before clipping is what [1] Figure 2 plots.
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip if args.clip > 0 else float("inf"))
    optimizer.step()
    return loss_sum.detach(), nll_sum.detach(), gnorm.detach()


# ---------------------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------------------
def setup_distributed(args):
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: PyTorch's DistributedDataParallel, gloo on CPU
    and NCCL on CUDA. Returns (rank, world size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(args.device)
    if world == 1:
        return 0, 1, device
    import torch.distributed as dist
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


def keep_freed_memory():
    """Ask glibc's malloc to keep freed memory for reuse instead of returning it to the OS.

    By default a block over 32 MiB (a batch's logits, an FFN activation) is mmap'ed fresh at
    every allocation and unmapped when freed, so each training step faults every page of it in
    again, zero-filled by the kernel: a tenth of a CPU step on Multi30k (system time halves
    without it). With these limits the freed blocks stay in malloc's heap; the process's peak
    memory is about the same. Linux/glibc only; elsewhere (and if libc is not found) a no-op.
    (The usual alternative is preloading jemalloc or tcmalloc, which this project does not need.)
    """
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # <malloc.h>
        libc.mallopt(m_mmap_threshold, 1 << 30)  # blocks up to 1 GiB come from the heap
        libc.mallopt(m_trim_threshold, 1 << 30)  # and freed heap memory is not trimmed back
        libc.mallopt(m_top_pad, 64 << 20)
    except (OSError, AttributeError):
        pass


def train(args):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    validate_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world, device = setup_distributed(args)
    if device.type == "cpu":
        keep_freed_memory()
    master = rank == 0  # only rank 0 logs and writes files
    console = Console(soft_wrap=True, quiet=not master)  # log lines never wrap in a log file

    def log(msg):
        console.print(msg, highlight=False, markup=False)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    run_dir = Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume_ckpt = None
    if args.resume and (run_dir / "checkpoint_last.pt").exists():
        resume_ckpt = torch.load(run_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)
        log(f"resume: {run_dir}/checkpoint_last.pt at step {resume_ckpt['step']}")
    metrics_path = run_dir / "metrics.jsonl"
    if master:
        if resume_ckpt is None:
            metrics_path.unlink(missing_ok=True)  # a fresh run starts a fresh log
        elif metrics_path.exists():  # drop what the killed run logged after its last checkpoint
            lines = [l for l in metrics_path.read_text().splitlines()
                     if l and json.loads(l).get("step", 1 << 62) <= resume_ckpt["step"]]
            atomic_write_text("".join(l + "\n" for l in lines), metrics_path)

    def write_metrics(record):
        if master:
            append_jsonl(metrics_path, record)

    if world > 1 and not master:
        torch.distributed.barrier()  # rank 0 prepares the BPE model and caches first
    tok, splits, train_pairs, dev_encoded, langs = prepare_data(args, run_dir, log)
    if world > 1 and master:
        torch.distributed.barrier()
    if master:
        atomic_write_text(json.dumps(vars(args), indent=2) + "\n", run_dir / "config.json")
    allowed = data.target_vocab_mask([t for _, t in train_pairs], tok.vocab_size)
    qk_g0 = 1.0
    if args.qknorm:
        if args.qk_length is not None:
            L, how = args.qk_length, "--qk-length"
        else:
            L = data.length_percentile(train_pairs, q=args.qk_percentile)
            how = f"{args.qk_percentile}th percentile of BPE training lengths, source and target pooled, no BOS/EOS"
        qk_g0 = data.qk_g0(L)
        log(f"qknorm: L = {L:.2f} ({how}); g0 = log2(L^2 - L) = {qk_g0:.3f}")

    cfg = model_config_from_args(args, tok.vocab_size, qk_g0)
    model = Transformer(cfg, allowed).to(device)
    log(f"model: {count_parameters(model) / 1e6:.2f}M parameters, "
        f"{'PreNorm' if cfg.prenorm else 'PostNorm'}, norm={cfg.encoder_norm or cfg.norm}/"
        f"{cfg.decoder_norm or cfg.norm}, fixnorm={cfg.fixnorm}, init={cfg.init}, qknorm={cfg.qknorm}, "
        f"device={device}, threads={torch.get_num_threads()}" + (f", {world} ranks" if world > 1 else ""))

    lr_scale = args.lr_scale if args.lr_scale is not None else lr_scale_for_peak(args.lr, args.d_model, args.warmup)
    opt_cls = torch.optim.AdamW if args.weight_decay > 0 else torch.optim.Adam
    optimizer = opt_cls(model.parameters(), lr=0.0, betas=(args.beta1, args.beta2), eps=args.adam_eps,
                        weight_decay=args.weight_decay, **({"fused": True} if device.type == "cuda" else {}))
    step_model = model
    if world > 1:  # PyTorch's DDP: gradients all-reduced (averaged) across ranks in backward
        step_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile:
        step_model = torch.compile(step_model)  # checkpoints always save `model`, the unwrapped module

    def amp():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    # -- training state (everything resume needs besides model/optimizer/RNG) -----------
    state = {"step": 0, "epoch": 0, "data_epoch": 0, "batch_pos": 0, "best_bleu": -1.0,
             "best_step": 0, "dev_bleu": None, "history": [], "lr_decay": 1.0, "since_best": 0,
             "stopped": None}
    # Word-dropout randomness: its own generator, on the device the batches live on.
    wd_gen = torch.Generator(device=device).manual_seed(args.seed + rank)
    if resume_ckpt is not None:
        model.load_state_dict(resume_ckpt["model"])
        optimizer.load_state_dict(resume_ckpt["optimizer"])
        state.update(resume_ckpt["train_state"])
        torch.set_rng_state(resume_ckpt["rng"]["torch"])
        random.setstate(resume_ckpt["rng"]["python"])
        if resume_ckpt["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(resume_ckpt["rng"]["cuda"])
        wd_gen.set_state(state.pop("wd_gen_state"))
    tok_proto = (run_dir / "bpe.model").read_bytes()  # so a checkpoint alone can decode

    def batches_of(data_epoch):
        return data.make_batches(train_pairs, args.batch_tokens, shuffle=True, seed=args.seed, epoch=data_epoch)

    def next_batch():
        """The next batch of this rank: each global step takes `world` consecutive batches of the
        shuffled order and rank r trains on the r-th (batches are sharded by rank)."""
        nonlocal order
        if state["batch_pos"] + world > len(order):  # the data ran out: next shuffled pass
            state["data_epoch"] += 1
            state["batch_pos"] = 0
            order = batches_of(state["data_epoch"])
        idx = order[state["batch_pos"] + rank]
        state["batch_pos"] += world
        return data.collate(train_pairs, idx, device)

    def global_tokens(b):
        if world == 1:
            return b.n_tgt
        n = torch.tensor([b.n_tgt], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(n)
        return n.item()

    order = batches_of(state["data_epoch"])
    model.train()
    if args.benchmark:
        return benchmark(args, model, step_model, optimizer, next_batch, wd_gen, amp, global_tokens,
                         lr_scale, device, log, train_pairs, order)
    peak_flops = measure_matmul_flops(device, cfg.d_model, cfg.ff)
    n_out = int(model.allowed.sum())  # the output layer computes these target words' logits
    log(f"speed: dense {cfg.d_model}x{cfg.ff} matmul runs at {peak_flops / 1e9:.1f} GFLOP/s here (MFU's denominator)")

    total_steps = args.max_epochs * args.epoch_size
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    progress = Progress(TextColumn("[bold]train[/]"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                        TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                        console=console, transient=False, disable=not console.is_terminal)
    win = {"loss": 0.0, "nll": 0.0, "tok": 0, "flops": 0.0, "t": 0.0, "gnorm": 0.0, "n": 0}
    train_time = 0.0
    with progress:
        task = progress.add_task("train", total=total_steps, completed=state["step"], info="")
        while state["step"] < total_steps and not state["stopped"]:
            # -- one step ---------------------------------------------------------------
            t_step = time.perf_counter()
            b = next_batch()
            state["step"] += 1
            lr = scheduled_lr(state["step"], args, lr_scale, state["lr_decay"])
            n_tgt = global_tokens(b)  # target tokens of this step on all ranks
            loss_sum, nll_sum, gnorm = train_step(step_model, model, optimizer, b, lr, args, wd_gen, amp, n_tgt)
            if world > 1:  # the whole batch's sums, so that every rank logs and stops alike
                sums = torch.stack([loss_sum.double(), nll_sum.double()])
                torch.distributed.all_reduce(sums)
                loss_sum, nll_sum = sums[0], sums[1]
            loss_sum, nll_sum, gnorm = loss_sum.item(), nll_sum.item(), gnorm.item()  # waits for the step
            dt = time.perf_counter() - t_step
            train_time += dt
            for k, v in (("loss", loss_sum), ("nll", nll_sum), ("tok", n_tgt), ("t", dt), ("gnorm", gnorm),
                         ("n", 1), ("flops", step_flops(cfg, *b.src.shape, b.tgt_in.size(1), n_out) * world)):
                win[k] += v
            # [1] Figure 2: the global gradient norm of every step.
            write_metrics({"step": state["step"], "loss": loss_sum / n_tgt, "gnorm": gnorm, "lr": lr,
                           "tokens": n_tgt})
            if not math.isfinite(loss_sum):
                state["stopped"] = (f"the loss became {loss_sum} at step {state['step']} "
                                    "(try a smaller --lr-scale, --prenorm, --init small or more --warmup)")
                log("error: " + state["stopped"])
                break
            # -- one log line per interval ---------------------------------------------
            if state["step"] % args.log_interval == 0 or state["step"] == total_steps:
                tl, nll = win["loss"] / max(win["tok"], 1), win["nll"] / max(win["tok"], 1)
                tps, mfu = win["tok"] / win["t"], win["flops"] / win["t"] / (peak_flops * world)
                log(f"step {state['step']:6d} | loss {tl:6.3f} | ppl {math.exp(min(nll, 50)):8.2f} | "
                    f"lr {lr:.2e} | {tps:7.0f} tok/s | MFU {100 * mfu:4.1f}% | gnorm {win['gnorm'] / win['n']:6.3f}")
                progress.update(task, info=f"loss {tl:.3f}")
                write_metrics({"step": state["step"], "train_loss": tl, "train_ppl": math.exp(min(nll, 50)),
                               "tok_per_s": tps, "mfu": mfu})
                win = {k: 0.0 if k != "tok" else 0 for k in win}
            progress.update(task, completed=state["step"])
            # -- end of an epoch: dev BLEU, validation decay, stopping, checkpoints ------
            if state["step"] % args.epoch_size == 0 or state["step"] == total_steps:
                end_of_epoch(args, model, optimizer, tok, splits, dev_encoded, state, lr_scale, wd_gen, amp,
                             tok_proto, langs, device, run_dir, log, write_metrics, master, world)
    result = finish(args, model, tok, splits, state, device, run_dir, metrics_path, log, train_time, master)
    if world > 1:
        torch.distributed.destroy_process_group()
    return result


def end_of_epoch(args, model, optimizer, tok, splits, dev_encoded, state, lr_scale, wd_gen, amp,
                 tok_proto, langs, device, run_dir, log, write_metrics, master, world):
    """Dev perplexity and BLEU, validation decay, stopping decisions, checkpoints (rank 0)."""
    state["epoch"] += 1
    t0 = time.time()
    if master:
        dev_loss, dev_nll, n = evaluate_loss(model, dev_encoded, args.batch_tokens, device, args.label_smoothing, amp)
        dev_loss, dev_nll = dev_loss / max(n, 1), dev_nll / max(n, 1)
        score, _ = evaluate_bleu(model, tok, splits["dev"], args.dev_beam, args.alpha, device, args.batch_tokens)
        model.train()
        bleu = score.score
    if world > 1:  # every rank takes the same decisions: share rank 0's score
        box = [bleu if master else None]
        torch.distributed.broadcast_object_list(box, src=0)
        bleu = box[0]
    state["dev_bleu"] = bleu
    state["history"].append(bleu)
    improved = bleu > state["best_bleu"]
    if improved:
        state["best_bleu"], state["best_step"], state["since_best"] = bleu, state["step"], 0
    else:
        state["since_best"] += 1
    # Validation decay ([1] 3.3), for the schedules that have it.
    if args.schedule != "invsqrt" and validation_decay(state["history"], args.patience):
        state["lr_decay"] *= args.decay_factor
        log(f"dev BLEU below each of the previous {args.patience}: LR x {args.decay_factor}")
    next_lr = scheduled_lr(state["step"] + 1, args, lr_scale, state["lr_decay"])
    # Stopping ([1] appendix A): the LR too small, or no dev improvement for a while.
    if next_lr < args.stop_lr and state["step"] >= args.warmup:
        state["stopped"] = f"the LR {next_lr:.2e} fell below --stop-lr {args.stop_lr:g}"
    elif args.early_stop and state["since_best"] >= args.early_stop:
        state["stopped"] = f"dev BLEU has not improved for {args.early_stop} evaluations"
    elif state["epoch"] >= args.max_epochs:
        state["stopped"] = f"--max-epochs {args.max_epochs} reached"
    if not master:
        return
    log(f"epoch {state['epoch']:3d} | step {state['step']:6d} | dev BLEU {bleu:6.2f} "
        f"| dev ppl {math.exp(min(dev_nll, 50)):7.2f} | best {state['best_bleu']:6.2f} "
        f"(step {state['best_step']}) | eval {time.time() - t0:.1f}s")
    # [1] Figure 1 (dev BLEU per epoch) and Figures 3-4 (learned g's) come from these records.
    write_metrics({"step": state["step"], "epoch": state["epoch"], "dev_bleu": bleu, "dev_loss": dev_loss,
                   "dev_ppl": math.exp(min(dev_nll, 50)), "lr": next_lr, "g": model.learned_scales()})
    ckpt = make_checkpoint(model, optimizer, tok_proto, dict(state, wd_gen_state=wd_gen.get_state()), args, langs)
    if improved:
        atomic_save(ckpt, run_dir / "checkpoint_best.pt")
    if args.keep_checkpoints > 0:  # per-epoch checkpoints, for averaging ([2]: the last 5)
        atomic_save(ckpt, run_dir / f"checkpoint_epoch{state['epoch']}.pt")
        (run_dir / f"checkpoint_epoch{state['epoch'] - args.keep_checkpoints}.pt").unlink(missing_ok=True)
    atomic_save(ckpt, run_dir / "checkpoint_last.pt")  # written last: the resume point
    if state["stopped"]:
        log(f"stopping: {state['stopped']}")


def benchmark(args, model, step_model, optimizer, next_batch, wd_gen, amp, global_tokens, lr_scale, device,
              log, train_pairs, order):
    """--benchmark N: time N training steps after a warm-up; print figures, assert nothing."""
    cfg = model.cfg
    warm = 3
    peak = measure_matmul_flops(device, cfg.d_model, cfg.ff)
    tok = flops = 0
    t = 0.0
    n_out = int(model.allowed.sum())  # the output layer computes these target words' logits
    for i in range(warm + args.benchmark):
        b = next_batch()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, _, _ = train_step(step_model, model, optimizer, b, scheduled_lr(i + 1, args, lr_scale, 1.0), args,
                                wd_gen, amp, global_tokens(b))
        loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warm:
            t += time.perf_counter() - t0
            tok += b.n_tgt
            flops += step_flops(cfg, *b.src.shape, b.tgt_in.size(1), n_out)
    if args.profile:  # a few more steps under the profiler (not in the figures above: it slows them)
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for i in range(3):
                b = next_batch()
                train_step(step_model, model, optimizer, b, scheduled_lr(i + 1, args, lr_scale, 1.0), args,
                           wd_gen, amp, global_tokens(b))[0].item()
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        log(prof.key_averages().table(sort_by=key, row_limit=25))
    # The probe again after the steps, the larger of the two kept: a probe that ran in a slow
    # moment of this shared machine would understate the peak and inflate MFU.
    peak = max(peak, measure_matmul_flops(device, cfg.d_model, cfg.ff))
    pad = data.padding_share(train_pairs, order)
    result = {"steps": args.benchmark, "tgt_tok_per_s": tok / t, "flops_per_tgt_token": flops / tok,
              "achieved_flops": flops / t, "matmul_peak_flops": peak, "mfu": flops / t / peak,
              "padding_share": pad, "peak_memory_mb": peak_memory_mb(device), "threads": torch.get_num_threads(),
              "device": str(device)}
    log(f"benchmark: {args.benchmark} steps | {result['tgt_tok_per_s']:.0f} target tok/s | "
        f"{result['flops_per_tgt_token'] / 1e6:.1f} MFLOP/target token | achieved {result['achieved_flops'] / 1e9:.1f} "
        f"GFLOP/s | matmul peak {peak / 1e9:.1f} GFLOP/s | MFU {100 * result['mfu']:.1f}% | padding "
        f"{100 * pad:.1f}% | peak memory {result['peak_memory_mb']:.0f} MiB | {result['threads']} threads")
    return result


def finish(args, model, tok, splits, state, device, run_dir, metrics_path, log, train_time, master=True):
    """Test BLEU of the best checkpoint (by dev BLEU), with beam search; the learned g's."""
    best = run_dir / "checkpoint_best.pt"
    if not master:
        return None
    if not best.exists():
        log("no checkpoint was written (the run ended before its first epoch)")
        return None
    import decode
    ckpt = torch.load(best, map_location=device, weights_only=False)
    model.load_state_dict(ckpt["model"])
    model.eval()
    result = {"best_step": ckpt["step"], "best_dev_bleu": ckpt["dev_bleu"], "train_seconds": train_time,
              "stopped": state["stopped"]}
    decode.print_g_table(model)  # [1] Figures 3-4: learned g versus depth
    decode.save_g_values(model, run_dir / "g_values.json")
    if splits["test"]:
        score, hyps = evaluate_bleu(model, tok, splits["test"], args.beam, args.alpha, device, args.batch_tokens)
        atomic_write_text("\n".join(hyps) + "\n", run_dir / "test.hyp")
        result.update(test_bleu=score.score, test_signature=score.signature)
        log(f"test BLEU (best checkpoint, step {ckpt['step']}, beam {args.beam}, alpha {args.alpha}): "
            f"{score.score:.2f}  {score.signature}")
    append_jsonl(metrics_path, {"final": result})
    atomic_write_text(json.dumps(result, indent=2) + "\n", run_dir / "results.json")
    return result


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume:
        cfg_path = Path(args.resume) / "config.json"
        if not cfg_path.exists():
            parser.error(f"--resume {args.resume}: no config.json there (is it a run directory?)")
        saved = json.loads(cfg_path.read_text())
        given = {a.dest for a in parser._actions if any(o in (argv or sys.argv[1:]) for o in a.option_strings)}
        keep_new = {"max_steps", "max_epochs", "device", "threads", "log_interval"} & given
        for k, v in saved.items():
            if k not in keep_new and k != "resume":
                setattr(args, k, v)
        args.out = args.resume
    try:
        return train(args)
    except data.DataError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted: resume with --resume " + str(args.out))


if __name__ == "__main__":
    main()
