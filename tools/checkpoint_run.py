"""Run the pipeline itself for one model with sharded checkpoints: train, kill the training after its first complete
checkpoint (SIGKILL of the driver and its job, like a node dying), resume, then convert, generate and evaluate;
record each step's wall clock, the checkpoint's size and save times, and the conversion's peak host memory.

Usage (on a GPU machine, from the repository root, the environment of ../shared/tools/gpu-setup.sh sourced):

    python3 tools/checkpoint_run.py --run mpt-1b --out benchmarks/checkpoints-h200-mpt-1b.json

The run trains on the built-in corpus with its own BPE tokenizer (no download), at the model's architecture and
sequence length 2048, for ``--batches`` batches of ``--global-batch`` samples, saving every ``--save-every``. FSDP
and sharded checkpoints follow ``train.fsdp_min_params`` (MPT-1B: on, at world size 1). Writes one JSON record.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

import yaml


def snakemake(args: list[str], log_path: str, kill_when: str | None = None, timeout: float = 1200) -> dict:
    """Run ``python3 -m snakemake`` in its own session; with ``kill_when`` (a glob), SIGKILL the whole session once
    a file matches. Returns ``{"seconds", "returncode", "killed"}``."""
    cmd = [sys.executable, "-m", "snakemake", "--scheduler", "greedy", "--cores", "all", *args]
    t0 = time.time()
    with open(log_path, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        killed = False
        while proc.poll() is None and time.time() - t0 < timeout:
            if kill_when and glob.glob(kill_when):
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.2)
        if proc.poll() is None and not killed:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # jobs of the local executor run in the killed session too; give the OS a moment to reap them
    time.sleep(2)
    return {"seconds": round(time.time() - t0, 1), "returncode": proc.returncode, "killed": killed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="mpt-1b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--results", default="results-ckpt")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--microbatch", type=int, default=8)
    ap.add_argument("--concat", type=int, default=2048, help="sequence length (data.concat_tokens)")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of the training, generation and evaluation (0: CPU)")
    ap.add_argument("--fsdp-min-params", type=float, default=None, help="train.fsdp_min_params (default: config's)")
    args = ap.parse_args()
    res = os.path.abspath(args.results)
    overlay = {
        "results_dir": res,
        "models": {args.run: {
            "data": {"corpus": "builtin-docs", "tokenizer": "bpe-builtin-docs", "concat_tokens": args.concat},
            "train": {"global_batch_size": args.global_batch, "microbatch_size": args.microbatch,
                      "max_duration_batches": args.batches, "save_interval_batches": args.save_every,
                      "eval_interval_batches": args.batches, "eval_subset_batches": 2, "compile": False,
                      "scheduler": {"t_warmup_batches": 5}, "log_interval_batches": 5},
            "resources": {"nodes": 1, "gpus_per_node": args.gpus, "tasks_per_node": 1, "cpus_per_task": 8,
                          "time_min": 60},
            "step_resources": {"generate": {"gpus_per_node": args.gpus}, "eval": {"gpus_per_node": args.gpus}},
        }},
        "eval": {"val_batches": 4},
    }
    if args.fsdp_min_params is not None:
        overlay["models"][args.run]["train"]["fsdp_min_params"] = args.fsdp_min_params
    os.makedirs(res, exist_ok=True)
    cfg_path = os.path.join(res, "overlay.yaml")
    with open(cfg_path, "w") as fh:
        yaml.safe_dump(overlay, fh)
    log = os.path.join(res, "snakemake.log")
    base = ["--configfile", "config/config.yaml", cfg_path]
    run_dir = os.path.join(res, args.run)
    phases = {}
    snakemake([*base, "--unlock", "--", f"{run_dir}/train.json"], log)  # a lock left by an earlier killed run
    phases["data"] = snakemake([*base, "--until", "verify_mds", "--", f"{run_dir}/train.json"], log)
    first = f"{run_dir}/checkpoints/*/ep*-ba{args.save_every}.complete"
    phases["train_killed"] = snakemake([*base, "--", f"{run_dir}/train.json"], log, kill_when=first)
    ckpts = sorted(glob.glob(f"{run_dir}/checkpoints/*/ep*-ba*.complete"))
    # the killed driver left Snakemake's lock behind, as after a node failure: a user's first step is --unlock
    phases["unlock"] = snakemake([*base, "--unlock", "--", f"{run_dir}/train.json"], log)
    phases["train_resumed"] = snakemake([*base, "--", f"{run_dir}/train.json"], log)
    phases["convert"] = snakemake([*base, "--", f"{run_dir}/hf/manifest.json"], log)
    phases["generate"] = snakemake([*base, "--", f"{run_dir}/generate.json"], log)
    phases["eval"] = snakemake([*base, "--", f"{run_dir}/eval.json"], log)

    def load(rel):
        try:
            with open(os.path.join(run_dir, rel)) as fh:
                return json.load(fh)
        except OSError:
            return None

    import torch
    record = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "run": args.run,
        "overlay": overlay,
        "phases": phases,
        "complete_checkpoints_when_killed": [os.path.basename(p) for p in ckpts],
        "train": load("train.json"),
        "convert": load("hf/manifest.json"),
        "generate": (load("generate.json") or {}).get("outputs"),
        "eval": load("eval.json"),
    }
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=1)
    print(json.dumps({k: record[k] for k in ("phases", "complete_checkpoints_when_killed")}, indent=1))
    ok = (phases["train_killed"]["killed"] and record["train"] and record["train"]["steps"] == args.batches
          and record["train"]["resumed_from"] and record["eval"] is not None)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
