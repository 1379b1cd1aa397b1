"""Claim-level tests for model.py: the Transformer of Transformers without Tears [1] with
QKNorm [3]. Each test checks a claim against a formula written out here.

  [1] Nguyen & Salazar 2019: PostNorm eq. 2, PreNorm eq. 3, Xavier eq. 4, SmallInit 2.2,
      ScaleNorm + FixNorm at the output eq. 6, FixNorm init 3.2, vocabulary mask app. A.
  [3] Henry et al. 2020, QKNorm: softmax(g * Q^ K^T) V, eq. 5, g init g0 (eq. 3).

Run: python -m pytest -q tests/test_model.py   (CPU, small models, a few seconds)
"""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from decode import decode_step, start_decoding
from model import (
    BOS,
    EOS,
    PAD,
    FeedForward,
    ModelConfig,
    MultiHeadAttention,
    SmoothedCrossEntropy,
    Transformer,
    attention_math,
    dropout,
    fast_dropout,
    label_smoothed_loss,
    residual,
)
from norms import NORMS, ScaleNorm, use_reference

V = 60


def small_cfg(**kw):
    base = dict(vocab_size=V, d_model=32, heads=4, ff=64, enc_layers=2, dec_layers=2, dropout=0.1)
    base.update(kw)
    return ModelConfig(**base)


def build(seed=0, tgt_vocab_mask=None, **kw):
    torch.manual_seed(seed)
    return Transformer(small_cfg(**kw), tgt_vocab_mask)


def batch(seed=0, src_lengths=(7, 4, 2), tgt_len=6, bos=True):
    """Random sentences of real tokens (ids >= 4), PAD after each source's length."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(src_lengths), max(src_lengths)
    src = torch.randint(4, V, (b, s), generator=g)
    src[torch.arange(s)[None, :] >= torch.tensor(src_lengths)[:, None]] = PAD
    tgt = torch.randint(4, V, (b, tgt_len), generator=g)
    if bos:
        tgt[:, 0] = BOS
    return src, tgt


def attention_modules(model):
    return [m for m in model.modules() if isinstance(m, MultiHeadAttention)]


def randomize_scales(model, seed=0, lo=0.5, hi=4.0):
    """Give every scalar g (ScaleNorm, QKNorm) a distinct trained-like value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 0:
                p.fill_(lo + (hi - lo) * torch.rand((), generator=g).item())


# ---------------------------------------------------------------------------------------
# Initialisation [1, 2.2 and 3.2]
# ---------------------------------------------------------------------------------------
def pooled_weights(model, kind):
    if kind == "attn":
        ws = [lin.weight for m in attention_modules(model) for lin in (m.q, m.kv, m.out)]
        bs = [lin.bias for m in attention_modules(model) for lin in (m.q, m.kv, m.out)]
    else:
        ffs = [m for m in model.modules() if isinstance(m, FeedForward)]
        ws = [lin.weight for m in ffs for lin in (m.w1, m.w2)]
        bs = [lin.bias for m in ffs for lin in (m.w1, m.w2)]
    return torch.cat([w.detach().flatten() for w in ws]), torch.cat(
        [b.detach().flatten() for b in bs]
    )


def test_smallinit_every_weight_has_std_sqrt_2_over_5d():
    """SmallInit: attention N(0, sqrt(2/(d+4d))); with ff = 4d the FFN's Xavier std is the
    same, so every weight matrix has std sqrt(2/(5d)). Biases start at 0."""
    d = 256
    m = build(vocab_size=V, d_model=d, ff=4 * d, heads=4, enc_layers=1, dec_layers=1, init="small")
    target = math.sqrt(2 / (5 * d))
    for kind in ("attn", "ff"):
        w, b = pooled_weights(m, kind)
        assert w.std().item() == pytest.approx(target, rel=0.03), kind
        assert abs(w.mean().item()) < 0.05 * target
        assert torch.count_nonzero(b) == 0
    # each of the fused [W^K; W^V] blocks separately (D x D fan sizes, not the fused shape)
    for mha in attention_modules(m):
        for block in mha.kv.weight.detach().chunk(2, dim=0):
            assert block.std().item() == pytest.approx(target, rel=0.03)


def test_xavier_attention_std_sqrt_2_over_2d_and_ffn_sqrt_2_over_d_plus_ff():
    """Xavier normal eq. 4: N(0, sqrt(2/(d_in + d_out))). ff = 2d so that FFN differs."""
    d, ff = 256, 512
    m = build(vocab_size=V, d_model=d, ff=ff, heads=4, enc_layers=1, dec_layers=1, init="xavier")
    w, b = pooled_weights(m, "attn")
    assert w.std().item() == pytest.approx(math.sqrt(2 / (2 * d)), rel=0.03)
    assert torch.count_nonzero(b) == 0
    w, b = pooled_weights(m, "ff")
    assert w.std().item() == pytest.approx(math.sqrt(2 / (d + ff)), rel=0.03)
    assert torch.count_nonzero(b) == 0


