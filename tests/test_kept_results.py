"""Finished results kept per identity (llmpipe.steps.kept_results): kept as hard links once complete, restored only for
the same identity on byte-identical inputs, pruned only after the current result is complete; and the rule-level
flow (llmpipe.steps.run_step) that restores instead of calling the step. The real chain is
tests/test_pipeline.py::test_going_back_after_a_killed_changed_run_restores_every_step."""

from __future__ import annotations

import json
import os
import types

import pytest

from llmpipe.train import checkpoints as ckpt
from llmpipe.steps import kept_results as kr
from llmpipe.config.identity import identity_text
from llmpipe.steps import THIS_RUN, Kept, Rule, run_step
from llmpipe.steps.context import StepContext
from tests.test_steps import NamedList

IDENT = identity_text({"step": "eval", "version": 2, "val_batches": 20})


@pytest.fixture
def run_dir(tmp_path):
    """results/r with an input file (results/r/in.json) and outputs: a file and a folder of two files."""
    d = tmp_path / "results" / "r"
    (d / "hf").mkdir(parents=True)
    (d / "in.json").write_text('{"a": 1}')
    (d / "out.json").write_text('{"score": 0.5}')
    (d / "hf" / "manifest.json").write_text("{}")
    (d / "hf" / "model.bin").write_bytes(b"\0" * 1000)
    return d


def key(run_dir, identity=IDENT):
    return kr.result_key(identity, [str(run_dir / "in.json")], str(run_dir.parent))


def test_kept_as_hard_links_and_restored_byte_for_byte(run_dir):
    store = kr.store_dir(str(run_dir.parent), "r", "eval")
    folder = kr.keep(store, key(run_dir), [str(run_dir / "out.json"), str(run_dir / "hf")], str(run_dir), 1)
    assert os.path.samefile(os.path.join(folder, "files", "out.json"), run_dir / "out.json")  # no extra space
    assert sorted(json.loads(open(os.path.join(folder, "key.json")).read())["files"]) == [
        "hf/manifest.json", "hf/model.bin", "out.json"]
    os.remove(run_dir / "out.json")                      # Snakemake deletes the output before a rerun
    (run_dir / "hf" / "stale.bin").write_text("x")     # the folder is replaced whole
    assert kr.find(store, key(run_dir)) == folder
    assert kr.restore(folder, str(run_dir), 1) == [str(run_dir / "out.json"), str(run_dir / "hf")]
    assert (run_dir / "out.json").read_text() == '{"score": 0.5}'
    assert sorted(os.listdir(run_dir / "hf")) == ["manifest.json", "model.bin"]
    assert not [n for n in os.listdir(run_dir) if n.endswith(".tmp")]


def test_another_identity_or_changed_input_finds_nothing(run_dir):
    store = kr.store_dir(str(run_dir.parent), "r", "eval")
    kr.keep(store, key(run_dir), [str(run_dir / "out.json")], str(run_dir), 1)
    # the same identity in another text form (0.0 for 0, key order) is the same result
    same = identity_text({"val_batches": 20.0, "version": 2, "step": "eval"})
    assert kr.find(store, key(run_dir, same)) is not None
    assert kr.find(store, key(run_dir, identity_text({"step": "eval", "version": 2, "val_batches": 3}))) is None
    (run_dir / "in.json").write_text('{"a": 2}')
    assert kr.find(store, key(run_dir)) is None
    assert kr.result_key(IDENT, [str(run_dir / "hf")], str(run_dir.parent)) is None  # a folder input: not kept


def test_a_damaged_kept_result_is_not_restored(run_dir):
    store = kr.store_dir(str(run_dir.parent), "r", "eval")
    folder = kr.keep(store, key(run_dir), [str(run_dir / "hf")], str(run_dir), 1)
    os.remove(os.path.join(folder, "files", "hf", "model.bin"))
    assert kr.find(store, key(run_dir)) is None


