# Supervised finetuning (finetunes: in the config): instruction set -> finetune -> the shared convert and generate
# rules -> evaluation on the held-out split. Logic in llmpipe/train/finetune.py and llmpipe/data/instructions.py; the
# inputs and the FINETUNE_RUN run-name pattern in rules/common.smk, the steps in llmpipe/steps/training.py and evaluate.py.
#   snakemake results/mpt-tiny-sft/eval.json           # offline: our tiny model on the builtin Python-docs Q&A
#   snakemake -n results/mpt-7b-dolly/eval.json        # the plan (and batch divisibility check) of MPT-7B on Dolly
#
# A finetune's outputs have the paths of a pretraining run's (results/<run>/train.json, eval.json), so two rules
# match them: `ruleorder` picks the finetune rules, and their `run` wildcard only matches finetune names.
# The shared rules (train's candidate job, convert, generate) read a finetune through cfg.run_config, which gives
# it the same keys as a pretraining run (data.tokenizer is the base's tokenizer, data.corpus the ICL corpus).


ruleorder: finetune > train
ruleorder: finetune_eval > eval


rule instructions:
    output:
        f"{RESULTS}/data/instructions/{{iset}}/manifest.json",
    log:
        f"{LOGS}/instructions/{{iset}}.log",
    wildcard_constraints:
        iset=r"[A-Za-z0-9_.-]+",
    threads: 1
    resources:
        nodes=1,
        runtime=res("instructions", "time_min"),
    params:
        identity=identity(data_steps.instructions_identity, check=cfg.validate_instruction_set),
    script:
        "../scripts/run_rule.py"


rule finetune:
    input:
        unpack(finetune_inputs),
    output:
        f"{RESULTS}/{{run}}/train.json",
    log:
        f"{LOGS}/finetune/{{run}}.log",
    wildcard_constraints:
        run=FINETUNE_RUN,
    threads: threads("finetune")
    resources:
        nodes=res("finetune", "nodes"),
        gpus_per_node=res("finetune", "gpus_per_node"),
        tasks_per_node=res("finetune", "tasks_per_node"),
        cpus_per_task=res("finetune", "cpus_per_task"),
        runtime=res("finetune", "time_min"),
    params:
        identity=identity(train_steps.train_identity, check=cfg.validate_run),
    script:
        "../scripts/run_rule.py"


rule finetune_eval:
    input:
        model=f"{RESULTS}/{{run}}/hf/manifest.json",
        instructions=instructions_manifest,
        icl=icl_task_files,
        task_data=eval_task_data_input,
        generation=generation_of_run,
    output:
        f"{RESULTS}/{{run}}/eval.json",
    log:
        f"{LOGS}/eval/{{run}}.log",
    wildcard_constraints:
        run=FINETUNE_RUN,
    threads: threads("finetune_eval")
    resources:
        nodes=1,
        gpus_per_node=res("finetune_eval", "gpus_per_node"),
        runtime=res("finetune_eval", "time_min"),
    params:
        identity=identity(eval_steps.finetune_eval_identity),
    script:
        "../scripts/run_rule.py"
