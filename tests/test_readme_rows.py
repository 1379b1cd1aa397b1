"""The README's "Every row, by flags" section must keep working as the flags change.

Every `python train.py ...` command between <!-- ROWS:BEGIN --> and <!-- ROWS:END --> is
parsed by train.py's own parser, validated, and its model is built at its exact size and
run forward once on a tiny batch. Every `python data.py prepare NAME` names a corpus that
data.py prepares, and every `python decode.py ...` parses. The per-pair flags of the pair
table are swapped into the en-vi commands and checked too.

Speed (the file must stay well under 30 s on a busy 2-core machine). Each distinct
ModelConfig is built once, at its exact size, by model.Transformer itself. What is slow there
is drawing ~44M fresh random numbers per model (~1 s), twice (nn.Linear's own init, then
model.py's): while building, torch.nn.init's normal_, uniform_ and kaiming_uniform_ copy
their numbers from a bank drawn once, scaled to the mean/std/bounds model.py asks for. Every
shape, code path and init distribution is the row's; only the random draws are reused. The
forward runs on one thread (two threads on a busy 2-core machine are several times slower for
these tiny matmuls).
"""
import math
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest
import torch

import decode
import model
import train

README = Path(__file__).resolve().parent.parent / "README.md"
PREPARE_NAMES = {"en-vi", "gl-en", "sk-en", "ar-en", "en-he", "de-en"}

# Rows with a command, per table (the README's rows; cited rows have none).
EXPECTED = {
    "Transformers without Tears": 12 + 4 + 5 + 6 + 5,  # Tables 2, 3, 4, 5, 7
    "PowerNorm": 4,  # Table 1: LN, BN, PN-V, PN
    "QKNorm": 2 + 5 + 7 + 5,  # Tables 2, 4, 5, 6
}
N_COMMANDS = sum(EXPECTED.values())  # 55


def rows_region():
    text = README.read_text(encoding="utf-8")
    begin, end = "<!-- ROWS:BEGIN -->", "<!-- ROWS:END -->"
    assert text.count(begin) == 1 and text.count(end) == 1, "README.md must hold one ROWS region"
    return text[text.index(begin) + len(begin):text.index(end)]


def code_spans(text):
    return re.findall(r"`([^`\n]+)`", text)


