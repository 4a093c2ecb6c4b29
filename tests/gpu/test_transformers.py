"""cuflash.interop.transformers: a Llama through attn_implementation="cufa" against transformers' own.

The yardstick is transformers itself: the logits, gradients and greedy tokens of a random-weight
bf16 Llama (4 layers, hidden 1024, 8 query heads over 2 kv heads) through cuflash ("cufa") are compared
with those through "sdpa", and the error must stay within 1.5 times the error of transformers'
"eager" path against "sdpa" on the same inputs, plus a small slack (``_assert_within_eager``).
Padded batches (left and right padding) compare the real tokens only.

The tests of the mask function (which form a mask takes, and that each form sees exactly the keys
transformers' own dense mask allows) need torch and transformers but no GPU; the rest need a CUDA
device (skipped otherwise). ``python tests/gpu/test_transformers.py`` times a training step
(benchmarks/bench_transformers.py does the same with more options).
"""

import pathlib
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("cupy")

from transformers import masking_utils  # noqa: E402

import cuflash.interop.transformers as cft  # noqa: E402
from cuflash.interop._transformers_masks import CuflashMask  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="torch has no CUDA device")
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "transformers.md"
LENGTHS = (160, 100, 37)   # real tokens per row of the padded batches (S = 160: not a tile multiple)


# --- the mask function, on the CPU -------------------------------------------------------------

def _visible(m, batch, q_length, kv_length):
    """(B, Sq, Sk) bool: which keys each real query sees under cuflash's form ``m`` (None, a
    CuflashMask, or a dense tensor), worked out from cuflash's documented rules."""
    if isinstance(m, torch.Tensor):
        return m[:, 0].expand(batch, q_length, kv_length).clone()
    if m is None:
        m = CuflashMask(batch, q_length, kv_length, True, None, kv_length)
    out = torch.zeros(batch, q_length, kv_length, dtype=torch.bool)
    left = None if m.window is None else m.window - 1
    if m.varlen is None:
        i = torch.arange(q_length)[:, None]
        j = torch.arange(m.kv_used)[None, :]
        diag = i + m.kv_used - q_length           # bottom-right
        seen = (j <= diag) if m.causal else torch.ones_like(j, dtype=torch.bool).expand(q_length, -1)
        if left is not None:
            seen = seen & (j >= diag - left) if m.causal else seen & ((j - diag).abs() <= left)
        seen = seen.expand(batch, -1, -1)
        if m.key_mask is not None:
            seen = seen & m.key_mask[:, 0]
        out[:, :, :m.kv_used] = seen
        return out
    p = m.varlen
    for b in range(batch):
        qs = p.seq_q[p.cu_seqlens_q[b]:p.cu_seqlens_q[b + 1]]
        ks = p.seq_k[p.cu_seqlens_k[b]:p.cu_seqlens_k[b + 1]]
        n_q, n_k = len(qs), len(ks)
        for r, s in enumerate(qs.tolist()):
            j = torch.arange(n_k)
            seen = j <= r + n_k - n_q
            if left is not None:
                seen &= j >= r + n_k - n_q - left
            out[b, s, ks[seen]] = True
    return out


def _transformers_visible(mask_function, batch, q_length, kv_length, q_offset, kv_offset, pad):
    dense = masking_utils.sdpa_mask(batch_size=batch, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                                    kv_offset=kv_offset, mask_function=mask_function, attention_mask=pad,
                                    allow_is_causal_skip=False)
    return dense[:, 0]


def _pad(kind, batch, positions, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, positions + 1, (batch,), generator=g)
    lengths[0] = positions
    j = torch.arange(positions)[None, :]
    if kind == "left":
        return j >= positions - lengths[:, None]
    if kind == "right":
        return j < lengths[:, None]
    pad = torch.rand(batch, positions, generator=g) < 0.7     # holes anywhere
    pad[:, -1] = True
    return pad


CASES = [  # (q_length, kv_length, q_offset, kv_offset): prefill, chunked prefill, decode, static cache, sliding cache
    (37, 37, 0, 0), (16, 53, 37, 0), (1, 54, 53, 0), (1, 64, 20, 0), (5, 64, 20, 0), (1, 20, 40, 21)]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("kind", ["left", "right", "holes", "none"])
