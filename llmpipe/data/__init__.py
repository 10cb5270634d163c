"""Data preparation: corpus (C4 layout), tokenizer, MDS conversion and verification, ICL tasks.

Modules:

* :mod:`llmpipe.data.corpus` – :func:`~llmpipe.data.corpus.prepare_corpus`: C4 from the hub, a local mirror, or a
  built-in corpus of English text from Python's own documentation, in C4's file layout, with a manifest.
* :mod:`llmpipe.data.tokenizer` – :func:`~llmpipe.data.tokenizer.prepare_tokenizer`: a hub tokenizer, a local one,
  or a byte-level BPE trained on the corpus, saved so that ``AutoTokenizer.from_pretrained`` loads it.
* :mod:`llmpipe.data.mds` – restartable tokenize + concatenate + MDS, one unit per input file
  (:func:`~llmpipe.data.mds.convert_unit`), and the dataset's layout and merge; run in parallel by
  :func:`llmpipe.steps.mds_units.convert_dataset`.
* :mod:`llmpipe.data.mds_verify` – :func:`~llmpipe.data.mds_verify.verify_dataset`: read a dataset back and
  check it.
* :mod:`llmpipe.data.icl` – :func:`~llmpipe.data.icl.build_cloze_task`: a cloze ICL task cut from held-out text.

Importing this package is light (no torch / transformers); the heavy imports happen inside the functions.
"""

from llmpipe.data.errors import DataError

__all__ = ["DataError"]
