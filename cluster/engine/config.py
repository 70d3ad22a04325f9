"""Engine options, declared once: the engine reads `EngineConfig`, the app config reuses
`EngineOptions` (cluster/config/pools.py). Validated where they enter (CLI, YAML), frozen inside.
No torch here: the front door sizes KV blocks with `kv_block_bytes` too."""

from __future__ import annotations

import math

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.errors import InvalidRequestError

from cluster.engine.distributed.plan import check_expert_parallel, kv_heads_per_rank
from cluster.engine.model_config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
# engine.kv_cache_dtype -> the pool's torch dtype name ("auto": the run dtype's).
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


PROMPT_CHARS_PER_TOKEN = 8  # max_prompt_chars' default, per token of the context length


class RequestLimits(BaseModel):
    """Caps on one request's input, checked before any per-item work (tokenizing, per-id loops),
    so a hostile request costs no more than its refusal. Each refusal names the field and the cap."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_request_id_len: int = Field(
        128, ge=1, description="Longest request_id (printable ASCII without whitespace).")
    max_stop_strings: int = Field(16, ge=0, description="Most stop strings per request.")
    max_stop_string_len: int = Field(256, ge=1, description="Longest stop string, in characters.")
    max_stop_token_ids: int = Field(64, ge=0, description="Most stop_token_ids per request.")
    max_logit_bias: int = Field(300, ge=0, description="Most logit_bias entries per request.")
    max_logprobs: int = Field(
        20, ge=0, description="Most top logprobs per token (chat top_logprobs; completions' own cap is 5).")
    max_schema_bytes: int = Field(
        32768, ge=2, description="Largest response_format JSON schema, in bytes (compact JSON).")
    max_schema_depth: int = Field(
        16, ge=1, description="Deepest nesting of a response_format JSON schema (objects and arrays).")
    max_prompt_chars: int | None = Field(
        None, ge=1, description=f"Longest text prompt in characters, checked before tokenizing; "
        f"None = {PROMPT_CHARS_PER_TOKEN} per token of the context length.")

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len

    def check_logit_bias(self, entries: int) -> None:
        """The entry cap, for the edges to check before converting a client's logit_bias entry by entry."""
        if entries > self.max_logit_bias:
            raise InvalidRequestError("logit_bias", f"has {entries} entries; at most {self.max_logit_bias} are accepted")

    def check_counts(self, stop_strings: int, stop_token_ids: int) -> None:
        """The count caps, for the edges to check before building a request's lists."""
        if stop_strings > self.max_stop_strings:
            raise InvalidRequestError(
                "stop", f"has {stop_strings} stop strings; at most {self.max_stop_strings} are accepted")
        if stop_token_ids > self.max_stop_token_ids:
            raise InvalidRequestError(
                "stop_token_ids", f"has {stop_token_ids} token ids; at most {self.max_stop_token_ids} are accepted")