@pytest.mark.parametrize("case", CASES)
def test_mask_forms_see_what_transformers_sees(case, kind, window):
    q_length, kv_length, q_offset, kv_offset = case
    if window is None and kv_offset:
        pytest.skip("a sliding cache's offsets come with a window")
    batch, positions = 4, q_offset + q_length
    pad = None if kind == "none" else _pad(kind, batch, positions, seed=q_length + kv_length)
    fn = masking_utils.causal_mask_function if window is None else \
        masking_utils.sliding_window_causal_mask_function(window)
    m = cft.attention_mask(batch, q_length, kv_length, q_offset, kv_offset, fn, pad, device="cpu")
    want = _transformers_visible(fn, batch, q_length, kv_length, q_offset, kv_offset, pad)
    got = _visible(m, batch, q_length, kv_length)
    real = torch.ones(batch, q_length, dtype=torch.bool) if pad is None else pad[:, q_offset:q_offset + q_length]
    assert torch.equal(got[real], want[real])
    # The cheap forms: no mask without padding, varlen for several queries over padding, a key mask
    # for decode steps and windows over holes; never a dense tensor for these patterns.
    assert not isinstance(m, torch.Tensor)
    if pad is None and window is None and kv_length == q_offset + q_length - kv_offset:
        assert m is None
    if kind in ("left", "right") and q_length > 1 and not pad[:, kv_offset:q_offset + q_length].all():
        assert m.varlen is not None


def test_left_padding_becomes_varlen_offsets():
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    m = cft.attention_mask(3, 5, 5, attention_mask=pad)
    assert m.varlen.cu_seqlens_q.tolist() == [0, 3, 8, 9] == m.varlen.cu_seqlens_k.tolist()
    assert (m.varlen.max_seqlen_q, m.varlen.max_seqlen_k) == (5, 5)
    assert m.varlen.seq_q.tolist() == [2, 3, 4, 0, 1, 2, 3, 4, 4]
    decode = cft.attention_mask(3, 1, 6, 5, 0, attention_mask=torch.nn.functional.pad(pad, (0, 1), value=True))
    assert decode.varlen is None and decode.key_mask.shape == (3, 1, 1, 6)


def test_the_window_is_exclusive_like_transformers():
    # sliding_window=3: a query sees itself and the 2 keys before it, cuflash's window=(2, 0).
    m = cft.attention_mask(1, 6, 6, mask_function=masking_utils.sliding_window_causal_mask_function(3))
    assert m.window == 3 and cft._window(m.window, True) == (2, 0)
    assert torch.equal(_visible(m, 1, 6, 6)[0, 5], torch.tensor([False, False, False, True, True, True]))


def test_unknown_patterns_get_transformers_dense_mask():
    # Packed sequences (found from position_ids): no cheap form here, the exact dense mask instead.
    seqs = torch.tensor([[0, 0, 0, 1, 1, 2]])
    fn = masking_utils.and_masks(masking_utils.causal_mask_function,
                                 masking_utils.packed_sequence_mask_function(seqs))
    m = cft.attention_mask(1, 6, 6, mask_function=fn, device="cpu")
    assert isinstance(m, torch.Tensor) and m.dtype == torch.bool and m.shape == (1, 1, 6, 6)
    assert torch.equal(m[0, 0], _transformers_visible(fn, 1, 6, 6, 0, 0, None)[0])


