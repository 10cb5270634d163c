"""Tokenizers: from the hub, from a local folder, or a byte-level BPE trained on a corpus.

Every source ends the same way: a Hugging Face tokenizer folder ``{out_dir}`` written by ``save_pretrained`` (so
``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads it with no llmpipe import) and, last and atomically,
``{out_dir}/manifest.json``::

    {"source", "name", "vocab_size" (len(tokenizer): base vocabulary + added tokens), "eos_text",
     "eos_token", "eos_token_id", "eos_ids" (the ids eos_text tokenizes to), "bos_token_id", "class",
     "probes": [{"text", "ids"}, ...] (what the transformers tokenizer makes of a few test strings), ...}

The probes let :func:`load_backend` use ``tokenizer.json`` through the Rust ``tokenizers`` library alone (about
0.02 s instead of ~2-3 s for importing transformers) and prove, each time it loads, that it tokenizes exactly as
the transformers tokenizer does; if it does not (a tokenizer whose Python class adds behaviour), callers fall back
to transformers.

A trained tokenizer is GPT-2 style: byte-level pre-tokenization (no prefix space), BPE merges learned on the
corpus' train split (documents in manifest order, so training is deterministic), ``eos_text`` as its only
special token, used as EOS, BOS and UNK (like ``EleutherAI/gpt-neox-20b``); no padding token is set. Training
uses the tokenizers library's thread pool (``TOKENIZERS_PARALLELISM``); the result is the same with or without it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

from llmpipe.data.errors import DataError, atomic_write_json, remove_if_exists

#: Strings whose ids (from the transformers tokenizer, with its special tokens) go into the manifest as probes.
PROBE_TEXTS = ["Hello world! The quick brown fox jumps over the lazy dog.",
               "  leading spaces,\ttabs\nand newlines\n\n", "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂 ok",
               "<|endoftext|>x = f(1, 2) ** 3  # code 123456789", ""]

#: Default cap on the training text read for ``source: train`` (characters); the rest of the corpus is unused.
TRAIN_MAX_CHARS = 500_000_000


def _where(tok_cfg: dict) -> str:
    return f"tokenizers.{tok_cfg['key']}" if tok_cfg.get("key") else "the tokenizer"


def _corpus_texts(corpus_manifest: str, max_chars: int) -> Iterator[str]:
    from llmpipe.data.corpus import iter_documents, load_manifest

    m = load_manifest(corpus_manifest)
    n = 0
    for f in m["splits"]["train"]:
        for doc in iter_documents(f["path"]):
            text = doc["text"]
            if not text.strip():
                continue
            yield text
            n += len(text)
            if n >= max_chars:
                return


def train_bpe(texts: Iterator[str], vocab_size: int, eos_text: str):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``texts`` with ``eos_text`` as its special token.

    Args:
        texts: training documents (an iterator of str).
        vocab_size: the final vocabulary size including the 256 byte tokens and ``eos_text``.
        eos_text: the end-of-text marker (e.g. ``<|endoftext|>``); gets id 0.

    Returns:
        A ``tokenizers.Tokenizer`` (deterministic for the same texts and settings).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), min_frequency=2, special_tokens=[eos_text],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def check_eos(tokenizer, eos_text: str | None, where: str) -> dict:
    """Check that documents can be separated: return ``{"eos_text", "eos_ids", "eos_token", "eos_token_id"}``.

    ``eos_text`` must tokenize (without added special tokens) to something non-empty; if it is empty, the
    tokenizer's own ``eos_token`` is used. A warning is printed when it is not exactly the EOS token.

    Raises:
        DataError: no EOS text and no EOS token, or ``eos_text`` tokenizes to nothing.
    """
    if not eos_text:
        eos_text = tokenizer.eos_token
    if not eos_text:
        raise DataError(f"{where} has no EOS token and no eos_text is set: documents could not be separated "
                        f"when concatenating. Fix: set {where}.eos_text (e.g. \"<|endoftext|>\") or use a "
                        f"tokenizer with an eos_token.")
    ids = tokenizer(eos_text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise DataError(f"{where}.eos_text {eos_text!r} tokenizes to no tokens. Fix: set eos_text to the "
                        f"tokenizer's end-of-text token ({tokenizer.eos_token!r}).")
    if tokenizer.eos_token_id is None or ids != [tokenizer.eos_token_id]:
        print(f"[llmpipe] warning: {where}.eos_text {eos_text!r} tokenizes to {ids}, not to the tokenizer's EOS "
              f"token ({tokenizer.eos_token!r} = {tokenizer.eos_token_id}); documents are separated by these "
              f"tokens.", file=sys.stderr, flush=True)
    return {"eos_text": eos_text, "eos_ids": list(ids), "eos_token": tokenizer.eos_token,
            "eos_token_id": tokenizer.eos_token_id}


def prepare_tokenizer(tok_cfg: dict, out_dir: str, corpus_manifest: str | None = None) -> dict:
    """Make a tokenizer folder loadable by ``AutoTokenizer.from_pretrained(out_dir)``; return its manifest.

    Args:
        tok_cfg: one entry of ``tokenizers:``: ``source`` (hub | local | train), ``eos_text``; for hub
            ``name`` (a repo id, optional ``revision``); for local ``name`` (a folder with tokenizer files); for
            train ``vocab_size`` (and optional ``train_max_chars``, default 5e8 characters of the train split).
            An optional ``key`` (the key under ``tokenizers:``) makes messages name the setting.
        out_dir: the tokenizer folder (created; ``save_pretrained`` files + ``manifest.json`` written last).
        corpus_manifest: the corpus ``manifest.json`` (file or folder); required for ``source: train``.

    Returns:
        The manifest dict (see the module docstring).

    Raises:
        DataError: the tokenizer cannot be loaded (names the source and the fix), has no usable EOS, or the
            training corpus is empty.
        llmpipe.config.settings.ConfigError: unknown source, missing ``name`` / ``vocab_size`` / corpus manifest.
    """
    from llmpipe.config.settings import ConfigError

    os.makedirs(out_dir, exist_ok=True)
    remove_if_exists(os.path.join(out_dir, "manifest.json"))
    where = _where(tok_cfg)
    src = tok_cfg.get("source")
    eos_text = tok_cfg.get("eos_text") or None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    extra: dict = {}
    if src == "train":
        if not corpus_manifest:
            raise ConfigError(f"{where}: source is train but no corpus manifest was given. Fix: set "
                              f"{where}.corpus to a corpus under `corpora:`.")
        vocab = int(tok_cfg.get("vocab_size") or 0)
        if vocab < 256 + 1:
            raise ConfigError(f"{where}.vocab_size must be at least 257 (256 bytes + EOS), got {vocab}.")
        if not eos_text:
            raise ConfigError(f"{where}.eos_text is empty; a trained tokenizer needs it as its EOS token. "
                              f"Fix: set eos_text: \"<|endoftext|>\".")
        max_chars = int(tok_cfg.get("train_max_chars", TRAIN_MAX_CHARS))
        counter = {"docs": 0, "chars": 0}

        def counted() -> Iterator[str]:
            for t in _corpus_texts(corpus_manifest, max_chars):
                counter["docs"] += 1
                counter["chars"] += len(t)
                yield t

        core = train_bpe(counted(), vocab, eos_text)
        if counter["docs"] == 0:
            raise DataError(f"{where}: the training corpus {corpus_manifest} has no non-blank text in its train "
                            f"split. Fix: prepare the corpus again / point it at real data.")
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos_text, bos_token=eos_text,
                                            unk_token=eos_text, clean_up_tokenization_spaces=False,
                                            model_max_length=int(tok_cfg.get("model_max_length", 1 << 20)))
        extra = {"trained_on": os.path.abspath(corpus_manifest), "train_documents": counter["docs"],
                 "train_characters": counter["chars"], "requested_vocab_size": vocab}
        if core.get_vocab_size() < vocab:
            print(f"[llmpipe] note: {where}: the corpus supports only {core.get_vocab_size()} tokens "
                  f"(asked for {vocab}).", file=sys.stderr, flush=True)
        name = None
    elif src in ("hub", "local"):
        name = tok_cfg.get("name")
        if not name:
            raise ConfigError(f"{where}.name is not set. Fix: a hub repo id (source: hub) or a folder "
                              f"(source: local).")
        if src == "local":
            name = os.path.abspath(os.path.expanduser(name))
            if not os.path.isdir(name):
                raise DataError(f"{where}.name: {name} is not a folder. Fix: point it at a folder with "
                                f"tokenizer.json / tokenizer_config.json (written by save_pretrained).")
        try:
            kw = {"revision": tok_cfg["revision"]} if tok_cfg.get("revision") and src == "hub" else {}
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=(src == "local"), **kw)
        except Exception as exc:  # noqa: BLE001 - transformers raises OSError/ValueError/HTTP errors
            fix = ("check the name, the network (HF_ENDPOINT / proxy), or use source: local with a folder "
                   "saved by save_pretrained") if src == "hub" else "check the folder's tokenizer files"
            raise DataError(f"{where}: cannot load tokenizer {name!r} ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}). Fix: {fix}.") from exc
        if eos_text and tokenizer.eos_token is None:
            ids = tokenizer(eos_text, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                tokenizer.eos_token = eos_text
    else:
        raise ConfigError(f"{where}.source is {src!r}; it must be hub, local or train.")

    eos = check_eos(tokenizer, eos_text, where)
    tokenizer.save_pretrained(out_dir)
    manifest = {
        "version": 1,
        "source": src,
        "name": name,
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **eos,
        "probes": make_probes(tokenizer),
        **extra,
    }
    atomic_write_json(os.path.join(out_dir, "manifest.json"), manifest)
    return manifest


def load_tokenizer(tokenizer_dir: str):
    """Load a prepared tokenizer folder with ``AutoTokenizer`` (length warnings off: we chunk ourselves).

    Raises:
        DataError: the folder has no tokenizer files (the tokenizer step did not run or failed).
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"cannot load the tokenizer in {tokenizer_dir} ({type(exc).__name__}: {exc}). "
                        f"Fix: run the tokenizer step again (prepare_tokenizer).") from exc
    tok.model_max_length = int(1e30)
    return tok


