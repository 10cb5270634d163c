"""Bad input gets one clear message naming the setting and the fix, already from the dry run."""

from __future__ import annotations

import os
import stat

import pytest

from llmpipe.config import schema
from llmpipe.config.runs import deep_merge
from llmpipe.config.settings import ConfigError

from tests.conftest import REPO, snakemake

SITE = REPO / "config/slurm-site.yaml"


def dry_fail(workdir, *args) -> str:
    proc = snakemake(workdir, "-n", *args, check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stdout + proc.stderr


def test_unknown_model(workdir):
    out = dry_fail(workdir, "results/mpt-2b/eval.json")
    assert "unknown model or run 'mpt-2b'" in out and "mpt-1b" in out


def test_missing_local_data_source(workdir, tmp_path):
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config",
                   f"corpora={{'c4': {{'source': 'local', 'local_dir': '{tmp_path}/nowhere'}}}}")
    assert "corpora.c4.local_dir" in out and "does not exist" in out


def test_global_batch_not_divisible_by_devices(workdir):
    # 3 nodes x 8 GPUs = 24 devices; 256 is not a multiple of 24
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config", "models={'mpt-125m': {'resources': {'nodes': 3}}}")
    assert ("models.mpt-125m.train.global_batch_size (256) is not divisible by the number of GPUs at 3 node(s) "
            "(24 = 3 x 8 per node). Fix: make global_batch_size a multiple of 24") in out


def test_concat_tokens_larger_than_max_seq_len(workdir):
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--config",
                   "models={'mpt-tiny': {'data': {'concat_tokens': 256}}}")
    assert "models.mpt-tiny.data.concat_tokens (256) is larger than models.mpt-tiny.arch.max_seq_len (128)" in out


def test_shard_size_limit_smaller_than_a_sample(workdir):
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config", "data_prep={'size_limit': 4096}")
    assert "data_prep.size_limit (4096 bytes per MDS shard) cannot hold one sample of " \
           "models.mpt-125m.data.concat_tokens=2048" in out


def test_compression_streaming_cannot_read(workdir):
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--config", "data_prep={'compression': 'ZSTD'}")
    assert "data_prep.compression is 'ZSTD', which mosaicml-streaming cannot read" in out


def test_tokenizer_without_eos_text(workdir):
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--config",
                   "tokenizers={'bpe-builtin-docs': {'eos_text': ''}}")
    assert "tokenizers.bpe-builtin-docs.eos_text is empty" in out


def test_tokenizer_eos_text_null_from_the_command_line():
    """``--config`` hands a nested ``null`` over as the string 'null', which became the literal end-of-text text."""
    from llmpipe.config.runs import validate_tokenizer

    config = _raw_config()
    config["tokenizers"]["bpe-builtin-docs"]["eos_text"] = "null"
    config = schema.coerce(config)
    assert config["tokenizers"]["bpe-builtin-docs"]["eos_text"] is None
    with pytest.raises(ConfigError, match=r"tokenizers\.bpe-builtin-docs\.eos_text is empty \(None\)"):
        validate_tokenizer(config, "bpe-builtin-docs")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere; covered by the path-under-a-file case")
