"""n > 1 on one engine, as the front door runs it (router/ingress/gateway/front_door.py,
`FrontDoor._start_choices`): choice 0 first, the other choices once it has its first token. They
share the prompt's full blocks through the prefix cache: exact block ids and counts while all four
run, and after they finish."""

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams

BLOCK = 16
PROMPT = [256] + [(5 * k + 11) % 256 for k in range(39)]  # 40 tokens: 2 full blocks and 8 tokens
FULL = len(PROMPT) // BLOCK
N, MAX_TOKENS = 4, 20


def test_four_choices_share_the_prompt_s_full_blocks_and_sample_with_seed_plus_index(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=64, block_size=BLOCK)
    total = engine.kv.num_free_blocks
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=40 + i, ignore_eos=True) for i in range(N)]

    tokens = {f"c{i}": [] for i in range(N)}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids

    engine.add_request("c0", prompt_token_ids=PROMPT, sampling=params[0])
    while not tokens["c0"]:
        step()
    assert engine.stats.cached_prompt_tokens == 0
    for i in range(1, N):
        engine.add_request(f"c{i}", prompt_token_ids=PROMPT, sampling=params[i])
    step()  # the three prompts' last 8 tokens: every choice now has its first token

    assert engine.stats.cached_prompt_tokens == (N - 1) * FULL * BLOCK
    assert all(tokens[f"c{i}"] for i in range(N))
    tables = [engine.kv.block_ids(f"c{i}") for i in range(N)]
    shared = tables[0][:FULL]
    assert all(t[:FULL] == shared for t in tables)  # the same block ids, not copies
    own = [set(t[FULL:]) for t in tables]
    assert all(len(t) == -(-(len(PROMPT) + len(tokens[f"c{i}"]) - 1) // BLOCK) for i, t in enumerate(tables))
    assert sum(len(o) for o in own) == len(set().union(*own))  # nothing else is shared
    assert total - engine.kv.num_free_blocks == FULL + sum(len(o) for o in own)
    engine.kv.check_invariants()

    while engine.has_unfinished():
        step()
    assert engine.kv.num_free_blocks == total
    engine.kv.check_invariants()

    # each choice is the single request with its seed
    alone = LLMEngine.from_model(tiny_model, num_blocks=64, block_size=BLOCK)
    for i in range(N):
        assert tokens[f"c{i}"] == alone.generate([PROMPT], params[i])[0].token_ids, i
    assert len({tuple(t) for t in tokens.values()}) > 1
