"""All-reduce bandwidth test across an allocation (the seed's ``nccl-tests`` table), its plot and the training gate.

:class:`AllReduceTask` runs in every task of a ``nodes x tasks_per_node`` job (one task per GPU) and sweeps message
sizes from ``allreduce.min_bytes`` to ``allreduce.max_bytes`` (factor ``allreduce.factor``) through
``torch.distributed.all_reduce``: NCCL on GPUs, gloo on CPUs. Per size it reports what NVIDIA's
``all_reduce_perf -b 8 -e 8G -f 2 -g 1`` reports, for an out-of-place and an in-place variant:

* ``time_us`` – the average time of one all-reduce (microseconds), measured over ``iters`` back-to-back calls
  after ``warmup`` untimed ones, and averaged over ranks (nccl-tests' default, ``-a 1``);
* ``algbw_gbps`` – algorithm bandwidth, ``size_bytes / time_s / 1e9`` (GB/s, 1 GB = 1e9 bytes);
* ``busbw_gbps`` – bus bandwidth, ``algbw * 2 * (n - 1) / n`` for ``n`` ranks: the factor nccl-tests applies to
  all-reduce so that the figure compares with the hardware's link speed whatever the number of ranks
  (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md, section "AllReduce": a ring all-reduce
  moves ``2 * (n - 1) / n`` times the buffer over every link). One rank: 0;
* ``wrong`` – elements that differ from the expected sum after one checked call, summed over ranks.

Out-of-place versus in-place: ``torch.distributed.all_reduce`` only reduces in place (NCCL's in-place mode, send
buffer = receive buffer). The in-place column is exactly that call. The out-of-place column keeps the input intact
the only way torch can, ``out.copy_(inp); all_reduce(out)``, and its time includes that device-local copy: it is
what reducing into a separate buffer costs through torch, slightly slower than nccl-tests' out-of-place at small
sizes (the copy's launch) and by the copy's memory traffic at large ones.

This module imports without torch (the Snakefile imports it to plan the DAG); torch is imported inside the task.
"""

from __future__ import annotations

import csv
import os
import time
from typing import Any

from llmpipe.config.runs import step_resources, world_size
from llmpipe.config.schema import section_defaults
from llmpipe.config.settings import ConfigError
from llmpipe.report.plots import finish_and_save

#: Columns of ``results/bench/allreduce/nodes{N}.csv``, in nccl-tests' order, then where it ran.
COLUMNS = ["size_bytes", "count", "type", "redop", "root",
           "oop_time_us", "oop_algbw_gbps", "oop_busbw_gbps", "oop_wrong",
           "ip_time_us", "ip_algbw_gbps", "ip_busbw_gbps", "ip_wrong",
           "nodes", "ranks", "backend", "device", "warmup", "iters"]

#: Settings of the bench the config does not set: the schema's defaults of ``allreduce:``.
DEFAULTS: dict[str, Any] = section_defaults("allreduce")


#: nccl-tests' type names -> torch dtype names and element sizes (bytes).
DTYPES = {"float": ("float32", 4), "double": ("float64", 8), "half": ("float16", 2),
          "bfloat16": ("bfloat16", 2), "int32": ("int32", 4), "int64": ("int64", 8)}


