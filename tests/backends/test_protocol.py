"""The protocol's helpers: common_prefix against its definition."""

from hypothesis import given, strategies as st

from specdecode.backends.protocol import common_prefix

tokens = st.lists(st.integers(0, 3), max_size=12)


@given(tokens, tokens, st.booleans())
def test_common_prefix_is_the_length_of_the_shared_start(a, b, as_tuple):
    expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix(tuple(a) if as_tuple else a, b) == expected  # a tuple and a list compare by value
    assert common_prefix(a, a + b) == len(a)  # one a prefix of the other: the fast path
