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
    threads: lm_eval_threads
    resources:
        nodes=1,
        gpus_per_node=lm_eval_res("gpus_per_node"),
        runtime=lm_eval_res("time_min"),
    params:
        identity=lm_eval_identity,
    script:
        "../scripts/lm_eval.py"
