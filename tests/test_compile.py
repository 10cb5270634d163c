"""The train setting ``compile`` (llmpipe.config.runs.compile_settings) and per-block compilation
(llmpipe.train.speedups.compile_blocks / the ``llmpipe_compile_blocks`` callback), on the CPU.

torch.compile runs with the ``aot_eager`` backend here (dynamo + AOT autograd, no C++ toolchain or GPU); what is
checked is that the blocks really run through dynamo, that names and checkpoints stay those of the eager model,
and that training through llm-foundry's ``train()`` gives the eager losses and weights.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('llmfoundry')

from llmpipe.config.runs import compile_settings, deep_merge, run_settings, validate_run  # noqa: E402
from llmpipe.config.settings import ConfigError  # noqa: E402
from llmpipe.dispatch.rendezvous import free_port  # noqa: E402
from tests import test_fused_loss as TFL  # noqa: E402
from tests.conftest import retire_process_groups  # noqa: E402


def _counting_backend(runs: list, graphs: list | None = None):
    """A torch.compile backend that runs dynamo's graph eagerly and appends to ``runs`` at every graph run (and each
    compiled graph to ``graphs``): proof that a call went through compiled code."""
    def backend(gm, example_inputs):
        if graphs is not None:
            graphs.append(gm)

        def run(*args):
            runs.append(1)
            return gm.forward(*args)
        return run
    return backend


@pytest.mark.parametrize('value,want', [
    (False, None), (None, None), (True, {'scope': 'model', 'options': {}}),
    ('blocks', {'scope': 'blocks', 'options': {}}), ('Blocks', {'scope': 'blocks', 'options': {}}),
    ('model', {'scope': 'model', 'options': {}}),
    ({'mode': 'max-autotune-no-cudagraphs'}, {'scope': 'model', 'options': {'mode': 'max-autotune-no-cudagraphs'}}),
    ({'scope': 'blocks', 'fullgraph': True}, {'scope': 'blocks', 'options': {'fullgraph': True}}),
    ({'scope': 'Blocks'}, {'scope': 'blocks', 'options': {}}), ({'scope': None}, {'scope': 'model', 'options': {}}),
    ({}, {'scope': 'model', 'options': {}}),
    ({'options': {'max_autotune': True}, 'dynamic': None}, {'scope': 'model',
                                                            'options': {'options': {'max_autotune': True},
                                                                        'dynamic': None}}),
])
def test_compile_settings(value, want):
    assert compile_settings({'compile': value}) == want


@pytest.mark.parametrize('value,key', [
    ('layers', ''), (3, ''), (['blocks'], ''), ({'scope': 'layers'}, '.scope'), ({'mode': 'bogus'}, '.mode'),
    ({'fullgrpah': True}, ''), ({'mode': 'max-autotune', 'options': {'x': 1}}, ''), ({'options': 'x'}, '.options'),
    ({'backend': 3}, '.backend'), ({'dynamic': 'maybe'}, '.dynamic'),
])
def test_bad_compile_setting_is_a_config_error(value, key):
    """At plan time, naming the setting (and the key under it), for models and finetunes; also when the
    llm-foundry config of a finetune is built (the run-time path names the finetune, not a model)."""
    from llmpipe.train.finetune import foundry_finetune_config
    config = deep_merge(TFL._project_config(), {'models': {'mpt-125m': {'train': {'compile': value}}}})
    with pytest.raises(ConfigError, match=r'models\.mpt-125m\.train\.compile' + key.replace('.', r'\.')):
        validate_run(config, 'mpt-125m')
    config = deep_merge(TFL._project_config(), {'finetunes': {'mpt-tiny-sft': {'train': {'compile': value}}}})
    with pytest.raises(ConfigError, match=r'finetunes\.mpt-tiny-sft\.train\.compile'):
        validate_run(config, 'mpt-tiny-sft')
    with pytest.raises(ConfigError, match=r'finetunes\.mpt-tiny-sft\.train\.compile'):
        foundry_finetune_config(run_settings(config, 'mpt-tiny-sft'), base_path='/nonexistent', save_folder=None,
                                world_size=1, instructions_dir=None)


def test_train_and_finetune_configs_carry_the_compile_scope():
    from llmpipe.train.finetune import foundry_finetune_config
    from llmpipe.train.pretrain import foundry_train_config
    config = TFL._project_config()

    def built(cfg, run='mpt-125m'):
        return foundry_train_config(run_settings(cfg, run), data_dir=None, save_folder=None, world_size=1)

    cfg = built(config)       # config.yaml: compile true
    assert cfg['compile_config'] == {} and 'llmpipe_compile_blocks' not in cfg['callbacks']
    blocks = deep_merge(config, {'models': {'mpt-125m': {'train': {'compile': 'blocks'}}}})
    cfg = built(blocks)
    assert 'compile_config' not in cfg and cfg['callbacks']['llmpipe_compile_blocks'] == {}
    opts = deep_merge(config, {'models': {'mpt-125m': {'train': {'compile': {'scope': 'blocks', 'mode': 'max-autotune'}}}}})
    assert built(opts)['callbacks']['llmpipe_compile_blocks'] == {'mode': 'max-autotune'}
    from llmpipe.config.schema import coerce   # snakemake --config passes 'False'; rules/common.smk types it
    off = coerce(deep_merge(config, {'models': {'mpt-125m': {'train': {'compile': 'False'}}}}))
    cfg = built(off)
    assert 'compile_config' not in cfg and 'llmpipe_compile_blocks' not in cfg['callbacks']
    ft = deep_merge(config, {'finetunes': {'mpt-tiny-sft': {'train': {'compile': 'blocks'}}}})
    cfg = foundry_finetune_config(run_settings(ft, 'mpt-tiny-sft'), base_path='/nonexistent', save_folder=None,
                                  world_size=1, instructions_dir=None)
    assert 'compile_config' not in cfg and cfg['callbacks']['llmpipe_compile_blocks'] == {}


def test_compile_is_speed_only():
    from llmpipe.config.runs import SPEED_ONLY_TRAIN_KEYS
    from llmpipe.steps.training import train_identity
    assert 'compile' in SPEED_ONLY_TRAIN_KEYS
    config = TFL._project_config()
    other = deep_merge(config, {'models': {'mpt-125m': {'train': {'compile': 'blocks'}}}})
    assert train_identity(other, 'mpt-125m') == train_identity(config, 'mpt-125m')


def test_compile_blocks_runs_the_blocks_through_dynamo_with_eager_names_and_results():
    """Every block call runs a dynamo graph (a counting backend), names stay the eager ones, and loss and
    gradients equal the eager stock model's."""
    import torch._dynamo

    from llmpipe.train import speedups
    torch._dynamo.reset()
    stock, fused = TFL._models(fused_loss_chunk_size=7)
    names = list(fused.state_dict())
    graphs, runs = [], []

    steps = 2
    try:
        assert speedups.compile_blocks(fused, backend=_counting_backend(runs, graphs)) == TFL.MPT_KW['n_layers']
        stock.train()
        fused.train()
        for _ in range(steps):
            batch = TFL._batch()
            del batch['attention_mask']
            lf, ls = fused.loss(fused(batch), batch), stock.loss(stock(batch), batch)
            torch.testing.assert_close(lf, ls, atol=1e-6, rtol=1e-6)
            lf.backward()
            ls.backward()
    finally:
        torch._dynamo.reset()
    assert graphs and len(runs) == steps * TFL.MPT_KW['n_layers']   # each block forward ran a compiled graph
    assert list(fused.state_dict()) == names   # no _orig_mod prefixes: checkpoints stay the eager model's
    for (name, p), (_, q) in zip(fused.named_parameters(), stock.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=lambda m: f'{name}: {m}')


