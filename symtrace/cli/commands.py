"""The ``show``, ``draw``, ``explain`` and ``diff`` subcommands (``lower`` is in lowering.py).

Each takes the parsed arguments and returns an exit code; user errors are raised as
:class:`~symtrace.cli.errors.CliError`.
"""
from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Tuple

from .errors import CliError, ExitCode, describe_exception
from .loading import is_saved_spec, load_model, make_inputs, trace_model
from .views import aligned_tables, format_histogram_diff, graph_text, unified_diff

__all__ = ["load", "prepare", "cmd_show", "cmd_draw", "cmd_explain", "cmd_diff", "check_writable"]

#: What ``draw -o`` can write (the file suffix picks one).
DRAW_FORMATS = ("svg", "png", "pdf", "dot", "gv")


def load(args: argparse.Namespace, spec: str) -> Tuple[Any, tuple]:
    """The model of ``spec`` and the example inputs of ``args``."""
    model = load_model(spec, train=args.train)
    return model, make_inputs(args.input, seed=args.seed, int_high=args.int_high)


def prepare(args: argparse.Namespace, spec: str) -> Tuple[Any, tuple, Any]:
    """Load ``spec`` and trace it: ``(model, inputs, graph_module)``."""
    model, inputs = load(args, spec)
    gm = trace_model(model, inputs, args.trace_mode, spec, args.progress)
    return model, inputs, gm


def check_writable(path: str) -> None:
    """Refuse early (before tracing) an output path whose folder is missing or read-only."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(ExitCode.OUTPUT, f"cannot write {path!r}: the folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise CliError(ExitCode.OUTPUT, f"cannot write {path!r}: it is a folder")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CliError(ExitCode.OUTPUT, f"cannot write {path!r}: permission denied")


# --- show ----------------------------------------------------------------------------------
def cmd_show(args: argparse.Namespace) -> int:
    _, _, gm = prepare(args, args.model)
    if args.view == "table":
        from .. import print_tabular
        print_tabular(gm)
    else:
        print(graph_text(gm, args.view))
    return ExitCode.OK


# --- draw ----------------------------------------------------------------------------------
def _draw_format(path: str) -> str:
    fmt = os.path.splitext(path)[1].lstrip(".").lower()
    if fmt not in DRAW_FORMATS:
        raise CliError(ExitCode.USAGE, f"cannot tell what to draw into {path!r}: give -o a file "
                                       f"ending in {', '.join('.' + f for f in DRAW_FORMATS)}")
    return fmt


def cmd_draw(args: argparse.Namespace) -> int:
    from .. import draw, to_dot
    if args.output is None:
        _, _, gm = prepare(args, args.model)
        print(to_dot(gm))
        return ExitCode.OK
    _draw_format(args.output)
    check_writable(args.output)
    _, _, gm = prepare(args, args.model)
    try:
        with warnings.catch_warnings(), args.progress(f"drawing {args.output}"):
            warnings.simplefilter("ignore", UserWarning)  # the fallback is reported below
            written = draw(gm, args.output)
    except OSError as e:
        raise CliError(ExitCode.OUTPUT, f"cannot write {args.output!r}: {e.strerror or e}") from None
    except RuntimeError as e:  # `dot` itself failed
        raise CliError(ExitCode.OUTPUT, str(e)) from None
    if os.path.abspath(written) != os.path.abspath(args.output):
        print(f"graphviz's `dot` program was not found, so {args.output} was not drawn; wrote "
              f"the DOT text to {written} instead (install graphviz, e.g. apt-get install "
              "graphviz, to draw pictures)")
    else:
        print(f"wrote {written} ({len(gm.graph)} nodes)")
    return ExitCode.OK


# --- explain -------------------------------------------------------------------------------
def cmd_explain(args: argparse.Namespace) -> int:
    import symtrace  # (not `from .. import explain`: the layering test reads that as symtrace.explain)
    if is_saved_spec(args.model):
        raise CliError(ExitCode.USAGE, "explain traces the model again, so it needs a model "
                                       "factory (package.module:factory), not a saved graph")
    model, inputs = load(args, args.model)
    mode = args.trace_mode or ("example" if inputs else "symbolic")
    if mode == "example" and not inputs:
        raise CliError(ExitCode.USAGE, "--trace-mode example needs the input shapes: add --input SHAPE")
    try:
        with args.progress(f"tracing {args.model}"):
            report = symtrace.explain(model, *inputs) if mode == "example" else symtrace.explain(model)
    except Exception as e:
        raise CliError(ExitCode.TRACE, f"tracing {args.model} failed: the model raised "
                                       f"{describe_exception(e)}") from None
    print(report)
    return ExitCode.OK if report.ok else ExitCode.TRACE


# --- diff ----------------------------------------------------------------------------------
def cmd_diff(args: argparse.Namespace) -> int:
    _, _, a = prepare(args, args.a)
    _, _, b = prepare(args, args.b)
    if args.by == "histogram":
        text = format_histogram_diff(a, b, args.a, args.b)
    else:
        ta, tb = aligned_tables([a, b], args.source) if args.by == "table" else \
            (graph_text(a, args.by), graph_text(b, args.by))
        text = unified_diff(ta, tb, args.a, args.b, context=args.context)
    if not text:
        print(f"no differences by {args.by} ({len(a.graph)} nodes)")
        return ExitCode.OK
    print(text)
    return ExitCode.DIFFERENT
