"""The train setting ``fp8`` (llmpipe.train.fp8: torchao float8 training), on the CPU: its validation at plan time, its
place in the training identity, the llm-foundry config that carries it (pretraining and finetuning), which layers
of a tiny MPT the filter converts, and the clear error where the stack cannot run it (no torchao, no FP8 GPU).

The FP8 matmuls themselves need a GPU of compute capability >= 8.9; their speed and loss were measured on an H200
(benchmarks/README.md, FP8 section).
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('llmfoundry')
pytest.importorskip('torchao')

import llmpipe.train.fp8 as F  # noqa: E402
from llmpipe.config.runs import deep_merge, run_config, run_settings, validate_run  # noqa: E402
from llmpipe.config.settings import ConfigError  # noqa: E402
from tests import test_fused_loss as TFL  # noqa: E402

DEFAULT = F.fp8_defaults()['min_features']   # the schema's x-default


def _config(run: str, train: dict, **section) -> dict:
    kind = 'finetunes' if run.endswith('-sft') else 'models'
    return deep_merge(TFL._project_config(), {kind: {run: {'train': train, **section}}})


# ------------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize('value,want', [
    (False, None), (None, None),
    (True, {'recipe': 'tensorwise', 'min_features': DEFAULT}),
    ('tensorwise', {'recipe': 'tensorwise', 'min_features': DEFAULT}),
    (' RowWise ', {'recipe': 'rowwise', 'min_features': DEFAULT}),
    ({}, {'recipe': 'tensorwise', 'min_features': DEFAULT}),
    ({'recipe': 'rowwise'}, {'recipe': 'rowwise', 'min_features': DEFAULT}),
    ({'recipe': None, 'min_features': 2048}, {'recipe': 'tensorwise', 'min_features': 2048}),
    ({'min_features': None}, {'recipe': 'tensorwise', 'min_features': DEFAULT}),
])
def test_fp8_settings(value, want):
    assert F.fp8_settings({'fp8': value}) == want
    assert F.fp8_settings({}) is None   # off by default


@pytest.mark.parametrize('value,key', [
    ('fast', ''), (3, ''), (['tensorwise'], ''), ({'recipe': 'blockwise'}, r'\.recipe'),
    ({'recipe': 'rowwise_with_gw_hp'}, r'\.recipe'), ({'min_features': 8}, r'\.min_features'),
    ({'min_features': '1024'}, r'\.min_features'), ({'min_features': True}, r'\.min_features'),
    ({'recipie': 'rowwise'}, r'\.recipie'),
])
def test_bad_fp8_setting_is_a_config_error(value, key):
    """At plan time, naming the setting (and the key under it), for models and finetunes."""
    with pytest.raises(ConfigError, match=r'^models\.mpt-125m\.train\.fp8' + key):
        validate_run(_config('mpt-125m', {'fp8': value}), 'mpt-125m')
    with pytest.raises(ConfigError, match=r'^finetunes\.mpt-tiny-sft\.train\.fp8' + key):
        validate_run(_config('mpt-tiny-sft', {'fp8': value}, resources={'gpus_per_node': 1}), 'mpt-tiny-sft')


def test_fp8_plans_on_gpus_in_bf16():
    rc = validate_run(_config('mpt-125m', {'fp8': 'rowwise'}), 'mpt-125m')
    assert rc['train']['fp8'] == 'rowwise'
    validate_run(_config('mpt-tiny-sft', {'fp8': True, 'precision': 'amp_bf16'}, resources={'gpus_per_node': 1}),
                 'mpt-tiny-sft')


def test_fp8_without_gpus_fails_at_plan_time():
    """mpt-tiny trains on CPU (gpus_per_node 0): FP8 cannot run there; the message names both settings."""
    with pytest.raises(ConfigError, match=r'^models\.mpt-tiny\.train\.fp8 is on, but models\.mpt-tiny\.resources'
                                          r'\.gpus_per_node is 0: FP8 training needs GPUs .*compute capability '
                                          r'>= 8\.9.*Fix:'):
        validate_run(_config('mpt-tiny', {'fp8': True}), 'mpt-tiny')


@pytest.mark.parametrize('precision', ['fp32', 'amp_fp16', 'amp_fp8'])
def test_fp8_needs_bf16_autocast(precision):
    with pytest.raises(ConfigError, match=rf"^models\.mpt-125m\.train\.fp8 is on with models\.mpt-125m\.train\."
                                          rf"precision '{precision}'.*Fix: precision: amp_bf16"):
        validate_run(_config('mpt-125m', {'fp8': True, 'precision': precision}), 'mpt-125m')


def test_fp8_without_torchao_fails_at_plan_time(monkeypatch):
    real = F.importlib.util.find_spec
    monkeypatch.setattr(F.importlib.util, 'find_spec', lambda name, *a: None if name == 'torchao' else real(name, *a))
    with pytest.raises(ConfigError, match=r'^models\.mpt-125m\.train\.fp8 is on, but the torchao package is not '
                                          r'installed\. Fix: pip install torchao \(torchao==0\.11\.0 for torch 2\.7'):
        validate_run(_config('mpt-125m', {'fp8': True}), 'mpt-125m')
    validate_run(_config('mpt-125m', {'fp8': False}), 'mpt-125m')   # off: torchao is not needed


def test_schema_refuses_a_wrong_fp8_value():
    from tests.test_config_errors import schema_error
    msg = schema_error({'models': {'mpt-125m': {'train': {'fp8': 'fast'}}}})
    assert msg.startswith("models.mpt-125m.train.fp8 is 'fast'; it must be false, true, tensorwise, rowwise"), msg
    msg = schema_error({'models': {'mpt-125m': {'train': {'fp8': {'recipie': 'rowwise'}}}}})
    assert msg.startswith('models.mpt-125m.train.fp8.recipie is not a fp8 setting; did you mean recipe?'), msg


# ------------------------------------------------------------------------------------------- identity

def test_fp8_is_part_of_the_training_identity():
    """FP8 changes the numbers: it is no speed-only setting, and turning it on (or changing the recipe or the layers
    it covers) retrains; the spellings of off, and of one recipe, name one training each."""
    from llmpipe.config.runs import SPEED_ONLY_TRAIN_KEYS
    from llmpipe.steps.training import train_identity
    assert 'fp8' not in SPEED_ONLY_TRAIN_KEYS
    for run in ('mpt-125m', 'mpt-tiny-sft'):
        def ident(value, _run=run):
            return train_identity(_config(_run, {} if value == 'absent' else {'fp8': value}), _run)
        off = ident('absent')
        assert ident(False) == off and ident(None) == off
        on = ident(True)
        assert on != off and on['train']['fp8'] == {'recipe': 'tensorwise', 'min_features': DEFAULT}
        assert ident('tensorwise') == on and ident({'recipe': 'tensorwise', 'min_features': DEFAULT}) == on
        assert ident('rowwise') != on and ident({'min_features': 2048}) != on


def test_finetune_identity_follows_the_base_models_fp8():
    from llmpipe.steps.training import train_identity
    base = train_identity(TFL._project_config(), 'mpt-tiny-sft')
    fp8_base = _config('mpt-tiny', {'fp8': True})
    assert train_identity(fp8_base, 'mpt-tiny-sft') != base


# ------------------------------------------------------------------------------------------- llm-foundry config

def test_train_and_finetune_configs_carry_the_fp8_callback():
    """The callback goes first (before compile_blocks and the run monitor), with the recipe, the size limit and the
    setting's path for messages; none when off."""
    from llmpipe.train.finetune import foundry_finetune_config
    from llmpipe.train.pretrain import foundry_train_config

    def built(cfg, run='mpt-125m'):
        return foundry_train_config(run_settings(cfg, run), data_dir=None, save_folder=None, world_size=1)

    assert F.CALLBACK_NAME not in built(TFL._project_config())['callbacks']
    cfg = built(_config('mpt-125m', {'fp8': {'recipe': 'rowwise', 'min_features': 2048}, 'compile': 'blocks'}))
    assert list(cfg['callbacks'])[0] == F.CALLBACK_NAME and 'llmpipe_compile_blocks' in cfg['callbacks']
    assert cfg['callbacks'][F.CALLBACK_NAME] == {'recipe': 'rowwise', 'min_features': 2048,
                                                 'where': 'models.mpt-125m.train.fp8'}
    cfg = built(_config('mpt-125m', {'fp8': True}), 'mpt-125m')
    assert cfg['compile_config'] == {}   # composer's torch.compile of the converted model, after FSDP
    on_gpu = {'resources': {'gpus_per_node': 1}, 'train': {'fp8': 'tensorwise', 'precision': 'amp_bf16'}}
    ft_config = deep_merge(TFL._project_config(), {'finetunes': {'mpt-tiny-sft': on_gpu}})
    ft = foundry_finetune_config(run_settings(ft_config, 'mpt-tiny-sft'),
                                 base_path='/nonexistent', save_folder=None, world_size=1, instructions_dir=None)
    assert list(ft['callbacks'])[0] == F.CALLBACK_NAME
    assert ft['callbacks'][F.CALLBACK_NAME]['where'] == 'finetunes.mpt-tiny-sft.train.fp8'


