"""machinery/fileio.py: TODO."""

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
    # UTF-16's byte-order mark: latin1 would make garbage of it
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(
            f"{name}: UTF-16 text, not UTF-8 (convert it with iconv -f utf-16 -t utf-8)"
        )
    # utf-8-sig drops a UTF-8 byte-order mark (Windows editors): not text, it would be a BPE piece
    # of line 1
    try:
        # "\n" is never part of a longer character: decode, then split, is the same
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # e.start counts from after the mark, if any
        at = len(raw) - len(e.object) + e.start  # the bad byte in raw
        line = raw.count(b"\n", 0, at) + 1  # and its line: 1 + the newlines before it
        raise DataError(
            f"{name}: line {line}: invalid UTF-8 byte 0x{raw[at]:02x} at byte offset {at} "
            f"(convert it with iconv -f ENCODING -t utf-8, e.g. latin1)"
        ) from None
    # the final newline does not start another line
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


# a log's new lines; a failed write (a full disk) is one line, as atomic_write's
def append_file(path, text):
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
                    # torch's zip writer reports a failed write (a full disk) as this
                    except RuntimeError as e:
                        raise e.__context__ if isinstance(e.__context__, OSError) else e
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


# the optional extras (decode.py --plot, --png; --tensorboard), one line
EXTRAS = "pip install matplotlib tensorboard"
