"""Incremental decoding (engine.inference) equals the full forward: every generated position's
logits against a fresh forward of the whole sequence, for each built-in family, several prompts
of different lengths in one batch (and images for the families that take them); adapters served
side by side equal each adapter's model alone; sampling, stop strings and lengths behave."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from engine.inference import Batcher, Decoder, Prompt, Sampling
from engine.inference.adapters import Adapters, ServedGroup, ServedLinear, fuse
from engine.inference.decode import encode_prompt, pixels_of
from engine.lora import apply_lora, save_adapter
from engine.model.registry import ensure_builtin, load_base
from kiln.dataset import Example, Message
from kiln.spec import LoraSpec
from kiln.tokenizer import Tokenizer, chat_template, load_tokenizer

FAMILIES = ["kiln-tiny", "kimi-linear-tiny", "kiln-hybrid-tiny"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name in FAMILIES:
        ensure_builtin(name, root / name)
    return root


def png(seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(20, 20, 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Recorder(Decoder):
    """A decoder that keeps, per prompt and choice, the logits each token was drawn from and the token."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: dict[tuple[int, int], list[tuple[torch.Tensor, int]]] = {}

    def _take(self, choices, logits):
        super()._take(choices, logits)
        for c, row in zip(choices, logits, strict=True):
            self.seen.setdefault((id(c.prompt), c.index), []).append((row, c.ids[-1]))


def run_all(dec: Decoder, prompts: list[Prompt]) -> None:
    dec.prefill(prompts)
    while dec.running:
        dec.step()


def prompts_for(model, tok, tpl, images: bool, sampling: Sampling) -> list[Prompt]:
    chats: list[tuple[list[Message], list[str]]] = [
        ([Message("user", "Hello there, who are you?")], []),
        ([Message("system", "Be brief."), Message("user", "What is 2 + 2? Answer with a number")], []),
        ([Message("user", "x")], []),
    ]
    if images:
        chats.append(([Message("user", "What is in <image> and <image>?")], [png(1), png(2)]))
    out = []
    for msgs, imgs in chats:
        ids = encode_prompt(tok, tpl, msgs, getattr(model, "image_tokens", 0) or 0 if imgs else 0)
        out.append(Prompt(ids, pixels_of(imgs, model.image_size) if imgs else None, None, sampling))
    return out


def full_logits(model, ids: list[int], pixels) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), pixels.double() if pixels is not None else None)[0]


def setup(models, name):
    model = load_base(models / name).double().eval()
    tok = load_tokenizer(models / name)
    return model, tok, chat_template(tok)


@pytest.mark.parametrize("name", FAMILIES)
def test_incremental_decode_equals_the_full_forward(models, name):
    model, tok, tpl = setup(models, name)
    dec = Recorder(model, tok, tpl, slots=8)
    dec.ends = set()  # every sequence runs to max_tokens: a random model may end its turn at once
    prompts = prompts_for(model, tok, tpl, name != "kimi-linear-tiny", Sampling(max_tokens=10, seed=5, n=2))
    prompts = prompts[:1] + [
        Prompt(p.ids, p.pixels, None, Sampling(max_tokens=10, seed=k)) for k, p in enumerate(prompts[1:])
    ]
    run_all(dec, prompts)
    assert sorted(dec.free) == list(range(8))  # every slot back
    for p in prompts:
        for i in range(p.sampling.n):
            rows = dec.seen[(id(p), i)]
            assert len(rows) == 10
            tokens = [t for _, t in rows]
            want = full_logits(model, p.ids + tokens[:-1], p.pixels)[len(p.ids) - 1 :]
            got = torch.stack([r for r, _ in rows])
            rel = float((got - want).norm() / want.norm())
            assert rel < 1e-10, (name, i, rel)
    two = [[t for _, t in dec.seen[(id(prompts[0]), i)]] for i in range(2)]
    assert two[0] != two[1]  # n choices draw apart


