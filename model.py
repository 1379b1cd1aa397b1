"""model.py -- the encoder-decoder Transformer of Transformers without Tears [1].

Reading order: norms.py -> model.py -> data.py -> train.py -> decode.py.
Shapes: B batch, S source length, T target length, D d_model, H heads, Dh = D/H, V vocab.

What is here, top-down (each piece cites the equation it computes):
  sinusoidal positions -> attention (SDPA fast path + written-out path, QKNorm [3])
  -> feed-forward -> the residual placement (PostNorm eq. 2 / PreNorm eq. 3 of [1])
  -> encoder and decoder layers -> the model: tied embeddings, FixNorm, the output
  layer with the target-vocabulary mask (appendix A of [1]), initialisation
  (Xavier normal eq. 4 vs SmallInit, section 2.2) and incremental decoding with
  cached keys/values for beam search.

  [1] Nguyen & Salazar 2019, Transformers without Tears.
  [2] Shen et al. 2020, PowerNorm.     [3] Henry et al. 2020, Query-Key Normalization.
  [4] Vaswani et al. 2017, Attention Is All You Need.
"""
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from norms import build_norm, fixnorm

PAD, UNK, BOS, EOS = 0, 1, 2, 3  # the same ids as data.py (sentencepiece is trained with them)


@dataclass
class ModelConfig:
    """Everything needed to rebuild a model; saved inside every checkpoint."""

    vocab_size: int
    d_model: int = 256
    heads: int = 4
    ff: int = 1024
    enc_layers: int = 3
    dec_layers: int = 3
    dropout: float = 0.1  # Paper (appendix A): the same rate on sublayer outputs, ReLU, attention weights
    attn_dropout: Optional[float] = None  # None: same as dropout (the PowerNorm recipe uses 0.1)
    relu_dropout: Optional[float] = None  # None: same as dropout
    norm: str = "scale"  # --norm: every sublayer's norm (norms.NORMS)
    encoder_norm: Optional[str] = None  # --encoder-norm override (PowerNorm paper: PN in the encoder only)
    decoder_norm: Optional[str] = None  # --decoder-norm override
    norm_options: dict = field(default_factory=dict)  # e.g. PowerNorm warmup / variant
    prenorm: bool = True  # PreNorm (eq. 3) or PostNorm (eq. 2)
    fixnorm: bool = True  # l2-normalised embedding rows (section 2.3)
    init: str = "small"  # "small" (SmallInit) or "xavier" (Xavier normal, eq. 4)
    qknorm: bool = False  # QKNorm [3]
    qk_g0: float = 1.0  # g0 = log2(L^2 - L) [3, eq. 3], computed by data.py
    qk_learn_g: bool = True  # False: the "no g" ablation of [3] Table 6 (g fixed at 1)
    qk_norm_v: bool = False  # the "normalize V as well" ablation of [3] Table 6
    sdpa: bool = True  # use F.scaled_dot_product_attention (False: the written-out path)

    def to_dict(self):
        return asdict(self)


