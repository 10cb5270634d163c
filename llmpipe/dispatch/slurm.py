"""The Slurm side of dispatch: a configured submitit ``SlurmExecutor`` per step, and a preflight check.

Where a step runs is site config, ``config['slurm']`` (defaults: :data:`DEFAULTS`, documented in
``config/slurm-site.yaml``, which ``profiles/slurm`` merges). What a step needs is the step's ``resources``
(``nodes, gpus_per_node, tasks_per_node, cpus_per_task, mem_gb, time_min``); a step's resources may also carry a
``slurm:`` mapping that overrides site keys for that step only (e.g. ``data_resources: {slurm: {partition: cpu}}``).

This module imports neither torch nor submitit at import time: :func:`preflight` runs in the Snakefile at
dry-run time and costs three ``scontrol``/``sinfo`` calls, plus two ``sacctmgr`` calls where the cluster enforces
associations (all cached per process).
"""

from __future__ import annotations

import functools
import getpass
import os
import pwd
import re
import shlex
import shutil
import subprocess
from typing import Any

from llmpipe.config.runs import deep_merge
from llmpipe.config.schema import check_part, section_defaults
from llmpipe.config.settings import ConfigError

#: Site settings read from ``config['slurm']`` when it does not set them: the schema's defaults of ``slurm:``
#: (schemas/config.schema.yaml, which documents every key).
DEFAULTS: dict[str, Any] = section_defaults("slurm")


def site_config(config: dict, resources: dict | None = None) -> dict:
    """The effective Slurm site settings for one step.

    :data:`DEFAULTS`, overlaid with ``config['slurm']``, overlaid with ``resources['slurm']`` (per-step overrides).

    Raises:
        ConfigError: ``slurm`` (or ``resources.slurm``) breaks the schema's ``slurm`` shape (an unknown key, a
            wrong type, an unknown ``container.type``), or a container type has no image.
    """
    site = config.get("slurm") or {}
    check_part(site, "slurm", "slurm")
    out = deep_merge(DEFAULTS, site)
    over = (resources or {}).get("slurm")
    if over:
        check_part(over, "slurm", "resources.slurm")
        out = deep_merge(out, over)
    out["container"] = dict(out.get("container") or {})
    ctype = out["container"].get("type")
    if ctype in ("pyxis", "apptainer") and not out["container"].get("image"):
        raise ConfigError(f"slurm.container.type is {ctype} but slurm.container.image is not set. "
                          f"Fix: set the image (a registry reference or a .sqsh/.sif file), or type: null.")
    return out


def tasks_per_node(resources: dict) -> int:
    """Tasks per node: ``tasks_per_node`` when given, else one per GPU (``gpus_per_node``), else 1."""
    t = resources.get("tasks_per_node")
    if t:
        return int(t)
    gpus = int(resources.get("gpus_per_node", 0) or 0)
    return gpus if gpus > 0 else 1


def _gres(site: dict, gpus: int) -> str:
    gtype = site.get("gpu_type")
    return f"gpu:{gtype}:{gpus}" if gtype else f"gpu:{gpus}"


def _python_and_srun_args(site: dict) -> tuple[str | None, list[str]]:
    """The python command of the job (None: this interpreter) and the srun arguments, container included."""
    srun_args = [str(a) for a in site.get("srun_args") or []]
    cont = site.get("container") or {}
    ctype = cont.get("type")
    mounts = [str(m) for m in cont.get("mounts") or []]
    if ctype == "apptainer":
        cmd = [str(cont.get("apptainer") or "apptainer"), "exec", *[str(a) for a in cont.get("apptainer_args") or []]]
        if mounts:
            cmd.append("--bind=" + ",".join(mounts))
        cmd += [str(cont["image"]), str(cont.get("python") or "python")]
        return " ".join(shlex.quote(c) for c in cmd), srun_args
    if ctype == "pyxis":
        srun_args.append(f"--container-image={cont['image']}")
        if mounts:
            srun_args.append("--container-mounts=" + ",".join(mounts))
        if cont.get("workdir"):
            srun_args.append(f"--container-workdir={cont['workdir']}")
        srun_args += [str(a) for a in cont.get("pyxis_args") or []]
        return shlex.quote(str(cont.get("python") or "python")), srun_args
    return None, srun_args