class SpeculativeOptions(BaseModel):
    """Speculative decoding of this model's decodes (cluster/engine/spec/): a proposer drafts up
    to `k` tokens per request and the model verifies them in the normal step. Off by default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["off", "ngram", "draft"] = Field(
        "off", description='"ngram": prompt lookup (the tokens that followed the latest earlier '
        'occurrence of the request\'s last n tokens); "draft": a smaller model\'s greedy continuation '
        '(draft_model); "off": none.')
    k: int = Field(4, ge=1, le=16, description="Most draft tokens per request per step (adaptive below it).")
    ngram_min: int = Field(2, ge=1, le=16, description="Shortest suffix the n-gram proposer matches.")
    ngram_max: int = Field(4, ge=1, le=16, description="Longest suffix the n-gram proposer matches (tried first).")
    draft_model: str | None = Field(
        None, min_length=1, description='method "draft": a checkpoint directory with the same vocabulary '
        "(and tokenizer) as the model, run on the same device and dtype with its own paged KV pool "
        "(e.g. a layer-skip self-draft from `python -m cluster.tools.make_draft`).")
    draft_num_blocks: int | None = Field(
        None, ge=2, description='method "draft": KV blocks of the draft model\'s pool (block_size tokens '
        "each); None = as many as the model's pool, so the draft holds the same tokens the model does. "
        "A request the draft pool has no room for gets no drafts that step.")
    min_acceptance: float = Field(
        0.35, ge=0.0, le=1.0, description="A request whose recent acceptance rate (drafts accepted / "
        "proposed) falls below this stops speculating for a while (doubling each time), then tries again.")
    cost_model: Literal["measured", "off"] = Field(
        "measured", description='"measured": a request drafts only when its expected accepted drafts pay '
        "for the extra step time its drafts cost at the current decode batch, from this replica's own "
        'measured step times (cluster/engine/spec/cost.py); "off": acceptance alone decides '
        "(deterministic, for tests).")
    max_batch: int = Field(
        32, ge=0, description="The replica speculates only while at most this many requests are decoding: "
        "under a larger batch a step is compute-bound and drafts cost more than they save.")

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeOptions":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError('speculative.draft_model is needed by method "draft", and only by it')
        if self.draft_num_blocks is not None and self.method != "draft":
            raise ValueError('speculative.draft_num_blocks applies to method "draft" only')
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "off"


class KVTierOptions(BaseModel):
    """KV tiers below the device pool (cluster/engine/kv_cache/tier.py): host, then disk. Off by default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host_blocks: int = Field(
        0, ge=0, le=2**24, description="KV blocks in the host tier (a preallocated arena in host memory; "
        "pinned on CUDA): blocks the device pool's prefix cache evicts are kept there, LRU, and a prefix "
        "found there is copied back instead of recomputed. 0 = off. Needs enable_prefix_caching.")
    disk_dir: str | None = Field(
        None, min_length=1, description="Directory of the disk tier, below the host tier (blocks the host tier "
        "evicts are written there, one file per block slot, in a fresh subdirectory removed when the engine "
        "goes; the index is in memory, nothing survives a restart). None = no disk tier. Needs host_blocks > 0; "
        "the directory must exist, be writable and have disk_gb free.")
    disk_gb: float = Field(
        1.0, gt=0, le=65536, description="Size limit of the disk tier in GiB (whole blocks: at least one must fit).")
    async_loads: bool = Field(
        True, description="Copy a prefix back from the tiers on a loader thread while the engine steps its other "
        "requests (the request computes once its copy is done); false = copy at admission, on the engine's thread")
    lease_from_host: bool = Field(
        False, description="Prefill: serve a finished prompt's full blocks to decode from the host tier (written "
        "there at once if not already, pinned for the lease) and give their device blocks back to the pool at once; "
        "only the partial last block stays leased on the device. Decode's NIXL READ reads the host arena (DRAM "
        "pools only). For prefill pools whose device memory leases would otherwise hold")
    store_threshold: int = Field(
        0, ge=0, le=1_000_000, description="Write a prompt block through to the host tier once it has been reused "
        "this many times (before any eviction: its eviction then costs no copy); 0 = blocks enter the tiers only "
        "when evicted")

    @model_validator(mode="after")
    def _disk_below_host(self) -> "KVTierOptions":
        if self.disk_dir is not None and self.host_blocks == 0:
            raise ValueError("kv_tiers.disk_dir needs kv_tiers.host_blocks > 0: the disk tier takes the host tier's "
                             "evictions")
        if self.lease_from_host and self.host_blocks == 0:
            raise ValueError("kv_tiers.lease_from_host needs kv_tiers.host_blocks > 0: leases are served from the "
                             "host tier")
        return self

    @property
    def enabled(self) -> bool:
        return self.host_blocks > 0


