"""llmpipe.dispatch.unit_array: complete units are reused, the others run once each; local claims vs. a Slurm array."""

from __future__ import annotations

import json
import os

import cloudpickle
import pytest

from llmpipe.dispatch import unit_array
from llmpipe.dispatch.unit_array import Unit, run_claimed_units, run_unit_array


def write_unit(arg: dict) -> dict:
    """A toy unit: writes ``{dir}/{name}.json`` (the output and its completion marker) atomically."""
    rec = {"name": arg["name"], "pid": os.getpid()}
    tmp = os.path.join(arg["dir"], f".tmp-{arg['name']}")
    with open(tmp, "w") as fh:
        json.dump(rec, fh)
    os.rename(tmp, os.path.join(arg["dir"], f"{arg['name']}.json"))
    return rec


def unit_done(arg: dict) -> dict | None:
    try:
        with open(os.path.join(arg["dir"], f"{arg['name']}.json")) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None


def units(d, n: int = 4) -> list[Unit]:
    return [Unit(key=f"s/u{i}", arg={"dir": str(d), "name": f"u{i}"}, weight=i) for i in range(n)]


def run(tmp_path, us, kind: str = "debug", workers: int = 2, log: str = "rule.log"):
    cfg = {"dispatch": {"executor": kind, "poll_s": 0.05, "state_dir": str(tmp_path / "state")}}
    (tmp_path / "work").mkdir(exist_ok=True)
    return run_unit_array(write_unit, us, is_complete=unit_done, workers=workers, work_dir=str(tmp_path / "work"),
                          name="toy", step="toy step", resources={"time_min": 5}, config=cfg,
                          log_dir=str(tmp_path / "logs"), log_file=str(tmp_path / log),
                          describe=lambda rec: f"wrote {rec['name']}", verb="making", detail="; detail")


def test_runs_missing_units_once_and_reuses_complete_ones(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    first = run(tmp_path, units(out))
    assert first.run == ["s/u3", "s/u2", "s/u1", "s/u0"]  # largest weight first
    assert first.reused == [] and first.workers == 2
    assert sorted(k for k, _ in first.records) == ["s/u0", "s/u1", "s/u2", "s/u3"]
    log = (tmp_path / "rule.log").read_text()
    assert "toy: making 4 unit(s) of 4 with 2 worker process(es) (debug); detail" in log
    for i in range(4):
        assert f"toy: unit s/u{i} done (" in log and f"/4): wrote u{i}" in log

    os.remove(out / "u1.json")
    second = run(tmp_path, units(out), log="rule2.log")
    assert second.run == ["s/u1"] and second.reused == ["s/u0", "s/u2", "s/u3"] and second.workers == 1
    log2 = (tmp_path / "rule2.log").read_text()
    assert "toy: 3 unit(s) already complete, reused: s/u0, s/u2, s/u3" in log2
    assert "toy: unit s/u1 done (1/1): wrote u1" in log2

    third = run(tmp_path, units(out), log="rule3.log")
    assert third.run == [] and third.workers == 0 and third.records == []
    assert "making" not in (tmp_path / "rule3.log").read_text()  # nothing submitted


def test_claims_give_each_unit_to_one_worker(tmp_path):
    """Local workers share one list: a unit claimed by one job is skipped by the others."""
    out = tmp_path / "out"
    out.mkdir()
    claims = tmp_path / "claims"
    claims.mkdir()
    us = units(out, 3)
    job = {"fn": write_unit, "is_complete": unit_done, "units": us, "claim_dir": str(claims)}
    assert [k for k, _ in run_claimed_units(job)] == ["s/u0", "s/u1", "s/u2"]
    for u in us:
        os.remove(out / f"{u.arg['name']}.json")
    assert run_claimed_units(job) == []  # all claimed already
    assert sorted(os.listdir(claims)) == ["s.u0", "s.u1", "s.u2"]


@pytest.mark.parametrize("workers, max_parallel", [(2, 2), (0, 0)])
def test_slurm_runs_one_array_task_per_unit(tmp_path, monkeypatch, workers, max_parallel):
    """On Slurm: one job per unit, no claims, array_parallelism = workers when set; the jobs pickle and run."""
    out = tmp_path / "out"
    out.mkdir()
    seen = {}

    def fake_map_steps(fn, items, *, step, resources, config, log_dir, log_file, max_parallel, on_result, key):
        seen.update(fn=fn, items=items, max_parallel=max_parallel, step=step, key=key)
        results = []
        for i, item in enumerate(items):
            fn2, item2 = cloudpickle.loads(cloudpickle.dumps((fn, item)))  # what submitit sends to a task
            results.append(fn2(item2))
            on_result(i, results[-1])
        return results

    monkeypatch.setattr(unit_array, "map_steps", fake_map_steps)
    r = run(tmp_path, units(out, 3), kind="slurm", workers=workers)
    assert seen["fn"] is run_claimed_units and seen["max_parallel"] == max_parallel
    assert [[u.key for u in it["units"]] for it in seen["items"]] == [["s/u2"], ["s/u1"], ["s/u0"]]
    assert all(it["claim_dir"] is None for it in seen["items"])
    assert not os.listdir(tmp_path / "work")  # no claim files on Slurm
    assert r.run == ["s/u2", "s/u1", "s/u0"] and sorted(os.listdir(out)) == ["u0.json", "u1.json", "u2.json"]
    log = (tmp_path / "rule.log").read_text()
    at_most = ", at most 2 at once" if max_parallel else ""
    assert f"toy: making 3 unit(s) of 3 as a Slurm job array of 3 task(s){at_most}; detail" in log
    assert "toy: unit s/u0 done (3/3): wrote u0" in log

