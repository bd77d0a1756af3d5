"""ONNX Runtime inference (irflow.learn.onnx_inference): a tiny exported model gives torch's embeddings and
cross-encoder scores (fp32, allclose); the backend is runtime (never keyed) and int8 is a keyed param
whose default keeps the keys of stores made before it existed; the export is a stored model with
lineage, made once; a bad backend is refused naming its key."""

import numpy as np
import pytest

from irflow.api import load_config
from irflow.dev.testing import beir_slice, ingest_folder, make_tiny_bi_encoder, make_tiny_cross_encoder, model
from irflow.engine.errors import ConfigError
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig
from irflow.learn import onnx_inference
from irflow.learn.encoding import encode_texts, load_sentence_transformer
from irflow.learn.scoring import cross_encoder_scores
from irflow.learn.teachers import CrossEncoderTeacher
from irflow.stages.dense import DenseSearchParams, EncodeParams, dense_search, encode_corpus
from irflow.stages.rerank import RerankParams, rerank

TEXTS = ["what causes cancer", "Vitamin D deficiency is associated with increased risk of falls in older adults.",
         "protein", "Chaperones assist the folding of newly made proteins in the cell " * 6, "a b c d e f g"] * 3
PAIRS = [(TEXTS[i], TEXTS[(i + 1) % len(TEXTS)]) for i in range(len(TEXTS))]


def _spread_head(path):
    """A tiny cross-encoder's fresh head scores every pair alike (~0.0117 +- 1e-4): scale it up, so that
    comparing scores compares something."""
    from transformers import AutoModelForSequenceClassification

    m = AutoModelForSequenceClassification.from_pretrained(path)
    m.classifier.weight.data *= 100
    m.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    return {"root": root, "bi": make_tiny_bi_encoder(root / "bi", normalize=True),
            "bi_raw": make_tiny_bi_encoder(root / "bi_raw", seed=1),
            "ce": _spread_head(make_tiny_cross_encoder(root / "ce"))}


def _embed(path, onnx_dir=None, normalize=False, batch_size=4):
    st = load_sentence_transformer(str(path), "cpu", onnx=str(onnx_dir) if onnx_dir else None, threads=2)
    return encode_texts(st, TEXTS, batch_size, normalize)


@pytest.mark.parametrize("name", ["bi", "bi_raw"])
def test_exported_bi_encoder_embeddings_are_torchs(tiny, name):
    out = onnx_inference.export(str(tiny[name]), tiny["root"] / f"{name}-fp32", "embed")
    meta = (out / onnx_inference.META_FILE).read_text()
    assert '"pooling": "mean"' in meta and (f'"normalize": {"true" if name == "bi" else "false"}') in meta
    for normalize in (False, True):
        torch_emb = _embed(tiny[name], normalize=normalize)
        onnx_emb = _embed(tiny[name], out, normalize=normalize)
        assert onnx_emb.shape == torch_emb.shape == (len(TEXTS), 32)
        np.testing.assert_allclose(onnx_emb, torch_emb, atol=1e-5, rtol=1e-4)
    # batch-invariant, as torch: the same text's embedding in other batches is the same, bit for bit
    np.testing.assert_array_equal(_embed(tiny[name], out, batch_size=3), _embed(tiny[name], out, batch_size=7))


def test_exported_cross_encoder_scores_are_torchs(tiny):
    out = onnx_inference.export(str(tiny["ce"]), tiny["root"] / "ce-fp32", "score")
    kw = dict(batch_size=4, max_length=64, show_progress=False)
    torch_scores = cross_encoder_scores(str(tiny["ce"]), PAIRS, **kw)
    onnx_scores = cross_encoder_scores(str(tiny["ce"]), PAIRS, onnx=str(out), threads=2, **kw)
    np.testing.assert_allclose(onnx_scores, torch_scores, atol=1e-5, rtol=1e-4)
    assert np.ptp(torch_scores) > 1e-2  # not a constant: the comparison means something


