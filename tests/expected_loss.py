"""The committed loss curve of ``mpt-tiny`` (CPU, fp32, seed 17) and the tolerance it is compared within.

``tests/expected/mpt-tiny-loss.json`` holds the train loss logged every ``log_interval_batches`` by the embedded
default run (the loss log train.json names, ``results/mpt-tiny/checkpoints/<identity>/train_log.jsonl``). A change in attention, loss, optimizer or data wiring that moves
the numbers fails ``tests/test_pipeline.py::test_loss_curve_matches_committed_reference``. When a change is meant to
move them (a new tokenizer default, another schedule), regenerate the file from a fresh run and say why in the
commit::

    snakemake --cores 2 -d /tmp/tiny results/mpt-tiny/train.json
    python -m tests.expected_loss /tmp/tiny > tests/expected/mpt-tiny-loss.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXPECTED = Path(__file__).resolve().parent / "expected" / "mpt-tiny-loss.json"

#: Relative tolerance per logged loss. Two runs on the same machine agree to float32 rounding; across thread counts
#: and CPUs the summation order of matmuls differs (about 1e-6 relative per step, compounding over 120 steps), far
#: below the 1e-2 that a wrong mask, scale, loss reduction or learning rate moves the curve by.
RTOL = 2e-3


def loss_curve(workdir: Path) -> dict[str, float]:
    """``{batch: loss}`` (batch as text, loss in nats) from the loss log that ``workdir``'s
    ``results/mpt-tiny/train.json`` names (``train_log``, relative to ``workdir``)."""
    train = json.loads((workdir / "results/mpt-tiny/train.json").read_text())
    rows = [json.loads(line) for line in (workdir / train["train_log"]).read_text().splitlines() if line.strip()]
    return {str(r["batch"]): float(r["loss"]) for r in rows}


if __name__ == "__main__":
    curve = loss_curve(Path(sys.argv[1]))
    json.dump({"model": "mpt-tiny", "precision": "fp32", "seed": 17, "unit": "nats",
               "loss": curve}, sys.stdout, indent=1)
    sys.stdout.write("\n")
