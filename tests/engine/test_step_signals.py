"""The slow-replica signals count one kind of work each: a step that computes prompt tokens
never moves the decode step average, and a decode-only step never moves the per-prompt-token one
(a mixed average made the replica that had just computed a prompt, and so held its cache, look
slow, and the router sent the prompt's next request elsewhere)."""

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def test_prompt_steps_and_decode_steps_are_timed_apart(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=32)
    st = engine.stats
    engine.add_request("a", prompt_token_ids=[256] + list(range(1, 40)), sampling=SP)
    engine.step()  # the whole 40-token prompt in one step, which samples the first token
    assert (st.prompt_steps, st.decode_steps, st.decode_step_s_avg) == (1, 0, 0.0)
    assert st.prompt_s_per_token_avg == st.last_step_s / 40
    for _ in range(2):
        engine.step()
    per_token, decode_avg = st.prompt_s_per_token_avg, st.decode_step_s_avg
    assert (st.prompt_steps, st.decode_steps) == (1, 2) and decode_avg > 0

    engine.add_request("b", prompt_token_ids=[256] + list(range(50, 80)), sampling=SP)
    engine.step()  # b's prompt with a's decode: a prompt step
    assert (st.prompt_steps, st.decode_steps, st.decode_step_s_avg) == (2, 2, decode_avg)
    assert st.prompt_s_per_token_avg == 0.9 * per_token + 0.1 * st.last_step_s / 32  # 31 + a decode
    while engine.has_unfinished():
        engine.step()
    assert (st.prompt_steps, st.decode_steps, st.steps) == (2, 6, 8)  # a: 1 more, b: 4 more (one together)


def test_queued_prefill_tokens_leave_out_what_the_cache_covers(tiny_model):
    """The router weighs a replica's queue against a cache hit: a waiting request whose prompt is
    mostly cached counts only its uncached tokens (it counted all of them, and one queued hit
    looked like a miss, so the next request for that prefix went to the other replica)."""
    engine = LLMEngine.from_model(tiny_model, num_blocks=32, block_size=16)
    prefix = [256] + list(range(1, 64))  # 4 full blocks
    engine.add_request("a", prompt_token_ids=prefix + [100, 101, 102], sampling=SP)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", prompt_token_ids=prefix + list(range(120, 140)), sampling=SP)  # 84: 64 cached
    engine.add_request("c", prompt_token_ids=list(range(150, 190)), sampling=SP)  # 40: none cached
    load = engine.load()
    assert (load.waiting, load.queued_prefill_tokens) == (2, (84 - 64) + 40)
    while engine.has_unfinished():
        engine.step()
    assert engine.load().queued_prefill_tokens == 0
    assert engine.load().free_blocks == 32


def test_only_the_first_waiting_requests_are_looked_up(tiny_model, monkeypatch):
    """A load report runs on the loop thread up to 50 times a second: the cache lookup is bounded
    to the first QUEUE_CACHE_LOOKUPS waiting requests; the rest count their whole prompt."""
    import cluster.engine.engine_state as engine_state

    monkeypatch.setattr(engine_state, "QUEUE_CACHE_LOOKUPS", 1)
    engine = LLMEngine.from_model(tiny_model, num_blocks=32, block_size=16)
    prefix = [256] + list(range(1, 64))
    engine.add_request("a", prompt_token_ids=prefix + [100], sampling=SP)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", prompt_token_ids=prefix + [120, 121], sampling=SP)  # looked up: 66 - 64
    engine.add_request("c", prompt_token_ids=prefix + [130, 131], sampling=SP)  # past the bound: 66
    assert engine.load().queued_prefill_tokens == 2 + 66
    while engine.has_unfinished():
        engine.step()
    assert engine.load().free_blocks == 32


def test_running_prompts_uncomputed_tokens_are_reported(tiny_model):
    """Chunked prefill runs a long prompt over several steps with nothing waiting: its uncomputed
    tokens are work ahead of the next prompt all the same (router/load_model.py tokens_ahead; the
    queue alone read 0 on a saturated prefill replica)."""
    engine = LLMEngine.from_model(tiny_model, num_blocks=32, block_size=16, max_num_batched_tokens=64)
    engine.add_request("a", prompt_token_ids=[256] + list(range(1, 200)), sampling=SP)  # 200 tokens
    assert (engine.load().queued_prefill_tokens, engine.load().running_prompt_tokens) == (200, 0)
    engine.step()  # the first 64-token chunk
    load = engine.load()
    assert (load.waiting, load.running, load.queued_prefill_tokens, load.running_prompt_tokens) == (0, 1, 0, 136)
    engine.step()
    assert engine.load().running_prompt_tokens == 72
    while engine.has_unfinished():
        engine.step()
    assert engine.load().running_prompt_tokens == 0
