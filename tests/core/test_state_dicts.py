import numpy as np
import pytest
import torch

from mima.core.errors import MimaError
from mima.core.state_dicts import check_compatible, cosine_matrix, difference, mean_off_diagonal, mean_state_dict


def _random_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.randn(3, generator=g),
        "steps": torch.tensor(seed, dtype=torch.int64),
    }


def test_mean_state_dict_matches_numpy_and_copies_integers():
    states = [_random_state(s) for s in range(3)]
    merged = mean_state_dict(states)
    for key in ("w", "b"):
        expected = np.mean([s[key].numpy() for s in states], axis=0)
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-6, atol=1e-7)
    assert int(merged["steps"]) == 0  # integer tensors come from the first input


def test_mean_of_bfloat16_accumulates_in_float32():
    states = [{"x": torch.full((8,), 1.0 + i / 128, dtype=torch.bfloat16)} for i in range(3)]
    merged = mean_state_dict(states)
    assert merged["x"].dtype == torch.bfloat16
    assert float(merged["x"][0]) == pytest.approx(1.0 + 1 / 128, abs=1e-2)


def test_cosine_matrix_matches_flattened_numpy_cosine():
    vectors = [_random_state(s) for s in range(4)]
    cos = cosine_matrix(vectors, ["w", "b"]).numpy()
    flat = np.stack([np.concatenate([v["w"].numpy().ravel(), v["b"].numpy().ravel()]) for v in vectors])
    norms = np.linalg.norm(flat, axis=1)
    np.testing.assert_allclose(cos, flat @ flat.T / np.outer(norms, norms), rtol=1e-6)
    off = cos[~np.eye(4, dtype=bool)].mean()
    assert mean_off_diagonal(torch.from_numpy(cos)) == pytest.approx(off)


def test_cosine_of_zero_vector_is_zero():
    vectors = [{"w": torch.zeros(3)}, {"w": torch.ones(3)}]
    assert cosine_matrix(vectors, ["w"])[0, 1] == 0


def test_difference_is_elementwise():
    a, b = _random_state(1), _random_state(2)
    diff = difference(a, b)
    assert set(diff) == {"w", "b"}
    torch.testing.assert_close(diff["w"], a["w"] - b["w"])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop("b"), "key 'b' is in first.safetensors but not in second.safetensors"),
        (lambda s: s.update(extra=torch.zeros(1)), "key 'extra' is in second.safetensors but not in first.safetensors"),
        (lambda s: s.update(w=torch.zeros(3, 4)), "key 'w': shape (4, 3) in first.safetensors but (3, 4) in second"),
        (lambda s: s.update(b=torch.zeros(3, dtype=torch.float64)), "key 'b': dtype torch.float32 in first"),
    ],
)
def test_check_compatible_names_key_and_files(change, message):
    first, second = _random_state(0), _random_state(1)
    change(second)
    with pytest.raises(MimaError) as error:
        check_compatible({"first.safetensors": first, "second.safetensors": second})
    assert message in str(error.value)
