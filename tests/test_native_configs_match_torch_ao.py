"""The first-party plugins' configs against torch.ao's native configs of the same name.

For fbgemm, qnnpack, x86 and onednn (the x86 plugin's second backend): the
plugin's pattern configs (built with qcore's own API: qcore.config.standard_ops,
qcore.config.onednn_fusions and qcore.config.fusers) are compared with
torch.ao's BackendConfig pattern by pattern, field by field; fuser methods are
compared by behaviour on freshly built modules, in eval and in QAT mode. Any
difference fails the test unless DELIBERATE_DIFFERENCES lists it with a
reason; a listed difference that no longer occurs fails too, so the table
stays true. The default QConfigMappings are compared with torch.ao's.
"""

from __future__ import annotations

import copy
import functools
import importlib
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qcore import BackendConfig
from qcore.config import MatchAllNode
from qcore.config.pattern import format_pattern, to_complex_format
from qcore.config.torch_ao import import_torch_ao_backend_config

ao = import_torch_ao_backend_config()  # also loads the utils torch 2.13 forgets


def _ao_x86():
    from torch.ao.quantization.backend_config.x86 import get_x86_backend_config

    return get_x86_backend_config()


def _ao_onednn():
    from torch.ao.quantization.backend_config.onednn import get_onednn_backend_config

    return get_onednn_backend_config()


BACKENDS = {
    "fbgemm": ("qcore_fbgemm.plugin", ao.get_fbgemm_backend_config, 192),
    "qnnpack": ("qcore_qnnpack.plugin", ao.get_qnnpack_backend_config, 190),
    "x86": ("qcore_x86.plugin", _ao_x86, 192),
    "onednn": ("qcore_x86.onednn_plugin", _ao_onednn, 221),
}
ENGINES = {"onednn": {"onednn", "x86", "fbgemm"}, "x86": {"x86", "fbgemm"}}
"""The quantized engines a backend's kernels run on, where not only the backend's name
(onednn: its convs packed for the onednn engine, the rest as x86's; x86: its
conv_transpose packed for fbgemm, qcore.kernels.PACKED_AS)."""

_TRANSPOSED_CONV_BN = [
    (nn.ConvTranspose1d, nn.BatchNorm1d),
    (nn.ConvTranspose2d, nn.BatchNorm2d),
    (nn.ConvTranspose3d, nn.BatchNorm3d),
]

ADDED_PATTERNS = (nn.ChannelShuffle, torch.channel_shuffle)
"""Patterns qcore declares and torch.ao's configs do not: torch.ao's convert runs
channel_shuffle on int8 without a pattern (a rule of its own for general tensor
ops); qcore says so in the config, as a shared-qparams op like pixel_shuffle."""

DELIBERATE_DIFFERENCES: dict[tuple[str, str], str] = {
    **{
        (format_pattern(to_complex_format(pattern)), "pattern"): (
            "not in torch.ao's config; torch.ao's convert quantizes it all the same"
        )
        for pattern in ADDED_PATTERNS
    },
    **{
        (format_pattern(to_complex_format(pattern)), "fuser_method[qat]"): (
            "QAT fusion of ConvTranspose + BatchNorm is unsupported in both; torch.ao raises a "
            "bare Exception, qcore a FusionError (a ValueError) naming the modules and what "
            "was expected"
        )
        for pattern in _TRANSPOSED_CONV_BN
    },
}
"""(pattern in complex format, field) -> why qcore differs from torch.ao there,
for every backend."""

_BN_CONV = (nn.BatchNorm2d, nn.Conv2d)
_BN_CONV_ADDS = [
    (add, *sides)
    for add in (torch.add, operator.add)
    for sides in ((_BN_CONV, MatchAllNode), (MatchAllNode, _BN_CONV))
]

