"""`python -m megatron_lc.models --list`: the flavours and their parameter counts (counted on meta)."""

import argparse

from megatron_lc.models.llama import FLAVOURS, build_model, count_parameters


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron_lc.models", description=__doc__)
    parser.add_argument("--list", action="store_true", help="print each flavour with its parameter count")
    args = parser.parse_args(argv)
    if not args.list:
        parser.print_help()
        return
    print(f"{'flavour':<12} {'parameters':>16}  layers hidden heads kv  ffn    vocab  tied")
    for name, c in FLAVOURS.items():
        n = count_parameters(build_model(c, device="meta"))
        print(f"{name:<12} {n:>16,}  {c.num_layers:>6} {c.hidden_size:>6} {c.num_attention_heads:>5} "
              f"{c.num_query_groups:>2} {c.ffn_hidden_size:>5} {c.vocab_size:>7}  {c.tie_embeddings}")


if __name__ == "__main__":
    main()