# ---------------------------------------------------------------------------------------
# Sinusoidal positions [4, section 3.5]:
#   PE(pos, 2i) = sin(pos / 10000^(2i/D)),   PE(pos, 2i+1) = cos(pos / 10000^(2i/D))
# Code: TwT uses sin on even and cos on odd dimensions (its 2021 fix); so do we.
# ---------------------------------------------------------------------------------------
def sinusoidal_positions(length, d):
    pos = torch.arange(length, dtype=torch.float32)[:, None]  # (L, 1)
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)  # (D/2,)
    pe = torch.zeros(length, d)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq[: d // 2])
    return pe  # (L, D)


# ---------------------------------------------------------------------------------------
# Dropout [Srivastava et al. 2014], inverted:  y = x * m / (1 - p),  m_i ~ Bernoulli(1 - p)
# so that E[y] = x and evaluation needs no rescaling.
# Note (speed): on the CPU, F.dropout draws each m_i with a Bernoulli sampler that costs ~20
# multiplies per element (profiled: 20% of a Multi30k training step). Here the draw is
# 64 random bits per int64, read as four int16 u_i, uniform on [-2^15, 2^15), and
#   m_i = [u_i >= -2^15 + round(p * 2^16)]    so P(m_i = 0) = round(p * 2^16) / 2^16 =: p'
# (p to 1/65536, e.g. 0.1 -> 0.1000061), and y = x * m / (1 - p') keeps E[y] = x exactly.
# It draws from torch's default generator, so torch.manual_seed fixes it and --resume
# restores it. On CUDA, F.dropout's fused kernel is already fast and is used.
# ---------------------------------------------------------------------------------------
def dropout(x, p, training=True):
    if not training or p == 0:
        return x
    if x.device.type != "cpu" or p >= 1:
        return F.dropout(x, p, training)
    drop = round(p * 65536)  # p' = drop / 2^16
    bits = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-2 ** 63, None)  # all 64 bits random
    u = bits.view(torch.int16)[: x.numel()].view(x.shape)  # uniform on [-2^15, 2^15)
    keep = u >= drop - 32768  # m: True with probability 1 - p'
    # Note: bool -> float is a slow path on the CPU; the same bytes read as uint8 convert fast.
    return x * keep.view(torch.uint8).to(x.dtype).mul_(65536 / (65536 - drop))  # x * m / (1 - p')


