"""Job failures name the real state, the first real error of the first failing rank and its log, at once.

Runs on the local executor (submitit's LocalExecutor, this machine); the Slurm side is in test_slurm_dispatch.py.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import cloudpickle
import pytest

from llmpipe.dispatch import job_failures
from llmpipe.dispatch.jobs import StepFailed, run_step

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the job runs these functions without importing us

SHM_NOISE = """Exception ignored in: <function SharedMemory.__del__ at 0x7f00>
Traceback (most recent call last):
  File "/usr/lib/python3.11/multiprocessing/shared_memory.py", line 184, in __del__
KeyError: '/000001_locals'
/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 1 leaked shared_memory objects to clean up at shutdown
"""


def _raises() -> None:
    print("about to fail", flush=True)
    raise ValueError("optimizer.lr must be positive, got -1")


def _unpicklable_result():
    return threading.Lock()


def _rank1_fails_first() -> str:
    import submitit

    rank = submitit.JobEnvironment().global_rank
    if rank == 1:
        raise ValueError("the real cause, on rank 1")
    time.sleep(1.5)  # rank 0 notices later that its peer is gone, amid shutdown noise
    print(SHM_NOISE, file=sys.stderr, flush=True)
    raise RuntimeError("Connection reset by peer (a consequence)")


def _rank0_killed_quietly_rank1_raises() -> None:
    import submitit

    if submitit.JobEnvironment().global_rank == 1:
        time.sleep(1.0)
        raise ValueError("the real cause, on rank 1")
    print("rank 0 waiting in a collective", file=sys.stderr, flush=True)  # its log's last write comes first
    time.sleep(2.5)
    os._exit(1)  # killed as a consequence: no result, no exception


def _rank0_raises_rank1_waits() -> None:
    import submitit

    if submitit.JobEnvironment().global_rank == 0:
        raise OSError("EADDRINUSE: the rendezvous port is taken")
    time.sleep(300)   # a rank waiting in the rendezvous for a rank 0 that is gone


def _inherited_master_port() -> str | None:
    return os.environ.get("MASTER_PORT")   # before anything in the job sets it


def _run(tmp_path, fn, tasks: int = 1):
    cfg = {"dispatch": {"executor": "local", "state_dir": str(tmp_path / "state"), "poll_s": 0.1}}
    res = {"nodes": 1, "tasks_per_node": tasks, "gpus_per_node": 0, "cpus_per_task": 1, "time_min": 5}
    t0 = time.time()
    with pytest.raises(StepFailed) as e:
        run_step(fn, step="probe", resources=res, config=cfg, log_dir=str(tmp_path / "logs"), key=fn.__name__)
    return str(e.value), time.time() - t0


def test_a_job_that_raised_is_reported_failed_with_its_error(tmp_path):
    msg, _ = _run(tmp_path, _raises)
    first = msg.splitlines()[0]
    assert re.fullmatch(r"probe: job \d+ ended in state FAILED: ValueError: optimizer.lr must be positive, got -1",
                        first), first
    assert "FINISHED" not in msg
    assert re.search(r"^log: .*/logs/\d+/\d+_0_log\.err$", msg, re.M), msg
    assert "about to fail" in msg  # the log tail


def test_a_result_that_cannot_be_pickled_is_reported_at_once(tmp_path):
    msg, took = _run(tmp_path, _unpicklable_result)
    assert "ended in state FAILED: TypeError: cannot pickle '_thread.lock' object" in msg, msg
    assert took < 8, f"took {took:.1f} s (submitit waits 15 s for a result pickle that never comes)"


def test_headline_is_the_first_real_error_of_the_first_failing_rank(tmp_path):
    msg, _ = _run(tmp_path, _rank1_fails_first, tasks=2)
    first = msg.splitlines()[0]
    assert first.endswith("ended in state FAILED: rank 1 ValueError: the real cause, on rank 1"), first
    assert re.search(r"^log: .*/logs/\d+/\d+_1_log\.err$", msg, re.M), msg  # rank 1's log, not rank 0's


def test_a_rank_that_raised_goes_before_one_killed_without_a_word(tmp_path):
    msg, _ = _run(tmp_path, _rank0_killed_quietly_rank1_raises, tasks=2)
    assert msg.splitlines()[0].endswith("ended in state FAILED: rank 1 ValueError: the real cause, on rank 1"), msg


def test_headline_skips_shutdown_noise():
    text = ("starting\n" + SHM_NOISE + "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
            "[rank0]: torch.distributed.DistBackendError: NCCL error: remote process exited\n"
            "During handling of the above exception, another exception occurred:\n"
            "RuntimeError: secondary\n")
    assert job_failures.headline(text) == "torch.distributed.DistBackendError: NCCL error: remote process exited"
    assert job_failures.headline(SHM_NOISE) is None


def test_the_node_of_a_finished_array_task_is_read_from_its_log_when_slurm_forgot_it(tmp_path):
    """Slurm may drop a finished array task before its node is asked for; submitit's own first log line names it."""
    from llmpipe.dispatch.job_failures import logged_host

    out = tmp_path / "20_1_0_log.out"
    out.write_text("submitit INFO (2026-12-01 20:53:38,182) - Starting with JobEnvironment(job_id=20_1, hostname=n2, "
                   "local_rank=0(1), node=0(1), global_rank=0(1))\n")
    assert logged_host(out) == "n2"
    assert logged_host(tmp_path / "missing.out") == ""


