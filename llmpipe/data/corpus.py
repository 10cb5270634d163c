"""Corpora in C4's file layout: download from the hub, read a local mirror, or build one offline.

A prepared corpus is a folder ``{out_dir}`` with

* ``{subset}/c4-train.NNNNN-of-01024.json.gz`` and ``{subset}/c4-validation.NNNNN-of-00008.json.gz``: gzip'ed
  JSON lines, one document per line with the fields ``text``, ``timestamp`` and ``url`` (C4's own names and
  fields). For ``source: local`` the files stay in the mirror and are not copied.
* ``manifest.json``, written last and atomically: which files make up each split (absolute paths), their sizes
  in bytes and their document counts. Every later step reads the file list from the manifest, never by globbing.

Sources (``corpus_cfg['source']``):

* ``builtin`` – real English prose built offline from the documentation that ships with Python: the
  ``pydoc_data.topics`` reference text, the docstrings of the pure-Python standard library (read with :mod:`ast`,
  never imported) and of its compiled modules. Code, grammar rules and tables are filtered out; paragraphs are
  deduplicated and grouped into ~2.5 kB documents. Deterministic for a given Python version: about 1.5 MB of text
  on CPython 3.11 (~1,000 documents, ~370 k tokens with a 4k BPE), capped at 4 MB; the validation documents are a
  disjoint, hash-selected ~10 % of the documents.
* ``hub`` – ``huggingface_hub.hf_hub_download`` of the first ``train_files`` / ``val_files`` files of
  ``repo_id`` (``allenai/c4``) at ``revision``, with ``download_retries`` attempts per file; partial downloads
  resume (huggingface_hub keeps ``*.incomplete`` files under ``{out_dir}/.cache``). ``HF_ENDPOINT`` is honoured
  at call time.
* ``local`` – a mirror folder ``local_dir`` with the hub's layout; the manifest points at the mirror's files.

Every file is read through once (streaming gzip, in parallel threads) to count its documents and to prove it is a
complete gzip stream with at least the ``text`` field: a truncated or non-gzip file fails here, naming the file.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import io
import json
import os
import re
import sys
import time
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from llmpipe.data.errors import DataError, atomic_write_bytes, atomic_write_json, remove_if_exists

#: C4's number of files per split; the file names carry it (``-of-01024``).
C4_NUM_FILES = {"train": 1024, "validation": 8}
#: Corpus split names (C4's) in the order they are listed in manifests.
SPLITS = ("train", "validation")
MANIFEST_VERSION = 1


def c4_filename(subset: str, split: str, index: int) -> str:
    """C4's relative file name, e.g. ``en/c4-train.00003-of-01024.json.gz``."""
    return f"{subset}/c4-{split}.{index:05d}-of-{C4_NUM_FILES[split]:05d}.json.gz"


def _where(corpus_cfg: dict) -> str:
    return f"corpora.{corpus_cfg['key']}" if corpus_cfg.get("key") else "the corpus"


# ------------------------------------------------------------------------------------------------- reading

def iter_documents(path: str) -> Iterator[dict]:
    """Yield the JSON documents of one C4-layout ``.json.gz`` file, one dict per non-blank line.

    Raises:
        DataError: the file is missing, not gzip, truncated / corrupt, or a line is not a JSON object with a
            ``text`` string (message: file, line number and the fix).
    """
    check_gzip_magic(path)
    lineno = 0
    try:
        with gzip.open(path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                yield _parse_line(line, path, lineno)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DataError(f"{path} is truncated or corrupt (gzip error after line {lineno}: {exc}). "
                        f"Fix: delete the file and download / copy it again.") from exc


def _parse_line(line: bytes, path: str, lineno: int) -> dict:
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{path}, line {lineno}: not valid JSON ({exc}). C4 files hold one JSON document per "
                        f"line. Fix: replace the file with a correct copy.") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
        raise DataError(f"{path}, line {lineno}: a document must be a JSON object with a string field 'text' "
                        f"(C4's fields are text, timestamp, url). Fix: convert the file to C4's format.")
    return doc


