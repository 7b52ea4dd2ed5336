"""SamplingParams and BeamSearchParams share one validation of ``stop_token_ids`` (pure Python, no engine)."""

import pytest

from hf_paged.sampling_params import BeamSearchParams, SamplingParams

BOTH = [SamplingParams, BeamSearchParams]


@pytest.mark.parametrize("cls", BOTH)
@pytest.mark.parametrize("value,exc,match", [
    ("abc", TypeError, r"stop_token_ids must be a list of ints, got 'abc'"),
    (b"ab", TypeError, r"stop_token_ids must be a list of ints, got b'ab'"),
    (5, TypeError, r"stop_token_ids must be a list of ints, got 5"),
    ([-1], ValueError, r"stop_token_ids entry must be >= 0, got -1"),
    ([1.5], TypeError, r"stop_token_ids entry must be an int, got 1.5"),
    ([True], TypeError, r"stop_token_ids entry must be an int, got True"),
])
def test_bad_stop_token_ids_are_refused_alike(cls, value, exc, match):
    with pytest.raises(exc, match=match):
        cls(stop_token_ids=value)


@pytest.mark.parametrize("cls", BOTH)
def test_stop_token_ids_become_a_list(cls):
    assert cls(stop_token_ids=(3, 7)).stop_token_ids == [3, 7]
    assert cls(stop_token_ids=iter([2])).stop_token_ids == [2]  # a one-shot iterable is read once
    assert cls(stop_token_ids=None).stop_token_ids is None
    assert cls().stop_token_ids is None
