"""The `kvconvert` commands (click), one module per command or command group, above the library.

Only this package imports click. Each command reads its flags from the options model of the stage
it drives (kvconvert.commands.options generates them), builds that model and calls the library;
the library packages (mla, heal, quant, eval, runtime, plan, pipeline) never import from here.
kvconvert.commands.main is the entry point (the `kvconvert` console script); it loads a command's
module only when that command runs, so `kvconvert --help` and `kvconvert budget` stay torch-free.
"""