#: sbatch options a step sets from other settings, which ``slurm.sbatch_args`` can neither set nor remove (each with
#: the setting to change instead).
SBATCH_OWNED = {
    "signal": "slurm.signal_delay_s", "time": "the step's resources.time_min", "nodes": "resources.nodes",
    "ntasks_per_node": "resources.tasks_per_node (gpus_per_node on GPUs)", "ntasks": "resources.tasks_per_node",
    "cpus_per_task": "resources.cpus_per_task", "gres": "resources.gpus_per_node and slurm.gpu_type",
    "gpus_per_node": "resources.gpus_per_node", "gpus": "resources.gpus_per_node", "mem": "resources.mem_gb",
    "partition": "slurm.partition", "account": "slurm.account", "qos": "slurm.qos", "constraint": "slurm.constraint",
    "exclusive": "slurm.exclusive", "job_name": "nothing (the step names its job)",
    "output": "nothing (submitit writes the job's logs)", "error": "nothing (submitit writes the job's logs)",
    "array": "nothing (the data steps submit their own arrays)",
}
#: What ``sbatch_args`` may remove with false/null: the options llmpipe adds besides those above.
SBATCH_DEFAULTS = {"requeue": True}   # preemption and time-limit checkpoints requeue the job


def sbatch_extra(site: dict) -> dict:
    """The extra sbatch options of ``slurm.sbatch_args`` over :data:`SBATCH_DEFAULTS` (true: a bare flag; false or
    null: remove one of those defaults; ``--config`` strings read as YAML would).

    Raises:
        ConfigError: an option that another setting owns (:data:`SBATCH_OWNED`, naming it), or false/null for an
            option llmpipe does not add (nothing would be removed).
    """
    extra: dict[str, Any] = dict(SBATCH_DEFAULTS)
    for key, v in (site.get("sbatch_args") or {}).items():
        k = str(key).lstrip("-").replace("-", "_")
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "null", "~"):
            v = {"true": True, "false": False}.get(v.strip().lower())  # `--config` strings, read as YAML would
        if k in SBATCH_OWNED:
            raise ConfigError(f"slurm.sbatch_args.{key} cannot be applied: the step sets --{k.replace('_', '-')} "
                              f"from {SBATCH_OWNED[k]}. Fix: change that instead and remove sbatch_args.{key}.")
        if v is None or v is False:
            if k not in SBATCH_DEFAULTS:
                raise ConfigError(f"slurm.sbatch_args.{key} is {v!r}, which removes an option, but llmpipe adds no "
                                  f"--{k.replace('_', '-')} (it adds only "
                                  f"{', '.join('--' + d for d in SBATCH_DEFAULTS)}). Fix: remove sbatch_args.{key}.")
            extra.pop(k, None)
        else:
            extra[k] = v
    return extra


def sbatch_parameters(config: dict, resources: dict, name: str) -> dict:
    """The submitit ``SlurmExecutor`` parameters for one step (what :func:`make_executor` passes on).

    Units: ``time`` in minutes (from ``resources.time_min``), ``mem`` as ``<N>GB`` (``resources.mem_gb``; 0 leaves
    memory to the site's default and is not sent), ``signal_delay_s`` in seconds.
    """
    site = site_config(config, resources)
    gpus = int(resources.get("gpus_per_node", 0) or 0)
    params: dict[str, Any] = {
        "job_name": name,
        "nodes": int(resources.get("nodes", 1)),
        "ntasks_per_node": tasks_per_node(resources),
        "cpus_per_task": int(resources.get("cpus_per_task", 1) or 1),
        "time": int(resources.get("time_min", 60)),
        "signal_delay_s": int(site["signal_delay_s"]),
    }
    if gpus > 0:
        params["gres"] = _gres(site, gpus)
    mem = float(resources.get("mem_gb", 0) or 0)
    if mem > 0:
        params["mem"] = f"{int(mem)}GB" if mem == int(mem) else f"{int(mem * 1024)}MB"
    for key in ("partition", "account", "qos", "constraint"):
        if site.get(key):
            params[key] = str(site[key])
    if site.get("exclusive"):
        params["exclusive"] = True
    params["additional_parameters"] = sbatch_extra(site)
    setup = [f"export {k}={shlex.quote(str(v))}" for k, v in (site.get("env") or {}).items()
             if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k))]
    bad = [k for k in (site.get("env") or {}) if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k))]
    if bad:
        raise ConfigError(f"slurm.env has invalid variable name(s) {bad}. Fix: use shell variable names.")
    setup += [str(line) for line in site.get("setup") or []]
    if setup:
        params["setup"] = setup
    _, srun_args = _python_and_srun_args(site)
    if srun_args:
        params["srun_args"] = srun_args
    return params


