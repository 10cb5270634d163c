"""llmpipe.model.fused_loss (chunked linear + cross-entropy) against llm-foundry's own loss path, on the CPU.

The reference is llm-foundry's ``compute_loss_from_logits`` with the ``torch_crossentropy`` loss of
``ComposerMPTCausalLM`` (full logits, per-token losses summed and divided by the count of non-ignored targets): the
fused loss must give the same loss and the same gradients w.r.t. the hidden states and the (tied) weight, for
chunk sizes that divide the token count, that do not, and that exceed it, with ignored targets present. The
registered composer model must train like the stock one (also under FSDP with two CPU ranks, and through
llm-foundry's ``train()``) and be the stock model in eval mode.
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('llmfoundry')

from llmfoundry.models.mpt import ComposerMPTCausalLM, MPTConfig, MPTForCausalLM  # noqa: E402
from llmfoundry.models.mpt.modeling_mpt import compute_loss_from_logits  # noqa: E402

import llmpipe.model.attention as A  # noqa: E402
from llmpipe.dispatch.rendezvous import free_port  # noqa: E402
from llmpipe.model import fused_loss as FL  # noqa: E402
from tests.conftest import load_tool, retire_process_groups  # noqa: E402

V, D = 101, 24


@pytest.fixture(autouse=True)
def _fp32_deterministic():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(False)


def _foundry_loss(hidden, weight, targets):
    """llm-foundry's loss from full logits: compute_loss_from_logits + ComposerMPTCausalLM's torch_crossentropy."""
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100, reduction='none')
    logits = torch.nn.functional.linear(hidden, weight)
    return compute_loss_from_logits(SimpleNamespace(logits=logits[None]), False, targets[None], loss_fn)


def _inputs(n=48, ignore=(0, 5, 6, 7, 31), dtype=torch.float32):
    h = torch.randn(n, D, dtype=dtype)
    w = torch.randn(V, D, dtype=dtype) * 0.3
    t = torch.randint(0, V, (n,))
    t[list(ignore)] = -100
    return h, w, t


def _loss_and_grads(fn, h, w, t, scale=1.0):
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    loss = fn(h, w, t)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


# ------------------------------------------------------------------------------------------ the function

# on CPU 'compile' and 'liger' run the 'torch' path (test_cuda_only_kernels_fall_back_on_cpu); their GPU parity
# is checked by tools/check_fused_loss_kernels.py (benchmarks/fused-loss-kernels-device-h200.csv)
@pytest.mark.parametrize('kernel', ['torch', 'softmax'])
@pytest.mark.parametrize('chunk', [1, 7, 16, 48, 1000, None], ids=lambda c: f'chunk{c}')
def test_loss_and_grads_equal_llm_foundry(chunk, kernel):
    h, w, t = _inputs()
    ref = _loss_and_grads(_foundry_loss, h, w, t, scale=0.37)
    got = _loss_and_grads(lambda a, b, c: FL.linear_cross_entropy(a, b, c, chunk_size=chunk, kernel=kernel),
                          h, w, t, scale=0.37)
    torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], ref[1], atol=1e-7, rtol=1e-5)   # d loss / d hidden
    torch.testing.assert_close(got[2], ref[2], atol=1e-7, rtol=1e-5)   # d loss / d weight
    assert got[0].dtype == torch.float32 and got[1].abs().sum() > 0 and got[2].abs().sum() > 0


def test_softmax_kernel_takes_one_softmax_per_chunk_and_no_exp(monkeypatch):
    """kernel='softmax' computes each chunk's gradient with torch.softmax (one kernel) and never runs the
    fp32 exp over the chunk (which PyTorch follows with a cast); kernel='torch' does the opposite."""
    calls = {'softmax': [], 'exp': []}
    orig_softmax, orig_exp = torch.softmax, torch.exp

    def softmax(x, *a, **k):
        calls['softmax'].append(tuple(x.shape))
        return orig_softmax(x, *a, **k)

    def exp(x, *a, **k):
        calls['exp'].append(tuple(x.shape))
        return orig_exp(x, *a, **k)

    monkeypatch.setattr(torch, 'softmax', softmax)
    monkeypatch.setattr(torch, 'exp', exp)
    h, w, t = _inputs(n=48)
    for kernel, want_softmax, want_exp in (('softmax', [(20, V), (20, V), (8, V)], []),
                                           ('torch', [], [(20, V), (20, V), (8, V)])):
        calls['softmax'].clear()
        calls['exp'].clear()
        _loss_and_grads(lambda a, b, c: FL.linear_cross_entropy(a, b, c, chunk_size=20, kernel=kernel), h, w, t)
        assert calls['softmax'] == want_softmax and calls['exp'] == want_exp, (kernel, calls)
    with pytest.raises(ValueError, match='kernel must be one of'):
        FL.linear_cross_entropy(h, w, t, kernel='triton')


def test_default_kernel_is_one_of_the_kernels():
    from llmpipe.config.settings import FUSED_LOSS_DEFAULT_KERNEL
    assert FUSED_LOSS_DEFAULT_KERNEL in FL.KERNELS


@pytest.mark.parametrize('kernel', ['compile', 'liger'])
def test_cuda_only_kernels_fall_back_on_cpu(monkeypatch, kernel):
    """On CPU the chunk runs the eager 'torch' path: neither Liger nor torch.compile is touched."""
    def boom(*a, **k):
        raise AssertionError('a CUDA-only kernel ran on CPU')

    monkeypatch.setattr(FL, '_chunk_loss_and_grad_liger', boom)
    monkeypatch.setattr(FL, '_compiled_chunk_fn', boom)
    h, w, t = _inputs(n=48)
    ref = _loss_and_grads(lambda a, b, c: FL.linear_cross_entropy(a, b, c, chunk_size=20, kernel='torch'), h, w, t)
    got = _loss_and_grads(lambda a, b, c: FL.linear_cross_entropy(a, b, c, chunk_size=20, kernel=kernel), h, w, t)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_liger_kernel_gets_the_contract_it_documents(monkeypatch):
    """The 'liger' chunk calls Liger-Kernel's ``cross_entropy_loss_and_grad`` with sum reduction (no token
    count from the device), the chunk's own targets with ignore_index kept, and uses the per-row fp32 losses and
    the gradient written over the logits. Liger's Triton implementation does not load without a GPU driver, so here
    a CPU function with the contract its docstring states (liger_kernel/ops/backends/_triton/cross_entropy.py)
    stands in; its values on a GPU are checked by tools/check_fused_loss_kernels.py."""
    import sys
    import types
    seen = []

    def dispatch(op, logits, targets, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
                 softcap, n_non_ignore, sum_non_ignore_weight, weight_sum, return_z_loss, return_token_accuracy,
                 return_predicted_tokens, has_gradients, *, impl=None, mode=None):
        seen.append((op, tuple(logits.shape), targets.clone(), ignore_index, reduction, has_gradients, impl))
        assert ce_weight is None and softcap is None and lse_square_scale == 0.0 and label_smoothing == 0.0
        valid = targets != ignore_index
        lsm = torch.log_softmax(logits.float(), dim=-1)
        loss = torch.where(valid, -lsm.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), torch.zeros(()))
        if has_gradients:
            g = lsm.exp()
            g[valid, targets[valid]] -= 1
            g[~valid] = 0
            logits.copy_(g)   # in place, like the Triton kernel
        return loss, None, None, None, logits

    monkeypatch.setitem(sys.modules, 'liger_kernel', types.ModuleType('liger_kernel'))
    monkeypatch.setitem(sys.modules, 'liger_kernel.functional', types.ModuleType('liger_kernel.functional'))
    backends = types.ModuleType('liger_kernel.backends')
    backends.dispatch = dispatch
    monkeypatch.setitem(sys.modules, 'liger_kernel.backends', backends)
    h, w, t = _inputs(n=48)
    t[5] = t[30] = -100
    ref = _loss_and_grads(lambda a, b, c: FL.linear_cross_entropy(a, b, c, chunk_size=20), h, w, t)

    def liger(hidden, weight, targets):   # the chunk loop with the liger chunk, on CPU
        return FL._LinearCrossEntropy.apply(hidden, weight, targets, -100, 20, torch.float32, 'liger', True)

    got = _loss_and_grads(liger, h, w, t)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
    assert [s[0] for s in seen] == ['cross_entropy_loss_and_grad'] * 3
    assert [s[1] for s in seen] == [(20, V), (20, V), (8, V)]
    assert all(s[3] == -100 and s[4] == 'sum' and s[5] is True and s[6] == 'nvidia-triton' for s in seen)
    torch.testing.assert_close(torch.cat([s[2] for s in seen]), t)   # ignore_index rows passed as such
    # without gradients (eval): the kernel is told so and the loss is unchanged
    seen.clear()
    with torch.no_grad():
        loss = FL._LinearCrossEntropy.apply(h, w, t, -100, 20, torch.float32, 'liger', False)
    torch.testing.assert_close(loss, got[0], atol=1e-6, rtol=1e-6)
    assert [s[5] for s in seen] == [False, False, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason='Liger-Kernel runs on CUDA only')
def test_liger_chunk_equals_the_torch_chunk_on_cuda():
    """On a GPU: the real Liger chunk against the eager chunk, bf16 logits with ignored rows."""
    g = torch.Generator(device='cuda').manual_seed(0)
    logits = (torch.randn(64, 1000, device='cuda', generator=g) * 3).to(torch.bfloat16)
    t = torch.randint(0, 1000, (64,), device='cuda', generator=g)
    t[[3, 40]] = -100
    valid = t != -100
    ref_loss, ref_grad = FL._chunk_loss_and_grad(logits.clone(), torch.where(valid, t, 0), valid, True)
    loss, grad = FL._chunk_loss_and_grad_liger(logits.clone(), t, -100, True)
    torch.testing.assert_close(loss, ref_loss, atol=1e-3, rtol=1e-5)
    # the eager chunk leaves ignored rows' softmax in place (they are masked after the matmuls); Liger zeroes them
    torch.testing.assert_close(grad[valid].float(), ref_grad[valid].float(), atol=1e-2, rtol=1e-2)
    assert torch.count_nonzero(grad[~valid]) == 0


def test_chunks_never_hold_more_than_chunk_rows_of_logits(monkeypatch):
    shapes = []
    orig = FL._chunk_loss_and_grad

    def spy(logits, *a, **k):
        shapes.append(tuple(logits.shape))
        return orig(logits, *a, **k)

    monkeypatch.setattr(FL, '_chunk_loss_and_grad', spy)
    h, w, t = _inputs(n=48)
    _loss_and_grads(lambda a, b, c: FL.linear_cross_entropy(a, b, c, chunk_size=20), h, w, t)
    assert shapes == [(20, V), (20, V), (8, V)]


def test_all_targets_ignored_gives_llm_foundrys_zero():
    h, w, t = _inputs(ignore=range(48))
    ref = _loss_and_grads(_foundry_loss, h, w, t)
    got = _loss_and_grads(lambda a, b, c: FL.linear_cross_entropy(a, b, c, chunk_size=7), h, w, t)
    assert float(ref[0]) == 0.0 and float(got[0]) == 0.0
    assert torch.count_nonzero(got[1]) == 0 and torch.count_nonzero(got[2]) == 0


def test_ignored_rows_change_nothing():
    h, w, t = _inputs()
    ignored = t == -100
    h2 = h.clone()
    h2[ignored] = torch.randn(int(ignored.sum()), D) * 5
    def fn(a, b, c):
        return FL.linear_cross_entropy(a, b, c, chunk_size=9)

    l1, gh1, gw1 = _loss_and_grads(fn, h, w, t)
    l2, gh2, gw2 = _loss_and_grads(fn, h2, w, t)
    torch.testing.assert_close(l2, l1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gw2, gw1, atol=1e-7, rtol=1e-5)
    assert torch.count_nonzero(gh1[ignored]) == 0 and torch.count_nonzero(gh2[ignored]) == 0


@pytest.mark.parametrize('kernel', ['torch', 'softmax'])
def test_autocast_runs_matmuls_in_bf16_and_returns_param_dtypes(monkeypatch, kernel):
    h, w, t = _inputs(n=64)
    mm_dtypes = []
    orig_mm = torch.mm

    def spy(a, b, *rest, **kw):
        mm_dtypes.append((a.dtype, b.dtype))
        return orig_mm(a, b, *rest, **kw)

    def stock(a, b, c):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            return _foundry_loss(a, b, c)

    ref = _loss_and_grads(stock, h, w, t)
    monkeypatch.setattr(torch, 'mm', spy)

    def fused(a, b, c):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            return FL.linear_cross_entropy(a, b, c, chunk_size=24, kernel=kernel)

    got = _loss_and_grads(fused, h, w, t)
    monkeypatch.undo()
    assert mm_dtypes and set(mm_dtypes) == {(torch.bfloat16, torch.bfloat16)}
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    # both compute the logits in bf16 and the loss in fp32: the same value up to bf16 rounding of the gradients
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    for g, r in ((got[1], ref[1]), (got[2], ref[2])):
        assert (g - r).abs().max() <= 0.02 * r.abs().max()


def test_bf16_parameters_without_autocast():
    """FSDP with mixed precision PURE hands bf16 weights and hidden states to the loss (no autocast)."""
    h, w, t = _inputs(n=64)
    ref = _loss_and_grads(_foundry_loss, h, w, t)   # fp32
    got = _loss_and_grads(lambda a, b, c: FL.linear_cross_entropy(a, b, c, chunk_size=10),
                          h.bfloat16(), w.bfloat16(), t)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    assert abs(float(got[0]) - float(ref[0])) < 0.02
    for g, r in ((got[1], ref[1]), (got[2], ref[2])):
        assert (g.float() - r).abs().max() <= 0.03 * r.abs().max()


def test_no_grad_computes_the_loss_only():
    h, w, t = _inputs()
    with torch.no_grad():
        loss = FL.linear_cross_entropy(h.requires_grad_(), w, t, chunk_size=5)
    torch.testing.assert_close(loss, _foundry_loss(h.detach(), w, t), atol=1e-6, rtol=1e-6)


def test_functional_chunk_matches_eager_and_traces():
    """The torch.compile'd variant (used on CUDA with fused_loss.kernel: compile) computes the eager values."""
    logits = torch.randn(13, V) * 3
    t = torch.randint(0, V, (13,))
    valid = torch.ones(13, dtype=torch.bool)
    valid[[2, 9]] = False
    t[~valid] = 0
    loss_e, grad_e = FL._chunk_loss_and_grad(logits.clone(), t, valid, True)
    loss_f, grad_f = FL._chunk_loss_and_grad_functional(logits.clone(), t, valid)
    torch.testing.assert_close(loss_f, loss_e)
    torch.testing.assert_close(grad_f, grad_e)
    traced = torch.compile(FL._chunk_loss_and_grad_functional, backend='aot_eager', dynamic=False)
    loss_c, grad_c = traced(logits.clone(), t, valid)
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(grad_c, grad_e)
    # softmax - onehot on valid rows, softmax alone on ignored rows
    p = torch.softmax(logits, -1)
    p[valid, t[valid]] -= 1
    torch.testing.assert_close(grad_e, p, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize('kwargs,match', [
    ({'chunk_size': 0}, 'chunk_size'),
    ({'chunk_size': True}, 'chunk_size'),
    ({'chunk_size': 2.5}, 'chunk_size'),
])
def test_bad_chunk_size(kwargs, match):
    h, w, t = _inputs()
    with pytest.raises(ValueError, match=match):
        FL.linear_cross_entropy(h, w, t, **kwargs)


def test_bad_shapes_and_targets():
    h, w, t = _inputs()
    with pytest.raises(ValueError, match='hidden must be'):
        FL.linear_cross_entropy(h[None], w, t)
    with pytest.raises(ValueError, match='hidden must be'):
        FL.linear_cross_entropy(h, w[:, :-1], t)
    with pytest.raises(ValueError, match='targets must be'):
        FL.linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match='integer class ids'):
        FL.linear_cross_entropy(h, w, t.float())


