"""Hypothesis: the line parser never crashes, always names a line, and keeps its invariants."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.dataset import IMAGE_TOKEN, parse_line, validate

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
roles = st.sampled_from(["system", "user", "assistant", "bot", "", None, 3])
message = st.fixed_dictionaries({"role": roles, "content": st.text(max_size=30) | st.just(IMAGE_TOKEN) | json_values})
line = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=5)},
    optional={"images": st.lists(st.text(max_size=12) | json_values, max_size=3)},
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(line, json_values), st.integers(min_value=1, max_value=10**6))
def test_parse_line_never_crashes_and_names_the_line(obj, n):
    ex, issues = parse_line(n, json.dumps(obj))
    assert (ex is None) == bool(issues)
    assert all(i.line == n and str(i).startswith(f"line {n}:") for i in issues)
    if ex is not None:
        assert sum(m.content.count(IMAGE_TOKEN) for m in ex.messages) == len(ex.images)
        assert all(m.role in ("system", "user", "assistant") for m in ex.messages)
        assert any(m.role == "assistant" and m.content.strip() for m in ex.messages)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=8))
def test_validate_survives_arbitrary_bytes(lines):
    report = validate([b + b"\n" for b in lines], max_line_bytes=150)
    assert report.examples + len({i.line for i in report.issues}) >= 0
    assert all(1 <= i.line <= len(lines) for i in report.issues if i.line)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20).filter(str.strip)),
        min_size=1,
        max_size=4,
    )
)
def test_valid_chats_always_parse(turns):
    msgs = []
    for q, a in turns:
        msgs += [
            {"role": "user", "content": q.replace(IMAGE_TOKEN, "")},
            {"role": "assistant", "content": a.replace(IMAGE_TOKEN, "") or "x"},
        ]
    ex, issues = parse_line(1, json.dumps({"messages": msgs}))
    if any(not m["content"].strip() for m in msgs if m["role"] == "assistant"):
        assert issues
    else:
        assert not issues and [m.content for m in ex.messages] == [m["content"] for m in msgs]
