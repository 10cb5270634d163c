# All-reduce bandwidth test (the seed's nccl-tests table) through torch.distributed on nodes x tasks, its plot, and
# the optional gate that keeps training from starting on a slow or misconfigured interconnect.
#   snakemake results/bench/allreduce/nodes2.csv --profile profiles/slurm   # one node count
#   snakemake allreduce_all --profile profiles/slurm                         # every count in allreduce.nodes + plot
from llmpipe import allreduce as allreduce_mod
from llmpipe.dispatch import check_executor


def allreduce_plan(wildcards):
    """No input files; checks the sweep and the executor, and runs the Slurm preflight, while the DAG is built."""
    nodes = int(wildcards.nodes)
    allreduce_mod.settings(config)
    check_executor(config, nodes, f"the all-reduce bench (results/bench/allreduce/nodes{nodes}.csv)")
    if config["dispatch"]["executor"] == "slurm" and ("allreduce", nodes) not in _PREFLIGHT_DONE:
        from llmpipe import slurm

        slurm.preflight(config, allreduce_mod.bench_resources(config, nodes), where="allreduce.resources")
        _PREFLIGHT_DONE.add(("allreduce", nodes))
    return []


def allreduce_res(key):
    def get(wildcards):
        return int(allreduce_mod.bench_resources(config, int(wildcards.nodes)).get(key) or 0)

    return get


def allreduce_threads(wildcards):
    return dispatch_threads(allreduce_mod.bench_resources, config, int(wildcards.nodes))


def allreduce_node_count(wildcards):
    """``nodes`` resource of the bench: the node count in its path."""
    return int(wildcards.nodes)


def allreduce_identity(wildcards):
    return identity_text(allreduce_steps.allreduce_identity(config))


def allreduce_csvs(wildcards):
    """The bench's CSV at every node count of allreduce.nodes."""
    return [f"{RESULTS}/bench/allreduce/nodes{n}.csv" for n in allreduce_mod.settings(config)["nodes"]]


def allreduce_gate_settings(wildcards):
    """``allreduce.gate`` as text: a changed threshold re-checks the gate (it never re-measures)."""
    return identity_text(allreduce_mod.settings(config)["gate"])


def allreduce_gate_input(wildcards):
    """Input of rule train when allreduce.gate is on and the training has more than one rank: the gate's record.

    ancient(): a rerun bench or a changed threshold re-checks the gate but never retrains a finished model."""
    if allreduce_mod.gate_nodes(config, wildcards.run) is None:
        return []
    return ancient(f"{RESULTS}/bench/allreduce/gate/{wildcards.run}.json")


def allreduce_gate_csv(wildcards):
    nodes = allreduce_mod.gate_nodes(config, wildcards.run, getattr(wildcards, "nodes", None))
    if nodes is None:
        raise cfg.ConfigError(f"no all-reduce gate for {wildcards.run}: allreduce.gate is off or the training has a "
                              f"single rank. Fix: set allreduce.gate: {{size_bytes: ..., min_busbw_gbps: ...}}.")
    return f"{RESULTS}/bench/allreduce/nodes{nodes}.csv"


rule allreduce:
    input:
        allreduce_plan,
    output:
        csv=f"{RESULTS}/bench/allreduce/nodes{{nodes}}.csv",
        md=f"{RESULTS}/bench/allreduce/nodes{{nodes}}.md",
    wildcard_constraints:
        nodes=r"\d+",
    params:
        identity=allreduce_identity,
    log:
        f"{LOGS}/allreduce/nodes{{nodes}}.log",
    threads: allreduce_threads
    resources:
        nodes=allreduce_node_count,
        gpus_per_node=allreduce_res("gpus_per_node"),
        tasks_per_node=allreduce_res("tasks_per_node"),
        cpus_per_task=allreduce_res("cpus_per_task"),
        runtime=allreduce_res("time_min"),
    script:
        "../scripts/allreduce.py"


rule allreduce_plot:
    input:
        allreduce_csvs,
    output:
        report(f"{RESULTS}/bench/allreduce/busbw.png", caption="../report/busbw.rst", category="All-reduce bandwidth"),
    log:
        f"{LOGS}/allreduce/plot.log",
    localrule: True
    script:
        "../scripts/allreduce.py"


rule allreduce_gate:
    input:
        csv=allreduce_gate_csv,
    output:
        f"{RESULTS}/bench/allreduce/gate/{{run}}.json",
    params:
        gate=allreduce_gate_settings,
    log:
        f"{LOGS}/allreduce/gate-{{run}}.log",
    localrule: True
    script:
        "../scripts/allreduce.py"


rule scaling_allreduce_gate:
    input:
        csv=allreduce_gate_csv,
    output:
        f"{RESULTS}/bench/allreduce/gate/{{run}}/nodes{{nodes}}.json",
    wildcard_constraints:
        nodes=r"\d+",
    params:
        gate=allreduce_gate_settings,
    log:
        f"{LOGS}/allreduce/gate-{{run}}-nodes{{nodes}}.log",
    localrule: True
    script:
        "../scripts/allreduce.py"


rule allreduce_all:
    input:
        allreduce_csvs,
        f"{RESULTS}/bench/allreduce/busbw.png",
