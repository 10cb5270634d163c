"""Multiple-choice and schema items forward their common prefix once (``eval.icl_batches: shared_prefix``).

llm-foundry scores a multiple-choice item as one sequence per choice: the same preamble and question, then each
choice; a schema item as one sequence per context option, then the same continuation. On trimmed batches
(:mod:`llmpipe.evaluation.icl_batches`) every choice still runs its whole context: a 25-shot item of four choices
forwards its 1,500-token preamble four times. Here each item's sequences (llm-foundry's ``choice_groupings``) share
one forward of their longest common prefix; each sequence then forwards only the rest, on the prefix's cached keys
and values. Under a causal model a position's logits depend only on the tokens up to it, so every logit the metrics
read (the answer positions) is the one the whole sequence gives; the sums are merely taken in another order.

The batches, sampler, metrics and evaluator stay llm-foundry's (the trimmed datasets); only the model's
``eval_forward`` of a multiple-choice or schema batch changes (:func:`register_prefix_model`, llm-foundry's ``models``
registry). Language modelling and generation batches, and any evaluation over several processes (under FSDP every
rank must call the model equally often), take the stock path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: The registry name of the causal LM whose ``eval_forward`` shares prefixes (:func:`register_prefix_model`).
PREFIX_MODEL = "llmpipe_prefix_causal_lm"


def common_prefix(ids: Any, mask: Any, lengths: Sequence[int]) -> int:
    """The columns every row of ``ids`` and ``mask`` [rows, width] starts with alike (token and attention), within
    each row's ``lengths`` (up to its last attended token; right padding after it), at most the shortest row less
    one column (each row keeps a token of its own to forward); 0 when the shortest row has one column."""
    import torch

    shortest = int(min(lengths))
    if shortest <= 1:
        return 0
    same = ((ids[:, :shortest] == ids[:1, :shortest]) & (mask[:, :shortest] == mask[:1, :shortest])).all(dim=0)
    differ = torch.nonzero(~same).flatten()
    n = int(differ[0]) if differ.numel() else shortest
    return min(n, shortest - 1)


def repeat_cache(past: Any, n: int) -> Any:
    """The key/value cache of one sequence for ``n`` sequences: a transformers ``Cache`` through its
    ``batch_repeat_interleave``, or a nested tuple/list of tensors (MPT's ``past_key_values``: per block, ``(key,
    value)`` with the batch first) expanded along the first dimension (a view, no copy)."""
    if hasattr(past, "batch_repeat_interleave"):
        past.batch_repeat_interleave(n)
        return past
    if isinstance(past, (tuple, list)):
        return type(past)(repeat_cache(p, n) for p in past)
    return past.expand(n, *past.shape[1:])


def prefix_logits(net: Any, input_ids: Any, attention_mask: Any, groups: Sequence[tuple[int, int]]) -> Any:
    """Logits [rows, width, vocabulary] of a right-padded multiple-choice or schema batch, each group's common
    prefix forwarded once.

    Args:
        net: a Hugging Face causal LM (``net(input_ids=..., attention_mask=..., past_key_values=..., use_cache=...)``
            returning ``.logits`` and ``.past_key_values``; the mask covers the cached columns too).
        input_ids: [rows, width] token ids, each row's real tokens first.
        attention_mask: [rows, width], as llm-foundry builds it (0 for padding, and for a pad/EOS token inside a
            context); passed through, so every kept position sees what it sees in the whole batch.
        groups: ``[start, end)`` rows of each item (llm-foundry's ``choice_groupings``), covering every row.

    Returns:
        Logits at every column up to each group's last attended one (later columns are zeros: padding, which no
        metric reads), in the dtype the model computes.
    """
    import torch

    rows, width = input_ids.shape
    cols = torch.arange(width, device=attention_mask.device)
    lengths = ((attention_mask != 0) * (cols + 1)).max(dim=1).values.tolist()   # through the last attended column
    out = None
    for a, b in groups:
        a, b = int(a), int(b)
        lens = [max(1, int(n)) for n in lengths[a:b]]
        p = common_prefix(input_ids[a:b], attention_mask[a:b], lens)
        top = max(lens)
        parts = []
        past = None
        if p:
            pre = net(input_ids=input_ids[a:a + 1, :p], attention_mask=attention_mask[a:a + 1, :p], use_cache=True)
            parts.append((slice(0, p), pre.logits.expand(b - a, -1, -1)))
            past = repeat_cache(pre.past_key_values, b - a)
        rest = net(input_ids=input_ids[a:b, p:top], attention_mask=attention_mask[a:b, :top], past_key_values=past,
                   use_cache=False)
        parts.append((slice(p, top), rest.logits))
        if out is None:
            out = torch.zeros(rows, width, parts[-1][1].shape[-1], dtype=parts[-1][1].dtype,
                              device=parts[-1][1].device)
        for span, logits in parts:
            out[a:b, span] = logits.to(out.dtype)
    return out


def register_prefix_model() -> str:
    """Register (once) llm-foundry's ``hf_causal_lm`` with a prefix-sharing ``eval_forward`` for multiple-choice and
    schema batches (:func:`prefix_logits`) under :data:`PREFIX_MODEL`; return the name. Other batches, and every
    batch when more than one process runs, take the stock ``eval_forward``."""
    from composer.utils import dist
    from llmfoundry.registry import models

    if PREFIX_MODEL in models.get_all():
        return PREFIX_MODEL
    base = models.get("hf_causal_lm")

    class PrefixSharingCausalLM(base):  # type: ignore[misc, valid-type]
        """llm-foundry's causal LM; multiple-choice and schema batches share each item's prefix."""

        def eval_forward(self, batch, outputs=None):
            if (outputs is not None or batch.get("mode") != "icl_task" or "choice_groupings" not in batch
                    or dist.get_world_size() > 1):
                return super().eval_forward(batch, outputs)
            # as composer's HuggingFaceModel.eval_forward for an ICL batch: labels popped and shifted
            self.labels = batch.pop("labels")
            self.labels[:, :-1] = self.labels[:, 1:].clone()
            self.labels[:, -1] = -100
            return prefix_logits(self.model, batch["input_ids"], batch["attention_mask"], batch["choice_groupings"])

    models.register(PREFIX_MODEL, func=PrefixSharingCausalLM)
    return PREFIX_MODEL
