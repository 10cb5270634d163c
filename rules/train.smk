# Pretraining with composer + llm-foundry: one job of nodes x GPUs-per-node tasks through the dispatch module.


rule train:
    input:
        data=verified_dataset,
        tokenizer=tokenizer_manifest_of_run,
        gate=allreduce_gate_input,  # [] unless allreduce.gate is on
    output:
        f"{RESULTS}/{{run}}/train.json",
    log:
        f"{LOGS}/train/{{run}}.log",
    threads: threads("train")
    resources:
        nodes=res("train", "nodes"),
        gpus_per_node=res("train", "gpus_per_node"),
        tasks_per_node=res("train", "tasks_per_node"),
        cpus_per_task=res("train", "cpus_per_task"),
        runtime=res("train", "time_min"),
    params:
        identity=identity(train_steps.train_identity, check=cfg.validate_run),
    script:
        "../scripts/run_rule.py"