def test_unwritable_results_dir_permissions(workdir, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    out = dry_fail(workdir, "--config", f"results_dir={ro}/results")
    assert "results_dir" in out and "not writable" in out


def test_unwritable_results_dir(workdir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = dry_fail(workdir, "--config", f"results_dir={blocker}/results")
    assert f"results_dir '{blocker}/results' is not writable" in out


def test_unknown_corpus_in_model(workdir):
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config", "models={'mpt-125m': {'data': {'corpus': 'pile'}}}")
    assert "models.mpt-125m.data.corpus is 'pile'" in out


def _shipped_config() -> dict:
    """config/config.yaml as a workflow run sees it (typed, checked, defaults filled)."""
    return schema.load_config(REPO / "config/config.yaml")


def _raw_config() -> dict:
    """config/config.yaml and config/slurm-site.yaml as written (the profile's merge), nothing filled in."""
    import yaml
    from snakemake.utils import update_config

    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    update_config(config, yaml.safe_load(SITE.read_text()))
    return config


def schema_error(override: dict) -> str:
    """The message of the config check for the shipped config (with the Slurm site file) with ``override`` merged in
    as ``--config`` merges it; fails when the check passes."""
    from snakemake.utils import update_config

    config = _raw_config()
    update_config(config, override)
    with pytest.raises(ConfigError) as err:
        schema.check(schema.coerce(config))
    return str(err.value)


def test_every_shipped_model_and_finetune_passes_validation():
    """The defaults in config/config.yaml must plan: each run's microbatch divides its per-device batch, etc.
    (mpt-760m once shipped microbatch 12 with a per-device batch of 32 and failed its own dry run)."""
    from llmpipe.config.runs import known_runs, validate_run

    config = _shipped_config()
    runs = known_runs(config)
    assert {"mpt-125m", "mpt-760m", "mpt-70b", "mpt-7b-dolly"} <= set(runs)
    for run in runs:
        validate_run(config, run)




# ---------------------------------------------------------------------------------------------- the schema's check
# Each row: a change merged into config/config.yaml + config/slurm-site.yaml as --config merges it, and what the
# message must say (a regex searched in it): the setting's full path where it is written, the closest known key or
# what the value must be, and a fix.
SCHEMA_ERRORS = [
    # unknown keys of a run, named where they are written
    ({"models": {"mpt-125m": {"train": {"microbatch": 8}}}},
     r"^models\.mpt-125m\.train\.microbatch is not a train setting; did you mean microbatch_size\?"),
    ({"finetunes": {"mpt-tiny-sft": {"train": {"compiles": True}}}},
     r"^finetunes\.mpt-tiny-sft\.train\.compiles is not a train setting; did you mean compile\?"),
    ({"models": {"mpt-1b": {"resources": {"gpus_per_nodes": 8}}}},
     r"^models\.mpt-1b\.resources\.gpus_per_nodes is not a resource setting; did you mean gpus_per_node\?"),
    ({"models": {"mpt-tiny": {"step_resources": {"eval": {"partition": "gpu"}}}}},
     r"^models\.mpt-tiny\.step_resources\.eval\.partition is not a resource setting.* go under slurm:.*"
     r"as models\.mpt-tiny\.step_resources\.eval\.slurm"),
    ({"models": {"mpt-125m": {"arch": {"d_modle": 1}}}}, r"^models\.mpt-125m\.arch\.d_modle is not a model setting "
                                                        r"the training step passes to MPT; did you mean d_model\?"),
    ({"models": {"mpt-125m": {"arch": {"tie_word_embeddings": 1}}}},
     r"^models\.mpt-125m\.arch\.tie_word_embeddings is not a model setting [^;]*; Known ones: .*Other MPTConfig"),
    ({"models": {"mpt-125m": {"data": {"concat_token": 1}}}},
     r"^models\.mpt-125m\.data\.concat_token is not a data setting of a pretraining run; did you mean concat_tokens\?"),
    ({"models": {"mpt-125m": {"resource": {"nodes": 2}}}},
     r"^models\.mpt-125m\.resource is not a section of a model; did you mean resources\?.*would be ignored"),
    ({"models": {"mpt-125m": {"trian": {"nodes": 2}}}}, r"^models\.mpt-125m\.trian is not a section of a model; "
                                                       r"did you mean train\?"),
    ({"finetunes": {"mpt-tiny-sft": {"node_count": [2]}}},
     r"^finetunes\.mpt-tiny-sft\.node_count is not a section of a finetune; did you mean node_counts\?"),
    ({"models": {"mpt-tiny": {"step_resources": {"evals": {"gpus_per_node": 1}}}}},
     r"^models\.mpt-tiny\.step_resources\.evals is not a step with its own resources; did you mean eval\?"),
    ({"models": {"mpt-tiny": {"step_resources": {"eval": {"slurm": {"qoss": "x"}}}}}},
     r"^models\.mpt-tiny\.step_resources\.eval\.slurm\.qoss is not a Slurm site setting .*did you mean qos\?"),
    ({"data_resources": {"slurm": {"partiton": "cpu"}}},
     r"^data_resources\.slurm\.partiton is not a Slurm site setting"),
    # a typo in the defaults is named where it is written, not at the model inheriting it
    ({"model_defaults": {"train": {"microbatch": 8}}},
     r"^model_defaults\.train\.microbatch is not a train setting; did you mean microbatch_size\?"),
    ({"finetune_defaults": {"train": {"seeed": 1}}},
     r"^finetune_defaults\.train\.seeed is not a train setting; did you mean seed\?"),
    ({"model_defaults": {"resources": {"gpus_per_nodes": 8}}},
     r"^model_defaults\.resources\.gpus_per_nodes is not a resource setting"),
    ({"finetune_defaults": {"resources": {"slurm": {"qoss": "x"}}}},
     r"^finetune_defaults\.resources\.slurm\.qoss is not a Slurm site setting"),
    ({"finetune_defaults": {"step_resources": {"evals": {"gpus_per_node": 1}}}},
     r"^finetune_defaults\.step_resources\.evals is not a step with its own resources"),
    ({"model_defaults": {"resource": {"nodes": 2}}},
     r"^model_defaults\.resource is not a section of model_defaults; did you mean resources\?"),
    ({"model_defaults": {"step_resources": {"eval": {}}}}, r"^model_defaults\.step_resources is not a section of "
                                                           r"model_defaults"),
    ({"model_defaults": {"arch": {"d_modle": 3}}}, r"^model_defaults\.arch\.d_modle is not a model setting"),
    # the open mappings passed on to composer / llm-foundry are closed: their keys are the classes' arguments
    ({"models": {"mpt-125m": {"train": {"optimizer": {"learning_rate": 1e-4}}}}},
     r"^models\.mpt-125m\.train\.optimizer\.learning_rate is not an optimizer setting; did you mean lr\?"),
    ({"model_defaults": {"train": {"scheduler": {"t_warmup": "10ba"}}}},
     r"^model_defaults\.train\.scheduler\.t_warmup is not a scheduler setting; did you mean t_warmup_batches\?"),
    ({"models": {"mpt-3b": {"train": {"fsdp": {"activation_checkpoint": True}}}}},
     r"^models\.mpt-3b\.train\.fsdp\.activation_checkpoint is not a setting of composer's FSDPConfig; did you mean "
     r"activation_checkpointing\?"),
    ({"model_defaults": {"train": {"fsdp": {"sharding_stratgy": "FULL_SHARD"}}}},
     r"^model_defaults\.train\.fsdp\.sharding_stratgy is not a setting of composer's FSDPConfig; did you mean "
     r"sharding_strategy\?"),
    ({"finetunes": {"mpt-7b-dolly": {"arch": {"attn_config": {"alibbi": True}}}}},
     r"^finetunes\.mpt-7b-dolly\.arch\.attn_config\.alibbi is not a key of MPT's attn_config; did you mean "
     r"alibi\?"),
    ({"models": {"mpt-125m": {"train": {"optimizer": {"name": "adam"}}}}},
     r"^models\.mpt-125m\.train\.optimizer\.name is 'adam'; it must be one of decoupled_adamw"),
    # names become paths and wildcards: letters, digits, _ . - only (rules/common.smk's wildcard_constraints)
    ({"eval": {"icl_tasks": [{"label": "my task", "kind": "cloze"}]}},
     r"^eval\.icl_tasks\[0\]\.label is 'my task'; it must be letters, digits, _ \. and - only"),
    ({"models": {"my model": {"arch": {"d_model": 64}}}},
     r"^models\.my model is not a usable name: a name must be letters, digits, _ \. and - only.*Fix: rename "
     r"'my model' \(e\.g\. my-model\)"),
    ({"finetunes": {"sft/1": {"base": {"run": "mpt-tiny"}}}}, r"^finetunes\.sft/1 is not a usable name"),
    ({"corpora": {"c4 en": {"source": "hub"}}}, r"^corpora\.c4 en is not a usable name"),
    ({"tokenizers": {"neox:20b": {"source": "hub", "name": "x"}}}, r"^tokenizers\.neox:20b is not a usable name"),
    ({"instruction_sets": {"dolly hh": {"source": "builtin"}}}, r"^instruction_sets\.dolly hh is not a usable name"),
    # unknown top-level sections and keys of settings sections
    ({"model_default": {"train": {"seed": 1}}},
     r"^config\.model_default is not a top-level section of the workflow config; did you mean model_defaults\?"),
    ({"eval": {"val_batchs": 3}}, r"^eval\.val_batchs is not a setting of `eval:`; did you mean val_batches\?.*"
                                  r"\(Its value would be ignored\.\)"),
    ({"generate": {"max_tokens": 5}}, r"^generate\.max_tokens is not a setting of `generate:`; did you mean "
                                      r"max_new_tokens\?.*\(Its value would be ignored\.\)"),
    ({"data_prep": {"worker": 4}}, r"^data_prep\.worker is not a setting of `data_prep:`; did you mean workers\?"),
    ({"convert": {"dtpye": "float16"}}, r"^convert\.dtpye is not a setting of `convert:`; did you mean dtype\?"),
    ({"dispatch": {"pol_s": 1}}, r"^dispatch\.pol_s is not a setting of `dispatch:`; did you mean poll_s\?"),
    ({"allreduce": {"max_byte": 8}},
     r"^allreduce\.max_byte is not a setting of `allreduce:`; did you mean max_bytes\?"),
    ({"scaling": {"node": [1]}}, r"^scaling\.node is not a setting of `scaling:`; did you mean nodes\?"),
    ({"report": {"projection": {"assume_mf": 0.4}}},
     r"^report\.projection\.assume_mf is not a setting of `report\.projection:`; did you mean assume_mfu\?"),
    ({"eval": {"icl_tasks": [{"label": "x", "num_item": 3}]}},
     r"^eval\.icl_tasks\[0\]\.num_item is not a setting of an ICL task; did you mean num_items\?.*ignored"),
    ({"slurm": {"partiton": "gpu"}}, r"^slurm\.partiton is not a Slurm site setting \(config/slurm-site\.yaml\); did "
                                     r"you mean partition\?.*\(Its value would be ignored\.\)"),
    ({"slurm": {"container": {"typ": "pyxis"}}}, r"^slurm\.container\.typ is not a container setting "
                                                 r"\(config/slurm-site\.yaml\); did you mean type\?"),
    ({"allreduce": {"gate": {"size_bytes": 1 << 30, "min_busbw_gbps": 100, "min_busbw_gbs": 90}}},
     r"^allreduce\.gate\.min_busbw_gbs is not a setting of the all-reduce gate; did you mean min_busbw_gbps\?"),
    # wrong values
    ({"models": {"mpt-125m": {"train": {"attn_impl": "sdpaa"}}}},
     r"^models\.mpt-125m\.train\.attn_impl is 'sdpaa'; it must be one of sdpa, torch, flash \(sdpa: PyTorch"),
    ({"models": {"mpt-125m": {"train": {"optimizer": {"lr": "fast"}}}}},
     r"^models\.mpt-125m\.train\.optimizer\.lr is 'fast'; it must be a number"),
    ({"models": {"mpt-125m": {"train": {"microbatch_size": 0}}}},
     r"^models\.mpt-125m\.train\.microbatch_size is 0; it must be >= 1"),
    ({"models": {"mpt-125m": {"train": {"fused_loss": {"kernal": "liger"}}}}},
     r"^models\.mpt-125m\.train\.fused_loss\.kernal is not a fused_loss setting; did you mean kernel\?"),
    ({"models": {"mpt-125m": {"train": {"compile": "layers"}}}},
     r"^models\.mpt-125m\.train\.compile is 'layers'; it must be false, true .*'blocks'"),
    ({"slurm": {"container": {"type": "docker"}}}, r"^slurm\.container\.type is 'docker'; it must be one of null, "
                                                   r"pyxis, apptainer"),
    ({"models": {"mpt-125m": {"train": {"compile": {"scope": "block"}}}}},
     r"^models\.mpt-125m\.train\.compile\.scope is 'block'; it must be model \(the whole model .*\), blocks "),
    ({"models": {"mpt-125m": {"train": {"fused_loss": "liger"}}}},
     r"^models\.mpt-125m\.train\.fused_loss is 'liger'; .*Fix: a kernel goes under the mapping: set "
     r"models\.mpt-125m\.train\.fused_loss to \{kernel: liger\}"),
    ({"finetunes": {"mpt-7b-dolly-lora": {"lora": {"rank": 8}}}},
     r"^finetunes\.mpt-7b-dolly-lora\.lora\.rank is not a LoRA setting; did you mean r\?"),
    ({"eval": {"icl_tasks": [{"label": 3}]}}, r"^eval\.icl_tasks\[0\]\.label is 3; it must be letters, digits"),
    # values with a valid range (issue 18): optimizer values, durations, intervals, batches, seeds, sampling
    ({"models": {"mpt-125m": {"train": {"optimizer": {"lr": -1e-4}}}}},
     r"^models\.mpt-125m\.train\.optimizer\.lr is -0\.0001; it must be >= 0"),
    ({"model_defaults": {"train": {"optimizer": {"betas": [0.9, 1.0]}}}},
     r"^model_defaults\.train\.optimizer\.betas\[1\] is 1\.0; it must be < 1 \(each beta is in \[0, 1\)\)"),
    ({"models": {"mpt-tiny": {"train": {"max_duration_batches": "0ba"}}}},
     r"^models\.mpt-tiny\.train\.max_duration_batches is '0ba'; it must be an integer .*Fix: write the number "
     r"alone, models\.mpt-tiny\.train\.max_duration_batches: 0 \(the setting counts batches; it must be >= 1\)"),
    ({"model_defaults": {"train": {"scheduler": {"t_warmup_batches": "100ba"}}}},
     r"^model_defaults\.train\.scheduler\.t_warmup_batches is '100ba'.*Fix: write the number alone, "
     r"model_defaults\.train\.scheduler\.t_warmup_batches: 100 \(the setting counts batches\)"),
    ({"models": {"mpt-125m": {"train": {"scheduler": {"t_max": "1000tok"}}}}},
     r"^models\.mpt-125m\.train\.scheduler\.t_max is '1000tok'; it must be a composer duration in batches, "
     r"epochs or a fraction of the training, e\.g\. 1000ba, 1ep, 1dur"),
    ({"models": {"mpt-tiny": {"train": {"seed": -1}}}}, r"^models\.mpt-tiny\.train\.seed is -1; it must be >= 0"),
    ({"models": {"mpt-tiny": {"train": {"checkpoints_to_keep": 0}}}},
     r"^models\.mpt-tiny\.train\.checkpoints_to_keep is 0; it must be -1 \(keep all\) or >= 1"),
    ({"models": {"mpt-tiny": {"train": {"eval_subset_batches": 0}}}},
     r"^models\.mpt-tiny\.train\.eval_subset_batches is 0; it must be -1 \(every batch\) or a number of batches"),
    ({"eval": {"val_batches": 0}}, r"^eval\.val_batches is 0; it must be -1 \(every batch\) or a number of batches"),
    ({"generate": {"temperature": 0}}, r"^generate\.temperature is 0; it must be > 0"),
    ({"generate": {"top_p": 1.5}}, r"^generate\.top_p is 1\.5; it must be <= 1"),
    ({"generate": {"long_prompts": "cut"}}, r"^generate\.long_prompts is 'cut'; it must be one of truncate, fail"),
    ({"eval": {"icl_batches": "fast"}}, r"^eval\.icl_batches is 'fast'; it must be one of trimmed, padded"),
    # prompts and templates (issue 32): an empty prompt gave the model nothing to continue and failed every prompt
    ({"generate": {"prompts": ["Once upon a time", ""]}},
     r"^generate\.prompts\[1\] is ''; it must be text with a character other than spaces.*Fix: write the prompt's "
     r"text there, or remove the empty entry from the list"),
    ({"generate": {"prompts": [3]}}, r"^generate\.prompts\[0\] is 3; it must be text .*quote a prompt"),
    # no prompt at all gave the generation step nothing to write; found in the dry run, not in the job
    ({"generate": {"prompts": []}}, r"^generate\.prompts is \[\]; it must be a list of at least one prompt"),
    ({"finetunes": {"mpt-tiny-sft": {"generate": {"prompts": []}}}},
     r"^finetunes\.mpt-tiny-sft\.generate\.prompts is \[\]; it must be null \(generate\.prompts\) or a list of at least"),
    ({"generate": {"prompts": [{"Question": "what?"}]}},
     r"^generate\.prompts\[0\] is \{'Question': 'what\?'\}; it must be text .*holding ': '"),
    ({"finetunes": {"mpt-tiny-sft": {"generate": {"prompts": [" "]}}}},
     r"^finetunes\.mpt-tiny-sft\.generate\.prompts\[0\] is ' '; it must be text with a character other than"),
    ({"generate": {"template": "Q: {question}\nA:"}},
     r"^generate\.template is 'Q: \{question\}\\nA:'; it must be text holding \{prompt\} where the prompt goes"),
    ({"models": {"mpt-tiny": {"generate": {"max_new_tokens": 8}}}},
     r"^models\.mpt-tiny\.generate\.max_new_tokens is not a generation setting of a run; Known ones: prompts, "
     r"template\. \(Sampling and lengths are"),
    ({"corpora": {"c4": {"val_files": 9}}}, r"^corpora\.c4\.val_files is 9; it must be <= 8"),
    ({"models": {"mpt-125m": {"arch": {"attn_config": {"sliding_window_size": 0}}}}},
     r"^models\.mpt-125m\.arch\.attn_config\.sliding_window_size is 0; it must be -1 \(no sliding window\)"),
    ({"models": {"mpt-125m": {"arch": {"attn_config": {"rope_theta": 0}}}}},
     r"^models\.mpt-125m\.arch\.attn_config\.rope_theta is 0; it must be > 0"),
    # sections that are not mappings (a YAML null in a settings section means its defaults: see below)
    ({"eval": "x"}, r"^`eval:` is 'x'; it must be a mapping of settings\. Fix: remove it \(the defaults apply\)"),
    ({"report": "x"}, r"^`report:` is 'x'; it must be a mapping of settings\. Fix: remove it"),
    ({"data_prep": 3}, r"^`data_prep:` is 3; it must be a mapping of settings\. Fix: remove it"),
    ({"slurm": "gpu"}, r"^`slurm:` is 'gpu'; it must be a mapping of settings\. Fix: remove it"),
    ({"models": {"mpt-tiny": {"train": {"seed": None}}}}, r"^models\.mpt-tiny\.train\.seed is null; it must be an "
                                                          r"integer"),
    ({"models": {"mpt-tiny": {"step_resources": 3}}}, r"^models\.mpt-tiny\.step_resources is 3; it must map steps"),
    ({"models": {"mpt-tiny": {"step_resources": {"eval": "x"}}}},
     r"^models\.mpt-tiny\.step_resources\.eval is 'x'; it must be a mapping of resources"),
    ({"models": {"mpt-tiny": {"resources": "x"}}}, r"^models\.mpt-tiny\.resources is 'x'; it must be a mapping"),
    ({"model_defaults": 3}, r"^model_defaults is 3; it must be a mapping of sections"),
    ({"eval": {"icl_tasks": 3}}, r"^eval\.icl_tasks is 3; it must be a list of tasks"),
    ({"eval": {"icl_tasks": ["x"]}}, r"^eval\.icl_tasks\[0\] is 'x'; it must be a mapping"),
    ({"allreduce": {"gate": 5}}, r"^allreduce\.gate is 5; it must be null \(no gate\) or a mapping"),
    ({"report": {"projection": "x"}}, r"^report\.projection is 'x'; it must be a mapping"),
    ({"slurm": {"container": "x"}}, r"^slurm\.container is 'x'; it must be null \(no container\) or a mapping"),
]


@pytest.mark.parametrize("override, expected", SCHEMA_ERRORS, ids=[m[1][1:40] for m in SCHEMA_ERRORS])
def test_schema_names_the_setting_and_the_fix(override, expected):
    """A key nothing reads would be dropped silently (the default used: e.g. no GPU, one node, or a retrained run);
    a wrong value would fail inside the job. The check names the full path where it is written, the closest key
    or what the value must be, and a fix."""
    import re

    msg = schema_error(override)
    assert re.search(expected, msg), msg
    assert "Fix:" in msg, msg


def test_optimizer_keys_are_checked_against_the_named_class():
    """The schema closes optimizer/scheduler to every class's keys; the merged run's keys must be its class's."""
    from llmpipe.config.runs import validate_run

    config = cfg_with({"models": {"mpt-125m": {"train": {"optimizer": {"outlier_threshold": 10.0}}}}})
    with pytest.raises(ConfigError, match=r"^models\.mpt-125m\.train\.optimizer\.outlier_threshold is not a "
                                          r"setting of the optimizer decoupled_adamw \(model_defaults\.train\."
                                          r"optimizer\.name\); It takes lr, betas, eps, weight_decay, amsgrad\."):
        validate_run(config, "mpt-125m")
    config = cfg_with({"finetunes": {"mpt-tiny-sft": {"train": {"scheduler": {"alpha": 0.5}}}}})
    with pytest.raises(ConfigError, match=r"^finetunes\.mpt-tiny-sft\.train\.scheduler\.alpha is not a setting of "
                                          r"the scheduler linear_decay_with_warmup \(finetune_defaults\.train\."
                                          r"scheduler\.name\); did you mean alpha_[if]\?"):
        validate_run(config, "mpt-tiny-sft")


RUN_ERRORS = [
    # cross-field ranges and local sources that must exist (issue 18), named where they are written
    ("mpt-tiny", {"models": {"mpt-tiny": {"train": {"scheduler": {"t_max": "100ba"}}}}},
     r"^models\.mpt-tiny\.train\.scheduler\.t_max is '100ba', so the learning-rate schedule would end before the "
     r"training's 120 batches \(models\.mpt-tiny\.train\.max_duration_batches\).*Fix: set it to at least 120ba"),
    ("mpt-tiny", {"model_defaults": {"train": {"scheduler": {"t_max": "0.5dur"}}}},
     r"^model_defaults\.train\.scheduler\.t_max is '0\.5dur', so the learning-rate schedule would end"),
    ("mpt-tiny", {"models": {"mpt-tiny": {"arch": {"n_kv_heads": 3}}}},
     r"^models\.mpt-tiny\.arch\.n_kv_heads is 3; MPT shares each key/value head among a whole number of the 4 "
     r"query heads \(models\.mpt-tiny\.arch\.n_heads\)\. Fix: pick a divisor of 4\."),
    ("mpt-125m", {"tokenizers": {"gpt-neox-20b": {"source": "local", "name": "/nowhere/neox"}}},
     r"^tokenizers\.gpt-neox-20b\.name: /nowhere/neox is not a folder but source is local\. Fix: point it at a "
     r"folder with tokenizer\.json"),
    ("mpt-7b-dolly", {"finetunes": {"mpt-7b-dolly": {"base": {"hub": "/nowhere/mpt-7b"}}}},
     r"^finetunes\.mpt-7b-dolly\.base\.hub is the folder /nowhere/mpt-7b, which does not exist\. Fix:"),
]


@pytest.mark.parametrize("run, override, expected", RUN_ERRORS, ids=[m[2][1:40] for m in RUN_ERRORS])
def test_run_checks_name_the_setting_and_the_fix(run, override, expected):
    """Values the schema cannot check alone (they depend on another setting or on the file system) fail the run's
    check (the dry run: rules/common.smk validates every planned run), naming where they are written."""
    from llmpipe.config.runs import validate_run

    with pytest.raises(ConfigError, match=expected) as err:
        validate_run(cfg_with(override), run)
    assert "Fix:" in str(err.value)


def test_an_empty_prompt_fails_the_dry_run(workdir):
    """An empty prompt passed the dry run and failed inside the generation job with MPT's IndexError, losing every
    prompt's completion; a finetune's own prompts are checked where they are written."""
    out = dry_fail(workdir, "results/mpt-tiny-sft/generate.json", "--config",
                   "finetunes={'mpt-tiny-sft': {'generate': {'prompts': ['What does json.dumps do?', '']}}}")
    assert ("finetunes.mpt-tiny-sft.generate.prompts[1] is ''; it must be text with a character other than spaces"
            in out), out[-3000:]
    assert "Fix: write the prompt's text there, or remove the empty entry from the list" in out


def test_local_corpus_missing_files_fail_the_dry_run(workdir, tmp_path):
    """A local mirror that lacks files the corpus asks for fails the dry run, not the corpus step."""
    (tmp_path / "mirror/en").mkdir(parents=True)
    (tmp_path / "mirror/en/c4-train.00000-of-01024.json.gz").write_bytes(b"")
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config",
                   f"corpora={{'c4': {{'source': 'local', 'local_dir': '{tmp_path}/mirror'}}}}")
    assert (f"corpora.c4.local_dir lacks 7 of the 8 train files corpora.c4.train_files asks for, e.g. "
            f"{tmp_path}/mirror/en/c4-train.00001-of-01024.json.gz. Fix:") in out, out[-3000:]


def test_a_duration_written_as_text_fails_the_dry_run(workdir):
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--config",
                   "models={'mpt-tiny': {'train': {'scheduler': {'t_warmup_batches': '10ba'}}}}")
    assert ("models.mpt-tiny.train.scheduler.t_warmup_batches is '10ba'; it must be an integer (Warmup batches). "
            "Fix: write the number alone, models.mpt-tiny.train.scheduler.t_warmup_batches: 10") in out, out[-3000:]


