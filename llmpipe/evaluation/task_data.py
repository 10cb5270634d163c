"""Standard ICL task files: fetched once from a pinned public location, or copied from a local mirror.

llm-foundry's task lists name their data as ``eval/local_data/<category>/<file>.jsonl``, a path inside the
``scripts/`` folder of its git repository; the wheel ships none of them. :func:`fetch_task_files` puts the files a
suite needs into one folder with that same layout (``<dest>/eval/local_data/...``) and writes a manifest with each
file's size, item count and sha256, so evaluation reads local files only and never needs the network.

Sources (``eval.task_data``):

* ``github``: ``<base_url>/<revision>/scripts/<path>`` over HTTP(S) (default: raw.githubusercontent.com at the
  commit of llm-foundry's v0.22.0 release), ``retries`` attempts per file with a back-off, a partial download
  resumed with an HTTP Range request; a file already complete (its size and checksum in the previous manifest)
  is not fetched again.
* ``local``: a folder with the same layout (``<local_dir>/eval/local_data/...``, e.g. the ``scripts`` folder of a
  clone of llm-foundry at that commit), for clusters whose nodes are offline.

Every file is written atomically (a temporary name, then ``os.replace``): a killed step never leaves a file that
looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request

from llmpipe.atomic import atomic_write_json, read_json, sha256_file

#: llm-foundry's task-list paths of standard task data start with this (relative to its ``scripts/`` folder).
FOUNDRY_PREFIX = "eval/local_data/"
#: The commit of llm-foundry's v0.22.0 release (its ``release/v0.22.0`` branch), the version this project pins.
FOUNDRY_REVISION = "969212bd384ac6639723428b779bfc45c600e30e"
FOUNDRY_BASE_URL = "https://raw.githubusercontent.com/mosaicml/llm-foundry"


class TaskDataError(RuntimeError):
    """A task file could not be fetched, copied or read; the message names the file and the fix."""


def count_items(path: str) -> int:
    """Items of a jsonl task file: its non-blank lines, each of which must be a JSON object.

    Raises:
        TaskDataError: a line is not a JSON object (naming the file and line).
    """
    n = 0
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                ok = isinstance(json.loads(line), dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                raise TaskDataError(f"{path} line {lineno} is not a JSON object: an ICL task file holds one JSON "
                                    f"object per line. Fix: replace the file (rerun its download or rebuild it).")
            n += 1
    return n


def file_url(base_url: str, revision: str, rel: str) -> str:
    """The URL of one task file: ``<base_url>/<revision>/scripts/<rel>``."""
    return f"{base_url.rstrip('/')}/{revision}/scripts/{rel}"


def _download(url: str, out: str, *, retries: int, wait_s: float, timeout_s: float) -> None:
    """Download ``url`` to ``out`` (atomically), resuming a partial ``out + '.part'`` with a Range request.

    Raises:
        TaskDataError: 404 (not retried) or every attempt failed.
    """
    part = out + ".part"
    last: Exception | None = None
    for attempt in range(1, retries + 1):
        have = os.path.getsize(part) if os.path.exists(part) else 0
        req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                mode = "ab" if have and resp.status == 206 else "wb"  # 200: the server ignored the Range
                with open(part, mode) as fh:
                    shutil.copyfileobj(resp, fh, 1 << 20)
            os.replace(part, out)
            return
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise TaskDataError(f"{url} does not exist (404). Fix: check eval.task_data.revision and the task's "
                                    f"dataset_uri (llm-foundry's scripts/eval/local_data layout).") from exc
            if exc.code == 416 and have:  # the partial file is already whole
                os.replace(part, out)
                return
            last = exc
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            last = exc
        if attempt < retries:
            print(f"[llmpipe] eval task data: {url} failed (attempt {attempt}/{retries}: {last}); retrying",
                  flush=True)
            time.sleep(min(60.0, wait_s * 2 ** (attempt - 1)))
    raise TaskDataError(f"could not download {url} after {retries} attempt(s): {type(last).__name__}: {last}. Fix: "
                        f"check the network of the machine running Snakemake, raise eval.task_data.retries, or mirror "
                        f"the files and set eval.task_data: {{source: local, local_dir: <folder>}} (docs/evaluation.md, Evaluation: standard benchmarks).")


def fetch_task_files(files: list[str], dest: str, settings: dict, *, wait_s: float = 2.0,
                     timeout_s: float = 60.0) -> dict:
    """Put ``files`` (llm-foundry task-list paths, ``eval/local_data/...``) under ``dest``; write its manifest.

    Args:
        files: the paths, relative to llm-foundry's ``scripts/`` folder.
        dest: the output folder; each file goes to ``dest/<path>``, the manifest to ``dest/manifest.json``.
        settings: ``eval.task_data``: ``source`` (github | local), ``base_url``, ``revision``, ``local_dir``,
            ``retries``.
        wait_s: first back-off between attempts (doubles, at most 60 s).
        timeout_s: socket timeout per request.

    Returns:
        The manifest: ``{"source", "revision", "base_url" | "local_dir", "files": {path: {"bytes", "items",
        "sha256", "url" | "copied_from"}}}``.

    Raises:
        TaskDataError: a file is missing (local), cannot be downloaded, is empty or is not jsonl.
    """
    source = settings["source"]
    manifest_path = os.path.join(dest, "manifest.json")
    previous = (read_json(manifest_path) or {}).get("files", {})
    out_files = {}
    for rel in files:
        if not rel.startswith(FOUNDRY_PREFIX) or ".." in rel.split("/"):
            raise TaskDataError(f"{rel!r} is not a path under {FOUNDRY_PREFIX}; only llm-foundry's task data "
                                f"files are fetched.")
        out = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        entry: dict = {}
        if source == "local":
            src = os.path.join(settings["local_dir"], rel)
            if not os.path.isfile(src):
                raise TaskDataError(f"{src} does not exist: eval.task_data.local_dir must hold llm-foundry's layout "
                                    f"({FOUNDRY_PREFIX}<category>/<file>.jsonl, i.e. its scripts/ folder). Fix: "
                                    f"mirror the files as docs/evaluation.md shows, or set eval.task_data.source: github.")
            tmp = out + ".copy"
            shutil.copyfile(src, tmp)
            os.replace(tmp, out)
            entry["copied_from"] = os.path.abspath(src)
        else:
            url = file_url(settings.get("base_url") or FOUNDRY_BASE_URL, settings["revision"], rel)
            old = previous.get(rel)
            done = (old and os.path.isfile(out) and os.path.getsize(out) == old.get("bytes")
                    and sha256_file(out) == old.get("sha256"))
            if not done:
                _download(url, out, retries=max(1, int(settings["retries"])), wait_s=wait_s,
                          timeout_s=timeout_s)
            entry["url"] = url
        items = count_items(out)
        if items == 0:
            raise TaskDataError(f"{out} (from {rel}) has no items: a task scored on no items has no accuracy. "
                                f"Fix: check the file at its source, or drop the task from the suite.")
        out_files[rel] = {"bytes": os.path.getsize(out), "items": items, "sha256": sha256_file(out), **entry}
    manifest = {"source": source, "revision": settings.get("revision"), "files": out_files}
    if source == "local":
        manifest["local_dir"] = os.path.abspath(settings["local_dir"])
    else:
        manifest["base_url"] = settings.get("base_url") or FOUNDRY_BASE_URL
    atomic_write_json(manifest_path, manifest)
    return manifest
