"""The embedded default end to end on CPU, then what a rerun plans after each kind of config change."""

from __future__ import annotations

import glob
import json
import math
import re
import os
import signal
import subprocess
import time

import pytest
import yaml

from llmpipe.dispatch.orphans import process_start_time
from llmpipe.steps import THIS_RUN
from tests.conftest import REPO, SNAKEMAKE, copy_run, no_symlink_env, planned_jobs, project_config, snakemake

pytestmark = pytest.mark.slow

AFTER_TRAIN = {"train": 1, "convert": 1, "generate": 1, "eval": 1, "all": 1}
TRAIN = "results/mpt-tiny/train.json"


def load(wd, rel):
    with open(wd / "results" / rel) as fh:
        return json.load(fh)


def test_tiny_pipeline_trains_and_evaluates(tiny_run):
    train = load(tiny_run, "mpt-tiny/train.json")
    cfg = project_config()
    tiny = cfg["models"]["mpt-tiny"]
    assert train["steps"] == tiny["train"]["max_duration_batches"]
    assert train["tokens"] == train["steps"] * tiny["train"]["global_batch_size"] * tiny["data"]["concat_tokens"]
    assert train["final_train_loss"] <= train["first_train_loss"] - 1.0, train
    assert train["tokens_per_s"] > 0 and train["mfu"] is None and train["devices"] == 1
    assert train["checkpoint_size_bytes"] == os.path.getsize(tiny_run / train["final_checkpoint"])
    # checkpoints were saved with symlinks refused, and only `checkpoints_to_keep` remain
    folder = (tiny_run / train["final_checkpoint"]).parent  # results/mpt-tiny/checkpoints/<identity key>
    assert folder.parent == tiny_run / "results/mpt-tiny/checkpoints"
    ckpts = sorted(p for p in os.listdir(folder) if p.endswith(".pt"))
    assert len(ckpts) == cfg["model_defaults"]["train"]["checkpoints_to_keep"], ckpts
    assert not any(p.is_symlink() for p in folder.parent.rglob("*"))

    ev = load(tiny_run, "mpt-tiny/eval.json")
    vocab = cfg["tokenizers"]["bpe-builtin-docs"]["vocab_size"]
    assert 0 < ev["val"]["loss"] < math.log(vocab), ev["val"]
    assert math.isclose(ev["val"]["perplexity"], math.exp(ev["val"]["loss"]), rel_tol=1e-3)
    assert 0 < ev["val"]["token_accuracy"] < 1
    assert "cloze_heldout" in ev["icl"] and 0 <= ev["icl"]["cloze_heldout"]["0-shot"] <= 1
    assert 0 < ev["icl"]["cloze_choice_heldout"]["0-shot"] <= 1  # 4-way choice: some items right
    # every item of each task is scored, whatever eval.batch_size and eval.val_batches (which caps the held-out loader)
    for task in ("cloze_heldout", "cloze_choice_heldout"):
        rec = ev["tasks"][task]["0-shot"]
        lines = (tiny_run / f"results/data/builtin-docs/icl/{task}.jsonl").read_text().splitlines()
        assert rec["items"] == rec["items_in_file"] == len(lines) and rec["subset"] is False
    assert ev["harness"].startswith("llm-foundry ") and ev["suite"] == "default"
    assert ev["gauntlet"]["over"] == ["heldout_text"] and math.isfinite(ev["gauntlet"]["average"])

    gen = load(tiny_run, "mpt-tiny/generate.json")
    assert [o["prompt"] for o in gen["outputs"]] == cfg["generate"]["prompts"]
    assert all(o["new_tokens"] > 0 and o["completion"] for o in gen["outputs"])

    hf = load(tiny_run, "mpt-tiny/hf/manifest.json")
    assert hf["dtype"] == "bfloat16" and hf["attn_impl"] == "torch"
    assert hf["bytes"] < train["checkpoint_size_bytes"]  # optimizer state dropped, bf16 weights


