"""Validation of a candidate checkpoint against its source, and quality gates.

    kvconvert validate --source SRC --candidate DIR --suite quick --out REPORT_DIR
    kvconvert gate --report REPORT_DIR/report.json --policy recipes/gates/default.yaml

Modules: runner (model runners: bundled runtime or transformers), suites (what each suite runs),
haystack / longbench (sample generation), metrics (scoring), kv_quant (perplexity and KL with a
fake-quantized cache, on transformers), cache (per-sample results),
validate (the run), report / plots (outputs), stats (bootstrap), gate (policies); the commands
(validate, gate) live in kvconvert/commands/.
"""