def test_a_prompt_joins_sequences_already_decoding(models):
    """Continuous batching: a prompt prefilled while others are mid-way decodes as if alone; b ends
    first, so a and c then step in slots 0 and 2 (the cache gathers their rows, not a view)."""
    model, tok, tpl = setup(models, "kimi-linear-tiny")
    dec = Recorder(model, tok, tpl, slots=4)
    dec.ends = set()
    a, b, c = prompts_for(model, tok, tpl, False, Sampling(max_tokens=8, seed=1))
    b = Prompt(b.ids, None, None, Sampling(max_tokens=4, seed=1))
    dec.prefill([a, b])
    for _ in range(3):
        dec.step()
    dec.prefill([c])
    assert [ch.slot for ch in dec.running] == [0, 2]
    while dec.running:
        dec.step()
    for p in (a, b, c):
        rows = dec.seen[(id(p), 0)]
        tokens = [t for _, t in rows]
        want = full_logits(model, p.ids + tokens[:-1], None)[len(p.ids) - 1 :]
        got = torch.stack([r for r, _ in rows])
        assert float((got - want).norm() / want.norm()) < 1e-10


def random_adapter(models, name: str, folder, seed: int, spec: LoraSpec) -> torch.nn.Module:
    """A trained-looking adapter (every factor random, B too), saved in PEFT's layout; returns the
    model with it applied (unmerged: the LoRA layers themselves)."""
    model = load_base(models / name).double()
    apply_lora(model, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    save_adapter(model, spec, name, folder)
    return model.eval()


@pytest.mark.parametrize("name", ["kiln-tiny", "kimi-linear-tiny", "kiln-hybrid-tiny"])
def test_adapters_served_side_by_side_equal_each_model_alone(models, tmp_path, name):
    """One batch: the base and two adapters (on different layers; the MoE families' on their
    experts too) each equal the model that has that adapter alone. The model as a server keeps
    it: the projections that read one input fused (KDA's six, an MLP's gate and up), their
    weights views of the group's; KDA's group holds both adapters (ranks 4 and 2: q and v, k),
    an MLP's the second (up). Removed, an adapter leaves every group."""
    experts = [] if name == "kiln-tiny" else ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    specs = [
        LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"], target_parameters=experts),
        LoraSpec(
            rank=2,
            alpha=2.0,
            target_modules=["o_proj", "up_proj", "k_proj"] + ([] if name == "kiln-tiny" else ["kv_b_proj"]),
        ),
    ]
    alone = [load_base(models / name).double().eval()]
    for k, spec in enumerate(specs):
        alone.append(random_adapter(models, name, tmp_path / f"a{k}", 10 + k, spec))
    model, tok, tpl = setup(models, name)
    fuse(model)
    fused = [m for m in model.modules() if isinstance(getattr(m, "served_group", None), ServedGroup)]
    assert bool(fused) == (name != "kiln-tiny")  # kiln-tiny's MLP is its own
    for m in fused:  # no copy kept: the layers' weights are rows of the group's
        group = m.served_group.weight.untyped_storage().data_ptr()
        assert all(m.get_submodule(n).weight.untyped_storage().data_ptr() == group for n in m.input_projections())
    served = Adapters(model)
    served.add("a0", tmp_path / "a0")
    served.add("a1", tmp_path / "a1")
    served.add("a1", tmp_path / "a1")  # again: nothing to do
    dec = Recorder(model, tok, tpl, slots=8)
    dec.ends = set()
    base = prompts_for(model, tok, tpl, False, Sampling(max_tokens=6, temperature=0))
    prompts = [Prompt(p.ids, None, adapter, p.sampling) for p in base for adapter in ("a1", None, "a0")]
    run_all(dec, prompts[:8])
    for p in prompts[:8]:
        ref = alone[{None: 0, "a0": 1, "a1": 2}[p.adapter]]
        rows = dec.seen[(id(p), 0)]
        tokens = [t for _, t in rows]
        want = full_logits(ref, p.ids + tokens[:-1], None)[len(p.ids) - 1 :]
        got = torch.stack([r for r, _ in rows])
        assert float((got - want).norm() / want.norm()) < 1e-10, p.adapter
    # the adapters differ from the base and each other on the same prompt
    first = {p.adapter: dec.seen[(id(p), 0)][0][0] for p in prompts[:3]}
    assert not torch.allclose(first["a0"], first[None]) and not torch.allclose(first["a1"], first[None])
    served.remove("a1")
    held = [set(m.served_group.factors) | set(m.served_group.parts) for m in fused]
    assert all("a1" not in h for h in held) and any("a0" in h for h in held) == (name != "kiln-tiny")


@pytest.mark.parametrize("full_rank_gate", [False, True])
def test_a_fused_kda_layer_equals_the_layer(full_rank_gate):
    """KDA with its six input projections served as one (the low-rank output gate and K3's
    full-rank one, which the fused layer copies out of the group's tensor): the same output."""
    from engine.model.common.kda import KimiDeltaAttention

    torch.manual_seed(0)
    layer = KimiDeltaAttention(32, 2, 8, full_rank_gate=full_rank_gate).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x, cu = torch.randn(1, 12, 32, dtype=torch.float64), torch.tensor([0, 5, 12])
    with torch.no_grad():
        want = layer(x, cu)
        fuse(layer)
        assert layer.served_group is not None
        assert float((layer(x, cu) - want).norm() / want.norm()) < 1e-12


def test_the_server_fuses_its_model(models):
    """The Batcher serves KDA's and the MLPs' input projections as groups (kimi-linear-tiny)."""
    b = Batcher(models / "kimi-linear-tiny", device="cpu")
    kinds = {type(m).__name__ for m in b.model.modules() if isinstance(getattr(m, "served_group", None), ServedGroup)}
    assert kinds == {"KimiDeltaAttention", "MLP"}


def test_an_adapter_that_does_not_fit_is_refused_and_changes_nothing(models, tmp_path):
    random_adapter(models, "kiln-tiny", tmp_path / "tiny", 1, LoraSpec(rank=2, target_modules=["q_proj"]))
    model, _, _ = setup(models, "kimi-linear-tiny")
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="adapter x"):
        Adapters(model).add("x", tmp_path / "tiny")
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert not any("Served" in type(m).__name__ for m in model.modules())


