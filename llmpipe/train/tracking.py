"""Experiment tracking through llm-foundry's own loggers (composer's MLflow, W&B and TensorBoard destinations).

Off by default (``tracking.loggers: []``). The workflow's ``tracking`` section is never part of a step's identity,
so turning tracking on or off reruns nothing; it changes only what a training job logs from then on.

One tracked run per training identity: the run's id is created once by rank 0 and kept in
``{identity checkpoint folder}/tracking.json`` (``results/{run}/checkpoints/<key>/``), so a resumed or requeued job
of the same identity logs into the same MLflow run / W&B run, with steps continuing at the resumed batch (composer
logs every metric at the trainer's batch count). A changed identity gets a new folder and so a new tracked run.

* MLflow: the run is made here with ``MlflowClient.create_run`` (tags ``llmpipe.run``, ``llmpipe.identity``) and
  handed to composer's ``MLFlowLogger`` through ``MLFLOW_RUN_ID``. Without a tracking URI the store is the local
  folder ``{results_dir}/tracking/mlruns`` (``mlflow ui --backend-store-uri <that folder>``).
* W&B: ``wandb.init(id=<kept id>, resume="allow", mode=offline|online)``, files under the identity folder
  (``wandb/``; offline runs upload with ``wandb sync``). ``wandb`` is an optional extra (``pip install .[wandb]``).
* TensorBoard: event files in ``{identity folder}/tensorboard/`` (needs the ``tensorboard`` package).

Secrets (``WANDB_API_KEY``, ``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``, ...) are read by the
libraries from the environment only; no setting holds one, and the parameters logged are the training's settings.
"""
from __future__ import annotations

import importlib.util
import os
import secrets

from llmpipe.atomic import read_json
from llmpipe.config.settings import ConfigError

LOGGERS = ("mlflow", "wandb", "tensorboard")
#: the package each logger needs, and how to get it
PACKAGES = {"mlflow": ("mlflow", "pip install mlflow"), "wandb": ("wandb", "pip install '.[wandb]' (or wandb)"),
            "tensorboard": ("tensorboard", "pip install tensorboard")}
STATE_FILE = "tracking.json"
#: llm-foundry's hyperparameters that differ between the jobs of one training (resume path, launch details). MLflow
#: refuses a changed parameter value within a run: the identity's first job logs the settings without these, and a
#: resumed job logs none (its identity, so its settings that determine the model, are the same; speed-only settings
#: and node counts may differ and would be refused)
JOB_SPECIFIC_PARAMS = ["load_path", "run_name", "dist_timeout", "node_name", "rank_zero_seed", "num_nodes"]


def settings(config: dict) -> dict | None:
    """The ``tracking`` section of the workflow config with its store resolved, or None when tracking is off.

    Returns ``{loggers, experiment, mlflow_tracking_uri, wandb_mode, wandb_entity}``; a missing MLflow tracking URI
    becomes the file store ``file://{abs results_dir}/tracking/mlruns``.

    Raises:
        ConfigError: a logger's package is not installed here (naming ``tracking.loggers`` and the fix).
    """
    t = dict(config.get("tracking") or {})
    loggers = list(t.get("loggers") or [])
    if not loggers:
        return None
    for name in loggers:
        module, fix = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"tracking.loggers names {name}, but the package {module!r} is not installed. "
                              f"Fix: {fix}, or remove {name} from tracking.loggers.")
    uri = t.get("mlflow_tracking_uri")
    if not uri:
        store = os.path.abspath(os.path.join(config["results_dir"], "tracking", "mlruns"))
        uri = "file://" + store
    return {"loggers": loggers, "experiment": t.get("experiment") or "llmpipe", "mlflow_tracking_uri": uri,
            "wandb_mode": t.get("wandb_mode") or "offline", "wandb_entity": t.get("wandb_entity")}


