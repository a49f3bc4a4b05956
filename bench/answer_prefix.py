"""Answer prefixes and token healing on the embedded SmolLM2: pass rate of small functions.

Each of 12 function-writing prompts gets the answer prefix "```python\\n<header>\\n" (as SciCode's
``answer_prefix``), and ``--samples`` completions at ``--temperature``, under three prompts:

* ``newline``: the prefix as is, ending on a bare "\\n" token (the tokenizer would write that
  newline together with the next line's indentation as one token);
* ``healed``: the same prefix with token healing (``Request.heal_tokens=1``, what the
  orchestrator does with ``rollout.heal_answer_prefix``);
* ``colon``: the prefix cut before its last newline ("...:"), the peer the issue measured.

The artifact is prefix + completion (as the orchestrator builds it), its code extracted as
SciCode does, then run with the prompt's asserts in the sandbox. Prints pass counts per
condition, the prompts with mixed outcomes, how often the first token closes the fence, and the
ratio healed / newline.

    python bench/answer_prefix.py [--samples 8] [--temperature 0.8] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import time
import warnings

import jax

PROBLEMS = [  # (header, what it does, asserts)
    ("def add(a, b):", "returns the sum of a and b", ["add(2, 3) == 5", "add(-1, 1) == 0"]),
    ("def is_even(n):", "returns True when the integer n is even, else False",
     ["is_even(4) is True", "is_even(7) is False"]),
    ("def factorial(n):", "returns n! for a non-negative integer n", ["factorial(0) == 1", "factorial(5) == 120"]),
    ("def reverse_string(s):", "returns the string s reversed", ["reverse_string('abc') == 'cba'"]),
    ("def max_of_list(xs):", "returns the largest number in the non-empty list xs",
     ["max_of_list([3, 9, 2]) == 9", "max_of_list([-5, -2]) == -2"]),
    ("def count_vowels(s):", "returns how many vowels (a, e, i, o, u, lower case) the string s contains",
     ["count_vowels('banana') == 3", "count_vowels('xyz') == 0"]),
    ("def fibonacci(n):", "returns the n-th Fibonacci number, with fibonacci(0) = 0 and fibonacci(1) = 1",
     ["fibonacci(0) == 0", "fibonacci(1) == 1", "fibonacci(10) == 55"]),
    ("def is_palindrome(s):", "returns True when the string s reads the same backwards, else False",
     ["is_palindrome('racecar') is True", "is_palindrome('abc') is False"]),
    ("def square_list(xs):", "returns a list with the square of every number in xs",
     ["square_list([1, 2, 3]) == [1, 4, 9]", "square_list([]) == []"]),
    ("def celsius_to_fahrenheit(c):", "converts a temperature c in degrees Celsius to degrees Fahrenheit",
     ["celsius_to_fahrenheit(0) == 32", "celsius_to_fahrenheit(100) == 212"]),
    ("def sum_of_digits(n):", "returns the sum of the decimal digits of the non-negative integer n",
     ["sum_of_digits(123) == 6", "sum_of_digits(0) == 0"]),
    ("def gcd(a, b):", "returns the greatest common divisor of the positive integers a and b",
     ["gcd(12, 18) == 6", "gcd(7, 5) == 1"]),
]
CONDITIONS = ("newline", "healed", "colon")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")

    from morse_jax.models import load_backbone
    from morse_jax.models.chat import encode_chat, stop_token_ids
    from morse_jax.models.loading import embedded_model_path
    from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig
    from morse_jax.tasks.sandbox.runner import run_many
    from morse_jax.tasks.scicode.context import extract_code

    bb = load_backbone(embedded_model_path())
    tok = bb.tokenizer
    stops = stop_token_ids(tok, bb.config.eos_token_ids)
    sampler = Sampler(bb, None, SamplerConfig(max_batch=16, chunk=16))
    print(f"sampler native CPU kernels: {sampler.native_kernels}")

    requests, meta = [], []  # meta: (condition, problem index, prefix)
    for c in CONDITIONS:
        for p, (header, what, _) in enumerate(PROBLEMS):
            name = header[4:header.index("(")]
            user = (f"Write a Python function `{name}` that {what}. Reply with the code in one ```python block.")
            prefix = f"```python\n{header}\n" if c != "colon" else f"```python\n{header}"
            ids = encode_chat(tok, [{"role": "user", "content": user}, {"role": "assistant", "content": prefix}])
            for _ in range(args.samples):
                # the fence is open in the prompt: the first "```" generated closes it (stop there)
                requests.append(Request(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        top_p=args.top_p, stop_token_ids=stops, stop_strings=("```",),
                                        heal_tokens=int(c == "healed")))
                meta.append((c, p, prefix))
    t0 = time.time()
    comps = sampler.generate(None, requests, key=jax.random.PRNGKey(args.seed))
    gen_s = time.time() - t0

    jobs = []
    for (c, p, prefix), comp in zip(meta, comps):
        header, _, asserts = PROBLEMS[p]
        code = extract_code(prefix + comp.text, header[4:header.index("(")])
        jobs.append(dict(code=code + "\n\n" + "\n".join(f"assert {a}" for a in asserts) + "\n", timeout_s=10.0))
    results = run_many(jobs)

    passed = {c: [0] * len(PROBLEMS) for c in CONDITIONS}
    closes = dict.fromkeys(CONDITIONS, 0)
    for (c, p, _), comp, res in zip(meta, comps, results):
        passed[c][p] += int(res.returncode == 0 and not res.timed_out)
        first = tok.decode(comp.token_ids[:1]) if comp.token_ids else ""
        closes[c] += int(first.lstrip().startswith("```") or not comp.token_ids)
    n = len(PROBLEMS) * args.samples
    print(f"{len(PROBLEMS)} prompts x {args.samples} samples, T={args.temperature}, top-p={args.top_p}, "
          f"{args.max_new_tokens} new tokens; generation {gen_s:.0f} s for {len(requests)} requests")
    for c in CONDITIONS:
        mixed = sum(0 < k < args.samples for k in passed[c])
        print(f"  {c:8s} pass {sum(passed[c]):3d}/{n}  prompts with mixed outcomes {mixed:2d}/{len(PROBLEMS)}  "
              f"first token closes the fence {closes[c]:3d}/{n}  per prompt {passed[c]}")
    base = sum(passed["newline"])
    ratio = f"{sum(passed['healed']) / base:.2f}x" if base else "inf (newline passes none)"
    print(f"healed / newline pass ratio: {ratio}; healed / colon: "
          f"{sum(passed['healed']) / max(sum(passed['colon']), 1):.2f}x")


if __name__ == "__main__":
    main()