def test_a_failed_rank_ends_its_local_job_without_waiting_for_the_others(tmp_path):
    """The other ranks of a local job would wait out the process group's timeout (600 s) for a failed rank 0."""
    msg, took = _run(tmp_path, _rank0_raises_rank1_waits, tasks=2)
    assert msg.splitlines()[0].endswith("ended in state FAILED: rank 0 OSError: EADDRINUSE: the rendezvous port is "
                                        "taken"), msg
    assert took < 60, f"took {took:.0f} s: the job waited for its other rank"


def test_a_local_job_of_two_ranks_inherits_a_free_port_below_the_ephemeral_range(tmp_path, monkeypatch):
    from llmpipe.dispatch.rendezvous import ephemeral_range

    monkeypatch.delenv("MASTER_PORT", raising=False)
    cfg = {"dispatch": {"executor": "local", "state_dir": str(tmp_path / "state"), "poll_s": 0.1}}
    res = {"nodes": 1, "tasks_per_node": 2, "gpus_per_node": 0, "cpus_per_task": 1, "time_min": 5}
    port = run_step(_inherited_master_port, step="probe", resources=res, config=cfg, log_dir=str(tmp_path / "logs"),
                    key="port")
    assert port is not None, "the job's ranks would use submitit's port, derived from the job id"
    assert 20000 <= int(port) < ephemeral_range()[0], port
    assert "MASTER_PORT" not in os.environ   # the submitting process's environment is restored


def test_free_port_skips_a_port_that_is_taken():
    import random
    import socket

    from llmpipe.dispatch import rendezvous

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", 0))
        busy = taken.getsockname()[1]
        taken.listen()

        class Picks(random.Random):
            def __init__(self):
                super().__init__(0)
                self.picks = []

            def randint(self, a, b):
                self.picks.append(busy if not self.picks else super().randint(a, b))
                return self.picks[-1]

        rng = Picks()
        port = rendezvous.free_port(rng=rng)
    assert rng.picks[0] == busy and port == rng.picks[1] != busy, rng.picks


def test_every_host_computes_the_same_port_of_a_job_below_the_default_ephemeral_range():
    from llmpipe.dispatch.rendezvous import job_port

    ports = {job_port(str(job_id)) for job_id in range(1000, 1400)}
    assert all(20000 <= p < 32768 for p in ports) and len(ports) > 300, sorted(ports)[:5]
    assert job_port("1234") == job_port("1234") and job_port("1234_5") != job_port("1235_5")


# ------------------------------------------------------------------------------------------- errors named at their cause

def _save_runs_out_of_space(path: str) -> None:
    import errno

    raise OSError(errno.ENOSPC, "No space left on device", path)


def test_a_save_that_raised_enospc_is_named_by_its_errno_and_path(tmp_path):
    """A save that raised ``OSError(ENOSPC)``: the headline names the errno's symbol and the file, not only the
    exception's text deep in the log tail."""
    target = str(tmp_path / "ckpt" / "ep0-ba40-rank0.pt")
    cfg = {"dispatch": {"executor": "local", "state_dir": str(tmp_path / "state"), "poll_s": 0.1}}
    res = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 1, "time_min": 5}
    with pytest.raises(StepFailed) as e:
        run_step(_save_runs_out_of_space, target, step="probe", resources=res, config=cfg,
                 log_dir=str(tmp_path / "logs"), key="enospc")
    first = str(e.value).splitlines()[0]
    assert re.fullmatch(rf"probe: job \d+ ended in state FAILED: ENOSPC \(No space left on device\) on "
                        rf"{re.escape(target)} \(OSError\)", first), first
    assert e.value.headline == first.split("FAILED: ", 1)[1]