def test_sampling_stop_strings_seed_and_length(models):
    """Through the threaded Batcher: a seed repeats a draw, a stop string cuts the text before it,
    max_tokens ends with 'length' after exactly that many tokens."""
    b = Batcher(models / "kiln-tiny", device="cpu", max_batch=8)
    try:
        ex = Example(0, [Message("user", "Tell me a story")], [])
        ids, pixels = b.encode(ex)

        def text(s: Sampling):
            h = b.submit(ids, pixels, None, s)
            out = [""] * s.n
            reasons = [None] * s.n
            for c in h:
                out[c.index] += c.text
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
            return out, reasons, h

        one, r1, h1 = text(Sampling(max_tokens=20, seed=7, n=2))
        two, _, _ = text(Sampling(max_tokens=20, seed=7, n=2))
        assert one == two and one[0] != one[1]
        if r1[0] == "length":
            assert h1.completion_tokens >= 20
        probe = one[0]
        assert len(probe) > 3
        stop = probe[2:4]
        cut, reasons, _ = text(Sampling(max_tokens=20, seed=7, stop=(stop,)))
        assert cut[0] == probe[: probe.index(stop)] and reasons[0] == "stop"
        b.decoder.ends = set()
        _, reasons, h = text(Sampling(max_tokens=5, seed=3))
        assert reasons == ["length"] and h.completion_tokens == 5
        h = b.submit(ids, pixels, None, Sampling(max_tokens=1000, seed=1))
        next(iter(h))
        h.cancel()
        assert len(list(h)) < 1000  # iterating ends: the request was stopped
        with pytest.raises(ValueError, match="n: 9"):
            b.submit(ids, None, None, Sampling(max_tokens=5, n=9))
        with pytest.raises(ValueError, match="context of 2048"):
            b.submit(ids, None, None, Sampling(max_tokens=2048))
        with pytest.raises(ValueError, match="not loaded"):
            b.submit(ids, None, "nope", Sampling(max_tokens=2))
    finally:
        b.close()


