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
