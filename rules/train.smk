# Pretraining with composer + llm-foundry: one job of nodes x GPUs-per-node tasks through the dispatch module.


def train_identity(wildcards):
    run_cfg(wildcards)
    return identity_text(train_steps.train_identity(config, wildcards.run))


def train_gate_input(wildcards):
    """The all-reduce gate's record when allreduce.gate is on, else nothing (allreduce_gate_input, rules/bench.smk,
    which is included after this file)."""
    return allreduce_gate_input(wildcards)


rule train:
    input:
        data=verified_dataset,
        tokenizer=tokenizer_manifest_of_run,
        gate=train_gate_input,
    output:
        f"{RESULTS}/{{run}}/train.json",
    params:
        identity=train_identity,
    log:
        f"{LOGS}/train/{{run}}.log",
    threads: step_threads("train")
    resources:
        nodes=res("train", "nodes"),
        gpus_per_node=res("train", "gpus_per_node"),
        tasks_per_node=res("train", "tasks_per_node"),
        cpus_per_task=res("train", "cpus_per_task"),
        runtime=res("train", "time_min"),
    script:
        "../scripts/train.py"
