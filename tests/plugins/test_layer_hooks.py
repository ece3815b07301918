"""Which attention layers call the connector's ``wait_for_layer_load`` (``kvctl.plugins.vllm_caches.layer_calls_hooks``).

The layered load (issue 45) writes a layer group when vLLM asks for its first layer; a layer class whose forward
reaches no hooked attention op never asks. On an H200 on 2026-12-05 GLM-5's sparse MLA (``DeepseekV32Attention``)
lost every layered hit that way. The layers here are vLLM 0.32's own classes, made without ``__init__`` (building
one needs a whole engine's config): only their class and ``use_direct_call`` matter to the check.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvctl.plugins.vllm_caches import CacheReading, layer_calls_hooks  # noqa: E402


def _bare(cls, **attrs):
    obj = object.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


def test_vllms_own_attention_layers_call_the_hook_and_sparse_mla_does_not():
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention

    assert layer_calls_hooks(_bare(Attention))
    assert layer_calls_hooks(_bare(MLAAttention, use_direct_call=False))
    assert not layer_calls_hooks(_bare(MLAAttention, use_direct_call=True))  # forward_impl, no op, no hook
    assert not layer_calls_hooks(_bare(DeepseekV32Attention, use_direct_call=False))

    class OwnForward(Attention):
        def forward(self, *args, **kwargs):  # noqa: D401 - a model's layer that runs attention itself
            return None

    assert not layer_calls_hooks(_bare(OwnForward))
    assert not layer_calls_hooks(None) and not layer_calls_hooks(object())


def test_the_reading_lists_the_layers_without_hooks_and_none_outside_an_engine():
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention

    ctx = {"m.0.attn": _bare(MLAAttention, use_direct_call=False), "m.1.attn": _bare(DeepseekV32Attention)}
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))
    assert CacheReading(vllm_config=cfg).without_layer_hooks(["m.0.attn", "m.1.attn", "m.2.attn"]) == ["m.1.attn", "m.2.attn"]
    assert CacheReading().without_layer_hooks(["m.0.attn"]) == []
