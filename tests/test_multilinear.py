"""The baseline's multi-linear attention as it ran (model.py Appendix B): --mask none and
--positions relative.

The tensorized Transformer that PowerNorm's language models point to
(szhangtju/The-compression-of-Transformer, BTD-Transformer/transformer_upload.py) never applies its
attention mask and puts position only inside the attention, as a second tensor term with the biases
r_w_bias and r_r_bias. Each choice is checked against its equation written out with loops in
float64, and against what it implies: an unmasked model sees later tokens, a causal one does not.
"""

import pytest
import torch

import data
import decode
from machinery import presets, train_cli
from model import ModelConfig, MultiLinearAttention, Transformer, sinusoidal_positions

D, H, L = 6, 2, 4
R = D // H


def attention(mask, positions):
    cfg = ModelConfig(
        vocab_size=10,
        d_model=D,
        heads=H,
        seq_len=L,
        attention="multilinear",
        lm=True,
        mask=mask,
        positions=positions,
        dropout=0.0,
    )
    torch.manual_seed(0)
    att = MultiLinearAttention(cfg).double().eval()
    return att


def by_loops(att, x, mask, positions):
    """out_i = W^O vec T[i] + b with T[i, j, k] = sum_r c_r (Q_ir + u_r) K_jr V_kr + sum_r c_r (Q_ir
    + v_r) P_jr V_kr (relative; only the first sum with u = 0 otherwise), zero unless j, k <= i when
    causal; P = PE(L-1..0) W^R."""
    B, t, _ = x.shape
    qkv = x @ att.qkv.weight.T + att.qkv.bias
    if positions == "relative":
        pe = sinusoidal_positions(L, D).double()
        # row j: PE(L-1-j), no relative shift
        P = torch.stack([pe[L - 1 - j] for j in range(L)]) @ att.r_net.weight.T
    out = torch.zeros(B, t, D, dtype=torch.float64)
    for b in range(B):
        for i in range(t):
            flat = []
            for h in range(H):
                q, k, v = (
                    qkv[b, :, part * D + h * R : part * D + (h + 1) * R] for part in range(3)
                )
                T = torch.zeros(L, L, dtype=torch.float64)
                seen = range(i + 1) if mask == "causal" else range(t)
                for j in seen:
                    for kk in seen:
                        for r in range(R):
                            c = att.core[r]
                            if positions == "relative":
                                u, w = att.r_w_bias[h, 0, r], att.r_r_bias[h, 0, r]
                                p = P[j, h * R + r]
                                T[j, kk] += (
                                    c * (q[i, r] + u) * k[j, r] * v[kk, r]
                                    + c * (q[i, r] + w) * p * v[kk, r]
                                )
                            else:
                                T[j, kk] += c * q[i, r] * k[j, r] * v[kk, r]
                flat.append(T.flatten())
            out[b, i] = att.out.weight @ torch.cat(flat) + att.out.bias
    return out


@pytest.mark.parametrize("positions", ["sinusoidal", "relative"])
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_each_variant_computes_its_equation_written_with_loops(mask, positions):
    att = attention(mask, positions)
    with torch.no_grad():
        x = torch.randn(2, L, D, dtype=torch.float64)
        torch.testing.assert_close(att(x), by_loops(att, x, mask, positions))
        # a shorter segment
        torch.testing.assert_close(att(x[:, :3]), by_loops(att, x[:, :3], mask, positions))


@pytest.mark.parametrize("positions", ["sinusoidal", "relative"])
def test_unmasked_later_tokens_move_earlier_outputs_and_causal_ones_do_not(positions):
    x = torch.randn(1, L, D, dtype=torch.float64)
    y = x.clone()
    y[:, 2:] = torch.randn(1, L - 2, D, dtype=torch.float64)  # positions 2 and 3 changed
    for mask, leaks in (("none", True), ("causal", False)):
        att = attention(mask, positions)
        with torch.no_grad():
            moved = (att(x)[:, :2] - att(y)[:, :2]).abs().max().item()
        assert (moved > 1e-6) == leaks, (mask, moved)


