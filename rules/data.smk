# Data: corpus files in C4's layout -> tokenizer -> tokenized, concatenated MDS shards -> verification.
# Prepared data is shared by every model with the same corpus, tokenizer and concat length.


rule corpus:
    output:
        f"{RESULTS}/data/{{corpus}}/raw/manifest.json",
    log:
        f"{LOGS}/corpus/{{corpus}}.log",
    threads: 1
    resources:
        nodes=1,
        runtime=res("data", "time_min"),
    params:
        identity=corpus_identity,
    script:
        "../scripts/corpus.py"


rule tokenizer:
    input:
        tokenizer_inputs,
    output:
        f"{RESULTS}/tokenizers/{{tokenizer}}/manifest.json",
    log:
        f"{LOGS}/tokenizer/{{tokenizer}}.log",
    threads: 1
    resources:
        nodes=1,
        runtime=res("data", "time_min"),
    params:
        identity=tokenizer_identity,
    script:
        "../scripts/tokenizer.py"


rule mds:
    input:
        corpus=f"{RESULTS}/data/{{corpus}}/raw/manifest.json",
        tokenizer=f"{RESULTS}/tokenizers/{{tokenizer}}/manifest.json",
    output:
        f"{RESULTS}/data/{{corpus}}/{{tokenizer}}/concat{{concat}}/mds/manifest.json",
    log:
        f"{LOGS}/mds/{{corpus}}-{{tokenizer}}-concat{{concat}}.log",
    threads: step_threads("data")
    resources:
        nodes=res("data", "nodes"),
        cpus_per_task=res("data", "cpus_per_task"),
        runtime=res("data", "time_min"),
    params:
        identity=mds_identity,
    script:
        "../scripts/mds.py"


rule verify_mds:
    input:
        mds=f"{RESULTS}/data/{{corpus}}/{{tokenizer}}/concat{{concat}}/mds/manifest.json",
        tokenizer=f"{RESULTS}/tokenizers/{{tokenizer}}/manifest.json",
    output:
        f"{RESULTS}/data/{{corpus}}/{{tokenizer}}/concat{{concat}}/verified.json",
    log:
        f"{LOGS}/verify/{{corpus}}-{{tokenizer}}-concat{{concat}}.log",
    threads: 1
    resources:
        nodes=1,
        runtime=res("data", "time_min"),
    params:
        identity=verify_identity,
    script:
        "../scripts/verify_mds.py"


rule icl_task:
    input:
        f"{RESULTS}/data/{{corpus}}/raw/manifest.json",
    output:
        f"{RESULTS}/data/{{corpus}}/icl/{{label}}.jsonl",
    log:
        f"{LOGS}/icl/{{corpus}}-{{label}}.log",
    threads: 1
    params:
        identity=icl_task_identity,
    script:
        "../scripts/icl_task.py"