# ------------------------------------------------------------------------------------------- the layer filter

def _tiny_mpt(composer: bool = True, **extra):
    """The project's mpt-tiny (d_model 128, 2 layers) through llm-foundry; FFN width 520 (not a multiple of 16)
    unless ``extra`` says otherwise."""
    from llmfoundry.models.mpt import ComposerMPTCausalLM, MPTConfig, MPTForCausalLM
    arch = run_config(TFL._project_config(), 'mpt-tiny')['arch']
    kw = dict(d_model=arch['d_model'], n_heads=arch['n_heads'], n_layers=arch['n_layers'],
              max_seq_len=arch['max_seq_len'], vocab_size=arch['vocab_size'], no_bias=True,
              norm_type='layernorm', expansion_ratio=4.0625, attn_config={'attn_impl': 'torch'})
    kw.update(extra)
    torch.manual_seed(0)
    return ComposerMPTCausalLM(loss_fn='torch_crossentropy', **kw) if composer else MPTForCausalLM(MPTConfig(**kw))


def _linears(model) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_filter_converts_block_linears_and_keeps_output_embedding_and_odd_sizes():
    model = _tiny_mpt(tie_word_embeddings=False)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    converted = F.convert_model(model, 'tensorwise', min_features=128)
    blocks = [f'model.transformer.blocks.{i}' for i in range(2)]
    assert converted == [f'{b}.attn.{n}' for b in blocks for n in ('Wqkv', 'out_proj')]
    kinds = _linears(model)
    for b in blocks:   # FFN 128 -> 520 -> 128: 520 is no multiple of 16 (torch._scaled_mm needs one)
        assert kinds[f'{b}.ffn.up_proj'] == kinds[f'{b}.ffn.down_proj'] == 'Linear'
    assert kinds['model.lm_head'] == 'Linear'                         # untied output layer stays bf16
    assert type(model.model.transformer.wte).__name__ == 'SharedEmbedding'   # embedding untouched
    # same parameter objects (the optimizer llm-foundry built before INIT stays valid), same checkpoint keys
    assert all(p is params[n] for n, p in model.named_parameters()) and list(model.state_dict()) == keys
    assert F.convert_model(model, 'tensorwise', min_features=128) == converted   # twice: nothing converted twice


