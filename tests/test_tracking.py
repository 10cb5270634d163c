"""Experiment tracking (llmpipe/train/tracking.py): off by default, one tracked run per training identity kept beside its
checkpoints, a killed and resumed training continues that run, and tracking never reruns anything."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from collections import Counter

import pytest

from llmpipe.train import tracking
from llmpipe.config.settings import ConfigError
from llmpipe.train.throughput import warmup_batches
from tests.conftest import SHORT_TINY, copy_run, no_symlink_env, planned_jobs, snakemake

mlflow = pytest.importorskip("mlflow")

TRAIN = "results/mpt-tiny/train.json"
MLFLOW_ON = "tracking={'loggers': ['mlflow', 'wandb', 'tensorboard']}"   # W&B in its default offline mode


def test_tracking_is_off_by_default_and_the_file_store_is_under_results(tmp_path):
    assert tracking.settings({}) is None and tracking.settings({"tracking": {"loggers": []}}) is None
    got = tracking.settings({"results_dir": str(tmp_path / "res"), "tracking": {"loggers": ["mlflow"]}})
    assert got["mlflow_tracking_uri"] == "file://" + str(tmp_path / "res" / "tracking" / "mlruns")
    assert got["experiment"] == "llmpipe" and got["wandb_mode"] == "offline"
    given = tracking.settings({"tracking": {"loggers": ["mlflow"], "mlflow_tracking_uri": "http://mlflow:5000"}})
    assert given["mlflow_tracking_uri"] == "http://mlflow:5000"


def test_a_missing_logger_package_names_the_setting(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tracking\.loggers names wandb.*Fix: pip install"):
        tracking.settings({"tracking": {"loggers": ["mlflow", "wandb"]}})


def test_one_tracked_run_per_identity_kept_in_its_checkpoint_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_RUN_ID", "")   # restored (to unset) after the test: foundry_loggers sets it
    monkeypatch.delenv("MLFLOW_RUN_ID")
    t = tracking.settings({"results_dir": str(tmp_path), "tracking": {"loggers": ["mlflow", "wandb"]}})
    key_a, key_b = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"
    a, b = tmp_path / "ck" / key_a, tmp_path / "ck" / key_b
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    first = tracking.foundry_loggers(t, str(a), 0, "mpt-tiny", key_a)
    state = json.loads((a / "tracking.json").read_text())
    assert state["mlflow_run_id"] and state["wandb_id"]
    init = first["wandb"]["init_kwargs"]
    assert init["id"] == state["wandb_id"] and init["mode"] == "offline" and init["resume"] == "allow"
    again = tracking.foundry_loggers(t, str(a), 0, "mpt-tiny", key_a)   # a resumed job of the same identity
    assert json.loads((a / "tracking.json").read_text()) == state and again["wandb"] == first["wandb"]
    # the continuing job logs no parameters: MLflow refuses changed values (a speed-only setting, the node count)
    assert first["mlflow"]["ignore_hyperparameters"] == tracking.JOB_SPECIFIC_PARAMS
    assert again["mlflow"]["ignore_hyperparameters"] == ["*"]
    assert os.environ["MLFLOW_RUN_ID"] == state["mlflow_run_id"]
    tracking.foundry_loggers(t, str(b), 0, "mpt-tiny", key_b)           # another identity: another run
    other = json.loads((b / "tracking.json").read_text())
    assert other["mlflow_run_id"] != state["mlflow_run_id"] and other["wandb_id"] != state["wandb_id"]
    client = mlflow.MlflowClient(t["mlflow_tracking_uri"])
    run = client.get_run(state["mlflow_run_id"])
    assert run.data.tags["llmpipe.identity"] == key_a and run.data.tags["llmpipe.run"] == "mpt-tiny"
    # other ranks never create ids; tracking off gives no loggers
    c = tmp_path / "ck" / "cccccccccccccccc"
    c.mkdir()
    tracking.foundry_loggers(t, str(c), 1, "mpt-tiny", "c" * 16)
    assert not (c / "tracking.json").exists()
    assert tracking.foundry_loggers(None, str(c), 0, "mpt-tiny", "c" * 16) == {}


@pytest.mark.slow
def test_tracked_training_killed_and_resumed_is_one_run_with_continuous_steps(tiny_run, tmp_path):
    """MLflow file store, W&B offline and TensorBoard: the short tiny training (:data:`tests.conftest.SHORT_TRAIN`, 60
    batches) SIGKILLed after its batch-20 checkpoint, then resumed, logs into one MLflow run whose steps run on from the resumed batch, and into TensorBoard event files read
    back as one run with the same steps; the resumed job's train.json has steady-state figures consistent with its
    loss log, and its step log the live lines. Turning tracking on or off reruns nothing."""
    wd = copy_run(tiny_run, tmp_path / "wd")
    assert planned_jobs(snakemake(wd, "-n", "--config", MLFLOW_ON)) == {}   # finished runs: nothing reruns
    shutil.rmtree(wd / "results/mpt-tiny/checkpoints")
    (wd / TRAIN).unlink()
    env = {**no_symlink_env(wd), "LLMPIPE_TEST_KILL_AT": str(wd / "results/mpt-tiny/checkpoints/*/ep0-ba20*.complete")}
    proc = snakemake(wd, "--cores", "2", TRAIN, "--config", MLFLOW_ON, SHORT_TINY, env=env, check=False)  # after ba20
    assert proc.returncode != 0, proc.stdout[-3000:]
    # resumed with a changed speed-only setting (same identity, same tracked run; a parameter value MLflow would refuse)
    snakemake(wd, "--cores", "2", TRAIN, "--config", MLFLOW_ON,
              SHORT_TINY.replace("'save_interval_batches': 20", "'save_interval_batches': 10"), env=no_symlink_env(wd))
    train = json.loads((wd / TRAIN).read_text())
    assert train["steps"] == 60 and train["resumed_from"].endswith("ep0-ba20-rank0.pt")
    assert train["batches_this_job"] == 40

    folder = wd / train["train_log"].rsplit("/", 1)[0]
    state = json.loads((folder / "tracking.json").read_text())
    client = mlflow.MlflowClient("file://" + str(wd / "results/tracking/mlruns"))
    exp = client.get_experiment_by_name("llmpipe")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [state["mlflow_run_id"]]       # one tracked run for both jobs
    run = runs[0]
    assert run.data.tags["llmpipe.identity"] == folder.name
    keys = set(run.data.metrics)
    for k in ("loss/train/total", "llmpipe/tokens_per_s", "llmpipe/memory_gib", "llmpipe/eta_s",
              "llmpipe/steady_tokens_per_s", "metrics/eval/LanguageCrossEntropy"):
        assert k in keys, sorted(keys)
    assert any(k.startswith("lr-") for k in keys), sorted(keys)
    assert run.data.params, "the training's settings are logged as parameters"
    steps = sorted({m.step for m in client.get_metric_history(run.info.run_id, "loss/train/total")})
    assert steps == list(range(60)), steps             # composer logs at the batch count before the step: 0 .. 59
    tps_steps = [m.step for m in client.get_metric_history(run.info.run_id, "llmpipe/tokens_per_s")]
    assert min(tps_steps) == 1 and max(tps_steps) == 60 and 15 in tps_steps and 25 in tps_steps   # both jobs

    # TensorBoard: both jobs' event files in the identity's folder (composer: tensorboard/<run name>/, a new file
    # after every flush, named ...<host>.<pid>.<n>), read back together as one run with the same metric steps as
    # MLflow's
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = folder / "tensorboard" / "mpt-tiny"
    files = sorted(p.name for p in tb.glob("events.out.tfevents.*"))
    assert len({name.split(".")[-2] for name in files}) == 2, files     # two processes: the killed and the resumed
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for k in ("loss/train/total", "llmpipe/tokens_per_s", "llmpipe/memory_gib", "llmpipe/eta_s",
              "metrics/eval/LanguageCrossEntropy"):
        assert k in tags, sorted(tags)
    assert any(k.startswith("lr-") for k in tags), sorted(tags)
    tb_steps = Counter(e.step for e in acc.Scalars("loss/train/total"))
    assert sorted(tb_steps) == steps
    # a step shows twice only where the killed job trained past its last checkpoint (batch 20) and the resumed one
    # trained that batch again (composer's logger opens its writer without TensorBoard's purge_step)
    assert all(s >= 20 for s, n in tb_steps.items() if n > 1), tb_steps
    assert {e.step for e in acc.Scalars("llmpipe/tokens_per_s")} == set(tps_steps)

    # W&B offline: each job's run folder carries the identity's one run id (wandb sync merges them)
    offline = sorted(p.name for p in (folder / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(n.endswith("-" + state["wandb_id"]) for n in offline), offline

    # steady state of the resumed job (its own batches only) against its loss log
    w = train["steady_window"]
    per_batch = train["global_batch_size"] * train["concat_tokens"]
    assert w["warmup_batches"] == warmup_batches(train["batches_this_job"])
    assert w["batches"] + w["excluded_batches"] + w["warmup_batches"] == train["batches_this_job"]
    assert w["excluded_batches"] >= 1 and w["tokens"] == w["batches"] * per_batch
    assert w["first_batch"] > 60 - train["batches_this_job"] + w["warmup_batches"] - 1
    assert train["steady_tokens_per_s"] == pytest.approx(w["tokens"] / w["seconds"], rel=1e-3)
    log = {r["batch"]: r for r in map(json.loads, (wd / train["train_log"]).read_text().splitlines())}
    assert all(r["tokens"] == b * per_batch for b, r in log.items())
    # the window lies inside this job's time (elapsed_s counts from its fit start): from its last logged batch before
    # the window, or from its start where it logged none (the rows up to the resumed batch are the killed job's)
    resumed_at = int(re.search(r"-ba(\d+)-rank0\.pt$", train["resumed_from"]).group(1))
    start = max((b for b in log if resumed_at < b < w["first_batch"]), default=None)
    since = log[start]["elapsed_s"] if start is not None else 0.0
    assert 0 < w["seconds"] <= log[w["last_batch"]]["elapsed_s"] - since + 0.01
    # the whole-run figure divides all of this job's tokens by the time from fit start to the end, which holds the
    # steady window's intervals; the two rates are not ordered (the window drops eval/save intervals that may cost
    # almost nothing in a tiny run), their times and tokens are
    fit_s = train["batches_this_job"] * per_batch / train["tokens_per_s"]
    assert fit_s >= w["seconds"] * (1 - 1e-3) and train["batches_this_job"] * per_batch > w["tokens"]
    out = "".join(p.read_text(errors="replace") for p in (wd / "results/logs/train").rglob("*.out"))
    lines = re.findall(r"llmpipe: batch (\d+)/60  loss \S+  tokens/s \S+  MFU -  mem \S+ GiB  ETA \d+:\d\d:\d\d",
                       out)
    assert {1, 20, 60} <= {int(b) for b in lines}, out[-3000:]

    # switching tracking off again retrains nothing
    assert planned_jobs(snakemake(wd, "-n", TRAIN, "--config", SHORT_TINY)) == {}