def make_executor(config: dict, resources: dict, folder: str, name: str):
    """A ``submitit.SlurmExecutor`` configured for one step.

    ``nodes x ntasks_per_node`` tasks (one per GPU, or ``tasks_per_node`` on CPU nodes), ``--gres=gpu:N`` when the
    step needs GPUs, ``--cpus-per-task``, ``--mem`` (unless ``mem_gb`` is 0), ``--time`` (minutes), the site's
    partition/account/qos/constraint/exclusive and extra sbatch/srun arguments, ``export`` lines for
    ``slurm.env``, ``--signal=USR2@slurm.signal_delay_s`` and ``--requeue`` (so checkpointing steps resume after a
    preemption or time limit) and, with ``slurm.container``, pyxis ``--container-image`` srun arguments or an
    ``apptainer exec IMAGE python`` wrapper around the job's python.

    Args:
        config: the workflow config (``slurm`` is read; see config/slurm-site.yaml).
        resources: the step's resources (see :func:`llmpipe.config.runs.step_resources`).
        folder: where submitit writes the job's pickles and logs (``%j`` is the job id); must be on a filesystem
            the compute nodes share.
        name: the job name (``squeue``/``sacct``).

    Raises:
        ConfigError: ``sbatch``/``srun`` are not on PATH, or a ``slurm`` setting is invalid.
    """
    for tool in ("sbatch", "srun"):
        if shutil.which(tool) is None:
            raise ConfigError(f"dispatch.executor is slurm but `{tool}` is not on PATH. Fix: run snakemake on a "
                              f"Slurm login node (or load the slurm module), or drop --profile slurm to run locally.")
    import submitit

    site = site_config(config, resources)
    python, _ = _python_and_srun_args(site)
    from llmpipe.dispatch.requeue import first_countdown

    ex = submitit.SlurmExecutor(folder=folder, python=python,
                                max_num_timeout=first_countdown(int(site["max_requeue_timeouts"])))
    ex.update_parameters(**sbatch_parameters(config, resources, name))
    return ex


# ---------------------------------------------------------------------------------------------- cluster queries

#: Appended to the errors of a cluster query that failed: how to dry-run the Slurm plan without a cluster.
OFFLINE_PLAN_HINT = (" To see the Slurm plan away from the cluster, turn off the site setting slurm.preflight: "
                     "snakemake -n --profile slurm <target> "
                     "--config 'slurm={preflight: false}'.")


def _run(cmd: list[str], timeout: float, fix: str = "check `sinfo` works here (SLURM_CONF, munge)") -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise ConfigError(f"`{cmd[0]}` is not on PATH. Fix: run on a Slurm login node (or load the slurm "
                          f"module), or drop --profile slurm to run locally.{OFFLINE_PLAN_HINT}") from exc
    except subprocess.TimeoutExpired as exc:
        who = "slurmdbd" if cmd[0] == "sacctmgr" else "the Slurm controller"
        raise ConfigError(f"`{' '.join(cmd)}` did not answer within {timeout:.0f} s: {who} is not reachable. "
                          f"Fix: {fix}.{OFFLINE_PLAN_HINT}") from exc
    if out.returncode != 0:
        raise ConfigError(f"`{' '.join(cmd)}` failed (exit {out.returncode}): {out.stderr.strip()[-500:]}. "
                          f"Fix: {fix}, or drop --profile slurm."
                          f"{OFFLINE_PLAN_HINT}")
    return out.stdout