def test_default_chunk_size():
    assert FL.default_chunk_size(50368) == 8192   # 1.54 GiB of fp32 logits per chunk
    assert FL.default_chunk_size(4096) == 8192
    assert FL.default_chunk_size(152064) == 3328  # capped at 2 GiB of fp32 logits
    assert FL.default_chunk_size(10**9) == 1


# ------------------------------------------------------------------------------------------ the composer model

MPT_KW = dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=32, vocab_size=V, no_bias=True,
              norm_type='low_precision_layernorm', attn_config=A.mpt_attn_config({}, 'sdpa'),
              loss_fn='torch_crossentropy')


def _models(use_train_metrics=False, **fused_kw):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        stock = ComposerMPTCausalLM(use_train_metrics=use_train_metrics, **MPT_KW)
    fused = FL.ComposerMPTCausalLMFusedLoss(use_train_metrics=use_train_metrics, **MPT_KW, **fused_kw)
    fused.load_state_dict(stock.state_dict())
    return stock, fused


def _batch(b=3, s=32):
    ids = torch.randint(0, V, (b, s))
    labels = ids.clone()
    labels[1, 4:12] = -100   # e.g. prompt tokens of a finetuning sample
    return {'input_ids': ids, 'attention_mask': torch.ones_like(ids), 'labels': labels}


