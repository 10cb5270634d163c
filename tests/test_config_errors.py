"""Bad input gets one clear message naming the setting and the fix, already from the dry run."""

from __future__ import annotations

import os
import stat

import pytest

from llmpipe.config import ConfigError

from tests.conftest import REPO, snakemake


def dry_fail(workdir, *args) -> str:
    proc = snakemake(workdir, "-n", *args, check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stdout + proc.stderr


def test_unknown_model(workdir):
    out = dry_fail(workdir, "results/mpt-2b/eval.json")
    assert "unknown model or run 'mpt-2b'" in out and "mpt-1b" in out


def test_missing_local_data_source(workdir, tmp_path):
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config",
                   "corpora={'c4': {'source': 'local', 'local_dir': '%s/nowhere'}}" % tmp_path)
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
    from llmpipe.config import validate_tokenizer

    config = _shipped_config()
    config["tokenizers"]["bpe-builtin-docs"]["eos_text"] = "null"
    with pytest.raises(ConfigError, match=r"tokenizers\.bpe-builtin-docs\.eos_text is empty \('null'\)"):
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
    import yaml
    return yaml.safe_load((REPO / "config/config.yaml").read_text())


def test_every_shipped_model_and_finetune_passes_validation():
    """The defaults in config/config.yaml must plan: each run's microbatch divides its per-device batch, etc.
    (mpt-760m once shipped microbatch 12 with a per-device batch of 32 and failed its own dry run)."""
    from llmpipe.config import known_runs, validate_run

    config = _shipped_config()
    config.setdefault("results_dir", "results")
    runs = known_runs(config)
    assert {"mpt-125m", "mpt-760m", "mpt-70b", "mpt-7b-dolly"} <= set(runs)
    for run in runs:
        validate_run(config, run)


def test_config_strings_from_the_command_line_read_as_yaml():
    """`snakemake --config` hands nested values over as strings: 'False' must switch compile off."""
    from llmpipe.config import run_config

    config = {"model_defaults": {"train": {"compile": True, "train_metrics": False}},
              "models": {"m": {"train": {"compile": "False", "train_metrics": "true", "fsdp": "null"}}}}
    train = run_config(config, "m")["train"]
    assert train["compile"] is False and train["train_metrics"] is True and train["fsdp"] is None


def test_unknown_attention_implementation(workdir):
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config",
                   "models={'mpt-125m': {'train': {'attn_impl': 'sdpaa'}}}")
    assert "models.mpt-125m.train.attn_impl is 'sdpaa'; it must be one of sdpa, torch, flash" in out


def test_misspelled_train_setting(workdir):
    """A typo under train: is an error (ignored, it would also have changed the run's identity and retrained it)."""
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config",
                   "models={'mpt-125m': {'train': {'microbatch': 8}}}")
    assert "models.mpt-125m.train.microbatch is not a train setting; did you mean microbatch_size?" in out
    out = dry_fail(workdir, "results/mpt-tiny-sft/eval.json", "--config",
                   "finetunes={'mpt-tiny-sft': {'train': {'compiles': True}}}")
    assert "finetunes.mpt-tiny-sft.train.compiles is not a train setting; did you mean compile?" in out


def test_local_run_refuses_multi_node_training_before_anything_runs(workdir):
    """The local executor runs on this one machine: a real run whose training (or finetune) asks for 2 nodes stops
    before any job runs (nothing converted or trained; the message names the setting and the fix); a dry run still
    shows the 2-node plan (README: dry runs of cluster configs on a laptop)."""
    for target, over, where in (
            ("results/mpt-tiny/train.json", "models={'mpt-tiny': {'resources': {'nodes': 2}}}",
             "models.mpt-tiny.resources (rule train)"),
            ("results/mpt-tiny-sft/train.json", "finetunes={'mpt-tiny-sft': {'resources': {'nodes': 2}}}",
             "finetunes.mpt-tiny-sft.resources (rule finetune)")):
        proc = snakemake(workdir, "--cores", "1", target, "--config", over, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-2000:]
        assert f"{where} needs 2 nodes but dispatch.executor is 'local'" in out, out[-3000:]
        assert "--profile profiles/slurm" in out
        assert not (workdir / "results").exists() or not [p for p in (workdir / "results").rglob("*") if p.is_file()]
        dry = snakemake(workdir, "-n", target, "--config", over)
        assert "nodes=2" in dry.stdout + dry.stderr