def test_oserror_lines_are_named_and_other_lines_kept():
    assert job_failures.named_oserror("PermissionError: [Errno 13] Permission denied: '/r/train.json'") == \
        "EACCES (Permission denied) on /r/train.json (PermissionError)"
    assert job_failures.named_oserror("OSError: [Errno 18] Invalid cross-device link: '/a.tmp' -> '/b'") == \
        "EXDEV (Invalid cross-device link) on /a.tmp -> /b (OSError)"
    assert job_failures.named_oserror("ValueError: lr must be positive") == "ValueError: lr must be positive"


class _Statvfs:
    """A stand-in for os.statvfs: ``free`` bytes (4 kB blocks) under each path prefix, 1 TB elsewhere."""

    def __init__(self, free: dict[str, int]):
        self.free = free

    def __call__(self, path: str):
        import types

        n = next((v for p, v in self.free.items() if path.startswith(p)), 10 ** 12)
        return types.SimpleNamespace(f_bavail=n // 4096, f_frsize=4096)


def _training_failure(tmp_path, headline: str, tail: str = "(no log output)"):
    from tests.conftest import project_config

    config = {**project_config(), "results_dir": str(tmp_path / "results")}
    folder = tmp_path / "results" / "mpt-tiny" / "checkpoints" / "abc123"
    folder.mkdir(parents=True)
    (folder / "ep0-ba40-rank0.pt").write_bytes(b"x")
    (folder / "ep0-ba40-rank0.pt.complete").write_text("40")
    exc = StepFailed(f"train mpt-tiny: job 7 ended in state FAILED: {headline}\nlog: /l/7_0_log.err\n{tail}",
                     state="FAILED", job_id="7", headline=headline)
    return config, str(folder), exc


def test_a_training_that_wrote_no_result_on_a_full_disk_names_out_of_space(tmp_path):
    """A save that ran out of space left no result (submitit could not dump the error; the job's log, on the same
    disk, is cut): the rule's headline names out-of-space, the full folder, its free bytes and the planned size of
    one checkpoint (the memory plan's checkpoint_bytes), and that the earlier checkpoint is untouched."""
    from llmpipe.config.runs import run_config
    from llmpipe.plan.memory_time import checkpoint_bytes
    from llmpipe.steps.training import storage_cause

    config, folder, exc = _training_failure(tmp_path, job_failures.NO_RESULT, "--- stderr (last 40 lines) ---\nbatch 35")
    planned = checkpoint_bytes(run_config(config, "mpt-tiny"))
    cause = storage_cause(exc, config, "mpt-tiny", folder, statvfs=_Statvfs({folder: 8192}))
    renamed = exc.renamed(cause)
    first = str(renamed).splitlines()[0]
    assert first.startswith(f"train mpt-tiny: job 7 ended in state FAILED: out of space: checkpoint folder {folder} "
                            f"has 8,192 bytes (8.2 kB) free, less than the {planned:,} bytes "), first
    assert "checkpoint_bytes" in first and "the checkpoint at batch 40 is untouched" in first, first
    assert str(renamed).splitlines()[1:] == str(exc).splitlines()[1:]   # the log and its tail stay
    assert (renamed.state, renamed.job_id) == ("FAILED", "7")
    # results_dir is the full one (the checkpoint folder has room): named instead
    cause = storage_cause(exc, config, "mpt-tiny", folder, statvfs=_Statvfs({folder: 10 ** 12, config["results_dir"]: 0}))
    assert cause.startswith(f"out of space: results_dir {config['results_dir']} has 0 bytes free"), cause


def test_a_full_disk_is_named_even_after_the_partial_save_was_removed(tmp_path):
    """The job's error says ENOSPC but the folders have room again: still out of space, with the free bytes now."""
    from llmpipe.steps.training import storage_cause

    headline = job_failures.named_oserror("OSError: [Errno 28] No space left on device: '/r/ckpt/ep0-ba80-rank0.pt'")
    config, folder, exc = _training_failure(tmp_path, headline)
    cause = storage_cause(exc, config, "mpt-tiny", folder, statvfs=_Statvfs({}))
    assert cause.startswith("out of space (the job's error says the disk is full): "), cause
    assert "1,000,000,000,000 bytes (1.0 TB) free, one checkpoint of this run needs " in cause, cause


def test_a_failure_that_is_not_about_space_is_not_named_out_of_space(tmp_path):
    """A training that raised its own error on a nearly full disk keeps its own headline."""
    from llmpipe.steps.training import storage_cause

    config, folder, exc = _training_failure(tmp_path, "ValueError: optimizer.lr must be positive, got -1")
    assert storage_cause(exc, config, "mpt-tiny", folder, statvfs=_Statvfs({"/": 0})) is None
