"""Command line: ``coalesced-int4 <command>`` or ``python -m coalesced_int4 <command>``.

demo      SmolLM2-135M-Instruct end to end: quantize, save, reload, generate (no network)
quantize  convert a Hugging Face safetensors checkpoint, streaming
generate  greedy text from a Hugging Face model (``--quantize`` quantizes a dense one at load)
eval      perplexity of a Hugging Face model over strided windows of a text file
inspect   summarise a checkpoint; ``--error SRC`` adds per-layer SNR against the dense source,
          ``--verify`` checks every stored tensor against its recorded checksum

Bad input (a damaged checkpoint, overlapping paths, a weight that cannot be quantized) is
printed as one ``error:`` line naming the file and tensor, with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coalesced-int4", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run SmolLM2-135M-Instruct end to end")
    demo.add_argument("--tokens", type=int, default=16, help="new tokens to generate")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")

    quantize = commands.add_parser("quantize", help="convert a Hugging Face checkpoint")
    quantize.add_argument("src", help="safetensors file, directory (with or without index), or a .gguf file "
                                      "(written as a dense checkpoint first)")
    quantize.add_argument("dst", help="output directory")
    quantize.add_argument("--include", action="append", default=None,
                          help="fnmatch pattern of tensor names to quantize (repeatable)")
    quantize.add_argument("--exclude", action="append", default=None,
                          help="fnmatch pattern of tensor names to copy (default: *embed*)")
    quantize.add_argument("--device", default="cpu", help="where to quantize, e.g. cuda")
    quantize.add_argument("--max-shard-size", default="5GB")

    for name, help_text in (("generate", "greedy text from a Hugging Face model"),
                            ("eval", "perplexity of a Hugging Face model on a text file")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("model", help="transformers model directory (dense or quantized) or a .gguf file")
        command.add_argument("--quantize", action="store_true", help="quantize a dense model at load")
        command.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    generate = commands.choices["generate"]
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-new-tokens", type=int, default=32)
    evaluate = commands.choices["eval"]
    evaluate.add_argument("--text", required=True, help="a plain text file")
    evaluate.add_argument("--window", type=int, default=512, help="tokens a window sees")
    evaluate.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    evaluate.add_argument("--max-windows", type=int, default=0, help="stop after this many windows (0: all)")

    inspect = commands.add_parser("inspect", help="summarise a quantized checkpoint")
    inspect.add_argument("path")
    inspect.add_argument("--error", metavar="SRC", default=None,
                         help="dense source checkpoint: print per-layer dequantization SNR")
    inspect.add_argument("--verify", action="store_true",
                         help="check every stored tensor's CRC-32 against the one recorded at save")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from coalesced_int4.serialization import CheckpointError

    try:
        if args.command == "demo":
            from coalesced_int4.demo import run_demo

            run_demo(new_tokens=args.tokens, device=args.device)
        elif args.command == "quantize":
            from coalesced_int4.hf_tools import as_checkpoint_directory
            from coalesced_int4.serialization.convert import DEFAULT_EXCLUDE, convert_checkpoint

            with as_checkpoint_directory(args.src) as src:
                summary = convert_checkpoint(
                    src, args.dst,
                    include=args.include or ("*",),
                    exclude=args.exclude or DEFAULT_EXCLUDE,
                    device=args.device,
                    max_shard_size=args.max_shard_size,
                )
            print(summary)
        elif args.command in ("generate", "eval"):
            from pathlib import Path

            import torch

            from coalesced_int4 import hf_tools

            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            model, tokenizer = hf_tools.load(args.model, quantize=args.quantize, device=device)
            if args.command == "generate":
                print(hf_tools.generate_text(model, tokenizer, args.prompt, args.max_new_tokens))
            else:
                text = Path(args.text).read_text()
                ppl = hf_tools.perplexity(model, tokenizer, text, args.window, args.stride, args.max_windows)
                print(f"perplexity {ppl:.3f} ({args.text}, window {args.window}, stride {args.stride})")
        elif args.command == "inspect":
            from coalesced_int4.serialization.convert import inspect_checkpoint

            print(inspect_checkpoint(args.path, args.error, verify=args.verify))
    except (CheckpointError, ValueError, OSError) as error:  # a bad input, said in one line
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
