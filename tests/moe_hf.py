"""tests/moe_models.py's DeepSeek-style MoE as a Hugging Face causal LM, the way remote code ships one:
a `PretrainedConfig` and a `PreTrainedModel` registered with the Auto classes, its experts an
`nn.ModuleList` of separate modules (not transformers 5's fused experts), experts without tokens not
called. TRL's trainers load it from a directory like any checkpoint (tests/scripts/trl_dpo.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from tests.moe_models import MoELayer, MoEShape


class TinyExpertsConfig(PretrainedConfig):
    """Sizes of the model; untied head and embedding."""

    model_type = "tiny_experts_moe"

    def __init__(self, vocab_size: int = 64, hidden_size: int = 32, intermediate_size: int = 32,
                 num_experts: int = 8, num_experts_per_tok: int = 2, num_hidden_layers: int = 2, **kwargs) -> None:
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_experts, self.num_experts_per_tok, self.num_hidden_layers = (num_experts, num_experts_per_tok,
                                                                              num_hidden_layers)
        self.auto_map = kwargs.pop("auto_map", {})  # remote-code configs carry one; loaders read it
        super().__init__(**{"tie_word_embeddings": False, **kwargs})


class CheckpointableMoELayer(GradientCheckpointingLayer, MoELayer):
    """MoELayer, recomputed in backward when gradient checkpointing is on (TRL's default): the
    recomputation routes the same tokens, so it calls the same experts again."""


class TinyExpertsPreTrainedModel(PreTrainedModel):
    """The classes' common settings (transformers' layout: a backbone under `model`, a head beside it)."""

    config_class = TinyExpertsConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True


class TinyExpertsModel(TinyExpertsPreTrainedModel):
    """embed -> MoE layers (a causal-mean token mixer and a gate + per-expert MLPs) -> norm. The
    experts record their calls, recomputations included."""

    def __init__(self, config: TinyExpertsConfig) -> None:
        super().__init__(config)
        shape = MoEShape(vocab=config.vocab_size, dim=config.hidden_size, hidden=config.intermediate_size,
                         num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                         num_layers=config.num_hidden_layers)
        self.embed_tokens = nn.Embedding(shape.vocab, shape.dim)
        self.layers = nn.ModuleList([CheckpointableMoELayer(shape) for _ in range(shape.num_layers)])
        self.norm = nn.LayerNorm(shape.dim)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x))


class TinyExpertsForCausalLM(TinyExpertsPreTrainedModel, GenerationMixin):
    """TinyExpertsModel and a language-model head."""

    def __init__(self, config: TinyExpertsConfig) -> None:
        super().__init__(config)
        self.model = TinyExpertsModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        hidden = self.model(input_ids, attention_mask).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden))

    def expert_calls(self) -> list[list[list[int]]]:
        """Per layer, per forward since it was built: the experts called."""
        return [layer.mlp.calls for layer in self.model.layers]


def register() -> None:
    """Make AutoConfig / AutoModelForCausalLM load the model type (what trust_remote_code does)."""
    AutoConfig.register(TinyExpertsConfig.model_type, TinyExpertsConfig, exist_ok=True)
    AutoModelForCausalLM.register(TinyExpertsConfig, TinyExpertsForCausalLM, exist_ok=True)
