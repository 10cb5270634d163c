"""Finished results kept per identity, so going back to earlier settings restores them instead of recomputing them.

Training keeps its work per identity (:mod:`llmpipe.train.checkpoints`); this module does the same for the steps after it
(rules ``convert``, ``generate``, ``eval``, ``finetune_eval``: :data:`llmpipe.steps.RULES`). When such a step
finishes, its outputs are kept under ``results/{run}/kept/<rule>/``; when the step runs again with the same
identity on the same inputs (a changed run was killed and the earlier settings came back, Snakemake deleted an
output, a forced rerun), the kept result is put back in place of the outputs, with no job and no model loaded.

Layout of ``results/{run}/kept/<rule>/``::

    <key>/              one folder per result (key: :func:`key_name`, 16 hex digits)
        key.json        what the result is of: the rule's identity, the SHA-256 of each input file that decides it,
                        the kept paths (relative to the run folder) and the size of every file
        last_used       when the result was last kept or restored (the order retention keeps)
        files/...       the outputs with their paths relative to the run folder (``files/hf/...``,
                        ``files/eval.json``): hard links to the outputs (a copy where the file system refuses them),
                        so keeping the current result costs no space

A result's key is its identity (:func:`llmpipe.config.identity.same_identity` compares them) together with the contents
of its inputs: an identity alone leaves out the step's inputs (an export's identity does not name the training), so
a result is restored only for byte-identical inputs (``train.json`` of the same finished training is rewritten
byte for byte from its record, and a restored export's ``manifest.json`` is the kept file itself).

A folder counts only once complete: it is written under a temporary name and renamed into place after its last file
and ``key.json``. Retention (``<section>.earlier_identities_to_keep``) prunes the results of other identities beyond
the most recently used ones only after the current result is kept or restored, so a changed run that fails never
costs the finished result before it.

Outputs are only ever replaced by rename (atomic writes, convert's folder rename, Snakemake deleting them), never
written in place, so the hard links stay the kept bytes. No torch, no Snakemake: the rule scripts call this before
any job.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time

from llmpipe.atomic import atomic_write_json, read_json, sha256_file
from llmpipe.config.identity import identity_text, parse_identity, same_identity
from llmpipe.train.checkpoints import MARKER, holds_identity, identity_folder, last_used, touch_last_used

KEPT = "kept"
FILES = "files"
KEY_FILE = "key.json"
#: A temporary folder (a kept result being written, an output folder being restored) older than this (seconds) was
#: left by a killed step and is removed.
STALE_TMP_S = 3600


def store_dir(results_dir: str, run: str, rule: str) -> str:
    """``<results_dir>/<run>/kept/<rule>``: where the finished results of ``rule`` for ``run`` are kept."""
    return os.path.join(results_dir, run, KEPT, rule)


def result_key(identity: str, inputs: list[str], results_dir: str) -> dict | None:
    """What a step's result is of: ``{"identity": <parsed identity>, "inputs": [[path, sha256], ...]}``, input paths
    relative to ``results_dir`` in the order given; None when an input is not a regular file (nothing is kept or
    restored then).

    Raises:
        OSError: an input file cannot be read.
    """
    hashed = []
    for path in inputs:
        if not os.path.isfile(path):
            return None
        hashed.append([os.path.relpath(path, results_dir), sha256_file(path)])
    return {"identity": parse_identity(identity), "inputs": hashed}


def key_name(key: dict) -> str:
    """The folder name of a result key: the first 16 hex digits of the SHA-256 of its canonical text."""
    return hashlib.sha256(identity_text(key).encode()).hexdigest()[:16]


def same_key(a: dict, b: dict) -> bool:
    """Whether two result keys name the same result: the same identity (:func:`llmpipe.config.identity.same_identity`)
    and the same inputs."""
    return (a.get("inputs") == b.get("inputs")
            and same_identity(identity_text(a.get("identity")), identity_text(b.get("identity"))))


def find(store: str, key: dict) -> str | None:
    """The complete kept folder of ``key`` under ``store``, or None: its ``key.json`` names the same result and
    every file it lists is there with its recorded size."""
    folder = os.path.join(store, key_name(key))
    rec = read_json(os.path.join(folder, KEY_FILE))
    if not isinstance(rec, dict) or not same_key(rec, key) or not rec.get("paths"):
        return None
    for rel, size in (rec.get("files") or {}).items():
        path = os.path.join(folder, FILES, rel)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return None
    return folder


def keep(store: str, key: dict, paths: list[str], run_dir: str, earlier: int) -> str:
    """Keep the finished outputs ``paths`` (files, or folders kept whole) of the result ``key``; return its folder.

    The folder is written under a temporary name (hard links, a copy where they fail) and renamed into place
    complete; a folder of the same key kept before is replaced only then. Results of other keys are then pruned
    beyond the ``earlier`` most recently used (:func:`prune`).

    Args:
        paths: outputs under ``run_dir`` (``results/<run>``), every one existing.
        earlier: kept results of other keys to keep (``<section>.earlier_identities_to_keep``); 0 keeps none.

    Raises:
        OSError: a file cannot be linked or copied, or the folder cannot be written (nothing is pruned then).
    """
    os.makedirs(store, exist_ok=True)
    remove_stale(store)
    name = key_name(key)
    tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=store)
    try:
        files = {}
        for path in paths:
            for src in _files_under(path):
                rel = os.path.relpath(src, run_dir)
                dest = os.path.join(tmp, FILES, rel)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                _link_or_copy(src, dest)
                files[rel] = os.path.getsize(dest)
        rels = [os.path.relpath(p, run_dir) for p in paths]
        atomic_write_json(os.path.join(tmp, KEY_FILE), {**key, "paths": rels, "files": files})
        touch_last_used(tmp)
        final = os.path.join(store, name)
        if os.path.isdir(final):  # the same result kept before: replaced once the new folder is complete
            aside = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=store)
            os.replace(final, os.path.join(aside, name))
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(store, final, earlier)
    return final


def restore(folder: str, run_dir: str, earlier: int) -> list[str]:
    """Put the kept result ``folder`` (from :func:`find`) back in place of its outputs under ``run_dir``; return the
    restored paths. A kept folder output (an export) is linked aside, complete, and renamed over the old folder; a
    file is linked to a temporary name beside the output and renamed onto it. Then results of other keys are pruned
    beyond the ``earlier`` most recently used (:func:`prune`).

    Raises:
        OSError: a file cannot be linked or copied.
    """
    rec = read_json(os.path.join(folder, KEY_FILE)) or {}
    files = os.path.join(folder, FILES)
    out = []
    for rel in rec.get("paths") or []:
        src, dest = os.path.join(files, rel), os.path.join(run_dir, rel)
        parent = os.path.dirname(os.path.abspath(dest))
        os.makedirs(parent, exist_ok=True)
        remove_stale(parent)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", suffix=".tmp", dir=parent)
        try:
            if os.path.isdir(src):
                staged = os.path.join(tmp, os.path.basename(dest))
                for f in _files_under(src):
                    target = os.path.join(staged, os.path.relpath(f, src))
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    _link_or_copy(f, target)
                os.makedirs(staged, exist_ok=True)
                if os.path.isdir(dest):
                    shutil.rmtree(dest)
                os.replace(staged, dest)
            else:
                staged = os.path.join(tmp, "file")
                _link_or_copy(src, staged)
                os.replace(staged, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        out.append(dest)
    touch_last_used(folder)
    prune(os.path.dirname(folder), folder, earlier)
    return out


def prune(store: str, current: str, earlier: int) -> list[str]:
    """Remove the kept results of ``store`` other than ``current`` (a folder) beyond the ``earlier`` most recently
    used (``last_used``); call it only once ``current`` is complete. Returns the removed folders."""
    others = []
    for name in os.listdir(store) if os.path.isdir(store) else []:
        folder = os.path.join(store, name)
        if name.startswith(".") or os.path.abspath(folder) == os.path.abspath(current):
            continue
        if os.path.isfile(os.path.join(folder, KEY_FILE)):
            others.append((last_used(folder), folder))
    others.sort(reverse=True)
    removed = [folder for _, folder in others[max(earlier, 0):]]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def remove_stale(folder: str, older_than_s: float = STALE_TMP_S) -> None:
    """Remove the temporary folders (``.<name>.<random>.tmp``) in ``folder`` that a killed keep or restore left and
    that are older than ``older_than_s`` seconds (a younger one may be another process's, still being written)."""
    now = time.time()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(".") and name.endswith(".tmp") and os.path.isdir(path):
            try:
                if now - os.path.getmtime(path) > older_than_s:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass


def train_json_lost(results_dir: str, run: str) -> bool:
    """Whether ``results/<run>/train.json`` is missing while the run's export (``hf/manifest.json``) is there: the
    cheap test before :func:`lost_train_note`."""
    run_dir = os.path.join(results_dir, run)
    return not os.path.exists(os.path.join(run_dir, "train.json")) and os.path.isfile(
        os.path.join(run_dir, "hf", "manifest.json"))


def lost_train_note(results_dir: str, run: str, identity: str) -> str | None:
    """A note for the console when ``results/<run>/train.json`` is missing beside the run's export although the
    training of ``identity`` (the current settings) finished: its identity folder holds the same identity and a
    record whose final checkpoint is complete. None otherwise.

    A changed run killed with Snakemake after Snakemake deleted train.json leaves this behind once the settings
    come back: the outputs after training are up to date, so Snakemake plans nothing for them (``eval.json``) and
    train.json stays missing. Asking for it restores it from the record without a job, and the steps after it
    restore their kept results. Reads a few small files only (no torch).
    """
    folder = identity_folder(os.path.join(results_dir, run, "checkpoints"), identity)
    if not holds_identity(folder, identity):
        return None
    final = (read_json(os.path.join(folder, "result.json")) or {}).get("final_checkpoint")
    if not final or not os.path.exists(final) or not os.path.exists(final + MARKER):
        return None
    target = os.path.join(results_dir, run, "train.json")
    return (f"llmpipe: {target} is missing although its training under these settings finished ({folder}); the "
            f"results after it are up to date, so Snakemake plans nothing for them. Restore it without a job: "
            f"snakemake {target}")




def _files_under(path: str) -> list[str]:
    """``path`` itself when a file, else every file below the folder ``path`` (sorted)."""
    if not os.path.isdir(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)


def _link_or_copy(src: str, dest: str) -> None:
    try:
        os.link(src, dest)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dest)


__all__ = ["store_dir", "result_key", "key_name", "same_key", "find", "keep", "restore", "prune", "remove_stale",
           "train_json_lost", "lost_train_note", "KEPT"]
