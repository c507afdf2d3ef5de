"""The ``ringpass`` command line. ``ringpass demo`` for now; ``inspect``, ``plan``, ``bench`` later."""

from __future__ import annotations

import argparse
import sys

from ringpass import demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ringpass", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    d = commands.add_parser("demo", help="ring attention on CPU processes against unsharded SDPA")
    defaults = demo.DemoConfig()
    d.add_argument("--world-size", type=int, default=defaults.world_size, help="processes in the ring")
    d.add_argument("--seq-len", type=int, default=defaults.seq_len)
    d.add_argument("--batch", type=int, default=defaults.batch)
    d.add_argument("--heads", type=int, default=defaults.heads, help="query heads")
    d.add_argument("--kv-heads", type=int, default=defaults.kv_heads, help="key/value heads (GQA)")
    d.add_argument("--head-dim", type=int, default=defaults.head_dim)
    d.add_argument("--dtype", choices=sorted(demo.DTYPES), default=defaults.dtype)
    d.add_argument("--bidirectional", action="store_true", help="no causal mask")
    d.add_argument("--layout", choices=["auto", "zigzag", "contiguous"], default=defaults.layout)
    d.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is stopped")
    args = parser.parse_args(argv)

    config = demo.DemoConfig(
        world_size=args.world_size, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
        seq_len=args.seq_len, head_dim=args.head_dim, dtype=args.dtype, causal=not args.bidirectional,
        layout=args.layout,
    )
    print(demo.format_report(demo.run_demo(config, timeout=args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
