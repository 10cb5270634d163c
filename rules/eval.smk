# Evaluation on unseen data: held-out LM metrics on the val split and in-context-learning accuracy.


rule eval:
    input:
        model=f"{RESULTS}/{{run}}/hf/manifest.json",
        data=verified_dataset,
        icl=icl_task_files,
    output:
        f"{RESULTS}/{{run}}/eval.json",
    log:
        f"{LOGS}/eval/{{run}}.log",
    threads: step_threads("eval")
    resources:
        nodes=1,
        gpus_per_node=res("eval", "gpus_per_node"),
        runtime=res("eval", "time_min"),
    params:
        identity=eval_identity,
    script:
        "../scripts/eval.py"
