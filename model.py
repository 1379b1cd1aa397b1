"""model.py -- chapter 2: the encoder-decoder Transformer of Transformers without Tears [1].

Reading order: norms.py -> model.py -> data.py -> decode.py -> train.py.

Contents
  1. ModelConfig and the special token ids
  2. Sinusoidal positions [6]
  3. Dropout (inverted)
  4. Attention [6, eq. 1] with QKNorm [3, eqs. 2-5]
  5. Feed-forward [6, eq. 2]
  6. The residual placement: PostNorm (eq. 2) and PreNorm (eq. 3) of [1], side by side
  7. Encoder and decoder layers
  8. The model: tied embeddings, FixNorm, the target-vocabulary mask ([1] app. A), Xavier (eq. 4) vs
     SmallInit; an LM
  9. The training objective: label-smoothed cross entropy ([1] appendix A)
  Appendix A: fast paths (the same math, measured faster for a whole training step)
  Appendix B: the multi-linear attention of the tensorized Transformer [7] (PowerNorm's language
     models)
  Appendix C: where the model runs: device and precision
  Appendix D: plumbing: the self-attention cache of incremental decoding, the parameter count

  [1] Nguyen & Salazar 2019, Transformers without Tears.     [2] Shen et al. 2020, PowerNorm.
  [3] Henry et al. 2020, Query-Key Normalization.
  [6] Vaswani et al. 2017, Attention Is All You Need.
  [7] Ma et al. 2019, A Tensorized Transformer for Language Modeling.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from norms import at_least_fp32, build_norm, fast_paths, fixnorm

# ---------------------------------------------------------------------------------------
# 1. The configuration, and the special ids (data.py trains sentencepiece with exactly these).
# ---------------------------------------------------------------------------------------
PAD, UNK, BOS, EOS = 0, 1, 2, 3


@dataclass
class ModelConfig:  # everything needed to rebuild a model; saved inside every checkpoint
    vocab_size: int
    d_model: int = 256
    heads: int = 4
    ff: int = 1024
    enc_layers: int = 3
    dec_layers: int = 3
    # Paper (appendix A): the same rate on sublayer outputs, ReLU and attention weights.
    dropout: float = 0.1
    attn_dropout: Optional[float] = None  # None: same as dropout (the PowerNorm recipe uses 0.1)
    relu_dropout: Optional[float] = None  # None: same as dropout
    norm: str = "scale"  # --norm: every sublayer's norm (norms.NORMS)
    encoder_norm: Optional[str] = None  # --encoder-norm (PowerNorm paper: PN in the encoder only)
    decoder_norm: Optional[str] = None  # --decoder-norm
    # Each norm takes the options its registry entry names (PowerNorm's).
    norm_options: dict = field(default_factory=dict)
    prenorm: bool = True  # PreNorm (eq. 3) or PostNorm (eq. 2)
    fixnorm: bool = True  # l2-normalised embedding rows (section 2.3)
    # "small" (SmallInit), "xavier" (Xavier normal, eq. 4) or "normal" (Appendix B's baseline).
    init: str = "small"
    qknorm: bool = False  # QKNorm [3]
    qk_g0: float = 1.0  # g0 = log2(L^2 - L) [3, eq. 3]: qk_g0() below
    qk_learn_g: bool = True  # False: [3] Table 6, "Without g" (g fixed at 1)
    qk_norm_v: bool = False  # [3] Table 6, "l2-normalizing V along with Q and K"
    sdpa: bool = True  # F.scaled_dot_product_attention (False: the written-out attention)
    # A language model: the decoder alone, no encoder or cross-attention (--task lm).
    lm: bool = False
    # The decoder's self-attention: softmax, or multilinear ([7], Appendix B).
    attention: str = "softmax"
    seq_len: int = 0  # the segment length a multi-linear attention's output layer is built for
    # The multi-linear attention's mask: causal, or none (the baseline's, Appendix B).
    mask: str = "causal"
    # Positions: sinusoidal at the input, or relative, the baseline's term inside the attention.
    positions: str = "sinusoidal"
    # The multi-linear attention's rank R per head (the baseline's d_head); None: D / H.
    head_dim: Optional[int] = None
    # Whether the multi-linear attention's W^QKV and W^O have biases (the baseline's have none).
    attn_bias: bool = True
    # Dropout on the decoder's output, before the output layer (the baseline LM's).
    final_dropout: float = 0.0


# ---------------------------------------------------------------------------------------
# 2. Sinusoidal positions [6, section 3.5]: sin on even and cos on odd dimensions.
#   PE(pos, 2i) = sin(pos / 10000^(2i/D)),   PE(pos, 2i+1) = cos(pos / 10000^(2i/D))
# Code: TwT does so since its 2021 fix, and so do we.
# ---------------------------------------------------------------------------------------
def sinusoidal_positions(length, d):
    pos = torch.arange(length, dtype=torch.float32)[:, None]  # (L, 1)
    # 1 / 10000^(2i/D), (D/2,).
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = pos * inv_freq  # (L, D/2)  pos / 10000^(2i/D)
    # PE (L, D): sin at 2i, cos at 2i+1.
    return torch.stack([torch.sin(angle), torch.cos(angle)], -1).flatten(1)[:, :d]


# ---------------------------------------------------------------------------------------
# 3. Dropout [Srivastava et al. 2014], inverted: y = x * m / (1 - p), m_i ~ Bernoulli(1 - p).
# So E[y] = x, and evaluation needs no rescaling.
# ---------------------------------------------------------------------------------------
def dropout(x, p, training=True, relu=False):
    # The fast path (Appendix A): the same distribution (p to 1/65536), 1.13x faster steps.
    if training and 0 < p < 1 and fast_paths():
        return fast_dropout(x, p, relu)
    # relu=True: dropout(ReLU(x)), the feed-forward's (the fast path does both in one pass).
    x = F.relu(x) if relu else x
    if not training or p == 0:
        return x
    if p >= 1:  # everything is dropped (and 1 / (1 - p) is undefined)
        return torch.zeros_like(x)
    keep = torch.rand_like(x) >= p  # m_i ~ Bernoulli(1 - p)
    return x * keep / (1 - p)


# ---------------------------------------------------------------------------------------
# 4. Attention [6, eq. 1] with QKNorm [3, eqs. 2-5].
#   Attention(Q, K, V) = softmax(Q K^T * scale + mask) V,   scaled dot product: scale = 1/sqrt(Dh)
#   QKNorm: softmax(g * Q^ K^T) V, no 1/sqrt(Dh); Q^ = Q/||Q||, K^ = K/||K|| along Dh; g init g0
# Why: [3] section 3: softmax sees only differences, and dot products are unbounded, so a few large
# logits can silence every other key (a saturated, "winner-take-all" softmax). Cosines are bounded,
# |Q^ K^T| <= 1, but too flat for a softmax to ignore a key, so a learned g scales them: logits in
# [-g, g], one key outweighs another at most e^(2g) times. g0 = log2(L^2 - L), a rule of thumb found
# empirically ([3] App. B), grows with QK^T's size. QKNorm's g is one scalar per attention module,
# shared by its heads (Code: 18 in a 6+6 model).
# ---------------------------------------------------------------------------------------
def attention_math(q, k, v, key_mask=None, causal=False, scale=None, dropout_p=0.0):
    """The written-out attention. q (B, H, Tq, Dh), k, v (B, H, Tk, Dh); key_mask bool,
    broadcastable to (B, H, Tq, Tk), True where a key may be attended. Returns the output (B, H, Tq,
    Dh), the weights (B, H, Tq, Tk)."""
    # Exercise attention: begin
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)  Q K^T * scale
    if causal:  # position t may attend to positions <= t only
        tq, tk = scores.shape[-2:]
        future = torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(tk - tq + 1)
        scores = scores.masked_fill(future, float("-inf"))
    if key_mask is not None:  # Code: TwT fills masked logits with -1e9; -inf gives the same softmax
        scores = scores.masked_fill(~key_mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (B, H, Tq, Tk)
    return dropout(weights, dropout_p) @ v, weights  # (B, H, Tq, Dh)
    # Exercise attention: end


def qk_g0(L):
    """QKNorm's g0 = log2(L^2 - L) [3, eq. 3], e.g. L=72 -> 12.32; L: data.length_percentile
    (97.5th) or --qk-length."""
    if not L >= 2:  # Note: L^2 - L = 2 at L = 2 (g0 = 1); below, g0 falls to 0 and then is negative
        raise ValueError(f"qk_g0 needs a length L >= 2, got {L}")
    # Exercise qk_g0: begin
    return math.log2(L * L - L)  # L^2 - L = number of off-diagonal entries of the L x L matrix QK^T
    # Exercise qk_g0: end


class MultiHeadAttention(nn.Module):  # with optional QKNorm [3]; one module per sublayer
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, self.heads = cfg.d_model, cfg.heads
        if d % self.heads:
            raise ValueError(f"--d-model {d} is not divisible by --heads {self.heads}")
        self.q = nn.Linear(d, d)  # W^Q
        self.kv = nn.Linear(d, 2 * d)  # [W^K; W^V] in one matmul
        self.out = nn.Linear(d, d)  # W^O
        self.dropout_p = cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout
        self.sdpa, self.qknorm, self.norm_v = cfg.sdpa, cfg.qknorm, cfg.qk_norm_v
        if self.qknorm:
            if cfg.qk_learn_g:  # Paper [3]: learnable, initialised to g0 = log2(L^2 - L)
                self.g = nn.Parameter(torch.tensor(float(cfg.qk_g0)))
            else:  # Paper [3] Table 6 ablation: no g (fixed at 1)
                self.register_buffer("g", torch.tensor(1.0))
        # keep_weights keeps the weights for decode.py's attention maps ([3] Figs 1-2).
        self.keep_weights, self.last_weights = False, None

    def split(self, x):  # (B, L, D) -> (B, H, L, Dh)
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def project_kv(self, x):  # (B, L, D) -> k, v each (B, H, L, Dh)
        k, v = self.kv(x).chunk(2, dim=-1)
        return self.split(k), self.split(v)

    def forward(self, x, k, v, key_mask=None, causal=False):
        """x (B, Tq, D) the queries' input; k, v (B, H, Tk, Dh) already projected."""
        q = self.split(self.q(x))  # (B, H, Tq, Dh)
        scale = None  # None = 1/sqrt(Dh)
        # Paper [3]: l2-normalise along Dh (in fp32). Code: eps 1e-12, divide by max(||q||, eps).
        if self.qknorm:
            q = (self.g * F.normalize(q.float(), dim=-1, eps=1e-12)).to(v.dtype)  # g * Q^
            k = F.normalize(k.float(), dim=-1, eps=1e-12).to(v.dtype)  # K^
            if self.norm_v:
                v = F.normalize(v.float(), dim=-1, eps=1e-12).to(q.dtype)
            scale = 1.0  # Paper [3]: no 1/sqrt(Dh); g is the scale
        p = self.dropout_p if self.training else 0.0
        # The fast path (Appendix A): torch's fused attention kernels.
        if self.sdpa and fast_paths() and not self.keep_weights:
            # The key mask for every query, (B, 1, Tq, Tk).
            mask = None if key_mask is None else key_mask.expand(-1, -1, q.size(2), -1)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale
            )
        else:
            o, w = attention_math(q, k, v, key_mask, causal=causal, scale=scale, dropout_p=p)
            self.last_weights = w.detach() if self.keep_weights else None
        return self.out(o.transpose(1, 2).flatten(2))  # (B, Tq, D)


