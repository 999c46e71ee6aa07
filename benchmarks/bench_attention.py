"""Superseded by ``flashtile bench`` and ``flashtile tune`` (one registry, one runner).

This script made the issue-2 table (docs/benchmarks/issue2-speed.md). It now forwards:

    python benchmarks/bench_attention.py [--headdim ..] [--seqlens ..] [--providers ..]
        -> python -m flashtile bench --providers flashtile sdpa-flash sdpa-cudnn
           sdpa-efficient --seqlens 1k 2k 4k 8k 16k [your options]
    python benchmarks/bench_attention.py --sweep [--headdim ..]
        -> python -m flashtile tune [--headdim ..]

``--json FILE`` is gone: ``flashtile bench`` writes results.json in its ``--out`` folder.
The tile candidates now live in ``flashtile/ops/configs.py`` (``CANDIDATES``).
"""

import sys

from flashtile.cli import main

# The issue-2 table: the peers and lengths it had (64k/32k and the naive paths came later).
ISSUE2 = {"--providers": ["flashtile", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"],
          "--seqlens": ["1k", "2k", "4k", "8k", "16k"]}


def translate(argv: list[str]) -> list[str]:
    argv = list(argv)
    if "--json" in argv:
        i = argv.index("--json")
        del argv[i:i + 2]
        print("--json: see results.json in the --out folder", file=sys.stderr)
    if "--sweep" in argv:
        argv.remove("--sweep")
        return ["tune", *argv]
    defaults = [x for flag, values in ISSUE2.items() if flag not in argv
                for x in (flag, *values)]
    return ["bench", *defaults, *argv]


if __name__ == "__main__":
    sys.exit(main(translate(sys.argv[1:])))
