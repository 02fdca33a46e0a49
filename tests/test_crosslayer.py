"""Cross-layer methods (SqueezeAttention, ChunkKV): the model-level hooks shared by them."""

import pytest

from velox.registry import get_method


@pytest.mark.parametrize("key,shared,a,b", [("squeeze", "strength", 0.3, 0.6),
                                            ("chunkkv", "reuse_layers", 1, 2)])
def test_model_init_refuses_layers_that_disagree_on_a_model_level_parameter(key, shared, a, b):
    init = get_method(key).model_init
    with pytest.raises(ValueError, match=f"layers disagree on {shared}"):
        init([{shared: a}, {shared: b}])
    with pytest.raises(ValueError, match=f"{key} needs at least one layer"):
        init([])
    init([{shared: a}, {shared: a}])  # agreeing layers are accepted
