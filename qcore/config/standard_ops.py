"""The standard operator pattern families, parametrised by dtype configs.

A backend that runs the usual int8 operators builds its BackendConfig from
these families instead of listing some 190 patterns by hand. Each family is a
function ``family(dtype_configs) -> list[BackendPatternConfig]`` that
configures every pattern of the family once, accepting the given dtype
configs; the families cover the same patterns as torch.ao's native configs
(torch 2.13), with qcore's own fuser methods (:mod:`qcore.config.fusers`).

Ops with weights (:mod:`qcore.config.standard_weighted_ops`):

* :func:`conv_pattern_configs` -- Conv1d/2d/3d (+ ReLU, + BatchNorm (+ ReLU),
  fused, QAT and functional forms) and ConvTranspose1d/2d/3d (57 patterns)
* :func:`linear_pattern_configs` -- Linear (+ ReLU, + BatchNorm1d; 12)
* :func:`batch_norm_pattern_configs` -- BatchNorm2d/3d (+ ReLU; 8)
* :func:`rnn_pattern_configs` -- GRU/LSTM/RNN cells, LSTM, GRU (5)
* :func:`embedding_pattern_configs` -- Embedding, EmbeddingBag (4)

Ops without weights (:mod:`qcore.config.standard_activation_ops`):

* :func:`binary_op_pattern_configs` -- add/mul (+ relu), matmul (17)
* :func:`cat_pattern_configs` -- torch.cat (1)
* :func:`own_qparams_op_pattern_configs` -- ELU, Hardswish, InstanceNorm,
  PReLU, group_norm, ... (14)
* :func:`fixed_qparams_op_pattern_configs` -- sigmoid, tanh, softmax, ... (13)
* :func:`shared_qparams_op_pattern_configs` -- pooling, reshaping, relu, ... (59)
* :func:`tensor_info_op_pattern_configs` -- x.shape, x.size() (2)
* :func:`layer_norm_pattern_configs` -- LayerNorm (2; not in fbgemm/qnnpack/x86)

:func:`standard_pattern_configs` assembles the families a backend names, each
with its own dtype configs. Example, a backend with only static int8::

    >>> from qcore.config.standard_ops import standard_pattern_configs
    >>> configs = standard_pattern_configs(
    ...     conv=[weighted_int8], linear=[weighted_int8], binary_op=[int8],
    ...     shared_qparams_op=[int8])
    >>> BackendConfig("mychip").set_backend_pattern_configs(configs)
"""

from __future__ import annotations

from collections.abc import Sequence

from qcore.config.backend import BackendConfig
from qcore.config.dtypes import DTypeConfig
from qcore.config.pattern import BackendPatternConfig
from qcore.config.standard_activation_ops import (
    FIXED_QPARAMS_0_TO_1,
    FIXED_QPARAMS_NEG1_TO_1,
    FIXED_QPARAMS_OP_CONSTRAINTS,
    binary_op_pattern_configs,
    cat_pattern_configs,
    fixed_qparams_dtype_configs,
    fixed_qparams_op_pattern_configs,
    layer_norm_pattern_configs,
    own_qparams_op_pattern_configs,
    shared_qparams_op_pattern_configs,
    tensor_info_op_pattern_configs,
)
from qcore.config.standard_weighted_ops import (
    batch_norm_pattern_configs,
    conv_pattern_configs,
    embedding_pattern_configs,
    linear_pattern_configs,
    rnn_pattern_configs,
)

__all__ = [
    "FIXED_QPARAMS_0_TO_1",
    "FIXED_QPARAMS_NEG1_TO_1",
    "FIXED_QPARAMS_OP_CONSTRAINTS",
    "STANDARD_FAMILIES",
    "batch_norm_pattern_configs",
    "binary_op_pattern_configs",
    "cat_pattern_configs",
    "conv_pattern_configs",
    "embedding_pattern_configs",
    "fixed_qparams_dtype_configs",
    "fixed_qparams_op_pattern_configs",
    "layer_norm_pattern_configs",
    "linear_pattern_configs",
    "own_qparams_op_pattern_configs",
    "rnn_pattern_configs",
    "shared_qparams_op_pattern_configs",
    "standard_fusion_config",
    "standard_pattern_configs",
    "tensor_info_op_pattern_configs",
]

STANDARD_FAMILIES = {
    "conv": conv_pattern_configs,
    "linear": linear_pattern_configs,
    "binary_op": binary_op_pattern_configs,
    "cat": cat_pattern_configs,
    "own_qparams_op": own_qparams_op_pattern_configs,
    "fixed_qparams_op": fixed_qparams_op_pattern_configs,
    "shared_qparams_op": shared_qparams_op_pattern_configs,
    "tensor_info_op": tensor_info_op_pattern_configs,
    "batch_norm": batch_norm_pattern_configs,
    "rnn": rnn_pattern_configs,
    "embedding": embedding_pattern_configs,
    "layer_norm": layer_norm_pattern_configs,
}
"""Keyword of :func:`standard_pattern_configs` -> family function, in the
order the families are assembled (torch.ao's order)."""


def standard_pattern_configs(
    **dtype_configs_by_family: Sequence[DTypeConfig] | None,
) -> list[BackendPatternConfig]:
    """The pattern configs of the named families, each with its dtype configs.

    Keywords are the keys of :data:`STANDARD_FAMILIES` (``conv``, ``linear``,
    ``binary_op``, ``cat``, ``own_qparams_op``, ``fixed_qparams_op``,
    ``shared_qparams_op``, ``tensor_info_op``, ``batch_norm``, ``rnn``,
    ``embedding``, ``layer_norm``); a family left out (or given None) is not
    configured. The families share no pattern, so the result holds each
    pattern once.
    """
    unknown = sorted(set(dtype_configs_by_family) - set(STANDARD_FAMILIES))
    if unknown:
        raise TypeError(
            f"standard_pattern_configs: got the keyword {unknown[0]!r}; expected one of "
            f"{', '.join(STANDARD_FAMILIES)}"
        )
    configs: list[BackendPatternConfig] = []
    for family, build in STANDARD_FAMILIES.items():
        dtype_configs = dtype_configs_by_family.get(family)
        if dtype_configs is not None:
            configs += build(dtype_configs)
    return configs


def standard_fusion_config() -> BackendConfig:
    """The fusion rules of the standard families alone (conv/linear with batch norm
    and relu, batch norm with relu): what ``fuse_fx`` applies when no backend is
    named, as torch.ao's ``fuse_fx`` applies its native config's. A backend's own
    fusions (onednn's Linear+Tanh, Linear+LeakyReLU, Conv+Add) are left for
    ``prepare_fx`` with that backend, or ``fuse_fx(model, backend=...)``: a module
    fused for one backend is one no other backend quantizes."""
    configs = standard_pattern_configs(**{family: [] for family in STANDARD_FAMILIES})
    return BackendConfig("standard").set_backend_pattern_configs(
        [config for config in configs if config.fuser_method is not None]
    )
