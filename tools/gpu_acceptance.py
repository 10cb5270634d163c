"""GPU acceptance: the literal chain ``results/<run>/eval.json`` through Snakemake with the shipped config, one record.

Usage (on a GPU machine, from the repository root, the environment of ../shared/tools/gpu-setup.sh sourced):

    python3 tools/gpu_acceptance.py --run mpt-1b --task-data DIR --out benchmarks/acceptance-h200-mpt-1b.json
    python3 tools/gpu_acceptance.py --run mpt-3b --task-data DIR --out benchmarks/acceptance-h200-mpt-3b.json --no-kill

``DIR`` holds llm-foundry's ``scripts/`` layout at the commit this project pins (``eval/local_data/...``; e.g. the
``scripts`` folder of ``git clone https://github.com/mosaicml/llm-foundry && git checkout 969212bd``): the suite
``tools/acceptance-suite.yaml`` reads its four files from there (``eval.task_data: {source: local}``).

What the overlay (written verbatim into the record) changes, and nothing else: the corpus and tokenizer (the built-in
ones: no download), the global batch, the duration, the save and eval intervals, the eval subset and held-out batches,
the resources (1 node x 1 GPU for every step) and the evaluation suite. Speed and precision settings (compile, FSDP as
shipped for one GPU, fused loss, attention, activation checkpointing, FP8) stay the shipped ones.

Phases, each run once (a rerun continues after the last finished one, from ``<results>/acceptance-state.json``):
``plan`` (the dry run's plan lines), ``data``, ``train_killed`` (SIGKILL of Snakemake's session and of every process
that carries this run's tag in its environment, right after the first complete checkpoint, as a node dying; with
``--no-kill`` the training runs through), ``unlock``, ``train`` (resumes), ``convert``, ``generate``, ``eval``. Each
phase's wall time and the GPU's peak used memory (``nvidia-smi``, sampled every 0.5 s: CUDA context and allocator
cache included) are recorded beside the step's plan line. Then the record is written and, with ``--clean``, the
run's checkpoints are removed (the record holds their sizes), so several models fit one disk one after the other.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from llmpipe.atomic import atomic_write_json, read_json  # noqa: E402
from llmpipe.train.checkpoints import checkpoint_bytes  # noqa: E402

SUITE = os.path.join(REPO, "tools", "acceptance-suite.yaml")
TAG_VAR = "LLMPIPE_ACCEPTANCE_TAG"
#: Snakemake's working folder (``-d``: its .snakemake/ metadata) is the results folder, passed in the environment.
WORKDIR_VAR = "LLMPIPE_ACCEPTANCE_WORKDIR"
PHASES = ("plan", "data", "train_killed", "unlock", "train", "convert", "generate", "eval")


class GpuPeak:
    """Peak ``memory.used`` of GPU 0 in GiB (``nvidia-smi``, every ``every_s`` s) while the ``with`` block runs;
    ``peak_gib`` stays None where nvidia-smi is missing."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak_gib, self._stop = every_s, None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=10).stdout
                mib = float(out.strip().splitlines()[0])
                self.peak_gib = max(self.peak_gib or 0.0, mib / 1024)
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return
            self._stop.wait(self.every_s)

    def __enter__(self) -> GpuPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def tagged_pids(tag: str) -> list[int]:
    """PIDs of the processes (other than this one) whose environment holds ``TAG_VAR=tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for d in glob.glob("/proc/[0-9]*"):
        pid = int(os.path.basename(d))
        if pid == os.getpid():
            continue
        try:
            with open(f"{d}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    pids.append(pid)
        except OSError:
            continue
    return pids


def snakemake(args: list[str], log_path: str, env: dict, kill_when: str | None = None,
              timeout: float = 3600) -> dict:
    """Run ``python3 -m snakemake`` in its own session; with ``kill_when`` (a glob), SIGKILL the session and every
    tagged process once a file matches. Returns ``{"seconds", "returncode", "killed", "gpu_peak_gib"}`` (plus, for a
    kill, the processes that outlived the session's SIGKILL and the tagged processes alive after the sweep)."""
    cmd = [sys.executable, "-m", "snakemake", "--scheduler", "greedy", "--cores", "all", *args]
    cmd[3:3] = ["-s", os.path.join(REPO, "Snakefile"), "-d", env[WORKDIR_VAR]]
    t0 = time.time()
    out: dict = {"killed": False}
    with open(log_path, "a") as fh, GpuPeak() as gpu:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        while proc.poll() is None and time.time() - t0 < timeout:
            if kill_when and glob.glob(kill_when):
                os.killpg(proc.pid, signal.SIGKILL)
                out["killed"] = True
                break
            time.sleep(0.2)
        if proc.poll() is None and not out["killed"]:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if out["killed"]:
            time.sleep(2)
            tag = env[TAG_VAR]
            survivors = tagged_pids(tag)
            out["outlived_session_kill"] = [_describe(p) for p in survivors]
            for pid in survivors:   # a node dying takes every process with it
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(2)
            out["alive_after_sweep"] = [_describe(p) for p in tagged_pids(tag)]
    out.update(seconds=round(time.time() - t0, 1), returncode=proc.returncode,
               gpu_peak_gib=None if gpu.peak_gib is None else round(gpu.peak_gib, 2))
    return out


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
        return f"{pid} {cmdline[:200]}"
    except OSError:
        return f"{pid} (gone)"


def plan_lines(base: list[str], target: str, env: dict) -> dict:
    """The dry run's ``plan <step> <run>: ...`` lines by step, and the dry run's return code."""
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", os.path.join(REPO, "Snakefile"), "-d",
                           env[WORKDIR_VAR], "-n", "--scheduler", "greedy", "--cores", "all", *base, "--", target],
                          capture_output=True, text=True, env=env)
    lines = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(r"plan (\w+) \S+: ", line)
        if m and m.group(1) not in lines:
            lines[m.group(1)] = line
    return {"returncode": proc.returncode, "lines": lines}


