"""The Hugging Face export as others use it: file modes from the umask, tied embeddings stated in config.json, and
generation that answers every prompt whatever its length. A randomly initialised mpt-tiny (no training) keeps these
fast; tests/test_convert.py checks the trained model's logits."""

from __future__ import annotations

import json
import os
import stat
import types
from pathlib import Path

import pytest

from llmpipe.config.runs import run_settings
from tests.conftest import project_config

#: Prompts that fit mpt-tiny's context (128 tokens) with room for the new tokens.
SHORT = ["The answer to life is", "Python is a programming language that"]
#: About 400 tokens: longer than the context.
LONG = "The documentation of the standard library describes every module in turn. " * 30


def tiny_tokenizer(folder: Path) -> str:
    """A byte-level BPE tokenizer folder (AutoTokenizer.from_pretrained loads it)."""
    from transformers import PreTrainedTokenizerFast

    from llmpipe.data.tokenizer import train_bpe

    texts = [LONG, *SHORT, "Modules, functions and classes are documented with examples."] * 20
    core = train_bpe(iter(texts), 300, "<|endoftext|>")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  unk_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    tok.save_pretrained(folder)
    return str(folder)


def random_checkpoint(rc: dict, path: Path) -> str:
    """A composer-style checkpoint (``state.model`` with ``model.`` prefixes) of a randomly initialised model."""
    import torch
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    from llmpipe.hf.export import mpt_config_dict
    from llmpipe.train.pretrain import register_extensions

    register_extensions()
    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(**mpt_config_dict(rc)))
    torch.save({"state": {"model": {f"model.{k}": v for k, v in model.state_dict().items()}}}, path)
    return str(path)


def export(tmp: Path, umask: int) -> Path:
    """Convert a random mpt-tiny checkpoint under ``umask``; return the export folder."""
    from llmpipe.hf.export import convert_checkpoint
    from llmpipe.config.stage_settings import ConvertSettings

    rc = run_settings(project_config(), "mpt-tiny")
    out = tmp / "hf"
    old = os.umask(umask)
    try:
        export = ConvertSettings.from_section({**project_config()["convert"], "dtype": "float32"})
        convert_checkpoint(rc, random_checkpoint(rc, tmp / "ckpt.pt"), tiny_tokenizer(tmp / "tok"), str(out), export,
                           verify=False)
    finally:
        os.umask(old)
    return out


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("export"), 0o027)


def test_every_exported_file_gets_the_mode_the_umask_gives(tiny_export):
    """safetensors writes the weights 0600 whatever the umask; every file must be as readable as the tokenizer's."""
    files = [p for p in tiny_export.rglob("*") if p.is_file()]
    assert {"model.safetensors", "config.json", "tokenizer.json", "manifest.json"} <= {p.name for p in files}
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in files}
    assert set(modes.values()) == {0o640}, modes
    assert stat.S_IMODE(tiny_export.stat().st_mode) == 0o750


def test_export_states_tied_embeddings_and_transformers_loads_them_tied(tiny_export):
    """config.json says tie_word_embeddings: true (save_pretrained drops it, being PretrainedConfig's default), the
    weights hold no lm_head tensor, and the loaded model's output layer is its input embedding."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    assert json.loads((tiny_export / "config.json").read_text())["tie_word_embeddings"] is True
    assert not [k for k in load_file(str(tiny_export / "model.safetensors")) if "lm_head" in k]
    assert AutoConfig.from_pretrained(tiny_export, trust_remote_code=True).tie_word_embeddings is True
    model = AutoModelForCausalLM.from_pretrained(tiny_export, trust_remote_code=True, torch_dtype=torch.float32)
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert out is None or out.weight.data_ptr() == emb.weight.data_ptr()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        hidden = model.transformer(input_ids=ids).last_hidden_state
        assert torch.allclose(model(input_ids=ids).logits, hidden @ emb.weight.T, atol=1e-5)


def test_use_sdpa_switches_an_export_loaded_with_its_own_code(tiny_export):
    """An export loaded with trust_remote_code runs its own copy of llm-foundry's attention classes; use_sdpa switches
    every block of it, and the logits stay those of the torch path."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmpipe.model.attention import sdpa_attention, use_sdpa

    model = AutoModelForCausalLM.from_pretrained(tiny_export, trust_remote_code=True, torch_dtype=torch.float32).eval()
    blocks = model.transformer.blocks
    assert not type(blocks[0].attn).__module__.startswith("llmfoundry"), type(blocks[0].attn)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert use_sdpa(model) == len(blocks)
        assert all(b.attn.attn_fn is sdpa_attention for b in blocks)
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-5, rtol=1e-4)


