"""llmpipe.model.mfu: parameter count and FLOPs against llm-foundry's own model and formula; device detection."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmpipe.model import mfu as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARCHES = [
    # the project's defaults (no_bias, low-precision layernorm, tied embeddings, learned positions)
    {'d_model': 64, 'n_heads': 4, 'n_layers': 2, 'expansion_ratio': 4, 'max_seq_len': 32, 'vocab_size': 101,
     'no_bias': True, 'norm_type': 'low_precision_layernorm'},
    # MPTConfig defaults: biases everywhere
    {'d_model': 48, 'n_heads': 3, 'n_layers': 3, 'expansion_ratio': 2, 'max_seq_len': 16, 'vocab_size': 77},
    # untied output layer, no learned positions (ALiBi), GQA
    {'d_model': 64, 'n_heads': 8, 'n_layers': 2, 'expansion_ratio': 3, 'max_seq_len': 24, 'vocab_size': 50,
     'no_bias': True, 'tie_word_embeddings': False,
     'attn_config': {'attn_type': 'grouped_query_attention', 'kv_n_heads': 2, 'alibi': True}},
    # multi-query attention, non-integer expansion
    {'d_model': 40, 'n_heads': 4, 'n_layers': 1, 'expansion_ratio': 2.5, 'max_seq_len': 8, 'vocab_size': 33,
     'attn_config': {'attn_type': 'multiquery_attention'}},
]


def _mpt_kwargs(arch):
    kw = dict(arch)
    kw['attn_config'] = {**(arch.get('attn_config') or {}), 'attn_impl': 'torch'}
    return kw


@pytest.mark.parametrize('arch', ARCHES)
def test_param_count_matches_instantiated_mpt(arch):
    pytest.importorskip('torch')
    pytest.importorskip('llmfoundry')
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    model = MPTForCausalLM(MPTConfig(**_mpt_kwargs(arch)))
    counted = M.mpt_param_count(arch)
    total = sum(p.numel() for p in model.parameters())
    wte = model.transformer.wte.weight.numel()
    wpe = model.transformer.wpe.weight.numel() if getattr(model.transformer, 'wpe', None) is not None else 0
    assert counted['total'] == total
    assert counted['embedding'] == wte == arch['vocab_size'] * arch['d_model']
    assert counted['positional'] == wpe
    assert counted['non_embedding'] == total - wte - wpe
    if not arch.get('tie_word_embeddings', True):
        assert model.lm_head.weight.numel() == wte   # untied output layer counted once, as a matmul
    assert counted['non_embedding'] > 0


@pytest.mark.parametrize('arch', ARCHES)
def test_flops_match_llmfoundry_flops_per_batch(arch):
    torch = pytest.importorskip('torch')
    pytest.importorskip('llmfoundry')
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    model = ComposerMPTCausalLM(loss_fn='torch_crossentropy', **_mpt_kwargs(arch))
    # llm-foundry's own active-parameter count (what its FLOPs use)
    assert M.mpt_param_count(arch)['active'] == model.n_active_params
    for b, s in ((2, arch['max_seq_len']), (3, arch['max_seq_len'] // 2)):
        batch = {'input_ids': torch.zeros(b, s, dtype=torch.long)}
        expected = model.flops_per_batch(batch)
        assert expected > 0
        assert M.flops_per_token(arch, s) * b * s == pytest.approx(expected, rel=1e-12)
    # default sequence length is max_seq_len
    assert M.flops_per_token(arch) == M.flops_per_token(arch, arch['max_seq_len'])


def test_flops_grow_with_sequence_length_by_the_attention_term():
    arch = ARCHES[0]
    d = M.flops_per_token(arch, 2048) - M.flops_per_token(arch, 1024)
    assert d == 12 * arch['n_layers'] * arch['d_model'] * 1024


def test_published_mpt_sizes_are_plausible():
    # MPT-1B / 760M / 125M of the project's config: parameter counts in the expected range
    base = {'expansion_ratio': 4, 'max_seq_len': 2048, 'vocab_size': 50368, 'no_bias': True}
    p125 = M.mpt_param_count({**base, 'd_model': 768, 'n_heads': 12, 'n_layers': 12})['total']
    p1b = M.mpt_param_count({**base, 'd_model': 2048, 'n_heads': 16, 'n_layers': 24})['total']
    assert 120e6 < p125 < 130e6
    assert 1.25e9 < p1b < 1.35e9


@pytest.mark.parametrize('name,dtype,expected', [
    ('NVIDIA H100 80GB HBM3', 'bf16', 989.5e12),
    ('NVIDIA H100 PCIe', 'bf16', 756.5e12),
    ('NVIDIA H100 NVL', 'amp_bf16', 835.5e12),
    ('NVIDIA H200', 'amp_bf16', 989.5e12),
    ('NVIDIA H200 NVL', 'bf16', 835.5e12),
    ('NVIDIA A100-SXM4-40GB', 'bf16', 312e12),
    ('NVIDIA A100-SXM4-80GB', 'fp16', 312e12),
    ('NVIDIA A100 80GB PCIe', 'tf32', 156e12),
    ('NVIDIA B200', 'bf16', 2250e12),
    ('NVIDIA L40S', 'bf16', 362.05e12),
    ('AMD Instinct MI300X', 'bf16', 1307.4e12),
    ('NVIDIA H100 80GB HBM3', 'fp8', 1979e12),
    ('NVIDIA H100 80GB HBM3', 'fp32', 67e12),
])
def test_peak_for_device_names(name, dtype, expected):
    assert M.peak_flops_for_name(name, dtype) == pytest.approx(expected)


def test_unknown_device_and_overrides():
    assert M.peak_flops_for_name('NVIDIA GeForce GTX 1080', 'bf16') is None
    assert M.peak_flops_for_name('NVIDIA GeForce GTX 1080', 'bf16', {'gtx 1080': 8.9e12}) == 8.9e12
    # an override wins over the table, case-insensitively
    assert M.peak_flops_for_name('NVIDIA H100 80GB HBM3', 'bf16', {'H100': 1.0e15}) == 1.0e15
    # a dtype missing for a device gives None, an unknown dtype raises
    assert M.peak_flops_for_name('NVIDIA A100-SXM4-80GB', 'fp8') is None
    with pytest.raises(ValueError):
        M.peak_flops_for_name('NVIDIA H100 80GB HBM3', 'int3')


def test_specific_names_win_over_generic():
    # 'h100 pcie' / 'h200 nvl' must not be read as the SXM parts
    assert M.peak_flops_for_name('NVIDIA H100 PCIe', 'bf16') < M.peak_flops_for_name('NVIDIA H100 80GB HBM3', 'bf16')
    assert M.peak_flops_for_name('NVIDIA H200 NVL', 'bf16') < M.peak_flops_for_name('NVIDIA H200', 'bf16')


def test_detect_on_cpu_returns_none():
    torch = pytest.importorskip('torch')
    if torch.cuda.is_available():
        pytest.skip('a GPU is present')
    assert M.detect_peak_flops('bf16') is None


def test_mfu_arithmetic():
    # 100k tokens/s at 6e9 FLOPs/token on a 1e15 FLOP/s device = 60% MFU
    assert M.mfu(100_000, 6e9, 1e15) == pytest.approx(0.6)
    assert M.mfu(100_000, 6e9, None) is None
    with pytest.raises(ValueError):
        M.mfu(1.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        M.mfu(-1.0, 1.0, 1.0)


def test_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import llmpipe.model.mfu as m\n"
            "assert m.detect_peak_flops is not None\n"
            "print(m.flops_per_token({'d_model': 8, 'n_heads': 2, 'n_layers': 1, 'vocab_size': 10, "
            "'max_seq_len': 4}))\n")
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert float(out.stdout) > 0