ONEDNN_DIFFERENCES: dict[tuple[str, str], str] = {
    **{
        (format_pattern(pattern), "fuser_method[qat]"): (
            "QAT fusion of a conv/linear + BatchNorm fused further (into an add, or with "
            "leaky_relu) is unsupported in both; torch.ao raises NotImplementedError, qcore a "
            "FusionError naming the modules and what to do"
        )
        for pattern in [
            *((nn.ReLU, add) for add in _BN_CONV_ADDS),
            *_BN_CONV_ADDS,
            (nn.LeakyReLU, (nn.BatchNorm1d, nn.Linear)),
        ]
    },
    **{
        (format_pattern((function, nn.Linear)), f"fuser_method[{mode}]"): (
            "a functional activation after nn.Linear is not fusable into LinearLeakyReLU/"
            "LinearTanh: torch.ao's fuser fails an assert, qcore's raises a FusionError "
            "naming the modules (and its engine leaves such a match unfused)"
        )
        for function in (F.leaky_relu, torch.tanh)
        for mode in ("eval", "qat")
    },
}
"""The same, for onednn only."""


def deliberate_differences(name):
    return {**DELIBERATE_DIFFERENCES, **(ONEDNN_DIFFERENCES if name == "onednn" else {})}


_CONSTRAINT_FIELDS = (
    "dtype",
    "quant_min_lower_bound",
    "quant_max_upper_bound",
    "scale_min_lower_bound",
    "scale_max_upper_bound",
    "scale_exact_match",
    "zero_point_exact_match",
)
_MODULE_FIELDS = ("root_module", "qat_module", "reference_quantized_module", "fused_module")


def plugin_module(name):
    return pytest.importorskip(
        BACKENDS[name][0], reason=f"the plugin serving {name} is not installed"
    )


@functools.cache
def qcore_config(name):
    plugin = importlib.import_module(BACKENDS[name][0])
    return BackendConfig(name).set_backend_pattern_configs(
        plugin.qcore_backend_pattern_configs(name)
    )


@functools.cache
def torch_ao_config(name):
    return BACKENDS[name][1]()


def keyed_qcore(config):
    return {c.pattern_complex_format: c for c in config.configs}


def keyed_torch_ao(config):
    return dict(config._pattern_complex_format_to_config)


# -- field-by-field comparison ------------------------------------------------


def dtype_config_fields(dtype_config):
    """Every DTypeWithConstraints field of input/output/weight, bias dtype, is_dynamic."""
    fields = {}
    for kind in ("input", "output", "weight"):
        constrained = getattr(dtype_config, f"{kind}_dtype_with_constraints")
        for name in _CONSTRAINT_FIELDS:
            fields[f"{kind}.{name}"] = getattr(constrained, name)
    fields["bias_dtype"] = dtype_config.bias_dtype
    fields["is_dynamic"] = dtype_config.is_dynamic
    return fields


def static_fields(config):
    """The fields compared by value (fuser methods are compared by behaviour)."""
    fields = {
        "pattern": config.pattern,
        "observation_type": config.observation_type.name,
        "num_tensor_args_to_observation_type": {
            count: kind.name for count, kind in config._num_tensor_args_to_observation_type.items()
        },
        "input_type_to_index": dict(config._input_type_to_index),
        "root_node_getter is set": config._root_node_getter is not None,
        "extra_inputs_getter is set": config._extra_inputs_getter is not None,
        "fuser_method is set": config.fuser_method is not None,
        "dtype_configs count": len(config.dtype_configs),
    }
    for name in _MODULE_FIELDS:
        fields[name] = getattr(config, name)
    for index, dtype_config in enumerate(config.dtype_configs):
        for name, value in dtype_config_fields(dtype_config).items():
            fields[f"dtype_configs[{index}].{name}"] = value
    return fields


# -- fuser methods by behaviour -------------------------------------------------

_SAMPLE_CHANNELS = 4


def sample_module(op):
    """A fresh module for one element of a fusion pattern (F.relu becomes nn.ReLU,
    as the engines hand it to the fuser; other functions and MatchAllNode are
    handed over as they are)."""
    if isinstance(op, tuple):  # a complex-format sub-pattern
        return tuple(sample_module(item) for item in op)
    if op in (F.relu, torch.relu, nn.ReLU):
        return nn.ReLU()
    if getattr(op, "__name__", None) == "MatchAllNode":
        return MatchAllNode
    if not isinstance(op, type):
        return op
    if op in (nn.LeakyReLU, nn.Tanh):
        return op()
    if op is nn.Linear:
        return nn.Linear(3, _SAMPLE_CHANNELS)
    if issubclass(op, nn.modules.conv._ConvNd):
        return op(3, _SAMPLE_CHANNELS, 3)
    if issubclass(op, nn.modules.batchnorm._BatchNorm):
        bn = op(_SAMPLE_CHANNELS)
        with torch.no_grad():  # non-trivial statistics, so folding shows in the weights
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 2)
            bn.bias.uniform_(-1, 1)
        return bn
    raise AssertionError(f"no sample module for {op!r}")


