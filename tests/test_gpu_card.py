"""Plans that know their GPU (llmpipe.plan.card): ``gpu_type: auto`` plans for the card nvidia-smi reports (faked here:
a replaced runner, or a fake ``nvidia-smi`` first on PATH), a Slurm run for the site file's ``gpu_type``, checked by
the preflight against the partition's gres type; and the refusal of a training whose model states alone exceed the
card (issue 49, items 1 and 5)."""

from __future__ import annotations

import json
import re
import stat
import types

import pytest

from llmpipe.config import runs as cfg
from llmpipe.config.runs import deep_merge, run_config, step_resources
from llmpipe.config.settings import ConfigError
from llmpipe.dispatch import slurm
from llmpipe.plan import card
from llmpipe.plan import memory_time as plan
from llmpipe.plan.dag_checks import DagChecks
from tests.conftest import REPO, project_config, snakemake

H100 = "NVIDIA H100 80GB HBM3, 81559 MiB\n"
H200 = "NVIDIA H200, 143771 MiB\n"
ADA = "NVIDIA RTX 6000 Ada Generation, 49140 MiB\n"


@pytest.fixture
def smi(monkeypatch):
    """``smi(text)``: this process's nvidia-smi answers ``text`` ('' = no nvidia-smi) until the test ends."""
    def fake(text: str) -> None:
        monkeypatch.setattr(card, "RUNNER", lambda: text)
        card.clear_cache()
    yield fake
    card.clear_cache()


def _plan_lines(capsys, config, *steps_runs) -> dict[str, str]:
    checks = DagChecks(config)
    checks.check_settings()
    for rule, run in steps_runs:
        checks.resources(rule, types.SimpleNamespace(run=run))
    err = capsys.readouterr().err
    return {m.group(1): m.group(0) for m in re.finditer(r"^plan (\w+) \S+: .*$", err, re.M)}


def test_device_names_map_to_the_tables_keys():
    table = plan.GPU_MEMORY_GB
    got = {name: card.card_for_device(name, mem, table) for name, mem in (
        ("NVIDIA H100 80GB HBM3", 79.6), ("NVIDIA H100 PCIe", 79.6), ("NVIDIA H100 NVL", 93.6), ("NVIDIA H200", 139.8),
        ("NVIDIA A100-SXM4-40GB", 39.4), ("NVIDIA A100 80GB PCIe", 79.2), ("NVIDIA A100-SXM4-80GB", 79.2),
        ("NVIDIA GH200 480GB", 95.0), ("Tesla V100-SXM2-32GB", 31.7), ("NVIDIA L40S", 44.5))}
    assert got == {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H100 NVL": "h100-nvl",
                   "NVIDIA H200": "h200", "NVIDIA A100-SXM4-40GB": "a100-40gb", "NVIDIA A100 80GB PCIe": "a100-80gb",
                   "NVIDIA A100-SXM4-80GB": "a100-80gb", "NVIDIA GH200 480GB": None, "Tesla V100-SXM2-32GB": None,
                   "NVIDIA L40S": "l40s"}
    # a plain A100 by its memory
    assert card.card_for_device("NVIDIA A100", 39.4, table) == "a100-40gb"
    assert card.parse_nvidia_smi(H100 + H100) == [("NVIDIA H100 80GB HBM3", 81559 / 1024)] * 2
    # several types: the plans are for the smallest
    c = card.resolve("auto", devices=card.parse_nvidia_smi(H200 + H100))
    assert (c.gpu_type, c.memory_gb, c.device) == ("h100", 80.0, "NVIDIA H100 80GB HBM3")