def test_unknown_init_raises():
    with pytest.raises(ValueError):
        build(init="kaiming")


def test_fixnorm_embedding_init_uniform_001_and_unit_rows():
    """[1] 3.2: FixNorm embeddings "initialized uniformly in [-0.01, 0.01]"; the matrix
    used everywhere (input, output) has unit rows."""
    d = 256
    m = build(d_model=d, ff=64, fixnorm=True)
    e = m.embed.detach()
    assert e.min().item() >= -0.01 and e.max().item() <= 0.01
    assert e.min().item() < -0.0098 and e.max().item() > 0.0098  # the whole interval is used
    # std of U(-a, a) = 2a/sqrt(12)
    assert e.std().item() == pytest.approx(0.02 / math.sqrt(12), rel=0.03)
    E = m.embedding_matrix()
    torch.testing.assert_close(torch.linalg.vector_norm(E, dim=-1), torch.ones(V))
    # rows point the same way as the raw embedding
    torch.testing.assert_close(F.cosine_similarity(E, e, dim=-1), torch.ones(V))


def test_no_fixnorm_embedding_std_inv_sqrt_d_and_unnormalised():
    """[1] 3.2: without FixNorm, N(0, sqrt(1/d)), and the matrix is used as is."""
    d = 256
    m = build(d_model=d, ff=64, fixnorm=False)
    assert m.embed.std().item() == pytest.approx(d**-0.5, rel=0.03)
    assert m.embedding_matrix() is m.embed


# ---------------------------------------------------------------------------------------
# Output layer: eq. 6 and the target-vocabulary mask (appendix A)
# ---------------------------------------------------------------------------------------
def test_eq6_logits_are_g_final_times_cosine():
    """PreNorm + ScaleNorm + FixNorm: logit_w - b_w = g * (w . x) / (||w|| ||x||), g the
    decoder's final ScaleNorm g, x the decoder state before that norm."""
    torch.manual_seed(0)
    allowed = torch.rand(V) < 0.7
    m = build(prenorm=True, norm="scale", fixnorm=True, tgt_vocab_mask=allowed).eval()
    randomize_scales(m)
    with torch.no_grad():
        m.out_bias.normal_()
    captured = {}
    hook = m.dec_final_norm.register_forward_hook(lambda mod, args, out: captured.update(x=args[0]))
    src, tgt = batch()
    with torch.no_grad():
        logits = m.logits(src, tgt)
    hook.remove()
    x = captured["x"]  # (B, T, D) decoder output before the final norm
    g = m.dec_final_norm.g.item()
    cos = F.cosine_similarity(x[:, :, None, :], m.embed.detach()[None, None], dim=-1)  # (B, T, V)
    ok = m.allowed
    assert ok.sum() > 10
    torch.testing.assert_close(
        (logits - m.out_bias.detach())[..., ok], g * cos[..., ok], rtol=1e-4, atol=1e-5
    )
    assert (logits[..., ok] - m.out_bias.detach()[ok]).abs().max() <= g * (1 + 1e-5)


def test_target_vocab_mask_gives_minus_inf_outside_and_for_pad_bos():
    torch.manual_seed(1)
    allowed = torch.rand(V) < 0.5
    allowed[PAD] = allowed[BOS] = True  # even if the caller allows them, PAD/BOS stay masked
    allowed[EOS] = True
    m = build(tgt_vocab_mask=allowed).eval()
    src, tgt = batch()
    with torch.no_grad():
        logits = m.logits(src, tgt)  # (B, T, V)
        cache = start_decoding(m, src)
        step = decode_step(m, tgt[:, 0], cache)  # (B, V)
    expect_ok = allowed.clone()
    expect_ok[PAD] = expect_ok[BOS] = False
    for lg in (logits, step):
        assert torch.isneginf(lg[..., ~expect_ok]).all()
        assert torch.isfinite(lg[..., expect_ok]).all()
    assert torch.isneginf(logits[..., PAD]).all() and torch.isneginf(logits[..., BOS]).all()
    # and the default (no mask given) forbids PAD and BOS only
    m2 = build().eval()
    with torch.no_grad():
        lg = m2.logits(src, tgt)
    assert torch.isneginf(lg[..., [PAD, BOS]]).all()
    keep = torch.ones(V, dtype=torch.bool)
    keep[[PAD, BOS]] = False
    assert torch.isfinite(lg[..., keep]).all()


