"""Model building blocks shared by every architecture: RoPE variants, RMSNorm, gated MLP."""