def fuser_outcome(fuser, is_qat, modules):
    """What a fuser makes of ``modules``: the module types and parameters/buffers
    of the result, or the name of the exception it raises."""
    try:
        fused = fuser(is_qat, *modules)
    except Exception as error:  # the outcome is the error
        return ("raises", type(error).__name__)
    return (
        "module",
        [type(m) for m in fused.modules()],
        {key: value.detach().clone() for key, value in fused.state_dict().items()},
    )


def same_outcome(ours, theirs):
    if ours[0] != theirs[0] or ours[1] != theirs[1]:
        return False
    if ours[0] == "raises":
        return True
    a, b = ours[2], theirs[2]
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.allclose(a[k].float(), b[k].float(), atol=1e-6)
        for k in a
    )


def describe_outcome(outcome):
    if outcome[0] == "raises":
        return f"raises {outcome[1]}"
    return f"{outcome[1][0].__name__} ({len(outcome[2])} tensors)"


def _train(modules, mode):
    for module in modules:
        if isinstance(module, tuple):
            _train(module, mode)
        elif isinstance(module, nn.Module):
            module.train(mode)


def fuser_differences(config, ours, theirs):
    """Apply both fusers to identical fresh modules, in eval and in QAT mode: in
    forward order for a simple pattern, in the pattern's nested order for a
    complex-format one (torch.ao hands the torch.ao MatchAllNode over; a fuser
    does not look at it)."""
    differences = []
    torch.manual_seed(0)
    if config.pattern is not None:
        modules = [sample_module(op) for op in config.pattern]
    else:
        modules = list(sample_module(config.pattern_complex_format))
    for mode, is_qat in (("eval", False), ("qat", True)):
        _train(modules, is_qat)
        mine = fuser_outcome(ours, is_qat, copy.deepcopy(modules))
        reference = fuser_outcome(theirs, is_qat, copy.deepcopy(modules))
        if not same_outcome(mine, reference):
            detail = f"qcore {describe_outcome(mine)}, torch.ao {describe_outcome(reference)}"
            if describe_outcome(mine) == describe_outcome(reference):
                detail += ": the module types match, the weights or buffers differ"
            differences.append((f"fuser_method[{mode}]", detail))
    return differences


# -- the comparison --------------------------------------------------------------


def differences(name):
    """Every (pattern, field, detail) where qcore's config differs from torch.ao's."""
    ours, theirs = keyed_qcore(qcore_config(name)), keyed_torch_ao(torch_ao_config(name))
    found = []
    for key in theirs.keys() - ours.keys():
        found.append((format_pattern(key), "pattern", "missing in qcore"))
    for key in ours.keys() - theirs.keys():
        found.append((format_pattern(key), "pattern", "not in torch.ao"))
    if list(ours.keys() & theirs.keys()) and [k for k in ours if k in theirs] != [
        k for k in theirs if k in ours
    ]:
        found.append(("*", "order", "patterns are configured in a different order"))
    for key in ours.keys() & theirs.keys():
        mine, reference = static_fields(ours[key]), static_fields(theirs[key])
        for field in sorted(mine.keys() | reference.keys()):
            a, b = mine.get(field, "<absent>"), reference.get(field, "<absent>")
            if a != b:
                found.append((format_pattern(key), field, f"qcore {a!r}, torch.ao {b!r}"))
        if ours[key].fuser_method is not None and theirs[key].fuser_method is not None:
            for field, detail in fuser_differences(
                ours[key], ours[key].fuser_method, theirs[key].fuser_method
            ):
                found.append((format_pattern(key), field, detail))
    return sorted(found)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_pattern_count(name):
    plugin_module(name)
    expected = BACKENDS[name][2]
    assert len(qcore_config(name)) == expected + len(ADDED_PATTERNS)
    assert len(keyed_torch_ao(torch_ao_config(name))) == expected


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_pattern_and_field_matches_torch_ao(name):
    plugin_module(name)
    unexpected = [
        f"{pattern} {field}: {detail}"
        for pattern, field, detail in differences(name)
        if (pattern, field) not in deliberate_differences(name)
    ]
    assert not unexpected, f"{name} differs from torch.ao:\n" + "\n".join(unexpected)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_deliberate_difference_still_occurs(name):
    plugin_module(name)
    occurring = {(pattern, field) for pattern, field, _ in differences(name)}
    stale = sorted(set(deliberate_differences(name)) - occurring)
    assert not stale, f"listed in DELIBERATE_DIFFERENCES but no longer different: {stale}"


