"""Keep-sampling-mask log-probs vs plain ``log_softmax`` + gather, in one process.

    python bench/algo_ksm.py            # vocab 32k and 152k, 4k tokens, kept 20/200/2000, fp32 CPU
    python bench/algo_ksm.py --quick    # vocab 32k, 1k tokens
    python bench/algo_ksm.py --device cuda --dtype bf16   # vocab 152k, 32k tokens (GPU)

For each (vocab, kept size) it prints the median time and the extra peak memory of
`masked_token_logprobs` (KSM) and of the baseline ``log_softmax(logits.float()/T).gather(y)``,
forward only and forward+backward, and their ratios (KSM / baseline). Target: time ≤ 1.2×, and
no extra [tokens, vocab] copy (the "×[N,V]" column: extra peak bytes / bytes of one fp32
[tokens, vocab] tensor; forward+backward always holds the [N,V] gradient of the logits itself).
The chunked full-vocabulary `token_logprobs` is shown for reference as kept = "full".
Memory method: see bench/algo_common.py.
"""

from __future__ import annotations

import torch
from algo_common import base_parser, fmt_bytes, peak_extra_bytes, ratio, resolve_device, time_it

from moe_rl.algo.logprobs import masked_token_logprobs, token_logprobs

TEMPERATURE = 0.8


def make_inputs(num: int, vocab: int, kept: int, dtype, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(num, vocab, generator=g, device=device, dtype=dtype)
    top = torch.topk(logits, kept, dim=-1).indices  # the engine keeps the top-k ids
    pick = torch.randint(0, kept, (num, 1), generator=g, device=device)
    tokens = top.gather(1, pick).squeeze(1)
    offsets = torch.arange(num + 1, device=device) * kept
    return logits, tokens, top.reshape(-1).contiguous(), offsets


def baseline(logits, tokens):
    return torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(1, tokens[:, None]).squeeze(1)


def fwd_bwd(fn, logits):
    def run():
        logits.grad = None  # measure one backward, not gradient accumulation
        fn().sum().backward()

    return run


def measure(fn, logits, device, repeats) -> dict[str, tuple[float, int | None]]:
    """{pass: (median seconds, extra peak bytes)} for forward only and forward+backward."""
    with torch.no_grad():
        fwd = (time_it(fn, device, repeats), peak_extra_bytes(fn, device))
    logits.requires_grad_(True)
    step = fwd_bwd(fn, logits)
    t = time_it(step, device, repeats)
    logits.grad = None  # the previous gradient must not be counted (nor freed inside the measurement)
    both = (t, peak_extra_bytes(step, device))
    logits.requires_grad_(False)
    logits.grad = None
    return {"fwd": fwd, "fwd+bwd": both}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--kept", type=int, nargs="+", default=None)
    args = p.parse_args()
    device, dtype = resolve_device(args)
    cuda = device.type == "cuda"
    vocabs = args.vocab or ([152064] if cuda else [32000] if args.quick else [32000, 152064])
    num = args.tokens or (32768 if cuda else 1024 if args.quick else 4096)
    kept_sizes = args.kept or ([20, 2000] if args.quick else [20, 200, 2000])
    repeats = args.repeats or (2 if args.quick else 3)
    print(f"KSM bench: device={device} dtype={dtype} tokens={num} T={TEMPERATURE} repeats={repeats} (median)")
    print(f"{'vocab':>7} {'kept':>5} {'pass':>8} | {'t_base':>9} {'t_ksm':>9} {'t ratio':>8} | "
          f"{'mem_base':>10} {'mem_ksm':>10} {'mem ratio':>9} {'ksm ×[N,V]':>10}")  # fmt: skip
    for vocab in vocabs:
        bench_vocab(vocab, num, kept_sizes, dtype, device, repeats, args.seed)


def bench_vocab(vocab, num, kept_sizes, dtype, device, repeats, seed) -> None:
    nv_bytes = num * vocab * 4
    base = None  # the baseline's cost does not depend on the kept sets: measured once per vocab
    for kept in [*kept_sizes, None]:
        logits, tokens, kept_ids, offsets = make_inputs(num, vocab, kept or 1, dtype, device, seed)
        if base is None:
            base = measure(lambda: baseline(logits, tokens), logits, device, repeats)  # noqa: B023
        if kept is None:
            fn = lambda: token_logprobs(logits, tokens, TEMPERATURE)  # noqa: E731, B023
        else:
            fn = lambda: masked_token_logprobs(logits, tokens, kept_ids, offsets, TEMPERATURE)  # noqa: E731, B023
        for name, (tk, mk) in measure(fn, logits, device, repeats).items():
            tb, mb = base[name]
            frac = "n/a" if mk is None else f"{mk / nv_bytes:.3f}"
            print(f"{vocab:>7} {kept or 'full':>5} {name:>8} | {tb * 1e3:>7.1f}ms {tk * 1e3:>7.1f}ms {ratio(tk, tb):>8} | "
                  f"{fmt_bytes(mb):>10} {fmt_bytes(mk):>10} {ratio(mk, mb):>9} {frac:>10}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