# ---------------------------------------------------------------------------------------
# 5. Feed-forward [6, eq. 2]: FFN(x) = W2 dropout(ReLU(W1 x + b1)) + b2.
# ---------------------------------------------------------------------------------------
class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ff)
        self.w2 = nn.Linear(cfg.ff, cfg.d_model)
        self.dropout_p = cfg.dropout if cfg.relu_dropout is None else cfg.relu_dropout

    def forward(self, x):  # (B, T, D) -> W1: (B, T, FF) -> ReLU, dropout -> W2: (B, T, D)
        return self.w2(dropout(self.w1(x), self.dropout_p, self.training, relu=True))


# ---------------------------------------------------------------------------------------
# 6. The residual placement, both forms side by side [1, section 2.1].
#   PostNorm (eq. 2):  x_{l+1} = norm(x_l + F_l(x_l))
#   PreNorm  (eq. 3):  x_{l+1} = x_l + F_l(norm(x_l))     (+ one final norm per stack)
#   with dropout on F's output (Code: drop(f(.))).
# Why: [1] section 2.1: a residual network trains deep because its identity path carries the
# gradient from the top back to every layer unchanged. PostNorm puts a norm on that path after every
# sublayer: [1] conjectures it acts like scaling x_l by some lambda_l != 1, whose products explode
# or vanish, so warmup is needed while they settle. PreNorm keeps the path an identity: it trains
# without warmup, at large learning rates, with steadier gradient norms.
# ---------------------------------------------------------------------------------------
def residual(x, f, norm, pad_mask, cfg: ModelConfig, training):
    # Exercise residual: begin
    if cfg.prenorm:
        return x + dropout(f(norm(x, pad_mask)), cfg.dropout, training)  # eq. 3
    return norm(x + dropout(f(x), cfg.dropout, training), pad_mask)  # eq. 2
    # Exercise residual: end


