"""Inference across GPUs: how many GPUs evaluation and generation get, and how the model is placed on them.

**The GPU count** (:func:`plan_gpus`, applied by :func:`llmpipe.config.runs.step_resources` to the ``eval`` and
``generate`` steps, shown and checked by the dry run): a model whose inference plan
(:func:`llmpipe.plan.memory_time.inference_memory`: weights, KV cache, activations, logits) fits one GPU within
:data:`llmpipe.plan.memory_time.TIGHT` of its memory runs on the GPUs the step's section asks for (``eval.resources`` /
``generate.resources``, one by default); a larger one gets all the GPUs of one node of its run
(``models.<run>.resources.gpus_per_node``, 8 by default). A run's ``step_resources.<step>.gpus_per_node`` overrides
the plan; an override (or a node) whose per-GPU plan clearly cannot fit is refused by
:func:`llmpipe.plan.memory_time.check_inference_fits`, naming the setting. CPU steps (``gpus_per_node: 0``) are never planned.

**Evaluation** on more than one process (:func:`foundry_parallel_settings`) runs llm-foundry's evaluator under FSDP
``FULL_SHARD``: on GPUs rank 0 reads the weights (``init_device: mixed``) and FSDP sends each rank its shard
(``sync_module_states``); torchmetrics sums each metric's state over the ranks when it is computed, and composer's
eval loop drops the samples a ``DistributedSampler`` repeats to even out the ranks, so the ICL item counts are those
of one process. Batch limits count batches over all ranks (each rank takes its ceiling share).

**Generation** (:func:`generation_placement`) is one process that places the model's blocks across the job's GPUs
with transformers' ``device_map="balanced"`` (accelerate; each GPU capped at :data:`DEVICE_MAP_SHARE` of its
memory, no CPU or disk offload: a model that does not fit fails to load instead of crawling), or on one device
(``{"": "cuda:0"}`` / ``{"": "cpu"}``: on a host without a GPU everything is on the CPU, as before).

**Time**: an evaluation's is :mod:`llmpipe.plan.eval_time`'s (from the batches it runs); a generation's
(:func:`inference_time`) is bound by memory bandwidth: each new token reads every weight once, and the GPUs of a
``device_map`` work one after the other, so one GPU's bandwidth (:data:`HBM_TB_S`, datasheets) bounds it from below.

This module imports without torch (the Snakefile's config layer calls :func:`plan_gpus`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping

from llmpipe.plan.memory_time import TIGHT, inference_memory

#: Share of each GPU's memory ``device_map`` may fill with weights (the rest: KV cache, activations, CUDA context).
DEVICE_MAP_SHARE = 0.9

#: HBM bandwidth in TB/s (10**12 bytes/s) by ``gpu_type`` (vendor datasheets), for generation's time bound.
HBM_TB_S: dict[str, float] = {
    'h100': 3.35, 'h100-pcie': 2.0, 'h100-nvl': 3.9, 'h200': 4.8, 'h200-nvl': 4.8, 'a100-80gb': 2.039,
    'a100-40gb': 1.555, 'b200': 8.0, 'l40s': 0.864, 'mi300x': 5.3,
}


def plan_gpus(rc: Mapping, step: str, *, capacity_gb: float, section_gpus: int, node_gpus: int,
              requested: int | None = None, batch_size: int = 1, shared_prefix: bool = False) -> dict:
    """The GPUs an ``eval`` or ``generate`` job of the run gets, and its per-GPU memory plan there.

    Args:
        rc: the run's merged settings (``arch`` with ``d_model``; ``data.concat_tokens``).
        step: ``eval`` or ``generate``.
        capacity_gb: one GPU's memory in GiB (:func:`llmpipe.plan.memory_time.gpu_memory_gb`).
        section_gpus: the step section's ``resources.gpus_per_node`` (the count for a model that fits one GPU).
        node_gpus: the GPUs of one node of the run (``models.<run>.resources.gpus_per_node``).
        requested: the run's ``step_resources.<step>.gpus_per_node`` when set (wins over the plan).
        batch_size: evaluation's ``eval.batch_size`` (sequences per GPU); generation 1.
        shared_prefix: evaluation with ``eval.icl_batches: shared_prefix`` (its cache counts on one GPU only).

    Returns:
        ``{'gpus': N, 'source': 'override' | 'one GPU fits' | 'node', 'memory': inference_memory(...) over N GPUs}``.
    """
    one = inference_memory(rc, step=step, batch_size=batch_size, gpus=1, shared_prefix=shared_prefix)
    if requested is not None:
        n, source = int(requested), 'override'
    elif one['total_gb'] <= TIGHT * capacity_gb:
        n, source = max(1, int(section_gpus)), 'one GPU fits'
    else:
        n, source = max(1, int(node_gpus), int(section_gpus)), 'node'
    mem = one if n == 1 else inference_memory(rc, step=step, batch_size=batch_size, gpus=n)
    return {'gpus': n, 'source': source, 'memory': mem}


def inference_time(rc: Mapping, step: str, *, gpus: int, gpu_type: str, basis: Mapping | None = None,
                   new_tokens: int = 0, weights_gb: float = 0.0, overheads: Mapping | None = None) -> dict | None:
    """Projected duration of a generation (``new_tokens`` tokens, each reading ``weights_gb`` GiB of weights once)
    on ``gpus`` GPUs of ``gpu_type``. (An evaluation's plan is :mod:`llmpipe.plan.eval_time`'s.)

    With ``overheads`` (:func:`llmpipe.plan.memory_time.job_overheads`): the job's start (``generate_start_s``)
    plus, per new token, the larger of ``generate_s_per_token_per_layer`` x blocks (batch-1 decoding is bound by
    kernel launches) and the bandwidth bound; without them, the bandwidth bound alone. ``basis`` is unused (kept
    for callers that pass the training basis).

    Returns ``{'seconds', 'basis': text}``, or None for another step or without the GPU's bandwidth.
    """
    bw = HBM_TB_S.get(str(gpu_type).lower())
    if step != 'generate' or not bw or new_tokens <= 0:
        return None
    bound = weights_gb * 2**30 / (bw * 1e12)
    if overheads:
        per_token = max(bound, overheads['generate_s_per_token_per_layer'] * int(rc['arch']['n_layers']))
        seconds = overheads['generate_start_s'] + new_tokens * per_token
        return {'seconds': seconds, 'basis': f"start {overheads['generate_start_s']:.0f} s + {new_tokens} new "
                                             f"tokens x {per_token * 1e3:.1f} ms ({overheads['source']})"}
    return {'seconds': new_tokens * bound, 'basis': f"lower bound: {new_tokens} new tokens x {weights_gb:.0f} "
                                                    f"GiB of weights read at {bw} TB/s ({gpu_type} HBM), one GPU "
                                                    f"at a time"}


# ------------------------------------------------------------------------------------------- in the job (torch)

def per_rank_batches(batches: int | None, world_size: int) -> int | None:
    """A batch limit over all ranks (``None`` or negative: every batch) as each rank's share, rounded up."""
    return batches if batches is None or int(batches) < 0 else math.ceil(int(batches) / world_size)


