"""qcore.config.standard_ops: each family configures each pattern once."""

import pytest
import torch

from qcore import BackendConfig, ConfigError, DTypeConfig, DTypeWithConstraints
from qcore.config.standard_ops import (
    FIXED_QPARAMS_0_TO_1,
    STANDARD_FAMILIES,
    fixed_qparams_dtype_configs,
    standard_pattern_configs,
)

INT8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8)


@pytest.mark.parametrize("family", sorted(STANDARD_FAMILIES))
def test_each_family_sets_each_pattern_once(family):
    configs = STANDARD_FAMILIES[family]([INT8])
    assert configs
    BackendConfig(family).set_backend_pattern_configs(configs)  # DuplicatePatternError if not


def test_all_families_together_share_no_pattern():
    configs = standard_pattern_configs(**{family: [INT8] for family in STANDARD_FAMILIES})
    # torch.ao native's 194, and channel_shuffle (module and function)
    assert len(BackendConfig().set_backend_pattern_configs(configs)) == 196


def test_unknown_family_keyword_lists_the_known_ones():
    with pytest.raises(TypeError, match="got the keyword 'convs'; expected one of conv, linear"):
        standard_pattern_configs(convs=[INT8])


def test_family_rejects_a_single_dtype_config():
    with pytest.raises(ConfigError, match="conv_pattern_configs"):
        STANDARD_FAMILIES["conv"](INT8)


def test_fixed_qparams_leave_other_dtypes_alone_and_reject_scale_bounds():
    qint8 = DTypeConfig(
        input_dtype=DTypeWithConstraints(dtype=torch.qint8, scale_min_lower_bound=2**-12),
        output_dtype=torch.qint8,
    )
    quint8, unchanged = fixed_qparams_dtype_configs([INT8, qint8], FIXED_QPARAMS_0_TO_1)
    assert quint8.output_dtype_with_constraints == FIXED_QPARAMS_0_TO_1
    assert unchanged == qint8
    bounded = DTypeConfig(
        input_dtype=DTypeWithConstraints(dtype=torch.quint8, scale_min_lower_bound=2**-12)
    )
    with pytest.raises(ConfigError, match="input scale_min_lower_bound=0.000244140625"):
        fixed_qparams_dtype_configs([bounded], FIXED_QPARAMS_0_TO_1)
