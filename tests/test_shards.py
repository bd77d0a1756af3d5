"""Sharded stages (irflow.engine.shards) with the in-process executor, on a real SciFact slice: shards of a
few rows give the same datasets (same ids) as one shard, a failed shard fails its stage naming its
rows and publishes nothing, and the next run computes only the missing shards."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from irflow import api
from irflow.dev.testing import beir_slice, make_tiny_bi_encoder
from irflow.engine import shards
from irflow.engine.store import DatasetRef, Store, write_parts

SHARDED = ("encode_corpus[zero-shot]", "dense_search[zero-shot]", "bm25_search[flat]")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_datasets, prefect_harness):
    root = tmp_path_factory.mktemp("shards")
    data = beir_slice(shared_datasets / "scifact.zip", root / "scifact-slice", n_test_queries=12, n_extra_docs=60)
    model = make_tiny_bi_encoder(root / "tiny", seed=0)
    cfg = {"flow": "baselines", "dataset": {"name": "scifact-slice", "source": str(data), "split": "test"},
           "bm25": {"variants": ["flat"], "depth": 50}, "dense": {"model": str(model), "batch_size": 16, "depth": 50},
           "runtime": {"threads": 2}}
    config = root / "baselines.yaml"
    config.write_text(yaml.safe_dump(cfg))
    whole = api.run(config, store=root / "whole")  # one shard per stage (shard_rows 100,000)
    return {"root": root, "config": config, "whole": whole}


def outputs(result) -> dict:
    return {s.name: s.outputs for s in result.stages}


def test_shards_give_the_same_datasets_as_one_shard(setup):
    whole = setup["whole"]
    assert all(len(whole.stage(n).shards) == 1 for n in SHARDED)
    sharded = api.run(setup["config"], ["runtime.shard_rows=5"], store=setup["root"] / "sharded")
    enc = sharded.stage("encode_corpus[zero-shot]")
    corpus_rows = enc.shards[-1]["rows"][1]
    assert len(enc.shards) == -(-corpus_rows // 5) > 10  # ~75 passages in shards of 5
    assert [s["rows"] for s in enc.shards] == [[a, min(a + 5, corpus_rows)] for a in range(0, corpus_rows, 5)]
    assert {s["status"] for s in enc.shards} == {"computed"} and all(s["pid"] and s["host"] for s in enc.shards)
    assert len(sharded.stage("dense_search[zero-shot]").shards) == 3  # 12 queries
    # Same bytes, same ids, downstream too. (Lucene's index files differ from build to build: the
    # index is the one stage output whose id is not its content's alone; its searches agree.)
    same = lambda r: {k: v for k, v in outputs(r).items() if not k.startswith("bm25_index")}  # noqa: E731
    assert same(sharded) == same(whole)
    assert sharded.metrics == whole.metrics


def test_runtime_is_not_keyed_a_sharded_run_reuses_an_unsharded_one(setup):
    again = api.run(setup["config"], ["runtime.shard_rows=7"], store=setup["root"] / "whole")
    assert again.computed == set() and outputs(again) == outputs(setup["whole"])
    assert all(s.shards == [] for s in again.stages)  # nothing computed, no shards


def test_a_failing_shard_fails_its_stage_then_only_missing_shards_run(setup, monkeypatch):
    store = setup["root"] / "resume"
    real = shards.run_shard

    def fail_third(job):
        if job.label == "encode_corpus[zero-shot]" and job.index == 2:
            raise RuntimeError("worker lost")
        return real(job)

    monkeypatch.setattr(shards, "run_shard", fail_third)
    with pytest.raises(Exception) as err:
        api.run(setup["config"], ["runtime.shard_rows=5"], store=store)
    assert "encode_corpus[zero-shot]" in str(err.value) and "shard 2 (rows 10-15 of corpus)" in str(err.value)
    assert not any(d.name.startswith("embeddings-") for d in (store / "objects").iterdir())  # nothing published
    parts = sorted(p.name for p in (store / "partial").glob("*/part-*.parquet"))
    assert parts[:2] == [shards.part_name(0, 5), shards.part_name(5, 10)]  # shards 0 and 1 finished

    monkeypatch.setattr(shards, "run_shard", real)
    rerun = api.run(setup["config"], ["runtime.shard_rows=5"], store=store)
    enc = rerun.stage("encode_corpus[zero-shot]")
    assert [s["status"] for s in enc.shards[:3]] == ["resumed", "resumed", "computed"]
    assert [s["status"] for s in enc.shards].count("resumed") == len(parts)
    assert rerun.stage("encode_corpus[zero-shot]").outputs == setup["whole"].stage("encode_corpus[zero-shot]").outputs
    assert not list((store / "partial").glob("*/part-*"))  # parts are removed once published


def test_a_shard_reads_only_its_rows(setup):
    emb = next(s for s in setup["whole"].stages if s.name == "encode_corpus[zero-shot]")
    ref = Store(setup["root"] / "whole")
    path = ref.object_dir(emb.dataset_id)
    whole = DatasetRef(emb.dataset_id, "embeddings", "table", "embeddings", str(path))
    n = whole.num_rows()
    part = whole.slice(3, 11)
    assert part.num_rows() == 8 and part.id == whole.id
    assert part.table().to_pylist() == whole.table().slice(3, 8).to_pylist()
    assert whole.slice(n - 2, n).table(columns=["doc_id"]).num_rows == 2


def test_parts_assemble_to_the_bytes_of_one_table(tmp_path, monkeypatch):
    """Any split of the rows into parts gives the file `stage_table` writes for the whole table, so the
    content id of a sharded stage does not depend on shard_rows (row groups included)."""
    import irflow.engine.store as store_mod

    monkeypatch.setattr(store_mod, "ROW_GROUP", 100)
    n = 350
    table = pa.table({"query_id": [f"q{i // 10:03d}" for i in range(n)], "doc_id": [f"d{i}" for i in range(n)],
                      "rank": pa.array([i % 10 + 1 for i in range(n)], pa.int32()),
                      "score": pa.array([1.0 / (i + 1) for i in range(n)], pa.float32()), "system": ["bm25"] * n})
    staging, _ = Store(tmp_path / "s").stage_table("run", table)
    expected = (staging / "data.parquet").read_bytes()
    assert pq.ParquetFile(staging / "data.parquet").metadata.num_row_groups == 4
    for cuts in ([0, n], [0, 70, 140, 350], [0, 100, 200, 300, 350], [0, 10, 20, 110, 330, 350]):
        files = []
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            files.append(tmp_path / f"part{i}.parquet")
            write_parts("run", [table.slice(a, b - a)], files[-1])
        assert write_parts("run", files, tmp_path / "out.parquet") == n
        assert (tmp_path / "out.parquet").read_bytes() == expected, cuts


def test_plan_rounds_shard_rows_up_to_the_stages_alignment_and_names_a_part_per_output():
    from irflow.stages.dense import encode_corpus
    from irflow.stages.generate_queries import generate_queries

    assert shards.row_ranges(10, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert shards.row_ranges(10, 3, align=4) == [(0, 4), (4, 8), (8, 10)]  # whole batches of 4
    assert shards.row_ranges(10, 8, align=4) == [(0, 8), (8, 10)] and shards.row_ranges(0, 3, align=4) == [(0, 0)]
    # one output: the part names of before; several: one part per output, a shard done when all are there
    assert shards.part_names(encode_corpus, 0, 5) == {"embeddings": "part-000000000000-000000000005.parquet"}
    assert shards.part_name(0, 5) == "part-000000000000-000000000005.parquet"
    assert shards.part_names(generate_queries, 0, 5) == {
        "queries": "part-000000000000-000000000005.queries.parquet",
        "qrels": "part-000000000000-000000000005.qrels.parquet"}