def settings(config: dict) -> dict:
    """The ``allreduce:`` section merged over :data:`DEFAULTS`, checked.

    Raises:
        ConfigError: an impossible sweep (sizes, factor, dtype, iterations) or gate.
    """
    s = {**DEFAULTS, **(config.get("allreduce") or {})}
    s["resources"] = {**DEFAULTS["resources"], **(s.get("resources") or {})}
    if s["dtype"] not in DTYPES:
        raise ConfigError(f"allreduce.dtype is {s['dtype']!r}; it must be one of {', '.join(DTYPES)}.")
    el = DTYPES[s["dtype"]][1]
    lo, hi, f = int(s["min_bytes"]), int(s["max_bytes"]), int(s["factor"])
    if lo < el or hi < lo:
        raise ConfigError(f"allreduce.min_bytes ({lo}) must be at least one {s['dtype']} ({el} bytes) and at most "
                          f"allreduce.max_bytes ({hi}).")
    if f < 2:
        raise ConfigError(f"allreduce.factor must be an integer >= 2, got {s['factor']!r}.")
    if int(s["iters"]) < 1 or int(s["warmup"]) < 0:
        raise ConfigError("allreduce.iters must be >= 1 and allreduce.warmup >= 0.")
    if s["backend"] not in ("auto", "nccl", "gloo"):
        raise ConfigError(f"allreduce.backend is {s['backend']!r}; it must be auto, nccl or gloo.")
    gate = s.get("gate")
    if gate:
        if "size_bytes" not in gate or "min_busbw_gbps" not in gate:
            raise ConfigError("allreduce.gate needs size_bytes and min_busbw_gbps, e.g. "
                              "{size_bytes: 1073741824, min_busbw_gbps: 100}; or gate: null to switch it off.")
        if int(gate["size_bytes"]) not in sweep_sizes(lo, hi, f):
            raise ConfigError(f"allreduce.gate.size_bytes ({gate['size_bytes']}) is not one of the sweep's sizes "
                              f"({lo} x {f}^k up to {hi}). Fix: pick one of them, or widen the sweep.")
    if s.get("health") is not None:
        s["health"] = health_settings(s)
    return s


def health_settings(s: dict) -> dict:
    """``allreduce.health`` of the merged section ``s`` with its schema defaults (``x-default``) filled, checked.

    Raises:
        ConfigError: health on without the gate it belongs to, or an impossible threshold.
    """
    from llmpipe.config.schema import node_at

    props = node_at("#/properties/allreduce/properties/health/properties")
    h = {**{k: p["x-default"] for k, p in props.items()}, **s["health"]}
    if not s.get("gate"):
        raise ConfigError("allreduce.health is set but allreduce.gate is null: the health check is part of the gate. "
                          "Fix: set allreduce.gate: {size_bytes: ..., min_busbw_gbps: ...} (0 for no busbw floor), "
                          "or allreduce.health: null.")
    if not 0 <= float(h["min_fraction_of_median"]) <= 1:
        raise ConfigError(f"allreduce.health.min_fraction_of_median is {h['min_fraction_of_median']!r}; it must be "
                          f"between 0 and 1 (0.8: a GPU slower than 80 % of the median fails).")
    if h["on_slow"] not in ("fail", "warn"):
        raise ConfigError(f"allreduce.health.on_slow is {h['on_slow']!r}; it must be fail or warn.")
    return h


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """Message sizes in bytes: ``min_bytes, min_bytes * factor, ...`` up to and including ``max_bytes``
    (nccl-tests' ``-b``, ``-e``, ``-f``)."""
    out, s = [], int(min_bytes)
    while s <= int(max_bytes):
        out.append(s)
        s *= int(factor)
    return out


def busbw_factor(ranks: int) -> float:
    """nccl-tests' all-reduce bus-bandwidth factor ``2 * (n - 1) / n`` (doc/PERFORMANCE.md); 0 for one rank."""
    n = int(ranks)
    return 2.0 * (n - 1) / n if n > 0 else 0.0


