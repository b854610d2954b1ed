"""The x86 backend's own PT2E Quantizer: quantize where int8 pays off on oneDNN.

qcore compiles any BackendConfig into a Quantizer; torch.ao's native x86 config,
which this plugin also ships, quantizes the output of every pattern it knows.
On x86 that costs accuracy for no speed: oneDNN runs conv and linear with fused
post-ops (relu, hardswish, a residual add) on int8 inputs and float or int8
outputs. This Quantizer follows that recipe, the one torchao's
X86InductorQuantizer implements, so that ``prepare_pt2e(model, "x86")`` matches
it (tests/test_pt2e_peers.py):

1. conv2d/linear, and conv1d followed by a unary post-op (as torchao, which leaves
   a lone conv1d in float: it loses accuracy for no oneDNN fusion; measured 9 dB on
   wav2vec2's feature extractor): the activation input (uint8, histogram) and the weight
   (int8, symmetric per output channel) are quantized; the bias stays float.
   A following post-op joins the pattern: for a conv relu, hardtanh (relu6),
   hardswish or silu, or a residual add (whose other input is quantized too)
   with an optional relu; for a linear relu, leaky_relu, tanh, gelu, or an add
   (other input float) with an optional relu. A batch norm between them
   (QAT, before folding) is part of the pattern.
2. mul of two same-shaped tensors: both inputs quantized. matmul stays float,
   as in torchao's default recipe.
3. max/avg pooling, adaptive average pooling, cat and flatten run on int8 when
   every input comes out of a quantized pattern (flatten only when a quantizable
   op consumes it); their output then shares their input's qparams.

Outputs are quantized only where a consumer's input is. Every op it leaves in
float gets a reason in ``qcore.explain``.
"""

from __future__ import annotations

import warnings

import torch
from torch.fx import GraphModule, Node

from qcore import HistogramObserver, PerChannelMinMaxObserver, QCoreWarning
from qcore.engine.kept_float import kept_float
from qcore.pt2e import REASON_KEY, canonicalize
from qcore.pt2e.graph import carries_values
from qcore.quantizer import (
    ANNOTATION_KEY,
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)
from qcore_x86.onednn import cpu_has_vnni

__all__ = ["X86Quantizer"]

aten = torch.ops.aten

WEIGHTED = {aten.conv1d, aten.conv2d, aten.linear}
CONV_POST_OPS = {aten.relu, aten.relu_, aten.hardtanh, aten.hardtanh_, aten.hardswish}
CONV_POST_OPS |= {aten.hardswish_, aten.silu, aten.silu_}
LINEAR_POST_OPS = {aten.relu, aten.relu_, aten.leaky_relu, aten.leaky_relu_, aten.tanh}
LINEAR_POST_OPS |= {aten.tanh_, aten.gelu}
RESIDUAL_ADDS = {aten.add, aten.add_}
RELUS = {aten.relu, aten.relu_}
BATCH_NORMS = {aten.batch_norm, aten._native_batch_norm_legit_no_training}
CONV1D_WITHOUT_POST_OP = (
    "x86 quantizes conv1d only with a fused unary post-op (relu, hardtanh, hardswish, "
    "silu), as torchao's X86InductorQuantizer does"
)
INT8_IN_INT8_OUT = {
    aten.max_pool2d,
    aten.avg_pool2d,
    aten.adaptive_avg_pool2d,
    aten.cat,
    aten.flatten,
}
# What a flatten must feed to run on int8 (matmul included: it could take int8).
QUANTIZABLE = WEIGHTED | INT8_IN_INT8_OUT | {aten.mul, aten.matmul}

# Why an op stays float, by what it is.
NOT_IN_RECIPE = (
    "x86 quantizes conv, linear, mul and the pooling/cat/flatten that follow them; "
    "this op runs in float between them"
)
ADD_NOT_AFTER_WEIGHTED = (
    "x86 quantizes an add only fused after the conv or linear that produces one input"
)
INPUT_NOT_QUANTIZED = (
    "runs on int8 only when every input comes out of a quantized op; one input is float"
)
FLATTEN_FEEDS_NO_QUANTIZED_OP = "no quantized op consumes its output, so it stays float"