def make_probes(tokenizer) -> list[dict]:
    """Probe strings and the ids the transformers ``tokenizer`` gives them (``add_special_tokens=True``).

    :data:`PROBE_TEXTS`, plus strings holding the text of every special and added token between ordinary
    characters (50 tokens per string), so a tokenizer whose Python class changes how those are split
    (``split_special_tokens``) or adds tokens outside ``tokenizer.json`` fails the check in :func:`load_backend`.
    """
    special = list(dict.fromkeys(list(tokenizer.all_special_tokens) + sorted(tokenizer.get_added_vocab())))
    texts = list(PROBE_TEXTS) + [" ".join(f"a{t}b {t}" for t in special[i:i + 50])
                                 for i in range(0, len(special), 50)]
    return [{"text": t, "ids": list(ids)} for t, ids in
            zip(texts, tokenizer(texts, add_special_tokens=True, truncation=False, padding=False)["input_ids"])]


def load_backend(tokenizer_dir: str):
    """The folder's ``tokenizer.json`` as a Rust ``tokenizers.Tokenizer`` (truncation and padding off), or None.

    Returns the backend only when the folder's manifest has probes and the backend reproduces every probe's ids
    exactly (``add_special_tokens=True``), i.e. it tokenizes as ``AutoTokenizer.from_pretrained(tokenizer_dir)``
    does; None otherwise (no tokenizer.json, no manifest / probes from an older run, any mismatch), and the
    caller then loads the tokenizer with :func:`load_tokenizer`. Does not import transformers or torch.
    """
    import json

    try:
        from tokenizers import Tokenizer

        with open(os.path.join(tokenizer_dir, "manifest.json")) as fh:
            probes = json.load(fh).get("probes")
        if not probes:
            return None
        backend = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    except Exception:  # noqa: BLE001 - any failure means "use transformers"
        return None
    backend.no_truncation()
    backend.no_padding()
    got = [e.ids for e in backend.encode_batch([p["text"] for p in probes], add_special_tokens=True)]
    if got != [list(p["ids"]) for p in probes]:
        return None
    return backend

