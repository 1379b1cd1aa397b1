"""Tests for `python data.py prepare NAME`: offline, on small fake archives laid out like the real
ones."""

import http.server
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

import data
from machinery import corpora, fileio, presets
from machinery.fileio import DataError

ROOT = Path(__file__).resolve().parent.parent


def _tar(path, members):
    """A .tar.gz holding {name: text}."""
    with tarfile.open(path, "w:gz") as t:
        for name, text in members.items():
            raw = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            t.addfile(info, io.BytesIO(raw))
    return path


def _stanford_en_vi(folder):
    """The Stanford iwslt15.en-vi file set: train 5, tst2012 (dev) 2, tst2013 (test) 3 lines."""
    folder.mkdir(parents=True)
    for name, n in (("train", 5), ("tst2012", 2), ("tst2013", 3)):
        (folder / f"{name}.en").write_text("".join(f"{name} en {i}\n" for i in range(n)))
        (folder / f"{name}.vi").write_text("".join(f"{name} vi {i} ạ\n" for i in range(n)))
    return folder


def test_en_vi_from_a_file_url_writes_the_split_files_and_the_command(tmp_path, capsys):
    src = _stanford_en_vi(tmp_path / "iwslt15.en-vi")
    out = tmp_path / "en-vi"
    corpora.prepare("en-vi", out, src.as_uri(), expected={"train": 5, "dev": 2, "test": 3})
    assert (out / "train.en").read_text().splitlines()[4] == "train en 4"
    assert (out / "dev.vi").read_text() == "tst2012 vi 0 ạ\ntst2012 vi 1 ạ\n"
    assert len((out / "test.en").read_text().splitlines()) == 3
    pairs, _ = data.read_parallel(out / "train.en", out / "train.vi")
    assert len(pairs) == 5
    printed = capsys.readouterr().out
    assert f"python train.py --data {out} --src en --tgt vi --bpe-size 8000 " in printed
    assert "--epoch-size 1500" in printed
    # Idempotent: the stamp makes a second run skip everything, even without the source.
    for f in src.iterdir():
        f.unlink()
    corpora.prepare("en-vi", out, src.as_uri(), expected={"train": 5, "dev": 2, "test": 3})
    assert "already prepared" in capsys.readouterr().out


def test_a_damaged_stamp_prepares_again(tmp_path, capsys):
    """A prepared.json that is not JSON, or not a JSON object, is no stamp: the corpus is prepared
    again (no traceback)."""
    src = _stanford_en_vi(tmp_path / "iwslt15.en-vi")
    out = tmp_path / "en-vi"
    corpora.prepare("en-vi", out, src.as_uri(), expected={"train": 5, "dev": 2, "test": 3})
    for damaged in ("{half", "[1, 2]"):
        (out / "prepared.json").write_text(damaged)
        capsys.readouterr()
        corpora.prepare("en-vi", out, src.as_uri(), expected={"train": 5, "dev": 2, "test": 3})
        assert "already prepared" not in capsys.readouterr().out
        assert json.loads((out / "prepared.json").read_text())["name"] == "en-vi"


def test_en_vi_papers_counts_are_checked_exactly(tmp_path):
    src = _stanford_en_vi(tmp_path / "iwslt15.en-vi")
    # the source read
    with pytest.raises(DataError, match=r"iwslt15.en-vi: train has 5 pairs, expected 133,317"):
        corpora.prepare("en-vi", tmp_path / "out", str(src))  # a local folder, read in place
    assert not (tmp_path / "out" / "prepared.json").exists()


def _ted_archive(path):
    """A Qi et al. ted_talks.tar.gz: all_talks_{train,dev,test}.tsv, one column per language."""

    def tsv(rows):
        return "talk_name\ten\tgl\tar\n" + "".join("\t".join(r) + "\n" for r in rows)

    return _tar(
        path,
        {
            "all_talks_train.tsv": tsv(
                [
                    ("t1", "hello .", "ola .", "marhaban ."),
                    ("t1", "thanks .", "__NULL__", "shukran ."),
                    ("t2", "yes .", "si .", ""),
                    ("t2", "no .", "non .", "la ."),
                ]
            ),
            "all_talks_dev.tsv": tsv([("t3", "dev .", "dev gl .", "__NULL__")]),
            "all_talks_test.tsv": tsv(
                [
                    ("t4", "test .", "proba .", "ikhtibar ."),
                    ("t4", "bye .", "adeus .", "maa salama ."),
                ]
            ),
        },
    )


