"""One llama-family decoder for Llama (SmolLM2), Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

Tokens of all requests in a step are packed into one flat batch ([tokens,
hidden]); attention reads per-request structure from ``AttentionMetadata``.
Parameter names follow the Hugging Face checkpoints except for the packed
``qkv_proj`` and ``gate_up_proj`` (see ``executor_svc/runtime/loader.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.attention.base import AttentionBackend, AttentionMetadata
from executor_svc.cpu.decode_stack import CpuDecodeStack
from executor_svc.layers.activation import SiluAndMul
from executor_svc.layers.attention import PagedAttention
from executor_svc.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from executor_svc.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from executor_svc.layers.norm import RMSNorm
from executor_svc.layers.rotary import RotaryEmbedding
from executor_svc.lora.layers import LoraStep
from executor_svc.runtime.config import ModelConfig
from executor_svc.runtime.distributed import divide, tp_size


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = divide(config.num_heads, tp_size())
        self.num_kv_heads = divide(config.num_kv_heads, tp_size())
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, config.qkv_bias
        )
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    """gate_up, SiLU-and-mul, down. On the CPU a long prefill runs in row chunks whose activations stay
    under ``CPU_CHUNK_BYTES``: below glibc's 32 MiB mmap threshold they reuse heap memory instead of
    page-faulting in fresh pages every layer (``executor_svc/cpu/malloc.py``), and they stay in cache. The
    kernels each chunk runs are the ones the kernel choice gives the whole prefill's rows (a big model's
    chunks are fewer rows than the prefill class starts at)."""

    CPU_CHUNK_BYTES = 24 << 20

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], config.mlp_bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            rows = max(1, self.CPU_CHUNK_BYTES // (sum(self.gate_up_proj.shard_sizes) * x.element_size()))
            if x.shape[0] > rows:
                return torch.cat([self._mlp_rows(x, start, rows) for start in range(0, x.shape[0], rows)])
        return self._mlp(x)

    def _mlp_rows(self, x: torch.Tensor, start: int, rows: int) -> torch.Tensor:
        """Rows [start, start + rows) of ``x``, whose adapters' updates (``executor_svc/lora``) take those rows'."""
        part = x[start : start + rows]
        if not self.gate_up_proj.lora_active():
            return self._mlp(part, x.shape[0])
        with self.gate_up_proj.lora.step.rows(start, start + len(part)):
            return self._mlp(part, x.shape[0])

    def _mlp(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, rows), rows), rows)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, dtype,
                                 config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # On the CPU, the layers of a decode step in the C stack where they fit (``cpu_decode_stack.attach``).
        self.cpu_stack: CpuDecodeStack | None = None
        # With adapters served (``executor_svc/lora``): the running step's adapter rows, whose update the C stack
        # leaves to the projections' modules.
        self.lora_step: LoraStep | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        adapted = self.lora_step is not None and self.lora_step.batch is not None
        if self.cpu_stack is not None and self.cpu_stack.applies(hidden, meta, adapted):
            hidden, residual = self.cpu_stack.run(hidden, positions, meta, adapted)
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of the packed batch."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [rows, vocab] of the given hidden rows."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