@pytest.mark.parametrize('chunk,kernel', [(5, 'torch'), (None, 'torch'), (5, 'softmax'), (5, 'liger')])
def test_model_training_loss_and_grads_equal_stock(chunk, kernel):
    stock, fused = _models(fused_loss_chunk_size=chunk, fused_loss_kernel=kernel)
    assert fused.model.transformer.wte.fused_loss_kernel == kernel
    stock.train()
    fused.train()
    for step in range(2):   # two microbatches: gradients accumulate
        batch = _batch()
        out = fused(batch)
        assert isinstance(out, FL.FusedLossOutput) and 'logits' not in out
        lf = fused.loss(out, batch)
        ls = stock.loss(stock(batch), batch)
        torch.testing.assert_close(lf, ls, atol=1e-6, rtol=1e-6)
        (lf * 0.5).backward()
        (ls * 0.5).backward()
    n = 0
    for (name, p), (_, q) in zip(fused.named_parameters(), stock.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-4, msg=lambda m: f'{name}: {m}')
        n += 1
    assert n == len(list(stock.parameters())) and fused.model.transformer.wte.weight.grad.abs().sum() > 0


def test_model_eval_and_generation_equal_stock():
    stock, fused = _models()
    batch = _batch()
    stock.eval()
    fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(batch).logits, stock(batch).logits, atol=0, rtol=0)
        torch.testing.assert_close(fused.eval_forward(dict(batch)), stock.eval_forward(dict(batch)), atol=0, rtol=0)
        torch.testing.assert_close(fused.loss(fused(batch), batch), stock.loss(stock(batch), batch), atol=0, rtol=0)
        ids = batch['input_ids'][:, :5]
        g_f = fused.model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
        g_s = stock.model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(g_f, g_s)
    # eval_forward handed a fused training output (composer does this for train metrics) recomputes the logits
    fused.train()
    out = fused(batch)
    fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused.eval_forward(dict(batch), out), stock.eval_forward(dict(batch)),
                                   atol=0, rtol=0)