def test_retention_prunes_only_after_the_new_result_is_complete(run_dir, monkeypatch):
    store = kr.store_dir(str(run_dir.parent), "r", "eval")
    out = [str(run_dir / "out.json")]
    folders = []
    for i in range(3):
        (run_dir / "in.json").write_text(json.dumps({"a": i}))
        folders.append(kr.keep(store, key(run_dir), out, str(run_dir), 1))
    assert sorted(os.listdir(store)) == sorted(os.path.basename(f) for f in folders[1:])  # current + 1 earlier
    # a keep that fails midway removes nothing that was finished
    (run_dir / "in.json").write_text('{"a": 9}')
    monkeypatch.setattr(kr, "_link_or_copy", lambda src, dest: (_ for _ in ()).throw(OSError(28, "disk full")))
    with pytest.raises(OSError):
        kr.keep(store, key(run_dir), out, str(run_dir), 0)
    assert sorted(os.listdir(store)) == sorted(os.path.basename(f) for f in folders[1:])
    monkeypatch.undo()
    current = kr.keep(store, key(run_dir), out, str(run_dir), 0)
    assert os.listdir(store) == [os.path.basename(current)]


def fake_rule(calls: list) -> Rule:
    def step(ctx):
        calls.append(ctx.rule)
        with open(ctx.output[0], "w") as fh:
            fh.write(json.dumps({"score": len(calls)}))
        return {"computed": True}
    return Rule(step, kept=Kept("eval", ignore_inputs=("generation",)))


def ctx_of(run_dir, identity=IDENT) -> StepContext:
    results = run_dir.parent
    (results / "gen.json").write_text(str(os.urandom(8)))  # an ignored input: its contents never matter
    return StepContext(rule="eval", config={"results_dir": str(results), "eval": {"earlier_identities_to_keep": 1}},
                       wildcards=types.SimpleNamespace(run="r"),
                       input=NamedList(model=str(run_dir / "in.json"), generation=str(results / "gen.json")),
                       output=[str(run_dir / "eval.json")], params=NamedList(identity=identity),
                       log_file=str(results / "logs" / "eval.log"), log_dir=None, resources={}, key="k",
                       executor="local")


def test_run_step_restores_instead_of_calling_the_step(run_dir):
    calls = []
    os.makedirs(run_dir.parent / "logs")
    open(run_dir.parent / "logs" / "eval.log", "w").close()
    assert run_step(ctx_of(run_dir), fake_rule(calls)) == {"computed": True}
    first = (run_dir / "eval.json").read_bytes()
    os.remove(run_dir / "eval.json")
    settings = run_step(ctx_of(run_dir), fake_rule(calls))
    assert calls == ["eval"] and (run_dir / "eval.json").read_bytes() == first
    assert settings["restored_from"].startswith(str(run_dir / "kept" / "eval"))
    log = (run_dir.parent / "logs" / "eval.log").read_text()
    assert f"restored from {settings['restored_from']}" in log and "no job submitted" in log
    assert json.loads((run_dir / "eval.json.provenance.json").read_text())["settings"] == settings
    # other settings compute again; going back to the first restores it
    run_step(ctx_of(run_dir, identity_text({"step": "eval", "version": 2, "val_batches": 3})), fake_rule(calls))
    assert calls == ["eval", "eval"]
    run_step(ctx_of(run_dir), fake_rule(calls))
    assert calls == ["eval", "eval"] and (run_dir / "eval.json").read_bytes() == first
    assert THIS_RUN not in log  # the log here was not started by run_rule


def test_lost_train_note_names_the_restore_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ident = identity_text({"step": "train", "version": 1, "seed": 17})
    (tmp_path / "results/r/hf").mkdir(parents=True)
    (tmp_path / "results/r/hf/manifest.json").write_text("{}")
    assert kr.train_json_lost("results", "r") and kr.lost_train_note("results", "r", ident) is None  # no training
    folder = ckpt.prepare_identity_folder("results/r/checkpoints", ident)
    final = os.path.join(folder, "ep0-ba120-rank0.pt")
    open(final, "w").close()
    ckpt.mark_complete(final, 120)
    ckpt.write_result(folder, {"steps": 120, "final_checkpoint": final})
    note = kr.lost_train_note("results", "r", ident)
    assert note and note.endswith("snakemake results/r/train.json"), note
    assert kr.lost_train_note("results", "r", identity_text({"step": "train", "version": 1, "seed": 18})) is None
    (tmp_path / "results/r/train.json").write_text("{}")
    assert not kr.train_json_lost("results", "r")
