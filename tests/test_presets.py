"""The papers' rows as presets (machinery/presets.py): every preset resolves to valid flags,
builds its model at its exact size and takes one training step; flags given with a preset
override it; --pair swaps the corpus; config.json records every resolved value.

Speed (well under a minute on a busy 2-core machine): each distinct ModelConfig is built once,
at its exact size, by model.Transformer itself. What is slow there is drawing ~44M fresh random
numbers per model (~1 s), twice (nn.Linear's own init, then model.py's): while building,
torch.nn.init's normal_, uniform_ and kaiming_uniform_ copy their numbers from a bank drawn once,
scaled to the mean/std/bounds model.py asks for. Every shape, code path and init distribution is
the row's; only the random draws are reused.
"""

import json
import math
from unittest import mock

import pytest
import torch
from conftest import TINY

import data
import model
import train
from machinery import arguments, corpora, presets, train_cli

_BANK = {"cursor": 0}


def _draw(n, kind):
    """n numbers from a bank of standard normal or U(0, 1) numbers drawn once; a moving cursor
    gives each tensor different numbers."""
    if kind not in _BANK:
        g = torch.Generator().manual_seed(0)
        _BANK[kind] = (
            torch.randn(1 << 22, generator=g)
            if kind == "normal"
            else torch.rand(1 << 22, generator=g)
        )
    bank = _BANK[kind]
    start = _BANK["cursor"] % (bank.numel() - 1)
    _BANK["cursor"] += 7919 + n
    return bank[torch.arange(start, start + n) % bank.numel()]


@torch.no_grad()
def _bank_normal_(tensor, mean=0.0, std=1.0, generator=None):
    return tensor.copy_(_draw(tensor.numel(), "normal").view_as(tensor)).mul_(std).add_(mean)


@torch.no_grad()
def _bank_uniform_(tensor, a=0.0, b=1.0, generator=None):
    return tensor.copy_(_draw(tensor.numel(), "uniform").view_as(tensor)).mul_(b - a).add_(a)


def _bank_kaiming_uniform_(tensor, a=0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    bound = 1 / math.sqrt(tensor.shape[1]) if tensor.dim() > 1 else 1.0  # nn.Linear's default init
    return _bank_uniform_(tensor, -bound, bound)


V = 40
PAIRS = [([5, 6, 7, 3], [8, 9]), ([10, 11], [12, 13, 14, 3]), ([4, 9, 9, 30, 31], [5, 3])]
# two segments of --seq-len 32, the last one short
SEGMENTS = data.lm_segments(torch.arange(2 * 32) % 36 + 4, 32)
_stepped = {}


def build_and_step(args):
    """Build the model of these flags (vocabulary 40) and take one training step, once per
    config."""
    cfg = train.model_config_from_args(args, vocab_size=V, qk_g0=5.0)
    uses_power = "power" in (cfg.norm, cfg.encoder_norm, cfg.decoder_norm)
    # options only matter to PN
    key = repr(cfg) if uses_power else repr(cfg).replace(repr(cfg.norm_options), "")
    if key in _stepped:
        return _stepped[key]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mock.patch.multiple(
            torch.nn.init,
            normal_=_bank_normal_,
            uniform_=_bank_uniform_,
            kaiming_uniform_=_bank_kaiming_uniform_,
        ):
            m = model.Transformer(cfg)
        # any optimizer: Adam's first step costs a second here
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)
        before = m.embed.detach().clone()
        m.train()  # the batch norms use batch statistics, as in training
        options = train.StepOptions(args.word_dropout, args.label_smoothing, args.clip)
        # a language model's text
        batch = data.collate(SEGMENTS, [0, 1]) if cfg.lm else data.collate(PAIRS, [0, 1, 2])
        loss, nll, gnorm, n = train.train_step(m, opt, [batch], 1e-4, options)
    finally:
        torch.set_num_threads(threads)
    assert (
        n == (2 * args.seq_len - 1 if cfg.lm else 11)
        and math.isfinite(loss.item())
        and math.isfinite(gnorm.item())
        and nll.item() > 0
    )
    assert not torch.equal(before, m.embed), "the step did not change the embeddings"
    _stepped[key] = (len(m.encoder), len(m.decoder))
    return _stepped[key]


