"""The finished model answers the validation prompts: each example's last assistant turn is the
reference, the turns before it the prompt, greedy decoding the answer; an exact match is the
answer's text equal to the reference's, surrounding whitespace aside. Decoded with the cache
(engine.inference.decode), ``BATCH`` prompts at a time, on the first ``MAX_PROMPTS`` of the
validation set (a bound on the time a job spends after its last step)."""

from __future__ import annotations

from torch import nn

from engine.data import Dataset
from engine.inference.decode import Chunk, Decoder, Prompt, Sampling, encode_prompt
from kiln.dataset import IMAGE_TOKEN

BATCH = 32
MAX_PROMPTS = 512


def exact_match(model: nn.Module, data: Dataset, indices: list[int]) -> float:
    """The fraction of ``indices``' examples whose greedy answer equals their last assistant turn
    (an answer that holds an image placeholder is not asked)."""
    tok, tpl = data.tok, data.tpl
    texts: dict[int, str] = {}

    def emit(prompt: Prompt, chunk: Chunk) -> None:
        texts[id(prompt)] = texts.get(id(prompt), "") + chunk.text

    right = asked = 0
    indices = indices[:MAX_PROMPTS]
    was = model.training
    model.eval()
    try:
        for at in range(0, len(indices), BATCH):
            batch: list[tuple[Prompt, str]] = []
            for i in indices[at : at + BATCH]:
                ex, pixels = data.example(i)
                last = max(k for k, m in enumerate(ex.messages) if m.role == "assistant")
                ref = ex.messages[last].content
                if IMAGE_TOKEN in ref:
                    continue
                ids = encode_prompt(tok, tpl, ex.messages[:last], data.image_tokens or 0)
                # an exact answer is the reference's tokens, then the turn's end: no need to go on
                sampling = Sampling(max_tokens=len(tok.encode(ref)) + len(tpl.end) + 1, temperature=0)
                batch.append((Prompt(ids, pixels if pixels.numel() else None, None, sampling), ref))
            if not batch:
                continue
            dec = Decoder(model, tok, tpl, len(batch), emit)
            dec.prefill([p for p, _ in batch])
            while dec.running:
                dec.step()
            asked += len(batch)
            right += sum(texts.pop(id(p), "").strip() == ref.strip() for p, ref in batch)
    finally:
        model.train(was)
    return right / max(asked, 1)