def test_two_icl_tasks_with_one_label_are_refused():
    config = _raw_config()
    config["eval"] = {"icl_tasks": [{"label": "a", "kind": "cloze"}, {"label": "b", "kind": "cloze"},
                                    {"label": "a", "kind": "cloze_choice"}]}
    with pytest.raises(ConfigError, match=r"^eval\.icl_tasks\[0\] and eval\.icl_tasks\[2\] have the same label 'a'"):
        schema.prepare(config)


def test_the_schema_names_match_the_workflow_wildcards():
    """A name the schema accepts must be one a target path's wildcard matches (else MissingInputException)."""
    import re

    smk = (REPO / "rules/common.smk").read_text()
    pattern = schema.load()["$defs"]["name"]["pattern"]
    for wildcard in ("corpus", "tokenizer", "label"):
        assert f'{wildcard}=r"{pattern[1:-1]}"' in smk
    assert re.search(r'run=r"\(\?!.*\)' + re.escape(pattern[1:-1]) + '"', smk)


def test_a_model_name_with_a_space_fails_the_dry_run(workdir):
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--config",
                   "models={'my model': {'arch': {'d_model': 64}}}")
    assert "models.my model is not a usable name" in out


def cfg_with(override: dict) -> dict:
    """The shipped config with ``override`` merged in as ``--config`` merges it, resolved."""
    return schema.load_config(REPO / "config/config.yaml", overrides=override)


