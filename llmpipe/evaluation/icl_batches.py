"""In-context-learning batches without the padding to the model's context (``eval.icl_batches: trimmed``).

llm-foundry 0.22's ICL datasets pad every sequence to ``max_seq_len`` (``padding_size``; ``max_seq_len`` minus the
longest answer for generation tasks, ``llmfoundry/eval/datasets/utils.py`` ``make_padded_input``), so a 150-token
multiple-choice item costs a full-context forward per choice. The datasets here are llm-foundry's own classes,
registered under other names in its ``icl_datasets`` registry, with two changes that leave every item's score as
it was:

* **Rows sorted by length, longest first**, after llm-foundry built them (few-shot examples are drawn in the
  file's order, as before). Batches then hold sequences of similar length, and the first batch is the largest, so a
  batch that does not fit the device fails at once. The choices of a multiple-choice or schema item stay one row.
  The sampler stays llm-foundry's (``composer.utils.dist.get_sampler``, no shuffle): with several processes every
  rank gets ``ceil(items / ranks)`` rows and runs the same number of batches.
* **Each batch cut to its longest real sequence**: columns that are padding in every row of the batch are dropped
  (right-padded task types: the tail after the last attended token or answer index; generation, left-padded: the
  head before the first attended token). Under a causal model the dropped columns change no kept position: right
  padding follows every kept token, and left padding is masked, with MPT's positions counted from the attention
  mask. Answer indices (``continuation_indices``) count from the left and stay valid.

Metrics, evaluator, microbatching (``split_batch``) and the sampler stay llm-foundry's and composer's.
"""

from __future__ import annotations

from typing import Any

#: llm-foundry's task type -> the metric its evaluator builds by default (``llmfoundry.utils.builders``
#: ``build_icl_evaluators``: ``_validate_cfg``); a registered name of our own gets no default there.
DEFAULT_METRICS = {
    "language_modeling": ["InContextLearningLMAccuracy"],
    "multiple_choice": ["InContextLearningMultipleChoiceAccuracy"],
    "schema": ["InContextLearningMultipleChoiceAccuracy"],
    "generation_task_with_answers": ["InContextLearningGenerationExactMatchAccuracy"],
}
#: The registered name of the trimmed dataset of each llm-foundry task type.
TRIMMED_NAMES = {ttype: f"llmpipe_trimmed_{ttype}" for ttype in DEFAULT_METRICS}
#: ``eval.icl_batches`` values: ``trimmed`` (this module), ``padded`` (llm-foundry's datasets as they are) or
#: ``shared_prefix`` (trimmed batches whose multiple-choice and schema items forward their common prefix once,
#: :mod:`llmpipe.evaluation.shared_prefix`).
ICL_BATCHES = ("trimmed", "padded", "shared_prefix")


def kept_columns(batch: dict[str, Any], padding_side: str) -> tuple[int, int]:
    """The columns ``[start, end)`` of a collated ICL batch that some row needs.

    Args:
        batch: llm-foundry's collated batch: ``input_ids`` and ``attention_mask`` [rows, padded length]; right-padded
            task types also ``continuation_indices`` (one index tensor per row).
        padding_side: the dataset's ``padding_side``, ``"right"`` or ``"left"``.

    Returns:
        ``(start, end)``: right padding keeps ``[0, 1 + max(last attended column, last answer index))``; left padding
        keeps ``[first attended column, padded length)``. A batch with no attended column keeps one column.

    Raises:
        ValueError: ``padding_side`` is neither ``"right"`` nor ``"left"``.
    """
    import torch

    mask = batch["attention_mask"].bool()
    width = int(mask.shape[1])
    attended = torch.nonzero(mask.any(dim=0)).flatten()
    if padding_side == "right":
        end = int(attended[-1]) + 1 if attended.numel() else 1
        for idx in batch.get("continuation_indices") or []:
            if len(idx):
                end = max(end, int(torch.as_tensor(idx).max()) + 1)
        return 0, min(end, width)
    if padding_side == "left":
        return (int(attended[0]) if attended.numel() else width - 1), width
    raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")


def trim_batch(batch: dict[str, Any], padding_side: str) -> dict[str, Any]:
    """``batch`` with every [rows, padded length] tensor cut to :func:`kept_columns` (in place; also returned)."""
    import torch

    width = int(batch["input_ids"].shape[1])
    start, end = kept_columns(batch, padding_side)
    if (start, end) != (0, width):
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == width:
                batch[key] = value[:, start:end]
    return batch