def foundry_parallel_settings(world_size: int, on_gpu: bool, eval_subset_num_batches: int,
                              icl_subset_num_batches: int | None) -> dict:
    """The llm-foundry evaluate config keys for ``world_size`` processes: none for one; for more, FSDP
    ``FULL_SHARD`` (``fsdp_config``), the batch limits per rank and ``model_init_device`` (the caller puts it in
    the model's config).

    The limits of one process (``eval_subset_num_batches``: -1 for every batch; ``icl_subset_num_batches``: None
    for every batch) count batches over all ranks, and composer applies them per rank, so each rank gets the
    ceiling of its share. An ICL task's ``DistributedSampler`` deals items out in turn, so its first k batches on
    each of n ranks hold the items of the first n x k batches of one process: the same items are scored. The
    held-out split's streaming dataset gives each rank a contiguous part instead: with every batch (-1) the same
    sequences are scored (the split padded by at most n - 1 repeated sequences), with fewer as many sequences but
    other ones.

    On GPUs rank 0 alone reads the weights (``init_device: mixed``) and FSDP sends each rank its shard
    (``sync_module_states``: a 70B model is read once, not once per GPU); torch's FSDP syncs module states only from
    GPUs, so on a host without one (the CPU test) every rank reads the weights (``init_device: cpu``).
    """
    if int(world_size) <= 1:
        return {}
    return {"fsdp_config": {"sharding_strategy": "FULL_SHARD", "mixed_precision": "DEFAULT",
                            "sync_module_states": bool(on_gpu), "use_orig_params": True, "limit_all_gathers": True,
                            "state_dict_type": "full"},
            "eval_subset_num_batches": per_rank_batches(eval_subset_num_batches, int(world_size)),
            "icl_subset_num_batches": per_rank_batches(icl_subset_num_batches, int(world_size)),
            "model_init_device": "mixed" if on_gpu else "cpu"}


@contextlib.contextmanager
def node_scratch(dist_env: Mapping) -> Iterator[str]:
    """A node-local scratch folder for llm-foundry's evaluator, the same for every process of the job on this node:
    its ICL loader has local rank 0 copy each task file into the working folder while the other ranks wait for that
    path (``dist.local_rank_zero_download_and_wait``), so the ranks must share it.

    Args:
        dist_env: :func:`llmpipe.dispatch.rendezvous.export_dist_env`'s values (``world_size``, ``local_rank``, ``job_id``,
            ``master_port``). One process: a fresh temporary folder. More: ``llmpipe-eval-<job>-<restart>-<port>``
            under the temporary folder, removed by local rank 0 when the evaluation is over.
    """
    if int(dist_env.get("world_size", 1)) <= 1:
        with tempfile.TemporaryDirectory(prefix="llmpipe-eval-") as folder:
            yield folder
        return
    name = (f"llmpipe-eval-{dist_env.get('job_id', 'job')}-{os.environ.get('SLURM_RESTART_COUNT', '0')}-"
            f"{dist_env.get('master_port', '')}")
    folder = os.path.join(tempfile.gettempdir(), name)
    os.makedirs(folder, exist_ok=True)
    try:
        yield folder
    finally:
        if int(dist_env.get("local_rank", 0)) == 0:
            shutil.rmtree(folder, ignore_errors=True)


def generation_placement(gpus: int | None) -> dict:
    """Where generation puts the model: ``{'device_map', 'max_memory', 'gpus'}`` for
    ``AutoModelForCausalLM.from_pretrained(device_map=..., max_memory=...)``.

    Args:
        gpus: the GPUs the job was given (``resources.gpus_per_node``); None: every visible GPU. Capped at the
            visible ones; none visible (or 0): everything on the CPU.
    """
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = visible if gpus is None else min(int(gpus), visible)
    if n <= 0:
        return {'device_map': {"": "cpu"}, 'max_memory': None, 'gpus': 0}
    if n == 1:
        return {'device_map': {"": "cuda:0"}, 'max_memory': None, 'gpus': 1}
    cap = {i: int(torch.cuda.get_device_properties(i).total_memory * DEVICE_MAP_SHARE) for i in range(n)}
    return {'device_map': "balanced", 'max_memory': cap, 'gpus': n}