# ---------------------------------------------------------------------------------------
# Residual placement [1, 2.1]
# ---------------------------------------------------------------------------------------
def test_prenorm_has_final_norms_postnorm_has_none():
    pre, post = build(prenorm=True, norm="scale"), build(prenorm=False, norm="scale")
    assert isinstance(pre.enc_final_norm, ScaleNorm) and isinstance(pre.dec_final_norm, ScaleNorm)
    assert pre.enc_final_norm is not pre.dec_final_norm
    assert post.enc_final_norm is None and post.dec_final_norm is None
    # the stack's output is scaled by its last norm: ||memory|| = that norm's g per token
    src, _ = batch()
    for m, last in ((pre, lambda m: m.enc_final_norm), (post, lambda m: m.encoder[-1].norm_ff)):
        m.eval()
        randomize_scales(m, seed=3)
        with torch.no_grad():
            mem, src_pad = m.encode(src, m.embedding_matrix())
        norms = torch.linalg.vector_norm(mem, dim=-1)
        torch.testing.assert_close(
            norms, torch.full_like(norms, last(m).g.item()), rtol=1e-5, atol=0
        )


def test_residual_computes_eq2_and_eq3():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    W = torch.randn(8, 8, dtype=torch.float64)

    def f(h):  # a toy sublayer
        return torch.tanh(h @ W) + 0.5

    def norm(h, pad_mask):  # a toy norm (unit rows, times 2)
        return 2 * h / h.norm(dim=-1, keepdim=True)

    mask = torch.zeros(2, 3, dtype=torch.bool)
    eq3 = x + f(norm(x, mask))  # PreNorm:  x + F(norm(x))
    eq2 = norm(x + f(x), mask)  # PostNorm: norm(x + F(x))
    pre, post = (
        SimpleNamespace(prenorm=True, dropout=0.3),
        SimpleNamespace(prenorm=False, dropout=0.3),
    )
    torch.testing.assert_close(residual(x, f, norm, mask, pre, False), eq3)
    torch.testing.assert_close(residual(x, f, norm, mask, post, False), eq2)
    assert not torch.allclose(eq2, eq3)
    # dropout sits on the sublayer output, before the sum: with p = 1 F(.) is dropped whole
    pre.dropout = post.dropout = 1.0
    torch.testing.assert_close(residual(x, f, norm, mask, pre, True), x)
    torch.testing.assert_close(residual(x, f, norm, mask, post, True), norm(x, mask))


