"""Properties of the NVIDIA plugin's naming rule, over generated names."""

from __future__ import annotations

import re
import string

from hypothesis import given
from hypothesis import strategies as st

from passthrough.pci.naming import plugin_name

any_text = st.text(st.characters(blacklist_categories=("Cs",)))

# A name built from words and separators, so the expected result is known by construction.
words = st.text(string.ascii_letters + string.digits + "-[]()+,:'&#*", min_size=1, max_size=8)
blank_runs = st.text(" \t\f", min_size=1, max_size=3)
separators = st.lists(st.sampled_from(["/", ".", "_", "blank"]), min_size=1, max_size=4)


@given(any_text)
def test_the_output_is_only_letters_digits_and_underscores(name):
    assert re.fullmatch(r"[A-Za-z0-9_]*", plugin_name(name))


@given(any_text)
def test_the_rule_is_idempotent_on_its_own_output(name):
    once = plugin_name(name)
    assert plugin_name(once) == once


@given(
    st.lists(st.tuples(words, separators), min_size=1, max_size=6),
    words,
    blank_runs,
    blank_runs,
    st.data(),
)
def test_each_slash_and_dot_gives_one_underscore_and_each_blank_run_one(pairs, last, lead, trail, data):
    name, expected = lead, ""
    for word, seps in pairs:
        name += word
        expected += "".join(c for c in word if c.isalnum()).upper()
        previous = None
        for sep in seps:
            if sep == "blank":
                name += data.draw(blank_runs)
                if previous != "blank":  # adjacent blanks are one run
                    expected += "_"
            else:
                name += sep
                expected += "_"
            previous = sep
    name += last + trail
    expected += "".join(c for c in last if c.isalnum()).upper()
    assert plugin_name(name) == expected
