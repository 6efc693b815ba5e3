"""Row scales (``mesa_train.nn.rowscale``) computed the cheap way are bitwise the definition:
``x * exp2(k)`` equals ``torch.ldexp(x, k)``, and abs+amax equals the inf-norm, for every
dtype and exponent range the layers use (NaN, inf, zeros, subnormals included)."""
import pytest
import torch

from mesa_train.nn.rowscale import max_exponent, row_exponents, scale_rows
from mesa_train.quant import reference


def _rows(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 16, generator=g) * torch.logspace(-30, 3, 6).view(6, 1, 1)
    x[0, 0, 0], x[1, 1, 1], x[2, 2, :] = float("nan"), float("inf"), 0.0
    x[3, 0, 3] = 1e-41  # a float32 subnormal
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_scale_rows_is_bitwise_ldexp(dtype):
    x = _rows(dtype)
    top = max_exponent(dtype)
    k = torch.randint(0, top + 1, (6, 5, 1), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    k[0, 0, 0], k[1, 0, 0] = 0, top
    got, want = scale_rows(x, k), torch.ldexp(x, k)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("row_dims", [1, 2])
def test_row_exponents_equal_the_inf_norm_definition(dtype, row_dims):
    x = _rows(dtype)
    dims = tuple(range(x.dim() - row_dims, x.dim()))
    r = torch.linalg.vector_norm(x, float("inf"), dim=dims, keepdim=True, dtype=torch.float32)
    _, e = torch.frexp(reference.row_max_mean(r) / r)  # (its mean: tests/test_row_max_mean.py)
    want = (e - 1).clamp_(0, max_exponent(dtype)).to(torch.int8)
    assert torch.equal(row_exponents(x, row_dims, max_exponent(dtype)), want)
