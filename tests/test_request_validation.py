"""validate_request's prompt checks (engine/validation.py): every id an int in [0, vocab), bools and
floats refused, the first bad id named; the C-speed path agrees with the per-token rule."""
from __future__ import annotations

import random

import numpy as np
import pytest

from linrnn_serve.engine.errors import RequestError
from linrnn_serve.engine.validation import RequestLimits, validate_request
from linrnn_serve.sampling_params import SamplingParams

LIMITS = RequestLimits(vocab_size=300, max_model_len=4096, max_num_seqs=4)


def per_token_ok(ids) -> bool:  # the rule, written the slow way
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 300 for t in ids)


@pytest.mark.parametrize("bad", [-1, 300, 10**30, True, False, 2.0, "7", None, np.int64(5)])
def test_bad_prompt_ids_are_named(bad):
    rng = random.Random(3)
    ids = [rng.randrange(300) for _ in range(2000)]
    at = rng.randrange(len(ids))
    ids[at] = bad
    with pytest.raises(RequestError) as e:
        validate_request(ids, SamplingParams(max_tokens=4), LIMITS)
    assert e.value.param == "prompt" and repr(bad) in str(e.value)


def test_good_prompt_ids_pass_unchanged():
    rng = random.Random(4)
    for n in (1, 2, 17, 3000):
        ids = [rng.randrange(300) for _ in range(n)]
        ids[0], ids[-1] = 0, 299
        assert per_token_ok(ids)
        assert validate_request(ids, SamplingParams(max_tokens=4), LIMITS) == ids
