"""The checkpoint folder of a run: one folder per training identity, complete checkpoints only, nothing lost.

Layout of ``results/{run}/checkpoints/``::

    <key>/                    one folder per training identity (key: :func:`identity_key`, 16 hex digits)
        identity.json         the identity (canonical JSON text)
        last_used             when a job last trained (or reused) this identity: the order for keeping old ones
        ep0-ba40-rank0.pt     a full checkpoint (one file, written by rank 0; small single-device runs)
        ep0-ba40-rank0.pt.complete
        ep0-ba80/             a sharded checkpoint (FSDP, PyTorch distributed checkpoint: .metadata and one
        ep0-ba80.complete       __<rank>_0.distcp file per rank); the marker sits beside the folder
        result.json           the train.json record of the finished training
        train_log.jsonl       the loss log (one line per logged batch, each batch once)
        damaged/              checkpoints that could not be read, moved aside (never deleted)

A checkpoint counts only once its ``.complete`` marker exists: the marker is written after every rank's save
returned (composer's save ends with a barrier), so a save interrupted by a kill is never resumed from. Nothing here
relies on symlinks (shared drives such as CIFS refuse them).

Retention: ``train.checkpoints_to_keep`` counts the complete checkpoints of the identity, whichever job saved
them; the newest is never removed. Folders of earlier identities are kept (``train.earlier_identities_to_keep``,
the most recently used first) and pruned only once the current identity has a complete checkpoint of its own, so a
changed run that fails or is killed early never costs the finished work of the settings before it.

This module imports torch only inside the functions that read checkpoint contents.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import time

from llmpipe.atomic import atomic_write_bytes, atomic_write_json, read_json
from llmpipe.config.identity import identity_text, parse_identity, same_identity

log = logging.getLogger("llmpipe.train.checkpoints")

#: A checkpoint's name: ``ep<epoch>-ba<batch>-rank0.pt`` (full) or ``ep<epoch>-ba<batch>`` (a sharded folder).
CKPT_RE = re.compile(r"ep(\d+)-ba(\d+)(-rank0\.pt)?$")
MARKER = ".complete"
DAMAGED = "damaged"


# ------------------------------------------------------------------------------------------- layout

def identity_key(identity: str) -> str:
    """The folder name of a training identity: the first 16 hex digits of the SHA-256 of its canonical text
    (:func:`llmpipe.config.identity.identity_text` of the parsed identity, so every text form of one identity, including
    the legacy form with nested JSON strings, has one key)."""
    canonical = identity_text(parse_identity(identity))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def identity_folder(checkpoints_dir: str, identity: str) -> str:
    """``<checkpoints_dir>/<identity_key(identity)>``: where the checkpoints of this identity live."""
    return os.path.join(checkpoints_dir, identity_key(identity))


def adopt_flat_layout(checkpoints_dir: str) -> str | None:
    """Move the checkpoints of the earlier flat layout (files directly in ``checkpoints_dir`` with an
    ``identity.json`` beside them, the loss log in the run folder) into their identity's folder and point the
    paths of its ``result.json`` there; return that folder, or None when there was nothing to move. Nothing is
    deleted."""
    ident_path = os.path.join(checkpoints_dir, "identity.json")
    if not os.path.isfile(ident_path):
        return None
    with open(ident_path) as fh:
        identity = fh.read()
    dest = identity_folder(checkpoints_dir, identity)
    os.makedirs(dest, exist_ok=True)
    for path in sorted(os.listdir(checkpoints_dir)):
        src = os.path.join(checkpoints_dir, path)
        if src == dest or (os.path.isdir(src) and re.fullmatch(r"[0-9a-f]{16}", path)):
            continue
        os.replace(src, os.path.join(dest, path))
    old_log = os.path.join(os.path.dirname(os.path.abspath(checkpoints_dir)), "train_log.jsonl")
    if os.path.exists(old_log):
        os.replace(old_log, os.path.join(dest, "train_log.jsonl"))
    rec = read_json(os.path.join(dest, "result.json"))
    if rec is not None:
        key = os.path.basename(dest)
        for field in ("final_checkpoint", "resumed_from", "train_log"):
            old = rec.get(field)
            if not old or os.path.basename(os.path.dirname(old)) == key:
                continue
            # same form (relative or absolute) as before; the loss log sat beside checkpoints/
            base = os.path.join(os.path.dirname(old), "checkpoints") if field == "train_log" else os.path.dirname(old)
            rec[field] = os.path.join(base, key, os.path.basename(old))
        write_result(dest, rec)
    log.info("moved the checkpoints of %s into %s (one folder per training identity)", checkpoints_dir, dest)
    return dest


def prepare_identity_folder(checkpoints_dir: str, identity: str) -> str:
    """Create (or reuse) the folder of ``identity`` under ``checkpoints_dir`` and return it.

    Writes ``identity.json`` (in the form given) and ``last_used``; removes what a killed save left behind (a
    checkpoint without its ``.complete`` marker, or a marker without its checkpoint). Other identities' folders are
    not touched (:func:`prune_earlier_identities` does that, once this identity has a complete checkpoint).
    """
    os.makedirs(checkpoints_dir, exist_ok=True)
    adopt_flat_layout(checkpoints_dir)
    folder = identity_folder(checkpoints_dir, identity)
    os.makedirs(folder, exist_ok=True)
    ident_path = os.path.join(folder, "identity.json")
    if os.path.exists(ident_path):
        with open(ident_path) as fh:
            old = fh.read()
        if not same_identity(old, identity):  # a key collision: 64 bits, never expected
            raise RuntimeError(f"{folder} holds checkpoints of another identity; move it away and rerun")
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if CKPT_RE.search(name) and not os.path.exists(path + MARKER):
            _remove(path)
        elif name.endswith(MARKER) and not os.path.exists(path[: -len(MARKER)]):
            os.remove(path)
    atomic_write_bytes(ident_path, identity.encode())
    touch_last_used(folder)
    return folder


def touch_last_used(folder: str) -> None:
    """Record now (Unix seconds) as the time ``folder`` (an identity folder, or a kept result of
    :mod:`llmpipe.steps.kept_results`) was last used: the order retention keeps (:func:`last_used`)."""
    atomic_write_bytes(os.path.join(folder, "last_used"), f"{time.time():.6f}\n".encode())


def last_used(folder: str) -> float:
    """When ``folder`` was last used (:func:`touch_last_used`; its modification time when it has no record)."""
    try:
        with open(os.path.join(folder, "last_used")) as fh:
            return float(fh.read().strip())
    except (OSError, ValueError):
        return os.path.getmtime(folder)


def holds_identity(folder: str, identity: str) -> bool:
    """Whether ``folder``'s ``identity.json`` is ``identity`` (:func:`llmpipe.config.identity.same_identity`); False when it
    has none."""
    try:
        with open(os.path.join(folder, "identity.json")) as fh:
            return same_identity(fh.read(), identity)
    except OSError:
        return False


# ------------------------------------------------------------------------------------------- listing

def checkpoint_batch(path: str) -> int | None:
    """The batch number in a checkpoint's name (``ep0-ba40-rank0.pt`` or ``ep0-ba40``), or None."""
    m = CKPT_RE.search(os.path.basename(path.rstrip(os.sep)))
    return int(m.group(2)) if m else None


