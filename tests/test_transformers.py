"""Hugging Face transformers integration (`flashforge.integrations.transformers`).

Real transformers model classes, built from small configs with seeded random weights, run
once with ``attn_implementation="forge"`` and once with transformers' own implementation
(``"sdpa"``, or ``"eager"`` where SDPA cannot: Gemma 2's softcap), with the same weights:

* logits equal (non-padding positions; left padding for decoders, right for BERT);
* greedy generation of 32 tokens identical, for a batch with left padding and one without
  (dynamic cache; a static cache for Llama), with transformers' auto-compile off;
* one training step's gradients equal (dropout off), and attention dropout in train mode
  runs, is reproducible under ``torch.manual_seed`` and differs from eval mode;
* the masks handed to the kernel stay small: None for plain causal / sliding-window
  attention without padding (KV-cache decoding included), a broadcast view for an
  encoder's padding.

Each test runs on the CPU (float32) and, with a GPU, on CUDA (bfloat16 logits and gradients,
held to a multiple of the baseline's own bfloat16 error against float32; generation stays in
float32 there, where greedy decoding is exact).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", minversion="4.53",
    reason="transformers >= 4.53 is not installed (pip install 'flashforge[transformers]')")

from flashforge.integrations import transformers as fft  # noqa: E402

TF_MAJOR = int(transformers.__version__.split(".")[0])
VOCAB, S, NEW_TOKENS = 128, 20, 32

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@dataclass(frozen=True)
class Spec:
    """A model class and its small config; ``baseline`` is the implementation we are compared with."""
    name: str
    model: str
    config: Callable[[], object]
    baseline: str = "sdpa"
    decoder: bool = True


def _decoder_kwargs(**kw):
    # initializer_range 0.2: scores of a few units, so that the softmax is peaked and masks,
    # windows and softcaps change the result (at 0.02 every row is a near-uniform average)
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return base


SPECS = [
    Spec("llama", "LlamaForCausalLM", lambda: transformers.LlamaConfig(**_decoder_kwargs())),
    Spec("qwen3", "Qwen3ForCausalLM", lambda: transformers.Qwen3Config(**_decoder_kwargs(head_dim=16))),
    # sliding window 6 < prompt (20) and < generated length (52): the window matters, and the
    # cache's sliding layers drop keys (kv_offset > 0)
    Spec("mistral", "MistralForCausalLM", lambda: transformers.MistralConfig(**_decoder_kwargs(sliding_window=6))),
    # one full and one sliding layer
    Spec("qwen2-hybrid", "Qwen2ForCausalLM", lambda: transformers.Qwen2Config(
        **_decoder_kwargs(use_sliding_window=True, sliding_window=6, max_window_layers=1))),
    # softcap 2 bites (scores are a few units); the scale is 32**-0.5, not head_dim**-0.5; SDPA
    # refuses softcap, so eager is the baseline
    Spec("gemma2", "Gemma2ForCausalLM", lambda: transformers.Gemma2Config(**_decoder_kwargs(
        head_dim=16, query_pre_attn_scalar=32, sliding_window=6, attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0)), baseline="eager"),
    Spec("bert", "BertForMaskedLM", lambda: transformers.BertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        initializer_range=0.2, pad_token_id=0), decoder=False),
]


def _spec_params(decoders_only: bool = False):
    params = []
    for spec in SPECS:
        if decoders_only and not spec.decoder:
            continue
        marks = []
        if spec.name == "bert" and TF_MAJOR < 5:
            marks.append(pytest.mark.skip(reason="BertModel dispatches through AttentionInterface "
                                                 "only from transformers 5"))
        params.append(pytest.param(spec, id=spec.name, marks=marks))
    return params


def _device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device(device)


def _pair(spec: Spec, device, dtype=torch.float32, **config_changes):
    """(baseline model, flashforge model) with the same seeded weights, in eval mode."""
    config = spec.config()
    for key, value in config_changes.items():
        setattr(config, key, value)
    cls = getattr(transformers, spec.model)
    torch.manual_seed(0)
    base = cls._from_config(copy.deepcopy(config), attn_implementation=spec.baseline)
    ours = cls._from_config(copy.deepcopy(config), attn_implementation=fft.ATTN_IMPLEMENTATION)
    ours.load_state_dict(base.state_dict())
    assert ours.config._attn_implementation == fft.ATTN_IMPLEMENTATION
    return base.to(device, dtype).eval(), ours.to(device, dtype).eval()


PADDING = [pytest.param(True, id="padded"), pytest.param(False, id="unpadded")]


def _batch(spec: Spec, device, padded: bool = True):
    """Token ids and attention mask ``[3, S]``. Padded: row 0 unpadded, the others padded by 3 and
    7 tokens (on the left for decoders, as for generation; on the right for the encoder), so that
    transformers builds a mask; unpadded: no mask, the kernel's causal and window flags do it all."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, S), generator=g)
    mask = torch.ones(3, S, dtype=torch.long)
    for row, pad in zip((1, 2), (3, 7) if padded else ()):
        cols = slice(0, pad) if spec.decoder else slice(S - pad, S)
        mask[row, cols] = 0
        ids[row, cols] = 0
    return ids.to(device), mask.to(device)


