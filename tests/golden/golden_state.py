"""The values every golden checkpoint holds, generated from scratch (never read back from a checkpoint).

Both ``make_golden.py`` (run with a released version's code) and ``tests/test_golden.py`` (run
with today's code) import this module, so the expected values of the test are not results of
the code under test. Everything is deterministic on any platform and torch version: numbers
come from Python's own ``random.Random`` (its sequence for a given seed is fixed by CPython) and
are turned into tensors with ``torch.tensor``; nothing here depends on torch's RNG or on
floating-point kernels (the optimizer state is set, not computed by ``optimizer.step()``).

Keep this module stable: changing a value makes every committed golden checkpoint fail.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch
from torch import nn

__all__ = [
    "ITERATION",
    "plain_state",
    "shard_state",
    "float_state",
    "placeholder",
    "training_objects",
    "assert_same",
    "assert_tensor_bits",
]

#: The iteration of the Checkpointer step in every golden set.
ITERATION = 7


def _floats(rng: random.Random, n: int) -> list[float]:
    return [rng.uniform(-4.0, 4.0) for _ in range(n)]


def _fp32(rng: random.Random, *shape: int) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.tensor(_floats(rng, n), dtype=torch.float32).reshape(shape)


def plain_state() -> dict[str, Any]:
    """The state dict of every golden DCP checkpoint: several dtypes, special values, byte items."""
    rng = random.Random(20_0001)
    w = _fp32(rng, 5, 7)
    flat = w.view(-1)
    flat[0], flat[1], flat[2], flat[3] = float("nan"), float("inf"), float("-inf"), -0.0
    flat[4] = 1e-45  # the smallest fp32 subnormal
    bf16 = torch.tensor(_floats(rng, 24), dtype=torch.float32).to(torch.bfloat16).reshape(6, 4)
    ids = torch.tensor(
        [rng.randrange(-(1 << 63), 1 << 63) for _ in range(9)] + [(1 << 63) - 1, -(1 << 63)], dtype=torch.int64
    )
    mask = torch.tensor([rng.random() < 0.5 for _ in range(15)], dtype=torch.bool).reshape(3, 5)
    return {
        "w_fp32": w,
        "w_bf16": bf16,
        "ids": ids,
        "mask": mask,
        "scalar": torch.tensor(rng.uniform(-1.0, 1.0), dtype=torch.float32),
        "nested": {"inner": _fp32(rng, 3), "deeper": {"bias": _fp32(rng, 2, 2)}},
        # Byte items (non-tensor values), as an optimizer's param_groups and a trainer's config.
        "param_groups": [
            {"lr": 0.001, "betas": (0.9, 0.999), "weight_decay": 0.01, "params": [0, 1], "name": "golden"}
        ],
        "note": "golden checkpoint \u00e9\u4e2d",
        "counts": [1, 2, 3],
        "config": {"depth": 3, "act": "gelu", "ratio": 0.5, "flags": {"amp": True, "seed": None}},
    }


def shard_state() -> dict[str, torch.Tensor]:
    """Full tensors of the 2-rank sharded checkpoint (each rank saves its row block of them)."""
    rng = random.Random(20_0002)
    return {
        "rows": _fp32(rng, 7, 3),  # 7 rows: torch.chunk gives ranks 4 and 3
        "rows_bf16": torch.tensor(_floats(rng, 6 * 5), dtype=torch.float32).to(torch.bfloat16).reshape(6, 5),
        "rows_i64": torch.tensor([rng.randrange(-(1 << 40), 1 << 40) for _ in range(10)], dtype=torch.int64),
    }


def _float_bits(rng: random.Random, n: int, exp_bits: int, man_bits: int, signed: bool) -> list[int]:
    """Bit patterns of ``n`` weight-like floats (1 sign bit if ``signed``, ``exp_bits`` exponent bits and
    ``man_bits`` mantissa bits): exponents a few steps below 2^-5, clustered as trained weights' are;
    integers only, so identical everywhere."""
    bias = (1 << (exp_bits - 1)) - 1
    out = []
    for _ in range(n):
        exponent = max(1, bias - 5 - min(rng.randrange(16), rng.randrange(16), rng.randrange(16)))
        sign = rng.getrandbits(1) if signed else 0
        out.append(sign << (exp_bits + man_bits) | exponent << man_bits | rng.getrandbits(man_bits))
    return out


def float_state() -> dict[str, torch.Tensor]:
    """Float tensors large and weight-like enough for the codec to group and compress their frames
    (``plain_state``'s are so small that every frame is stored raw)."""
    rng = random.Random(20_0003)

    def tensor(bits: list[int], int_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
        width = torch.empty(0, dtype=int_dtype).element_size() * 8
        signed = [b - (1 << width) if b >> (width - 1) else b for b in bits]  # as the signed int of that width
        return torch.tensor(signed, dtype=int_dtype).view(dtype)

    return {
        "fp32": tensor(_float_bits(rng, 6000, 8, 23, True), torch.int32, torch.float32).reshape(60, 100),
        "bf16": tensor(_float_bits(rng, 6000, 8, 7, True), torch.int16, torch.bfloat16).reshape(60, 100),
        "fp16": tensor(_float_bits(rng, 2000, 5, 10, True), torch.int16, torch.float16),
        "fp64": tensor(_float_bits(rng, 1500, 11, 52, True), torch.int64, torch.float64),
        "exp_avg_sq": tensor(_float_bits(rng, 3000, 8, 23, False), torch.int32, torch.float32),
    }


def placeholder(value: Any) -> Any:
    """A load target shaped like ``value``: tensors zeroed, other leaves ``None`` (so a load must fill them)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: placeholder(v) for k, v in value.items()}
    if isinstance(value, list):
        return [placeholder(v) for v in value]
    return None


class GoldenNet(nn.Module):
    """The model of the Checkpointer step: fp32 and bf16 parameters, an int64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.emb = nn.Parameter(torch.zeros(5, 2, dtype=torch.bfloat16))
        self.register_buffer("seen", torch.zeros(2, dtype=torch.int64))


def training_objects(filled: bool = True) -> tuple[GoldenNet, torch.optim.Optimizer, Any]:
    """(model, AdamW, StepLR): with ``filled`` the golden training state, else fresh objects with other values."""
    model = GoldenNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if not filled:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.25)
        return model, opt, sched
    rng = random.Random(20_0003)
    with torch.no_grad():
        model.fc.weight.copy_(_fp32(rng, 3, 4))
        model.fc.bias.copy_(_fp32(rng, 3))
        model.emb.copy_(_fp32(rng, 5, 2).to(torch.bfloat16))
        model.seen.copy_(torch.tensor([ITERATION, 1 << 40]))
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.tensor(float(ITERATION)),
            "exp_avg": _fp32(rng, *p.shape).to(p.dtype),
            "exp_avg_sq": _fp32(rng, *p.shape).abs().to(p.dtype),
        }
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore")
        for _ in range(3):
            sched.step()
    return model, opt, sched


def assert_tensor_bits(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    assert isinstance(got, torch.Tensor), f"{where}: got {type(got).__name__}, not a tensor"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    a = got.detach().contiguous().reshape(-1).view(torch.uint8)
    b = want.detach().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a, b), f"{where}: bytes differ"


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Recursive bit-exact comparison of a loaded value with the generated one (types included)."""
    if isinstance(want, torch.Tensor):
        assert_tensor_bits(got, want, where)
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__} ({got!r})"
    if isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"
