"""Weight-only kernels for Embedding and EmbeddingBag: 8-bit or 4-bit rows with
float qparams (``torch.ops.quantized.embedding_byte`` / ``embedding_4bit``,
``embedding_bag_byte`` / ``embedding_bag_4bit``); indices in, float out.
"""

from __future__ import annotations

import torch

from qcore.engine.reference import ReferenceModule
from qcore.kernels.common import require
from qcore.kernels.packed import PackedWeights
from qcore.plugin.kernels import KernelMatch

__all__ = ["QuantizedEmbedding", "QuantizedEmbeddingBag"]

# torch's ops, bound once: a lookup through torch.ops costs about as much as the
# Python around a kernel call. TorchScript compiles them as the ops themselves.
_embedding_4bit = torch.ops.quantized.embedding_4bit
_embedding_byte = torch.ops.quantized.embedding_byte
_embedding_bag_4bit = torch.ops.quantized.embedding_bag_4bit
_embedding_bag_byte = torch.ops.quantized.embedding_bag_byte

# torch 2.13's embedding_bag_byte/_4bit sum whatever mode they are given.
_MODES = {"sum": 0}


def _check(match: KernelMatch, kind: type) -> ReferenceModule:
    reference = match.module
    require(isinstance(reference, ReferenceModule), "its weight is not quantized")
    module = reference.module
    require(isinstance(module, kind), f"not an {kind.__name__}")
    require(module.max_norm is None, "max_norm renormalizes float rows")
    require(not module.scale_grad_by_freq and not module.sparse, "training-only options set")
    (qparams,) = reference.weight_qparams.values()
    require(
        qparams.dtype in (torch.quint8, torch.quint4x2) and qparams.axis == 0,
        f"embedding kernels take per-row quint8/quint4x2 weights, not {qparams.dtype} "
        f"(axis {qparams.axis})",
    )
    return reference


class QuantizedEmbedding(PackedWeights):
    """nn.Embedding on 8-bit or 4-bit rows."""

    returns_quantized = False

    def __init__(self, reference: ReferenceModule, engine: str) -> None:
        super().__init__(engine)
        module = reference.module
        self.num_embeddings, self.embedding_dim = module.num_embeddings, module.embedding_dim
        self.set_weight_from(reference)
        self.repack()

    def pack(self):
        return torch.ops.quantized.embedding_bag_prepack(self.qweight())

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        if self.weight_dtype == torch.quint4x2:
            return _embedding_4bit(self._packed, indices)
        return _embedding_byte(self._packed, indices)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, weights={self.weight_dtype}"

    @classmethod
    def lower(cls, match: KernelMatch):
        return cls(_check(match, torch.nn.Embedding), match.engine)


class QuantizedEmbeddingBag(PackedWeights):
    """nn.EmbeddingBag (mode="sum") on 8-bit or 4-bit rows."""

    returns_quantized = False

    def __init__(self, reference: ReferenceModule, engine: str) -> None:
        super().__init__(engine)
        module = reference.module
        require(
            module.mode in _MODES,
            f"mode {module.mode!r}: torch's int8 embedding_bag kernels only sum",
        )
        require(module.padding_idx is None, "padding_idx")
        self.num_embeddings, self.embedding_dim = module.num_embeddings, module.embedding_dim
        self.mode, self.include_last_offset = module.mode, module.include_last_offset
        self.set_weight_from(reference)
        self.repack()

    def pack(self):
        return torch.ops.quantized.embedding_bag_prepack(self.qweight())

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        include_last_offset = self.include_last_offset
        if indices.dim() == 2:  # fixed-length bags, as nn.EmbeddingBag takes them
            offsets = torch.arange(0, indices.numel(), indices.size(1), dtype=indices.dtype)
            indices = indices.reshape(-1)
            include_last_offset = False  # the offsets made here have no last one
        mode = 0  # _MODES["sum"], the only mode taken
        if self.weight_dtype == torch.quint4x2:
            return _embedding_bag_4bit(
                self._packed, indices, offsets, False, mode, False,
                per_sample_weights, None, include_last_offset,
            )  # fmt: skip
        return _embedding_bag_byte(
            self._packed, indices, offsets, False, mode, False,
            per_sample_weights, None, include_last_offset,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, "
            f"weights={self.weight_dtype}"
        )

    @classmethod
    def lower(cls, match: KernelMatch):
        return cls(_check(match, torch.nn.EmbeddingBag), match.engine)
