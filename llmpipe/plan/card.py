"""The GPU a run's plans are for: the configured ``gpu_type``, or, with ``gpu_type: auto`` (the schema's default), the
card this machine's ``nvidia-smi`` reports.

* ``gpu_type: auto`` on the local executor asks ``nvidia-smi --query-gpu=name,memory.total --format=csv,noheader``
  once per process (no torch: the dry run must not import it). A name that :func:`card_candidates` maps to a key
  of :data:`llmpipe.plan.memory_time.GPU_MEMORY_GB` is planned with that key's datasheet memory and bf16 peak
  (``NVIDIA H100 80GB HBM3`` -> ``h100``, 80 GiB). A card the tables do not know is planned with the memory
  nvidia-smi reports, under its own name as the key, and every plan line says how to add it (``gpu_memory_gb``,
  ``gpu_peak_flops``). No nvidia-smi, or no GPU in its answer: the plans are for no card (the jobs run on the CPU).
  Several cards of different types: the one with the least memory (a job may get any of them).
* ``gpu_type: auto`` on the Slurm executor is refused: the jobs run on the partition's nodes, not on this one; the
  site file (``config/slurm-site.yaml``) sets the top-level ``gpu_type``, and the Slurm preflight checks it against
  the partition's gres type (:func:`llmpipe.dispatch.slurm.preflight`, :func:`matches`).

This module imports without torch and takes explicit arguments or the workflow config's three GPU keys
(``gpu_type``, ``gpu_memory_gb``, ``gpu_peak_flops``) and ``dispatch.executor``.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from llmpipe.config.settings import ConfigError
from llmpipe.model.mfu import peak_flops_for_name

__all__ = ["AUTO", "NVIDIA_SMI_QUERY", "Card", "card_candidates", "check_partition_card", "card_for_device",
           "clear_cache", "config_card", "detect", "matches", "parse_nvidia_smi", "resolve"]

#: The ``gpu_type`` value that asks this machine's nvidia-smi.
AUTO = "auto"
#: The device query: one ``<name>, <memory> MiB`` line per GPU.
NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader")

# family -> (qualifier in the name, table key) in order; the first whose qualifier is in the name wins; a
# qualifier None is the plain part. A plain part may still be another variant (a Slurm gres type ``h100`` says
# nothing of PCIe or NVL), so every key of the family stays a candidate after the preferred one.
_FAMILIES: dict[str, tuple[tuple[str | None, str], ...]] = {
    "h100": (("nvl", "h100-nvl"), ("pcie", "h100-pcie"), (None, "h100")),
    "h200": (("nvl", "h200-nvl"), (None, "h200")),
    "a100": (("80g", "a100-80gb"), ("40g", "a100-40gb"), (None, "a100-80gb"), (None, "a100-40gb")),
    "b200": ((None, "b200"),),
    "l40s": ((None, "l40s"),),
    "mi300x": ((None, "mi300x"),),
}


def _words(name: str) -> str:
    """``name`` lower-cased with '-', '_' and runs of spaces read as one space."""
    return re.sub(r"[\s\-_]+", " ", str(name).lower()).strip()


def card_candidates(name: str) -> list[str]:
    """The keys of :data:`llmpipe.plan.memory_time.GPU_MEMORY_GB` a device or gres type name can stand for, the
    likeliest first; empty for a name of no known family.

    The family is matched as a word start (``gh200``, a Grace Hopper superchip, is no ``h200``); a qualifier in the
    name (``NVL``, ``PCIe``, ``80GB``) picks its variant, the plain part comes first otherwise (nvidia-smi names the
    SXM parts plainly: ``NVIDIA H100 80GB HBM3``, ``NVIDIA H200``). Examples: ``NVIDIA H100 PCIe`` -> ``[h100-pcie]``;
    gres type ``h100`` -> ``[h100, h100-nvl, h100-pcie]``; ``nvidia_a100_80gb_pcie`` -> ``[a100-80gb]``; ``a100``
    -> ``[a100-80gb, a100-40gb]``."""
    words = _words(name)
    for family, variants in _FAMILIES.items():
        if not re.search(rf"(?<![a-z0-9]){family}(?![0-9])", words):
            continue
        qualified = [key for q, key in variants if q is not None and q in words]
        if qualified:
            return qualified[:1]
        plain = [key for q, key in variants if q is None]
        return plain + [key for q, key in variants if q is not None and key not in plain]
    return []


def card_for_device(name: str, memory_gib: float | None, table: Mapping[str, float]) -> str | None:
    """The table key of a device nvidia-smi names ``name`` with ``memory_gib`` GiB: of :func:`card_candidates`
    (those in ``table``, ``{key: GB}``), the one whose datasheet memory is closest to ``memory_gib`` (the first on a
    tie, or without a memory); None for a device of no known family."""
    cands = [c for c in card_candidates(name) if c in table]
    if not cands:
        return None
    if memory_gib is None:
        return cands[0]
    return min(cands, key=lambda c: abs(float(table[c]) - float(memory_gib)))


def parse_nvidia_smi(text: str) -> list[tuple[str, float | None]]:
    """``(name, memory in GiB or None)`` per line of :data:`NVIDIA_SMI_QUERY`'s answer (``NVIDIA H100 80GB HBM3,
    81559 MiB``); lines without a name are skipped."""
    out = []
    for line in text.splitlines():
        name, _, mem = line.rpartition(",")
        if not name.strip():
            continue
        m = re.match(r"\s*([\d.]+)\s*(MiB|GiB)?", mem)
        gib = None if not m else float(m.group(1)) / (1 if (m.group(2) or "MiB") == "GiB" else 1024)
        out.append((name.strip(), gib))
    return out


def _run_nvidia_smi(timeout: float = 20) -> str:
    """nvidia-smi's answer to :data:`NVIDIA_SMI_QUERY`, or '' where it is missing or fails (no GPU, no driver)."""
    try:
        proc = subprocess.run(list(NVIDIA_SMI_QUERY), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


#: What :func:`detect` runs; tests replace it (or put a fake ``nvidia-smi`` first on PATH).
RUNNER: Callable[[], str] = _run_nvidia_smi


@functools.lru_cache(maxsize=8)
def _detect(path: str) -> tuple[tuple[str, float | None], ...]:
    return tuple(parse_nvidia_smi(RUNNER()))


def detect() -> tuple[tuple[str, float | None], ...]:
    """This machine's GPUs as :func:`parse_nvidia_smi` reads nvidia-smi's answer, asked once per process and
    ``PATH``; empty without nvidia-smi or GPUs."""
    return _detect(os.environ.get("PATH", ""))


def clear_cache() -> None:
    """Forget :func:`detect`'s answer (tests)."""
    _detect.cache_clear()


@dataclass(frozen=True)
class Card:
    """The GPU the plans are for.

    Attributes:
        gpu_type: the key its memory and bf16 peak are looked up by (``gpu_memory_gb``, ``gpu_peak_flops`` and the
            built-in tables); None: no GPU (the plans are for the CPU).
        memory_gb: one card's memory in GiB (datasheet GB read as GiB; nvidia-smi's for an unknown card); None
            without a card.
        device: nvidia-smi's name of the detected card; None when ``gpu_type`` was configured.
        memory_known, peak_known: whether the tables or the config give its memory and its bf16 peak.
    """

    gpu_type: str | None
    memory_gb: float | None
    device: str | None = None
    memory_known: bool = True
    peak_known: bool = True

    @property
    def label(self) -> str:
        """How plan lines name it: ``h200`` (configured), ``h100, nvidia-smi: NVIDIA H100 80GB HBM3`` (detected),
        ``no GPU``."""
        if self.gpu_type is None:
            return "no GPU"
        return self.gpu_type if self.device is None else f"{self.gpu_type}, nvidia-smi: {self.device}"

    @property
    def known(self) -> bool:
        """Memory and bf16 peak both known."""
        return self.memory_known and self.peak_known

    def unknown_note(self) -> str:
        """'' for a known card; else what the tables lack and the config keys that add it."""
        if self.gpu_type is None or self.known:
            return ""
        lacks = [w for w, known in (("memory", self.memory_known), ("bf16 peak", self.peak_known)) if not known]
        keys = []
        if not self.memory_known:
            keys.append(f"gpu_memory_gb: {{'{self.gpu_type}': <datasheet GB>}}")
        if not self.peak_known:
            keys.append(f"gpu_peak_flops: {{'{self.gpu_type}': <dense bf16 FLOP/s>}}")
        got = (f"; memory planned from nvidia-smi's {self.memory_gb:.1f} GiB"
               if not self.memory_known and self.memory_gb else "")
        return (f"card {self.gpu_type!r} is not in llmpipe's GPU tables (no {' or '.join(lacks)}: "
                f"llmpipe.plan.memory_time.GPU_MEMORY_GB, llmpipe.model.mfu.PEAK_FLOPS){got}"
                f"{'; no time plan' if not self.peak_known else ''}. "
                f"Fix: add it to the config: {', '.join(keys)}")


def _memory_table(memory_overrides: Mapping[str, float] | None) -> dict[str, float]:
    from llmpipe.plan.memory_time import GPU_MEMORY_GB
    return {**GPU_MEMORY_GB, **{str(k).lower(): float(v) for k, v in (memory_overrides or {}).items()}}


def resolve(gpu_type: str | None, memory_overrides: Mapping[str, float] | None = None,
            peak_overrides: Mapping[str, float] | None = None, *, executor: str = "local",
            devices: Sequence[tuple[str, float | None]] | None = None) -> Card:
    """The :class:`Card` for the config's ``gpu_type`` (``gpu_memory_gb`` = ``memory_overrides``,
    ``gpu_peak_flops`` = ``peak_overrides``, ``dispatch.executor`` = ``executor``).

    ``auto``: the card of ``devices`` (default :func:`detect`; module doc). Anything else: that key, its memory from
    the overrides or the table.

    Raises:
        ConfigError: ``auto`` on the Slurm executor (the site file must name the partition's card), or an unknown
            configured ``gpu_type`` (:func:`llmpipe.plan.memory_time.gpu_memory_gb`: naming the known ones,
            ``gpu_memory_gb`` and ``gpu_peak_flops``).
    """
    from llmpipe.plan.memory_time import gpu_memory_gb

    table = _memory_table(memory_overrides)
    if str(gpu_type).lower() != AUTO:
        if gpu_type is None:
            return Card(None, None)
        memory = gpu_memory_gb(str(gpu_type), memory_overrides)
        peak = peak_flops_for_name(str(gpu_type).replace("-", " "), "bf16", peak_overrides)
        return Card(str(gpu_type), memory, peak_known=bool(peak))
    if executor == "slurm":
        raise ConfigError(f"gpu_type is {AUTO!r}, which plans for the GPU this machine's nvidia-smi reports, but "
                          f"dispatch.executor is slurm: the jobs run on the partition's nodes. Fix: set the top-level "
                          f"gpu_type in config/slurm-site.yaml (or with --config gpu_type=...) to the partition's GPU "
                          f"(known: {', '.join(sorted(table))}); the Slurm preflight checks it against the "
                          f"partition's gres type.")
    found = list(detect() if devices is None else devices)
    if not found:
        return Card(None, None)
    # several types: the one with the least memory (unknown memory last)
    name, mem = min(found, key=lambda d: float("inf") if d[1] is None else d[1])
    key = card_for_device(name, mem, table)
    if key is None:
        key = _words(name).removeprefix("nvidia ").strip() or _words(name)
    memory_known = key in table
    memory = float(table[key]) if memory_known else mem
    peak = peak_flops_for_name(key.replace("-", " "), "bf16", peak_overrides) or \
        peak_flops_for_name(name, "bf16", peak_overrides)
    return Card(key, memory, device=name, memory_known=memory_known, peak_known=bool(peak))


def config_card(config: Mapping) -> Card:
    """:func:`resolve` for the workflow config ``config`` (its ``gpu_type``, ``gpu_memory_gb``, ``gpu_peak_flops``
    and ``dispatch.executor``).

    Raises:
        ConfigError: as :func:`resolve`.
    """
    from llmpipe.config.schema import section_defaults

    dispatch = config.get("dispatch") or {}   # as llmpipe.dispatch.jobs.executor_kind reads it
    executor = dispatch["executor"] if "executor" in dispatch else section_defaults("dispatch")["executor"]
    return resolve(config.get("gpu_type"), config.get("gpu_memory_gb"), config.get("gpu_peak_flops"),
                   executor=executor)


def matches(gpu_type: str, gres_type: str, memory_overrides: Mapping[str, float] | None = None) -> bool | None:
    """Whether a Slurm gres type (``h100`` of ``gpu:h100:8``) can be the card ``gpu_type`` plans for: True when the
    names are equal or ``gpu_type`` is one of :func:`card_candidates` of the gres type; False when the gres type
    names a known card and ``gpu_type`` is a table key that is not among them; None when it cannot tell (a gres
    type of no known family, or a ``gpu_type`` only the config's ``gpu_memory_gb`` defines)."""
    if _words(gpu_type) == _words(gres_type):
        return True
    cands = card_candidates(gres_type)
    if not cands:
        return None
    from llmpipe.plan.memory_time import GPU_MEMORY_GB
    key = str(gpu_type).lower()
    if key in cands:
        return True
    return False if key in GPU_MEMORY_GB else None


def check_partition_card(config: dict, types: Sequence[str], partition: str, gres_type: str | None) -> None:
    """Refuse a top-level ``gpu_type`` (the card every plan is for) that the partition's GPUs are not: where their
    gres ``types`` (:func:`llmpipe.dispatch.slurm.gres_types` of the partition's nodes) name a known card
    (:func:`matches`) and none of them is ``gpu_type``. Untyped gres,
    types of no known family and a ``gpu_type`` only ``gpu_memory_gb`` defines are not checked.

    Raises:
        ConfigError: naming both, the card each gres type stands for, and the fix.
    """
    planned = config.get("gpu_type")
    if not planned or str(planned).lower() == AUTO:
        return
    verdicts = {t: matches(str(planned), t, config.get("gpu_memory_gb")) for t in types}
    if not verdicts or True in verdicts.values() or False not in verdicts.values():
        return
    named = ", ".join(f"gpu:{t} ({' or '.join(card_candidates(t)) or 'unknown'})" for t in types)
    first = next(card_candidates(t)[0] for t, v in verdicts.items() if v is False)
    raise ConfigError(f"gpu_type is {planned!r}: every plan (memory per GPU, activation checkpointing, time) is for "
                      f"that card, but the GPUs of Slurm partition {partition!r}"
                      f"{f' of slurm.gpu_type {gres_type!r}' if gres_type else ''} are {named}. Fix: set the "
                      f"top-level gpu_type in config/slurm-site.yaml (or --config gpu_type=...) to {first!r}, or pick "
                      f"a partition of {planned} GPUs with slurm.partition (and slurm.gpu_type).")