class EngineOptions(BaseModel):
    """What an engine replica may be tuned with; the model is chosen elsewhere."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV block.")
    num_blocks: int | None = Field(
        None, ge=2, description="KV blocks in the pool (per replica; blocks of the whole model, every rank holding "
        "its KV heads of each); None = derived from kv_cache_memory_gb.")
    kv_cache_memory_gb: float = Field(
        1.0, gt=0, description="KV pool size when num_blocks is None, per device: with tensor_parallel_size > 1 each "
        "rank's pool, whose blocks hold only its KV heads (so a tp replica holds more blocks of the whole model).")
    max_num_seqs: int = Field(64, ge=1, description="Most requests running at once.")
    max_num_batched_tokens: int = Field(
        512, ge=1, description="Token budget of one engine step (decodes + prefill chunks).")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output; None = the model's max_position_embeddings.")
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "torch", "cpu_paged", "flash_attn"] = "auto"
    model_ops: Literal["auto", "torch", "cpu_kernels"] = Field(
        "auto", description='Linear and RMSNorm: "auto" = compiled CPU kernels on CPU float32 when they build, else torch.')
    device: str = Field("auto", description='"auto" (cuda when available), "cpu", "cuda", "cuda:N".')
    static_decode: Literal["auto", "off", "eager", "graphs"] = Field(
        "auto", description='Decode-only steps on fixed-shape inputs per batch bucket, a persistent block table and '
        'attention that reads the paged cache in place (cluster/engine/static_decode.py): "graphs" captures each '
        'bucket as a CUDA graph (CUDA only), "eager" runs the same path uncaptured, "off" builds every step\'s '
        'shapes. "auto" = graphs on CUDA with the torch attention backend and torch ops, else off.')
    async_output: Literal["auto", "on", "off"] = Field(
        "auto", description='Process a decode-only step\'s outputs (detokenize, build the stream deltas) while the '
        'next step runs on the device, as vLLM v0\'s async output processing: a step\'s deltas are emitted one step '
        'later, after the next step is launched. Requests with stop strings (whose text can end them) are processed '
        'in their own step. "auto" = on with a CUDA device (where the forward runs asynchronously), off on CPU.')
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description='"auto" = the checkpoint\'s dtype.')
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto", description='The KV pool\'s element type. "auto" = the run dtype; "fp8" (= "fp8_e4m3"): float8 '
        "e4m3 with one scale per layer for K and one for V, calibrated at load (cluster/engine/attention/fp8_kv.py): "
        "half the bytes of a bf16 block, so twice the blocks for the same kv_cache_memory_gb. Attention dequantizes "
        "the blocks it reads (torch attention backend only); a pull from a pool of another KV dtype converts.")
    max_waiting: int | None = Field(
        None, ge=0, description="Most requests waiting for admission; more are refused (overload). None = unbounded.")
    queue_ttl_s: float | None = Field(
        None, gt=0, description="A request waiting in the queue this long is rejected (overload): since its arrival, "
        "or since it went back to the queue (preempted). None = no limit.")
    limits: RequestLimits = Field(default_factory=RequestLimits, description="Caps on one request's input (400).")
    speculative: SpeculativeOptions = Field(
        default_factory=SpeculativeOptions, description="Speculative decoding (off by default).")
    kv_tiers: KVTierOptions = Field(
        default_factory=KVTierOptions, description="KV tiers below the device pool (off by default).")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="Ranks the model is sharded over (cluster/engine/distributed/): query heads, "
        "MLP rows, every expert's rows and vocabulary split tp ways; KV heads split when tp divides them, "
        "replicated when tp is a multiple of them, else refused; a latent-attention (MLA) cache whole on every "
        "rank. The engine is rank 0 of a torch.distributed group whose other ranks run the worker loop (a Serve "
        "replica starts them as Ray actors in its placement group).")
    expert_parallel: bool = Field(
        False, description="Mixtures of experts (Mixtral, Qwen3-MoE, DeepSeek-V2/V3) over the tensor_parallel_size "
        "ranks: each rank holds num_experts / tp whole routed experts instead of 1/tp of every expert's rows (vLLM's "
        "--enable-expert-parallel); tp must divide the routed experts' count. The router is whole on every rank, "
        "DeepSeek's shared experts stay split by their rows, one all-reduce sums a layer's output as without it. "
        "Refused for a model without routed experts; at tensor_parallel_size 1 the one rank holds every expert.")

    @model_validator(mode="after")
    def _tiers_need_prefix_caching(self) -> "EngineOptions":
        if self.kv_tiers.enabled and not self.enable_prefix_caching:
            raise ValueError("kv_tiers.host_blocks > 0 needs enable_prefix_caching: the host tier holds "
                             "blocks by their prefix-cache hash")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_alone(self) -> "EngineOptions":
        # Both copy or run on rank 0's KV cache only; sharding them is later work of issue 41.
        if self.tensor_parallel_size > 1 and (self.kv_tiers.enabled or self.speculative.method == "draft"):
            raise ValueError("tensor_parallel_size > 1 does not support kv_tiers or a draft model yet (issue 41)")
        return self

    @model_validator(mode="after")
    def _fp8_kv_paths(self) -> "EngineOptions":
        if self.kv_cache_dtype == "auto":
            return self
        if self.tensor_parallel_size > 1:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype} is not implemented with tensor_parallel_size > 1")
        if self.attention_backend in ("cpu_paged", "flash_attn"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype}: attention_backend={self.attention_backend} reads "
                             "a float KV pool; fp8 KV is read by the torch backend (torch or auto)")
        if self.static_decode in ("eager", "graphs"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype}: static_decode={self.static_decode}'s paged kernel "
                             "reads a float KV pool; use static_decode auto or off")
        return self

    @model_validator(mode="after")
    def _static_decode_alone(self) -> "EngineOptions":
        if self.static_decode in ("eager", "graphs"):
            if self.tensor_parallel_size > 1:
                raise ValueError("static_decode runs one device's model: tensor_parallel_size > 1 needs it off")
            if self.model_ops == "cpu_kernels" or self.attention_backend in ("cpu_paged", "flash_attn"):
                raise ValueError(f"static_decode={self.static_decode} is the torch path: it needs model_ops torch "
                                 "and attention_backend torch (or auto)")
        return self

    def num_kv_blocks(self, block_bytes: int) -> int:
        return self.num_blocks or int(self.kv_cache_memory_gb * 2**30 // block_bytes)


class EngineConfig(EngineOptions):
    """One engine: its options plus the checkpoint and what only an in-process engine sets."""

    model: str = Field(description="A Hugging Face checkpoint directory, or a Hub repo id (org/name) resolved through "
                       "huggingface_hub's cache (HF_HOME; HF_HUB_OFFLINE=1: the cache only).")
    seed: int = 0
    cache_salt: str = Field("", description="Extra salt in every block hash (e.g. a deployment id).")


def run_dtype(mc: ModelConfig, opts: EngineOptions) -> str:
    """The dtype the model runs in (weights and activations)."""
    return mc.dtype if opts.dtype == "auto" else opts.dtype


def cache_dtype(mc: ModelConfig, opts: EngineOptions) -> str:
    """The KV pool's dtype: the run dtype, or float8_e4m3fn (kv_cache_dtype fp8)."""
    return KV_CACHE_DTYPES.get(opts.kv_cache_dtype) or run_dtype(mc, opts)