def test_unknown_top_level_section_fails_the_dry_run(workdir):
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config", "model_default={'train': {'seed': 1}}")
    assert "config.model_default is not a top-level section" in out and "did you mean model_defaults?" in out


def test_misspelled_train_setting_fails_the_dry_run_where_it_is_written(workdir):
    """A typo under train: is an error (ignored, it would also have changed the run's identity and retrained it);
    one under model_defaults is named there, not at a model inheriting it."""
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config",
                   "model_defaults={'train': {'microbatch': 8}}")
    assert "model_defaults.train.microbatch is not a train setting; did you mean microbatch_size?" in out
    out = dry_fail(workdir, "results/mpt-tiny/eval.json", "--config", "eval={'val_batchs': 3}")
    assert "eval.val_batchs is not a setting of `eval:`; did you mean val_batches?" in out


def test_a_wrong_setting_names_the_file_or_option_it_is_written_in(workdir):
    """The user's own config file (--configfile) wins over config/config.yaml, --config over both; the error names
    where the wrong value was written."""
    mine = workdir / "my-experiment.yaml"
    mine.write_text("models:\n  mpt-tiny:\n    train:\n      microbatch: 8\n    arch:\n      d_model: 64\n")
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--configfile", str(mine))
    assert ("models.mpt-tiny.train.microbatch is not a train setting; did you mean microbatch_size?" in out
            and f"(written in {mine})" in out), out[-3000:]
    mine.write_text("models:\n  mpt-tiny:\n    arch:\n      d_model: -3\n")
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--configfile", str(mine))
    assert "models.mpt-tiny.arch.d_model is -3" in out and f"(written in {mine})" in out, out[-3000:]
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--configfile", str(mine), "--config",
                   "models={'mpt-tiny': {'arch': {'d_model': -5}}}")
    assert "models.mpt-tiny.arch.d_model is -5" in out and "(written in --config)" in out, out[-3000:]
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--config", "eval={'val_batches': 0}")
    assert "(written in --config)" in out, out[-3000:]


