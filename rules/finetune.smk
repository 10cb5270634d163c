# Supervised finetuning (finetunes: in the config): instruction set -> finetune -> the shared convert and generate
# rules -> evaluation on the held-out split. Logic in llmpipe/finetune.py and llmpipe/data/instructions.py.
#   snakemake results/mpt-tiny-sft/eval.json           # offline: our tiny model on the builtin Python-docs Q&A
#   snakemake -n results/mpt-7b-dolly/eval.json        # the plan (and batch divisibility check) of MPT-7B on Dolly
#
# A finetune's outputs have the paths of a pretraining run's (results/<run>/train.json, eval.json), so two rules
# match them: `ruleorder` picks the finetune rules, and their `run` wildcard only matches finetune names.
# The shared rules (train's candidate job, convert, generate) read a finetune through cfg.run_config, which gives
# it the same keys as a pretraining run (data.tokenizer is the base's tokenizer, data.corpus the ICL corpus).

import re

FINETUNES = sorted(config.get("finetunes") or {})
_FT_RUN = "|".join(re.escape(r) for r in FINETUNES) if FINETUNES else "(?!)"


def finetune_cfg(wildcards):
    """Validated settings of the finetune in the target path (clear ConfigError if wrong, already in a dry run)."""
    return cfg.validate_run(config, wildcards.run)


def instructions_manifest(wildcards):
    """The prepared instruction set the finetune trains and is evaluated on."""
    return f"{RESULTS}/data/instructions/{finetune_cfg(wildcards)['data']['instructions']}/manifest.json"


def finetune_inputs(wildcards):
    """Inputs of rule finetune: instruction set, tokenizer, the base run's export (own bases), the all-reduce gate."""
    rc = finetune_cfg(wildcards)
    inputs = {
        "instructions": instructions_manifest(wildcards),
        "tokenizer": f"{RESULTS}/tokenizers/{rc['data']['tokenizer']}/manifest.json",
    }
    if rc["base"].get("run"):  # our own model: its Hugging Face export (retraining it reruns this finetune)
        inputs["base"] = f"{RESULTS}/{rc['base']['run']}/hf/manifest.json"
    gate = globals().get("allreduce_gate_input")  # rules/bench.smk, when included
    if gate is not None:
        g = gate(wildcards)
        if g:
            inputs["gate"] = g
    return inputs


def finetune_icl_files(wildcards):
    """The ICL task files of the finetune's eval, built from its ICL corpus (the base run's corpus by default)."""
    corpus = finetune_cfg(wildcards)["data"]["icl_corpus"]
    return [f"{RESULTS}/data/{corpus}/icl/{t['label']}.jsonl" for t in config["eval"]["icl_tasks"]]


def instructions_identity(wildcards):
    cfg.validate_instruction_set(config, wildcards.iset)
    return identity_text(data_steps.instructions_identity(config, wildcards.iset))


def finetune_identity(wildcards):
    finetune_cfg(wildcards)
    return identity_text(train_steps.train_identity(config, wildcards.run))


def finetune_eval_identity(wildcards):
    return identity_text(eval_steps.finetune_eval_identity(config, wildcards.run))


ruleorder: finetune > train
ruleorder: finetune_eval > eval


rule instructions:
    output:
        f"{RESULTS}/data/instructions/{{iset}}/manifest.json",
    params:
        identity=instructions_identity,
    log:
        f"{LOGS}/instructions/{{iset}}.log",
    wildcard_constraints:
        iset=r"[A-Za-z0-9_.-]+",
    threads: 1
    resources:
        nodes=1,
        runtime=res("data", "time_min"),
    script:
        "../scripts/instructions.py"


rule finetune:
    input:
        unpack(finetune_inputs),
    output:
        f"{RESULTS}/{{run}}/train.json",
    params:
        identity=finetune_identity,
    log:
        f"{LOGS}/finetune/{{run}}.log",
    wildcard_constraints:
        run=_FT_RUN,
    threads: step_threads("train")
    resources:
        nodes=res("train", "nodes"),
        gpus_per_node=res("train", "gpus_per_node"),
        tasks_per_node=res("train", "tasks_per_node"),
        cpus_per_task=res("train", "cpus_per_task"),
        runtime=res("train", "time_min"),
    script:
        "../scripts/finetune.py"


rule finetune_eval:
    input:
        model=f"{RESULTS}/{{run}}/hf/manifest.json",
        instructions=instructions_manifest,
        icl=finetune_icl_files,
    output:
        f"{RESULTS}/{{run}}/eval.json",
    params:
        identity=finetune_eval_identity,
    log:
        f"{LOGS}/eval/{{run}}.log",
    wildcard_constraints:
        run=_FT_RUN,
    threads: step_threads("eval")
    resources:
        nodes=1,
        gpus_per_node=res("eval", "gpus_per_node"),
        runtime=res("eval", "time_min"),
    script:
        "../scripts/finetune_eval.py"