def test_console_shows_each_steps_progress_and_a_summary_at_the_end(tiny_run):
    """With dispatch.progress_s 1, the console (Snakemake's output) has the training's progress record as lines of
    done/total with figures and an ETA, and the chain's summary names the run's scores and folder."""
    out = (tiny_run / "pipeline-stdout.txt").read_text()
    batches = [int(b) for b in re.findall(r"\] train mpt-tiny: batch (\d+)/120 \(\d+%\), loss \d+\.\d{4}, "
                                          r"tokens/s [\d,]+, MFU -, ETA \d+(?:m\d\ds|s)\n", out)]
    assert len(batches) >= 2 and batches == sorted(set(batches)), out[-5000:]
    # the evaluation's record: its last evaluator, done; every ICL task and the held-out loader counted
    rec = json.loads((tiny_run / "results/logs/eval/mpt-tiny.submitit/progress.json").read_text())
    assert rec["done"] == rec["total"] > 0 and rec["unit"] in ("item", "batch") and rec["task"], rec
    assert rec["figures"]["task"] == "3/3", rec      # two ICL tasks and the held-out text
    rec = json.loads((tiny_run / "results/logs/convert/mpt-tiny.submitit/progress.json").read_text())
    assert (rec["done"], rec["total"], rec["unit"], rec["task"]) == (3, 3, "part", "done"), rec
    train, ev = load(tiny_run, "mpt-tiny/train.json"), load(tiny_run, "mpt-tiny/eval.json")
    summary = out[out.index("llmpipe: summary of the runs this chain changed:"):]
    assert (f"  mpt-tiny: train loss {train['final_train_loss']:.4f} after 120 batches, held-out loss "
            f"{ev['val']['loss']:.4f}, gauntlet average {ev['gauntlet']['average']:.4f}, 2 prompt(s) answered; "
            f"files: results/mpt-tiny/") in summary, summary


def test_eval_json_says_where_the_eval_steps_wall_time_went(tiny_run):
    """eval.json's ``timing.phases`` tile the eval job's wall time, from its process's start (the rule log's
    submission, to the second) to eval.json's write (its mtime): every phase happened in a job, none is NaN."""
    from llmpipe.evaluation.step_clock import PHASES

    ev = load(tiny_run, "mpt-tiny/eval.json")
    t = ev["timing"]
    assert list(t["phases"]) == list(PHASES)
    assert all(isinstance(v, float) and v >= 0 for v in t["phases"].values()), t["phases"]
    assert sum(t["phases"].values()) == pytest.approx(t["wall_s"], abs=0.01)
    assert t["wall_s"] == pytest.approx(t["job_s"] + t["phases"]["hand_back_s"], abs=0.002)
    assert t["phases"]["batches_s"] == t["batches_s"] and t["phases"]["imports_s"] > 0.5  # a fresh interpreter
    log = (tiny_run / "results/logs/eval/mpt-tiny.log").read_text()
    h, m, sec = map(int, re.findall(r"\[llmpipe (\d\d):(\d\d):(\d\d)\] eval mpt-tiny: submitted job", log)[-1])
    started = time.localtime((tiny_run / "results/mpt-tiny/eval.json").stat().st_mtime - t["wall_s"])
    off = ((started.tm_hour * 3600 + started.tm_min * 60 + started.tm_sec) - (h * 3600 + m * 60 + sec)) % 86400
    assert off in (0, 1, 86399), (off, t)   # the job started within the second the step logged its submission


