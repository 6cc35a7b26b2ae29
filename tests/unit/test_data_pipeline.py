"""The data pipeline: packing is exact, indexing streams, images decode once, batches and
splits are deterministic."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
import torch

from engine.data import Dataset, ImageCache, collate, epoch_batches, split
from engine.model.tiny import TinyConfig, TinyForCausalLM, init_weights
from kiln.dataset import DatasetError, LengthBound
from kiln.tokenizer import ByteTokenizer, chat_template

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"
TOK = ByteTokenizer()
TPL = chat_template(TOK)


def dataset(tmp_path, path=SAMPLE / "train.jsonl", max_len=2048, **kw) -> Dataset:
    return Dataset(
        path, SAMPLE / "images.zip", TOK, TPL, 32, 16, LengthBound("kiln-tiny", 2048, max_len), tmp_path, **kw
    )


def test_a_packed_row_computes_what_its_examples_compute_alone(tmp_path):
    torch.manual_seed(0)
    model = TinyForCausalLM(TinyConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=128)).double().eval()
    init_weights(model, 3)
    model.double()
    data = dataset(tmp_path)
    samples = [data[i] for i in range(6)]  # text and image examples mixed
    assert {len(s.pixels_NCHW) for s in samples} == {0, 1}
    packed = collate(samples, TPL.pad_id, pack_to=400)
    assert packed["input_ids_BT"].shape[0] == 1 and packed["doc_ids_BT"].max() == 5
    with torch.no_grad():
        out = model(
            packed["input_ids_BT"], packed["pixels_NCHW"].double(), packed["doc_ids_BT"], packed["positions_BT"]
        )
        at = 0
        for s in samples:
            alone = model(s.input_ids_T[None], s.pixels_NCHW.double())
            rel = (out[0, at : at + len(s)] - alone[0]).norm() / alone.norm()
            assert rel < 1e-12, rel
            at += len(s)
    assert packed["labels_BT"].ne(-100).sum() == sum(s.labels_T.ne(-100).sum() for s in samples)


def test_packing_fills_rows_and_never_splits_an_example(tmp_path):
    data = dataset(tmp_path)
    samples = [data[i] for i in range(32)]
    padded = collate(samples, TPL.pad_id)
    packed = collate(samples, TPL.pad_id, pack_to=256)
    assert padded["doc_ids_BT"] is None and padded["input_ids_BT"].shape[0] == 32
    rows = packed["input_ids_BT"].shape[0]
    assert rows < 32 and packed["input_ids_BT"].shape[1] <= 256
    real = sum(len(s) for s in samples)
    assert (packed["input_ids_BT"] != TPL.pad_id).sum() == real
    packed_pad = 1 - real / packed["input_ids_BT"].numel()
    padded_pad = 1 - real / padded["input_ids_BT"].numel()
    assert packed_pad < 0.2 and packed_pad < padded_pad / 2, (packed_pad, padded_pad)
    for b in range(rows):  # positions restart at every document
        docs = packed["doc_ids_BT"][b]
        for d in docs.unique().tolist():
            if d >= 0:
                assert packed["positions_BT"][b][docs == d].tolist() == list(range(int((docs == d).sum())))


def test_indexing_streams_a_large_file_in_little_memory(tmp_path):
    line = json.dumps({"messages": [{"role": "user", "content": "q" * 40}, {"role": "assistant", "content": "a" * 40}]})
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for _ in range(100_000):  # ~11 MB
            f.write(line + "\n")
    tracemalloc.start()
    data = dataset(tmp_path, big)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(data) == 100_000 and peak < 4_000_000, peak  # 16 bytes an example, not the file
    assert data[99_999].line == 100_000 and len(data[5]) == data.lengths[5]


def test_each_image_is_decoded_once(tmp_path):
    line = json.dumps(
        {
            "images": ["images/train_0000.png"],
            "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "a"}],
        }
    )
    f = tmp_path / "same.jsonl"
    f.write_text((line + "\n") * 20)
    cache = ImageCache(32)
    data = dataset(tmp_path, f, cache=cache)
    stacked = [data[i].pixels_NCHW for i in range(20)]
    assert cache.decoded == 1 and all(torch.equal(p, stacked[0]) for p in stacked)


def test_batches_are_deterministic_cover_everything_and_can_group_by_length(tmp_path):
    data = dataset(tmp_path)
    idx = list(range(len(data)))
    a = epoch_batches(data.lengths, idx, 8, seed=5, epoch=1, group_by_length=False)
    assert a == epoch_batches(data.lengths, idx, 8, seed=5, epoch=1, group_by_length=False)
    assert a != epoch_batches(data.lengths, idx, 8, seed=5, epoch=2, group_by_length=False)
    g = epoch_batches(data.lengths, idx, 8, seed=5, epoch=1, group_by_length=True)
    assert sorted(i for b in a for i in b) == sorted(i for b in g for i in b) == idx

    def spread(batches):
        return sum(max(data.lengths[i] for i in b) - min(data.lengths[i] for i in b) for b in batches)

    assert spread(g) < spread(a) / 2


def test_split_is_deterministic_and_disjoint():
    train, valid = split(100, 0.1, seed=3)
    assert (train, valid) == split(100, 0.1, seed=3) and len(valid) == 10
    assert not set(train) & set(valid) and sorted(train + valid) == list(range(100))
    assert split(100, 0.1, seed=4)[1] != valid
    assert split(10, 0.0, seed=1) == (list(range(10)), [])


def test_too_long_or_missing_image_names_the_line(tmp_path):
    with pytest.raises(DatasetError, match=r"line 1: messages: example is \d+ tokens, over max_seq_len 30"):
        dataset(tmp_path, max_len=30)
    f = tmp_path / "missing.jsonl"
    f.write_text(
        json.dumps(
            {
                "images": ["images/nope.png"],
                "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "a"}],
            }
        )
        + "\n"
    )
    with pytest.raises(DatasetError, match=r"line 1: images\[0\]: image 'images/nope.png' not found"):
        dataset(tmp_path, f)
