"""FP8 training through torchao's float8 linear layers (train setting ``fp8``).

``train.fp8`` swaps the model's ``nn.Linear`` layers for torchao's ``Float8Linear``
(``torchao.float8.convert_to_float8_training``): each matmul of the forward and backward casts its operands to
float8 (e4m3 forward, e5m2 gradients for ``tensorwise``; e4m3 with one scale per row for ``rowwise``) with dynamic
scales computed from the current amax, and runs on the GPU's FP8 tensor cores (``torch._scaled_mm``); weights,
gradients and optimizer state stay in their usual precision, and checkpoints keep the same keys. The recipes are
torchao's (https://github.com/pytorch/ao/tree/main/torchao/float8); the filter and the llm-foundry hook are ours.

Kept in bf16 (:func:`fp8_module_filter`): the embedding and the output layer (a linear sharing its weight with an
``nn.Embedding``, a model's ``get_output_embeddings()``, or one named ``lm_head``/``output``/``embed_out``), and
every linear whose ``in_features`` or ``out_features`` is not a multiple of 16 (``_scaled_mm`` needs that) or is
below ``min_features`` (small matmuls run slower in FP8 than in bf16: the casts cost more than the matmul saves).

The conversion runs in the composer callback ``llmpipe_fp8`` (llm-foundry's callbacks registry,
:func:`register`) at ``Event.INIT``: after llm-foundry built the model and the optimizer, before composer wraps the
model in FSDP and compiles it. ``Float8Linear`` keeps the ``nn.Linear``'s parameter objects, so the optimizer built
before stays valid. The callback's constructor checks the stack (:func:`require_fp8_runtime`: torchao importable,
a GPU of compute capability 8.9 or more, 9.0 for ``rowwise``) before llm-foundry builds the model or the loaders.

Versions: torchao 0.11.0 with the pinned torch 2.7.0 (``envs/requirements.lock``; torchao 0.12 is built for torch
2.7.1), torchao 0.17.0 with torch 2.11 (the H200 machine). Plan-time checks (:func:`check_fp8`) import neither.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

from llmpipe.config.schema import node_at
from llmpipe.config.settings import ConfigError

#: ``train.fp8.recipe`` values: torchao's ``Float8LinearRecipeName`` names.
RECIPES = ("tensorwise", "rowwise")
#: Lowest CUDA compute capability with FP8 tensor cores per recipe (Ada 8.9: tensorwise; rowwise scaling in
#: ``torch._scaled_mm`` needs Hopper, 9.0).
MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0)}
#: torchao versions known to work, by torch minor version (the fix of a missing-torchao error names the one for the
#: installed torch).
TORCHAO_FOR_TORCH = {"2.7": "0.11.0", "2.11": "0.17.0"}
#: Names of output layers (last part of the module path) kept in bf16 even when untied.
OUTPUT_LAYER_NAMES = frozenset({"lm_head", "output", "embed_out"})
#: The callback's name in llm-foundry's callbacks registry.
CALLBACK_NAME = "llmpipe_fp8"


def fp8_defaults() -> dict:
    """The FP8 settings a value leaves out, from the schema (``train.fp8``'s ``x-default`` of ``recipe`` and
    ``min_features``): the recipe of ``fp8: true`` and of a mapping without one, and the smallest input or output
    features of a linear trained in FP8 (fewer stay bf16), e.g. ``{"recipe": "tensorwise", "min_features": 1024}``."""
    props = next(branch["properties"] for branch in node_at("#/$defs/train")["properties"]["fp8"]["anyOf"]
                 if branch.get("type") == "object")   # the mapping form {recipe, min_features}
    return {"recipe": props["recipe"]["x-default"], "min_features": int(props["min_features"]["x-default"])}


def fp8_settings(train: Mapping, where: str = "train") -> dict | None:
    """The FP8 settings of a run's ``train`` section.

    ``fp8`` is ``false``/``null`` (off, the default), ``true`` (:func:`fp8_defaults`), a recipe name
    (``tensorwise`` | ``rowwise``), or a mapping ``{recipe: tensorwise | rowwise | null, min_features: int | null}``
    (``min_features`` null: :func:`fp8_defaults`; at least 16).

    Returns:
        None when off, else ``{"recipe": str, "min_features": int}``.

    Raises:
        ConfigError: any other value, naming ``{where}.fp8`` (or the key under it) and the fix.
    """
    value = train.get("fp8")  # not written: off
    if value is None or value is False:
        return None
    default = fp8_defaults()
    if value is True:
        return default
    if isinstance(value, str):
        if value.strip().lower() in RECIPES:
            return {"recipe": value.strip().lower(), "min_features": default["min_features"]}
        raise ConfigError(f"{where}.fp8 is {value!r}; the recipes are {' | '.join(RECIPES)}. Fix: fp8: "
                          f"{{recipe: {default['recipe']}}} (or false for bf16).")
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}.fp8 is {value!r}; it must be false, true, a recipe ({' | '.join(RECIPES)}) or "
                          f"a mapping {{recipe: <{'|'.join(RECIPES)}>, min_features: <int>}}.")
    unknown = sorted(set(value) - {"recipe", "min_features"})
    if unknown:
        raise ConfigError(f"{where}.fp8.{unknown[0]} is not an fp8 setting; it takes recipe and min_features. "
                          f"Fix: remove it.")
    recipe = value.get("recipe")
    recipe = default["recipe"] if recipe is None else str(recipe).strip().lower()
    if recipe not in RECIPES:
        raise ConfigError(f"{where}.fp8.recipe is {value.get('recipe')!r}; it must be one of {', '.join(RECIPES)} "
                          f"(null: {default['recipe']}).")
    low = value.get("min_features")
    if low is None:
        low = default["min_features"]
    if isinstance(low, bool) or not isinstance(low, int) or low < 16:
        raise ConfigError(f"{where}.fp8.min_features must be an integer >= 16 (linears with fewer input or output "
                          f"features stay bf16) or null ({default['min_features']}), got {value.get('min_features')!r}.")
    return {"recipe": recipe, "min_features": int(low)}


def check_fp8(train: Mapping, where: str, gpus_per_node: int, gpus_at: str) -> dict | None:
    """Plan-time checks of ``train.fp8`` (no torch import): the value (:func:`fp8_settings`), then, when on, that
    the run trains on GPUs, in ``amp_bf16`` precision, and that torchao is installed.

    Args:
        train: the run's merged ``train`` section; ``where``: its config path (``models.mpt-1b.train``).
        gpus_per_node: the run's ``resources.gpus_per_node``; ``gpus_at``: where that value is written.

    Returns:
        :func:`fp8_settings`'s value.

    Raises:
        ConfigError: naming ``{where}.fp8`` (or the conflicting setting) and the fix.
    """
    settings = fp8_settings(train, where)
    if settings is None:
        return None
    if int(gpus_per_node) <= 0:
        raise ConfigError(f"{where}.fp8 is on, but {gpus_at} is {gpus_per_node}: FP8 training needs GPUs with FP8 "
                          f"tensor cores (compute capability >= 8.9: H100, H200, L4, L40). Fix: train on such GPUs "
                          f"or set {where}.fp8: false.")
    precision = train.get("precision")
    if precision != "amp_bf16":
        raise ConfigError(f"{where}.fp8 is on with {where}.precision {precision!r}; torchao's float8 layers run "
                          f"inside bf16 autocast (amp_fp8 is composer's TransformerEngine path, another FP8 "
                          f"implementation). Fix: precision: amp_bf16, or fp8: false.")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{where}.fp8 is on, but the torchao package is not installed. Fix: "
                          f"{_install_hint()}, or set {where}.fp8: false.")
    return settings


def _install_hint() -> str:
    pins = ", ".join(f"torchao=={ao} for torch {t}" for t, ao in TORCHAO_FOR_TORCH.items())
    return f"pip install torchao ({pins}; envs/requirements.lock pins it)"


def require_fp8_runtime(recipe: str, where: str = "train.fp8") -> None:
    """Raise unless this process can train with the FP8 ``recipe``: torchao imports and the current CUDA GPU has
    compute capability >= :data:`MIN_CAPABILITY` of the recipe.

    Raises:
        ConfigError: the reason (no torchao, no CUDA GPU, or the GPU's name and capability) and the fix, naming
            ``where``.
    """
    import torch
    try:
        import torchao  # noqa: F401
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"{where} is on, but torchao cannot be imported here ({e}). Fix: {_install_hint()}, or "
                          f"set {where}: false.") from e
    need = MIN_CAPABILITY[recipe]
    gpu = f"compute capability >= {need[0]}.{need[1]}"
    if not torch.cuda.is_available():
        raise ConfigError(f"{where} ({recipe}) is on, but this process sees no CUDA GPU; FP8 training needs one of "
                          f"{gpu} (H100/H200{', L4/L40' if need < (9, 0) else ''}). Fix: run on such a GPU or set "
                          f"{where}: false.")
    have = tuple(torch.cuda.get_device_capability())
    if have < need:
        name = torch.cuda.get_device_name()
        raise ConfigError(f"{where} ({recipe}) is on, but the GPU {name} has compute capability {have[0]}.{have[1]}: "
                          f"no FP8 tensor cores for this recipe (it needs {gpu}). Fix: run on such a GPU "
                          f"(H100/H200), {'use recipe tensorwise (8.9 suffices), ' if recipe == 'rowwise' else ''}"
                          f"or set {where}: false.")


def fp8_module_filter(model: Any, min_features: int) -> Callable[[Any, str], bool]:
    """The ``module_filter_fn`` for ``convert_to_float8_training``: True for the ``nn.Linear`` layers of
    ``model`` that go to FP8.

    False (the layer stays bf16) for the output layer (weight shared with an ``nn.Embedding`` of ``model``, the
    ``get_output_embeddings()`` of any submodule that has it, or a path ending in :data:`OUTPUT_LAYER_NAMES`), for
    in/out features not a multiple of 16, for in or out features below ``min_features``, and for subclasses of
    ``nn.Linear`` (an already converted ``Float8Linear`` among them). Embeddings are no linears and are never
    converted.
    """
    import torch.nn as nn

    keep: set[int] = set()   # id() of weights and modules that stay bf16
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            keep.add(id(mod.weight))
        getter = getattr(mod, "get_output_embeddings", None)
        if callable(getter):
            try:
                out = getter()
            except (NotImplementedError, AttributeError):
                out = None
            if isinstance(out, nn.Module):
                keep.add(id(out))

    def convert(mod: Any, fqn: str) -> bool:
        if type(mod) is not nn.Linear:
            return False  # torchao asks about linears only; a subclass (Float8Linear itself, TE) stays as it is
        if id(mod) in keep or id(mod.weight) in keep or fqn.rsplit(".", 1)[-1] in OUTPUT_LAYER_NAMES:
            return False
        n_in, n_out = mod.in_features, mod.out_features
        if n_in % 16 or n_out % 16:
            return False
        return min(n_in, n_out) >= min_features

    return convert


def convert_model(model: Any, recipe: str, min_features: int) -> list[str]:
    """Swap ``model``'s eligible ``nn.Linear`` layers (:func:`fp8_module_filter`) for torchao ``Float8Linear``
    in place, with torchao's ``recipe`` (``Float8LinearConfig.from_recipe_name``).

    Works on any device (meta and CPU too: nothing is cast until a forward). Parameters are the same objects
    afterwards (an optimizer built before stays valid); ``state_dict`` keys do not change.

    Returns:
        The module paths converted, in ``model.named_modules()`` order.

    Raises:
        ValueError: ``recipe`` is unknown, or no layer qualifies (FP8 would change nothing: the model is too small
            for ``min_features`` or has no linear layers).
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; known: {', '.join(RECIPES)}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert_to_float8_training(model, module_filter_fn=fp8_module_filter(model, min_features),
                               config=Float8LinearConfig.from_recipe_name(recipe))
    done = [name for name, mod in model.named_modules() if isinstance(mod, Float8Linear)]
    if not done:
        raise ValueError(f"train.fp8 converted no layer of {type(model).__name__}: every linear is the output "
                         f"layer, has a dimension that is not a multiple of 16, or is below min_features "
                         f"{min_features}. Fix: lower train.fp8.min_features or set fp8: false.")
    return done


def apply_fp8(cfg: dict, settings: Mapping[str, Any] | None, where: str) -> None:
    """Put a run's FP8 settings (:attr:`llmpipe.config.settings.TrainSettings.fp8`, parsed by :func:`fp8_settings`; None:
    off) into llm-foundry config ``cfg``: the ``llmpipe_fp8`` callback first among ``cfg["callbacks"]`` (so the
    layers are swapped before any other INIT callback, e.g. block compilation, sees them), or none when off (a
    config built for another run does not leak into this one). ``where``: the run's ``train`` section, for the
    callback's messages (``models.mpt-1b.train``)."""
    callbacks = {k: v for k, v in cfg["callbacks"].items() if k != CALLBACK_NAME}
    cfg["callbacks"] = ({CALLBACK_NAME: {**settings, "where": f"{where}.fp8"}} if settings else {}) | callbacks


def register() -> None:
    """Register the composer callback ``llmpipe_fp8`` in llm-foundry's callbacks registry (idempotent).

    Its constructor (``recipe``, ``min_features``, ``where``: the config path for messages) runs
    :func:`require_fp8_runtime`; at ``Event.INIT`` it runs :func:`convert_model` on ``state.model`` and logs the
    number of layers converted.
    """
    from composer.core import Callback, State
    from composer.loggers import Logger
    from llmfoundry.registry import callbacks

    if CALLBACK_NAME in callbacks.get_all():
        return

    class Fp8Training(Callback):
        """Swap the model's linear layers for torchao Float8Linear at Event.INIT (:func:`convert_model`)."""

        def __init__(self, recipe: str, min_features: int, where: str = "train.fp8") -> None:
            require_fp8_runtime(recipe, where)
            self.recipe, self.min_features = recipe, int(min_features)
            self.converted: list[str] = []

        def init(self, state: State, logger: Logger) -> None:
            self.converted = convert_model(state.model, self.recipe, self.min_features)
            print(f"llmpipe: fp8 ({self.recipe}): {len(self.converted)} linear layers in float8, "
                  f"min_features {self.min_features}", flush=True)

    callbacks.register(CALLBACK_NAME, func=Fp8Training)
