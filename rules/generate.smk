# Generation: the converted model answers the configured prompts.


rule generate:
    input:
        f"{RESULTS}/{{run}}/hf/manifest.json",
    output:
        f"{RESULTS}/{{run}}/generate.json",
    log:
        f"{LOGS}/generate/{{run}}.log",
    threads: threads("generate")
    resources:
        nodes=1,
        gpus_per_node=res("generate", "gpus_per_node"),
        runtime=res("generate", "time_min"),
    params:
        identity=identity(generate_steps.generate_identity),
    script:
        "../scripts/run_rule.py"
