# All-reduce bandwidth test (the seed's nccl-tests table) through torch.distributed on nodes x tasks, its plot, and
# the optional gate that keeps training from starting on a slow or misconfigured interconnect (with
# allreduce.health, also on a slow GPU: results/bench/allreduce/health/nodes{N}.json, one line per GPU).
#   snakemake results/bench/allreduce/nodes2.csv --profile slurm   # one node count
#   snakemake allreduce_all --profile slurm                         # every count in allreduce.nodes + plot


rule allreduce:
    input:
        allreduce_check,
    output:
        csv=f"{RESULTS}/bench/allreduce/nodes{{nodes}}.csv",
        md=f"{RESULTS}/bench/allreduce/nodes{{nodes}}.md",
    log:
        f"{LOGS}/allreduce/nodes{{nodes}}.log",
    wildcard_constraints:
        nodes=r"\d+",
    threads: threads("allreduce")
    resources:
        nodes=res("allreduce", "nodes"),
        gpus_per_node=res("allreduce", "gpus_per_node"),
        tasks_per_node=res("allreduce", "tasks_per_node"),
        cpus_per_task=res("allreduce", "cpus_per_task"),
        runtime=res("allreduce", "time_min"),
    params:
        identity=identity(allreduce_steps.allreduce_identity),
    script:
        "../scripts/run_rule.py"


rule allreduce_plot:
    input:
        allreduce_csvs,
    output:
        report(f"{RESULTS}/bench/allreduce/busbw.png", caption="../report/busbw.rst", category="All-reduce bandwidth"),
    log:
        f"{LOGS}/allreduce/plot.log",
    localrule: True
    script:
        "../scripts/run_rule.py"


rule allreduce_health:
    input:
        allreduce_check,
    output:
        f"{RESULTS}/bench/allreduce/health/nodes{{nodes}}.json",
    log:
        f"{LOGS}/allreduce/health-nodes{{nodes}}.log",
    wildcard_constraints:
        nodes=r"\d+",
    threads: threads("allreduce_health")
    resources:
        nodes=res("allreduce_health", "nodes"),
        gpus_per_node=res("allreduce_health", "gpus_per_node"),
        tasks_per_node=res("allreduce_health", "tasks_per_node"),
        cpus_per_task=res("allreduce_health", "cpus_per_task"),
        runtime=res("allreduce_health", "time_min"),
    params:
        identity=identity(allreduce_steps.health_identity),
    script:
        "../scripts/run_rule.py"


rule allreduce_gate:
    input:
        unpack(allreduce_gate_inputs),
    output:
        f"{RESULTS}/bench/allreduce/gate/{{run}}.json",
    log:
        f"{LOGS}/allreduce/gate-{{run}}.log",
    localrule: True
    params:
        gate=identity(allreduce_steps.gate_identity),
    script:
        "../scripts/run_rule.py"


rule scaling_allreduce_gate:
    input:
        unpack(allreduce_gate_inputs),
    output:
        f"{RESULTS}/bench/allreduce/gate/{{run}}/nodes{{nodes}}.json",
    log:
        f"{LOGS}/allreduce/gate-{{run}}-nodes{{nodes}}.log",
    wildcard_constraints:
        nodes=r"\d+",
    localrule: True
    params:
        gate=identity(allreduce_steps.gate_identity),
    script:
        "../scripts/run_rule.py"


rule allreduce_all:
    input:
        allreduce_csvs,
        f"{RESULTS}/bench/allreduce/busbw.png",