def test_ted_pairs_from_a_local_tar_gz(tmp_path, capsys):
    archive = _ted_archive(tmp_path / "ted_talks.tar.gz")
    out = corpora.prepare("gl-en", tmp_path / "gl-en", str(archive))
    assert (out / "train.gl").read_text() == "ola .\nsi .\nnon .\n"  # NULL row dropped
    assert (out / "train.en").read_text() == "hello .\nyes .\nno .\n"
    assert (out / "dev.gl").read_text() == "dev gl .\n"
    assert len((out / "test.en").read_text().splitlines()) == 2
    cap = capsys.readouterr()
    # The papers' train size (10k) is approximate: a warning, not an error.
    assert "warning: gl-en train: 3 pairs" in cap.err and "not certain" in cap.err
    # The command it prints works, and sets the corpus's flags: those --pair gl-en sets, with the
    # folder prepared.
    import shlex

    args, _ = presets.resolve_flags(shlex.split(cap.out.splitlines()[-1])[2:])
    assert {k: getattr(args, k) for k in corpora.PAIRS["gl-en"]} == dict(
        corpora.PAIRS["gl-en"], data=str(out)
    )
    out = corpora.prepare("ar-en", tmp_path / "ar-en", str(archive))
    assert (out / "train.ar").read_text() == "marhaban .\nshukran .\nla .\n"  # empty ar dropped
    assert (out / "dev.ar").read_text() == ""


def test_ted_missing_language_column_is_named(tmp_path):
    archive = _ted_archive(tmp_path / "ted_talks.tar.gz")
    with pytest.raises(DataError, match="no column 'sk'.*talk_name en gl ar"):
        corpora.prepare("sk-en", tmp_path / "sk-en", str(archive))


def test_iwslt14_de_en_follows_the_fairseq_steps(tmp_path, capsys):
    train_de, train_en = (
        ["<url>http://ted.com/x</url>", "<talkid>1</talkid>", "<title>Ein Titel</title>"],
        ["<url>http://ted.com/x</url>", "<talkid>1</talkid>", "<title>A Title</title>"],
    )
    for i in range(46):
        train_de.append(f"Satz Nummer {i} ." if i != 5 else "Eins zwei drei vier fünf sechs .")
        train_en.append(f"Sentence number {i} ." if i != 5 else "One .")  # ratio > 1.5: cleaned
    seg = '<doc docid="1">\n<seg id="{}"> {} </seg>\n</doc>\n'
    members = {
        "de-en/train.tags.de-en.de": "\n".join(train_de) + "\n",
        "de-en/train.tags.de-en.en": "\n".join(train_en) + "\n",
    }
    for t in ("TED.dev2010", "TEDX.dev2012", "TED.tst2010", "TED.tst2011", "TED.tst2012"):
        members[f"de-en/IWSLT14.{t}.de-en.de.xml"] = seg.format(1, f"Test {t} .")
        members[f"de-en/IWSLT14.{t}.de-en.en.xml"] = seg.format(1, f"It\u2019s {t} .")
    archive = _tar(tmp_path / "de-en.tgz", members)
    out = corpora.prepare(
        "de-en", tmp_path / "de-en", archive.as_uri(), expected={"train": 44, "dev": 2, "test": 5}
    )
    train = (out / "train.de").read_text().splitlines()
    assert train[0] == "ein titel" and "eins zwei drei vier fünf sechs ." not in train
    assert (out / "dev.en").read_text() == "sentence number 22 .\nsentence number 45 .\n"
    assert (out / "test.en").read_text().splitlines()[0] == "it's ted.dev2010 ."
    assert "--src de --tgt en --bpe-size 10000" in capsys.readouterr().out


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    body = bytes(range(256)) * 400
    honour_range = True
    ranges = []

    def do_GET(self):
        rng = self.headers.get("Range")
        type(self).ranges.append(rng)
        start = int(rng[6:-1]) if rng and self.honour_range else 0
        self.send_response(206 if start else 200)
        if start:
            self.send_header(
                "Content-Range", f"bytes {start}-{len(self.body) - 1}/{len(self.body)}"
            )
        self.send_header("Content-Length", str(len(self.body) - start))
        self.end_headers()
        self.wfile.write(self.body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """A loopback HTTP server that honours Range requests; stopped after the test."""
    _RangeHandler.ranges, _RangeHandler.honour_range = [], True
    srv = http.server.HTTPServer(("127.0.0.1", 0), _RangeHandler)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}/x.tar.gz"
    srv.shutdown()
    srv.server_close()
    thread.join(5)


