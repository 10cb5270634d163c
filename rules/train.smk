# Pretraining with composer + llm-foundry: one job of nodes x GPUs-per-node tasks through the dispatch module.


def train_identity(wildcards):
    run_cfg(wildcards)
    return cfg.train_identity(config, wildcards.run)


rule train:
    input:
        data=lambda wc: dataset_path(wc, "verified.json"),
        tokenizer=tokenizer_manifest_of_run,
        gate=lambda wc: allreduce_gate_input(wc),  # rules/bench.smk: [] unless allreduce.gate is on
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
