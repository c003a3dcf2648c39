"""One file per architecture with its shapes, typed per-layer weights and maths (llama,
deepseek_v3), and what they share (common). The converter, calibration, healing and the runtime
all compute through these."""
