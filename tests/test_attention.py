"""llmpipe.model.attention (SDPA) against llm-foundry's reference attention (``attn_impl: torch``), on the CPU in float32.

Each case draws fresh random inputs and compares outputs and the gradients w.r.t. query, key, value (and the
returned KV cache) with ``scaled_multihead_dot_product_attention``; a tiny MPT built with the SDPA attention class
must give the reference model's logits and gradients.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('llmfoundry')

from llmfoundry.layers_registry import attention_classes, attention_implementations  # noqa: E402
from llmfoundry.models.layers.attention import (  # noqa: E402
    build_alibi_bias,
    scaled_multihead_dot_product_attention as reference,
)

import llmpipe.model.attention as A  # noqa: E402

ATOL = 2e-5
RTOL = 1e-5


@pytest.fixture(autouse=True)
def _fp32_deterministic():
    torch.manual_seed(1234)
    yield


def _qkv(b, s_q, s_k, n_heads, kv_heads, d, *, grad=True):
    q = torch.randn(b, s_q, n_heads * d, dtype=torch.float32)
    k = torch.randn(b, s_k, kv_heads * d, dtype=torch.float32)
    v = torch.randn(b, s_k, kv_heads * d, dtype=torch.float32)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _run(fn, q, k, v, **kw):
    out, w, pkv = fn(q, k, v, **kw)
    return out, w, pkv


def _compare(kw, b=2, s_q=16, s_k=16, n_heads=4, kv_heads=4, d=8, check_grad=True):
    """Run both implementations on the same fresh random inputs; assert equal outputs and input gradients."""
    q, k, v = _qkv(b, s_q, s_k, n_heads, kv_heads, d)
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out_ref, _, pkv_ref = _run(reference, q, k, v, n_heads=n_heads, kv_n_heads=kv_heads, **kw)
    out, w, pkv = _run(A.sdpa_attention, q2, k2, v2, n_heads=n_heads, kv_n_heads=kv_heads, **kw)
    assert w is None
    assert out.shape == out_ref.shape == (b, s_q, n_heads * d)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out_ref, atol=ATOL, rtol=RTOL)
    if check_grad:
        g = torch.randn_like(out_ref)
        out_ref.backward(g)
        out.backward(g)
        for a, r, name in ((q2, q, 'query'), (k2, k, 'key'), (v2, v, 'value')):
            assert a.grad is not None and torch.isfinite(a.grad).all(), name
            assert r.grad.abs().sum() > 0, name  # the gradient is not trivially zero
            torch.testing.assert_close(a.grad, r.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f'{name}: {m}')
    return out, out_ref, pkv, pkv_ref


def test_registered_on_import_and_idempotent():
    assert attention_implementations.get('sdpa') is A.sdpa_attention
    cls = attention_classes.get('sdpa_multihead_attention')
    A.register()
    A.register()
    assert attention_implementations.get('sdpa') is A.sdpa_attention
    assert attention_classes.get('sdpa_multihead_attention') is cls
    for name in A.SDPA_ATTN_TYPES.values():
        assert name in attention_classes.get_all()
    from llmfoundry.registry import callbacks
    assert callbacks.get('drop_full_attention_mask') is A.DropFullAttentionMask


def test_causal():
    _compare({'is_causal': True})


def test_not_causal():
    _compare({'is_causal': False})


def test_softmax_scale():
    _compare({'is_causal': True, 'softmax_scale': 0.37})


def test_key_padding_mask():
    b, s = 3, 16
    kpm = torch.ones(b, s, dtype=torch.bool)
    kpm[0, 11:] = False   # right padding (finetuning)
    kpm[1, 5:] = False
    _compare({'is_causal': True, 'key_padding_mask': kpm}, b=b, s_q=s, s_k=s)


def test_key_padding_mask_fully_masked_rows_match():
    # Left padding (generation): the first query rows see only padding. The reference gives them a uniform
    # average (finite minimum); SDPA must not give NaN there.
    b, s = 2, 12
    kpm = torch.ones(b, s, dtype=torch.bool)
    kpm[0, :4] = False
    _compare({'is_causal': True, 'key_padding_mask': kpm}, b=b, s_q=s, s_k=s, check_grad=False)


def test_mpt_style_padding_bias_plus_mask():
    # MPT's torch path folds the padding mask into a (b, 1, 1, s) float32 bias AND passes key_padding_mask.
    b, s = 2, 16
    kpm = torch.ones(b, s, dtype=torch.bool)
    kpm[1, 9:] = False
    bias = torch.zeros(b, 1, 1, s).masked_fill(~kpm.view(b, 1, 1, s), torch.finfo(torch.float32).min)
    _compare({'is_causal': True, 'key_padding_mask': kpm, 'attn_bias': bias}, b=b, s_q=s, s_k=s)


@pytest.mark.parametrize('kv_heads', [1, 2])
def test_grouped_query(kv_heads):
    _compare({'is_causal': True}, n_heads=4, kv_heads=kv_heads)


def test_grouped_query_with_padding():
    kpm = torch.ones(2, 16, dtype=torch.bool)
    kpm[0, 10:] = False
    _compare({'is_causal': True, 'key_padding_mask': kpm}, n_heads=8, kv_heads=2)


def test_alibi_causal():
    n_heads, s = 4, 16
    # MPT builds a (1, h, 1, max_seq_len) causal ALiBi bias and the attention slices its last s_k columns.
    bias = build_alibi_bias(n_heads, 32, full=False, alibi_bias_max=8, dtype=torch.float32)
    assert bias.abs().max() > 0
    _compare({'is_causal': True, 'attn_bias': bias}, n_heads=n_heads, s_q=s, s_k=s)


def test_alibi_full_not_causal():
    n_heads, s = 4, 16
    bias = build_alibi_bias(n_heads, s, full=True, alibi_bias_max=8, dtype=torch.float32)
    _compare({'is_causal': False, 'attn_bias': bias}, n_heads=n_heads, s_q=s, s_k=s)


def test_sequence_id():
    from llmfoundry.models.mpt.modeling_mpt import apply_sequence_id
    b, s = 2, 16
    seq_id = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    bias = apply_sequence_id(torch.zeros(1, 1, s, s), seq_id, s)
    assert bias.shape == (b, 1, s, s)
    _compare({'is_causal': True, 'attn_bias': bias}, b=b, s_q=s, s_k=s)


def test_sequence_id_with_alibi():
    from llmfoundry.models.mpt.modeling_mpt import apply_sequence_id
    b, s, h = 2, 16, 4
    seq_id = torch.tensor([[0] * 9 + [1] * 7, [0] * 3 + [1] * 13])
    bias = build_alibi_bias(h, s, full=True, dtype=torch.float32)
    bias = apply_sequence_id(bias, seq_id, s)
    _compare({'is_causal': True, 'attn_bias': bias}, b=b, s_q=s, s_k=s, n_heads=h)


def test_bias_shape_error_like_reference():
    q, k, v = _qkv(1, 8, 8, 2, 2, 4, grad=False)
    bad = torch.zeros(1, 2, 8, 5)
    with pytest.raises(RuntimeError, match='broadcast'):
        reference(q, k, v, n_heads=2, kv_n_heads=2, attn_bias=bad)
    with pytest.raises(RuntimeError, match='broadcast'):
        A.sdpa_attention(q, k, v, n_heads=2, kv_n_heads=2, attn_bias=bad)


@pytest.mark.parametrize('kv_heads', [4, 2])
def test_kv_cache_prefill_then_decode(kv_heads):
    n_heads, d, b, s = 4, 8, 2, 10
    # prefill: start a cache with ()
    out, out_ref, pkv, pkv_ref = _compare({'is_causal': True, 'past_key_value': ()}, b=b, s_q=s, s_k=s,
                                          n_heads=n_heads, kv_heads=kv_heads, d=d, check_grad=False)
    assert pkv[0].shape == pkv_ref[0].shape == (b, kv_heads, d, s)     # keys (b, h, d, s)
    assert pkv[1].shape == pkv_ref[1].shape == (b, kv_heads, s, d)     # values (b, h, s, d)
    torch.testing.assert_close(pkv[0], pkv_ref[0])
    torch.testing.assert_close(pkv[1], pkv_ref[1])
    # two decode steps of one token, each appended to the reference's own cache
    cache, cache_ref = tuple(t.detach() for t in pkv), tuple(t.detach() for t in pkv_ref)
    for step in range(2):
        q, k, v = _qkv(b, 1, 1, n_heads, kv_heads, d)
        q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        o_ref, _, cache_ref = reference(q, k, v, n_heads=n_heads, kv_n_heads=kv_heads, past_key_value=cache_ref,
                                        is_causal=True)
        o, _, cache = A.sdpa_attention(q2, k2, v2, n_heads=n_heads, kv_n_heads=kv_heads, past_key_value=cache,
                                       is_causal=True)
        assert cache[0].shape == (b, kv_heads, d, s + step + 1)
        torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(cache[0], cache_ref[0])
        torch.testing.assert_close(cache[1], cache_ref[1])
        g = torch.randn_like(o)
        o.backward(g)
        o_ref.backward(g)
        torch.testing.assert_close(q2.grad, q.grad, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(v2.grad, v.grad, atol=ATOL, rtol=RTOL)


def test_kv_cache_with_padding_decode():
    n_heads, d, b, s = 4, 8, 2, 6
    _, _, pkv, pkv_ref = _compare({'is_causal': True, 'past_key_value': ()}, b=b, s_q=s, s_k=s, n_heads=n_heads,
                                  kv_heads=n_heads, d=d, check_grad=False)
    kpm = torch.ones(b, s + 1, dtype=torch.bool)
    kpm[0, :2] = False   # left padding
    q, k, v = _qkv(b, 1, 1, n_heads, n_heads, d, grad=False)
    o_ref, _, _ = reference(q, k, v, n_heads=n_heads, kv_n_heads=n_heads, past_key_value=pkv_ref, is_causal=True,
                            key_padding_mask=kpm)
    o, _, _ = A.sdpa_attention(q, k, v, n_heads=n_heads, kv_n_heads=n_heads, past_key_value=pkv, is_causal=True,
                               key_padding_mask=kpm)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_multi_token_query_with_cache_is_bottom_right_causal():
    # s_q > 1 with a longer key sequence (chunked prefill): the reference aligns the causal mask bottom-right.
    n_heads, d, b = 2, 8, 1
    _, _, pkv, pkv_ref = _compare({'is_causal': True, 'past_key_value': ()}, b=b, s_q=5, s_k=5, n_heads=n_heads,
                                  kv_heads=n_heads, d=d, check_grad=False)
    q, k, v = _qkv(b, 3, 3, n_heads, n_heads, d, grad=False)
    o_ref, _, _ = reference(q, k, v, n_heads=n_heads, kv_n_heads=n_heads, past_key_value=pkv_ref, is_causal=True)
    o, _, _ = A.sdpa_attention(q, k, v, n_heads=n_heads, kv_n_heads=n_heads, past_key_value=pkv, is_causal=True)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_no_cache_returns_none():
    q, k, v = _qkv(1, 4, 4, 2, 2, 4, grad=False)
    assert A.sdpa_attention(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True)[2] is None


def test_needs_weights_falls_back_to_reference():
    q, k, v = _qkv(2, 8, 8, 2, 2, 4, grad=False)
    out, w, _ = A.sdpa_attention(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True, needs_weights=True)
    out_r, w_r, _ = reference(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True, needs_weights=True)
    assert w is not None and w.shape == (2, 2, 8, 8)
    torch.testing.assert_close(w, w_r)
    torch.testing.assert_close(out, out_r)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 8))


def test_dropout():
    q, k, v = _qkv(2, 16, 16, 2, 2, 8, grad=False)
    base = A.sdpa_attention(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True)[0]
    # not training: no dropout, equal to the reference
    ev = A.sdpa_attention(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True, dropout_p=0.5, training=False)[0]
    torch.testing.assert_close(ev, base)
    # training: dropout changes the output, and its mean over many draws approaches the dropout-free output
    torch.manual_seed(0)
    outs = torch.stack([
        A.sdpa_attention(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True, dropout_p=0.3, training=True)[0]
        for _ in range(400)
    ])
    assert not torch.allclose(outs[0], base)
    assert torch.isfinite(outs).all()
    err = (outs.mean(0) - base).abs().mean() / base.abs().mean()
    assert err < 0.05, err


def test_softcapping_and_sliding_window_fall_back():
    q, k, v = _qkv(1, 8, 8, 2, 2, 4, grad=False)
    for kw in ({'attn_logit_softcapping': 2.0}, {'sliding_window_size': 2}):
        o = A.sdpa_attention(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True, **kw)[0]
        r = reference(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True, **kw)[0]
        torch.testing.assert_close(o, r)
        plain = reference(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True)[0]
        assert not torch.allclose(o, plain)  # the option had an effect


def test_mpt_attn_config_round_trip():
    cfg = A.mpt_attn_config({'attn_type': 'grouped_query_attention', 'kv_n_heads': 2}, 'sdpa')
    assert cfg == {'attn_type': 'sdpa_grouped_query_attention', 'kv_n_heads': 2, 'attn_impl': 'torch'}
    assert A.mpt_attn_config(None, 'sdpa') == {'attn_type': 'sdpa_multihead_attention', 'attn_impl': 'torch'}
    assert A.stock_attn_config(cfg)['attn_type'] == 'grouped_query_attention'
    assert A.mpt_attn_config(cfg, 'torch') == {'attn_type': 'grouped_query_attention', 'kv_n_heads': 2,
                                               'attn_impl': 'torch'}
    with pytest.raises(ValueError):
        A.mpt_attn_config({}, 'xformers')


def _tiny_mpt(attn_config, **extra):
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
    cfg = MPTConfig(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=32, vocab_size=97,
                    no_bias=True, norm_type='low_precision_layernorm', attn_config=attn_config, **extra)
    return MPTForCausalLM(cfg)


@pytest.mark.parametrize('attn_extra,model_extra', [
    ({}, {}),
    ({'attn_type': 'grouped_query_attention', 'kv_n_heads': 2}, {}),
    ({'alibi': True}, {'learned_pos_emb': False}),
    ({'attn_uses_sequence_id': True}, {}),
])
def test_tiny_mpt_logits_and_grads_match_torch(attn_extra, model_extra):
    torch.manual_seed(0)
    ref = _tiny_mpt({**attn_extra, 'attn_impl': 'torch'}, **model_extra)
    torch.manual_seed(0)
    ours = _tiny_mpt(A.mpt_attn_config(attn_extra, 'sdpa'), **model_extra)
    ours.load_state_dict(ref.state_dict())
    n_attn = sum(1 for m in ours.modules() if getattr(m, 'attn_fn', None) is A.sdpa_attention)
    assert n_attn == 2
    assert not any(getattr(m, 'attn_fn', None) is A.sdpa_attention for m in ref.modules())

    b, s = 3, 32
    ids = torch.randint(0, 97, (b, s))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[2, 20:] = 0   # a right-padded sample (finetuning)
    kw = {'input_ids': ids, 'attention_mask': mask}
    if attn_extra.get('attn_uses_sequence_id'):
        kw['sequence_id'] = torch.tensor([[0] * 10 + [1] * 22, [0] * 32, [0] * 5 + [1] * 27])
    ref.train()
    ours.train()
    lr = ref(**kw).logits
    lo = ours(**kw).logits
    torch.testing.assert_close(lo, lr, atol=ATOL, rtol=RTOL)
    lr.float().pow(2).mean().backward()
    lo.float().pow(2).mean().backward()
    for (n, p), (_, pr) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, pr.grad, atol=ATOL, rtol=1e-4, msg=lambda m: f'{n}: {m}')


def test_tiny_mpt_no_mask_uses_fast_path_and_matches():
    # The pretraining case after DropFullAttentionMask: no attention_mask, causal, no bias.
    torch.manual_seed(0)
    ref = _tiny_mpt({'attn_impl': 'torch'})
    ours = _tiny_mpt(A.mpt_attn_config({}, 'sdpa'))
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 97, (2, 32))
    calls = []
    orig = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **k):
        calls.append((k.get('attn_mask') is None, k.get('is_causal')))
        return orig(*a, **k)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        lo = ours(input_ids=ids).logits
    finally:
        torch.nn.functional.scaled_dot_product_attention = orig
    assert calls == [(True, True)] * 2       # mask-free causal kernel in both layers
    torch.testing.assert_close(lo, ref(input_ids=ids).logits, atol=ATOL, rtol=RTOL)
    # and with an all-ones mask (what the collator sends) the result is the same
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, lo,
                               atol=ATOL, rtol=RTOL)


def test_tiny_mpt_generate_matches_torch():
    torch.manual_seed(0)
    ref = _tiny_mpt({'attn_impl': 'torch'})
    ours = _tiny_mpt(A.mpt_attn_config({}, 'sdpa'))
    ours.load_state_dict(ref.state_dict())
    ref.eval()
    ours.eval()
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        g_ref = ref.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
        g = ours.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
    assert g.shape == (2, 15)
    assert torch.equal(g, g_ref)


def test_use_sdpa_switches_built_model():
    torch.manual_seed(0)
    m = _tiny_mpt({'attn_impl': 'torch'})
    ids = torch.randint(0, 97, (2, 16))
    before = m(input_ids=ids).logits
    assert A.use_sdpa(m) == 2
    torch.testing.assert_close(m(input_ids=ids).logits, before, atol=ATOL, rtol=RTOL)


def test_sdpa_class_rejects_flash_impl():
    with pytest.raises(ValueError, match="attn_impl 'torch'"):
        attention_classes.get('sdpa_multihead_attention')(d_model=32, n_heads=2, attn_impl='flash')


def test_drop_full_attention_mask_callback():
    cb = A.DropFullAttentionMask()

    class S:
        pass

    st = S()
    st.batch = {'input_ids': torch.zeros(2, 4, dtype=torch.long), 'attention_mask': torch.ones(2, 4)}
    cb.after_dataloader(st, None)
    assert 'attention_mask' not in st.batch and 'input_ids' in st.batch
    padded = torch.ones(2, 4)
    padded[1, 3] = 0
    st.batch = {'input_ids': torch.zeros(2, 4, dtype=torch.long), 'attention_mask': padded}
    cb.after_dataloader(st, None)
    assert torch.equal(st.batch['attention_mask'], padded)
    assert (cb.dropped, cb.kept) == (1, 1)


def test_math_sanity_against_explicit_softmax():
    # Independent of llm-foundry: causal attention computed by hand in float64.
    q, k, v = _qkv(1, 6, 6, 2, 2, 4, grad=False)
    out = A.sdpa_attention(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True)[0]
    qh = q.double().view(1, 6, 2, 4).transpose(1, 2)
    kh = k.double().view(1, 6, 2, 4).transpose(1, 2)
    vh = v.double().view(1, 6, 2, 4).transpose(1, 2)
    s = qh @ kh.transpose(-1, -2) / math.sqrt(4)
    s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float('-inf'))
    ref = (s.softmax(-1) @ vh).transpose(1, 2).reshape(1, 6, 8)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_set_sdpa_backend_flags():
    b = torch.backends.cuda
    try:
        A.set_sdpa_backend('efficient')
        assert b.mem_efficient_sdp_enabled() and not b.flash_sdp_enabled() and b.math_sdp_enabled()
        A.set_sdpa_backend('math')
        assert not b.mem_efficient_sdp_enabled() and not b.flash_sdp_enabled() and b.math_sdp_enabled()
        # with only the math backend on, results still match the reference
        q, k, v = _qkv(1, 8, 8, 2, 2, 4, grad=False)
        torch.testing.assert_close(A.sdpa_attention(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True)[0],
                                   reference(q, k, v, n_heads=2, kv_n_heads=2, is_causal=True)[0],
                                   atol=ATOL, rtol=RTOL)
        with pytest.raises(ValueError):
            A.set_sdpa_backend('xformers')
    finally:
        A.set_sdpa_backend(None)
    assert b.flash_sdp_enabled() and b.mem_efficient_sdp_enabled() and b.math_sdp_enabled()
