"""LoRA finetunes (llmpipe.train.lora): the tiny LoRA finetune end to end (train, merged export, evaluation), the adapted
modules and their size against peft's own, the merge against the adapter-applied model, the settings as identity,
bad target modules stopping the dry run, and the memory and time plans of the 7B/30B LoRA finetunes."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil

import pytest

from llmpipe.config import runs as cfg
from llmpipe.config.settings import ConfigError
from llmpipe.model.mfu import mpt_param_count
from llmpipe.plan import memory_time as plan
from llmpipe.train.lora import adapter_param_count, lora_settings, merge_adapters, mpt_linear_modules, target_matches
from tests.conftest import project_config, snakemake
from tests.test_export import usual_calls
from tests.test_finetune import check_generation_template

LORA = "mpt-tiny-sft-lora"
GIB = 2**30


def _with(config: dict, run: str, lora: dict) -> dict:
    return cfg.deep_merge(config, {"finetunes": {run: {"lora": lora}}})


# ------------------------------------------------------------------------------------------- the tiny chain

@pytest.mark.slow
def test_tiny_lora_finetune_chain(finetune_run, tiny_run):
    import torch
    from transformers import AutoModelForCausalLM

    config = project_config()
    ft = config["finetunes"][LORA]
    rc = cfg.run_config(config, LORA)
    res = finetune_run / "results"
    train = json.loads((res / LORA / "train.json").read_text())
    assert train["kind"] == "finetune" and train["base"] == "results/mpt-tiny/hf"
    assert train["lora"] == lora_settings(ft["lora"]) and train["steps"] == ft["train"]["max_duration_batches"]
    log = [json.loads(line) for line in (finetune_run / train["train_log"]).read_text().splitlines()]
    first, last = [r["loss"] for r in log[:4]], [r["loss"] for r in log[-4:]]
    assert sum(last) / 4 < sum(first) / 4 - 0.2, log  # the adapters learn the response tokens

    # only the adapters trained: the optimizer holds state for them alone, and the checkpoint holds them alone
    ckpt_path = finetune_run / train["final_checkpoint"]
    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)["state"]
    (opt,) = state["optimizers"].values()
    n_adapter = adapter_param_count(rc["arch"], ft["lora"])
    assert opt["state"] and all(".lora_A." in k or ".lora_B." in k for k in opt["state"]), list(opt["state"])[:5]
    assert sum(s["exp_avg"].numel() for s in opt["state"].values()) == n_adapter
    adapters = state["model"]
    assert adapters and all(".lora_A.default." in k or ".lora_B.default." in k for k in adapters), list(adapters)[:5]
    assert sum(t.numel() for t in adapters.values()) == n_adapter
    n_params = mpt_param_count(rc["arch"])["total"]
    size = train["checkpoint_size_bytes"]
    assert size == ckpt_path.stat().st_size and plan.checkpoint_bytes(rc) == 12 * n_adapter
    # beside the adapters' 12 bytes each, composer's own state (the tokenizer, RNG, loader): far below the fp32
    # frozen base alone, which LoRA checkpoints held before
    assert 12 * n_adapter < size < 2 * n_params, (size, n_adapter, n_params)

    # conversion: merged weights, a plain MPT folder of the base's size, the merge checked against the adapters
    man = json.loads((res / LORA / "hf/manifest.json").read_text())
    assert man["n_params"] == json.loads((res / "mpt-tiny/hf/manifest.json").read_text())["n_params"] == n_params
    lora = man["lora"]
    assert lora["base_weights"] == str(res / "mpt-tiny/hf")  # read from the base export, not the checkpoint
    assert lora["adapter_params"] == n_adapter and lora["adapted_modules"] == 4 * rc["arch"]["n_layers"]
    assert lora["merge_max_abs_logit_diff"] < 1e-4 * lora["max_abs_logit"]
    assert lora["adapter_max_abs_logit_delta"] > 0.5
    assert man["verify_max_abs_logit_diff"] < 0.1
    merged = AutoModelForCausalLM.from_pretrained(res / LORA / "hf", trust_remote_code=True,
                                                  torch_dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())

    # independently of the conversion code: peft's merge of the checkpoint's adapters into the base export
    adapter_cfg = state["integrations"]["huggingface"]["model"]["peft_config"]["content"]
    base, independent = _independent_merge(res / "mpt-tiny/hf", adapters, adapter_cfg)
    ids = torch.randint(0, rc["arch"]["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = merged(input_ids=ids).logits
        want = independent(input_ids=ids).logits
        before = base(input_ids=ids).logits
    merge_err = float((got - want).abs().max())
    assert merge_err < 0.1, merge_err  # the bf16 rounding of the merged weights, as the export's own verification
    assert float((got - before).abs().max()) > 5 * merge_err  # the merged model is not the base
    # in fp32, what conversion builds (before its bf16 export) is peft's merge
    from llmpipe.train.finetune import build_finetuned_mpt
    converted = build_finetuned_mpt(str(ckpt_path), base_path=str(res / "mpt-tiny/hf"))
    with torch.no_grad():
        assert float((converted(input_ids=ids).logits - want).abs().max()) < 1e-5

    # generation in the instruction format it trained on; the export's tokenizer with the usual calls
    check_generation_template(config, LORA, json.loads((res / LORA / "generate.json").read_text()),
                              json.loads((res / "mpt-tiny/generate.json").read_text()))
    usual_calls(res / LORA / "hf", res / "tokenizers/bpe-builtin-docs")

    ev = json.loads((res / LORA / "eval.json").read_text())
    assert ev["kind"] == "finetune" and ev["val"]["split"] == "test" and ev["val"]["token_scope"] == "response"
    assert type(ev["val"]["tokens"]) is int and ev["val"]["tokens"] > 0  # a count, as in every run
    assert 0 < ev["val"]["loss"] < math.log(rc["arch"]["vocab_size"])
    assert math.isclose(ev["val"]["perplexity"], math.exp(ev["val"]["loss"]), rel_tol=1e-3)
    assert set(ev["icl"]) == {t["label"] for t in config["eval"]["icl_tasks"]}


def _independent_merge(base_dir, adapters: dict, adapter_cfg: dict):
    """The base export (transformers' own loading of its folder, fp32) and, separately, peft's ``merge_and_unload`` of
    ``adapters`` (a checkpoint's ``state.model``: keys ``model.base_model.model....lora_*``) into another copy of it:
    a merge computed without the conversion code."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(base_dir, trust_remote_code=True, torch_dtype=torch.float32)
    applied = peft.get_peft_model(load(), peft.get_peft_config(adapter_cfg))
    missing, unexpected = applied.load_state_dict({k[len("model."):]: v for k, v in adapters.items()}, strict=False)
    assert not unexpected and not [k for k in missing if ".lora_" in k]
    return load().eval(), applied.merge_and_unload().eval()


# ------------------------------------------------------------------------------------------- modules and merge

def _tiny_mpt(arch: dict):
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
    kw = {k: v for k, v in arch.items() if k in ("d_model", "n_heads", "n_layers", "expansion_ratio", "max_seq_len",
                                                  "vocab_size", "attn_config", "ffn_config")}
    kw["attn_config"] = {"attn_impl": "torch", **(kw.get("attn_config") or {})}
    return MPTForCausalLM(MPTConfig(init_device="cpu", **kw))


ARCH = {"d_model": 32, "n_heads": 4, "n_layers": 2, "expansion_ratio": 4, "max_seq_len": 16, "vocab_size": 64}


@pytest.mark.parametrize("arch,targets", [
    (ARCH, ["Wqkv"]),
    (ARCH, ["Wqkv", "out_proj", "up_proj", "down_proj"]),
    (ARCH, ["attn.out_proj", "blocks.1.ffn.down_proj"]),
    ({**ARCH, "attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2}}, ["Wqkv", "up_proj"]),
    ({**ARCH, "attn_config": {"fused_qkv": False}}, ["Wq", "Wv"]),
    ({**ARCH, "ffn_config": {"ffn_type": "mptglu"}}, ["gate_proj", "down_proj"]),
], ids=["wqkv", "all-linear", "with-parents", "gqa", "unfused-qkv", "glu"])
def test_adapted_modules_and_size_match_peft(arch, targets):
    """The module table and adapter count that the dry run and the memory plan use agree with what peft builds."""
    import peft
    model = _tiny_mpt(arch)
    linear = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
              if type(m).__name__ == "Linear" and n.startswith("transformer.blocks.")}
    assert mpt_linear_modules(arch) == linear
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                         task_type="CAUSAL_LM"))
    adapted = {n[len("base_model.model."):] for n, m in wrapped.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {m for m in linear if any(target_matches(m, t) for t in targets)} and adapted
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert adapter_param_count(arch, {"r": 4, "target_modules": targets}) == trainable


def _trained_checkpoint(tmp_path, targets=("Wqkv", "up_proj"), r=4, alpha=8):
    """A composer-style state of a LoRA model whose adapters are non-zero (as after training), with the adapter
    config composer stores (adapter_config.json's content)."""
    import peft
    import torch
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(_tiny_mpt(ARCH), peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.1,
                                                                   target_modules=list(targets), task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in wrapped.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.5)
    wrapped.peft_config["default"].save_pretrained(str(tmp_path))
    adapter_cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    return wrapped.eval(), {f"model.{k}": v.clone() for k, v in wrapped.state_dict().items()}, adapter_cfg


def test_merge_adapters_reproduces_the_adapter_applied_model(tmp_path):
    import torch
    wrapped, state, adapter_cfg = _trained_checkpoint(tmp_path)
    report: dict = {}
    merged = merge_adapters(_tiny_mpt(ARCH), state, adapter_cfg, source="test", report=report)
    assert type(merged).__name__ == "MPTForCausalLM" and not any("lora" in n for n, _ in merged.named_parameters())
    pre = "model.base_model.model.transformer.blocks.0.attn.Wqkv"
    w, a, b = (state[f"{pre}.base_layer.weight"], state[f"{pre}.lora_A.default.weight"],
               state[f"{pre}.lora_B.default.weight"])
    assert torch.allclose(merged.transformer.blocks[0].attn.Wqkv.weight, w + (b @ a) * (8 / 4), atol=1e-6)
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = wrapped(input_ids=ids).logits
        with wrapped.disable_adapter():
            base = wrapped(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert float((got - base).abs().max()) > 0.1  # the adapters change the model
    assert report["merge_max_abs_logit_diff"] < 1e-5 and report["adapter_max_abs_logit_delta"] > 0.1
    assert report["adapter_params"] == adapter_param_count(ARCH, {"r": 4, "target_modules": ["Wqkv", "up_proj"]})
    assert report["adapted_modules"] == 4 and report["r"] == 4 and report["alpha"] == 8
    # a checkpoint of the adapters only (composer's should_save_peft_only) merged into the base weights the model
    # already holds (read from the finetune's base) gives the same model; without the base weights it is refused
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    base = _tiny_mpt(ARCH)
    base.load_state_dict({k[len("model.base_model.model."):].replace(".base_layer", ""): v
                          for k, v in state.items() if ".lora_" not in k})
    alone = merge_adapters(base, adapters, adapter_cfg, source="test", adapters_only=True)
    with torch.no_grad():
        assert torch.equal(alone(input_ids=ids).logits, got)
    with pytest.raises(KeyError, match=r"missing \['base_model.model.transformer.wte.weight"):
        merge_adapters(_tiny_mpt(ARCH), adapters, adapter_cfg, source="test")
    del adapters[f"{pre}.lora_B.default.weight"]
    with pytest.raises(KeyError, match=r"missing \['base_model.model.transformer.blocks.0.attn.Wqkv.lora_B"):
        merge_adapters(_tiny_mpt(ARCH), adapters, adapter_cfg, source="test", adapters_only=True)
    # weights that do not belong to the adapter config are refused, naming them
    del state[f"{pre}.lora_B.default.weight"]
    with pytest.raises(KeyError, match=r"missing \['base_model.model.transformer.blocks.0.attn.Wqkv.lora_B"):
        merge_adapters(_tiny_mpt(ARCH), state, adapter_cfg, source="test")


def test_full_finetune_weights_refuse_adapters():
    import torch

    from llmpipe.train.finetune import hf_weights
    assert list(hf_weights({"model.transformer.wte.weight": torch.ones(3, 4)})) == ["transformer.wte.weight"]
    with pytest.raises(KeyError, match="merge_adapters"):
        hf_weights({"model.base_model.model.transformer.blocks.0.attn.Wqkv.lora_A.default.weight": torch.ones(2, 4)})


# ------------------------------------------------------------------------------------------- settings

def test_lora_settings_are_the_finetune_identity():
    from llmpipe.steps.training import train_identity
    config = project_config()
    base = train_identity(config, LORA)
    lora = config["finetunes"][LORA]["lora"]
    for change in ({"r": 4}, {"alpha": 8}, {"dropout": 0.0}, {"target_modules": ["Wqkv"]}):
        assert train_identity(_with(config, LORA, change), LORA) != base, change
    same = copy.deepcopy(config)
    same["finetunes"][LORA]["lora"] = {**lora, "alpha": None, "target_modules": lora["target_modules"][::-1]}
    assert lora["alpha"] == 2 * lora["r"]  # null alpha means 2 x r
    assert train_identity(same, LORA) == base
    full = copy.deepcopy(config)
    full["finetunes"][LORA]["lora"] = None
    assert train_identity(full, LORA) != base


def test_foundry_peft_config():
    pytest.importorskip("llmfoundry")
    from llmpipe.train.finetune import foundry_finetune_config
    rc = cfg.run_settings(project_config(), LORA)
    fcfg = foundry_finetune_config(rc, instructions_dir=None, base_path="results/mpt-tiny/hf", save_folder=None,
                                   world_size=1)
    model = fcfg["model"]
    assert model["peft_config"] == {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16.0,
                                    "lora_dropout": 0.05,
                                    "target_modules": ["Wqkv", "down_proj", "out_proj", "up_proj"]}
    # the checkpoint holds the adapters only: a resume loads them over the base (not strictly), conversion merges them
    assert model["should_save_peft_only"] is True and fcfg["load_strict_model_weights"] is False
    full = foundry_finetune_config(cfg.run_settings(project_config(), "mpt-tiny-sft"), instructions_dir=None,
                                   base_path="results/mpt-tiny/hf", save_folder=None, world_size=1)
    assert "should_save_peft_only" not in full["model"] and "load_strict_model_weights" not in full


@pytest.mark.parametrize("target,why", [("q_proj", "matches no module"), ("norm_1", "is not a linear layer"),
                                        ("ffn.Wqkv", "matches no module")])
def test_bad_target_module_names_the_setting(target, why):
    config = _with(project_config(), LORA, {"target_modules": ["Wqkv", target]})
    with pytest.raises(ConfigError, match=rf"^finetunes\.{LORA}\.lora\.target_modules names '{target}', which "
                                              rf"{why} of the MPT model .*Fix: use the linear layers' names: "
                                              r"Wqkv, down_proj, out_proj, up_proj"):
        cfg.validate_run(config, LORA)


def test_dry_run_stops_on_a_bad_target_module(workdir):
    proc = snakemake(workdir, "-n", "results/mpt-7b-dolly-lora/eval.json", "--config",
                     "finetunes={'mpt-7b-dolly-lora': {'lora': {'target_modules': ['q_proj', 'v_proj']}}}",
                     check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rule finetune:" not in proc.stdout
    assert "finetunes.mpt-7b-dolly-lora.lora.target_modules names 'q_proj', which matches no module" in out, out[-2000:]


def test_missing_peft_is_named(monkeypatch):
    import importlib.util

    from llmpipe.train.finetune import require_peft
    rc = cfg.run_settings(project_config(), LORA)
    require_peft(rc)  # installed here (envs/requirements.lock)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ConfigError, match=rf"finetunes\.{LORA}\.lora is set, but the `peft` package is not "
                                              r"installed.*pip install peft"):
        require_peft(rc)
    require_peft(dataclasses.replace(rc, lora=None))  # full finetuning needs no peft


# ------------------------------------------------------------------------------------------- plans

@pytest.mark.parametrize("run,lora,nodes,adapters", [
    ("mpt-7b-dolly", {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["Wqkv"]}, 1,
     32 * 8 * (4096 + 3 * 4096)),                                        # 32 layers, Wqkv 4096 -> 3 x 4096
    ("mpt-30b-instruct", {"r": 16, "target_modules": ["Wqkv", "out_proj"]}, 8,
     48 * 16 * ((7168 + 3 * 7168) + (7168 + 7168))),
])
def test_lora_memory_and_time_plans(run, lora, nodes, adapters):
    """A LoRA finetune's plan keeps fp32 weights of the whole model but gradients and Adam moments of the adapters
    only, its checkpoints hold the adapters only, and its time plan drops the frozen base's weight gradients."""
    config = project_config()
    full_rc = cfg.run_config(config, run)
    lora_rc = cfg.run_config(_with(config, run, lora), run)
    full = plan.train_memory(full_rc, nodes=nodes, gpus_per_node=8)
    mem = plan.train_memory(lora_rc, nodes=nodes, gpus_per_node=8)
    p, ws = full["params"], 8 * nodes
    assert mem["trained_params"] == adapters and full["trained_params"] == p and mem["lora"] and not full["lora"]
    assert full["states_gb"] == pytest.approx(16 * p / ws / GIB)
    assert mem["states_gb"] == pytest.approx((4 * (p + adapters) + 12 * adapters) / ws / GIB)
    assert mem["activations_gb"] == full["activations_gb"] and mem["logits_gb"] == full["logits_gb"]
    # a checkpoint holds fp32 weights and two Adam moments of what trains: the LoRA one the adapters only
    assert plan.checkpoint_bytes(lora_rc) == 12 * adapters and plan.checkpoint_bytes(full_rc) == 12 * p
    basis = plan.benchmark_basis()
    kw = dict(nodes=nodes, gpus_per_node=8, gpu_type="h100", basis=basis, activation_checkpointing=True)
    t_full, t_lora = plan.train_time(full_rc, **kw), plan.train_time(lora_rc, **kw)
    a = full_rc["arch"]
    attention = 12 * a["n_layers"] * a["d_model"] * full_rc["data"]["concat_tokens"]
    six_p = t_full["flops_per_token"] - attention
    # with recompute: 8 P + 4/3 attention in full, 6 P + 4/3 attention with LoRA (FLOPs per token)
    assert t_lora["seconds"] / t_full["seconds"] == pytest.approx(
        (six_p + attention * 4 / 3) / (six_p * 8 / 6 + attention * 4 / 3))
    assert "LoRA: x 0." in t_lora["basis"] and "LoRA" not in t_full["basis"]
    t_saved = plan.train_time(lora_rc, **kw, overheads=plan.job_overheads())
    assert f"save(s) of {12 * adapters / GIB:.3g} GiB (LoRA: the adapters only) x" in t_saved["basis"]
    line = plan.plan_line("train", run, mem, 80, "h100", t_lora)
    assert f"LoRA: {adapters:,} trained of {p:,} parameters" in line


# ------------------------------------------------------------------------------------------- kill, resume, convert

@pytest.mark.slow
def test_lora_finetune_killed_after_its_first_checkpoint_resumes_and_converts(finetune_run, tmp_path):
    """The tiny LoRA finetune, killed after its first checkpoint (batch 30 of 60), resumes: the base is read again
    from its export, the adapters from the checkpoint of the adapters only; it ends at the step count, and conversion
    merges the final checkpoint's adapters into the base export as peft's own merge does (fp32 logits).
    (Under FSDP a LoRA resume fails in torch's FSDP whatever the checkpoint holds: docs/finetuning.md.)"""
    import torch

    from llmpipe.train import checkpoints as ckpt
    from llmpipe.train.finetune import build_finetuned_mpt
    from tests.conftest import copy_run, no_symlink_env

    wd = copy_run(finetune_run, tmp_path / "wd")
    run_dir = wd / "results" / LORA
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "train.json").unlink()
    env = {**no_symlink_env(wd), "LLMPIPE_TEST_KILL_AT": str(run_dir / "checkpoints/*/ep0-ba30-rank0.pt.complete")}
    proc = snakemake(wd, "--cores", "2", f"results/{LORA}/train.json", env=env, check=False)
    assert proc.returncode != 0, proc.stdout[-3000:]
    (first,) = run_dir.glob("checkpoints/*/ep0-ba30-rank0.pt")
    rc = cfg.run_config(project_config(), LORA)
    n_adapter = adapter_param_count(rc["arch"], rc["lora"])
    names = ckpt.model_weight_names(str(first))
    assert names and all(".lora_A.default." in k or ".lora_B.default." in k for k in names), list(names)[:5]
    assert sum(math.prod(shape) for shape, _ in names.values()) == n_adapter

    snakemake(wd, "--cores", "2", f"results/{LORA}/train.json", f"results/{LORA}/hf/manifest.json",
              env=no_symlink_env(wd))
    train = json.loads((run_dir / "train.json").read_text())
    assert train["steps"] == 60 and train["resumed_from"].endswith("ep0-ba30-rank0.pt")
    assert train["batches_this_job"] == 30
    final = wd / train["final_checkpoint"]
    assert set(ckpt.model_weight_names(str(final))) == set(names)
    man = json.loads((run_dir / "hf/manifest.json").read_text())
    assert man["lora"]["base_weights"] == str(wd / "results/mpt-tiny/hf")

    state = torch.load(final, map_location="cpu", weights_only=False)["state"]
    adapter_cfg = state["integrations"]["huggingface"]["model"]["peft_config"]["content"]
    base, independent = _independent_merge(wd / "results/mpt-tiny/hf", state["model"], adapter_cfg)
    converted = build_finetuned_mpt(str(final), base_path=str(wd / "results/mpt-tiny/hf"))
    ids = torch.randint(0, rc["arch"]["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = independent(input_ids=ids).logits
        assert float((converted(input_ids=ids).logits - want).abs().max()) < 1e-5
        assert float((base(input_ids=ids).logits - want).abs().max()) > 0.1  # the adapters changed the model
