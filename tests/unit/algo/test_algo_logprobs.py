"""moe_rl.algo.logprobs: chunked log-probs, entropy and keep-sampling-mask (KSM) log-probs."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_rl.algo.logprobs import masked_token_logprobs, token_entropy, token_logprobs


def reference_logprobs(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)


def csr(sets: list[list[int]]):
    ids = [i for s in sets for i in s]
    offsets = [0]
    for s in sets:
        offsets.append(offsets[-1] + len(s))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)


class MaxNumelMode(TorchDispatchMode):
    """Records the largest freshly allocated tensor any aten op produces (views are not counted)."""

    def __init__(self, big: int = 0):
        super().__init__()
        self.max_numel = 0
        self.big = big
        self.num_big = 0  # allocations of at least `big` elements

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        for o in out if isinstance(out, tuple | list) else (out,):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in storages:
                self.max_numel = max(self.max_numel, o.numel())
                self.num_big += bool(self.big) and o.numel() >= self.big
        return out


# --- token_logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "temperature", "expected"),
    [
        (1, 1.0, math.log(3 / 4)),
        (0, 1.0, math.log(1 / 4)),
        (1, 2.0, math.log(math.sqrt(3) / (1 + math.sqrt(3)))),
    ],
    ids=["p=3/4", "p=1/4", "T=2"],
)
def test_token_logprobs_hand_values(token, temperature, expected):
    logits = torch.tensor([[0.0, math.log(3.0)]])
    got = token_logprobs(logits, torch.tensor([token]), temperature=temperature)
    assert got.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 3, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_logprobs_matches_log_softmax_and_its_gradient(chunk_size, dtype):
    torch.manual_seed(0)
    logits = (3 * torch.randn(10, 37)).to(dtype).requires_grad_()
    tokens = torch.randint(0, 37, (10,))
    weights = torch.randn(10)
    got = token_logprobs(logits, tokens, temperature=0.7, chunk_size=chunk_size)
    want = reference_logprobs(logits, tokens, 0.7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g_got = torch.autograd.grad((got * weights).sum(), logits)[0]
    g_want = torch.autograd.grad((want * weights).sum(), logits)[0]
    assert g_got.dtype == dtype
    torch.testing.assert_close(g_got.float(), g_want.float(), atol=1e-5, rtol=1e-3)


def test_token_logprobs_gradcheck_float64():
    torch.manual_seed(1)
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (5,))
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, tokens, 0.8, chunk_size=2), (logits,))


def test_token_logprobs_keeps_leading_dims():
    logits = torch.randn(2, 3, 5)
    tokens = torch.randint(0, 5, (2, 3))
    got = token_logprobs(logits, tokens)
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, reference_logprobs(logits, tokens))


def test_token_logprobs_forward_never_materializes_full_vocab_rows():
    logits = torch.randn(64, 100)
    tokens = torch.randint(0, 100, (64,))
    with MaxNumelMode() as mode:
        token_logprobs(logits, tokens, chunk_size=8)
    assert mode.max_numel <= 8 * 100


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"tokens": [7]}, "tokens\\[0\\] = 7"),
    ],
    ids=["temperature0", "chunk0", "token-out-of-vocab"],
)
def test_token_logprobs_rejects_bad_input(kwargs, match):
    tokens = torch.tensor(kwargs.pop("tokens", [1]))
    with pytest.raises(ValueError, match=match):
        token_logprobs(torch.zeros(1, 4), tokens, **kwargs)


# --- token_entropy ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ([0.0, 0.0, 0.0, 0.0], math.log(4)),
        ([0.0, math.log(3.0)], -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))),
        ([0.0, 0.0, -math.inf], math.log(2)),
    ],
    ids=["uniform4", "quarter-threequarters", "masked-id"],
)
def test_token_entropy_hand_values(row, expected):
    assert token_entropy(torch.tensor([row])).item() == pytest.approx(expected, abs=1e-6)


def test_token_entropy_temperature_and_gradient_match_reference():
    torch.manual_seed(2)
    logits = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    got = token_entropy(logits, temperature=1.3, chunk_size=4)
    p = torch.softmax(logits / 1.3, -1)
    want = -(p * p.log()).sum(-1)
    torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(lambda z: token_entropy(z, 1.3, 4), (logits,))


# --- masked_token_logprobs (KSM) --------------------------------------------------------------


def test_ksm_hand_value():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    ids, offsets = csr([[1, 3], [0, 1, 2]])
    got = masked_token_logprobs(logits, torch.tensor([3, 2]), ids, offsets)
    assert got[0].item() == pytest.approx(4 - math.log(math.exp(2) + math.exp(4)), abs=1e-6)
    assert got[1].item() == pytest.approx(-math.log(3), abs=1e-6)


def test_ksm_temperature_hand_value():
    logits = torch.tensor([[2.0, 4.0, 100.0]])
    ids, offsets = csr([[0, 1]])
    got = masked_token_logprobs(logits, torch.tensor([0]), ids, offsets, temperature=2.0)
    assert got.item() == pytest.approx(1 - math.log(math.exp(1) + math.exp(2)), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_ksm_with_every_id_kept_equals_log_softmax(dtype):
    torch.manual_seed(3)
    logits = torch.randn(6, 11, dtype=dtype, requires_grad=True)
    tokens = torch.randint(0, 11, (6,))
    ids, offsets = csr([list(torch.randperm(11).tolist()) for _ in range(6)])  # any order
    got = masked_token_logprobs(logits, tokens, ids, offsets, temperature=0.9)
    want = torch.log_softmax(logits / 0.9, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        torch.autograd.grad(got.sum(), logits)[0], torch.autograd.grad(want.sum(), logits)[0]
    )


def test_ksm_gradcheck_and_no_gradient_to_dropped_ids():
    torch.manual_seed(4)
    logits = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([0, 5, 2])
    ids, offsets = csr([[0, 1], [5], [2, 3, 4]])
    assert torch.autograd.gradcheck(lambda z: masked_token_logprobs(z, tokens, ids, offsets), (logits,))
    grad = torch.autograd.grad(masked_token_logprobs(logits, tokens, ids, offsets).sum(), logits)[0]
    kept = torch.zeros(3, 6, dtype=torch.bool)
    kept[0, [0, 1]] = kept[1, 5] = kept[2, [2, 3, 4]] = True
    assert torch.all(grad[~kept] == 0)
    assert grad[1, 5] == 0  # a one-id kept set has log-prob 0 whatever the logits


def test_ksm_extra_memory_is_o_of_kept_and_backward_allocates_only_the_gradient():
    vocab, num = 1000, 32
    logits = torch.randn(num, vocab, requires_grad=True)
    tokens = torch.randint(0, vocab, (num,))
    ids, offsets = csr([sorted({int(y), 1, 2, 3}) for y in tokens])
    with MaxNumelMode() as mode:
        out = masked_token_logprobs(logits, tokens, ids, offsets)
    assert mode.max_numel <= 4 * num + 1
    with MaxNumelMode(big=num * vocab) as mode:
        out.sum().backward()
    assert mode.num_big == 1  # the [N, V] gradient of the logits, nothing else


def test_token_logprobs_backward_allocates_the_gradient_and_chunks_only():
    logits = torch.randn(64, 100, requires_grad=True)
    out = token_logprobs(logits, torch.randint(0, 100, (64,)), chunk_size=8)
    with MaxNumelMode(big=16 * 100) as mode:
        out.sum().backward()
    assert mode.num_big == 1


@pytest.mark.parametrize(
    ("tokens", "sets", "offsets", "match"),
    [
        ([3, 1], [[1, 2], [1]], None, "sampled token id 3 at token position 0"),
        ([1, 2], [[1], [0, 1]], None, "sampled token id 2 at token position 1"),
        ([1], [[1]], [0, 1, 1], "length tokens\\+1"),
        ([1], [[1]], [1, 1], "start at 0"),
        ([1, 1], [[1], [1]], [0, 1, 1], "end at len\\(kept_ids\\) = 2"),
        ([1, 1, 1], [[1], [1], [1]], [0, 2, 1, 3], "non-decreasing; token position 1"),
        ([1], [[1, 9]], None, "kept_ids\\[1\\] = 9"),
    ],
    ids=[
        "token-not-kept",
        "token-not-kept-pos1",
        "offsets-length",
        "offsets-start",
        "offsets-end",
        "offsets-decreasing",
        "id-out-of-vocab",
    ],
)
def test_ksm_rejects_corrupt_masks(tokens, sets, offsets, match):
    ids, default_offsets = csr(sets)
    offsets = default_offsets if offsets is None else torch.tensor(offsets)
    with pytest.raises(ValueError, match=match):
        masked_token_logprobs(torch.zeros(len(tokens), 4), torch.tensor(tokens), ids, offsets)
