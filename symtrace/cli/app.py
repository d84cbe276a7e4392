"""Argument parsing and the ``main`` entry point of the ``symtrace`` command."""
from __future__ import annotations

import argparse
import functools
import os
import sys
import textwrap
import traceback
from typing import List, Optional

from .errors import EXIT_CODE_HELP, CliError, ExitCode
from .loading import SPEC_HELP, parse_input
from .progress import Progress
from .views import VIEWS

__all__ = ["main", "build_parser"]

_DESCRIPTION = """\
Trace a PyTorch model with symtrace and look at the graph: print it, draw it, explain its
guards, lower it to kernels, or compare two models."""

_MODEL_FORMS = """\
MODEL is one of
  package.module:factory   e.g. examples.models:SmallResNet (imported from the working directory)
  path/to/file.py:factory  e.g. my_net.py:make"""

_SAVED_FORM = """
  saved.symtrace           a GraphModule saved with symtrace.save(gm, path); read with
                           symtrace.load, which runs nothing from the file (pickle and
                           torch.save files are refused)"""

_EPILOG = _MODEL_FORMS + _SAVED_FORM + f"""
factory() is called with no arguments and must return an nn.Module (an nn.Module object is
used as is). Models are put in eval mode unless --train is given.

Inputs: --input SHAPE[:DTYPE], once per positional argument of forward, in order.
  SHAPE is the sizes joined by 'x' (1x3x32x32), or 'scalar' for a 0-d tensor;
  DTYPE is a torch dtype name (float32 by default; float16, bfloat16, int64, bool ...).
  Floats are standard normal, integers uniform in [0, --int-high), seeded by --seed.
  With inputs the model is traced on them (--trace-mode example); without, symbolically.

Exit codes:
{chr(10).join(f"  {int(c):3d}  {text}" for c, text in EXIT_CODE_HELP.items())}

Examples:
  symtrace show examples.models:SmallResNet --input 1x3x32x32 --as histogram
  symtrace draw examples.models:TransformerBlock --input 2x8x64 -o block.svg
  symtrace explain examples.cli_models:branchy --input 4x8
  symtrace diff examples.cli_models:mlp_relu examples.cli_models:mlp_gelu --input 2x16"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=32)


def _input_type(text: str):
    try:
        return parse_input(text)
    except CliError as e:
        raise argparse.ArgumentTypeError(e.message) from None


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {minimum}")
        return value
    return parse


def _model_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("model and inputs")
    g.add_argument("-i", "--input", action="append", default=[], type=_input_type, metavar="SHAPE[:DTYPE]",
                   help="an example input of forward, e.g. 1x3x32x32 or 8x128:int64 (repeat for each argument)")
    g.add_argument("--trace-mode", choices=("example", "symbolic"), default=None,
                   help="trace on the example inputs (default when --input is given) or symbolically "
                        "like torch.fx (default without inputs; inputs then only fill in shapes)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    g.add_argument("--int-high", type=_count(1), default=10, metavar="N",
                   help="integer inputs are drawn from [0, N) (default 10)")
    g.add_argument("--train", action="store_true", help="keep the model in training mode (default: eval)")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress indicators on stderr")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``symtrace`` and its subcommands."""
    common = _model_options()
    parser = argparse.ArgumentParser(prog="symtrace", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=_Formatter)
    from .. import __version__
    parser.add_argument("--version", action="version", version=f"symtrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help: str, description: str, saved: bool = True) -> argparse.ArgumentParser:
        epilog = _EPILOG.split("\n\nExamples:")[0]
        if not saved:  # the command re-traces: only the forms it accepts are listed
            epilog = epilog.replace(_SAVED_FORM, "")
        return sub.add_parser(name, help=help, description=textwrap.fill(description, 92), parents=[common],
                              epilog=epilog, formatter_class=_Formatter)

    p = add("show", "print the traced graph",
            "Trace MODEL and print its graph as a table (opcode, name, target, args, tensor type, "
            "source line), as the generated Python code, as an op histogram (count of each "
            "function, method and module type, most frequent first) or in the compact graph form.")
    p.add_argument("model", metavar="MODEL", help=SPEC_HELP)
    p.add_argument("--as", dest="view", choices=("table", "code", "histogram", "graph"), default="table",
                   help="what to print (default: table)")

    p = add("draw", "draw the traced graph with graphviz",
            "Trace MODEL and draw its graph, one box per node, clustered by submodule. Without -o "
            "the DOT text goes to stdout. When graphviz's `dot` program is missing, the DOT text "
            "is written next to the requested picture (same name, .dot) and a note says so.")
    p.add_argument("model", metavar="MODEL", help=SPEC_HELP)
    p.add_argument("-o", "--output", metavar="FILE",
                   help="picture to write: .svg, .png, .pdf, or .dot/.gv for DOT text")

    p = add("explain", "list guards, specialisations and what could not be traced",
            "Trace MODEL and report every guard and specialisation with the user's file:line, "
            "every site the tracer could not capture, and the limits of a Python-level tracer. "
            "Exits with the trace error code when tracing fails (the report says why).", saved=False)
    p.add_argument("model", metavar="MODEL", help="package.module:factory or path/to/file.py:factory")

    p = add("lower", "compile the graph to kernels, list them and time against eager",
            "Trace MODEL on the inputs, compile it with symtrace.lower.compile, list the kernels, "
            "check the result against eager PyTorch and time both, interleaved call by call "
            "(medians and interquartile ranges of --repeat calls, without autograd, with the "
            "machine's load average). A speed-up is reported only where the two ranges do not "
            "overlap. Needs --input.")
    p.add_argument("model", metavar="MODEL", help=SPEC_HELP)
    p.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: C kernels; cuda: Triton kernels on a GPU (default: cpu)")
    p.add_argument("--report", action="store_true", help="print what was lowered and why not")
    p.add_argument("--source", action="store_true", help="print the generated kernel source")
    p.add_argument("--repeat", type=_count(0), default=20, metavar="N", help="timed calls of each (default 20; 0: no timing)")
    p.add_argument("--warmup", type=_count(0), default=3, metavar="N", help="untimed calls first (default 3)")

    p = add("diff", "compare the graphs of two models",
            "Trace models A and B on the same inputs and compare their graphs: a unified diff of "
            "the node tables (without source lines unless --source), code or compact graphs, or "
            "the op counts that differ (--by histogram). Exits 0 when they are the same, 1 when "
            "they differ.")
    p.add_argument("a", metavar="A", help=SPEC_HELP)
    p.add_argument("b", metavar="B", help="the model to compare A with, in the same forms")
    p.add_argument("--by", choices=VIEWS, default="table", help="what to compare (default: table)")
    p.add_argument("--source", action="store_true", help="compare the source file:line column too")
    p.add_argument("-U", "--context", type=_count(0), default=3, metavar="N", help="lines of context (default 3)")
    return parser


def _run(args: argparse.Namespace) -> int:
    from . import commands, lowering
    handlers = {"show": commands.cmd_show, "draw": commands.cmd_draw, "explain": commands.cmd_explain,
                "diff": commands.cmd_diff, "lower": lowering.cmd_lower}
    return int(handlers[args.command](args))


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``symtrace`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version or a usage error (already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else ExitCode.USAGE)
    args.progress = functools.partial(Progress, enabled=False if args.quiet else None)
    try:
        return _run(args)
    except CliError as e:
        print(f"symtrace: error: {e.message}", file=sys.stderr)
        return int(e.code)
    except KeyboardInterrupt:
        print("symtrace: interrupted", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:  # `symtrace show ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return int(ExitCode.OK)
    except Exception:
        traceback.print_exc()
        print("symtrace: internal error: this is a bug in symtrace; please report it with the "
              "traceback above", file=sys.stderr)
        return int(ExitCode.INTERNAL)
