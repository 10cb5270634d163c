"""Generation with the exported Hugging Face model (transformers only: no llm-foundry import needed).

Each prompt is handled on its own. A prompt and its new tokens must fit the model's context (``max_seq_len``):
the new tokens get ``reserve = min(max_new_tokens, context // 2)`` positions, and a prompt longer than
``context - reserve`` tokens is too long. Too-long prompts are truncated from the left (their last
``context - reserve`` tokens are kept, as transformers' text-generation pipeline does with
``handle_long_generation="hole"``) and recorded as such, or, with ``long_prompts: fail``, not answered and recorded
with an error; the other prompts are answered either way. A prompt that fits keeps every token and gets the new
tokens that fit behind it, at most ``max_new_tokens``.

The model continues each prompt put into ``template`` (``{prompt}`` replaced by the prompt, as
:func:`llmpipe.data.instructions.apply_template` builds a finetune's training prompts); the tokens counted above are
that text's. A prompt that cannot be answered (not text, no tokens, too long under ``long_prompts: fail``, or an
error raised while generating it) is recorded with its error and the other prompts are answered.
"""

from __future__ import annotations

import sys
import time
import traceback

from llmpipe.config.stage_settings import GenerateSettings
from llmpipe.data.instructions import PROMPT_FIELD, apply_template


