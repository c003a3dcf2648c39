"""scripts/demo_summary.py --machine: the CPU kind the main job runs on and its expected time, printed first."""

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_machine_banner_names_the_kind_torch_runs_and_its_expected_time():
    from kvconvert.eval.runner import cpu_kind

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo_summary.py"), "--machine"],
                         capture_output=True, text=True, check=True).stdout
    kind = cpu_kind()
    assert f"This machine: {kind.name} (torch runs {torch.backends.cpu.get_cpu_capability()} kernels" in out
    assert "Expected time after setup on 2 cores of this kind:" in out
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import demo_summary
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert set(demo_summary.EXPECTED_SECONDS) == {"AMX", "AVX-512", "AVX2"}  # every kind cpu_kind names but "other"
    for seconds, how in demo_summary.EXPECTED_SECONDS.values():
        assert how and (seconds is None or seconds > 0)


def _row(label, fraction, ppl, kl, gate, serve=None, line="gate passed: PASS on every gated metric (whole interval within)"):
    return {"gate_line": line if gate else "gate FAILED: kl_mean", "label": label, "bytes": int(23040 * fraction), "fraction": fraction, "ppl_pct": ppl, "ppl_low": ppl - 1,
            "ppl_high": ppl + 1, "kl": kl, "kl_low": 0.9 * kl, "kl_high": 1.1 * kl, "serve": serve, "gate": gate,
            "longbench_drop": None}


def test_verdict_ships_the_smallest_that_passes_and_says_what_it_traded():
    """The smallest passing candidate is shipped with its intervals and serve command; a larger passing one is what
    it traded against (bytes saved, KL ratio); a smaller failing one is what the next step would cost; a point
    estimate past a threshold is said with the gate's interval rule."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import demo_summary
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from kvconvert.eval.gate import load_policy
    from kvconvert.resources import find_policy

    limits = load_policy(Path(find_policy("default"))).thresholds
    allowed = "gate passed with INCONCLUSIVE metrics (perplexity_increase_pct): not shown within"
    rows = [_row("fp8", 0.5, 0.1, 0.0055, True), _row("4-bit", 0.28125, 4.6, 0.0403, True, "llama-cli -m m.gguf", allowed),
            _row("mla", 0.2, 11.0, 0.1, False)]
    text = demo_summary.verdict(rows, limits)
    assert text.startswith("Shipped: 4-bit - the KV cache at 28% of the source's bf16 bytes (6480 B/token), "
                           "perplexity +4.6% [+3.6, +5.6], KL 0.040 [0.036, 0.044]: the gate passes (both point "
                           "estimates inside the thresholds). The gate's verdict: gate passed with INCONCLUSIVE metrics "
                           "(perplexity_increase_pct): not shown within. Serve it with: llama-cli -m m.gguf.")
    assert [demo_summary._gate_word(r) for r in rows] == ["PASS", "PASS+INCONCL.", "FAIL"]
    assert "Traded against fp8 (50%, KL 0.0055, perplexity +0.10%): 44% fewer KV bytes for KL 7.3x as large." in text
    assert "Smaller: mla would cut it to 20% but costs perplexity +11.0% and KL 0.10, past the gate." in text
    rows[1]["ppl_pct"] = 5.3
    assert "the perplexity point estimate is past the threshold" in demo_summary.verdict(rows, limits)
    assert demo_summary.verdict([_row("mla", 0.2, 11.0, 0.1, False)], limits).startswith("No candidate passed")
