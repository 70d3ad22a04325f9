"""An fp8 KV pool (engine.kv_cache_dtype fp8): float8 e4m3 with one scale per layer for K and one for V.

Stored = saturate(x * (1 / scale)) in float8_e4m3fn (|stored| <= 448); read = stored * scale, in
the run dtype. Both are products by a float32 constant, so the quantization of a value is the
same bits wherever it happens: in a layer's KV write, or converting a pulled block
(kv_transfer/convert.py).

Scales are per tensor, per layer (vLLM's default for an fp8 KV cache), calibrated once at load: one
forward of CALIBRATION_TEXT in the run dtype, scale = amax / K_RANGE for K and amax / V_RANGE for V
(vLLM's calculate_kv_scales constants: the calibration's largest value lands at 200 and 100 of
e4m3's 448, leaving 2.2x and 4.5x of headroom for other inputs; a larger value saturates, never
NaN). The same checkpoint and run dtype give the same scales on every replica, and a KV layout
carries them, so a pull between pools of other dtypes or scales converts exactly. Not chosen:
dynamic per-block scales (a decode writes its block a token at a time, so the block's scale would
move under the tokens already stored), and 1.0 (values below e4m3's 2^-6 lose their precision: a V
of magnitude 0.01 would keep two bits).

Reading: the torch backend's gathers (only the blocks a step reads) are dequantized. A chunk that
is its request's whole context attends to its own fresh K/V, as over a float pool, so a cold
one-chunk prefill computes what a float pool's engine computes (first token included) and stores
exactly quantize() of its K/V: what a float pool's blocks become when an fp8 engine pulls them.
"""

from __future__ import annotations

import logging

import torch

from cluster.engine.attention.metadata import AttentionMetadata, PrefillSpan
from cluster.engine.attention.torch_sdpa import TorchSDPABackend

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
K_RANGE, V_RANGE = 200.0, 100.0
MIN_AMAX = 1e-6  # a layer whose calibration K or V is all zeros still gets a usable scale

CALIBRATION_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press. Within fifty years, presses in more than "
    "two hundred European cities had printed some twenty million volumes.\n\n"
    "def mean(xs: list[float]) -> float:\n    return sum(xs) / len(xs) if xs else 0.0\n\n"
    "Q: What is 17 * 23? A: 391. Q: Name three primary colours. A: red, yellow and blue.\n"
    "User: Could you summarise the plot of Hamlet in two sentences?\nAssistant: Prince Hamlet seeks to "
    "avenge his father's murder by his uncle Claudius, who has taken the throne and married Hamlet's mother. "
    "His hesitation and feigned madness lead to a chain of deaths, his own among them."
)


def f32(x: float) -> float:
    """x rounded to float32: a scale a layout carries (JSON, pickles) as the exact value used."""
    return float(torch.tensor(x, dtype=torch.float32))


def quantize(x: torch.Tensor, inv_scale: float | torch.Tensor) -> torch.Tensor:
    """x (any float dtype) -> float8_e4m3fn of x / scale, saturated at +-448."""
    return (x.float() * inv_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x8: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x8.float() * scale).to(dtype)


class FP8LayerBackend(TorchSDPABackend):
    """The torch backend over one layer of an fp8 pool: quantizes what it writes, dequantizes what it reads."""

    name = "torch+fp8"

    def __init__(self, k_scale: float, v_scale: float, dtype: torch.dtype):
        self.k_scale, self.v_scale, self.dtype = k_scale, v_scale, dtype
        self.k_inv, self.v_inv = f32(1.0 / k_scale), f32(1.0 / v_scale)

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
        idx = (meta.slot_blocks, meta.slot_offsets)
        k_cache.index_put_(idx, quantize(k, self.k_inv))
        v_cache.index_put_(idx, quantize(v, self.v_inv))

    def read_k(self, cache, idx):
        return dequantize(cache.index_select(0, idx), self.k_scale, self.dtype)

    def read_v(self, cache, idx):
        return dequantize(cache.index_select(0, idx), self.v_scale, self.dtype)