class _Layer(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.config._attn_implementation = name
        self.is_causal = True


def test_attention_refuses_masks_it_does_not_know():
    q = torch.zeros(2, 8, 5, 64)
    k = torch.zeros(2, 2, 5, 64)
    cft.register()
    with pytest.raises(TypeError, match="2D|not a form cuflash runs"):
        cft.attention_forward(_Layer(cft.NAME), q, k, k, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="no mask function"):
        cft.attention_forward(_Layer("cuflash_attention_only"), q, k, k, None)
    other = cft.attention_mask(3, 5, 5, attention_mask=torch.ones(3, 5, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="built for batch 3"):
        cft.attention_forward(_Layer(cft.NAME), q, k, k, other)


def test_register_puts_both_functions_in_place():
    assert cft.register("cufa_test_name") == "cufa_test_name"
    assert transformers.AttentionInterface._global_mapping["cufa_test_name"] is cft.attention_forward
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["cufa_test_name"] is cft.attention_mask


def test_register_refuses_names_transformers_takes_for_flash_attention():
    from transformers.utils.generic import is_flash_attention_requested

    assert is_flash_attention_requested(requested_attention_implementation="cuflash")   # why
    assert not is_flash_attention_requested(requested_attention_implementation=cft.NAME)
    with pytest.raises(ValueError, match="contains 'flash'"):
        cft.register("cuflash")


def test_a_model_takes_the_registered_name():
    # set_attn_implementation checks the name (and, for "flash" names, imports a build): on the CPU.
    cft.register()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation(cft.NAME)
    assert model.config._attn_implementation == cft.NAME


# --- a Llama on the GPU -------------------------------------------------------------------------

_IMPL = {"cuflash": cft.NAME}   # the tests' label -> the registered attn_implementation


def _llama(seed=0, **overrides):
    config = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                  initializer_range=0.05, pad_token_id=0)
    config.update(overrides)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to("cuda", torch.bfloat16)


def _batch(padding, batch=3, seq=160, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(1, 1024, (batch, seq), device="cuda", generator=g)
    if padding == "none":
        return ids, None
    j = torch.arange(seq, device="cuda")[None, :]
    lengths = torch.tensor(LENGTHS[:batch], device="cuda")[:, None]
    real = (j >= seq - lengths) if padding == "left" else (j < lengths)
    return ids.masked_fill(~real, 0), real.long()


def _assert_within_eager(name, err, eager_err, slack):
    print(f"{name}: cuflash vs sdpa {err:.3e}, eager vs sdpa {eager_err:.3e}")
    assert err <= 1.5 * eager_err + slack, f"{name}: cuflash vs sdpa {err:.3e} > 1.5 x eager's {eager_err:.3e} + {slack:.1e}"


def _logits(model, impl, ids, mask):
    model.set_attn_implementation(_IMPL.get(impl, impl))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_llama_logits_match_sdpa(padding):
    cft.register()
    model = _llama()
    ids, mask = _batch(padding)
    out = {impl: _logits(model, impl, ids, mask) for impl in ("sdpa", "eager", "cuflash")}
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    out = {impl: x[real] for impl, x in out.items()}   # (real tokens, vocab)
    assert torch.isfinite(out["cuflash"]).all()
    err = (out["cuflash"] - out["sdpa"]).abs().max().item()
    eager_err = (out["eager"] - out["sdpa"]).abs().max().item()
    _assert_within_eager(f"logits, {padding} padding", err, eager_err, 1e-3 * out["sdpa"].abs().max().item())


def _grads(model, impl, ids, mask):
    model.set_attn_implementation(_IMPL.get(impl, impl))
    model.zero_grad(set_to_none=True)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return {name: p.grad.float().clone() for name, p in model.named_parameters()}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_llama_training_step_gradients_match_sdpa(padding):
    cft.register()
    model = _llama()
    model.train()
    ids, mask = _batch(padding)
    grads = {impl: _grads(model, impl, ids, mask) for impl in ("sdpa", "eager", "cuflash")}

    def rel_err(a, b):   # over all parameters: ||a - b|| / ||b||
        num = sum((a[n] - b[n]).square().sum() for n in b)
        return (num / sum(b[n].square().sum() for n in b)).sqrt().item()

    assert all(torch.isfinite(g).all() for g in grads["cuflash"].values())
    _assert_within_eager(f"gradients, {padding} padding", rel_err(grads["cuflash"], grads["sdpa"]),
                         rel_err(grads["eager"], grads["sdpa"]), 1e-4)


def _generate(model, impl, ids, mask, new_tokens=16):
    model.set_attn_implementation(_IMPL.get(impl, impl))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    scores = torch.stack(out.scores, 1).float()   # (B, new, vocab); -inf where a processor banned a token
    return out.sequences[:, ids.shape[1]:], scores.clamp(min=-1e4)


@gpu
@pytest.mark.gpu
def test_llama_generate_greedy_matches_sdpa():
    cft.register()
    model = _llama()
    ids, mask = _batch("left", seq=48)
    tokens, scores = {}, {}
    for impl in ("sdpa", "eager", "cuflash"):
        tokens[impl], scores[impl] = _generate(model, impl, ids, mask)
    same = tokens["cuflash"] == tokens["sdpa"]
    print(f"generate: {int(same.sum())} of {same.numel()} new tokens as sdpa's "
          f"(eager: {int((tokens['eager'] == tokens['sdpa']).sum())})")
    if same.all():
        return
    # bf16 near-ties may pick another token: then up to the first difference of each row the scores
    # must agree within the rule, and at it the two choices must be (nearly) tied under sdpa.
    eager_err = (scores["eager"][:, 0] - scores["sdpa"][:, 0]).abs().max().item()
    for b in range(tokens["sdpa"].shape[0]):
        if same[b].all():
            continue
        t = int((~same[b]).nonzero()[0])
        err = (scores["cuflash"][b, :t + 1] - scores["sdpa"][b, :t + 1]).abs().max().item()
        _assert_within_eager(f"generate scores, row {b} to step {t}", err, eager_err, 1e-3)
        gap = (scores["sdpa"][b, t, tokens["sdpa"][b, t]] - scores["sdpa"][b, t, tokens["cuflash"][b, t]]).item()
        assert gap <= 2 * eager_err + 1e-3, f"row {b} step {t}: a different token with a score gap of {gap:.3e}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["left", "right"])
def test_mistral_sliding_window_matches_sdpa(padding):
    cft.register()
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=2, sliding_window=48,
                                        initializer_range=0.05, pad_token_id=0)
    model = transformers.MistralForCausalLM(config).to("cuda", torch.bfloat16)
    ids, mask = _batch(padding)
    out = {impl: _logits(model, impl, ids, mask)[mask.bool()] for impl in ("sdpa", "eager", "cuflash")}
    err = (out["cuflash"] - out["sdpa"]).abs().max().item()
    eager_err = (out["eager"] - out["sdpa"]).abs().max().item()
    _assert_within_eager(f"mistral window 48, {padding} padding", err, eager_err,
                         1e-3 * out["sdpa"].abs().max().item())


@gpu
@pytest.mark.gpu
def test_softcap_and_scaling_reach_cuflash():
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 8, 96, 64, device="cuda", generator=g)
    k, v = (torch.randn(2, 2, 96, 64, device="cuda", generator=g) for _ in range(2))
    out, weights = cft.attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.3, softcap=5.0,
                                         is_causal=True)
    kr, vr = (x.repeat_interleave(4, dim=1).double() for x in (k, v))
    s = 5.0 * torch.tanh(0.3 * q.double() @ kr.transpose(-1, -2) / 5.0)
    s = s.masked_fill(torch.ones(96, 96, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    want = (s.softmax(-1) @ vr).transpose(1, 2)
    assert weights is None and out.shape == (2, 96, 8, 64)
    assert (out.double() - want).abs().max().item() < 1e-4


def _doc_blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_doc_has_example_code():
    assert _doc_blocks(), "docs/transformers.md has no ```python block"


@gpu
@pytest.mark.gpu
def test_the_doc_examples_run():
    namespace = {}
    for block in _doc_blocks():
        exec(compile(block, str(DOC), "exec"), namespace)   # noqa: S102 - our own documentation


if __name__ == "__main__":   # a quick timing of one training step; benchmarks/bench_transformers.py has more
    import runpy
    import sys

    benchmarks = DOC.parents[1] / "benchmarks"
    sys.path.insert(0, str(benchmarks))   # bench_transformers.py imports _harness beside it
    sys.argv = [sys.argv[0], "--rounds", "5"]
    runpy.run_path(str(benchmarks / "bench_transformers.py"), run_name="__main__")
