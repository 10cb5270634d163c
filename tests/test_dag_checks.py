"""llmpipe.plan.dag_checks: what the workflow checks and says while the DAG is built, each check once per request or run
(the dry runs of tests/test_plan.py and the Slurm tests see the same through Snakemake)."""

from __future__ import annotations

import types

import pytest

from llmpipe.dispatch import slurm
from llmpipe.config.runs import deep_merge, step_resources
from llmpipe.config.settings import ConfigError
from llmpipe.plan.dag_checks import DagChecks, PreflightRefused
from tests.conftest import project_config


def wildcards(**values):
    return types.SimpleNamespace(**values)


def test_a_runs_plan_is_printed_and_checked_once(capsys):
    config = project_config()
    checks = DagChecks(config)
    for _ in range(3):  # Snakemake asks once per resource of every job
        got = checks.resources("train", wildcards(run="mpt-1b"))
    assert got == step_resources(config, "train", "mpt-1b")
    checks.resources("finetune", wildcards(run="mpt-1b"))  # the same training plan: not printed again
    err = capsys.readouterr().err
    assert err.count("plan train mpt-1b:") == 1, err
    assert checks.planned == {("train", "mpt-1b")}


def test_an_undefined_eval_suite_stops_the_dag_before_any_input_function(tmp_path):
    """Raised by check_settings, the error reaches the user as the other config errors do, not wrapped in
    Snakemake's InputFunctionException with a traceback; finetunes are checked too."""
    base = {"results_dir": str(tmp_path / "results")}
    for section, run in (("models", "mpt-tiny"), ("finetunes", "mpt-tiny-sft")):
        config = deep_merge(project_config(), {**base, section: {run: {"eval_suite": "nope"}}})
        with pytest.raises(ConfigError, match=rf"^{section}\.{run}\.eval_suite is 'nope': eval suite 'nope' is not "
                                              r"defined: known ones are default"):
            DagChecks(config, main_process=False).check_settings()
    DagChecks(deep_merge(project_config(), base), main_process=False).check_settings()


def test_only_the_main_process_prints(capsys):
    checks = DagChecks(project_config(), main_process=False)
    checks.resources("eval", wildcards(run="mpt-1b"))
    assert capsys.readouterr().err == "" and checks.planned == {("eval", "mpt-1b")}


def test_a_plan_that_cannot_fit_stops_with_the_setting_to_change():
    config = deep_merge(project_config(), {"gpu_type": "a100-40gb", "models": {"mpt-70b": {"train": {"fsdp": {
        "activation_checkpointing": False}}}}})
    with pytest.raises(ConfigError, match=r"models\.mpt-70b: the train step of mpt-70b needs about"):
        DagChecks(config).resources("train", wildcards(run="mpt-70b"))


def test_preflight_asks_the_cluster_once_per_request_and_refuses_as_its_own_error(monkeypatch):
    asked = []

    def preflight(config, resources, where="resources"):
        asked.append(where)
        if int(resources["nodes"]) > 4:
            raise ConfigError(f"{where}.nodes is {resources['nodes']}, but the partition has 4 nodes")
        return {}

    monkeypatch.setattr(slurm, "preflight", preflight)
    checks = DagChecks(deep_merge(project_config(), {"dispatch": {"executor": "slurm"}}))
    for _ in range(2):
        checks.resources("convert", wildcards(run="mpt-tiny"))
        checks.resources("scaling_train", wildcards(run="mpt-tiny", nodes="2"))
    assert asked == ["convert.resources", "models.mpt-tiny.resources (scaling at 2 nodes)"]
    with pytest.raises(PreflightRefused, match=r"^models\.mpt-70b\.resources\.nodes is 8, but the partition"):
        checks.resources("train", wildcards(run="mpt-70b"))
    assert checks.dispatch_threads("train", wildcards(run="mpt-70b")) == 0  # a rule that waits on Slurm


def test_threads_are_the_jobs_cpus_on_the_local_executor():
    config = project_config()
    r = step_resources(config, "train", "mpt-tiny")
    assert DagChecks(config).dispatch_threads("train", wildcards(run="mpt-tiny")) == \
        int(r["cpus_per_task"]) * int(r["tasks_per_node"])


def test_multi_node_trainings_are_refused_before_a_local_run_only():
    job = types.SimpleNamespace(rule=types.SimpleNamespace(name="finetune"), wildcards=wildcards(run="big"),
                                resources={"nodes": 2})
    with pytest.raises(ConfigError, match=r"finetunes\.big\.resources \(rule finetune\) needs 2 nodes"):
        DagChecks(project_config()).refuse_local_multi_node([job])
    DagChecks(deep_merge(project_config(), {"dispatch": {"executor": "slurm"}})).refuse_local_multi_node([job])