def settings(**over) -> dict:
    return {"prompts": [SHORT[0], LONG, SHORT[1]], "max_new_tokens": 8, "do_sample": False, "seed": 17, **over}


def typed(**over):
    """:func:`settings` over the shipped ``generate:`` section, typed as the generation job takes it (no template:
    the prompt alone, as a pretraining run generates)."""
    from llmpipe.config.stage_settings import GenerateSettings

    return GenerateSettings.from_section({**project_config()["generate"], "template": "{prompt}", **settings(**over)})


def test_a_prompt_longer_than_the_context_is_truncated_from_the_left(tiny_export):
    """The long prompt keeps its last tokens and leaves room for max_new_tokens; the short prompts' completions are
    those they get alone."""
    from llmpipe.evaluation.generation import generate

    got = generate(str(tiny_export), typed())
    assert got["context_tokens"] == 128 and [o["prompt"] for o in got["outputs"]] == [SHORT[0], LONG, SHORT[1]]
    long = got["outputs"][1]
    assert long["prompt_tokens"] > 128 and long["prompt_truncated"] is True
    assert long["prompt_tokens_kept"] == 128 - 8 and 1 <= long["new_tokens"] <= 8
    alone = generate(str(tiny_export), typed(prompts=SHORT))["outputs"]
    for o, a in zip([got["outputs"][0], got["outputs"][2]], alone):
        assert o["prompt_truncated"] is False and o["prompt_tokens_kept"] == o["prompt_tokens"]
        assert o["completion"] == a["completion"] and o["new_tokens"] == a["new_tokens"]


def test_new_tokens_beyond_the_context_keep_half_the_context_for_the_prompt():
    from llmpipe.evaluation.generation import prompt_budget

    assert prompt_budget(12, 128, 256) == (12, 116)  # mpt-tiny's defaults: the prompt whole, 116 new tokens
    assert prompt_budget(400, 128, 256) == (64, 64)
    assert prompt_budget(2000, 2048, 256) == (1792, 256)
    assert prompt_budget(1000, 2048, 256) == (1000, 256)


def step_context(export: Path, tmp_path: Path, generate: dict, run: str = "mpt-tiny"):
    """A rule ``generate`` context for ``run`` on ``export`` with the shipped config and ``generate`` over its
    ``generate:`` section, the job run in this process; returns ``(ctx, generate.json path)``."""
    from llmpipe.config.runs import deep_merge

    out = tmp_path / run / "generate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    ctx = types.SimpleNamespace(
        wildcards=types.SimpleNamespace(run=run), input=[str(export / "manifest.json")], output=[str(out)],
        config=deep_merge(project_config(), {"generate": generate}), resources={"gpus_per_node": 0},
        log=print, dispatch=lambda fn, *args, step, **kwargs: fn(*args, **kwargs),
        write_json=lambda obj, path=None: Path(path or out).write_text(json.dumps(obj)))
    return ctx, out


def test_strict_mode_fails_naming_the_prompt_and_keeps_the_other_completions(tiny_export, tmp_path):
    """generate.long_prompts: fail: the step fails naming the prompt and the context length, generate.json is not
    written, and the other prompts' completions are in generate.partial.json."""
    from llmpipe.config.settings import ConfigError
    from llmpipe.steps import generate as step

    ctx, out = step_context(tiny_export, tmp_path, settings(long_prompts="fail"))
    with pytest.raises(ConfigError, match=r"generate\.prompts\[1\] \('The documentation.*has \d+ tokens; the model's "
                                          r"context is 128 tokens.*Fix: shorten the prompt, or set "
                                          r"generate\.long_prompts: truncate"):
        step.generate(ctx)
    assert not out.exists()
    partial = json.loads((out.parent / "generate.partial.json").read_text())
    assert [o["prompt"] for o in partial["outputs"] if "completion" in o] == SHORT
    ctx.config["generate"].update(settings(prompts=SHORT, long_prompts="fail"))
    step.generate(ctx)  # every prompt fits: generate.json, and the stale partial answers are gone
    assert out.exists() and not (out.parent / "generate.partial.json").exists()