# ---------------------------------------------------------------------------------------
# 7. Encoder and decoder layers.
# ---------------------------------------------------------------------------------------
def _norm(cfg, name):
    return build_norm(name, cfg.d_model, cfg.heads, cfg.norm_options)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_name):
        super().__init__()
        self.cfg = cfg
        self.self_attn, self.ff = MultiHeadAttention(cfg), FeedForward(cfg)
        self.norm_attn, self.norm_ff = _norm(cfg, norm_name), _norm(cfg, norm_name)

    def forward(self, x, pad_mask, key_mask):
        def attn(h):
            return self.self_attn(h, *self.self_attn.project_kv(h), key_mask)

        x = residual(x, attn, self.norm_attn, pad_mask, self.cfg, self.training)
        return residual(x, self.ff, self.norm_ff, pad_mask, self.cfg, self.training)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_name):
        super().__init__()
        self.cfg = cfg
        self.self_attn = (
            MultiLinearAttention(cfg) if cfg.attention == "multilinear" else MultiHeadAttention(cfg)
        )
        # [1] Figure 3's "decoder-encoder" attention; a language model has none.
        self.cross_attn = None if cfg.lm else MultiHeadAttention(cfg)
        self.ff = FeedForward(cfg)
        self.norm_self = _norm(cfg, norm_name)
        self.norm_cross = None if cfg.lm else _norm(cfg, norm_name)
        self.norm_ff = _norm(cfg, norm_name)

    def forward(self, x, pad_mask, mem_kv, mem_key_mask, self_kv=None):
        """x (B, T, D); mem_kv: the encoder output's cross-attention (k, v); self_kv: None, or
        decode.py's cache."""

        def self_attn(h):
            """Causal: position t attends to positions <= t (unless --mask none, Appendix B)."""
            # Decoding's cache, or the multi-linear attention [7]: other_self_attention, Appendix D.
            if self_kv is not None or isinstance(self.self_attn, MultiLinearAttention):
                return other_self_attention(self.self_attn, h, self_kv)
            # The plain causal attention; project_kv gives k, v (B, H, T, Dh).
            return self.self_attn(h, *self.self_attn.project_kv(h), None, causal=True)

        def cross_attn(h):
            return self.cross_attn(h, mem_kv[0], mem_kv[1], mem_key_mask)

        x = residual(x, self_attn, self.norm_self, pad_mask, self.cfg, self.training)
        if self.cross_attn is not None:
            x = residual(x, cross_attn, self.norm_cross, pad_mask, self.cfg, self.training)
        return residual(x, self.ff, self.norm_ff, pad_mask, self.cfg, self.training)