def test_unmasked_and_relative_the_model_is_position_blind_at_the_input():
    """The baseline's model as it ran: two equal tokens of one segment get equal outputs, wherever
    they are."""
    cfg = ModelConfig(
        vocab_size=12,
        d_model=8,
        heads=1,
        ff=16,
        dec_layers=2,
        lm=True,
        norm="layer",
        prenorm=False,
        attention="multilinear",
        seq_len=6,
        mask="none",
        positions="relative",
        dropout=0.0,
    )
    torch.manual_seed(0)
    m = Transformer(cfg).eval()
    tokens = torch.tensor([[5, 7, 5, 9, 5, 4]])
    with torch.no_grad():
        logits = m.logits(None, tokens)
    torch.testing.assert_close(logits[0, 0], logits[0, 2])
    torch.testing.assert_close(logits[0, 0], logits[0, 4])
    # with the input's positions, the same tokens differ by where they are
    cfg.positions = "sinusoidal"
    torch.manual_seed(0)
    with torch.no_grad():
        logits = Transformer(cfg).eval().logits(None, tokens)
    assert not torch.allclose(logits[0, 0], logits[0, 2])


def test_the_two_biases_are_one_pair_for_the_model_and_train():
    cfg = ModelConfig(
        vocab_size=12,
        d_model=8,
        heads=2,
        ff=16,
        dec_layers=3,
        lm=True,
        norm="layer",
        attention="multilinear",
        seq_len=6,
        mask="none",
        positions="relative",
    )
    torch.manual_seed(0)
    m = Transformer(cfg)
    attns = [layer.self_attn for layer in m.decoder]
    assert all(a.r_w_bias is attns[0].r_w_bias and a.r_r_bias is attns[0].r_r_bias for a in attns)
    names = [n for n, _ in m.named_parameters() if n.endswith(("r_w_bias", "r_r_bias"))]
    assert len(names) == 2  # counted once each
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    tokens = torch.randint(4, 12, (4, 7))
    before = attns[2].r_r_bias.detach().clone()
    loss, _ = m(None, tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert attns[0].r_w_bias.grad is not None and attns[0].r_r_bias.grad.abs().sum() > 0
    opt.step()
    # the last layer's is the first's: updated with it
    assert not torch.equal(attns[2].r_r_bias, before)
    # A checkpoint's state_dict reads back into a fresh model, the pair still one.
    fresh = Transformer(cfg)
    fresh.load_state_dict(m.state_dict())
    assert fresh.decoder[2].self_attn.r_r_bias is fresh.decoder[0].self_attn.r_r_bias
    torch.testing.assert_close(fresh.decoder[0].self_attn.r_r_bias, attns[2].r_r_bias)


def test_a_bad_mask_or_positions_is_refused():
    for kw in ({"mask": "future"}, {"positions": "learned"}):
        cfg = ModelConfig(
            vocab_size=12, d_model=8, heads=2, lm=True, attention="multilinear", seq_len=4, **kw
        )
        with pytest.raises(ValueError, match="--mask causal|none and --positions"):
            Transformer(cfg)


@pytest.mark.parametrize("mask, leaks", [("causal", False), ("none", True)])
def test_the_leak_probe_sees_an_unmasked_model_use_later_tokens(mask, leaks):
    cfg = ModelConfig(
        vocab_size=40,
        d_model=16,
        heads=2,
        ff=32,
        dec_layers=2,
        lm=True,
        norm="layer",
        attention="multilinear",
        seq_len=8,
        mask=mask,
        positions="relative",
        dropout=0.0,
    )
    torch.manual_seed(0)
    m = Transformer(cfg)
    segs = data.Segments(torch.randint(4, 40, (6, 8)), torch.randint(4, 40, (6, 8)))
    r = decode.future_leak(m, segs, t=3)
    assert (r["mean_abs_change"] > 1e-4) == leaks, r


def test_a_multilinear_attention_too_large_for_memory_is_refused_in_one_line_with_its_size(
    tmp_path,
):
    """Issue 30: --seq-len 4096 built W^O's H L^2 x D weights (and T's H L^2 numbers a token) and
    failed to allocate: refused before anything is written, with the size it would need; the PTB
    preset's segments of 32 pass."""
    with pytest.raises(SystemExit) as e:
        train_cli.main(
            [
                "--task",
                "lm",
                "--attention",
                "multilinear",
                "--seq-len",
                "4096",
                "--out",
                str(tmp_path / "r"),
            ]
        )
    msg = str(e.value.code)
    assert "\n" not in msg and "--seq-len" in msg and "GB" in msg, msg
    # H L^2 D in each of the 2 layers, at the defaults
    assert f"{4 * 4096**2 * 128 * 2:,} weights in W^O" in msg
    assert not (tmp_path / "r").exists()
    for preset, seq_len in (("pn2-layernorm", "32"), ("pn2-layernorm", "384")):
        # no error
        train_cli.check_flags(*presets.resolve_flags(["--preset", preset, "--seq-len", seq_len]))