@pytest.mark.parametrize("change,expected", [
    ([], {}),
    (["eval={'val_batches': 3}"], {"eval": 1, "all": 1}),
    (["generate={'prompts': ['Once upon a time']}"], {"generate": 1, "all": 1}),
    (["models={'mpt-tiny': {'arch': {'d_model': 192}}}"], AFTER_TRAIN),
    (["models={'mpt-tiny': {'train': {'microbatch_size': 8, 'attn_impl': 'torch', 'num_workers': 2, "
      "'checkpoints_to_keep': 1, 'save_interval_batches': 30, 'fused_loss': True}, "
      "'resources': {'cpus_per_task': 1}}}"], {}),
    (["tokenizers={'bpe-builtin-docs': {'vocab_size': 2048}}"],
     {"tokenizer": 1, "mds": 1, "verify_mds": 1} | AFTER_TRAIN),
    (["models={'mpt-tiny': {'data': {'concat_tokens': 64}}}"], {"mds": 1, "verify_mds": 1} | AFTER_TRAIN),
    # restating shipped values: --config hands them over as strings ('17', '3.0e-3'), typed as the YAML file has them
    (["models={'mpt-tiny': {'train': {'seed': 17, 'optimizer': {'lr': 3.0e-3}, 'compile': False}}}"], {}),
], ids=["nothing", "eval-only", "prompts", "width", "speed-only", "tokenizer", "concat", "restated"])
def test_rerun_scope(tiny_run, tmp_path, change, expected):
    wd = copy_run(tiny_run, tmp_path / "wd")
    args = ["--config", *change] if change else []
    assert planned_jobs(snakemake(wd, "-n", *args)) == expected


def test_reformatted_config_reruns_nothing(tiny_run, tmp_path):
    wd = copy_run(tiny_run, tmp_path / "wd")
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    reordered = dict(reversed(list(cfg.items())))  # new key order, no comments, other layout
    (tmp_path / "reformatted.yaml").write_text(yaml.safe_dump(reordered, default_flow_style=True, width=60))
    assert planned_jobs(snakemake(wd, "-n", "--configfile", str(tmp_path / "reformatted.yaml"))) == {}


def test_failed_step_leaves_nothing_complete_and_rerun_fixes_only_it(tiny_run, tmp_path):
    wd = copy_run(tiny_run, tmp_path / "wd")
    (wd / "results/mpt-tiny/generate.json").unlink()
    # a prompt longer than the tiny model's context, refused in the job (an empty list is refused by the dry run)
    long = " ".join(["word"] * 400)
    bad = snakemake(wd, "--cores", "2", "--config", f"generate={{'prompts': ['{long}'], 'long_prompts': 'fail'}}",
                    check=False)
    assert bad.returncode != 0
    said = bad.stdout + bad.stderr
    assert "generate.prompts[0] ('word word" in said and "tokens; the model's context is 128 tokens" in said, said
    assert not (wd / "results/mpt-tiny/generate.json").exists()
    assert (wd / "results/mpt-tiny/generate.partial.json").exists()  # the errors, beside; never the result file
    # the evaluation depends on the generation through ancient(), which spares only an existing file: with
    # generate.json gone, Snakemake reruns the evaluation after it (docs/evaluation.md)
    assert planned_jobs(snakemake(wd, "-n")) == {"generate": 1, "eval": 1, "all": 1}
    assert (wd / "results/mpt-tiny/eval.json").exists()  # the finished evaluation stays until its rerun replaces it


def test_lost_train_json_reuses_finished_training(tiny_run, tmp_path):
    """The job ended after the final checkpoint but train.json was lost: the rerun trains nothing again."""
    wd = copy_run(tiny_run, tmp_path / "wd")
    train0 = load(wd, "mpt-tiny/train.json")
    (wd / "results/mpt-tiny/train.json").unlink()
    proc = snakemake(wd, "--cores", "2", "results/mpt-tiny/train.json")
    train1 = load(wd, "mpt-tiny/train.json")
    assert train1 == train0
    log = (wd / "results/logs/train/mpt-tiny.log").read_text()
    own = log.split(THIS_RUN)[-1]
    assert "training already complete" in log and "submitted job" not in own, log + proc.stdout[-2000:]


def run_outputs(run) -> dict:
    """The bytes of a run's outputs after training (train.json, the export, generate.json, eval.json), provenance
    records left out (each execution writes its own)."""
    paths = [run / "train.json", run / "generate.json", run / "eval.json", *sorted((run / "hf").iterdir())]
    return {str(p.relative_to(run)): p.read_bytes() for p in paths if not p.name.endswith(".provenance.json")}


