# Loaded by Python at start-up when this folder is on PYTHONPATH (tests only).
# LLMPIPE_TEST_NO_SYMLINK=<folder> makes os.symlink fail for links created inside <folder>, like on a
# CIFS shared drive that refuses symlinks (node-local folders such as /tmp still allow them).
import errno
import os

_ROOT = os.environ.get("LLMPIPE_TEST_NO_SYMLINK")
if _ROOT:
    _ROOT = os.path.realpath(_ROOT)
    _symlink = os.symlink

    def _refuse(src, dst, *args, **kwargs):
        if os.path.realpath(os.path.dirname(os.path.abspath(dst))).startswith(_ROOT):
            raise OSError(errno.EPERM, f"symlinks are not supported on this filesystem (test): {dst}")
        return _symlink(src, dst, *args, **kwargs)

    os.symlink = _refuse