def test_model_with_train_metrics_is_the_stock_path():
    with pytest.warns(UserWarning, match='use_train_metrics is true'):
        stock, fused = _models(use_train_metrics=True)
    assert not fused.fused_loss_active
    stock.train()
    fused.train()
    batch = _batch()
    out = fused(batch)
    assert not isinstance(out, FL.FusedLossOutput) and out.logits.shape == (3, 32, V)
    torch.testing.assert_close(fused.loss(out, batch), stock.loss(stock(batch), batch), atol=0, rtol=0)


def test_registered_and_state_dict_is_stock_mpt():
    from llmfoundry.registry import models
    assert models.get(FL.FUSED_LOSS_MODEL_NAME) is FL.ComposerMPTCausalLMFusedLoss
    FL.register()   # idempotent
    stock, fused = _models()
    assert list(fused.state_dict()) == list(stock.state_dict())
    plain = MPTForCausalLM(MPTConfig(**{k: v for k, v in MPT_KW.items() if k != 'loss_fn'}))
    plain.load_state_dict(fused.model.state_dict(), strict=True)   # what llmpipe.hf.export does
    assert type(fused.model.transformer.wte) is FL.FusedLossEmbedding
    assert fused.model.get_output_embeddings() is fused.model.transformer.wte


def test_model_under_torch_compile_equals_stock():
    """Composer compiles the model's forward (compile_config); the fused loss runs eagerly inside it
    (torch.compiler.disable: one graph break at the end) and still equals the stock loss and gradients."""
    import torch._dynamo
    torch._dynamo.reset()
    stock, fused = _models(fused_loss_chunk_size=7)
    compiled = torch.compile(fused, backend='aot_eager')
    fused.forward = compiled.dynamo_ctx(fused.forward)   # what composer's Trainer does with compile_config
    stock.train()
    fused.train()
    for _ in range(2):
        batch = _batch()
        del batch['attention_mask']   # as after drop_full_attention_mask
        out = fused(batch)
        assert isinstance(out, FL.FusedLossOutput)
        lf, ls = fused.loss(out, batch), stock.loss(stock(batch), batch)
        torch.testing.assert_close(lf, ls, atol=1e-6, rtol=1e-6)
        lf.backward()
        ls.backward()
    for (name, p), (_, q) in zip(fused.named_parameters(), stock.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-4, msg=lambda m: f'{name}: {m}')
    torch._dynamo.reset()


