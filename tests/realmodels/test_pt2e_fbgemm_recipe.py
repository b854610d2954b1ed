"""PT2E fbgemm against torch.ao FX fbgemm on the same transformer (FINDINGS.md 8).

qcore's PT2E fbgemm scored 30.4 / 30.4 dB on BERT / DistilBERT where the corpus's FX
rows say 33.3 / 33.7, and 8.8 dB on LLaMA with x50 outlier channels where x86 and
qnnpack score 15.6 and 13.7. Neither is a fault of the PT2E recipe: given a model FX
traces whole, torch.ao's own FX fbgemm gives the same numbers. These tests pin that
down, with the two causes:

* the corpus's FX rows leave ``model.embeddings`` float (it does not trace), and the
  three 7-bit quantizations there (word embedding, the two embedding adds) reach the
  output through the residual stream: PT2E with those embeddings float scores what FX does;
* fbgemm's activations are 7-bit (``reduce_range``, torch.ao's fbgemm default): with
  8-bit activations fbgemm scores what qnnpack does, on the same quantized ops.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402
from zoo.baseline import _quiet, backend_config, quantized_engine  # noqa: E402

import qcore  # noqa: E402

from .harness import _score, fx_mapping  # noqa: E402
from .models import (  # noqa: E402
    BATCH,
    CALIBRATION_BATCHES,
    CALIBRATION_SEED,
    EVAL_BATCHES,
    EVAL_SEED,
    MODEL_SEED,
    TOKENS,
    VOCAB,
    Case,
    MainOutput,
    _tokens,
    build,
)

pytestmark = pytest.mark.skipif(
    not {"fbgemm", "qnnpack"} <= set(qcore.list_backends()),
    reason="needs the fbgemm and qnnpack plugins",
)


# ----------------------------------------------------------------------- traceable bodies
# The same float functions as the corpus models, written so torch.fx traces them whole
# (BertSelfAttention and the embeddings do not): attention as one sdpa.


class _Attention(nn.Module):
    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, heads: int, scale: float):
        super().__init__()
        self.q, self.k, self.v, self.heads, self.scale = q, k, v, heads, scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        d = h.shape[-1] // self.heads
        q = self.q(h).view(BATCH, TOKENS, -1, d).transpose(1, 2)
        k = self.k(h).view(BATCH, TOKENS, -1, d).transpose(1, 2)
        v = self.v(h).view(BATCH, TOKENS, -1, d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return a.transpose(1, 2).reshape(BATCH, TOKENS, -1)


class BertBody(nn.Module):
    """BertModel's encoder: embeddings (word + token type + position), two layers."""

    def __init__(self, main: MainOutput) -> None:
        super().__init__()
        self.bert = main.model
        self.register_buffer("positions", torch.arange(TOKENS).unsqueeze(0), persistent=False)
        self.register_buffer("types", torch.zeros(1, TOKENS, dtype=torch.long), persistent=False)
        self.attention = nn.ModuleList(
            _Attention(s.query, s.key, s.value, s.num_attention_heads, s.scaling)
            for s in (layer.attention.self for layer in self.bert.encoder.layer)
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.bert.embeddings
        h = e.word_embeddings(input_ids) + e.token_type_embeddings(self.types)
        h = e.dropout(e.LayerNorm(h + e.position_embeddings(self.positions)))
        for layer, attention in zip(self.bert.encoder.layer, self.attention, strict=True):
            h = layer.attention.output(attention(h), h)
            h = layer.output(layer.intermediate(h), h)
        return h


class DistilBertBody(nn.Module):
    """DistilBertModel: embeddings (word + position), two layers."""

    def __init__(self, main: MainOutput) -> None:
        super().__init__()
        self.distilbert = main.model
        self.register_buffer("positions", torch.arange(TOKENS).unsqueeze(0), persistent=False)
        self.attention = nn.ModuleList(
            _Attention(a.q_lin, a.k_lin, a.v_lin, a.n_heads, (a.dim // a.n_heads) ** -0.5)
            for a in (layer.attention for layer in self.distilbert.transformer.layer)
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.distilbert.embeddings
        h = e.word_embeddings(input_ids) + e.position_embeddings(self.positions)
        h = e.dropout(e.LayerNorm(h))
        for layer, attention in zip(self.distilbert.transformer.layer, self.attention, strict=True):
            h = layer.sa_layer_norm(layer.attention.out_lin(attention(h)) + h)
            h = layer.output_layer_norm(layer.ffn(h) + h)
        return h


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBody(nn.Module):
    """LlamaModel: RMSNorm pre-norm blocks, RoPE (tables as buffers), causal sdpa."""

    def __init__(self, main: MainOutput) -> None:
        super().__init__()
        self.llama = main.model
        with torch.no_grad():
            cos, sin = self.llama.rotary_emb(
                torch.zeros(1, TOKENS, 1), torch.arange(TOKENS).unsqueeze(0)
            )
        self.register_buffer("cos", cos.unsqueeze(1), persistent=False)
        self.register_buffer("sin", sin.unsqueeze(1), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.llama.embed_tokens(input_ids)
        for layer in self.llama.layers:
            attention, x = layer.self_attn, layer.input_layernorm(h)
            d, config = attention.head_dim, attention.config
            q = attention.q_proj(x).view(BATCH, TOKENS, -1, d).transpose(1, 2)
            k = attention.k_proj(x).view(BATCH, TOKENS, -1, d).transpose(1, 2)
            v = attention.v_proj(x).view(BATCH, TOKENS, -1, d).transpose(1, 2)
            q = q * self.cos + _rotate_half(q) * self.sin
            k = k * self.cos + _rotate_half(k) * self.sin
            groups = config.num_attention_heads // config.num_key_value_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attention.scaling)
            h = h + attention.o_proj(a.transpose(1, 2).reshape(BATCH, TOKENS, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.llama.norm(h)


OUTLIER_CHANNELS = [0, 1, 2, 3]
OUTLIER_SCALE = 50.0


def llama_with_outliers() -> Case:
    """Tiny LLaMA (hidden 32, two layers, one KV head) whose RMSNorm gains make four
    hidden channels of every norm's output x50: the outlier channels of real LLMs."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(MODEL_SEED)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
    )
    model = MainOutput(transformers.LlamaModel(config)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[OUTLIER_CHANNELS] *= OUTLIER_SCALE
    calibration = _tokens(CALIBRATION_SEED, CALIBRATION_BATCHES)
    return Case(
        "llama_outliers",
        "text",
        model,
        calibration[0],
        calibration,
        _tokens(EVAL_SEED, EVAL_BATCHES),
    )


# ----------------------------------------------------------------------- the flows


def _body(case: Case, body_class: type[nn.Module]) -> nn.Module:
    body = body_class(case.model).eval()
    with torch.no_grad():
        for batch in case.evaluation[:2]:
            expected = case.model(*batch)
            torch.testing.assert_close(body(*batch), expected, rtol=1e-4, atol=1e-5)
    return body


def torch_ao_fx(case: Case, model: nn.Module, backend: str = "fbgemm") -> float:
    """torch.ao's FX flow with its own default mapping, under its engine."""
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    with _quiet(), quantized_engine(backend), torch.no_grad():
        config = backend_config(backend)
        prepared = prepare_fx(
            copy.deepcopy(model), fx_mapping(backend), case.example_inputs, backend_config=config
        )
        for batch in case.calibration:
            prepared(*batch)
        return _score(case.model, convert_fx(prepared, backend_config=config), case.evaluation)


def qcore_pt2e(case: Case, quantizer) -> float:
    """qcore's PT2E flow on the exported model, lowered."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(case.model, case.example_inputs).module()
        prepared = qcore.prepare_pt2e(exported, quantizer)
        with torch.no_grad():
            for batch in case.calibration:
                prepared(*batch)
        return _score(case.model, qcore.convert_pt2e(prepared), case.evaluation)


def fbgemm_with(mapping) -> qcore.Quantizer:
    from qcore.pt2e import BackendQuantizer

    return BackendQuantizer.for_backend("fbgemm", mapping)


# ----------------------------------------------------------------------- the tests

BODIES = {"bert": BertBody, "distilbert": DistilBertBody}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_pt2e_fbgemm_scores_torch_aos_fx_fbgemm_on_the_same_ops(name: str) -> None:
    """BERT 30.37 dB, DistilBERT 30.42 on both: the same ops quantized, the same qparams."""
    case = build(name)
    theirs = torch_ao_fx(case, _body(case, BODIES[name]))
    ours = qcore_pt2e(case, "fbgemm")
    assert ours == pytest.approx(theirs, abs=0.1), (ours, theirs)


@pytest.mark.parametrize("name", sorted(BODIES))
def test_pt2e_fbgemm_with_float_embeddings_scores_the_fx_rows(name: str) -> None:
    """The corpus's FX rows (33.27, 33.74 dB) leave ``model.embeddings`` float, which
    does not trace; PT2E given a QConfig of None there scores the same, 2.9-3.3 dB
    above PT2E with them quantized."""
    case = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fx = qcore.prepare_fx(
            case.model,
            fx_mapping("fbgemm"),
            case.example_inputs,
            "fbgemm",
            _non_traceable(name),
        )
        with torch.no_grad():
            for batch in case.calibration:
                fx(*batch)
        fx_sqnr = _score(case.model, qcore.convert_fx(fx), case.evaluation)
    float_embeddings = fx_mapping("fbgemm").set_module_name("model.embeddings", None)
    ours = qcore_pt2e(case, fbgemm_with(float_embeddings))
    assert ours == pytest.approx(fx_sqnr, abs=0.1), (ours, fx_sqnr)
    assert ours >= qcore_pt2e(case, "fbgemm") + 2.0


def _non_traceable(name: str):
    from .harness import custom_config, fx_workaround

    use_body, names = fx_workaround(name)
    assert not use_body, name
    assert "model.embeddings" in names, names
    return custom_config(names)


def test_fbgemm_activations_are_7_bit_as_in_torch_ao() -> None:
    """fbgemm's default observes activations over 0..127, torch.ao's fbgemm default too."""
    from torch.ao.quantization import get_default_qconfig

    from qcore.api import default_mapping_for

    with _quiet():
        theirs = get_default_qconfig("fbgemm").activation()
    ours = default_mapping_for("fbgemm", False).global_qconfig.activation()
    assert (ours.quant_min, ours.quant_max, ours.reduce_range) == (0, 127, True)
    assert (theirs.quant_min, theirs.quant_max, theirs.reduce_range) == (0, 127, True)


def test_llama_outliers_fbgemm_below_qnnpack_by_its_7_bit_activations() -> None:
    """LLaMA with x50 channels: fbgemm 8.8 dB, qnnpack 13.7; fbgemm with 8-bit
    activations 13.5, on the same ops. torch.ao's FX fbgemm on the same function: 2.3
    (it also quantizes RMSNorm's statistics, qcore/engine/kept_float.py)."""
    from qcore.config.qconfig import default_qconfig_mapping

    case = llama_with_outliers()
    fbgemm = qcore_pt2e(case, "fbgemm")
    qnnpack = qcore_pt2e(case, "qnnpack")
    fbgemm_8_bit = qcore_pt2e(
        case, fbgemm_with(default_qconfig_mapping("fbgemm", reduce_range=False))
    )
    theirs = torch_ao_fx(case, _body(case, LlamaBody))
    assert fbgemm_8_bit == pytest.approx(qnnpack, abs=0.5), (fbgemm_8_bit, qnnpack)
    assert qnnpack - fbgemm >= 3.0, (fbgemm, qnnpack)
    assert fbgemm >= theirs, (fbgemm, theirs)