def check_gzip_magic(path: str) -> None:
    """Check that ``path`` exists, is readable and starts with gzip's magic bytes (reads 2 bytes).

    Raises:
        DataError: missing, unreadable or not gzip (names the file and the fix).
    """
    try:
        with open(path, "rb") as fh:
            magic = fh.read(2)
    except FileNotFoundError as exc:
        raise DataError(f"{path} does not exist. Fix: prepare the corpus again (delete its manifest.json).") from exc
    except PermissionError as exc:
        raise DataError(f"{path} is not readable ({exc}). Fix: check the file's permissions.") from exc
    if magic != b"\x1f\x8b":
        raise DataError(f"{path} is not a gzip file (it starts with {magic!r}, not 1f 8b). C4 files are gzip'ed "
                        f"JSON lines. Fix: replace it with the real .json.gz file (a failed download can leave "
                        f"an HTML error page).")


def scan_file(path: str) -> dict:
    """Read one ``.json.gz`` file through: its size, document count, and whether it has any non-empty text.

    Decompresses in 1 MiB chunks (zlib releases the GIL, so several files scan in parallel threads) and counts
    lines; JSON is parsed only until the first document with non-blank ``text`` is found.

    Returns:
        ``{"path", "bytes", "documents", "has_text"}``.

    Raises:
        DataError: not gzip, truncated, corrupt, or a parsed line is not a C4 document (names the file).
    """
    check_gzip_magic(path)
    size = os.path.getsize(path)
    docs = 0
    has_text = False
    partial = b""
    lineno = 0
    last = b"\n"
    fed = False
    d = zlib.decompressobj(wbits=31)
    try:
        with open(path, "rb") as fh:
            while True:
                chunk = fh.read(1 << 20)
                if not chunk:
                    break
                if d.eof:  # a new gzip member starts in this chunk
                    d = zlib.decompressobj(wbits=31)
                fed = True
                data = d.decompress(chunk)
                while d.eof and d.unused_data:
                    rest = d.unused_data
                    d = zlib.decompressobj(wbits=31)
                    data += d.decompress(rest)
                if not data:
                    continue
                docs += data.count(b"\n")
                last = data[-1:]
                if not has_text:
                    partial += data
                    lines = partial.split(b"\n")
                    partial = lines.pop()
                    for line in lines:
                        lineno += 1
                        if line.strip() and _parse_line(line, path, lineno)["text"].strip():
                            has_text = True
                            partial = b""
                            break
    except zlib.error as exc:
        raise DataError(f"{path} is corrupt (zlib: {exc}). Fix: delete it and download / copy it again.") from exc
    if fed and not d.eof:
        raise DataError(f"{path} is truncated: the gzip stream ends before its end marker (an interrupted "
                        f"download or copy). Fix: delete the file and download / copy it again.")
    if last != b"\n":
        docs += 1
    if not has_text and partial.strip():
        lineno += 1
        has_text = bool(_parse_line(partial, path, lineno)["text"].strip())
    return {"path": os.path.abspath(path), "bytes": size, "documents": docs, "has_text": has_text}


def scan_all(paths: dict[str, list[str]], threads: int = 8) -> dict[str, list[dict]]:
    """Scan every file of ``paths`` (split -> json.gz paths) in ``threads`` threads: split -> one
    :func:`scan_file` record per file (document count, bytes, ...) plus its base ``name``, in input order."""
    flat = [(split, p) for split in SPLITS for p in paths.get(split, [])]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(flat)))) as pool:
        infos = list(pool.map(lambda sp: scan_file(sp[1]), flat))
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for (split, path), info in zip(flat, infos):
        info["name"] = os.path.basename(path)
        out[split].append(info)
    return out


def _write_manifest(corpus_cfg: dict, out_dir: str, files: dict[str, list[dict]], extra: dict) -> dict:
    where = _where(corpus_cfg)
    for split in SPLITS:
        if not files[split]:
            raise DataError(f"{where}: the {split} split has no files. Fix: set "
                            f"{'train_files' if split == 'train' else 'val_files'} >= 1.")
        if not any(f["has_text"] for f in files[split]):
            raise DataError(f"{where}: the {split} split is empty: no document in "
                            f"{', '.join(f['path'] for f in files[split])} has any non-blank text. "
                            f"Fix: point the corpus at real data (check local_dir / the downloaded files).")
    manifest = {
        "version": MANIFEST_VERSION,
        "source": corpus_cfg.get("source"),
        "key": corpus_cfg.get("key"),
        "subset": corpus_cfg.get("subset", "en"),
        "root": os.path.abspath(out_dir),
        "splits": {s: [{k: f[k] for k in ("name", "path", "bytes", "documents")} for f in files[s]]
                   for s in SPLITS},
        "documents": {s: sum(f["documents"] for f in files[s]) for s in SPLITS},
        "bytes": {s: sum(f["bytes"] for f in files[s]) for s in SPLITS},
        **extra,
    }
    atomic_write_json(os.path.join(out_dir, "manifest.json"), manifest)
    return manifest


