"""flashtile's benchmarks: ``flashtile bench``, ``flashtile info`` and ``flashtile tune``.

- ``registry``: the providers (attention implementations) and the sweeps (shapes), and
  ``attn_flops``, the one FLOP count every table uses.
- ``run``: input sets, warm-up and timing, peak memory, OOM / n/a handling; one runner.
- ``report``: the markdown tables, the raw JSON (with machine info) and the plots.
- ``machine``: versions, device, backend, and the device's measured ceilings (cached).
- ``accuracy``: the precision table (fp32, TF32, fp16, bf16 against float64).
- ``tune``: the tile study that fills the tuned-config cache read by ``ops/configs.py``.
- ``commands``: the ``bench``, ``info`` and ``tune`` command-line handlers.
- ``decode``: the decode (KV-cache) benchmark of issue 4, on its own for now.

Adding a provider or a sweep: docs/benchmarks/ADDING_A_BENCH.md.
"""