def test_misspelled_slurm_setting_fails_the_dry_run_of_the_slurm_profile(workdir):
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--profile", str(REPO / "profiles/slurm"), "--config",
                   "slurm={'partiton': 'gpu'}")
    assert "slurm.partiton is not a Slurm site setting (config/slurm-site.yaml); did you mean partition?" in out


def test_signal_delay_that_leaves_no_time_to_train_fails_the_dry_run(workdir):
    """time_min 2 with the default signal_delay_s 120: USR2 would come at every start (no cluster asked); Slurm's
    up-to-60 s early signal and the declared set-up (slurm.setup_s) count against the time limit."""
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--profile", str(REPO / "profiles/slurm"), "--config",
                   "slurm={'preflight': False}", "models={'mpt-tiny': {'resources': {'time_min': 2}}}")
    assert ("slurm.signal_delay_s is 120 s but models.mpt-tiny.resources.time_min is 2 minute(s) (120 s)" in out
            and "Fix: set slurm.signal_delay_s to at most 0, or models.mpt-tiny.resources.time_min to at least 4"
            in out), out[-3000:]
    # a per-step delay is named where it is set
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--profile", str(REPO / "profiles/slurm"), "--config",
                   "slurm={'preflight': False}",
                   "models={'mpt-tiny': {'resources': {'time_min': 5, 'slurm': {'signal_delay_s': 280}}}}")
    assert "models.mpt-tiny.resources.slurm.signal_delay_s is 280 s" in out and "at most 180" in out, out[-3000:]
    # a 40 s delay leaves a 3-minute limit 80 s of work, but only 30 s after a declared 50 s set-up
    out = dry_fail(workdir, "results/mpt-tiny/train.json", "--profile", str(REPO / "profiles/slurm"), "--config",
                   "slurm={'preflight': False, 'signal_delay_s': 40, 'setup_s': 50}",
                   "models={'mpt-tiny': {'resources': {'time_min': 3}}}")
    assert ("after a set-up of slurm.setup_s=50 s a job could have only 30 s of work" in out
            and "set slurm.signal_delay_s to at most 10, or models.mpt-tiny.resources.time_min to at least 4"
            in out), out[-3000:]


