"""Typed run settings (llmpipe.config.settings): their cross-field checks, one implementation for pretraining, finetuning
and the node-scaling study; each error names the setting's full config path and the fix. Fast: no snakemake."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from llmpipe.config import runs as cfg
from llmpipe.bench import scaling_study as scaling
from llmpipe.config.settings import (ArchSettings, ConfigError, DataSettings, OptimizerSettings, Resources, RunSettings,
                              SchedulerSettings, TrainSettings,
                              lcm)
from tests.conftest import REPO


@pytest.fixture(scope="module")
def shipped() -> dict:
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["results_dir"] = "results"
    return config


def error_of(config: dict, override: dict, run: str, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        cfg.validate_run(cfg.deep_merge(config, override), run, **kw)
    return str(err.value)


# (override of config/config.yaml, run, substrings of the message: the setting's path and the fix)
CASES = {
    "global batch not divisible by the devices": (
        {"models": {"mpt-125m": {"resources": {"nodes": 3}}}}, "mpt-125m",
        ["models.mpt-125m.train.global_batch_size (256) is not divisible by the number of GPUs at 3 node(s) "
         "(24 = 3 x 8 per node).", "Fix: make global_batch_size a multiple of 24, or change "
                                   "models.mpt-125m.resources.nodes (3) or "
                                   "model_defaults.resources.gpus_per_node (8)."]),
    "global batch not divisible by CPU tasks": (
        {"models": {"mpt-tiny": {"resources": {"tasks_per_node": 3}}}}, "mpt-tiny",
        ["models.mpt-tiny.train.global_batch_size (8) is not divisible by the number of tasks at 1 node(s) "
         "(3 = 1 x 3 per node)", "Fix: make global_batch_size a multiple of 3"]),
    "microbatch does not divide the per-device batch": (
        {"models": {"mpt-125m": {"train": {"microbatch_size": 12}}}}, "mpt-125m",
        ["models.mpt-125m.train.microbatch_size (12) does not divide the per-device batch at 1 node(s) "
         "(32 = 256 / 8 GPUs)", "Fix: pick a microbatch_size that divides the per-device batch (32), e.g. 8"]),
    "microbatch not positive": (
        {"models": {"mpt-tiny": {"train": {"microbatch_size": 0}}}}, "mpt-tiny",
        ["models.mpt-tiny.train.microbatch_size must be positive, got 0."]),
    "max_duration_batches not positive": (
        {"models": {"mpt-tiny": {"train": {"max_duration_batches": 0}}}}, "mpt-tiny",
        ["models.mpt-tiny.train.max_duration_batches must be positive, got 0."]),
    "global batch not a number": (
        {"models": {"mpt-tiny": {"train": {"global_batch_size": "lots"}}}}, "mpt-tiny",
        ["models.mpt-tiny.train.global_batch_size is 'lots'; it must be a whole number."]),
    "microbatch given as a boolean": (
        {"models": {"mpt-tiny": {"train": {"microbatch_size": True}}}}, "mpt-tiny",
        ["models.mpt-tiny.train.microbatch_size is True; it must be a whole number."]),
    "nodes below 1": (
        {"models": {"mpt-tiny": {"resources": {"nodes": 0}}}}, "mpt-tiny",
        ["models.mpt-tiny.resources.nodes must be at least 1, got 0."]),
    "concat_tokens larger than max_seq_len": (
        {"models": {"mpt-tiny": {"data": {"concat_tokens": 256}}}}, "mpt-tiny",
        ["models.mpt-tiny.data.concat_tokens (256) is larger than models.mpt-tiny.arch.max_seq_len (128)",
         "Fix: lower concat_tokens or raise max_seq_len."]),
    "concat_tokens below 2": (
        {"models": {"mpt-tiny": {"data": {"concat_tokens": 1}}}}, "mpt-tiny",
        ["models.mpt-tiny.data.concat_tokens must be at least 2, got 1."]),
    "d_model not divisible by n_heads": (
        {"models": {"mpt-tiny": {"arch": {"n_heads": 3}}}}, "mpt-tiny",
        ["models.mpt-tiny.arch.d_model (128) does not divide by n_heads (3).",
         "Fix: choose n_heads that divides d_model."]),
    "arch key missing": (
        {"models": {"mpt-tiny": {"arch": {"d_model": None}}}}, "mpt-tiny",
        ["models.mpt-tiny.arch.d_model is missing.", "Fix: set it"]),
    "trained tokenizer larger than the model's vocabulary": (
        {"tokenizers": {"bpe-builtin-docs": {"vocab_size": 5000}}}, "mpt-tiny",
        ["tokenizers.bpe-builtin-docs.vocab_size (5000) exceeds models.mpt-tiny.arch.vocab_size (4096)",
         "Fix: raise the model's vocab_size or lower the tokenizer's."]),
    # finetunes: the same checks (the batch at every count of node_counts too), and their own values
    "finetune batch at its node_counts": (
        {"finetunes": {"mpt-7b-dolly": {"train": {"global_batch_size": 48}}}}, "mpt-7b-dolly",
        ["at every node count it trains at (1, 2, 4, 8)",
         "  at 4 node(s): finetunes.mpt-7b-dolly.train.global_batch_size (48) is not divisible by the number of "
         "GPUs at 4 node(s) (32 = 4 x 8 per node)\n", "  at 8 node(s): ",
         "Fix: make global_batch_size a multiple of 64, or change finetune_defaults.resources.nodes (1), "
         "finetunes.mpt-7b-dolly.node_counts or finetune_defaults.resources.gpus_per_node (8)."]),
    "finetune microbatch at its node_counts": (
        {"finetunes": {"mpt-7b-dolly": {"train": {"microbatch_size": 3}}}}, "mpt-7b-dolly",
        ["  at 1 node(s): finetunes.mpt-7b-dolly.train.microbatch_size (3) does not divide the per-device batch at "
         "1 node(s) (8 = 64 / 8 GPUs)", "  at 2 node(s): ",
         "Fix: pick a microbatch_size that divides the per-device batch (8, 4, 2, 1), e.g. 2, or change "
         "finetune_defaults.resources.nodes (1), finetunes.mpt-7b-dolly.node_counts or "
         "finetune_defaults.resources.gpus_per_node (8)."]),
    # each value is named where it is written: the run's section, model_defaults or finetune_defaults
    "concat_tokens inherited from model_defaults": (
        {"model_defaults": {"data": {"concat_tokens": 4096}}}, "mpt-1b",
        ["model_defaults.data.concat_tokens (4096) is larger than model_defaults.arch.max_seq_len (2048)"]),
    "devices per node inherited from model_defaults": (
        {"model_defaults": {"resources": {"gpus_per_node": 6}}}, "mpt-1b",
        ["(6 = 1 x 6 per node)", "or change model_defaults.resources.nodes (1) or "
                                 "model_defaults.resources.gpus_per_node (6)."]),
    "CPU tasks per node inherited from model_defaults": (
        {"model_defaults": {"resources": {"gpus_per_node": 0, "tasks_per_node": 3}}}, "mpt-125m",
        ["models.mpt-125m.train.global_batch_size (256)", "model_defaults.resources.tasks_per_node (3)."]),
    "finetune nodes inherited from finetune_defaults": (
        {"finetune_defaults": {"resources": {"nodes": 3}}}, "mpt-7b-dolly",
        ["at every node count it trains at (1, 2, 3, 4, 8)", "or change finetune_defaults.resources.nodes (3), "]),
    "vocabulary inherited from model_defaults": (
        {"model_defaults": {"arch": {"vocab_size": 0}}}, "mpt-125m",
        ["model_defaults.arch.vocab_size must be positive, got 0."]),
    "packing ratio inherited from finetune_defaults": (
        {"finetune_defaults": {"data": {"packing_ratio": 0.5}}}, "mpt-7b-dolly",
        ["finetune_defaults.data.packing_ratio is 0.5; it must be null"]),
    "a null in the run's section is named there": (
        {"finetunes": {"mpt-7b-dolly": {"train": {"microbatch_size": None}}}}, "mpt-7b-dolly",
        ["finetunes.mpt-7b-dolly.train.microbatch_size is missing."]),
    "nodes in model_defaults below 1": (
        {"model_defaults": {"resources": {"nodes": 0}}}, "mpt-125m",
        ["model_defaults.resources.nodes must be at least 1, got 0."]),
    "finetune's base run's max_seq_len": (
        {"finetunes": {"mpt-tiny-sft": {"data": {"max_seq_len": 4096}}}}, "mpt-tiny-sft",
        ["finetunes.mpt-tiny-sft.data.max_seq_len (4096) is larger than the base model's max_seq_len (128, "
         "models.mpt-tiny.arch.max_seq_len)"]),
    "finetune node count below 1": (
        {"finetunes": {"mpt-7b-dolly": {"node_counts": [0, 1]}}}, "mpt-7b-dolly",
        ["finetunes.mpt-7b-dolly.node_counts must list node counts >= 1"]),
    "finetune max_seq_len larger than the base's": (
        {"finetunes": {"mpt-7b-dolly": {"data": {"max_seq_len": 4096}}}}, "mpt-7b-dolly",
        ["finetunes.mpt-7b-dolly.data.max_seq_len (4096) is larger than the base model's max_seq_len (2048, "
         "finetunes.mpt-7b-dolly.arch.max_seq_len)", "Fix: lower max_seq_len."]),
    "finetune arch of hub weights missing": (
        {"finetunes": {"mpt-7b-dolly": {"arch": {"n_layers": None}}}}, "mpt-7b-dolly",
        ["finetunes.mpt-7b-dolly.arch.n_layers is missing: for hub weights", "Fix: copy it from the model's "
                                                                             "config.json."]),
    "finetune's base run misses a shape key": (
        {"models": {"mpt-tiny": {"arch": {"d_model": None}}}}, "mpt-tiny-sft",
        ["models.mpt-tiny.arch.d_model is missing. Fix: set it"]),
    "finetune's base run has a bad shape": (
        {"models": {"mpt-tiny": {"arch": {"n_heads": 3}}}}, "mpt-tiny-sft",
        ["models.mpt-tiny.arch.d_model (128) does not divide by n_heads (3)."]),
    "finetune tokenizer larger than its base run's vocabulary": (
        {"tokenizers": {"bpe-builtin-docs": {"vocab_size": 5000}}}, "mpt-tiny-sft",
        ["tokenizers.bpe-builtin-docs.vocab_size (5000) exceeds models.mpt-tiny.arch.vocab_size (4096)"]),
    "finetune packing ratio": (
        {"finetunes": {"mpt-7b-dolly": {"data": {"packing_ratio": 0.5}}}}, "mpt-7b-dolly",
        ["finetunes.mpt-7b-dolly.data.packing_ratio is 0.5; it must be null, 'auto' or a number >= 1."]),
    "finetune hub revision": (
        {"finetunes": {"mpt-7b-dolly": {"base": {"revision": "v1"}}}}, "mpt-7b-dolly",
        ["finetunes.mpt-7b-dolly.base.revision is 'v1'", "Fix: download that revision"]),
    "finetune LoRA rank": (
        {"finetunes": {"mpt-7b-dolly-lora": {"lora": {"r": 0}}}}, "mpt-7b-dolly-lora",
        ["finetunes.mpt-7b-dolly-lora.lora must be null or {r: 8", "with r > 0"]),
}


@pytest.mark.parametrize("case", CASES)
def test_cross_field_check_names_the_setting_and_the_fix(shipped, case):
    override, run, parts = CASES[case]
    message = error_of(shipped, override, run)
    for part in parts:
        assert part in message, message


def test_a_run_with_extra_node_counts_is_checked_at_each(shipped):
    """The node counts a caller adds (a scaling study's) are checked like the run's own, named in the fix."""
    cfg.validate_run(shipped, "mpt-7b")  # 1024 over 2 x 8 GPUs
    message = error_of(shipped, {}, "mpt-7b", node_counts=[3], counts_where="scaling.nodes")
    assert ("  at 3 node(s): models.mpt-7b.train.global_batch_size (1024) is not divisible by the number of GPUs at "
            "3 node(s) (24 = 3 x 8 per node)\n") in message
    assert "at 2 node(s)" not in message and message.endswith(
        "or change scaling.nodes or model_defaults.resources.gpus_per_node (8).")


def test_scaling_study_uses_the_same_check(shipped):
    """scaling.check_study lists every count where the batch fails, with the very lines a run's own check gives."""
    with pytest.raises(ConfigError) as err:
        scaling.check_study(shipped, "mpt-7b", [1, 2, 3, 5])
    study = str(err.value)
    assert study.startswith("the node-scaling study of mpt-7b (scaling.nodes = [1, 2, 3, 5]) cannot run: ")
    assert "at 1 node(s)" not in study and "at 2 node(s)" not in study
    assert ("Fix: make global_batch_size a multiple of 240, or change scaling.nodes or "
            "model_defaults.resources.gpus_per_node (8).") in study
    for n in (3, 5):
        own = error_of(shipped, {"models": {"mpt-7b": {"resources": {"nodes": n}}}}, "mpt-7b")
        line = own.split(". Fix:")[0]
        assert f"  at {n} node(s): {line}\n" in study


def test_scaling_study_of_a_finetune_keeps_its_node_counts(shipped):
    """A finetune's study checks its own node_counts too (the same finetune runs at each), and says where they are."""
    with pytest.raises(ConfigError) as err:
        scaling.check_study(shipped, "mpt-30b-instruct", [3])
    message = str(err.value)
    assert "every node count it trains at (1, 2, 3, 4, 8)" in message
    assert "  at 3 node(s): finetunes.mpt-30b-instruct.train.global_batch_size (64) is not divisible" in message
    assert ("or change scaling.nodes, finetunes.mpt-30b-instruct.node_counts or "
            "finetune_defaults.resources.gpus_per_node (8).") in message


def test_scaling_study_reports_a_setting_error_once(shipped):
    bad = cfg.deep_merge(shipped, {"models": {"mpt-7b": {"data": {"concat_tokens": 4096}}}})
    with pytest.raises(ConfigError, match=r"^the node-scaling study of mpt-7b .* cannot run: models\.mpt-7b\.data\."
                                          r"concat_tokens \(4096\) is larger than") as err:
        scaling.check_study(bad, "mpt-7b", [1, 2])
    assert str(err.value).count("concat_tokens (4096)") == 1


def test_every_shipped_run_builds_typed_settings(shipped):
    for run in cfg.known_runs(shipped):
        rs = cfg.run_settings(shipped, run)
        rc = cfg.run_config(shipped, run)
        assert rs.name == run and rs.kind == rc.get("kind", "pretrain")
        assert rs.where == f"{'finetunes' if rs.kind == 'finetune' else 'models'}.{run}"
        assert rs.train.global_batch_size == int(rc["train"]["global_batch_size"])
        assert rs.resources.devices() == cfg.world_size(rc["resources"])
    tiny = cfg.run_settings(shipped, "mpt-tiny")
    assert tiny.tokenizer_vocab_size == 4096 and tiny.resources.device_kind == "tasks"
    sft = cfg.run_settings(shipped, "mpt-tiny-sft")
    assert sft.base.run == "mpt-tiny" and sft.arch.where == "models.mpt-tiny.arch"
    lora = cfg.run_settings(shipped, "mpt-7b-dolly-lora")
    assert lora.lora.r == 8 and lora.lora.target_modules == ("Wqkv",) and lora.node_counts == (1, 2, 4, 8)


def test_settings_are_frozen_and_keyword_only():
    res = Resources(nodes=2, gpus_per_node=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.nodes = 3
    with pytest.raises(TypeError):
        Resources(2, 8)  # positional arguments are refused
    assert res.devices() == 16 and res.devices(4) == 32 and res.per_node == 8
    assert Resources.from_dict({"gpus_per_node": None, "tasks_per_node": 4}).devices() == 4


def test_settings_built_by_hand_check_the_same():
    """The typed settings work without a workflow config (e.g. a test or a tool building one run)."""
    rest = {"seed": 17, "precision": "fp32", "optimizer": OptimizerSettings(name="adamw", kwargs={"lr": 1e-3}),
            "scheduler": SchedulerSettings(name="cosine_with_warmup", t_warmup_batches=1, kwargs={}),
            "grad_clip_norm": 1.0, "loss_fn": "torch_crossentropy", "eval_microbatch_size": 4, "attn_impl": "torch",
            "fsdp": None, "compile": None, "fused_loss": None, "fp8": None, "num_workers": 0,
            "save_interval_batches": 5, "checkpoints_to_keep": 2, "earlier_identities_to_keep": 1,
            "fsdp_min_params": None, "log_interval_batches": 1, "eval_interval_batches": 5, "eval_subset_batches": 1,
            "fused_optimizer": False, "train_metrics": False}

    def run(**train):
        return RunSettings(
            name="m", data=DataSettings(concat_tokens=128),
            arch=ArchSettings(d_model=64, n_heads=4, n_layers=2, vocab_size=256, max_seq_len=128,
                              expansion_ratio=4, no_bias=True, norm_type="layernorm"),
            train=TrainSettings(where="models.m.train", **{"global_batch_size": 16, "microbatch_size": 4,
                                                           "max_duration_batches": 5, **rest, **train}),
            resources=Resources(nodes=1, gpus_per_node=2))

    assert run().check(node_counts=[2, 4]) is not None
    with pytest.raises(ConfigError, match=r"at 3 node\(s\): models\.m\.train\.global_batch_size \(16\) is not "
                                          r"divisible .*\nFix: make global_batch_size a multiple of 6, or change "
                                          r"models\.m\.resources\.nodes \(1\) or models\.m\.resources\."
                                          r"gpus_per_node \(2\)\.$"):
        run().check(node_counts=[3])
    with pytest.raises(ConfigError, match=r"^models\.m\.train\.max_duration_batches must be positive"):
        run(max_duration_batches=-1)


def test_prepared_tokenizer_checked_against_the_model(shipped):
    """What the training step checks once a hub tokenizer is fetched (its manifest's vocabulary)."""
    rs = cfg.run_settings(shipped, "mpt-125m")
    rs.check_vocab(50277, "results/tokenizers/gpt-neox-20b/manifest.json vocab_size")
    with pytest.raises(ConfigError, match=r"^results/tokenizers/gpt-neox-20b/manifest\.json vocab_size \(60000\) "
                                          r"exceeds model_defaults\.arch\.vocab_size \(50368\).*Fix: raise"):
        rs.check_vocab(60000, "results/tokenizers/gpt-neox-20b/manifest.json vocab_size")


def test_lcm():
    assert lcm([8, 16, 24, 40]) == 240 and lcm([]) == 1


def test_key_value_heads_count_where_mpt_counts_them(shipped):
    """arch.n_kv_heads turns grouped-query attention on, also when attn_config repeats the count;
    attn_config.kv_n_heads alone counts only under a grouped-query attn_type (MPT ignores it otherwise), so the
    model built, its parameter count and its MFU agree with MPT."""
    from llmpipe.config.runs import run_config
    from llmpipe.model.mfu import mpt_param_count
    from llmpipe.config.schema import deep_merge
    from llmpipe.train.pretrain import foundry_train_config

    def model(arch: dict) -> tuple[dict, dict, dict]:
        config = deep_merge(shipped, {"models": {"mpt-1b": {"arch": arch}}})
        settings = cfg.run_settings(config, "mpt-1b")
        built = foundry_train_config(settings, data_dir=None, save_folder=None, world_size=1)["model"]
        return built["attn_config"], settings.arch.as_dict(), run_config(config, "mpt-1b")["arch"]

    for arch in ({"n_kv_heads": 4}, {"n_kv_heads": 4, "attn_config": {"kv_n_heads": 4}}):
        attn, typed, _ = model(arch)
        assert attn["attn_type"].endswith("grouped_query_attention") and attn["kv_n_heads"] == 4, arch
        assert typed["n_kv_heads"] == 4
    attn, typed, written = model({"attn_config": {"kv_n_heads": 4}})   # no grouped-query attn_type: multi-head
    assert attn["attn_type"].endswith("multihead_attention") and "n_kv_heads" not in typed
    assert mpt_param_count(typed) == mpt_param_count(written)
    gqa = {"attn_config": {"kv_n_heads": 4, "attn_type": "grouped_query_attention"}}
    attn, typed, written = model(gqa)
    assert attn["attn_type"].endswith("grouped_query_attention") and attn["kv_n_heads"] == 4
    assert mpt_param_count(typed) == mpt_param_count(written)
    assert mpt_param_count(typed)["total"] < mpt_param_count(model({})[1])["total"]
