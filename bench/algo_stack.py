"""The whole correction stack vs a plain PPO loss on the same tensors, in one process.

    python bench/algo_stack.py            # 4k tokens, vocab 32k, kept 200, fp32 CPU
    python bench/algo_stack.py --quick    # 1k tokens
    python bench/algo_stack.py --device cuda                # vocab 152k, bf16, tokens sized to the GPU

On CUDA the default token count is sized to the GPU: the baseline's full-vocabulary fp32
``log_softmax`` is the largest footprint of the bench (the stack path's chunked passes need only
the [tokens, vocab] gradient), so the peak is estimated from the shapes (`estimate_peak_bytes`:
the logits and π_old's logits, the fp32 log-softmax output autograd keeps, its gradient and the
gradient of its input, ≈ 16 bytes per logit in bf16) and the largest power-of-two token count
whose estimate stays below 60 % (``--mem-fraction``) of the device's total memory is used:
16,384 tokens at vocab 152,064 on an 80 GB H100 (≈ 37 GiB), 32,768 on a 141 GB H200. The
estimate and the choice are printed; ``--tokens`` overrides it.

baseline  = full-vocab ``log_softmax``+gather log-probs (π_θ with grad, π_old without) →
            ``ppo_clip`` (token-mean) → backward.
stack     = KSM log-probs (π_θ and π_old) + full-vocabulary entropy of π_old (chunked) +
            token TIS + IcePop + OPSM + ESPO (with those weights/masks) + mismatch
            diagnostics → backward.
Rows: the whole step (logits → loss → gradient of the logits), the loss math alone on
precomputed log-probs (PPO-clip vs TIS + IcePop + OPSM + ESPO + diagnostics), and the ESPO
entropy pass alone. Ratios are stack / baseline. Memory method: see bench/algo_common.py.
"""

from __future__ import annotations

import torch
from algo_common import base_parser, fmt_bytes, peak_extra_bytes, ratio, resolve_device, time_it

from moe_rl.algo import advantages, corrections, diagnostics, objectives
from moe_rl.algo.logprobs import masked_token_logprobs, token_entropy

TEMPERATURE, RESPONSE_LEN, GROUP = 0.8, 256, 8