# ---------------------------------------------------------------------------------------
# Attention [4, eq. 1]:  Attention(Q, K, V) = softmax(Q K^T * scale + mask) V
#   scaled dot product:  scale = 1/sqrt(Dh)
#   QKNorm [3, eq. 2-5]: Q^ = Q/||Q||, K^ = K/||K|| along Dh (after the head split), and
#                        softmax(g * Q^ K^T) V, no 1/sqrt(Dh); g learnable, init g0.
# ---------------------------------------------------------------------------------------
def attention_math(q, k, v, key_mask=None, causal=False, scale=None, dropout_p=0.0):
    """The written-out attention. q (B, H, Tq, Dh), k, v (B, H, Tk, Dh).

    key_mask: bool, broadcastable to (B, H, Tq, Tk), True where a key may be attended.
    Returns the output (B, H, Tq, Dh) and the attention weights (B, H, Tq, Tk).
    """
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)  Q K^T * scale
    if causal:  # position t may attend to positions <= t only
        tq, tk = scores.shape[-2:]
        future = torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(tk - tq + 1)
        scores = scores.masked_fill(future, float("-inf"))
    if key_mask is not None:
        # Code: TwT fills masked logits with -1e9; -inf gives the same softmax here.
        scores = scores.masked_fill(~key_mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (B, H, Tq, Tk)
    dropped = dropout(weights, dropout_p)
    return dropped @ v, weights  # (B, H, Tq, Dh)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with optional QKNorm [3]; one module per sublayer.

    QKNorm's g is one scalar per attention module, shared by its heads (Code: 18 in a
    6+6 model). SDPA stays usable: g * Q^ is passed as the query with scale 1, since
    softmax((g Q^) K^T * 1) = softmax(g * Q^ K^T).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, self.heads = cfg.d_model, cfg.heads
        if d % self.heads:
            raise ValueError(f"--d-model {d} is not divisible by --heads {self.heads}")
        self.q = nn.Linear(d, d)  # W^Q
        self.kv = nn.Linear(d, 2 * d)  # [W^K; W^V] in one matmul
        self.out = nn.Linear(d, d)  # W^O
        self.dropout_p = cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout
        self.sdpa = cfg.sdpa
        self.qknorm, self.norm_v = cfg.qknorm, cfg.qk_norm_v
        if self.qknorm:
            g0 = torch.tensor(float(cfg.qk_g0) if cfg.qk_learn_g else 1.0)
            if cfg.qk_learn_g:
                self.g = nn.Parameter(g0)  # Paper [3]: learnable, initialised to g0 = log2(L^2 - L)
            else:
                self.register_buffer("g", g0)  # Paper [3] Table 6 ablation: no g (fixed at 1)
        self.last_weights = None  # set when keep_weights is on (analysis of [3] Figures 1-2)
        self.keep_weights = False

    def split(self, x):  # (B, L, D) -> (B, H, L, Dh)
        b, l, d = x.shape
        return x.view(b, l, self.heads, d // self.heads).transpose(1, 2)

    def project_kv(self, x):  # (B, L, D) -> k, v each (B, H, L, Dh)
        k, v = self.kv(x).chunk(2, dim=-1)
        return self.split(k), self.split(v)

    def forward(self, x, k, v, key_mask=None, causal=False):
        """x (B, Tq, D) queries' input; k, v (B, H, Tk, Dh) already projected."""
        q = self.split(self.q(x))  # (B, H, Tq, Dh)
        scale = None  # None = 1/sqrt(Dh)
        if self.qknorm:
            # Paper [3]: l2-normalise along the head dimension; statistics in fp32.
            # Code: eps 1e-12 (divide by max(||q||, eps)).
            q = (self.g * F.normalize(q.float(), dim=-1, eps=1e-12)).to(v.dtype)  # g * Q^
            k = F.normalize(k.float(), dim=-1, eps=1e-12).to(v.dtype)  # K^
            if self.norm_v:
                v = F.normalize(v.float(), dim=-1, eps=1e-12).to(q.dtype)
            scale = 1.0  # Paper [3]: no 1/sqrt(Dh); g is the scale
        p = self.dropout_p if self.training else 0.0
        if self.sdpa and not self.keep_weights:
            mask = None if key_mask is None else key_mask.expand(-1, -1, q.size(2), -1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                               is_causal=causal, scale=scale)
        else:
            o, w = attention_math(q, k, v, key_mask, causal, scale, p)
            if self.keep_weights:
                self.last_weights = w.detach()
        b, h, t, dh = o.shape
        return self.out(o.transpose(1, 2).reshape(b, t, h * dh))  # (B, Tq, D)


# ---------------------------------------------------------------------------------------
# Feed-forward [4, eq. 2]:  FFN(x) = W2 dropout(ReLU(W1 x + b1)) + b2
# ---------------------------------------------------------------------------------------
class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ff)
        self.w2 = nn.Linear(cfg.ff, cfg.d_model)
        self.dropout_p = cfg.dropout if cfg.relu_dropout is None else cfg.relu_dropout

    def forward(self, x):
        h = F.relu(self.w1(x))  # (B, T, FF)
        return self.w2(dropout(h, self.dropout_p, self.training))  # (B, T, D)


