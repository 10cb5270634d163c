# Second harness (optional, off by default): lm-evaluation-harness on the Hugging Face export, offline, with the
# task YAMLs and data files of lm_eval.data_dir. Its own file, never mixed with llm-foundry's eval.json.


rule lm_eval:
    input:
        model=f"{RESULTS}/{{run}}/hf/manifest.json",
        data=lm_eval_data_files,
    output:
        f"{RESULTS}/{{run}}/eval-lm_eval.json",
    log:
        f"{LOGS}/lm_eval/{{run}}.log",
    threads: threads("lm_eval")
    resources:
        nodes=1,
        gpus_per_node=res("lm_eval", "gpus_per_node"),
        runtime=res("lm_eval", "time_min"),
    params:
        identity=identity(lm_eval_steps.lm_eval_identity),
    script:
        "../scripts/run_rule.py"
