"""Safety properties of qcore's FX engine (issue 3, item 9).

On small random traceable models (hypothesis, derandomized): prepare and
convert never crash, outputs are finite, explain accounts for every node of
the prepared and of the converted graph, and prepare never mutates the user's
model. A model symbolic tracing cannot follow gets an error naming the module
and the prepare_custom_config options that leave it as a leaf.
"""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import qcore
from qcore.engine.explain import Status
from qcore.engine.trace import TraceFailure

pytest.importorskip("qcore_fbgemm", reason="needs the fbgemm plugin")

SIDE = 8  # input images are (N, 3, SIDE, SIDE)
WIDTHS = (1, 2, 3, 4, 8)

# What each op needs from the running tensor: "4d" (N, C, H, W) or "2d" (N, F).
IMAGE_OPS = ("conv", "bn", "add_conv", "cat", "maxpool", "flatten")
VECTOR_OPS = ("linear", "add_linear")
ANY_OPS = ("relu", "relu6", "hardswish", "relu_fn")


class RandomNet(nn.Module):
    """A chain of ops from ``plan``: (op name, width) pairs, built to fit the shapes."""

    def __init__(self, plan: list[tuple[str, int]]) -> None:
        super().__init__()
        self.plan = []
        self.layers = nn.ModuleList()
        channels, side, features = 3, SIDE, None
        for op, width in plan:
            image = features is None
            if op in IMAGE_OPS and not image or op in VECTOR_OPS and image:
                continue
            if op == "maxpool" and side < 2:
                continue
            if op == "cat" and channels * 2 > 16:
                continue
            module = None
            if op == "conv":
                module, channels = nn.Conv2d(channels, width, 3, padding=1), width
            elif op == "bn":
                module = nn.BatchNorm2d(channels)
            elif op == "add_conv":
                module = nn.Conv2d(channels, channels, 1)
            elif op == "cat":
                channels *= 2
            elif op == "maxpool":
                module, side = nn.MaxPool2d(2), side // 2
            elif op == "flatten":
                features = channels * side * side
            elif op == "linear":
                module, features = nn.Linear(features, width), width
            elif op == "add_linear":
                module = nn.Linear(features, features)
            elif op == "relu":
                module = nn.ReLU()
            elif op == "relu6":
                module = nn.ReLU6()
            elif op == "hardswish":
                module = nn.Hardswish()
            index = None
            if module is not None:
                index = len(self.layers)
                self.layers.append(module)
            self.plan.append((op, index))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for op, index in self.plan:
            layer = self.layers[index] if index is not None else None
            if op in ("add_conv", "add_linear"):
                x = x + layer(x)
            elif op == "cat":
                x = torch.cat([x, torch.relu(x)], dim=1)
            elif op == "flatten":
                x = torch.flatten(x, 1)
            elif op == "relu_fn":
                x = torch.nn.functional.relu(x)
            else:
                x = layer(x)
        return x


def _steps(ops: tuple[str, ...]):
    """One op, or a conv-bn(-relu) chain (what fusion rules look for), with a width."""
    chains = st.sampled_from(
        [(op,) for op in ops]
        + ([("conv", "bn"), ("conv", "bn", "relu"), ("conv", "relu")] if "conv" in ops else [])
    )
    return st.tuples(chains, st.sampled_from(WIDTHS)).map(
        lambda chain_width: [(op, chain_width[1]) for op in chain_width[0]]
    )


plans = st.tuples(
    st.lists(_steps(tuple(op for op in IMAGE_OPS if op != "flatten") + ANY_OPS), max_size=5),
    st.booleans(),
    st.lists(_steps(VECTOR_OPS + ANY_OPS), max_size=3),
).map(
    lambda parts: (
        [step for chain in parts[0] for step in chain]
        + ([("flatten", 1)] + [step for chain in parts[2] for step in chain] if parts[1] else [])
    )
)


def build(plan: list[tuple[str, int]]) -> nn.Module:
    torch.manual_seed(0)
    model = RandomNet(plan)
    # Non-trivial batch-norm statistics, as in a trained model.
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
    return model.eval()


def batches(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, SIDE, SIDE, generator=generator) for _ in range(n)]


def snapshot(model: nn.Module) -> tuple:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    types = [(name, type(m)) for name, m in model.named_modules()]
    return state, types, model.training


def assert_unchanged(model: nn.Module, before: tuple) -> None:
    state, types, training = before
    after = model.state_dict()
    assert list(after) == list(state), "prepare changed the user's state_dict keys"
    for key, value in state.items():
        assert torch.equal(after[key], value), f"prepare changed the user's {key}"
    assert [(name, type(m)) for name, m in model.named_modules()] == types
    assert model.training == training


def is_inserted(node: torch.fx.Node) -> bool:
    """Observers (prepared) and quantize/dequantize nodes (converted) qcore added."""
    if node.op == "call_module":
        return node.target.startswith("activation_post_process_")
    name = getattr(node.target, "__name__", str(node.target))
    return "quantize" in name


