"""What the hybrid families (LFM2, Qwen3.5) share: a stack of layers each of which mixes tokens either
with attention over the paged KV cache or with a recurrent layer over the recurrent state
(kiln/models/recurrent_state.py), then runs its MLP.

A family gives its layer (`forward(x, mixer)` around the mixer it is handed, whose parts keep the
checkpoint's names) and its final norm's name; the model runs each layer with its mixer.
"""

from __future__ import annotations

from typing import Callable

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from .decoder import DecoderConfig, DecoderModel, cache_layer_ids, recurrent_layer_ids
from .layers import Embedding, Linear
from .recurrent_state import RecurrentState


class HybridModel(nn.Module):
    """`model.*`: the embeddings, the layers, and the final norm under the family's name for it."""

    def __init__(self, config: DecoderConfig, dtype: str, layer: Callable, norm: Callable, norm_name: str):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        recurrent = set(config.recurrent_layers)
        self.layers = nn.ModuleList([layer(config, dtype, i in recurrent) for i in range(config.num_hidden_layers)])
        self.norm_name = norm_name
        setattr(self, norm_name, norm(config.hidden_size, config.rms_norm_eps, dtype))

    def final_norm(self, x: nn.Tensor) -> nn.Tensor:
        return getattr(self, self.norm_name)(x)


class HybridForCausalLM(DecoderModel):
    """A family's layer (`layer_class(config, dtype, recurrent)`) keeps its attention in
    `attention_name` and its recurrent mixer in `recurrent_name`."""

    layer_class: Callable
    norm_class: Callable
    norm_name: str
    attention_name = "self_attn"
    recurrent_name: str

    def __init__(self, config: DecoderConfig, dtype: str):
        self.config = config
        self.dtype = dtype
        self.model = HybridModel(config, dtype, self.layer_class, self.norm_class, self.norm_name)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype)

    def embed_tokens(self, token_ids: nn.Tensor) -> nn.Tensor:
        return self.model.embed_tokens(token_ids)

    def hidden_states(self, embeds: nn.Tensor, kv_cache: PagedKVCache, rnn_state: RecurrentState) -> nn.Tensor:
        cache_layers, recurrent_layers = cache_layer_ids(self.config), recurrent_layer_ids(self.config)
        for i, layer in enumerate(self.model.layers):
            if i in recurrent_layers:
                mixer, state, index = getattr(layer, self.recurrent_name), rnn_state, recurrent_layers[i]
            else:
                mixer, state, index = getattr(layer, self.attention_name), kv_cache, cache_layers[i]
            embeds = layer(embeds, lambda x, mixer=mixer, state=state, index=index: mixer(x, state, index))
        return self.model.final_norm(embeds)

    def logits(self, hidden: nn.Tensor) -> nn.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.project(hidden)
        return nn.op.astype(self.lm_head(hidden), "float32")