def test_generation_through_the_placement_gives_the_tokens_of_a_plain_greedy_generate(tiny_export):
    """On a host without a GPU the placement (llmpipe.plan.inference_placement.generation_placement, the code that spreads
    a large model over a node's GPUs) puts every weight on the CPU, whatever GPU count the job asked for, and the
    answers are token for token those of the model loaded whole and generating greedily with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmpipe.evaluation.generation import generate
    from llmpipe.plan.inference_placement import generation_placement

    if torch.cuda.is_available():
        pytest.skip("checks the CPU placement")
    assert generation_placement(8) == {"device_map": {"": "cpu"}, "max_memory": None, "gpus": 0}
    got = generate(str(tiny_export), typed(prompts=SHORT, max_new_tokens=12), gpus=8)
    assert got["gpus"] == 0 and got["device"] == "cpu"
    tok = AutoTokenizer.from_pretrained(tiny_export)
    model = AutoModelForCausalLM.from_pretrained(tiny_export, trust_remote_code=True, torch_dtype=torch.float32)
    model.eval()
    for prompt, out in zip(SHORT, got["outputs"], strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        assert out["new_tokens"] == ref.numel() and out["completion"] == tok.decode(ref, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------- templates and errors

def test_each_prompt_is_sent_in_the_template_and_the_text_sent_is_recorded(tiny_export):
    """The model continues the template applied to the prompt, token for token what it does given that text bare;
    generate.json records the text; without a template the text is the prompt itself."""
    from llmpipe.data.instructions import BUILTIN_TEMPLATE, apply_template
    from llmpipe.evaluation.generation import generate

    got = generate(str(tiny_export), typed(prompts=SHORT, template=BUILTIN_TEMPLATE))
    texts = [apply_template(BUILTIN_TEMPLATE, p) for p in SHORT]
    assert [o["text"] for o in got["outputs"]] == texts == [f"Question: {p}\nAnswer:" for p in SHORT]
    assert [o["prompt"] for o in got["outputs"]] == SHORT and got["settings"]["template"] == BUILTIN_TEMPLATE
    bare = generate(str(tiny_export), typed(prompts=texts))
    assert [o["text"] for o in bare["outputs"]] == texts and bare["settings"]["template"] == "{prompt}"
    for o, b in zip(got["outputs"], bare["outputs"], strict=True):
        assert (o["completion"], o["new_tokens"], o["prompt_tokens"]) == (b["completion"], b["new_tokens"],
                                                                          b["prompt_tokens"])
    braces = generate(str(tiny_export), typed(prompts=SHORT[:1], template='{"q": "{prompt}"} =>'))
    assert braces["outputs"][0]["text"] == '{"q": "' + SHORT[0] + '"} =>'  # other braces are literal text


def test_a_prompt_that_fails_is_recorded_for_it_and_the_others_are_answered(tiny_export, tmp_path, monkeypatch):
    """Prompts the dry run would refuse ("", not text) reach generation when the function is called directly, and a
    prompt can fail while generating: each is recorded with its error in generate.partial.json, the others get their
    completions, and the step fails naming the prompt (ConfigError for a prompt, RuntimeError for a raise)."""
    import transformers

    from llmpipe.config.settings import ConfigError
    from llmpipe.steps import generate as step

    ctx, out = step_context(tiny_export, tmp_path, settings(prompts=[SHORT[0], "", 3, SHORT[1]]))
    with pytest.raises(ConfigError, match=r"generate\.prompts\[1\] \(''\) has no tokens.*Fix: write the prompt's "
                                          r"text\.\ngenerate\.prompts\[2\] is 3, not text\. Fix:.*\nThe other "
                                          r"prompts' completions \(2 of 4\)"):
        step.generate(ctx)
    partial = json.loads((out.parent / "generate.partial.json").read_text())["outputs"]
    assert not out.exists() and [("completion" in o, "error" in o) for o in partial] == [
        (True, False), (False, True), (False, True), (True, False)]

    real = transformers.GenerationMixin.generate
    calls = []

    def generate_failing_on_the_second_call(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", generate_failing_on_the_second_call)
    ctx.config["generate"]["prompts"] = [SHORT[0], "Modules, functions", SHORT[1]]
    with pytest.raises(RuntimeError, match=r"^generate\.prompts\[1\] \('Modules, functions'\): generation failed: "
                                           r"RuntimeError: CUDA out of memory \(simulated\)\nThe other prompts' "
                                           r"completions \(2 of 3\)"):
        step.generate(ctx)
    partial = json.loads((out.parent / "generate.partial.json").read_text())["outputs"]
    assert partial[1]["exception"] == "RuntimeError" and partial[1]["text"] == "Modules, functions"
    monkeypatch.undo()
    ctx.config["generate"]["prompts"] = SHORT
    step.generate(ctx)  # the same prompts answered alone give the completions recorded beside the failed ones
    final = json.loads(out.read_text())["outputs"]
    assert [o["completion"] for o in final] == [partial[0]["completion"], partial[2]["completion"]]
    assert not (out.parent / "generate.partial.json").exists()


def test_each_run_generates_with_its_own_prompts_and_template():
    """Pretraining runs send the prompt alone, finetunes their instruction set's format (the template the builtin
    set's training prompts are built with); a run's own generate: section, then the global template, win; the
    template is part of generation's identity."""
    from llmpipe.config.runs import deep_merge
    from llmpipe.data.instructions import BUILTIN_TEMPLATE, builtin_instructions
    from llmpipe.steps.generate import generate_identity, generate_settings, run_generate_settings

    config = project_config()
    shipped = config["generate"]["prompts"]
    assert config["generate"]["template"] is None  # the schema's default: each run's own
    got = {run: generate_settings(config, run) for run in ("mpt-tiny", "mpt-tiny-sft", "mpt-tiny-sft-lora",
                                                           "mpt-7b-dolly")}
    assert {run: (g["template"], g["template_at"], g["prompts"]) for run, g in got.items()} == {
        "mpt-tiny": ("{prompt}", None, shipped),
        "mpt-tiny-sft": (BUILTIN_TEMPLATE, "instruction_sets.python-docs-qa", shipped),
        "mpt-tiny-sft-lora": (BUILTIN_TEMPLATE, "instruction_sets.python-docs-qa", shipped),
        "mpt-7b-dolly": ("{prompt}", "instruction_sets.dolly_hhrlhf", shipped)}  # its prompts hold their format
    typed = run_generate_settings(config, "mpt-tiny-sft")  # what the job takes: the same values, typed
    assert (typed.template, typed.template_at, list(typed.prompts)) == (
        BUILTIN_TEMPLATE, "instruction_sets.python-docs-qa", shipped)
    row = builtin_instructions(50)["train"][0]  # the training prompts: the same template around the question
    question = row["prompt"][len("Question: "):-len("\nAnswer:")]
    assert row["prompt"] == BUILTIN_TEMPLATE.replace("{prompt}", question)

    own = deep_merge(config, {"finetunes": {"mpt-tiny-sft": {"generate": {"prompts": ["What does json.dumps do?"]}}},
                              "models": {"mpt-tiny": {"generate": {"template": "Q: {prompt}\nA:"}}}})
    sft, tiny = generate_settings(own, "mpt-tiny-sft"), generate_settings(own, "mpt-tiny")
    assert (sft["prompts"], sft["prompts_at"], sft["template"]) == (
        ["What does json.dumps do?"], "finetunes.mpt-tiny-sft.generate.prompts", BUILTIN_TEMPLATE)
    assert (tiny["prompts"], tiny["template"], tiny["template_at"]) == (
        shipped, "Q: {prompt}\nA:", "models.mpt-tiny.generate.template")
    every = deep_merge(config, {"generate": {"template": "{prompt}"}})
    assert generate_settings(every, "mpt-tiny-sft")["template"] == "{prompt}"  # set for every run: finetunes too
    defaults = deep_merge(config, {"finetune_defaults": {"generate": {"template": "### {prompt}"}}})
    assert generate_settings(defaults, "mpt-tiny-sft-lora")["template_at"] == "finetune_defaults.generate.template"
    assert generate_identity(every, "mpt-tiny-sft") != generate_identity(config, "mpt-tiny-sft")
    assert generate_identity(every, "mpt-tiny") == generate_identity(config, "mpt-tiny")  # the same text sent