def test_a_detected_h100_is_what_every_plan_line_names(smi, capsys):
    """The schema's default gpu_type is auto: with an H100 80GB on this machine, the 1B's training, generation and
    evaluation plan for 80 GiB and say which card; the training's time starts from the H100 rows of
    benchmarks/plan-basis.json, the evaluation's from the h200 row at the H100's peak."""
    config = deep_merge(project_config(), {"models": {"mpt-1b": {"resources": {"gpus_per_node": 1}}}})
    assert config["gpu_type"] == "auto"
    smi(H100)
    lines = _plan_lines(capsys, config, ("train", "mpt-1b"), ("generate", "mpt-1b"), ("eval", "mpt-1b"))
    for step in ("train", "generate", "eval"):
        assert re.match(rf"plan {step} mpt-1b: [\d.]+ GiB per GPU of 80 GiB \(h100, nvidia-smi: NVIDIA H100 80GB "
                        r"HBM3\)", lines[step]), lines[step]
        assert "141 GiB" not in lines[step] and "not in llmpipe's GPU tables" not in lines[step]
    assert "named by benchmarks/plan-basis.json for h100) x h100 bf16 peak" in lines["train"], lines["train"]
    assert "acceptance-h100-mpt-1b-nokill.json" in lines["train"]
    assert "(eval-plan-basis.json: its h200 row at the h100 bf16 peak)" in lines["eval"], lines["eval"]
    mem = plan.train_memory(run_config(config, "mpt-1b"), nodes=1, gpus_per_node=1, capacity_gb=80)
    assert f"{mem['total_gb']:.1f} GiB per GPU of 80 GiB" in lines["train"]
    # an H200 here: the same settings plan for 141 GiB
    smi(H200)
    lines = _plan_lines(capsys, config, ("train", "mpt-1b"))
    assert "GiB per GPU of 141 GiB (h200, nvidia-smi: NVIDIA H200)" in lines["train"], lines["train"]
    assert "for h200) x h200 bf16 peak" in lines["train"]


def test_mpt_3b_recomputes_on_a_detected_80gb_card(smi, capsys, tmp_path):
    """MPT-3B on one GPU needs about 82 GiB without recompute (above 85% of an 80 GB card): with a detected H100 the
    plan and the training job's settings choose recompute, with a detected H200 they do not."""
    from llmpipe.config.runs import run_settings
    from llmpipe.steps.context import StepContext
    from llmpipe.steps.training import training_task

    tok = tmp_path / "tokenizer" / "manifest.json"
    tok.parent.mkdir()
    tok.write_text(json.dumps({"vocab_size": 50000}))
    config = deep_merge(project_config(), {"models": {"mpt-3b": {"resources": {"gpus_per_node": 1}}}})
    for text, want in ((H100, True), (H200, False)):
        smi(text)
        line = _plan_lines(capsys, config, ("train", "mpt-3b"))["train"]
        assert f"activation checkpointing {'on' if want else 'off'} (auto: " in line, line
        ctx = StepContext(rule="train", config=config, wildcards=types.SimpleNamespace(run="mpt-3b"),
                          input=types.SimpleNamespace(tokenizer=str(tok), data=str(tmp_path / "data" / "v.json")),
                          output=[str(tmp_path / "mpt-3b" / "train.json")], params=types.SimpleNamespace(identity="x"),
                          log_file=str(tmp_path / "log"), log_dir=None, resources={}, key="k", executor="local")
        task = training_task(ctx, config, "mpt-3b", run_settings(config, "mpt-3b"))
        assert task.settings.train.fsdp["activation_checkpointing"] is want, text


def test_an_unknown_card_says_so_and_how_to_add_it(smi, capsys):
    config = deep_merge(project_config(), {"models": {"mpt-1b": {"resources": {"gpus_per_node": 1}}}})
    smi(ADA)
    line = _plan_lines(capsys, config, ("train", "mpt-1b"))["train"]
    key = "rtx 6000 ada generation"
    assert f"of 48 GiB ({key}, nvidia-smi: NVIDIA RTX 6000 Ada Generation)" in line, line
    assert f"card '{key}' is not in llmpipe's GPU tables" in line and "; time " not in line
    assert (f"Fix: add it to the config: gpu_memory_gb: {{'{key}': <datasheet GB>}}, gpu_peak_flops: {{'{key}': "
            f"<dense bf16 FLOP/s>}}") in line
    # added as the line says: planned at the given memory, with a time and no note
    config = deep_merge(config, {"gpu_memory_gb": {key: 48}, "gpu_peak_flops": {key: 364.2e12}})
    line = _plan_lines(capsys, config, ("train", "mpt-1b"))["train"]
    assert f"of 48 GiB ({key}, nvidia-smi" in line and "; time " in line and "x " + key + " bf16 peak" in line
    assert "not in llmpipe's GPU tables" not in line