def assert_explained(model: torch.fx.GraphModule) -> None:
    report = qcore.explain(model)
    nodes = list(model.graph.nodes)
    names = {node.name for node in nodes}
    in_graph = [entry for entry in report if entry.node in names]
    assert [entry.node for entry in in_graph] == [node.name for node in nodes], (
        "explain has not one entry per graph node, in graph order"
    )
    # A node a kernel absorbed (the relu of add-relu) keeps its entry, naming the kernel.
    for entry in report:
        if entry.node not in names:
            assert entry.status is Status.QUANTIZED and entry.kernel, entry
    for node, entry in zip(nodes, in_graph, strict=True):
        assert isinstance(entry.status, Status), entry
        if not node.op.startswith("call"):
            assert entry.status is Status.NOT_AN_OP, entry
        elif entry.status is Status.NOT_AN_OP:
            assert is_inserted(node), f"op node {node.name} ({node.target}) has no status"
        if entry.status in (Status.FLOAT, Status.REFERENCE):
            assert entry.reason.strip(), f"{entry.status.value} node {entry.node} has no reason"
        if entry.status is not Status.NOT_AN_OP:
            assert entry.op, entry


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(plan=plans)
def test_random_models_prepare_convert_explain(plan):
    model = build(plan)
    before = snapshot(model)
    inputs = batches(3)
    with torch.no_grad():
        expected = model(inputs[0])
    mapping = qcore.get_default_qconfig_mapping("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the summary of what stays float
        prepared = qcore.prepare_fx(model, mapping, (inputs[0],), backend="fbgemm")
    assert_unchanged(model, before)
    assert_explained(prepared)

    with torch.no_grad():
        for batch in inputs:
            observed = prepared(batch)
            assert torch.isfinite(observed).all()
    assert_unchanged(model, before)

    converted = qcore.convert_fx(prepared)
    assert_explained(converted)
    with torch.no_grad():
        actual = converted(inputs[0])
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    assert_unchanged(model, before)


# -- models symbolic tracing cannot follow ------------------------------------


class Gate(nn.Module):
    """Data-dependent control flow: symbolic tracing cannot follow it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return -x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.conv(x))


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = Block()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(torch.relu(self.stem(x)))
        return self.fc(x.mean(dim=(2, 3)))


def make_untraceable() -> nn.Module:
    torch.manual_seed(0)
    return Untraceable().eval()


def test_untraceable_module_error_names_it_and_the_options():
    model = make_untraceable()
    before = snapshot(model)
    mapping = qcore.get_default_qconfig_mapping("fbgemm")
    with pytest.raises(TraceFailure) as caught:
        qcore.prepare_fx(model, mapping, (batches(1)[0],), backend="fbgemm")
    message = str(caught.value)
    assert "'block.gate'" in message and "Gate" in message, message
    assert "prepare_custom_config" in message
    assert "non_traceable_module_name" in message and "non_traceable_module_class" in message
    assert caught.value.__cause__ is not None  # the tracer's own error is kept
    assert_unchanged(model, before)


def _torch_ao_custom_config():
    from torch.ao.quantization.fx.custom_config import PrepareCustomConfig

    return PrepareCustomConfig().set_non_traceable_module_names(["block.gate"])


@pytest.mark.parametrize(
    "custom_config",
    [
        pytest.param({"non_traceable_module_name": ["block.gate"]}, id="by-name"),
        pytest.param({"non_traceable_module_class": [Gate]}, id="by-class"),
        pytest.param("torch.ao", id="torch.ao-PrepareCustomConfig"),
    ],
)
def test_marking_it_non_traceable_works(custom_config):
    if custom_config == "torch.ao":
        custom_config = _torch_ao_custom_config()
    model = make_untraceable()
    before = snapshot(model)
    inputs = batches(3)
    mapping = qcore.get_default_qconfig_mapping("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(
            model, mapping, (inputs[0],), backend="fbgemm", prepare_custom_config=custom_config
        )
    assert_unchanged(model, before)
    gate_nodes = [
        n for n in prepared.graph.nodes if n.op == "call_module" and n.target == "block.gate"
    ]
    assert len(gate_nodes) == 1, "the non-traceable module is one leaf node"
    with torch.no_grad():
        for batch in inputs:
            prepared(batch)
    converted = qcore.convert_fx(prepared)
    report = qcore.explain(converted)
    gate = report[gate_nodes[0].name]
    assert gate.status is Status.FLOAT and gate.reason
    assert report["fc"].status is Status.QUANTIZED
    assert_explained(converted)
    with torch.no_grad():
        expected = model(inputs[0])
        actual = converted(inputs[0])
    assert torch.isfinite(actual).all()
    # Quantized, not broken: close to the float model.
    assert (actual - expected).abs().max() < 0.1 * expected.abs().max() + 0.05