def test_compile_blocks_finds_the_blocks_of_an_exported_checkpoint(tmp_path):
    """A finetune loads our HF export with trust_remote_code: its blocks are the export's own copy of MPTBlock
    (another class object than llm-foundry's); they are compiled too."""
    import torch._dynamo
    from llmfoundry.models.layers.blocks import MPTBlock
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
    from llmfoundry.utils.huggingface_hub_utils import edit_files_for_hf_compatibility
    from transformers import AutoModelForCausalLM

    from llmpipe.train import speedups
    out = str(tmp_path / 'hf')
    model = MPTForCausalLM(MPTConfig(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=32,
                                     vocab_size=64, attn_config={'attn_impl': 'torch'}))
    MPTConfig.register_for_auto_class()
    MPTForCausalLM.register_for_auto_class('AutoModelForCausalLM')
    model.save_pretrained(out, safe_serialization=True)
    edit_files_for_hf_compatibility(out)
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    blocks = [m for m in hf.modules() if type(m).__name__ == 'MPTBlock']
    assert len(blocks) == 2 and not any(isinstance(b, MPTBlock) for b in blocks)   # the export's own class
    runs = []

    torch._dynamo.reset()
    try:
        assert speedups.compile_blocks(hf, backend=_counting_backend(runs)) == 2
        ids = torch.randint(0, 64, (2, 16))
        hf(input_ids=ids, labels=ids).loss.backward()
    finally:
        torch._dynamo.reset()
    assert len(runs) >= 2   # compiled graphs ran for both blocks (the export's torch attention adds graph breaks)