def kv_block_shape(mc: ModelConfig, block_size: int) -> tuple[int, ...]:
    """One block of all layers, one contiguous region: [L, 2, bs, H_kv, D] (each token's K and V per
    KV head), or under latent attention [L, 1, bs, 1, kv_lora_rank + qk_rope_head_dim] (each token's
    latent and rope key, shared by every head)."""
    if mc.mla is not None:
        return (mc.num_layers, 1, block_size, 1, mc.mla.latent_dim)
    return (mc.num_layers, 2, block_size, mc.num_kv_heads, mc.head_dim)


def check_latent_paths(mc: ModelConfig, opts: EngineOptions) -> None:
    """A latent pool is read by model/mla.py alone: options choosing a path that reads per-head K and V
    (or an fp8 pool) are refused, named, rather than ignored."""
    if mc.mla is None:
        return
    what = f"latent attention (model_type {mc.model_type!r})"
    if opts.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={opts.kv_cache_dtype} is not implemented for {what}: its cache holds the "
                         "latent in the run dtype; use kv_cache_dtype auto")
    if opts.static_decode in ("eager", "graphs"):
        raise ValueError(f"static_decode={opts.static_decode}'s paged kernel reads per-head K and V, not the latent "
                         f"of {what}; use static_decode auto or off")
    if opts.attention_backend not in ("auto", "torch"):
        raise ValueError(f"attention_backend={opts.attention_backend} reads per-head K and V; {what} attends over "
                         "its latent itself (model/mla.py); use attention_backend auto")


def kv_block_bytes(mc: ModelConfig, opts: EngineOptions) -> int:
    """Bytes of one KV block (all layers) for these engine options (refusing those a latent pool cannot take,
    and expert_parallel on a model without experts)."""
    check_latent_paths(mc, opts)
    check_expert_parallel(mc, opts.expert_parallel)
    return math.prod(kv_block_shape(mc, opts.block_size)) * DTYPE_BYTES[cache_dtype(mc, opts)]


def kv_block_bytes_per_rank(mc: ModelConfig, opts: EngineOptions) -> int:
    """Bytes of one block's share on one tensor-parallel rank (its KV heads; the whole block at tp=1,
    and under latent attention, whose latent every rank holds whole): what a device's
    kv_cache_memory_gb is divided by."""
    if mc.mla is not None:
        return kv_block_bytes(mc, opts)
    heads = kv_heads_per_rank(mc.num_kv_heads, opts.tensor_parallel_size)
    return kv_block_bytes(mc, opts) // mc.num_kv_heads * heads