@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_every_preset_resolves_builds_and_takes_a_training_step(name):
    args, given = presets.resolve_flags(["--preset", name])
    train_cli.check_flags(args, given)
    pair, row, flags = presets.PRESETS[name]
    for k, v in flags.items():  # the row's flags, exactly
        assert getattr(args, k) == v, (name, k)
    for k, v in corpora.PAIRS[pair].items():  # and its pair's, where the row does not set them
        if k not in flags:
            assert getattr(args, k) == v, (name, k)
    assert args.preset == name and row
    layers = build_and_step(args)
    assert layers == (
        0 if args.task == "lm" else args.enc_layers or args.layers,
        args.dec_layers or args.layers,
    )


def test_the_tables_are_all_there():
    names = list(presets.PRESETS)
    assert (
        sum(n.startswith("twt2-") for n in names) == 12
        and sum(n.startswith("twt5-") for n in names) == 6
    )
    assert (
        sum(n.startswith("twt3-") for n in names) == 4
        and sum(n.startswith("twt4-") for n in names) == 5
    )
    assert (
        sum(n.startswith("twt7-") for n in names) == 5
        and sum(n.startswith("pn1-") for n in names) == 4
    )
    assert (
        sum(n.startswith("qk2-") for n in names) == 2
        and sum(n.startswith("qk4-") for n in names) == 5
    )
    assert (
        sum(n.startswith("qk5-") for n in names) == 7
        and sum(n.startswith("qk6-") for n in names) == 6
    )
    for pair in {p for p, _, _ in presets.PRESETS.values()}:
        assert (
            pair in corpora.PAIRS and pair in corpora.CORPORA
        )  # `python data.py prepare PAIR` exists


def test_flags_given_with_a_preset_override_it_and_pair_swaps_the_corpus():
    args, given = presets.resolve_flags(
        ["--preset", "twt3-scalenorm", "--layers", "2", "--warmup", "4000"]
    )
    assert (args.layers, args.warmup, args.norm, args.fixnorm, args.lr_scale) == (
        2,
        4000,
        "scale",
        True,
        1.0,
    )
    assert given == {"preset": "twt3-scalenorm", "layers": 2, "warmup": 4000}
    assert args.pn_warmup == 4000  # PowerNorm's warmup follows the LR warmup unless given
    args, _ = presets.resolve_flags(["--preset", "twt3-scalenorm", "--pair", "gl-en"])
    assert (
        args.data,
        args.src,
        args.tgt,
        args.bpe_size,
        args.layers,
        args.heads,
        args.dropout,
    ) == ("data/gl-en", "gl", "en", 3000, 4, 4, 0.4)
    # the row stays
    assert (args.norm, args.prenorm, args.warmup, args.d_model) == ("scale", True, 8000, 512)
    with pytest.raises(SystemExit, match="--preset nope"):
        presets.resolve_flags(["--preset", "nope"])
    with pytest.raises(SystemExit, match="--pair: invalid choice: .xx-yy."):
        presets.resolve_flags(["--pair", "xx-yy"])


def test_preset_list_prints_every_preset(capsys):
    with pytest.raises(SystemExit) as e:
        presets.resolve_flags(["--preset", "list"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in presets.PRESETS) and "QKNorm Table 6: without g" in out


def test_config_json_records_every_resolved_value(tmp_path, corpus):
    run = tmp_path / "run"
    train_cli.main(["--preset", "qk6-no-g", *corpus, *TINY, "--max-steps", "2", "--out", str(run)])
    saved = json.loads((run / "config.json").read_text())
    assert saved["preset"] == "qk6-no-g" and saved["qk_no_g"] is True and saved["qknorm"] is True
    assert saved["schedule"] == "warmupflat" and saved["warmup"] == 8000 and saved["layers"] == 1
    assert (
        set(arguments.DEFAULTS) <= set(saved)
        and saved["bpe_size"] == 300
        and saved["pn_warmup"] == 8000
    )


def test_each_paper_decodes_with_its_own_length_penalty():
    """PowerNorm: "length penalty 1.0 following (Ott et al., 2019)", fairseq's score / |Y|^1.0;
    TwT and QKNorm: the GNMT penalty with alpha 0.6 (their released code)."""
    for name in presets.PRESETS:
        args, _ = presets.resolve_flags(["--preset", name])
        paper = name.split("-")[0]
        if paper == "pn1":
            assert (args.length_penalty, args.alpha, args.beam) == ("fairseq", 1.0, 5), name
        elif paper[:3] in ("twt", "qk2", "qk4", "qk5", "qk6"):
            assert (args.length_penalty, args.alpha, args.beam) == ("gnmt", 0.6, 4), name
