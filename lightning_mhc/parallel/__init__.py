"""The parallel runtime: process groups, launch, tensor-parallel helpers (no Lightning import)."""
