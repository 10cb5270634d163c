"""Trimmed ICL batches (``eval.icl_batches: trimmed``, :mod:`llmpipe.evaluation.icl_batches`) against llm-foundry's
padded ones: per-item log-likelihoods, correctness and generations of a random MPT in fp32 on the CPU, for every
task type the suites use; the tokens each path runs; the same number of batches on every rank over two gloo
processes."""

from __future__ import annotations

import datetime
import json
import os
import random

import pytest

from llmpipe.dispatch.rendezvous import free_port
from tests.helpers.repeat_model import SPECIAL, WORDS

SEQ = 96
PAD = 0  # <|endoftext|>: pad and EOS of the word tokenizer


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    return str(path)


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(SPECIAL + WORDS)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=SPECIAL[0], pad_token=SPECIAL[0],
                                   unk_token="[UNK]")


def sent(rnd, n):
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def task_files(d, n=24, seed=5):
    """One file per task type. Contexts run from a quarter of the context to more than the context (cut from the
    left), with most items short as in real suites; the first batch of 8 holds both a quarter-context item and the
    cut one; some contexts contain the pad/EOS word ``<|endoftext|>``."""
    rnd = random.Random(seed)
    lengths = ([SEQ // 4, SEQ // 2, SEQ - 8, SEQ + 20] + [rnd.randint(3, 12) for _ in range(20)])[:n]

    def ctx(i):
        words = sent(rnd, lengths[i]).split()
        if i % 4 == 1:
            words[len(words) // 2] = SPECIAL[0]
        return " ".join(words)

    return {
        "language_modeling": write_jsonl(d / "lm.jsonl", [{"context": ctx(i), "continuation": " " + sent(rnd, 2)}
                                                          for i in range(n)]),
        "multiple_choice": write_jsonl(d / "mc.jsonl", [{"query": ctx(i), "choices": [sent(rnd, rnd.randint(1, 4))
                                                          for _ in range(3)], "gold": rnd.randint(0, 2)}
                                                         for i in range(n)]),
        "schema": write_jsonl(d / "sc.jsonl", [{"context_options": [ctx(i), sent(rnd, 5)], "continuation":
                                                sent(rnd, 3), "gold": rnd.randint(0, 1)} for i in range(n)]),
        "generation_task_with_answers": write_jsonl(d / "gen.jsonl", [{"context": ctx(i), "answer": sent(rnd, 2),
                                                                       "aliases": []} for i in range(n)]),
    }


def loader(ttype, uri, tok, dest, trimmed, batch_size=8, shots=0):
    from llmfoundry.eval.datasets import get_icl_task_dataloader

    from llmpipe.evaluation.icl_batches import register_trimmed_datasets

    name = register_trimmed_datasets()[ttype] if trimmed else ttype
    kwargs = {"max_seq_len": SEQ, "pad_tok_id": PAD, "num_fewshot": shots, "continuation_delimiter": " ",
              "fewshot_random_seed": 3}
    return get_icl_task_dataloader(name, uri, tok, batch_size, destination_path=str(dest), kwargs=kwargs).dataloader


def model():
    import torch
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    cfg = MPTConfig(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=SEQ,
                    vocab_size=len(SPECIAL + WORDS), attn_config={"attn_impl": "torch"}, init_device="cpu")
    return MPTForCausalLM(cfg).eval()


def per_item(dl, net, ttype, shared=False):
    """File index -> per-sequence scores, and the tokens the batches held. Right-padded types: each sequence's
    (answer log-likelihood, mean answer log-likelihood, all answer tokens top-1, smallest top-1 margin); generation:
    the next-token log-probabilities at the last position and the greedy continuation. ``shared``: multiple-choice
    and schema logits from :func:`llmpipe.evaluation.shared_prefix.prefix_logits`."""
    import torch

    from llmpipe.evaluation.shared_prefix import prefix_logits

    order = list(dl.sampler)
    rows_of = getattr(dl.dataset, "item_order", None)
    out, tokens, k = {}, 0, 0
    for batch in dl:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        tokens += ids.numel()
        n = len(batch["gold_indices"]) if "gold_indices" in batch else ids.shape[0]
        items = [rows_of[i] if rows_of else i for i in order[k:k + n]]
        k += n
        with torch.no_grad():
            if shared and "choice_groupings" in batch:
                logits = prefix_logits(net, ids, mask, batch["choice_groupings"]).float()
            else:
                logits = net(input_ids=ids, attention_mask=mask).logits.float()
        if ttype == "generation_task_with_answers":
            lp = torch.log_softmax(logits[:, -1], dim=-1)
            gen = net.generate(ids, attention_mask=mask, do_sample=False,
                               max_new_tokens=batch["generation_kwargs"]["max_new_tokens"], pad_token_id=PAD, eos_token_id=None)[:, ids.shape[1]:]
            for r, item in enumerate(items):
                out[item] = (lp[r], gen[r].tolist())
            continue
        lps = torch.log_softmax(logits, dim=-1)
        seqs = []
        for r, idx in enumerate(batch["continuation_indices"]):
            idx = torch.as_tensor(idx)
            step = lps[r, idx - 1]
            top2 = step.topk(2, dim=-1).values
            tok_lp = step.gather(1, ids[r, idx].unsqueeze(1)).squeeze(1)
            seqs.append((float(tok_lp.sum()), float(tok_lp.mean()), bool((step.argmax(-1) == ids[r, idx]).all()),
                         float((top2[:, 0] - top2[:, 1]).min())))
        if "choice_groupings" in batch:
            for item, (a, b), gold in zip(items, batch["choice_groupings"], batch["gold_indices"]):
                out[item] = (seqs[a:b], int(gold))
        else:
            for item, s in zip(items, seqs):
                out[item] = ([s], None)
    return out, tokens


class Counting:
    """A model that counts the tokens forwarded through it."""

    def __init__(self, net):
        self.net, self.tokens = net, 0

    def __call__(self, input_ids, **kwargs):
        self.tokens += input_ids.numel()
        return self.net(input_ids=input_ids, **kwargs)


def correct(scores, gold):
    """An item's correctness as llm-foundry's metrics decide it, and its decision margin."""
    if gold is None:  # language modelling: every answer token is the top-1 token
        return scores[0][2], scores[0][3]
    means = sorted((s[1], i) for i, s in enumerate(scores))
    return means[-1][1] == gold, means[-1][0] - means[-2][0]


@pytest.mark.parametrize("ttype, shared", [("multiple_choice", False), ("schema", False), ("language_modeling", False),
                                           ("generation_task_with_answers", False), ("multiple_choice", True),
                                           ("schema", True)])
def test_trimmed_batches_score_every_item_as_the_padded_ones(tmp_path, ttype, shared):
    """Per-item log-likelihoods within 1e-5 and the same correctness for every item decided by more than 1e-4, in
    batches that mix a quarter of the context with the full context, an item cut to fit and contexts holding the
    pad/EOS token; generation (left-padded): the same next-token distribution and greedy tokens. The trimmed path
    runs fewer than half the padded path's tokens. ``shared``: the trimmed batches' multiple-choice and schema items
    forward their common prefix once (``eval.icl_batches: shared_prefix``), with 2 shots so that prefixes are long."""
    import torch

    tok, net = tokenizer(), model()
    uri = task_files(tmp_path)[ttype]
    shots = 2 if shared else 0
    padded, p_tokens = per_item(loader(ttype, uri, tok, tmp_path / "p.jsonl", False, shots=shots), net, ttype)
    trimmed_dl = loader(ttype, uri, tok, tmp_path / "t.jsonl", True, shots=shots)
    counted = Counting(net)
    trimmed, t_tokens = per_item(trimmed_dl, counted if shared else net, ttype, shared=shared)
    if shared:   # the choices' common prefixes ran once: far fewer tokens forwarded than the batches hold
        # (schema options differ early, after the shots: less is shared than by the choices of one question)
        assert counted.tokens < (0.7 if ttype == "multiple_choice" else 0.95) * t_tokens, (counted.tokens, t_tokens)
        t_tokens = counted.tokens
    assert sorted(padded) == sorted(trimmed) == list(range(24))
    assert sorted(trimmed_dl.dataset.item_order) == list(range(24))
    assert t_tokens < 0.5 * p_tokens, (t_tokens, p_tokens)
    close = 0
    for item in padded:
        if ttype == "generation_task_with_answers":
            assert torch.allclose(padded[item][0], trimmed[item][0], atol=1e-5, rtol=0), item
            assert padded[item][1] == trimmed[item][1], item
            continue
        (ps, gold), (ts, _) = padded[item], trimmed[item]
        for a, b in zip(ps, ts):
            assert abs(a[0] - b[0]) <= 1e-5, (item, a, b)
        (pc, margin), (tc, _) = correct(ps, gold), correct(ts, gold)
        if margin > 1e-4:
            assert pc == tc, item
        else:
            close += 1
    print(f"{ttype}: {close} of {len(padded)} items decided by at most 1e-4 (correctness not compared)")


def test_trimmed_batches_are_sorted_and_cut_to_their_longest_sequence(tmp_path):
    """Rows run longest first; each batch is as wide as its longest real sequence (right padding: up to the last
    answer token; left padding: from the first attended token); the choices of one item stay together."""
    tok = tokenizer()
    files = task_files(tmp_path)
    dl = loader("multiple_choice", files["multiple_choice"], tok, tmp_path / "dest-mc.jsonl", True, batch_size=6)
    widths = []
    for batch in dl:
        ends = [int(max(idx)) + 1 for idx in batch["continuation_indices"]]
        assert batch["input_ids"].shape[1] == max(ends)  # no column beyond the longest answer
        assert all(b - a == 3 for a, b in batch["choice_groupings"])
        widths.append(batch["input_ids"].shape[1])
    assert widths == sorted(widths, reverse=True) and widths[0] == SEQ  # the item cut to fit the context runs first
    dl = loader("generation_task_with_answers", files["generation_task_with_answers"], tok, tmp_path / "dest-g.jsonl",
                True, batch_size=4)
    for batch in dl:
        mask = batch["attention_mask"]
        assert mask[:, 0].any() and mask[:, -1].all()  # the first column is some row's first token


def test_padded_setting_keeps_llm_foundry_tasks_and_trimmed_names_the_metric():
    from llmpipe.evaluation.icl_batches import icl_task_configs

    tasks = [{"label": "a", "icl_task_type": "schema"}, {"label": "b", "icl_task_type": "language_modeling",
                                                          "metric_names": ["InContextLearningLMAccuracy"]}]
    assert icl_task_configs(tasks, "padded") is tasks
    out = icl_task_configs(tasks, "trimmed")
    assert [t["icl_task_type"] for t in out] == ["llmpipe_trimmed_schema", "llmpipe_trimmed_language_modeling"]
    assert out[0]["metric_names"] == ["InContextLearningMultipleChoiceAccuracy"] and "metric_names" not in tasks[0]
    with pytest.raises(ValueError, match="eval.icl_batches: padded"):
        icl_task_configs([{"label": "c", "icl_task_type": "code_evaluation"}], "trimmed")
    with pytest.raises(ValueError, match="eval.icl_batches must be one of"):
        icl_task_configs(tasks, "fast")


def _rank_worker(rank, world, port, uri, dest, out):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    # one destination for the node, as llm-foundry's evaluator gives it (local rank 0 copies, the others wait)
    dl = loader("multiple_choice", uri, tokenizer(), f"{dest}.jsonl", True, batch_size=6)
    items = [dl.dataset.item_order[i] for i in dl.sampler]
    batches = sum(1 for _ in dl)
    with open(f"{out}-{rank}.json", "w") as fh:
        json.dump({"batches": batches, "items": items}, fh)
    dist.barrier()


def test_every_rank_runs_the_same_number_of_batches(tmp_path):
    """Two gloo processes on 11 items (an odd count): llm-foundry's sampler gives each rank 6 items, 2 a batch
    (batch size 6, 3 choices each), so both run 3 batches and together cover every item."""
    import torch.multiprocessing as mp


    uri = write_jsonl(tmp_path / "mc11.jsonl", [json.loads(line) for line in
                                                 open(task_files(tmp_path)["multiple_choice"])][:11])
    mp.spawn(_rank_worker, args=(2, free_port(), uri, str(tmp_path / "dest"), str(tmp_path / "rank")), nprocs=2,
             join=True)
    got = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert got[0]["batches"] == got[1]["batches"] == 3
    assert set(got[0]["items"]) | set(got[1]["items"]) == set(range(11))


def test_batch_tokens_as_hand_counted():
    """llmpipe.evaluation.icl_tokens.batch_tokens on hand-made counts: padded rows are the context wide, trimmed
    batches their longest row; multiple choice batches max(batch, C) // C items; two ranks deal the sorted items in
    turn (the list padded with its first item); generation keeps room for its longest answer; each category is
    batched on its own."""
    from llmpipe.evaluation.icl_tokens import ItemTokens, batch_tokens

    mc = [ItemTokens((3, 3), (1, 2)), ItemTokens((10, 10), (1, 1)), ItemTokens((2, 2), (1, 1))]  # rows 4,5 | 8,8 | 3,3
    assert batch_tokens("multiple_choice", mc, 8, 4, "padded") == 8 * 4 + 8 * 2
    assert batch_tokens("multiple_choice", mc, 8, 4, "trimmed") == 8 * 4 + 3 * 2  # items 1,0 then 2
    assert batch_tokens("multiple_choice", mc, 8, 4, "trimmed", world_size=2) == 8 * 4 + 8 * 4  # [1,2] and [0,1]
    gen = [ItemTokens((5,), (3,)), ItemTokens((2,), (1,))]  # contexts cut to 8 - 3 = 5
    assert (batch_tokens("generation_task_with_answers", gen, 8, 1, "padded"),
            batch_tokens("generation_task_with_answers", gen, 8, 1, "trimmed")) == (10, 7)
    lm = [ItemTokens((3,), (1,), "a"), ItemTokens((5,), (1,), "b")]
    assert batch_tokens("language_modeling", lm, 8, 2, "trimmed") == 4 + 6
    with pytest.raises(ValueError, match="contexts counted"):
        batch_tokens("language_modeling", [ItemTokens(None, (1,))], 8, 2, "trimmed")


def test_forward_shapes_count_shared_prefixes_once():
    """llmpipe.evaluation.icl_tokens.forward_shapes on hand-made counts: with shared_prefix on one process a
    multiple-choice batch is the items' prefixes (their contexts) then every row's rest on them; a batch whose
    prefix and rest overflow the context shares the shortest prefix; an item sharing nothing, several processes,
    other task types and the other paths keep one forward per batch (``ItemTokens.shared`` from item_tokens:
    tests/test_eval_suite.py::test_item_tokens_match_llm_foundry_datasets)."""
    from llmpipe.evaluation.icl_tokens import ItemTokens, batch_shapes, forward_shapes

    mc = [ItemTokens((6, 6), (1, 2), None, 6), ItemTokens((3, 3), (1, 1), None, 3)]  # rows 7,8 | 4,4
    assert forward_shapes("multiple_choice", mc, 16, 4, "shared_prefix") == [(2, 6, 6), (4, 2, 8)]
    long_rest = [ItemTokens((6, 6), (1, 2), None, 6), ItemTokens((1, 1), (6, 6), None, 1)]  # rows 7,8 | 7,7
    # the longest prefix (6) and the longest rest (6) overflow 9 tokens: both items share 1
    assert forward_shapes("multiple_choice", long_rest, 9, 4, "shared_prefix") == [(2, 1, 1), (4, 7, 8)]
    for path, world in (("trimmed", 1), ("shared_prefix", 2)):
        assert forward_shapes("multiple_choice", mc, 16, 4, path, world) == [
            (r, w, w) for r, w in batch_shapes("multiple_choice", mc, 16, 4, path, world)]
    lone = [ItemTokens((6, 6), (1, 2), None, 6), ItemTokens((1, 1), (1, 1), None, 1)]  # shortest row 2: shares 1
    assert forward_shapes("multiple_choice", lone, 16, 4, "shared_prefix") == [(2, 6, 6), (4, 2, 8)]
    assert forward_shapes("multiple_choice", [ItemTokens((0, 0), (1, 1), None, 0)], 16, 4, "shared_prefix") == [
        (2, 1, 1)]
    lm = [ItemTokens((3,), (1,))]
    assert forward_shapes("language_modeling", lm, 8, 2, "shared_prefix") == [(1, 4, 4)]


def test_prefix_logits_equal_the_whole_batch_forward_at_every_real_column():
    """Groups of rows with a common prefix (one with a masked pad token inside it), of several lengths: the shared
    forward gives the whole batch's logits at every attended column; a batch whose longest prefix and longest rest
    overflow the model's context shares the shortest prefix; a group of one-token rows shares nothing."""
    import torch

    from llmpipe.evaluation.shared_prefix import common_prefix, prefix_logits

    net = model()
    gen = torch.Generator().manual_seed(3)

    def batch(groups, width):
        """Rows of random tokens; each group's rows start with its first row's ``prefix`` tokens."""
        rows = sum(len(lens) for _, lens in groups)
        ids = torch.randint(len(SPECIAL), net.config.vocab_size, (rows, width), generator=gen)
        mask = torch.zeros_like(ids)
        spans, r = [], 0
        for prefix, lens in groups:
            first = r
            for n in lens:
                ids[r, :prefix] = ids[first, :prefix]
                mask[r, :n] = 1
                r += 1
            spans.append((first, r))
        ids[mask == 0] = PAD
        return ids, mask, spans

    for groups, width in (([(20, [25, 30, 22]), (8, [9, 12])], 40), ([(SEQ - 4, [SEQ - 2, SEQ - 1]), (2, [SEQ - 1, SEQ])], SEQ),
                          ([(0, [1, 1]), (5, [7, 8])], 10)):
        ids, mask, spans = batch(groups, width)
        ids[0, 3], mask[:spans[0][1], 3] = PAD, 0   # a pad/EOS token inside the first group's prefix, masked
        with torch.no_grad():
            whole = net(input_ids=ids, attention_mask=mask).logits
            shared = prefix_logits(net, ids, mask, spans)
        for r in range(ids.shape[0]):
            real = mask[r].nonzero().flatten()
            cols = torch.arange(int(real.max()) + 1)
            cols = cols[mask[r, cols] == 1]
            assert torch.allclose(whole[r, cols], shared[r, cols], atol=1e-5, rtol=0), (groups, r)
    assert common_prefix(torch.tensor([[1, 2, 3], [1, 2, 4]]), torch.ones(2, 3), [3, 3]) == 2
    assert common_prefix(torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.ones(2, 3), [3, 3]) == 2   # each keeps one
    assert common_prefix(torch.tensor([[1, 2], [1, 2]]), torch.tensor([[1, 0], [1, 1]]), [2, 2]) == 1