def test_over_its_adapter_limit_a_base_unloads_the_least_recently_used_idle_one(models, tmp_path):
    """max_adapters 2: a third adapter unloads the least recently used one no request is using
    (its factors leave every served layer), never one a running request decodes with; a request
    to an unloaded adapter loads it again from its folder, and answers as before."""
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj", "down_proj"])
    for k in range(4):
        random_adapter(models, "kiln-tiny", tmp_path / f"a{k}", 20 + k, spec)
    b = Batcher(models / "kiln-tiny", device="cpu", max_batch=8, max_adapters=2)
    b.decoder.ends = set()

    def factors() -> set[str]:
        return {n for m in b.model.modules() if isinstance(m, (ServedLinear, ServedGroup)) for n in m.factors}

    try:
        ids, _ = b.encode(Example(0, [Message("user", "Tell me a story")], []))
        greedy = Sampling(max_tokens=4, temperature=0)
        for k in (0, 1):
            b.add_adapter(f"a{k}", tmp_path / f"a{k}")
        first = "".join(c.text for c in b.submit(ids, None, "a0", greedy))  # a0 used last: a1 is older
        long = b.submit(ids, None, "a1", Sampling(max_tokens=1500, temperature=0))
        chunks = iter(long)
        next(chunks)  # a1 is decoding
        b.add_adapter("a2", tmp_path / "a2")  # a0 is the only idle one
        assert b.adapters.names == {"a1", "a2"} == factors()
        b.add_adapter("a3", tmp_path / "a3")  # a1 still runs: a2 goes, a1 stays
        assert b.adapters.names == {"a1", "a3"} == factors()
        with pytest.raises(ValueError, match="a0 is not loaded"):
            b.submit(ids, None, "a0", greedy)
        again = "".join(c.text for c in b.submit(ids, None, "a0", greedy, tmp_path / "a0"))
        assert again == first and "a0" in b.adapters.names and len(b.adapters.names) == 2
        long.cancel()
        assert len(list(chunks)) < 1500
    finally:
        b.close()


def test_a_finished_job_reports_the_exact_match_of_its_answers(tmp_path):
    """The trainer's final evaluation (engine.inference.evaluate): kiln-tiny learns one answer; of
    two validation examples asking the same, the one whose reference is that answer counts, the
    other does not; OpenAI's full_valid_* metrics come with it, at the last step and its checkpoint."""
    import json

    import engine
    from engine.reporting import RecordingReporter
    from kiln.spec import JobSpec
    from kiln.store import LocalStore

    def chat(answer: str) -> str:
        msgs = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": answer}]
        return json.dumps({"messages": msgs}) + "\n"

    (tmp_path / "train.jsonl").write_text(chat("4") * 8)
    (tmp_path / "valid.jsonl").write_text(chat("4") + chat("5"))
    spec = JobSpec(
        job_id="ftjob-eval",
        model="kiln-tiny",
        training_file=str(tmp_path / "train.jsonl"),
        validation_file=str(tmp_path / "valid.jsonl"),
        n_epochs=60,
        batch_size=8,
        learning_rate_multiplier=10.0,
        seed=3,
        checkpoint_interval=100,
        lora=LoraSpec(rank=8, alpha=16),
    )
    rec = RecordingReporter()
    engine.train(spec, LocalStore(tmp_path / "store"), rec)
    final = rec.steps[max(rec.steps)]
    assert final["full_valid_exact_match"] == 0.5
    assert final["full_valid_loss"] == final["valid_loss"] > 0
    assert 0 < final["full_valid_mean_token_accuracy"] <= 1
    assert not any("full_valid" in k for s, m in rec.steps.items() if s != max(rec.steps) for k in m)


def test_the_image_placeholder_is_never_drawn(models):
    """It stands for pixels an answer does not have: even as the best logit, another token is taken."""
    from engine.inference.decode import Choice

    model, tok, tpl = setup(models, "kiln-tiny")
    assert tpl.image_id is not None
    dec = Decoder(model, tok, tpl, 2)
    logits = torch.zeros(2, model.config.vocab_size, dtype=torch.float64)
    logits[:, tpl.image_id] = 50.0
    logits[:, 65] = 1.0
    p = Prompt([1], None, None, Sampling(max_tokens=4, temperature=0))
    q = Prompt([1], None, None, Sampling(max_tokens=4, temperature=1.0, seed=0))
    choices = [Choice(p, 0, 0, torch.Generator()), Choice(q, 0, 1, torch.Generator().manual_seed(0))]
    dec._take(choices, logits)
    assert choices[0].ids == [65] and choices[1].ids[0] != tpl.image_id