def test_fusion_patterns_are_compared_by_behaviour():
    """The behaviour check is not vacuous: every fusion pattern got both fusers
    applied, and BN folding changes the weights."""
    plugin_module("fbgemm")
    ours = keyed_qcore(qcore_config("fbgemm"))
    fusions = [c for c in ours.values() if c.fuser_method is not None]
    assert len(fusions) == 3 * 6 + 3 + 4  # conv (per dim), linear, bn + relu
    conv, bn = nn.Conv2d(3, 4, 3).eval(), sample_module(nn.BatchNorm2d).eval()
    folded = ours[(nn.BatchNorm2d, nn.Conv2d)].fuser_method(False, conv, bn)
    assert not torch.allclose(folded.weight, conv.weight)


def test_qnnpack_has_the_symmetric_qint8_configs():
    plugin_module("qnnpack")
    ours = keyed_qcore(qcore_config("qnnpack"))
    for key in (nn.Conv2d, nn.Linear, torch.add, torch.cat, nn.Sigmoid, nn.MaxPool2d):
        symmetric = [d for d in ours[key].dtype_configs if d.input_dtype == torch.qint8]
        assert len(symmetric) == 1, format_pattern(key)
        dtype_config = symmetric[0]
        for kind in ("input", "output"):
            constrained = getattr(dtype_config, f"{kind}_dtype_with_constraints")
            assert constrained.scale_min_lower_bound == 2**-12
        if dtype_config.weight_dtype is not None:
            weight = dtype_config.weight_dtype_with_constraints
            assert weight.dtype == torch.qint8
            assert (weight.quant_min_lower_bound, weight.quant_max_upper_bound) == (-127, 127)
            assert weight.scale_min_lower_bound == 2**-12


def test_fixed_qparams_ops_carry_exact_match_constraints():
    plugin_module("fbgemm")
    ours = keyed_qcore(qcore_config("fbgemm"))
    sigmoid = ours[torch.sigmoid].dtype_configs[0].output_dtype_with_constraints
    tanh = ours["tanh"].dtype_configs[0].input_dtype_with_constraints
    assert (sigmoid.scale_exact_match, sigmoid.zero_point_exact_match) == (1 / 256, 0)
    assert (tanh.scale_exact_match, tanh.zero_point_exact_match) == (2 / 256, 128)


# -- the plugins' hooks --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_plugin_hooks_answer_only_for_their_backend(name):
    plugin = plugin_module(name)
    assert plugin.QCORE_PLUGIN_API_VERSION == 1
    kernels = plugin.qcore_backend_kernels(name)
    assert kernels and {kernel.engine for kernel in kernels} == ENGINES.get(name, {name})
    other = "some-other-backend"
    assert plugin.qcore_backend_pattern_configs(other) is None
    assert plugin.qcore_backend_kernels(other) is None
    assert plugin.qcore_default_qconfig_mapping(other, False) is None


@pytest.mark.parametrize("is_qat", [False, True], ids=["ptq", "qat"])
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_default_qconfig_mapping_is_qcores_for_the_backend(name, is_qat):
    # Its structure against torch.ao's is checked in test_qconfig.py.
    from qcore.config.qconfig import QConfigMapping, default_qconfig_mapping

    ours = plugin_module(name).qcore_default_qconfig_mapping(name, is_qat)
    reduce_range = None
    if name == "onednn":  # 7-bit activations where int8 sums saturate (qcore_x86.onednn)
        from qcore_x86.onednn import cpu_has_vnni

        reduce_range = None if cpu_has_vnni() else True
    expected = default_qconfig_mapping(name, is_qat=is_qat, reduce_range=reduce_range)
    assert isinstance(ours, QConfigMapping)
    assert repr(ours.global_qconfig) == repr(expected.global_qconfig)
    assert list(ours.object_type_qconfigs) == list(expected.object_type_qconfigs)
