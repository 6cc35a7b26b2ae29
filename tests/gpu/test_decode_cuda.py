"""On a GPU (skipped elsewhere): the served model decodes on CUDA as the server runs it (bf16
weights under bf16 autocast, the Triton kernels for the prefill, the one-step recurrence after),
with adapters served side by side. Each generated position's logits against the whole sequence
in one forward, in fp64 on the CPU (the reference kernels): the decode is as close to it as a
fresh bf16 forward of the whole sequence on the GPU is (twice its error, plus bf16's 1e-2)."""

from __future__ import annotations

import pytest
import torch

from engine.inference import Batcher, Decoder, Prompt, Sampling
from kiln.spec import LoraSpec
from tests.tolerance import rel
from tests.unit import test_decode
from tests.unit.test_decode import FAMILIES, Recorder, random_adapter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
models = test_decode.models  # the built-in models' folders, written once (a fixture)


@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_decode_equals_the_full_forward(models, tmp_path, name):
    experts = [] if name == "kiln-tiny" else ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"], target_parameters=experts)
    random_adapter(models, name, tmp_path / "a", 3, spec)
    b = Batcher(models / name, device="cuda")
    b.add_adapter("a", tmp_path / "a")
    dec = Recorder(b.model, b.tok, b.tpl, slots=8)
    dec.ends = set()
    g = torch.Generator().manual_seed(0)
    lengths = [300, 17, 1000]
    prompts = [
        Prompt(torch.randint(3, 200, (n,), generator=g).tolist(), None, a, Sampling(max_tokens=24, seed=n))
        for n, a in zip(lengths, ["a", None, "a"], strict=True)
    ]
    dec.prefill(prompts)
    while dec.running:
        dec.step()
    whole = Decoder(b.model, b.tok, b.tpl, slots=1)  # no cache reuse: each sequence in one forward
    ref = Batcher(models / name, device="cpu")
    ref.model.double()
    ref.add_adapter("a", tmp_path / "a")
    exact = Decoder(ref.model, ref.tok, ref.tpl, slots=1)
    for p in prompts:
        rows = dec.seen[(id(p), 0)]
        tokens = [t for _, t in rows]
        for k in (0, 11, 23):  # the prefill's last position, and two decode steps
            seq = [p.ids + tokens[:k]]
            full = whole._forward(seq, [0], [p.adapter], None)[0]
            want = exact._forward(seq, [0], [p.adapter], None)[0]
            whole.cache.free(0)
            exact.cache.free(0)
            assert rel(rows[k][0].cpu(), want) < 2 * rel(full.cpu(), want) + 1e-2, (name, p.adapter, k)