# ---------------------------------------------------------------------------------------
# Every configuration trains
# ---------------------------------------------------------------------------------------
def smoothed_ce(logits, target, allowed, eps):
    """Label smoothing over the allowed types only (the TwT code, tnq177/transformers_without_tears,
    spreads epsilon over the target vocabulary), mean over non-pad targets."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    nll = -lp.gather(-1, target[..., None])[..., 0]
    smooth = -lp.masked_fill(~allowed, 0.0).sum(-1) / allowed.sum()
    loss = (1 - eps) * nll + eps * smooth
    real = target.ne(PAD)
    return loss[real].mean()


# every registered norm
CONFIGS = list(itertools.product([True, False], sorted(NORMS), [True, False], [True, False]))


@pytest.mark.parametrize(
    "prenorm,norm,fixnorm,qknorm",
    CONFIGS,
    ids=[f"{'pre' if p else 'post'}-{n}-fix{int(f)}-qk{int(q)}" for p, n, f, q in CONFIGS],
)
def test_every_configuration_takes_a_finite_training_step(prenorm, norm, fixnorm, qknorm):
    m = build(
        prenorm=prenorm,
        norm=norm,
        fixnorm=fixnorm,
        qknorm=qknorm,
        qk_g0=5.0,
        init="small" if prenorm else "xavier",
    ).train()
    src, tgt = batch(seed=1)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:].clone()
    tgt_out[1, 3:] = PAD  # padded targets
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    logits = m.logits(src, tgt_in)
    if fixnorm:  # alternate the two losses over the grid
        loss = smoothed_ce(logits, tgt_out, m.allowed, 0.1)
    else:
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)
    assert torch.isfinite(loss)
    loss.backward()
    for n, p in m.named_parameters():
        assert p.grad is not None, f"{n} gets no gradient"
        assert torch.isfinite(p.grad).all(), n
    opt.step()
    changed = [n for n, p in m.named_parameters() if not torch.equal(p, before[n])]
    assert "embed" in changed and len(changed) > 0.9 * len(before)
    with torch.no_grad():
        assert torch.isfinite(m.logits(src, tgt_in)[..., m.allowed]).all()


# ---------------------------------------------------------------------------------------
# Incremental decoding (cached keys/values) equals the teacher-forced pass
# ---------------------------------------------------------------------------------------
DECODE_CFGS = {
    "prenorm-scale": dict(prenorm=True, norm="scale"),
    "postnorm-layer": dict(prenorm=False, norm="layer", fixnorm=False),
    "prenorm-layer-qknorm": dict(prenorm=True, norm="layer", qknorm=True, qk_g0=6.0),
    "postnorm-rms-qknorm-written-out": dict(prenorm=False, norm="rms", qknorm=True, sdpa=False),
}


@pytest.mark.parametrize("name", list(DECODE_CFGS))
def test_incremental_decoding_equals_full_decoding(name):
    m = build(**DECODE_CFGS[name]).eval()
    randomize_scales(m, seed=4, lo=1.0, hi=6.0)
    src, tgt = batch(seed=2, src_lengths=(7, 3, 5), tgt_len=8)
    with torch.no_grad():
        full = m.logits(src, tgt)  # (B, T, V)
        cache = start_decoding(m, src)
        steps = torch.stack([decode_step(m, tgt[:, t], cache) for t in range(tgt.size(1))], dim=1)
    ok = m.allowed
    torch.testing.assert_close(steps[..., ok], full[..., ok], rtol=1e-4, atol=1e-4)
    assert torch.isneginf(steps[..., ~ok]).all()
    assert cache.step == tgt.size(1)


def test_cache_select_equals_decoding_the_selected_rows():
    m = build(prenorm=True, norm="scale", qknorm=True).eval()
    src, tgt = batch(seed=3, src_lengths=(7, 3, 5), tgt_len=7)
    index = torch.tensor([2, 0, 0, 1, 2])  # permute and duplicate (beams)
    k = 3  # reorder after k steps
    with torch.no_grad():
        ref_cache = start_decoding(m, src)
        ref = [decode_step(m, tgt[:, t], ref_cache) for t in range(tgt.size(1))]
        cache = start_decoding(m, src)
        for t in range(k):
            decode_step(m, tgt[:, t], cache)
        cache.select(index)
        tgt_r = tgt[index]
        for t in range(k, tgt.size(1)):
            got = decode_step(m, tgt_r[:, t], cache)
            torch.testing.assert_close(
                got[:, m.allowed], ref[t][index][:, m.allowed], rtol=1e-5, atol=1e-5
            )
    # rows can also be dropped (a finished sentence leaves the batch)
    with torch.no_grad():
        cache = start_decoding(m, src)
        decode_step(m, tgt[:, 0], cache)
        cache.select(torch.tensor([1]))
        got = decode_step(m, tgt[1:2, 1], cache)
    torch.testing.assert_close(got[:, m.allowed], ref[1][1:2][:, m.allowed], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Attention: SDPA fast path vs the written-out equation
# ---------------------------------------------------------------------------------------
def qkv(seed, b=2, h=4, tq=5, tk=5, dh=8):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, tq, dh, generator=g),
        torch.randn(b, h, tk, dh, generator=g) * 2,
        torch.randn(b, h, tk, dh, generator=g),
    )


def written_attention(q, k, v, allowed, scale):
    """softmax(Q K^T * scale + m) V with m = -inf where not allowed (B, H, Tq, Tk)."""
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    w = s.softmax(-1)
    return torch.einsum("bhqk,bhkd->bhqd", w, v), w


def test_attention_math_equals_sdpa_with_key_mask_and_causal():
    q, k, v = qkv(0)
    # (B,1,1,Tk)
    key_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, None, :]
    for scale in (None, 1.0):
        o, w = attention_math(q, k, v, key_mask, False, scale)
        ref = F.scaled_dot_product_attention(
            q, k, v, attn_mask=key_mask.expand(-1, -1, 5, -1), scale=scale
        )
        torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)
        o2, w2 = written_attention(q, k, v, key_mask, 1 / math.sqrt(8) if scale is None else scale)
        torch.testing.assert_close(o, o2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w, w2, rtol=1e-5, atol=1e-6)
        assert (w[1, :, :, 3:] == 0).all()
    o, w = attention_math(q, k, v, None, True)
    torch.testing.assert_close(
        o, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5
    )
    lower = torch.ones(5, 5, dtype=torch.bool).tril()
    assert (w[..., ~lower] == 0).all() and (w[..., lower] > 0).all()
    # causal and key mask together: SDPA with the combined boolean mask
    o, w = attention_math(q, k, v, key_mask, True)
    both = key_mask & torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(
        o, F.scaled_dot_product_attention(q, k, v, attn_mask=both), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 5))


def test_attention_math_causal_aligns_last_queries_with_last_keys():
    """Tq < Tk (the last queries of a prefix): query i sees keys <= Tk - Tq + i, i.e. the
    rows of the square causal attention they stand for."""
    q, k, v = qkv(1, tq=5, tk=5)
    o_full, _ = attention_math(q, k, v, None, True)
    o_last, _ = attention_math(q[:, :, 3:], k, v, None, True)
    torch.testing.assert_close(o_last, o_full[:, :, 3:])


@pytest.mark.parametrize("qknorm", [False, True])
@pytest.mark.parametrize("prenorm", [True, False])
def test_model_sdpa_equals_written_out_attention(qknorm, prenorm):
    a = build(sdpa=True, qknorm=qknorm, prenorm=prenorm, qk_g0=4.0).eval()
    b = Transformer(small_cfg(sdpa=False, qknorm=qknorm, prenorm=prenorm, qk_g0=4.0))
    b.load_state_dict(a.state_dict())
    b.eval()
    assert all(m.sdpa for m in attention_modules(a)) and not any(
        m.sdpa for m in attention_modules(b)
    )
    src, tgt = batch(seed=5)
    with torch.no_grad():
        la, lb = a.logits(src, tgt), b.logits(src, tgt)
    ok = a.allowed
    torch.testing.assert_close(la[..., ok], lb[..., ok], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------
# QKNorm [3]: softmax(g * Q^ K^T) V, scores bounded by |g|
# ---------------------------------------------------------------------------------------
def recompute_attention_calls(model, src, tgt):
    """Run a forward with keep_weights on; for every attention call recompute, from the
    module's own inputs and linears, the scores written out here:
        QKNorm:  g * (q/||q||) . (k/||k||)       standard: q . k / sqrt(Dh)
    Returns a list of (module, scores (masked -inf), kept weights, v used, module output)."""
    calls = []

    def hook(mod, args, kwargs, out):
        x, k, v = args[:3]
        key_mask = args[3] if len(args) > 3 else kwargs.get("key_mask")
        causal = args[4] if len(args) > 4 else kwargs.get("causal", False)
        q = mod.split(mod.q(x))  # (B, H, Tq, Dh)
        if mod.qknorm:
            qh = q / q.norm(dim=-1, keepdim=True)
            kh = k / k.norm(dim=-1, keepdim=True)
            s = mod.g * qh @ kh.transpose(-2, -1)
        else:
            s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        allowed = torch.ones_like(s, dtype=torch.bool)
        if causal:
            allowed = allowed & torch.ones(s.shape[-2:], dtype=torch.bool).tril(
                s.size(-1) - s.size(-2)
            )
        if key_mask is not None:
            allowed = allowed & key_mask
        calls.append((mod, s, allowed, mod.last_weights, v, out))

    mods = attention_modules(model)
    handles = [mm.register_forward_hook(hook, with_kwargs=True) for mm in mods]
    for mm in mods:
        mm.keep_weights = True
    try:
        with torch.no_grad():
            model.logits(src, tgt)
    finally:
        for h in handles:
            h.remove()
        for mm in mods:
            mm.keep_weights = False
    return calls


@pytest.mark.parametrize("qknorm", [True, False])
def test_attention_weights_are_softmax_of_the_papers_scores(qknorm):
    """Each module's kept weights equal softmax of eq. 5 (QKNorm) or eq. 4 (scaled dot
    product), recomputed from its inputs; its output is W^O (weights V)."""
    m = build(qknorm=qknorm, qk_g0=3.0, norm="layer").eval()
    randomize_scales(m, seed=6, lo=0.5, hi=5.0)
    src, tgt = batch(seed=6)
    calls = recompute_attention_calls(m, src, tgt)
    assert len(calls) == 2 + 2 * 2
    for mod, s, allowed, w, v, out in calls:
        expect = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        torch.testing.assert_close(w, expect, rtol=1e-5, atol=1e-6)
        if mod.qknorm and mod.norm_v:
            v = v / v.norm(dim=-1, keepdim=True)
        o = (w @ v).transpose(1, 2).flatten(2)
        torch.testing.assert_close(out, mod.out(o), rtol=1e-5, atol=1e-5)


def test_qknorm_scores_bounded_by_g():
    """Cosine similarities are in [-1, 1], so g * Q^ K^T is in [-|g|, |g|] and any two
    attention weights of one query differ by a factor <= exp(2|g|)."""
    m = build(qknorm=True, qk_g0=2.0, norm="scale").eval()
    randomize_scales(m, seed=7, lo=0.5, hi=3.0)
    with torch.no_grad():  # large activations: unnormalised dot products would be huge
        for mod in attention_modules(m):
            mod.q.weight.mul_(20)
            mod.kv.weight.mul_(20)
    src, tgt = batch(seed=7)
    calls = recompute_attention_calls(m, src, tgt)
    for mod, s, allowed, w, _v, _out in calls:
        g = abs(mod.g.item())
        assert s.abs().max().item() <= g * (1 + 1e-5)
        w_ok = w.masked_fill(~allowed, float("nan"))
        # max / min weight per query
        ratio = w_ok.nan_to_num(-1.0).amax(-1) / w_ok.nan_to_num(2.0).amin(-1)
        assert ratio.max().item() <= math.exp(2 * g) * (1 + 1e-4)
    # the same weights without QKNorm are far from that bound (so the check can fail)
    m2 = build(qknorm=False, norm="scale").eval()
    # same weights, no QKNorm g
    missing, unexpected = m2.load_state_dict(m.state_dict(), strict=False)
    assert not missing and all(k.endswith("attn.g") for k in unexpected)
    calls2 = recompute_attention_calls(m2, src, tgt)
    assert max(s.masked_fill(~al, 0).abs().max().item() for _, s, al, *_ in calls2) > 10


def test_qknorm_one_g_per_attention_module_init_g0():
    """[3] / its code: one scalar g per attention module (encoder self, decoder self,
    decoder cross), shared by its heads, initialised to g0."""
    for enc, dec in ((2, 2), (3, 1)):
        m = build(qknorm=True, qk_g0=12.32, enc_layers=enc, dec_layers=dec)
        gs = {n: p for n, p in m.named_parameters() if n.endswith(("self_attn.g", "cross_attn.g"))}
        assert len(gs) == enc + 2 * dec
        assert all(p.dim() == 0 and p.requires_grad for p in gs.values())
        assert all(p.item() == pytest.approx(12.32) for p in gs.values())
        assert {id(mod.g) for mod in attention_modules(m)} == {id(p) for p in gs.values()}
    m = build(qknorm=False)
    assert not any(hasattr(mod, "g") for mod in attention_modules(m))


def test_qknorm_fixed_g_is_a_buffer_at_1():
    """[3] Table 6 "no g" ablation: g fixed at 1, whatever g0 is."""
    m = build(qknorm=True, qk_g0=9.0, qk_learn_g=False)
    for mod in attention_modules(m):
        assert "g" in dict(mod.named_buffers()) and "g" not in dict(mod.named_parameters())
        assert mod.g.item() == 1.0


def test_qknorm_norm_v_normalises_values():
    """[3] Table 6 ablation "normalize V": the output is W^O (weights V^), ||v^|| = 1."""
    m = build(qknorm=True, qk_norm_v=True, qk_g0=3.0).eval()
    src, tgt = batch(seed=8)
    calls = recompute_attention_calls(m, src, tgt)
    for mod, _s, _allowed, w, v, out in calls:
        assert mod.norm_v
        vh = v / v.norm(dim=-1, keepdim=True)
        expect = mod.out((w @ vh).transpose(1, 2).flatten(2))
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out, mod.out((w @ v).transpose(1, 2).flatten(2)), atol=1e-3)


# ---------------------------------------------------------------------------------------
# Padding, learned scales
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg",
    [
        dict(prenorm=True, norm="scale"),
        dict(prenorm=False, norm="layer", fixnorm=False),
        dict(prenorm=True, norm="rms", qknorm=True, sdpa=False),
        dict(prenorm=True, norm="scale_fixed", qknorm=True),
    ],
    ids=["pre-scale", "post-layer", "pre-rms-qk-math", "pre-scalefixed-qk"],
)
def test_source_padding_does_not_change_real_outputs(cfg):
    m = build(**cfg).eval()
    src, tgt = batch(seed=9, src_lengths=(7, 3), tgt_len=6)
    tgt[1, 4:] = PAD  # target padding too
    with torch.no_grad():
        together = m.logits(src, tgt)
        alone0 = m.logits(src[:1], tgt[:1])
        alone1 = m.logits(src[1:, :3], tgt[1:, :4])  # no padding at all
    ok = m.allowed
    torch.testing.assert_close(together[0][:, ok], alone0[0][:, ok], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(together[1, :4][:, ok], alone1[0][:, ok], rtol=1e-4, atol=1e-4)


def test_learned_scales_returns_scalenorm_and_qknorm_g():
    m = build(prenorm=True, norm="scale", qknorm=True, qk_g0=7.0)
    d = m.cfg.d_model
    sn = {n: mod for n, mod in m.named_modules() if isinstance(mod, ScaleNorm)}
    qk = {n: mod for n, mod in m.named_modules() if isinstance(mod, MultiHeadAttention)}
    assert len(sn) == (2 * 2 + 1) + (3 * 2 + 1)  # 2 per encoder layer, 3 per decoder layer, 2 final
    scales = m.learned_scales()
    assert set(scales) == {f"{n}.g" for n in sn} | {f"{n}.g" for n in qk}
    assert all(scales[f"{n}.g"] == pytest.approx(math.sqrt(d)) for n in sn)
    assert all(scales[f"{n}.g"] == pytest.approx(7.0) for n in qk)
    randomize_scales(m, seed=10)
    scales = m.learned_scales()
    for n, mod in list(sn.items()) + list(qk.items()):
        assert scales[f"{n}.g"] == pytest.approx(mod.g.item())
    # LayerNorm without QKNorm has no scalar g
    assert build(norm="layer").learned_scales() == {}


def test_scale_fixed_keeps_the_fixnorm_output_g_learned():
    m = build(prenorm=True, norm="scale_fixed", fixnorm=True)
    d = m.cfg.d_model
    inner = [
        mod for mod in m.modules() if isinstance(mod, ScaleNorm) and mod is not m.dec_final_norm
    ]
    assert all(
        not isinstance(mod.g, torch.nn.Parameter) and mod.g.item() == pytest.approx(math.sqrt(d))
        for mod in inner
    )
    assert isinstance(m.dec_final_norm.g, torch.nn.Parameter)
    assert list(m.learned_scales()) == ["dec_final_norm.g"]


# --- dropout (inverted); its CPU fast path draws 16 random bits per element -------------------
@pytest.fixture
def reference():
    use_reference(True)
    yield
    use_reference(False)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
@pytest.mark.parametrize("path", ["fast", "written"])
def test_dropout_keeps_1_minus_p_and_rescales_to_keep_the_mean(p, path):
    torch.manual_seed(0)
    x = torch.rand(200_000) + 0.5
    use_reference(path == "written")
    try:
        y = dropout(x, p)
    finally:
        use_reference(False)
    kept = y != 0
    n = x.numel()
    # The fast path's P(drop) = p' = round(p 2^16) / 2^16 (the written one's is p itself);
    # the kept share is within 5 binomial std of 1 - p'
    p_q = round(p * 65536) / 65536 if path == "fast" else p
    assert abs(kept.float().mean().item() - (1 - p_q)) < 5 * math.sqrt(p_q * (1 - p_q) / n)
    torch.testing.assert_close(y[kept], x[kept] / (1 - p_q))  # kept values scaled by 1 / (1 - p')
    assert (y[~kept] == 0).all()
    assert abs(y.mean().item() / x.mean().item() - 1) < 0.01  # E[y] = x


def test_dropout_masks_are_independent_across_positions_and_reproducible():
    torch.manual_seed(3)
    a = fast_dropout(torch.ones(4, 50_000), 0.5) != 0
    # the 4 int16 read from one int64 must not be correlated: neighbours agree half the time
    agree = (a[..., 1:] == a[..., :-1]).float().mean().item()
    assert abs(agree - 0.5) < 0.01
    assert abs(a.float().mean(1) - 0.5).max() < 0.01  # every row, not only on average
    torch.manual_seed(3)
    # the default generator fixes it
    assert torch.equal(fast_dropout(torch.ones(4, 50_000), 0.5) != 0, a)


@pytest.mark.parametrize("path", ["fast", "written"])
def test_the_feed_forwards_relu_then_dropout_in_one_call(path):
    """dropout(x, p, relu=True) is dropout(ReLU(x), p): on the fast path ReLU is folded into the
    mask (m_i = 0 where x_i <= 0), on the same random numbers as fast_dropout(ReLU(x)); values and
    gradients equal; eval and p = 0: ReLU."""
    x = torch.randn(64, 33, dtype=torch.float64, requires_grad=True)
    use_reference(path == "written")
    try:
        outs = []
        for relu in (True, False):
            torch.manual_seed(3)
            y = dropout(x, 0.3, relu=relu) if relu else dropout(torch.relu(x), 0.3)
            outs.append((y, torch.autograd.grad(y.sum(), x)[0]))
        assert (outs[0][0] == 0).float().mean() > 0.6  # about 1 - 0.7 * 0.5 of the values are 0
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert torch.equal(dropout(x, 0.3, training=False, relu=True), torch.relu(x))
        assert torch.equal(dropout(x, 0.0, relu=True), torch.relu(x))
    finally:
        use_reference(False)


@pytest.mark.parametrize("path", ["fast", "written"])
def test_dropout_gradient_is_the_mask_and_eval_is_the_identity(path):
    torch.manual_seed(0)
    x = torch.randn(64, 33, requires_grad=True)
    use_reference(path == "written")
    try:
        y = dropout(x, 0.2)
        y.sum().backward()
        torch.testing.assert_close(x.grad, (y / x).detach())  # dy/dx = m / (1 - p')
        assert dropout(x, 0.2, training=False) is x and dropout(x, 0.0) is x
        assert (dropout(x, 1.0) == 0).all()
    finally:
        use_reference(False)


# --- the fast paths compute the reference's math ---------------------------------------------
FAST_CFGS = {
    "scale-fixnorm": dict(norm="scale"),
    "layer-qknorm": dict(norm="layer", qknorm=True, qk_g0=4.0),
    "postnorm-layer": dict(norm="layer", prenorm=False, fixnorm=False),
    "rms-norm-v": dict(norm="rms", qknorm=True, qk_norm_v=True),
}


@pytest.mark.parametrize("name", list(FAST_CFGS))
def test_the_fast_paths_give_the_reference_loss_and_gradients(name):
    """The training loss over the target words only (fast path) equals the -inf-masked loss over
    all V words, and SDPA and F.layer_norm equal their written-out equations: the same loss and
    the same parameter gradients, in float64, with and without --reference."""
    torch.manual_seed(0)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[torch.arange(3, V, 2)] = True  # every other word is a target word
    mask[1] = True  # and UNK, as data.target_vocab_mask makes it
    m = build(tgt_vocab_mask=mask, dropout=0.0, **FAST_CFGS[name]).double().train()
    randomize_scales(m, seed=5, lo=1.0, hi=5.0)
    src, tgt = batch(seed=4, src_lengths=(6, 4, 2), tgt_len=6)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:].clone()
    tgt_out[2, 3:] = PAD
    tgt_out[0, 0] = 4  # a word outside the target vocabulary: scored as UNK on both paths
    # Note: torch's CPU SDPA kernel computes float64 attention at about float32 precision (1.5e-7
    # from the written-out attention on the same inputs, measured with torch 2.13); the other fast
    # paths agree to float64 rounding. So: without SDPA to 1e-10, with SDPA to 1e-6.
    for sdpa, tol in ((False, 1e-10), (True, 1e-6)):
        for mod in m.modules():
            if isinstance(mod, MultiHeadAttention):
                mod.sdpa = sdpa
        results = []
        for ref in (False, True):
            use_reference(ref)
            try:
                loss, nll = m(src, tgt_in, tgt_out, 0.1)
                results.append(
                    (loss, nll, torch.autograd.grad(loss, list(m.parameters()), allow_unused=True))
                )
            finally:
                use_reference(False)
        (fl, fn, fg), (rl, rn, rg) = results
        torch.testing.assert_close((fl, fn), (rl, rn), rtol=tol, atol=tol)
        for a, b in zip(fg, rg, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=100 * tol, atol=tol)
    # the loss is the label-smoothed cross entropy of the masked full-vocabulary logits
    logits = m.logits(src, tgt_in)
    target = torch.where(m.allowed[tgt_out] | tgt_out.eq(PAD), tgt_out, 1)  # UNK = 1
    torch.testing.assert_close(
        fl.float() / tgt_out.ne(PAD).sum(),
        smoothed_ce(logits, target, m.allowed, 0.1),
        rtol=1e-6,
        atol=1e-6,
    )  # smoothed_ce works in float32


@pytest.mark.parametrize("eps", [0.1, 0.0])  # eps 0 skips the smoothing's passes
def test_the_fast_loss_has_the_exact_gradient_of_the_equation(eps):
    """SmoothedCrossEntropy's written-out backward, w (softmax - q), against autograd (gradcheck),
    and its values against label_smoothed_loss, padding rows (w = 0) included."""
    torch.manual_seed(0)
    z = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 3, 8, 2, 2, 5])
    real = torch.tensor([True, True, False, True, True, True])

    def both(z):
        return SmoothedCrossEntropy.apply(z, target, real, eps)

    assert torch.autograd.gradcheck(both, (z,))  # d/dz of loss and of NLL, any mix of the two
    got, ref = both(z), label_smoothed_loss(z, target, eps, real)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(
        torch.autograd.grad(got[0] + 0.3 * got[1], z),
        torch.autograd.grad(ref[0] + 0.3 * ref[1], z),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
