"""What the hostile package's plugins share; importing it never misbehaves."""

import torch

from qcore import DTypeConfig

INT8 = DTypeConfig(
    input_dtype=torch.quint8,
    output_dtype=torch.quint8,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
)