def test_filter_min_features_and_multiple_of_16():
    model = _tiny_mpt(expansion_ratio=4)   # FFN 512: every block linear is a multiple of 16
    assert len(F.convert_model(model, 'rowwise', min_features=128)) == 8
    small = _tiny_mpt(expansion_ratio=4)
    with pytest.raises(ValueError, match=r'converted no layer of ComposerMPTCausalLM.*min_features 129'):
        F.convert_model(small, 'tensorwise', min_features=129)   # every linear has 128 in or out features
    with pytest.raises(ValueError, match=r'converted no layer.*min_features 1024'):
        F.convert_model(_tiny_mpt(expansion_ratio=4), 'tensorwise', DEFAULT)   # the default keeps a tiny model bf16


def test_filter_keeps_the_output_layer_of_a_hugging_face_model():
    """A finetune trains llm-foundry's hf_causal_lm: the output layer is found by get_output_embeddings(), also
    under another name, and a tied one (the embedding's weight) is never a Float8Linear."""
    hf = _tiny_mpt(composer=False, tie_word_embeddings=False, expansion_ratio=4)
    hf.unembed = hf.lm_head   # another name for the same module
    keep = F.fp8_module_filter(hf, 16)
    assert not keep(hf.lm_head, 'unembed') and keep(hf.transformer.blocks[0].attn.Wqkv, 'x')
    tied = _tiny_mpt(composer=False, expansion_ratio=4)
    fake_head = torch.nn.Linear(128, 4096, bias=False)
    fake_head.weight = tied.transformer.wte.weight   # a linear sharing the embedding's weight
    tied.extra_head = fake_head
    assert not F.fp8_module_filter(tied, 16)(fake_head, 'extra_head')


