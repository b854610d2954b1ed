"""Switching an exported graph's batch norms and dropouts between training and eval.

A graph from torch.export records each batch norm's and dropout's mode as an
argument, so ``model.train()``/``model.eval()`` cannot switch them (qcore's PT2E
models refuse both). These functions rewrite the arguments in place, as torchao's
``move_exported_model_to_eval``/``_train`` do, keeping each dropout's own
probability: torchao's put back ``p=0.5`` on every dropout it switches to training
(a BERT's 0.1 became 0.5, and QAT trained a model with five times the dropout).
Attention's dropout (``scaled_dot_product_attention(..., dropout_p)``, which
transformers' models pass as ``p if self.training else 0``) and the feature and
alpha dropouts switch too.

Example::

    >>> prepared = qcore.prepare_qat_pt2e(exported_in_train_mode, "x86")
    >>> train(prepared)
    >>> qcore.pt2e.move_exported_model_to_eval(prepared)   # evaluate
    >>> qcore.pt2e.move_exported_model_to_train(prepared)  # and train on
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from qcore.config.errors import describe
from qcore.pt2e.patterns import packet

__all__ = ["draws_dropout", "move_exported_model_to_eval", "move_exported_model_to_train"]

aten = torch.ops.aten

#: Dropouts taking ``(input, p, train)``: the train flag is argument 2.
_DROPOUTS = {
    aten.dropout,
    aten.dropout_,
    aten.feature_dropout,
    aten.feature_dropout_,
    aten.alpha_dropout,
    aten.alpha_dropout_,
    aten.feature_alpha_dropout,
    aten.feature_alpha_dropout_,
}
_SDPA_DROPOUT = 4  # scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, ...)
_TRAINING_P_KEY = "qcore_training_dropout_p"  # node.meta: attention's p while training


def move_exported_model_to_eval(model: GraphModule) -> GraphModule:
    """Switch ``model``'s batch norms and dropouts to eval, in place; returns it."""
    _switch(_graph_module(model), training=False)
    return model


def move_exported_model_to_train(model: GraphModule) -> GraphModule:
    """Switch ``model``'s batch norms and dropouts to training, in place; returns it.
    A dropout keeps its probability; attention's gets back the one it was exported
    with in training."""
    _switch(_graph_module(model), training=True)
    return model


def draws_dropout(node: Node) -> bool:
    """Whether ``node`` is a dropout (of any kind, attention's too) that draws
    random numbers: in training mode with a probability above 0."""
    op = packet(node)
    if op in _DROPOUTS:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return bool(train and p)
    if op is aten.scaled_dot_product_attention:
        return bool(_attention_p(node))
    return False


def _attention_p(node: Node) -> float:
    if len(node.args) > _SDPA_DROPOUT:
        return node.args[_SDPA_DROPOUT]
    return node.kwargs.get("dropout_p", 0.0)


def _graph_module(model: object) -> GraphModule:
    if not isinstance(model, GraphModule):
        raise TypeError(
            f"model: got {describe(model)}; expected a GraphModule from torch.export "
            "(exported.module()), prepared or not"
        )
    return model


def _switch(gm: GraphModule, *, training: bool) -> None:
    changed = False
    for node in gm.graph.nodes:
        op = packet(node)
        if op is aten.batch_norm:
            changed |= _set_batch_norm(node, training)
        elif op in _DROPOUTS and len(node.args) > 2 and node.args[2] is not training:
            node.args = (*node.args[:2], training, *node.args[3:])
            changed = True
        elif op is aten.scaled_dot_product_attention:
            changed |= _set_attention_dropout(node, training)
    if changed:
        gm.recompile()


def _set_batch_norm(node: Node, training: bool) -> bool:
    """A batch norm without running statistics (``F.batch_norm(w, None, None,
    training=True)``: BiT's weight standardization) normalizes by its input's own
    statistics in every mode: it stays as it is."""
    if len(node.args) <= 5 or node.args[3] is None or node.args[5] is training:
        return False
    node.args = (*node.args[:5], training, *node.args[6:])
    return True


def _set_attention_dropout(node: Node, training: bool) -> bool:
    in_args = len(node.args) > _SDPA_DROPOUT
    p = _attention_p(node)
    if training:
        wanted = node.meta.pop(_TRAINING_P_KEY, p)
    else:
        if p:
            node.meta[_TRAINING_P_KEY] = p
        wanted = 0.0
    if wanted == p:
        return False
    if in_args:
        node.args = (*node.args[:_SDPA_DROPOUT], wanted, *node.args[_SDPA_DROPOUT + 1 :])
    else:
        node.kwargs = {**node.kwargs, "dropout_p": wanted}
    return True
