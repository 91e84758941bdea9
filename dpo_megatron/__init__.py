"""dpo-megatron: a 3D-parallel Direct Preference Optimization engine on megatron-core."""

__version__ = "0.1.0"
