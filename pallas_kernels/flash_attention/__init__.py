"""Blockwise (flash) attention: reference, blockwise XLA, Pallas GPU (Triton) and TPU (Mosaic) kernels."""

from pallas_kernels.flash_attention._common import BlockSizes
from pallas_kernels.flash_attention.api import IMPLEMENTATIONS, flash_attention
from pallas_kernels.flash_attention.reference import attention_reference

__all__ = ["BlockSizes", "IMPLEMENTATIONS", "attention_reference", "flash_attention"]
