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

from llmpipe.config import run_config
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

    from llmpipe.convert import mpt_config_dict
    from llmpipe.train import register_extensions

    register_extensions()
    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(**mpt_config_dict(rc)))
    torch.save({"state": {"model": {f"model.{k}": v for k, v in model.state_dict().items()}}}, path)
    return str(path)


def export(tmp: Path, umask: int) -> Path:
    """Convert a random mpt-tiny checkpoint under ``umask``; return the export folder."""
    from llmpipe.convert import convert_checkpoint

    rc = run_config(project_config(), "mpt-tiny")
    out = tmp / "hf"
    old = os.umask(umask)
    try:
        convert_checkpoint(rc, random_checkpoint(rc, tmp / "ckpt.pt"), tiny_tokenizer(tmp / "tok"), str(out),
                           "float32", verify=False)
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


def settings(**over) -> dict:
    return {"prompts": [SHORT[0], LONG, SHORT[1]], "max_new_tokens": 8, "do_sample": False, "seed": 17, **over}


def test_a_prompt_longer_than_the_context_is_truncated_from_the_left(tiny_export):
    """The long prompt keeps its last tokens and leaves room for max_new_tokens; the short prompts' completions are
    those they get alone."""
    from llmpipe.generate import generate

    got = generate(str(tiny_export), settings())
    assert got["context_tokens"] == 128 and [o["prompt"] for o in got["outputs"]] == [SHORT[0], LONG, SHORT[1]]
    long = got["outputs"][1]
    assert long["prompt_tokens"] > 128 and long["prompt_truncated"] is True
    assert long["prompt_tokens_kept"] == 128 - 8 and 1 <= long["new_tokens"] <= 8
    alone = generate(str(tiny_export), settings(prompts=SHORT))["outputs"]
    for o, a in zip([got["outputs"][0], got["outputs"][2]], alone):
        assert o["prompt_truncated"] is False and o["prompt_tokens_kept"] == o["prompt_tokens"]
        assert o["completion"] == a["completion"] and o["new_tokens"] == a["new_tokens"]


def test_new_tokens_beyond_the_context_keep_half_the_context_for_the_prompt():
    from llmpipe.generate import prompt_budget

    assert prompt_budget(12, 128, 256) == (12, 116)  # mpt-tiny's defaults: the prompt whole, 116 new tokens
    assert prompt_budget(400, 128, 256) == (64, 64)
    assert prompt_budget(2000, 2048, 256) == (1792, 256)
    assert prompt_budget(1000, 2048, 256) == (1000, 256)


def test_strict_mode_fails_naming_the_prompt_and_keeps_the_other_completions(tiny_export, tmp_path):
    """generate.long_prompts: fail: the step fails naming the prompt and the context length, generate.json is not
    written, and the other prompts' completions are in generate.partial.json."""
    from llmpipe.config import ConfigError
    from llmpipe.steps import generate as step

    out = tmp_path / "mpt-tiny" / "generate.json"
    out.parent.mkdir()
    log = tmp_path / "generate.log"
    log.write_text("")
    ctx = types.SimpleNamespace(
        wildcards=types.SimpleNamespace(run="mpt-tiny"), input=[str(tiny_export / "manifest.json")],
        output=[str(out)], config={"generate": settings(long_prompts="fail")}, resources={"gpus_per_node": 0},
        log=print, dispatch=lambda fn, *args, step, **kwargs: fn(*args, **kwargs),
        write_json=lambda obj, path=None: Path(path or out).write_text(json.dumps(obj)))
    with pytest.raises(ConfigError, match=r"generate\.prompts\[1\] \('The documentation.*has \d+ tokens; the model's "
                                          r"context is 128 tokens.*Fix: shorten the prompt, or set "
                                          r"generate\.long_prompts: truncate"):
        step.generate(ctx)
    assert not out.exists()
    partial = json.loads((out.parent / "generate.partial.json").read_text())
    assert [o["prompt"] for o in partial["outputs"] if "completion" in o] == SHORT
    ctx.config["generate"] = settings(prompts=SHORT, long_prompts="fail")
    step.generate(ctx)  # every prompt fits: generate.json, and the stale partial answers are gone
    assert out.exists() and not (out.parent / "generate.partial.json").exists()


def test_generation_through_the_placement_gives_the_tokens_of_a_plain_greedy_generate(tiny_export):
    """On a host without a GPU the placement (llmpipe.inference_placement.generation_placement, the code that spreads
    a large model over a node's GPUs) puts every weight on the CPU, whatever GPU count the job asked for, and the
    answers are token for token those of the model loaded whole and generating greedily with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmpipe.generate import generate
    from llmpipe.inference_placement import generation_placement

    if torch.cuda.is_available():
        pytest.skip("checks the CPU placement")
    assert generation_placement(8) == {"device_map": {"": "cpu"}, "max_memory": None, "gpus": 0}
    got = generate(str(tiny_export), settings(prompts=SHORT, max_new_tokens=12), gpus=8)
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
