"""The engine both pools run: model, KV cache, attention, scheduler, runner, sampler, tokenizer,
validation and the engine loop. No Ray, no router, no KV transfer; importing this package is cheap
(torch is imported only by the modules that compute)."""
