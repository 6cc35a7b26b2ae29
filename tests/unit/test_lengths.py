"""One rule for the longest example (kiln.dataset.LengthBound), as the API's catalog and the
engine's models state each model's position limit."""

from __future__ import annotations

import pytest

from kiln.dataset import LengthBound


def test_a_model_without_a_position_limit_takes_any_length_unless_the_job_bounds_it():
    free = LengthBound("kimi-linear-tiny", None)
    assert free.bound is None and free.problem(10**6) is None
    bounded = LengthBound("kimi-linear-tiny", None, 4096)
    assert bounded.problem(4096) is None
    assert bounded.problem(5000) == (
        "example is 5000 tokens, over max_seq_len 4096; raise hyperparameters.max_seq_len "
        "to 5000 or more (kimi-linear-tiny has no position limit)"
    )


def test_a_position_limit_is_the_default_bound_and_names_what_fits():
    tiny = LengthBound("kiln-tiny", 2048)
    assert tiny.bound == 2048 and tiny.problem(2048) is None
    assert tiny.problem(3000).endswith("shorten it: kiln-tiny takes at most 2048 tokens")
    assert (
        LengthBound("kiln-tiny", 2048, 1000)
        .problem(1500)
        .endswith("raise hyperparameters.max_seq_len to 1500 or more (kiln-tiny takes up to 2048)")
    )
    with pytest.raises(ValueError, match="max_seq_len 4096 is over kiln-tiny's position limit of 2048 tokens"):
        LengthBound("kiln-tiny", 2048, 4096)


def test_the_catalog_and_the_engine_agree_on_every_built_in_model(tmp_path):
    from api import catalog
    from engine.model.registry import ensure_builtin, load_base, position_limit

    for name, info in catalog.BASE_MODELS.items():
        ensure_builtin(name, tmp_path / name)
        assert position_limit(load_base(tmp_path / name)) == info["position_limit"], name