def test_int8_is_close_and_does_not_depend_on_the_batch(tiny):
    """Dynamic quantisation scales activations over its whole input: int8 runs one text per call, so a
    text's embedding (a pair's score) is its own whatever its batch (shards assemble to the same bytes)."""
    bi8 = onnx_inference.export(str(tiny["bi"]), tiny["root"] / "bi-int8", "embed", "int8")
    assert not list(bi8.glob(onnx_inference.FP32_FILE + "*"))  # only the int8 graph is kept
    a, b = _embed(tiny["bi"], bi8, batch_size=3), _embed(tiny["bi"], bi8, batch_size=16)
    np.testing.assert_array_equal(a, b)
    # threads 2: two callers of a one-thread session, each text alone -- the same rows in the same order
    alone = onnx_inference.load(str(bi8), threads=1)
    assert alone.callers == 1 and onnx_inference.load(str(bi8), threads=2).callers == 2
    np.testing.assert_array_equal(alone.embed(TEXTS, 64, False), a)
    cos = (a * _embed(tiny["bi"])).sum(1)
    assert cos.min() > 0.95, cos  # lossy, but the same embedding
    ce8 = onnx_inference.export(str(tiny["ce"]), tiny["root"] / "ce-int8", "score", "int8")
    kw = dict(max_length=64, show_progress=False, onnx=str(ce8), threads=2)
    s3 = cross_encoder_scores(str(tiny["ce"]), PAIRS, batch_size=3, **kw)
    np.testing.assert_array_equal(s3, cross_encoder_scores(str(tiny["ce"]), PAIRS, batch_size=8, **kw))
    exact = cross_encoder_scores(str(tiny["ce"]), PAIRS, batch_size=4, max_length=64, show_progress=False)
    # Without integer dot products (VNNI / AMX int8) ONNX Runtime's u8s8 products saturate: less exact (0.89
    # measured on an AVX2-only EPYC, against > 0.9 with VNNI), and loading the model warns about it.
    assert np.corrcoef(s3, exact)[0, 1] > (0.9 if onnx_inference.cpu_has_int8_dot() else 0.8)


def test_int8_without_integer_dot_products_warns(tiny, monkeypatch, caplog):
    from irflow.engine import runtime as irt

    ce8 = onnx_inference.export(str(tiny["ce"]), tiny["root"] / "ce-int8-warn", "score", "int8")
    for flags, warned in ((frozenset({"avx2"}), True), (frozenset({"avx2", "avx512_vnni"}), False)):
        monkeypatch.setattr(irt, "cpu_flags", lambda flags=flags: flags)
        caplog.clear()
        onnx_inference.load(str(ce8), threads=1)
        assert any("saturate" in r.getMessage() for r in caplog.records) == warned, flags


def test_quantization_is_keyed_only_when_set():
    """Keys of stores made before `quantization` existed stay valid: its default is not dumped."""
    for p in (EncodeParams(), RerankParams(system="x"), CrossEncoderTeacher(type="cross_encoder")):
        assert p.quantization == "none" and "quantization" not in p.key_dump()
        assert p.key_dump() == {k: v for k, v in p.model_dump(mode="json").items() if k != "quantization"}
        int8 = p.model_copy(update={"quantization": "int8"})
        assert int8.key_dump()["quantization"] == "int8"
    # the key of encode_corpus with the default is the one computed before the field existed
    from irflow.engine.cache import cache_key
    from irflow.engine.store import DatasetRef

    refs = {"corpus": DatasetRef("corpus-1", "corpus", "table", "corpus", "/x"),
            "model": DatasetRef("hub:m", "m", "model", None, "/m")}
    old_dump = {"similarity": "cos", "batch_size": 64, "max_seq_length": None}
    assert encode_corpus.key(EncodeParams(), refs) == cache_key("encode_corpus", "4", old_dump,
                                                                {k: [v] for k, v in refs.items()})
    assert encode_corpus.key(EncodeParams(quantization="int8"), refs) != encode_corpus.key(EncodeParams(), refs)
    # nested: a teacher's quantization in a stage's params
    from irflow.stages.score_candidates import ScoreCandidatesParams

    sc = ScoreCandidatesParams(teacher=CrossEncoderTeacher(type="cross_encoder"))
    assert "quantization" not in sc.key_dump()["teacher"]
    assert sc.model_copy(update={"teacher": CrossEncoderTeacher(type="cross_encoder", quantization="int8")}
                         ).key_dump()["teacher"]["quantization"] == "int8"