def test_per_step_slurm_settings_are_resources(workdir):
    """A per-step slurm mapping is a resource key (docs/slurm.md): the plan goes through."""
    snakemake(workdir, "-n", "results/mpt-tiny/eval.json", "--config",
              "models={'mpt-tiny': {'step_resources': {'eval': {'slurm': {'partition': 'cpu'}}}}}")


def test_shipped_config_and_slurm_site_pass_the_schema():
    schema.check(schema.coerce(_raw_config()))
    full = schema.load_config(REPO / "config/config.yaml", SITE)
    assert full["dispatch"]["executor"] == "slurm" and full["slurm"]["poll_s"] == 30


def _schema_nodes(nodes: list, key) -> tuple[list, bool]:
    """The subschemas of ``key`` under ``nodes`` and whether the key is described (a property, or a named entry)
    rather than let through by an open mapping."""
    def expand(n):
        out = [n]
        if "$ref" in n:
            out += expand(schema.node_at(n["$ref"]))
        for alt in n.get("anyOf", []) + n.get("oneOf", []) + n.get("allOf", []):
            out += expand(alt)
        return out

    flat = [x for n in nodes if isinstance(n, dict) for x in expand(n)]
    if isinstance(key, int):
        return [n["items"] for n in flat if isinstance(n.get("items"), dict)], True
    props = [n["properties"][key] for n in flat if key in (n.get("properties") or {})]
    if props:
        return props, True
    named = [n["additionalProperties"] for n in flat if isinstance(n.get("additionalProperties"), dict)]
    return named, bool(named)


def test_every_key_of_the_shipped_files_is_in_the_schema():
    """Every key written in config/config.yaml and config/slurm-site.yaml has its own entry in the schema (a type and
    a description), not only a pass through an open mapping (optimizer arguments, attn_config)."""
    import yaml

    missing = []

    def walk(value, nodes, path):
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            return
        for key, sub in items:
            subs, described = _schema_nodes(nodes, key)
            if not described and path[-1:] != ["attn_config"]:
                missing.append(".".join(map(str, path + [key])))
            walk(sub, subs, path + [key])

    for f in ("config/config.yaml", "config/slurm-site.yaml"):
        walk(yaml.safe_load((REPO / f).read_text()), [schema.load()], [])
    assert not missing, missing