def _kv(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value2`` (scontrol -o) to a dict; values never contain spaces in the keys we read."""
    out = {}
    for tok in line.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k] = v
    return out


def parse_time_min(text: str) -> float:
    """A Slurm time (``MaxTime``) in minutes; ``inf`` for UNLIMITED/INFINITE.

    Accepts ``minutes``, ``minutes:seconds``, ``hours:minutes:seconds``, ``days-hours``, ``days-hours:minutes``
    and ``days-hours:minutes:seconds``. Raises ValueError for anything else.
    """
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE", "NONE", ""):
        return float("inf")
    days = 0
    if "-" in t:
        d, t = t.split("-", 1)
        days = int(d)
        parts = [int(p) for p in t.split(":")]
        h, m, s = (parts + [0, 0])[:3]
        return days * 1440 + h * 60 + m + s / 60
    parts = [int(p) for p in t.split(":")]
    if len(parts) == 1:
        return float(parts[0])
    if len(parts) == 2:
        return parts[0] + parts[1] / 60
    if len(parts) == 3:
        return parts[0] * 60 + parts[1] + parts[2] / 60
    raise ValueError(f"not a Slurm time: {text!r}")


def parse_gpus(gres: str, gpu_type: str | None = None) -> int:
    """Number of GPUs in a node's GRES string (``gpu:4``, ``gpu:a100:8(S:0-1)``, ``gpu:a100:4,gpu:v100:2``).

    With ``gpu_type`` only GPUs of that type count (untyped GPUs never do).
    """
    total = 0
    for item in re.split(r",(?![^()]*\))", gres or ""):
        item = re.sub(r"\(.*?\)", "", item).strip()
        parts = item.split(":")
        if not parts or parts[0] != "gpu":
            continue
        count = int(parts[-1]) if len(parts) >= 2 and parts[-1].isdigit() else 1
        gtype = parts[1] if len(parts) == 3 else None
        if gpu_type and gtype != gpu_type:
            continue
        total += count
    return total


def gres_types(gres: str, gpu_type: str | None = None) -> set[str]:
    """The GPU types a node's GRES string names (``gpu:h100:8(S:0-1)`` -> ``{'h100'}``; untyped GPUs name none);
    with ``gpu_type`` (``slurm.gpu_type``) only that one."""
    out = set()
    for item in re.split(r",(?![^()]*\))", gres or ""):
        parts = re.sub(r"\(.*?\)", "", item).strip().split(":")
        if len(parts) == 3 and parts[0] == "gpu" and (not gpu_type or parts[1] == gpu_type) and \
                (not parts[2].isdigit() or int(parts[2]) > 0):
            out.add(parts[1])
    return out


def _conf_key() -> str:
    return os.environ.get("SLURM_CONF", "")


@functools.lru_cache(maxsize=8)
def _partitions(conf_key: str, timeout: float) -> dict[str, dict[str, str]]:
    out = _run(["scontrol", "show", "partition", "--oneliner"], timeout)
    parts = {}
    for line in out.splitlines():
        kv = _kv(line)
        if "PartitionName" in kv:
            parts[kv["PartitionName"]] = kv
    return parts


@functools.lru_cache(maxsize=32)
def _nodes(conf_key: str, partition: str, timeout: float) -> list[dict[str, Any]]:
    out = _run(["sinfo", "--noheader", "--Node", "--partition", partition, "--format", "%N|%G|%c|%m|%t"],
               timeout)
    nodes = {}
    for line in out.splitlines():
        f = line.strip().split("|")
        if len(f) != 5:
            continue
        name, gres, cpus, mem, state = f
        nodes[name] = {"name": name, "gres": gres, "cpus": int(cpus) if cpus.isdigit() else 0,
                       "mem_mb": int(mem) if mem.rstrip("+").isdigit() else 0, "state": state}
    return list(nodes.values())


@functools.lru_cache(maxsize=8)
def _cluster_config(conf_key: str, timeout: float) -> dict[str, str]:
    """``scontrol show config`` as a dict (its ``Key = Value`` lines)."""
    conf = {}
    for line in _run(["scontrol", "show", "config"], timeout).splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            conf[key.strip()] = value.strip()
    return conf


def enforced_flags(text: str) -> frozenset[str]:
    """The flags of Slurm's ``AccountingStorageEnforce`` (as ``scontrol show config`` prints it), lower-case, with
    what slurm.conf(5) says they imply: ``limits``, ``qos``, ``wckeys`` and ``safe`` imply ``associations``, ``safe``
    implies ``limits``, ``all`` is all of them; ``none`` or empty gives no flag."""
    flags = {f.strip().lower() for f in (text or "").split(",")} - {"", "none", "(null)"}
    if "all" in flags:
        flags |= {"associations", "limits", "qos", "safe", "wckeys"}
    if "safe" in flags:
        flags.add("limits")
    if flags & {"limits", "qos", "wckeys", "safe"}:
        flags.add("associations")
    return frozenset(flags)


_SACCTMGR_FIX = ("check that `sacctmgr show associations` works here (SLURM_CONF, munge, slurmdbd reachable), or "
                 "skip the whole check with slurm.preflight: false")


@functools.lru_cache(maxsize=8)
def _associations(conf_key: str, user: str, cluster: str, timeout: float) -> tuple[tuple[dict[str, str], ...], str]:
    """The user's associations (``account``, ``partition``, ``qos`` comma-separated, ``defaultqos``; lower-case, as
    Slurm compares them) and his default account ('' when none), from ``sacctmgr``."""
    keys = ("account", "partition", "qos", "defaultqos")
    where = [f"user={user}"] + ([f"cluster={cluster}"] if cluster else [])
    out = _run(["sacctmgr", "--noheader", "--parsable2", "show", "associations", "where", *where,
                f"format={','.join(keys)}"], timeout, fix=_SACCTMGR_FIX)
    rows = tuple(dict(zip(keys, (f.strip().lower() for f in line.split("|")))) for line in out.splitlines()
                 if line.count("|") == len(keys) - 1)
    out = _run(["sacctmgr", "--noheader", "--parsable2", "show", "user", user, "format=defaultaccount"], timeout,
               fix=_SACCTMGR_FIX)
    return rows, next((line.strip().lower() for line in out.splitlines() if line.strip()), "")


def _slurm_user() -> str:
    """The user sbatch submits as (the real uid's name)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return getpass.getuser()


def _accounting(timeout: float) -> dict[str, Any]:
    """What :func:`check_associations` needs from the cluster; ``sacctmgr`` is asked only where enforced."""
    conf = _cluster_config(_conf_key(), timeout)
    enforce = conf.get("AccountingStorageEnforce", "none")
    if "associations" not in enforced_flags(enforce):
        return {"enforce": enforce}
    user, cluster = _slurm_user(), conf.get("ClusterName", "")
    try:
        rows, default = _associations(_conf_key(), user, cluster, timeout)
    except ConfigError as exc:
        raise ConfigError(f"This Slurm cluster enforces associations (AccountingStorageEnforce={enforce}), so the "
                          f"preflight checks slurm.account and slurm.qos with sacctmgr, which did not answer: "
                          f"{exc}") from exc
    return {"enforce": enforce, "user": user, "cluster": cluster, "associations": rows, "default_account": default}


def check_associations(site: dict, resources: dict, partition: str, accounting: dict,
                       where: str = "resources") -> dict[str, str] | None:
    """Refuse an account or QOS that sbatch would refuse on a cluster that enforces associations.

    Where ``AccountingStorageEnforce`` includes ``associations`` (:func:`enforced_flags`), the job's account
    (``slurm.account``, else the user's default account) must be one of the user's associations for ``partition``
    (an association without a partition counts for all); where it includes ``qos``, a set ``slurm.qos`` must be in
    that association's QOS list. Names compare case-insensitively, as Slurm's do.

    Args:
        site: the step's effective Slurm site settings (:func:`site_config`).
        resources: the step's resources (its ``slurm`` overrides are named as such in messages).
        partition: the partition the job goes to.
        accounting: ``enforce`` (AccountingStorageEnforce as ``scontrol show config`` prints it) and, where
            associations are enforced, ``user``, ``cluster``, ``associations`` (rows with ``account``,
            ``partition``, ``qos``, ``defaultqos``) and ``default_account``.
        where: the config path of ``resources`` for messages.

    Returns:
        The association row the job would use, or None where associations are not enforced.

    Raises:
        ConfigError: naming the setting, the user's accounts or the association's QOS, and the fix.
    """
    flags = enforced_flags(accounting.get("enforce", ""))
    if "associations" not in flags:
        return None
    over = resources.get("slurm") or {}
    at_acct = f"{where}.slurm.account" if "account" in over else "slurm.account"
    at_qos = f"{where}.slurm.qos" if "qos" in over else "slurm.qos"
    user, cluster, default = accounting["user"], accounting["cluster"], accounting.get("default_account") or ""
    why = f"(AccountingStorageEnforce={accounting['enforce']})"
    rows = sorted((r for r in accounting["associations"] if r["partition"] in ("", partition.lower())),
                  key=lambda r: r["partition"] == "")   # an association for this partition wins over a general one
    here = sorted({r["account"] for r in rows})
    other = sorted({f"{r['account']} (partition {r['partition']})" for r in accounting["associations"]
                    if r["partition"] not in ("", partition.lower())})
    has = (f"Slurm user {user!r} has {'the account(s) ' + ', '.join(here) if here else 'no account'} for "
           f"partition {partition!r} on cluster {cluster!r} (default account: {default or 'none'}"
           f"{'; other partitions: ' + ', '.join(other) if other else ''})")
    ask = f"ask the cluster's administrators for the association (sacctmgr add user {user} account=ACCOUNT)"
    account = str(site.get("account") or "").lower()
    if account and account not in here:
        raise ConfigError(f"{at_acct} is {site['account']!r}, but {has}, and this cluster enforces associations "
                          f"{why}: sbatch would refuse the job (Invalid account). Fix: set {at_acct} to one of those "
                          f"accounts"
                          f"{' (or leave it unset: the default account)' if default in here else ''}, or "
                          f"{ask.replace('ACCOUNT', account)}.")
    if not account and default not in here:
        raise ConfigError(f"{at_acct} is not set, so jobs would use the default account, but {has}, and this cluster "
                          f"enforces associations {why}: sbatch would refuse every job (Invalid account). Fix: "
                          f"{'set ' + at_acct + ' to one of those accounts' if here else ask}.")
    account = account or default
    assoc = next(r for r in rows if r["account"] == account)
    allowed = sorted(q for q in assoc["qos"].split(",") if q)
    qos = str(site.get("qos") or "").lower()
    if qos and "qos" in flags and qos not in allowed:
        dq = assoc.get("defaultqos")
        via = ", ".join(sorted({r["account"] for r in rows if qos in r["qos"].split(",")}))
        raise ConfigError(f"{at_qos} is {site['qos']!r}, but the association of Slurm user {user!r} with account "
                          f"{account!r} on cluster {cluster!r} allows only the QOS {', '.join(allowed) or 'none'}, "
                          f"and this cluster enforces QOS {why}: sbatch would refuse the job (Invalid qos "
                          f"specification). Fix: set {at_qos} to one of those"
                          f"{f' (or leave it unset: the default QOS {dq})' if dq else ''}"
                          f"{f', or {at_acct} to an account whose association allows it: {via}' if via else ''}"
                          f", or ask the cluster's administrators to allow it (sacctmgr modify user {user} where "
                          f"account={account} set qos+={qos}).")
    return assoc


def clear_cache() -> None:
    """Forget cached ``scontrol``/``sinfo``/``sacctmgr`` answers (tests change the cluster between calls)."""
    _partitions.cache_clear()
    _nodes.cache_clear()
    _cluster_config.cache_clear()
    _associations.cache_clear()


#: Seconds a job needs between its start and Slurm's USR2 signal (``slurm.signal_delay_s`` before its time limit):
#: start-up (imports, process group, first batches) plus some training, so that every allocation makes progress
#: before it checkpoints and requeues itself.
MIN_WORK_BEFORE_SIGNAL_S = 60

#: How much earlier than ``--signal=USR2@N`` asks Slurm may send it: slurmctld checks time limits about once a
#: minute, so sbatch(1) (``--signal``) warns that the signal can come up to 60 s before the time asked for.
SIGNAL_EARLY_S = 60


def max_time_fix_note(where: str) -> str:
    """Why lowering ``time_min`` to the partition's MaxTime works for the step whose resources are at ``where``
    (a config path, e.g. ``models.mpt-1b.resources`` or ``data_resources``): the note in the MaxTime refusal's fix.

    Trainings (``models.*``, ``finetunes.*``) checkpoint and requeue themselves; the data steps and the others do
    not, so their note says what a time limit does to them instead.
    """
    if where.startswith(("models.", "finetunes.")):
        return "training checkpoints and requeues itself, as many allocations as it needs"
    if where.startswith("data_resources"):
        return ("a data step is not requeued at its time limit: each of its jobs must finish within it; the mds "
                "conversion runs one job per input file, and a rerun converts only the files not finished")
    return "this step does not checkpoint: it must finish within one allocation"


def check_signal_delay(site: dict, resources: dict, where: str = "resources") -> None:
    """Refuse a ``signal_delay_s`` that can leave a job less than :data:`MIN_WORK_BEFORE_SIGNAL_S` seconds of work.

    Slurm sends USR2 ``signal_delay_s`` seconds before the time limit (``time_min`` minutes), or up to
    :data:`SIGNAL_EARLY_S` seconds earlier, and only to job steps: while the batch script runs its set-up
    (``slurm.setup``, declared to take ``slurm.setup_s`` seconds) no step exists and the signal is lost. So the
    work before the signal is at worst ``time_min x 60 - signal_delay_s - SIGNAL_EARLY_S - setup_s`` seconds; below
    the minimum the signal can come during start-up in every allocation, which is requeued without progress.

    Args:
        site: the step's effective Slurm site settings (:func:`site_config`).
        resources: the step's resources (``time_min`` in minutes).
        where: the config path of ``resources`` for messages.

    Raises:
        ConfigError: naming both settings, the seconds left, and the largest delay / smallest time limit that fit.
    """
    time_min = int(resources.get("time_min", 60))
    delay, setup = int(site["signal_delay_s"]), int(site.get("setup_s") or 0)
    left = time_min * 60 - delay - SIGNAL_EARLY_S - setup
    if left < MIN_WORK_BEFORE_SIGNAL_S:
        delay_at = f"{where}.slurm.signal_delay_s" if "signal_delay_s" in (resources.get("slurm") or {}) \
            else "slurm.signal_delay_s"
        fixed = SIGNAL_EARLY_S + setup + MIN_WORK_BEFORE_SIGNAL_S
        need_min = -(-(delay + fixed) // 60)
        lines = len(site.get("setup") or [])
        if lines and not setup:   # set-up lines of undeclared length: the fix leaves their seconds S to the user
            unknown = f"slurm.setup_s is 0 but slurm.setup has {lines} line(s), which take time before srun starts"
            fix = (f"set slurm.setup_s to the seconds S that the slurm.setup line(s) take (a module load, a "
                   f"container start), then {delay_at} to at most {max(time_min * 60 - fixed, 0)} - S, or "
                   f"{where}.time_min to at least ({delay + fixed} + S) / 60 rounded up (at least {need_min})")
        else:
            unknown = ""
            fix = f"set {delay_at} to at most {max(time_min * 60 - fixed, 0)}, or {where}.time_min to at least {need_min}"
        raise ConfigError(f"{delay_at} is {delay} s but {where}.time_min is {time_min} minute(s) ({time_min * 60} s): "
                          f"Slurm sends the checkpoint-and-requeue signal (USR2) up to {SIGNAL_EARLY_S} s earlier than "
                          f"asked, and after a set-up of slurm.setup_s={setup} s a job could have only {max(left, 0)} "
                          f"s of work before it, less than the {MIN_WORK_BEFORE_SIGNAL_S} s it needs to start and "
                          f"train: it would be requeued without progress until it fails"
                          f"{f' ({unknown}: fewer still)' if unknown else ''}. Fix: {fix} (docs/slurm.md, Signal delay).")


def preflight(config: dict, resources: dict, where: str = "resources") -> dict:
    """Check that a step's request can ever run on this cluster, before anything is submitted.

    Reads ``scontrol show partition`` and ``sinfo --Node`` (cached per process; no torch, no submitit) and checks:
    sbatch/sinfo/scontrol are on PATH, the partition (``slurm.partition``, or the cluster's default) exists and is
    up, ``nodes`` is at most the partition's node count (and its MaxNodes), enough of its nodes have
    ``gpus_per_node`` GPUs (of ``slurm.gpu_type`` when set) whose gres type is the card the plans are for (the
    top-level ``gpu_type``, :func:`llmpipe.plan.card.check_partition_card`), ``cpus_per_task x tasks`` CPUs and ``mem_gb`` memory,
    and ``time_min`` is within the partition's MaxTime. Where the cluster enforces associations
    (``AccountingStorageEnforce`` in ``scontrol show config``), it also asks ``sacctmgr`` (cached) and checks that
    ``slurm.account`` (or the user's default account) is one of the user's associations for the partition and,
    where QOS are enforced, that ``slurm.qos`` is allowed by that association (:func:`check_associations`).
    When ``slurm.preflight`` is false only the checks that ask no cluster run: ``signal_delay_s`` leaves room to
    work within ``time_min`` (:func:`check_signal_delay`) and ``slurm.sbatch_args`` can be applied
    (:func:`sbatch_extra`).

    Args:
        config: the workflow config.
        resources: the step's resources.
        where: the config path of ``resources`` for messages (e.g. ``models.mpt-1b.resources``).

    Returns:
        A summary: ``partition``, ``max_time_min``, ``total_nodes`` and ``fitting_nodes`` (empty when skipped).

    Raises:
        ConfigError: naming the setting, what the cluster has, and the fix; also where a query fails (a
            ``sacctmgr`` that fails on a cluster that enforces associations included).
    """
    site = site_config(config, resources)
    check_signal_delay(site, resources, where)
    sbatch_extra(site)   # sbatch_args that cannot be applied stop here, before anything waits in a queue
    if not site.get("preflight", True):
        return {}
    timeout = float(site.get("command_timeout_s") or 30)
    for tool in ("sbatch", "sinfo", "scontrol"):
        if shutil.which(tool) is None:
            raise ConfigError(f"dispatch.executor is slurm but `{tool}` is not on PATH. Fix: run snakemake on a "
                              f"Slurm login node (or load the slurm module), or drop --profile slurm to run locally."
                              f"{OFFLINE_PLAN_HINT}")
    parts = _partitions(_conf_key(), timeout)
    pname = site.get("partition")
    if pname:
        if pname not in parts:
            raise ConfigError(f"slurm.partition is {pname!r}, but this cluster has no such partition (it has: "
                              f"{', '.join(sorted(parts)) or 'none'}). Fix: set slurm.partition in "
                              f"config/slurm-site.yaml or with --config, to one of those.")
    else:
        defaults = [n for n, kv in parts.items() if kv.get("Default") == "YES"]
        if not defaults:
            raise ConfigError(f"slurm.partition is not set and this cluster has no default partition (it has: "
                              f"{', '.join(sorted(parts)) or 'none'}). Fix: set slurm.partition.")
        pname = defaults[0]
    p = parts[pname]
    state = p.get("State", "UP")
    if state != "UP":
        raise ConfigError(f"Slurm partition {pname!r} (slurm.partition) is {state}: jobs would wait forever. "
                          f"Fix: choose another partition with slurm.partition.")
    check_associations(site, resources, pname, _accounting(timeout), where)

    nodes = int(resources.get("nodes", 1))
    total = int(p.get("TotalNodes", "0") or 0)
    if nodes > total:
        raise ConfigError(f"{where}.nodes is {nodes}, but Slurm partition {pname!r} has only {total} node(s) "
                          f"({p.get('Nodes', '?')}). Fix: lower {where}.nodes to at most {total}, or pick a bigger "
                          f"partition with slurm.partition.")
    max_nodes = p.get("MaxNodes", "UNLIMITED")
    if max_nodes.isdigit() and nodes > int(max_nodes):
        raise ConfigError(f"{where}.nodes is {nodes}, but Slurm partition {pname!r} allows at most {max_nodes} "
                          f"node(s) per job (MaxNodes). Fix: lower {where}.nodes, or pick another partition.")

    time_min = float(resources.get("time_min", 60))
    max_time = parse_time_min(p.get("MaxTime", "UNLIMITED"))
    if time_min > max_time:
        raise ConfigError(f"{where}.time_min is {time_min:g} minutes, but Slurm partition {pname!r} allows at most "
                          f"{max_time:g} minutes (MaxTime={p.get('MaxTime')}): the job would wait forever "
                          f"(PartitionTimeLimit). Fix: set {where}.time_min to at most {max_time:g} "
                          f"({max_time_fix_note(where)}), or pick another partition with slurm.partition.")

    gpus = int(resources.get("gpus_per_node", 0) or 0)
    tasks = tasks_per_node(resources)
    cpus = int(resources.get("cpus_per_task", 1) or 1) * tasks
    mem_mb = float(resources.get("mem_gb", 0) or 0) * 1024
    node_list = _nodes(_conf_key(), pname, timeout)
    gtype = site.get("gpu_type")
    what = f"gpu:{gtype}" if gtype else "GPU"
    if gpus > 0:
        best = max((parse_gpus(n["gres"], gtype) for n in node_list), default=0)
        if gpus > best:
            raise ConfigError(f"{where}.gpus_per_node is {gpus}, but the nodes of Slurm partition {pname!r} have at "
                              f"most {best} {what}(s) each. Fix: set {where}.gpus_per_node to at most {best} "
                              f"(and raise nodes instead), or pick a GPU partition with slurm.partition"
                              f"{'' if not gtype else ' or change slurm.gpu_type'}.")
    if gpus > 0:
        from llmpipe.plan import card
        card.check_partition_card(config, sorted(set().union(*(gres_types(n["gres"], gtype) for n in node_list))),
                                  pname, gtype)
    fitting = [n for n in node_list if (gpus == 0 or parse_gpus(n["gres"], gtype) >= gpus)
               and (not n["cpus"] or n["cpus"] >= cpus) and (not mem_mb or not n["mem_mb"] or n["mem_mb"] >= mem_mb)]
    if len(fitting) < nodes:
        max_cpus = max((n["cpus"] for n in node_list), default=0)
        max_mem_gb = max((n["mem_mb"] for n in node_list), default=0) / 1024
        raise ConfigError(f"{where} asks for {nodes} node(s) with {gpus} {what}(s), {cpus} CPUs "
                          f"(cpus_per_task x {tasks} tasks) and {resources.get('mem_gb', 0) or 0} GB each, but only "
                          f"{len(fitting)} node(s) of Slurm partition {pname!r} have that (most CPUs on a node: "
                          f"{max_cpus}, most memory: {max_mem_gb:.1f} GB). Fix: lower {where}.cpus_per_task / mem_gb / nodes, or pick another "
                          f"partition with slurm.partition.")
    return {"partition": pname, "max_time_min": max_time, "total_nodes": total, "fitting_nodes": len(fitting)}


def job_info(job_id: str, timeout: float = 30) -> dict[str, str] | None:
    """What Slurm knows about a job: ``{'JobID', 'JobName', 'State', 'NodeList'}``, or None when it knows nothing.

    Asks ``squeue`` first (live jobs, no accounting lag), then ``sacct`` (finished jobs).

    Raises:
        RuntimeError: ``sacct`` failed or did not answer within ``timeout`` seconds (so "unknown" is not "gone").
    """
    jid = str(job_id)
    try:
        out = subprocess.run(["squeue", "--noheader", "--jobs", jid, "--format", "%i|%j|%T|%N"],
                             capture_output=True, text=True, timeout=timeout)
        for line in out.stdout.splitlines():
            f = line.strip().split("|")
            if len(f) == 4 and f[0] == jid:
                return {"JobID": f[0], "JobName": f[1], "State": f[2], "NodeList": f[3]}
        out = subprocess.run(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", jid,
                              "--format", "JobID,JobName,State,NodeList"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"cannot ask Slurm about job {jid}: {exc}") from exc
    if out.returncode != 0:
        raise RuntimeError(f"sacct failed for job {jid}: {out.stderr.strip()[-300:]}")
    for line in out.stdout.splitlines():
        f = line.strip().split("|")
        if len(f) == 4 and f[0] == jid:
            return {"JobID": f[0], "JobName": f[1], "State": (f[2].split() or ["UNKNOWN"])[0], "NodeList": f[3]}
    return None