class TrimmedBatches:
    """Mix-in before an llm-foundry ICL dataset class: rows sorted longest first, each batch cut to its longest
    sequence (module docstring). llm-foundry tokenizes its rows on first access (``_prepare_dataset``); they are
    sorted right after."""

    _item_order: list[int] | None = None

    def _prepare_dataset(self) -> None:
        super()._prepare_dataset()
        lengths = self._row_lengths()
        self._item_order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
        # flatten_indices: rows rewritten in the new order (a select() alone reads every row through an index
        # mapping, which costs more per batch than the rows themselves on small models)
        self.dataset = self.dataset.select(self._item_order).flatten_indices()

    @property
    def item_order(self) -> list[int]:
        """``item_order[k]``: the index, in the order llm-foundry built them (the file's, within a category), of the
        item in row ``k``."""
        if self._item_order is None:
            self._prepare_dataset()
        return list(self._item_order)

    def _row_lengths(self) -> list[int]:
        """Each row's kept width as :func:`kept_columns` counts it for a batch of that row alone."""
        if self.padding_side == "right" and "continuation_indices" in self.dataset.column_names:
            out = []
            for idx in self.dataset["continuation_indices"]:
                flat = [int(i) for i in _flatten(idx)]
                out.append(max(flat) + 1 if flat else 1)
            return out
        if self.padding_side == "left":
            pad = self.pad_tok_id
            out = []
            for ctx in self.dataset[self.context_key]:
                lead = next((j for j, tok in enumerate(ctx) if tok != pad), len(ctx) - 1)
                out.append(len(ctx) - lead)
            return out
        lengths = []
        for k in range(len(self.dataset)):
            start, end = kept_columns(super().collate_fn([self.dataset[k]]), self.padding_side)
            lengths.append(end - start)
        return lengths

    def collate_fn(self, data: list[dict[str, Any]]) -> dict[str, Any]:
        return trim_batch(super().collate_fn(data), self.padding_side)


def _flatten(value: Any) -> list:
    """The integers of a nested list (one answer's indices, or one list per choice)."""
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def register_trimmed_datasets() -> dict[str, str]:
    """Register the trimmed dataset of each task type in llm-foundry's ``icl_datasets`` registry (idempotent).

    Returns:
        :data:`TRIMMED_NAMES` (llm-foundry task type -> registered name).
    """
    import llmfoundry.eval.datasets  # noqa: F401 - registers llm-foundry's own task types
    from llmfoundry.registry import icl_datasets

    registered = icl_datasets.get_all()
    for ttype, name in TRIMMED_NAMES.items():
        if name not in registered:
            base = icl_datasets.get(ttype)
            icl_datasets.register(name, func=type(f"Trimmed{base.__name__}", (TrimmedBatches, base), {}))
    return dict(TRIMMED_NAMES)


def icl_task_configs(tasks: list[dict], icl_batches: str) -> list[dict]:
    """llm-foundry ICL task configs for ``eval.icl_batches``.

    Args:
        tasks: llm-foundry task configs (``icl_task_type`` one of :data:`DEFAULT_METRICS`' keys).
        icl_batches: ``"trimmed"`` or ``"shared_prefix"`` (copies naming the trimmed datasets, with the metric
            llm-foundry would have built) or ``"padded"`` (``tasks`` as they are).

    Raises:
        ValueError: ``icl_batches`` is not one of :data:`ICL_BATCHES`, or a task type has no trimmed dataset.
    """
    if icl_batches == "padded":
        return tasks
    if icl_batches not in ICL_BATCHES:
        raise ValueError(f"eval.icl_batches must be one of {ICL_BATCHES}, got {icl_batches!r}")
    names = register_trimmed_datasets()
    out = []
    for task in tasks:
        ttype = task["icl_task_type"]
        if ttype not in names:
            raise ValueError(f"ICL task {task.get('label')}: task type {ttype!r} has no trimmed dataset. Fix: set "
                             f"eval.icl_batches: padded, or use one of {sorted(names)}.")
        out.append({**task, "icl_task_type": names[ttype],
                    "metric_names": list(task.get("metric_names") or DEFAULT_METRICS[ttype])})
    return out