def test_commented_examples_of_the_slurm_site_file_are_valid_settings():
    """config/slurm-site.yaml documents every site setting as a commented example: uncommented, they pass the schema."""
    import re

    import yaml

    text = "\n".join(re.sub(r"^(\s+)# ", r"\1", line) for line in SITE.read_text().splitlines())
    site = yaml.safe_load(text)["slurm"]
    assert set(site) == set(schema.load()["$defs"]["slurm"]["properties"]), sorted(site)
    schema.check(schema.coerce(dict(_raw_config(), slurm=site)))


def test_every_default_in_the_schema_is_valid():
    """Each ``default`` is valid against the node it sits in, and the defaults together pass the schema."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(schema.load())
    bad = []

    def walk(node, path):
        if isinstance(node, dict):
            if "default" in node and not validator.evolve(schema=node).is_valid(node["default"]):
                bad.append(path)
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(schema.load(), "#")
    assert not bad, bad
    filled = schema.resolve({})
    schema.check(filled)
    assert schema.fill_defaults({}) == filled  # the jobs' reading of the defaults is Snakemake's
    assert filled["convert"]["resources"]["time_min"] == 120 and filled["slurm"]["container"]["python"] == "python"


def test_speed_only_settings_are_marked_in_the_schema():
    """Step identity leaves out exactly the settings the schema marks x-speed-only."""
    from llmpipe.config.runs import SPEED_ONLY_FINETUNE_DATA_KEYS, SPEED_ONLY_TRAIN_KEYS

    assert SPEED_ONLY_TRAIN_KEYS == {
        "microbatch_size", "eval_microbatch_size", "attn_impl", "fsdp", "compile", "num_workers",
        "save_interval_batches", "checkpoints_to_keep", "log_interval_batches", "eval_interval_batches",
        "eval_subset_batches", "fused_optimizer", "train_metrics", "fused_loss", "earlier_identities_to_keep",
        "fsdp_min_params"}
    assert SPEED_ONLY_FINETUNE_DATA_KEYS == {"allow_pad_trimming"}
    train = schema.load()["$defs"]["train"]["properties"]
    assert {k for k, v in train.items() if v.get("x-speed-only")} == SPEED_ONLY_TRAIN_KEYS


# ---------------------------------------------------------------------------------------------- --config typing

def test_config_strings_from_the_command_line_read_as_yaml():
    """`snakemake --config` hands nested values over as strings: each is read as a YAML file would have it where the
    schema wants a number, integer, true/false or null ('False' must switch compile off; a learning rate '1e-3' is a
    float); text stays text."""
    from llmpipe.config.runs import run_config

    config = deep_merge(_raw_config(), {"models": {"mpt-tiny": {"train": {
        "compile": "False", "train_metrics": "true", "fsdp": "null", "seed": "17", "grad_clip_norm": "0.5",
        "optimizer": {"lr": "1e-3", "betas": ["0.8", "0.9"], "amsgrad": "True"}, "attn_impl": "torch",
        "fused_loss": {"chunk_size": "4096", "kernel": "torch"}}}}})
    train = run_config(schema.coerce(config), "mpt-tiny")["train"]
    assert train["compile"] is False and train["train_metrics"] is True and train["fsdp"] is None
    assert train["seed"] == 17 and isinstance(train["seed"], int) and train["grad_clip_norm"] == 0.5
    assert train["optimizer"]["lr"] == 1e-3 and isinstance(train["optimizer"]["lr"], float)
    assert train["optimizer"]["betas"] == [0.8, 0.9] and train["optimizer"]["amsgrad"] is True
    assert train["attn_impl"] == "torch" and train["fused_loss"] == {"chunk_size": 4096, "kernel": "torch"}


def test_restating_a_value_from_the_command_line_keeps_the_identity():
    """``--config`` with ``seed: 17`` (arriving as '17') restates the shipped value: the training's identity text,
    hence its Snakemake params, is unchanged and nothing retrains."""
    from llmpipe.steps.training import train_identity

    base = _shipped_config()
    restated = schema.resolve(deep_merge(_raw_config(), {"models": {"mpt-tiny": {"train": {"seed": "17"}}}}))
    assert train_identity(restated, "mpt-tiny") == train_identity(base, "mpt-tiny")
    changed = schema.resolve(deep_merge(_raw_config(), {"models": {"mpt-tiny": {"train": {"seed": "18"}}}}))
    assert train_identity(changed, "mpt-tiny") != train_identity(base, "mpt-tiny")


PROBE = """
import json
configfile: {config!r}
include: {common!r}
print("TRAIN=" + json.dumps(config["models"]["mpt-tiny"]["train"]))
print("IDENTITY=" + identity_text(train_steps.train_identity(config, "mpt-tiny")))
rule probe:
    output: "x"
    shell: "touch {{output}}"
"""


def _probe(tmp_path, *args) -> tuple[dict, str]:
    """The workflow config's mpt-tiny train section and training identity as rules/common.smk leaves them."""
    import json
    import subprocess
    import sys

    snakefile = tmp_path / "Snakefile"
    snakefile.write_text(PROBE.format(config=str(REPO / "config/config.yaml"), common=str(REPO / "rules/common.smk")))
    p = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(snakefile), "-d", str(tmp_path), "-n", *args],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stdout + p.stderr
    lines = (p.stdout + p.stderr).splitlines()
    train = json.loads(next(x for x in lines if x.startswith("TRAIN="))[len("TRAIN="):])
    return train, next(x for x in lines if x.startswith("IDENTITY="))


def test_nested_config_overrides_reach_the_jobs_typed(tmp_path):
    """The README's override form through a real Snakemake start: the jobs get a float learning rate, and restating
    the seed leaves the training's params text as it was."""
    base_train, base_id = _probe(tmp_path)
    train, ident = _probe(tmp_path, "--config", "models={'mpt-tiny': {'train': {'optimizer': {'lr': '1e-3'}, "
                                                "'seed': '17'}}}")
    assert train["optimizer"]["lr"] == 1e-3 and train["seed"] == 17
    _, restated = _probe(tmp_path, "--config", "models={'mpt-tiny': {'train': {'seed': 17}}}")
    assert restated == base_id and ident != base_id


# ---------------------------------------------------------------------------------------------- null and defaults

@pytest.mark.parametrize("section", ["eval", "report", "data_prep", "dispatch", "scaling", "allreduce", "slurm"])
@pytest.mark.parametrize("value", [None, "null", ""])
def test_empty_settings_sections_mean_the_defaults(section, value):
    """``eval:`` left empty in a config file, or ``--config 'report=null'`` (the string 'null'), means the schema's
    defaults of that section, as for a section that is not written at all."""
    config = _raw_config()
    config[section] = value
    resolved = schema.resolve(config)
    assert resolved[section] == schema.resolve(dict(_raw_config(), **{section: {}}))[section]
    assert resolved[section] == schema.section_defaults(section) or section == "dispatch"