# ---------------------------------------------------------------------------------------
# 8. The model: an encoder-decoder Transformer with one shared embedding matrix E (V, D).
# Paper [1] appendix A: "The source and target's input and output embeddings are shared, but we mask
# out words that are not in the target's vocabulary at the final output layer before softmax, by
# setting their logits to -inf."
#   input:   x_emb = E[w] * sqrt(D) + PE(pos), then dropout
#   output:  logits = h E^T + b + m,   m_w = 0 if w is a target word else -inf
# FixNorm: E's rows have unit length, and PreNorm + ScaleNorm's final norm makes ||h|| = g, so
# logit_w = g cos(h, e_w) + b_w. A language model (cfg.lm, [2] Table 2) is this decoder with nothing
# to attend to (no encoder, no cross-attention), the same embeddings, norms, residuals and output
# layer:
#   p(w_t | w_<t) = softmax(h_t E^T + b)_w
# ---------------------------------------------------------------------------------------
class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, tgt_vocab_mask=None):
        super().__init__()
        self.cfg = cfg
        d, V = cfg.d_model, cfg.vocab_size
        enc_norm, dec_norm = cfg.encoder_norm or cfg.norm, cfg.decoder_norm or cfg.norm
        self.embed = nn.Parameter(torch.empty(V, d))  # E: source, target and output embedding
        self.out_bias = nn.Parameter(torch.zeros(V))  # b
        allowed = (
            torch.ones(V, dtype=torch.bool)
            if tgt_vocab_mask is None
            else tgt_vocab_mask.clone().bool()
        )
        allowed[PAD] = allowed[BOS] = False  # Code: PAD and BOS are never predicted
        self.register_buffer("allowed", allowed)  # (V,) saved with the checkpoint
        self.register_buffer("logit_mask", torch.zeros(V).masked_fill(~allowed, float("-inf")))  # m
        self.register_buffer("pe", sinusoidal_positions(1024, d), persistent=False)
        self.encoder = nn.ModuleList(
            EncoderLayer(cfg, enc_norm) for _ in range(0 if cfg.lm else cfg.enc_layers)
        )
        self.decoder = nn.ModuleList(DecoderLayer(cfg, dec_norm) for _ in range(cfg.dec_layers))
        # Paper [1] section 2.1: under PreNorm "one must append an additional normalization
        # after both encoder and decoder so their outputs are appropriately scaled".
        self.enc_final_norm = _norm(cfg, enc_norm) if cfg.prenorm and not cfg.lm else None
        # Paper [1] Table 7, "ScaleNorm (g = sqrt d) + FixNorm (learned)": the output layer's g
        # (eq. 6) stays learned.
        self.dec_final_norm = (
            _norm(cfg, "scale" if dec_norm == "scale_fixed" else dec_norm) if cfg.prenorm else None
        )
        # Appendix B: --positions relative's two biases become one pair for every layer.
        tie_relative_biases(self)
        index_target_words(self)  # Appendix A, and again whenever a checkpoint's mask is loaded:
        self.register_load_state_dict_post_hook(lambda module, keys: index_target_words(module))
        self.reset_parameters()

    # Why, as [1] section 2.2 explains it: Xavier normal starts attention too large: embeddings are
    # scaled by sqrt(d), and in the early steps residual sums and products q.k compound any excess,
    # so PostNorm can fail to converge whatever the warmup ([1] Table 2). SmallInit (sqrt(2/5) ~
    # 0.63 on attention) trains it (PreNorm trains anyway).
    def reset_parameters(self):
        """Initialisation [1, sections 2.2 and 3.2]. Xavier normal (eq. 4): W ~ N(0, sqrt(2 / (d_in
        + d_out))); attention D x D gives sqrt(2/(2D)). SmallInit (section 2.2): attention weights
        N(0, sqrt(2/(D + 4D))). Feed-forward weights are N(0, sqrt(2/(D + FF))) either way, =
        sqrt(2/(5D)) at the paper's FF = 4D, so under SmallInit every weight has that std. Note: the
        paper's N(0, x) writes the std x. Biases start at 0."""
        c = self.cfg
        if c.init not in ("small", "xavier", "normal"):
            raise ValueError(f"--init must be 'small', 'xavier' or 'normal', not {c.init!r}")
        # --init normal: Appendix B's baseline's (its train_upload.py, weights_init), not a paper's.
        if c.init == "normal":
            return normal_init(self)
        # Exercise smallinit: begin
        attn_std = (
            math.sqrt(2 / (5 * c.d_model)) if c.init == "small" else math.sqrt(2 / (2 * c.d_model))
        )
        ff_std = math.sqrt(2 / (c.d_model + c.ff))
        # Exercise smallinit: end
        for m in self.modules():
            if isinstance(m, MultiHeadAttention):
                # Note: W^K, W^V are one (2D, D) matrix: the std is from each D x D block's fans,
                # not the fused shape.
                inits = [(m.q, attn_std), (m.kv, attn_std), (m.out, attn_std)]
            elif isinstance(m, MultiLinearAttention):
                # W^O (H L^2 inputs, Appendix B): Xavier normal of its shape; W^QKV as above.
                inits = [(m.out, math.sqrt(2 / sum(m.out.weight.shape))), (m.qkv, attn_std)]
            elif isinstance(m, FeedForward):
                inits = [(m.w1, ff_std), (m.w2, ff_std)]
            else:
                continue
            for lin, std in inits:
                nn.init.normal_(lin.weight, 0.0, std)
                if lin.bias is not None:  # --no-attn-bias (Appendix B): none in W^QKV and W^O
                    nn.init.zeros_(lin.bias)
        if c.fixnorm:
            # Paper 3.2: "initialized uniformly in [-0.01, 0.01]"
            nn.init.uniform_(self.embed, -0.01, 0.01)
        else:
            nn.init.normal_(self.embed, 0.0, c.d_model**-0.5)  # Paper 3.2: std sqrt(1/d)
        nn.init.zeros_(self.out_bias)

    def embedding_matrix(self):
        """E, or FixNorm(E) (unit rows) when --fixnorm: (V, D)."""
        return fixnorm(self.embed) if self.cfg.fixnorm else self.embed

    def embed_tokens(self, tokens, E, start=0):
        # Paper [1] 2.2: "one scales the word embeddings by a large value (e.g., sqrt(d) ...)";
        # Code: with FixNorm too. F.embedding(tokens, E) = E[tokens], with a faster backward (2-3x
        # on the CPU; indexing's was 5% of a GPU step).
        x = F.embedding(tokens, E) * math.sqrt(self.cfg.d_model)  # (B, L, D)
        end = start + tokens.size(1)  # + PE(pos) for pos = start .. end - 1 (L, D), from self.pe
        # Under --positions relative, position enters inside the attention instead (Appendix B).
        if self.cfg.positions != "relative":
            if end > self.pe.size(0):  # self.pe grown on demand (long decodes)
                self.pe = sinusoidal_positions(2 * end, self.cfg.d_model).to(self.pe.device)
            x = x + self.pe[start:end]
        return dropout(x, self.cfg.dropout, self.training)

    def output_logits(self, h, E):
        """logits = h E^T + b + m  (B, T, V); m = -inf outside the target vocabulary."""
        return F.linear(h, E.to(h.dtype), (self.out_bias + self.logit_mask).to(h.dtype))

    def encode(self, src, E):
        """src (B, S) -> memory (B, S, D), src_pad (B, S) bool True at padding."""
        src_pad = src.eq(PAD)  # (B, S)
        key_mask = ~src_pad[:, None, None, :]  # (B, 1, 1, S) True = may attend
        x = self.embed_tokens(src, E)
        for layer in self.encoder:
            x = layer(x, src_pad, key_mask)
        if self.enc_final_norm is not None:
            x = self.enc_final_norm(x, src_pad)
        return x, src_pad

    def memory_kv(self, memory):
        """Each decoder layer's cross-attention (k, v), computed once per sentence."""
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder]

    def decode(self, tgt_in, src_pad, E, mem_kv, self_kv=None, start=0):
        """tgt_in (B, T) -> h (B, T, D), the decoder's output. self_kv: None, or per layer
        decode.py's cache."""
        tgt_pad = tgt_in.eq(PAD) if self_kv is None else None  # (B, T)
        # The source's key mask (B, 1, 1, S), or None in a language model.
        mem_key_mask = None if src_pad is None else ~src_pad[:, None, None, :]
        x = self.embed_tokens(tgt_in, E, start)
        for i, layer in enumerate(self.decoder):
            layer_kv = None if self_kv is None else self_kv[i]
            x = layer(x, tgt_pad, mem_kv and mem_kv[i], mem_key_mask, layer_kv)
        if self.dec_final_norm is not None:
            x = self.dec_final_norm(x, tgt_pad)
        # --final-dropout: 0, but in the baseline LM's row.
        return dropout(x, self.cfg.final_dropout, self.training)

    def hidden(self, src, tgt_in, E):
        """Teacher-forced pass: src (B, S), tgt_in (B, T) -> the decoder's output h (B, T, D). A
        language model has no source: src is None, tgt_in the text w_0..w_{T-1}."""
        if self.cfg.lm:  # the decoder alone, causal self-attention only
            return self.decode(tgt_in, None, E, None)
        memory, src_pad = self.encode(src, E)
        return self.decode(tgt_in, src_pad, E, self.memory_kv(memory))

    def logits(self, src, tgt_in):
        """(B, T, V) of a teacher-forced pass: what decoding's checks and attention maps read."""
        E = self.embedding_matrix()
        return self.output_logits(self.hidden(src, tgt_in, E), E)

    def forward(self, src, tgt_in, tgt_out, smoothing=0.0):
        """The objective of a teacher-forced pass with references tgt_out (B, T), PAD-padded
        (w_1..w_T for a language model): (label-smoothed loss sum, NLL sum), in forward as nanoGPT
        does (DDP and torch.compile cover it)."""
        E = self.embedding_matrix()  # normalised once per forward
        h = self.hidden(src, tgt_in, E)
        # Note: a reference word outside the target vocabulary (a BPE piece seen only on the source
        # side) can never be produced: scored as UNK, the loss stays finite. Training targets are
        # target words (data.target_vocab_mask).
        tgt_out = torch.where(self.allowed[tgt_out] | tgt_out.eq(PAD), tgt_out, UNK)
        # The fast path (Appendix A): the target words' logits only, the same softmax; 1.2x faster.
        if fast_paths():
            return target_words_loss(self, h, E, tgt_out, smoothing)
        return label_smoothed_loss(
            self.output_logits(h, E), tgt_out, smoothing, tgt_out.ne(PAD), self.allowed
        )

    def learned_scales(self):
        """name -> value of every scalar g (ScaleNorm's, QKNorm's), in the order built."""
        return {
            n: p.detach().float().item()
            for n, p in self.named_parameters()
            if p.dim() == 0 and n.split(".")[-1] == "g"
        }