def test_the_absorbed_decode_step_scores_in_fp32_from_bf16_rows():
    """MLA's decode step (the absorbed form over the cache's padded rows) with a bf16 model's rows
    and peaked attention: within bf16's rounding of the float64 answer; padded rows take no
    weight. (Scores rounded to bf16 before the softmax were 1.7x further off here.)"""
    from bench.e2e import TINY
    from engine.model.kimi_linear import KimiLinearConfig
    from engine.model.kimi_linear.model import MLAttention

    c = KimiLinearConfig.from_hf({**TINY, "kv_lora_rank": 128, "qk_rope_head_dim": 32, "num_attention_heads": 8})
    m = MLAttention(c).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    N, S, C = 3, 300, c.kv_lora_rank + c.qk_rope_head_dim
    q = torch.randn(N, m.H, m.nope + m.rope, generator=g) * 6  # peaked attention
    rows = torch.randn(N, S, C, generator=g)
    valid = torch.arange(S) < torch.tensor([S, 7, 150])[:, None]
    up, down = m._absorbed()
    assert up is not None and down is not None
    scale = (m.nope + m.rope) ** -0.5
    want = m._absorbed_step(q.double(), up.double(), down.double(), rows.double(), valid, scale)
    got = m._absorbed_step(q.bfloat16(), up.bfloat16(), down.bfloat16(), rows.bfloat16(), valid, scale)
    assert got.dtype == torch.bfloat16
    assert float((got.double() - want).norm() / want.norm()) < 0.007  # measured 0.0056; bf16 scores 0.0094
    rows[1, 7:] = 1e4  # what a padded row holds must not matter
    again = m._absorbed_step(q.double(), up.double(), down.double(), rows.double(), valid, scale)
    assert torch.equal(again, want)


def test_decoding_keeps_no_autograd_record_and_the_model_trains_after_it(models):
    """The decoder's forwards run in inference mode (no version counters, no autograd record:
    a decode step's many small ops cost less): what it keeps is inference tensors, and the same
    model (a job's final evaluation decodes with it) still runs a training forward and backward."""
    model, tok, tpl = setup(models, "kimi-linear-tiny")
    dec = Decoder(model, tok, tpl, 2)
    dec.ends = set()
    dec.prefill([Prompt([5, 6, 7], None, None, Sampling(max_tokens=4, temperature=0, n=2))])
    while dec.running:
        dec.step()
    assert dec.cache.kept and all(t.is_inference() for t in dec.cache.kept.values())
    model.train()
    ids = torch.tensor([[5, 6, 7, 8]])
    model.lm_head(model.hidden(ids)).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _hf(t, folder) -> Tokenizer:
    """``t`` (a tokenizers.Tokenizer) as Kiln loads a base model's: saved as tokenizer.json, read
    back through kiln.tokenizer."""
    t.save(str(folder / "tokenizer.json"))
    return load_tokenizer(folder)