# ---------------------------------------------------------------------------------------
# The residual placement, both forms side by side [1, section 2.1]:
#   PostNorm (eq. 2):  x_{l+1} = norm(x_l + F_l(x_l))
#   PreNorm  (eq. 3):  x_{l+1} = x_l + F_l(norm(x_l))     (+ one final norm per stack)
# Dropout is on the sublayer output, before the residual sum (Code: drop(f(.))).
# ---------------------------------------------------------------------------------------
def residual(x, f, norm, pad_mask, prenorm, dropout_p, training):
    if prenorm:
        return x + dropout(f(norm(x, pad_mask)), dropout_p, training)  # eq. 3
    return norm(x + dropout(f(x), dropout_p, training), pad_mask)  # eq. 2


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_name):
        super().__init__()
        self.cfg = cfg
        self.self_attn = MultiHeadAttention(cfg)
        self.ff = FeedForward(cfg)
        opts = dict(cfg.norm_options)
        self.norm_attn = build_norm(norm_name, cfg.d_model, heads=cfg.heads, **opts)
        self.norm_ff = build_norm(norm_name, cfg.d_model, heads=cfg.heads, **opts)

    def forward(self, x, pad_mask, key_mask):
        c = self.cfg

        def attn(h):
            k, v = self.self_attn.project_kv(h)
            return self.self_attn(h, k, v, key_mask)

        x = residual(x, attn, self.norm_attn, pad_mask, c.prenorm, c.dropout, self.training)
        return residual(x, self.ff, self.norm_ff, pad_mask, c.prenorm, c.dropout, self.training)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_name):
        super().__init__()
        self.cfg = cfg
        self.self_attn = MultiHeadAttention(cfg)
        self.cross_attn = MultiHeadAttention(cfg)  # "decoder-encoder" attention in [1] Figure 3
        self.ff = FeedForward(cfg)
        opts = dict(cfg.norm_options)
        self.norm_self = build_norm(norm_name, cfg.d_model, heads=cfg.heads, **opts)
        self.norm_cross = build_norm(norm_name, cfg.d_model, heads=cfg.heads, **opts)
        self.norm_ff = build_norm(norm_name, cfg.d_model, heads=cfg.heads, **opts)

    def forward(self, x, pad_mask, mem_kv, mem_key_mask, cache=None):
        """x (B, T, D). mem_kv: this layer's cross-attention (k, v) of the encoder output.

        cache: None for a full (teacher-forced) pass with a causal mask; for incremental
        decoding a dict holding this layer's self-attention keys/values so far, which the
        new step's keys/values are appended to (so the prefix is never recomputed).
        """
        c = self.cfg

        def self_attn(h):
            k, v = self.self_attn.project_kv(h)  # (B, H, T, Dh)
            if cache is None:
                return self.self_attn(h, k, v, None, causal=True)
            if "k" in cache:  # append this step to the cached prefix
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
            return self.self_attn(h, k, v, None, causal=False)  # the new query sees the whole prefix

        def cross_attn(h):
            return self.cross_attn(h, mem_kv[0], mem_kv[1], mem_key_mask)

        x = residual(x, self_attn, self.norm_self, pad_mask, c.prenorm, c.dropout, self.training)
        x = residual(x, cross_attn, self.norm_cross, pad_mask, c.prenorm, c.dropout, self.training)
        return residual(x, self.ff, self.norm_ff, pad_mask, c.prenorm, c.dropout, self.training)


