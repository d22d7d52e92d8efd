"""The prompt cache over many prompts: the store's choice and budget, a kept state restored
bit for bit in both backends, and the decoder reading only what a returning prompt does not
share with a kept state, its tokens those of a fresh run."""

from __future__ import annotations

import pytest
import torch

from flyspec.config import DecodeConfig
from flyspec.decoding.loop import SpeculativeDecoder
from flyspec.decoding.stats import RequestStats
from flyspec.models.cache import CachedLM
from flyspec.models.prompt_cache import PromptCache

A = [5, 9, 2, 33, 7, 7, 12, 40, 3, 8, 21, 19]
B = [6, 1, 44, 2, 9, 30, 30, 11, 4]


def test_the_longest_shared_prefix_wins_within_the_models_states():
    cache = PromptCache(1000)
    cache.put("target", [1, 2, 3, 4], "a", 10)
    cache.put("target", [1, 2, 9], "b", 10)
    cache.put("draft", [1, 2, 3, 4, 5], "c", 10)
    kept, shared = cache.best("target", [1, 2, 3, 7])
    assert (kept.state, shared) == ("a", 3)
    assert cache.best("target", [8]) is None
    assert cache.best("draft", [1, 2, 3, 4, 5, 6])[1] == 5


def test_the_budget_drops_the_least_recently_used_and_superseded_states():
    cache = PromptCache(100)
    cache.put("target", [1, 2], "short", 40)
    cache.put("target", [1, 2, 3], "longer", 40)  # begins with [1, 2]: that one goes
    assert [kept.state for kept in cache.states] == ["longer"]
    cache.put("target", [7], "other", 40)
    cache.best("target", [1, 2, 3])  # used: the other is now the least recent
    cache.put("target", [8], "new", 40)
    assert [kept.state for kept in cache.states] == ["longer", "new"]
    assert not cache.put("target", [9], "too big", 101)
    assert cache.nbytes <= 100


def forwarded(lm: CachedLM) -> list[int]:
    """Records the number of new positions of each of ``lm``'s forwards."""
    sizes: list[int] = []
    forward = lm.runner.forward

    def counting(input_ids, num_logits):
        sizes.append(input_ids.shape[1])
        return forward(input_ids, num_logits)

    lm.runner.forward = counting
    return sizes


def test_a_kept_state_comes_back_bit_for_bit(target):
    lm = CachedLM(target, forward_path="lean")
    cache = PromptCache()
    lm.use_prompt_cache(cache, name="target")
    lm.prefill(A)
    expected = lm.logits([*A, 17], 1)
    lm.keep()
    lm.prefill(B)  # the live cache now holds another prompt
    lm.keep()
    sizes = forwarded(lm)
    lm.prefill([*A[:-2], 50])  # shares all but A's last two tokens with the kept state
    assert sizes == [1]  # only the token after the shared prefix
    lm.prefill(A)
    assert torch.equal(lm.logits([*A, 17], 1), expected)
    assert cache.restored_tokens >= len(A) - 2


def test_nothing_is_kept_without_a_cache_or_over_the_budget(target):
    lm = CachedLM(target, forward_path="lean")
    lm.prefill(A)
    lm.keep()  # no cache: nothing to do
    small = PromptCache(16)
    lm.use_prompt_cache(small, name="target")
    lm.keep()
    assert small.states == []


@pytest.mark.parametrize("mode", ["target", "spd"])
def test_a_returning_prompt_reads_only_what_no_kept_state_holds(target, draft, mode):
    config = DecodeConfig(mode=mode, k=3, max_new_tokens=6)
    fresh = SpeculativeDecoder(target, draft)
    expected = {
        name: [e.token for e in fresh.stream(prompt, config)]
        for name, prompt in (("a", A), ("b", B))
    }
    decoder = SpeculativeDecoder(target, draft, reuse_prefix=True)
    decoder.keep_prompts(2**30)
    for name, prompt in (("a", A), ("b", B)):
        assert [e.token for e in decoder.stream(prompt, config)] == expected[name]
    sizes = forwarded(decoder.target)
    stats = RequestStats()
    assert [e.token for e in decoder.stream(A, config, stats=stats)] == expected["a"]
    assert sizes[0] < len(A) - 1  # the prompt was not read again
    assert decoder.prompt_cache.restored_tokens > 0
    models = {kept.model for kept in decoder.prompt_cache.states}
    assert models == ({"target"} if mode == "target" else {"target", "draft"})


def test_llamacpps_kept_state_comes_back(tiny_ggufs):
    pytest.importorskip("llama_cpp")
    from flyspec.models.llamacpp import LlamaCppLM

    _, _, _, _, target_path = tiny_ggufs
    lm = LlamaCppLM(target_path, context=256, threads=1)
    cache = PromptCache()
    lm.use_prompt_cache(cache, name="target")
    lm.prefill(A)
    expected = lm.logits([*A, 17], 1)
    lm.keep()
    lm.prefill(B)
    sizes = forwarded(lm)
    lm.prefill(A)
    assert sizes == []  # all of A restored, nothing read
    assert lm.cached_tokens == A
    assert torch.allclose(lm.logits([*A, 17], 1), expected, atol=1e-5)


def test_the_usage_says_how_much_of_the_prompt_came_from_the_caches():
    """Through the server: a prompt that comes back after another is read from the prompt
    cache (OpenAI's ``prompt_tokens_details.cached_tokens``), and counted in the metrics."""
    import httpx

    from tests.test_server import loosening_engine, openai_client

    engine = loosening_engine()
    engine.decoder.reuse_prefix = True
    engine.decoder.keep_prompts(2**30)
    first = "def fibonacci(n):\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    other = "print the range of self and the rest of it"
    with openai_client(engine, max_new_tokens=4) as client:

        def cached(prompt: str) -> tuple[int, int]:
            answer = client.completions.create(model="tiny-test", prompt=prompt, max_tokens=4)
            usage = answer.usage
            return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

        assert cached(first)[1] == 0  # nothing seen before
        assert cached(other)[1] == 0
        prompt_tokens, reused = cached(first)  # back after another: restored
        assert reused == prompt_tokens - 1  # all but the last, which the first round reads
        metrics = httpx.get(str(client.base_url).replace("/v1/", "/metrics")).text
    counted = [line for line in metrics.splitlines() if "cached_prompt_tokens_total{" in line]
    assert sum(float(line.split()[-1]) for line in counted) == reused
