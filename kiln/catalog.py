"""What the service says about each base model, torch-free: the API's catalog reads it to check a
job, and the engine's model families point at the same cards, so the two cannot drift apart (a
test holds every name here to the built model's real modules).

A family's LoRA targets (``Targets``) are the last names of its linear layers that LoRA may wrap
(``lora.target_modules``), the ones a job gets when it names none, and its grouped expert tensors
(``lora.target_parameters``, PEFT's names). A ``ModelCard`` is one built-in model of a family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Targets:
    modules: tuple[str, ...]  # every linear layer name LoRA may wrap
    defaults: tuple[str, ...]  # what a job that names none gets; a subset of ``modules``
    parameters: tuple[str, ...] = ()  # grouped expert tensors (PEFT's target_parameters)


LLAMA_STYLE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KIMI_LINEAR_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "b_proj",
    "g_a_proj",
    "g_b_proj",
    "f_a_proj",
    "f_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

TINY = Targets(LLAMA_STYLE_TARGETS, LLAMA_STYLE_TARGETS)
KIMI_LINEAR = Targets(
    KIMI_LINEAR_TARGETS,
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    EXPERT_PARAMETERS,
)
HYBRID = Targets(
    KIMI_LINEAR_TARGETS + ("q_a_proj", "q_b_proj", "g_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "gate_proj", "up_proj", "down_proj"),
    EXPERT_PARAMETERS,
)
# no built-in model (the service offers none yet): the Gated DSA blocks' and MLPs' names, the
# defaults the hybrid's DSA layers get
DEEPSEEK_V32 = Targets(
    ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ("q_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    EXPERT_PARAMETERS,
)


@dataclass(frozen=True)
class ModelCard:
    """One built-in model. ``experts``: routed experts per MoE layer (parallel.ep_size must divide
    it; 0: none). ``position_limit``: the longest sequence the model's positions allow (kiln-tiny's
    max_position_embeddings, the hybrid's RoPE max_seq_len); None: no limit (Kimi Linear: KDA and
    NoPE attention), any length that fits. ``image_tokens``: tokens an image fills; None: a
    text-only model. ``context_parallel``: the family splits one sequence over ranks
    (parallel.cp_size > 1; KDA + MLA or DSA models). ``tokens_per_second`` only feeds the dataset
    report's time estimate."""

    name: str
    model_type: str  # config.json's, which picks the engine's family
    created: int
    lora: Targets
    experts: int
    position_limit: int | None
    image_tokens: int | None
    tokens_per_second: int
    context_parallel: bool = False

    def row(self) -> dict[str, Any]:
        """The API catalog's entry for the model."""
        return {
            "created": self.created,
            "targets": self.lora.modules,
            "default_targets": self.lora.defaults,
            "parameters": self.lora.parameters,
            "experts": self.experts,
            "position_limit": self.position_limit,
            "context_parallel": self.context_parallel,
            "image_tokens": self.image_tokens,
            "tokens_per_second": self.tokens_per_second,
        }


# kiln-tiny's tokens_per_second was measured on the 2-core development VM (CPU, sample dataset,
# batch 8): 4,000-5,000 tokens/s; the two others are rough guesses for the reference kernels on
# that VM, not measurements.
KILN_TINY = ModelCard(
    "kiln-tiny",
    "kiln_tiny",
    created=1764633600,
    lora=TINY,
    experts=0,
    position_limit=2048,
    image_tokens=16,
    tokens_per_second=4000,
)
KIMI_LINEAR_TINY = ModelCard(
    "kimi-linear-tiny",
    "kimi_linear",
    created=1796256000,
    lora=KIMI_LINEAR,
    experts=8,
    position_limit=None,
    image_tokens=None,
    tokens_per_second=1000,
    context_parallel=True,
)
KILN_HYBRID_TINY = ModelCard(
    "kiln-hybrid-tiny",
    "kiln_hybrid",
    created=1796256000,
    lora=HYBRID,
    experts=4,
    position_limit=4096,
    image_tokens=16,
    tokens_per_second=500,
    context_parallel=True,
)

CARDS: dict[str, ModelCard] = {c.name: c for c in (KILN_TINY, KIMI_LINEAR_TINY, KILN_HYBRID_TINY)}