def read_state(save_folder: str) -> dict:
    """The tracked-run ids kept for an identity (``{mlflow_run_id, mlflow_experiment_id, wandb_id}``) and where its
    loggers write (``experiment``, ``mlflow_tracking_uri``, ``wandb_mode``/``wandb_entity``/``wandb_dir``,
    ``tensorboard_dir``); empty when never tracked."""
    return read_json(os.path.join(save_folder, STATE_FILE), {})


def _write_state(save_folder: str, state: dict) -> None:
    from llmpipe.atomic import atomic_write_json
    atomic_write_json(os.path.join(save_folder, STATE_FILE), state)


def _mlflow_run_id(tracking: dict, run: str, key: str) -> tuple[str, str]:
    """Create the identity's MLflow run (experiment made when missing); return its id and its experiment's id."""
    from mlflow import MlflowClient
    client = MlflowClient(tracking["mlflow_tracking_uri"])
    exp = client.get_experiment_by_name(tracking["experiment"])
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(tracking["experiment"])
    created = client.create_run(exp_id, run_name=f"{run}-{key[:8]}",
                                tags={"llmpipe.run": run, "llmpipe.identity": key})
    return created.info.run_id, str(exp_id)


def _where(tracking: dict, save_folder: str) -> dict:
    """Where this job's loggers write (kept in ``tracking.json`` for the report, :func:`locations`)."""
    folder = os.path.abspath(save_folder)
    out: dict = {"experiment": tracking["experiment"]}
    if "mlflow" in tracking["loggers"]:
        out["mlflow_tracking_uri"] = tracking["mlflow_tracking_uri"]
    if "wandb" in tracking["loggers"]:
        out.update(wandb_mode=tracking["wandb_mode"], wandb_entity=tracking["wandb_entity"],
                   wandb_dir=os.path.join(folder, "wandb"))
    if "tensorboard" in tracking["loggers"]:
        out["tensorboard_dir"] = os.path.join(folder, "tensorboard")
    return out


def locations(state: dict, base: str | None = None) -> list[dict]:
    """Where an identity's tracked run can be looked at, one row per logger it logged to, from its
    ``tracking.json`` (:func:`read_state`); empty when it was never tracked.

    Each row: ``logger``, ``where`` (store / project / folder and the run id) and ``open`` (a URL or the command
    that shows it). Folders under ``base`` (the workflow's folder, when given) are shown relative to it. MLflow over
    HTTP(S) links ``{uri}/#/experiments/{experiment id}/runs/{run id}`` (MLflow UI's route); W&B online with an
    entity links ``https://wandb.ai/{entity}/{project}/runs/{id}`` (a self-hosted W&B: the same path on its host).
    """
    def show(path: str) -> str:
        if base and os.path.abspath(path).startswith(os.path.abspath(base).rstrip(os.sep) + os.sep):
            return os.path.relpath(path, base)
        return path

    rows = []
    exp = state.get("experiment") or "llmpipe"
    if state.get("mlflow_run_id"):
        uri, rid, eid = state.get("mlflow_tracking_uri") or "", state["mlflow_run_id"], state.get("mlflow_experiment_id")
        store = show(uri[len("file://"):]) if uri.startswith("file://") else uri
        if uri.startswith(("http://", "https://")) and eid:
            how = f"{uri.rstrip('/')}/#/experiments/{eid}/runs/{rid}"
        elif uri.startswith("file://"):
            how = f"mlflow ui --backend-store-uri {store}"
        else:
            how = f"MLflow UI on {uri or '?'}"
        kind = "file store" if uri.startswith("file://") else "tracking URI"
        rows.append({"logger": "MLflow", "where": f"{kind} {store or '?'}, experiment {exp}, run id {rid}",
                     "open": how})
    if state.get("wandb_id"):
        wid, mode, entity = state["wandb_id"], state.get("wandb_mode") or "offline", state.get("wandb_entity")
        folder = show(state.get("wandb_dir") or "wandb")
        if mode == "online":
            where = f"project {exp}, run id {wid} (online; files in {folder})"
            how = f"https://wandb.ai/{entity}/{exp}/runs/{wid}" if entity else f"W&B project {exp}, run {wid}"
        else:
            where = f"{folder} (offline), project {exp}, run id {wid}"
            how = f"wandb sync {folder}/offline-run-*-{wid}"
        rows.append({"logger": "W&B", "where": where, "open": how})
    if state.get("tensorboard_dir"):
        folder = show(state["tensorboard_dir"])
        rows.append({"logger": "TensorBoard", "where": folder, "open": f"tensorboard --logdir {folder}"})
    return rows


