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
registry). Language modelling and generation batches, any evaluation over several processes (under FSDP every
rank must call the model equally often) and any model but MPT (other models take positions from the cache, not
from the attention mask) take the stock path.
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


def select_cache(past: Any, index: Any) -> Any:
    """The key/value cache of ``past``'s sequences picked by ``index`` (a tensor of sequence numbers, repeats
    allowed): MPT's ``past_key_values``, per block ``(key, value)`` tensors with the batch first."""
    if isinstance(past, (tuple, list)):
        return type(past)(select_cache(p, index) for p in past)
    return past.index_select(0, index.to(past.device))


def prefix_logits(net: Any, input_ids: Any, attention_mask: Any, groups: Sequence[tuple[int, int]]) -> Any:
    """Logits [rows, width, vocabulary] of a right-padded multiple-choice or schema batch, each group's common
    prefix forwarded once.

    Two forwards: the groups' prefixes (one sequence per group, right-padded to the longest prefix, the padding
    masked), then every row's rest on the cached keys and values of its group's prefix, with the attention mask of
    both (the prefix's padding stays masked). MPT counts positions from the attention mask (a masked column takes no
    position), so every kept column has the position and the context it has in the whole batch.

    Args:
        net: an MPT causal LM (llm-foundry's ``MPTForCausalLM``: ``net(input_ids=..., attention_mask=...,
            past_key_values=..., use_cache=...)``; the mask covers the cached columns too).
        input_ids: [rows, width] token ids, each row's real tokens first.
        attention_mask: [rows, width], as llm-foundry builds it (0 for padding, and for a pad/EOS token inside a
            context); passed through.
        groups: ``[start, end)`` rows of each item (llm-foundry's ``choice_groupings``), covering every row.

    Returns:
        Logits at every column up to each row's last attended one (later columns are zeros: padding, which no metric
        reads), in the dtype the model computes. A batch where some group shares no column is forwarded whole;
        one whose longest prefix and longest rest together exceed the model's ``max_seq_len`` shares the shortest
        group prefix in every group.
    """
    import torch

    rows, width = input_ids.shape
    dev = input_ids.device
    cols = torch.arange(width, device=dev)
    mask = attention_mask.to(dev)
    lengths = [max(1, int(n)) for n in ((mask != 0) * (cols + 1)).max(dim=1).values.tolist()]
    spans = [(int(a), int(b)) for a, b in groups]
    shared = [common_prefix(input_ids[a:b], mask[a:b], lengths[a:b]) for a, b in spans]
    if not spans or min(shared) == 0:
        return net(input_ids=input_ids, attention_mask=mask).logits
    group_of = torch.empty(rows, dtype=torch.long, device=dev)
    for g, (a, b) in enumerate(spans):
        group_of[a:b] = g
    limit = int(getattr(getattr(net, "config", None), "max_seq_len", width) or width)
    if max(shared) + max(lengths[r] - shared[int(group_of[r])] for r in range(rows)) > limit:
        # the cached columns and the rest must fit MPT's context (its positions check counts the masked ones too):
        # one prefix length for every group keeps them within the batch's width
        shared = [min(shared)] * len(spans)
    top = max(shared)
    firsts = torch.tensor([a for a, _ in spans], device=dev)
    pre_ids = input_ids[firsts, :top]
    pre_mask = mask[firsts, :top] * (cols[:top].unsqueeze(0) < torch.tensor(shared, device=dev).unsqueeze(1))
    pre = net(input_ids=pre_ids, attention_mask=pre_mask, use_cache=True)
    rest_len = [lengths[r] - shared[int(group_of[r])] for r in range(rows)]
    s = max(rest_len)
    suf_ids = input_ids.new_zeros(rows, s)
    suf_mask = mask.new_zeros(rows, s)
    for r in range(rows):
        p = shared[int(group_of[r])]
        suf_ids[r, :rest_len[r]] = input_ids[r, p:lengths[r]]
        suf_mask[r, :rest_len[r]] = mask[r, p:lengths[r]]
    rest = net(input_ids=suf_ids, attention_mask=torch.cat([pre_mask[group_of], suf_mask], dim=1),
               past_key_values=select_cache(pre.past_key_values, group_of), use_cache=False)
    out = torch.zeros(rows, width, rest.logits.shape[-1], dtype=rest.logits.dtype, device=rest.logits.device)
    for g, (a, b) in enumerate(spans):
        out[a:b, :shared[g]] = pre.logits[g, :shared[g]].to(out.dtype)
    for r in range(rows):
        p = shared[int(group_of[r])]
        out[r, p:lengths[r]] = rest.logits[r, :rest_len[r]].to(out.dtype)
    return out


def register_prefix_model() -> str:
    """Register (once) llm-foundry's ``hf_causal_lm`` with a prefix-sharing ``eval_forward`` for multiple-choice and
    schema batches of an MPT model (:func:`prefix_logits`) under :data:`PREFIX_MODEL`; return the name. Other
    batches and models, and every batch when more than one process runs, take the stock ``eval_forward``."""
    from composer.utils import dist
    from llmfoundry.registry import models

    if PREFIX_MODEL in models.get_all():
        return PREFIX_MODEL
    base = models.get("hf_causal_lm")

    class PrefixSharingCausalLM(base):  # type: ignore[misc, valid-type]
        """llm-foundry's causal LM; multiple-choice and schema batches share each item's prefix."""

        def eval_forward(self, batch, outputs=None):
            if (outputs is not None or batch.get("mode") != "icl_task" or "choice_groupings" not in batch
                    or dist.get_world_size() > 1 or getattr(self.model.config, "model_type", None) != "mpt"):
                return super().eval_forward(batch, outputs)
            # as composer's HuggingFaceModel.eval_forward for an ICL batch: labels popped and shifted
            self.labels = batch.pop("labels")
            self.labels[:, :-1] = self.labels[:, 1:].clone()
            self.labels[:, -1] = -100
            return prefix_logits(self.model, batch["input_ids"], batch["attention_mask"], batch["choice_groupings"])

    models.register(PREFIX_MODEL, func=PrefixSharingCausalLM)
    return PREFIX_MODEL
