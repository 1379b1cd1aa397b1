"""machinery/plots.py: decode.py's pictures: the runs' curves, attention heatmaps, PNG figures.

--plot RUN [RUN ...] --out FILE.png overlays runs' metrics.jsonl (written by train.py), as in [1]
Figs. 1-4 and [2] Figs. 2-4: plot_series() picks the curves (tested), plot_runs() draws them.
--attention prints render_heatmap()'s text map of attention weights ([3] Figures 1-2), and with
--png save_heatmap_png() draws it; --svd --png draws the embedding's singular values
([2] Figure 6) on a figure().

matplotlib is an optional extra (fileio.EXTRAS), imported only in figure(): without it a picture
is skipped with a note, or refused with a DataError where the picture is what was asked for
(--plot, --png). machinery/decode_cli.py calls these (python decode.py); the references [1]-[3]
are decode.py's: TwT, PowerNorm and QKNorm.
"""

import contextlib
import json
import sys
from pathlib import Path

import torch

from machinery import fileio, rundir
from machinery.fileio import DataError

SHADES = " .:-=+*#%@"  # weight 0 -> " ", weight 1 -> "@"


def render_heatmap(weights, rows, cols, max_label=8):
    """A text heatmap of weights (R, C) in [0, 1]: each cell the shade SHADES[round(w * 9)], on an
    absolute scale (not per row) so that maps of different heads and models compare, as wide as its
    column's label (labels across the top, cut to max_label with "~")."""
    w = torch.as_tensor(weights, dtype=torch.float32)
    if w.dim() != 2 or w.shape != (len(rows), len(cols)):
        raise ValueError(
            f"weights {tuple(w.shape)} do not match {len(rows)} rows x {len(cols)} columns"
        )
    rlab, clab = (
        [t if len(t) <= max_label else t[: max_label - 1] + "~" for t in ts] for ts in (rows, cols)
    )
    rw = max([len(r) for r in rlab] + [1])
    lines = [" " * rw + " | " + " ".join(clab)]
    for r, row in zip(rlab, w.tolist(), strict=True):
        cells = [
            SHADES[min(len(SHADES) - 1, max(0, round(v * (len(SHADES) - 1))))] * len(c)
            for c, v in zip(clab, row, strict=True)
        ]
        lines.append(r.rjust(rw) + " | " + " ".join(cells))
    lines.append(f"shades: {SHADES!r} for weights 0 .. 1 (absolute scale)")
    return "\n".join(lines)


def figure(path, flag=None, **size):
    """A matplotlib Figure (an optional extra, not in requirements.txt, imported only here) to draw
    the PNG `path`; without it None and a line on stderr saying how to install it, or with `flag`
    DataError naming it."""
    try:
        # No pyplot: no display is needed, and there is no open figure to close.
        from matplotlib import figure as matplotlib_figure

        return matplotlib_figure.Figure(**size)
    except ImportError:
        why = f"{path} needs matplotlib, which is not installed: {fileio.EXTRAS}"
        if flag:
            raise DataError(f"{flag} {why}") from None
        print(f"note: {why}", file=sys.stderr)


def save_heatmap_png(weights, rows, cols, path, title=None):
    """Saves the map as a PNG with matplotlib; True if written, False (and a note) without it."""
    if (
        fig := figure(path, figsize=(max(4, 0.4 * len(cols) + 2), max(3, 0.4 * len(rows) + 1.5)))
    ) is None:
        return False  # no matplotlib: figure's note said so
    # The axes set by add_subplot's keywords, as for the --svd picture.
    ax = fig.add_subplot(title=title or "", yticks=range(len(rows)), yticklabels=rows)
    im = ax.imshow(
        torch.as_tensor(weights).float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto"
    )
    ax.set_xticks(range(len(cols)), cols, rotation=90)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    return True


