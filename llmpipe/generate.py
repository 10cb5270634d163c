"""Generation with the exported Hugging Face model (transformers only: no llm-foundry import needed)."""

from __future__ import annotations

import time


def generate(model_dir: str, gen_cfg: dict) -> dict:
    """Answer each prompt of ``gen_cfg['prompts']`` with the model in ``model_dir``.

    Args:
        model_dir: a folder written by :func:`llmpipe.convert.convert_checkpoint`.
        gen_cfg: ``prompts`` (list of str), ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``, ``seed``.

    Returns:
        ``{"model", "device", "settings", "outputs": [{"prompt", "completion", "new_tokens", "seconds"}],
        "tokens_per_s"}``; tokens/s counts generated tokens over generation time.

    Raises:
        ValueError: no prompts configured.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = list(gen_cfg.get("prompts") or [])
    if not prompts:
        raise ValueError("generate.prompts is empty. Fix: list at least one prompt under generate.prompts.")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, torch_dtype=dtype).to(device)
    model.eval()
    torch.manual_seed(int(gen_cfg.get("seed", 17)))
    kwargs = {"max_new_tokens": int(gen_cfg.get("max_new_tokens", 256)), "do_sample": bool(gen_cfg.get("do_sample")),
              "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
              "eos_token_id": tok.eos_token_id}
    if kwargs["do_sample"]:
        kwargs.update(temperature=float(gen_cfg.get("temperature", 1.0)), top_p=float(gen_cfg.get("top_p", 1.0)))
    max_len = int(getattr(model.config, "max_seq_len", 2048))
    outputs, total_new, total_s = [], 0, 0.0
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        budget = min(kwargs["max_new_tokens"], max(0, max_len - ids.shape[1]))
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **{**kwargs, "max_new_tokens": budget})
        dt = time.time() - t0
        new = out[0, ids.shape[1]:]
        outputs.append({"prompt": prompt, "completion": tok.decode(new, skip_special_tokens=True),
                        "new_tokens": int(new.numel()), "seconds": round(dt, 3),
                        "truncated_to_context": budget < kwargs["max_new_tokens"]})
        total_new += int(new.numel())
        total_s += dt
    return {"model": model_dir, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "settings": {k: gen_cfg.get(k) for k in ("max_new_tokens", "do_sample", "temperature", "top_p", "seed")},
            "outputs": outputs, "tokens_per_s": round(total_new / total_s, 2) if total_s else None}