def test_null_strings_from_the_command_line_mean_null():
    """``--config 'step_resources=null'`` and friends arrive as the string 'null'; they mean the defaults, as a YAML
    null does, instead of crashing in the code that reads them."""
    from llmpipe.bench import allreduce_bw as allreduce, scaling_study as scaling
    from llmpipe.report import tables as report
    from llmpipe.config.runs import step_resources, validate_run

    base = _shipped_config()
    c = schema.resolve(deep_merge(_raw_config(), {"models": {"mpt-tiny": {"step_resources": "null"}}}))
    validate_run(c, "mpt-tiny")
    assert step_resources(c, "eval", "mpt-tiny")["gpus_per_node"] == base["eval"]["resources"]["gpus_per_node"]
    c = schema.resolve(deep_merge(_raw_config(), {"models": {"mpt-tiny": {"step_resources": {"eval": "null"}}}}))
    validate_run(c, "mpt-tiny")
    assert step_resources(c, "eval", "mpt-tiny")["gpus_per_node"] == base["eval"]["resources"]["gpus_per_node"]
    c = schema.resolve(dict(_raw_config(), allreduce="null", report="null", scaling="null", slurm="null"))
    assert allreduce.settings(c)["iters"] == allreduce.DEFAULTS["iters"]
    assert report.settings(c)["runs"] == report.DEFAULTS["runs"]
    assert scaling.settings(c)["nodes"] == scaling.DEFAULTS["nodes"]
    c = schema.resolve(deep_merge(_raw_config(), {"allreduce": {"gate": "null"}}))
    assert allreduce.settings(c)["gate"] is None
    c = schema.resolve(deep_merge(_raw_config(), {"slurm": {"container": None, "partition": "null"}}))
    assert c["slurm"]["container"]["type"] is None and c["slurm"]["partition"] is None  # no container, default partition


@pytest.mark.parametrize("section", ["train", "resources", "data"])
def test_a_run_section_written_empty_means_what_it_inherits(section):
    """``models: {mpt-125m: {train: }}`` in a YAML file is None: as if the section were not written (the model
    inherits model_defaults'), as ``models.mpt-125m: null`` already is."""
    from llmpipe.config.runs import run_config, validate_run

    config = _raw_config()
    config["models"]["mpt-125m"][section] = None
    config["finetunes"]["mpt-7b-dolly"][section if section not in ("data", "arch") else "resources"] = None
    resolved = schema.resolve(config)
    validate_run(resolved, "mpt-125m")
    validate_run(resolved, "mpt-7b-dolly")
    assert run_config(resolved, "mpt-125m")[section] == resolved["model_defaults"][section]


@pytest.mark.parametrize("text, null", [("null", True), ("Null", True), ("NULL", True), ("~", True), ("", True),
                                        ("none", False), ("None", False), ("nil", False)])
def test_only_what_yaml_reads_as_null_becomes_null(text, null):
    """A text-or-null setting keeps a text YAML reads as text (``qos: none`` in a site file names a QOS)."""
    config = _raw_config()
    config["slurm"] = dict(config.get("slurm") or {}, qos=text)
    assert schema.coerce(config)["slurm"]["qos"] == (None if null else text)


def test_local_run_refuses_multi_node_training_before_anything_runs(workdir):
    """The local executor runs on this one machine: a real run whose training (or finetune) asks for 2 nodes stops
    before any job runs (nothing converted or trained; the message names the setting and the fix); a dry run still
    shows the 2-node plan (docs/slurm.md: the Slurm plan away from the cluster)."""
    for target, over, where in (
            ("results/mpt-tiny/train.json", "models={'mpt-tiny': {'resources': {'nodes': 2}}}",
             "models.mpt-tiny.resources (rule train)"),
            ("results/mpt-tiny-sft/train.json", "finetunes={'mpt-tiny-sft': {'resources': {'nodes': 2}}}",
             "finetunes.mpt-tiny-sft.resources (rule finetune)")):
        proc = snakemake(workdir, "--cores", "1", target, "--config", over, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-2000:]
        assert f"{where} needs 2 nodes but dispatch.executor is 'local'" in out, out[-3000:]
        assert "--profile slurm" in out
        assert not (workdir / "results").exists() or not [p for p in (workdir / "results").rglob("*") if p.is_file()]
        dry = snakemake(workdir, "-n", target, "--config", over)
        assert "nodes=2" in dry.stdout + dry.stderr


def test_local_executor_never_runs_a_multi_node_step_on_one_node(tmp_path):
    """The backstop in dispatch: the local executor refuses resources of 2 nodes instead of running one."""
    from llmpipe.dispatch import jobs as dispatch
    with pytest.raises(ConfigError, match=r"step x needs 2 nodes but dispatch.executor is 'local'"):
        dispatch.make_executor({"dispatch": {"executor": "local"}}, {"nodes": 2, "tasks_per_node": 1}, str(tmp_path),
                               "x")



def test_misspelled_slurm_setting_of_a_step_or_container():
    """Per-step ``resources.slurm`` and ``slurm.container`` keys are checked when a step's Slurm settings are built
    (before sbatch)."""
    from llmpipe.dispatch.slurm import site_config

    with pytest.raises(ConfigError, match=r"resources\.slurm\.qoss is not a Slurm site setting .*did you mean qos\?"):
        site_config({}, {"slurm": {"qoss": "high"}})
    with pytest.raises(ConfigError, match=r"slurm\.container\.imag is not a container setting .*did you mean image\?"):
        site_config({"slurm": {"container": {"type": "pyxis", "imag": "nvcr.io/x"}}})
    assert site_config({"slurm": {"container": {"type": "pyxis", "image": "nvcr.io/x"}}})["container"]["type"] == "pyxis"



def test_eos_text_that_is_not_text():
    from llmpipe.config.runs import validate_tokenizer

    config = _shipped_config()
    config["tokenizers"]["bpe-builtin-docs"]["eos_text"] = 5
    with pytest.raises(ConfigError, match=r"eos_text is 5; it must be the tokenizer's end-of-text text"):
        validate_tokenizer(config, "bpe-builtin-docs")