@pytest.fixture(scope="module")
def slice_refs(tmp_path_factory, shared_datasets, tiny):
    root = tmp_path_factory.mktemp("onnx-stages")
    data = beir_slice(shared_datasets / "scifact.zip", root / "slice", n_test_queries=6, n_extra_docs=30, seed=2)
    return {"root": root, "data": data}


def _stages(store, data, tiny, backend: str, quantization: str = "none", shard_rows: int = 100_000):
    """encode_corpus, dense_search and rerank of a SciFact slice in ``store`` with tiny models."""
    run = Run(store, f"r-{backend}-{quantization}",
              runtime=RuntimeConfig(backend=backend, threads=2, shard_rows=shard_rows))
    refs = ingest_folder(run, data)
    bi, ce = model(run, tiny["bi"]), model(run, tiny["ce"])
    emb, status = encode_corpus.execute(run, EncodeParams(batch_size=8, quantization=quantization), None,
                                        {"corpus": refs["corpus"], "model": bi})
    ranking = dense_search.run(run, DenseSearchParams(system="d", depth=10, batch_size=8, quantization=quantization),
                               embeddings=emb, queries=refs["queries"], model=bi)
    reranked = rerank.run(run, RerankParams(system="ce", depth=5, batch_size=8, max_length=64,
                                            quantization=quantization),
                          ranking=ranking, queries=refs["queries"], corpus=refs["corpus"], model=ce)
    return run, {"embeddings": emb, "run": ranking, "rerank": reranked, "status": status, "bi": bi, "ce": ce}


def _table(ref):
    return ref.table().to_pydict()


def test_backend_onnx_is_not_keyed_int8_is_and_exports_are_stored_once(slice_refs, tiny):
    root, data = slice_refs["root"], slice_refs["data"]
    # torch, then onnx in the same store: the same keys, nothing recomputed, nothing exported
    _, torch_out = _stages(root / "a", data, tiny, "torch")
    run, again = _stages(root / "a", data, tiny, "onnx")
    assert again["status"] == "cached" and again["embeddings"].id == torch_out["embeddings"].id
    assert [r["name"] for r in run.catalog.stage_runs(run.run_id) if r["name"].startswith("export_onnx")] == []

    # onnx in a fresh store: computed with ONNX Runtime, the same results as torch (allclose; ranks equal)
    run, onnx_out = _stages(root / "b", data, tiny, "onnx")
    a = np.array(_table(torch_out["embeddings"])["embedding"])
    b = np.array(_table(onnx_out["embeddings"])["embedding"])
    np.testing.assert_allclose(b, a, atol=1e-5)
    for k in ("run", "rerank"):
        t, o = _table(torch_out[k]), _table(onnx_out[k])
        assert (t["query_id"], t["doc_id"]) == (o["query_id"], o["doc_id"])
        np.testing.assert_allclose(o["score"], t["score"], atol=1e-4)
    stage_runs = {r["name"]: r for r in run.catalog.stage_runs(run.run_id)}
    assert stage_runs["encode_corpus"]["runtime"]["backend"] == "onnx"
    exported = stage_runs["encode_corpus"]["runtime"]["onnx_models"]
    assert list(exported) == [onnx_out["bi"].path] and exported[onnx_out["bi"].path].startswith("onnx_model-")
    # one export per (model, quantization): encode_corpus computed it, dense_search found it cached
    exports = [(r["name"], r["status"]) for r in run.catalog.stage_runs(run.run_id)
               if r["name"].startswith("export_onnx")]
    assert exports == [("export_onnx[embed-none]", "computed"), ("export_onnx[embed-none]", "cached"),
                       ("export_onnx[score-none]", "computed")]
    # a stored model with lineage back to its source model
    lineage = run.catalog.parents(exported[onnx_out["bi"].path])
    assert lineage == [("model", onnx_out["bi"].id)]

    # int8: new keys (stored apart), exported once more, under the torch backend too
    run, int8 = _stages(root / "b", data, tiny, "torch", "int8")
    assert int8["status"] == "computed" and int8["embeddings"].id != onnx_out["embeddings"].id
    names = {r["name"]: r["status"] for r in run.catalog.stage_runs(run.run_id)}
    assert names["export_onnx[embed-int8]"] == "cached" and names["export_onnx[score-int8]"] == "computed"
    e8 = np.array(_table(int8["embeddings"])["embedding"])
    assert (e8 * b).sum(1).min() > 0.95  # normalised embeddings, close to the exact ones

    # in shards of 4 passages / 4 queries: the same bytes, so the same ids, for fp32 and int8 alike
    for backend, quantization, whole in (("onnx", "none", onnx_out), ("torch", "int8", int8)):
        _, sharded = _stages(root / f"shards-{quantization}", data, tiny, backend, quantization, shard_rows=4)
        assert [sharded[k].id for k in ("embeddings", "run", "rerank")] == \
            [whole[k].id for k in ("embeddings", "run", "rerank")]