# ---------------------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------------------
class Transformer(nn.Module):
    """Encoder-decoder Transformer with one shared embedding matrix E (V, D).

    Paper [1] appendix A: "The source and target's input and output embeddings are shared,
    but we mask out words that are not in the target's vocabulary at the final output
    layer before softmax, by setting their logits to -inf."
      input:   x_emb = E[w] * sqrt(D) + PE(pos), then dropout
      output:  logits = h E^T + b + m,   m_w = 0 if w is a target word else -inf
    With FixNorm E is replaced by rows of unit length, and with PreNorm + ScaleNorm the
    decoder's final norm gives ||h|| = g, so logit_w = g cos(h, e_w) + b_w: eq. 6.
    """

    def __init__(self, cfg: ModelConfig, tgt_vocab_mask=None):
        super().__init__()
        self.cfg = cfg
        d, V = cfg.d_model, cfg.vocab_size
        enc_norm = cfg.encoder_norm or cfg.norm
        dec_norm = cfg.decoder_norm or cfg.norm
        self.embed = nn.Parameter(torch.empty(V, d))  # E: source, target and output embedding
        self.out_bias = nn.Parameter(torch.zeros(V))  # b
        if tgt_vocab_mask is None:  # every type allowed but PAD and BOS
            tgt_vocab_mask = torch.ones(V, dtype=torch.bool)
        allowed = tgt_vocab_mask.clone().bool()
        allowed[PAD] = allowed[BOS] = False  # Code: PAD and BOS are never predicted
        self.register_buffer("allowed", allowed)  # (V,) saved with the checkpoint
        self.register_buffer("logit_mask", torch.zeros(V).masked_fill(~allowed, float("-inf")))  # m
        self.register_buffer("pe", sinusoidal_positions(1024, d), persistent=False)
        self.encoder = nn.ModuleList(EncoderLayer(cfg, enc_norm) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg, dec_norm) for _ in range(cfg.dec_layers))
        opts = dict(cfg.norm_options)
        # Paper [1] section 2.1: under PreNorm "one must append an additional normalization
        # after both encoder and decoder so their outputs are appropriately scaled".
        self.enc_final_norm = build_norm(enc_norm, d, heads=cfg.heads, **opts) if cfg.prenorm else None
        # Paper [1] Table 7, "ScaleNorm (g = sqrt d) + FixNorm (learned)": with fixed-g ScaleNorm the
        # output layer's g (the decoder's final norm, eq. 6) is still learned.
        final_dec = "scale" if dec_norm == "scale_fixed" else dec_norm
        self.dec_final_norm = build_norm(final_dec, d, heads=cfg.heads, **opts) if cfg.prenorm else None
        self.reset_parameters()

    # -- initialisation [1, sections 2.2 and 3.2] ---------------------------------------
    def reset_parameters(self):
        """Xavier normal (eq. 4): W ~ N(0, sqrt(2 / (d_in + d_out))); attention D x D gives
        sqrt(2/(2D)). SmallInit (section 2.2): attention weights N(0, sqrt(2/(D + 4D))).
        Feed-forward weights are N(0, sqrt(2/(D + FF))) either way, which equals
        sqrt(2/(5D)) at the paper's FF = 4D, so under SmallInit every weight has that std.
        Note: the paper's N(0, x) writes the standard deviation x. Biases start at 0.
        """
        c = self.cfg
        d, ff = c.d_model, c.ff
        attn_std = math.sqrt(2 / (5 * d)) if c.init == "small" else math.sqrt(2 / (d + d))
        if c.init not in ("small", "xavier"):
            raise ValueError(f"--init must be 'small' or 'xavier', not {c.init!r}")
        ff_std = math.sqrt(2 / (d + ff))
        for m in self.modules():
            if isinstance(m, MultiHeadAttention):
                # Note: W^K and W^V live in one (2D, D) matrix; each block is D x D, so the
                # std is set from D x D fan sizes, not from the fused shape.
                for lin in (m.q, m.kv, m.out):
                    nn.init.normal_(lin.weight, 0.0, attn_std)
                    nn.init.zeros_(lin.bias)
            elif isinstance(m, FeedForward):
                for lin in (m.w1, m.w2):
                    nn.init.normal_(lin.weight, 0.0, ff_std)
                    nn.init.zeros_(lin.bias)
        if c.fixnorm:
            nn.init.uniform_(self.embed, -0.01, 0.01)  # Paper 3.2: "initialized uniformly in [-0.01, 0.01]"
        else:
            nn.init.normal_(self.embed, 0.0, d ** -0.5)  # Paper 3.2: std sqrt(1/d)
        nn.init.zeros_(self.out_bias)

    # -- pieces --------------------------------------------------------------------------
    def embedding_matrix(self):
        """E, or FixNorm(E) (unit rows) when --fixnorm: (V, D)."""
        return fixnorm(self.embed) if self.cfg.fixnorm else self.embed

    def positions(self, start, length):
        if start + length > self.pe.size(0):  # grow the table on demand
            self.pe = sinusoidal_positions(2 * (start + length), self.cfg.d_model).to(self.pe.device)
        return self.pe[start:start + length]  # (L, D)

    def embed_tokens(self, tokens, E, start=0):
        # Paper [1] 2.2: "one scales the word embeddings by sqrt(d)" (kept with FixNorm too).
        x = E[tokens] * math.sqrt(self.cfg.d_model) + self.positions(start, tokens.size(1))  # (B, L, D)
        return dropout(x, self.cfg.dropout, self.training)

    def output_logits(self, h, E):
        """logits = h E^T + b + m  (B, T, V); m = -inf outside the target vocabulary."""
        return F.linear(h, E.to(h.dtype), (self.out_bias + self.logit_mask).to(h.dtype))

    # -- encoder / decoder ----------------------------------------------------------------
    def encode(self, src, E=None):
        """src (B, S) -> memory (B, S, D), src_pad (B, S) bool True at padding."""
        E = self.embedding_matrix() if E is None else E
        src_pad = src.eq(PAD)  # (B, S)
        key_mask = ~src_pad[:, None, None, :]  # (B, 1, 1, S) True = may attend
        x = self.embed_tokens(src, E)
        for layer in self.encoder:
            x = layer(x, src_pad, key_mask)
        if self.enc_final_norm is not None:
            x = self.enc_final_norm(x, src_pad)
        return x, src_pad

    def memory_kv(self, memory):
        """Each decoder layer's cross-attention keys/values, computed once per sentence."""
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder]

    def decode(self, tgt_in, memory, src_pad, E=None, caches=None, mem_kv=None, start=0):
        """tgt_in (B, T) -> decoder output h (B, T, D) (before the output layer)."""
        E = self.embedding_matrix() if E is None else E
        mem_kv = self.memory_kv(memory) if mem_kv is None else mem_kv
        tgt_pad = tgt_in.eq(PAD) if caches is None else None  # (B, T)
        mem_key_mask = ~src_pad[:, None, None, :]  # (B, 1, 1, S)
        x = self.embed_tokens(tgt_in, E, start)
        for i, layer in enumerate(self.decoder):
            x = layer(x, tgt_pad, mem_kv[i], mem_key_mask, None if caches is None else caches[i])
        if self.dec_final_norm is not None:
            x = self.dec_final_norm(x, tgt_pad)
        return x

    def forward(self, src, tgt_in, target_only=False):
        """Teacher-forced pass: src (B, S), tgt_in (B, T) -> logits (B, T, V).

        target_only=True (training): logits (B, T, Vt) over the Vt target words only, column j
        for word target_words()[j]. The same softmax as the -inf mask gives (masked words have
        p = 0), without computing the V - Vt masked columns (Multi30k en-de: Vt/V ~ 0.7).
        """
        E = self.embedding_matrix()  # normalised once per forward
        memory, src_pad = self.encode(src, E)
        h = self.decode(tgt_in, memory, src_pad, E)
        if target_only:
            words = self.target_words()
            return F.linear(h, E[words].to(h.dtype), self.out_bias[words].to(h.dtype))  # h E_t^T + b_t
        return self.output_logits(h, E)

    def target_words(self):
        """The ids of the words the output layer may predict, ascending: (Vt,) long."""
        return self.allowed.nonzero().squeeze(1)

    # -- incremental decoding (beam search) --------------------------------------------
    def start_decoding(self, src):
        """Encode once and return the decoding state for decode_step()."""
        E = self.embedding_matrix()
        memory, src_pad = self.encode(src, E)
        return {"E": E, "src_pad": src_pad, "mem_kv": self.memory_kv(memory),
                "caches": [{} for _ in self.decoder], "step": 0}

    def decode_step(self, y, state):
        """y (B,) the last output token -> logits (B, V) for the next one; state is updated."""
        h = self.decode(y[:, None], None, state["src_pad"], state["E"], state["caches"],
                        state["mem_kv"], start=state["step"])
        state["step"] += 1
        return self.output_logits(h[:, -1], state["E"])

    @staticmethod
    def reorder_state(state, index):
        """Keep/reorder batch rows (beams, sentences) of a decoding state: index (B',) long."""
        state["src_pad"] = state["src_pad"].index_select(0, index)
        state["mem_kv"] = [(k.index_select(0, index), v.index_select(0, index)) for k, v in state["mem_kv"]]
        for cache in state["caches"]:
            for key in list(cache):
                cache[key] = cache[key].index_select(0, index)
        return state

    # -- analysis ---------------------------------------------------------------------
    def learned_scales(self):
        """Name -> value of every scalar g (ScaleNorm g, QKNorm g), in depth order."""
        return {n: p.detach().float().item() for n, p in self.named_parameters()
                if p.dim() == 0 and n.split(".")[-1] == "g"}


def count_parameters(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