# ---------------------------------------------------------------------------------------
# 9. The training objective: label-smoothed cross entropy [1 appendix A; Szegedy et al. 2016].
#   q = (1 - eps) * onehot(y) + eps * uniform over the allowed words A   (Code: the target words)
#   loss = -sum_w q_w log p_w = (1 - eps) * NLL + eps * mean_{w in A} (-log p_w)   (masked: p_w = 0)
# Note: F.cross_entropy(label_smoothing=eps) on the allowed columns gives this loss (tests), not the
# NLL we log.
# ---------------------------------------------------------------------------------------
def label_smoothed_loss(logits, target, eps, real=None, allowed=None):
    """logits (..., C), -inf where a class is not allowed; target (...) class ids; real (...) bool,
    the positions that count (None: all); allowed (C,) bool (None: every class). Returns (loss sum,
    NLL sum) over them."""
    # Exercise label_smoothing: begin
    logp = torch.log_softmax(at_least_fp32(logits), dim=-1)  # (..., C)  log p_w (fp32 softmax)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (...)  -log p_y
    if allowed is None:
        smooth = -logp.mean(-1)  # (...)  mean over the C classes of -log p_w
    else:
        smooth = -torch.where(allowed, logp, 0.0).sum(-1) / allowed.sum()  # mean over A of -log p_w
    loss = (1 - eps) * nll + eps * smooth
    if real is None:
        return loss.sum(), nll.sum()
    return torch.where(real, loss, 0.0).sum(), torch.where(real, nll, 0.0).sum()
    # Exercise label_smoothing: end


# =======================================================================================
# Appendix A: fast paths, the same math as the main text, measured faster.
# Each computes the math of the main text (tests check it; dropout's distribution to 1/65536) and is
# there because a whole training step measured faster with it (Multi30k, 3+3 layers, d 256,
# 4096-token batches, 2 CPU threads, 2026-11-23). --reference turns them off.
# F.scaled_dot_product_attention (MultiHeadAttention.forward) gives attention_math's output, not its
# weights; with QKNorm too: g * Q^ is passed as the query with scale 1, since
# softmax((g Q^) K^T * 1) = softmax(g * Q^ K^T).
# =======================================================================================
# Each function with a fast path, and what runs instead.
FAST_PATHS = {
    "norms.LayerNorm.forward": "F.layer_norm",
    "model.dropout": "fast_dropout",
    "model.attention_math": "F.scaled_dot_product_attention",
    "model.label_smoothed_loss": "target_words_loss",
}