@pytest.mark.parametrize('extra,match', [
    ({'loss_fn': 'fused_crossentropy'}, 'loss_fn'),
    ({'tie_word_embeddings': False}, 'tie_word_embeddings'),
    ({'logit_scale': 0.5}, 'logit_scale'),
    ({'final_logit_softcapping': 30.0}, 'final_logit_softcapping'),
    ({'fused_loss_chunk_size': 0}, 'fused_loss_chunk_size'),
    ({'fused_loss_chunk_size': 2.0}, 'fused_loss_chunk_size'),
])
def test_model_refuses_unsupported_settings(extra, match):
    kw = {**MPT_KW, 'use_train_metrics': False, **extra}
    with pytest.raises(ValueError, match=match):
        FL.ComposerMPTCausalLMFusedLoss(**kw)


def test_model_refuses_megablocks_ffn(monkeypatch):
    from llmfoundry.layers_registry import ffns_with_megablocks
    monkeypatch.setattr(ffns_with_megablocks, 'get_all', lambda: ['mb_moe', 'mb_dmoe'])
    with pytest.raises(ValueError, match='MegaBlocks'):
        FL.ComposerMPTCausalLMFusedLoss(**{**MPT_KW, 'use_train_metrics': False,
                                           'ffn_config': {'ffn_type': 'mb_moe'}})


# ------------------------------------------------------------------------------------------ under FSDP (2 CPU ranks)

def _fsdp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import datetime
    import functools

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    # a bounded timeout: a rank that fails leaves the other in a collective for 5 minutes, not gloo's 30
    dist.init_process_group('gloo', rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    results = {}
    for mixed in (False, True):
        stock, fused = _models(fused_loss_chunk_size=11)

        def policy(m):  # composer's: modules marked _fsdp_wrap (wte, norm_f, ...) and MPT's blocks
            return bool(getattr(m, '_fsdp_wrap', False)) or fused.model.fsdp_wrap_fn(m)

        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
        fused.model = FSDP(fused.model, use_orig_params=True, device_id=torch.device('cpu'), mixed_precision=mp,
                           auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=policy))
        fused.train()
        stock.train()
        torch.manual_seed(1)   # every rank the same batches: the FSDP average equals one process' gradient
        batches = [_batch(b=4), _batch(b=4)]
        for batch in batches:   # two microbatches: gradients accumulate
            out = fused(batch)
            assert isinstance(out, FL.FusedLossOutput)
            (fused.loss(out, batch) * 0.5).backward()
        for batch in batches:
            (stock.loss(stock(batch), batch) * 0.5).backward()
        with FSDP.summon_full_params(fused.model, with_grads=True):
            results[mixed] = {
                n: float((p.grad.float() - q.grad).abs().max() / q.grad.abs().max())
                for (n, p), (_, q) in zip(fused.model.named_parameters(), stock.model.named_parameters())}
    if rank == 0:
        torch.save(results, out_path)
    # no destroy_process_group(): gloo's can block forever once the other rank has exited (this test hung
    # for 15 minutes that way once); the spawned process ends right after, which closes gloo's sockets


def test_fsdp_gradients_equal_stock(tmp_path):
    """Under FSDP (two CPU ranks, gloo; composer's wrapping: the tied embedding is its own FSDP unit), in fp32
    and with bf16 mixed precision, the fused loss gives the stock gradients (relative max error per parameter).
    A loss computed by a module call after the root forward returned loses the embedding's gradient under mixed
    precision (the root's pre-backward hook resets it): relative error ~0.4 instead of bf16 rounding."""
    import torch.multiprocessing as mp
    out = str(tmp_path / 'diffs.pt')
    mp.spawn(_fsdp_worker, args=(2, free_port(), out), nprocs=2, join=True)
    results = torch.load(out)
    n_params = len(list(_models()[0].model.parameters()))
    for mixed, tol in ((False, 1e-5), (True, 0.05)):
        diffs = results[mixed]
        assert 'transformer.wte.weight' in diffs and len(diffs) == n_params
        assert max(diffs.values()) < tol, (mixed, diffs)


# ------------------------------------------------------------------------------------------ config and training

def _project_config():
    from tests.conftest import project_config
    return project_config()


