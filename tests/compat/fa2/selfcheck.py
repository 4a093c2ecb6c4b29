#!/usr/bin/env python
"""CPU checks of the shim's pure-torch pieces (no GPU, no CuPy needed).

    python tests/compat/fa2/selfcheck.py [--tests .devrun/fa2/test_flash_attn.py]

- ``bert_padding.unpad_input`` / ``pad_input`` against a per-sequence loop, gradients included;
- ``layers.rotary.apply_rotary_emb`` against the rotation written out pair by pair, both
  conventions, partial rotary dims, per-sequence offsets, packed (cu_seqlens) input, in place;
- the torch Philox keep mask of ``_probs`` against :func:`cuflash.random.dropout_keep`;
- the ``S_dmask`` encoding decoded by FA2's own helpers (``convert_flash_attn_S_to_softmax``,
  ``normalize_flash_attn_S``, ``get_dropout_fraction`` from the test file, when ``--tests`` is
  given): the decoded probabilities must equal FA2's ``attention_ref`` probabilities and the
  decoded mask the keep mask, for causal, local windows, ALiBi, GQA and Sq != Sk.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from flash_attn import _probs  # noqa: E402
from flash_attn.bert_padding import pad_input, unpad_input  # noqa: E402
from flash_attn.layers.rotary import apply_rotary_emb  # noqa: E402


def check_padding():
    torch.manual_seed(0)
    batch, seqlen = 4, 13
    x = torch.randn(batch, seqlen, 3, 5, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([13, 1, 7, 0])
    mask = torch.arange(seqlen).view(1, -1) < lengths.view(-1, 1)
    mask[2, 0] = False                       # a hole: unpad keeps any marked token, in order
    rows, indices, cu, max_seqlen, used = unpad_input(x, mask)
    expect = torch.cat([x[b][mask[b]] for b in range(batch)])
    assert torch.equal(rows, expect)
    lens = mask.sum(-1)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *torch.cumsum(lens, 0).tolist()]
    assert max_seqlen == int(lens.max()) and isinstance(max_seqlen, int)
    assert used.tolist() == lens.tolist()
    padded = pad_input(rows, indices, batch, seqlen)
    assert torch.equal(padded, x * mask.view(batch, seqlen, 1, 1))
    g = torch.randn_like(padded)
    (grad,) = torch.autograd.grad(padded, x, g)
    assert torch.equal(grad, g * mask.view(batch, seqlen, 1, 1))
    unused = torch.zeros_like(mask)
    unused[3, :2] = True
    rows2, _, cu2, _, used2 = unpad_input(x, mask, unused)
    assert rows2.shape[0] == rows.shape[0] + 2 and cu2[-1] == cu[-1] + 2 and used2.tolist() == used.tolist()
    print("bert_padding: ok")


def _rotary_by_pairs(x, cos, sin, positions, interleaved):
    """Each pair rotated on its own, in float64: the definition, with no vectorisation tricks."""
    out = x.double().clone()
    half = cos.shape[-1]
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in positions.shape)):
        idx = tuple(idx.tolist()) if idx.dim() else (int(idx),)
        p = int(positions[idx])
        for kk in range(half):
            a, b = (2 * kk, 2 * kk + 1) if interleaved else (kk, kk + half)
            c, s = float(cos[p, kk]), float(sin[p, kk])
            xa, xb = x[idx][..., a].double(), x[idx][..., b].double()
            out[idx][..., a] = xa * c - xb * s
            out[idx][..., b] = xa * s + xb * c
    return out


def check_rotary():
    torch.manual_seed(1)
    batch, seqlen, heads, d, seqlen_ro = 2, 5, 3, 12, 20
    for rotary_dim in (4, 12):
        angle = torch.rand(seqlen_ro, rotary_dim // 2, dtype=torch.float64) * 2 * math.pi
        cos, sin = torch.cos(angle), torch.sin(angle)
        x = torch.randn(batch, seqlen, heads, d, dtype=torch.float64)
        offsets = torch.tensor([3, 11], dtype=torch.int32)
        for interleaved in (False, True):
            for off in (0, 4, offsets):
                got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off)
                pos = torch.arange(seqlen).view(1, -1) + (off.view(-1, 1).long() if torch.is_tensor(off) else off)
                pos = pos.expand(batch, seqlen)
                want = _rotary_by_pairs(x, cos, sin, pos, interleaved)
                assert torch.allclose(got.double(), want, atol=1e-6), (rotary_dim, interleaved, off)
                assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
            # packed input: same result as the padded one, row by row
            cu = torch.tensor([0, 5, 8], dtype=torch.int32)
            packed = torch.cat([x[0], x[1, :3]])
            got = apply_rotary_emb(packed, cos, sin, interleaved=interleaved, seqlen_offsets=offsets, cu_seqlens=cu)
            want = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
            assert torch.allclose(got, torch.cat([want[0], want[1, :3]]))
            y = x.clone()
            assert apply_rotary_emb(y, cos, sin, interleaved=interleaved, inplace=True) is y
            assert torch.allclose(y, apply_rotary_emb(x, cos, sin, interleaved=interleaved))
    # half precision in, float32 arithmetic inside, half out
    xh = torch.randn(1, 4, 2, 8).half()
    cos_h, sin_h = torch.cos(torch.rand(8, 4)).half(), torch.sin(torch.rand(8, 4)).half()
    got = apply_rotary_emb(xh, cos_h, sin_h)
    want = _rotary_by_pairs(xh, cos_h.double(), sin_h.double(), torch.arange(4).view(1, 4), False)
    assert got.dtype == torch.float16 and torch.allclose(got.double(), want, atol=2e-3)
    print("rotary: ok")


def check_keep_mask():
    from cuflash.random import dropout_keep, dropout_threshold

    cases = [(0, 0, 0.17, 0, 3, 5, 9), (2**64 - 1, 2**32 + 7, 0.5, 3, 2, 4, 17), (123456789012345, 12, 0.9, 1, 4, 1, 1)]
    for seed, offset, p, b, heads, sq, sk in cases:
        threshold = dropout_threshold(p)
        got = _probs.keep_mask(seed, offset, threshold, [b, b + 2], heads, sq, sk, "cpu").numpy()
        bb, h, i, j = torch.meshgrid(torch.tensor([b, b + 2]), torch.arange(heads), torch.arange(sq),
                                     torch.arange(sk), indexing="ij")
        want = dropout_keep(seed, offset, p, bb.numpy(), h.numpy(), i.numpy(), j.numpy(), heads)
        assert (got == want).all(), (seed, offset, p, b)
    print("philox keep mask: ok (equal to cuflash.random.dropout_keep)")


def _load_fa2(path):
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)   # FA2's file asks at import
    spec = importlib.util.spec_from_file_location("fa2_test_flash_attn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_encoding(fa2):
    """Encode with _probs, decode with FA2's helpers, compare with FA2's attention_ref."""
    from cuflash import reference

    torch.manual_seed(2)
    p = 0.17
    for sq, sk, hq, hk, d, causal, local, alibi in [(113, 203, 6, 2, 32, False, False, False),
                                                   (256, 131, 4, 4, 64, True, False, False),
                                                   (97, 300, 6, 1, 16, False, True, True),
                                                   (200, 200, 2, 2, 64, True, True, True),
                                                   (1, 147, 3, 3, 32, False, False, True)]:
        batch = 2
        q, k, v = (torch.randn(batch, s, h, d) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
        window_size = (-1, -1) if not local else tuple(int(w) for w in torch.randint(0, sk, (2,)))
        slopes = torch.rand(batch, hq) * 0.3 if alibi else None
        attn_bias = fa2.attn_bias_from_alibi_slopes(slopes, sq, sk, causal=causal) if alibi else None
        folded = (window_size[0], 0) if causal else window_size
        s_dmask = torch.zeros(batch, hq, -(-sq // 128) * 128, -(-sk // 128) * 128)
        keeps = []
        # batched and per-sequence calls give the same values
        s_all = _probs.scores(q, k, scale=d ** -0.5, softcap=0.0, alibi_slopes=slopes, window=folded)
        # The lse of the encoding comes from cuflash's float64 reference (as the kernel's would),
        # nudged by 1e-3 so that the check sees it carried through.
        _, lse_ref = reference.attention_forward(q.numpy(), k.numpy(), v.numpy(), causal=causal,
                                                 window=None if window_size == (-1, -1) else window_size,
                                                 alibi_slopes=None if slopes is None else slopes.numpy())
        lse_ref = torch.from_numpy(lse_ref).float() + 1e-3
        for b in range(batch):
            s = _probs.scores(q[b:b + 1], k[b:b + 1], scale=d ** -0.5, softcap=0.0,
                              alibi_slopes=None if slopes is None else slopes[b], window=folded)[0]
            assert torch.allclose(s, s_all[b], rtol=1e-6, atol=1e-6, equal_nan=True)
            lse = lse_ref[b]
            keep = _probs.keep_mask(5, 9, round(p * 2**32), b, hq, sq, sk, "cpu")[0]
            keeps.append(keep)
            s_dmask[b, :, :sq, :sk] = _probs.encode(s, lse, keep)
        conv = fa2.convert_flash_attn_S_to_softmax(s_dmask, sq, sk, None, None, d, True, causal=causal,
                                                   window_size=window_size)
        mask = conv >= 0
        k_rep, v_rep = (x.repeat_interleave(hq // hk, dim=2) for x in (k, v))
        attn = fa2.normalize_flash_attn_S(conv.abs(), q, k_rep, v_rep, None, None, attn_bias, True, causal=causal,
                                          window_size=window_size)
        _, attn_ref = fa2.attention_ref(q, k, v, None, None, attn_bias, p, mask, causal=causal,
                                        window_size=window_size)
        # decoded = reference * exp(-1e-3): the encoding carries the given lse through
        assert torch.allclose(attn, attn_ref * math.exp(-1e-3), atol=1e-5, rtol=1e-4), (sq, sk, causal, local)
        keep = torch.stack(keeps)
        visible = attn_ref > 0
        assert torch.equal(mask[visible], keep[visible])
        if not alibi:
            frac = fa2.get_dropout_fraction(mask, None, None, causal=causal, window_size=window_size).item()
            assert abs(frac - p) < 0.03, frac
    print("S_dmask encoding: ok (decoded by FA2's helpers = attention_ref probabilities, mask = keep mask)")


class _ReferenceCuflash:
    """Stands in for cuflash (and its torch adapter) on the CPU: cuflash's float64 reference.

    With it the shim's own mapping (layouts, options, window tensors, dropout states, the varlen
    batch index, paged varlen through decode, rotary placement, leftpad masks, cache appends)
    runs end to end without a GPU; the kernels themselves are for the device run.
    """

    def __init__(self):
        import cuflash

        self.random = cuflash.random
        self.Generator = cuflash.Generator
        self.reference = __import__("cuflash.reference", fromlist=["reference"])

    @staticmethod
    def _np(x):
        return x if x is None or not torch.is_tensor(x) else x.detach().cpu().numpy()

    def _opts(self, options):
        options = dict(options)
        for name in ("alibi_slopes", "mask"):
            if name in options:
                options[name] = self._np(options[name])
        return options

    # the adapter (cuflash.interop.torch)
    def attention(self, q, k, v, *, generator=None, deterministic=False, **options):
        out, _, _ = self.attention_forward(q, k, v, generator=generator, **options)
        return torch.from_numpy(out).to(q.dtype)

    def attention_varlen(self, q, k, v, cu_q, cu_k, *, generator=None, deterministic=False, return_lse=False,
                         **options):
        rng = generator.next_state() if options.get("dropout_p", 0) > 0 else None
        out, lse = self.reference.attention_varlen(self._np(q), self._np(k), self._np(v), self._np(cu_q),
                                                   self._np(cu_k), rng_state=rng, **self._opts(options))
        out = torch.from_numpy(out).to(q.dtype)
        return (out, torch.from_numpy(lse).float()) if return_lse else out

    # the functional API
    def attention_forward(self, q, k, v, *, generator=None, **options):
        rng = generator.next_state() if options.get("dropout_p", 0) > 0 else None
        out, lse = self.reference.attention_forward(self._np(q), self._np(k), self._np(v), rng_state=rng,
                                                    **self._opts(options))
        return out, torch.from_numpy(lse).float(), rng

    def decode(self, q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, k_new=None, v_new=None,
               num_splits=0, return_lse=False, **options):
        out, lse, k_after, v_after = self.reference.decode(
            self._np(q), self._np(k_cache), self._np(v_cache), cache_seqlens=self._np(cache_seqlens),
            block_table=self._np(block_table), k_new=self._np(k_new), v_new=self._np(v_new), return_cache=True,
            **self._opts(options))
        if k_new is not None:
            k_cache.copy_(torch.from_numpy(k_after))
            v_cache.copy_(torch.from_numpy(v_after))
        out = torch.from_numpy(out).to(q.dtype)
        return (out, torch.from_numpy(lse).float()) if return_lse else out


def _use_reference_backend():
    import contextlib

    from flash_attn import flash_attn_interface as fi

    fake = _ReferenceCuflash()
    fi._cuflash = lambda: fake
    fi._ct = lambda: fake
    fi._torch_stream = lambda device: contextlib.nullcontext()
    state = {"offset": 40}

    def generator(device):   # stands in for torch's CUDA generator
        g = fake.Generator(1234)
        g.set_state([1234, state["offset"]])
        state["offset"] += 4
        return g

    fi._dropout_generator = generator
    return fi


def _close(got, want, what, atol=2e-5):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol, f"{what}: max error {err}"


def check_dense_and_varlen(fa2, fi):
    """flash_attn_(kv)(qkv)packed / varlen with dropout and return_attn_probs, as FA2's tests do."""
    torch.manual_seed(3)
    p = 0.17
    for sq, sk, hq, hk, causal, local, alibi in [(113, 203, 6, 2, False, False, True), (128, 97, 4, 4, True, True, False),
                                                 (1, 147, 3, 1, True, False, True), (77, 77, 2, 2, False, True, True)]:
        batch, d = 3, 32
        q = torch.randn(batch, sq, hq, d)
        kv = torch.randn(batch, sk, 2, hk, d)
        k, v = kv.unbind(2)
        window_size = (-1, -1) if not local else torch.randint(0, sk, (2,))     # tensors, as FA2 passes
        slopes = torch.rand(batch, hq) * 0.3 if alibi else None
        bias = fa2.attn_bias_from_alibi_slopes(slopes, sq, sk, causal=causal) if alibi else None
        for packed in (False, True):
            if packed:
                out, lse, s_dmask = fi.flash_attn_kvpacked_func(q, kv, p, causal=causal, window_size=window_size,
                                                                alibi_slopes=slopes, return_attn_probs=True)
            else:
                out, lse, s_dmask = fi.flash_attn_func(q, k, v, p, causal=causal, window_size=window_size,
                                                       alibi_slopes=slopes, return_attn_probs=True)
            conv = fa2.convert_flash_attn_S_to_softmax(s_dmask, sq, sk, None, None, d, True, causal=causal,
                                                       window_size=window_size)
            mask = conv >= 0
            k_rep, v_rep = (x.repeat_interleave(hq // hk, dim=2) for x in (k, v))
            attn = fa2.normalize_flash_attn_S(conv.abs(), q, k_rep, v_rep, None, None, bias, True, causal=causal,
                                              window_size=window_size)
            out_ref, attn_ref = fa2.attention_ref(q, k, v, None, None, bias, p, mask, causal=causal,
                                                  window_size=window_size)
            _close(out, out_ref, "dense out (dropout mask decoded from S_dmask)")
            _close(attn, attn_ref, "dense attention probabilities")
            assert lse.shape == (batch, hq, sq)
        # varlen, padded batches as FA2's tests build them
        qpm = fa2.generate_random_padding_mask(sq, batch, "cpu", mode="random")
        kpm = fa2.generate_random_padding_mask(sk, batch, "cpu", mode="random")
        bias = fa2.attn_bias_from_alibi_slopes(slopes, sq, sk, qpm, kpm, causal=causal) if alibi else None
        (q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, q_p, k_p, v_p, out_pad_fn, _, _) = fa2.generate_qkv(
            q, k, v, qpm, kpm)
        out_unpad, lse, s_dmask = fi.flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, p,
                                                            causal=causal, window_size=window_size,
                                                            alibi_slopes=slopes, return_attn_probs=True)
        out = out_pad_fn(out_unpad)
        conv = fa2.convert_flash_attn_S_to_softmax(s_dmask, sq, sk, qpm, kpm, d, True, causal=causal,
                                                   window_size=window_size)
        mask = conv >= 0
        k_rep, v_rep = (x.repeat_interleave(hq // hk, dim=2) for x in (k_p, v_p))
        attn = fa2.normalize_flash_attn_S(conv.abs(), q_p, k_rep, v_rep, qpm, kpm, bias, True, causal=causal,
                                          window_size=window_size)
        out_ref, attn_ref = fa2.attention_ref(q_p, k_p, v_p, qpm, kpm, bias, p, mask, causal=causal,
                                              window_size=window_size)
        _close(out, out_ref, "varlen out (dropout mask decoded from S_dmask)")
        _close(attn, attn_ref, "varlen attention probabilities")
        assert lse.shape == (hq, q_unpad.shape[0])
    print("dense / varlen mapping with dropout and S_dmask: ok (reference backend)")


def check_probs_memo(fi):
    """The S_dmask memo hits only for the same tensor objects, unchanged, with the same key."""
    memo = fi._LastProbs()
    q, k = torch.randn(2, 3), torch.randn(2, 3)
    value = torch.ones(1)
    memo.put((q, k), ("key",), value)
    assert memo.get((q, k), ("key",)) is value
    assert memo.get((q, k), ("other",)) is None
    assert memo.get((q.clone(), k), ("key",)) is None        # equal data, another tensor
    del q
    assert memo.get((torch.randn(2, 3), k), ("key",)) is None
    print("S_dmask memo: ok")


def check_paged_varlen(fa2, fi):
    """flash_attn_varlen_func with block_table, as test_flash_attn_varlen_causal builds it."""
    torch.manual_seed(4)
    for sq, sk, local in [(13, 40, False), (40, 13, True), (1, 50, True), (33, 33, False)]:
        batch, heads, d, page = 3, 2, 16, 8
        q = torch.randn(batch, sq, heads, d)
        k, v, table, k_pages, v_pages, _ = fa2._generate_block_kvcache(sk, page, batch, heads, d, "cpu",
                                                                       torch.float32)
        window_size = (-1, -1) if not local else torch.randint(0, sk, (2,))
        qpm = fa2.generate_random_padding_mask(sq, batch, "cpu", mode="random")
        kpm = fa2.generate_random_padding_mask(sk, batch, "cpu", mode="random")
        (q_unpad, _, _, cu_q, cu_k, max_q, max_k, q_p, k_p, v_p, out_pad_fn, _, _) = fa2.generate_qkv(q, k, v, qpm, kpm)
        out = out_pad_fn(fi.flash_attn_varlen_func(q_unpad, k_pages, v_pages, cu_q, cu_k, max_q, max_k, 0.0,
                                                   causal=True, window_size=window_size, block_table=table))
        out_ref, _ = fa2.attention_ref(q_p, k_p, v_p, qpm, kpm, None, 0.0, None, causal=True,
                                       window_size=window_size)
        _close(out, out_ref, f"paged varlen {sq}x{sk}")
    print("paged varlen through decode: ok (reference backend)")


def check_kvcache(fa2, fi):
    """flash_attn_with_kvcache over the option grid of test_flash_attn_kvcache, small sizes."""
    import itertools

    from flash_attn.layers.rotary import apply_rotary_emb as rotary

    count = 0
    grid = itertools.product([(1, 40), (3, 64), (7, 64)], [None, 8], [0.0, 0.5, 1.0], [False, True], [False, True],
                             [False, True], [False, True], [False, True], [False, True], ["mha", "gqa"])
    for (sq, sk), page, frac, interleaved, causal, local, alibi, new_kv, leftpad, mha in grid:
        if (not new_kv and frac > 0) or (leftpad and page is not None):
            continue   # FA2's own skips
        count += 1
        torch.manual_seed(count)
        batch, heads, d = 2, 4, 32
        heads_k = heads if mha == "mha" else 2
        rotary_dim = int(frac * d) // 16 * 16
        window_size = (-1, -1) if not local else torch.randint(0, sk, (2,))
        q = torch.randn(batch, sq, heads, d)
        seqlen_new = sq if (count % 2 or sq == 1) else torch.randint(1, sq + 1, (1,)).item()
        k_new = torch.randn(batch, seqlen_new, heads_k, d) if new_kv else None
        v_new = torch.randn(batch, seqlen_new, heads_k, d) if new_kv else None
        if page is None:
            k_cache, v_cache = torch.randn(batch, sk, heads_k, d), torch.randn(batch, sk, heads_k, d)
            table = None
        else:
            k_cache, v_cache, table, k_pages, v_pages, pages = fa2._generate_block_kvcache(sk, page, batch, heads_k, d,
                                                                                           "cpu", torch.float32)
        hi = (sk - (sq if (causal or local) and rotary_dim > 1 else seqlen_new) + 1) if new_kv else sk + 1
        lens = torch.randint(0 if new_kv else 1, hi, (batch,), dtype=torch.int32)
        left = (torch.cat([torch.randint(0, int(n), (1,), dtype=torch.int32) if n > 0
                           else torch.zeros(1, dtype=torch.int32) for n in lens]) if leftpad else None)
        arange = torch.arange(sk).view(1, sk)
        kpm = arange < lens.view(-1, 1) + (seqlen_new if new_kv else 0)
        if leftpad:
            kpm &= arange >= left.view(-1, 1)
        slopes = torch.rand(batch, heads) * 0.3 if alibi else None
        bias = (fa2.attn_bias_from_alibi_slopes(slopes, sq, sk, None, kpm, causal=causal, key_leftpad=left)
                if alibi else None)
        cos = sin = None
        q_ro, k_ro = q, k_new
        if rotary_dim:
            rows = sk if page is None else pages * page
            angle = torch.rand(rows, rotary_dim // 2) * 2 * math.pi
            cos, sin = torch.cos(angle), torch.sin(angle)
            if causal or local:
                q_ro = rotary(q, cos, sin, seqlen_offsets=lens, interleaved=interleaved)
            else:
                q_ro = rotary(q.reshape(batch, 1, sq * heads, d), cos, sin, seqlen_offsets=lens,
                              interleaved=interleaved).reshape(q.shape)
            k_ro = rotary(k_new, cos, sin, seqlen_offsets=lens, interleaved=interleaved)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        if new_kv:
            upd = (lens.view(-1, 1) <= arange) & (arange < lens.view(-1, 1) + seqlen_new)
            k_ref[upd] = k_ro.reshape(-1, heads_k, d)
            v_ref[upd] = v_new.reshape(-1, heads_k, d)
        out = fi.flash_attn_with_kvcache(q, k_cache if page is None else k_pages, v_cache if page is None else v_pages,
                                         k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                         cache_leftpad=left, block_table=table, causal=causal,
                                         window_size=window_size, rotary_interleaved=interleaved,
                                         alibi_slopes=slopes)
        g = heads // heads_k
        out_ref, _ = fa2.attention_ref(q_ro, k_ref.repeat_interleave(g, 2), v_ref.repeat_interleave(g, 2), None, kpm,
                                       bias, 0.0, None, causal=causal, window_size=window_size, key_leftpad=left)
        what = f"kvcache sq={sq} sk={sk} page={page} rot={rotary_dim}/{interleaved} causal={causal} local={local} " \
               f"alibi={alibi} new={new_kv} leftpad={leftpad} {mha}"
        _close(out, out_ref, what)
        if new_kv:
            if page is None:
                k_sel, v_sel = k_cache, v_cache
            else:
                flat = table.long().flatten()
                k_sel = k_pages[flat].reshape(batch, -1, heads_k, d)[:, :sk]
                v_sel = v_pages[flat].reshape(batch, -1, heads_k, d)[:, :sk]
            assert torch.allclose(k_sel, k_ref) and torch.equal(v_sel, v_ref), what
    # cache_batch_idx (FA2's grid does not reach it): rows gathered, appended, written back
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(4, 16, 2, 8), torch.randn(4, 16, 2, 8)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    q, k_new, v_new = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    k_before = k_cache.clone()
    out = fi.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, cache_batch_idx=idx)
    assert torch.equal(k_cache[2, 5], k_new[0, 0]) and torch.equal(k_cache[0, 9], k_new[1, 0])
    assert torch.equal(k_cache[1], k_before[1]) and torch.equal(k_cache[3], k_before[3])
    out_ref, _ = fa2.attention_ref(q, k_cache[idx.long()], v_cache[idx.long()], None,
                                   torch.arange(16).view(1, 16) < (lens + 1).view(-1, 1))
    _close(out, out_ref, "kvcache cache_batch_idx")
    print(f"kvcache mapping: ok ({count} option combinations + cache_batch_idx, reference backend)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", help="FA2's tests/test_flash_attn.py, for the S_dmask round trip")
    args = parser.parse_args(argv)
    check_padding()
    check_rotary()
    check_keep_mask()
    if args.tests:
        fa2 = _load_fa2(args.tests)
        check_encoding(fa2)
        fi = _use_reference_backend()
        check_dense_and_varlen(fa2, fi)
        check_probs_memo(fi)
        check_paged_varlen(fa2, fi)
        check_kvcache(fa2, fi)
    else:
        print("S_dmask encoding and the mapping checks need FA2's test file: give --tests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