def fast_dropout(x, p, relu=False):
    """dropout(x, p) in training, of ReLU(x) with relu: the same distribution with p rounded to
    1/65536, drawn from other random numbers. On CUDA and under --compile, F.dropout, which the GPU
    and the compiler fuse. On the CPU F.dropout draws each m_i with a Bernoulli sampler that costs
    ~20 multiplies per element (a training step with it is 1.13x slower). Here: 64 random bits per
    int64, read as four int16 u_i, uniform on [-2^15, 2^15), and
        m_i = [u_i >= -2^15 + round(p * 2^16)]    so P(m_i = 0) = round(p * 2^16) / 2^16 =: p'
    (p to 1/65536, e.g. 0.1 -> 0.1000061), and y = x * m / (1 - p') keeps E[y] = x exactly.
    It draws from torch's default generator, so torch.manual_seed fixes it and --resume restores it.
    """
    # On CUDA and under --compile: F.dropout, which the GPU and the compiler fuse.
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.dropout(F.relu(x) if relu else x, p, True)
    drop = round(p * 65536)  # p' = drop / 2^16
    # All 64 bits random.
    bits = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    u = bits.view(torch.int16)[: x.numel()].view(x.shape)  # uniform on [-2^15, 2^15)
    keep = u >= drop - 32768  # m: True with probability 1 - p'
    # ReLU in the mask, ReLU(x) m = x [x > 0] m: one pass over x, not two (a PTB step ~5% faster)
    if relu:
        keep &= x > 0
    # Note: bool -> float is a slow path on the CPU; the same bytes read as uint8 convert fast.
    return x * keep.view(torch.uint8).to(x.dtype).mul_(65536 / (65536 - drop))  # x * m / (1 - p')


def target_words_loss(model, h, E, tgt_out, eps):
    """label_smoothed_loss of the masked logits over V words, computed on the Vt target words'
    logits z = h E_t^T + b_t only: the masked words have p = 0, so the softmax over the target
    words is the same one. Saves the V - Vt masked columns of the output layer and of the softmax
    (Multi30k en-de: Vt/V ~ 0.7); with the loss's written-out backward below, a whole training step
    measured 1.2x faster."""
    # z, the target words' logits (B, T, Vt).
    z = F.linear(h, E[model.target_ids].to(h.dtype), model.out_bias[model.target_ids].to(h.dtype))
    return SmoothedCrossEntropy.apply(
        z.flatten(0, 1), model.target_column[tgt_out].flatten(), tgt_out.ne(PAD).flatten(), eps
    )


class SmoothedCrossEntropy(torch.autograd.Function):
    """label_smoothed_loss over all C columns of z (N, C), with its gradient written out. With
    logp = log_softmax(z), q = (1 - eps) onehot(y) + eps / C and w_n = 1 at real positions:
        loss = sum_n w_n (-sum_c q_c logp_c) = sum_n w_n ((1 - eps) NLL_n + eps mean_c(-logp_c))
        dloss/dz = w_n (softmax(z) - q)                  dNLL/dz = w_n (softmax(z) - onehot(y))
    Why: autograd of label_smoothed_loss makes ~6 more passes over the (N, C) logits in backward
    (gather's zero fill, mean's expand and divide, the sums, log_softmax's backward): measured
    ~5% of a whole Multi30k training step (profile, 2026-11-23). This keeps log p from the forward
    and reads it once. Tests: gradcheck in float64, and equal to label_smoothed_loss.
    Returns (loss sum, NLL sum).
    """

    @staticmethod
    def forward(ctx, z, target, real, eps):
        # Exercise label_smoothing: begin
        logp = torch.log_softmax(at_least_fp32(z), dim=-1)  # (N, C)
        w = real.to(logp.dtype)  # (N,) 1 at real positions, 0 at padding
        nll = -logp.gather(-1, target[:, None]).squeeze(-1)  # (N,)
        # (N,); eps 0: no pass over logp for the mean
        loss = (1 - eps) * nll - eps * logp.mean(-1) if eps else nll
        # Exercise label_smoothing: end
        ctx.save_for_backward(logp, target, w)
        ctx.eps, ctx.z_dtype = eps, z.dtype
        return (loss * w).sum(), (nll * w).sum()

    @staticmethod
    def backward(ctx, d_loss, d_nll):
        logp, target, w = ctx.saved_tensors
        eps, C = ctx.eps, logp.size(-1)
        grad = logp.exp()  # softmax(z)
        grad.mul_((w * (d_loss + d_nll))[:, None])  # w (dL + dNLL) softmax
        if eps:  # - w dL eps / C
            grad.sub_((w * d_loss * eps / C)[:, None])
        # - w (dL (1 - eps) + dNLL) onehot(y)
        grad.scatter_add_(-1, target[:, None], -(w * (d_loss * (1 - eps) + d_nll))[:, None])
        return grad.to(ctx.z_dtype), None, None, None


def output_columns(model):
    """The output layer's columns a training step computes (machinery/speed.py's FLOPs): the target
    words, as target_words_loss does (all V under --reference). Read from the shape of target_ids:
    no wait for the device."""
    return model.target_ids.numel() if fast_paths() else model.cfg.vocab_size


def index_target_words(model):
    """The target words' ids (Vt,) and each word's column among them (V,), from the mask
    (Transformer.__init__ and, whenever a checkpoint's mask is loaded, its load_state_dict hook)."""
    ids = model.allowed.nonzero().squeeze(1)  # (Vt,)
    column = (model.allowed.cumsum(0) - 1).clamp_min(0)  # (V,)
    model.register_buffer("target_ids", ids, persistent=False)
    model.register_buffer("target_column", column, persistent=False)