def test_local_executor_never_runs_a_multi_node_step_on_one_node(tmp_path):
    """The backstop in dispatch: the local executor refuses resources of 2 nodes instead of running one."""
    from llmpipe import dispatch
    with pytest.raises(ConfigError, match=r"step x needs 2 nodes but dispatch.executor is 'local'"):
        dispatch.make_executor({"dispatch": {"executor": "local"}}, {"nodes": 2, "tasks_per_node": 1}, str(tmp_path),
                               "x")


def test_misspelled_resource_key_names_the_closest(workdir):
    """A typo under resources (here gpus_per_nodes) would be ignored and the job would get no GPU: the dry run
    stops, naming the key, the closest known one and where Slurm site settings go."""
    out = dry_fail(workdir, "results/mpt-1b/train.json", "--config",
                   "models={'mpt-1b': {'resources': {'gpus_per_nodes': 8}}}")
    assert "models.mpt-1b.resources.gpus_per_nodes is not a resource setting; did you mean gpus_per_node?" in out
    out = dry_fail(workdir, "results/mpt-tiny/eval.json", "--config",
                   "models={'mpt-tiny': {'step_resources': {'eval': {'partition': 'gpu'}}}}")
    assert "models.mpt-tiny.step_resources.eval.partition is not a resource setting" in out
    assert "models.mpt-tiny.step_resources.eval.slurm" in out
    # a per-step slurm mapping is a resource key (docs/slurm.md): the plan goes through
    snakemake(workdir, "-n", "results/mpt-tiny/eval.json", "--config",
              "models={'mpt-tiny': {'step_resources': {'eval': {'slurm': {'partition': 'cpu'}}}}}")


@pytest.mark.parametrize('section,key,close', [('arch', 'd_modle', 'd_model'), ('arch', 'tie_word_embeddings', None),
                                               ('data', 'concat_token', 'concat_tokens')])
def test_unknown_arch_or_data_key_of_a_pretraining_run_is_a_config_error(section, key, close):
    """A key under a pretraining run's arch/data that the training step never reads (a typo, or an MPTConfig
    setting it does not pass on) would be ignored by training while other steps (the MFU formula) read it."""
    from llmpipe.config import ConfigError, deep_merge, validate_run
    config = _shipped_config()   # which passes: test_every_shipped_model_and_finetune_passes_validation
    bad = deep_merge(config, {'models': {'mpt-125m': {section: {key: 1}}}})
    with pytest.raises(ConfigError, match=rf'models\.mpt-125m\.{section}\.{key} is not a') as err:
        validate_run(bad, 'mpt-125m')
    assert (f'did you mean {close}?' in str(err.value)) == bool(close)


@pytest.mark.parametrize('section,typo,close', [('models', 'resource', 'resources'), ('models', 'trian', 'train'),
                                                ('finetunes', 'node_count', 'node_counts')])
def test_misspelled_section_of_a_run_is_a_config_error(section, typo, close):
    """A misspelled section of a model or finetune (e.g. `resource: {nodes: 2}`) would otherwise be dropped
    silently, and the run would use the defaults (one node)."""
    from llmpipe.config import ConfigError, deep_merge, validate_run
    config = _shipped_config()
    run = 'mpt-125m' if section == 'models' else next(iter(config['finetunes']))
    with pytest.raises(ConfigError, match=rf'{section}\.{run}\.{typo} is not a section of a .*did you mean {close}\?'):
        validate_run(deep_merge(config, {section: {run: {typo: {'nodes': 2}}}}), run)


def test_misspelled_top_level_section_is_a_config_error(workdir):
    out = dry_fail(workdir, "results/mpt-125m/train.json", "--config", "model_default={'train': {'seed': 1}}")
    assert "config.model_default is not a top-level section" in out and "did you mean model_defaults?" in out


