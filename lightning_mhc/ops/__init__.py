"""The hyper-connection math as plain functions of tensors (torch only, no megatron).

``reference``: the readable op-by-op math, differentiated by autograd op by op.
``fused``: the same math as few autograd nodes with hand-written backwards that
save O(n^2) values per token (``docs/fused_hyper_connection.md``).
"""
MHC_IMPLEMENTATIONS = ("auto", "fused", "reference")
"""Values of ``mhc_implementation``: 'auto' picks the fused ops."""


def is_fused(mhc_implementation: str) -> bool:
    """Whether ``mhc_implementation`` runs the fused ops ('auto' and 'fused' do)."""
    return mhc_implementation != "reference"