def source_commit() -> str | None:
    """The commit of the code that ran: the environment variable ``LLMPIPE_COMMIT`` where set (a copied working tree
    can carry an older .git than its files), else ``git rev-parse HEAD`` of this checkout, else None."""
    if os.environ.get("LLMPIPE_COMMIT"):
        return os.environ["LLMPIPE_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def stack() -> dict:
    """torch, CUDA, driver, Python, composer, llm-foundry, streaming, torchao versions and the GPU's name."""
    import importlib.metadata as md

    import torch

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None
    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver,
            "python": platform.python_version(), "composer": version("mosaicml"),
            "llm_foundry": version("llm-foundry"), "streaming": version("mosaicml-streaming"),
            "torchao": version("torchao"), "transformers": version("transformers"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "host_cpus": os.cpu_count()}


def overlay_for(args: argparse.Namespace, results: str) -> dict:
    """The config overlay: only corpus, tokenizer, global batch, duration, save/eval intervals, eval subset and held-out
    batches, resources, the suite and where its files are (module docstring)."""
    gpus = args.gpus
    step = {"gpus_per_node": gpus}
    return {
        "results_dir": results,
        "models": {args.run: {
            "data": {"corpus": "builtin-docs", "tokenizer": "bpe-builtin-docs"},
            "train": {"global_batch_size": args.global_batch, "max_duration_batches": args.batches,
                      "save_interval_batches": args.save_every, "eval_interval_batches": args.eval_every,
                      "eval_subset_batches": args.eval_subset},
            "resources": {"nodes": 1, "gpus_per_node": gpus, "tasks_per_node": 1, "cpus_per_task": 8},
            "step_resources": {"convert": step, "generate": step, "eval": step},
            "eval_suite": "acceptance",
        }},
        "eval": {"val_batches": args.val_batches,
                 "task_data": {"source": "local", "local_dir": os.path.abspath(args.task_data)}},
    }


def train_log_batches(run_dir: str) -> list[int]:
    """The batches of the identity's loss log (``train_log.jsonl``), in file order."""
    out = []
    for path in glob.glob(f"{run_dir}/checkpoints/*/train_log.jsonl"):
        with open(path) as fh:
            out += [json.loads(line)["batch"] for line in fh if line.strip()]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="mpt-1b")
    ap.add_argument("--out", required=True, help="the record (JSON)")
    ap.add_argument("--results", default="results-acceptance", help="results_dir of the run (default %(default)s)")
    ap.add_argument("--task-data", required=True, help="llm-foundry's scripts/ layout at the pinned commit")
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-subset", type=int, default=4, help="train.eval_subset_batches")
    ap.add_argument("--val-batches", type=int, default=4, help="eval.val_batches")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of every step (0: CPU)")
    ap.add_argument("--configfile", default=os.path.join(REPO, "config", "config.yaml"),
                    help="the shipped config (default: this checkout's config/config.yaml)")
    ap.add_argument("--no-kill", action="store_true", help="train through, without the kill and resume")
    ap.add_argument("--clean", action="store_true", help="remove the run's checkpoints after the record")
    args = ap.parse_args(argv)
    res = os.path.abspath(args.results)
    os.makedirs(res, exist_ok=True)
    state_path = os.path.join(res, f"acceptance-state-{args.run}.json")
    state = read_json(state_path) or {"tag": uuid.uuid4().hex, "phases": {}}
    overlay = overlay_for(args, res)
    cfg_path = os.path.join(res, f"overlay-{args.run}.yaml")
    with open(cfg_path, "w") as fh:
        yaml.safe_dump(overlay, fh)
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)   # jobs import llmpipe
    env = {**os.environ, TAG_VAR: state["tag"], WORKDIR_VAR: res, "PYTHONPATH": path}
    log = os.path.join(res, f"snakemake-{args.run}.log")
    base = ["--configfile", os.path.abspath(args.configfile), SUITE, cfg_path]
    run_dir = os.path.join(res, args.run)
    target = f"{run_dir}/eval.json"
    first_ckpt = f"{run_dir}/checkpoints/*/ep*-ba{args.save_every}[.-]*complete"
    phases = state["phases"]

    steps = {
        "plan": lambda: plan_lines(base, target, env),
        "data": lambda: snakemake([*base, "--until", "verify_mds", "--", f"{run_dir}/train.json"], log, env),
        "train_killed": lambda: snakemake([*base, "--", f"{run_dir}/train.json"], log, env, kill_when=first_ckpt),
        "unlock": lambda: snakemake([*base, "--unlock", "--", target], log, env),
        "train": lambda: snakemake([*base, "--", f"{run_dir}/train.json"], log, env),
        "convert": lambda: snakemake([*base, "--", f"{run_dir}/hf/manifest.json"], log, env),
        "generate": lambda: snakemake([*base, "--", f"{run_dir}/generate.json"], log, env),
        "eval": lambda: snakemake([*base, "--", target], log, env),
    }
    snakemake([*base, "--unlock", "--", target], log, env)   # a lock left by an interrupted run of this tool
    for name in PHASES:
        done = phases.get(name, {})
        if done.get("returncode") == 0 or done.get("killed") or (args.no_kill and name in ("train_killed", "unlock")):
            continue   # finished (a failed phase runs again)
        print(f"acceptance {args.run}: {name} ...", flush=True)
        phases[name] = steps[name]()
        if name == "train_killed":
            phases[name]["complete_checkpoints"] = sorted(
                os.path.basename(p) for p in glob.glob(f"{run_dir}/checkpoints/*/ep*-ba*.complete"))
        atomic_write_json(state_path, state)
        print(f"acceptance {args.run}: {name}: {json.dumps(phases[name])[:400]}", flush=True)
        if name != "plan" and name != "train_killed" and phases[name].get("returncode") != 0:
            print(f"acceptance {args.run}: {name} failed; see {log}", flush=True)
            break

    def load(rel):
        return read_json(os.path.join(run_dir, rel))

    batches = train_log_batches(run_dir)
    ckpt_bytes = {os.path.basename(p): checkpoint_bytes(p)
                  for p in sorted(glob.glob(f"{run_dir}/checkpoints/*/ep*-ba*")) if not p.endswith(".complete")}
    export_bytes = checkpoint_bytes(f"{run_dir}/hf") if os.path.isdir(f"{run_dir}/hf") else 0
    evaluation = load("eval.json")
    record = {
        "command": " ".join(["python3", "tools/gpu_acceptance.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "commit": source_commit(),
        "stack": stack(),
        "run": args.run,
        "overlay": overlay,
        "suite": yaml.safe_load(open(SUITE)),
        "phases": phases,
        "train_log_batches": batches,
        "each_logged_batch_once": len(batches) == len(set(batches)) and batches == sorted(batches),
        "checkpoint_bytes": ckpt_bytes,
        "export_bytes": export_bytes,
        "train": load("train.json"),
        "convert": load("hf/manifest.json"),
        "generate": load("generate.json"),
        "eval": evaluation,
    }
    ok = all(phases.get(p, {}).get("returncode") == 0 for p in ("data", "train", "convert", "generate", "eval"))
    if not args.no_kill:
        kill = phases.get("train_killed", {})
        ok = ok and kill.get("killed") and not kill.get("alive_after_sweep") and bool((record["train"] or {})
                                                                                       .get("resumed_from"))
    ok = ok and record["each_logged_batch_once"] and evaluation is not None
    record["ok"] = bool(ok)
    atomic_write_json(args.out, record)
    print(json.dumps({"ok": record["ok"], "phases": {k: {x: v.get(x) for x in ("seconds", "returncode", "gpu_peak_gib")}
                                                    for k, v in phases.items() if k != "plan"}}, indent=1))
    if args.clean and record["ok"]:
        for d in glob.glob(f"{run_dir}/checkpoints/*/ep*-ba*"):
            shutil.rmtree(d, ignore_errors=True)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
