"""Batched forward of a Hugging Face decoder-only model over a per-slot KV cache.

Why our own forward instead of ``model(..., past_key_values=...)``: continuous batching needs every running
sequence to keep its own KV history while sequences join and leave the batch at arbitrary steps. HF cache objects
assume one batch that lives and dies together (left padding fixed at prefill time), so requests could not be added
or removed without re-gathering every cache on every step. Here each running sequence owns one *slot* (a row of a
static cache tensor per layer) and a decode step attends, for every slot at once, over that slot's first ``position
+ 1`` keys. Running sequences are kept in slots ``0..n-1`` (the scheduler fills holes by moving the last slot), so a
decode step reads plain views of the cache without copying it.

The forward reuses the model's own sub-modules (embedding, projections, RMSNorm, MLP, rotary embedding, LM head);
only attention and the KV bookkeeping are ours. Loading new weights into the module therefore takes effect at the
next forward with nothing to re-derive. Architectures whose attention differs from the Llama family (sliding
windows, soft-capping, non-static RoPE, MoE, ...) are refused at construction rather than silently mis-computed.
"""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
# RoPE variants whose cos/sin depend on the position only. "dynamic" and "longrope" rescale with the current sequence
# length, so a batched forward would not reproduce a single-sequence forward.
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# The cache grows its sequence dimension in blocks of this many positions, so memory tracks the longest sequence
# actually seen instead of max_model_len times max_num_seqs up front.
_BLOCK_LEN = 128


class UnsupportedModelError(ValueError):
    """Raised for a model whose forward this module cannot reproduce exactly."""


