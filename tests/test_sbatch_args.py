"""slurm.sbatch_args that cannot be applied stop the dry run's preflight, naming the setting to change instead."""

from __future__ import annotations

import pytest

from llmpipe.dispatch import slurm
from llmpipe.config.settings import ConfigError

RES = {"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1, "mem_gb": 0, "time_min": 10}


def cfg(**sbatch_args):
    # preflight: false asks no cluster; the checks that need none still run
    return {"dispatch": {"executor": "slurm"}, "slurm": {"preflight": False, "sbatch_args": sbatch_args}}


@pytest.mark.parametrize("args,message", [
    ({"signal": None}, r"sbatch_args\.signal cannot be applied: the step sets --signal from slurm\.signal_delay_s"),
    ({"signal": "USR1@60"}, r"--signal from slurm\.signal_delay_s"),
    ({"time": "01:00:00"}, r"--time from the step's resources\.time_min"),
    ({"account": "x"}, r"--account from slurm\.account"),
    ({"ntasks-per-node": 2}, r"sbatch_args\.ntasks-per-node cannot be applied"),
    ({"mail-type": None}, r"sbatch_args\.mail-type is None, which removes an option, but llmpipe adds no --mail-type"),
    ({"comment": "false"}, r"adds only --requeue"),
])
def test_unappliable_sbatch_args_stop_the_preflight(args, message):
    with pytest.raises(ConfigError, match=message):
        slurm.preflight(cfg(**args), dict(RES))


def test_applicable_sbatch_args_pass_through():
    assert slurm.sbatch_extra({"sbatch_args": {"mail-type": "END", "requeue": False, "hold": True}}) == \
        {"mail_type": "END", "hold": True}
    assert slurm.sbatch_extra({"sbatch_args": {"requeue": "null"}}) == {}
    assert slurm.sbatch_extra({}) == {"requeue": True}
    assert slurm.preflight(cfg(reservation="r1"), dict(RES)) == {}