def test_going_back_after_a_killed_changed_run_restores_every_step(tiny_run, tmp_path):
    """A changed run (another seed) whose Snakemake is killed mid-training, after Snakemake deleted train.json and
    after the changed run's first checkpoint (its retention ran beside the finished identity's folder); back
    at the shipped settings, eval.json alone plans nothing (the results after training are up to date) and the
    console names the command that restores train.json; asking for train.json and eval.json then submits no job and
    loads no model: train.json comes from the finished training's record, the export, generate.json and eval.json
    from their kept results ("restored from <folder>", llmpipe.steps.kept_results), each byte for byte."""
    from tests.test_orphans import _descendants

    wd = copy_run(tiny_run, tmp_path / "wd")
    run = wd / "results/mpt-tiny"
    before = run_outputs(run)
    log = wd / "results/logs/train/mpt-tiny.log"
    log.unlink()  # the tiny run's own: the changed run's new log starts with the history and THIS_RUN
    cmd = [*SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(wd), "--cores", "2", TRAIN,
           "--config", "models={'mpt-tiny': {'train': {'seed': 18}}}"]
    proc = subprocess.Popen(cmd, cwd=wd, env={**os.environ, **no_symlink_env(wd)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    first = f"{run}/checkpoints/*/ep0-ba40-rank0.pt.complete"    # the changed identity's (the tiny run kept 80, 120)
    t0 = time.time()
    while not glob.glob(first) and time.time() - t0 < 300:
        assert proc.poll() is None
        time.sleep(0.2)
    below = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)  # Snakemake and its rule script: no cleanup, no metadata written
    proc.wait()
    while any(process_start_time(p) is not None for p in below) and time.time() - t0 < 360:
        time.sleep(0.2)
    for p in below:
        if process_start_time(p) is not None:
            os.kill(p, signal.SIGKILL)
    assert not (run / "train.json").exists()
    assert len(list((run / "checkpoints").iterdir())) == 2   # the finished identity and the changed one
    snakemake(wd, "--unlock", TRAIN)

    dry = snakemake(wd, "-n", "results/mpt-tiny/eval.json")
    assert planned_jobs(dry) == {}
    assert ("results/mpt-tiny/train.json is missing although its training under these settings finished" in
            dry.stderr and "Restore it without a job: snakemake results/mpt-tiny/train.json" in dry.stderr), dry.stderr
    snakemake(wd, "--cores", "2", TRAIN, "results/mpt-tiny/eval.json", env=no_symlink_env(wd))
    own = {step: (wd / f"results/logs/{step}/mpt-tiny.log").read_text().split(THIS_RUN)[-1]
           for step in ("train", "convert", "generate", "eval")}
    assert not any("submitted job" in text for text in own.values()), own
    assert "training already complete" in own["train"], own["train"]
    for step in ("convert", "generate", "eval"):
        assert f"{step} mpt-tiny: restored from results/mpt-tiny/kept/{step}/" in own[step], own[step]
    assert run_outputs(run) == before
    assert planned_jobs(snakemake(wd, "-n")) == {}


def test_loss_curve_matches_committed_reference(tiny_run):
    """Every logged train loss of the tiny run equals the committed curve within tests.expected_loss.RTOL: a silent
    numeric change in attention, loss, optimizer or data wiring fails here (tests/expected_loss.py says how to
    regenerate the file when a change is meant to move it)."""
    from tests.expected_loss import EXPECTED, RTOL, loss_curve

    want = json.loads(EXPECTED.read_text())["loss"]
    got = loss_curve(tiny_run)
    assert sorted(got, key=int) == sorted(want, key=int), "logged batches differ from the reference"
    off = {b: (got[b], want[b]) for b in want if not math.isclose(got[b], want[b], rel_tol=RTOL)}
    assert not off, f"loss differs from tests/expected/mpt-tiny-loss.json beyond rtol {RTOL}: {off}"