# =======================================================================================
# Appendix B: the multi-linear attention of the tensorized Transformer [7], "core-1" (one block).
# It is the attention of PowerNorm's language models ([2] A.2: "there exists only one linear
# projection in multi-linear attention"; [2] section 5.1: "with masking"). Per head, on a segment of
# L positions:
#   [Q; K; V] = x [W^Q; W^K; W^V]                   (one projection, split in three), each (L, R)
#   T[i, j, k] = sum_r c_r Q[i, r] K[j, r] V[k, r]  c: the core, R = D / H numbers (or --head-dim)
#   causal:  T[i, j, k] = 0 unless j <= i and k <= i      (position i sees no later token)
#   out_i = W^O [vec T_1[i, :, :]; ...; vec T_H[i, :, :]] + b   (H L^2 numbers -> D, one layer)
# No softmax: position i's output is a learned linear map of the (L, L) slice of the tensor.
# W^O has L^2 inputs per head: the model is built for segments of cfg.seq_len positions; shorter
# ones are zero-padded to L: under --mask causal, exactly the first positions of a full one.
# Code (szhangtju/The-compression-of-Transformer, BTD-Transformer/transformer_upload.py, the
# baseline PowerNorm points to; its BlockTensorAttn): the same tensor, the core softmax-initialised,
# qkv_net and o_net without biases (--no-attn-bias), R = d_head = 40 in its PTB script (--head-dim);
# it builds a mask and never applies it, and it has no positions at the input. Both are choices
# here, to redo its runs:
#   --mask causal (default; [2] says its runs were "with masking") | none (the code: every position
#     sees the whole segment, future included);
#   --positions sinusoidal (default: added to the input, as everywhere in this project) | relative
#     (the code's Transformer-XL term, the second of two tensors added before W^O):
#       T[i, j, k] = sum_r c_r (Q[i, r] + u_r) K[j, r] V[k, r]
#                  + sum_r c_r (Q[i, r] + v_r) P[j, r] V[k, r]
#       P = dropout(PE(L-1), ..., PE(0)) W^R   (W^R: r_net, no bias): row j is PE(L-1-j) for
#         every i, no relative shift;
#       u, v: r_w_bias and r_r_bias, learned, one pair shared by every layer (Transformer-XL's
#         default; the code's too).
# Note: the code takes PE(t-1), ..., PE(0) for a segment of t positions; for a full one (every
# segment of training and of evaluation on segments) that is the same; a shorter one takes a full
# one's first t rows of P, as above, so that position i does not learn how many tokens follow it.
# The code's sinusoids are [sin; cos] halves, ours interleaved (a permutation that W^R absorbs).
# Unmasked and relative, the model is position-blind at the input: two equal tokens of one segment
# get equal outputs (a test checks it).
# =======================================================================================
class MultiLinearAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, self.heads, self.L = cfg.d_model, cfg.heads, cfg.seq_len
        if d % self.heads:
            raise ValueError(f"--d-model {d} is not divisible by --heads {self.heads}")
        if self.L < 1:
            raise ValueError(
                "the multi-linear attention needs the segment length (--seq-len) it is built for"
            )
        if cfg.mask not in ("causal", "none") or cfg.positions not in ("sinusoidal", "relative"):
            raise ValueError(
                "--mask causal|none and --positions sinusoidal|relative, "
                f"not {cfg.mask}, {cfg.positions}"
            )
        # The rank R: --head-dim (the code's PTB script: d_head 40), else D / H.
        R = cfg.head_dim or d // self.heads
        # [W^Q; W^K; W^V], the core c (R,) and W^O. Code: no biases; the core softmax-initialised.
        self.qkv = nn.Linear(d, 3 * self.heads * R, bias=cfg.attn_bias)
        self.core = nn.Parameter(torch.softmax(torch.randn(R), 0))
        self.out = nn.Linear(self.heads * self.L * self.L, d, bias=cfg.attn_bias)
        i = torch.arange(self.L)
        # The mask (L, L, L): [j <= i and k <= i]. Under --mask none there is no mask (None), every
        # (j, k) kept: a mask of ones would cost a pass over T, forward and backward.
        causal = (i[None, :, None] <= i[:, None, None]) & (i[None, None, :] <= i[:, None, None])
        self.register_buffer("mask", causal if cfg.mask == "causal" else None, persistent=False)
        self.relative, self.p = cfg.positions == "relative", cfg.dropout
        if self.relative:
            pe_reversed = sinusoidal_positions(self.L, d).flip(0)  # PE(L-1), ..., PE(0): (L, D)
            self.register_buffer("pe_reversed", pe_reversed, persistent=False)
            self.r_net = nn.Linear(d, self.heads * R, bias=False)  # W^R; Xavier, as W^O
            nn.init.normal_(self.r_net.weight, 0.0, math.sqrt(2 / (d + self.heads * R)))
            # u and v, each (H, 1, R). Code: N(0, 0.02) (its init_std).
            self.r_w_bias = nn.Parameter(torch.randn(self.heads, 1, R) * 0.02)
            self.r_r_bias = nn.Parameter(torch.randn(self.heads, 1, R) * 0.02)

    def tensor(self, q, k, v, e=None):
        """T (B, H, t, t, t) = sum_r c_r (q[i, r] k[j, r] + e[j, r]) v[k, r], masked; e: no i in it
        (None: 0)."""
        b, t = v.size(0), v.size(2)  # q, k, v, e (B, H, t, R)
        # Exercise multilinear: begin
        S = q[:, :, :, None, :] * k[:, :, None, :, :]  # (B, H, t, t, R) Q[i, r] K[j, r]
        S = S if e is None else S + e[:, :, None, :, :]  # + e[j, r], the same for every i
        # sum_r S c_r V[k, r]
        T = (S.flatten(2, 3) @ (v * self.core).transpose(-1, -2)).view(b, self.heads, t, t, t)
        if self.mask is not None:  # --mask none: all kept
            T = T * self.mask[:t, :t, :t]  # T[i, j, k] = 0 unless j, k <= i
        # Exercise multilinear: end
        return T

    def forward(self, x):
        """x (B, t, D), t <= L -> (B, t, D)."""
        b, t, d = x.shape
        if t > self.L:
            raise ValueError(
                f"a multi-linear attention built for --seq-len {self.L} got {t} positions"
            )
        # q, k, v, each (B, H, t, R).
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1)
        )
        # Relative: (q + u) K + (q + v) P = q (K + P) + (u K + v P), one product by q (a PTB step
        # ~6% faster than two, alternated --benchmark), and e = u K + v P, which no query i is in.
        if self.relative:
            P = self.r_net(dropout(self.pe_reversed[:t], self.p, self.training))  # (t, D)
            P = P.to(q.dtype).view(1, t, self.heads, -1).transpose(1, 2)  # (1, H, t, R)
            T = self.tensor(q, k + P, v, self.r_w_bias * k + self.r_r_bias * P)
        else:
            T = self.tensor(q, k, v)
        # (B, H, t, L, L): zero beyond t
        T = F.pad(T, (0, self.L - t, 0, self.L - t)) if t < self.L else T
        return self.out(T.transpose(1, 2).reshape(b, t, self.heads * self.L * self.L))  # (B, t, D)


