"""The steps package: one rule table (the registered steps) and one script for every rule, identity as dicts (and the upgrade from the legacy text form
without retraining), and the provenance record every step writes beside its output."""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pandas as pd
import pytest

from llmpipe.config.runs import run_config
from llmpipe.config.identity import identity_text, parse_identity, same_identity
from llmpipe.dispatch.jobs import StepFailed
from llmpipe.steps import RULES, THIS_RUN, Rule, console_failure, context, run_rule, run_step
from llmpipe.steps.prepare import mds_identity
from llmpipe.steps.provenance import provenance_path
from llmpipe.steps.training import train_identity
from llmpipe.train import checkpoints as ckpt
from tests.conftest import REPO, project_config


class NamedList(list):
    """Snakemake's named list (input, output, params): a list whose entries also have names."""

    def __init__(self, **named):
        super().__init__(named.values())
        self.__dict__.update(named)

    def items(self):
        return list(self.__dict__.items())


def load_config() -> dict:
    """The shipped config as a workflow run sees it (typed, defaults filled)."""
    return project_config()


#: Prints the workflow's rules as Snakemake reads them: name -> script, log patterns, number of outputs.
LIST_RULES = """
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import OutputSettings, ResourceSettings
with SnakemakeApi(OutputSettings()) as api:
    wf = api.workflow(resource_settings=ResourceSettings(), snakefile=Path(sys.argv[1]), workdir=Path(sys.argv[2]))
    rules = {r.name: {"script": r.script, "log": [str(f) for f in r.log], "output": len(r.output)}
             for r in wf._workflow.rules}
print("RULES=" + json.dumps(rules))
"""