def test_without_a_gpu_the_plans_are_for_the_cpu(smi, capsys):
    config = project_config()
    smi("")   # no nvidia-smi
    lines = _plan_lines(capsys, config, ("train", "mpt-1b"), ("eval", "mpt-1b"), ("eval", "mpt-tiny"))
    assert re.match(r"plan train mpt-1b: [\d.]+ GiB per GPU, planned for no card \(no GPU: gpu_type is auto and "
                    r"nvidia-smi finds none on this machine\) = states", lines["train"]), lines["train"]
    assert "; time " not in lines["train"]
    assert cfg.gpu_memory(config) is None and cfg.inference_plan(config, "eval", "mpt-1b") is None
    capsys.readouterr()
    checks = DagChecks(config)
    checks.resources("eval", types.SimpleNamespace(run="mpt-1b"))
    out = capsys.readouterr().err
    assert "plan eval mpt-1b: planned for the CPU (no GPU: gpu_type is auto" in out, out


def test_auto_is_refused_on_slurm_and_the_site_file_names_a_card(smi):
    smi(H100)  # this machine's card is no Slurm job's
    config = deep_merge(project_config(), {"dispatch": {"executor": "slurm"}})
    with pytest.raises(ConfigError, match=r"^gpu_type is 'auto', .* dispatch\.executor is slurm.* Fix: set the "
                                          r"top-level gpu_type in config/slurm-site\.yaml"):
        DagChecks(config, main_process=False).check_settings()
    import yaml
    site = yaml.safe_load((REPO / "config/slurm-site.yaml").read_text())
    assert site["gpu_type"] in plan.GPU_MEMORY_GB
    c = cfg.gpu_card(deep_merge(config, {"gpu_type": site["gpu_type"]}))
    assert c.gpu_type == site["gpu_type"] and c.device is None