def _op(node: Node):
    target = node.target if node.op == "call_function" else None
    return getattr(target, "overloadpacket", None)


def _has_unary_post_op(conv: Node) -> bool:
    """A conv followed (through a training batch norm) by one of its fusable unary ops."""
    user = _only_user(conv)
    if user is not None and _op(user) in BATCH_NORMS:
        user = _only_user(user)
    return user is not None and _op(user) in CONV_POST_OPS


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_float_tensor(value) -> bool:
    """A floating-point tensor: what quantizing applies to (an integer mul, such as
    RoBERTa's position ids from a cumsum of the mask, stays as it is)."""
    found = value.meta.get("val") if isinstance(value, Node) else None
    return isinstance(found, torch.Tensor) and found.is_floating_point()


class X86Quantizer(Quantizer):
    """oneDNN's int8 recipe for torch.export graphs (see the module docstring).

    ``reduce_range`` quantizes activations to 7 bits (0..127): the default on
    CPUs without VNNI, where oneDNN's int8 products saturate with 8-bit ones
    (torchao's ``reduce_range`` and torch.ao's x86 qconfig do the same).

    Example::

        >>> prepared = qcore.prepare_pt2e(exported, "x86")         # uses this Quantizer
        >>> prepared = qcore.prepare_pt2e(exported, X86Quantizer())  # the same
    """

    backend_name = "x86"

    def __init__(self, *, is_qat: bool = False, reduce_range: bool | None = None) -> None:
        if reduce_range is None:
            reduce_range = not cpu_has_vnni()
        if not isinstance(reduce_range, bool):
            raise TypeError(f"reduce_range: got {reduce_range!r}; expected True, False or None")
        if not reduce_range and not cpu_has_vnni():
            warnings.warn(
                "X86Quantizer(reduce_range=False) on a CPU without VNNI: oneDNN's and "
                "fbgemm's int8 conv and linear would saturate with 8-bit activations, so "
                "convert_pt2e runs those on qnnpack's kernels or in reference form (right, "
                "but slower); leave reduce_range unset to quantize activations to 7 bits",
                QCoreWarning,
                stacklevel=2,
            )
        self.is_qat = is_qat
        self.reduce_range = reduce_range
        extra = {"eps": 2**-12}
        if is_qat:
            from qcore import FusedMovingAvgObsFakeQuantize, MovingAveragePerChannelMinMaxObserver

            activation_ctr = FusedMovingAvgObsFakeQuantize.with_args(**extra)
            weight_ctr = FusedMovingAvgObsFakeQuantize.with_args(
                observer=MovingAveragePerChannelMinMaxObserver, **extra
            )
        else:
            activation_ctr = HistogramObserver.with_args(**extra)
            weight_ctr = PerChannelMinMaxObserver.with_args(**extra)
        self.activation = QuantizationSpec(
            dtype=torch.uint8,
            quant_min=0,
            quant_max=127 if reduce_range else 255,
            qscheme=torch.per_tensor_affine,
            observer_or_fake_quant_ctr=activation_ctr,
        )
        self.weight = QuantizationSpec(
            dtype=torch.int8,
            quant_min=-128,
            quant_max=127,
            qscheme=torch.per_channel_symmetric,
            ch_axis=0,
            observer_or_fake_quant_ctr=weight_ctr,
        )

    # -- annotate ------------------------------------------------------------------

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        """String-padded convs and ``addmm`` linears in the forms oneDNN's patterns and
        kernels read (:func:`qcore.pt2e.canonicalize`)."""
        canonicalize(model)
        return model

    def annotate(self, model: GraphModule) -> GraphModule:
        self._outputs: set[Node] = set()  # ends of quantized patterns: int8-capable outputs
        self._done: set[Node] = set()
        nodes = list(model.graph.nodes)
        for node, reason in kept_float(model, carries_values).items():  # rotary angles...
            node.meta[REASON_KEY] = reason
            self._done.add(node)
        for node in nodes:
            if _op(node) in WEIGHTED and node not in self._done:
                self._weighted_pattern(node)
        for node in nodes:
            if _op(node) is aten.mul and node not in self._done:
                self._mul(node)
        for node in nodes:
            if _op(node) in INT8_IN_INT8_OUT and node not in self._done:
                self._propagate(node)
        for node in nodes:
            if node.op == "call_function" and node not in self._done:
                reason = ADD_NOT_AFTER_WEIGHTED if _op(node) in RESIDUAL_ADDS else NOT_IN_RECIPE
                node.meta.setdefault(REASON_KEY, reason)
        return model

    def _annotate(self, node: Node, inputs: dict, output=None, *, ends_pattern=False) -> None:
        node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
            input_qspec_map=inputs, output_qspec=output, _annotated=True
        )
        self._done.add(node)
        if ends_pattern:
            self._outputs.add(node)

    def _weighted_pattern(self, root: Node) -> None:
        if _op(root) is aten.conv1d and not _has_unary_post_op(root):
            root.meta[REASON_KEY] = CONV1D_WITHOUT_POST_OP
            return
        activation, weight = root.args[0], root.args[1]
        self._annotate(root, {activation: self.activation, weight: self.weight})
        is_conv = _op(root) is not aten.linear
        end = root
        batch_norm = _only_user(root)
        if batch_norm is not None and _op(batch_norm) in BATCH_NORMS:  # QAT: it trains
            self._annotate(batch_norm, {})
            end = batch_norm
        post_ops = CONV_POST_OPS if is_conv else LINEAR_POST_OPS
        user = _only_user(end)
        if user is not None and _op(user) in post_ops and user not in self._done:
            self._annotate(user, {})
            end = user
        elif user is not None and _op(user) in RESIDUAL_ADDS and user not in self._done:
            other = next((a for a in user.args[:2] if a is not end), None)
            if _is_float_tensor(other) and list(user.args[:2]).count(end) == 1:
                # oneDNN adds a conv's residual in int8; a linear's in float.
                self._annotate(user, {other: self.activation} if is_conv else {})
                end = user
                relu = _only_user(end)
                if relu is not None and _op(relu) in RELUS and relu not in self._done:
                    self._annotate(relu, {})
                    end = relu
        self._outputs.add(end)

    def _mul(self, node: Node) -> None:
        first, second = node.args[0], node.args[1]
        if not (_is_float_tensor(first) and _is_float_tensor(second)):
            node.meta[REASON_KEY] = (
                "x86 quantizes mul of two float tensors (not by a scalar, not of integers)"
            )
            return
        if first.meta["val"].shape != second.meta["val"].shape:
            node.meta[REASON_KEY] = "x86 quantizes mul of two tensors of the same shape only"
            return
        inputs = {first: self.activation}
        if second is not first:
            inputs[second] = self.activation
        self._annotate(node, inputs, ends_pattern=True)

    def _propagate(self, node: Node) -> None:
        op = _op(node)
        if op is aten.flatten and not any(_op(user) in QUANTIZABLE for user in node.users):
            node.meta[REASON_KEY] = FLATTEN_FEEDS_NO_QUANTIZED_OP
            return
        inputs = list(node.args[0]) if op is aten.cat else [node.args[0]]
        if not all(isinstance(i, Node) and i in self._outputs for i in inputs):
            node.meta[REASON_KEY] = INPUT_NOT_QUANTIZED
            return
        first = inputs[0]
        shared = SharedQuantizationSpec((first, node))
        specs = {first: self.activation}
        specs.update({other: shared for other in inputs[1:] if other not in specs})
        self._annotate(node, specs, shared, ends_pattern=True)