def prompt_budget(prompt_tokens: int, context: int, max_new_tokens: int) -> tuple[int, int]:
    """How many of a prompt's tokens are kept (its last ones) and how many new tokens may follow.

    Args:
        prompt_tokens: the prompt's length in tokens.
        context: the model's context length in tokens (``max_seq_len``).
        max_new_tokens: ``generate.max_new_tokens``.

    Returns:
        ``(kept, new)``: ``kept < prompt_tokens`` means the prompt is too long and loses its first
        ``prompt_tokens - kept`` tokens; ``kept + new <= context`` always, ``new >= 1`` when ``context >= 2``.

    Raises:
        ValueError: a context shorter than 2 tokens or ``max_new_tokens`` < 1.
    """
    if context < 2 or max_new_tokens < 1:
        raise ValueError(f"context ({context}) must be >= 2 and max_new_tokens ({max_new_tokens}) >= 1")
    reserve = min(max_new_tokens, context // 2)
    kept = min(prompt_tokens, context - reserve)
    return kept, min(max_new_tokens, context - kept)


def generate(model_dir: str, settings: GenerateSettings, *, gpus: int | None = None) -> dict:
    """Answer each prompt of ``settings.prompts`` with the model in ``model_dir``.

    Args:
        model_dir: a folder written by :func:`llmpipe.hf.export.convert_checkpoint`.
        settings: the run's generation settings (:func:`llmpipe.steps.generate.run_generate_settings`): prompts,
            template (text with ``{prompt}``), ``max_new_tokens``, sampling, ``seed``, ``long_prompts``
            (``truncate`` | ``fail``, see the module docstring); ``prompts_at`` names the prompts in messages.
        gpus: the job's GPUs (``resources.gpus_per_node``; None: every visible one). The model is placed across
            them (:func:`llmpipe.plan.inference_placement.generation_placement`: ``device_map``), on the CPU when the
            host has none.

    Returns:
        ``{"model", "device", "gpus" (the model was placed across; 0: CPU), "context_tokens", "settings"
        (:meth:`llmpipe.config.stage_settings.GenerateSettings.record`), "outputs", "tokens_per_s"}``; each output is
        ``{"prompt", "text" (the template applied: what the model continued), "prompt_tokens" (of the text),
        "prompt_tokens_kept", "prompt_truncated", "completion", "new_tokens", "seconds", "truncated_to_context"}``
        (``truncated_to_context``: fewer than ``max_new_tokens`` new tokens fit), or, for a prompt that was not
        answered, ``{"prompt", "text", "prompt_tokens" (when tokenized), "error"}`` with ``exception`` (its type's
        name) when generating it raised. tokens/s counts generated tokens over generation time.

    Raises:
        ValueError: no prompts configured, or a template without ``{prompt}``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts_at = settings.prompts_at
    prompts = list(settings.prompts)
    if not prompts:
        raise ValueError(f"{prompts_at} is empty. Fix: list at least one prompt under {prompts_at}.")
    mode = settings.long_prompts
    template = settings.template
    if not isinstance(template, str) or PROMPT_FIELD not in template:
        raise ValueError(f"the generation template {template!r} has no {PROMPT_FIELD}. Fix: write {PROMPT_FIELD} "
                         f"where the prompt goes (generate.template).")
    from llmpipe.plan.inference_placement import generation_placement

    place = generation_placement(gpus)
    dtype = torch.bfloat16 if place["gpus"] else torch.float32
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, torch_dtype=dtype,
                                                 device_map=place["device_map"], max_memory=place["max_memory"])
    model.eval()
    device = model.get_input_embeddings().weight.device  # the first block's device: prompts go there
    torch.manual_seed(int(settings.seed))
    max_new = int(settings.max_new_tokens)
    kwargs = {"do_sample": bool(settings.do_sample),
              "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
              "eos_token_id": tok.eos_token_id}
    if kwargs["do_sample"]:
        kwargs.update(temperature=float(settings.temperature), top_p=float(settings.top_p))
    context = int(getattr(model.config, "max_seq_len", 2048))
    outputs, total_new, total_s = [], 0, 0.0
    for i, prompt in enumerate(prompts):
        shown = f"{prompts_at}[{i}] ({str(prompt)[:40]!r}{'...' if len(str(prompt)) > 40 else ''})"
        if not isinstance(prompt, str):
            outputs.append({"prompt": prompt, "text": None, "error": (
                f"{prompts_at}[{i}] is {prompt!r}, not text. Fix: write the prompt as text (quoted in YAML).")})
            continue
        text = apply_template(template, prompt)
        record: dict = {"prompt": prompt, "text": text}
        try:
            ids = tok(text, return_tensors="pt").input_ids.to(device)
            n = record["prompt_tokens"] = int(ids.shape[1])
            if n == 0:  # MPT's generate indexes the last position of the prompt
                outputs.append({**record, "error": f"{shown} has no tokens (the text sent is {text!r}), so there is "
                                                  f"nothing to continue. Fix: write the prompt's text."})
                continue
            kept, budget = prompt_budget(n, context, max_new)
            if kept < n and mode == "fail":
                outputs.append({**record, "error": (
                    f"{shown} has {n} tokens; the model's context is {context} tokens and {context - kept} of them "
                    f"are kept for new tokens, so a prompt may have at most {kept}. Fix: shorten the prompt, or set "
                    f"generate.long_prompts: truncate (its first {n - kept} tokens are dropped).")})
                continue
            ids = ids[:, n - kept:]
            t0 = time.time()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, **kwargs)
            dt = time.time() - t0
            new = out[0, ids.shape[1]:]
            completion = tok.decode(new, skip_special_tokens=True)
        except Exception as exc:  # recorded for this prompt alone; the others are still answered
            print(f"{shown}: generation failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            outputs.append({**record, "error": f"{shown}: generation failed: {type(exc).__name__}: {exc}",
                            "exception": type(exc).__name__})
            continue
        outputs.append({**record, "prompt_tokens_kept": kept, "prompt_truncated": kept < n,
                        "completion": completion, "new_tokens": int(new.numel()),
                        "seconds": round(dt, 3), "truncated_to_context": budget < max_new})
        total_new += int(new.numel())
        total_s += dt
    return {"model": model_dir, "device": torch.cuda.get_device_name() if place["gpus"] else "cpu",
            "gpus": place["gpus"],
            "context_tokens": context,
            "settings": settings.record(),
            "outputs": outputs, "tokens_per_s": round(total_new / total_s, 2) if total_s else None}