# ------------------------------------------------------------------------------------------- the usual calls

#: The start of a script that uses an export with transformers alone: llm-foundry, composer and llmpipe unimportable.
WITHOUT_FOUNDRY = r"""
import builtins, json, sys
real_import = builtins.__import__
def guard(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.split('.')[0] in ('llmfoundry', 'composer', 'llmpipe'):
        raise ImportError(f'{name} must not be needed to use the export')
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = guard
"""

#: transformers' usual calls on an export (:data:`WITHOUT_FOUNDRY`); prints a JSON summary.
USUAL_CALLS = WITHOUT_FOUNDRY + r"""
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = sys.argv[1]
texts = ["The answer to life is", "Python is a programming language that"]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
one = tok(texts[0], return_tensors="pt")
batch = tok(texts, padding=True, return_tensors="pt")
new = 6
with torch.no_grad():
    logits = model(**one).logits
    padded = model(**batch).logits
    generated = model.generate(**batch, max_new_tokens=new, do_sample=False)
    alone = [model.generate(**tok(t, return_tensors="pt"), max_new_tokens=new, do_sample=False) for t in texts]
    scores = [model(**tok(t, return_tensors="pt")).logits[0] for t in texts]
width = batch["input_ids"].shape[1]
eos = tok.eos_token_id
def upto_eos(ids):  # generation ends at EOS (generation_config.json); a batch pads the rows that ended
    return ids[:ids.index(eos) + 1] if eos in ids else ids
prompt = [tok(t, return_tensors="pt")["input_ids"].shape[1] for t in texts]
pad_diff = max(float((padded[i][batch["attention_mask"][i].bool()] - scores[i]).abs().max())
               for i in range(len(texts)))
pipe = transformers.pipeline("text-generation", model=folder, trust_remote_code=True, torch_dtype=torch.float32)
piped = pipe(texts[0], max_new_tokens=new, do_sample=False)[0]["generated_text"]
print(json.dumps({
    "keys": sorted(one), "logits": list(logits.shape), "pad_token": tok.pad_token, "eos_token": tok.eos_token,
    "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "padding_side": tok.padding_side,
    "tokens": len(tok), "embeddings": model.get_input_embeddings().weight.shape[0],
    "vocab_size": model.config.vocab_size, "padded_rows": batch["attention_mask"].sum(1).tolist(),
    "batched_new": [upto_eos(generated[i, width:].tolist()) for i in range(len(texts))],
    "alone_new": [upto_eos(a[0, n:].tolist()) for a, n in zip(alone, prompt)], "pad_max_abs_logit_diff": pad_diff,
    "pipeline": piped,
    "pipeline_expected": texts[0] + tok.decode(alone[0][0, prompt[0]:], skip_special_tokens=True),
    "generation_config": {"pad_token_id": model.generation_config.pad_token_id,
                          "eos_token_id": model.generation_config.eos_token_id},
}))
"""