def test_train_config_selects_the_fused_model():
    from llmpipe.config.runs import deep_merge
    from llmpipe.config.runs import run_settings
    from llmpipe.train.pretrain import FUSED_LOSS_MODEL_KEYS, foundry_train_config
    config = _project_config()

    def model(cfg, run='mpt-125m'):
        return foundry_train_config(run_settings(cfg, run), data_dir=None, save_folder=None, world_size=1)['model']

    m = model(config)
    assert m['name'] == FL.FUSED_LOSS_MODEL_NAME and m['fused_loss_chunk_size'] is None
    assert m['fused_loss_kernel'] == 'liger' and m['loss_fn'] == 'torch_crossentropy'
    for run in ('mpt-350m', 'mpt-760m', 'mpt-1b', 'mpt-7b', 'mpt-70b'):
        assert model(config, run)['name'] == FL.FUSED_LOSS_MODEL_NAME
    assert model(config, 'mpt-tiny')['name'] == 'mpt_causal_lm'   # the CI model keeps the stock loss
    assert not set(FUSED_LOSS_MODEL_KEYS) & set(model(config, 'mpt-tiny'))
    over = deep_merge(config, {'models': {'mpt-125m': {'train': {'fused_loss': {'chunk_size': 4096,
                                                                                 'kernel': 'compile'}}}}})
    m = model(over)
    assert (m['fused_loss_chunk_size'], m['fused_loss_kernel']) == (4096, 'compile')
    sm = deep_merge(config, {'models': {'mpt-125m': {'train': {'fused_loss': {'kernel': 'softmax'}}}}})
    assert model(sm)['fused_loss_kernel'] == 'softmax' and model(sm)['fused_loss_chunk_size'] is None
    dflt = deep_merge(config, {'models': {'mpt-125m': {'train': {'fused_loss': {'chunk_size': 1024}}}}})
    assert model(dflt)['fused_loss_kernel'] == 'liger'
    # snakemake --config passes nested values as strings; rules/common.smk types them (llmpipe.config.schema.coerce)
    from llmpipe.config.schema import coerce
    cli = coerce(deep_merge(config, {'models': {'mpt-125m': {'train': {'fused_loss': {'chunk_size': '4096',
                                                                                'kernel': 'torch'}}}}}))
    assert (model(cli)['fused_loss_chunk_size'], model(cli)['fused_loss_kernel']) == (4096, 'torch')
    cli_off = coerce(deep_merge(config, {'models': {'mpt-125m': {'train': {'fused_loss': 'false'}}}}))
    assert model(cli_off)['name'] == 'mpt_causal_lm'
    cli_on = coerce(deep_merge(config, {'models': {'mpt-tiny': {'train': {'fused_loss': 'True'}}}}))
    assert model(cli_on, 'mpt-tiny')['name'] == FL.FUSED_LOSS_MODEL_NAME
    metrics = deep_merge(config, {'models': {'mpt-125m': {'train': {'train_metrics': True}}}})
    assert model(metrics)['name'] == 'mpt_causal_lm'   # the metrics need the logits
    off = deep_merge(config, {'models': {'mpt-125m': {'train': {'fused_loss': False}}}})
    assert model(off)['name'] == 'mpt_causal_lm'


@pytest.mark.parametrize('value', ['yes', 3, {'chunk_size': 0}, {'chunk_size': 'big'}, {'chunk': 4},
                                   {'kernel': 'triton'}, {'kernel': True}, {'kernal': 'liger'}, 'liger'])
def test_bad_fused_loss_setting_is_a_config_error(value):
    from llmpipe.config.runs import deep_merge, validate_run
    from llmpipe.config.settings import ConfigError
    config = deep_merge(_project_config(), {'models': {'mpt-125m': {'train': {'fused_loss': value}}}})
    with pytest.raises(ConfigError, match=r'models\.mpt-125m\.train\.fused_loss'):
        validate_run(config, 'mpt-125m')


@pytest.mark.parametrize('old,kernel', [('compile', 'compile'), ('softmax_grad', 'softmax')])
def test_replaced_fused_loss_keys_name_the_kernel_setting(old, kernel):
    from llmpipe.config.runs import deep_merge, validate_run
    from llmpipe.config.settings import ConfigError
    config = deep_merge(_project_config(), {'models': {'mpt-125m': {'train': {'fused_loss': {old: True}}}}})
    with pytest.raises(ConfigError, match=rf'fused_loss\.{old} was replaced by .*fused_loss\.kernel.*kernel: {kernel}'):
        validate_run(config, 'mpt-125m')


def test_fused_loss_is_speed_only():
    from llmpipe.config.runs import SPEED_ONLY_TRAIN_KEYS, deep_merge
    from llmpipe.steps.training import train_identity
    assert 'fused_loss' in SPEED_ONLY_TRAIN_KEYS
    config = _project_config()
    for run, value in (('mpt-tiny', True), ('mpt-125m', False), ('mpt-125m', {'chunk_size': 1024})):
        other = deep_merge(config, {'models': {run: {'train': {'fused_loss': value}}}})
        assert train_identity(other, run) == train_identity(config, run)


def test_convert_config_has_no_fused_loss_keys():
    from llmpipe.hf.export import mpt_config_dict
    from llmpipe.config.runs import run_settings
    kwargs = mpt_config_dict(run_settings(_project_config(), 'mpt-125m'))
    assert not any(k.startswith('fused_loss') for k in kwargs)
    assert MPTConfig(**kwargs).to_dict().get('fused_loss_chunk_size') is None


def _bench():
    return load_tool('bench_train_throughput')