def is_sharded(path: str) -> bool:
    """True for a sharded (distributed) checkpoint: a folder; False for a full checkpoint file."""
    return os.path.isdir(path)


def complete_checkpoints(folder: str) -> list[tuple[int, str]]:
    """The checkpoints in ``folder`` whose ``.complete`` marker exists, as ``(batch, path)`` sorted by batch."""
    found = []
    for path in glob.glob(os.path.join(folder, "ep*-ba*")):
        batch = checkpoint_batch(path)
        if batch is not None and os.path.exists(path + MARKER):
            found.append((batch, path))
    return sorted(found)


def newest_checkpoint(folder: str) -> str | None:
    """Path of the newest complete checkpoint in ``folder`` (by batch number), or None."""
    ckpts = complete_checkpoints(folder)
    return ckpts[-1][1] if ckpts else None


def checkpoint_bytes(path: str) -> int:
    """Size on disk of a checkpoint in bytes (a sharded one: all its files)."""
    if not is_sharded(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def mark_complete(path: str, batch: int) -> None:
    """Write ``path``'s ``.complete`` marker (after every rank's save returned)."""
    atomic_write_bytes(path + MARKER, str(int(batch)).encode())


# ------------------------------------------------------------------------------------------- damage

def checkpoint_problem(path: str, deep: bool = True) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded, or None when it reads.

    A full checkpoint (torch's zip format) must open as a zip file and, with ``deep``, pass the CRC check of every
    member and unpickle (memory-mapped, so no tensor is read into memory): that reads the whole file (full
    checkpoints are written by small single-device runs). A sharded one must have a readable ``.metadata`` whose
    every stored item lies inside a file of the folder (only the metadata and file sizes are read).
    """
    try:
        if is_sharded(path):
            return _sharded_problem(path)
        import zipfile
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip() if deep else None
        if bad is not None:
            return f"member {bad} fails its CRC check"
        if not deep:
            return None
        import torch
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        if not isinstance(state, dict) or "state" not in state:
            return "not a composer checkpoint (no 'state')"
    except Exception as exc:  # noqa: BLE001 - any failure to read is the answer
        return f"{type(exc).__name__}: {exc}"
    return None


def _sharded_problem(path: str) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(path).read_metadata()
    sizes: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        rel = info.relative_path
        if rel not in sizes:
            full = os.path.join(path, rel)
            if not os.path.exists(full):
                return f"shard file {rel} is missing"
            sizes[rel] = os.path.getsize(full)
        if info.offset + info.length > sizes[rel]:
            return f"shard file {rel} is truncated ({sizes[rel]} bytes, an item ends at {info.offset + info.length})"
    return None


def move_aside(path: str, folder: str, reason: str) -> str:
    """Move a damaged checkpoint (and its marker) into ``folder/damaged/``; return where it went. Never deletes."""
    dest_dir = os.path.join(folder, DAMAGED)
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, os.path.basename(path.rstrip(os.sep)))
    if os.path.exists(dest):
        dest = f"{dest}.{int(time.time())}"
    os.replace(path, dest)
    if os.path.exists(path + MARKER):
        os.replace(path + MARKER, dest + MARKER)
    log.warning("checkpoint %s cannot be loaded (%s): moved to %s", path, reason, dest)
    print(f"llmpipe: checkpoint {path} cannot be loaded ({reason}); moved to {dest}", flush=True)
    return dest


def loadable_checkpoint(folder: str) -> str | None:
    """The newest complete checkpoint of ``folder`` that reads (:func:`checkpoint_problem`), or None when the
    folder has none. Damaged ones are moved aside (:func:`move_aside`) on the way and named in the log.

    Raises:
        RuntimeError: every complete checkpoint was damaged; the message lists what was moved where (a rerun then
            trains from scratch).
    """
    moved = []
    for _, path in reversed(complete_checkpoints(folder)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        moved.append(f"{path} ({problem}) -> {move_aside(path, folder, problem)}")
    if moved:
        raise RuntimeError("no complete checkpoint of this training can be loaded; moved aside: " + "; ".join(moved)
                           + ". Rerun to train from scratch, or put a good checkpoint back with its .complete marker.")
    return None


def resume_mismatch(resume: str, what: str) -> str:
    """The error for a full (unsharded) checkpoint that a training under FSDP cannot resume from."""
    return (f"{what}: the newest checkpoint {resume} is a full checkpoint saved on 1 device without FSDP; this "
            f"training would run under FSDP (more than one device, or train.fsdp_min_params). Resume it on "
            f"1 device (resources: nodes 1, one task) or move the checkpoint folder "
            f"{os.path.dirname(resume)} away to train from scratch.")


# ------------------------------------------------------------------------------------------- retention

def prune_checkpoints(folder: str, keep: int) -> list[str]:
    """Remove the oldest complete checkpoints of ``folder`` beyond the newest ``keep`` (any job's saves count);
    the newest is always kept. ``keep`` <= 0 keeps all. Returns the removed paths."""
    ckpts = complete_checkpoints(folder)
    if keep <= 0 or len(ckpts) <= keep:
        return []
    removed = []
    for _, path in ckpts[: len(ckpts) - max(keep, 1)]:
        os.remove(path + MARKER)  # first the marker: a half-removed checkpoint is never taken as complete
        _remove(path)
        removed.append(path)
    return removed


def prune_earlier_identities(checkpoints_dir: str, current: str, keep: int) -> list[str]:
    """Remove identity folders of ``checkpoints_dir`` other than ``current`` (a folder) beyond the ``keep``
    most recently used; only call it once ``current`` holds a complete checkpoint. Returns the removed folders."""
    others = []
    for path in glob.glob(os.path.join(checkpoints_dir, "*", "identity.json")):
        folder = os.path.dirname(path)
        if os.path.abspath(folder) != os.path.abspath(current):
            others.append((last_used(folder), folder))
    others.sort(reverse=True)
    removed = [folder for _, folder in others[max(keep, 0):]]
    for folder in removed:
        log.info("removing %s: checkpoints of settings older than the %d kept", folder, keep)
        print(f"llmpipe: removing {folder} (train.earlier_identities_to_keep is {keep})", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    return removed


# ------------------------------------------------------------------------------------------- results and loss log

def cut_loss_log(path: str, batch: int) -> None:
    """Keep only the lines of the loss log ``path`` up to ``batch`` (the checkpoint a job resumes from), so
    batches an interrupted job logged after its last checkpoint are not counted twice; batch 0 removes the log."""
    if not os.path.exists(path):
        return
    if batch <= 0:
        os.remove(path)
        return
    with open(path) as fh:
        keep = [line for line in fh if line.strip() and json.loads(line).get("batch", 0) <= batch]
    atomic_write_bytes(path, "".join(keep).encode())


def write_result(folder: str, result: dict) -> None:
    """Write the finished training's train.json record as ``folder/result.json`` (atomically)."""
    atomic_write_json(os.path.join(folder, "result.json"), result)


#: The train.json fields that only the job which trained the final batches measures: a record recovered from a final
#: checkpoint (:func:`recovered_result`) holds them as null.
JOB_MEASURED_FIELDS = ("wall_clock_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "peak_flops_per_device",
                       "peak_memory_per_device_gib", "peak_host_rss_gib", "device", "steady_tokens_per_s",
                       "steady_tokens_per_s_per_device", "steady_mfu", "steady_window", "resumed_from",
                       "checkpoint_save_s", "activation_checkpointing")

#: The ``recovered`` field of a record written by :func:`recovered_result` (docs/outputs.md).
RECOVERED_NOTE = ("written from the final checkpoint and the loss log: the job that trained the last batches ended "
                  "before writing its record, so the figures only that job measured are null")


def recovered_result(save_folder: str, final: str, known: dict, relative_to: str | None = None) -> dict:
    """The train.json record of a training whose final checkpoint ``final`` is complete but whose job ended before
    writing ``result.json`` (the time limit came during the final save or the record's write; or an earlier version
    saved a checkpoint at the final batch on Slurm's end-of-allocation signal and requeued the finished job).

    Built without starting composer, from what the folder holds: ``steps`` is the checkpoint's batch; ``tokens`` and
    ``final_train_loss`` come from the loss log's line of that batch (null when it has none), ``first_train_loss``
    from its line of batch 1; ``checkpoint_size_bytes`` and ``fsdp`` (sharded or not) from the checkpoint. The fields
    of :data:`JOB_MEASURED_FIELDS` are null, ``batches_this_job`` is 0 and ``recovered`` says why
    (:data:`RECOVERED_NOTE`).

    Args:
        save_folder: the identity's checkpoint folder; ``final``: its complete final checkpoint.
        known: fields the caller knows without the job (run, nodes, devices, global batch, ...); they win over the
            nulls above, never over the fields read from the folder.
        relative_to: write the paths relative to this folder when they lie inside it (as the job does).
    """
    log_path = os.path.join(save_folder, "train_log.jsonl")
    batch = checkpoint_batch(final) or 0
    rows = []
    if os.path.exists(log_path):
        with open(log_path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    at = {int(r.get("batch", -1)): r for r in rows}

    def path(p: str | None) -> str | None:
        if p and relative_to and os.path.abspath(p).startswith(os.path.abspath(relative_to).rstrip(os.sep) + os.sep):
            return os.path.relpath(os.path.abspath(p), relative_to)
        return p

    rec = {**{k: None for k in JOB_MEASURED_FIELDS}, **known}
    rec.update({
        "steps": batch,
        "tokens": at[batch].get("tokens") if batch in at else None,
        "first_train_loss": at[1].get("loss") if 1 in at else None,
        "final_train_loss": at[batch].get("loss") if batch in at else None,
        "batches_this_job": 0,
        "final_checkpoint": path(final),
        "checkpoint_size_bytes": checkpoint_bytes(final),
        "train_log": path(log_path) if rows else None,
        "fsdp": is_sharded(final),
        "recovered": RECOVERED_NOTE,
    })
    return rec


def finished_result(save_folder: str, newest: str | None, max_batches: int, recover: dict | None = None,
                    relative_to: str | None = None) -> dict | None:
    """The train.json record of the training in ``save_folder`` when ``newest`` (the newest complete checkpoint) is
    the final step (batch ``max_batches`` or later) and reads; else None.

    The record is ``result.json`` when it names ``newest`` as its final checkpoint. Without such a record, and with
    ``recover`` given (the fields known without the job, :func:`recovered_result`), the record is rebuilt from the
    checkpoint and the loss log and written as ``result.json``: a final checkpoint is a finished training, never
    one to resume (composer refuses to train past its duration).

    A training whose record this returns is finished: a rerun (forced, or after its train.json was lost or its
    identity text changed form) returns the record instead of training again."""
    if newest is None or (checkpoint_batch(newest) or 0) < max_batches:
        return None
    if checkpoint_problem(newest, deep=False) is not None:
        return None  # a damaged final checkpoint: the training job moves it aside and resumes from an older one
    rec = read_json(os.path.join(save_folder, "result.json"))
    if rec is not None and os.path.basename((rec.get("final_checkpoint") or "").rstrip(os.sep)) == os.path.basename(newest):
        return rec
    if recover is None:
        return None
    rec = recovered_result(save_folder, newest, recover, relative_to)
    log.info("%s has no record of its final checkpoint %s: recovered one", save_folder, newest)
    write_result(save_folder, rec)
    return rec


def recorded_result(checkpoints_dir: str, identity: str, max_batches: int, recover: dict | None = None,
                    relative_to: str | None = None) -> dict | None:
    """The train.json record of a finished training of ``identity`` under ``checkpoints_dir``, or None.

    Finished: the identity's folder (:func:`identity_folder`; a folder of the earlier flat
    layout is adopted first) holds the same identity and :func:`finished_result` returns the record for its newest
    complete checkpoint. Light enough for the submitting machine, so a rerun of a finished training, or going back
    to earlier settings, needs no job (:mod:`llmpipe.steps.training`). ``recover`` and ``relative_to``: as for
    :func:`finished_result` (a final checkpoint without its record gets one, still without a job).
    """
    if os.path.isdir(checkpoints_dir):
        adopt_flat_layout(checkpoints_dir)
    folder = identity_folder(checkpoints_dir, identity)
    if not holds_identity(folder, identity):
        return None
    return finished_result(folder, newest_checkpoint(folder), max_batches, recover, relative_to)


# ------------------------------------------------------------------------------------------- weights only

def model_weight_names(path: str, prefix: str = "state.model.") -> dict[str, tuple[tuple[int, ...], str]]:
    """The model tensors of a checkpoint as ``{name: (shape, dtype name)}``, names without ``prefix`` (composer's
    ``state.model.``). A sharded checkpoint is read from its ``.metadata`` only; a full one is memory-mapped."""
    if is_sharded(path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        meta = FileSystemReader(path).read_metadata()
        return {k[len(prefix):]: (tuple(v.size), str(v.properties.dtype).replace("torch.", ""))
                for k, v in meta.state_dict_metadata.items()
                if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    return {k: (tuple(t.shape), str(t.dtype).replace("torch.", "")) for k, t in _full_model_state(path).items()}


def load_objects(path: str, prefix: str) -> dict:
    """The non-tensor entries under ``prefix`` (e.g. ``state.integrations``) of a sharded checkpoint, as the nested
    dict composer saved (the distributed checkpoint stores each as pickled bytes under a flattened key; its
    metadata's ``planner_data`` maps each key back to its path). No process group is needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata()
    flat = {k: None for k, v in meta.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, BytesStorageMetadata)}
    if flat:
        # unflattened, so the loaded objects land in ``flat`` itself
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        dcp.load(flat, storage_reader=reader, planner=planner, no_dist=True)
    nested: dict = {}
    for key, value in flat.items():
        node = nested
        obj_path = (meta.planner_data or {}).get(key) or tuple(key.split("."))
        for part in obj_path[:-1]:
            node = node.setdefault(part, {})
        node[obj_path[-1]] = value
    return nested


def load_model_weights(path: str, dtype, prefix: str = "state.model.", names: list[str] | None = None,
                       strip_wrapper: bool = True) -> dict:
    """Load the model weights of a composer checkpoint (full or sharded) as ``{name: tensor}`` in ``dtype``.

    No optimizer state is read and no process group is needed. A sharded checkpoint is read one tensor at a time
    (PyTorch distributed checkpoint's ``load`` without a process group) and each tensor is cast to ``dtype`` before
    the next is read, so the peak host memory is one ``dtype`` copy of the weights plus the largest tensor in its
    stored dtype. Names drop ``prefix`` and composer's ``model.`` wrapper prefix.

    Args:
        path: a full checkpoint file or a sharded checkpoint folder.
        dtype: a torch dtype (e.g. ``torch.bfloat16``).
        names: load only these (names as returned); None loads every model tensor.
        strip_wrapper: drop composer's ``model.`` prefix (False keeps the names as the checkpoint has them).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    import torch
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist; rerun training (snakemake --forcerun train ...)")
    out = {}
    if not is_sharded(path):
        for k, t in _full_model_state(path).items():
            if names is None or k in names:
                out[_strip_wrapper(k) if strip_wrapper else k] = t.to(dtype).clone()
        return out
    import torch.distributed.checkpoint as dcp
    for name, (shape, stored) in model_weight_names(path, prefix).items():
        if names is not None and name not in names:
            continue
        buf = torch.empty(shape, dtype=getattr(torch, stored))
        sd = {prefix + name: buf}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        out[_strip_wrapper(name) if strip_wrapper else name] = buf.to(dtype)
        del buf, sd
    return out


def _full_model_state(path: str) -> dict:
    import torch
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return state["state"]["model"]


def _strip_wrapper(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


# ------------------------------------------------------------------------------------------- small helpers

def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


__all__ = ["identity_key", "identity_folder", "adopt_flat_layout", "prepare_identity_folder", "touch_last_used",
           "checkpoint_batch", "is_sharded", "complete_checkpoints", "newest_checkpoint", "checkpoint_bytes",
           "mark_complete", "checkpoint_problem", "move_aside", "loadable_checkpoint", "resume_mismatch",
           "prune_checkpoints", "prune_earlier_identities", "model_weight_names", "load_model_weights", "load_objects",
           "cut_loss_log", "write_result", "recovered_result", "finished_result", "recorded_result", "MARKER",
           "JOB_MEASURED_FIELDS", "RECOVERED_NOTE"]
