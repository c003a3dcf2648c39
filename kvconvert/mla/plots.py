"""Pictures for conversion reports (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path


def plot_spectra(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = report.layers
    rank = report.config["kv_lora_rank"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    cmap = plt.get_cmap("viridis")
    for rep in layers:
        spec = rep["latent_spectrum"]
        axes[0].semilogy(range(1, len(spec) + 1), [max(s, 1e-12) for s in spec],
                         color=cmap(rep["layer"] / max(len(layers) - 1, 1)), lw=0.8)
    axes[0].axvline(rank, color="red", ls="--", label=f"kv_lora_rank={rank}")
    axes[0].set(title="Weighted latent spectrum per layer (normalised)", xlabel="component", ylabel="energy")
    axes[0].legend()
    idx = [r["layer"] for r in layers]
    axes[1].plot(idx, [r["rope_energy_kept"] for r in layers], "o-", label="RoPE key energy kept")
    axes[1].plot(idx, [r["latent_energy_kept"] for r in layers], "s-", label="latent energy kept")
    axes[1].set(title="Energy kept per layer", xlabel="layer", ylim=(0, 1.02))
    axes[1].legend()
    axes[2].plot(idx, [r["attn_rel_error"] for r in layers], "o-", label="closed form")
    if "attn_rel_error_refit" in layers[0]:
        axes[2].plot(idx, [r["attn_rel_error_refit"] for r in layers], "s-", label="+ o_proj refit")
    axes[2].set(title="Attention output relative error (calibration)", xlabel="layer")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