@pytest.mark.parametrize("override, message", [
    ({"eval": {"val_batchs": 3}}, "eval.val_batchs is not a setting of `eval:`; did you mean val_batches?"),
    ({"generate": {"max_tokens": 5}}, "generate.max_tokens is not a setting of `generate:`; did you mean max_new_tokens?"),
    ({"data_prep": {"worker": 4}}, "data_prep.worker is not a setting of `data_prep:`; did you mean workers?"),
    ({"convert": {"dtpye": "float16"}}, "convert.dtpye is not a setting of `convert:`; did you mean dtype?"),
    ({"dispatch": {"pol_s": 1}}, "dispatch.pol_s is not a setting of `dispatch:`; did you mean poll_s?"),
    ({"allreduce": {"max_byte": 8}}, "allreduce.max_byte is not a setting of `allreduce:`; did you mean max_bytes?"),
    ({"scaling": {"node": [1]}}, "scaling.node is not a setting of `scaling:`; did you mean nodes?"),
    ({"report": {"projection": {"assume_mf": 0.4}}},
     "report.projection.assume_mf is not a setting of `report.projection:`; did you mean assume_mfu?"),
    ({"eval": {"icl_tasks": [{"label": "x", "num_item": 3}]}},
     "eval.icl_tasks[0].num_item is not a setting of an ICL task; did you mean num_items?"),
    ({"slurm": {"partiton": "gpu"}}, "slurm.partiton is not a Slurm site setting (config/slurm-site.yaml); did you "
                                     "mean partition?"),
    ({"slurm": {"container": {"typ": "pyxis"}}}, "slurm.container.typ is not a container setting "
                                                 "(config/slurm-site.yaml); did you mean type?"),
    ({"allreduce": {"gate": {"size_bytes": 1 << 30, "min_busbw_gbps": 100, "min_busbw_gbs": 90}}},
     "allreduce.gate.min_busbw_gbs is not a setting of the all-reduce gate; did you mean min_busbw_gbps?"),
])
def test_misspelled_key_of_a_settings_section(override, message):
    """A key inside a settings section that nothing reads was dropped silently (the default used instead)."""
    from llmpipe.config import check_section_keys, deep_merge

    with pytest.raises(ConfigError) as err:
        check_section_keys(deep_merge(_shipped_config(), override), str(REPO / "config/config.yaml"))
    assert message in str(err.value) and "(Its value would be ignored.)" in str(err.value)


def test_shipped_settings_sections_pass_the_key_check():
    import yaml

    from llmpipe.config import check_section_keys, deep_merge

    site = yaml.safe_load((REPO / "config/slurm-site.yaml").read_text())
    config = deep_merge(_shipped_config(), site)
    check_section_keys(config, str(REPO / "config/config.yaml"))


def test_misspelled_slurm_setting_of_a_step_or_container():
    """Per-step ``resources.slurm`` and ``slurm.container`` keys are checked when a step's Slurm settings are built
    (before sbatch)."""
    from llmpipe.slurm import site_config

    with pytest.raises(ConfigError, match=r"resources\.slurm\.qoss is not a Slurm site setting .*did you mean qos\?"):
        site_config({}, {"slurm": {"qoss": "high"}})
    with pytest.raises(ConfigError, match=r"slurm\.container\.imag is not a container setting .*did you mean image\?"):
        site_config({"slurm": {"container": {"type": "pyxis", "imag": "nvcr.io/x"}}})
    assert site_config({"slurm": {"container": {"type": "pyxis", "image": "nvcr.io/x"}}})["container"]["type"] == "pyxis"


def test_misspelled_section_key_fails_the_dry_run(workdir):
    out = dry_fail(workdir, "results/mpt-tiny/eval.json", "--config", "eval={'val_batchs': 3}")
    assert "eval.val_batchs is not a setting of `eval:`; did you mean val_batches?" in out


@pytest.mark.parametrize("section, value", [("eval", "x"), ("eval", "null"), ("eval", None), ("report", "x"),
                                            ("data_prep", 3), ("data_prep", "null"), ("dispatch", None),
                                            ("slurm", "gpu")])
