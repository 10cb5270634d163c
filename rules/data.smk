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
        runtime=res("corpus", "time_min"),
    params:
        identity=identity(data_steps.corpus_identity, check=cfg.validate_corpus),
    script:
        "../scripts/run_rule.py"


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
        runtime=res("tokenizer", "time_min"),
    params:
        identity=identity(data_steps.tokenizer_identity, check=cfg.validate_tokenizer),
    script:
        "../scripts/run_rule.py"


rule mds:
    input:
        corpus=f"{RESULTS}/data/{{corpus}}/raw/manifest.json",
        tokenizer=f"{RESULTS}/tokenizers/{{tokenizer}}/manifest.json",
    output:
        f"{RESULTS}/data/{{corpus}}/{{tokenizer}}/concat{{concat}}/mds/manifest.json",
    log:
        f"{LOGS}/mds/{{corpus}}-{{tokenizer}}-concat{{concat}}.log",
    threads: threads("mds")
    resources:
        nodes=res("mds", "nodes"),
        cpus_per_task=res("mds", "cpus_per_task"),
        runtime=res("mds", "time_min"),
    params:
        identity=identity(data_steps.mds_identity),
    script:
        "../scripts/run_rule.py"


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
        runtime=res("verify_mds", "time_min"),
    params:
        identity=identity(data_steps.verify_identity),
    script:
        "../scripts/run_rule.py"


rule icl_task:
    input:
        f"{RESULTS}/data/{{corpus}}/raw/manifest.json",
    output:
        f"{RESULTS}/data/{{corpus}}/icl/{{label}}.jsonl",
    log:
        f"{LOGS}/icl/{{corpus}}-{{label}}.log",
    threads: 1
    params:
        identity=identity(data_steps.icl_task_identity),
    script:
        "../scripts/run_rule.py"
