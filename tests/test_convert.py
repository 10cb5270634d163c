"""The Hugging Face export loads with transformers alone and matches the composer model's logits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from llmpipe.config.runs import run_settings
from tests.conftest import project_config
from tests.test_export import WITHOUT_FOUNDRY, usual_calls

pytestmark = pytest.mark.slow

LOAD_WITHOUT_FOUNDRY = WITHOUT_FOUNDRY + r"""
import torch
from transformers import AutoModelForCausalLM
folder, ids_path, out_path = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
ids = torch.load(ids_path)
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, out_path)
print(json.dumps({'class': type(model).__name__, 'dtype': str(next(model.parameters()).dtype)}))
"""


def composer_logits(config: dict, run: str, ckpt: str, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the composer model (llm-foundry's ComposerMPTCausalLM) restored from the training checkpoint."""
    from llmfoundry.utils.builders import build_composer_model

    from llmpipe.train.pretrain import foundry_train_config
    cfg = foundry_train_config(run_settings(config, run), data_dir=None, save_folder=None, world_size=1)
    model_cfg = dict(cfg["model"])
    name = model_cfg.pop("name")
    model = build_composer_model(name=name, cfg=model_cfg, tokenizer=None)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state"]["model"]
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        out = model({"input_ids": ids})
        return (out.logits if hasattr(out, "logits") else out).float()


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", None)])
def test_export_matches_composer_logits(tiny_run, tmp_path, dtype, tol):
    from llmpipe.hf.export import convert_checkpoint
    from llmpipe.config.stage_settings import ConvertSettings

    config = project_config()
    train = json.loads((tiny_run / "results/mpt-tiny/train.json").read_text())
    ckpt = str(tiny_run / train["final_checkpoint"])
    out = tmp_path / "hf"
    out.mkdir()
    tokenizer_dir = tiny_run / "results/tokenizers/bpe-builtin-docs"
    export = ConvertSettings.from_section({**config["convert"], "dtype": dtype})
    manifest = convert_checkpoint(run_settings(config, "mpt-tiny"), ckpt, str(tokenizer_dir), str(out), export)
    assert manifest["dtype"] == dtype and (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["attn_config"]["attn_impl"] == "torch"
    if dtype == "float32":  # the trained model's export with transformers' usual calls (tests/test_export.py)
        usual_calls(out, tokenizer_dir)

    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_FOUNDRY, str(out), str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf_logits = torch.load(tmp_path / "logits.pt")
    ref = composer_logits(config, "mpt-tiny", ckpt, ids)
    diff = (hf_logits - ref).abs().max().item()
    if tol is not None:
        assert diff <= tol, diff
    else:
        # bf16 weights: each weight is rounded to 8 significant bits (relative error <= 2**-8); the logits may move
        # by a few bf16 ulps of their magnitude, far below the spread of the logits themselves.
        scale = ref.abs().max().item()
        assert diff <= 0.05 * scale, (diff, scale)
        assert diff > 0  # the weights really are bf16
        assert (hf_logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