@pytest.mark.parametrize("honour_range", [True, False])
def test_download_resumes_a_truncated_part_over_http(tmp_path, server, honour_range):
    _RangeHandler.honour_range = honour_range
    dest = tmp_path / "x.tar.gz"
    (tmp_path / "x.tar.gz.part").write_bytes(_RangeHandler.body[:30000])
    corpora.download(server, dest)
    assert dest.read_bytes() == _RangeHandler.body  # a server ignoring Range: whole file again
    assert not (tmp_path / "x.tar.gz.part").exists()
    assert _RangeHandler.ranges == ["bytes=30000-"]
    corpora.download(server, dest)  # already there: no request
    assert len(_RangeHandler.ranges) == 1


def test_download_resumes_a_truncated_part_from_a_file_url(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(50000))
    dest = tmp_path / "out" / "src.bin"
    dest.parent.mkdir()
    (dest.parent / "src.bin.part").write_bytes(src.read_bytes()[:1234])
    corpora.download(src.as_uri(), dest)
    assert dest.read_bytes() == src.read_bytes()


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_network_gives_one_line_and_keeps_the_part(tmp_path):
    out = tmp_path / "de-en"
    (out / "orig").mkdir(parents=True)
    (out / "orig" / "de-en.tgz.part").write_bytes(b"partial")
    url = f"http://127.0.0.1:{_closed_port()}/de-en.tgz"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "data.py"),
            "prepare",
            "de-en",
            "--dir",
            str(out),
            "--url",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"data.py: cannot reach {url} (")
    assert lines[0].endswith(
        "no network?); download it elsewhere and pass --url /path/to/de-en.tgz"
    )
    assert "Traceback" not in r.stderr + r.stdout
    assert (out / "orig" / "de-en.tgz.part").read_bytes() == b"partial"


