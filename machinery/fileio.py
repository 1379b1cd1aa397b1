"""machinery/fileio.py: the project's files in and out, the lowest module of the project.

It holds DataError, the one-line error for a bad input file or value that every program prints
and exits with (a subclass, WriteFailed, for a failed write); SPLITS and a corpus's file names
(corpus_paths: DIR/{train,dev,test}.LANG); reading lines exactly (split_lines and read_lines, the
project's one line reader: UTF-8 split on "\n" only, with one-line errors that name the file and
line); pairs_sha256, the key that the encoding cache and a resumed run check; the project's one
writer (atomic_write, atomic_write_all) and append_file for a log's new lines; and EXTRAS, the
install line of the optional extras.

Writing is atomic: a temporary file with a unique name in the same folder, flushed to disk, then
renamed over the target. A kill at any moment leaves the old file or the new one, never half of
one, and two processes never share a temporary file; a failed write (a full disk) is one line.

Who calls it: data.py reads a corpus through read_lines; in machinery/, corpora.py and
toy_corpus.py write the corpora, rundir.py the run directory and its checkpoints, logbook.py the
logs, decode_cli.py the translations, and every module that refuses a file or a value raises
DataError, which train_cli.py and decode_cli.py print as one line. It imports no other module of
the project.
"""

import hashlib
import os
import tempfile
from pathlib import Path

import torch

SPLITS = ("train", "dev", "test")  # a corpus's splits, in the order they are read


class DataError(ValueError):
    """A problem with an input file or value; the message is one line naming the file (and line)."""


def corpus_paths(data_dir, *langs):
    """{split: (DIR/split.LANG for each of langs)}, e.g. DIR/train.en and DIR/train.de; a language
    model's train.txt."""
    return {s: tuple(Path(data_dir) / f"{s}.{lang}" for lang in langs) for s in SPLITS}


def split_lines(raw, name):
    """UTF-8 bytes -> stripped lines, split on "\\n" only; DataError naming `name` and the line.

    Note: str.splitlines() would also split on \\x0b, \\x1c, U+2028 ..., which would silently
    break the line alignment of a parallel corpus.
    """
    # UTF-16's byte-order mark: read as latin1, the text would be garbage.
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(
            f"{name}: UTF-16 text, not UTF-8 (convert it with iconv -f utf-16 -t utf-8)"
        )
    # utf-8-sig drops a UTF-8 byte-order mark (Windows editors): it is not text, and it would be a
    # BPE piece of line 1. "\n" is never part of a longer character, so decoding first, then
    # splitting, splits where the bytes' newlines are.
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # e.start counts from after the mark, if any
        at = len(raw) - len(e.object) + e.start  # the bad byte in raw
        line = raw.count(b"\n", 0, at) + 1  # and its line: 1 + the newlines before it
        raise DataError(
            f"{name}: line {line}: invalid UTF-8 byte 0x{raw[at]:02x} at byte offset {at} "
            f"(convert it with iconv -f ENCODING -t utf-8, e.g. latin1)"
        ) from None
    # The final newline does not start another line.
    lines = text.removesuffix("\n").split("\n") if text else []
    return [line.strip() for line in lines]


def read_lines(path, hint=None):
    """The stripped lines of a UTF-8 text file; DataError (one line, naming the file, and the hint
    of what it should be when it is not there) if unreadable."""
    path = Path(path)
    try:
        return split_lines(path.read_bytes(), path)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found" + (f" ({hint})" if hint else "")) from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None


def pairs_sha256(pairs, prefix=b""):
    """The sha256 (hex) of prefix and the text pairs (or a language model's lines): what a cache
    or a resumed run checks."""
    h = hashlib.sha256(prefix)
    for p in pairs:
        h.update(("\t".join(p) if isinstance(p, tuple) else p).encode("utf-8") + b"\n")
    return h.hexdigest()


class WriteFailed(DataError):
    """A write failed (a full disk): one line that names the file; the old file is intact
    (train.py's main() says what to do next)."""


def append_file(path, text):
    """Appends a log's new lines to path; a failed write (a full disk) is WriteFailed, one line, as
    atomic_write's."""
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError as e:
        raise WriteFailed(f"{path}: cannot append to it ({e.strerror})") from None


def atomic_write(path, content):
    """Write content to path atomically: str (UTF-8), bytes, or any object for torch.save."""
    atomic_write_all({path: content})


def atomic_write_all(contents):
    """Write {path: content} so that no path is replaced until every content is written: each goes
    to a temporary file beside its path (flushed to disk), then all are moved in by renames: a
    failure before those replaces none. A failed write (a full disk, any OSError): WriteFailed, one
    line."""
    staged = []
    try:
        for path, content in contents.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged.append((tmp, path))
            with os.fdopen(fd, "wb") as f:
                if isinstance(content, (str, bytes, bytearray)):
                    f.write(content.encode("utf-8") if isinstance(content, str) else content)
                else:
                    try:
                        torch.save(content, f)
                    except RuntimeError as e:
                        # torch's zip writer reports a failed write (a full disk) as a
                        # RuntimeError whose context is the OSError.
                        if isinstance(e.__context__, OSError):
                            raise e.__context__ from None
                        raise
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
        for tmp, path in staged:
            os.replace(tmp, path)
    except BaseException as e:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise WriteFailed(
                f"{path}: cannot write it ({e.strerror}); what was written before it is intact"
            ) from None
        raise


# The optional extras (decode.py --plot, --png; train.py --tensorboard), in one install line.
EXTRAS = "pip install matplotlib tensorboard"
