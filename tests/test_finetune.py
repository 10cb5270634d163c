"""Supervised finetuning: the tiny chain end to end on CPU, rerun scope, dry runs of the 7B/30B finetunes with their
resources and batch divisibility, and their data and dataloader config built on a few stand-in rows in the hub's
layout (the hub cannot be reached here)."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from tests.conftest import REPO, copy_run, planned_jobs, project_config, snakemake
from tests.test_export import usual_calls

SFT = "mpt-tiny-sft"
SFT_TARGETS = [f"results/{SFT}/eval.json", f"results/{SFT}/generate.json"]
AFTER_FINETUNE = {"finetune": 1, "convert": 1, "generate": 1, "finetune_eval": 1}


def load_config() -> dict:
    return project_config()


def load(wd, rel):
    with open(wd / "results" / rel) as fh:
        return json.load(fh)


def check_generation_template(cfg: dict, run: str, gen: dict, pretrained: dict) -> None:
    """A finetune's generate.json sent each prompt in the instruction format it trained on, byte for byte (the
    builtin set's template, which its training prompts are built with); the pretraining run's text is the prompt."""
    from llmpipe.data.instructions import BUILTIN_TEMPLATE, apply_template, instruction_template

    prompts = cfg["generate"]["prompts"]
    iset = cfg["instruction_sets"][cfg["finetunes"][run]["data"]["instructions"]]
    template = instruction_template(iset)
    assert template == BUILTIN_TEMPLATE == "Question: {prompt}\nAnswer:" and gen["settings"]["template"] == template
    sent = [o["text"].encode() for o in gen["outputs"]]
    assert sent == [apply_template(template, p).encode() for p in prompts]
    assert sent == [f"Question: {p}\nAnswer:".encode() for p in prompts]
    assert [o["text"].encode() for o in pretrained["outputs"]] == [p.encode() for p in prompts]
    assert pretrained["settings"]["template"] == "{prompt}"


# ------------------------------------------------------------------------------------------- the tiny chain

def leaf_types(record: dict, key: str) -> dict:
    """The type name of each field of ``record[key]``."""
    return {k: type(v).__name__ for k, v in record[key].items()}


@pytest.mark.slow
def test_tiny_finetune_chain(finetune_run, tiny_run):
    cfg = load_config()
    ft = cfg["finetunes"][SFT]
    train = load(finetune_run, f"{SFT}/train.json")
    pre = load(tiny_run, "mpt-tiny/train.json")
    # the same fields as a pretraining run's train.json (seed 000's Table 1/2 columns), MFU included
    assert set(pre) <= set(train), set(pre) - set(train)
    assert train["kind"] == "finetune" and train["base"] == "results/mpt-tiny/hf" and train["lora"] is None
    assert train["steps"] == ft["train"]["max_duration_batches"] and train["devices"] == 1
    assert train["global_batch_size"] == ft["train"]["global_batch_size"] and train["concat_tokens"] == 128
    assert 0 < train["tokens"] <= train["steps"] * 16 * 128  # non-padding tokens of prompt + response
    assert train["tokens_per_s"] > 0 and "mfu" in train and train["mfu"] is None  # CPU: no peak FLOP/s
    assert train["flops_per_token"] == pre["flops_per_token"]  # same architecture, same sequence length
    assert os.path.getsize(finetune_run / train["final_checkpoint"]) == train["checkpoint_size_bytes"]
    # the loss on response tokens falls (per-batch values are noisy: compare the first and last logged ones)
    log = [json.loads(line) for line in (finetune_run / train["train_log"]).read_text().splitlines()]
    first, last = [r["loss"] for r in log[:4]], [r["loss"] for r in log[-4:]]
    assert sum(last) / 4 < sum(first) / 4 - 0.2, log

    hf = load(finetune_run, f"{SFT}/hf/manifest.json")
    assert hf["dtype"] == "bfloat16" and hf["verify_max_abs_logit_diff"] < 0.1
    assert hf["n_params"] == load(tiny_run, "mpt-tiny/hf/manifest.json")["n_params"]

    ev = load(finetune_run, f"{SFT}/eval.json")
    assert ev["kind"] == "finetune" and ev["val"]["split"] == "test" and ev["val"]["token_scope"] == "response"
    assert type(ev["val"]["tokens"]) is int and ev["val"]["tokens"] > 0  # a count, as in every run
    pre_ev = load(tiny_run, "mpt-tiny/eval.json")
    assert leaf_types(pre_ev, "val") == leaf_types(ev, "val")  # every held-out field has one type in every run
    assert {k: type(v) for k, v in pre_ev.items()} == {k: type(v) for k, v in ev.items()}
    assert 0 < ev["val"]["loss"] < math.log(cfg["tokenizers"]["bpe-builtin-docs"]["vocab_size"])
    assert math.isclose(ev["val"]["perplexity"], math.exp(ev["val"]["loss"]), rel_tol=1e-3)
    assert 0 < ev["val"]["token_accuracy"] < 1
    assert set(ev["icl"]) == {t["label"] for t in cfg["eval"]["icl_tasks"]}
    assert all(0 <= v <= 1 for task in ev["icl"].values() for v in task.values())

    gen = load(finetune_run, f"{SFT}/generate.json")
    assert [o["prompt"] for o in gen["outputs"]] == cfg["generate"]["prompts"]
    assert all(o["new_tokens"] > 0 for o in gen["outputs"])
    check_generation_template(cfg, SFT, gen, load(tiny_run, "mpt-tiny/generate.json"))
    # the export's tokenizer with transformers' usual calls (tests/test_export.py)
    usual_calls(finetune_run / "results" / SFT / "hf", finetune_run / "results/tokenizers/bpe-builtin-docs")

    inst = load(finetune_run, "data/instructions/python-docs-qa/manifest.json")
    assert inst["splits"]["train"]["rows"] > 500 and inst["splits"]["test"]["rows"] > 50


@pytest.mark.slow
@pytest.mark.parametrize("change,expected", [
    ([], {}),
    (["finetunes={'mpt-tiny-sft': {'train': {'microbatch_size': 8, 'num_workers': 1, 'save_interval_batches': 20, "
      "'log_interval_batches': 10}, 'data': {'allow_pad_trimming': True}, 'resources': {'cpus_per_task': 1}}}"], {}),
    (["models={'mpt-tiny': {'train': {'microbatch_size': 8, 'attn_impl': 'torch'}}}"], {}),
    (["finetunes={'mpt-tiny-sft': {'train': {'optimizer': {'lr': 1.0e-4}}}}"], AFTER_FINETUNE),
    (["finetunes={'mpt-tiny-sft': {'train': {'max_duration_batches': 30}}}"], AFTER_FINETUNE),
    (["instruction_sets={'python-docs-qa': {'max_items': 500}}"], {"instructions": 1} | AFTER_FINETUNE),
    (["models={'mpt-tiny': {'train': {'max_duration_batches': 100}}}"],
     {"train": 1, "convert": 2, "finetune": 1, "generate": 1, "finetune_eval": 1}),
    (["eval={'val_batches': 3}"], {"finetune_eval": 1}),
], ids=["nothing", "speed-only", "base-speed-only", "optimizer", "steps", "data", "base-retrained", "eval-only"])
def test_finetune_rerun_scope(finetune_run, tmp_path, change, expected):
    wd = copy_run(finetune_run, tmp_path / "wd")
    args = ["--config", *change] if change else []
    assert planned_jobs(snakemake(wd, "-n", *SFT_TARGETS, *args)) == expected


# ------------------------------------------------------------------------------------------- 7B / 30B: dry runs

LORA_30B = {"r": 16, "target_modules": ["Wqkv", "out_proj"]}  # MPT-30B-Instruct with LoRA (not in the config)


@pytest.mark.parametrize("run,nodes,extra", [("mpt-7b-dolly", 1, None), ("mpt-7b-dolly-lora", 1, None),
                                             ("mpt-30b-instruct", 8, None), ("mpt-30b-instruct", 8, LORA_30B)],
                         ids=["7b", "7b-lora", "30b", "30b-lora"])
def test_dry_run_plans_hub_finetune_with_resources(workdir, run, nodes, extra):
    """The 7B and 30B finetunes, full and LoRA, plan their jobs with their resources, memory and time, without
    importing torch."""
    from llmpipe.config import runs as cfg
    from llmpipe.plan import memory_time as plan

    blocked = workdir / "blocked"
    blocked.mkdir()
    for name in ("torch", "transformers", "llmfoundry", "composer", "peft"):
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} must not be imported by a dry run')\n")
    proc = snakemake(workdir, "-n", f"results/{run}/eval.json", f"results/{run}/generate.json", "--config",
                     "gpu_type=h200", *([f"finetunes={{'{run}': {{'lora': {extra!r}}}}}"] if extra else []),
                     env={"PYTHONPATH": os.pathsep.join([str(blocked), str(REPO)])})
    jobs = planned_jobs(proc)
    # hub weights: no pretraining, but the hub tokenizer, the instruction set and the ICL tasks (from C4) are there
    assert {k: jobs.get(k) for k in ("instructions", "tokenizer", "finetune", "convert", "generate",
                                     "finetune_eval")} == {k: 1 for k in ("instructions", "tokenizer", "finetune",
                                                                          "convert", "generate", "finetune_eval")}
    assert "train" not in jobs and "mds" not in jobs and "eval" not in jobs, jobs
    out = proc.stdout
    block = out[out.index("rule finetune:"):]
    block = block[: block.index("\n\n")] if "\n\n" in block else block
    assert f"nodes={nodes}," in block and "gpus_per_node=8" in block and "runtime=1440" in block, block
    # the memory and time plan of the finetune (llmpipe.plan.memory_time), as for pretraining; LoRA: adapters trained only
    out = proc.stdout + proc.stderr
    config = load_config()
    if extra:
        config = cfg.deep_merge(config, {"finetunes": {run: {"lora": extra}}})
    rc = cfg.run_config(config, run)
    mem = plan.train_memory(rc, nodes=nodes, gpus_per_node=8, capacity_gb=141)
    m = re.search(rf"plan train {run}: ([\d.]+) GiB per GPU of 141 GiB \(h200\) = states ([\d.]+) .*"
                  rf"FULL_SHARD over {nodes * 8} GPU\(s\) \({nodes} node\(s\) x 8\).*"
                  r"activation checkpointing (on|off) \(auto: [^)]*\)"
                  r"(, LoRA: ([\d,]+) trained)?.*; time ([\d.]+) (minutes|hours|days) \(projection: MFU", out)
    assert m, out[-3000:]
    # the shipped auto: the plan's own choice for 141 GiB GPUs (7B and 30B finetunes fit without recompute)
    assert m.group(3) == ("on" if mem["activation_checkpointing"] else "off") == "off"
    assert float(m.group(1)) == pytest.approx(mem["total_gb"], abs=0.05)
    assert float(m.group(2)) == pytest.approx(mem["states_gb"], abs=0.05)
    assert bool(m.group(4)) == bool(rc["lora"]) and (not rc["lora"] or int(m.group(5).replace(",", "")) ==
                                                      mem["trained_params"] < mem["params"] / 100)
    for step in ("eval", "generate"):
        assert re.search(rf"plan {step} {run}: [\d.]+ GiB per GPU", out), out[-3000:]


@pytest.mark.parametrize("run,gbs,bad_nodes", [("mpt-7b-dolly", 48, 4), ("mpt-30b-instruct", 72, 2)])
def test_dry_run_names_batch_not_divisible_at_some_node_count(workdir, run, gbs, bad_nodes):
    """The seed's batch sizes (48 for 7B, 72 for 30B) do not split over the GPUs of every node count of Table 2."""
    proc = snakemake(workdir, "-n", f"results/{run}/eval.json", "--config",
                     f"finetunes={{'{run}': {{'train': {{'global_batch_size': {gbs}}}}}}}", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    ws = bad_nodes * 8
    assert (f"finetunes.{run}.train.global_batch_size ({gbs}) is not divisible by the number of GPUs at "
            f"{bad_nodes} node(s) ({ws} = {bad_nodes} x 8 per node)") in out, out[-3000:]
    assert "Fix: make global_batch_size a multiple of 64" in out


def test_config_errors_of_finetunes():
    from llmpipe.config import runs as cfg
    from llmpipe.config.settings import ConfigError
    from llmpipe.steps.training import train_identity
    base = load_config()
    with pytest.raises(ConfigError, match="base must name exactly one of"):
        cfg.validate_run(cfg.deep_merge(base, {"finetunes": {SFT: {"base": {"hub": "mosaicml/mpt-7b"}}}}), SFT)
    with pytest.raises(ConfigError, match="base.run is 'mpt-9b'"):
        cfg.validate_run(cfg.deep_merge(base, {"finetunes": {SFT: {"base": {"run": "mpt-9b"}}}}), SFT)
    with pytest.raises(ConfigError, match=rf"^finetunes\.{SFT}\.data\.instructions is 'alpaca', which is not "
                                              r"defined under `instruction_sets:`"):
        cfg.validate_run(cfg.deep_merge(base, {"finetunes": {SFT: {"data": {"instructions": "alpaca"}}}}), SFT)
    with pytest.raises(ConfigError, match=r"^finetune_defaults\.data\.instructions is 'python-docs-q', "
                                              r".*did you mean python-docs-qa\?"):
        typo = cfg.deep_merge(base, {"finetune_defaults": {"data": {"instructions": "python-docs-q"}}})
        del typo["finetunes"][SFT]["data"]["instructions"]  # inherited from finetune_defaults
        cfg.validate_run(typo, SFT)
    with pytest.raises(ConfigError, match=r"max_seq_len \(4096\) is larger than the base"):
        cfg.validate_run(cfg.deep_merge(base, {"finetunes": {"mpt-7b-dolly": {"data": {"max_seq_len": 4096}}}}),
                         "mpt-7b-dolly")
    rc = cfg.validate_run(base, "mpt-7b-dolly")
    assert rc["data"]["tokenizer"] == "gpt-neox-20b" and rc["data"]["corpus"] == "c4" and rc["arch"]["d_model"] == 4096
    tiny = cfg.validate_run(base, SFT)
    assert tiny["arch"] == cfg.run_config(base, "mpt-tiny")["arch"] and tiny["data"]["tokenizer"] == "bpe-builtin-docs"
    # the base's training is part of the finetune's identity; its speed-only settings are not
    changed = cfg.deep_merge(base, {"models": {"mpt-tiny": {"arch": {"n_layers": 3}}}})
    assert train_identity(changed, SFT) != train_identity(base, SFT)
    speed = cfg.deep_merge(base, {"models": {"mpt-tiny": {"train": {"microbatch_size": 4}}}})
    assert train_identity(speed, SFT) == train_identity(base, SFT)
    assert cfg.step_resources(base, "eval", SFT)["gpus_per_node"] == 0
    assert cfg.step_resources(base, "train", "mpt-30b-instruct")["nodes"] == 8


# ------------------------------------------------------------------------------------------- 7B / 30B: data and config

def _standin_rows(n: int, with_source: bool) -> list[dict]:
    rows = []
    for i in range(n):
        r = {"prompt": f"Below is an instruction that describes a task. Write a response that appropriately "
                       f"completes the request.\n\n### Instruction:\nName the number {i} in words.\n\n### Response:\n",
             "response": f"The number is {i}, written as a word."}
        if with_source:
            r["source"] = "standin"
        rows.append(r)
    return rows


def _tokenizer(tmp_path, texts) -> str:
    from transformers import PreTrainedTokenizerFast

    from llmpipe.data.tokenizer import train_bpe
    core = train_bpe(iter(texts * 4), 320, "<|endoftext|>")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  unk_token="<|endoftext|>")
    d = tmp_path / "tokenizer"
    tok.save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("run,iset,with_source,fmt", [
    ("mpt-7b-dolly", "dolly_hhrlhf", False, "parquet"),      # mosaicml/dolly_hhrlhf: prompt, response
    ("mpt-30b-instruct", "instruct-v3", True, "jsonl"),      # instruct-v3: prompt, response, source
])
def test_hub_finetune_data_and_config_on_standin_rows(tmp_path, run, iset, with_source, fmt, monkeypatch):
    pytest.importorskip("llmfoundry")
    import torch
    from omegaconf import OmegaConf

    from llmpipe.config import runs as cfg
    from llmpipe.data.instructions import prepare_instructions, write_standin
    from llmpipe.train.finetune import build_dataloader, foundry_finetune_config, require_peft

    monkeypatch.chdir(tmp_path)  # llm-foundry writes signal files into the working folder
    monkeypatch.setenv("MAX_NUM_PROC", "1")
    standin = write_standin(str(tmp_path / "hub-layout"), {"train": _standin_rows(24, with_source),
                                                           "test": _standin_rows(4, with_source)}, fmt=fmt)
    config = cfg.deep_merge(load_config(), {"instruction_sets": {iset: {"source": "local", "local_dir": standin}}})
    config["results_dir"] = str(tmp_path / "results")
    rc, rs = cfg.validate_run(config, run), cfg.run_settings(config, run)
    out_dir = tmp_path / "results/data/instructions" / iset
    manifest = prepare_instructions(dict(config["instruction_sets"][iset], key=iset), str(out_dir))
    assert manifest["splits"]["train"]["rows"] == 24 and manifest["splits"]["test"]["rows"] == 4
    first = json.loads((out_dir / "data/train.jsonl").read_text().splitlines()[0])
    assert set(first) == {"prompt", "response"}  # instruct-v3's `source` column is dropped

    # the llm-foundry train config at the largest node count of the study, checked by llm-foundry's own dataclass
    ws = 8 * 8
    fcfg = foundry_finetune_config(rs, instructions_dir=str(out_dir), base_path=rc["base"]["hub"],
                                   save_folder=str(tmp_path / "ckpt"), world_size=ws, tokenizer_dir="tok")
    assert fcfg["model"]["name"] == "hf_causal_lm" and fcfg["model"]["pretrained_model_name_or_path"] == rc["base"]["hub"]
    assert fcfg["model"]["init_device"] == "mixed" and fcfg["fsdp_config"]["sync_module_states"] is True
    assert fcfg["global_train_batch_size"] == 64 and fcfg["max_seq_len"] == rc["data"]["max_seq_len"]
    assert fcfg["device_train_microbatch_size"] == min(rc["train"]["microbatch_size"], 64 // ws)
    assert fcfg["train_loader"]["name"] == "finetuning" and fcfg["train_loader"]["dataset"]["split"] == "train"
    assert fcfg["eval_loader"]["dataset"]["split"] == "test" and fcfg["eval_loader"]["drop_last"] is False
    assert fcfg["model"]["config_overrides"]["attn_config"]["attn_uses_sequence_id"] == (
        rc["data"].get("packing_ratio") is not None)
    assert "drop_full_attention_mask" not in fcfg["callbacks"] and "peft_config" not in fcfg["model"]
    from llmfoundry.command_utils.train import TRAIN_CONFIG_KEYS, TrainConfig
    from llmfoundry.utils.config_utils import make_dataclass_and_log_config
    _, train_cfg = make_dataclass_and_log_config(OmegaConf.create(fcfg), TrainConfig, TRAIN_CONFIG_KEYS,
                                                 transforms="all")
    assert train_cfg.model["pretrained_model_name_or_path"] == rc["base"]["hub"]
    require_peft(rs)  # no LoRA: nothing to check

    # llm-foundry's finetuning dataloader on the stand-in rows: one batch, prompt tokens masked out of the labels
    tok_dir = _tokenizer(tmp_path, [r["prompt"] + r["response"] for r in _standin_rows(12, False)])
    # read in this process: the run's loader workers, forked from the test process for one batch and left to the
    # garbage collector, cost seconds each on a loaded 2-core machine
    rs = cfg.run_settings(cfg.deep_merge(config, {"finetunes": {run: {"train": {"num_workers": 0}}}}), run)
    spec = build_dataloader(rs, str(out_dir), "train", tok_dir, device_batch_size=2)
    batch = next(iter(spec.dataloader))
    seq = rc["data"]["max_seq_len"]
    assert batch["input_ids"].shape == (2, seq) and batch["labels"].shape == (2, seq)
    labels = batch["labels"][0]
    target = labels[labels != -100]
    assert 0 < target.numel() < int(batch["attention_mask"][0].sum())  # only the response is a target
    if rc["data"].get("packing_ratio"):
        assert int(batch["sequence_id"].max()) >= 1  # several examples packed into one sequence
    assert torch.all(batch["attention_mask"].sum(1) > 0)
    held = build_dataloader(rs, str(out_dir), "test", tok_dir, device_batch_size=2)
    assert next(iter(held.dataloader))["input_ids"].shape[1] == seq


def test_lora_config_and_peft_requirement():
    from llmpipe.config import runs as cfg
    from llmpipe.train.finetune import foundry_finetune_config, require_peft

    config = load_config()
    pytest.importorskip("llmfoundry")
    rc = cfg.run_settings(config, "mpt-7b-dolly-lora")
    fcfg = foundry_finetune_config(rc, instructions_dir=None, base_path="mosaicml/mpt-7b", save_folder=None,
                                   world_size=8)
    peft_cfg = fcfg["model"]["peft_config"]
    assert peft_cfg == {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
                        "target_modules": ["Wqkv"]}
    assert fcfg["model"]["should_save_peft_only"] is True  # checkpoints of the adapters only
    require_peft(rc)  # peft is installed (envs/requirements.lock); tests/test_lora.py: the message without it


@pytest.mark.slow
def test_builtin_instructions_are_deterministic(finetune_run):
    """Built in this process, the builtin instruction set is byte for byte what the finetune run's job wrote in
    another process (another hash seed): the manifest's sha256 of each split's JSON lines."""
    import hashlib

    from llmpipe.data.instructions import builtin_instructions

    iset = project_config()["instruction_sets"]["python-docs-qa"]
    a = builtin_instructions(iset["max_items"], iset["eval_percent"])
    written = load(finetune_run, "data/instructions/python-docs-qa/manifest.json")["sha256"]
    assert {split: hashlib.sha256("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()).hexdigest()
            for split, rows in a.items()} == written
    assert 0 < len(a["train"]) + len(a["test"]) <= iset["max_items"] and a["test"]
    keys = {r["prompt"] for r in a["train"]}
    assert not keys & {r["prompt"] for r in a["test"]}  # disjoint splits
    r = a["train"][0]
    assert r["prompt"].startswith("Question: What does ") and r["prompt"].endswith("do?\nAnswer:")
    assert r["response"].startswith(" ") and r["response"].endswith(".")