def tie_relative_biases(model):
    """--positions relative: every layer's u and v become the first layer's (one pair for the model,
    as the code)."""
    attns = [m for m in model.modules() if isinstance(m, MultiLinearAttention) and m.relative]
    for m in attns[1:]:
        m.r_w_bias, m.r_r_bias = attns[0].r_w_bias, attns[0].r_r_bias


def normal_init(model):
    """--init normal, the baseline's (Code: BTD-Transformer/train_upload.py, weights_init, at its
    init_std 0.02): every weight matrix and the embedding N(0, 0.02), every norm's gain N(1, 0.02),
    every bias 0; u and v keep their N(0, 0.02). Its core is the softmax of a torch.FloatTensor it
    never writes, memory read before it is written (uniform in one run, uneven in another): we take
    the defined case of that memory zeroed, c = softmax(0) = 1/R."""
    for name, p in model.named_parameters():
        leaf = name.split(".")[-1]
        if p.dim() == 2:  # E, and every nn.Linear's weight
            nn.init.normal_(p, 0.0, 0.02)
        elif leaf == "weight":  # a norm's gain (LayerNorm's, or a batch norm's gamma)
            nn.init.normal_(p, 1.0, 0.02)
        elif leaf == "core":
            nn.init.constant_(p, 1 / p.numel())
        elif leaf in ("bias", "out_bias"):
            nn.init.zeros_(p)


# =======================================================================================
# Appendix C: where the model runs: device and precision.
# On a CUDA GPU: bf16 autocast (statistics stay fp32, see norms.py), SDPA, fused Adam (train.py),
# pinned-memory batches (data.py): the nanoGPT recipe. On a CPU that computes bf16 natively
# (AVX512-BF16, AMX, Arm's BF16) the same autocast with --dtype bf16; precision() is the one rule.
# =======================================================================================
def pick_device(name="auto"):
    """--device auto|cpu|cuda -> torch.device; ValueError when cuda is asked for and absent."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if name == "cuda":
        # Note: SDPA's cuDNN kernel builds a plan for every new input shape, ~8 ms of host time per
        # call, and sentence lengths make nearly every batch (and every decoding step) a new shape:
        # measured on an H100, 93% of a training step was the host waiting on it. Flash and
        # memory-efficient attention (the other fused kernels) have no per-shape cost.
        torch.backends.cuda.enable_cudnn_sdp(False)
    return torch.device(name)


def has_bf16(device):
    """Whether the device computes bf16 natively: a CUDA GPU of compute capability 8.0+ (A100,
    H100, RTX 30xx+), or a CPU with AVX512-BF16 or AMX (AMD Zen 4 and later; Intel Cooper Lake,
    Sapphire Rapids and later) or Arm's BF16 instructions. Elsewhere bf16 is emulated: the same
    results, slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    return cpu_has_bf16()


def cpu_has_bf16():
    """This CPU's native bf16, as torch's own checks see it, else as /proc/cpuinfo's flags say."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch 2.3+
    if any(getattr(torch.cpu, name, lambda: False)() for name in checks):
        return True
    try:
        with open("/proc/cpuinfo") as f:  # Linux; elsewhere: not known to be native
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})  # bf16: Arm's feature flag


def precision(device, dtype="auto"):
    """The precision a run computes in, from --dtype auto|bf16|fp32: (bf16, why), why in words
    for the first screen. bf16 autocast runs the matmuls in bf16 and keeps the norms' statistics,
    the softmaxes, the loss, the weights and Adam's state in fp32. --reference: fp32 always (every
    equation as written). auto: bf16 on a CUDA GPU that computes it natively, else fp32; on a CPU
    fp32 too, until time to quality is measured on one with native bf16 (docs/speed.md)."""
    native = has_bf16(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    can = f"{name} {'computes bf16 natively' if native else 'has no native bf16'}"
    if not fast_paths():
        return False, f"fp32: --reference runs every equation as written ({can})"
    if dtype == "fp32":
        return False, f"fp32, as --dtype fp32 asks ({can})"
    if device.type == "cuda" and not native:
        return (
            False,
            f"fp32: {name} has no bf16, which it would only emulate, slowly (--dtype fp32)",
        )
    if dtype == "auto" and device.type == "cpu":
        return False, f"fp32, --dtype auto's choice on a CPU ({can}; --dtype bf16 computes in bf16)"
    slow = "" if native else ": emulated, so slower than fp32 here"
    return True, f"bf16 autocast ({can}{slow})"


def autocast(device, bf16=False):
    """bf16 autocast where precision() chose bf16, on a GPU or a CPU; off under fp32 and --reference
    (use_reference: every equation as written)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and fast_paths())


# =======================================================================================
# Appendix D: plumbing a first reading can skip.
# =======================================================================================
def other_self_attention(attn, h, self_kv):
    """The decoder's self-attention other than the plain causal one: Appendix B's multi-linear
    attention (its own mask), or incremental decoding (decode.py): h (B, 1, D) the new step; self_kv
    a dict with this layer's self-attention keys/values so far, which the new step's are appended to
    (so the prefix is never recomputed)."""
    if isinstance(attn, MultiLinearAttention):
        return attn(h)
    k, v = attn.project_kv(h)  # (B, H, T, Dh)
    if "k" in self_kv:  # append this step to the cached prefix
        k, v = torch.cat([self_kv["k"], k], dim=2), torch.cat([self_kv["v"], v], dim=2)
    self_kv["k"], self_kv["v"] = k, v
    return attn(h, k, v, None, causal=False)  # the new query sees the whole prefix


def count_parameters(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
