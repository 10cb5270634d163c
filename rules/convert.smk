# Conversion of the final composer checkpoint to a Hugging Face model folder (safetensors + tokenizer).


rule convert:
    input:
        unpack(convert_inputs),
    output:
        f"{RESULTS}/{{run}}/hf/manifest.json",
    log:
        f"{LOGS}/convert/{{run}}.log",
    threads: threads("convert")
    resources:
        nodes=1,
        gpus_per_node=res("convert", "gpus_per_node"),
        runtime=res("convert", "time_min"),
    params:
        identity=identity(convert_steps.convert_identity),
    script:
        "../scripts/run_rule.py"