def _assert_close(ours: torch.Tensor, base: torch.Tensor, ref: torch.Tensor, name: str):
    """float32: ours == base up to rounding. bfloat16: ours is at most 3x the baseline's own error
    against the float32 run ``ref``, plus a rounding floor."""
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, base, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
        return
    ours, base, ref = ours.float(), base.float(), ref.float()
    err, base_err = (ours - ref).abs().max().item(), (base - ref).abs().max().item()
    floor = 2e-2 * max(1.0, ref.abs().max().item())
    assert err <= 3 * base_err + floor, f"{name}: error {err:.3g} vs the baseline's {base_err:.3g}"


def _logits(model, ids, mask, **kw):
    return model(input_ids=ids, attention_mask=mask, **kw).logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", PADDING)
@pytest.mark.parametrize("spec", _spec_params())
def test_logits_match(spec, padded, device):
    device = _device(device)
    ids, mask = _batch(spec, device, padded)
    keep = mask.bool()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    base, ours = _pair(spec, device, dtype)
    with torch.no_grad():
        got, want = _logits(ours, ids, mask), _logits(base, ids, mask)
        ref = want if dtype == torch.float32 else _logits(base.float(), ids, mask)
    assert torch.isfinite(got).all()
    _assert_close(got[keep], want[keep], ref[keep], f"{spec.name} logits")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", PADDING)
@pytest.mark.parametrize("spec", _spec_params(decoders_only=True))
def test_greedy_generation_matches(spec, padded, device):
    device = _device(device)
    ids, mask = _batch(spec, device, padded)
    base, ours = _pair(spec, device)
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=0, disable_compile=True)
    with torch.no_grad():
        want, got = base.generate(ids, **kw), ours.generate(ids, **kw)
    assert got.shape == (ids.shape[0], S + NEW_TOKENS)
    assert torch.equal(got, want), f"{spec.name}: generations differ\n{got}\n{want}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", PADDING)
def test_static_cache_generation_matches(padded, device):
    """A static cache is longer than what has been written to it: the keys do not end where the
    queries end, and the mask function materialises the mask even without padding."""
    device = _device(device)
    spec = SPECS[0]
    ids, mask = _batch(spec, device, padded)
    base, ours = _pair(spec, device)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
              cache_implementation="static", disable_compile=True)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kw), base.generate(ids, **kw))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", PADDING)
@pytest.mark.parametrize("spec", _spec_params())
def test_training_step_gradients_match(spec, padded, device):
    device = _device(device)
    ids, mask = _batch(spec, device, padded)
    labels = ids.masked_fill(mask == 0, -100)
    if spec.decoder:
        # the logits of a padding position must not enter the loss either (they predict the next
        # label): its row sees no key, and flashforge (0) and eager (a uniform average) differ there
        labels[:, 1:].masked_fill_(mask[:, :-1] == 0, -100)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    models = _pair(spec, device, dtype)
    if dtype != torch.float32:
        models += (_pair(spec, device)[0],)
    grads = []
    for model in models:
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    base, ours = grads[0], grads[1]
    ref = grads[2] if len(grads) == 3 else base
    assert ours.keys() == base.keys()
    for name in base:
        assert torch.isfinite(ours[name]).all(), name
        _assert_close(ours[name], base[name], ref[name], f"{spec.name} grad {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", _spec_params())
def test_attention_dropout_in_training(spec, device):
    device = _device(device)
    ids, mask = _batch(spec, device)
    keep = mask.bool()
    p = {"attention_probs_dropout_prob": 0.3} if spec.name == "bert" else {"attention_dropout": 0.3}
    _, ours = _pair(spec, device, **p)
    with torch.no_grad():
        evaluated = _logits(ours, ids, mask)
    ours.train()
    torch.manual_seed(7)
    first = _logits(ours, ids, mask)
    torch.manual_seed(7)
    again = _logits(ours, ids, mask)
    assert torch.isfinite(first).all()
    assert torch.equal(first, again), "dropout is not reproducible under torch.manual_seed"
    assert not torch.allclose(first[keep], evaluated[keep], atol=1e-3), "dropout changed nothing"
    first[keep].square().mean().backward()
    assert all(torch.isfinite(q.grad).all() for q in ours.parameters() if q.grad is not None)