# ------------------------------------------------------------------------------------------- the stack check

def _fake_gpu(monkeypatch, capability, name='NVIDIA A100-SXM4-80GB'):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda *a: capability)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda *a: name)


def _build_callback(**kw):
    from llmfoundry.utils.builders import build_callback
    F.register()
    return build_callback(F.CALLBACK_NAME, kwargs={'where': 'models.mpt-1b.train.fp8', 'min_features': DEFAULT, **kw})


def test_callback_fails_early_without_a_gpu():
    """llm-foundry builds callbacks before the model and the loaders: the reason comes before any work."""
    if torch.cuda.is_available():
        pytest.skip('this machine has a GPU')
    with pytest.raises(ConfigError, match=r'^models\.mpt-1b\.train\.fp8 \(tensorwise\) is on, but this process sees '
                                          r'no CUDA GPU; FP8 training needs one of compute capability >= 8\.9.*Fix:'):
        _build_callback(recipe='tensorwise')


def test_callback_names_a_gpu_without_fp8(monkeypatch):
    _fake_gpu(monkeypatch, (8, 0))
    with pytest.raises(ConfigError, match=r'the GPU NVIDIA A100-SXM4-80GB has compute capability 8\.0: no FP8 tensor '
                                          r'cores for this recipe \(it needs compute capability >= 8\.9\)'):
        _build_callback(recipe='tensorwise')
    _fake_gpu(monkeypatch, (8, 9), 'NVIDIA L40S')
    with pytest.raises(ConfigError, match=r'NVIDIA L40S has compute capability 8\.9.*>= 9\.0.*use recipe tensorwise'):
        _build_callback(recipe='rowwise')
    _build_callback(recipe='tensorwise')   # Ada runs tensorwise


def test_callback_without_torchao(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0), 'NVIDIA H200')
    monkeypatch.setitem(__import__('sys').modules, 'torchao', None)   # import torchao raises ImportError
    with pytest.raises(ConfigError, match=r'train\.fp8 is on, but torchao cannot be imported here.*Fix: pip install '
                                          r'torchao'):
        _build_callback(recipe='tensorwise')


def test_callback_converts_the_model_at_init(monkeypatch):
    """On a capable GPU (here: its capability faked) the callback swaps the layers at Event.INIT, i.e. on the model
    composer has before it wraps it in FSDP or compiles it."""
    _fake_gpu(monkeypatch, (9, 0), 'NVIDIA H200')
    cb = _build_callback(recipe='rowwise', min_features=128)
    model = _tiny_mpt(expansion_ratio=4)
    cb.init(types.SimpleNamespace(model=model), logger=None)
    assert len(cb.converted) == 8
    assert {type(m).__name__ for n, m in model.named_modules() if n.endswith(('Wqkv', 'up_proj'))} == {'Float8Linear'}
    assert model.model.transformer.blocks[0].attn.Wqkv.config.cast_config_input.scaling_granularity.value == 'axiswise'
