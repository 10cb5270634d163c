# Loaded by Python at start-up when this folder is on PYTHONPATH (tests only).
# LLMPIPE_TEST_NO_SYMLINK=<folder> makes os.symlink fail for links created inside <folder>, like on a
# CIFS shared drive that refuses symlinks (node-local folders such as /tmp still allow them).
import errno
import os
import sys

_ROOT = os.environ.get("LLMPIPE_TEST_NO_SYMLINK")
if _ROOT:
    _ROOT = os.path.realpath(_ROOT)
    _symlink = os.symlink

    def _refuse(src, dst, *args, **kwargs):
        if os.path.realpath(os.path.dirname(os.path.abspath(dst))).startswith(_ROOT):
            raise OSError(errno.EPERM, f"symlinks are not supported on this filesystem (test): {dst}")
        return _symlink(src, dst, *args, **kwargs)

    os.symlink = _refuse

#: a process that submitit started (a job's task), where the hooks below apply
_IN_JOB = any("submitit" in a for a in sys.argv)

# LLMPIPE_TEST_KILL_AT=<glob> SIGKILLs every training rank (a process started by submitit) as soon as a file
# matching <glob> exists, e.g. a checkpoint's .complete marker: a node dying mid-run, after that checkpoint.
_KILL_AT = os.environ.get("LLMPIPE_TEST_KILL_AT")
if _KILL_AT and _IN_JOB:
    import glob
    import signal
    import threading
    import time

    def _watch():
        while not glob.glob(_KILL_AT):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=_watch, daemon=True).start()

# LLMPIPE_TEST_MIN_STEP_S=<seconds> makes every optimizer step of a process started by submitit come at least that
# long after the one before (torch's global optimizer step post-hook): a training whose length in seconds does not
# depend on the machine's load, for a test that needs a training to outlast one Slurm time limit and fit in two.
_MIN_STEP_S = os.environ.get("LLMPIPE_TEST_MIN_STEP_S")
if _MIN_STEP_S and _IN_JOB:
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    _min_step_s = float(_MIN_STEP_S)
    _last_step = []

    def _pace(optimizer, args, kwargs):
        if _last_step:
            time.sleep(max(0.0, _min_step_s - (time.monotonic() - _last_step[0])))
        _last_step[:] = [time.monotonic()]

    register_optimizer_step_post_hook(_pace)

# LLMPIPE_TEST_PAUSE_AT=<N> (or save:<N>) with LLMPIPE_TEST_PAUSE_DIR=<dir>: in the first allocation of a job
# (SLURM_RESTART_COUNT 0 or unset), the training process pauses as its N-th optimizer step ends (save:<N>: as the
# first torch.save after the N-th step starts, the final full checkpoint of an N-batch training), writes <dir>/paused
# and waits up to 300 s for <dir>/go: a test sends Slurm's signal while the training is at that point.
_PAUSE_AT = os.environ.get("LLMPIPE_TEST_PAUSE_AT")
if _PAUSE_AT and _IN_JOB and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    import time

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _pause_dir = os.environ["LLMPIPE_TEST_PAUSE_DIR"]
    _in_save, _, _pause_step = _PAUSE_AT.rpartition(":")
    _pause_step = int(_pause_step)
    _steps = [0]

    def _pause() -> None:
        open(os.path.join(_pause_dir, "paused"), "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(_pause_dir, "go")) and time.monotonic() < deadline:
            time.sleep(0.05)   # Python signal handlers run between these sleeps

    def _count(optimizer, args, kwargs):
        _steps[0] += 1
        if not _in_save and _steps[0] == _pause_step:
            _pause()

    register_optimizer_step_post_hook(_count)
    if _in_save:
        _save = torch.save

        def _save_paused(*args, **kwargs):
            if _steps[0] == _pause_step and not os.path.exists(os.path.join(_pause_dir, "paused")):
                _pause()
            return _save(*args, **kwargs)

        torch.save = _save_paused
