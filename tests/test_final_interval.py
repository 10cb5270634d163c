"""Slurm's end-of-allocation signal (USR2) in a training's last save interval, in process on the CPU.

The real :class:`llmpipe.train.pretrain.TrainTask` trains the tiny model (the session's tiny run's data and tokenizer)
for :data:`STEPS` batches with a checkpoint every :data:`SAVE_EVERY`; a test callback sends USR2 to this process as
a given batch trains, or as the final save starts. submitit's handler, which the training defers to a batch boundary,
is a stand-in that raises :class:`Requeued` ("checkpoint, requeue, exit"); the test then calls the task again, as
the requeued allocation would. A signal before the final batch must requeue once and resume from the checkpoint
saved on it; a signal in the final batch or during the final save must end the job with its result (no requeue).
A final checkpoint without its record (what b8f743e's code left: it saved at the final batch on the signal and
requeued) must give train.json without starting composer.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from llmpipe.atomic import read_json
from llmpipe.config.runs import run_settings
from llmpipe.train import checkpoints as ckpt
from tests.conftest import project_config

pytestmark = pytest.mark.slow

STEPS, SAVE_EVERY = 4, 2        # the last save interval: batches 3 and 4
IDENTITY = '{"test": "final-interval"}'
_SIGNAL_AT: list = []           # the batch (int) or "final save" at which the test callback sends USR2, once


class Requeued(Exception):
    """What submitit's USR2 handler does in a Slurm job (pickle the task, ``scontrol requeue``, exit)."""


def _fake_submitit(signum, frame):
    raise Requeued(signum)


def _register_signal_callback() -> None:
    from composer.core import Callback
    from llmfoundry.registry import callbacks

    class SignalAt(Callback):
        def batch_start(self, state, logger):
            if _SIGNAL_AT and _SIGNAL_AT[0] == int(state.timestamp.batch) + 1:   # the batch about to train
                _SIGNAL_AT.clear()
                os.kill(os.getpid(), signal.SIGUSR2)

    if "llmpipe_test_signal_at" not in callbacks:
        callbacks.register("llmpipe_test_signal_at", func=SignalAt)


@pytest.fixture
def task(tiny_run, tmp_path, monkeypatch):
    from llmpipe.train.pretrain import TrainTask, register_extensions

    register_extensions()
    _register_signal_callback()
    config = project_config()
    config["models"]["mpt-tiny"]["train"].update(max_duration_batches=STEPS, save_interval_batches=SAVE_EVERY,
                                                 log_interval_batches=2, eval_interval_batches=100,
                                                 scheduler={"t_warmup_batches": 1})
    mds = next(tiny_run.glob("results/data/builtin-docs/*/concat128/mds"))
    tok = tiny_run / "results/tokenizers/bpe-builtin-docs"
    t = TrainTask(run_settings(config, "mpt-tiny"), str(mds), str(tok), str(tmp_path / "run"), IDENTITY,
                  resources={"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1})
    build = t.build_config

    def with_signal(*args, **kwargs):
        cfg = build(*args, **kwargs)
        cfg["callbacks"]["llmpipe_test_signal_at"] = {}
        return cfg

    monkeypatch.setattr(t, "build_config", with_signal)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    previous = signal.signal(signal.SIGUSR2, _fake_submitit)
    yield t
    signal.signal(signal.SIGUSR2, previous)
    _SIGNAL_AT.clear()


def allocations(task, limit: int = 3) -> tuple[dict, int]:
    """Call ``task`` as Slurm's allocations would until it returns; (its result, the number of requeues)."""
    for requeues in range(limit):
        signal.signal(signal.SIGUSR2, _fake_submitit)   # each allocation starts with submitit's handler
        try:
            return task(), requeues
        except Requeued:
            continue
    raise AssertionError(f"still requeued after {limit} allocations")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("at", [3, 4, "final save"])
def test_a_signal_in_the_last_save_interval_ends_with_the_result(task, at, capsys, monkeypatch):
    if at == "final save":
        from composer.callbacks import CheckpointSaver
        save = CheckpointSaver._save_checkpoint

        def signal_during_the_final_save(self, state, logger):
            if int(state.timestamp.batch) == STEPS:
                os.kill(os.getpid(), signal.SIGUSR2)
            return save(self, state, logger)

        monkeypatch.setattr(CheckpointSaver, "_save_checkpoint", signal_during_the_final_save)
    else:
        _SIGNAL_AT.append(at)
    result, requeues = allocations(task)
    out = capsys.readouterr().out
    assert result["steps"] == STEPS and not result.get("recovered"), result
    folder = task.checkpoint_folder()
    assert [b for b, _ in ckpt.complete_checkpoints(folder)][-1] == STEPS
    assert read_json(os.path.join(folder, "result.json"))["final_checkpoint"] == result["final_checkpoint"]
    if at in (STEPS, "final save"):     # the final batch had trained: no requeue, one job to the end
        assert requeues == 0 and "before requeue" not in out, out[-3000:]
        assert f"came after the final batch {STEPS} had trained" in out, out[-3000:]
        assert result["resumed_from"] is None and result["batches_this_job"] == STEPS
    else:                               # an earlier batch: checkpoint there, requeue once, resume from it
        assert requeues == 1 and f"saving checkpoint at batch {at} before requeue" in out, out[-3000:]
        assert os.path.basename(result["resumed_from"]) == f"ep0-ba{at}-rank0.pt", result
        assert result["batches_this_job"] == STEPS - at
    # the loss log holds every batch's line once, the final batch's included
    log = [json.loads(line) for line in open(os.path.join(folder, "train_log.jsonl"))]
    assert [r["batch"] for r in log] == [1, 2, 4]


@pytest.mark.timeout(600)
def test_a_final_checkpoint_without_its_record_gives_train_json_without_composer(task, monkeypatch, capsys):
    """The state b8f743e's code left after a signal in the final batch: the final checkpoint complete, the loss log,
    no result.json. The next allocation writes the record from them and never builds a trainer; a later run reads
    the record it wrote."""
    result, _ = allocations(task)
    folder = task.checkpoint_folder()
    os.remove(os.path.join(folder, "result.json"))

    def no_composer(*args, **kwargs):
        raise AssertionError("composer was started for a finished training")

    import llmfoundry.command_utils
    monkeypatch.setattr(llmfoundry.command_utils, "train", no_composer)
    capsys.readouterr()
    recovered, requeues = allocations(task)
    assert requeues == 0
    assert "its record recovered from the checkpoint and the loss log" in capsys.readouterr().out
    assert recovered["recovered"] == ckpt.RECOVERED_NOTE
    # what the folder holds is what the trained job recorded; what only that job measured is null, never made up
    for key in ("steps", "tokens", "first_train_loss", "final_train_loss", "final_checkpoint", "checkpoint_size_bytes",
                "run", "nodes", "devices", "global_batch_size", "concat_tokens", "flops_per_token", "fsdp"):
        assert recovered[key] == result[key], key
    assert all(recovered[k] is None for k in ckpt.JOB_MEASURED_FIELDS)
    assert read_json(os.path.join(folder, "result.json")) == recovered
    # the submitting machine's check (rule train) finds the record now, and would have recovered it without a job too
    os.remove(os.path.join(folder, "result.json"))
    again = ckpt.recorded_result(os.path.dirname(folder), IDENTITY, STEPS, task.recovery_fields(), task.submit_dir)
    assert again == recovered
