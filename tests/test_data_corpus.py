"""Corpus preparation: builtin corpus, hub download (against a local HTTP server), local mirror, bad input."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import os
import threading

import pytest

from llmpipe.config.settings import ConfigError
from llmpipe.data.corpus import c4_filename, prepare_corpus, scan_file
from llmpipe.data.errors import DataError


def write_c4(root, split: str, i: int, texts: list[str], subset: str = "en") -> str:
    """Write one C4-layout file with the given document texts; return its path."""
    path = os.path.join(str(root), c4_filename(subset, split, i))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for j, t in enumerate(texts):
            fh.write(json.dumps({"text": t, "timestamp": "2019-04-25T12:57:54Z",
                                 "url": f"https://example.org/{split}/{i}/{j}"}) + "\n")
    return path


def docs(prefix: str, n: int) -> list[str]:
    return [f"{prefix} document number {j} says that the quick brown fox jumps over the lazy dog." for j in range(n)]


def make_mirror(root, train: int = 2, val: int = 1) -> None:
    for i in range(train):
        write_c4(root, "train", i, docs(f"train{i}", 5 + i))
    for i in range(val):
        write_c4(root, "validation", i, docs(f"val{i}", 3))


# ------------------------------------------------------------------------------------------------ builtin

@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    out = tmp_path_factory.mktemp("builtin")
    m = prepare_corpus({"source": "builtin", "subset": "en", "train_files": 3, "val_files": 1,
                        "key": "builtin-docs"}, str(out))
    return out, m


def test_builtin_layout_fields_and_manifest(builtin):
    out, m = builtin
    assert os.path.isfile(out / "manifest.json")
    assert json.loads((out / "manifest.json").read_text()) == m
    names = sorted(os.listdir(out / "en"))
    assert names == ["c4-train.00000-of-01024.json.gz", "c4-train.00001-of-01024.json.gz",
                     "c4-train.00002-of-01024.json.gz", "c4-validation.00000-of-00008.json.gz"]
    texts = {}
    for split in ("train", "validation"):
        texts[split] = []
        for f in m["splits"][split]:
            assert f["path"] == str(out / "en" / f["name"])
            assert f["bytes"] == os.path.getsize(f["path"])
            with gzip.open(f["path"], "rt", encoding="utf-8") as fh:
                rows = [json.loads(line) for line in fh]
            assert len(rows) == f["documents"] > 10
            for r in rows:
                assert set(r) == {"text", "timestamp", "url"}
                assert r["text"].strip() and r["url"].startswith("https://docs.python.org/")
                assert len(r["timestamp"]) == 20 and r["timestamp"].endswith("Z")
            texts[split] += [r["text"] for r in rows]
    assert m["documents"] == {s: len(texts[s]) for s in texts}
    # held-out: no validation document is also a train document
    assert not set(texts["validation"]) & set(texts["train"])
    total = sum(len(t) for s in texts.values() for t in s)
    assert 1_000_000 < total < 5_000_000, total
    val_share = sum(len(t) for t in texts["validation"]) / total
    assert 0.04 < val_share < 0.2
    # real English prose, not code
    sample = " ".join(texts["train"][:50])
    for word in (" the ", " is ", " of ", " and "):
        assert word in sample
    assert ">>>" not in sample


def test_builtin_is_deterministic(builtin, tmp_path):
    out, m = builtin
    m2 = prepare_corpus({"source": "builtin", "subset": "en", "train_files": 3, "val_files": 1}, str(tmp_path))
    for f1, f2 in zip(m["splits"]["train"] + m["splits"]["validation"],
                      m2["splits"]["train"] + m2["splits"]["validation"]):
        assert open(f1["path"], "rb").read() == open(f2["path"], "rb").read()


# ------------------------------------------------------------------------------------------------ local mirror

def test_local_mirror_points_at_mirror(tmp_path):
    mirror = tmp_path / "mirror"
    make_mirror(mirror, train=2, val=1)
    out = tmp_path / "corpus"
    m = prepare_corpus({"source": "local", "local_dir": str(mirror), "subset": "en", "train_files": 2,
                        "val_files": 1}, str(out))
    assert [f["path"] for f in m["splits"]["train"]] == [str(mirror / "en" / f"c4-train.0000{i}-of-01024.json.gz")
                                                         for i in range(2)]
    assert [f["documents"] for f in m["splits"]["train"]] == [5, 6]
    assert m["documents"] == {"train": 11, "validation": 3}
    assert os.listdir(out) == ["manifest.json"]  # nothing copied


def test_local_mirror_missing_file(tmp_path):
    mirror = tmp_path / "mirror"
    make_mirror(mirror, train=2, val=1)
    with pytest.raises(DataError) as e:
        prepare_corpus({"source": "local", "local_dir": str(mirror), "subset": "en", "train_files": 3,
                        "val_files": 1, "key": "c4"}, str(tmp_path / "out"))
    msg = str(e.value)
    assert "c4-train.00002-of-01024.json.gz" in msg and "corpora.c4.local_dir" in msg and "Fix" in msg
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_local_dir_not_set(tmp_path):
    with pytest.raises(ConfigError, match="local_dir"):
        prepare_corpus({"source": "local", "subset": "en", "train_files": 1, "val_files": 1}, str(tmp_path))


def test_truncated_gzip_names_file(tmp_path):
    mirror = tmp_path / "mirror"
    make_mirror(mirror, train=1, val=1)
    # a bigger file, cut in the middle
    p = write_c4(mirror, "train", 0, docs("long", 2000))
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2])
    with pytest.raises(DataError, match="truncated") as e:
        prepare_corpus({"source": "local", "local_dir": str(mirror), "train_files": 1, "val_files": 1},
                       str(tmp_path / "out"))
    assert p in str(e.value)


def test_not_gzip_names_file(tmp_path):
    mirror = tmp_path / "mirror"
    make_mirror(mirror, train=1, val=1)
    p = mirror / "en" / "c4-validation.00000-of-00008.json.gz"
    p.write_text("<html>429 Too Many Requests</html>")
    with pytest.raises(DataError, match="not a gzip file") as e:
        prepare_corpus({"source": "local", "local_dir": str(mirror), "train_files": 1, "val_files": 1},
                       str(tmp_path / "out"))
    assert str(p) in str(e.value)


def test_empty_corpus(tmp_path):
    mirror = tmp_path / "mirror"
    write_c4(mirror, "train", 0, ["", "   ", "\n"])
    write_c4(mirror, "validation", 0, docs("val", 2))
    with pytest.raises(DataError, match="empty"):
        prepare_corpus({"source": "local", "local_dir": str(mirror), "train_files": 1, "val_files": 1,
                        "key": "mine"}, str(tmp_path / "out"))


def test_scan_counts_multimember_and_no_trailing_newline(tmp_path):
    p = tmp_path / "x.json.gz"
    with open(p, "wb") as fh:
        fh.write(gzip.compress(b'{"text": "a"}\n{"text": "b"}\n'))
        fh.write(gzip.compress(b'{"text": "c"}'))  # a second gzip member, no final newline
    info = scan_file(str(p))
    assert info["documents"] == 3 and info["has_text"]


# ------------------------------------------------------------------------------------------------ hub

class FakeHub:
    """A local HTTP server with the hub's file layout: /datasets/{repo}/resolve/{revision}/{path}.

    huggingface_hub sends HEAD (metadata: ETag, X-Repo-Commit, size) then GET (optionally with Range) there.
    ``fail_gets[path] = n`` answers the first n GETs of a file with HTTP 500; ``cut_gets[path] = n`` sends only
    half the body of the first n GETs and closes the connection (an interrupted download).
    """

    def __init__(self, files: dict[str, bytes], repo: str = "allenai/c4", revision: str = "main",
                 repo_type: str = "dataset"):
        self.files = files
        self.prefix = f"{'/datasets' if repo_type == 'dataset' else ''}/{repo}/resolve/{revision}/"
        self.requests: list[tuple[str, str, str | None]] = []
        self.fail_gets: dict[str, int] = {}
        self.cut_gets: dict[str, int] = {}
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _common(self, head: bool):
                path = self.path.split("?")[0]
                hub.requests.append((self.command, path, self.headers.get("Range")))
                if not path.startswith(hub.prefix) or path[len(hub.prefix):] not in hub.files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("X-Error-Message", "Entry not found")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                rel = path[len(hub.prefix):]
                body = hub.files[rel]
                etag = '"' + hashlib.sha256(body).hexdigest() + '"'
                if not head and hub.fail_gets.get(rel, 0) > 0:
                    hub.fail_gets[rel] -= 1
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng and not head:
                    start = int(rng.split("=")[1].split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("ETag", etag)
                self.send_header("X-Repo-Commit", "a" * 40)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(body) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.end_headers()
                if head:
                    return
                if hub.cut_gets.get(rel, 0) > 0:
                    hub.cut_gets[rel] -= 1
                    self.wfile.write(body[start: start + (len(body) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body[start:])

            def do_HEAD(self):
                self._common(head=True)

            def do_GET(self):
                self._common(head=False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def gets(self, rel: str) -> list[str | None]:
        return [r for m, p, r in self.requests if m == "GET" and p == self.prefix + rel]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _hub_files() -> dict[str, bytes]:
    files = {}
    for i in range(3):
        files[c4_filename("en", "train", i)] = gzip.compress(
            "".join(json.dumps({"text": t, "timestamp": "t", "url": "u"}) + "\n"
                    for t in docs(f"hub{i}", 400)).encode())
    files[c4_filename("en", "validation", 0)] = gzip.compress(
        "".join(json.dumps({"text": t, "timestamp": "t", "url": "u"}) + "\n" for t in docs("hubval", 7)).encode())
    return files


@pytest.fixture
def hub(monkeypatch, tmp_path):
    h = FakeHub(_hub_files())
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    yield h
    h.close()


def _hub_cfg(**kw):
    cfg = {"source": "hub", "repo_id": "allenai/c4", "revision": "main", "subset": "en", "train_files": 2,
           "val_files": 1, "download_retries": 3, "retry_wait_s": 0.01, "key": "c4"}
    cfg.update(kw)
    return cfg


def test_hub_download_layout_and_retry(hub, tmp_path):
    rel0 = c4_filename("en", "train", 0)
    hub.fail_gets[rel0] = 1  # the first GET of train file 0 fails with HTTP 500: retried
    out = tmp_path / "c4"
    m = prepare_corpus(_hub_cfg(), str(out))
    for rel in (rel0, c4_filename("en", "train", 1), c4_filename("en", "validation", 0)):
        assert (out / rel).read_bytes() == hub.files[rel]
    assert len(hub.gets(rel0)) == 2
    assert len(hub.gets(c4_filename("en", "train", 1))) == 1
    assert c4_filename("en", "train", 2) not in [p for _, p, _ in hub.requests]  # only the first K files
    assert [f["documents"] for f in m["splits"]["train"]] == [400, 400]
    assert m["splits"]["validation"][0]["documents"] == 7
    # a second run finds the files complete and downloads nothing again
    n_before = len([r for r in hub.requests if r[0] == "GET"])
    prepare_corpus(_hub_cfg(), str(out))
    assert len([r for r in hub.requests if r[0] == "GET"]) == n_before


def test_hub_resumes_partial_download(hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    # huggingface_hub writes in 10 MiB chunks; small chunks let a small test file be cut and resumed
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 64)
    rel = c4_filename("en", "train", 0)
    hub.cut_gets[rel] = 1  # the first GET sends half the file, then the connection drops
    out = tmp_path / "c4"
    prepare_corpus(_hub_cfg(train_files=1), str(out))
    assert (out / rel).read_bytes() == hub.files[rel]
    ranges = hub.gets(rel)
    assert len(ranges) >= 2 and ranges[0] is None
    # the retry asked only for the missing part
    assert ranges[-1] is not None and int(ranges[-1].split("=")[1].split("-")[0]) > 0


def test_hub_gives_up_with_clear_error(hub, tmp_path):
    rel = c4_filename("en", "train", 0)
    hub.fail_gets[rel] = 10
    with pytest.raises(DataError) as e:
        prepare_corpus(_hub_cfg(train_files=1, download_retries=2), str(tmp_path / "c4"))
    msg = str(e.value)
    assert rel in msg and "2 attempt" in msg and "source: local" in msg
    assert len(hub.gets(rel)) == 2
    assert not (tmp_path / "c4" / "manifest.json").exists()


def test_hub_missing_file_is_not_retried(hub, tmp_path):
    with pytest.raises(DataError, match="not in the hub dataset") as e:
        prepare_corpus(_hub_cfg(train_files=4), str(tmp_path / "c4"))  # the fake hub has 3 train files
    assert "c4-train.00003-of-01024.json.gz" in str(e.value)
