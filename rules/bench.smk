# All-reduce bandwidth test (the seed's nccl-tests table) through torch.distributed on nodes x tasks, its plot, and
# the optional gate that keeps training from starting on a slow or misconfigured interconnect (with
# allreduce.health, also on a slow GPU: results/bench/allreduce/health/nodes{N}.json, one line per GPU).
#   snakemake results/bench/allreduce/nodes2.csv --profile slurm   # one node count
#   snakemake allreduce_all --profile slurm                         # every count in allreduce.nodes + plot


rule allreduce:
    input:
        allreduce_plan,
    output:
        csv=f"{RESULTS}/bench/allreduce/nodes{{nodes}}.csv",
        md=f"{RESULTS}/bench/allreduce/nodes{{nodes}}.md",
    log:
        f"{LOGS}/allreduce/nodes{{nodes}}.log",
    wildcard_constraints:
        nodes=r"\d+",
    threads: allreduce_threads
    resources:
        nodes=allreduce_node_count,
        gpus_per_node=allreduce_res("gpus_per_node"),
        tasks_per_node=allreduce_res("tasks_per_node"),
        cpus_per_task=allreduce_res("cpus_per_task"),
        runtime=allreduce_res("time_min"),
    params:
        identity=allreduce_identity,
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


rule allreduce_health:
    input:
        allreduce_plan,
    output:
        f"{RESULTS}/bench/allreduce/health/nodes{{nodes}}.json",
    log:
        f"{LOGS}/allreduce/health-nodes{{nodes}}.log",
    wildcard_constraints:
        nodes=r"\d+",
    threads: allreduce_threads
    resources:
        nodes=allreduce_node_count,
        gpus_per_node=allreduce_res("gpus_per_node"),
        tasks_per_node=allreduce_res("tasks_per_node"),
        cpus_per_task=allreduce_res("cpus_per_task"),
        runtime=allreduce_res("time_min"),
    params:
        identity=allreduce_health_identity,
    script:
        "../scripts/allreduce.py"


rule allreduce_gate:
    input:
        unpack(allreduce_gate_inputs),
    output:
        f"{RESULTS}/bench/allreduce/gate/{{run}}.json",
    log:
        f"{LOGS}/allreduce/gate-{{run}}.log",
    localrule: True
    params:
        gate=allreduce_gate_settings,
    script:
        "../scripts/allreduce.py"


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
        gate=allreduce_gate_settings,
    script:
        "../scripts/allreduce.py"


rule allreduce_all:
    input:
        allreduce_csvs,
        f"{RESULTS}/bench/allreduce/busbw.png",