def make_batch(num: int, vocab: int, kept: int, dtype, device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    old_logits = 4 * torch.randn(num, vocab, generator=g, device=device, dtype=dtype)
    logits = old_logits + 0.05 * torch.randn(num, vocab, generator=g, device=device, dtype=dtype)
    top = torch.topk(old_logits, kept, dim=-1).indices
    tokens = top.gather(1, torch.randint(0, kept, (num, 1), generator=g, device=device)).squeeze(1)
    kept_ids, offsets = top.reshape(-1).contiguous(), torch.arange(num + 1, device=device) * kept
    num_seqs = max(1, num // RESPONSE_LEN)
    seq_ids = (torch.arange(num, device=device) * num_seqs) // num
    rewards = (torch.rand(num_seqs, generator=g, device=device) > 0.5).float()
    adv = advantages.grpo(rewards, torch.arange(num_seqs, device=device) // GROUP)[seq_ids]
    with torch.no_grad():
        old_ksm = masked_token_logprobs(old_logits, tokens, kept_ids, offsets, TEMPERATURE)
    rollout_logp = old_ksm + 0.02 * torch.randn(num, generator=g, device=device)
    return {
        "logits": logits.requires_grad_(), "old_logits": old_logits, "tokens": tokens, "kept_ids": kept_ids,
        "offsets": offsets, "seq_ids": seq_ids, "num_seqs": num_seqs, "advantages": adv,
        "loss_mask": torch.ones(num, dtype=torch.bool, device=device), "rollout_logp": rollout_logp, "vocab": vocab,
    }  # fmt: skip


def full_logp(logits, tokens):
    return torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(1, tokens[:, None]).squeeze(1)


def ppo_loss(b, logp, old_logp):
    return objectives.ppo_clip(
        logp, old_logp, b["advantages"], b["loss_mask"], b["seq_ids"], num_seqs=b["num_seqs"]
    )


def stack_loss(b, logp, old_logp, entropy):
    mask, seq, s, roll = b["loss_mask"], b["seq_ids"], b["num_seqs"], b["rollout_logp"]
    corr = corrections.combine(
        mask,
        corrections.token_tis(old_logp, roll, mask, cap=2.0),
        corrections.icepop(old_logp, roll, mask, low=0.5, high=5.0),
        corrections.opsm_mask(logp, roll, b["advantages"], mask, seq, num_seqs=s, delta=0.05),
    )
    out = objectives.espo(
        logp, old_logp, b["advantages"], entropy, corr.mask, seq, num_seqs=s, vocab_size=b["vocab"],
        weights=corr.weights,
    )  # fmt: skip
    out.metrics.update(diagnostics.mismatch_metrics(old_logp, roll, mask, seq, num_seqs=s))
    return out


def baseline_step(b):
    b["logits"].grad = None
    with torch.no_grad():
        old_logp = full_logp(b["old_logits"], b["tokens"])
    ppo_loss(b, full_logp(b["logits"], b["tokens"]), old_logp).loss.backward()


def stack_step(b):
    b["logits"].grad = None
    ksm = (b["tokens"], b["kept_ids"], b["offsets"], TEMPERATURE)
    with torch.no_grad():
        old_logp = masked_token_logprobs(b["old_logits"], *ksm)
        entropy = token_entropy(b["old_logits"], TEMPERATURE)
    stack_loss(b, masked_token_logprobs(b["logits"], *ksm), old_logp, entropy).loss.backward()


def loss_only(b, stack: bool):
    logp = b["rollout_logp"].detach().clone().requires_grad_()
    old_logp, entropy = b["rollout_logp"] + 0.01, torch.rand_like(b["rollout_logp"])

    def run():
        logp.grad = None
        out = stack_loss(b, logp, old_logp, entropy) if stack else ppo_loss(b, logp, old_logp)
        out.loss.backward()

    return run


def estimate_peak_bytes(num: int, vocab: int, dtype: torch.dtype) -> int:
    """Estimated peak device memory of the bench at ``num`` tokens, in bytes.

    Live throughout: ``logits`` and ``old_logits`` (2 × [N, V] in ``dtype``). On top of that the
    largest transient is the baseline's step: its forward keeps the fp32 ``log_softmax`` output
    for backward, and its backward holds that output, the gradient of it (``gather``'s backward
    scatters into a zero [N, V] fp32 tensor) and the gradient of its input at once: 3 × [N, V]
    fp32. (π_old's no-grad pass before it peaks at 2 × [N, V] fp32; the stack path's chunked
    KSM/entropy passes allocate only the [N, V] gradient in ``dtype``; ``make_batch``'s
    temporaries peak at 2 × [N, V] in ``dtype``.) Allocator fragmentation, the CUDA context and
    the O(N·kept) tensors are not counted: leave a margin.
    """
    item = torch.empty((), dtype=dtype).element_size()
    logits = num * vocab
    live = 2 * logits * item
    return live + 3 * logits * 4


def cuda_default_tokens(vocab: int, dtype: torch.dtype, device: torch.device, fraction: float) -> int:
    """The largest power-of-two token count (≥ 1024) whose estimate stays below ``fraction`` of
    the GPU's total memory; prints the estimate and the choice."""
    total = torch.cuda.get_device_properties(device).total_memory
    budget = fraction * total
    num = 1024
    while estimate_peak_bytes(2 * num, vocab, dtype) <= budget:
        num *= 2
    est = estimate_peak_bytes(num, vocab, dtype)
    gib = 2**30
    note = "" if est <= budget else "  (does not fit the budget even at the smallest size)"
    print(f"memory: estimated peak {est / gib:.1f} GiB at {num} tokens x vocab {vocab} ({dtype}); "
          f"{estimate_peak_bytes(2 * num, vocab, dtype) / gib:.1f} GiB at {2 * num}; budget {fraction:.0%} of "
          f"{total / gib:.1f} GiB = {budget / gib:.1f} GiB -> tokens={num}{note}")  # fmt: skip
    return num


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--kept", type=int, default=200)
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=0.6,
        help="cuda: default --tokens is the largest power of two whose estimated peak stays below this "
        "fraction of the GPU's memory",
    )
    args = p.parse_args()
    device, dtype = resolve_device(args)
    cuda = device.type == "cuda"
    vocab = args.vocab or (152064 if cuda else 32000)
    if args.tokens:
        num = args.tokens
        if cuda:
            est = estimate_peak_bytes(num, vocab, dtype) / 2**30
            total = torch.cuda.get_device_properties(device).total_memory / 2**30
            print(f"memory: estimated peak {est:.1f} GiB at {num} tokens (--tokens) of {total:.1f} GiB")
    elif cuda:
        num = cuda_default_tokens(vocab, dtype, device, args.mem_fraction)
    else:
        num = 1024 if args.quick else 4096
    repeats = args.repeats or (2 if args.quick else 3)
    b = make_batch(num, vocab, args.kept, dtype, device, args.seed)
    print(f"stack bench: device={device} dtype={dtype} tokens={num} vocab={vocab} kept={args.kept} "
          f"responses={b['num_seqs']} repeats={repeats} (median)")  # fmt: skip
    cases = {
        "whole step (fwd+bwd)": (lambda: baseline_step(b), lambda: stack_step(b)),
        "loss math only": (loss_only(b, stack=False), loss_only(b, stack=True)),
        "ESPO entropy pass": (
            lambda: full_logp(b["old_logits"], b["tokens"]),
            lambda: token_entropy(b["old_logits"], TEMPERATURE),
        ),
    }
    print(
        f"{'case':>22} | {'t_base':>9} {'t_stack':>9} {'t ratio':>8} | {'mem_base':>10} {'mem_stack':>10} {'mem ratio':>9}"
    )
    for name, (base, stack) in cases.items():
        with torch.no_grad() if name == "ESPO entropy pass" else torch.enable_grad():
            tb, ts = time_it(base, device, repeats), time_it(stack, device, repeats)
            b["logits"].grad = None
            mb = peak_extra_bytes(base, device)
            b["logits"].grad = None
            ms = peak_extra_bytes(stack, device)
        print(f"{name:>22} | {tb * 1e3:>7.1f}ms {ts * 1e3:>7.1f}ms {ratio(ts, tb):>8} | "
              f"{fmt_bytes(mb):>10} {fmt_bytes(ms):>10} {ratio(ms, mb):>9}")  # fmt: skip


if __name__ == "__main__":
    main()