@functools.cache
def workflow_rules() -> dict[str, dict]:
    """Every rule of the workflow, read once by Snakemake itself: name -> ``{script, log, output}``."""
    with tempfile.TemporaryDirectory() as wd:
        proc = subprocess.run([sys.executable, "-c", LIST_RULES, str(REPO / "Snakefile"), wd], cwd=wd,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RULES=")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[len("RULES="):])


# ------------------------------------------------------------------------------------------- one shape

def test_every_rule_with_a_script_runs_a_registered_step_through_the_one_script():
    """The rule table is once: the rules with a script are exactly the registered steps, each rule's script is
    scripts/run_rule.py, the only rule script there is, and the rules without one are targets only."""
    rules = workflow_rules()
    scripted = {name for name, r in rules.items() if r["script"]}
    assert scripted == set(RULES), f"rules without a registered step or steps without a rule: {scripted ^ set(RULES)}"
    assert {r["script"] for r in rules.values() if r["script"]} == {"../scripts/run_rule.py"}
    assert sorted(p.name for p in (REPO / "scripts").iterdir() if p.suffix == ".py") == ["run_rule.py"]
    code = [ln for ln in (REPO / "scripts/run_rule.py").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert code[0] == "try:" and code[1].strip() == "from llmpipe.steps import run_rule" and code[-1] == \
        "run_rule(snakemake)  # noqa: F821 - injected by Snakemake"   # an import failure is logged, then re-raised
    assert all(r["output"] == 0 for name, r in rules.items() if name not in scripted)
    for name in scripted:  # one log under results/logs/: beside it, the submitit folder of a dispatching step
        assert len(rules[name]["log"]) == 1 and rules[name]["log"][0].startswith("results/logs/"), name


def test_rule_files_define_no_function_named_like_a_package_function():
    """A function of rules/common.smk never shares its name with one in llmpipe/ (same name, other signature)."""
    smk_functions = set(re.findall(r"^def (\w+)\(", (REPO / "rules/common.smk").read_text(), re.M))
    package = {node.name for path in (REPO / "llmpipe").rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert not smk_functions & package, sorted(smk_functions & package)


def test_rule_files_have_no_lambdas_and_their_functions_are_in_common_smk():
    """Named functions only, all in rules/common.smk, which has no rules (snakemake --lint: no file mixes them)."""
    for smk in [REPO / "Snakefile", *(REPO / "rules").glob("*.smk")]:
        text = smk.read_text()
        assert "lambda" not in text, smk
        if smk.name == "common.smk":
            assert not re.search(r"rule .+?:", text), "the linter would take rules/common.smk for a rule file"
        else:
            assert not re.search(r"^def ", text, re.M), f"{smk}: move its functions to rules/common.smk"


def test_steps_package_imports_no_private_names_across_modules():
    for path in (REPO / "llmpipe" / "steps").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmpipe"):
                assert not [a.name for a in node.names if a.name.startswith("_")], (path, node.module)


def test_context_names_log_folder_resources_and_key_once():
    config = load_config()
    smk = types.SimpleNamespace(rule="train", config=config, wildcards=types.SimpleNamespace(run="mpt-tiny"),
                                input=[], output=["results/mpt-tiny/train.json"], params=["{}"],
                                log=[os.path.join(config["results_dir"], "logs/train/mpt-tiny.log")])
    ctx = context(smk, RULES["train"])
    assert ctx.log_dir == os.path.join(config["results_dir"], "logs", "train", "mpt-tiny.submitit")
    assert ctx.resources["nodes"] == 1 and "time_min" in ctx.resources
    assert ctx.executor == config["dispatch"]["executor"] and re.fullmatch(r"[0-9a-f]{16}", ctx.key)
    scaling = types.SimpleNamespace(**{**vars(smk), "rule": "scaling_train",
                                       "wildcards": types.SimpleNamespace(run="mpt-tiny", nodes="1"),
                                       "log": [os.path.join(config["results_dir"], "logs/scaling/mpt-tiny/nodes1.log")]})
    assert context(scaling, RULES["scaling_train"]).log_dir.endswith("logs/scaling/mpt-tiny/nodes1.submitit")
    report = context(types.SimpleNamespace(**{**vars(smk), "rule": "report"}), RULES["report"])
    assert report.log_dir is None and report.resources == {}  # a step that dispatches nothing
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rule = "other"


# ------------------------------------------------------------------------------------------- identity

def legacy_text(identity: dict) -> str:
    """The identity text as written before identities were dicts: every nested step identity (a dict with a
    ``step`` key) was itself canonical JSON text inside the outer JSON."""
    def encode(value, top=False):
        if isinstance(value, dict):
            inner = {k: encode(v) for k, v in value.items()}
            return inner if top or "step" not in value else identity_text(inner)
        if isinstance(value, list):
            return [encode(v) for v in value]
        return value
    return identity_text(encode(identity, top=True))


def test_identity_is_a_dict_without_text_inside():
    config = load_config()
    ident = train_identity(config, "mpt-tiny")
    d = run_config(config, "mpt-tiny")["data"]
    assert ident["data"] == mds_identity(config, d["corpus"], d["tokenizer"], d["concat_tokens"])
    assert isinstance(ident["data"]["tokenizer"], dict) and ident["data"]["tokenizer"]["step"] == "tokenizer"
    assert '\\"' not in identity_text(ident)  # no escaped quotes: nothing is JSON text inside JSON text


def test_legacy_nested_text_means_the_same_identity():
    legacy = '{"data":"{\\"concat_tokens\\":128,\\"step\\":\\"mds\\",\\"version\\":1}","step":"train","version":1}'
    new = identity_text({"step": "train", "version": 1, "data": {"step": "mds", "version": 1, "concat_tokens": 128}})
    assert same_identity(legacy, new) and parse_identity(legacy) == json.loads(new)
    other = new.replace('"concat_tokens":128', '"concat_tokens":64')
    assert not same_identity(legacy, other)
    ident = train_identity(load_config(), "mpt-tiny")
    assert legacy_text(ident) != identity_text(ident) and same_identity(legacy_text(ident), identity_text(ident))


def test_whole_number_floats_do_not_change_the_identity():
    """``weight_decay: 0`` restates the shipped ``0.0`` (and ``temperature: 1`` the shipped ``1.0``): the same
    identity text, so nothing retrains; an identity written with ``0.0`` before compares equal to it."""
    from llmpipe.steps.generate import generate_identity

    base = load_config()
    restated = copy.deepcopy(base)
    restated["model_defaults"]["train"]["optimizer"]["weight_decay"] = 0
    restated["model_defaults"]["train"]["grad_clip_norm"] = 1
    restated["generate"]["temperature"] = 1
    assert base["model_defaults"]["train"]["optimizer"]["weight_decay"] == 0.0
    assert identity_text(train_identity(restated, "mpt-1b")) == identity_text(train_identity(base, "mpt-1b"))
    assert identity_text(generate_identity(restated, "mpt-1b")) == identity_text(generate_identity(base, "mpt-1b"))
    assert same_identity('{"lr":0.0006,"weight_decay":0.0}', '{"lr":0.0006,"weight_decay":0}')
    assert not same_identity('{"lr":0.0006}', '{"lr":0.0007}')
    changed = copy.deepcopy(base)
    changed["model_defaults"]["train"]["optimizer"]["weight_decay"] = 0.1
    assert identity_text(train_identity(changed, "mpt-1b")) != identity_text(train_identity(base, "mpt-1b"))


def finished_save_folder(path: str, identity: str) -> str:
    """A checkpoint folder of the earlier flat layout as a finished tiny training left it: final checkpoint,
    marker, record, identity, all directly in ``path``."""
    import torch
    os.makedirs(path)
    for batch in (80, 100):
        torch.save({"state": {"model": {}}}, os.path.join(path, f"ep0-ba{batch}-rank0.pt"))
    for name, text in [("ep0-ba80-rank0.pt.complete", "80"), ("ep0-ba100-rank0.pt.complete", "100"),
                       ("identity.json", identity)]:
        with open(os.path.join(path, name), "w") as fh:
            fh.write(text)
    with open(os.path.join(path, "result.json"), "w") as fh:
        json.dump({"steps": 100, "final_checkpoint": os.path.join(path, "ep0-ba100-rank0.pt")}, fh)
    return path


def test_finished_training_with_legacy_identity_is_kept_and_recognized(tmp_path):
    """After the upgrade the train step gets its identity in the new text form; a finished training whose
    identity.json holds the legacy form keeps every checkpoint and is recognized as finished (no retraining),
    and identity.json is rewritten in the new form."""
    ident = train_identity(load_config(), "mpt-tiny")
    root = finished_save_folder(str(tmp_path / "checkpoints"), legacy_text(ident))
    before = sorted(os.listdir(root))
    folder = ckpt.prepare_identity_folder(root, identity_text(ident))
    assert os.path.dirname(folder) == root and os.listdir(root) == [os.path.basename(folder)]  # the flat files moved
    assert sorted(os.listdir(folder)) == sorted(before + ["last_used"])
    assert Path(os.path.join(folder, "identity.json")).read_text() == identity_text(ident)
    newest = ckpt.newest_checkpoint(folder)
    assert newest.endswith("ep0-ba100-rank0.pt")
    assert ckpt.finished_result(folder, newest, 100)["steps"] == 100


def test_train_step_returns_a_finished_legacy_training_without_a_job(tmp_path):
    """Rule train as Snakemake runs it once after the upgrade: the save folder of a finished training holds the
    legacy identity text; the step writes the recorded result as train.json without submitting a job (the config's
    executor cannot run one), keeps every checkpoint and rewrites identity.json in the new form."""
    config = load_config()
    config["dispatch"] = {**config["dispatch"], "executor": "none: a job here would be a retraining"}
    config["models"]["mpt-tiny"].setdefault("train", {})["max_duration_batches"] = 100  # the folder's final step
    ident = train_identity(config, "mpt-tiny")
    run_dir = tmp_path / "results" / "mpt-tiny"
    root = finished_save_folder(str(run_dir / "checkpoints"), legacy_text(ident))
    before = sorted(os.listdir(root))
    tok = tmp_path / "results" / "tokenizers" / "t" / "manifest.json"
    tok.parent.mkdir(parents=True)
    tok.write_text(json.dumps({"vocab_size": 64}))
    smk = types.SimpleNamespace(rule="train", config=config, wildcards=NamedList(run="mpt-tiny"),
                                input=NamedList(data=str(tmp_path / "verified.json"), tokenizer=str(tok), gate=[]),
                                output=[str(run_dir / "train.json")], params=NamedList(identity=identity_text(ident)),
                                log=[str(tmp_path / "logs" / "train.log")])
    run_rule(smk)
    assert json.loads((run_dir / "train.json").read_text())["steps"] == 100
    folder = ckpt.identity_folder(root, identity_text(ident))
    assert sorted(os.listdir(folder)) == sorted(before + ["last_used"])
    assert Path(folder, "identity.json").read_text() == identity_text(ident)
    assert "training already complete" in Path(smk.log[0]).read_text()
    assert json.loads(Path(provenance_path(smk.output[0])).read_text())["identity"] == ident


def test_changed_identity_gets_its_own_folder_and_keeps_the_finished_one(tmp_path):
    config = load_config()
    old = train_identity(config, "mpt-tiny")
    root = finished_save_folder(str(tmp_path / "checkpoints"), legacy_text(old))
    config["models"]["mpt-tiny"].setdefault("train", {})["seed"] = 12345
    new = ckpt.prepare_identity_folder(root, identity_text(train_identity(config, "mpt-tiny")))
    assert sorted(os.listdir(new)) == ["identity.json", "last_used"]
    assert ckpt.recorded_result(root, identity_text(old), 100)["steps"] == 100


# ------------------------------------------------------------------------------------------- provenance

def gate_smk(tmp_path, busbw: float) -> types.SimpleNamespace:
    csv = tmp_path / "nodes2.csv"
    pd.DataFrame([{"size_bytes": 1024, "ip_busbw_gbps": busbw, "oop_busbw_gbps": busbw, "ip_wrong": 0,
                   "oop_wrong": 0, "nodes": 2, "ranks": 2, "backend": "gloo"}]).to_csv(csv, index=False)
    config = {**load_config(), "results_dir": str(tmp_path / "results"),
              "allreduce": {"max_bytes": 4096, "gate": {"size_bytes": 1024, "min_busbw_gbps": 1.0}}}
    out = str(tmp_path / "gate" / "mpt-tiny.json")
    gate = identity_text(config["allreduce"]["gate"])
    return types.SimpleNamespace(rule="allreduce_gate", config=config, wildcards=types.SimpleNamespace(run="mpt-tiny"),
                                 input=NamedList(csv=str(csv)), output=[out], params=NamedList(gate=gate),
                                 log=[str(tmp_path / "logs" / "gate.log")])


def test_a_step_writes_its_provenance_beside_its_output(tmp_path):
    smk = gate_smk(tmp_path, busbw=5.0)
    run_rule(smk)
    out = smk.output[0]
    rec = json.loads(Path(provenance_path(out)).read_text())
    assert provenance_path(out) == out + ".provenance.json"
    assert json.loads(Path(out).read_text())["passed"] is True
    assert rec["rule"] == "allreduce_gate" and rec["wildcards"] == {"run": "mpt-tiny"}
    assert rec["settings"] == {"gate": {"size_bytes": 1024, "min_busbw_gbps": 1.0}, "health": None}
    assert rec["params"]["gate"] == {"size_bytes": 1024, "min_busbw_gbps": 1.0}
    assert rec["git"] is None or re.fullmatch(r"[0-9a-f]{40}", rec["git"]["commit"])
    assert {"llmpipe", "torch", "mosaicml", "llm-foundry", "mosaicml-streaming", "transformers",
            "snakemake"} <= set(rec["packages"])
    assert rec["packages"]["snakemake"] and rec["host"] and rec["time"].endswith("+00:00")


def test_a_failed_step_leaves_no_provenance(tmp_path, capsys):
    smk = gate_smk(tmp_path, busbw=0.5)  # below the gate's threshold: the step raises
    os.makedirs(os.path.dirname(smk.output[0]))
    with open(provenance_path(smk.output[0]), "w") as fh:
        fh.write("{}")  # an earlier execution's record
    with pytest.raises(SystemExit) as ended:
        run_rule(smk)
    assert ended.value.code == 1
    assert not os.path.exists(smk.output[0]) and not os.path.exists(provenance_path(smk.output[0]))
    log = Path(smk.log[0]).read_text()
    assert "ERROR: RuntimeError" in log and "training refuses to start" in log and "Traceback" in log
    # the console: the error once, no traceback, and where the rule log is
    err = capsys.readouterr().err
    assert err.count("training refuses to start") == 1 and "Traceback" not in err, err
    assert f"rule log (with the traceback): {smk.log[0]}" in err, err


@pytest.mark.parametrize("ending, status", [(SystemExit("gate: terminated by signal 15"), 1),
                                            (KeyboardInterrupt(), 130), (SystemExit(3), 3)])
def test_every_exit_of_the_rule_script_leaves_its_reason_in_the_rule_log(tmp_path, monkeypatch, ending, status):
    """An exit that is no error of the step (SIGTERM while waiting becomes SystemExit, Ctrl-C, sys.exit) ends the
    rule script as it asks, with its reason appended to the rule log (it left the log empty: exit 1, no reason)."""
    import llmpipe.steps as steps

    smk = gate_smk(tmp_path, busbw=2.0)

    def ends(*args, **kwargs):
        raise ending
    monkeypatch.setattr(steps, "run_step", ends)
    with pytest.raises(SystemExit if isinstance(ending, KeyboardInterrupt) else type(ending)) as raised:
        run_rule(smk)
    log = Path(smk.log[0]).read_text()
    if isinstance(ending, KeyboardInterrupt):   # an interrupt: one line, exit 130 (llmpipe.dispatch.interrupts)
        assert raised.value.code == status and f"{smk.rule}: interrupted" in log and "Traceback" not in log, log
        return
    assert f"ERROR: the step was ended by {type(ending).__name__}" in log and f"(exit status {status})" in log, log
    if str(ending):
        assert str(ending) in log, log


def test_an_import_failure_of_the_rule_script_is_in_the_rule_log(tmp_path):
    """scripts/run_rule.py itself: when llmpipe.steps does not import, the traceback goes to the rule log."""
    import subprocess
    import sys

    (tmp_path / "llmpipe").mkdir()
    (tmp_path / "llmpipe" / "__init__.py").write_text("raise ImportError('a broken package')\n")
    log = tmp_path / "rule.log"
    code = (f"import types; snakemake = types.SimpleNamespace(log=[{str(log)!r}]); "
            f"exec(open({str(REPO / 'scripts/run_rule.py')!r}).read())")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert p.returncode == 1
    text = log.read_text()
    assert "ERROR: the rule script could not import llmpipe.steps" in text and "a broken package" in text, text


def test_a_failed_job_shows_its_error_and_a_short_log_tail_on_the_console():
    tail = "\n".join(f"line {i}" for i in range(40))
    exc = StepFailed(f"eval r: job 7 ended in state FAILED: KeyError: 'x'\nlog: /logs/7_0_log.err\n"
                     f"--- stderr (last 40 lines) ---\n{tail}\n--- stdout (last 40 lines) ---\nonly one", "FAILED")
    text = console_failure(exc, "results/logs/eval/r.log")
    assert text.splitlines()[:2] == ["StepFailed: eval r: job 7 ended in state FAILED: KeyError: 'x'",
                                     "log: /logs/7_0_log.err"]
    assert "--- stderr (last 12 lines; the rule log has more) ---\nline 28\n" in text and "line 27" not in text
    assert text.endswith("--- stdout (last 12 lines; the rule log has more) ---\nonly one\n"
                         "rule log: results/logs/eval/r.log"), text


def test_a_failed_write_of_the_step_itself_is_named_by_its_errno_and_path():
    import errno

    exc = OSError(errno.ENOSPC, "No space left on device", "/r/mpt-tiny/train.json.tmp")
    assert console_failure(exc, "results/logs/train/r.log").splitlines()[0] == \
        "ENOSPC (No space left on device) on /r/mpt-tiny/train.json.tmp (OSError)"


def test_provenance_records_identity_and_version(tmp_path):
    out = str(tmp_path / "x.json")
    ident = {"step": "demo", "version": 3, "inner": {"step": "mds", "version": 1}}

    def demo_step(ctx):
        ctx.write_json({"ok": True})
        return {"used": 1}

    ctx = context(types.SimpleNamespace(rule="demo", config={"results_dir": str(tmp_path)}, wildcards={},
                                        input=[], output=[out], log=[str(tmp_path / "demo.log")],
                                        params=NamedList(identity=identity_text(ident))),
                  Rule(demo_step))
    assert run_step(ctx, Rule(demo_step)) == {"used": 1}
    rec = json.loads(Path(provenance_path(out)).read_text())
    assert rec["identity"] == ident and rec["version"] == 3 and rec["settings"] == {"used": 1}


@pytest.mark.slow
def test_upgraded_finished_training_returns_its_result_at_once(tiny_run, tmp_path):
    """A finished tiny run whose identity.json holds the legacy nested-text form, rerun as Snakemake plans it once
    after the upgrade (here forced): the train step keeps every checkpoint, trains nothing, returns the recorded
    result and rewrites identity.json in the new form."""
    from tests.conftest import copy_run, snakemake

    wd = copy_run(tiny_run, tmp_path / "wd")
    ck = wd / "results/mpt-tiny/checkpoints"
    (key,) = os.listdir(ck)
    for name in os.listdir(ck / key):  # back to the flat layout of earlier versions
        os.replace(ck / key / name, ck / name)
    os.rmdir(ck / key)
    new_text = (ck / "identity.json").read_text()
    (ck / "identity.json").write_text(legacy_text(json.loads(new_text)))
    os.replace(ck / "train_log.jsonl", ck.parent / "train_log.jsonl")  # where earlier versions kept the loss log
    train0 = json.loads((wd / "results/mpt-tiny/train.json").read_text())
    flat = {**train0, "final_checkpoint": train0["final_checkpoint"].replace(f"/{key}/", "/"),
            "train_log": "results/mpt-tiny/train_log.jsonl"}
    (ck / "result.json").write_text(json.dumps(flat))
    (wd / "results/mpt-tiny/train.json").write_text(json.dumps(flat))
    before = sorted(os.listdir(ck))
    snakemake(wd, "--cores", "2", "--forcerun", "train", "--", "results/mpt-tiny/train.json")
    assert json.loads((wd / "results/mpt-tiny/train.json").read_text()) == train0  # paths now in the key folder
    assert os.listdir(ck) == [key] and sorted(os.listdir(ck / key)) == sorted(before + ["train_log.jsonl"])
    assert (ck / key / "identity.json").read_text() == new_text
    log = (wd / "results/logs/train/mpt-tiny.log").read_text()
    assert "training already complete" in log and "submitted job" not in log.split(THIS_RUN)[-1], log
    prov = json.loads((wd / "results/mpt-tiny/train.json.provenance.json").read_text())
    assert prov["identity"] == json.loads(new_text) and prov["version"] == 1


def test_scaling_table_step_writes_its_files_and_provenance(tmp_path):
    """Rule scaling_table through the same entry as every rule (its real run needs a Slurm cluster)."""
    base = {"run": "m", "steps": 12, "global_batch_size": 16, "concat_tokens": 128, "tokens": 1000,
            "tokens_per_s": 100.0, "tokens_per_s_per_device": 100.0, "mfu": None, "device": "cpu"}
    inputs = []
    for nodes, wall in ((1, 40.0), (2, 25.0)):
        p = tmp_path / "scaling" / "m" / f"nodes{nodes}" / "train.json"
        p.parent.mkdir(parents=True)
        p.write_text(json.dumps({**base, "nodes": nodes, "devices": nodes, "wall_clock_s": wall}))
        inputs.append(str(p))
    out = NamedList(csv=str(tmp_path / "scaling.csv"), md=str(tmp_path / "scaling.md"),
                    png=str(tmp_path / "speedup.png"))
    run_rule(types.SimpleNamespace(rule="scaling_table", config={"results_dir": str(tmp_path)},
                                   wildcards=NamedList(run="m"), input=inputs, output=out, params=NamedList(),
                                   log=[str(tmp_path / "logs" / "table.log")]))
    df = pd.read_csv(out.csv)
    assert list(df["nodes"]) == [1, 2] and list(df["speedup"]) == [1.0, 1.6]
    assert "Node scaling of m" in Path(out.md).read_text() and os.path.getsize(out.png) > 1000
    rec = json.loads(Path(provenance_path(out.csv)).read_text())
    assert rec["rule"] == "scaling_table" and rec["settings"] == {"nodes": [1, 2]} and rec["identity"] is None