def _fake_cluster(monkeypatch, gres: str):
    """slurm's queries answered by one partition 'gpu' of two nodes with ``gres``; no associations enforced."""
    answers = {"partition": "PartitionName=gpu Default=YES State=UP TotalNodes=2 MaxTime=UNLIMITED Nodes=g[1-2]\n",
               "config": "AccountingStorageEnforce = none\n",
               "sinfo": "".join(f"g{i}|{gres}|64|512000|idle\n" for i in (1, 2))}

    def run(cmd, timeout, fix=""):
        return answers["sinfo" if cmd[0] == "sinfo" else cmd[2]]

    monkeypatch.setattr(slurm, "_run", run)
    monkeypatch.setattr(slurm.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    slurm.clear_cache()


def test_preflight_refuses_a_gres_type_that_is_not_the_planned_card(monkeypatch):
    res = {"nodes": 1, "gpus_per_node": 8, "tasks_per_node": 8, "cpus_per_task": 4, "mem_gb": 0, "time_min": 60}
    try:
        _fake_cluster(monkeypatch, "gpu:h100:8(S:0-1)")
        config = {"dispatch": {"executor": "slurm"}, "slurm": {}, "gpu_type": "h200"}
        with pytest.raises(ConfigError) as e:
            slurm.preflight(config, res, where="models.mpt-1b.resources")
        msg = str(e.value)
        assert msg.startswith("gpu_type is 'h200': every plan") and "partition 'gpu'" in msg
        assert "gpu:h100 (h100 or h100-nvl or h100-pcie)" in msg
        assert "Fix: set the top-level gpu_type in config/slurm-site.yaml (or --config gpu_type=...) to 'h100'" in msg
        assert slurm.preflight({**config, "gpu_type": "h100"}, res)["partition"] == "gpu"
        assert slurm.preflight({**config, "gpu_type": "h100-pcie"}, res)["partition"] == "gpu"
        assert slurm.preflight({**config, "gpu_type": "h200"}, {**res, "gpus_per_node": 0})  # a CPU step: no check
        # gres that names no known card, or no type: nothing to check against
        for gres in ("gpu:8", "gpu:tesla:8"):
            _fake_cluster(monkeypatch, gres)
            assert slurm.preflight(config, res)["fitting_nodes"] == 2, gres
        # slurm.gpu_type picks the type the job gets on a mixed node
        _fake_cluster(monkeypatch, "gpu:a100:4,gpu:h200:4")
        assert slurm.preflight({**config, "slurm": {"gpu_type": "h200"}}, {**res, "gpus_per_node": 4})
        with pytest.raises(ConfigError, match=r"of slurm\.gpu_type 'a100' are gpu:a100 \(a100-80gb or a100-40gb\).*"
                                              r"to 'a100-80gb'"):
            slurm.preflight({**config, "slurm": {"gpu_type": "a100"}}, {**res, "gpus_per_node": 4})
    finally:
        slurm.clear_cache()


def test_dry_run_plans_for_the_card_a_fake_nvidia_smi_reports(workdir, tmp_path):
    """The whole dry run (no torch) with the shipped config: a fake nvidia-smi first on PATH answering for an H100."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = --query-gpu=name,memory.total ] || exit 9\nprintf '{H100.strip()}\\n'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    import os
    proc = snakemake(workdir, "-n", "results/mpt-1b/train.json", "--config",
                     "models={'mpt-1b': {'resources': {'gpus_per_node': 1}}}",
                     env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    out = proc.stdout + proc.stderr
    assert re.search(r"plan train mpt-1b: [\d.]+ GiB per GPU of 80 GiB \(h100, nvidia-smi: NVIDIA H100 80GB HBM3\)",
                     out), out[-3000:]


# ------------------------------------------------------------------------------------------- item 5: the refusal

def test_a_full_7b_finetune_on_one_80gb_gpu_names_the_fewest_gpus_that_fit():
    """The full MPT-7B finetune's model states (16 bytes x 6.7B parameters, 100 GiB) exceed one 80 GB card: the
    refusal says so, offers neither recompute nor a smaller microbatch, and names the fewest GPUs whose plan fits;
    that many GPUs pass."""
    config = deep_merge(project_config(), {"gpu_type": "h100", "finetunes": {"mpt-7b-dolly": {
        "resources": {"nodes": 1, "gpus_per_node": 1}}}})
    wc = types.SimpleNamespace(run="mpt-7b-dolly")
    with pytest.raises(ConfigError) as e:
        DagChecks(config, main_process=False).resources("finetune", wc)
    msg = str(e.value)
    rc = run_config(config, "mpt-7b-dolly")
    mem = plan.train_memory(rc, nodes=1, gpus_per_node=1, capacity_gb=80)
    assert mem["states_gb"] > 80
    assert msg.startswith("finetunes.mpt-7b-dolly: the train step of mpt-7b-dolly needs about"), msg
    assert f"model states and FSDP buffers alone take {mem['states_gb'] + mem['fsdp_buffers_gb']:.0f} GiB" in msg
    fix = msg[msg.index("Fix: "):]
    assert "microbatch_size" not in fix and "activation_checkpointing" not in fix and "fsdp_min_params" not in fix
    m = re.search(r"more GPUs: at least (\d+) \(finetunes\.mpt-7b-dolly\.resources\.nodes x gpus_per_node = "
                  r"(\d+) x (\d+): ([\d.]+) GiB per GPU; now 1", fix)
    assert m, fix
    n, nodes, per_node = (int(m.group(i)) for i in (1, 2, 3))
    assert n == nodes * per_node and n > 1
    # the fewest: every smaller count the batch trains at plans above the card, that count within it
    gbs = int(rc["train"]["global_batch_size"])
    for k in range(1, n):
        if gbs % k == 0:
            assert plan.train_memory(rc, nodes=1, gpus_per_node=k, capacity_gb=80)["total_gb"] > 80, k
    at_n = plan.train_memory(rc, nodes=nodes, gpus_per_node=per_node, capacity_gb=80)
    assert at_n["total_gb"] <= 80 and f"{at_n['total_gb']:.0f} GiB per GPU" in fix
    fixed = deep_merge(config, {"finetunes": {"mpt-7b-dolly": {"resources": {"nodes": nodes,
                                                                             "gpus_per_node": per_node}}}})
    DagChecks(fixed, main_process=False).resources("finetune", wc)   # passes
    assert step_resources(fixed, "train", "mpt-7b-dolly")["gpus_per_node"] == per_node
    # where only the activations overflow, the refusal still offers recompute and the microbatch
    mem = plan.train_memory(run_config(config, "mpt-7b"), nodes=1, gpus_per_node=8, activation_checkpointing=False,
                            microbatch_size=16)
    with pytest.raises(ConfigError, match=r"Fix: turn on .*activation_checkpointing.*; or a smaller "
                                          r"models\.mpt-7b\.train\.microbatch_size \(now 16\)"):
        plan.check_fits("train", "mpt-7b", mem, 40, "a100-40gb", "models.mpt-7b", run_config(config, "mpt-7b"))
