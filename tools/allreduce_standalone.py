#!/usr/bin/env python3
"""The all-reduce sweep of rule ``allreduce`` on one node, without Snakemake.

For a GPU machine that has torch and submitit but not the workflow's environment (the device machine used for
``benchmarks/allreduce-device-*``): it runs rule ``allreduce``'s own step (:func:`llmpipe.steps.run_rule`) with the
project config (``config/config.yaml``) merged with ``--set``, the local executor and one node, and writes
``OUT/nodes1.csv`` (nccl-tests' columns), ``OUT/nodes1.md`` and ``OUT/allreduce-nodes1.log``.

Usage (from the repository root)::

    python3 tools/allreduce_standalone.py /tmp/ar --gpus 2
    python3 tools/allreduce_standalone.py /tmp/ar --gpus 0 --set "{allreduce: {max_bytes: 65536,
        resources: {tasks_per_node: 2}}}"          # 2 CPU tasks through gloo

Exit status 0 with the table printed; a failed job raises :class:`llmpipe.dispatch.jobs.StepFailed` (its log tail).
"""

from __future__ import annotations

import argparse
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class _Files(list):
    """A Snakemake-like named file list: ``out.csv``, ``out.md`` and iteration over both."""


def main(argv: list[str] | None = None) -> int:
    import yaml

    from llmpipe.config import schema
    from llmpipe.config.runs import deep_merge
    from llmpipe.steps import run_rule

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for nodes1.csv, nodes1.md, the log and submitit's files")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs of this machine to use (one task each); 0: CPU tasks")
    ap.add_argument("--config", default=os.path.join(ROOT, "config", "config.yaml"))
    ap.add_argument("--set", default="", help="YAML mapping merged over the config, e.g. \"{allreduce: {iters: 5}}\"")
    args = ap.parse_args(argv)
    with open(args.config) as fh:
        config = yaml.safe_load(fh)
    config = deep_merge(config, {"results_dir": args.out, "dispatch": {"executor": "local"},
                                 "allreduce": {"resources": {"gpus_per_node": args.gpus}}})
    config = schema.resolve(deep_merge(config, yaml.safe_load(args.set) if args.set else {}))  # + the defaults
    os.makedirs(args.out, exist_ok=True)
    out = _Files([os.path.join(args.out, "nodes1.csv"), os.path.join(args.out, "nodes1.md")])
    out.csv, out.md = out
    smk = types.SimpleNamespace(rule="allreduce", config=config, wildcards=types.SimpleNamespace(nodes="1"),
                                input=[], params=[], output=out, log=[os.path.join(args.out, "allreduce-nodes1.log")])
    run_rule(smk)
    with open(out.md) as fh:
        print(fh.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