def sections(region):
    """{heading: text} for the region's '### ' sections."""
    parts = re.split(r"^### (.+)$", region, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def train_commands(text):
    return [s for s in code_spans(text) if s.startswith("python train.py ")]


def parse(cmd):
    """train.py's parser and validate_args on one command; a bad flag fails with the command."""
    try:
        args = train.build_parser().parse_args(shlex.split(cmd)[2:])
        train.validate_args(args)  # sys.exit on a bad combination
    except SystemExit as e:
        pytest.fail(f"README command rejected by train.py ({e}): {cmd}")
    return args


def section_of(name):
    for heading, text in sections(rows_region()).items():
        if heading.startswith(name):
            return text
    raise AssertionError(f"no '### {name}' section in the ROWS region")


# -- building and running each distinct model once ------------------------------------------
_checked = {}
_BANK = {"cursor": 0}


def _draw(n, kind):
    """n numbers from a bank of standard normal or U(0, 1) numbers, drawn once; a moving cursor
    gives each tensor different numbers."""
    if kind not in _BANK:
        g = torch.Generator().manual_seed(0)
        _BANK[kind] = torch.randn(1 << 22, generator=g) if kind == "normal" else torch.rand(1 << 22, generator=g)
    bank = _BANK[kind]
    start = _BANK["cursor"] % (bank.numel() - 1)
    _BANK["cursor"] += 7919 + n
    idx = torch.arange(start, start + n) % bank.numel() if start + n > bank.numel() else slice(start, start + n)
    return bank[idx]


@torch.no_grad()
def _bank_normal_(tensor, mean=0.0, std=1.0, generator=None):
    return tensor.copy_(_draw(tensor.numel(), "normal").view_as(tensor)).mul_(std).add_(mean)


@torch.no_grad()
def _bank_uniform_(tensor, a=0.0, b=1.0, generator=None):
    return tensor.copy_(_draw(tensor.numel(), "uniform").view_as(tensor)).mul_(b - a).add_(a)


def _bank_kaiming_uniform_(tensor, a=0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    # nn.Linear's default (a = sqrt 5): U(-1/sqrt(fan_in), 1/sqrt(fan_in)); model.py overwrites it
    bound = 1 / math.sqrt(tensor.shape[1]) if tensor.dim() > 1 else 1.0
    return _bank_uniform_(tensor, -bound, bound)


def build_and_run(args):
    """Build the model of these flags (vocabulary 40) and run one forward pass, once per config."""
    cfg = train.model_config_from_args(args, vocab_size=40, qk_g0=5.0)
    key = repr(cfg)
    if key in _checked:
        return _checked[key]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mock.patch.multiple(torch.nn.init, normal_=_bank_normal_, uniform_=_bank_uniform_,
                                 kaiming_uniform_=_bank_kaiming_uniform_):
            m = model.Transformer(cfg)
        src = torch.tensor([[5, 6, 3], [7, 3, 0]])  # (B=2, S=3), EOS = 3, PAD = 0
        tgt = torch.tensor([[2, 8, 9, 10], [2, 11, 12, 0]])  # (B=2, T=4), BOS = 2
        m.train()  # the batch norms use batch statistics here, as in training
        with torch.no_grad():
            logits = m(src, tgt)  # (B, T, V)
    finally:
        torch.set_num_threads(threads)
    assert logits.shape == (2, 4, 40)
    assert torch.isfinite(logits[..., m.allowed]).all(), f"non-finite logits for {cmd_hint(args)}"
    assert (logits[..., ~m.allowed] == float("-inf")).all()  # PAD and BOS are never predicted
    n_layers = (len(m.encoder), len(m.decoder))
    _checked[key] = n_layers
    return n_layers


def cmd_hint(args):
    return f"--norm {args.norm} --encoder-norm {args.encoder_norm} --heads {args.heads} --layers {args.layers}"


# -- the tests ------------------------------------------------------------------------------
def test_every_row_has_a_command():
    region = rows_region()
    assert len(train_commands(region)) >= N_COMMANDS
    for name, n in EXPECTED.items():
        assert len(train_commands(section_of(name))) >= n, name


@pytest.mark.parametrize("section", list(EXPECTED))
def test_commands_parse_build_and_run(section):
    for cmd in train_commands(section_of(section)):
        args = parse(cmd)
        assert args.data is not None and args.data.startswith("data/"), cmd
        assert args.out.startswith("runs/"), cmd
        assert (args.d_model, args.label_smoothing, args.batch_tokens) == (512, 0.1, 4096), cmd
        assert args.beta1 == 0.9 and args.adam_eps == 1e-8, cmd
        if section == "PowerNorm":
            assert (args.heads, args.ff, args.layers, args.prenorm) == (4, 1024, 6, True), cmd
            assert (args.beta2, args.weight_decay, args.clip, args.lr, args.warmup) == (0.98, 1e-4, 0, 0.0015, 8000), cmd
            assert args.encoder_norm in (None, "batch", "pnv", "power") and args.norm == "layer", cmd
            assert (args.beam, args.alpha) == (5, 1.0), cmd
        else:  # TwT appendix A, which the unwritten flags rely on
            assert args.ff == 2048 and args.word_dropout == 0.1, cmd
            assert (args.beta2, args.clip, args.weight_decay) == (0.999, 1.0, 0.0), cmd
            assert (args.decay_factor, args.patience) == (0.8, 3), cmd
            assert (args.beam, args.alpha) == (4, 0.6), cmd
            if section == "QKNorm":  # all but the TwT baseline of QKNorm Table 2
                assert args.qknorm == (args.out != "runs/qk2-twt-en-vi"), cmd
        layers = build_and_run(args)
        assert layers == (args.layers, args.layers), cmd


def test_prepare_names_exist():
    names = re.findall(r"python data\.py prepare (\S+?)`", rows_region())
    assert names, "no `python data.py prepare NAME` in the ROWS region"
    assert set(names) <= PREPARE_NAMES, set(names) - PREPARE_NAMES
    assert set(names) == PREPARE_NAMES  # every corpus the tables use is named


def test_decode_commands_parse():
    cmds = [s for s in code_spans(rows_region()) if s.startswith("python decode.py ")]
    assert cmds, "the PowerNorm rows need a checkpoint-averaging decode command"
    for cmd in cmds:
        try:
            decode.parse_args(shlex.split(cmd)[2:])
        except SystemExit as e:
            pytest.fail(f"README command rejected by decode.py ({e}): {cmd}")


def test_pair_flags_swap_into_en_vi_commands():
    """The pair table: each pair's flags replace en-vi's in the per-pair tables' commands."""
    region = rows_region()
    pairs = {}
    for line in region.splitlines():
        spans = code_spans(line)
        prep = [s for s in spans if s.startswith("python data.py prepare ")]
        flags = [s for s in spans if s.startswith("--data data/")]
        early = [s for s in spans if s.startswith("--early-stop ")]
        if prep and flags and early:
            pairs[prep[0].split()[-1]] = (flags[0], early[0])
    assert set(pairs) == {"gl-en", "sk-en", "en-vi", "en-he", "ar-en"}
    en_vi, en_vi_early = pairs["en-vi"]
    twt = [c for c in train_commands(section_of("Transformers without Tears")) if en_vi in c]
    assert len(twt) >= 12 + 4 + 5 + 5  # Tables 2, 3, 4, 7 (Table 5 varies --layers)
    for name, (flags, early) in pairs.items():
        a = parse("python train.py " + flags)
        src, tgt = name.split("-")
        assert (a.data, a.src, a.tgt) == (f"data/{name}", src, tgt)
        assert a.bpe_size == (3000 if name == "gl-en" else 8000)
        assert (a.layers, a.heads, a.dropout) == ((4, 4, 0.4) if name == "gl-en" else (6, 8, 0.3))
        for i, cmd in enumerate(twt):
            args = parse(cmd.replace(en_vi, flags).replace(en_vi_early, early))
            assert args.data == f"data/{name}" and args.early_stop == int(early.split()[1])
            if i == 0:  # one model per pair: only gl-en differs in shape from en-vi
                assert build_and_run(args) == (a.layers, a.layers)
        for cmd in train_commands(section_of("QKNorm")):  # QKNorm Table 2 covers the five pairs too
            if en_vi in cmd:
                args = parse(cmd.replace(en_vi, flags))
                assert args.data == f"data/{name}" and args.early_stop == 0