def test_mirror_env_var_is_used(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    _stanford_en_vi(mirror / "iwslt15.en-vi")
    monkeypatch.setenv("NMT_DATA_MIRROR", mirror.as_uri())
    out = corpora.prepare("en-vi", tmp_path / "en-vi", expected={"train": 5, "dev": 2, "test": 3})
    assert (out / "orig" / "train.en").exists() and (out / "train.en").exists()


def test_unknown_name_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        corpora.prepare_main(["xx-yy"])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert "invalid choice: 'xx-yy'" in err and all(n in err for n in corpora.CORPORA)
    with pytest.raises(DataError, match="choose from en-vi, gl-en"):
        corpora.prepare("xx-yy")


def test_registry_is_complete():
    for name, c in corpora.CORPORA.items():
        f = c["flags"]  # its train.py flags, their one copy (train.PAIRS reads them)
        # a language model's text: one file a split, each with its md5, or one archive's md5
        if f.get("task") == "lm":
            assert set(c["splits"]) == set(fileio.SPLITS) and f["bpe_size"] == 0  # words, no BPE
            assert set(c["md5"]) == ({"archive"} if c["archive"] else set(fileio.SPLITS))
            continue
        assert f["src"] + "-" + f["tgt"] == name.removeprefix("multi30k-") or (name, f["tgt"]) == (
            "multi30k",
            "de",
        )
        assert set(c["splits"]) == set(fileio.SPLITS)
        assert f["bpe_size"] > 0 and set(c["exact"]) <= set(c["counts"])


@pytest.mark.parametrize("name, tgt", [("multi30k", "de"), ("multi30k-en-cs", "cs")])
def test_multi30k_from_gzipped_files_in_a_folder(name, tgt, tmp_path, capsys):
    """The Multi30k repository ships task 1 as gzipped files (train, val, test_2016_flickr), German
    and Czech for the same English captions."""
    import gzip

    src = tmp_path / "raw"
    src.mkdir()
    sizes = {"train": 4, "val": 2, "test_2016_flickr": 3}
    for split, n in sizes.items():
        for lang in ("en", "de", "cs"):
            (src / f"{split}.{lang}.gz").write_bytes(
                gzip.compress("".join(f"{split} {lang} {i} ä\n" for i in range(n)).encode())
            )
    out = tmp_path / "m30k"
    corpora.prepare(name, out, str(src), expected={"train": 4, "dev": 2, "test": 3})
    assert (out / f"dev.{tgt}").read_text() == f"val {tgt} 0 ä\nval {tgt} 1 ä\n"
    assert len((out / "test.en").read_text().splitlines()) == 3
    assert (
        f"python train.py --data {out} --src en --tgt {tgt} --bpe-size 4000"
        in capsys.readouterr().out
    )


def test_prepare_help_says_what_each_corpus_is_and_where_it_departs(capsys):
    with pytest.raises(SystemExit) as e:
        corpora.prepare_main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    for name, c in corpora.CORPORA.items():
        assert f"{name}" in text and " ".join(c["notes"].split()) in text, name
    assert "prepare-iwslt14.sh only approximately" in text


def _users_corpus(folder):
    """A folder holding a user's own corpus (no prepared.json): what prepare must not touch when it
    fails."""
    folder.mkdir(parents=True)
    for name in ("train.en", "train.vi", "dev.en", "dev.vi", "test.en", "test.vi"):
        (folder / name).write_text(f"the user's own {name}\n")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_source_missing_a_split_changes_none_of_the_folders_files(tmp_path):
    """Issue 30: a source without tst2013.* (the test split) wrote train and dev into DIR before
    failing."""
    src = _stanford_en_vi(tmp_path / "src")
    for f in src.glob("tst2013.*"):
        f.unlink()
    mine = _users_corpus(tmp_path / "mine")
    with pytest.raises(DataError, match="tst2013.en"):
        corpora.prepare("en-vi", tmp_path / "mine", str(src))
    assert {p.name: p.read_bytes() for p in (tmp_path / "mine").iterdir()} == mine


def test_a_line_count_mismatch_writes_no_split(tmp_path):
    src = _stanford_en_vi(tmp_path / "src")
    mine = _users_corpus(tmp_path / "mine")
    with pytest.raises(DataError, match="expected 4"):
        corpora.prepare(
            "en-vi", tmp_path / "mine", str(src), expected={"train": 5, "dev": 2, "test": 4}
        )
    assert {p.name: p.read_bytes() for p in (tmp_path / "mine").iterdir()} == mine


def test_a_failed_write_replaces_no_file(tmp_path, monkeypatch):
    """Every file is staged before any is moved in: a write failing on the last leaves the others as
    they were."""
    paths = [tmp_path / f"{s}.txt" for s in ("train", "dev", "test")]
    for p in paths:
        p.write_text("old\n")
    real, calls = os.fdopen, {"n": 0}

    def failing_fdopen(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(os, "fdopen", failing_fdopen)
    with pytest.raises(fileio.WriteFailed, match="No space"):
        fileio.atomic_write_all({p: "new\n" for p in paths})
    assert [p.read_text() for p in paths] == ["old\n"] * 3
    # no temporary left
    assert sorted(q.name for q in tmp_path.iterdir()) == ["dev.txt", "test.txt", "train.txt"]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_a_bpe_size_under_what_sentencepiece_needs_is_one_line(size):
    """Issue 30: --bpe-size 1, 2 and 3 were a sentencepiece traceback (it failed on a special
    piece's id)."""
    with pytest.raises(
        DataError, match=rf"--bpe-size {size}: too small for this corpus, .* at least 14"
    ):
        data.train_bpe(["hello world"] * 20, ["hallo welt"] * 20, size)


def _wikitext_zip(path, test=" = Test = \n \n the test <unk> . \n"):
    """A wikitext-103-v1.zip laid out as the real one: wikitext-103/wiki.{train,valid,test}.tokens,
    blank lines in."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("wikitext-103/", "")
        z.writestr("wikitext-103/wiki.train.tokens", " \n = Title = \n \n the cat sat . \n")
        z.writestr("wikitext-103/wiki.valid.tokens", " \n the dev @-@ line . \n")
        z.writestr("wikitext-103/wiki.test.tokens", test)
    return path


def test_prepare_wikitext_103_from_a_zip_checks_its_md5_offline(tmp_path, monkeypatch, capsys):
    """Issue 31: WikiText-103 from one zip (its author's mirror), the zip's md5 checked as
    torchtext's; offline."""
    import hashlib

    src = _wikitext_zip(tmp_path / "wikitext-103-v1.zip")
    monkeypatch.setitem(
        corpora.CORPORA["wikitext-103"],
        "md5",
        {"archive": hashlib.md5(src.read_bytes()).hexdigest()},
    )
    out = corpora.prepare("wikitext-103", tmp_path / "wt", str(src))
    # blank lines kept: counts as released
    assert (out / "train.txt").read_text() == "\n= Title =\n\nthe cat sat .\n"
    assert (out / "dev.txt").read_text() == "\nthe dev @-@ line .\n"
    assert (out / "test.txt").read_text() == "= Test =\n\nthe test <unk> .\n"
    assert "--preset pn2-wt103-layernorm" in capsys.readouterr().out
    # Over a file:// URL too (downloaded into DIR/orig), and a damaged zip is one line that changes
    # nothing.
    corpora.prepare("wikitext-103", tmp_path / "wt2", src.as_uri())
    assert (tmp_path / "wt2" / "orig" / "wikitext-103-v1.zip").read_bytes() == src.read_bytes()
    monkeypatch.setitem(corpora.CORPORA["wikitext-103"], "md5", {"archive": "0" * 32})
    with pytest.raises(
        DataError,
        match=r"wikitext-103-v1.zip: md5 [0-9a-f]{32}, expected 0{32}: not the wikitext-103",
    ):
        corpora.prepare("wikitext-103", tmp_path / "wt3", str(src))
    assert not (tmp_path / "wt3").exists()


def test_a_language_models_corpus_reads_the_mirror_and_its_stamp_names_the_corpus(
    tmp_path, monkeypatch, capsys
):
    """$NMT_DATA_MIRROR serves PTB and WikiText-103 as it serves the translation corpora (it was
    ignored for them), and a folder whose prepared.json names another corpus is prepared again, not
    reported as done (it was)."""
    import hashlib

    (tmp_path / "mirror").mkdir()
    src = _wikitext_zip(tmp_path / "mirror" / "wikitext-103-v1.zip")
    monkeypatch.setitem(
        corpora.CORPORA["wikitext-103"],
        "md5",
        {"archive": hashlib.md5(src.read_bytes()).hexdigest()},
    )
    monkeypatch.setenv("NMT_DATA_MIRROR", (tmp_path / "mirror").as_uri())
    # no --url: the mirror's copy, fetched into DIR/orig
    out = corpora.prepare("wikitext-103", tmp_path / "wt")
    assert (out / "orig" / "wikitext-103-v1.zip").read_bytes() == src.read_bytes()
    assert (
        json.loads((out / "prepared.json").read_text())["source"]
        == f"{(tmp_path / 'mirror').as_uri()}/{src.name}"
    )
    # as if PTB had been prepared into this folder
    (out / "prepared.json").write_text(json.dumps({"name": "ptb"}))
    (out / "train.txt").write_text("PTB's text\n")
    capsys.readouterr()
    corpora.prepare("wikitext-103", out)
    assert "already prepared" not in capsys.readouterr().out
    assert (out / "train.txt").read_text() == "\n= Title =\n\nthe cat sat .\n"
    assert json.loads((out / "prepared.json").read_text())["name"] == "wikitext-103"


def test_a_wikitext_zip_missing_a_file_names_it(tmp_path, monkeypatch):
    import hashlib
    import zipfile

    src = tmp_path / "wikitext-103-v1.zip"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("wikitext-103/wiki.train.tokens", "a\n")
    monkeypatch.setitem(
        corpora.CORPORA["wikitext-103"],
        "md5",
        {"archive": hashlib.md5(src.read_bytes()).hexdigest()},
    )
    with pytest.raises(DataError, match="no file wiki.valid.tokens in it"):
        corpora.prepare("wikitext-103", tmp_path / "wt", str(src))


@pytest.mark.parametrize("name", ["en-vi", "ptb"])
def test_a_dir_that_is_a_file_is_one_line_and_the_file_is_kept(name, tmp_path, capsys):
    """Issue 30's probe: --dir naming an existing file was a FileExistsError traceback after reading
    every source."""
    (tmp_path / "mine").write_text("the user's file\n")
    src = _stanford_en_vi(tmp_path / "src")
    assert corpora.prepare_main([name, "--dir", str(tmp_path / "mine"), "--url", str(src)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"data.py: --dir {tmp_path / 'mine'}: a file, not a folder", err
    assert (tmp_path / "mine").read_text() == "the user's file\n"


def test_sigterm_stops_prepare_as_ctrl_c_does(tmp_path, monkeypatch, capsys):
    """SIGTERM (machinery/rundir.py's interrupt_on_sigterm) raises KeyboardInterrupt(15): prepare
    says how to resume and exits 143; Ctrl-C's KeyboardInterrupt exits 130."""

    def killed(signum):
        def opener(*a, **k):
            raise KeyboardInterrupt(signum) if signum else KeyboardInterrupt

        return opener

    src = _stanford_en_vi(tmp_path / "src")
    for signum, status in ((15, 143), (None, 130)):
        monkeypatch.setattr(corpora, "_opener", killed(signum))
        assert (
            corpora.prepare_main(["en-vi", "--dir", str(tmp_path / "out"), "--url", str(src)])
            == status
        )
        assert "interrupted; run the same command again to resume" in capsys.readouterr().err
