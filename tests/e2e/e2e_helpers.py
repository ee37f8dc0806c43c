"""Helpers for the end-to-end tests: transformers as the reference, and a stack context."""

from __future__ import annotations

import contextlib


class Reference:
    """Greedy continuations from Hugging Face transformers on the same checkpoint."""

    def __init__(self, model_dir):
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = {self.model.config.eos_token_id} if self.model.config.eos_token_id is not None else set()
        self._cache: dict[tuple, list[int]] = {}

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._cache:
            torch = self._torch
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                )
            self._cache[key] = out[0, len(prompt):].tolist()
        return self._cache[key]

    def check(self, prompt: list[int], max_tokens: int, got: list[int]) -> None:
        """`got` must be transformers' continuation, ending early only on EOS."""
        want = self.greedy(prompt, max_tokens)
        assert got == want[: len(got)], f"diverged from transformers at {_first_diff(got, want)}"
        assert len(got) == max_tokens or (got and got[-1] in self.eos), (
            f"stopped after {len(got)} of {max_tokens} tokens without EOS"
        )


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@contextlib.contextmanager
def running_stack(model_dir, executor_args=(), scheduler_args=()):
    from chunkwise_tools.serve import start_stack

    stack = start_stack(
        str(model_dir),
        executor_args=["--dtype", "float32", *executor_args],
        scheduler_args=["--stats-interval", "0", *scheduler_args],
        timeout=180,
    )
    try:
        yield stack
    finally:
        stack.stop()