def usual_calls(folder: Path, tokenizer_dir: Path) -> dict:
    """Run :data:`USUAL_CALLS` on the export ``folder`` in a fresh interpreter and check what it found against the
    run's tokenizer in ``tokenizer_dir`` (the tokenizer the export was made from); return the summary."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    proc = subprocess.run([sys.executable, "-c", USUAL_CALLS, str(folder)], capture_output=True, text=True,
                          cwd=folder.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    source = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert got["keys"] == ["attention_mask", "input_ids"]  # no token_type_ids: MPT's forward takes none
    assert got["pad_token"] == got["eos_token"] == source.eos_token and got["pad_token_id"] == got["eos_token_id"]
    assert got["tokens"] == len(source) and got["embeddings"] == got["vocab_size"]  # no new token, no resize
    assert got["padding_side"] == "left" and len(set(got["padded_rows"])) == 2  # the batch really is padded
    assert got["batched_new"] == got["alone_new"]
    assert got["pad_max_abs_logit_diff"] < 1e-4, got  # padding changes no score
    assert got["pipeline"] == got["pipeline_expected"]
    # generate() called without pad/eos ids uses the tokenizer's (generation_config.json)
    assert got["generation_config"] == {"pad_token_id": got["pad_token_id"], "eos_token_id": got["eos_token_id"]}
    return got


def test_the_exported_tokenizer_works_with_the_usual_calls(tiny_export):
    """model(**tok(text)), model.generate(**tok(texts, padding=True)) and a text-generation pipeline on the export,
    with transformers alone: the pad token is the EOS token (none added), padding is on the left (MPT generates
    from left-padded batches only), no token_type_ids; the manifest says so."""
    got = usual_calls(tiny_export, tiny_export.parent / "tok")
    manifest = json.loads((tiny_export / "manifest.json").read_text())
    assert manifest["tokenizer"] == {"class": "PreTrainedTokenizer", "pad_token": got["pad_token"],
                                     "pad_token_id": got["pad_token_id"], "eos_token_id": got["eos_token_id"],
                                     "padding_side": "left",
                                     "model_input_names": ["input_ids", "attention_mask"]}