def _metaspace_bpe(text: str, folder) -> Tokenizer:
    """A SentencePiece-style BPE (pieces carry their leading space as "▁", which a decode drops at
    the start of its text), trained on ``text``."""
    from tokenizers import Tokenizer as T
    from tokenizers import decoders, models, pre_tokenizers, trainers

    t = T(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    t.train_from_iterator([text] * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    return _hf(t, folder)


def _stream(models, tok: Tokenizer, ids: list[int]):
    """A decoder made to take ``ids`` one a step (one-hot logits, greedy): its choice, the text
    pieces it streamed, and the length of every id list it gave the tokenizer to decode."""
    from engine.inference.decode import Choice

    model, _, tpl = setup(models, "kiln-tiny")
    decoded: list[int] = []
    pieces: list[str] = []

    class Counting:
        vocab_size = tok.vocab_size
        encode, special = tok.encode, tok.special

        def decode(self, ids: list[int]) -> str:
            decoded.append(len(ids))
            return tok.decode(ids)

    dec = Decoder(model, Counting(), tpl, 1, lambda p, chunk: pieces.append(chunk.text))
    dec.ends, dec.banned = set(), torch.tensor([], dtype=torch.long)
    c = Choice(Prompt([1], None, None, Sampling(max_tokens=len(ids), temperature=0)), 0, 0, torch.Generator())
    for t in ids:
        logits = torch.zeros(1, max(tok.vocab_size, max(ids) + 1))
        logits[0, t] = 1.0
        dec._take([c], logits)
    return c, pieces, decoded


@pytest.mark.parametrize("kind", ["bytes", "metaspace"])
def test_the_streamed_text_is_the_whole_decode_and_each_step_decodes_a_few_tokens(models, kind, tmp_path):
    """An answer of 600 tokens or more with characters split over tokens (bytes) and pieces whose
    leading space a decode drops at its start (metaspace): the streamed pieces join to the
    tokenizer's text of the whole answer, and the steps decode a bounded number of tokens each,
    not the answer so far (which made a long answer's steps slower with every token)."""
    from kiln.tokenizer import ByteTokenizer

    text = " ".join(["Trois — façon, ☕ déjà vu; naïve café ≠ 咖啡."] * 60)
    tok = ByteTokenizer() if kind == "bytes" else _metaspace_bpe(text, tmp_path)
    ids = tok.encode(text)
    assert len(ids) >= 600
    c, pieces, decoded = _stream(models, tok, ids)
    assert c.finish == "length" and "".join(pieces) == tok.decode(ids) == text
    assert max(decoded) <= 16 and sum(decoded) <= 8 * len(ids)


def test_a_tokenizer_whose_later_text_rewrites_the_earlier_still_decodes_a_few_tokens_a_step(models, tmp_path):
    """A ByteFallback decoder (Llama's) joins byte tokens into one run before it decodes them: é's
    two bytes then a lone lead byte read back as three U+FFFD, not "é" and one. The text of the
    later tokens no longer extends that of the earlier, and the whole answer is decoded at that
    step; the steps after it go back to a few tokens each (they used to stay on the whole)."""
    from tokenizers import Tokenizer as T
    from tokenizers import decoders
    from tokenizers import models as tok_models

    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "<0xE2>": 3, "▁x": 4, "y": 5}
    t = T(tok_models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    t.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok = _hf(t, tmp_path)
    ids = [1, 2, 3, 4] + [5] * 600
    assert tok.decode(ids[:2]) == "é" and tok.decode(ids[:4]) == "\ufffd\ufffd\ufffd x"
    c, pieces, decoded = _stream(models, tok, ids)
    assert c.finish == "length" and "".join(pieces)[1:] == tok.decode(ids)[1:] and c.text == tok.decode(ids)
    assert max(decoded[8 * 3 :]) <= 8  # after the rewrite (the whole: 4 tokens), a few tokens a step


def test_a_small_cpu_decode_step_runs_in_one_thread_and_gives_the_count_back(models, monkeypatch):
    """On the CPU a decode step of few rows x a narrow width runs in one intra-op thread; the
    prefill keeps the process's threads, and so does the caller after each step, even a step
    that fails; a step over ``SMALL_STEP`` keeps them too."""
    from engine.inference import decode

    model, tok, tpl = setup(models, "kimi-linear-tiny")
    assert model.lm_head.in_features < decode.SMALL_STEP  # one row of it is a small step
    seen: list[int] = []
    real = model.hidden
    monkeypatch.setattr(model, "hidden", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        dec = Decoder(model, tok, tpl, 2)
        dec.ends = set()
        dec.prefill([Prompt([5, 6, 7], None, None, Sampling(max_tokens=3, temperature=0))])
        while dec.running:
            dec.step()
        assert seen == [2, 1, 1] and torch.get_num_threads() == 2
        dec.prefill([Prompt([5, 6], None, None, Sampling(max_tokens=3, temperature=0))])
        monkeypatch.setattr(model, "hidden", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of rows")))
        with pytest.raises(RuntimeError, match="out of rows"):
            dec.step()
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(model, "hidden", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
        monkeypatch.setattr(decode, "SMALL_STEP", model.lm_head.in_features)  # one row is no longer small
        seen.clear()
        dec.step()
        assert seen == [2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