class _MaskSpy:
    """Records the ``attention_mask`` each attention call of ``"forge"`` receives."""

    def __init__(self, monkeypatch):
        self.masks = []
        forward = fft.attention_forward

        def spy(module, query, key, value, attention_mask, **kwargs):
            self.masks.append(attention_mask)
            return forward(module, query, key, value, attention_mask, **kwargs)

        monkeypatch.setitem(transformers.AttentionInterface._global_mapping, fft.ATTN_IMPLEMENTATION, spy)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_no_mask_is_built_without_padding(name, monkeypatch):
    """Plain causal and sliding-window attention, prefill and every decoding step with a dynamic
    cache: the kernel gets None and applies causal (bottom-right) and window flags itself."""
    spy = _MaskSpy(monkeypatch)
    spec = next(s for s in SPECS if s.name == name)
    base, ours = _pair(spec, "cpu")
    ids = _batch(spec, "cpu")[0][:1]
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, disable_compile=True)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kw), base.generate(ids, **kw))
    assert spy.masks and all(m is None for m in spy.masks)


@pytest.mark.skipif(TF_MAJOR < 5, reason="BertModel dispatches through AttentionInterface only from transformers 5")
def test_encoder_padding_mask_is_a_broadcast_view(monkeypatch):
    spy = _MaskSpy(monkeypatch)
    spec = next(s for s in SPECS if s.name == "bert")
    _, ours = _pair(spec, "cpu")
    ids, mask = _batch(spec, "cpu")
    with torch.no_grad():
        ours(input_ids=ids, attention_mask=mask)
        ours(input_ids=ids[:1], attention_mask=mask[:1])
    padded, unpadded = spy.masks[0], spy.masks[-1]
    assert padded.dtype == torch.bool and padded.shape == (3, 1, S, S) and padded.stride(2) == 0
    assert unpadded is None


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # renamed `cache` in 5.x
def test_kv_cache_continuation_matches_full_forward():
    """A prompt fed in two chunks through the cache (Sq > 1, keys beyond the queries' start,
    sliding layers that dropped keys) gives the logits of one full forward."""
    spec = next(s for s in SPECS if s.name == "mistral")
    _, ours = _pair(spec, "cpu")
    ids = _batch(spec, "cpu")[0][:1]
    with torch.no_grad():
        full = ours(input_ids=ids).logits
        first = ours(input_ids=ids[:, :12], use_cache=True)
        cache = getattr(first, "past_key_values", None) or first.cache
        second = ours(input_ids=ids[:, 12:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(second, full[:, 12:], rtol=1e-4, atol=1e-4)


def _module(is_causal=True):
    module = torch.nn.Module()
    module.is_causal = is_causal
    return module


def test_position_bias_is_added_to_the_scores():
    """A T5-style ``position_bias`` (learned, so its gradient matters) on top of each mask kind."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    bias = torch.randn(1, 4, 5, 7, requires_grad=True)
    keep = torch.rand(2, 1, 5, 7) > 0.3
    keep[..., 0] = True
    additive = torch.zeros(2, 1, 5, 7).masked_fill(~keep, torch.finfo(torch.float32).min)
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    for mask, total in ((None, bias), (keep, bias.masked_fill(~keep, float("-inf"))), (additive, bias + additive)):
        got, weights = fft.attention_forward(_module(is_causal=False), q, k, v, mask, position_bias=bias)
        want = torch.nn.functional.scaled_dot_product_attention(q, k4, v4, attn_mask=total).transpose(1, 2)
        assert weights is None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        (dgot,) = torch.autograd.grad(got.sum(), bias)
        (dwant,) = torch.autograd.grad(want.sum(), bias)
        torch.testing.assert_close(dgot, dwant, rtol=1e-4, atol=1e-5)


def test_unsupported_arguments_raise():
    q = k = v = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="s_aux"):
        fft.attention_forward(_module(), q, k, v, None, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="head_mask"):
        fft.attention_forward(_module(), q, k, v, None, head_mask=torch.ones(2))
    with pytest.raises(ValueError, match="register"):
        fft.attention_forward(_module(), q, k, v, torch.ones(1, 3))


def test_register_is_idempotent():
    assert fft.register() == fft.register() == "forge"
    assert transformers.AttentionInterface._global_mapping["forge"] is fft.attention_forward
    assert fft.AttentionMaskInterface._global_mapping["forge"] is fft.mask_interface