def test_settings_section_that_is_not_a_mapping(section, value):
    """``--config 'eval=3'`` (or ``eval: null`` in a config file) crashed later with a bare Python error."""
    from llmpipe.config import check_section_keys

    config = dict(_shipped_config(), **{section: value})
    with pytest.raises(ConfigError, match=rf"`{section}:` is .*; it must be a mapping of settings\. Fix: remove it"):
        check_section_keys(config, str(REPO / "config/config.yaml"))


def test_empty_optional_sections_mean_the_defaults():
    from llmpipe.config import check_section_keys

    config = dict(_shipped_config(), report=None, scaling="", allreduce=None, slurm=None)
    check_section_keys(config, str(REPO / "config/config.yaml"))


def test_step_resources_of_an_unknown_step_and_its_slurm_keys_are_named():
    """``step_resources: {evals: ...}`` was ignored; a per-step ``slurm:`` typo is named with its full path."""
    from llmpipe.config import deep_merge, step_resources, validate_run

    base = dict(_shipped_config(), results_dir="results")
    bad = deep_merge(base, {"models": {"mpt-tiny": {"step_resources": {"evals": {"gpus_per_node": 1}}}}})
    with pytest.raises(ConfigError, match=r"models\.mpt-tiny\.step_resources\.evals is not a step with its own "
                                          r"resources; did you mean eval\?"):
        validate_run(bad, "mpt-tiny")
    bad = deep_merge(base, {"models": {"mpt-tiny": {"step_resources": {"eval": {"slurm": {"qoss": "x"}}}}}})
    with pytest.raises(ConfigError, match=r"models\.mpt-tiny\.step_resources\.eval\.slurm\.qoss is not a Slurm "
                                          r"site setting .*did you mean qos\?"):
        validate_run(bad, "mpt-tiny")
    bad = deep_merge(base, {"data_resources": {"slurm": {"partiton": "cpu"}}})
    with pytest.raises(ConfigError, match=r"data_resources\.slurm\.partiton is not a Slurm site setting"):
        step_resources(bad, "data")


def test_typo_in_the_defaults_is_named_where_it_is_written():
    """A key misspelled under model_defaults / finetune_defaults was reported against the first run checked
    (models.mpt-125m.train.microbatch), where the user finds no such line."""
    from llmpipe.config import deep_merge, validate_run

    base = dict(_shipped_config(), results_dir="results")
    cases = [
        ({"model_defaults": {"train": {"microbatch": 8}}}, "mpt-125m", r"model_defaults\.train\.microbatch is not a "
                                                                       r"train setting; did you mean microbatch_size\?"),
        ({"model_defaults": {"train": {"microbatch": 8}}}, "mpt-tiny-sft", r"model_defaults\.train\.microbatch "),
        ({"finetune_defaults": {"train": {"seeed": 1}}}, "mpt-7b-dolly", r"finetune_defaults\.train\.seeed is not"),
        ({"models": {"mpt-125m": {"train": {"microbatch": 8}}}}, "mpt-125m", r"models\.mpt-125m\.train\.microbatch "),
        ({"model_defaults": {"resources": {"gpus_per_nodes": 8}}}, "mpt-1b",
         r"model_defaults\.resources\.gpus_per_nodes is not a resource setting"),
        ({"finetune_defaults": {"resources": {"slurm": {"qoss": "x"}}}}, "mpt-tiny-sft",
         r"finetune_defaults\.resources\.slurm\.qoss is not a Slurm site setting"),
        ({"finetune_defaults": {"step_resources": {"evals": {"gpus_per_node": 1}}}}, "mpt-tiny-sft",
         r"finetune_defaults\.step_resources\.evals is not a step with its own resources"),
        ({"model_defaults": {"resource": {"nodes": 2}}}, "mpt-tiny", r"model_defaults\.resource is not a section of "
                                                                     r"model_defaults; did you mean resources\?"),
        ({"model_defaults": {"step_resources": {"eval": {}}}}, "mpt-tiny",
         r"model_defaults\.step_resources is not a section of model_defaults"),
        ({"model_defaults": {"arch": {"d_modle": 3}}}, "mpt-1b", r"model_defaults\.arch\.d_modle is not a model "
                                                                 r"setting"),
    ]
    for override, run, message in cases:
        with pytest.raises(ConfigError, match="^" + message):
            validate_run(deep_merge(base, override), run)


