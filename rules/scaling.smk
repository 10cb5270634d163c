# Node-scaling study: the same training at every node count of scaling.nodes, then a table and a speedup plot.
#   snakemake -n results/scaling/mpt-7b/scaling.csv --profile slurm   # the plan; says if a count cannot run
#   snakemake scaling --profile slurm                                 # every study in scaling.runs


rule scaling_train:
    input:
        unpack(scaling_inputs),
    output:
        f"{RESULTS}/scaling/{{run}}/nodes{{nodes}}/train.json",
    log:
        f"{LOGS}/scaling/{{run}}/nodes{{nodes}}.log",
    wildcard_constraints:
        nodes=r"\d+",
    threads: threads("scaling_train")
    resources:
        nodes=res("scaling_train", "nodes"),
        gpus_per_node=res("scaling_train", "gpus_per_node"),
        tasks_per_node=res("scaling_train", "tasks_per_node"),
        cpus_per_task=res("scaling_train", "cpus_per_task"),
        runtime=res("scaling_train", "time_min"),
    params:
        identity=identity(scaling_steps.study_identity),
    script:
        "../scripts/run_rule.py"


rule scaling_table:
    input:
        study_trainings,
    output:
        csv=report(
            f"{RESULTS}/scaling/{{run}}/scaling.csv",
            caption="../report/scaling.rst",
            category="Node scaling",
            subcategory="{run}",
        ),
        md=f"{RESULTS}/scaling/{{run}}/scaling.md",
        png=report(
            f"{RESULTS}/scaling/{{run}}/speedup.png",
            caption="../report/speedup.rst",
            category="Node scaling",
            subcategory="{run}",
        ),
    log:
        f"{LOGS}/scaling/{{run}}/table.log",
    localrule: True
    script:
        "../scripts/run_rule.py"


rule scaling:
    input:
        scaling_tables,