def plot_series(run_dirs):
    """{panel title: [(run name, xs, ys)]}: the curves of each panel of --plot, one per run."""
    # The panels of one key each (dev perplexity: steadier than a short run's BLEU).
    keys = {
        "dev BLEU": "dev_bleu",
        "dev perplexity": "dev_ppl",
        "training loss": "train_loss",
        "gradient norm (before clipping)": "gnorm",
    }
    panels = {
        t: []
        for t in (
            *keys,
            "learned g by depth (last evaluation)",
            "QKNorm g (mean over modules)",
            "batch vs running statistic, first norm",
            "embedding singular values / the largest ([2] Fig. 6)",
        )
    }
    for run in run_dirs:
        rows, name = rundir.read_metrics(run), Path(run).name
        for title, key in keys.items():
            curve = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            panels[title].append(_curve(name, curve))
        if evals := [r for r in rows if r.get("g")]:
            g = evals[-1]["g"]
            scale = sorted((k for k in g if not _is_qknorm(k)), key=_depth)  # ScaleNorm's by depth
            curve = [*enumerate(g[k] for k in scale)]
            panels["learned g by depth (last evaluation)"].append(_curve(name, curve))
            # (step, its QKNorm g's) at each evaluation
            qk = [(r["step"], [v for k, v in r["g"].items() if _is_qknorm(k)]) for r in evals]
            curve = [(x, sum(gs) / len(gs)) for x, gs in qk if gs]
            panels["QKNorm g (mean over modules)"].append(_curve(name, curve))
        # The first norm: the encoder's, else the decoder's (a language model has no encoder).
        first = (
            "encoder.0.norm_attn"
            if any("encoder.0.norm_attn" in r.get("batch_norm_stats", {}) for r in rows)
            else "decoder.0.norm_self"
        )
        stats = [
            (r["step"], s)
            for r in rows
            for n, s in r.get("batch_norm_stats", {}).items()
            if n == first
        ]
        if key := next(
            (k for k in ("dist_sigma2", "dist_psi2") if stats and k in stats[0][1]), None
        ):
            curve = _curve(f"{name} ({key})", [(x, s[key]) for x, s in stats])
            panels["batch vs running statistic, first norm"].append(curve)
        # The finished run's embedding ([2] Figure 6), from results.json: none before the run ends.
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            sv = json.loads((Path(run) / "results.json").read_text())["embedding_singular_values"]
            curve = _curve(name, [*enumerate(sv, 1)])
            panels["embedding singular values / the largest ([2] Fig. 6)"].append(curve)
    return panels


def _curve(label, points):
    """[(x, y)] -> a curve of --plot: (label, xs, ys)."""
    return label, [x for x, _ in points], [y for _, y in points]


def _is_qknorm(key):
    """Whether the g of metrics.jsonl's key is an attention module's (QKNorm), not a norm's."""
    return key.endswith(("self_attn.g", "cross_attn.g"))


def _depth(key):
    """A norm's g in depth order: the encoder's first, each stack by layer, its final norm last."""
    layer = key.split(".")[1]
    return not key.startswith("enc"), int(layer) if layer.isdigit() else 1 << 30


def plot_runs(run_dirs, out):
    """--plot: draws plot_series() into out, a PNG that decode_cli's run() checked; without
    matplotlib, a DataError (one line)."""
    fig = figure(out, "--out")
    # Only the panels with data, three a row.
    panels = {t: c for t, c in plot_series(run_dirs).items() if any(xs for _, xs, _ in c)}
    rows = -(-max(len(panels), 1) // 3)
    fig.set_size_inches(15, 4 * rows)
    for i, (title, curves) in enumerate(panels.items()):
        xlabel = (
            "layer (encoder, then decoder)"
            if "depth" in title
            else "index"
            if "singular" in title
            else "step"
        )
        log = any(w in title for w in ("gradient", "statistic", "perplexity"))
        # The axes set by add_subplot's keywords, as for the --svd picture.
        ax = fig.add_subplot(rows, 3, i + 1, xlabel=xlabel, yscale="log" if log else "linear")
        for name, xs, ys in curves:
            if xs:
                # Markers on the depth panel, and on a curve of one point (no line to draw).
                ax.plot(
                    xs,
                    ys,
                    label=name,
                    marker="o" if "depth" in title or len(xs) == 1 else None,
                    lw=1,
                )
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}", file=sys.stderr)