class FP8KV:
    """An fp8 pool's scales ((k, v) per layer, float32 values) and each layer's backend."""

    def __init__(self, scales: tuple[tuple[float, float], ...], dtype: torch.dtype):
        self.scales = tuple((f32(k), f32(v)) for k, v in scales)
        self._layers = [FP8LayerBackend(k, v, dtype) for k, v in self.scales]

    def layer(self, i: int, backend) -> FP8LayerBackend:
        return self._layers[i]


class _Recorder:
    """A layer's backend during calibration: the float backend, noting |K| and |V|'s maxima."""

    def __init__(self, inner, amax: list[list[float]], i: int):
        self.inner, self.amax, self.i = inner, amax, i

    def write_kv(self, k_cache, v_cache, k, v, meta):
        self.amax[self.i] = [float(k.abs().max()), float(v.abs().max())]
        self.inner.write_kv(k_cache, v_cache, k, v, meta)

    def attend(self, *args):
        return self.inner.attend(*args)


class Calibration:
    """The model's kv_quant while one forward records each layer's K and V maxima."""

    def __init__(self, num_layers: int):
        self.amax = [[0.0, 0.0] for _ in range(num_layers)]

    def layer(self, i: int, backend) -> _Recorder:
        return _Recorder(backend, self.amax, i)

    def scales(self) -> tuple[tuple[float, float], ...]:
        return tuple((max(k, MIN_AMAX) / K_RANGE, max(v, MIN_AMAX) / V_RANGE) for k, v in self.amax)


def calibrate(model, token_ids: list[int], block_size: int, dtype: torch.dtype,
              device: torch.device) -> tuple[tuple[float, float], ...]:
    """Per-layer (K, V) scales from one cold forward of `token_ids` over a scratch float pool."""
    cfg = model.cfg
    n = len(token_ids)
    nb = -(-n // block_size)
    pool = torch.zeros(nb, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
    pos = torch.arange(n, device=device)
    blocks = torch.arange(nb, device=device)
    meta = AttentionMetadata(
        slot_blocks=pos // block_size, slot_offsets=pos % block_size, num_decode=0,
        prefills=(PrefillSpan(0, n, n, blocks, None),),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=blocks[None].int(), max_q_len=n, max_seq_len=n, block_size=block_size, decode_seq_lens=())
    calibration = Calibration(cfg.num_layers)
    previous, model.kv_quant = model.kv_quant, calibration
    try:
        model(torch.tensor(token_ids, device=device), pos, pool, meta, TorchSDPABackend(),
              torch.tensor([n - 1], device=device))
    finally:
        model.kv_quant = previous
    return calibration.scales()


def check_fp8_device(device: torch.device) -> None:
    """Refuse a device that cannot store and convert float8_e4m3fn, naming the option."""
    try:
        quantize(torch.ones(4, device=device), 1.0).float().sum().item()
    except (RuntimeError, TypeError, NotImplementedError) as e:
        raise ValueError(f"kv_cache_dtype=fp8: device {device} cannot hold float8_e4m3fn KV ({e})") from None


def kv_quant_for(model, kv_dtype: torch.dtype, tokenizer, max_model_len: int, block_size: int,
                 device: torch.device) -> FP8KV | None:
    """The model's kv_quant for a pool of `kv_dtype`: calibrated FP8KV for fp8, None for the run dtype."""
    if kv_dtype != FP8:
        return None
    check_fp8_device(device)
    vocab = model.cfg.vocab_size
    ids = [t for t in tokenizer.encode(CALIBRATION_TEXT) if t < vocab][:max_model_len]
    run_dtype = model.embed_tokens.weight.dtype
    scales = calibrate(model, ids, block_size, run_dtype, device)
    log.info("fp8 KV scales from %d calibration tokens: K %.3g..%.3g, V %.3g..%.3g", len(ids),
             min(k for k, _ in scales), max(k for k, _ in scales), min(v for _, v in scales), max(v for _, v in scales))
    return FP8KV(scales, run_dtype)
