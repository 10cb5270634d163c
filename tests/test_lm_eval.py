"""The optional second harness (lm-evaluation-harness, rule ``lm_eval``): off by default, its settings checked in the
dry run, its result file free of NaN and labelled with the harness's version, and, on the tiny run's real export,
scores that agree with the model's own log-likelihoods computed here with transformers (no network).

The stand-in tasks are written here (a multiple-choice task and a rolling log-likelihood task); they are not
copies of any benchmark. With ``LLMPIPE_REQUIRE_LM_EVAL=1`` (``make test``) a missing lm_eval fails these tests
instead of skipping them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil

import pytest

from llmpipe.evaluation import harness
from llmpipe.config.settings import ConfigError
from tests.conftest import REPO, copy_run, planned_jobs, snakemake

TARGET = "results/mpt-tiny/eval-lm_eval.json"


def need_lm_eval():
    if harness.installed_version() is None:
        if os.environ.get("LLMPIPE_REQUIRE_LM_EVAL") == "1":
            pytest.fail(f"LLMPIPE_REQUIRE_LM_EVAL=1 but lm_eval is not installed ({harness.INSTALL_HINT})")
        pytest.skip("lm_eval is not installed (optional: envs/lm-eval.lock)")


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_task_yamls_must_read_local_files(tmp_path):
    """A task YAML that would read the hub, or local data files that are not there, stops the dry run."""
    (tmp_path / "hub.yaml").write_text("task: hub\ndataset_path: allenai/ai2_arc\noutput_type: multiple_choice\n")
    with pytest.raises(ConfigError, match=r"'hub' .* has dataset_path 'allenai/ai2_arc', which lm_eval would fetch"):
        harness.check_inputs(["hub"], str(tmp_path), version="0.4.13")
    (tmp_path / "miss.yaml").write_text("task: miss\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        "    test: d/*.jsonl\nprocess_docs: !function utils.process\n")
    with pytest.raises(ConfigError, match=r"'miss' .* reads 'd/\*\.jsonl', which matches no file under"):
        harness.check_inputs(["miss"], str(tmp_path), version="0.4.13")
    write_jsonl(tmp_path / "d" / "test.jsonl", [{"x": 1}])
    assert str(tmp_path / "d" / "test.jsonl") in harness.check_inputs(["miss"], str(tmp_path), version="0.4.13")


def test_a_model_too_large_for_one_gpu_is_refused_in_the_dry_run():
    """lm_eval runs the model in one process on one GPU: MPT-70B (about 250 GiB to evaluate) on an 80 GB GPU is
    refused before anything is queued, naming the target to leave out; MPT-1B passes."""
    from llmpipe.steps.lm_eval_harness import check_fits_one_gpu
    from tests.conftest import project_config

    config = project_config()
    config["gpu_type"] = "h100"
    with pytest.raises(ConfigError, match=r"^models\.mpt-70b: lm_eval scores mpt-70b in one process on one GPU.*"
                                          r"Fix: leave results/mpt-70b/eval-lm_eval\.json out of the targets"):
        check_fits_one_gpu(config, "mpt-70b")
    check_fits_one_gpu(config, "mpt-1b")


CHOICE_YAML = """\
task: standin_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: choice/test.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: label
doc_to_choice: "{{choices}}"
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
metadata: {version: 1.0}
"""

TEXT_YAML = """\
task: standin_text
dataset_path: json
dataset_kwargs:
  data_files: [text/*.jsonl]
test_split: train
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}
metadata: {version: 1.0}
"""

#: Our own questions and texts (never a benchmark's).
QUESTIONS = [
    ("What does a module docstring describe?", ["the module", "a tuple of numbers", "rain"]),
    ("Which keyword defines a function?", ["def", "while the loop runs", "import"]),
    ("What does the tokenizer produce?", ["tokens", "a picture", "the default value of a keyword"]),
    ("Where are the files written?", ["in the folder", "never", "to the standard error stream of a process"]),
    ("How many items does the list hold?", ["three", "a string", "none of the arguments"]),
    ("What is returned when nothing is found?", ["None", "the first element of the sequence", "True"]),
    ("Which object raises the error?", ["the parser", "a class attribute", "zero"]),
    ("What does the function take?", ["an argument", "the name of the file to open", "four"]),
]
TEXTS = [
    "The function returns a new list with the items in sorted order.",
    "Each call opens the file, reads one line and closes it again.",
    "A module can define classes, functions and variables.",
    "The default value is used when the argument is not given.",
    "Errors that are raised inside the loop stop the iteration.",
]


# ---------------------------------------------------------------------------------------------- settings, DAG


def test_settings_are_checked_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"lm_eval.tasks is empty"):
        harness.check_inputs([], str(tmp_path), version="0.4.13")
    with pytest.raises(ConfigError, match=r"not installed.*envs/lm-eval.lock"):
        harness.check_inputs(["a"], str(tmp_path), version=None)
    with pytest.raises(ConfigError, match=r"lm_eval.data_dir: .* is not a folder"):
        harness.check_inputs(["a"], str(tmp_path / "missing"), version="0.4.13")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.yaml").write_text("task: a\ndataset_path: json\n")
    (tmp_path / "g.yml").write_text("group: g\ntask:\n  - a\n")
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / ".hidden").write_text("x")
    with pytest.raises(ConfigError, match=r"lm_eval.tasks: \['b'\] are defined by no YAML .*found: \['a', 'g'\]"):
        harness.check_inputs(["a", "b"], str(tmp_path), version="0.4.13")
    files = harness.check_inputs(["a", "g"], str(tmp_path), version="0.4.13")
    assert files == [str(tmp_path / f) for f in ("a.jsonl", "g.yml", "sub/a.yaml")]


def test_off_by_default_and_a_request_without_tasks_fails_the_dry_run(workdir):
    assert "lm_eval" not in planned_jobs(snakemake(workdir, "-n"))
    proc = snakemake(workdir, "-n", TARGET, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "lm_eval.tasks is empty" in out, out[-3000:]
    proc = snakemake(workdir, "-n", TARGET, "--config", "lm_eval={tasks: [t], data_dir: no/such/dir}", check=False)
    out = proc.stdout + proc.stderr
    if harness.installed_version() is not None:
        assert proc.returncode != 0 and "lm_eval.data_dir: 'no/such/dir' is not a folder" in out, out[-3000:]
    else:
        assert proc.returncode != 0 and "lm-evaluation-harness (lm_eval) is not installed" in out, out[-3000:]


# ---------------------------------------------------------------------------------------------- the result file


def test_no_nan_or_infinity_reaches_the_result_file(tmp_path):
    raw_task = {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.25, "f1,none": float("nan"),
                "f1_stderr,none": 0.1, "ppl,none": 12.0, "ppl_stderr,none": "N/A", "em,strict": 1.0,
                "em_stderr,strict": float("inf"), "bpb,none": float("inf"), "bpb_stderr,none": "N/A"}
    metrics, absent = harness.metric_entries(raw_task)
    assert metrics == {"acc": {"value": 0.5, "stderr": 0.25}, "ppl": {"value": 12.0, "stderr": None},
                       "em/strict": {"value": 1.0, "stderr": None}}
    assert set(absent) == {"f1", "bpb", "ppl.stderr", "em/strict.stderr"}
    assert "nan" in absent["f1"] and "'N/A'" in absent["ppl.stderr"] and "inf" in absent["em/strict.stderr"]
    (tmp_path / "t.yaml").write_text("task: t\n")
    write_jsonl(tmp_path / "d" / "test.jsonl", [{"x": 1}])
    conf = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "d/*.jsonl"}},
            "output_type": "multiple_choice", "metadata": {"config_source": str(tmp_path / "t.yaml")}}
    raw = {"results": {"t": raw_task}, "configs": {"t": conf}, "n-samples": {"t": {"original": 4, "effective": 2}},
           "n-shot": {"t": 0}, "versions": {"t": 1.0}}
    rec = harness.result_record(raw, str(tmp_path), version="9.9", settings={})
    json.dumps(rec, allow_nan=False)  # raises on NaN or infinity
    task = rec["tasks"]["t"]
    assert rec["harness"] == "lm-evaluation-harness" and rec["version"] == "9.9"
    assert task["items"] == {"scored": 2, "available": 4}
    assert task["yaml"]["sha256"] == hashlib.sha256(b"task: t\n").hexdigest()
    data = (tmp_path / "d" / "test.jsonl").read_bytes()
    assert task["data_files"] == [{"path": "d/test.jsonl", "sha256": hashlib.sha256(data).hexdigest(),
                                   "bytes": len(data)}]
    raw["n-samples"]["t"]["effective"] = 0
    with pytest.raises(ValueError, match="scored no item"):
        harness.result_record(raw, str(tmp_path), version="9.9", settings={})


# ---------------------------------------------------------------------------------------------- on the tiny export


def model_loglikelihoods(hf_dir):
    """The export's log-likelihoods computed here with transformers, as lm_eval defines them: a continuation's summed
    log-probabilities after its context (tokens of ``context + continuation`` past those of ``context``), and a
    text's summed log-probabilities after the end-of-text token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, torch_dtype=torch.float32).eval()

    def summed(ids, first):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), -1)
        return float(sum(logp[j - 1, ids[j]] for j in range(first, len(ids))))

    def continuation(context, cont):
        return summed(tok(context + cont).input_ids, len(tok(context).input_ids))

    def text(t):
        return summed([tok.eos_token_id] + tok(t).input_ids, 1)

    return continuation, text


@pytest.mark.slow
def test_lm_eval_scores_the_tiny_export_offline_as_computed_by_hand(tiny_run, tmp_path):
    need_lm_eval()
    wd = copy_run(tiny_run, tmp_path / "wd")
    continuation, text_ll = model_loglikelihoods(str(wd / "results/mpt-tiny/hf"))

    # multiple choice: the label is the model's favourite for the first 5 questions and its least favourite for the
    # other 3, so accuracy must be exactly 5/8 (margins checked: batching noise cannot flip a choice)
    rows, correct, correct_norm = [], [], []
    for i, (q, choices) in enumerate(QUESTIONS):
        lls = [continuation(f"Question: {q}\nAnswer:", " " + c) for c in choices]
        order = sorted(range(len(lls)), key=lls.__getitem__)
        label = order[-1] if i < 5 else order[0]
        assert abs(lls[order[-1]] - lls[order[-2]]) > 1e-3 and abs(lls[order[0]] - lls[order[1]]) > 1e-3
        norm = [ll / len(c) for ll, c in zip(lls, choices)]
        rows.append({"question": q, "choices": choices, "label": label})
        correct.append(float(label == order[-1]))
        correct_norm.append(float(label == max(range(len(norm)), key=norm.__getitem__)))
    data = wd / "lm_eval_data"
    write_jsonl(data / "choice" / "test.jsonl", rows)
    # the example of docs/evaluation.md (lm_eval's arc_easy on local files) on stand-in rows of ARC's layout: labels A-D, the
    # model's favourite right for the first 2 of 3 questions
    arc_rows, arc_correct = [], 0
    for i, (q, choices) in enumerate(QUESTIONS[:3]):
        lls = [continuation(f"Question: {q}\nAnswer:", " " + c) for c in choices]
        best = max(range(len(lls)), key=lls.__getitem__)
        key = best if i < 2 else (best + 1) % len(choices)
        arc_correct += key == best
        arc_rows.append({"id": f"standin-{i}", "question": q, "answerKey": "ABC"[key],
                         "choices": {"text": choices, "label": ["A", "B", "C"]}})
    for split, part in (("train", arc_rows[:1]), ("validation", arc_rows[:1]), ("test", arc_rows)):
        write_jsonl(data / "arc_easy" / f"{split}.jsonl", part)
    shutil.copy(REPO / "docs/lm_eval/arc_easy_local.yaml", data / "arc_easy_local.yaml")
    write_jsonl(data / "text" / "part-0.jsonl", [{"text": t} for t in TEXTS[:3]])
    write_jsonl(data / "text" / "part-1.jsonl", [{"text": t} for t in TEXTS[3:]])
    (data / "choice.yaml").write_text(CHOICE_YAML)
    (data / "text.yaml").write_text(TEXT_YAML)

    settings = "lm_eval={tasks: [standin_choice, standin_text, arc_easy_local], batch_size: 3}"
    assert planned_jobs(snakemake(wd, "-n", TARGET, "--config", settings)) == {"lm_eval": 1}
    eval_json = (wd / "results/mpt-tiny/eval.json").read_bytes()
    # no hub: the harness sets the offline variables itself; any request that still went out would hit a dead proxy
    dead = "http://127.0.0.1:9"
    snakemake(wd, "--cores", "2", TARGET, "--config", settings,
              env={"HTTP_PROXY": dead, "HTTPS_PROXY": dead, "http_proxy": dead, "https_proxy": dead})
    text = (wd / TARGET).read_text()
    res = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the result file"))
    assert (wd / "results/mpt-tiny/eval.json").read_bytes() == eval_json  # llm-foundry's file is left alone
    assert res["harness"] == "lm-evaluation-harness" and res["version"] == harness.installed_version()
    assert res["settings"]["model_args"]["max_length"] == 128 and res["settings"]["device"] == "cpu"

    mc = res["tasks"]["standin_choice"]
    n = len(QUESTIONS)
    assert mc["items"] == {"scored": n, "available": n} and mc["num_fewshot"] == 0
    assert mc["metrics"]["acc"]["value"] == pytest.approx(5 / 8, abs=1e-12) == sum(correct) / n
    p = sum(correct) / n
    assert mc["metrics"]["acc"]["stderr"] == pytest.approx(math.sqrt(p * (1 - p) * n / (n - 1) / n), rel=1e-9)
    assert mc["metrics"]["acc_norm"]["value"] == pytest.approx(sum(correct_norm) / n, abs=1e-12)

    lm = res["tasks"]["standin_text"]
    assert lm["items"] == {"scored": len(TEXTS), "available": len(TEXTS)}
    total_ll = sum(text_ll(t) for t in TEXTS)
    words = sum(len(re.split(r"\s+", t)) for t in TEXTS)
    nbytes = sum(len(t.encode()) for t in TEXTS)
    assert lm["metrics"]["word_perplexity"]["value"] == pytest.approx(math.exp(-total_ll / words), rel=1e-4)
    assert lm["metrics"]["bits_per_byte"]["value"] == pytest.approx(-total_ll / nbytes / math.log(2), rel=1e-4)
    assert lm["metrics"]["bits_per_byte"]["stderr"] is None and "bits_per_byte.stderr" in lm["absent"]

    arc = res["tasks"]["arc_easy_local"]
    assert arc["items"] == {"scored": 3, "available": 3} and arc_correct == 2
    assert arc["metrics"]["acc"]["value"] == pytest.approx(2 / 3, abs=1e-12)
    assert [f["path"] for f in arc["data_files"]] == [f"arc_easy/{s}.jsonl" for s in ("test", "train", "validation")]

    def sha(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    assert mc["yaml"] == {"path": "choice.yaml", "sha256": sha(data / "choice.yaml"),
                          "bytes": len(CHOICE_YAML.encode())}
    assert [(f["path"], f["sha256"]) for f in lm["data_files"]] == [
        (f"text/part-{i}.jsonl", sha(data / "text" / f"part-{i}.jsonl")) for i in (0, 1)]
    # a changed data file reruns the harness alone
    write_jsonl(data / "text" / "part-1.jsonl", [{"text": t} for t in TEXTS[3:4]])
    assert planned_jobs(snakemake(wd, "-n", TARGET, "--config", settings)) == {"lm_eval": 1}