def test_bench_builds_every_variant(tmp_path):
    bench = _bench()
    config = _project_config()
    for run in ('mpt-125m', 'mpt-350m', 'mpt-tiny'):
        for name, variant in bench.VARIANTS.items():
            cfg, knobs = bench.build_train_config(config, run, variant, steps=3, mb_override=None,
                                                  tok_dir=str(tmp_path))
            fused = cfg['model']['name'] == FL.FUSED_LOSS_MODEL_NAME
            want = variant.get('fused_loss', run != 'mpt-tiny') and not knobs['train_metrics']
            assert fused == bool(want), (run, name)
            assert (knobs['fused_loss'] != 'off') == fused
    cfg, knobs = bench.build_train_config(config, 'mpt-125m', bench.VARIANTS['default'], steps=3,
                                          mb_override=None, tok_dir=str(tmp_path))
    assert knobs['fused_loss'] == 'chunk=8192,liger' and knobs['compile'] == 'fix'      # follows config.yaml
    # the synthetic loader runs with the model's own loader worker count (config.yaml: 4), unless a variant says
    assert knobs['num_workers'] == cfg['train_loader']['num_workers'] == 4
    assert config['model_defaults']['train']['num_workers'] == 4 and 'num_workers' not in config['models'][
        'mpt-125m']['train']
    cfg, knobs = bench.build_train_config(config, 'mpt-125m', bench.VARIANTS['default_w0'], steps=3,
                                          mb_override=None, tok_dir=str(tmp_path))
    assert knobs['num_workers'] == cfg['train_loader']['num_workers'] == 0
    cfg, knobs = bench.build_train_config(config, 'mpt-350m', bench.VARIANTS['default'], steps=3,
                                          mb_override=None, tok_dir=str(tmp_path))
    assert knobs['compile'] == 'fix'   # compiled by default: the catalogue fix, as in the training step
    # activation_checkpointing: auto is decided at the benchmark's own microbatch (this host has no GPU: planned for
    # an h200's 141 GiB): MPT-3B at 8 fits without recompute (82 GiB planned), at 16 (mb_x2_default, 122 GiB) it does not
    config = {**config, 'gpu_type': 'h200'}
    for name, want in (('default', False), ('mb_x2_default', True), ('ac_on', True), ('ac_off', False)):
        cfg, knobs = bench.build_train_config(config, 'mpt-3b', bench.VARIANTS[name], steps=3, mb_override=None,
                                              tok_dir=str(tmp_path))
        assert knobs['fsdp'] is True and knobs['activation_checkpointing'] is want, name
        assert knobs['microbatch'] == (16 if name == 'mb_x2_default' else 8)


def _train_tiny(bench, variant: dict, steps: int, tok_dir: str) -> tuple[list, dict]:
    from llmfoundry.command_utils import train
    from omegaconf import OmegaConf
    cfg, _ = bench.build_train_config(_project_config(), 'mpt-tiny', variant, steps=steps, mb_override=8,
                                      tok_dir=tok_dir)
    cfg['callbacks']['llmpipe_run_monitor'] = {'log_interval': 1}
    cfg['seed'] = 5
    trainer = train(OmegaConf.create(cfg))
    try:
        monitor = next(cb for cb in trainer.state.callbacks if type(cb).__name__ == 'RunMonitor')
        losses = [r['loss'] for r in monitor.records]
        model = trainer.state.model
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return losses, {'params': params, 'class': type(model).__name__}
    finally:
        trainer.close()
        retire_process_groups()   # train() made a process group from the env variables; later tests must not inherit it


