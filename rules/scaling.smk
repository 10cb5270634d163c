# Node-scaling study: the same training at every node count of scaling.nodes, then a table and a speedup plot.
#   snakemake -n results/scaling/mpt-7b/scaling.csv --profile profiles/slurm   # the plan; says if a count cannot run
#   snakemake scaling --profile profiles/slurm                                 # every study in scaling.runs
from llmpipe import scaling as scaling_mod


def scaling_check(wildcards):
    """Validate the whole study (every node count) while the DAG is built; Slurm preflight for this count."""
    checked = scaling_mod.check_study(config, wildcards.run)
    nodes = int(getattr(wildcards, "nodes", 0) or 0)
    if nodes and nodes not in checked:
        checked.update(scaling_mod.check_study(config, wildcards.run, [nodes]))
    if nodes and config["dispatch"]["executor"] == "slurm" and ("scaling", wildcards.run, nodes) not in _PREFLIGHT_DONE:
        from llmpipe import slurm

        slurm.preflight(config, checked[nodes], where=f"models.{wildcards.run}.resources (scaling at {nodes} nodes)")
        _PREFLIGHT_DONE.add(("scaling", wildcards.run, nodes))
    return checked


def scaling_res(key):
    def get(wildcards):
        sc = scaling_mod.study_config(config, wildcards.run, int(wildcards.nodes))
        return int(cfg.step_resources(sc, "train", wildcards.run).get(key) or 0)

    return get


def scaling_threads(wildcards):
    return dispatch_threads(cfg.step_resources, config, "train", wildcards.run)


def study_identity(wildcards):
    """The study's training identity (the same at every node count), once the whole study is checked."""
    scaling_check(wildcards)
    return identity_text(scaling_steps.study_identity(config, wildcards.run))


def study_trainings(wildcards):
    """The train.json of every node count of the study."""
    return [f"{RESULTS}/scaling/{wildcards.run}/nodes{n}/train.json" for n in scaling_check(wildcards)]


def scaling_tables(wildcards):
    """The table of every study in scaling.runs."""
    return [f"{RESULTS}/scaling/{r}/scaling.csv" for r in scaling_mod.settings(config)["runs"]]


def scaling_gate_input(wildcards):
    """The all-reduce gate at this node count when allreduce.gate is on (see rules/bench.smk)."""
    if allreduce_mod.gate_nodes(config, wildcards.run, int(wildcards.nodes)) is None:
        return []
    return ancient(f"{RESULTS}/bench/allreduce/gate/{wildcards.run}/nodes{wildcards.nodes}.json")


def scaling_inputs(wildcards):
    """A pretraining run's dataset and tokenizer, or a finetune's inputs (rules/finetune.smk), and the gate."""
    if cfg.is_finetune(config, wildcards.run):
        inputs = {k: v for k, v in globals()["finetune_inputs"](wildcards).items() if k != "gate"}
    else:
        inputs = {"data": dataset_path(wildcards, "verified.json"), "tokenizer": tokenizer_manifest_of_run(wildcards)}
    gate = scaling_gate_input(wildcards)
    if gate:
        inputs["gate"] = gate
    return inputs


rule scaling_train:
    input:
        unpack(scaling_inputs),
    output:
        f"{RESULTS}/scaling/{{run}}/nodes{{nodes}}/train.json",
    wildcard_constraints:
        nodes=r"\d+",
    params:
        identity=study_identity,
    log:
        f"{LOGS}/scaling/{{run}}/nodes{{nodes}}.log",
    threads: scaling_threads
    resources:
        nodes=scaling_res("nodes"),
        gpus_per_node=scaling_res("gpus_per_node"),
        tasks_per_node=scaling_res("tasks_per_node"),
        cpus_per_task=scaling_res("cpus_per_task"),
        runtime=scaling_res("time_min"),
    script:
        "../scripts/scaling_train.py"


rule scaling_table:
    input:
        study_trainings,
    output:
        csv=report(f"{RESULTS}/scaling/{{run}}/scaling.csv", caption="../report/scaling.rst",
                   category="Node scaling", subcategory="{run}"),
        md=f"{RESULTS}/scaling/{{run}}/scaling.md",
        png=report(f"{RESULTS}/scaling/{{run}}/speedup.png", caption="../report/speedup.rst",
                   category="Node scaling", subcategory="{run}"),
    log:
        f"{LOGS}/scaling/{{run}}/table.log",
    localrule: True
    script:
        "../scripts/scaling_table.py"


rule scaling:
    input:
        scaling_tables,