def test_compile_blocks_refuses_a_model_without_mpt_blocks():
    from llmpipe.train import speedups
    with pytest.raises(ValueError, match='no MPT transformer block'):
        speedups.compile_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_llm_foundry_train_with_compiled_blocks_matches_eager(tmp_path, monkeypatch):
    """The callback through llm-foundry's train() (project config for mpt-tiny, synthetic tokens): the blocks of
    the trained model are compiled, and the loss curve and weights equal the eager run's."""
    import torch._dynamo
    from llmfoundry.command_utils import train
    from omegaconf import OmegaConf

    from llmpipe.train.pretrain import register_extensions
    for k, v in {'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '1', 'NODE_RANK': '0',
                 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    bench = TFL._bench()
    bench._register_synthetic_loader()
    register_extensions(compile_enabled=True)
    tok_dir = bench._dummy_tokenizer_dir(64)

    def run(variant, options=None):
        cfg, knobs = bench.build_train_config(TFL._project_config(), 'mpt-tiny', variant, steps=3, mb_override=8,
                                              tok_dir=tok_dir)
        if options is not None:
            cfg['callbacks']['llmpipe_compile_blocks'] = options
        cfg['callbacks']['llmpipe_run_monitor'] = {'log_interval': 1}
        cfg['seed'] = 5
        torch._dynamo.reset()
        trainer = train(OmegaConf.create(cfg))
        try:
            monitor = next(cb for cb in trainer.state.callbacks if type(cb).__name__ == 'RunMonitor')
            blocks = [m for m in trainer.state.model.modules() if type(m).__name__ == 'MPTBlock']
            compiled = [m._compiled_call_impl is not None for m in blocks]
            params = {n: p.detach().clone() for n, p in trainer.state.model.named_parameters()}
            return [r['loss'] for r in monitor.records], params, compiled, knobs
        finally:
            trainer.close()
            torch._dynamo.reset()
            retire_process_groups()   # train() made a process group from the env set above; later tests must not inherit it

    # a named backend that counts graph runs: proves the callback's options reach torch.compile
    graph_runs = []

    def llmpipe_test_counting(gm, example_inputs):   # aot_eager, counting each forward graph run
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def forward_compiler(fx, _inputs):
            def run(*args):
                graph_runs.append(1)
                return fx(*args)
            return make_boxed_func(run)

        return aot_autograd(fw_compiler=forward_compiler,
                            bw_compiler=lambda fx, _inputs: make_boxed_func(fx))(gm, example_inputs)

    from torch._dynamo import list_backends, register_backend
    if 'llmpipe_test_counting' not in list_backends(exclude_tags=()):
        register_backend(llmpipe_test_counting)
    eager_losses, eager, eager_compiled, _ = run(bench.VARIANTS['nometrics'])
    assert not graph_runs
    losses, params, compiled, knobs = run({**bench.VARIANTS['nometrics'], 'compile': 'blocks', 'compile_fix': True},
                                          {'backend': 'llmpipe_test_counting'})
    assert graph_runs, 'the backend named in the callback options never ran'
    assert knobs['compile'] == 'blocks,fix'
    assert eager_compiled and not any(eager_compiled)
    assert len(compiled) == 2 and all(compiled)
    assert losses == pytest.approx(eager_losses, rel=1e-5) and len(losses) == 3
    for name, p in eager.items():
        torch.testing.assert_close(params[name], p, atol=2e-5, rtol=1e-4, msg=lambda m: f'{name}: {m}')


def _fsdp_compiled_blocks_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import datetime
    import functools
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    from llmpipe.train import speedups
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    # a bounded timeout: a rank that fails leaves the other in a collective for 5 minutes, not gloo's 30
    dist.init_process_group('gloo', rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    runs = []

    stock, fused = TFL._models(fused_loss_chunk_size=11)
    # what the llmpipe_compile_blocks callback does at Event.INIT, before composer wraps the model in FSDP
    speedups.compile_blocks(fused, backend=_counting_backend(runs))

    def policy(m):  # composer's: modules marked _fsdp_wrap (wte, norm_f, ...) and MPT's blocks
        return bool(getattr(m, '_fsdp_wrap', False)) or fused.model.fsdp_wrap_fn(m)

    fused.model = FSDP(fused.model, use_orig_params=True, device_id=torch.device('cpu'),
                       auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=policy))
    fused.train()
    stock.train()
    torch.manual_seed(1)   # every rank the same batches: the FSDP average equals one process' gradient
    batches = [TFL._batch(b=4), TFL._batch(b=4)]
    for batch in batches:
        (fused.loss(fused(batch), batch) * 0.5).backward()
    for batch in batches:
        (stock.loss(stock(batch), batch) * 0.5).backward()
    with FSDP.summon_full_params(fused.model, with_grads=True):
        diffs = {n: float((p.grad.float() - q.grad).abs().max() / q.grad.abs().max())
                 for (n, p), (_, q) in zip(fused.model.named_parameters(), stock.model.named_parameters())}
    if rank == 0:
        torch.save({'diffs': diffs, 'runs': len(runs)}, out_path)
    # no destroy_process_group(): gloo's can block forever once the other rank has exited (the same worker in
    # tests/test_fused_loss.py hung for 15 minutes that way once); the process ends right after, closing the sockets


def test_compiled_blocks_under_fsdp_give_the_stock_gradients(tmp_path):
    """Blocks compiled in place and then wrapped by FSDP (two CPU ranks, gloo, use_orig_params as composer sets
    it): every block call runs the compiled graph and the gradients equal the eager stock model's."""
    import torch.multiprocessing as mp
    out = str(tmp_path / 'diffs.pt')
    mp.spawn(_fsdp_compiled_blocks_worker, args=(2, free_port(), out), nprocs=2, join=True)
    res = torch.load(out)
    assert res['runs'] == 2 * TFL.MPT_KW['n_layers']
    assert len(res['diffs']) == len(list(TFL._models()[0].model.parameters()))
    assert max(res['diffs'].values()) < 1e-5, res['diffs']