def load_manifest(path: str) -> dict:
    """Read a corpus ``manifest.json`` (the file, or the corpus folder holding it).

    Raises:
        DataError: the manifest is missing or not a corpus manifest.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "manifest.json")
    try:
        with open(path) as fh:
            m = json.load(fh)
    except FileNotFoundError as exc:
        raise DataError(f"corpus manifest {path} does not exist. Fix: run the corpus step first "
                        f"(prepare_corpus).") from exc
    if "splits" not in m or "train" not in m["splits"]:
        raise DataError(f"{path} is not a corpus manifest (no splits.train). Fix: prepare the corpus again.")
    return m


# ------------------------------------------------------------------------------------------------- entry

def prepare_corpus(corpus_cfg: dict, out_dir: str) -> dict:
    """Make a corpus available in C4's layout and write ``{out_dir}/manifest.json`` (last, atomically).

    Args:
        corpus_cfg: one entry of ``corpora:`` in the config: ``source`` (builtin | hub | local), ``subset``,
            ``train_files``, ``val_files``; for hub ``repo_id``, ``revision``, ``download_retries`` (attempts
            per file, default 5), optionally ``download_workers`` (files downloaded at once, default 4),
            ``retry_wait_s`` (first back-off, default 2 s) and ``endpoint``
            (default: ``$HF_ENDPOINT`` or the public hub); for local ``local_dir``. An optional ``key`` (the
            corpus' key in ``corpora:``) makes error messages name the setting.
        out_dir: the corpus folder (created).

    Returns:
        The manifest: ``{"version", "source", "key", "subset", "root", "splits": {"train": [file, ...],
        "validation": [...]}, "documents": {split: n}, "bytes": {split: n}, ...}`` where each file is
        ``{"name", "path" (absolute), "bytes", "documents"}``.

    Raises:
        DataError: a file is missing, unreadable, truncated or not gzip; the corpus has no non-blank text; a
            download failed after all retries. Messages name the file / setting and the fix.
        llmpipe.config.settings.ConfigError: an unknown source or a missing required setting.
    """
    from llmpipe.config.settings import ConfigError  # the class llmpipe.config.runs re-exports (no import cycle)

    os.makedirs(out_dir, exist_ok=True)
    remove_if_exists(os.path.join(out_dir, "manifest.json"))
    src = corpus_cfg.get("source")
    where = _where(corpus_cfg)
    for key in ("train_files", "val_files"):
        if int(corpus_cfg.get(key, 0) or 0) < 1:
            raise ConfigError(f"{where}.{key} must be at least 1, got {corpus_cfg.get(key)!r}.")
    if src == "builtin":
        return _prepare_builtin(corpus_cfg, out_dir)
    if src == "hub":
        return _prepare_hub(corpus_cfg, out_dir)
    if src == "local":
        return _prepare_local(corpus_cfg, out_dir)
    raise ConfigError(f"{where}.source is {src!r}; it must be builtin, hub or local.")


def _wanted(corpus_cfg: dict) -> dict[str, list[str]]:
    """Relative C4 file names wanted per split (the first K of each)."""
    from llmpipe.config.settings import ConfigError  # the class llmpipe.config.runs re-exports (no import cycle)

    subset = corpus_cfg.get("subset", "en")
    out = {}
    for split, key in (("train", "train_files"), ("validation", "val_files")):
        k = int(corpus_cfg[key])
        if k > C4_NUM_FILES[split]:
            raise ConfigError(f"{_where(corpus_cfg)}.{key} is {k}, but C4 has only {C4_NUM_FILES[split]} "
                              f"{split} files. Fix: set it to at most {C4_NUM_FILES[split]}.")
        out[split] = [c4_filename(subset, split, i) for i in range(k)]
    return out


# ------------------------------------------------------------------------------------------------- local

def _prepare_local(corpus_cfg: dict, out_dir: str) -> dict:
    from llmpipe.config.settings import ConfigError  # the class llmpipe.config.runs re-exports (no import cycle)

    where = _where(corpus_cfg)
    root = corpus_cfg.get("local_dir")
    if not root:
        raise ConfigError(f"{where}.local_dir is not set but source is local. Fix: set it to a folder with the "
                          f"hub's layout ({corpus_cfg.get('subset', 'en')}/c4-train.00000-of-01024.json.gz ...).")
    root = os.path.abspath(os.path.expanduser(root))
    wanted = _wanted(corpus_cfg)
    missing = []
    paths: dict[str, list[str]] = {}
    for split, rels in wanted.items():
        paths[split] = []
        for rel in rels:
            p = os.path.join(root, rel)
            if not os.path.isfile(p):
                missing.append(p)
            elif not os.access(p, os.R_OK):
                raise DataError(f"{where}: mirror file {p} is not readable. Fix: check its permissions.")
            paths[split].append(p)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise DataError(f"{where}.local_dir={root} lacks {len(missing)} file(s) the config asks for: "
                        f"{', '.join(missing[:5])}{more}. Fix: copy them into the mirror, or lower "
                        f"{where}.train_files / val_files to what the mirror has.")
    files = scan_all(paths)
    return _write_manifest(corpus_cfg, out_dir, files, {"local_dir": root})


# ------------------------------------------------------------------------------------------------- hub

def _prepare_hub(corpus_cfg: dict, out_dir: str) -> dict:
    from llmpipe.config.settings import ConfigError  # the class llmpipe.config.runs re-exports (no import cycle)

    where = _where(corpus_cfg)
    repo_id = corpus_cfg.get("repo_id")
    if not repo_id:
        raise ConfigError(f"{where}.repo_id is not set but source is hub. Fix: set it (allenai/c4).")
    revision = corpus_cfg.get("revision") or "main"
    retries = max(1, int(corpus_cfg.get("download_retries", 5) or 1))
    wait0 = float(corpus_cfg.get("retry_wait_s", 2.0))
    endpoint = corpus_cfg.get("endpoint") or os.environ.get("HF_ENDPOINT") or None
    wanted = _wanted(corpus_cfg)
    flat = [(split, rel) for split, rels in wanted.items() for rel in rels]
    total = len(flat)

    def fetch(i_item: tuple[int, tuple[str, str]]) -> str:
        i, (_split, rel) = i_item
        print(f"[llmpipe] corpus: {repo_id}@{revision}: file {i + 1}/{total}: {rel}", file=sys.stderr, flush=True)
        return download_file(repo_id, rel, revision=revision, out_dir=out_dir, retries=retries, wait_s=wait0,
                             endpoint=endpoint, where=where)

    # a few files at a time: the hub serves each file at a limited rate
    n_threads = max(1, min(int(corpus_cfg.get("download_workers", 4) or 1), total))
    with ThreadPoolExecutor(max_workers=n_threads) as pool:
        got = list(pool.map(fetch, enumerate(flat)))
    paths: dict[str, list[str]] = {s: [] for s in wanted}
    for (split, _rel), path in zip(flat, got):
        paths[split].append(path)
    files = scan_all(paths)
    return _write_manifest(corpus_cfg, out_dir, files, {"repo_id": repo_id, "revision": revision,
                                                        "endpoint": endpoint or "https://huggingface.co"})


def download_file(repo_id: str, filename: str, *, revision: str, out_dir: str, retries: int = 5,
                  wait_s: float = 2.0, endpoint: str | None = None, where: str = "the corpus") -> str:
    """Download one file of a hub *dataset* repo into ``{out_dir}/{filename}``; return its absolute path.

    Uses ``huggingface_hub.hf_hub_download(repo_type="dataset", local_dir=out_dir)``, which shows a progress bar,
    skips a file that is already complete, and resumes a partial ``.incomplete`` download. A failed attempt
    (network error, HTTP 5xx, a file that is not a complete gzip stream) is retried after ``wait_s``, doubling up
    to 60 s, up to ``retries`` attempts in all. A 404 (no such repo / file / revision) is not retried.

    Raises:
        DataError: every attempt failed, or the file does not exist on the hub (message: repo, file, endpoint,
            last error, and the fix).
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    last_exc: BaseException | None = None
    for attempt in range(1, retries + 1):
        try:
            path = hf_hub_download(repo_id=repo_id, filename=filename, repo_type="dataset", revision=revision,
                                   local_dir=out_dir, endpoint=endpoint)
            try:
                check_gzip_magic(path)
            except DataError:
                os.unlink(path)  # e.g. an HTML error page saved as the file: fetch it again
                raise
            return os.path.abspath(path)
        except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
            raise DataError(f"{where}: {filename} is not in the hub dataset {repo_id} at revision {revision} "
                            f"({type(exc).__name__}). Fix: check repo_id, subset, revision and "
                            f"train_files/val_files.") from exc
        except Exception as exc:  # noqa: BLE001 - network errors come in many types; retried, then reported
            last_exc = exc
            if attempt < retries:
                delay = min(60.0, wait_s * 2 ** (attempt - 1))
                print(f"[llmpipe] corpus: download of {filename} failed (attempt {attempt}/{retries}: "
                      f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); retrying in "
                      f"{delay:.0f} s (partial data is kept and resumed)", file=sys.stderr, flush=True)
                time.sleep(delay)
    raise DataError(f"{where}: could not download {filename} from {repo_id} ({endpoint or 'https://huggingface.co'})"
                    f" after {retries} attempt(s): {type(last_exc).__name__}: {last_exc}. Fix: check the network "
                    f"(compute nodes are often offline: download on a login node, or use source: local with a "
                    f"mirror), or raise download_retries.") from last_exc


