"""The examples in the rules' and steps' docstrings run (and must give what they show)."""

import doctest

import pytest

from zo_byzantine import aggregators, attacks, context, history, trusted


@pytest.mark.parametrize("module", [aggregators, attacks, context, history, trusted])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    if module is aggregators:
        assert result.attempted >= 10  # every rule and step with an example