def test_llm_foundry_train_with_the_fused_model_matches_stock(tmp_path, monkeypatch):
    """A few optimizer steps through llm-foundry's train() (the project's config for mpt-tiny, synthetic tokens):
    the same loss curve and weights as the stock model, and the fused loss is what ran."""
    for k, v in {'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '1', 'NODE_RANK': '0',
                 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    bench = _bench()
    bench._register_synthetic_loader()
    from llmpipe.train.pretrain import register_extensions
    register_extensions()
    tok_dir = bench._dummy_tokenizer_dir(64)
    calls = []
    orig = FL.linear_cross_entropy

    def spy(hidden, weight, targets, **kw):
        calls.append(tuple(hidden.shape))
        return orig(hidden, weight, targets, **kw)

    steps = 4
    stock_losses, stock = _train_tiny(bench, bench.VARIANTS['nometrics'], steps, tok_dir)
    monkeypatch.setattr(FL, 'linear_cross_entropy', spy)
    fused_losses, fused = _train_tiny(bench, {**bench.VARIANTS['fused_loss'], 'fused_loss': {'chunk_size': 300}},
                                      steps, tok_dir)
    assert fused['class'] == 'ComposerMPTCausalLMFusedLoss' and stock['class'] == 'ComposerMPTCausalLM'
    assert calls == [(8 * 128, 128)] * steps   # one fused loss per step over all 8 x 128 tokens
    assert len(fused_losses) == len(stock_losses) == steps
    assert fused_losses == pytest.approx(stock_losses, rel=1e-5)
    assert stock_losses[-1] < stock_losses[0]
    for name, p in stock['params'].items():
        torch.testing.assert_close(fused['params'][name], p, atol=2e-5, rtol=1e-4, msg=lambda m: f'{name}: {m}')


def test_gpu_idle_report_attributes_gaps_to_frames():
    """The profiler's idle report: busy time merges overlapping kernels, only gaps >= min_gap_us count, and each
    Python frame is credited with the gap time it overlapped (the frame outside every gap gets nothing)."""
    from tools import bench_profile as prof
    k = lambda ts, dur: {'ph': 'X', 'cat': 'kernel', 'name': 'k', 'ts': ts, 'dur': dur}  # noqa: E731
    f = lambda name, ts, dur: {'ph': 'X', 'cat': 'python_function', 'name': name, 'ts': ts, 'dur': dur,  # noqa: E731
                               'tid': 1}
    main = f('script.py(1): <module>', 0, 2000)   # marks tid 1 as the main thread
    trace = {'traceEvents': [k(0, 100), k(50, 60), k(300, 100), k(410, 90),      # gaps: 110..300 (190 us), 400..410
                             f('outer', 0, 600), f('inner', 150, 100), f('elsewhere', 420, 60), main,
                             dict(f('other_thread', 100, 300), tid=2)]}        # not the main thread: left out
    report = prof.gpu_idle_report(trace, min_gap_us=50)
    lines = report.splitlines()
    assert lines[0].startswith('kernel span 0.5 ms, GPU busy 0.3 ms, idle 0.2 ms (40.0%); 1 gaps >= 50 us sum 0.2 ms')
    frames = {ln.split()[1]: float(ln.split()[0]) for ln in lines[3:]}
    assert frames == {'outer': 0.19, 'inner': 0.1, 'script.py(1):': 0.19}
    assert prof.gpu_idle_report({'traceEvents': [f('x', 0, 5)]}) == 'no CUDA kernels in the trace\n'
    # a long kernel that ends after a later-starting one sets the span; a frame nested in itself counts once
    trace = {'traceEvents': [k(0, 1000), k(10, 10), k(1500, 100), main, f('rec', 1000, 500), f('rec', 1100, 200),
                             f('step', 900, 800)]}
    lines = prof.gpu_idle_report(trace, min_gap_us=50).splitlines()
    assert lines[0].startswith('kernel span 1.6 ms, GPU busy 1.1 ms, idle 0.5 ms (31.2%); 1 gaps >= 50 us sum 0.5')
    assert {ln.split()[1]: float(ln.split()[0]) for ln in lines[3:]} == {'rec': 0.5, 'step': 0.5, 'script.py(1):': 0.5}


def test_kernel_report_keeps_lambda_kernels_and_drops_profiler_ranges():
    """PyTorch's elementwise kernels name C++ lambdas ('{lambda()#3}'); they are kernels and must be counted
    (dropping names with '#' loses about 20 ms a step of casts); the profiler's own ranges
    ('Optimizer.step#FusedAdamW.step', 'ProfilerStep#3') are not."""
    from tools import bench_profile as prof
    copy = 'void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>'
    assert not prof.is_profiler_range(copy) and not prof.is_profiler_range('nvjet_sm90_tst_192x192')
    assert prof.is_profiler_range('Optimizer.step#FusedAdamW.step') and prof.is_profiler_range('ProfilerStep#3')
    cats, top = prof.kernel_time_report([(copy, 3000.0), ('nvjet_sm90_x', 6000.0), ('mystery', 1000.0)], 2, 20000.0)
    assert cats.splitlines()[0] == '2 steps, wall 20.0 ms, CUDA kernel time 10.0 ms (50.0% of wall)'
    assert {ln.split()[0]: float(ln.split()[-3]) for ln in cats.splitlines()[1:]} == {
        'matmul': 6.0, 'copy/cast': 3.0, 'other': 1.0}
    assert top.splitlines()[0].split()[:2] == ['6.00', 'ms']
    kern = prof.trace_kernels({'traceEvents': [{'ph': 'X', 'cat': 'kernel', 'name': copy, 'ts': 0, 'dur': 7},
                                               {'ph': 'X', 'cat': 'cpu_op', 'name': 'aten::copy_', 'ts': 0, 'dur': 9},
                                               {'ph': 'X', 'cat': 'gpu_memset', 'name': 'Memset', 'ts': 9, 'dur': 1}]})
    assert kern == [(copy, 7.0), ('Memset', 1.0)]


def test_batch_layout_line_says_when_the_microbatch_is_capped():
    """MPT-125M asks microbatch 64; on 8 GPUs its per-device batch is 32, so the training step runs 32 and its log
    says so (it was capped silently)."""
    from llmpipe.config.runs import run_settings
    from llmpipe.train.pretrain import batch_layout, foundry_train_config
    config = _project_config()
    rc = run_settings(config, 'mpt-125m')
    cfg = foundry_train_config(rc, data_dir=None, save_folder=None, world_size=8)
    asked = config['models']['mpt-125m']['train']['microbatch_size']
    line = batch_layout(cfg['global_train_batch_size'], 8, asked, cfg['device_train_microbatch_size'])
    assert asked == 64 and cfg['device_train_microbatch_size'] == 32
    assert line.startswith('global batch 256 = 8 device(s) x 32 per device, microbatch 32 (1 gradient accumulation')
    assert 'train.microbatch_size 64 is above the per-device batch: capped at 32' in line
    cfg1 = foundry_train_config(rc, data_dir=None, save_folder=None, world_size=1)
    line1 = batch_layout(cfg1['global_train_batch_size'], 1, asked, cfg1['device_train_microbatch_size'])
    assert line1 == 'global batch 256 = 1 device(s) x 256 per device, microbatch 64 (4 gradient accumulation step(s))'


def test_benchmark_loader_counts_tokens_in_its_collator_as_the_text_loader_does():
    """The synthetic loader's batches carry each row's token counts (llm-foundry's LossGeneratingTokensCollatorWrapper,
    as its text collator adds them), so the trainer's per-batch count sums them instead of comparing the labels in
    the training process: the count is right and does not read the labels."""
    pytest.importorskip('llmfoundry')
    from llmfoundry.data.utils import get_tokens_per_batch_func
    from llmfoundry.registry import dataloaders

    bench = _bench()
    bench._register_synthetic_loader()
    spec = dataloaders.get('llmpipe_synthetic_tokens')(None, 3, seq_len=16, vocab_size=50, num_samples=6)
    batch = next(iter(spec.dataloader))
    assert batch['input_ids'].shape == (3, 16)
    assert batch['total_tokens'] == [16, 16, 16] and [int(n) for n in batch['loss_generating_tokens']] == [15] * 3
    counted = get_tokens_per_batch_func()({k: batch[k] for k in ('input_ids', 'attention_mask', 'labels')})
    assert int(counted['total']) == 48 and int(counted['loss_generating']) == 45
    no_labels = {k: v for k, v in batch.items() if k != 'labels'}
    assert int(spec.get_num_tokens_in_batch(no_labels)) == 48
    assert int(spec.get_num_tokens_in_batch(no_labels, token_type='loss_generating')) == 45
