"""The report: Table 1 from the real tiny run's results, Table 2 and the projection from known numbers, the plots,
and Snakemake's HTML report; only requested runs or runs with results are included."""

from __future__ import annotations

import base64
import json
import math
import re

import pandas as pd
import pytest

from llmpipe.report import tables as report, run_page as run_report
from llmpipe.train import tracking
from llmpipe.config.runs import tokens_per_run
from llmpipe.model.mfu import flops_per_token
from tests.conftest import copy_run, planned_jobs, project_config, snakemake

PNG = b"\x89PNG\r\n\x1a\n"


def load_config() -> dict:
    return project_config()


def test_dry_run_includes_only_requested_runs(workdir):
    jobs = planned_jobs(snakemake(workdir, "-n", "report"))
    assert jobs.get("report") == 1 and jobs.get("train") == 1 and jobs.get("eval") == 1, jobs  # mpt-tiny only
    jobs = planned_jobs(snakemake(workdir, "-n", "--config", "report={'runs': []}", "--", "report"))
    assert jobs == {"report": 1}, jobs


@pytest.mark.slow
def test_tables_and_plots_from_the_tiny_run(tiny_run, tmp_path):
    wd = copy_run(tiny_run, tmp_path / "wd")
    # another configured model with results on disk is included although not requested (a stand-in train.json)
    (wd / "results/mpt-125m").mkdir()
    other = json.loads((wd / "results/mpt-tiny/train.json").read_text())
    other.update(run="mpt-125m", steps=4800, wall_clock_s=547.9, tokens_per_s=6589902.0, devices=64, nodes=8,
                 tokens_per_s_per_device=None, train_log=None)
    (wd / "results/mpt-125m/train.json").write_text(json.dumps(other))
    jobs = planned_jobs(snakemake(wd, "-n", "report"))
    assert jobs == {"report": 1, "report_run": 2}, jobs  # everything it reads exists: nothing is trained or evaluated
    # the tiny run's tracked run, made as its training job makes it (MLflow file store, W&B offline, TensorBoard)
    train = json.loads((wd / "results/mpt-tiny/train.json").read_text())
    folder = wd / train["train_log"].rsplit("/", 1)[0]
    t = tracking.settings({"results_dir": str(wd / "results"),
                           "tracking": {"loggers": ["mlflow", "wandb", "tensorboard"]}})
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_RUN_ID", raising=False)   # foundry_loggers sets it
        tracking.foundry_loggers(t, str(folder), 0, "mpt-tiny", folder.name)
    state = json.loads((folder / "tracking.json").read_text())
    snakemake(wd, "--cores", "1", "report")
    out = wd / "results/report"
    train = json.loads((wd / "results/mpt-tiny/train.json").read_text())
    ev = json.loads((wd / "results/mpt-tiny/eval.json").read_text())
    t1 = pd.read_csv(out / "table1_pretraining.csv")
    assert list(t1["model"]) == ["mpt-tiny", "mpt-125m"]
    row = t1.iloc[0]
    assert row["throughput, whole run (tokens/s)"] == train["tokens_per_s"]
    assert row["throughput, steady state (tokens/s)"] == train["steady_tokens_per_s"]
    assert row["wall clock (s)"] == train["wall_clock_s"] and row["nodes"] == train["nodes"] == 1
    assert row["max duration (batches)"] == 120 and row["eval interval (batches)"] == 60
    assert row["checkpoint size (GiB)"] == round(train["checkpoint_size_bytes"] / 2**30, 3)
    assert row["conversion, inference & eval ok"] == "Y"
    assert row["eval accuracy (held-out tokens)"] == round(ev["val"]["token_accuracy"], 4)
    tag = f"[{ev['harness']}]"
    assert ev["harness"].startswith("llm-foundry ")
    assert row[f"ICL cloze_heldout (0-shot) {tag}"] == round(ev["icl"]["cloze_heldout"]["0-shot"], 4)
    assert row[f"ICL gauntlet average (default) {tag}"] == round(ev["gauntlet"]["average"], 4)
    # CPU: no MFU
    assert math.isnan(row["MFU, whole run"]) and math.isnan(row["MFU, steady state"]) and row["device"] == "cpu"
    assert row["ratio batches / 125M batches"] == round(120 / 4800, 2)
    r125 = t1.iloc[1]
    assert r125["ratio params / 125M params"] == 1.0 and r125["ratio runtime / 125M runtime"] == 1.0
    assert r125["conversion, inference & eval ok"] == "–"  # no export/eval results for it
    assert row["ratio runtime / 125M runtime"] == round(train["wall_clock_s"] / 547.9, 2)
    md = (out / "table1_pretraining.md").read_text()
    assert "| mpt-tiny | builtin-docs | 120 |" in md
    assert pd.read_csv(out / "table2_finetuning.csv").empty  # no finetunes configured
    proj = pd.read_csv(out / "projection.csv")
    assert "PROJECTION, not a measurement" in (out / "projection.md").read_text()
    # the only measured run is on CPU (no MFU): the committed GPU benchmark is the basis instead (llmpipe.plan.memory_time)
    assert set(proj["reference"]) == {"benchmark"}
    assert proj["basis"].str.contains("benchmarks/train-throughput.csv").all()
    for name in ("loss", "mfu", "busbw", "speedup"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == PNG and len(data) > 5_000, name
    # one HTML file with the tables and plots, and a page per run: its loss and MFU plots and its tracked run
    snakemake(wd, "--report", str(wd / "report.html"), "report")
    html = (wd / "report.html").read_text(errors="replace")
    for name in ("table1_pretraining.csv", "table2_finetuning.csv", "projection.csv", "loss.png", "mfu.png"):
        assert name in html, name
    categories, results = report_data(html)
    page = [f"results/report/runs/mpt-tiny/{leaf}" for leaf in ("loss.png", "mfu.png", "tracking.html")]
    assert categories["Runs"]["mpt-tiny"] == page and len(categories["Runs"]["mpt-125m"]) == 3
    for path in page[:2]:
        png = embedded(results[path])
        assert png[:8] == PNG and len(png) > 5_000 and png == (wd / path).read_bytes(), path
    assert "steady-state figure" in results[page[1]]["caption"]
    shown = embedded(results[page[2]]).decode()
    mlflow = pytest.importorskip("mlflow")
    store = "results/tracking/mlruns"
    assert f"file store {store}, experiment llmpipe, run id {state['mlflow_run_id']}" in shown, shown
    assert f"mlflow ui --backend-store-uri {store}" in shown
    assert mlflow.MlflowClient(f"file://{wd / store}").get_run(state["mlflow_run_id"]).info.run_id
    rel = folder.relative_to(wd)
    assert f"{rel}/wandb (offline), project llmpipe, run id {state['wandb_id']}" in shown, shown
    assert f"tensorboard --logdir {rel}/tensorboard" in shown, shown
    assert "Not tracked" in embedded(results["results/report/runs/mpt-125m/tracking.html"]).decode()


def report_data(html: str) -> tuple[dict, dict]:
    """The categories (category -> subcategory -> paths) and results (path -> record) of Snakemake's HTML report."""
    got = [json.loads(re.search(rf"var {name} = (\{{.*?\}});\n", html).group(1)) for name in ("categories", "results")]
    return got[0], got[1]


def embedded(record: dict) -> bytes:
    """The file a Snakemake HTML report embeds as a base64 data URI."""
    return base64.b64decode(record["data_uri"].split(",", 1)[1])


def test_run_page_shows_the_steady_window_and_where_each_logger_writes(tmp_path, monkeypatch):
    """A run's page (llmpipe.report.run_page) from a train.json, its loss log and a tracking.json as a training job writes
    it (tracking.foundry_loggers); tracking servers: MLflow over HTTP and W&B online link the run."""
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "results/r1/checkpoints/0123456789abcdef"
    folder.mkdir(parents=True)
    log = [{"batch": b, "loss": 9.0 - b / 10, "tokens": b * 1000, "elapsed_s": b / 2} for b in range(5, 45, 5)]
    (folder / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    train = {"run": "r1", "devices": 2, "flops_per_token": 6e9, "peak_flops_per_device": 1e15, "mfu": 0.004,
             "steady_mfu": 0.006, "steady_window": {"first_batch": 10, "last_batch": 40},
             "train_log": "results/r1/checkpoints/0123456789abcdef/train_log.jsonl"}
    (tmp_path / "results/r1/train.json").write_text(json.dumps(train))
    t = tracking.settings({"results_dir": "results", "tracking": {"loggers": ["wandb", "tensorboard"],
                                                                  "wandb_mode": "online", "wandb_entity": "team"}})
    tracking.foundry_loggers(t, str(folder), 0, "r1", folder.name)
    out = {k: str(tmp_path / "results/report/runs/r1" / f) for k, f in
           (("loss", "loss.png"), ("mfu", "mfu.png"), ("tracking", "tracking.html"))}
    got = run_report.build_run("results", "r1", out, base=str(tmp_path))
    wid = json.loads((folder / "tracking.json").read_text())["wandb_id"]
    assert [r["logger"] for r in got["tracking"]] == ["W&B", "TensorBoard"]
    page = (tmp_path / "results/report/runs/r1/tracking.html").read_text()
    assert f"https://wandb.ai/team/llmpipe/runs/{wid}" in page and "online" in page
    assert "tensorboard --logdir results/r1/checkpoints/0123456789abcdef/tensorboard" in page
    for name in ("loss", "mfu"):
        assert open(out[name], "rb").read(8) == PNG, name
    # MLflow behind a server: the run's page in the MLflow UI
    rows = tracking.locations({"mlflow_run_id": "abc", "mlflow_experiment_id": "7", "experiment": "e",
                               "mlflow_tracking_uri": "https://mlflow.example.org/"})
    assert rows == [{"logger": "MLflow", "where": "tracking URI https://mlflow.example.org/, experiment e, run id abc",
                     "open": "https://mlflow.example.org/#/experiments/7/runs/abc"}]
    assert tracking.locations({}) == [] and run_report.identity_folder_of({"train_log": None}) is None


def test_throughput_series_and_mfu():
    log = [{"batch": 10, "tokens": 10_000, "elapsed_s": 1.0}, {"batch": 20, "tokens": 30_000, "elapsed_s": 2.0}]
    (p,) = report.throughput_series(log, devices=4, flops_per_token_=1e9, peak=1e15)
    assert p["batch"] == 20 and p["tokens_per_s_per_device"] == 5000 and p["mfu"] == pytest.approx(0.005)


def test_table2_speedup_from_finetune_and_its_scaling_study(tmp_path):
    cfg = {**load_config(), "finetunes": {"mpt-7b-dolly": {"dataset": "mosaicml/dolly_hhrlhf"}}}
    res = tmp_path / "results"
    (res / "mpt-7b-dolly").mkdir(parents=True)
    base = {"run": "mpt-7b-dolly", "devices": 8, "tokens_per_s": 7124.0, "peak_memory_per_device_gib": 24.9}
    (res / "mpt-7b-dolly/train.json").write_text(json.dumps({**base, "nodes": 1, "wall_clock_s": 4708.0}))
    (res / "mpt-7b-dolly/eval.json").write_text(json.dumps({"val": {"token_accuracy": 0.85, "loss": 0.5}}))
    for n, wall, tps in ((2, 1764.0, 13844.0), (8, 815.0, 50708.0)):
        (res / f"scaling/mpt-7b-dolly/nodes{n}").mkdir(parents=True)
        (res / f"scaling/mpt-7b-dolly/nodes{n}/train.json").write_text(
            json.dumps({**base, "nodes": n, "devices": 8 * n, "wall_clock_s": wall, "tokens_per_s": tps}))
    t2 = report.table2(cfg, str(res), ["mpt-tiny", "mpt-7b-dolly"])
    assert list(t2["nodes"]) == [1, 2, 8]  # the seed's Table 2 rows
    assert list(t2["speedup versus fewest nodes"]) == ["–", "2.67x", "5.78x"]
    assert list(t2["throughput, whole run (tokens/s)"]) == [7124.0, 13844.0, 50708.0]
    assert t2["eval accuracy (held-out tokens)"].iloc[0] == 0.85 and t2["wall clock"].iloc[0] == "1h18m28.000s"
    assert set(t2["finetuning data"]) == {"mosaicml/dolly_hhrlhf"}


def test_projection_from_a_measured_run(tmp_path):
    """The seed's MPT-1B row (8 nodes x 8 H100, 2,368,224 tokens/s) projects MPT-70B's token budget."""
    cfg = load_config()
    cfg["report"] = {"projection": {"nodes": [8, 64], "models": ["mpt-1b", "mpt-70b"]}}
    res = tmp_path / "results"
    (res / "mpt-1b").mkdir(parents=True)
    arch1 = dict(cfg["model_defaults"]["arch"], **cfg["models"]["mpt-1b"]["arch"])
    fpt1 = flops_per_token(arch1, 2048)
    (res / "mpt-1b/train.json").write_text(json.dumps({
        "tokens_per_s_per_device": 2368224 / 64, "devices": 64, "nodes": 8, "flops_per_token": fpt1,
        "concat_tokens": 2048, "mfu": 0.33, "peak_flops_per_device": 989.5e12, "device": "NVIDIA H100 80GB HBM3"}))
    assert report.pick_reference(cfg, str(res), ["mpt-1b"]) == "mpt-1b"
    df = report.projection(cfg, str(res), "mpt-1b")
    arch70 = dict(cfg["model_defaults"]["arch"], **cfg["models"]["mpt-70b"]["arch"])
    fpt70 = flops_per_token(arch70, 2048)
    want = tokens_per_run(cfg, "mpt-70b") / (2368224 / 64 * fpt1 / fpt70 * 64)
    r = df[(df["model"] == "mpt-70b") & (df["nodes"] == 8)].iloc[0]
    assert r["projected time (s)"] == pytest.approx(want, rel=1e-6) and r["devices"] == 64
    r64 = df[(df["model"] == "mpt-70b") & (df["nodes"] == 64)].iloc[0]
    assert r64["projected time (s)"] == pytest.approx(want / 8, rel=1e-6)
    r1b = df[(df["model"] == "mpt-1b") & (df["nodes"] == 8)].iloc[0]  # the reference projects its own budget
    assert r1b["projected time (s)"] == pytest.approx(tokens_per_run(cfg, "mpt-1b") / 2368224, abs=0.1)
    assert "same MFU = 0.33" in r["basis"] and r["projected time"].startswith("about ")
    # with an assumed MFU: rate = MFU x peak / FLOPs per token
    cfg["report"]["projection"]["assume_mfu"] = 0.4
    r = report.projection(cfg, str(res), "mpt-1b").iloc[-1]
    assert r["projected time (s)"] == pytest.approx(tokens_per_run(cfg, "mpt-70b") / (0.4 * 989.5e12 / fpt70 * 512),
                                                    rel=1e-6)
