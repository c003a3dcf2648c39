"""The `kvconvert` command line (the console script's entry point). Each command lives in its own
module of kvconvert.commands and is loaded lazily, so `kvconvert budget` never imports torch and a
broken feature cannot break the others. User errors (KVConvertError) print one line and exit 2."""

from __future__ import annotations

import importlib
import sys

import click

from kvconvert.errors import KVConvertError, interrupted_by_signal, raise_on_sigterm, record_sigint

# command name -> ("module:attribute", one-line help)
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("kvconvert.commands.inspect:inspect_cmd",
                "Describe a model: attention kind, heads, KV bytes per token."),
    "budget": ("kvconvert.commands.budget:budget_cmd",
               "KV-cache capacity planner: bytes per token/request, requests that fit."),
    "fetch": ("kvconvert.commands.fetch:fetch_cmd", "Put a built-in model (default smollm2-135m) into the local cache."),
    "import-gguf": ("kvconvert.commands.fetch:import_gguf_cmd",
                    "Dequantize a GGUF file into a Hugging Face safetensors folder."),
    "export-gguf": ("kvconvert.commands.export_gguf:export_gguf_cmd",
                    "Write a Llama source or an MLA conversion as GGUF for stock llama.cpp."),
    "mla": ("kvconvert.commands.mla:mla_cmd", "Convert an MHA/GQA checkpoint to stock DeepSeek-V3 MLA."),
    "heal": ("kvconvert.commands.heal:heal_cmd", "Recover conversion loss: layer-wise reconstruction + distillation."),
    "calibrate": ("kvconvert.commands.calibrate:calibrate_cmd",
                  "Calibrate FP8/NVFP4 KV-cache scales and write them for vLLM/TensorRT-LLM."),
    "generate": ("kvconvert.commands.generate:generate_cmd", "Generate text with the bundled paged-KV runtime."),
    "validate": ("kvconvert.commands.validate:validate_cmd",
                 "Compare a candidate against its source: ppl/KL, passkey, NIAH, RULER, LongBench."),
    "gate": ("kvconvert.commands.validate:gate_cmd",
             "Pass/fail a validation report against a policy (exit 1 on failure)."),
    "pipeline": ("kvconvert.commands.pipeline:pipeline_cmd", "Convert -> heal -> calibrate -> validate -> gate on one model."),
    "plan": ("kvconvert.commands.plan:plan_cmd", "The least-damage KV artifact for a byte budget, measured; writes its recipe."),
    "sensitivity": ("kvconvert.commands.sensitivity:sensitivity_cmd",
                    "Where a llama.cpp cache's loss sits: KL of K-only and V-only rounding, per layer."),
}


class LazyGroup(click.Group):
    """Imports a command's module only when that command runs (`kvconvert budget` and
    `kvconvert --help` stay torch-free)."""

    def format_commands(self, ctx, formatter):
        rows = [(name, LAZY_COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def list_commands(self, ctx):
        return sorted(LAZY_COMMANDS)

    def get_command(self, ctx, name):
        if name not in LAZY_COMMANDS:
            return None
        module_name, attr = LAZY_COMMANDS[name][0].split(":")
        return getattr(importlib.import_module(module_name), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.version_option(package_name="kvconvert")
@click.pass_context
def cli(ctx, debug):
    """kvconvert: smaller KV caches on the model side (MLA conversion, FP8/NVFP4 KV scales),
    validated in a bundled paged runtime."""
    from kvconvert.device import check_single_process

    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    if ctx.invoked_subcommand is not None:  # under accelerate launch / torchrun: heal only, before any work
        check_single_process(ctx.invoked_subcommand)


def main(argv=None):
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    raise_on_sigterm()  # SIGTERM unwinds like Ctrl-C: atomic cleanup and the message below
    record_sigint()
    try:
        cli.main(args=argv, standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt) as exc:
        # click turns an EOFError into Abort, as if it were Ctrl-C: a file that ended early is not an interrupt
        if isinstance(exc.__cause__, EOFError) and not interrupted_by_signal():
            if debug:
                raise exc.__cause__ from None
            _exit_truncated(exc.__cause__)
        _exit_interrupted()
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except Exception as exc:
        # The `with` blocks have already unwound (temp folders removed) whatever the exception was;
        # an interrupt that C code turned into another error is still reported as the interrupt.
        if interrupted_by_signal() and not debug:
            _exit_interrupted()
        if debug or not isinstance(exc, KVConvertError):
            raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)


def _exit_truncated(exc: EOFError):
    """An EOFError no reader named a file for: some input (a data or state file) ended before its end."""
    click.echo(f"error: a file ended before its end (EOFError: {exc or 'no more data'}): an input or saved-state file "
               "is truncated or empty; rerun with --debug to see which read failed", err=True)
    sys.exit(KVConvertError.exit_code)


def _exit_interrupted():
    click.echo("Interrupted: nothing was left half-written at the output path.", err=True)
    sys.exit(130)


if __name__ == "__main__":
    main()