# ------------------------------------------------------------------------------------------------- builtin

#: Share of builtin documents that go to the validation split (selected by a hash of the document's key).
BUILTIN_VAL_PERCENT = 10
#: Upper bound on the builtin corpus' text (characters); documents beyond it are left out.
BUILTIN_MAX_CHARS = 4_000_000
#: A builtin document is closed once it has this many characters (C4 documents average ~2 kB).
BUILTIN_DOC_CHARS = 2500

_CODEISH = re.compile(r"[{}\[\]=<>|\\`#@$]")
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo",
              "ensurepip", "pydoc_data"}
#: Compiled modules whose import has side effects on the terminal, or that exist only for CPython's tests.
_SKIP_CMODULES = {"readline", "_curses", "_curses_panel", "_tkinter", "antigravity", "this"}


def _clean_paragraph(par: str) -> str | None:
    """Turn one raw paragraph into a line of prose, or None when it does not look like English prose."""
    lines = par.split("\n")
    if any(ln.lstrip().startswith((">>>", "...", "$ ", "%", "+--", "|", "==", "--", "::")) for ln in lines):
        return None
    if not any(ln.strip() for ln in lines):
        return None
    text = " ".join(ln.strip() for ln in lines)
    text = re.sub(r"^[*\-] ", "", text)  # bullet
    text = re.sub(r"(?<![\w*])\*{1,2}(?=\S)([^*]+?)(?<=\S)\*{1,2}(?![\w*])", r"\1", text)  # *emphasis*
    text = re.sub(r"\s+", " ", text).strip()
    if text.endswith("::"):
        text = text[:-1]
    words = text.split(" ")
    if len(words) < 8 or len(text) < 50:
        return None
    if text[-1] not in ".!?:)\"'":
        return None
    letters = sum(c.isalpha() or c == " " for c in text)
    if letters < 0.78 * len(text):
        return None
    if len(_CODEISH.findall(text)) > 0.03 * len(text):
        return None
    if not text[0].isupper() and not text[0].isdigit() and text[0] not in "\"'(":
        return None
    return text