def check_supported(model: nn.Module) -> None:
    """Fail loudly unless ``model`` is a Llama-family causal LM that :class:`SlotKVModel` reproduces exactly."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the CPU engine; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    backbone = getattr(model, "model", None)
    if backbone is None or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a *ForCausalLM with .model and .lm_head")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise UnsupportedModelError(f"only full attention is supported, got layer types {sorted(layer_types)}")
    rope_type = getattr(backbone.rotary_emb, "rope_type", None)
    if rope_type not in _STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {sorted(_STATIC_ROPE_TYPES)}"
        )
    for index, layer in enumerate(backbone.layers):
        attn = layer.self_attn
        missing = [name for name in ("q_proj", "k_proj", "v_proj", "o_proj") if not hasattr(attn, name)]
        if missing:
            raise UnsupportedModelError(f"layer {index}: attention lacks {missing}")
        if getattr(attn, "sliding_window", None) is not None:
            raise UnsupportedModelError(f"layer {index}: sliding-window attention is not supported")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SlotKVModel:
    """A causal LM plus a static KV cache with one row ("slot") per running sequence.

    Not thread-safe: the engine calls it from a single worker thread. All methods must run under
    ``torch.inference_mode()`` (the cache tensors are inference tensors). The cache and every index tensor live on
    the model's device (the device of its LM head), so the same code runs on CPU and on a GPU.
    """

    def __init__(self, model: nn.Module, *, max_slots: int, max_model_len: int) -> None:
        check_supported(model)
        config = model.config
        self.model = model
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.vocab_size: int = config.vocab_size
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.group = self.num_heads // self.num_kv_heads
        self.scaling: float = model.model.layers[0].self_attn.scaling
        self._dtype = model.lm_head.weight.dtype
        self.device = model.lm_head.weight.device
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._num_slots = 0
        self._capacity = 0

    @property
    def cache_bytes(self) -> int:
        """Bytes currently held by the KV cache (for memory reporting)."""
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)

    def reserve(self, num_slots: int, length: int) -> None:
        """Make room for ``num_slots`` slots of ``length`` positions, keeping existing contents.

        Both dimensions grow geometrically or by blocks (capped at ``max_slots`` / ``max_model_len``) so that the
        copy a growth costs is amortised over many steps.
        """
        if num_slots <= self._num_slots and length <= self._capacity:
            return
        if num_slots > self.max_slots or length > self.max_model_len:
            raise ValueError(f"cache request {num_slots=} {length=} exceeds {self.max_slots=} {self.max_model_len=}")
        slots = self._num_slots
        if num_slots > slots:
            slots = min(self.max_slots, max(num_slots, 2 * slots))
        capacity = max(self._capacity, min(self.max_model_len, -(-length // _BLOCK_LEN) * _BLOCK_LEN))
        shape = (slots, self.num_kv_heads, capacity, self.head_dim)
        for cache in (self._keys, self._values):
            for index in range(len(self.model.model.layers)):
                grown = torch.zeros(shape, dtype=self._dtype, device=self.device)
                if index < len(cache):
                    grown[: self._num_slots, :, : self._capacity] = cache[index]
                    cache[index] = grown
                else:
                    cache.append(grown)
        self._num_slots, self._capacity = slots, capacity

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached positions of slot ``src`` into slot ``dst`` (to keep slots compact)."""
        for cache in (self._keys, self._values):
            for layer_cache in cache:
                layer_cache[dst, :, :length] = layer_cache[src, :, :length]

    def prefill(self, prompts: list[list[int]], first_slot: int) -> torch.Tensor:
        """Run whole prompts into slots ``first_slot, first_slot + 1, ...``; return float32 next-token logits [B, V].

        Prompts are right-padded to a common length; padded positions write garbage K/V past each prompt's end,
        which the length mask hides and later decode steps overwrite.
        """
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        padded = [prompt + [0] * (width - len(prompt)) for prompt in prompts]
        ids = torch.tensor(padded, dtype=torch.long, device=self.device)
        positions = torch.arange(width, device=self.device).expand(len(prompts), width)
        hidden = self._layers_forward(ids, positions, slice(first_slot, first_slot + len(prompts)), prefill=True)
        last = hidden[torch.arange(len(prompts), device=self.device), torch.tensor(lengths, device=self.device) - 1]
        return self._logits(last)

    def decode(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of slots ``0..n-1`` at the given positions; return float32 logits [n, V]."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device).unsqueeze(1)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device).unsqueeze(1)
        hidden = self._layers_forward(ids, pos, slice(0, len(token_ids)), prefill=False)
        return self._logits(hidden[:, 0])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden)).float()

    def _layers_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: slice, *, prefill: bool
    ) -> torch.Tensor:
        backbone = self.model.model
        batch, width = ids.shape
        hidden = backbone.embed_tokens(ids)
        cos, sin = backbone.rotary_emb(hidden, positions)
        cos_q, sin_q = cos[:, None, None], sin[:, None, None]  # broadcast over [B, KVH, G, T, D]
        cos_k, sin_k = cos[:, None], sin[:, None]  # broadcast over [B, KVH, T, D]
        rows = torch.arange(slots.start, slots.stop, device=self.device)
        # Query at position p sees keys 0..p of its own slot: causal for prefill, the slot's history for decode.
        # Decode attends per length bucket (see _length_buckets) instead of padding every row to the longest.
        buckets = [torch.arange(batch, device=self.device)] if prefill else _length_buckets(positions[:, 0])
        spans = []
        for members in buckets:
            key_len = width if prefill else int(positions[members].max()) + 1
            key_positions = torch.arange(key_len, device=self.device)
            visible = key_positions[None, None, :] <= positions[members][:, :, None]  # [b, T, L]
            mask = visible[:, None, None].expand(len(members), 1, self.group, width, key_len)
            spans.append((members, key_len, mask.reshape(len(members), 1, -1, key_len)))
        for index, layer in enumerate(backbone.layers):
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            q = attn.q_proj(normed).view(batch, width, self.num_heads, self.head_dim)
            k = attn.k_proj(normed).view(batch, width, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(normed).view(batch, width, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q.view(batch, width, self.num_kv_heads, self.group, self.head_dim).permute(0, 2, 3, 1, 4)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, KVH, T, D]
            q = q * cos_q + _rotate_half(q) * sin_q
            k = k * cos_k + _rotate_half(k) * sin_k
            key_cache, value_cache = self._keys[index], self._values[index]
            if prefill:
                key_cache[slots, :, :width] = k
                value_cache[slots, :, :width] = v
            else:
                key_cache[rows, :, positions[:, 0]] = k[:, :, 0]
                value_cache[rows, :, positions[:, 0]] = v[:, :, 0]
            q = q.reshape(batch, self.num_kv_heads, self.group * width, self.head_dim)
            out = torch.empty_like(q)
            for members, key_len, mask in spans:
                if prefill:
                    keys, values = k, v
                else:
                    keys, values = key_cache[rows[members], :, :key_len], value_cache[rows[members], :, :key_len]
                scores = torch.matmul(q[members], keys.transpose(-1, -2)) * self.scaling
                scores = scores.masked_fill(~mask, float("-inf"))
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                out[members] = torch.matmul(probs, values)
            out = out.view(batch, self.num_kv_heads, self.group, width, self.head_dim)
            out = out.permute(0, 3, 1, 2, 4).reshape(batch, width, self.num_heads * self.head_dim)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden


def _length_buckets(positions: torch.Tensor) -> list[torch.Tensor]:
    """Decode rows grouped so that no row attends over more than twice its own history.

    Padded attention costs (rows x longest history); a batch mixing resumed long samples with fresh
    short ones -- exactly what partial rollout produces -- would pay the longest history for every
    row. Power-of-two buckets bound that waste at 2x, like a coarse version of paged attention.
    """
    bucket_of = torch.ceil(torch.log2((positions + 1).to(torch.float64))).to(torch.long)
    return [torch.nonzero(bucket_of == bucket).flatten() for bucket in torch.unique(bucket_of)]