def foundry_loggers(tracking: dict | None, save_folder: str, rank: int, run: str, key: str) -> dict:
    """The ``loggers`` section of the llm-foundry train config for one training job.

    Args:
        tracking: :func:`settings`' result (None: tracking off, returns ``{}``).
        save_folder: the identity's checkpoint folder (``tracking.json`` and TensorBoard/W&B files live there).
        rank: this process's global rank; rank 0 creates the tracked run ids on the identity's first job, before
            the other ranks read the start plan, so every job of the identity finds the same ids.
        run, key: the run name and the identity key (tags and the tracked run's name).

    Side effect on rank 0 with MLflow: sets ``MLFLOW_RUN_ID`` so composer's ``MLFlowLogger`` continues that run; a
    job continuing a run logs no parameters (:data:`JOB_SPECIFIC_PARAMS`).
    """
    if not tracking:
        return {}
    state = read_state(save_folder)
    resumed = bool(state.get("mlflow_run_id"))
    if rank == 0:
        before = dict(state)
        if "mlflow" in tracking["loggers"] and not state.get("mlflow_run_id"):
            state["mlflow_run_id"], state["mlflow_experiment_id"] = _mlflow_run_id(tracking, run, key)
        if "wandb" in tracking["loggers"] and not state.get("wandb_id"):
            state["wandb_id"] = secrets.token_hex(4)
        state.update(_where(tracking, save_folder))  # the latest job's locations; the ids are never replaced
        if state != before:
            _write_state(save_folder, state)
        if state.get("mlflow_run_id"):
            os.environ["MLFLOW_RUN_ID"] = state["mlflow_run_id"]
    out: dict = {}
    name = f"{run}-{key[:8]}"
    if "mlflow" in tracking["loggers"]:
        out["mlflow"] = {"experiment_name": tracking["experiment"], "tracking_uri": tracking["mlflow_tracking_uri"],
                         "run_name": name, "tags": {"llmpipe.run": run, "llmpipe.identity": key},
                         "log_system_metrics": _has_gpu(),
                         "ignore_hyperparameters": ["*"] if resumed else JOB_SPECIFIC_PARAMS,
                         "synchronous": True}
    if "wandb" in tracking["loggers"]:
        out["wandb"] = {"project": tracking["experiment"], "entity": tracking["wandb_entity"], "name": name,
                        "tags": [run, key[:8]],
                        "init_kwargs": {"id": state.get("wandb_id"), "resume": "allow", "dir": save_folder,
                                        "mode": tracking["wandb_mode"]}}
    if "tensorboard" in tracking["loggers"]:
        out["tensorboard"] = {"log_dir": os.path.join(save_folder, "tensorboard"), "flush_interval": 10}
    return out


def apply(cfg: dict, tracking: dict | None, save_folder: str, rank: int, run: str, key: str) -> None:
    """Set the llm-foundry train config ``cfg``'s loggers (:func:`foundry_loggers`) and, with tracking on, the
    learning-rate callback (composer's ``lr_monitor``), so the tracked run has loss, learning rate, throughput,
    MFU, memory (:class:`llmpipe.train.pretrain.RunMonitor`), evaluation metrics and the settings as parameters."""
    cfg["loggers"] = foundry_loggers(tracking, save_folder, rank, run, key)
    if cfg["loggers"]:
        cfg["callbacks"].setdefault("lr_monitor", {})


def _has_gpu() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except ImportError:
        return False


__all__ = ["settings", "foundry_loggers", "apply", "read_state", "locations", "LOGGERS"]