def test_a_bad_backend_is_refused_naming_the_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("flow: baselines\ndataset: {name: x, source: x.zip, split: test}\nruntime: {backend: tensorrt}\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert "runtime.backend" in str(err.value) and "onnx" in str(err.value)
    cfg.write_text("flow: baselines\ndataset: {name: x, source: x.zip, split: test}\n"
                   "runtime: {backend: onnx, device: {encode: cuda}}\n")
    with pytest.raises(ConfigError, match="onnxruntime's CPU provider"):
        load_config(cfg)


def test_backend_auto_probes_once_per_model_and_runs_the_faster(slice_refs, tiny):
    """auto: a probe of torch and ONNX Runtime on real passages decides, per model and task, remembered in
    the store (a second run probes nothing); the stages record the backend they ran, with results equal to
    torch's either way."""
    import json

    from irflow.engine import backends as backend_probe

    root, data = slice_refs["root"], slice_refs["data"]
    run, out = _stages(root / "auto", data, tiny, "auto")
    probes = json.loads((root / "auto" / backend_probe.PROBES_FILE).read_text())
    assert len(probes) == 2 and {k.split(" | ")[2] for k in probes} == {"embed", "score"}
    for p in probes.values():
        assert p["torch"] > 0 and p["onnx"] > 0
        assert p["backend"] == ("onnx" if p["torch"] / p["onnx"] >= backend_probe.MARGIN else "torch")
    embed = next(p for k, p in probes.items() if " | embed | " in k)
    stage_runs = {r["name"]: r for r in run.catalog.stage_runs(run.run_id)}
    assert stage_runs["encode_corpus"]["runtime"]["backend"] == embed["backend"]
    # what the probe would have picked, forced the other way: the same embeddings (exact either way)
    key = next(k for k in probes if " | embed | " in k)
    other = "torch" if embed["backend"] == "onnx" else "onnx"
    probes[key] = {**embed, "backend": other}
    (root / "auto-2").mkdir()
    (root / "auto-2" / backend_probe.PROBES_FILE).write_text(json.dumps(probes))
    run2, out2 = _stages(root / "auto-2", data, tiny, "auto")
    assert json.loads((root / "auto-2" / backend_probe.PROBES_FILE).read_text()) == probes  # nothing probed again
    assert {r["name"]: r for r in run2.catalog.stage_runs(run2.run_id)}["encode_corpus"]["runtime"]["backend"] == other
    np.testing.assert_allclose(np.array(_table(out2["embeddings"])["embedding"]),
                               np.array(_table(out["embeddings"])["embedding"]), atol=1e-5)
