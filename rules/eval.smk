# Evaluation on unseen data: held-out LM metrics on the val split and in-context-learning accuracy on every item of
# the run's ICL suite (llmpipe/evaluation/suites.py), whose standard task files are fetched once, beforehand.


rule eval_task_data:
    output:
        f"{RESULTS}/data/eval-tasks/{{suite}}/manifest.json",
    log:
        f"{LOGS}/eval-tasks/{{suite}}.log",
    threads: 1
    params:
        identity=identity(eval_steps.eval_task_data_identity),
    script:
        "../scripts/run_rule.py"


rule eval:
    input:
        model=f"{RESULTS}/{{run}}/hf/manifest.json",
        data=verified_dataset,
        icl=icl_task_files,
        task_data=eval_task_data_input,
        generation=generation_of_run,
    output:
        f"{RESULTS}/{{run}}/eval.json",
    log:
        f"{LOGS}/eval/{{run}}.log",
    threads: threads("eval")
    resources:
        nodes=1,
        gpus_per_node=res("eval", "gpus_per_node"),
        runtime=res("eval", "time_min"),
    params:
        identity=identity(eval_steps.eval_identity),
    script:
        "../scripts/run_rule.py"
