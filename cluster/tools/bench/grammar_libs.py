"""Grammar libraries compared: compile time and per-token cost (mask + advance) for a JSON schema.

    pip install --no-deps --target /tmp/gram xgrammar apache-tvm-ffi llguidance outlines-core
    PYTHONPATH=/tmp/gram python -m cluster.tools.bench.grammar_libs

Only llguidance is a dependency of pdserve; the others are installed aside for this comparison.
For the tiny test model's byte tokenizer and SmolLM2-135M-Instruct's (49152 tokens), each library
builds its tokenizer view and a grammar for SCHEMA, then walks the tokens of one valid document:
per token, fill the allowed-token bitmask and advance by that token (the work a decode step adds
per constrained stream). A warm-up walk first; then the timed walk's mean, p50, p99 and max.
"""
import json
import time

import torch
from cluster.engine.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
       "address": {"city": "London", "zip": "W1"}}

def run(model_dir, vocab):
    tok = Tokenizer(model_dir)
    eos = tok.token_to_id(tok.special_tokens.get("eos_token"))
    n = tok.vocab_size
    raw = [tok.token_bytes(i) for i in range(n)]
    text = json.dumps(DOC, separators=(",", ":"))
    ids = tok.encode(text, add_special_tokens=False)
    print(f"\n## {model_dir.split('/')[-1]}: vocab {n} (model {vocab}), {len(ids)} tokens in the document")
    words = (vocab + 31) // 32
    res = {}
    # xgrammar
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[eos])
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    t2 = time.perf_counter()
    cgo = comp.compile_builtin_json_grammar()
    t3 = time.perf_counter()
    bm = xgr.allocate_token_bitmask(1, vocab)
    def xg_once():
        m = xgr.GrammarMatcher(cg)
        ts = []
        for t in ids:
            a = time.perf_counter(); m.fill_next_token_bitmask(bm); ok = m.accept_token(t); ts.append(time.perf_counter() - a)
            assert ok, t
        m.fill_next_token_bitmask(bm); assert m.accept_token(eos) and m.is_terminated()
        return ts
    xg_once(); ts = sorted(xg_once())
    res["xgrammar"] = (t1 - t0, t2 - t1, t3 - t2, ts)
    # llguidance
    import llguidance as llg, llguidance.torch as lt
    t0 = time.perf_counter()
    lltok = llg.LLTokenizer(tok._tok.to_str(), n_vocab=vocab, eos_token=eos)
    t1 = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    m0 = llg.LLMatcher(lltok, grammar); assert not m0.is_error(), m0.get_error()
    t2 = time.perf_counter()
    mo = llg.LLMatcher(lltok, llg.LLMatcher.grammar_from_json_schema('{"type":"object"}'))
    t3 = time.perf_counter()
    lbm = lt.allocate_token_bitmask(1, vocab)
    def ll_once():
        m = llg.LLMatcher(lltok, grammar)
        ts = []
        for t in ids:
            a = time.perf_counter(); lt.fill_next_token_bitmask(m, lbm); ok = m.consume_token(t); ts.append(time.perf_counter() - a)
            assert ok, (t, m.get_error())
        lt.fill_next_token_bitmask(m, lbm); assert m.consume_token(eos) or m.is_accepting()
        return ts
    ll_once(); ts = sorted(ll_once())
    res["llguidance"] = (t1 - t0, t2 - t1, t3 - t2, ts)
    # outlines-core
    import outlines_core as oc
    t0 = time.perf_counter()
    mp = {}
    for i, b in enumerate(raw):
        if i != eos and b:
            mp.setdefault(b, []).append(i)
    voc = oc.Vocabulary(eos, mp)
    t1 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
    idx = oc.Index(regex, voc)
    t2 = time.perf_counter()
    obm = torch.zeros(words, dtype=torch.int32)
    def oc_once():
        g = oc.Guide(idx)
        ts = []
        for t in ids:
            a = time.perf_counter(); g.write_mask_into(obm.data_ptr(), obm.numel(), 4); g.advance(t); ts.append(time.perf_counter() - a)
        assert g.is_finished()
        return ts
    oc_once(); ts = sorted(oc_once())
    res["outlines-core"] = (t1 - t0, t2 - t1, float("nan"), ts)
    print("| library | tokenizer setup (s) | schema compile (ms) | json_object compile (ms) | per token mean (µs) | p50 | p99 | max |")
    print("|---|---|---|---|---|---|---|---|")
    for k, (a, b, c, ts) in res.items():
        mean = sum(ts) / len(ts)
        print(f"| {k} | {a:.2f} | {b*1e3:.1f} | {c*1e3:.1f} | {mean*1e6:.0f} | {ts[len(ts)//2]*1e6:.0f} | {ts[int(len(ts)*0.99)]*1e6:.0f} | {ts[-1]*1e6:.0f} |")

if __name__ == "__main__":
    from cluster.engine.model.init_model import init_model
    import tempfile
    d = tempfile.mkdtemp()
    init_model(d, layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, max_positions=512, seed=0)
    run(d, 320)
    from cluster.engine.model.demo import smollm2_135m_instruct
    run(str(smollm2_135m_instruct()), 49152)
