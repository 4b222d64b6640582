"""Body policy units: duplicate keys are always found, whatever the spelling of keys and colons."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import LimitsConfig
from gateway.filters import RequestContext
from gateway.filters.body import BodyPolicy
from gateway.routes import ROUTES

pytestmark = pytest.mark.unit

ROUTE = ROUTES[("POST", "/v1/chat/completions")]
policy = BodyPolicy(LimitsConfig())

keys = st.text(alphabet=st.sampled_from('ab:"\\\u00e9 \u003a'), min_size=0, max_size=4)
leaves = st.one_of(st.integers(-5, 5), st.booleans(), st.none(), st.text(alphabet=st.sampled_from('x:\\"\u003a '), max_size=5))
trees = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)), max_leaves=12)


def parse(raw: bytes):
    ctx = RequestContext({}, ROUTE, {})
    return policy.parse(ctx, raw), ctx


@settings(max_examples=400, deadline=None)
@given(tree=st.dictionaries(keys, trees, max_size=4), ascii_only=st.booleans(), spaced=st.booleans())
def test_bodies_without_duplicates_are_accepted(tree, ascii_only, spaced):
    tree = {**tree, "model": "m"}
    raw = json.dumps(tree, ensure_ascii=ascii_only, separators=(", ", " : ") if spaced else (",", ":")).encode()
    refusal, ctx = parse(raw)
    assert refusal is None, (raw, refusal)
    assert ctx.body == tree


@settings(max_examples=400, deadline=None)
@given(tree=st.dictionaries(keys, trees, min_size=1, max_size=4), dup_value=trees, ascii_only=st.booleans(), data=st.data())
def test_a_duplicate_key_anywhere_is_refused(tree, dup_value, ascii_only, data):
    tree = {"model": "m", **tree}
    key = data.draw(st.sampled_from(sorted(tree)))
    text = json.dumps(tree, ensure_ascii=ascii_only)
    extra = json.dumps({key: dup_value}, ensure_ascii=ascii_only)[1:-1]
    raw = (text[:-1] + ", " + extra + "}").encode()
    refusal, _ = parse(raw)
    assert refusal is not None and refusal.reason == "duplicate_key", raw