def bandwidths(size_bytes: int, time_s: float, ranks: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (1e9 bytes/s) of one all-reduce of ``size_bytes`` taking ``time_s`` seconds
    on ``ranks`` ranks: ``algbw = size / time``, ``busbw = algbw * 2 (n - 1) / n`` (nccl-tests' definitions)."""
    algbw = size_bytes / time_s / 1e9 if time_s > 0 else 0.0
    return algbw, algbw * busbw_factor(ranks)


def bench_resources(config: dict, nodes: int) -> dict:
    """The bench step's resources: ``allreduce.resources`` on ``nodes`` nodes (one task per GPU, or
    ``tasks_per_node`` CPU tasks), with the usual defaults of :func:`llmpipe.config.runs.step_resources`."""
    s = settings(config)
    res = step_resources({"allreduce": {"resources": dict(s["resources"], nodes=int(nodes))}}, "allreduce")
    return res


# ------------------------------------------------------------------------------------------- the task

def init_group(backend: str = "auto") -> tuple[dict, str, object, str]:
    """Join the job's torch.distributed group (environment from submitit, :func:`llmpipe.dispatch.rendezvous.export_dist_env`) and
    pick this rank's device: NCCL on the local rank's GPU when CUDA is there (``backend: auto``), else gloo on the
    CPU. Returns ``(dist_env, backend, torch.device, device name)``."""
    import torch
    import torch.distributed as dist

    from llmpipe.dispatch.rendezvous import export_dist_env

    env = export_dist_env()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", int(env["local_rank"]) % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        device_name = torch.cuda.get_device_name(device)
    else:
        device, device_name = torch.device("cpu"), "cpu"
    dist.init_process_group(backend=backend, init_method="env://", rank=int(env["rank"]),
                            world_size=int(env["world_size"]))
    return env, backend, device, device_name


class AllReduceTask:
    """The bandwidth sweep as submitit runs it in every task of the job; rank 0 returns the rows.

    Args:
        sizes: message sizes in bytes (see :func:`sweep_sizes`).
        dtype: an nccl-tests type name (:data:`DTYPES`).
        warmup, iters: untimed and timed calls per size and variant.
        backend: ``auto`` (NCCL when CUDA is available, else gloo), ``nccl`` or ``gloo``.
        check: run one extra call per size and variant on known values and count wrong elements.
        nodes: nodes of the allocation (written to the rows).
    """

    def __init__(self, sizes: list[int], dtype: str = "float", warmup: int = 5, iters: int = 20,
                 backend: str = "auto", check: bool = True, nodes: int = 1):
        self.sizes, self.dtype, self.warmup, self.iters = list(sizes), dtype, int(warmup), int(iters)
        self.backend, self.check, self.nodes = backend, bool(check), int(nodes)

    def __call__(self) -> list[dict] | None:
        import torch
        import torch.distributed as dist

        env, backend, device, device_name = init_group(self.backend)
        rank, ws = int(env["rank"]), int(env["world_size"])
        try:
            print(f"llmpipe: all-reduce rank {rank}/{ws} on {env.get('hostname', 'localhost')} ({backend}, "
                  f"{device_name}); {len(self.sizes)} sizes {self.sizes[0]}..{self.sizes[-1]} B", flush=True)
            rows = []
            for size in self.sizes:
                row = self._one_size(size, ws, device, backend, device_name)
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # this size's buffers are gone: give their memory back
                if rank == 0:
                    print(f"llmpipe: {size:>12} B  oop {row['oop_time_us']:>10.2f} us {row['oop_busbw_gbps']:>8.2f}"
                          f" GB/s  ip {row['ip_time_us']:>10.2f} us {row['ip_busbw_gbps']:>8.2f} GB/s  "
                          f"#wrong {row['oop_wrong']}/{row['ip_wrong']}", flush=True)
            dist.barrier()
        finally:
            # gloo's destroy_process_group can block forever once a peer has exited (seen here: rank 1 stuck in it
            # after rank 0 returned); the process ends right after, which releases gloo's sockets anyway.
            if backend == "nccl":
                dist.destroy_process_group()
        return rows if rank == 0 else None

    def _one_size(self, size: int, ws: int, device, backend: str, device_name: str) -> dict:
        import torch
        import torch.distributed as dist

        tname, el = DTYPES[self.dtype]
        dtype = getattr(torch, tname)
        count = size // el
        inp = torch.zeros(count, dtype=dtype, device=device)
        out = torch.zeros(count, dtype=dtype, device=device)
        row: dict[str, Any] = {"size_bytes": count * el, "count": count, "type": self.dtype, "redop": "sum",
                               "root": -1}
        for prefix, in_place in (("oop", False), ("ip", True)):
            if in_place:
                def op():
                    dist.all_reduce(out)
            else:
                def op():
                    out.copy_(inp)
                    dist.all_reduce(out)
            t = self._time(op, device)
            t_avg = torch.tensor([t], dtype=torch.float64, device=device)
            dist.all_reduce(t_avg)
            t_s = float(t_avg.item()) / ws
            algbw, busbw = bandwidths(count * el, t_s, ws)
            wrong = self._check(inp, out, in_place, ws, device) if self.check else -1
            row.update({f"{prefix}_time_us": round(t_s * 1e6, 3), f"{prefix}_algbw_gbps": round(algbw, 6),
                        f"{prefix}_busbw_gbps": round(busbw, 6), f"{prefix}_wrong": wrong})
        row.update({"nodes": self.nodes, "ranks": ws, "backend": backend, "device": device_name,
                    "warmup": self.warmup, "iters": self.iters})
        return row

    def _time(self, op, device) -> float:
        """Seconds per call: ``warmup`` untimed calls, then ``iters`` back to back (CUDA events on GPUs)."""
        import torch
        import torch.distributed as dist

        for _ in range(self.warmup):
            op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.iters):
                op()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / self.iters
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(self.iters):
            op()
        return (time.perf_counter() - t0) / self.iters

    def _check(self, inp, out, in_place: bool, ws: int, device) -> int:
        """One all-reduce of known values; the number of wrong elements summed over ranks.

        Rank ``r`` holds ``(r + 1) + (i mod 3)`` at index ``i``; the sum over ``n`` ranks is
        ``n (n + 1) / 2 + n (i mod 3)`` (small integers: exact in 32/64-bit types; 16-bit floats are compared with a
        1 % tolerance). Filled and compared in chunks so an 8 GiB buffer needs no 8 GiB temporaries. For the
        out-of-place variant an input changed by the call counts as wrong too."""
        import torch
        import torch.distributed as dist

        rank, n = dist.get_rank(), inp.numel()
        chunk = 1 << 24
        exact = inp.dtype in (torch.float32, torch.float64, torch.int32, torch.int64)

        def pattern(a: int, b: int, plus: int, times: int):
            return (torch.arange(a, b, device=device) % 3) * times + plus

        target = out if in_place else inp
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            target[a:b].copy_(pattern(a, b, rank + 1, 1).to(inp.dtype))
        if not in_place:
            out.copy_(inp)
        dist.all_reduce(out)
        bad = 0
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            want = pattern(a, b, ws * (ws + 1) // 2, ws).to(torch.float64)
            got = out[a:b].to(torch.float64)
            diff = (got != want) if exact else ((got - want).abs() > 1e-2 * want.abs())
            bad += int(diff.sum().item())
            if not in_place:
                bad += int((inp[a:b].to(torch.float64) != pattern(a, b, rank + 1, 1).to(torch.float64)).sum().item())
        wrong = torch.tensor([bad], dtype=torch.int64, device=device)
        dist.all_reduce(wrong)
        return int(wrong.item())


# ------------------------------------------------------------------------------------------- files

def write_csv(path: str, rows: list[dict]) -> None:
    """Write the sweep's rows to ``path`` (columns :data:`COLUMNS`) atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    os.replace(tmp, path)


def write_markdown(path: str, rows: list[dict], s: dict) -> None:
    """Write the sweep's rows to ``path`` as a titled Markdown table (:func:`to_markdown`) atomically; ``s`` is
    the bench's :func:`settings` (warmup and iterations go into the title)."""
    import pandas as pd

    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(f"All-reduce sweep on {rows[0]['nodes']} node(s), {rows[0]['ranks']} ranks, {rows[0]['backend']} on "
                 f"{rows[0]['device']}; {s['warmup']} warmup + {s['iters']} timed calls per size. busbw = algbw x "
                 f"2(n-1)/n (nccl-tests doc/PERFORMANCE.md). Out-of-place time includes torch's copy into the "
                 f"output buffer.\n\n")
        fh.write(to_markdown(pd.DataFrame(rows)))
    os.replace(tmp, path)


def read_csv(path: str):
    """The sweep of one CSV as a pandas DataFrame."""
    import pandas as pd
    return pd.read_csv(path)


def to_markdown(df) -> str:
    """The sweep as a Markdown table in nccl-tests' layout (out-of-place, then in-place columns; times and
    bandwidths with 2 decimals as nccl-tests prints them; the CSV keeps full precision)."""
    heads = ["size (B)", "count (elements)", "type", "redop", "root",
             "oop time (us)", "oop algbw (GB/s)", "oop busbw (GB/s)", "oop #wrong",
             "ip time (us)", "ip algbw (GB/s)", "ip busbw (GB/s)", "ip #wrong"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for d in df.to_dict("records"):
        cells = [f"{d[c]:.2f}" if c.endswith(("_time_us", "_gbps")) else str(d[c]) for c in COLUMNS[:13]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_busbw(csv_paths: dict[int, str], png: str, title: str | None = None) -> None:
    """Bus bandwidth (GB/s, in-place, solid; out-of-place, dashed) versus message size, one line per node count.

    Args:
        csv_paths: node count -> CSV written by the bench (an empty dict draws an empty, labelled plot).
        png: the PNG to write.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for nodes in sorted(csv_paths):
        df = pd.read_csv(csv_paths[nodes])
        label = f"{nodes} node{'s' if nodes > 1 else ''} ({int(df['ranks'].iloc[0])} ranks, {df['backend'].iloc[0]})"
        line, = ax.plot(df["size_bytes"], df["ip_busbw_gbps"], marker="o", ms=3, label=label)
        ax.plot(df["size_bytes"], df["oop_busbw_gbps"], ls="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    finish_and_save(fig, ax, png, xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
                    title=title or "All-reduce bus bandwidth (solid: in-place, dashed: out-of-place)",
                    has_data=bool(csv_paths), empty_text="no all-reduce results", grid_which="both")


# ------------------------------------------------------------------------------------------- the gate

def gate_nodes(config: dict, run: str, nodes: int | None = None) -> int | None:
    """The node count whose bench result gates ``run``'s training, or None when there is no gate.

    None when ``allreduce.gate`` is off or the training has a single rank (nothing to communicate).
    ``nodes`` overrides the run's own (scaling studies)."""
    s = settings(config)
    if not s.get("gate"):
        return None
    res = step_resources(config, "train", run)
    if nodes is not None:
        res = dict(res, nodes=int(nodes))
    if world_size(res) <= 1:
        return None
    return int(res["nodes"])


def check_gate(config: dict, csv_path: str, where: str) -> dict:
    """Compare the measured in-place busbw at ``allreduce.gate.size_bytes`` with ``min_busbw_gbps``.

    Returns the gate record (written by the gate rule). Raises:
        RuntimeError: busbw below the threshold, wrong elements, or the size missing; the message names the
            NCCL settings to look at.
    """
    s = settings(config)
    gate = s["gate"]
    import pandas as pd
    df = pd.read_csv(csv_path)
    size, floor = int(gate["size_bytes"]), float(gate["min_busbw_gbps"])
    row = df[df["size_bytes"] == size]
    if row.empty:
        raise RuntimeError(f"{where}: {csv_path} has no result at allreduce.gate.size_bytes = {size}. Fix: rerun the "
                           f"bench with a sweep that includes it (allreduce.min_bytes/max_bytes).")
    r = row.iloc[0]
    busbw = float(r["ip_busbw_gbps"])
    wrong = int(r["ip_wrong"]) + int(r["oop_wrong"])
    rec = {"where": where, "csv": csv_path, "size_bytes": size, "min_busbw_gbps": floor, "busbw_gbps": busbw,
           "nodes": int(r["nodes"]), "ranks": int(r["ranks"]), "backend": r["backend"], "wrong": wrong}
    if wrong > 0 or busbw < floor:
        why = (f"{wrong} wrong element(s) in the all-reduce result" if wrong > 0 else
               f"all-reduce bus bandwidth at {size} B is {busbw:.2f} GB/s on {rec['nodes']} node(s) x "
               f"{rec['ranks']} ranks ({rec['backend']}), below allreduce.gate.min_busbw_gbps = {floor}")
        raise RuntimeError(
            f"{where}: training refuses to start: {why} ({csv_path}). The interconnect is misconfigured or slow: "
            f"check slurm.env NCCL_SOCKET_IFNAME (the interface NCCL bootstraps and sends socket traffic on, e.g. "
            f"ib0 or the RoCE interface, not a slow management eth0), NCCL_IB_HCA / NCCL_IB_DISABLE / "
            f"NCCL_IB_GID_INDEX (whether InfiniBand/RoCE is used), and run the bench with NCCL_DEBUG=INFO: "
            f"'NET/Socket' instead of 'NET/IB' means no RDMA. To train anyway, lower or remove allreduce.gate.")
    rec["passed"] = True
    return rec