@pytest.mark.parametrize("override, message", [
    ({"models": {"mpt-tiny": {"train": None}}}, r"models\.mpt-tiny\.train is None; it must be a mapping"),
    ({"models": {"mpt-tiny": {"step_resources": 3}}}, r"models\.mpt-tiny\.step_resources is 3; it must map steps"),
    ({"models": {"mpt-tiny": {"step_resources": {"eval": "x"}}}},
     r"models\.mpt-tiny\.step_resources\.eval is 'x'; it must be a mapping of resources"),
    ({"models": {"mpt-tiny": {"resources": "x"}}}, r"models\.mpt-tiny\.resources is 'x'; it must be a mapping"),
    ({"model_defaults": 3}, r"model_defaults is 3; it must be a mapping of sections"),
])
def test_run_section_that_is_not_a_mapping(override, message):
    from llmpipe.config import deep_merge, validate_run

    with pytest.raises(ConfigError, match="^" + message):
        validate_run(deep_merge(dict(_shipped_config(), results_dir="results"), override), "mpt-tiny")


def test_null_strings_from_the_command_line_mean_null():
    """``--config 'step_resources=null'`` and friends arrive as the string 'null'; they mean the defaults, as a YAML
    null does, instead of crashing in the code that reads them."""
    from llmpipe import allreduce, report, scaling
    from llmpipe.config import check_section_keys, deep_merge, step_resources, validate_run

    base = dict(_shipped_config(), results_dir="results")
    c = deep_merge(base, {"models": {"mpt-tiny": {"step_resources": "null"}}})
    validate_run(c, "mpt-tiny")
    assert step_resources(c, "eval", "mpt-tiny")["gpus_per_node"] == base["eval"]["resources"]["gpus_per_node"]
    c = deep_merge(base, {"models": {"mpt-tiny": {"step_resources": {"eval": "null"}}}})
    validate_run(c, "mpt-tiny")
    assert step_resources(c, "eval", "mpt-tiny")["gpus_per_node"] == base["eval"]["resources"]["gpus_per_node"]
    c = dict(base, allreduce="null", report="null", scaling="null", slurm="null")
    check_section_keys(c, str(REPO / "config/config.yaml"))
    assert allreduce.settings(c)["iters"] == allreduce.DEFAULTS["iters"]
    assert report.settings(c)["runs"] == report.DEFAULTS["runs"]
    assert scaling.settings(c)["nodes"] == scaling.DEFAULTS["nodes"]
    c = deep_merge(base, {"allreduce": {"gate": "null"}})
    check_section_keys(c, str(REPO / "config/config.yaml"))
    assert allreduce.settings(c)["gate"] is None


@pytest.mark.parametrize("override, message", [
    ({"eval": {"icl_tasks": 3}}, r"eval\.icl_tasks is 3; it must be a list of tasks"),
    ({"eval": {"icl_tasks": ["x"]}}, r"eval\.icl_tasks\[0\] is 'x'; it must be a mapping"),
    ({"allreduce": {"gate": 5}}, r"allreduce\.gate is 5; it must be null \(no gate\) or a mapping"),
    ({"report": {"projection": "x"}}, r"report\.projection is 'x'; it must be a mapping"),
    ({"slurm": {"container": "x"}}, r"slurm\.container is 'x'; it must be null \(no container\) or a mapping"),
])
def test_settings_subsection_that_is_not_a_mapping(override, message):
    from llmpipe.config import check_section_keys, deep_merge

    with pytest.raises(ConfigError, match="^" + message):
        check_section_keys(deep_merge(_shipped_config(), override), str(REPO / "config/config.yaml"))


def test_eos_text_that_is_not_text():
    from llmpipe.config import validate_tokenizer

    config = _shipped_config()
    config["tokenizers"]["bpe-builtin-docs"]["eos_text"] = 5
    with pytest.raises(ConfigError, match=r"eos_text is 5; it must be the tokenizer's end-of-text text"):
        validate_tokenizer(config, "bpe-builtin-docs")
