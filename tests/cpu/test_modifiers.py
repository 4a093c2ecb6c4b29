"""User-written modifiers on the CPU: the grammar (what parses, what is refused and how the message
names it), the types, the NumPy evaluation against an independent scalar evaluation in plain Python,
the symbolic derivative against finite differences, the generated CUDA compiled by NVRTC for
sm_80 and sm_90a, and the float64 reference with modifiers against the same attention written with
the built-in options (bias, mask, softcap, ALiBi), forward and backward. Random expressions come
from a hypothesis strategy over the grammar.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from cuflash import reference
from cuflash.modifiers import MaskMod, ScoreMod
from cuflash.modifiers.check import ArgKind, check
from cuflash.modifiers.derivative import d_score
from cuflash.modifiers.numpy_eval import evaluate
from cuflash.modifiers.parse import Binary, Index, Name, Num, Unary, parse, unparse

# ----------------------------------------------------------------------------- random expressions

ARRAY_LEN = 11
KINDS = {"c": ArgKind(False, "float"), "n": ArgKind(False, "int"), "flag": ArgKind(False, "bool"),
         "tab": ArgKind(True, "float"), "ids": ArgKind(True, "int"), "bits": ArgKind(True, "bool")}


def _expr(t: str, depth: int):
    """A strategy of well-typed expression texts of type ``t``."""
    leaves = {
        "float": st.one_of(st.just("score"), st.just("c"),
                           st.floats(0, 8, allow_nan=False).map(lambda x: repr(float(x)))),
        "int": st.one_of(st.sampled_from(["b", "h", "q_idx", "kv_idx", "n"]), st.integers(0, 20).map(str)),
        "bool": st.sampled_from(["flag", "(q_idx <= kv_idx)", "(b == h)"]),
    }[t]
    if depth == 0:
        return leaves
    sub = {u: _expr(u, depth - 1) for u in ("float", "int", "bool")}
    if t == "float":
        options = [
            st.tuples(sub["float"], st.sampled_from("+-*/"), st.one_of(sub["float"], sub["int"])).map(
                lambda x: f"({x[0]} {x[1]} {x[2]})"),
            st.tuples(st.sampled_from(["tanh", "exp", "abs"]), sub["float"]).map(lambda x: f"{x[0]}({x[1]})"),
            st.tuples(st.sampled_from(["min", "max"]), sub["float"], sub["float"]).map(
                lambda x: f"{x[0]}({x[1]}, {x[2]})"),
            st.tuples(sub["bool"], sub["float"], sub["float"]).map(lambda x: f"where({x[0]}, {x[1]}, {x[2]})"),
            sub["int"].map(lambda i: f"tab[{i}]"),
            sub["float"].map(lambda x: f"(-{x})"),
        ]
    elif t == "int":
        options = [
            st.tuples(sub["int"], st.sampled_from(["+", "-", "*", "%"]), sub["int"]).map(
                lambda x: f"({x[0]} {x[1]} {x[2]})"),
            st.tuples(st.sampled_from(["floor_div", "min", "max"]), sub["int"], sub["int"]).map(
                lambda x: f"{x[0]}({x[1]}, {x[2]})"),
            sub["int"].map(lambda i: f"ids[{i}]"),
            sub["int"].map(lambda i: f"abs({i})"),
        ]
    else:
        options = [
            st.tuples(sub["float"], st.sampled_from(["<", "<=", ">", ">="]), sub["float"]).map(
                lambda x: f"({x[0]} {x[1]} {x[2]})"),
            st.tuples(sub["int"], st.sampled_from(["==", "!="]), sub["int"]).map(lambda x: f"({x[0]} {x[1]} {x[2]})"),
            st.tuples(sub["bool"], st.sampled_from(["&&", "||"]), sub["bool"]).map(lambda x: f"({x[0]} {x[1]} {x[2]})"),
            sub["bool"].map(lambda x: f"(!{x})"),
            sub["int"].map(lambda i: f"bits[{i}]"),
        ]
    return st.one_of(leaves, *options)


def _env(rng, shape=(2, 3, 4, 5)):
    env = {"c": np.float64(rng.uniform(-2, 2)), "n": np.int64(rng.integers(-5, 6)), "flag": bool(rng.integers(2)),
           "tab": rng.uniform(-3, 3, ARRAY_LEN), "ids": rng.integers(-4, 9, ARRAY_LEN).astype(np.int64),
           "bits": rng.integers(0, 2, ARRAY_LEN).astype(bool)}
    B, H, Sq, Sk = shape
    env.update(b=np.arange(B).reshape(B, 1, 1, 1), h=np.arange(H).reshape(1, H, 1, 1),
               q_idx=np.arange(Sq).reshape(1, 1, Sq, 1), kv_idx=np.arange(Sk).reshape(1, 1, 1, Sk),
               score=rng.standard_normal(shape))
    return env


# ----------------------------------------------------------------------------- an independent evaluator

def _scalar(node, env):
    """The value of ``node`` at one point, in plain Python (math, //, %), written from the grammar's
    rules independently of cuflash.modifiers.numpy_eval."""
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Name):
        value = env[node.id]
        return value.item() if hasattr(value, "item") else value
    if isinstance(node, Index):
        i = _scalar(node.index, env)
        array = env[node.array]
        return array[i].item() if 0 <= i < len(array) else array.dtype.type(0).item()
    if isinstance(node, Unary):
        x = _scalar(node.operand, env)
        return (not x) if node.op == "!" else (-x if node.op == "-" else x)
    if isinstance(node, Binary):
        a, b = _scalar(node.left, env), _scalar(node.right, env)
        op = node.op
        if op == "/":
            a, b = float(a), float(b)
            if b == 0:
                return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1, b)
            return a / b
        if op == "%":
            return 0 if b == 0 else a % b
        ops = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "<": lambda: a < b, "<=": lambda: a <= b,
               ">": lambda: a > b, ">=": lambda: a >= b, "==": lambda: a == b, "!=": lambda: a != b,
               "&&": lambda: a and b, "||": lambda: a or b}
        return ops[op]()
    args = [_scalar(a, env) for a in node.args]
    f = node.function
    if f == "where":
        return args[1] if args[0] else args[2]
    if f == "floor_div":
        return 0 if args[1] == 0 else args[0] // args[1]
    if f in ("min", "max"):
        if any(isinstance(x, float) and math.isnan(x) for x in args):
            return math.nan
        return min(args) if f == "min" else max(args)
    if f == "abs":
        return abs(args[0])
    x = float(args[0])
    if f == "tanh":
        return math.tanh(x)
    if f == "exp":
        return math.exp(x) if x < 700 else math.inf
    if f == "log":
        return math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan)
    return math.sqrt(x) if x >= 0 else math.nan


def _at(env, point):
    b, h, i, j = point
    picked = dict(env)
    picked.update(b=b, h=h, q_idx=i, kv_idx=j, score=float(env["score"][point]))
    return picked


def _same(x, y) -> bool:
    x, y = float(x), float(y)
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= 1e-12 * max(1.0, abs(x), abs(y))


# ----------------------------------------------------------------------------- grammar

@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(text=st.sampled_from(["float", "int", "bool"]).flatmap(lambda t: _expr(t, 3)), seed=st.integers(0, 2**31))
def test_numpy_evaluation_matches_a_scalar_evaluation(text, seed):
    node = parse(text)
    assert parse(unparse(node)) == node, "the canonical text must parse back to the same tree"
    check(node, KINDS, "test")
    env = _env(np.random.default_rng(seed))
    values = np.broadcast_to(evaluate(node, env), env["score"].shape)
    rng = np.random.default_rng(seed + 1)
    for _ in range(6):
        point = tuple(int(rng.integers(n)) for n in env["score"].shape)
        want = _scalar(node, _at(env, point))
        assert _same(values[point], want), f"{text} at {point}: numpy {values[point]!r}, python {want!r}"


@pytest.mark.parametrize("text, token", [
    ("score +", "the end"), ("score ** 2", "'*'"), ("__import__('os')", '"\'"'), ("a.b", "'.'"),
    ("q_idx < kv_idx < 3", "'<'"), ("foo(score)", "'foo'"), ("score[1]", "'['"), ("(score", "the end"),
    ("score)", "')'"), ("tanh(score, 1.0)", "'tanh'"), ("1 2", "'2'"),
    ("99999999999999999999", "'99999999999999999999'"),
    ("", "empty"), ("score;", "';'"),
])
def test_malformed_expressions_are_refused_naming_the_token(text, token):
    with pytest.raises(ValueError, match="score_mod") as caught:
        ScoreMod(text)
    assert token in str(caught.value)


@pytest.mark.parametrize("text, words", [
    ("score && 1", "takes bools"), ("where(1, 2, 3)", "condition must be a bool"), ("q_idx % 2.0", "takes ints"),
    ("!score", "takes a bool"), ("b == (q_idx < 3)", "compares a bool"), ("nope + score", "unknown name 'nope'"),
    ("tab + score", "index it"), ("c[1] + score", "scalar"), ("tab[0.5]", "must be an int"), ("score < 1.0", "bool"),
    ("floor_div(score, 2)", "takes ints"),
])
def test_type_errors_name_the_subexpression(text, words):
    with pytest.raises(ValueError, match="score_mod") as caught:
        ScoreMod(text, c=1.0, tab=np.zeros(3, np.float32))
    assert words in str(caught.value)


def test_arguments_and_mask_rules():
    with pytest.raises(ValueError, match="taken by the grammar"):
        ScoreMod("score", q_idx=1)
    with pytest.raises(TypeError, match="dtype complex64"):
        ScoreMod("score", t=np.zeros(2, np.complex64))
    with pytest.raises(TypeError, match="must be a bool, int, float or an array"):
        ScoreMod("score", t="text")
    with pytest.raises(ValueError, match="at most 8 array"):
        ScoreMod("score", **{f"a{i}": np.zeros(1) for i in range(9)})
    with pytest.raises(ValueError, match="cannot read score"):
        MaskMod("score > 0.0")
    with pytest.raises(ValueError, match="must give a bool"):
        MaskMod("q_idx - kv_idx")
    with pytest.raises(ValueError, match="gives a bool"):
        ScoreMod("q_idx < kv_idx")


def test_integer_rules_match_python_and_zero_divisors_give_zero():
    rng = np.random.default_rng()
    a, b = rng.integers(-50, 50, 200), rng.integers(-7, 8, 200)
    env = {"q_idx": a, "kv_idx": b}
    for text, op in (("floor_div(q_idx, kv_idx)", lambda x, y: 0 if y == 0 else x // y),
                     ("q_idx % kv_idx", lambda x, y: 0 if y == 0 else x % y)):
        got = evaluate(parse(text), env)
        assert got.tolist() == [op(int(x), int(y)) for x, y in zip(a, b)], text


def test_array_reads_outside_give_zero_and_nan_propagates_through_min_max():
    m = ScoreMod("score + tab[q_idx - 2]", tab=np.array([5.0, 7.0]))
    out = m.reference(np.zeros((1, 1, 5, 1)))[0, 0, :, 0]
    assert out.tolist() == [0.0, 0.0, 5.0, 7.0, 0.0]
    env = {"score": np.array([np.nan, 1.0]), "q_idx": np.array([0, 0])}
    assert np.isnan(evaluate(parse("min(score, 2.0)"), env)).tolist() == [True, False]
    assert np.isnan(evaluate(parse("max(0.0, score)"), env)).tolist() == [True, False]


def test_the_key_follows_the_compiled_code_not_the_scalar_values():
    tab = np.zeros(4, np.float32)
    key = ScoreMod("score * c + tab[q_idx]", c=1.0, tab=tab).key
    assert ScoreMod("score*c+tab[q_idx]", c=2.5, tab=np.ones(9, np.float32)).key == key, "spacing, values, sizes"
    assert ScoreMod("score * c + tab[q_idx]", c=1.0, tab=tab.astype(np.float16)).key != key, "a dtype is compiled in"
    assert ScoreMod("score * c + tab[kv_idx]", c=1.0, tab=tab).key != key
    assert ScoreMod("score * c + tab[q_idx]", c=1, tab=tab).key != key, "an int scalar is another type"
    assert MaskMod("q_idx >= kv_idx").key != MaskMod("q_idx > kv_idx").key


# ----------------------------------------------------------------------------- derivative

def _smooth(depth):
    """Float expressions without kinks or int parts (where finite differences are the derivative)."""
    if depth == 0:
        return st.one_of(st.just("score"), st.just("c"), st.floats(0.5, 3).map(lambda x: repr(float(x))))
    sub = _smooth(depth - 1)
    return st.one_of(
        sub,
        st.tuples(sub, st.sampled_from("+-*"), sub).map(lambda x: f"({x[0]} {x[1]} {x[2]})"),
        st.tuples(sub, sub).map(lambda x: f"({x[0]} / (2.0 + tanh({x[1]})))"),
        st.tuples(st.sampled_from(["tanh", "exp"]), sub).map(lambda x: f"{x[0]}({x[1]} / 4.0)"),
        sub.map(lambda x: f"sqrt(1.0 + {x} * {x})"),
        sub.map(lambda x: f"log(2.0 + tanh({x}))"),
    )


@settings(max_examples=120, deadline=None)
@given(text=_smooth(3), seed=st.integers(0, 2**31))
def test_the_derivative_matches_finite_differences(text, seed):
    node = parse(text)
    rng = np.random.default_rng(seed)
    score, step = rng.uniform(-1.5, 1.5, 32), 1e-6
    env = {"c": np.float64(rng.uniform(-1, 1))}
    value = lambda s: np.broadcast_to(evaluate(node, dict(env, score=s)), s.shape)   # noqa: E731
    derivative = np.broadcast_to(evaluate(d_score(node), dict(env, score=score)), score.shape)
    numeric = (value(score + step) - value(score - step)) / (2 * step)
    assume(np.all(np.isfinite(numeric)) and np.all(np.abs(value(score)) < 1e6))
    np.testing.assert_allclose(derivative, numeric, rtol=1e-5, atol=1e-5 * (1 + np.abs(numeric).max()))


def test_a_derivative_of_exactly_one_needs_no_grad():
    tab = np.zeros(3)
    for text in ("score + tab[q_idx]", "score - 0.5 * abs(q_idx - kv_idx)", "(score * 1.0) + c", "score"):
        m = ScoreMod(text, tab=tab, c=1.0)
        assert not m.needs_grad and m.gradient() == Num(1), text
    m = ScoreMod("score * c", c=2.0)
    assert m.needs_grad
    with pytest.raises(ValueError, match=r"pass grad=, e.g. grad='c'"):
        m.gradient()
    assert not ScoreMod("score * c", grad="c", c=2.0).needs_grad


# ----------------------------------------------------------------------------- CUDA

def _compile(source: str, arch: str):
    from cuflash._build import compile as _compile_mod, nvrtc

    try:
        nvrtc.version()
    except Exception as exc:   # no libnvrtc: nothing to compile with
        pytest.skip(f"NVRTC is not available: {exc}")
    return nvrtc.compile_to_cubin(source, "user_mod_test.cu", ["-std=c++17", f"-arch={arch}",
                                                                f"-I{_compile_mod.CUDA_SRC}"])


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(st.sampled_from(["float", "int"]).flatmap(lambda t: _expr(t, 3)), min_size=24, max_size=24),
       masks=st.lists(_expr("bool", 3), min_size=8, max_size=8))
def test_generated_cuda_compiles_for_sm80_and_sm90a(texts, masks):
    args = dict(c=1.0, n=3, flag=True, tab=np.zeros(ARRAY_LEN, np.float16), ids=np.zeros(ARRAY_LEN, np.int32),
                bits=np.zeros(ARRAY_LEN, np.bool_))
    mods = [ScoreMod(t, grad="1.0 + score", **args) for t in texts] + [MaskMod(t, **args) for t in masks]
    body = "\n".join(m.cuda_source(f"f{i}") for i, m in enumerate(mods))
    calls = " + ".join(f"f{i}(x, b, h, i, j, args)" if isinstance(m, ScoreMod) else f"float(f{i}(b, h, i, j, args))"
                       for i, m in enumerate(mods))
    source = (f'#include "user_mod.cuh"\n{body}\n'
              'extern "C" __global__ void probe(float* out, const float* x_in, cuflash::user::Args args) {\n'
              '    long long b = blockIdx.x, h = blockIdx.y, i = threadIdx.x, j = threadIdx.y;\n'
              f'    float x = x_in[threadIdx.x];\n    out[threadIdx.x] = {calls};\n}}\n')
    for arch in ("sm_80", "sm_90a"):
        cubin, _ = _compile(source, arch)
        assert cubin[:4] == b"\x7fELF"


def test_the_generated_code_holds_no_user_text():
    m = ScoreMod("score + weird_name[q_idx] * 1e-3", weird_name=np.zeros(3, np.float32))
    source = m.cuda_source()
    assert "weird_name" not in source and "read_f32(args, 0" in source and "0.001f" in source


# ----------------------------------------------------------------------------- the reference

def _qkv(rng, B=2, Sq=7, Sk=9, Hq=4, Hk=2, D=16):
    return (rng.standard_normal((B, Sq, Hq, D)), rng.standard_normal((B, Sk, Hk, D)),
            rng.standard_normal((B, Sk, Hk, D)), rng.standard_normal((B, Sq, Hq, D)))


def _close(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_reference_modifiers_equal_the_built_in_options():
    rng = np.random.default_rng()
    q, k, v, dout = _qkv(rng)
    B, Sq, Hq, _ = q.shape
    Sk = k.shape[1]
    # A relative-position bias table equals the dense bias it stands for, forward and backward.
    table = rng.standard_normal(Hq * (Sq + Sk))
    rel = ScoreMod(f"score + table[h * {Sq + Sk} + q_idx - kv_idx + {Sk}]", table=table)
    i, j, h = np.arange(Sq)[:, None], np.arange(Sk)[None, :], np.arange(Hq)[:, None, None]
    dense = table[h * (Sq + Sk) + i - j + Sk][None]
    _close(reference.attention_forward(q, k, v, score_mod=rel, causal=True),
           reference.attention_forward(q, k, v, bias=dense, causal=True))
    _close(reference.attention_backward(dout, q, k, v, score_mod=rel, causal=True),
           reference.attention_backward(dout, q, k, v, bias=dense, causal=True))
    # A document mask equals the dense mask.
    doc = np.sort(rng.integers(0, 3, Sk))
    docs = MaskMod("doc[q_idx + 2] == doc[kv_idx]", doc=doc)
    dense_mask = (doc[np.arange(Sq)[:, None] + 2] == doc[None, :])[None, None]
    _close(reference.attention_forward(q, k, v, mask_mod=docs), reference.attention_forward(q, k, v, mask=dense_mask))
    _close(reference.attention_backward(dout, q, k, v, mask_mod=docs),
           reference.attention_backward(dout, q, k, v, mask=dense_mask))
    # softcap and ALiBi as score modifiers equal the built-in ones (the softcap needs its grad).
    cap = ScoreMod("c * tanh(score / c)", grad="1.0 - tanh(score / c) * tanh(score / c)", c=5.0)
    _close(reference.attention_forward(q, k, v, score_mod=cap), reference.attention_forward(q, k, v, softcap=5.0))
    _close(reference.attention_backward(dout, q, k, v, score_mod=cap),
           reference.attention_backward(dout, q, k, v, softcap=5.0))
    slopes = rng.uniform(0.1, 1, Hq)
    alibi = ScoreMod(f"score - slopes[h] * abs(q_idx + {Sk - Sq} - kv_idx)", slopes=slopes)
    _close(reference.attention_forward(q, k, v, score_mod=alibi, causal=True),
           reference.attention_forward(q, k, v, alibi_slopes=slopes, causal=True))
    _close(reference.attention_backward(dout, q, k, v, score_mod=alibi, causal=True),
           reference.attention_backward(dout, q, k, v, alibi_slopes=slopes, causal=True))
    with pytest.raises(ValueError, match="pass grad="):
        reference.attention_backward(dout, q, k, v, score_mod=ScoreMod("2.0 * score"))


# ----------------------------------------------------------------------------- what models write

def _t5_buckets(relative, num_buckets=32, max_distance=128):
    """T5's bidirectional relative-position bucket of each (query - key) distance, in NumPy."""
    half = num_buckets // 2
    bucket = (relative < 0).astype(np.int64) * half
    n = np.abs(relative)
    max_exact = half // 2
    large = max_exact + (np.log(np.maximum(n, 1) / max_exact) / np.log(max_distance / max_exact)
                         * (half - max_exact)).astype(np.int64)
    return bucket + np.where(n < max_exact, n, np.minimum(large, half - 1))


def test_the_modifiers_models_use_equal_their_dense_forms():
    rng = np.random.default_rng()
    q, k, v, dout = _qkv(rng, B=2, Sq=12, Sk=12, Hq=4, Hk=2)
    S, Hq = q.shape[1], q.shape[2]
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    # T5 relative-position buckets: a bucket index per distance and a learned table per (head, bucket).
    nb = 32
    buckets = _t5_buckets(np.arange(-S + 1, S))              # distance q - k + S - 1 -> bucket
    table = rng.standard_normal(Hq * nb)
    t5 = ScoreMod(f"score + table[h * {nb} + buckets[q_idx - kv_idx + {S - 1}]]", table=table, buckets=buckets)
    dense = table[np.arange(Hq)[:, None, None] * nb + buckets[i - j + S - 1]][None]
    _close(reference.attention_forward(q, k, v, score_mod=t5), reference.attention_forward(q, k, v, bias=dense))
    # Prefix-LM: the prefix sees itself whole, the rest causally.
    prefix = 5
    plm = MaskMod("kv_idx < prefix || kv_idx <= q_idx", prefix=prefix)
    _close(reference.attention_forward(q, k, v, mask_mod=plm),
           reference.attention_forward(q, k, v, mask=((j < prefix) | (j <= i))[None, None]))
    # A sliding window with a softcap (Gemma-2): the built-in window and softcap as modifiers.
    window = ScoreMod("c * tanh(score / c)", grad="1.0 - tanh(score / c) * tanh(score / c)", c=30.0)
    sliding = MaskMod("kv_idx <= q_idx && q_idx - kv_idx < w", w=4)
    _close(reference.attention_forward(q, k, v, score_mod=window, mask_mod=sliding),
           reference.attention_forward(q, k, v, causal=True, window=(3, 0), softcap=30.0))
    _close(reference.attention_backward(dout, q, k, v, score_mod=window, mask_mod=sliding),
           reference.attention_backward(dout, q, k, v, causal=True, window=(3, 0), softcap=30.0))
    # A tree of draft tokens (speculative decoding): the cached prefix, then each draft token sees
    # its ancestors in the tree (a flat ancestor bitmap).
    drafts = 6
    parents = [-1, 0, 0, 1, 1, 2]
    ancestors = np.eye(drafts, dtype=bool)
    for t in range(drafts):
        p = parents[t]
        while p >= 0:
            ancestors[t, p] = True
            p = parents[p]
    cached = S - drafts
    tree = MaskMod(f"kv_idx < {cached} || (q_idx >= {cached} && "
                   f"anc[(q_idx - {cached}) * {drafts} + kv_idx - {cached}])", anc=ancestors.reshape(-1))
    dense_tree = (j < cached) | ((i >= cached) & np.pad(ancestors, ((cached, 0), (cached, 0)))[i, j])
    _close(reference.attention_forward(q, k, v, mask_mod=tree),
           reference.attention_forward(q, k, v, mask=dense_tree[None, None]))