def _paragraphs(raw: str) -> list[str]:
    out = []
    for par in re.split(r"\n\s*\n", raw.expandtabs(8)):
        cleaned = _clean_paragraph(par)
        if cleaned:
            out.append(cleaned)
    return out


def _stdlib_docstrings() -> Iterator[tuple[str, str, list[str]]]:
    """(key, module name, paragraphs) for each standard-library source file, in sorted path order."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        for fn in sorted(filenames):
            if fn.endswith(".py") and not fn.startswith(("test_", "_test")):
                files.append(os.path.join(dirpath, fn))
    for path in sorted(files):
        rel = os.path.relpath(path, root)
        mod = rel[:-3].replace(os.sep, ".")
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        try:
            with open(path, "rb") as fh:
                tree = ast.parse(fh.read())
        except (SyntaxError, ValueError, OSError):
            continue
        pars: list[str] = []
        nodes = [tree] + [n for n in ast.walk(tree)
                          if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)
            if doc:
                pars.extend(_paragraphs(doc))
        if pars:
            yield rel, mod, pars


def _cmodule_docstrings() -> Iterator[tuple[str, str, list[str]]]:
    """(key, module name, paragraphs) for the compiled standard-library modules (``math``, ``builtins`` ...).

    Their docstrings live in C, so the module is imported (only compiled modules: no import side effects).
    """
    import importlib
    import inspect
    import sysconfig

    names = set(sys.builtin_module_names)
    dyn = os.path.join(sysconfig.get_paths()["stdlib"], "lib-dynload")
    if os.path.isdir(dyn):
        names |= {f.split(".")[0] for f in os.listdir(dyn) if f.endswith(".so")}
    for name in sorted(names):
        if name in _SKIP_CMODULES or name.startswith(("_test", "xx", "_xx", "_ctypes_test")):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated modules (audioop, nis ...) still have docs
                mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that cannot load here simply contributes nothing
            continue
        raw = [mod.__doc__ or ""]
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr, None)
            if callable(obj) or inspect.isclass(obj):
                raw.append(getattr(obj, "__doc__", "") or "")
                if inspect.isclass(obj) and getattr(obj, "__module__", "") == name:
                    for member in sorted(vars(obj)):
                        raw.append(getattr(vars(obj)[member], "__doc__", "") or "")
        pars = [p for d in raw if isinstance(d, str) for p in _paragraphs(inspect.cleandoc(d))]
        if pars:
            yield f"cmodule:{name}", name.lstrip("_"), pars


def builtin_documents(max_chars: int = BUILTIN_MAX_CHARS) -> list[dict]:
    """The builtin corpus' documents, deterministic for a Python version.

    Each is ``{"key", "text", "url"}``: paragraphs of English prose (deduplicated, code and grammar blocks
    removed) grouped per source into documents of about :data:`BUILTIN_DOC_CHARS` characters.
    """
    from pydoc_data.topics import topics

    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    def sources() -> Iterator[tuple[str, str, list[str]]]:  # lazily: stops being read at max_chars
        for name in sorted(topics):
            yield (f"topic:{name}", f"https://docs.python.org/{ver}/reference/topics.html#{name}",
                   _paragraphs(topics[name]))
        for rel, mod, pars in _stdlib_docstrings():
            yield f"module:{rel}", f"https://docs.python.org/{ver}/library/{mod}.html", pars
        for key, mod, pars in _cmodule_docstrings():
            yield key, f"https://docs.python.org/{ver}/library/{mod}.html", pars
    seen: set[str] = set()
    docs: list[dict] = []
    total = 0
    for key, url, pars in sources():
        cur: list[str] = []
        n = 0
        part = 0

        def flush() -> None:
            nonlocal cur, n, part, total
            if cur:
                text = "\n\n".join(cur)
                docs.append({"key": f"{key}#{part}", "text": text, "url": url})
                total += len(text)
                part += 1
            cur, n = [], 0

        for p in pars:
            h = p.lower()
            if h in seen:
                continue
            seen.add(h)
            cur.append(p)
            n += len(p)
            if n >= BUILTIN_DOC_CHARS:
                flush()
        flush()
        if total >= max_chars:
            break
    return docs


def _is_val(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 100 < BUILTIN_VAL_PERCENT


def _gzip_jsonl(docs: list[dict]) -> bytes:
    raw = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz:
        gz.write(raw)
    return buf.getvalue()


def _prepare_builtin(corpus_cfg: dict, out_dir: str) -> dict:
    docs = builtin_documents(int(corpus_cfg.get("max_chars", BUILTIN_MAX_CHARS)))
    if not docs:
        raise DataError(f"{_where(corpus_cfg)}: the builtin corpus is empty: no prose was found in this Python's "
                        f"documentation ({sys.executable}). Fix: use source: hub or local.")
    wanted = _wanted(corpus_cfg)
    split_docs = {"train": [d for d in docs if not _is_val(d["key"])],
                  "validation": [d for d in docs if _is_val(d["key"])]}
    # deterministic C4-style timestamps: one minute apart from a fixed start
    base = 1555545600  # 2019-04-18T00:00:00Z, within C4's crawl dates
    paths: dict[str, list[str]] = {}
    for split, rels in wanted.items():
        paths[split] = []
        k = len(rels)
        for i, rel in enumerate(rels):
            part = split_docs[split][i::k]
            rows = [{"text": d["text"],
                     "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(base + 60 * (j * k + i))),
                     "url": d["url"]} for j, d in enumerate(part)]
            p = os.path.join(out_dir, rel)
            atomic_write_bytes(p, _gzip_jsonl(rows))
            paths[split].append(p)
    files = scan_all(paths)
    return _write_manifest(corpus_cfg, out_dir, files, {
        "python": sys.version.split()[0],
        "characters": {s: sum(len(d["text"]) for d in split_docs[s]) for s in SPLITS},
    })
